"""One key for every result (`keys.key_of`), tested by walking every declared result kind: each value its work
receives, each file it reads (its bytes changed at the same path, size and mtime), each environment variable and
each module of its code changes the key when changed; what is marked as how it runs does not; nothing changed, the
same key. Then two runs through the CLI on a tiny model: a prompt file edited in place is measured again."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from lm_eval_sink.keys import Work, key_of


def declared_kinds() -> list[type[Work]]:
    """Every result kind the package declares (the modules that declare them imported)."""
    import lm_eval_sink.commands.attribute
    import lm_eval_sink.commands.buckets
    import lm_eval_sink.commands.screen
    import lm_eval_sink.extract.pipeline
    import lm_eval_sink.margin
    import lm_eval_sink.merging.merge
    import lm_eval_sink.merging.sweep  # noqa: F401

    def below(cls: type) -> list[type]:
        return [k for sub in cls.__subclasses__() for k in (sub, *below(sub))]

    public = {k for k in below(Work) if getattr(sys.modules[k.__module__], k.__name__, None) is k}  # not the class
    return sorted(public, key=lambda k: k.__name__)  # a slots dataclass replaced


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.fixture
def declarations(tmp_path) -> dict[type[Work], Any]:
    """A declaration of every result kind, each file and folder it names written under `tmp_path`."""
    from lm_eval_sink.attribution import AttributeOptions
    from lm_eval_sink.buckets.settings import BucketSettings
    from lm_eval_sink.commands.attribute import AttributeWork
    from lm_eval_sink.commands.buckets import BucketsWork
    from lm_eval_sink.commands.recovery import RecoveryWork
    from lm_eval_sink.commands.screen import ScreenWork
    from lm_eval_sink.extract.pipeline import ExtractCode
    from lm_eval_sink.harness.runner import EvalSettings
    from lm_eval_sink.margin import MarginSettings, MarginWork
    from lm_eval_sink.merging.configs import ValidatedConfig
    from lm_eval_sink.merging.merge import MergeWork
    from lm_eval_sink.merging.sweep import EvalWork, SweepStrengthWork
    from lm_eval_sink.options import ScreenOptions
    from lm_eval_sink.strength import StrengthSettings, StrengthWork

    f = {n: tmp_path / n for n in ("a", "b", "tasks", "adapter", "run", "tok")}
    for model in ("a", "b"):
        _write(f[model] / "config.json", json.dumps({"model_type": "llama", "vocab_size": 8}))
        _write(f[model] / "model.safetensors", f"weights of {model} " * 8)
    _write(f["tasks"] / "suite.yaml", "group: my_suite\ntask: [ifeval]\n")
    _write(f["adapter"] / "adapter_model.bin", "adapter weights")
    _write(f["tok"] / "tokenizer.json", '{"tokenizer": 1}')
    _write(f["run"] / "results_1.json", '{"results": {}}')
    prompts = _write(tmp_path / "prompts.jsonl", '{"prompt": "one"}\n{"prompt": "two"}\n')
    strength = StrengthSettings(last_k=2, prompts_file=prompts, system_prompt="be brief")
    eval_settings = EvalSettings(
        tasks=("ifeval",),
        include_path=str(f["tasks"]),
        model_args={"peft": str(f["adapter"]), "max_length": 64},
        gen_kwargs={"max_gen_toks": 16},
        limit=4,
    )
    config = ValidatedConfig(
        "m.yaml",
        "# a comment\n",
        {"merge_method": "linear", "dtype": "float32"},
        "linear",
        None,
        (str(f["a"]),),
        None,
        tokenizer=str(f["tok"]),
    )
    samples = {"reference samples": Path(_write(tmp_path / "s_ref.jsonl", '{"doc_id": 0}\n'))}
    registry = AttributeOptions(registry_file=_write(tmp_path / "reg.yaml", "models: {}\n"), mixture={"sft": "1"})
    engine = {"model_args": {"quantization": "fp8", "enforce_eager": True}, "dtype": "bfloat16"}
    return {
        StrengthWork: StrengthWork(str(f["a"]), strength, "auto"),
        ScreenWork: ScreenWork(
            (str(f["a"]), str(f["b"])), strength, "float32", ScreenOptions(_write(tmp_path / "pairs.yaml", "p: 1\n"))
        ),
        MarginWork: MarginWork(str(f["a"]), str(f["b"]), MarginSettings(strength, last_k=3), "auto"),
        MergeWork: MergeWork(config, 0),
        EvalWork: EvalWork(str(f["a"]), "sha256:a", eval_settings),
        SweepStrengthWork: SweepStrengthWork("merges/m", "inputs-key-of-m", strength, "float32", engine),
        BucketsWork: BucketsWork(samples, "ifeval", BucketSettings(confidence=0.9), str(f["tok"])),
        RecoveryWork: RecoveryWork({**samples, "reference results": f["run"] / "results_1.json"}, BucketSettings()),
        AttributeWork: AttributeWork((str(f["run"]),), ("vendor:x",), registry, Path(_write(tmp_path / "v.yml", "{}"))),
        ExtractCode: ExtractCode(),
    }


def _leaves(value: Any, how: str | None = "value", path: tuple = ()) -> Iterator[tuple[tuple, Any, str | None]]:
    """(path, value, how the key holds it) of every value in a declaration, containers walked (an empty one is a
    value)."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), how and f.metadata.get("key", "value"), (*path, f.name))
    elif isinstance(value, (Mapping, list, tuple)) and value:
        for k, v in value.items() if isinstance(value, Mapping) else enumerate(value):
            yield from _leaves(v, how, (*path, k))
    else:
        yield path, value, how


def _replaced(value: Any, path: tuple, new: Any) -> Any:
    """`value` with the value at `path` replaced by `new` (a dataclass copied without its checks)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if dataclasses.is_dataclass(value):
        out = copy.copy(value)
        object.__setattr__(out, head, _replaced(getattr(value, head), rest, new))
        return out
    if isinstance(value, Mapping):
        return {**value, head: _replaced(value[head], rest, new)}
    return type(value)(_replaced(v, rest, new) if i == head else v for i, v in enumerate(value))


def _other(value: Any) -> Any:
    """Another value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    return {"x": 1} if isinstance(value, Mapping) else ("x",) if isinstance(value, tuple) else "x"


def _edited_in_place(path: Path) -> Callable[[], None]:
    """Change the first byte of the file `path` (a folder: its first file), keeping its size and mtime; returns
    the function that puts the byte back (the mtime kept again)."""
    file = path if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())[0]
    data, st = file.read_bytes(), file.stat()

    def put(content: bytes) -> None:
        file.write_bytes(content)
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))

    put(bytes([data[0] ^ 1]) + data[1:])
    assert file.stat().st_size == st.st_size and file.stat().st_mtime_ns == st.st_mtime_ns
    return lambda: put(data)


def test_every_declared_input_of_every_result_kind_is_in_its_key(declarations):
    """Generated over every kind and every value of its declaration: a value changed, or a file's bytes changed at
    the same path, size and mtime, gives another key, and put back the same key; a value the kind marks as how it
    runs (batching, device, where a model lies when its identity is given) gives the same key."""
    assert set(declarations) == set(declared_kinds())  # a new result kind needs a declaration here
    checked = 0
    for work in declarations.values():
        key = key_of(work).key
        assert key_of(work).key == key  # nothing changed: the same key
        for path, value, how in _leaves(work):
            where = f"{type(work).__name__}.{'.'.join(map(str, path))}"
            names_file = isinstance(value, (str, Path)) and os.path.exists(value)
            if how is None:
                assert key_of(_replaced(work, path, _other(value))).key == key, f"{where} is in no key"
            elif names_file and (how in ("content", "model") or isinstance(value, Path)):
                put_back = _edited_in_place(Path(value))
                assert key_of(work).key != key, f"{where}: its content edited in place, the key stayed"
                put_back()
                assert key_of(work).key == key, where
            elif how != "model":  # a model is keyed by content, checked above
                assert key_of(_replaced(work, path, _other(value))).key != key, f"{where} is not in the key"
            checked += 1
    assert checked > 60


CODE = {  # where each kind's settings are chosen and handed to the work, and code it runs that its key once missed
    "StrengthWork": ("commands/strength", "capture"),
    "ScreenWork": ("commands/screen", "commands/strength"),
    "MarginWork": ("commands/margin", "strength"),
    "MergeWork": ("commands/merge", "merging/methods", "merging/inmemory"),
    "EvalWork": ("commands/units", "commands/sweep"),
    "SweepStrengthWork": ("commands/units", "harness/inprocess", "harness/engine_strength"),
    "BucketsWork": ("commands/buckets", "power", "pairing"),
    "RecoveryWork": ("commands/recovery", "recovery", "power", "plots", "buckets/stats"),
    "AttributeWork": ("commands/attribute",),
    "ExtractCode": ("extract/pipeline",),
}


def test_every_environment_variable_and_module_a_kind_declares_is_in_its_key(declarations, tmp_path, monkeypatch):
    """The local data LM_EVAL_SINK_DATA names is keyed by content (a file edited in place, the variable unset or
    pointed elsewhere: another key), and every module a kind names as its code, the command that chooses the
    settings included (`commands/strength.py` for S), changes the key when its text changes."""
    from helpers import change_code

    data = Path(_write(tmp_path / "data" / "ifeval" / "train.jsonl", '{"key": 1}\n')).parent.parent
    for kind, work in declarations.items():
        missing = {f"lm_eval_sink/{m}.py" for m in CODE[kind.__name__]} - set(key_of(work).versions["code"])
        assert not missing, f"{kind.__name__}: {missing}"
    for work in declarations.values():
        for name in type(work).ENV:
            monkeypatch.setenv(name, str(data))
            key = key_of(work).key
            put_back = _edited_in_place(data)
            assert key_of(work).key != key, name
            put_back()
            assert key_of(work).key == key
            monkeypatch.delenv(name)
            assert key_of(work).key != key, name
        key = key_of(work)
        for root in type(work).CODE:
            file = "lm_eval_sink/" + root.removeprefix("lm_eval_sink.").replace(".", "/") + ".py"
            assert file in key.versions["code"], f"{type(work).__name__}: {file}"
            with monkeypatch.context() as m:
                change_code(m, file)
                assert key_of(work).key != key.key, f"{type(work).__name__}: {file}"
    assert {w.__name__ for w in declarations if w.ENV} == {"EvalWork"}


def test_a_prompt_file_edited_in_place_is_not_reused_by_strength(handset_llama_dir, tmp_path, capsys):
    """`strength --prompts FILE` keyed the file by its path: edited in place from two prompts to one (same size,
    same mtime), the rerun said `reused` and kept S of two. Now the rerun is refused as one of other inputs, --force
    measures the one prompt, and the next run reuses it."""
    from lm_eval_sink.cli import main

    prompts, out = tmp_path / "prompts.txt", tmp_path / "out"
    prompts.write_text("Name two colours.\nName a big city.\n")
    args = ["strength", str(handset_llama_dir), "--prompts", str(prompts), "--last-k", "2", "--output", str(out)]
    assert main([*args, "--quiet"]) == 0
    (result,) = out.glob("*.strength.json")
    assert json.loads(result.read_text())["n_prompts"] == 2
    capsys.readouterr()
    assert main([*args, "--quiet"]) == 0 and ": reused" in capsys.readouterr().out
    mtime = prompts.stat().st_mtime_ns
    prompts.write_text("Name two colours.\n" + " " * 16 + "\n")  # one prompt, the same size
    os.utime(prompts, ns=(mtime, mtime))
    assert main([*args, "--quiet"]) == 2
    assert "already exists with other inputs" in capsys.readouterr().err
    assert main([*args, "--quiet", "--force"]) == 0 and json.loads(result.read_text())["n_prompts"] == 1
    capsys.readouterr()
    assert main([*args, "--quiet"]) == 0 and ": reused" in capsys.readouterr().out
