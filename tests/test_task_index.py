"""lm-eval's index of its own tasks read back from the cache (`harness/task_index.py`): the same index lm-eval
builds, a key that follows every YAML, and a torn file built again."""

from __future__ import annotations

import os
from pathlib import Path

from lm_eval_sink.harness.task_index import cached_build, folder_key


def test_the_key_follows_every_yaml_of_the_folder(tmp_path):
    root = tmp_path / "tasks"
    (root / "a").mkdir(parents=True)
    (root / "a" / "t.yaml").write_text("task: t\n")

    def key(version: str = "0.4.13") -> str:
        return folder_key(root, sorted(root.rglob("*.yaml")), version)

    first = key()
    assert key() == first and key("0.4.14") != first
    (root / "a" / "u.yaml").write_text("task: u\n")
    added = key()
    assert added != first
    os.utime(root / "a" / "t.yaml", ns=(1, 1))
    touched = key()
    assert touched not in (first, added)
    (root / "a" / "u.yaml").unlink()
    assert key() not in (first, added, touched)


def test_the_cached_index_is_lm_evals_and_later_folders_still_win(tmp_path, monkeypatch, caplog):
    """A miss stores lm-eval's own build; a hit reads it back without parsing lm-eval's folder and equals it; a
    task of an include path replaces lm-eval's of that name, with lm-eval's warning; a torn file is built again;
    a cache that cannot be written costs the build, nothing else."""
    import lm_eval
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
    stored = list((tmp_path / "cache" / "task_index").glob("*.pickle"))
    assert len(stored) == 1

    built.clear()
    caplog.clear()
    hit = cached_build(build, [own, include])
    assert built == [[include]] and hit == missed
    assert "Task 'ifeval' from" in caplog.text and "overrides existing task" in caplog.text

    stored[0].write_bytes(b"torn")
    built.clear()
    rebuilt = cached_build(build, [own])
    assert built == [[own], []] and stored[0].stat().st_size > 1000
    assert rebuilt["ifeval"].yaml_path.is_relative_to(own)
    assert {k: v for k, v in rebuilt.items() if k != "ifeval"} == {k: v for k, v in missed.items() if k != "ifeval"}

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(tmp_path / "a_file" / "cache"))  # no folder can be made there
    assert cached_build(build, [own]) == rebuilt
