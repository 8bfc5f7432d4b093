"""Faults a tester tries: hostile, undecodable and damaged inputs, and a second command during the conversion of the
default model. Each is one `error:` line (exit 2, nothing written) naming the file, its line or field, and the real
cause; the conversion is waited for, with one line saying so. A full disk is in test_outputs.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from constructed_runs import write_run
from helpers import CHILD_ENV

from lm_eval_sink.errors import UserError

# A dozen lines that expand to 9**12 values: a YAML alias bomb under a merge config's `parameters:`.
BOMB = "\n".join([f"      a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 13)])
HOSTILE = {  # what is added under `parameters:` (line 7 on), and the line and words of the refusal
    "alias bomb": ("      a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + BOMB, "11: expands to more than 50,000 values"),
    "self alias": ("      a: &a [*a]", "7: an alias refers to a value that holds it"),
    "deep nesting": ("      a:\n" + "".join(f"{'  ' * (i + 4)}k{i}:\n" for i in range(70)), "68: nested more than 64"),
    "huge integer": ("      a: " + "9" * 5000, "7: a number of 5,000 digits"),
}


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    """A guard against a hang (what an alias bomb did): the block raises TimeoutError past `seconds`."""

    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _merge_config(path: Path, model: Path, extra: str) -> Path:
    path.write_text(
        f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {model}\n    parameters:\n      weight: 1.0\n"
        f"{extra}\n"
    )
    return path


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_merge_config_is_one_line_before_any_work(handset_llama_dir, tmp_path, user_error, case):
    extra, expected = HOSTILE[case]
    config = _merge_config(tmp_path / "m.yaml", handset_llama_dir, extra)
    with no_hang():
        line = user_error(["merge", config, tmp_path / "out"], tmp_path / "out")
    assert f"{config}:{expected}" in line


def test_a_sweep_file_with_an_alias_bomb_is_one_line(tmp_path, user_error):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("output: out\na0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + BOMB.replace("      ", "") + "\n")
    with no_hang():
        line = user_error(["sweep", sweep, "--quiet"], tmp_path / "out")
    assert f"{sweep}:6: expands to more than 50,000 values" in line


def _undecodable(path: Path, lines: list[bytes], bad: int) -> Path:
    """`lines` written with bytes that are not UTF-8 in line `bad` (1-based)."""
    lines = list(lines)
    lines[bad - 1] = lines[bad - 1][:5] + b"\xff\xfe\x00binary" + lines[bad - 1][5:]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_undecodable_prompt_samples_and_config_files_name_the_file_and_the_line(
    handset_llama_dir, tmp_path, user_error
):
    prompts = _undecodable(tmp_path / "p.jsonl", [b'{"prompt": "Write a title."}'] * 4, 3)
    line = user_error(["strength", handset_llama_dir, "--prompts", prompts, "--output", tmp_path / "s"], tmp_path / "s")
    assert f"{prompts}:3: not UTF-8 text (byte 0xff at column 6)" in line and "save the prompt file as UTF-8" in line

    ref = write_run(tmp_path / "ref", {"ifeval": ([1, 1, 0], [1, 1, 1])}).parent
    cand = write_run(tmp_path / "cand", {"ifeval": ([1, 0, 0], [1, 1, 0])}).parent
    samples = next(cand.glob("samples_ifeval_*.jsonl"))
    _undecodable(samples, samples.read_bytes().splitlines(), 2)
    line = user_error(["buckets", ref, cand, "--output", tmp_path / "b", "--quiet"], tmp_path / "b")
    assert f"{samples}:2: not UTF-8 text" in line and "save the samples file as UTF-8" in line

    config = _merge_config(tmp_path / "m.yaml", handset_llama_dir, "")
    _undecodable(config, config.read_bytes().splitlines(), 6)
    line = user_error(["merge", config, tmp_path / "out"], tmp_path / "out")
    assert f"{config}:6: not UTF-8 text" in line


def test_a_config_with_zero_attention_heads_names_the_file_and_the_field(handset_llama_dir, tmp_path, user_error):
    """transformers divides by num_attention_heads while it reads the config (ZeroDivisionError)."""
    model = shutil.copytree(handset_llama_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    line = user_error(["strength", model, "--output", tmp_path / "s", "--quiet"], tmp_path / "s")
    assert f"{model / 'config.json'}: num_attention_heads is 0; a model's sizes are positive integers" in line


@pytest.mark.parametrize("cut", ["header", "data"])
def test_a_truncated_gguf_is_one_line_naming_it(tmp_path, user_error, cut):
    from lm_eval_sink.models import _gguf_path

    source = _gguf_path()
    fake = tmp_path / "fake.gguf"
    with open(source, "rb") as f:
        fake.write_bytes(f.read(1 << 20 if cut == "header" else source.stat().st_size // 2))
    line = user_error(["strength", fake, "--output", tmp_path / "s", "--quiet"], tmp_path / "s")
    expected = "a damaged GGUF file: it ends inside its header" if cut == "header" else "a GGUF file cut short"
    assert f"{fake}: {expected}" in line and "copy or download the file again" in line


def test_nan_weights_name_the_tensor_not_the_dtype(handset_llama_dir, tmp_path, user_error):
    """They were told to change --dtype."""
    import torch
    from safetensors.torch import load_file, save_file

    model = shutil.copytree(handset_llama_dir, tmp_path / "model")
    weights = load_file(model / "model.safetensors")
    name = "model.layers.2.self_attn.q_proj.weight"
    weights[name][0, 0] = torch.nan
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    line = user_error(["strength", model, "--n-prompts", "5", "--output", tmp_path / "s", "--quiet"])
    assert f"the checkpoint's weights hold NaN or inf (tensor {name} of {model})" in line
    assert "--dtype" not in line and not list((tmp_path / "s").glob("*.strength.json"))


def test_a_results_json_that_is_a_list_is_named_as_no_results_file(tmp_path, user_error):
    listed = tmp_path / "results.json"
    listed.write_text(json.dumps([{"results": {}}]))
    line = user_error(["buckets", listed, listed, "--quiet"])
    assert f"{listed}: not an lm-eval results file (a JSON list, not an object)" in line and "--log_samples" not in line


def test_buckets_on_sink_strength_samples_names_the_file_and_the_cause(tmp_path, user_error):
    row = {"doc_id": 0, "doc": {"prompt_id": 0}, "filter": "none", "metrics": ["sink_strength"]}
    rows = [{**row, "doc_id": i, "sink_strength": {"prompt_id": i, "sink_strength_prompt": 1.5}} for i in range(3)]
    samples = tmp_path / "samples_sink_strength_2026-12-01T10-00-00.000000.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = user_error(["buckets", samples, samples, "--quiet"])
    assert f"reference samples {samples}: Sink Strength samples" in line and "scored task" in line


def test_a_misspelled_config_in_a_sweep_names_the_sweep_file(handset_llama_dir, tmp_path, user_error):
    sweep = tmp_path / "sweep.yaml"
    models = {"reference": str(handset_llama_dir), "candidate": str(handset_llama_dir)}
    data = {"output": "out", "models": models, "configs": ["linear_unifrom"], "eval": False}
    sweep.write_text(yaml.safe_dump(data))
    line = user_error(["sweep", sweep, "--quiet"], tmp_path / "out")
    assert f"{sweep}: configs[0]: unknown merge config 'linear_unifrom' (did you mean 'linear_uniform'?)" in line


# The other process: holds the lock of the default model's folder, as a conversion does, and publishes a converted
# folder (the session's, linked file by file) before it lets go, two seconds later.
CONVERTER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from lm_eval_sink.locks import hold
    from lm_eval_sink.outputs import staged_dir
    from lm_eval_sink.models import default_model_dir

    out, source = default_model_dir(create=False), Path(sys.argv[1])
    with hold(out, sibling=True):
        print("converting", flush=True)
        time.sleep(2)
        with staged_dir(out) as tmp:
            for f in source.iterdir():
                os.link(f, tmp / f.name)
    """
)


def test_a_command_during_the_conversion_waits_for_it(default_model, tmp_path, monkeypatch, capsys):
    """`strength default` while another process converts the default model said "choose another output folder";
    it waits for that conversion, with one line and then one every `locks.WAIT_NOTE_S` (here 0.5 s, 15 s by default)
    saying how long it has waited, then goes on with the converted folder."""
    from lm_eval_sink import locks
    from lm_eval_sink.outputs import read_complete
    from lm_eval_sink.models import default_model_dir

    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(locks, "WAIT_NOTE_S", 0.5)
    child = subprocess.Popen(
        [sys.executable, "-c", CONVERTER, str(default_model)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **CHILD_ENV},
    )
    try:
        assert child.stdout.readline().strip() == "converting"
        capsys.readouterr()
        with no_hang():
            folder = default_model_dir()
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 3 and err[0].startswith(f"waiting for pid {child.pid} on "), err  # the converter takes 2 s
    assert all(line.startswith("still waiting (") and f" s) for pid {child.pid} on " in line for line in err[1:]), err
    assert all(line.endswith(f"it is converting the embedded default model into {folder}") for line in err)
    assert read_complete(folder) == read_complete(default_model)


def _damaged(model: Path, out: Path, damage: str) -> Path:
    """A copy of `model` whose weights are cut to 200 bytes, miss their last 100 bytes, are no safetensors, or are
    sharded by an index naming a shard that is missing; returns the file the line must name."""
    shutil.copytree(model, out)
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    if damage == "missing shard":
        names = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        weight_map = {n: "model-00002-of-00002.safetensors" for n in names if n != "__metadata__"}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        weights.rename(out / "model-00001-of-00002.safetensors")
        return out / "model-00002-of-00002.safetensors"
    cut = {"cut to 200 bytes": data[:200], "last 100 bytes missing": data[:-100], "not safetensors": b"<html>" * 50}
    weights.write_bytes(cut[damage])
    return weights


DAMAGE = {
    "cut to 200 bytes": "is cut short",
    "last 100 bytes missing": "is cut short",
    "not safetensors": "is not a safetensors file",
    "missing shard": "missing",
}


@pytest.mark.parametrize(
    ("command", "damage"),
    [
        ("strength", "cut to 200 bytes"),
        ("screen", "last 100 bytes missing"),
        ("margin", "not safetensors"),
        ("merge", "missing shard"),
        ("sweep", "last 100 bytes missing"),
        ("lm_eval", "cut to 200 bytes"),
    ],
)
def test_damaged_weights_are_one_line_naming_the_file_before_anything_loads(
    handset_llama_dir, tmp_path, user_error, command, damage
):
    """strength and screen ended in a SafetensorError traceback from transformers' loader; each command, and lm-eval
    under the hook, now names the file in one line before any model loads."""
    bad = _damaged(handset_llama_dir, tmp_path / "model", damage)
    model, out = tmp_path / "model", tmp_path / "out"
    if command == "lm_eval":
        import lm_eval

        with pytest.raises(UserError) as e:
            lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model}", tasks=["sink_strength_n5"])
        line = e.value.line()
    else:
        sweep = tmp_path / "sweep.yaml"
        models = {"reference": str(model), "candidate": str(model)}
        sweep.write_text(yaml.safe_dump({"output": "out", "models": models, "eval": False}))
        argv = {
            "strength": ["strength", model, "--output", out],
            "screen": ["screen", model, "--output", out],
            "margin": ["margin", handset_llama_dir, model, "--output", out],
            "merge": ["merge", _merge_config(tmp_path / "m.yaml", model, ""), out],
            "sweep": ["sweep", sweep, "--quiet"],
        }[command]
        line = user_error(argv, out)
    assert f"{bad}: {DAMAGE[damage]}" in line and "copy or download the checkpoint's files again" in line


def test_a_config_vocabulary_the_weights_do_not_have_is_blamed_on_the_config(handset_llama_dir, tmp_path, user_error):
    """A vocab_size of 10^12 in config.json was refused as too large for memory; the weights fix the vocabulary."""
    model = shutil.copytree(handset_llama_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 10**12}))
    line = user_error(["strength", model, "--output", tmp_path / "s", "--quiet"], tmp_path / "s")
    rows = config["vocab_size"]
    assert f"{model / 'config.json'}: vocab_size is 1,000,000,000,000, but the weights' " in line
    assert f"embed_tokens.weight has {rows:,} rows" in line and "restore the config.json" in line


def test_a_prompt_longer_than_the_model_names_its_file_and_line(handset_llama_dir, tmp_path, user_error):
    """A 200,000-character prompt was refused as "a calibration prompt has N tokens", naming neither file nor line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Write a title."}) + "\n\n" + json.dumps({"prompt": "word " * 40_000}))
    argv = ["strength", handset_llama_dir, "--prompts", prompts, "--output", tmp_path / "s", "--quiet"]
    line = user_error(argv, tmp_path / "s")
    assert f"error: {prompts}:3: a calibration prompt has " in line and "more than the model's" in line


def test_protocol_show_of_a_samples_file_without_results_names_the_file(tmp_path, monkeypatch, user_error):
    """It named "." (the folder of a file given by its bare name)."""
    monkeypatch.chdir(tmp_path)
    Path("junk.jsonl").write_text("junk\n")
    assert user_error(["protocol", "show", "junk.jsonl"]).startswith("error: junk.jsonl: no results_<time>.json")


# A sweep's stand-in: starts a child as the sweep starts lm_eval (the child first runs DIE_WITH_PARENT), prints its
# pid once the child is ready, then waits.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    from lm_eval_sink.harness.runner import DIE_WITH_PARENT
    child = subprocess.Popen(
        [sys.executable, "-c", DIE_WITH_PARENT + "; print('ready', flush=True); import time; time.sleep(300)"],
        stdout=subprocess.PIPE, text=True,
    )
    child.stdout.readline()
    print(child.pid, flush=True)
    time.sleep(300)
    """
)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_sweep_takes_its_lm_eval_child_with_it():
    """kill -9 of a sweep left its lm_eval child running to the end; the child now dies with it."""
    from lm_eval_sink.harness.runner import _ENTRY, DIE_WITH_PARENT

    assert _ENTRY.startswith(DIE_WITH_PARENT + ";")  # what run_lm_eval's child runs first
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _running(child)
        parent.kill()
        parent.wait()
        for _ in range(100):
            if not _running(child):
                break
            subprocess.run(["sleep", "0.1"])
        assert not _running(child)
    finally:
        parent.kill()
