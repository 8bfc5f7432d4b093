"""The experiment scripts of benchmarks/ run end to end at a tiny size (`--smoke`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import sinkmodels as sm
from helpers import REPO

VL_ADAPTATION = REPO / "benchmarks" / "exp_vl_adaptation.py"


@pytest.mark.slow
def test_vl_adaptation_smoke_runs_every_stage(tmp_path, tiny_tokenizer, shared_data):
    """One training step per arm on a tiny selective-sink Llama, 5 calibration prompts, 2 IFEval prompts:
    the plan, the protection, the trajectories, IFEval through lm-eval, the margins, the table and the plot.
    Two arms (text-only and vision+protection) cover both input paths and the freeze; the other two differ
    from them only in flags."""
    start = tmp_path / "start_model"
    sm.build_selective(
        "llama", n_layers=3, vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id
    ).save_pretrained(start)
    tiny_tokenizer.save_pretrained(start)
    out = tmp_path / "exp"
    cmd = [sys.executable, VL_ADAPTATION, "--smoke", "--model", start, "--runs", "text-only,vision+protection"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LM_EVAL_SINK_DATA": str(shared_data), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(c) for c in [*cmd, "--output", out]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    res = json.loads((out / "results.json").read_text())
    assert (res["config"]["steps"], res["config"]["n_prompts"], res["config"]["n_ifeval"]) == (1, 5, 2)
    assert list(res["runs"]) == ["text-only", "vision+protection"]
    assert res["start"]["ifeval"]["n_prompts"] == 2 and 0.0 <= res["start"]["ifeval"]["prompt_level_strict_acc"] <= 1
    plan = json.loads((out / "start" / "plan.json").read_text())
    assert {(h["layer"], h["head"]) for h in plan["heads"] if h["selected"]} == {
        (l, h) for l in range(3) for h in sm.SINK_HEADS
    }
    for r in res["runs"].values():
        tr = r["train"]
        assert [step for step, _ in tr["trajectory"]] == [0, 1]
        assert math.isfinite(tr["heldout_caption_loss_end"]) and math.isfinite(r["s_end"])
        assert 0.0 <= r["ifeval"] <= 1.0 and r["margin"]["n_heads_total"] == 12
    text, protected = res["runs"]["text-only"]["train"], res["runs"]["vision+protection"]["train"]
    assert text["frozen_parameters"] == 0 and text["protection_report"] is None
    assert protected["frozen_parameters"] > 0 and sorted(protected["protection_report"]) == ["0", "1", "2"]
    assert (out / "vision_protection" / "model" / "config.json").is_file()
    assert len((out / "results.md").read_text().splitlines()) == 2 + 2
    assert (out / "trajectories.png").read_bytes()[:4] == b"\x89PNG"
