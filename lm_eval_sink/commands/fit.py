"""`lm-eval-sink fit`: read a PAIRS file (and the strength files it names), fit, write the output folder."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from lm_eval_sink.comparability import setting_of
from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_json, atomic_write_text, decode_text, read_json, sha256_bytes
from lm_eval_sink.predict import (
    SHIPPED_PAIRS,
    SHIPPED_REPORTED,
    PairTable,
    finite,
    fit_pairs,
    fit_table_markdown,
    parse_pairs,
)


def _strength_from_file(value: str, base: Path, where: str) -> tuple[float, Any]:
    """S of a *.strength.json named in a PAIRS file, with the setting it was measured in."""
    path = base / Path(value).expanduser()  # an absolute path as it is
    if not path.is_file():
        raise UserError(
            f"{where}: sink_strength file {path} not found",
            "give a number, or the path of a *.strength.json written by `lm-eval-sink strength`",
        )
    data = read_json(path)
    if not isinstance(data, dict) or "sink_strength" not in data:
        raise UserError(
            f"{where}: {path} has no 'sink_strength' key", "pass a *.strength.json written by `lm-eval-sink strength`"
        )
    return finite(data["sink_strength"], where, f"sink_strength in {path}"), setting_of(data)


def read_pairs(path: Path | str | None = None) -> PairTable:
    """Read and validate a PAIRS file; None reads the shipped paper table."""
    from lm_eval_sink.yaml_input import parse_yaml

    package = resources.files("lm_eval_sink")
    shipped = package.joinpath(SHIPPED_PAIRS).read_bytes()
    if path is None:
        data, where, base = shipped, f"builtin:{SHIPPED_PAIRS}", None
    else:
        p = Path(path)
        if not p.is_file():
            raise UserError(
                f"{p}: no such PAIRS file",
                "pass a YAML list of pairs (see the shipped lm_eval_sink/data/paper_pairs.yaml), or no "
                "file for the paper's table",
            )
        data, where, base = p.read_bytes(), str(p), p.resolve().parent
    obj = parse_yaml(decode_text(data, where, "the PAIRS file"), where)
    base = base or Path.cwd()
    pairs = parse_pairs(obj, where, lambda value, at: _strength_from_file(value, base, at))
    reported = json.loads(package.joinpath(SHIPPED_REPORTED).read_text(encoding="utf-8")) if data == shipped else None
    return PairTable(pairs=pairs, source=where, sha256=sha256_bytes(data), shipped=data == shipped, reported=reported)


def run_fit(pairs_file: Path | str | None, output: Path | None, force: bool = False) -> list[str]:
    """The `fit` command: fit a PAIRS file (None: the shipped table); write fit.json, fit.md, fit_<task>.png into the
    folder `output`."""
    from lm_eval_sink.outputs import check_output_dir, staged_dir
    from lm_eval_sink.provenance import provenance

    table = read_pairs(pairs_file)
    if output is not None:
        output = Path(output)
        check_output_dir(output, force, inputs=[pairs_file])
    result = fit_pairs(table)
    md = fit_table_markdown(result)
    lines = md.rstrip("\n").splitlines()
    for task, env in sorted((result.rounding_envelope or {}).items()):
        lines.append(
            f"{task}: inputs rounded as published allow loo_mae {env['loo_mae'][0]:.3f}..{env['loo_mae'][1]:.3f} "
            f"and baseline_mae {env['baseline_mae'][0]:.3f}..{env['baseline_mae'][1]:.3f} (corners of the rounding box)"
        )
    if output is None:
        lines.append("not saved (pass --output DIR to write fit.json, fit.md and plots)")
        return lines
    from lm_eval_sink.plots import fit_scatter

    prov = provenance(pairs_file=table.source, pairs_sha256=table.sha256, seed=0)
    data = {**result.to_json(), "provenance": prov}
    qk = {p.name: p.qk_norm for p in table.pairs}
    with staged_dir(output, force=force) as tmp:
        atomic_write_json(tmp / "fit.json", data)
        atomic_write_text(tmp / "fit.md", md)
        for task, f in sorted(result.tasks.items()):
            fit_scatter(f, [qk[n] for n in f.names], tmp / f"fit_{task}.png")
    written = [output / "fit.json", output / "fit.md"] + [output / f"fit_{task}.png" for task in sorted(result.tasks)]
    lines.append("wrote " + ", ".join(str(p) for p in written))
    return lines
