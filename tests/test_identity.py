"""Content identity (whole-file hashes, hub revisions), locks, and recovery between the two renames."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import sinkmodels as sm
from helpers import hf_cache_snapshot
from lm_eval_sink.cli import main
from lm_eval_sink.errors import UserError
from lm_eval_sink.identity import FINGERPRINT_RULE, file_hash, model_identity

ONE_LINE = re.compile(r"^error: .+ \(fix: .+\)$")


@pytest.fixture
def model_dir(tmp_path, tiny_tokenizer) -> Path:
    d = tmp_path / "llama"
    sm.build("llama", n_layers=3, bos_id=tiny_tokenizer.bos_token_id).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def _one_error(rc: int, err: str, pattern: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and ONE_LINE.match(lines[0]) and "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def _scale_tensor_in_place(path: Path, name: str, factor: float) -> None:
    """Rewrite one float32 tensor's bytes inside a safetensors file: same size, same header."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    start, end = header[name]["data_offsets"]
    assert header[name]["dtype"] == "F32"
    with open(path, "r+b") as f:
        f.seek(8 + n + start)
        values = np.frombuffer(f.read(end - start), dtype="<f4") * factor
        f.seek(8 + n + start)
        f.write(values.astype("<f4").tobytes())
    assert path.stat().st_size == len(raw)


def test_file_hash_is_whole_file_and_cached_by_stat(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * (3 << 20))
    first = file_hash(f)
    assert first.startswith("xxh3_128:") and file_hash(f) == first
    with open(f, "r+b") as fh:  # the middle byte: outside the first and last MiB the old rule hashed
        fh.seek(3 << 19)
        fh.write(b"b")
    assert file_hash(f) != first


def test_a_cached_file_hash_is_used_only_in_the_form_file_hash_writes(tmp_path, monkeypatch):
    """The hash cache is data: an entry for another path, of another shape, torn, or in a file or cache another user
    can write is hashed again and replaced (or the cache refused)."""
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    right = file_hash(f)
    [entry] = (tmp_path / "cache" / "file_hashes").rglob("*.json")
    for planted in (
        {"path": str(f.resolve()), "size": 3, "hash": ["not", "a", "hash"]},
        {"path": "/elsewhere", "size": 3, "hash": "xxh3_128:" + "0" * 32},
        "torn",
    ):
        entry.write_text(planted if isinstance(planted, str) else json.dumps(planted))
        assert file_hash(f) == right
    assert json.loads(entry.read_text())["hash"] == right

    # Changed weights, and an entry for their new stat that holds the old hash (what reused an old S): in a file
    # another user could have written it is not used; in a cache others can write nothing is read.
    f.write_bytes(b"abd")
    changed = file_hash(f)
    [entry] = [e for e in (tmp_path / "cache" / "file_hashes").rglob("*.json") if changed in e.read_text()]
    entry.write_text(json.dumps({"path": str(f.resolve()), "size": 3, "hash": right}))
    entry.chmod(0o666)
    assert file_hash(f) == changed != right and entry.stat().st_mode & 0o022 == 0
    entry.write_text(json.dumps({"path": str(f.resolve()), "size": 3, "hash": right}))
    (tmp_path / "cache").chmod(0o777)
    with pytest.raises(UserError, match=r"project cache .* is writable by others \(mode 777\)"):
        file_hash(f)


def test_identity_skips_locks_and_markers(model_dir):
    before = model_identity(str(model_dir))
    (model_dir / ".lock").write_text("")
    (model_dir / "COMPLETE.json").write_text("{}")
    after = model_identity(str(model_dir))
    assert after["fingerprint"] == before["fingerprint"] and after["fingerprint_rule"] == FINGERPRINT_RULE
    assert "model.safetensors" in after["files"]


def test_in_place_weight_change_is_refused_then_recomputed_with_force(model_dir, tmp_path, user_error):
    out = tmp_path / "out"
    argv = ["strength", str(model_dir), "--last-k", "2", "--output", str(out), "--quiet"]
    assert main(argv) == 0
    old = json.loads((out / "llama.strength.json").read_text())
    _scale_tensor_in_place(model_dir / "model.safetensors", "model.layers.1.self_attn.q_proj.weight", 0.5)
    line = user_error(argv)
    assert re.search(r"made from other inputs: .*llama changed \(model\.safetensors\)", line), line
    assert json.loads((out / "llama.strength.json").read_text()) == old  # nothing written
    assert main([*argv, "--force"]) == 0
    new = json.loads((out / "llama.strength.json").read_text())
    assert abs(new["sink_strength"] - old["sink_strength"]) > 1e-3
    from lm_eval_sink.strength import StrengthSettings, measure_model

    fresh = measure_model(str(model_dir), StrengthSettings(last_k=2), progress=False)
    assert abs(fresh.sink_strength - new["sink_strength"]) < 1e-6


def test_output_of_the_older_fingerprint_rule_is_refused(model_dir, tmp_path, user_error):
    out = tmp_path / "out"
    argv = ["strength", str(model_dir), "--last-k", "2", "--output", str(out), "--quiet"]
    assert main(argv) == 0
    path = out / "llama.strength.json"
    data = json.loads(path.read_text())
    data["provenance"]["model"] = {
        k: v for k, v in data["provenance"]["model"].items() if k not in ("fingerprint_rule", "files")
    }
    path.write_text(json.dumps(data))
    line = user_error(argv)
    assert "its model identity has no fingerprint_rule, files (written by hand, cut short, or by a" in line, line


@pytest.mark.parametrize(
    ("command", "kind"), [("strength", "failed"), ("strength", "partial"), ("extract", "partial")]
)  # the model resolver, and extraction's own checks of its VLM folder
def test_folders_of_failed_or_interrupted_runs_are_refused_as_models(model_dir, tmp_path, user_error, command, kind):
    if kind == "failed":
        (model_dir / "FAILED.json").write_text("{}")
        target, pattern = model_dir, r"left by a failed run"
    else:
        target, pattern = (
            model_dir.rename(model_dir.with_name("llama.partial-1234abcd")),
            r"staging folder left by an interrupted run",
        )
    out = tmp_path / "out"
    args = ["--output", out, "--quiet"] if command == "strength" else [out, "--no-verify", "--quiet"]
    line = user_error([command, target, *args], out)
    assert re.search(pattern, line), line


def _with_hub_extras(model_dir: Path, folder: Path) -> Path:
    """`model_dir` plus files of a hub repo that no load reads: a README, .gitattributes, a second weight format."""
    import shutil

    shutil.copytree(model_dir, folder)
    (folder / "README.md").write_text("# tiny\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 64)
    return folder


def test_hub_id_resolves_to_its_revision_from_a_local_snapshot(model_dir, tmp_path):
    """An HF cache laid out as huggingface_hub writes it: refs/main, snapshots/<sha>/ links into blobs/. The
    identity covers the files a load reads, not the README, .gitattributes or .bin beside them; a second
    run reuses the first one's output."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    cached = hf_cache_snapshot(
        tmp_path / "hf" / "hub", "org/tiny-llama", _with_hub_extras(model_dir, tmp_path / "r"), sha
    )
    expected = {n: h for n, h in cached.items() if n not in ("README.md", ".gitattributes", "pytorch_model.bin")}
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / "out"
    argv = ["strength", "org/tiny-llama", "--last-k", "2", "--output", str(out), "--quiet"]
    driver = f"from lm_eval_sink.cli import main; assert main({argv!r}) == 0; assert main({argv!r}) == 0"
    proc = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("reused") == 1, proc.stdout
    model = json.loads(next(out.glob("*.strength.json")).read_text())["provenance"]["model"]
    assert model["revision"] == sha and model["files"] == expected and model["fingerprint_rule"] == FINGERPRINT_RULE


def test_hub_fingerprint_is_the_same_file_set_cached_or_listed(model_dir, tmp_path, monkeypatch):
    """A cache holding the whole repo, one holding only what a load downloaded, and the hub's file list
    (a real `ModelInfo` as the hub API returns it) give one fingerprint; the offline switch is
    huggingface_hub's."""
    from huggingface_hub import constants
    from huggingface_hub.hf_api import ModelInfo

    from lm_eval_sink.identity import cached_folder, listed_files

    sha = "0123456789abcdef0123456789abcdef01234567"
    hub = tmp_path / "hub"
    full = hf_cache_snapshot(hub, "org/full", _with_hub_extras(model_dir, tmp_path / "r"), sha)
    hf_cache_snapshot(hub, "org/loaded", model_dir, sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    a, b = model_identity("org/full"), model_identity("org/loaded")
    assert a["fingerprint"] == b["fingerprint"] and a["files"] == b["files"] and a["revision"] == sha
    assert set(a["files"]) == {p.name for p in model_dir.iterdir()} and "README.md" not in a["files"]
    assert cached_folder("org/loaded") == hub / "models--org--loaded" / "snapshots" / sha
    siblings = [
        {"rfilename": n, "blobId": h[4:] if h.startswith("git:") else "0" * 40}
        | ({"lfs": {"sha256": h[7:], "size": 1, "pointerSize": 1}} if h.startswith("sha256:") else {})
        for n, h in {**full, "onnx/model.onnx": "git:" + "1" * 40}.items()
    ]
    info = ModelInfo(id="org/full", sha=sha, siblings=siblings)
    assert listed_files(info) == a["files"]

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # huggingface_hub's switch (is_offline_mode) is asked
    with pytest.raises(UserError, match="not in the local Hugging Face cache and the hub is offline"):
        model_identity("org/absent")


def test_a_second_process_is_refused_while_the_first_holds_the_lock(model_dir, tmp_path):
    out = tmp_path / "out"
    strength = [sys.executable, "-m", "lm_eval_sink.cli", "strength", str(model_dir), "--output", str(out), "--quiet"]
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from lm_eval_sink.locks import hold
        with hold(Path({str(out)!r})):
            print("held", flush=True)
            time.sleep(120)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = subprocess.run(strength, capture_output=True, text=True, timeout=300)
        _one_error(proc.returncode, proc.stderr, rf"{re.escape(str(out))} is in use by pid {holder.pid} on ")
        assert not list(out.glob("*.strength.json"))
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    proc = subprocess.run([*strength, "--last-k", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]  # a killed holder frees the lock


_KILL_BETWEEN_RENAMES = """
import json, os, sys
from pathlib import Path
from lm_eval_sink.io import atomic_write_json
from lm_eval_sink.outputs import staged_dir
real = os.replace
def replace(a, b):
    if Path(a).name.startswith(out.name + ".partial-"):  # after <out> -> .old-*: die before .partial-* -> <out>
        os._exit(137)
    real(a, b)
os.replace = replace
out = Path(sys.argv[1])
with staged_dir(out, force=True) as tmp:
    atomic_write_json(tmp / "COMPLETE.json", {"key": sys.argv[2]})
"""


@pytest.mark.parametrize("unit_key", ["new", "other"])
def test_recovery_after_a_kill_between_the_two_renames_keeps_a_complete_copy(tmp_path, unit_key):
    from lm_eval_sink.outputs import clean_stale_all

    out = tmp_path / "sweep"
    target = out / "strength" / "reference"
    target.mkdir(parents=True)
    (target / "COMPLETE.json").write_text(json.dumps({"key": "old"}))
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_BETWEEN_RENAMES, str(target), "new"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 137, proc.stderr
    assert (
        not target.exists()
        and len(list(target.parent.glob("reference.old-*"))) == 1
        and len(list(target.parent.glob("reference.partial-*"))) == 1
    )
    notes = clean_stale_all({target: unit_key})  # what the sweep calls for its units before any runs
    kept = json.loads((target / "COMPLETE.json").read_text())["key"]
    assert kept == ("new" if unit_key == "new" else "old")  # the finished new copy, else the previous one
    left = sorted(p.name for p in target.parent.iterdir())
    assert left == ["reference", "reference.lock", "reference.lock.json"]  # the killed holder's free lock stays
    assert any(("promoted" if unit_key == "new" else "restored") in n for n in notes)


def test_lm_eval_command_pins_a_hub_id_to_its_revision(model_dir, tmp_path):
    sha = "89abcdef0123456789abcdef0123456789abcdef"
    hf_cache_snapshot(tmp_path / "hf" / "hub", "org/tiny", model_dir, sha)
    code = (
        "from pathlib import Path; from lm_eval_sink.harness.runner import EvalSettings; "
        "print(EvalSettings(tasks=('ifeval',)).command('org/tiny', Path('o'))[3])"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(f"pretrained=org/tiny,revision={sha}")


def test_an_edited_cached_default_model_is_refused_before_any_work(default_model, tmp_path, monkeypatch, user_error):
    """The default model's COMPLETE.json lists every file it holds with its hash, checked on each use: the folder as
    converted is used; an edited config.json (which gave another S under the default model's name) or an added file
    is one line naming it, before anything is loaded or written. (A copy: its weights linked, the rest copied.)"""
    import shutil

    from lm_eval_sink.models import default_model_dir

    copy = tmp_path / "cache" / "models" / default_model.name
    copy.mkdir(parents=True)
    for f in default_model.iterdir():
        (copy / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy2(f, copy / f.name)
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(tmp_path / "cache"))
    assert default_model_dir() == copy
    config = (copy / "config.json").read_text()
    (copy / "config.json").write_text(json.dumps({**json.loads(config), "rms_norm_eps": 0.5}))
    line = user_error(["strength", "default", "--output", tmp_path / "s", "--quiet"], tmp_path / "s")
    assert f"the cached default model {copy} is not what was converted (config.json changed)" in line
    assert f"delete {copy} to convert it again" in line
    (copy / "config.json").write_text(config)
    (copy / "extra.py").write_text("")
    assert "(extra.py changed)" in user_error(["strength", "default", "--output", tmp_path / "s", "--quiet"])


def test_a_cache_in_a_folder_another_user_could_rename_it_in_is_refused(tmp_path, monkeypatch):
    """A parent that others can write without the sticky bit lets them rename the cache away and put their own in
    its place; the check looked at the world bit alone, so a team folder its group writes (mode 775) passed, as did
    a parent owned by another user. Both are refused in one line; the sticky bit (as /tmp has) is enough."""
    import os

    from lm_eval_sink.cache import cache_dir

    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o775)
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(team / "cache"))
    with pytest.raises(UserError, match=rf"cache {team / 'cache'} is in {team}, which its group can write \(mode 775"):
        cache_dir()
    team.chmod(0o1775)
    assert cache_dir() == team / "cache"
    if os.geteuid() == 0:  # as root the folder can be given to another user
        alice = tmp_path / "alice"
        alice.mkdir()
        os.chown(alice, 65534, 65534)
        monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(alice / "cache"))
        with pytest.raises(UserError, match=r"is in .*alice, owned by another user \(uid 65534\), who can rename it"):
            cache_dir()


def test_a_cache_that_is_a_link_in_a_folder_its_group_can_write_is_refused(tmp_path, monkeypatch):
    """Privacy was checked on the resolved path only, so a cache that is a symlink inside a folder its group can
    write passed (whoever writes that folder can point the link elsewhere), while a real folder there was refused;
    every folder on the path as given is checked, the link's own included, and a link in a private folder passes."""
    from lm_eval_sink.cache import cache_dir

    real, team = tmp_path / "real", tmp_path / "team"
    real.mkdir()
    team.mkdir(mode=0o775)
    team.chmod(0o775)
    (team / "cache").symlink_to(real)
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(team / "cache"))
    with pytest.raises(UserError, match=rf"cache {team / 'cache'} is in {team}, which its group can write"):
        cache_dir()
    team.chmod(0o700)
    assert cache_dir() == team / "cache"
    (tmp_path / "link").symlink_to(team)  # a link to the private folder, itself in a folder its group can write
    tmp_path.chmod(0o775)
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(tmp_path / "link" / "cache"))
    with pytest.raises(UserError, match=rf"is in {tmp_path}, which its group can write"):
        cache_dir()
    tmp_path.chmod(0o700)
