"""A miniature vision-language adaptation of SmolLM2-135M-Instruct, with and without sink protection (2nd edition).

Three arms from the same start weights; for each seed the same data order, steps, learning rates,
batch and sequence length in every arm:
    vision             M visual tokens (a trained projector over synthetic image features that
                       encode colour, shape, count and size) inserted right after the chat
                       template's first token (position 0 stays the sink token), then a caption
                       of those attributes; loss on the caption tokens only
    text-only          the same captions and prompts, no visual tokens (it cannot see the image)
    vision+protection  vision with the position-0 path below the lowest protected layer frozen and
                       SinkProtection's Rule K / Rule Q (plan from the start model)
Per arm and seed: the Sink Strength trajectory (SinkStrengthCallback) and the held-out caption loss
every `--loss-every` steps; then, with the project's own commands as a user runs them: `strength`
of the end model, IFEval on all 541 local prompts (`eval`, vLLM backend in the vLLM venv, the
instruct protocol with the batch left to vLLM, float32, max_gen_toks 256), `margin` and `buckets`
against the start model, `buckets` of vision+protection against vision, and one HTML `report` per
arm. The start model's S, protection plan and IFEval are shared.

Each stage writes its result atomically and is skipped when present, so a rerun resumes where the
last one stopped (an arm's training restarts from its start if it was interrupted). Figures:
<output>/results.md, results.json, trajectories.png.

    OMP_NUM_THREADS=1 nohup python benchmarks/exp_vl_adaptation.py --output out/exp_vl2 &
    python benchmarks/exp_vl_adaptation.py --output out/exp_vl_gpu --scale 10 --device cuda \
        --lm-eval-python .venv-vllm/bin/python                         # GPU: 10x the steps
    python benchmarks/exp_vl_adaptation.py --output /tmp/pilot --train-only --runs vision,text-only --seeds 0
    python benchmarks/exp_vl_adaptation.py --output /tmp/exp_vl_smoke --smoke   # every stage and arm, tiny, HF
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
RUNS = ("vision", "text-only", "vision+protection")
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
SHAPES = ("circle", "square", "triangle", "star", "cross", "heart", "ring", "arrow")
SIZES = ("small", "large")
QUESTION = "Describe the image."
N_IFEVAL = 541  # the local IFEval file
# The instruct protocol (zero-shot, chat template) with the batch left to vLLM's scheduler: lm-eval's
# fixed batch of 8 would hand vLLM 8 prompts at a time. Written to <output>/protocols.yaml.
PROTOCOL = "instruct-vllm"
PROTOCOL_YAML = f"""schema_version: 1
protocols:
  {PROTOCOL}:
    description: The instruct protocol (zero-shot, chat template) with the batch left to vLLM's scheduler.
    apply_chat_template: true
    num_fewshot: 0
    system_instruction: null
    batch_size: auto
"""
# vLLM's CPU build: in-process engine on one OpenMP thread; a 3 GiB KV cache (70k tokens) holds every running
# IFEval sequence (1 GiB, 23k tokens, does not at 100 sequences).
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "3"}
# No torch.compile: it took 2.3 min per model folder here (vLLM's compile cache is keyed by the path) and decoded
# no faster in a 100-prompt probe (docs/training.md).
VLLM_MODEL_ARGS = "enforce_eager=True"
# Seconds measured on the 2-core shared machine (docs/training.md), for the printed estimate.
COST_TRAIN_STEP = 4.0  # batch 4, seq 64, one thread (first run: 849 s for 199 steps with 5 S and 10 held-out losses)
COST_STRENGTH = 7.0  # one Sink Strength measurement, 15 prompts
COST_HELDOUT = 4.0  # held-out caption loss, 32 captions
COST_IFEVAL_PROMPT = 0.93  # one IFEval prompt, vLLM, max_gen_toks 256 (the start model: 561 s for 541)
COST_IFEVAL_START = 60.0  # importing vLLM, starting its engine, scoring
COST_COMMAND = 40.0  # one `strength`, `margin`, `buckets` or `report` process


@dataclass(frozen=True)
class Config:
    steps: int = 400  # held-out caption loss still falling at 160-200 steps (docs/training.md)
    batch: int = 4
    seq_len: int = 64
    lr: float = 3e-4  # language model
    projector_lr: float = 1e-3  # the projector, trained from scratch (vision arms)
    warmup: int = 10
    n_visual: int = 8
    feature_dim: int = 32
    every: int = 40  # S trajectory interval
    loss_every: int = 20  # held-out caption loss interval
    tau: float = 0.05
    last_k: int = 10
    n_eval_captions: int = 32
    device: str = "cpu"
    n_prompts: int | None = None  # calibration prompts of every S measurement (None: all 15)
    ifeval_limit: int | None = None  # None: all 541 prompts
    max_gen_toks: int = 256
    backend: str = "vllm"


# --smoke: every stage and every arm at the smallest size that still runs it (HF backend, no vLLM venv needed).
SMOKE = dict(
    steps=2, batch=2, every=1, loss_every=1, warmup=0, n_eval_captions=4, n_prompts=5, ifeval_limit=2, max_gen_toks=8
)
SMOKE_BACKEND = "hf"


def strength_settings(cfg: Config):
    from lm_eval_sink.strength import StrengthSettings

    return StrengthSettings(last_k=cfg.last_k, n_prompts=cfg.n_prompts)


def caption_of(attrs: tuple[int, int, int, int]) -> str:
    colour, shape, count, size = attrs
    noun = SHAPES[shape] + ("s" if count > 1 else "")
    return f"There {'is' if count == 1 else 'are'} {count} {SIZES[size]} {COLOURS[colour]} {noun}."


class Synthetic:
    """Synthetic images: M patch features = attribute codes + noise; captions name the attributes.

    The codes depend on `code_seed` only, so training and held-out images of a seed share them
    (the first edition drew them per set, so no held-out image could be read).
    """

    def __init__(self, cfg: Config, code_seed: int, sample_seed: int) -> None:
        codes = np.random.default_rng(code_seed)
        self.cfg = cfg
        self.codes = [codes.normal(size=(n, cfg.feature_dim)) for n in (len(COLOURS), len(SHAPES), 5, len(SIZES))]
        self.gen = np.random.default_rng(sample_seed)

    def sample(self) -> tuple[tuple[int, int, int, int], np.ndarray]:
        g = self.gen
        attrs = (
            int(g.integers(len(COLOURS))),
            int(g.integers(len(SHAPES))),
            int(g.integers(1, 6)),
            int(g.integers(len(SIZES))),
        )
        base = self.codes[0][attrs[0]] + self.codes[1][attrs[1]] + self.codes[2][attrs[2] - 1] + self.codes[3][attrs[3]]
        feats = base[None, :] + 0.3 * g.normal(size=(self.cfg.n_visual, self.cfg.feature_dim))
        return attrs, feats.astype(np.float32)


def encode_example(tokenizer, caption: str, seq_len: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels): chat template with the question, the caption as the assistant turn."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(caption + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    ids = (p_ids + c_ids)[:seq_len]
    labels = ([-100] * len(p_ids) + c_ids)[:seq_len]
    return ids, labels


class CaptionData(torch.utils.data.Dataset):
    def __init__(self, tokenizer, cfg: Config, n: int, seed: int, stream: int, vision: bool) -> None:
        syn = Synthetic(cfg, seed, 1000 * stream + seed)
        self.items = []
        width = cfg.seq_len - (cfg.n_visual if vision else 0)
        for _ in range(n):
            attrs, feats = syn.sample()
            ids, labels = encode_example(tokenizer, caption_of(attrs), width)
            pad = width - len(ids)
            self.items.append(
                {
                    "input_ids": ids + [tokenizer.pad_token_id or 0] * pad,
                    "labels": labels + [-100] * pad,
                    "attention_mask": [1] * len(ids) + [0] * pad,
                    "image": feats,
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def collate(items: list[dict]) -> dict:
    return {k: torch.tensor(np.stack([np.asarray(x[k]) for x in items])) for k in items[0]}


def vl_embeds(lm, projector, batch: dict, vision: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inputs_embeds, attention_mask, labels with the visual tokens after position 0 (vision runs)."""
    emb = lm.get_input_embeddings()(batch["input_ids"])
    mask, labels = batch["attention_mask"], batch["labels"]
    if not vision:
        return emb, mask, labels
    vis = projector(batch["image"].to(emb.dtype))
    b, m = vis.shape[:2]
    emb = torch.cat([emb[:, :1], vis, emb[:, 1:]], dim=1)
    mask = torch.cat([mask[:, :1], torch.ones((b, m), dtype=mask.dtype, device=mask.device), mask[:, 1:]], dim=1)
    labels = torch.cat(
        [labels[:, :1], torch.full((b, m), -100, dtype=labels.dtype, device=labels.device), labels[:, 1:]], dim=1
    )
    return emb, mask, labels


def caption_loss(lm, projector, data: CaptionData, vision: bool, batch: int) -> float:
    """Mean token loss on held-out captions (the model's train mode is restored)."""
    was_training = lm.training
    lm.eval()
    total, count = 0.0, 0
    device = next(lm.parameters()).device
    with torch.no_grad():
        for i in range(0, len(data), batch):
            b = {k: v.to(device) for k, v in collate([data[j] for j in range(i, min(i + batch, len(data)))]).items()}
            emb, mask, labels = vl_embeds(lm, projector, b, vision)
            logits = lm(inputs_embeds=emb, attention_mask=mask).logits[:, :-1].float()
            tgt = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100, reduction="sum"
            )
            total += float(loss)
            count += int((tgt != -100).sum())
    lm.train(was_training)
    return total / count


def held_out_callback(projector, held_out: CaptionData, vision: bool, cfg: Config, points: list):
    """A TrainerCallback appending (step, held-out caption loss) every cfg.loss_every steps and at the end."""
    from transformers import TrainerCallback

    class HeldOutLoss(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % cfg.loss_every == 0 or state.global_step == state.max_steps:
                points.append((state.global_step, caption_loss(model, projector, held_out, vision, cfg.batch)))
                print(f"  step {points[-1][0]}: held-out caption loss {points[-1][1]:.3f}", flush=True)

    return HeldOutLoss()


def train_run(name: str, start_dir: Path, plan_path: Path, out: Path, cfg: Config, seed: int) -> dict:
    """Train one arm; save the language model to out/model; returns the training record."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from lm_eval_sink.io import atomic_write_json, read_json
    from lm_eval_sink.outputs import staged_dir
    from lm_eval_sink.training import SinkProtection, SinkStrengthCallback

    record_path = out / "train.json"
    if record_path.is_file() and (out / "model" / "config.json").is_file():
        return read_json(record_path)
    vision = name != "text-only"
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(start_dir)
    lm = AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32).to(cfg.device)
    hidden = lm.config.hidden_size
    projector = torch.nn.Sequential(
        torch.nn.Linear(cfg.feature_dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden)
    ).to(cfg.device)
    protection = None
    if name == "vision+protection":
        protection = SinkProtection.from_plan(plan_path, freeze=True, project=True)
        protection.freeze(lm)
    train = CaptionData(tok, cfg, cfg.steps * cfg.batch, seed, 1, vision)
    held_out = CaptionData(tok, cfg, cfg.n_eval_captions, seed, 2, vision)
    held = [(0, caption_loss(lm, projector, held_out, vision, cfg.batch))]
    groups = [{"params": [p for p in lm.parameters() if p.requires_grad], "lr": cfg.lr}]
    if vision:
        groups.append({"params": list(projector.parameters()), "lr": cfg.projector_lr})
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)

    class VLTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            emb, mask, labels = vl_embeds(model, projector, inputs, vision)
            out = model(inputs_embeds=emb, attention_mask=mask, labels=labels)
            return (out.loss, out) if return_outputs else out.loss

    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.batch,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=cfg.warmup,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=seed,
        data_seed=seed,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=cfg.device == "cpu",
        disable_tqdm=True,
        max_grad_norm=1.0,
    )
    callbacks = [held_out_callback(projector, held_out, vision, cfg, held)] + ([protection] if protection else [])
    trainer = VLTrainer(
        model=lm,
        args=args,
        train_dataset=train,
        data_collator=collate,
        optimizers=(optimizer, None),
        callbacks=callbacks,
    )
    cb = SinkStrengthCallback(tok, strength_settings(cfg), every_n_steps=cfg.every, output_dir=out).attach(trainer)
    t = time.time()
    trainer.train()
    seconds = time.time() - t
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    report = protection.report(lm, torch.tensor([prompt])) if protection else None
    frozen = sum(p.numel() for p in lm.parameters() if not p.requires_grad)
    with staged_dir(out / "model", force=(out / "model").exists()) as tmp:
        for p in lm.parameters():
            p.requires_grad_(True)
        lm.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    record = {
        "run": name,
        "seed": seed,
        "train_seconds": round(seconds, 1),
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last10": float(np.mean(losses[-10:])) if losses else None,
        "heldout_caption_loss_start": held[0][1],
        "heldout_caption_loss_end": held[-1][1],
        "heldout_trajectory": held,
        "frozen_parameters": frozen,
        "trajectory": [(r["step"], r["sink_strength"]) for r in cb.records],
        "protection_report": None if report is None else {str(k): v for k, v in report.items()},
    }
    atomic_write_json(record_path, record)
    return record


def command(args: list, dest: Path, env: dict[str, str] | None = None, output_flag: str = "--output") -> Path:
    """Run `lm-eval-sink ARGS --output <dest>.run --force` and rename to dest on success; skipped when dest exists.

    The command runs through the CLI's entry point in this process (one interpreter start for every command; its
    printed lines are kept back, its error line is shown on failure); `env` is set while it runs (the lm_eval child
    of `eval` inherits it). The rename makes every command's result a stage: present only when the command finished.
    """
    from lm_eval_sink.cli import main as cli_main

    if dest.exists():
        return dest
    tmp = dest.with_name(dest.name + ".run")
    if tmp.is_dir():  # what an interrupted attempt left
        shutil.rmtree(tmp)
    argv = [*map(str, args), output_flag, str(tmp), "--force"]
    print("$ lm-eval-sink " + " ".join(argv), flush=True)
    t, saved, err = time.time(), dict(os.environ), io.StringIO()
    try:
        os.environ.update(env or {})
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = cli_main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if rc != 0:
        raise SystemExit(f"error: lm-eval-sink {args[0]} failed (exit {rc}):\n{err.getvalue()[-3000:]}")
    tmp.rename(dest)
    print(f"  ({time.time() - t:.0f} s)", flush=True)
    return dest


def ifeval(model_dir: Path, dest: Path, cfg: Config, protocol_file: Path, python: str) -> Path:
    """IFEval through `lm-eval-sink eval` (vLLM in its venv, or HF for --smoke)."""
    args = [
        "eval",
        model_dir,
        "--tasks",
        "ifeval",
        "--dtype",
        "float32",
        "--gen-kwargs",
        f"max_gen_toks={cfg.max_gen_toks}",
    ]
    if cfg.ifeval_limit:
        args += ["--limit", cfg.ifeval_limit]
    if cfg.backend == "vllm":
        args += ["--protocol", PROTOCOL, "--protocol-file", protocol_file, "--backend", "vllm"]
        args += ["--lm-eval-python", python, "--model-args", VLLM_MODEL_ARGS]
        return command(args, dest, VLLM_ENV)
    return command([*args, "--protocol", "instruct", "--device", cfg.device], dest)


def ifeval_scores(folder: Path) -> dict:
    """Prompt / instruction level, strict / loose accuracy from an `eval` folder's results JSON."""
    res = json.loads(next(folder.rglob("results_*.json")).read_text(encoding="utf-8"))["results"]["ifeval"]
    return {
        k: res[f"{k},none"]
        for level in ("prompt", "inst")
        for k in (f"{level}_level_strict_acc", f"{level}_level_loose_acc")
    }


def strength_of(folder: Path) -> dict:
    return json.loads(next(folder.glob("*.strength.json")).read_text(encoding="utf-8"))


def buckets_summary(folder: Path) -> dict:
    b = json.loads((folder / "buckets.json").read_text(encoding="utf-8"))
    if "tasks" in b:  # several tasks: the IFEval one
        b = next(t for t in b["tasks"] if t.get("task") == "ifeval")
    keys = (
        "n",
        "counts",
        "reference_score",
        "candidate_score",
        "delta",
        "delta_ci",
        "delta_ci_method",
        "mcnemar_p",
        "truncation",
    )
    return {k: b.get(k) for k in keys}


def arm_stages(name: str, seed: int, ctx: dict, cfg: Config) -> dict:
    """Every stage of one arm and seed; returns its row of the results."""
    folder = ctx["out"] / f"seed{seed}" / name.replace("+", "_")
    folder.mkdir(parents=True, exist_ok=True)
    start, model = ctx["start"], folder / "model"
    tr = train_run(name, ctx["start_dir"], ctx["plan"], folder, cfg, seed)
    sl = ["--last-k", cfg.last_k, "--dtype", "float32", "--device", cfg.device, "--quiet"]
    sl += ["--n-prompts", cfg.n_prompts] if cfg.n_prompts else []
    command(["strength", model, *sl], folder / "strength")
    ifeval(model, folder / "ifeval", cfg, ctx["protocol_file"], ctx["python"])
    command(["margin", ctx["start_dir"], model, *sl], folder / "margin")
    bk = ["--same-protocol", "--tokenizer", ctx["start_dir"], "--max-gen-toks", cfg.max_gen_toks, "--quiet"]
    command(["buckets", start / "ifeval", folder / "ifeval", *bk], folder / "buckets_vs_start")
    report = [
        "report",
        "--strength",
        next((start / "strength").glob("*.strength.json")),
        next((folder / "strength").glob("*.strength.json")),
        "--margin",
        folder / "margin",
        "--buckets",
        folder / "buckets_vs_start",
        "--title",
        f"{name}, seed {seed}, vs the start model",
    ]
    command(report, folder / "report.html", output_flag="-o")
    margin = json.loads((folder / "margin" / "margin.json").read_text(encoding="utf-8"))
    return {
        "train": tr,
        "s_end": strength_of(folder / "strength")["sink_strength"],
        "ifeval": ifeval_scores(folder / "ifeval"),
        "buckets_vs_start": buckets_summary(folder / "buckets_vs_start"),
        "margin": margin["summary"],
        "report": str(folder / "report.html"),
    }


def estimate_seconds(cfg: Config, n_arms: int, n_seeds: int, train_only: bool) -> float:
    """Wall time on this machine's measured costs (module constants)."""
    per_arm = (
        cfg.steps * COST_TRAIN_STEP
        + (cfg.steps // cfg.every + 2) * COST_STRENGTH
        + (cfg.steps // cfg.loss_every + 2) * COST_HELDOUT
    )
    if train_only:
        return n_arms * n_seeds * per_arm
    n_ifeval = cfg.ifeval_limit or N_IFEVAL
    one_eval = n_ifeval * COST_IFEVAL_PROMPT + COST_IFEVAL_START
    per_arm += one_eval + 4 * COST_COMMAND
    return n_arms * n_seeds * per_arm + one_eval + COST_COMMAND * (1 + n_seeds)


def start_stages(ctx: dict, cfg: Config, eval_too: bool) -> None:
    """The start model's S (`strength`), protection plan and IFEval, shared by every arm and seed."""
    from lm_eval_sink.io import atomic_write_json, read_json
    from lm_eval_sink.provenance import provenance
    from lm_eval_sink.models import load_model
    from lm_eval_sink.training.protection import ProtectSettings, select_sink_heads

    start, start_dir = ctx["start"], ctx["start_dir"]
    sl = ["--last-k", cfg.last_k, "--dtype", "float32", "--device", cfg.device, "--quiet"]
    command(
        ["strength", start_dir, *sl, *(["--n-prompts", cfg.n_prompts] if cfg.n_prompts else [])], start / "strength"
    )
    if not ctx["plan"].is_file():
        loaded = load_model(str(start_dir), dtype="float32")
        protect = ProtectSettings(tau=cfg.tau)
        plan = select_sink_heads(loaded.model, loaded.tokenizer, strength_settings(cfg), protect, progress=False)
        atomic_write_json(
            ctx["plan"], {**plan.to_json(), "provenance": {**plan.provenance, **provenance(model=loaded.info)}}
        )
        del loaded
    plan = read_json(ctx["plan"])
    print(
        f"start: S = {strength_of(start / 'strength')['sink_strength']:.4f}; plan protects "
        f"{sum(h['selected'] for h in plan['heads'])} of {len(plan['heads'])} heads in layers "
        f"{[lp['layer'] for lp in plan['layers']]}, rank of U "
        f"{sorted({lp['max_u_rank'] for lp in plan['layers']})} of {plan['head_dim']} (tau {cfg.tau})",
        flush=True,
    )
    if eval_too:
        ifeval(start_dir, start / "ifeval", cfg, ctx["protocol_file"], ctx["python"])
        print(f"start: IFEval {ifeval_scores(start / 'ifeval')}", flush=True)


def fmt_p(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.3g}"


def tables(start: dict, rows: dict, pairs: dict) -> str:
    """results.md: IFEval, buckets, S, margin and caption-loss tables."""
    from lm_eval_sink.tables import markdown_table

    def ife(r: dict) -> list[str]:
        return [
            f"{r[k]:.4f}"
            for k in (
                "prompt_level_strict_acc",
                "prompt_level_loose_acc",
                "inst_level_strict_acc",
                "inst_level_loose_acc",
            )
        ]

    ife_rows = [["start", "-", *ife(start["ifeval"])]] + [[n, str(s), *ife(r["ifeval"])] for (n, s), r in rows.items()]
    out = ["## IFEval (541 prompts)" if not start.get("limit") else f"## IFEval (first {start['limit']} prompts)"]
    out.append(
        markdown_table(["model", "seed", "prompt strict", "prompt loose", "inst strict", "inst loose"], ife_rows)
    )

    def bk(label: str, b: dict) -> list[str]:
        c, ci = b["counts"] or {}, b["delta_ci"]
        trunc = (b.get("truncation") or {}).get("regressions_truncated", "n/a")
        return [
            label,
            str(b["n"]),
            str(c.get("regression")),
            str(c.get("recovered")),
            f"{b['delta']:+.4f}",
            f"[{ci[0]:+.4f}, {ci[1]:+.4f}]",
            fmt_p(b["mcnemar_p"]),
            str(trunc),
        ]

    compared = [(f"{n} (seed {s}) vs start", r["buckets_vs_start"]) for (n, s), r in rows.items()]
    compared += [(f"vision+protection vs vision (seed {s})", b) for s, b in pairs.items()]
    bk_rows = [bk(label, b) for label, b in compared]
    out.append("## Paired prompt-level strict IFEval (`lm-eval-sink buckets`)")
    out.append(
        markdown_table(
            [
                "comparison",
                "n",
                "regressed",
                "improved",
                "delta",
                "95% CI",
                "McNemar p",
                "regressions truncated",
            ],
            bk_rows,
        )
    )
    out.append("Intervals: " + "; ".join(sorted({b["delta_ci_method"] for _, b in compared})))
    s0 = start["sink_strength"]
    other = []
    for (n, s), r in rows.items():
        tr, mg = r["train"], r["margin"]
        other.append(
            [
                n,
                str(s),
                f"{s0:.4f}",
                f"{r['s_end']:.4f}",
                f"{mg['margin_median']:.3f}",
                f"{mg['margin_min']:.3f}",
                f"{mg['n_negative_margin']}/{mg['n_heads_total']}",
                f"{tr['heldout_caption_loss_start']:.3f}",
                f"{tr['heldout_caption_loss_end']:.3f}",
                f"{tr['train_seconds']:.0f}",
            ]
        )
    out.append("## S, margin (`lm-eval-sink margin` vs the start model), held-out caption loss")
    out.append(
        markdown_table(
            [
                "arm",
                "seed",
                "S start",
                "S end",
                "margin median",
                "margin min",
                "negative-margin heads",
                "caption loss start",
                "caption loss end",
                "train s",
            ],
            other,
        )
    )
    traj = [
        [
            n,
            str(s),
            " / ".join(f"{st}: {v:.3f}" for st, v in r["train"]["trajectory"]),
            " / ".join(f"{st}: {v:.3f}" for st, v in r["train"]["heldout_trajectory"]),
        ]
        for (n, s), r in rows.items()
    ]
    out.append("## Trajectories (step: value)")
    out.append(markdown_table(["arm", "seed", "S", "held-out caption loss"], traj))
    return "\n\n".join(out) + "\n"


CAPTION = re.compile(r"There (is|are) \d+ (small|large) \w+ \w+\.?")


def responses(folder: Path, tokenizer, limit: int) -> dict:
    """What an `eval` folder's IFEval responses are: how many reached the generation limit (less 2), how many are
    one of the training captions ("There are 3 large red circles.") and nothing else, and how many differ."""
    rows = [json.loads(x) for f in folder.rglob("samples_ifeval_*.jsonl") for x in f.read_text().splitlines() if x]
    texts = [r["resps"][0][0] for r in rows]
    return {
        "truncated": sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) >= limit - 2 for t in texts),
        "caption_only": sum(CAPTION.fullmatch(t.strip()) is not None for t in texts),
        "distinct": len(set(texts)),
        "n": len(texts),
    }


def plot(rows: dict, path: Path, title: str) -> None:
    """S and held-out caption loss against optimizer step, one line per arm and seed."""
    from lm_eval_sink.plots import _pyplot, save_figure

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for (name, seed), r in rows.items():
        for ax, key in zip(axes, ("trajectory", "heldout_trajectory"), strict=True):
            pts = r["train"][key]
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], "o-" if seed == 0 else "s--", ms=3, label=f"{name} s{seed}"
            )
    for ax, label in zip(axes, ("Sink Strength S", "held-out caption loss (nats/token)"), strict=True):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def parse() -> tuple[argparse.Namespace, Config]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default="out/exp_vl2")
    for f in ("steps", "batch", "every", "loss_every", "warmup", "max_gen_toks"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(Config, f))
    for f in ("lr", "projector_lr", "tau"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=float, default=getattr(Config, f))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--scale", type=int, default=1, help="multiply steps and both intervals (e.g. 10 on a GPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="default", help="start model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--lm-eval-python", default=str(REPO / ".venv-vllm" / "bin" / "python"), help="the vLLM venv")
    ap.add_argument("--train-only", action="store_true", help="train and log the held-out loss only (the pilot)")
    ap.add_argument("--smoke", action="store_true", help=f"every stage at a tiny size, HF backend: {SMOKE}")
    a = ap.parse_args()
    fields = {f: getattr(a, f) for f in ("batch", "lr", "projector_lr", "warmup", "tau", "device", "max_gen_toks")}
    fields |= {f: getattr(a, f) * a.scale for f in ("steps", "every", "loss_every")}
    cfg = Config(**{**fields, **(dict(SMOKE, backend=SMOKE_BACKEND) if a.smoke else {})})
    bad = [r for r in a.runs.split(",") if r not in RUNS]
    if bad:
        raise SystemExit(f"error: unknown run(s) {bad} (fix: choose from {', '.join(RUNS)})")
    if cfg.backend == "vllm" and not a.train_only and not Path(a.lm_eval_python).is_file():
        raise SystemExit(f"error: {a.lm_eval_python} is absent (fix: `make venv-vllm`, or pass --lm-eval-python)")
    return a, cfg


def main() -> None:
    a, cfg = parse()
    runs = [r for r in a.runs.split(",") if r]
    seeds = [int(s) for s in a.seeds.split(",") if s]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from transformers import AutoTokenizer

    from lm_eval_sink.io import atomic_write_json, atomic_write_text, read_json
    from lm_eval_sink.models import model_fingerprint, resolve_model

    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    start_dir = Path(resolve_model(a.model))
    recorded = {"config": asdict(cfg), "start_model": model_fingerprint(str(start_dir))}
    cfg_path = out / "config.json"
    if cfg_path.is_file() and {k: read_json(cfg_path)[k] for k in recorded} != recorded:
        raise SystemExit(
            f"error: {out} holds a run with other settings or another start model "
            "(fix: use another --output, or the same options)"
        )
    atomic_write_json(cfg_path, {**recorded, "runs": runs, "seeds": seeds})
    protocol_file = out / "protocols.yaml"
    atomic_write_text(protocol_file, PROTOCOL_YAML)
    est = estimate_seconds(cfg, len(runs), len(seeds), a.train_only)
    n_ifeval = cfg.ifeval_limit or N_IFEVAL
    print(
        f"estimate on this machine's measured costs: ~{est / 60:.0f} min ({len(runs)} arms x {len(seeds)} seeds x "
        f"{cfg.steps} steps, batch {cfg.batch}, seq {cfg.seq_len}, lr {cfg.lr} (projector {cfg.projector_lr}); "
        + (
            "training only"
            if a.train_only
            else f"{len(runs) * len(seeds) + 1} IFEval runs of {n_ifeval} prompts, "
            f"{cfg.backend}, max_gen_toks {cfg.max_gen_toks}"
        )
        + f"; finished stages in {out} are reused)",
        flush=True,
    )
    t0 = time.time()
    ctx = {
        "out": out,
        "start": out / "start",
        "start_dir": start_dir,
        "plan": out / "start" / "plan.json",
        "protocol_file": protocol_file,
        "python": a.lm_eval_python,
    }
    ctx["start"].mkdir(exist_ok=True)
    start_stages(ctx, cfg, eval_too=not a.train_only)
    rows, pairs = {}, {}
    for seed in seeds:
        for name in runs:
            if a.train_only:
                folder = out / f"seed{seed}" / name.replace("+", "_")
                folder.mkdir(parents=True, exist_ok=True)
                rows[name, seed] = {"train": train_run(name, start_dir, ctx["plan"], folder, cfg, seed)}
            else:
                rows[name, seed] = arm_stages(name, seed, ctx, cfg)
            tr = rows[name, seed]["train"]
            print(
                f"{name} seed {seed}: held-out caption loss "
                f"{' / '.join(f'{s}: {v:.3f}' for s, v in tr['heldout_trajectory'])}"
                f"; S {tr['trajectory'][0][1]:.3f} -> {tr['trajectory'][-1][1]:.3f}; train {tr['train_seconds']:.0f} s "
                f"({time.time() - t0:.0f} s so far)",
                flush=True,
            )
        if not a.train_only and {"vision", "vision+protection"} <= set(runs):
            seed_dir = out / f"seed{seed}"
            bk = ["--same-protocol", "--tokenizer", start_dir, "--max-gen-toks", cfg.max_gen_toks, "--quiet"]
            dest = seed_dir / "buckets_protection_vs_vision"
            command(["buckets", seed_dir / "vision" / "ifeval", seed_dir / "vision_protection" / "ifeval", *bk], dest)
            pairs[seed] = buckets_summary(dest)
    title = (
        f"{'SmolLM2-135M-Instruct' if a.model == 'default' else start_dir.name}, {cfg.steps} steps, batch "
        f"{cfg.batch}, lr {cfg.lr} (projector {cfg.projector_lr}), seeds {seeds}"
    )
    plot(rows, out / "trajectories.png", title)
    if a.train_only:
        print(f"-> {out / 'trajectories.png'} ({time.time() - t0:.0f} s this invocation)")
        return
    from lm_eval_sink.tables import markdown_table

    tok = AutoTokenizer.from_pretrained(start_dir)
    start = {
        "sink_strength": strength_of(ctx["start"] / "strength")["sink_strength"],
        "limit": cfg.ifeval_limit,
        "ifeval": ifeval_scores(ctx["start"] / "ifeval"),
    }
    facts = {"start": responses(ctx["start"] / "ifeval", tok, cfg.max_gen_toks)}
    for (name, seed), r in rows.items():
        facts[f"{name} seed {seed}"] = r["responses"] = responses(
            out / f"seed{seed}" / name.replace("+", "_") / "ifeval", tok, cfg.max_gen_toks
        )
    md = (
        tables(start, rows, pairs)
        + "\n\n## IFEval responses\n"
        + markdown_table(
            ["model", "responses", f"reached max_gen_toks {cfg.max_gen_toks}", "a training caption only", "distinct"],
            [
                [k, str(v["n"]), str(v["truncated"]), str(v["caption_only"]), str(v["distinct"])]
                for k, v in facts.items()
            ],
        )
        + "\n"
    )
    atomic_write_text(out / "results.md", md)
    atomic_write_json(
        out / "results.json",
        {
            "config": asdict(cfg),
            "seeds": seeds,
            "start": {**start, "responses": facts["start"]},
            "runs": {f"{n}|seed{s}": r for (n, s), r in rows.items()},
            "protection_vs_vision": {str(s): b for s, b in pairs.items()},
            "wall_seconds_this_invocation": round(time.time() - t0, 1),
        },
    )
    print(md)
    print(f"-> {out / 'results.md'}, {out / 'trajectories.png'} ({time.time() - t0:.0f} s this invocation)")


if __name__ == "__main__":
    main()
