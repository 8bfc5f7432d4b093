"""The experiment scripts of benchmarks/ run end to end at a tiny size (`--smoke`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sinkmodels as sm
from helpers import REPO

VL_ADAPTATION = REPO / "benchmarks" / "exp_vl_adaptation.py"


@pytest.mark.slow
def test_vl_adaptation_smoke_runs_every_stage(tmp_path, tiny_tokenizer, shared_data):
    """Two training steps per arm on a tiny selective-sink Llama, one seed, 5 calibration prompts, 2 IFEval
    prompts (HF backend): the plan, the protection, both trajectories, and the project's own `strength`, `eval`,
    `margin`, `buckets` (each arm vs start, protection vs vision) and `report`; the tables and the plot.
    A rerun finds every stage done and reuses it."""
    start = tmp_path / "start_model"
    sm.build_selective(
        "llama", n_layers=3, vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id
    ).save_pretrained(start)
    tiny_tokenizer.save_pretrained(start)
    out = tmp_path / "exp"
    cmd = [sys.executable, VL_ADAPTATION, "--smoke", "--model", start, "--seeds", "0", "--output", out]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LM_EVAL_SINK_DATA": str(shared_data), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(c) for c in cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]

    res = json.loads((out / "results.json").read_text())
    assert (res["config"]["steps"], res["config"]["n_prompts"], res["config"]["ifeval_limit"]) == (2, 5, 2)
    assert sorted(res["runs"]) == ["text-only|seed0", "vision+protection|seed0", "vision|seed0"]
    assert 0.0 <= res["start"]["ifeval"]["prompt_level_strict_acc"] <= 1
    plan = json.loads((out / "start" / "plan.json").read_text())
    assert {(h["layer"], h["head"]) for h in plan["heads"] if h["selected"]} == {
        (l, h) for l in range(3) for h in sm.SINK_HEADS
    }
    for r in res["runs"].values():
        tr = r["train"]
        assert [step for step, _ in tr["trajectory"]] == [0, 1, 2]
        assert [step for step, _ in tr["heldout_trajectory"]] == [0, 1, 2]
        assert math.isfinite(tr["heldout_caption_loss_end"]) and math.isfinite(r["s_end"])
        assert set(r["ifeval"]) == {f"{lv}_level_{m}_acc" for lv in ("prompt", "inst") for m in ("strict", "loose")}
        b = r["buckets_vs_start"]
        assert b["n"] == 2 and sum(b["counts"].values()) == 2 and 0.0 <= b["mcnemar_p"] <= 1.0
        assert r["margin"]["n_heads_total"] == 12 and Path(r["report"]).read_text().startswith("<!")
    text, protected = res["runs"]["text-only|seed0"]["train"], res["runs"]["vision+protection|seed0"]["train"]
    assert text["frozen_parameters"] == 0 and text["protection_report"] is None
    assert protected["frozen_parameters"] > 0 and sorted(protected["protection_report"]) == ["0", "1", "2"]
    assert res["protection_vs_vision"]["0"]["n"] == 2
    assert (out / "seed0" / "vision_protection" / "model" / "config.json").is_file()
    assert "McNemar p" in (out / "results.md").read_text()
    assert (out / "trajectories.png").read_bytes()[:4] == b"\x89PNG"

    again = subprocess.run([str(c) for c in cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "$ lm-eval-sink" not in again.stdout and "step 1: held-out" not in again.stdout
