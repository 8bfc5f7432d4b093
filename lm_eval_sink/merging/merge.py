"""Run one validated mergekit config in this process into a verified, staged output folder.

Validated before any weight is read, verified after (expected tensors and shapes, all finite, a tokenizer), each
merge with an empty mergekit loader cache and the RNG states kept (docs/merging.md).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_eval_sink.io import sha256_text
from lm_eval_sink.keys import UNKEYED, Work, key_of, key_versions, keyed
from lm_eval_sink.outputs import COMPLETE, check_output_dir, manifest, staged_dir, write_complete
from lm_eval_sink.provenance import provenance
from lm_eval_sink.merging.configs import DTYPES, ValidatedConfig, stored_dtype, validate_file

_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


@dataclass(frozen=True, slots=True)
class MergeResult:
    out: Path
    method: str
    n_tensors: int


@dataclass(frozen=True, slots=True)
class MergeWork(Work):
    """What a merge receives: the validated config (its data, its inputs by content) and the seed; keyed with the
    code that merges, on disk or resident (TSV and STAR register with mergekit on every merge), and mergekit's,
    torch's and transformers' versions (`keys.key_of`)."""

    CODE = (__name__, "lm_eval_sink.merging.inmemory", "lm_eval_sink.commands.merge")
    PACKAGES = ("mergekit", "torch", "transformers")

    config: ValidatedConfig
    random_seed: int | None
    device: str = field(default="cpu", metadata=UNKEYED)  # where mergekit's math runs: the same merge
    template: str | None = field(default=None, metadata=UNKEYED)  # the sweep template it was rendered from


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Keep the python/numpy/torch RNG states around one merge (mergekit seeds them globally)."""
    import numpy as np
    import torch

    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


def _pinned(node: Any, pin) -> Any:
    """A copy of a parsed mergekit config with `pin` applied to the ModelPath of every hub-id ModelReference."""
    from mergekit.common import ModelReference
    from pydantic import BaseModel

    if isinstance(node, ModelReference):  # a path that exists is a folder: mergekit's own test for a hub id
        return node if os.path.exists(node.model.path) else node.model_copy(update={"model": pin(node.model)})
    if isinstance(node, BaseModel):
        return node.model_copy(update={k: _pinned(getattr(node, k), pin) for k in type(node).model_fields})
    if isinstance(node, list):
        return [_pinned(v, pin) for v in node]
    if isinstance(node, dict):
        return {k: _pinned(v, pin) for k, v in node.items()}
    return node


def run_mergekit(
    text: str,
    out_dir: Path,
    random_seed: int | None = None,
    device: str = "cpu",
    quiet: bool = True,
    revisions: dict[str, str] | None = None,
    config: Any = None,
) -> dict[str, str]:
    """mergekit's `run_merge` on validated YAML text (or its parsed `config`) into `out_dir`, every hub-id input at one
    commit (`revisions`, else its identity's); {reference as written: commit sha}, as `mergekit_config.yml` says."""
    from mergekit.io.tasks import LoaderCache
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    from lm_eval_sink.devices import math_device
    from lm_eval_sink.merging.methods import register

    register()
    to_load, recipe, pins = pinned_configs(text, revisions, config)
    source = (
        text
        if not pins
        else "# hub inputs pinned to their commits by lm-eval-sink: "
        f"{', '.join(f'{r} -> {s}' for r, s in pins.items())}\n{recipe.to_yaml()}\n"
    )
    options = MergeOptions(random_seed=random_seed, device=math_device(device), quiet=quiet, copy_tokenizer=True)
    LoaderCache().loaders.clear()  # each merge with an empty loader cache, the RNG states kept
    try:
        with isolated_rng():
            run_merge(to_load, str(out_dir), options=options, config_source=source)
    finally:
        LoaderCache().loaders.clear()
    return pins


def pinned_configs(text: str, revisions: dict[str, str] | None, config: Any = None) -> tuple[Any, Any, dict[str, str]]:
    """(config to load, recipe with `@sha` references, {reference as written: sha}) for YAML text, or for its
    already parsed MergeConfiguration `config` (a deep copy: mergekit's planner rewrites what it is given)."""
    import yaml
    from huggingface_hub import is_offline_mode
    from mergekit.common import ModelPath
    from mergekit.config import MergeConfiguration

    from lm_eval_sink.identity import model_identity, snapshot_dir

    config = MergeConfiguration.model_validate(yaml.safe_load(text)) if config is None else config.model_copy(deep=True)
    pins: dict[str, str] = {}

    def sha_of(path: ModelPath) -> str:
        ref = str(path)
        if ref not in pins:
            pins[ref] = (revisions or {}).get(ref) or model_identity(ref)["revision"]
        return pins[ref]

    def loadable(path: ModelPath) -> ModelPath:
        sha = sha_of(path)
        snap = snapshot_dir(path.path, sha) if is_offline_mode() else None
        return ModelPath(path=str(snap)) if snap else ModelPath(path=path.path, revision=sha)

    recipe = _pinned(config, lambda p: ModelPath(path=p.path, revision=sha_of(p)))
    return _pinned(config, loadable), recipe, pins


def verify_checkpoint(folder: Path, expect_tokenizer: bool = True) -> tuple[int, tuple[str, ...]]:
    """Check a merged folder: expected tensors and shapes only, all finite. Returns (count, files)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"{folder}: mergekit wrote no *.safetensors")
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    required = {name for name, _ in model.named_parameters()}  # tied duplicates appear once
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                tensor = st.get_tensor(name)
                found[name] = tuple(tensor.shape)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise RuntimeError(f"{folder}: tensor {name} has NaN or inf values")
    unexpected = sorted(set(found) - set(expected))
    missing = sorted(required - set(found))
    wrong = sorted(n for n in found if n in expected and found[n] != expected[n])
    if unexpected or missing or wrong:
        raise RuntimeError(
            f"{folder}: merged tensors do not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )
    if expect_tokenizer and not any((folder / n).is_file() for n in _TOKENIZER_FILES):
        raise RuntimeError(f"{folder}: mergekit did not copy a tokenizer")
    return len(found), tuple(f.name for f in files)


def output_size(config: ValidatedConfig) -> int | None:
    """About the bytes a merge writes, for the message of a full disk: its largest input's weight files (the merge
    has the same tensors), scaled to the output dtype (`out_dtype`, else `dtype`, else the input's own)."""
    from lm_eval_sink.identity import cached_folder

    out = str(config.data.get("out_dtype") or config.data.get("dtype") or "").removeprefix("torch.")
    sizes = []
    for path in config.inputs:
        folder = cached_folder(path) or Path(path)
        stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        sizes.append(stored * DTYPES.get(out, 1) // DTYPES.get(out and stored_dtype(path), 1))
    return max(sizes, default=0) or None


def _donor_has_tokenizer(config: ValidatedConfig, identities: dict[str, dict[str, Any]]) -> bool:
    donor = config.base_model or config.inputs[0]
    return any(n in identities[donor]["files"] for n in _TOKENIZER_FILES)


def merge_config(
    config: str | Path | ValidatedConfig,
    out: str | Path,
    random_seed: int | None = None,
    device: str = "cpu",
    force: bool = False,
    quiet: bool = True,
    extra: dict[str, Any] | None = None,
) -> MergeResult:
    """Validate, merge in this process (hub-id inputs at the commits their identities name), verify, and publish `out`
    with its COMPLETE.json."""
    from lm_eval_sink.identity import FINGERPRINT_RULE
    from lm_eval_sink.keys import check_same_versions
    from lm_eval_sink.models import model_fingerprint

    vc = config if isinstance(config, ValidatedConfig) else validate_file(config)
    out = Path(out)
    check_same_versions(out / COMPLETE, key_versions(MergeWork), force)
    check_output_dir(out, force, "OUT", inputs=[vc.source, *vc.inputs, vc.tokenizer])
    declared = MergeWork(vc, random_seed)
    work = key_of(declared)
    identities = {p: model_fingerprint(p) for p in vc.inputs}
    revisions = {p: ident["revision"] for p, ident in identities.items() if not Path(p).is_dir()}
    with staged_dir(out, force=force, key=work.key, size=output_size(vc)) as tmp:
        pins = run_mergekit(
            vc.text, tmp, random_seed=random_seed, device=device, quiet=quiet, revisions=revisions, config=vc.mergekit
        )
        n_tensors, files = verify_checkpoint(tmp, expect_tokenizer=_donor_has_tokenizer(vc, identities))
        write_complete(
            tmp,
            {
                "schema_version": 1,
                "key": work.key,
                "inputs_key": work.inputs_key,
                "key_versions": work.versions,
                "fingerprint_rule": FINGERPRINT_RULE,
                "work": keyed(declared),  # what changed, when its key does (`merging.sweep.changed_inputs`)
                "merge_method": vc.method,
                "config_sha256": sha256_text(vc.text),
                "random_seed": random_seed,
                "hub_revisions": pins,
                "n_tensors": n_tensors,
                "weight_files": manifest(tmp, files),
                "provenance": provenance(
                    config_source=vc.source, inputs=list(identities.values()), device=device, **(extra or {})
                ),
            },
        )
    return MergeResult(out=out, method=vc.method, n_tensors=n_tensors)
