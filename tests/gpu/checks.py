"""The GPU check: each check runs one path on the accelerator and on the CPU in one process and compares.

`make gpu-check` runs them through tests/gpu/run.py (one line per check with its figures); pytest runs
them through tests/gpu/test_gpu.py (marker `gpu`). Every model is built here: the closed-form sink
models of tests/sinkmodels.py, tiny merge trios (tests/helpers.make_tiny_lm), a random-init 7B-shaped
Llama. Nothing is downloaded. A check returns its figures, raises `Skip(reason)` when its path cannot
run on this machine, and raises anything else on failure.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # tests/sinkmodels.py and tests/helpers.py, also under `make gpu-check`
    sys.path.insert(0, str(TESTS))

FLOAT32_TOL = 1e-4  # S on the accelerator vs the CPU, float32 (docs/scale.md)
BF16_TOL = 0.05  # S in bfloat16 vs float32 (docs/sink-strength.md)
MERGE_TOL = 1e-4  # merged tensors, accelerator vs CPU (TSV / STAR run SVDs)
CONTROLS = (
    "linear_95_5",
    "linear_uniform",
    "task_arithmetic",
    "ties",
    "dare_linear",
    "slerp",
    "tsv",
    "star",
)
RANDOM_MASKS = {"dare_linear"}  # drop masks come from the device's own generator: compared by their statistics
SWEEP_CONTROLS = ("linear_95_5", "tsv")
IFEVAL_DOCS = (  # two IFEval-format prompts written for this check; their checks need no nltk data
    {
        "key": 1,
        "prompt": "Write a short note about rain. Do not use any commas.",
        "instruction_id_list": ["punctuation:no_comma"],
        "kwargs": [{}],
    },
    {
        "key": 2,
        "prompt": "Give the note a title wrapped in double angular brackets, i.e. <<title>>.",
        "instruction_id_list": ["detectable_format:title"],
        "kwargs": [{}],
    },
)


class Skip(Exception):
    """The check's path cannot run on this machine (the reason says why)."""


@dataclass
class Context:
    """What the checks share: the accelerator, a work folder, and artefacts built once."""

    device: str
    work: Path
    _made: dict[str, Any] = field(default_factory=dict)

    def once(self, name: str, make: Callable[[], Any]) -> Any:
        if name not in self._made:
            self._made[name] = make()
        return self._made[name]

    @property
    def tokenizer(self):
        from helpers import make_tokenizer

        return self.once("tokenizer", make_tokenizer)

    def sink_llama_dir(self) -> Path:
        """The closed-form sink Llama (3 layers) saved with the tiny tokenizer."""

        def make() -> Path:
            import sinkmodels as sm

            d = self.work / "sink_llama"
            sm.build("llama", n_layers=3, bos_id=self.tokenizer.bos_token_id).save_pretrained(d)
            self.tokenizer.save_pretrained(d)
            return d

        return self.once("sink_llama_dir", make)

    def trio(self) -> dict[str, Path]:
        from helpers import make_tiny_lm

        return self.once(
            "trio",
            lambda: {
                r: make_tiny_lm(self.work / "trio" / r, "llama", s)
                for r, s in (("base", None), ("reference", 1), ("candidate", 2))
            },
        )


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _measure(model, tokenizer, **settings):
    from lm_eval_sink.strength import StrengthSettings, measure

    return measure(model, tokenizer, StrengthSettings(**settings), progress=False)


def _s_pair(cpu, acc) -> tuple[float, float]:
    """|dS| and max |d(layer, head)| between two results."""
    ds = abs(cpu.sink_strength - acc.sink_strength)
    dlh = float(np.abs(np.array(cpu.sink_strength_layer_head) - np.array(acc.sink_strength_layer_head)).max())
    return ds, dlh


def check_strength_float32(ctx: Context) -> str:
    """S of the closed-form sink Llama on the accelerator equals the CPU value (and the closed form) in float32."""
    import sinkmodels as sm
    from lm_eval_sink.calibration import encode_prompts, load_prompts

    tok = ctx.tokenizer
    model = sm.build("llama", n_layers=3, bos_id=tok.bos_token_id)
    cpu = _measure(model, tok, last_k=2)
    acc = _measure(model.to(ctx.device), tok, last_k=2)
    lengths = [len(x) for x in encode_prompts(tok, load_prompts(None, None).prompts).input_ids]
    want, _ = sm.expected_strength("llama", 3, lengths, last_k=2)
    ds, dlh = _s_pair(cpu, acc)
    assert ds <= FLOAT32_TOL and dlh <= FLOAT32_TOL, (cpu.sink_strength, acc.sink_strength, dlh)
    assert abs(acc.sink_strength - want) <= FLOAT32_TOL, (acc.sink_strength, want)
    return (
        f"S cpu {cpu.sink_strength:.6f} {ctx.device} {acc.sink_strength:.6f} closed form {want:.6f}; "
        f"|dS| {ds:.1e}, max |d layer x head| {dlh:.1e} (tol {FLOAT32_TOL:g})"
    )


def check_strength_bfloat16(ctx: Context) -> str:
    """S of the same model in bfloat16 on the accelerator is within the documented tolerance of float32 on the CPU."""
    import torch

    import sinkmodels as sm

    tok = ctx.tokenizer
    cpu = _measure(sm.build("llama", n_layers=3, bos_id=tok.bos_token_id), tok, last_k=2)
    model = sm.build("llama", n_layers=3, bos_id=tok.bos_token_id, dtype=torch.bfloat16).to(ctx.device)
    acc = _measure(model, tok, last_k=2)
    ds, dlh = _s_pair(cpu, acc)
    assert math.isfinite(acc.sink_strength) and ds <= BF16_TOL, (cpu.sink_strength, acc.sink_strength)
    return (
        f"S cpu float32 {cpu.sink_strength:.6f} {ctx.device} bfloat16 {acc.sink_strength:.6f}; "
        f"|dS| {ds:.1e} (tol {BF16_TOL:g}), max |d layer x head| {dlh:.1e}"
    )


def check_device_auto(ctx: Context) -> str:
    """`strength` with `--device auto`: weights load straight onto the GPU (device map recorded), S as on the CPU."""
    from lm_eval_sink.strength import StrengthSettings, measure_model

    if not ctx.device.startswith("cuda"):
        raise Skip("device auto means the CPU here")
    folder = str(ctx.sink_llama_dir())
    cpu = measure_model(folder, StrengthSettings(last_k=2), dtype="float32", device="cpu", progress=False)
    acc = measure_model(folder, StrengthSettings(last_k=2), dtype="float32", device="auto", progress=False)
    model = acc.provenance["model"]
    ds, dlh = _s_pair(cpu, acc)
    assert model["device"].startswith("cuda") and ds <= FLOAT32_TOL and dlh <= FLOAT32_TOL, (model, ds)
    return (
        f"device {model['device']}, layers per device {model['device_map']}; "
        f"S {acc.sink_strength:.6f}, |dS| vs cpu {ds:.1e}"
    )


def _merged(ctx: Context, name: str, device: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    from lm_eval_sink.merging.configs import render
    from lm_eval_sink.merging.merge import run_mergekit

    trio = ctx.trio()
    out = ctx.work / "merges" / f"{name}-{device.replace(':', '_')}"
    run_mergekit(render(name, trio["reference"], trio["candidate"], base=trio["base"]).text, out, 0, device)
    tensors: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _kept_fraction(merged: dict[str, Any], base: dict[str, Any]) -> float:
    changed = sum(int((merged[k].float() != base[k].float()).sum()) for k in base)
    return changed / sum(v.numel() for v in base.values())


def check_merge_controls(ctx: Context) -> str:
    """The eight bundled controls (siblings lineage) merged with mergekit on the accelerator equal the CPU merges."""
    from safetensors.torch import load_file

    base = load_file(ctx.trio()["base"] / "model.safetensors")
    parts = []
    for name in CONTROLS:
        cpu, acc = _merged(ctx, name, "cpu"), _merged(ctx, name, ctx.device)
        assert cpu.keys() == acc.keys(), name
        if name in RANDOM_MASKS:
            kc, ka = _kept_fraction(cpu, base), _kept_fraction(acc, base)
            assert abs(kc - ka) <= 0.02 and all(bool(v.float().isfinite().all()) for v in acc.values()), (kc, ka)
            parts.append(f"{name} changed share cpu {kc:.3f} {ctx.device} {ka:.3f}")
            continue
        err = max(float((cpu[k].float() - acc[k].float()).abs().max()) for k in cpu)
        assert err <= MERGE_TOL, (name, err)
        parts.append(f"{name} {err:.1e}")
    return (
        "max |d tensor| " + ", ".join(parts) + f" (tol {MERGE_TOL:g}; DARE masks are drawn by each device's generator)"
    )


def _sweep(ctx: Context, device: str) -> list[dict[str, Any]]:
    import yaml

    from lm_eval_sink.cli import main

    trio = ctx.trio()
    folder = ctx.work / f"sweep-{device.replace(':', '_')}"
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "output": "out",
        "models": {"reference": str(trio["reference"]), "candidate": str(trio["candidate"])},
        "configs": list(SWEEP_CONTROLS),
        "merge": {"random_seed": 0, "device": device, "in_memory": True},
        "eval": {
            "tasks": ["lm_eval_sink_tiny_choice"],
            "include_path": str(TESTS / "data" / "merging_task"),
            "batch_size": 1,
            "seed": 0,
            "dtype": "float32",
            "device": device,
        },
        "strength": {"n_prompts": 5, "last_k": 2, "dtype": "float32", "device": device},
    }
    (folder / "sweep.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the check prints one line; the sweep's own lines stay here
        code = main(["sweep", str(folder / "sweep.yaml"), "--quiet"])
    assert code == 0, (device, printed.getvalue()[-2000:])
    return json.loads((folder / "out" / "table.json").read_text())["rows"]


def _peaks(ctx: Context, device: str) -> list[int | None]:
    """The peak accelerator memory each unit of the in-memory sweep on `device` recorded in its marker."""
    out = ctx.work / f"sweep-{device.replace(':', '_')}" / "out"
    markers = [json.loads(p.read_text()) for p in sorted(out.rglob("COMPLETE.json"))]
    return [m.get("peak_accelerator_memory") for m in markers if m.get("in_memory")]


def check_inmemory_sweep(ctx: Context) -> str:
    """An in-memory sweep of two controls on the accelerator gives the CPU sweep's table (S to float32 rounding)."""
    cpu, acc = _sweep(ctx, "cpu"), _sweep(ctx, ctx.device)
    assert [r["checkpoint"] for r in acc] == [r["checkpoint"] for r in cpu] and all(r["status"] == "ok" for r in acc)
    worst = 0.0
    for rc, ra in zip(cpu, acc, strict=True):
        for key, value in rc.items():
            if isinstance(value, float):
                worst = max(worst, abs(value - ra[key]))
    assert worst <= FLOAT32_TOL, worst
    peaks = _peaks(ctx, ctx.device)
    if ctx.device.startswith("cuda"):  # every unit records its peak; a CPU run records none
        assert peaks and all(isinstance(p, dict) and sum(p.values()) > 0 for p in peaks), peaks
    recorded = [sum(p.values()) for p in peaks if isinstance(p, dict)]
    names = ", ".join(r["checkpoint"] for r in acc)
    return (
        f"{len(acc)} checkpoints ({names}) ok; max |d figure| vs the CPU sweep {worst:.1e}; {len(recorded)} of "
        f"{len(peaks)} units record their peak accelerator memory (largest {max(recorded, default=0) / 2**20:.1f} MiB)"
    )


def check_protection(ctx: Context) -> str:
    """SinkProtection freeze / project / report on the accelerator match the CPU after the same weight updates."""
    import copy

    import torch

    import sinkmodels as sm
    from lm_eval_sink.strength import StrengthSettings
    from lm_eval_sink.training import SinkProtection, select_sink_heads

    tok = ctx.tokenizer
    bos = tok.bos_token_id
    cpu_model = sm.build_selective("llama", n_layers=3, vocab=len(tok), bos_id=bos, noise=0.05)
    plan = select_sink_heads(cpu_model, tok, StrengthSettings(last_k=2), progress=False)
    acc_model = copy.deepcopy(cpu_model).to(ctx.device)
    ids = torch.tensor([[bos, 5, 6, 7, 8]])
    out = {}
    for where, model in (("cpu", cpu_model), (ctx.device, acc_model)):
        prot = SinkProtection(plan)
        frozen = prot.freeze(model)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _ in range(3):  # three "optimizer steps": the same random updates on both devices
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.device))
                prot.project_(model)
        out[where] = (frozen, {n: p.detach().cpu() for n, p in model.named_parameters()}, prot.report(model, ids))
    (fc, wc, rc), (fa, wa, ra) = out["cpu"], out[ctx.device]
    err = max(float((wc[n] - wa[n]).abs().max()) for n in wc)
    dk = max(abs(rc[l]["dk_sink"] - ra[l]["dk_sink"]) for l in rc)
    assert fc == fa and err <= 1e-5 and dk <= 1e-5, (err, dk)
    dk_acc = max(r["dk_sink"] for r in ra.values())
    return (
        f"{len(fa)} frozen tensors; weights after 3 projected steps max |d| {err:.1e}; "
        f"report dk_sink {ctx.device} {dk_acc:.1e}, |d| vs cpu {dk:.1e}"
    )


def _lm_eval(ctx: Context, args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env_extra}
    argv = [sys.executable, "-m", "lm_eval", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ctx.work, timeout=900)


def check_lm_eval_hf(ctx: Context) -> str:
    """`lm_eval --model hf --tasks sink_strength,ifeval --limit 2` with sdpa on the accelerator: S equals the CPU's."""
    data = ctx.work / "data" / "ifeval"
    data.mkdir(parents=True, exist_ok=True)
    (data / "input_data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in IFEVAL_DOCS))
    model_dir = ctx.sink_llama_dir()
    out = ctx.work / "lm_eval"
    t0 = time.perf_counter()
    proc = _lm_eval(
        ctx,
        [
            "--model",
            "hf",
            "--model_args",
            f"pretrained={model_dir},dtype=float32,attn_implementation=sdpa",
            "--device",
            ctx.device,
            "--tasks",
            "sink_strength,ifeval",
            "--limit",
            "2",
            "--batch_size",
            "2",
            "--gen_kwargs",
            "max_gen_toks=16",
            "--output_path",
            str(out),
        ],
        {"LM_EVAL_SINK_DATA": str(data.parent)},
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, (proc.stderr or proc.stdout)[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    s = results["sink_strength"]["sink_strength,none"]
    from transformers import AutoModelForCausalLM

    cpu = _measure(AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"), ctx.tokenizer)
    assert abs(s - cpu.sink_strength) <= FLOAT32_TOL, (s, cpu.sink_strength)
    strict = results["ifeval"]["prompt_level_strict_acc,none"]
    return (
        f"S {s:.6f} (cpu measure {cpu.sink_strength:.6f}), ifeval prompt strict {strict:.2f} on 2 prompts; {wall:.0f} s"
    )


def check_flash_attention(ctx: Context) -> str:
    """A model loaded with flash_attention_2: S equals the same weights' S under sdpa, generation unchanged."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        raise Skip("flash_attn is not installed, so transformers cannot load flash_attention_2 here")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(ctx.tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    sdpa = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).to(ctx.device).eval()
    flash = LlamaForCausalLM._from_config(cfg, attn_implementation="flash_attention_2", dtype=torch.bfloat16)
    flash.load_state_dict(sdpa.state_dict())
    flash = flash.to(ctx.device).eval()
    ids = torch.tensor([[ctx.tokenizer.bos_token_id, 10, 11, 12]], device=ctx.device)
    before = flash.generate(ids, max_new_tokens=8, do_sample=False)
    s_flash, s_sdpa = _measure(flash, ctx.tokenizer), _measure(sdpa, ctx.tokenizer)
    after = flash.generate(ids, max_new_tokens=8, do_sample=False)
    assert flash.config._attn_implementation == "flash_attention_2"
    assert torch.equal(before, after) and abs(s_flash.sink_strength - s_sdpa.sink_strength) <= FLOAT32_TOL
    captured = s_flash.provenance.get("captured_with")
    return (
        f"S flash model {s_flash.sink_strength:.6f} sdpa {s_sdpa.sink_strength:.6f}; generation unchanged; "
        f"captured_with {captured!r}"
    )


def check_adapter(ctx: Context) -> str:
    """`strength ADAPTER_FOLDER` (a peft LoRA on the sink Llama) on the accelerator equals the CPU value."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lm_eval_sink.strength import StrengthSettings, measure_model

    base = ctx.sink_llama_dir()
    adapter = ctx.work / "adapter"
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"], lora_dropout=0.0),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.05)
    model.save_pretrained(adapter)
    settings = StrengthSettings(last_k=2)
    cpu = measure_model(str(adapter), settings, dtype="float32", device="cpu", progress=False)
    acc = measure_model(str(adapter), settings, dtype="float32", device=ctx.device, progress=False)
    plain = measure_model(str(base), settings, dtype="float32", device=ctx.device, progress=False)
    ds, dlh = _s_pair(cpu, acc)
    assert ds <= FLOAT32_TOL and dlh <= FLOAT32_TOL and abs(acc.sink_strength - plain.sink_strength) > 1e-3
    return (
        f"S adapter cpu {cpu.sink_strength:.6f} {ctx.device} {acc.sink_strength:.6f} "
        f"(base {plain.sink_strength:.6f}); |dS| {ds:.1e}"
    )


def _timed(device: str, fn: Callable[[], Any]) -> tuple[float, int]:
    """(seconds, peak accelerator bytes above what was allocated before) of one call, after one warm-up."""
    import torch

    fn()
    _sync(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated(device) - before


def _left_padded(rows: list[list[int]], device: str):
    """A left-padded batch (ids, attention mask), as a user batches the same prompts for a forward."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, device=device)
        mask[i, width - len(r) :] = 1
    return ids, mask


def check_scale_7b(ctx: Context) -> str:
    """A random-init 7B-shaped Llama in bfloat16: time and peak memory of strength.measure vs a plain forward."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lm_eval_sink.calibration import encode_prompts, load_prompts

    if not ctx.device.startswith("cuda"):
        raise Skip("peak accelerator memory needs CUDA")
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    tok = ctx.tokenizer
    long_file = ctx.work / "long_prompt.txt"
    long_file.write_text(" ".join(["the"] * 4094) + "\n")
    parts = [f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params"]
    for label, settings in (
        ("15 prompts", {}),
        ("one 4,096-token prompt", {"prompts_file": str(long_file), "use_chat_template": False}),
    ):
        prompts = load_prompts(settings.get("prompts_file"), None).prompts
        encoded = encode_prompts(tok, prompts, settings.get("use_chat_template", True), None)
        ids, mask = _left_padded(encoded.input_ids, ctx.device)

        def forward(ids=ids, mask=mask) -> None:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, use_cache=False)

        tf, mf = _timed(ctx.device, forward)
        tm, mm = _timed(ctx.device, lambda s=settings: _measure(model, tok, **s))
        parts.append(
            f"{label} ({ids.shape[0]} x {ids.shape[1]} tokens): measure {tm * 1e3:.0f} ms / {mm / 2**20:.0f} MiB, "
            f"forward {tf * 1e3:.0f} ms / {mf / 2**20:.0f} MiB ({tm / tf:.2f}x time, {mm / max(mf, 1):.2f}x memory)"
        )
    return "; ".join(parts)


CHECKS: dict[str, Callable[[Context], str]] = {
    "strength_float32": check_strength_float32,
    "strength_bfloat16": check_strength_bfloat16,
    "device_auto": check_device_auto,
    "merge_controls": check_merge_controls,
    "inmemory_sweep": check_inmemory_sweep,
    "protection": check_protection,
    "lm_eval_hf": check_lm_eval_hf,
    "flash_attention": check_flash_attention,
    "adapter": check_adapter,
    "scale_7b": check_scale_7b,
}


def accelerator() -> tuple[str | None, str]:
    """('cuda', its name) when CUDA is usable, else (None, why not)."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        return None, f"CUDA is not available (torch {torch.__version__}, {'CUDA ' + built if built else 'a CPU build'})"
    return "cuda", torch.cuda.get_device_name(0)
