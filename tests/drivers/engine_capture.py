"""One family's tiny model measured twice in the vLLM venv: transformers' eager capture, then the vLLM engine's own.

Usage: .venv-vllm/bin/python tests/drivers/engine_capture.py JOB.json   (one engine per process)
JOB: {"family", "folder", "out", "dtype", "tensor_parallel_size", "n_prompts", "max_num_batched_tokens",
"enforce_eager" (default true: torch.compile takes minutes on a CPU), "config" (config fields to override),
"engine_args" (more LLM arguments), "lora" (true: a LoRA adapter on q_proj and k_proj, applied by the engine),
"w4a16" (true: the engine runs a compressed-tensors W4A16 copy, the eager side its dequantized weights)}.
A measurement the engine refuses writes OUT.json {"refused": REASON, "texts": [generations before, after]} only.
It builds the family's model (tests/engine_models.py) in `folder`, captures the calibration prompts with
`capture.capture_prompts` on the model loaded eager (batches of 2: left padding), starts one engine with
this project's worker extension (`EngineWorkerExtension`, which inherits `SinkCaptureMixin`) and measures them there
(`measure_on_engine`), twice, with greedy generations before, between and after; with `lora` it also measures them
with the engine applying a LoRA adapter (`lora_request`), against the eager capture of the weights with the adapter
merged in; with `max_num_batched_tokens` it also asks for a prompt longer than that, once refused by the driver's
check and once with that check skipped (the workers then see the split prefill); and seedless sampled generations
from the workers' start seed with and without a measurement before them. It writes OUT.npz (both sides' arrays) and
OUT.json (texts, sampled, refusals, timings).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: engine_models, helpers

FIELDS = ("sink_logodds", "sink_pos", "pos0_mass", "pos0_visible", "content")
EXTENSION = "lm_eval_sink.harness.engine_worker.EngineWorkerExtension"
LORA_RANK, LORA_ALPHA = 8, 16


def _lora(folder: Path, out: Path) -> tuple[Path, Path]:
    """A peft-format LoRA adapter on every layer's q_proj and k_proj (seeded, large enough to move S) in `out`, and
    the base with it merged in (W + alpha / r * B A) in `out`/merged: (adapter folder, merged model folder)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    weights, generator, adapter = load_file(folder / "model.safetensors"), torch.Generator().manual_seed(1), {}
    for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight"))]:
        w = weights[name]
        a = torch.randn(LORA_RANK, w.shape[1], generator=generator, dtype=torch.float32) * 0.1
        b = torch.randn(w.shape[0], LORA_RANK, generator=generator, dtype=torch.float32) * 0.1
        stem = "base_model.model." + name.removesuffix(".weight")
        adapter |= {f"{stem}.lora_A.weight": a.to(w.dtype), f"{stem}.lora_B.weight": b.to(w.dtype)}
        weights[name] = (w.float() + LORA_ALPHA / LORA_RANK * b @ a).to(w.dtype)
    out.mkdir(parents=True)
    save_file(adapter, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": LORA_ALPHA}
    config |= {"target_modules": ["q_proj", "k_proj"], "lora_dropout": 0.0, "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(folder)}))
    shutil.copytree(folder, out / "merged")
    save_file(weights, out / "merged" / "model.safetensors", metadata={"format": "pt"})
    return out, out / "merged"


def _w4a16(folder: Path, out: Path) -> tuple[Path, Path]:
    """The model as a compressed-tensors W4A16 checkpoint (symmetric int4 per group of 32 on every decoder linear,
    pack-quantized: the 4-bit format the CPU build's WNA16 kernel runs; scales rounded to bf16, as the engine holds
    them) in `out`/quantized, and the same weights dequantized by compressed-tensors' own fake_quantize in
    `out`/dequantized: (quantized, dequantized)."""
    import shutil

    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization import apply_quantization_config, fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"w4a16": scheme}, ignore=["lm_head"], format="pack-quantized")
    model, plain = (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32) for _ in range(2))
    apply_quantization_config(model, config)
    dequantized = {}
    for name, m in model.named_modules():
        if getattr(m, "quantization_scheme", None) is not None:
            groups = m.weight.data.reshape(m.weight.shape[0], -1, 32)
            scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            scale = scale.to(torch.bfloat16).float()  # the engine holds the scale in bf16: q x scale is then exact
            m.weight_scale.data = scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype)
            m.weight_zero_point.data = zero.reshape(m.weight_zero_point.shape).to(m.weight_zero_point.dtype)
            dequantized[f"{name}.weight"] = fake_quantize(m.weight.data, m.weight_scale, m.weight_zero_point, args)
    quantized, plain_out = out / "quantized", out / "dequantized"
    for target in (quantized, plain_out):
        shutil.copytree(folder, target)  # the tokenizer files; the weights and config.json are written over
    plain.load_state_dict({**plain.state_dict(), **dequantized})
    plain.save_pretrained(plain_out)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(quantized)
    compressor.update_config(quantized)
    return quantized, plain_out


def _hf(folder: Path, encoded, layers, dtype: str) -> list:
    import torch
    from transformers import AutoModelForCausalLM

    from lm_eval_sink.calibration import Batching
    from lm_eval_sink.capture import capture_prompts

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation="eager")
    return capture_prompts(model.eval(), encoded, layers, Batching(batch_size=2), progress=False)


def _greedy(llm, encoded) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(ids)} for ids in encoded.input_ids[:2]], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _sampled(llm, encoded, layers) -> dict:
    """Seedless sampled generations from the seed the workers set at start (`reseed`), with and without a
    measurement before them: equal where the measurement draws no random number. One prompt: with two, vLLM's
    default process mode may schedule the second a step later (it reaches the engine core through a socket), which
    changes the batches' draws whatever the measurement did (a fresh-clone run saw it once)."""
    from vllm import SamplingParams

    from lm_eval_sink.harness.engine_capture import measure_on_engine

    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(encoded.input_ids[0])}]
    out = {}
    for name in ("plain", "measured"):
        llm.collective_rpc("reseed")
        if name == "measured":
            measure_on_engine(llm, encoded, layers)
        out[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return out


def _refusals(llm, encoded, layers, limit: int) -> dict:
    """A prompt longer than max_num_batched_tokens: the driver's refusal, then (its check skipped) the workers'."""
    from lm_eval_sink.calibration import EncodedPrompts
    from lm_eval_sink.harness import engine_capture as ec

    ids = tuple(encoded.input_ids[0] * (limit // len(encoded.input_ids[0]) + 2))[: limit + 20]
    long = EncodedPrompts((ids,), ((False,) * len(ids),), True, None, None)
    out = {}
    for name in ("driver", "workers"):
        try:
            if name == "workers":
                ec._check_prompts = lambda *args: None
            ec.measure_on_engine(llm, long, layers)
            out[name] = None
        except ec.EngineCaptureRefused as e:
            out[name] = e.reason
    return out


def main(job: dict) -> None:
    import engine_models
    from transformers import AutoTokenizer
    from vllm import LLM

    from lm_eval_sink.calibration import encode_prompts, load_prompts
    from lm_eval_sink.harness.engine_capture import EngineCaptureRefused, measure_on_engine
    from lm_eval_sink.harness.engine_strength import engine_record

    folder = engine_models.build(job["family"], Path(job["folder"]), job["dtype"], job.get("config"))
    encoded = encode_prompts(AutoTokenizer.from_pretrained(folder), load_prompts(None, job["n_prompts"]).prompts)
    layers = [0, 1]
    w4a16 = _w4a16(folder, Path(job["folder"] + "_w4a16")) if job.get("w4a16") else None
    hf = _hf(w4a16[1] if w4a16 else folder, encoded, layers, job["dtype"])
    start = time.perf_counter()
    extra = {"max_num_batched_tokens": job["max_num_batched_tokens"]} if job.get("max_num_batched_tokens") else {}
    lora = _lora(folder, Path(job["folder"] + "_lora")) if job.get("lora") else None
    lora_args = {"enable_lora": True, "max_lora_rank": LORA_RANK} if lora else {}
    engine_args = {"worker_extension_cls": EXTENSION, **extra, **lora_args, **job.get("engine_args", {})}
    llm = LLM(
        model=str(w4a16[0] if w4a16 else folder),
        dtype=job["dtype"],
        enforce_eager=job.get("enforce_eager", True),
        max_model_len=256,
        seed=0,
        tensor_parallel_size=job["tensor_parallel_size"],
        **engine_args,
    )
    built = time.perf_counter()
    before = _greedy(llm, encoded)
    began = time.perf_counter()
    try:
        first = measure_on_engine(llm, encoded, layers)
    except EngineCaptureRefused as e:  # the engine goes on: its generations are those of before
        Path(job["out"] + ".json").write_text(
            json.dumps({"refused": e.reason, "texts": [before, _greedy(llm, encoded)]})
        )
        return
    measured = time.perf_counter()
    wrapped = [r["wrapped"] for r in llm.collective_rpc("sink_capture_layers")]  # 0: every impl.forward restored
    between = _greedy(llm, encoded)
    second = measure_on_engine(llm, encoded, layers)
    after = _greedy(llm, encoded)
    sampled = _sampled(llm, encoded, layers)
    sides = {"hf": hf, "engine": first, "again": second}
    if w4a16 is not None:
        sides["unquantized_hf"] = _hf(folder, encoded, layers, job["dtype"])
    if lora is not None:
        from vllm.lora.request import LoRARequest

        sides["lora_hf"] = _hf(lora[1], encoded, layers, job["dtype"])
        sides["lora_engine"] = measure_on_engine(llm, encoded, layers, lora_request=LoRARequest("a", 1, str(lora[0])))
        sides["after_lora"] = measure_on_engine(llm, encoded, layers)  # the base again: the adapter left no trace
    refusals = _refusals(llm, encoded, layers, extra["max_num_batched_tokens"]) if extra else {}
    arrays = {
        f"{side}_{j}_{f}": getattr(c, f) for side, caps in sides.items() for j, c in enumerate(caps) for f in FIELDS
    }
    np.savez(job["out"] + ".npz", **arrays)
    texts = {"before": before, "between": between, "after": after}
    seconds = {"engine_start": built - start, "measure": measured - began}
    record = {"texts": texts, "refusals": refusals, "seconds": seconds, "wrapped": wrapped, "sides": list(sides)}
    record["sampled"] = sampled
    record["engine_record"] = engine_record(llm)  # what a task's capture record says about this engine
    Path(job["out"] + ".json").write_text(json.dumps({**record, "n_prompts": len(encoded)}))


if __name__ == "__main__":  # vLLM's default mode spawns its engine process, which imports this file
    main(json.loads(Path(sys.argv[1]).read_text()))
