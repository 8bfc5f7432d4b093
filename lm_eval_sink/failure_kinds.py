"""Why an IFEval regression failed, and truncation detection (docs/buckets.md, 'Failure kinds and truncation').
No lm-eval or transformers at import: the IFEval checker and the tokenizer load lazily when used.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.protocols import max_gen_toks_in

FAILURE_KINDS = ("truncation", "language", "phrase_marker", "length", "format", "other")  # truncation, then by priority
_RELATION_KEYS = ("relation", "let_relation", "capital_relation")


@dataclass(frozen=True, slots=True)
class FailureKind:
    """The primary kind of one regression and what it rests on."""

    kind: str
    failed_instructions: tuple[str, ...]
    detail: str
    checker_agrees: bool  # False: lm-eval's checker, re-run on the response, finds it passing


def ends_mid_sentence(response: str) -> bool:
    """True when the last visible character is a letter, a digit or one of `,;:-(`."""
    text = response.rstrip()
    return bool(text) and (text[-1].isalnum() or text[-1] in ",;:-(")


def is_truncated(
    response: str, max_gen_toks: int | None, count_tokens: Callable[[str], int] | None = None
) -> bool | None:
    """Whether a response hit the generation limit, within a slack of 1% of it and at least 2 tokens (None: the
    limit is unknown, cannot tell)."""
    if max_gen_toks is None:
        return None
    if count_tokens is not None:
        return count_tokens(response) >= max_gen_toks - max(2, math.ceil(0.01 * max_gen_toks))
    return ends_mid_sentence(response) and len(response.encode("utf-8")) >= max_gen_toks


def max_gen_toks_of(sample: Mapping[str, Any]) -> int | None:
    """The generation limit recorded in a samples line (`arguments.gen_args_0.arg_1`), if any."""
    args = sample.get("arguments")
    first = args.get("gen_args_0") if isinstance(args, Mapping) else None
    return max_gen_toks_in(first.get("arg_1") if isinstance(first, Mapping) else None)


def tokenizer_counter(name: str) -> Callable[[str], int]:
    """A token counter from a tokenizer folder, hub id or 'default' (loads transformers lazily)."""
    from lm_eval_sink.models import resolve_model

    path = resolve_model(name)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(
            f"--tokenizer {name}: cannot load a tokenizer ({str(e).splitlines()[0]})",
            "pass the candidate model's folder or hub id",
        ) from None
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


@contextlib.contextmanager
def _deterministic_quiet_checker() -> Iterator[None]:
    """Make the re-check reproducible and quiet, restored afterwards: langdetect and the global `random` seeded
    (letter_frequency draws from it for IFEval keys 1122 and 1129), the checker's own log lines muted."""
    from langdetect import DetectorFactory

    old_seed, old_state = DetectorFactory.seed, random.getstate()
    checker_log = logging.getLogger("lm_eval.tasks.ifeval.instructions")
    old_level = checker_log.level
    DetectorFactory.seed = 0
    random.seed(0)
    checker_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        DetectorFactory.seed = old_seed
        random.setstate(old_state)
        checker_log.setLevel(old_level)


def check_instructions(doc: Mapping[str, Any], response: str, loose: bool) -> list[bool]:
    """lm-eval's own IFEval check of one response: followed or not, per instruction of `doc`."""
    try:
        from lm_eval.tasks.ifeval import utils
    except ImportError as e:
        raise UserError(f"lm-eval's IFEval checker cannot be imported ({e})", "pip install 'lm-eval[ifeval]'") from None
    inp = utils.InputExample(
        key=doc.get("key"),
        instruction_id_list=list(doc["instruction_id_list"]),
        prompt=doc["prompt"],
        kwargs=list(doc["kwargs"]),
    )
    fn = utils.test_instruction_following_loose if loose else utils.test_instruction_following_strict
    try:
        with _deterministic_quiet_checker():
            return list(fn(inp, response).follow_instruction_list)
    except LookupError as e:
        raise UserError(
            f"IFEval's checker needs NLTK data it cannot find ({str(e).strip().splitlines()[0]})",
            "set NLTK_DATA to a folder holding tokenizers/punkt_tab/english",
        ) from None
    except KeyError as e:
        raise UserError(
            f"IFEval instruction {e} is not in lm-eval's instruction registry",
            "bucket these logs with the lm-eval version that wrote them",
        ) from None


def _truncation_can_break(
    instruction_id: str, kwargs: Mapping[str, Any] | None, table: Mapping[str, Mapping[str, str]]
) -> bool:
    rule = table.get(instruction_id, {}).get("truncation", "always")
    if rule == "at_least":
        kwargs = kwargs or {}
        return any(kwargs.get(k) == "at least" for k in _RELATION_KEYS)
    return rule == "always"


def classify_ifeval(
    doc: Mapping[str, Any], response: str, loose: bool, truncated: bool | None, table: Mapping[str, Mapping[str, str]]
) -> FailureKind:
    """The primary failure kind of one IFEval regression (see the module docstring for the rule)."""
    ids = list(doc["instruction_id_list"])
    kwargs = list(doc.get("kwargs") or [{}] * len(ids))
    if not response.strip():
        return FailureKind("other", tuple(ids), "empty response", True)
    followed = check_instructions(doc, response, loose)
    failed = [(i, kw) for i, kw, ok in zip(ids, kwargs, followed, strict=True) if not ok]
    if not failed:
        return FailureKind(
            "other", (), "lm-eval's checker re-run on the response finds every instruction followed", False
        )
    names = tuple(i for i, _ in failed)
    if truncated and any(_truncation_can_break(i, kw, table) for i, kw in failed):
        return FailureKind("truncation", names, "hit the generation limit; failed: " + ", ".join(names), True)
    kinds = {table.get(i, {}).get("kind", "other") for i in names}
    kind = next(k for k in FAILURE_KINDS[1:] if k in kinds or k == "other")
    return FailureKind(kind, names, "failed: " + ", ".join(names), True)


def kind_counts(kinds: Sequence[str]) -> dict[str, int]:
    """Count per kind, every kind present (zeros included) in the fixed order."""
    return {k: sum(1 for x in kinds if x == k) for k in FAILURE_KINDS}
