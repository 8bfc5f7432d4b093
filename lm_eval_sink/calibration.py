"""Calibration prompts and the ONE tokenization function used by the API, the CLI and the task.

`encode_prompts` renders each prompt through the chat template as `apply_chat_template(tokenize=True)` does (the
template's BOS the only one), or as plain text without one, and marks each token content or template. `Batching`
groups the prompts into forwards (no torch here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import json_lines, read_text, sha256_text

ALLOWED_N_PROMPTS = (5, 15)
DEFAULT_QUERY_CHUNK = 128  # query rows whose [row, key] logits the capture holds at once, per layer


@dataclass(frozen=True, slots=True)
class PromptSet:
    """Calibration prompts with where they came from."""

    prompts: tuple[str, ...]
    source: str  # "builtin" or the file path
    where: tuple[str, ...] = ()  # each prompt's place: "FILE:LINE", or "builtin prompt K"

    @property
    def sha256(self) -> str:
        return sha256_text(json.dumps(list(self.prompts), ensure_ascii=False))


@dataclass(frozen=True, slots=True)
class EncodedPrompts:
    """Token ids per prompt plus a per-token content flag (True = the user message's text)."""

    input_ids: tuple[tuple[int, ...], ...]
    content_mask: tuple[tuple[bool, ...], ...]
    chat_template_applied: bool
    chat_template_sha256: str | None
    system_prompt: str | None
    where: tuple[str, ...] = ()  # each prompt's place, for errors (PromptSet.where)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True, slots=True)
class Batching:
    """How a measurement runs, never what it gives (in no result key): forwards of at most `batch_size` prompts and
    `batch_tokens` padded tokens, shortest first; `query_chunk` query rows' logits per layer at a time."""

    batch_size: int | None = None
    batch_tokens: int = 8192  # padded tokens (prompts x longest) per forward
    query_chunk: int = DEFAULT_QUERY_CHUNK

    def __post_init__(self) -> None:
        for flag, value in (("--batch-size", self.batch_size), ("--batch-tokens", self.batch_tokens)):
            if value is not None and value <= 0:
                raise UserError(f"{flag} must be positive, got {value}", f"use {flag} 1 or more")
        if self.query_chunk <= 0:
            raise UserError(f"--query-chunk must be positive, got {self.query_chunk}", "use e.g. --query-chunk 256")

    def batches(self, lengths: list[int] | tuple[int, ...]) -> list[list[int]]:
        """Indices of the prompts of each forward: by length, each batch filled while it stays within both limits."""
        out: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
            batch = out[-1] if out else []
            fits = (len(batch) + 1) * lengths[i] <= self.batch_tokens  # i is the longest so far
            if batch and fits and (self.batch_size is None or len(batch) < self.batch_size):
                batch.append(i)
            else:
                out.append([i])
        return out


def builtin_prompts() -> tuple[str, ...]:
    """The 15 project-written IFEval-style prompts (disjoint from IFEval: no shared 8-gram)."""
    text = resources.files("lm_eval_sink").joinpath("data/calibration_prompts.jsonl").read_text(encoding="utf-8")
    return tuple(json.loads(line)["prompt"] for line in text.splitlines() if line.strip())


_ROW = 'each line must be an object like {"prompt": "..."}'


def read_prompt_file(path: Path) -> dict[str, str]:
    """A JSONL file with a `prompt` field per line, or plain text with one prompt a line: {"FILE:LINE": prompt}."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path}: no such prompt file",
            "pass a JSONL file with a 'prompt' field per line, or a text file with one prompt a line",
        )
    text = read_text(path, "the prompt file")
    lines = {f"{path}:{n}": ln.strip() for n, ln in enumerate(text.split("\n"), 1) if ln.strip()}
    if not lines:
        raise UserError(f"{path}: the prompt file is empty", "put at least one prompt in it, one per line")
    if path.suffix != ".jsonl" and not next(iter(lines.values())).startswith("{"):
        return lines
    prompts = {}
    for n, row in json_lines(text, str(path), _ROW):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise UserError(f"{path}:{n}: no non-empty string field 'prompt'", _ROW)
        prompts[f"{path}:{n}"] = row["prompt"]
    return prompts


def load_prompts(path: str | Path | None = None, n_prompts: int | None = None) -> PromptSet:
    """The builtin set (first `n_prompts` of 15) or a user file (first `n_prompts` if given)."""
    given = (
        read_prompt_file(path)
        if path is not None
        else {f"builtin prompt {k}": p for k, p in enumerate(builtin_prompts(), 1)}
    )
    prompts = tuple(given.values())
    if n_prompts is not None:
        if n_prompts <= 0:
            raise UserError(f"--n-prompts must be positive, got {n_prompts}", "use 5 or 15")
        if path is None and n_prompts not in ALLOWED_N_PROMPTS:
            raise UserError(
                f"--n-prompts {n_prompts} is not a calibrated setting",
                f"use one of {ALLOWED_N_PROMPTS}, or pass --prompts FILE",
            )
        if n_prompts > len(prompts):
            raise UserError(
                f"--n-prompts {n_prompts} but only {len(prompts)} prompts are available", f"use at most {len(prompts)}"
            )
        prompts = prompts[:n_prompts]
    return PromptSet(tuple(prompts), "builtin" if path is None else str(path), tuple(given)[: len(prompts)])


def encode_prompts(
    tokenizer: Any,
    prompts: tuple[str, ...] | list[str],
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    where: tuple[str, ...] = (),
) -> EncodedPrompts:
    """Render (chat template + generation prompt) and tokenize each prompt; mark content tokens; `where` for errors."""
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"{type(tokenizer).__name__} is a slow tokenizer without offsets",
            "load the model's fast tokenizer (tokenizer.json)",
        )
    template = getattr(tokenizer, "chat_template", None)
    apply = bool(use_chat_template and template)
    special_ids = set(tokenizer.all_special_ids)
    ids_out, content_out = [], []
    for prompt in prompts:
        if not prompt.strip():
            raise UserError("a calibration prompt is empty", "remove empty prompts from the prompt file")
        if apply:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
                {"role": "user", "content": prompt}
            ]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            special = False
            start = text.rfind(prompt.strip())
            if start < 0:
                raise UserError(
                    "the chat template does not contain the prompt's text verbatim",
                    "use --no-chat-template or a tokenizer whose template keeps the message text",
                )
            end = start + len(prompt.strip())
        else:
            text, special = prompt, True
            start, end = 0, len(prompt)
        enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        # Content: a token whose characters lie inside the user message's span, never a special token (BOS, roles).
        pairs = zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        ids_out.append(tuple(enc["input_ids"]))
        content_out.append(tuple(start <= s < e <= end and t not in special_ids for t, (s, e) in pairs))
    return EncodedPrompts(
        input_ids=tuple(ids_out),
        content_mask=tuple(content_out),
        chat_template_applied=apply,
        chat_template_sha256=sha256_text(template) if apply else None,
        system_prompt=system_prompt if apply else None,
        where=where,
    )


def encoded_prompts(tokenizer: Any, settings: Any) -> tuple[PromptSet, EncodedPrompts]:
    """The calibration prompts a `strength.StrengthSettings` names, and their encoding by `tokenizer` as it says."""
    prompt_set = load_prompts(settings.prompts_file, settings.n_prompts)
    return prompt_set, encode_prompts(
        tokenizer, prompt_set.prompts, settings.use_chat_template, settings.system_prompt, prompt_set.where
    )
