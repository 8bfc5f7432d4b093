"""`sink_strength` under lm-eval's data parallel mode: two torchrun processes over gloo give the
single-process S, companion figures and layer x head matrix, with each prompt logged once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import CHILD_ENV
from lm_eval_sink.harness.task import decode_array
from lm_eval_sink.runs import load_results, read_samples, resolve_run

DRIVER = Path(__file__).parent / "drivers" / "dp_sink_strength.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _run(cmd: list[str], out: Path):
    env = {**os.environ, **CHILD_ENV, "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return resolve_run(next(out.glob("*/results_*.json")))


@pytest.fixture(scope="module")
def runs(handset_llama_dir, tiny_task_dir, tmp_path_factory):
    one, two = tmp_path_factory.mktemp("dp1"), tmp_path_factory.mktemp("dp2")
    args = [str(DRIVER), str(handset_llama_dir), str(tiny_task_dir)]
    single = _run([sys.executable, *args, str(one)], one)
    parallel = _run([TORCHRUN, "--standalone", "--nproc_per_node", "2", *args, str(two)], two)
    return single, parallel


def test_two_ranks_give_the_single_process_figures(runs):
    single, parallel = (load_results(r) for r in runs)
    assert single["config"]["world_size"] == 1 and parallel["config"]["world_size"] == 2
    a, b = single["results"]["sink_strength"], parallel["results"]["sink_strength"]
    figures = [k for k in a if k.endswith(",none") and "_stderr" not in k and k != "sink_strength_layer_head,none"]
    assert len(figures) == 11
    for key in figures:
        if isinstance(a[key], float):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
        else:  # attention layers, chat_template_applied, learned-sink figures (None: this model has none)
            assert b[key] == a[key], key
    assert b["attention_layers,none"] == [0, 1, 2] and b["learned_sink_mass_median,none"] is None
    assert b["rows_beyond_window,none"] == a["rows_beyond_window,none"] == 0  # no sliding window here
    la, lb = a["sink_strength_layer_head,none"], b["sink_strength_layer_head,none"]
    assert la["layers"] == lb["layers"] == [0, 1, 2]
    np.testing.assert_allclose(lb["values"], la["values"], atol=1e-6)
    assert b["sample_len"] == 15 and "tiny_gen" in parallel["results"]


def test_samples_hold_each_prompt_once_with_its_arrays_once(runs):
    _, parallel = runs
    path = parallel.samples["sink_strength"]
    rows = read_samples(path)
    assert sorted(int(r["doc_id"]) for r in rows) == list(range(15))
    for line in path.read_text().splitlines():
        assert line.count('"b64"') == 5  # sink_logodds, sink_pos, pos0_mass, content, pos0_visible: once each
    r = rows[0]
    logodds = decode_array(r["sink_strength"]["sink_logodds"])
    assert logodds.dtype == np.float32 and logodds.shape[:2] == (3, 2)
    assert decode_array(r["sink_strength"]["content"]).shape == (logodds.shape[2],)
    assert "see the 'sink_strength' field" in r["pos0_mass_median"] and "see the" in str(r["resps"])
