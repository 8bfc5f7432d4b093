"""Peak memory and time of `extract` on a synthetic ~1.2 GB VLM, against baselines of the same run.

Builds (once, in --workdir) a random Qwen2-VL with a 16-layer, hidden-1024 language model (fp32,
~1.2 GB in 300 MB shards), then runs each job in a fresh Python process and reads its peak RSS
(VmHWM; ru_maxrss would carry the parent's peak across exec) above its RSS after imports:
  imports   : the imports every job makes (torch, transformers, the model classes), nothing else
  copy      : copy every shard file (the I/O floor for time)
  naive     : from_pretrained the whole VLM, save its language model's state dict
  extract   : lm_eval_sink.extract.extract_backbone(verify=False), the streaming path
  extract+v : the same with the round-trip verification (loads the VLM, then the backbone)
Prints peak RSS above the import floor as a ratio of the checkpoint size and of its largest
shard, and time as a ratio of the copy. Usage: nice -n 10 python benchmarks/bench_extract.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, shutil
from pathlib import Path
job, vlm, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
import torch, transformers, safetensors.torch
import lm_eval_sink.extract as ex
# Warm the lazy imports every job needs, so time and memory measure the work, not imports.
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from transformers import Qwen2VLForConditionalGeneration, Qwen2ForCausalLM
import transformers.core_model_loading

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

start_rss = status("VmRSS:")
t0 = time.perf_counter()
if job == "copy":
    out.mkdir()
    for f in sorted(vlm.glob("*.safetensors")):
        shutil.copyfile(f, out / f.name)
elif job == "naive":
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype="auto")
    lm = model.model.language_model
    state = {f"model.{k}": v.contiguous() for k, v in lm.state_dict().items()}
    state["lm_head.weight"] = model.lm_head.weight.contiguous()
    out.mkdir()
    safetensors.torch.save_file(state, out / "model.safetensors")
elif job in ("extract", "extract+v"):
    report = ex.extract_backbone(vlm, out, verify=job == "extract+v")
    assert report.ok, report.verification
seconds = time.perf_counter() - t0
print(json.dumps({"job": job, "seconds": seconds, "start_rss": start_rss, "peak_rss": status("VmHWM:")}))
"""


def build_vlm(folder: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig

    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=4096,
            rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]},
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            depth=2, embed_dim=256, hidden_size=1024, num_heads=4, mlp_ratio=2, patch_size=14, spatial_merge_size=2
        ),
        image_token_id=31990,
        video_token_id=31991,
        vision_start_token_id=31992,
        vision_end_token_id=31993,
    )
    model = AutoModelForImageTextToText.from_config(config)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="300MB")
    tmp.rename(folder)


def run(job: str, vlm: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, job, str(vlm), str(out)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"{job} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "lm_eval_sink_bench_extract")
    parser.add_argument("--jobs", default="imports,copy,naive,extract,extract+v")
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)  # internal: build in a child process
    args = parser.parse_args()
    if args.build:
        build_vlm(args.build)
        return
    vlm = args.workdir / "synthetic_qwen2_vl"
    if not vlm.is_dir():
        print(f"building the synthetic VLM in {vlm} ...", flush=True)
        args.workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--build", str(vlm)], check=True)
    shards = sorted(vlm.glob("*.safetensors"))
    size, largest = sum(f.stat().st_size for f in shards), max(f.stat().st_size for f in shards)
    print(f"synthetic Qwen2-VL: {size / 1e9:.2f} GB on disk in {len(shards)} shards (largest {largest / 1e9:.2f} GB)")
    results = {job: run(job, vlm, args.workdir / f"out_{job}") for job in args.jobs.split(",")}
    copy_s = results["copy"]["seconds"] if "copy" in results else None
    print(
        f"{'job':<10} {'time s':>8} {'x copy':>7} {'peak RSS GB':>12} {'above imports GB':>17} "
        f"{'/ size':>7} {'/ shard':>8}"
    )
    for job, r in results.items():
        above = r["peak_rss"] - r["start_rss"]
        ratio_t = f"{r['seconds'] / copy_s:.1f}" if copy_s else "-"
        print(
            f"{job:<10} {r['seconds']:>8.2f} {ratio_t:>7} {r['peak_rss'] / 1e9:>12.2f} "
            f"{above / 1e9:>17.2f} {above / size:>7.2f} {above / largest:>8.2f}"
        )


if __name__ == "__main__":
    main()
