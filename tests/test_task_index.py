"""lm-eval's index of its own tasks read back from the cache (`harness/task_index.py`): the same index lm-eval
builds, kept as data (JSON) that no planted file can turn into code, under a key that follows every file the
index reads, and a torn or planted file built again."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.discovery import index_of
from lm_eval_sink.harness.task_index import cached_build, decode, encode, folder_key


def test_the_key_follows_every_file_the_index_may_read(tmp_path):
    """Every YAML and every include target whatever its name, by content (bytes changed at the same path, size and
    mtime make another key; a copy of the same files keeps it); not Python files, which the index never reads."""
    root = tmp_path / "tasks"
    (root / "a" / "__pycache__").mkdir(parents=True)
    (root / "a" / "t.yaml").write_text("include: _default_template_yaml\ntask: t\n")
    (root / "a" / "_default_template_yaml").write_text("output_type: generate_until\n")

    def key(version: str = "0.4.13") -> str:
        return folder_key(root, version)

    first = key()
    assert key() == first and key("0.4.14") != first
    (root / "a" / "utils.py").write_text("x = 1\n")
    (root / "a" / "__pycache__" / "utils.cpython-311.pyc").write_bytes(b"\0")
    assert key() == first
    (root / "a" / "_default_template_yaml").write_text("output_type: loglikelihood\n")
    template = key()
    assert template != first
    (root / "a" / "u.yaml").write_text("task: u\n")
    added = key()
    assert added not in (first, template)
    (root / "a" / "u.yaml").unlink()
    assert key() == template  # the content alone: the same files give the same key
    same = (root / "a" / "t.yaml").stat()
    (root / "a" / "t.yaml").write_text("include: _default_template_yaml\ntask: T\n")  # the same size
    os.utime(root / "a" / "t.yaml", ns=(same.st_atime_ns, same.st_mtime_ns))
    assert (root / "a" / "t.yaml").stat().st_size == same.st_size and key() not in (first, template, added)
    edited = key()
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, copy_function=shutil.copy2)  # other inodes and ctimes, the same bytes and mtimes
    shutil.rmtree(root)
    copy.rename(root)
    assert key() == edited  # a reinstall of the same files keeps the index


class _Planted:
    """A pickle that creates `marker` when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_the_cached_index_is_lm_evals_data_and_later_folders_still_win(tmp_path, monkeypatch, caplog):
    """A miss stores lm-eval's own build as JSON; a hit reads it back without parsing lm-eval's folder and equals
    it; a task of an include path replaces lm-eval's of that name, with lm-eval's warning from lm-eval's logger; a
    planted pickle is never loaded (a TaskManager builds the index again, right); a redirected task or a changed
    tag in a file another user could have written is not read, and a cache others can write is refused; a cache that
    cannot be written costs the build, nothing else."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import TaskIndex

    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(tmp_path / "cache"))
    lm_evals_build = getattr(TaskIndex.build, "__wrapped__", TaskIndex.build)  # the hook may have patched it
    own = Path(lm_eval.__file__).parent / "tasks"
    include = tmp_path / "include"
    include.mkdir()
    (include / "ifeval.yaml").write_text("task: ifeval\ndataset_path: local\noutput_type: generate_until\n")
    built: list[list[Path]] = []

    def build(paths, *, resolve_includes=True):
        built.append(list(paths))
        return lm_evals_build(paths, resolve_includes=resolve_includes)

    missed = cached_build(build, [own, include])
    assert built == [[own], [include]] and len(missed) > 10_000
    assert missed["ifeval"].yaml_path == include / "ifeval.yaml"
    stored = list((tmp_path / "cache" / "task_index").iterdir())
    assert len(stored) == 1 and stored[0].suffix == ".json"
    lm_evals_own = decode(json.loads(stored[0].read_text()), own)
    assert {k: v for k, v in missed.items() if k != "ifeval"} == {
        k: v for k, v in lm_evals_own.items() if k != "ifeval"
    }

    built.clear()
    caplog.clear()
    hit = cached_build(build, [own, include])
    assert built == [[include]] and hit == missed
    overrides = [r for r in caplog.records if "overrides existing task" in r.getMessage()]
    assert "Task 'ifeval' from" in caplog.text and {r.name for r in overrides} == {TaskIndex.__module__}

    marker = tmp_path / "planted-code-ran"
    stored[0].write_bytes(pickle.dumps(_Planted(marker)))
    manager = TaskManager()  # the hooked TaskManager, as every lm_eval process builds it
    assert not marker.exists()
    assert "sink_strength" in manager.all_tasks and index_of(manager)["arc_easy"] == lm_evals_own["arc_easy"]
    assert decode(json.loads(stored[0].read_text()), own) == lm_evals_own  # replaced by lm-eval's build again

    # An entry that redirects a task to another stock YAML and one that adds a member to a tag, in a file that
    # another user could have written (the cache was not always private) or in a cache that others can write.
    rows = json.loads(stored[0].read_text())
    for row in rows["entries"]:
        if row["name"] == "arc_easy":
            row["yaml_path"] = "arc/arc_challenge.yaml"
        if row["name"] == "ai2_arc":
            row["tags"].append("ifeval")
    stored[0].write_text(json.dumps(rows))
    stored[0].chmod(0o664)
    rebuilt: list[list[Path]] = []

    def rebuild(paths, *, resolve_includes=True):  # lm-eval's build of its own folder, as made above
        rebuilt.append(list(paths))
        return dict(lm_evals_own) if list(paths) == [own] else lm_evals_build(paths, resolve_includes=resolve_includes)

    assert cached_build(rebuild, [own]) == lm_evals_own and rebuilt == [[own], []]  # not read: built, replaced
    assert decode(json.loads(stored[0].read_text()), own) == lm_evals_own and stored[0].stat().st_mode & 0o022 == 0
    stored[0].write_text(json.dumps(rows))
    (tmp_path / "cache").chmod(0o775)  # a cache its group can write: refused before anything in it is read
    with pytest.raises(UserError, match=r"project cache .* is writable by its group \(mode 775\)") as refused:
        cached_build(rebuild, [own])
    assert refused.value.hint.startswith(f"make it yours alone (chmod 700 {tmp_path / 'cache'}")
    (tmp_path / "cache").chmod(0o700)

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(tmp_path / "a_file" / "cache"))  # no folder can be made there
    built.clear()
    assert cached_build(build, [own]) == lm_evals_own and built == [[own], []]


def _entries(root: Path, **cfg_extra):
    from lm_eval.tasks._index import Entry, Kind

    return {
        "t": Entry("t", Kind.TASK, root / "a" / "t.yaml", {"task": "t", "tag": "g", **cfg_extra}, {"g"}),
        "g": Entry("g", Kind.TAG, None, None, {"t"}),
    }


@pytest.mark.parametrize(
    "value",
    [datetime.date(2026, 1, 1), {1: "a"}, ("a", "b"), float("nan"), {"a"}],
    ids=["date", "int key", "tuple", "nan", "set"],
)
def test_an_index_json_would_not_give_back_equal_is_not_kept(tmp_path, value):
    assert decode(json.loads(encode(_entries(tmp_path), tmp_path)), tmp_path) == _entries(tmp_path)
    assert encode(_entries(tmp_path, odd=value), tmp_path) is None
    assert encode(_entries(tmp_path.parent / "elsewhere"), tmp_path) is None  # a file outside the folder


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"yaml_path": "../../evil/t.yaml"}, "no file inside"),
        ({"yaml_path": "/evil/t.yaml"}, "no file inside"),
        ({"yaml_path": None}, "no file inside"),  # lm-eval would build the task from the stored cfg
        ({"yaml_path": ""}, "no file inside"),  # the folder itself: a traceback where lm-eval read it as a file
        ({"cfg": "task: t"}, "no file inside"),
        ({"kind": "NOT_A_KIND"}, "not an entry"),
        ({"tags": "g"}, "must be strings"),
    ],
    ids=["path up", "absolute path", "no file", "the folder", "cfg not a dict", "kind", "tags"],
)
def test_a_stored_index_that_names_no_file_of_lm_evals_folder_is_refused(tmp_path, change, why):
    data = json.loads(encode(_entries(tmp_path), tmp_path))
    data["entries"][0].update(change)
    with pytest.raises(ValueError, match=why):
        decode(data, tmp_path)
    data = json.loads(encode(_entries(tmp_path), tmp_path))
    data["entries"][1]["yaml_path"] = "a/t.yaml"  # a tag names no file
    with pytest.raises(ValueError, match="names a file"):
        decode(data, tmp_path)
