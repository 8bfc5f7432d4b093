"""Merging into a resident model gives the on-disk merge's weights, for every bundled control."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY_SWEEP_TASK as CHOICE_TASK
from helpers import TINY_SWEEP_TASKS as MERGING_TASKS
from safetensors.torch import load_file

from lm_eval_sink.merging.configs import bundled_names, render
from lm_eval_sink.merging.inmemory import merge_into
from lm_eval_sink.merging.merge import run_mergekit


def _on_disk(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _resident(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)


@pytest.mark.parametrize("lineage", ["chain", "siblings"])
def test_every_bundled_control_in_memory_equals_on_disk(tmp_path, tiny_trio, lineage):
    """One resident model takes every control in turn (seeded DARE included): each equals its on-disk merge, and the
    caller's RNG state is left as it was."""
    resident = _resident(tiny_trio["reference"])
    base = tiny_trio["base"] if lineage == "siblings" else None
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    for name in bundled_names():
        text = render(name, tiny_trio["reference"], tiny_trio["candidate"], base=base).text
        out = tmp_path / name
        run_mergekit(text, out, random_seed=7)
        disk = _on_disk(out)
        copied = merge_into(resident, text, name, random_seed=7)
        state = resident.state_dict()
        assert copied == len(disk), name
        for key, tensor in disk.items():
            assert torch.equal(state[key], tensor.to(torch.float32)), (name, key)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_bf16_resident_equals_the_on_disk_checkpoint_loaded_in_bf16(tmp_path, tiny_trio):
    """bfloat16 endpoints: every control's tensors, cast by mergekit to the written dtype and copied into a bf16
    resident, equal the merged checkpoint as the on-disk eval loads it (dtype auto: its own, bf16)."""
    from transformers import AutoModelForCausalLM

    trio = {}
    for role in ("reference", "candidate"):
        model = AutoModelForCausalLM.from_pretrained(tiny_trio[role], dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / role)
        trio[role] = tmp_path / role
    resident = AutoModelForCausalLM.from_pretrained(trio["reference"], dtype="auto").eval()
    assert next(resident.parameters()).dtype == torch.bfloat16
    for name in ("linear_95_5", "ties", "tsv"):
        text = render(name, trio["reference"], trio["candidate"]).text
        run_mergekit(text, tmp_path / name, random_seed=0)
        merge_into(resident, text, name, random_seed=0)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype="auto").state_dict()
        state = resident.state_dict()
        assert all(v.dtype == torch.bfloat16 and torch.equal(state[k], v) for k, v in loaded.items()), name


def test_a_resident_model_of_another_architecture_is_refused(tmp_path, tiny_trio):
    """A resident model whose parameters mergekit does not write (a Qwen2 for a Llama merge) is refused."""
    from helpers import make_tiny_lm

    from lm_eval_sink.errors import UserError

    text = render("linear_uniform", tiny_trio["reference"], tiny_trio["candidate"]).text
    other = _resident(make_tiny_lm(tmp_path / "qwen2", "qwen2"))
    with pytest.raises(UserError) as err:
        merge_into(other, text, "linear_uniform")
    assert err.value.line().startswith("control 'linear_uniform': mergekit writes no tensor for the resident parameter")


# In-process evaluation of a resident model against the subprocess path on the same checkpoint saved by mergekit.


@pytest.fixture(scope="module")
def both_paths(tmp_path_factory, tiny_trio, tiny_task_dir):
    """`linear_95_5` merged in memory and evaluated in this process, and on disk through `run_lm_eval`.

    One include folder holds a loglikelihood task (tiny_choice) and a generation task (tiny_gen), float32.
    """
    import shutil

    from helpers import TINY_TASK
    from lm_eval_sink.harness.inprocess import evaluate, load_resident, measure_strength
    from lm_eval_sink.harness.runner import EvalSettings, run_lm_eval
    from lm_eval_sink.strength import StrengthSettings, measure_model

    root = tmp_path_factory.mktemp("inprocess")
    tasks = root / "tasks"
    shutil.copytree(MERGING_TASKS, tasks)
    for f in tiny_task_dir.iterdir():
        shutil.copy2(f, tasks / f.name)
    settings = EvalSettings(
        tasks=(CHOICE_TASK, TINY_TASK), include_path=str(tasks), dtype="float32", seed=0, gen_kwargs={"max_gen_toks": 3}
    )
    strength = StrengthSettings(n_prompts=5, last_k=2)
    text = render("linear_95_5", tiny_trio["reference"], tiny_trio["candidate"]).text
    merged = root / "merged"
    run_mergekit(text, merged, random_seed=0)
    resident = load_resident(tiny_trio["reference"], settings)
    merge_into(resident.model, text, "linear_95_5", random_seed=0)
    torch.manual_seed(5)
    rng = torch.random.get_rng_state()
    memory, memory_s = (
        evaluate(resident, settings, root / "memory", merged),
        measure_strength(resident, strength, "float32"),
    )
    return {
        "disk": run_lm_eval(merged, settings, root / "disk"),
        "memory": memory,
        "rng_kept": torch.equal(torch.random.get_rng_state(), rng),
        "disk_s": measure_model(str(merged), strength, dtype="float32", progress=False),
        "memory_s": memory_s,
        "root": root,
        "resident": resident,
        "settings": settings,
    }


def _samples(path: Path) -> list[dict]:
    import json

    keep = ("doc_id", "doc_hash", "prompt_hash", "target_hash", "arguments", "resps", "filtered_resps", "target")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k in keep or k in r.get("metrics", ())} for r in rows]


def test_in_process_eval_equals_the_subprocess_run_of_the_checkpoint_on_disk(both_paths):
    """Every metric and every sample's responses and scores equal; S equals measure_model on the disk checkpoint.
    The caller's RNG state is kept (lm-eval seeds the global generators)."""
    import json

    assert both_paths["rng_kept"]

    disk, memory = both_paths["disk"], both_paths["memory"]
    rd, rm = (json.loads(r.results.read_text()) for r in (disk, memory))
    assert rm["results"] == rd["results"]
    assert rm["n-samples"] == rd["n-samples"] and rm["task_hashes"] == rd["task_hashes"]
    assert memory.results.parent.name == disk.results.parent.name  # the folder lm-eval names after `pretrained`
    assert sorted(memory.samples) == sorted(disk.samples) == sorted([CHOICE_TASK, "tiny_gen"])
    for task in disk.samples:
        assert _samples(memory.samples[task]) == _samples(disk.samples[task]), task
    s_disk, s_mem = both_paths["disk_s"].to_json(), both_paths["memory_s"].to_json()
    s_disk.pop("provenance"), s_mem.pop("provenance")
    assert s_mem == s_disk


def _differing(a, b, path: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return {p for k in set(a) | set(b) for p in _differing(a.get(k), b.get(k), f"{path}.{k}")}
    return set() if a == b else {path}


def test_in_process_run_has_the_subprocess_runs_protocol(both_paths):
    """No protocol difference. The results files differ only in the date, the run time and each task
    metadata's copy of `pretrained` (the reference: one TaskManager serves the sweep), which nothing reads."""
    import json

    from lm_eval_sink.protocols import diff, fingerprint_run

    rd, rm = (json.loads(both_paths[k].results.read_text()) for k in ("disk", "memory"))
    assert _differing(rd, rm) == {
        ".date",
        ".total_evaluation_time_seconds",
        f".configs.{CHOICE_TASK}.metadata.pretrained",
        ".configs.tiny_gen.metadata.pretrained",
    }

    fd, fm = fingerprint_run(both_paths["disk"]), fingerprint_run(both_paths["memory"])
    assert diff(fd, fm) == ()
    assert fm.harness == fd.harness and fm.model == fd.model
    assert {k: v for k, v in fm.run.items() if fd.run[k] != v}.keys() == {"date"}
    assert fm.run["model"] == "hf"


def test_in_process_refusals(both_paths, tiny_trio):
    """vllm, settings other than the resident's, and a strength dtype other than its own are refused in one line."""
    from dataclasses import replace

    from lm_eval_sink.errors import UserError
    from lm_eval_sink.harness.inprocess import evaluate, load_resident, measure_strength
    from lm_eval_sink.strength import StrengthSettings

    resident, settings, root = both_paths["resident"], both_paths["settings"], both_paths["root"]
    with pytest.raises(UserError, match="runs lm-eval's hf backend in this process, not 'vllm'"):
        load_resident(tiny_trio["reference"], replace(settings, backend="vllm", device=None))
    with pytest.raises(UserError, match="differ from the ones the resident model"):
        evaluate(resident, replace(settings, limit=2), root / "refused", "x")
    with pytest.raises(UserError, match="strength dtype bfloat16 differs from the resident model's float32"):
        measure_strength(resident, StrengthSettings(n_prompts=5), "bfloat16")
    assert not (root / "refused").exists()
