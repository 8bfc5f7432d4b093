"""One sweep unit on disk (`run_unit`: from its arguments alone, so a cluster can dispatch it), and the outputs
every unit writes whichever path computed it (`finish_eval`, `save_strength`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.harness import runner
from lm_eval_sink.harness.runner import run_lm_eval
from lm_eval_sink.identity import FINGERPRINT_RULE
from lm_eval_sink.io import atomic_write_json
from lm_eval_sink.keys import keyed
from lm_eval_sink.outputs import staged_dir, write_complete
from lm_eval_sink.provenance import provenance
from lm_eval_sink.merging.engines import placement_fields
from lm_eval_sink.merging.sweep import Unit
from lm_eval_sink.strength import measure_model


def _finish(tmp: Path, unit: Unit, **fields: Any) -> None:
    write_complete(
        tmp,
        {
            "schema_version": 1,
            "unit": unit.id,
            "key": unit.key,
            "inputs_key": unit.inputs_key,
            "key_versions": unit.versions,
            "fingerprint_rule": FINGERPRINT_RULE,
            "model_identity": getattr(unit.inputs, "identity", None),
            "work": keyed(unit.inputs),  # what changed, when its key does (`merging.sweep.changed_inputs`)
            **fields,
            "provenance": provenance(unit=unit.id, **placement_fields()),
        },
    )


def run_unit(unit: Unit, **fields: Any) -> None:
    """Run one unit into its staged output folder (replacing an older one); `fields` join a strength unit's marker.
    No shared state."""
    work = unit.inputs  # a MergeWork, EvalWork or SweepStrengthWork
    if unit.kind == "merge":
        from lm_eval_sink.merging.merge import merge_config

        merge_config(
            work.config,  # validated when the sweep file was loaded; mergekit gets a copy
            unit.output,
            random_seed=work.random_seed,
            device=work.device,
            force=True,
            quiet=True,
            extra={"unit": unit.id, "template": work.template, **placement_fields()},
        )
    elif unit.kind == "eval":
        with staged_dir(unit.output, force=True, key=unit.key) as tmp:
            try:
                run = run_lm_eval(work.model, work.settings, tmp / "lm_eval")
            except UserError as e:  # keep lm-eval's log: the staged folder is about to be removed
                raise UserError(e.message, f"see lm-eval's log in {keep_logs(unit, tmp)}") from None
            finish_eval(tmp, unit, run)
    elif unit.kind == "strength":
        res = measure_model(work.model, work.settings, dtype=work.dtype, device=work.device, progress=False)
        save_strength(unit, res, **fields)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")


def keep_logs(unit: Unit, tmp: Path) -> Path:
    """Copy a failed eval unit's lm-eval logs out of its staged folder (about to be removed) to `<out>/logs/`."""
    kept = unit.output.parent.parent / "logs" / f"{unit.kind}-{unit.checkpoint}"
    kept.mkdir(parents=True, exist_ok=True)
    for log in (tmp / "lm_eval" / "logs").glob("*.log"):
        shutil.copy2(log, kept / log.name)
    return kept


def finish_eval(tmp: Path, unit: Unit, run: Any, **fields: Any) -> None:
    """Mark an eval unit's staged folder complete: where its results and samples are, what made them."""
    _finish(
        tmp,
        unit,
        results=str(run.results.relative_to(tmp)),
        samples={t: str(p.relative_to(tmp)) for t, p in run.samples.items()},
        model=unit.inputs.model,
        lm_eval_python=unit.inputs.settings.interpreter(),
        eval_versions=runner.eval_versions(unit.inputs.settings),
        **fields,
    )


def save_strength(unit: Unit, res: Any, **fields: Any) -> None:
    """A strength unit's output: strength.json (with the unit's key) and its marker, which says where S was measured
    and with which versions (`measured_with`: the engine's capture record, else this interpreter's transformers)."""
    prov = res.provenance
    here = {"capture_backend": "hf", "process": "the unit's own, with transformers", "dtype": prov.get("dtype")}
    here |= {k: (prov.get("versions") or {}).get(k) for k in ("torch", "transformers")}
    with staged_dir(unit.output, force=True, key=unit.key) as tmp:
        atomic_write_json(tmp / "strength.json", {**res.to_json(), "provenance": {**prov, "input_key": unit.key}})
        measured = {"measured_with": prov.get("capture") or here}
        _finish(tmp, unit, sink_strength=res.sink_strength, model=unit.inputs.model, **measured, **fields)
