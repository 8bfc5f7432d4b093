"""A miniature vision-language adaptation of SmolLM2-135M-Instruct, with and without sink protection.

Four runs from the same start weights, with the same seed, steps, learning rate, batch and
sequence length:
    vision             M visual tokens (a trained projector over synthetic image features that
                       encode colour, shape, count and size) inserted right after the chat
                       template's first token (position 0 stays the sink token), then a caption
                       of those attributes; loss on the caption tokens only
    text-only          the same captions and prompts, no visual tokens
    vision+freeze      vision with the position-0 path below the lowest protected layer frozen
    vision+protection  vision+freeze plus SinkProtection's Rule K / Rule Q (plan from the start model)
For each: the Sink Strength trajectory (SinkStrengthCallback), S and prompt-level strict IFEval
at start and end (40 fixed IFEval keys, instruct protocol, max_gen_toks 128, batch 8, local data
from LM_EVAL_SINK_DATA), the caption loss (last training steps and a held-out set), and the sink
margin of the end model against the start model. The start measurements are shared.

Each stage writes its result atomically and is skipped when present, so a rerun resumes where
the last one stopped (a run's training restarts from its start if it was interrupted). Figures:
<output>/results.md, results.json, trajectories.png.

    OMP_NUM_THREADS=1 nohup python benchmarks/exp_vl_adaptation.py --output out/exp_vl &
    python benchmarks/exp_vl_adaptation.py --output out/exp_vl_gpu --scale 20 --device cuda
    python benchmarks/exp_vl_adaptation.py --output /tmp/exp_vl_smoke --smoke   # every stage and arm, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

# The 40 IFEval keys evaluated (the first 40 of the 541-prompt file, fixed here).
IFEVAL_KEYS = (
    1000,
    1001,
    1005,
    1012,
    1019,
    102,
    1021,
    1040,
    1051,
    1069,
    1072,
    1075,
    1082,
    1087,
    1092,
    1094,
    1098,
    1107,
    1108,
    1122,
    1127,
    1128,
    1129,
    1130,
    1131,
    1132,
    1137,
    1139,
    1147,
    1148,
    1153,
    1154,
    1162,
    1174,
    1180,
    1187,
    1203,
    1216,
    1217,
    1219,
)
RUNS = ("vision", "text-only", "vision+freeze", "vision+protection")
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")
SHAPES = ("circle", "square", "triangle", "star", "cross", "heart", "ring", "arrow")
SIZES = ("small", "large")
QUESTION = "Describe the image."
# Seconds measured on the 2-core shared machine (see docs/training.md), for the printed estimate.
COST_TRAIN_STEP = 5.0  # batch 4, sequence 64, one thread (measured 4.2-5.4 s)
COST_STRENGTH = 7.0  # one Sink Strength measurement, 15 prompts
COST_IFEVAL_PROMPT = (
    2.0  # one IFEval prompt at max_gen_toks 128, batch 8, lm-eval start-up included (40 prompts: 30-96 s)
)


@dataclass(frozen=True)
class Config:
    steps: int = 24
    batch: int = 4
    seq_len: int = 64
    lr: float = 3e-4
    n_visual: int = 8
    feature_dim: int = 32
    every: int = 6
    seed: int = 0
    tau: float = 0.05
    last_k: int = 10
    n_eval_captions: int = 32
    device: str = "cpu"
    n_prompts: int | None = None  # calibration prompts of every S measurement (None: all 15)
    n_ifeval: int = len(IFEVAL_KEYS)
    max_gen_toks: int = 128


# --smoke: every stage and every arm at the smallest size that still runs it (one step, a few prompts).
SMOKE = dict(steps=1, batch=2, every=1, n_eval_captions=4, n_prompts=5, n_ifeval=2, max_gen_toks=8)


def strength_settings(cfg: Config):
    from lm_eval_sink.strength import StrengthSettings

    return StrengthSettings(last_k=cfg.last_k, n_prompts=cfg.n_prompts)


def caption_of(attrs: tuple[int, int, int, int]) -> str:
    colour, shape, count, size = attrs
    noun = SHAPES[shape] + ("s" if count > 1 else "")
    return f"There {'is' if count == 1 else 'are'} {count} {SIZES[size]} {COLOURS[colour]} {noun}."


class Synthetic:
    """Synthetic images: M patch features = fixed attribute codes + noise; captions name the attributes."""

    def __init__(self, cfg: Config, seed: int) -> None:
        gen = np.random.default_rng(seed)
        self.cfg = cfg
        self.codes = [gen.normal(size=(n, cfg.feature_dim)) for n in (len(COLOURS), len(SHAPES), 5, len(SIZES))]
        self.gen = gen

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
    def __init__(self, tokenizer, cfg: Config, n: int, seed: int, vision: bool) -> None:
        syn = Synthetic(cfg, seed)
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
        self.vision = vision

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
    """Mean token loss on held-out captions."""
    lm.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(data), batch):
            b = {
                k: v.to(next(lm.parameters()).device)
                for k, v in collate([data[j] for j in range(i, min(i + batch, len(data)))]).items()
            }
            emb, mask, labels = vl_embeds(lm, projector, b, vision)
            logits = lm(inputs_embeds=emb, attention_mask=mask).logits[:, :-1].float()
            tgt = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100, reduction="sum"
            )
            total += float(loss)
            count += int((tgt != -100).sum())
    return total / count


def ifeval_subset(out: Path, keys: tuple[int, ...]) -> Path:
    """A data folder holding only the chosen IFEval prompts (from LM_EVAL_SINK_DATA)."""
    src_root = os.environ.get("LM_EVAL_SINK_DATA")
    if not src_root:
        raise SystemExit(
            "error: LM_EVAL_SINK_DATA is not set (fix: point it at the offline data folder, e.g. "
            "LM_EVAL_SINK_DATA=/work/shared/data)"
        )
    from lm_eval_sink.io import atomic_write_text

    rows = {
        json.loads(line)["key"]: line
        for line in Path(src_root, "ifeval", "input_data.jsonl").read_text(encoding="utf-8").splitlines()
        if line.strip()
    }
    missing = [k for k in keys if k not in rows]
    if missing:
        raise SystemExit(
            f"error: IFEval keys {missing[:5]} are not in {src_root}/ifeval/input_data.jsonl (fix: use "
            "the full 541-prompt file)"
        )
    folder = out / f"ifeval{len(keys)}"
    atomic_write_text(folder / "ifeval" / "input_data.jsonl", "".join(rows[k] + "\n" for k in keys))
    return folder


def ifeval_score(model_dir: Path, out: Path, data: Path, cfg: Config) -> dict:
    """Prompt-level strict IFEval on the chosen keys (instruct protocol); cached in out/ifeval.json."""
    from lm_eval_sink.harness.runner import EvalSettings, run_lm_eval
    from lm_eval_sink.io import atomic_write_json, read_json
    from lm_eval_sink.protocols import get_protocol, settings_fields

    done = out / "ifeval.json"
    if done.is_file():
        return read_json(done)
    fields = settings_fields(
        get_protocol("instruct"),
        tasks=["ifeval"],
        gen_kwargs={"max_gen_toks": cfg.max_gen_toks},
        dtype="float32",
        device=cfg.device,
    )
    t = time.time()
    run = run_lm_eval(model_dir, EvalSettings(**fields), out / "lm_eval", env={"LM_EVAL_SINK_DATA": str(data)})
    res = json.loads(Path(run.results).read_text(encoding="utf-8"))["results"]["ifeval"]
    record = {
        "prompt_level_strict_acc": res["prompt_level_strict_acc,none"],
        "inst_level_strict_acc": res["inst_level_strict_acc,none"],
        "n_prompts": cfg.n_ifeval,
        "results": str(run.results),
        "seconds": round(time.time() - t, 1),
    }
    atomic_write_json(done, record)
    return record


def strength_json(model_dir: Path, path: Path, cfg: Config) -> dict:
    from lm_eval_sink.io import atomic_write_json, read_json
    from lm_eval_sink.strength import measure_model

    if path.is_file():
        return read_json(path)
    res = measure_model(str(model_dir), strength_settings(cfg), dtype="float32", device=cfg.device, progress=False)
    atomic_write_json(path, res.to_json())
    return res.to_json()


def train_run(name: str, start_dir: Path, plan_path: Path, out: Path, cfg: Config) -> dict:
    """Train one run; save the language model to out/model; returns the training record."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from lm_eval_sink.io import atomic_write_json, read_json, staged_dir
    from lm_eval_sink.training import SinkProtection, SinkStrengthCallback

    record_path = out / "train.json"
    if record_path.is_file() and (out / "model" / "config.json").is_file():
        return read_json(record_path)
    vision = name != "text-only"
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(start_dir)
    lm = AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32).to(cfg.device)
    hidden = lm.config.hidden_size
    projector = torch.nn.Sequential(
        torch.nn.Linear(cfg.feature_dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden)
    ).to(cfg.device)
    callbacks = []
    protection = None
    if name in ("vision+freeze", "vision+protection"):
        protection = SinkProtection.from_plan(plan_path, freeze=True, project=name == "vision+protection")
        protection.freeze(lm)
        callbacks.append(protection)
    train = CaptionData(tok, cfg, cfg.steps * cfg.batch, cfg.seed + 1, vision)
    held_out = CaptionData(tok, cfg, cfg.n_eval_captions, cfg.seed + 2, vision)
    loss_start = caption_loss(lm, projector if vision else None, held_out, vision, cfg.batch)
    params = [p for p in lm.parameters() if p.requires_grad] + (list(projector.parameters()) if vision else [])
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)

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
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=cfg.seed,
        data_seed=cfg.seed,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=cfg.device == "cpu",
        disable_tqdm=False,
        max_grad_norm=1.0,
    )
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
    loss_end = caption_loss(lm, projector if vision else None, held_out, vision, cfg.batch)
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
        "train_seconds": round(seconds, 1),
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last5": float(np.mean(losses[-5:])) if losses else None,
        "heldout_caption_loss_start": loss_start,
        "heldout_caption_loss_end": loss_end,
        "frozen_parameters": frozen,
        "trajectory": [(r["step"], r["sink_strength"]) for r in cb.records],
        "protection_report": None if report is None else {str(k): v for k, v in report.items()},
    }
    atomic_write_json(record_path, record)
    return record


def margin_of(start_dir: Path, model_dir: Path, path: Path, cfg: Config) -> dict:
    from lm_eval_sink.io import atomic_write_json, read_json
    from lm_eval_sink.commands.margin import measure_margin
    from lm_eval_sink.margin import MarginSettings

    if path.is_file():
        return read_json(path)
    m, _ = measure_margin(
        str(start_dir),
        str(model_dir),
        MarginSettings(strength=strength_settings(cfg), last_k=cfg.last_k),
        dtype="float32",
        device=cfg.device,
        progress=False,
    )
    atomic_write_json(path, m.to_json())
    return m.to_json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default="out/exp_vl_adaptation")
    ap.add_argument("--steps", type=int, default=Config.steps)
    ap.add_argument("--batch", type=int, default=Config.batch)
    ap.add_argument("--lr", type=float, default=Config.lr)
    ap.add_argument("--every", type=int, default=Config.every)
    ap.add_argument("--tau", type=float, default=Config.tau)
    ap.add_argument("--seed", type=int, default=Config.seed)
    ap.add_argument(
        "--scale", type=int, default=1, help="multiply steps and the trajectory interval (e.g. 20 on a GPU)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="default", help="start model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--smoke", action="store_true", help=f"every stage at a tiny size, to check it runs: {SMOKE}")
    a = ap.parse_args()
    cfg = Config(
        **{
            "steps": a.steps * a.scale,
            "batch": a.batch,
            "lr": a.lr,
            "every": a.every * a.scale,
            "tau": a.tau,
            "seed": a.seed,
            "device": a.device,
            **(SMOKE if a.smoke else {}),
        }
    )
    runs = [r for r in a.runs.split(",") if r]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        raise SystemExit(f"error: unknown run(s) {bad} (fix: choose from {', '.join(RUNS)})")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from lm_eval_sink.io import atomic_write_json, atomic_write_text, provenance, read_json
    from lm_eval_sink.models import load_model, model_fingerprint, resolve_model
    from lm_eval_sink.training.callback import trajectory_plot
    from lm_eval_sink.training.protection import select_sink_heads

    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    start_dir = Path(resolve_model(a.model))
    start_model = model_fingerprint(str(start_dir))
    if cfg_path.is_file() and [read_json(cfg_path)[k] for k in ("config", "start_model")] != [asdict(cfg), start_model]:
        raise SystemExit(
            f"error: {out} holds a run with other settings or another start model "
            "(fix: use another --output, or the same options)"
        )
    keys = IFEVAL_KEYS[: cfg.n_ifeval]
    atomic_write_json(
        cfg_path,
        {"config": asdict(cfg), "runs": runs, "ifeval_keys": list(keys), "start_model": start_model},
    )
    n_measure = cfg.steps // cfg.every + 2
    est = (
        len(runs) * (cfg.steps * COST_TRAIN_STEP + n_measure * COST_STRENGTH + 3 * COST_STRENGTH)
        + (len(runs) + 1) * len(keys) * COST_IFEVAL_PROMPT
    )
    print(
        f"estimate on this machine's measured costs: ~{est / 60:.0f} min ({len(runs)} runs x "
        f"{cfg.steps} steps, batch {cfg.batch}, seq {cfg.seq_len}, lr {cfg.lr}; "
        f"{len(runs) + 1} IFEval runs of {len(keys)} prompts; finished stages in {out} are reused)",
        flush=True,
    )
    t0 = time.time()
    data = ifeval_subset(out, keys)
    start = out / "start"
    start.mkdir(exist_ok=True)
    s_start = strength_json(start_dir, start / "strength.json", cfg)
    plan_path = start / "plan.json"
    if not plan_path.is_file():
        loaded = load_model(str(start_dir), dtype="float32")
        plan = select_sink_heads(loaded.model, loaded.tokenizer, strength_settings(cfg), tau=cfg.tau, progress=False)
        atomic_write_json(
            plan_path, {**plan.to_json(), "provenance": {**plan.provenance, **provenance(model=loaded.info)}}
        )
        del loaded
    plan = read_json(plan_path)
    print(
        f"start: S = {s_start['sink_strength']:.4f}; plan protects "
        f"{sum(h['selected'] for h in plan['heads'])} of {len(plan['heads'])} heads in layers "
        f"{[lp['layer'] for lp in plan['layers']]}, rank of U "
        f"{sorted({lp['max_u_rank'] for lp in plan['layers']})} of {plan['head_dim']} (tau "
        f"{cfg.tau})",
        flush=True,
    )
    if_start = ifeval_score(start_dir, start, data, cfg)
    print(
        f"start: IFEval prompt-strict {if_start['prompt_level_strict_acc']:.3f} ({if_start['seconds']} s)", flush=True
    )
    rows = {}
    for name in runs:
        folder = out / name.replace("+", "_")
        folder.mkdir(exist_ok=True)
        tr = train_run(name, start_dir, plan_path, folder, cfg)
        s_end = strength_json(folder / "model", folder / "strength.json", cfg)
        ife = ifeval_score(folder / "model", folder, data, cfg)
        mg = margin_of(start_dir, folder / "model", folder / "margin.json", cfg)
        rows[name] = {
            "train": tr,
            "s_end": s_end["sink_strength"],
            "ifeval": ife["prompt_level_strict_acc"],
            "ifeval_seconds": ife["seconds"],
            "margin": mg["summary"],
        }
        print(
            f"{name}: S {s_start['sink_strength']:.4f} -> {s_end['sink_strength']:.4f}, IFEval "
            f"{if_start['prompt_level_strict_acc']:.3f} -> {ife['prompt_level_strict_acc']:.3f}, "
            f"held-out caption loss {tr['heldout_caption_loss_start']:.3f} -> "
            f"{tr['heldout_caption_loss_end']:.3f}, margin median {mg['summary']['margin_median']:.3f}, "
            "negative-margin heads "
            f"{mg['summary']['n_negative_margin']}/{mg['summary']['n_heads_total']} "
            f"({time.time() - t0:.0f} s so far)",
            flush=True,
        )
    head = [
        "run",
        "S start",
        "S end",
        "IFEval start",
        "IFEval end",
        "caption loss (held-out) start",
        "end",
        "train loss last 5",
        "margin median",
        "margin min",
        "negative-margin heads",
        "train s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        tr, mg = r["train"], r["margin"]
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    f"{s_start['sink_strength']:.4f}",
                    f"{r['s_end']:.4f}",
                    f"{if_start['prompt_level_strict_acc']:.3f}",
                    f"{r['ifeval']:.3f}",
                    f"{tr['heldout_caption_loss_start']:.3f}",
                    f"{tr['heldout_caption_loss_end']:.3f}",
                    "n/a" if tr["train_loss_last5"] is None else f"{tr['train_loss_last5']:.3f}",
                    f"{mg['margin_median']:.3f}",
                    f"{mg['margin_min']:.3f}",
                    f"{mg['n_negative_margin']}/{mg['n_heads_total']}",
                    f"{tr['train_seconds']:.0f}",
                ]
            )
            + " |"
        )
    atomic_write_text(out / "results.md", "\n".join(lines) + "\n")
    atomic_write_json(
        out / "results.json",
        {
            "config": asdict(cfg),
            "start": {"sink_strength": s_start["sink_strength"], "ifeval": if_start},
            "runs": rows,
            "wall_seconds_this_invocation": round(time.time() - t0, 1),
        },
    )
    trajectory_plot(
        {n: [tuple(p) for p in r["train"]["trajectory"]] for n, r in rows.items()},
        out / "trajectories.png",
        f"{'SmolLM2-135M-Instruct' if a.model == 'default' else start_dir.name}, "
        f"{cfg.steps} steps, batch {cfg.batch}, lr {cfg.lr}",
    )
    print("\n".join(lines))
    print(f"-> {out / 'results.md'}, {out / 'trajectories.png'} ({time.time() - t0:.0f} s this invocation)")


if __name__ == "__main__":
    main()
