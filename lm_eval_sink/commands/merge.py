"""`lm-eval-sink merge`: one mergekit YAML into a verified, published OUT folder (`merging.merge.merge_config`)."""

from __future__ import annotations

from pathlib import Path


def run_merge(
    config_file: Path,
    out: Path,
    random_seed: int | None = None,
    device: str = "cpu",
    force: bool = False,
    quiet: bool = True,
) -> list[str]:
    """The `merge` command: merge, verify, publish; returns the line to print."""
    from lm_eval_sink.outputs import check_writable
    from lm_eval_sink.merging.merge import merge_config

    check_writable(Path(out), "OUT")  # before the config's models are resolved
    result = merge_config(config_file, out, random_seed=random_seed, device=device, force=force, quiet=quiet)
    return [f"{result.method}: {result.n_tensors} tensors verified -> {result.out}"]
