"""Plain test helpers and constants shared by several test modules (fixtures are in conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LM_EVAL_SINK_SHARED", REPO.parent / "shared"))
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # for a child process

# Real lm-eval runs of the embedded default model, made ONCE per test session and shared by the
# harness, buckets and protocols tests. Small and non-final: --limit 5, max_gen_toks 64.
FIXTURE_LIMIT = 5
FIXTURE_GEN_KWARGS = {"max_gen_toks": 64}
FIXTURE_BATCH = 8  # the instruct protocol's; the community run uses the same so the two differ only in protocol


TINY_TASK = "tiny_gen"
TINY_SWEEP_TASKS = REPO / "tests" / "data" / "merging_task"  # a tiny multiple-choice lm-eval task, for sweeps
TINY_SWEEP_TASK = "lm_eval_sink_tiny_choice"
# the units of `write_tiny_sweep`'s sweep, in the order they run
TINY_SWEEP_UNITS = (
    *("eval:reference", "strength:reference", "eval:candidate", "strength:candidate"),
    *("merge:dare_linear", "eval:dare_linear", "strength:dare_linear"),
)


def make_tokenizer(vocab_size: int = 96):
    """A tiny word-level fast tokenizer with a chat template, trained locally (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = (
        "the a an of to in and is it you that for on with as are this be at or by from write list "
        "explain answer give name three two four words using only letters title story json colors".split()
    )
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["<unk>", *specials])
    tok.train_from_iterator([" ".join(words)] * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return fast


def save_sink_llama(path: Path, gaps, tokenizer) -> Path:
    """sinkmodels' hand-set Llama with chosen sink gaps, saved with `tokenizer` (margin/screen tests).

    `gaps[layer][head]` = c (2 heads): a row at query position t >= 1 has logits [c, 0 x t], so its
    sink log-odds at key 0 are c - log(t). In sinkmodels' Llama c = alpha * beta * H / sqrt(D).
    """
    import sinkmodels as sm
    import torch

    model = sm.build("llama", n_layers=len(gaps), bos_id=tokenizer.bos_token_id)
    beta = sm.betas(len(gaps))
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            for h, c in enumerate(gaps[li]):
                layer.self_attn.q_proj.weight[h * sm.D + 1, 1] = c / (beta[li] * sm.H * sm.D**-0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_lm(
    out: Path,
    arch: str = "llama",
    delta_seed: int | None = None,
    delta_scale: float = 0.02,
    vocab_extra: int = 0,
    **shape: int,
) -> Path:
    """A tiny random causal LM folder (weights + tokenizer). The same `arch` always starts from the
    same base weights (seed 0); `delta_seed` adds a task vector delta_scale * N(0, 1) to every
    parameter, so base / base + tau_1 / base + tau_2 make a reference-candidate-base trio. `shape`
    overrides config sizes (e.g. intermediate_size=48)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = make_tokenizer()
    dims = dict(
        vocab_size=len(tok) + vocab_extra,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    dims.update(shape)
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**dims, tie_word_embeddings=False))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**dims, tie_word_embeddings=True))
    else:
        raise ValueError(arch)
    if delta_seed is not None:
        g = torch.Generator().manual_seed(delta_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(delta_scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)


def hf_cache_snapshot(
    hub: Path, repo_id: str, folder: Path, sha: str, refs: tuple[str, ...] = ("main",)
) -> dict[str, str]:
    """Lay `folder` out in the HF hub cache `hub` as huggingface_hub writes it: `refs/<ref>` names the
    commit `sha`, `snapshots/<sha>/` links into `blobs/` (sha256 names for LFS files (*.safetensors),
    git blob ids for the others). Returns {file: blob hash} as `identity.model_identity` reports it."""
    import hashlib

    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snap, blobs = repo / "snapshots" / sha, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    files = {}
    for f in sorted(Path(folder).iterdir()):
        data = f.read_bytes()
        lfs = f.suffix == ".safetensors"
        blob = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(data).hexdigest()
        (blobs / blob).write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blobs / blob, snap))
        files[f.name] = ("sha256:" if lfs else "git:") + blob
    return files


def isolated_ray_auth(folder: Path) -> dict[str, str]:
    """The environment of a Ray cluster and its drivers that share a token of their own in `folder`: the mode and the
    token file explicit, so a ~/.ray/auth_token an earlier Ray run left (Ray 2.60 looks there last, and with the
    mode unset turns token auth on whenever it finds one) decides nothing."""
    import secrets

    folder.mkdir(parents=True, exist_ok=True)
    token = folder / "auth_token"
    if not token.is_file():
        token.write_text(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


def stop_ray_cluster(temp_dir: Path, grace: float = 3.0) -> None:
    """Stop the Ray cluster that `ray start --temp-dir temp_dir` started, and nothing else (`ray stop` stops every Ray
    of the machine): the processes whose command line names its temp dir and their descendants (workers rename
    themselves `ray::...`), SIGTERM, then SIGKILL for those still alive after `grace` seconds."""
    import signal
    import time

    cmdlines, parents = {}, {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdlines[int(proc.name)] = (proc / "cmdline").read_bytes()
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    pids = {p for p, c in cmdlines.items() if str(temp_dir).encode() in c and p != os.getpid()}
    while True:
        more = {p for p, parent in parents.items() if parent in pids} - pids
        if not more:
            break
        pids |= more

    def alive() -> list[int]:
        out = []
        for p in pids:
            try:
                if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # a zombie is gone already
                    out.append(p)
            except (OSError, IndexError):
                continue
        return out

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while alive() and time.time() < deadline:
            time.sleep(0.2)


def set_package_version(monkeypatch, name: str, version: str) -> str | None:
    """Make `provenance.package_versions` (the one source of the versions in result keys) report `version` for
    `name`, as an upgrade of that package would; returns the installed version."""
    import lm_eval_sink.provenance as provenance

    real = provenance.package_versions
    installed = real((name,))[name]

    def patched(names=provenance._RECORDED_PACKAGES):
        return {n: version if n == name else v for n, v in real(names).items()}

    monkeypatch.setattr(provenance, "package_versions", patched)
    return installed


def change_code(monkeypatch, path: str) -> None:
    """Make `code_key.source_hashes` (the one source of the code hashes in result keys) report another hash for the
    project file `path` (e.g. `lm_eval_sink/capture.py`), as an edit of that file would, in this process. The test
    that edits a real file is tests/test_code_key.py."""
    import lm_eval_sink.code_key as code_key

    real = code_key.source_hashes

    def patched(roots):
        hashes = real(roots)
        assert path in hashes, f"{path} is not on the path of {roots}"
        return {**hashes, path: "edited-" + hashes[path]}

    monkeypatch.setattr(code_key, "source_hashes", patched)


def kill_sweep_when(sweep: Path, folder: Path, pattern: str, settle: float = 0.0, timeout: float = 600) -> bool:
    """Run `sweep` in a forked process group and SIGKILL the group once `folder.glob(pattern)` finds something
    (a staged `.partial-*` unit), `settle` seconds later. True when it was killed, False when it ended first."""
    import signal
    import time

    import torch

    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            torch.set_num_threads(1)
            run_sweep(load_sweep(sweep), progress=False)
        finally:
            os._exit(0)
    deadline, seen = time.time() + timeout, False
    while time.time() < deadline and not seen:
        seen = bool(list(folder.glob(pattern)))
        if not seen and os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
        time.sleep(settle if seen else 0.02)
    os.killpg(pid, signal.SIGKILL)  # also on timeout: no sweep outlives the test
    os.waitpid(pid, 0)
    return seen


def start_ray_cluster(temp_dir: Path, env: dict[str, str], num_cpus: int, num_gpus: int = 0) -> str:
    """`ray start --head` listening on 127.0.0.1 alone, with `num_cpus` (and `num_gpus` declared), its files under
    `temp_dir`, no dashboard, no usage stats; returns the GCS address it wrote. `stop_ray_cluster(temp_dir)` stops it.
    """
    import subprocess
    import sys

    cmd = [
        *(str(Path(sys.executable).with_name("ray")), "start", "--head", "--num-cpus", str(num_cpus)),
        *(("--num-gpus", str(num_gpus)) if num_gpus else ()),
        *("--include-dashboard=false", "--temp-dir", str(temp_dir), "--node-ip-address", "127.0.0.1"),
        *("--port", "0", "--disable-usage-stats"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise RuntimeError(f"ray start failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return (temp_dir / "ray_current_cluster").read_text().strip()  # the GCS address `ray start` wrote


def write_tiny_sweep(folder: Path, trio: dict[str, Path], **extra) -> Path:
    """The sweep file of the sweep tests: the tiny trio's reference, candidate and one seeded DARE merge, evaluated on
    the tiny choice task and measured on 5 prompts; each `extra` section replaces the one of that name."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "output": "out",
        "models": {"reference": str(trio["reference"]), "candidate": str(trio["candidate"])},
        "configs": ["dare_linear"],
        "merge": {"random_seed": 0},
        "eval": {"tasks": [TINY_SWEEP_TASK], "include_path": str(TINY_SWEEP_TASKS), "batch_size": 1, "seed": 0},
        "strength": {"n_prompts": 5, "last_k": 2, "dtype": "float32"},
        **extra,
    }
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --- real vLLM (the CPU build in .venv-vllm) -------------------------------------------------------------

VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
# vLLM's default process mode, as users run it (the engine core in a process of its own; VLLM_ENABLE_V1_MULTIPROCESSING
# unset), on one OpenMP thread with 1 GiB of KV cache: one test of each vLLM path runs so (docs/scale.md).
VLLM_DEFAULT_MODE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# The tests' speed-up for the others: the engine in the calling process (start-up seconds, not half a minute).
VLLM_ENV = {**VLLM_DEFAULT_MODE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
VLLM_MODEL_ARGS = "enforce_eager=True"  # no torch.compile (minutes on a CPU); a resource argument, not the protocol
SWEEP_LIMIT = 2  # local IFEval prompts of the SmolLM2 sweeps
NEAR_REFERENCE = REPO / "tests" / "data" / "near_reference.yaml"  # 0.95 reference + 0.05 candidate


def vllm_missing_reason() -> str:
    return f"{VLLM_PY} is absent: `make venv-vllm` builds it (make test does)"


def smollm2_sweep_file(folder: Path, reference: Path, candidate: Path, backend: dict, strength) -> Path:
    """The SmolLM2 sweep (reference, candidate, the near-reference merge; IFEval on SWEEP_LIMIT local prompts with 32
    new tokens and sink_strength, float32), its evaluations in .venv-vllm's python, with `backend`'s eval keys."""
    import yaml

    folder.mkdir(parents=True)
    evals = {"tasks": ["ifeval", "sink_strength"], "apply_chat_template": True, "num_fewshot": 0}
    evals |= {"gen_kwargs": {"max_gen_toks": 32}, "python": os.path.relpath(VLLM_PY, folder)}
    evals |= {"limit": SWEEP_LIMIT, "batch_size": 1, "dtype": "float32", "seed": 0, **backend}
    data = {
        "output": "out",
        "models": {"reference": str(reference), "candidate": str(candidate)},
        "configs": [str(NEAR_REFERENCE)],
        "eval": evals,
        "strength": strength,
    }
    (folder / "sweep.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return folder / "sweep.yaml"


def engine_core_pids(log_text: str) -> set[int]:
    """The process ids vLLM's log lines name as its engine core (`(EngineCore pid=N) ...`): one, of a process of its
    own, in vLLM's default process mode; none with the in-process engine (its lines say `MainProcess`)."""
    import re

    return {int(m) for m in re.findall(r"\(EngineCore pid=(\d+)\)", log_text)}
