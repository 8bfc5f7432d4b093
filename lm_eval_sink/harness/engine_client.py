"""The sweep's side of the resident vLLM engine: its process, the requests, and what a checkpoint fixes in an engine.

`EngineProcess` runs `engine_server` in the eval settings' interpreter, one JSON line per request and answer;
`checkpoint_facts` reads what an engine started from a folder would fix, loading nothing. docs/scale.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.identity import TOKENIZER_FILES
from lm_eval_sink.io import canonical_json, parse_json, read_text, sha256_file


def _json(path: Path) -> Any:
    """A checkpoint's JSON file (None where there is none), one line where it does not read (`io.parse_json`)."""
    return parse_json(read_text(path), str(path), "repair or replace the checkpoint's file") if path.is_file() else None


def _file_sha(path: Path) -> str:
    """A tokenizer file's content: a JSON file as parsed (its formatting does not count), any other byte for byte."""
    if path.suffix == ".json":
        return hashlib.sha256(canonical_json(_json(path)).encode("utf-8")).hexdigest()
    return sha256_file(path)


def tensor_elements(folder: Path) -> int:
    """The elements of a checkpoint's largest tensor, from its safetensors headers (0 without any)."""
    from lm_eval_sink.weights import checkpoint_tensors

    return max((math.prod(t.shape) for t in checkpoint_tensors(folder).values()), default=0)


def _tensors(folder: Path) -> dict[str, Any]:
    """Every weight tensor's shape (safetensors); for other formats the weight files' names (shapes unread)."""
    from lm_eval_sink.weights import checkpoint_tensors

    tensors = checkpoint_tensors(folder)
    if tensors:
        return {name: list(t.shape) for name, t in tensors.items()}
    return {"files": sorted(p.name for p in folder.glob("*.bin"))}


def checkpoint_facts(folder: str | Path) -> dict[str, Any]:
    """What an engine started from `folder` would fix, as `engine_reuse.engine_fields` takes it."""
    folder = Path(folder)
    return {
        "config": _json(folder / "config.json") or {},
        "generation_config": _json(folder / "generation_config.json"),
        "tokenizer_config": _json(folder / "tokenizer_config.json"),
        "files": {
            name: _file_sha(folder / name)
            for name in TOKENIZER_FILES
            if name != "tokenizer_config.json" and (folder / name).is_file()  # that one: compared key by key
        },
        "tensors": _tensors(folder),
    }


# Run in the vLLM interpreter; reads vLLM's source, imports none of it (an import of vLLM takes tens of seconds).
RELOAD_PROBE = """
import ast, importlib.metadata as m, importlib.util as u, json, pathlib
def methods(path, cls):
    if not path.is_file():
        return set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {f.name for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
            for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
spec = u.find_spec("vllm")
root = pathlib.Path(spec.origin).parent if spec and spec.origin else pathlib.Path("/nonexistent")
try:
    version = m.version("vllm")
except m.PackageNotFoundError:
    version = None
worker = methods(root / "v1" / "worker" / "gpu_worker.py", "Worker")
llm = methods(root / "entrypoints" / "llm.py", "LLM")
print(json.dumps({"vllm": version, "vllm_module": spec is not None, "reload_weights": "reload_weights" in worker,
                  "collective_rpc": "collective_rpc" in llm, "reset_prefix_cache": "reset_prefix_cache" in llm}))
"""


def reload_support(python: str) -> dict[str, Any]:
    """{vllm: version, vllm_module, reload_weights, collective_rpc, reset_prefix_cache} of the vLLM in `python`."""
    from lm_eval_sink.harness.runner import run_probe

    return run_probe(python, RELOAD_PROBE)


class EngineProcess:
    """One resident engine's process and its request stream; its stderr (outside requests) goes to `log`."""

    def __init__(self, python: str, env: dict[str, str], log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "a", encoding="utf-8") as stderr:  # the process keeps its own handle
            # -P: the current folder does not count (a source checkout there would shadow the installed project)
            self.proc = subprocess.Popen(
                [python, "-P", "-m", "lm_eval_sink.harness.engine_server"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                text=True,
                bufsize=1,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its answer; a process that exits meanwhile is one line naming its log."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(payload) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = self.proc.wait()
            raise UserError(
                f"the resident vLLM engine's process exited with {code} (killed, out of memory or crashed?)",
                f"see its log {self.log}; the next checkpoint starts a new engine",
            )
        return json.loads(line)

    def close(self) -> None:
        """Ask the process to shut its engine down and exit; kill it when it does not within 120 seconds."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
