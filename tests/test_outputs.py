"""Outputs never destroy inputs (every writing command, an output that is, contains or lies inside an input, with and
without --force: one line, the inputs byte-identical), cannot-be-written outputs, one writer per output, a killed
build tidied by the next one, a full disk in one line (`outputs`, `locks`, `disk_full`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from constructed_runs import write_run
from helpers import CHILD_ENV, hf_cache_snapshot, make_tiny_lm
from test_extract import _save_vlm

from lm_eval_sink.errors import UserError
from lm_eval_sink.outputs import COMPLETE, check_not_inputs, staged_dir
from lm_eval_sink.locks import hold


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Every kind of input a writing command reads, under one root: models, a VLM, configs, runs, JSONs."""
    root = tmp_path_factory.mktemp("inputs")
    models = root / "models"
    w = {"root": root, "models": models}
    for role, seed in (("reference", 1), ("candidate", 2)):
        w[role] = make_tiny_lm(models / role, "llama", seed)
    w["vlm"] = _save_vlm("llava", root / "vlm")  # a tiny Llava: CLIP vision tower + Llama text model
    configs = root / "configs"
    configs.mkdir()
    w["merge_yaml"] = configs / "linear.yaml"
    halves = [{"model": str(w[r]), "parameters": {"weight": 0.5}} for r in ("reference", "candidate")]
    merge = {"merge_method": "linear", "dtype": "float32", "tokenizer_source": str(w["reference"]), "models": halves}
    w["merge_yaml"].write_text(yaml.safe_dump(merge))
    w["sweep_yaml"] = configs / "sweep.yaml"
    sweep = {"output": "out", "models": {"reference": str(w["reference"]), "candidate": str(w["candidate"])},
             "configs": ["linear_uniform"], "eval": False, "strength": {"n_prompts": 5, "last_k": 2}}  # fmt: skip
    w["sweep_yaml"].write_text(yaml.safe_dump(sweep))
    w["pairs"] = configs / "pairs.yaml"
    shutil.copy(Path(__file__).parents[1] / "lm_eval_sink" / "data" / "paper_pairs.yaml", w["pairs"])
    runs = root / "runs"
    w["ref_run"] = write_run(runs / "ref", {"ifeval": ([1, 1, 0], [1, 1, 1])}).parent
    w["cand_run"] = write_run(runs / "cand", {"ifeval": ([1, 0, 0], [1, 1, 0])}).parent
    w["strength_json"] = runs / "reference.strength.json"
    w["strength_json"].write_text("{}")
    w["a_file"] = root / "a_file"  # no command's input: a file in an output's path
    w["a_file"].write_text("x")
    return w


def _tree_hash(root: Path) -> str:
    """Names and bytes of every file and link under `root`: any write, deletion or new file changes it."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_symlink():
            h.update(str(p.readlink()).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


# Every writing command, its output as `{out}`.
WRITERS = [
    ("merge", ["merge", "{merge_yaml}", "{out}"]),
    ("extract", ["extract", "{vlm}", "{out}", "--quiet"]),
    ("inject", ["inject", "{reference}", "{vlm}", "{out}", "--quiet"]),
    ("strength", ["strength", "{reference}", "--output", "{out}", "--quiet"]),
    ("screen", ["screen", "{candidate}", "--output", "{out}", "--quiet"]),
    ("sweep", ["sweep", "{sweep_yaml}", "--output", "{out}", "--quiet"]),
    ("buckets", ["buckets", "{ref_run}", "{cand_run}", "--output", "{out}", "--quiet"]),
    ("fit", ["fit", "{pairs}", "--output", "{out}"]),
    ("margin", ["margin", "{reference}", "{candidate}", "--output", "{out}", "--quiet"]),
    ("protect-plan", ["protect-plan", "{reference}", "-o", "{out}", "--quiet"]),
    ("report", ["report", "--strength", "{strength_json}", "{strength_json}", "-o", "{out}"]),
    ("configs-render", ["configs", "render", "tsv", "--reference", "{reference}", "--candidate", "{candidate}",
                        "-o", "{out}"]),
    ("eval", ["eval", "{reference}", "--protocol", "instruct", "--tasks", "ifeval", "--output", "{out}"]),
    ("attribute", ["attribute", "--reference", "{ref_run}", "--candidate", "{cand_run}", "--output", "{out}"]),
    ("protocol-show", ["protocol", "show", "{ref_run}", "-o", "{out}"]),
    ("protocol-diff", ["protocol", "diff", "{ref_run}", "{cand_run}", "-o", "{out}"]),
    ("models-convert", ["models", "convert", "{gguf}", "{out}"]),
]  # fmt: skip

# (command, its output, how the output overlaps the input, the input named)
OVERLAPS = [
    ("merge", "{reference}", "is", "reference"),
    ("merge", "{models}", "contains", "reference"),
    ("extract", "{vlm}", "is", "vlm"),
    ("inject", "{root}", "contains", "vlm"),
    ("strength", "{reference}/s", "lies inside", "reference"),
    ("screen", "{models}", "contains", "candidate"),
    ("sweep", "{reference}", "is", "reference"),
    ("buckets", "{ref_run}", "is", "ref_run"),
    ("fit", "{pairs}", "is", "pairs"),
    ("margin", "{candidate}/m", "lies inside", "candidate"),
    ("protect-plan", "{reference}/plan.json", "lies inside", "reference"),
    ("report", "{strength_json}", "is", "strength_json"),
    ("configs-render", "{candidate}/tsv.yaml", "lies inside", "candidate"),
    ("eval", "{models}", "contains", "reference"),
    ("attribute", "{root}", "contains", "ref_run"),
    ("protocol-show", "{ref_run}/fp.json", "lies inside", "ref_run"),
    ("protocol-diff", "{cand_run}", "is", "cand_run"),
]


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize(("command", "out", "how", "role"), OVERLAPS, ids=[f"{c[0]}-{c[2]}" for c in OVERLAPS])
def test_an_output_overlapping_an_input_is_refused_and_the_input_kept(
    world, user_error, command, out, how, role, force
):
    argv = [a.replace("{out}", out) for a in dict(WRITERS)[command]]
    args = [a.format(**world) for a in argv] + (["--force"] if force else [])
    before = _tree_hash(world["root"])
    err = user_error(args)
    assert f" {how} the input " in err and str(world[role]) in err, err
    assert _tree_hash(world["root"]) == before


def test_a_link_to_an_input_is_that_input_and_a_hub_id_is_no_path(world, tmp_path, monkeypatch, user_error):
    model, vlm = tmp_path / "model", tmp_path / "vlm"
    model.symlink_to(world["reference"])
    vlm.symlink_to(world["vlm"])
    before = _tree_hash(world["root"])
    assert " lies inside the input " in user_error(["strength", world["reference"], "--output", model / "s", "--force"])
    assert " is the input " in user_error(["extract", world["vlm"], vlm, "--force", "--quiet"])
    assert _tree_hash(world["root"]) == before
    monkeypatch.chdir(tmp_path)
    check_not_inputs(["org"], inputs=["org/name", None], option="--output")  # a hub id names no folder here
    (tmp_path / "org" / "name").mkdir(parents=True)
    with pytest.raises(UserError, match="--output org contains the input org/name"):
        check_not_inputs(["org"], inputs=["org/name"], option="--output")  # a folder of that name is a path


def test_a_hub_models_snapshot_folder_is_an_input(world, tmp_path, monkeypatch, user_error):
    """`extract org/vlm OUT`: the hub id is no path, but the snapshot folder it resolves to is an input."""
    from huggingface_hub import constants

    hub = tmp_path / "hf" / "hub"
    hf_cache_snapshot(hub, "org/vlm", world["vlm"], "1" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    snap = hub / "models--org--vlm" / "snapshots" / ("1" * 40)
    before = _tree_hash(hub)
    err = user_error(["extract", "org/vlm", snap / "backbone", "--force", "--quiet"], snap / "backbone")
    assert f"OUT_DIR {snap / 'backbone'} lies inside the input {snap}" in err
    assert _tree_hash(hub) == before


# --- an output that cannot be written: one line naming it and why, before any work --------------------------

# (where the output goes, what the line must say): a pseudo-filesystem, a missing folder that cannot be made there,
# a file in the path
UNWRITABLE = {
    "proc": ("/proc/lm_eval_sink_out", "/proc is on a proc pseudo-filesystem"),
    "no-such-parent": ("/proc/lm_eval_sink_missing/out", "no such folder /proc/lm_eval_sink_missing, and /proc is on"),
    "file-in-path": ("{a_file}/out", "{a_file} is a file, not a folder"),
}


@pytest.mark.parametrize("kind", list(UNWRITABLE))
@pytest.mark.parametrize("argv", [c[1] for c in WRITERS], ids=[c[0] for c in WRITERS])
def test_an_output_that_cannot_be_written_is_one_line_before_any_work(world, user_error, argv, kind):
    """Every writing command refuses it naming the path and the reason; "in use" is said only of a held lock."""
    from lm_eval_sink.models import _gguf_path

    names = {**world, "gguf": _gguf_path()}
    where, reason = (text.format(**names) for text in UNWRITABLE[kind])
    line = user_error([a.format(**names, out=where) for a in argv], where)
    assert f"{where} cannot be written: " in line and reason in line and "in use" not in line, line


def test_refusals_come_before_the_default_model_is_converted(tmp_path, monkeypatch, user_error):
    """On an empty project cache (a new machine), a bad output, prompt file, interpreter or earlier result is one
    line, and `default` is not converted first (no model folder in the cache, no file hashed)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(cache))
    bad = "/proc/lm_eval_sink_out"
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "SmolLM2-135M-Instruct.strength.json").write_text('{"sink_strength": 1.2')  # cut short
    for argv, needle in [
        (["strength", "default", "--output", bad], "cannot be written"),
        (["strength", "default", "--output", tmp_path / "s"], "strength.json: an earlier output in --output"),
        (["screen", "default", "--output", bad], "cannot be written"),
        (["margin", "default", "default", "--output", bad], "cannot be written"),
        (["margin", "default", "default", "--prompts", tmp_path / "none.txt"], "none.txt"),
        (["protect-plan", "default", "-o", f"{bad}.json"], "cannot be written"),
        (["eval", "default", "--protocol", "instruct", "--tasks", "ifeval", "--output", bad], "cannot be written"),
    ]:
        assert needle in (line := user_error(argv + (["--quiet"] if argv[0] != "eval" else []))), line
        if "earlier" in needle:  # the file named, and the fix: never "pass a JSON file" the user did not pass
            assert "not valid JSON" in line and "pass --force to recompute it, or delete that file" in line
    assert not (cache / "models").exists() and not (cache / "file_hashes").exists()


def test_a_read_only_folder_is_refused_for_any_user_but_root(tmp_path):
    """Root may write a folder of mode 555, so the check runs as `nobody` (a forked child) where the tests run as
    root: the folder itself, and a folder to be made inside it. A read-only mount (EROFS for root too, the same
    `os.access` and `statvfs` test) needs a privilege to mount and is not tested."""
    import tempfile

    from lm_eval_sink.outputs import check_writable

    top = Path(tempfile.mkdtemp(prefix="lm-eval-sink-ro-"))  # under /tmp: pytest's own folders are root's only
    try:
        top.chmod(0o755)
        (top / "ro").mkdir(mode=0o555)
        (top / "ro").chmod(0o555)
        lines = []
        for out in (top / "ro" / "out", top / "ro" / "missing" / "out"):
            r, w = os.pipe()
            if (pid := os.fork()) == 0:  # the child reports the line and exits without running pytest's teardown
                try:
                    if os.geteuid() == 0:
                        os.setgid(65534)
                        os.setuid(65534)
                    try:
                        check_writable(out)
                        os.write(w, b"written")
                    except UserError as e:
                        os.write(w, e.line().encode())
                finally:
                    os._exit(0)
            os.close(w)
            lines.append(os.read(r, 4096).decode())
            os.close(r)
            os.waitpid(pid, 0)
        assert lines[0].startswith(f"--output {top / 'ro' / 'out'} cannot be written: {top / 'ro'} is not writable")
        assert f"no such folder {top / 'ro' / 'missing'}, and {top / 'ro'} is not writable" in lines[1]
        check_writable(top / "out")  # the parent is writable
    finally:
        (top / "ro").chmod(0o755)
        shutil.rmtree(top)


# --- item 3: one writer per output, and a killed build tidied by the next ----------------------------


def test_staged_dir_restores_the_previous_output_and_removes_stale_siblings(tmp_path):
    out = tmp_path / "out"
    old, partial = tmp_path / "out.old-0123abcd", tmp_path / "out.partial-89abcdef"
    old.mkdir()
    (old / "a.txt").write_text("previous")
    partial.mkdir()
    other = tmp_path / "out.partial-not-ours"  # not a staging name of ours: left alone
    other.mkdir()
    with pytest.raises(UserError, match="output already exists"), staged_dir(out):
        pass  # the previous output is restored first, so without --force it is refused
    assert (out / "a.txt").read_text() == "previous" and not old.exists() and not partial.exists()
    with hold(out, sibling=True), staged_dir(out, force=True) as tmp:  # the lock is reentrant in one process
        (tmp / "b.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.partial-not-ours"]  # lock file removed too
    assert [p.name for p in out.iterdir()] == ["b.txt"]


@pytest.mark.parametrize("partial_key", ["same", "other"])
def test_merge_killed_between_the_two_renames_keeps_its_finished_build(world, tmp_path, partial_key, capsys):
    """On disk as a kill between staged_dir's renames leaves it: OUT missing, the previous OUT as `.old-*`, the finished
    new build as `.partial-*`. The rerun promotes the build when its marker carries the merge's key (then OUT exists,
    so without --force it is refused before mergekit runs), else restores the previous OUT; nothing else is left."""
    import json

    from lm_eval_sink.cli import main

    out = tmp_path / "merged"
    assert main(["merge", str(world["merge_yaml"]), str(out), "--quiet"]) == 0
    key = json.loads((out / COMPLETE).read_text())["key"]
    partial = shutil.copytree(out, tmp_path / "merged.partial-89abcdef")
    out.rename(tmp_path / "merged.old-0123abcd")
    (partial / "built.txt").write_text("the finished build")
    (partial / COMPLETE).write_text(json.dumps({"key": key if partial_key == "same" else "made from other inputs"}))
    capsys.readouterr()
    assert main(["merge", str(world["merge_yaml"]), str(out)]) == 2
    assert "output already exists" in capsys.readouterr().err
    assert (out / "built.txt").is_file() == (partial_key == "same")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


@contextlib.contextmanager
def holder(block: str):
    """Another process inside `with <block> as held:` (a function of lm_eval_sink.outputs), which prints `held` and
    waits; yields its pid and that line, then kills it."""
    code = f"import time\nfrom pathlib import Path\nfrom lm_eval_sink.outputs import *\nwith {block} as held:\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code + "    print(held, flush=True)\n    time.sleep(120)\n"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc.pid, proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def test_a_live_holders_partial_is_left_alone(tmp_path):
    out = tmp_path / "out"
    with holder(f"staged_dir(Path({str(out)!r}))") as (pid, name):
        with pytest.raises(UserError, match=rf"{out} is in use by pid {pid} "), staged_dir(out):
            pass
        assert (tmp_path / name).is_dir()  # the holder's partial survives a second writer


def test_a_killed_extraction_is_tidied_by_the_rerun(world, tmp_path, caplog):
    from lm_eval_sink.cli import main

    out = tmp_path / "backbone"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lm_eval_sink.cli", "extract", str(world["vlm"]), str(out), "--quiet"],
        env={**os.environ, **CHILD_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    partial = None
    deadline = time.monotonic() + 300  # a safety net, not a timing assertion
    while partial is None and proc.poll() is None and time.monotonic() < deadline:
        partial = next((p for p in tmp_path.glob("backbone.partial-*") if any(p.glob("*.safetensors"))), None)
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial is not None, "the extraction ended before it could be interrupted"
    assert not out.exists() and partial.is_dir() and not (partial / COMPLETE).exists()
    with caplog.at_level(logging.WARNING, logger="lm_eval_sink.outputs"):
        assert main(["extract", str(world["vlm"]), str(out), "--quiet"]) == 0  # no --force needed
    assert f"removed {partial}, left by an interrupted run" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backbone"]  # partial and the killed holder's lock gone
    assert (out / COMPLETE).is_file() and any(out.glob("*.safetensors"))


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "default", "--protocol", "instruct", "--tasks", "ifeval", "--output", "{inside}"],
        ["margin", "default", "default", "--output", "{inside}"],
        ["protect-plan", "default", "-o", "{inside}/plan.json"],
    ],
)
def test_the_default_model_is_an_input_by_its_folder(default_model, user_error, argv):
    """`default` names the embedded model's cache folder: an output inside it is refused like any input's."""
    inside = default_model / "out"
    before = sorted(p.name for p in default_model.iterdir())
    line = user_error([a.format(inside=inside) for a in argv], inside)
    assert "lies inside the input" in line and str(default_model) in line
    assert sorted(p.name for p in default_model.iterdir()) == before


def test_a_one_file_output_is_held_while_it_is_written(tmp_path, user_error):
    """`-o FILE` holds `<FILE>.lock`: a second writer is refused naming the holder, and nothing is written."""
    out = tmp_path / "tsv.yaml"
    with holder(f"new_files([Path({str(out)!r})], False, inputs=[])") as (pid, held):
        assert held == "None"  # inside the block: the lock is held
        ref, cand = make_tiny_lm(tmp_path / "ref"), make_tiny_lm(tmp_path / "cand", delta_seed=1)
        line = user_error(["configs", "render", "tsv", "--reference", ref, "--candidate", cand, "-o", out], out)
        assert f"{out} is in use by pid {pid}" in line


@contextlib.contextmanager
def file_size_limit(limit: int):
    """For the block, this process writes no file past `limit` bytes (ulimit -f): a write past it fails (EFBIG; the
    SIGXFSZ that would kill the process is ignored) as on a full disk, midway. No .pyc is written meanwhile (one cut
    short would break its module's next import); matplotlib's font cache is built before."""
    import resource

    import matplotlib.pyplot  # noqa: F401

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler, bytecode = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
        sys.dont_write_bytecode = bytecode


def test_a_full_disk_in_merge_strength_and_buckets_is_one_line_and_leaves_nothing_half_written(
    world, tmp_path, user_error
):
    """They ended in a traceback (OSError 27/28, SafetensorError); now one line names the output, what it needs and
    the limit, and no temp file, staged folder or half a figure is left."""
    config = tmp_path / "linear.yaml"
    halves = [{"model": str(world[r]), "parameters": {"weight": 0.5}} for r in ("reference", "candidate")]
    config.write_text(yaml.safe_dump({"merge_method": "linear", "dtype": "float32", "models": halves}))
    outs = {c: tmp_path / c for c in ("merged", "s", "b")}
    argvs = [
        ["merge", config, outs["merged"], "--quiet"],
        ["strength", world["reference"], "--n-prompts", "5", "--output", outs["s"], "--quiet"],
        ["buckets", world["ref_run"], world["cand_run"], "--output", outs["b"], "--quiet"],
    ]
    before = _tree_hash(world["root"])
    for argv, out in zip(argvs, outs.values(), strict=True):
        with file_size_limit(4000):
            line = user_error(argv, outs["merged"], outs["b"])
        assert line.startswith(f"error: {out}") and "the output needs about " in line, line
        assert "a file larger than this process may write (ulimit -f: 4.0 kB)" in line, line
        assert "nothing half-written was left" in line, line
    left = [p.name for p in tmp_path.rglob("*") if p.name.startswith(".") or ".partial-" in p.name]
    assert not left and not list(tmp_path.rglob("*.png")), left
    assert _tree_hash(world["root"]) == before


def test_a_write_to_a_full_device_names_the_path_the_size_and_the_free_space(tmp_path):
    """ENOSPC as the kernel gives it: a write to /dev/full."""
    from lm_eval_sink.disk_full import DiskFull, room_for

    with pytest.raises(DiskFull) as raised, room_for(tmp_path / "out.bin", 4096), open("/dev/full", "wb") as f:
        f.write(b"x" * 4096)
    line = raised.value.line()
    assert line.startswith(f"{tmp_path / 'out.bin'}: no space left on the device: the output needs about 4.1 kB, ")
    assert " free there (fix: free space there or choose an output on another disk" in line


# In a child whose files may not grow past 1 byte (ulimit -f; SIGXFSZ ignored): a file's hash and lm-eval's task
# index, whose cache writes are a saving only. Prints the hash and the number of tasks the index holds.
_CACHE_WRITES_FAIL = """
import json, resource, signal, sys
from pathlib import Path
import lm_eval
from lm_eval_sink.harness.task_index import cached_build
from lm_eval_sink.identity import file_hash
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
own = Path(lm_eval.__file__).parent / "tasks"
index = cached_build(lambda paths, resolve_includes=True: {}, [own])
print(json.dumps([file_hash(Path(sys.argv[1])), len(index)]))
"""


def test_a_full_cache_costs_its_savings_not_the_run(tmp_path):
    """The hash cache and lm-eval's task index are savings: a cache that cannot be written costs the next process
    the work, nothing else. With atomic writes raising DiskFull (a UserError, not the OSError they caught), a full
    cache disk ended `strength`, `merge` and every `TaskManager` in one line naming a cache file."""
    import json as _json

    from lm_eval_sink.identity import file_hash

    weights = tmp_path / "w.bin"
    weights.write_bytes(b"x" * 4096)
    env = {**os.environ, "LM_EVAL_SINK_CACHE": str(tmp_path / "cache"), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CACHE_WRITES_FAIL, str(weights)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    digest, tasks = _json.loads(proc.stdout.strip().splitlines()[-1])
    assert digest == file_hash(weights) and tasks == 0
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.stat().st_size]
