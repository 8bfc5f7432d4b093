"""SinkProtection and SinkStrengthCallback in torchrun processes on CPU (gloo); used by test_training.py.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 distributed_training.py OUT
1. DDP: a real Trainer (use_cpu, so gloo; ddp_find_unused_parameters=False, so DDP's reducer holds
   exactly the parameters that required grad when it wrapped the model) with SinkProtection in
   `callbacks=[...]` and an attached SinkStrengthCallback (each rank its own folder), 3 steps.
   Then a second Trainer that gets its protection by `add_callback`.
2. FSDP2: the model sharded with `fully_shard` on a CPU mesh, 2 AdamW steps, SinkStrengthCallback's
   hooks called on every rank as the Trainer calls them (every_n_steps=1), each rank writing to its
   own folder; then the full weights gathered into an unsharded copy and measured the plain way.
   Last, torch's FSDP1 wrapper, which the callback refuses.
Each rank writes OUT/rank<r>.json with what the test checks.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sinkmodels as sm
from helpers import make_tokenizer
from lm_eval_sink.errors import UserError
from lm_eval_sink.strength import StrengthSettings, measure
from lm_eval_sink.training import SinkProtection, SinkStrengthCallback, select_sink_heads

out = Path(sys.argv[1])
tok = make_tokenizer()
vocab, bos = len(tok), tok.bos_token_id
strength = StrengthSettings(n_prompts=5)


def build():
    return sm.build_selective("llama", vocab=vocab, bos_id=bos, noise=0.05)


def args_for(name: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out / name),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        seed=0,
    )


def data(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (10,), generator=gen)
        ids[0] = bos
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def ddp_part(report: dict) -> None:
    from transformers import Trainer, TrainerCallback

    model = build()
    plan = select_sink_heads(model, tok, StrengthSettings(last_k=2, n_prompts=5), progress=False)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    prot = SinkProtection(plan)

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            report["wrapped"] = type(trainer.model_wrapped).__name__
            report["optimizer_params"] = sum(len(g["params"]) for g in trainer.optimizer.param_groups)

    trainer = Trainer(model=model, args=args_for("ddp"), train_dataset=data(12, 0), callbacks=[prot, Probe()])
    cb = SinkStrengthCallback(tok, strength, every_n_steps=3, output_dir=out / f"ddp-rank{trainer.args.process_index}")
    cb.attach(trainer)
    trainer.train()
    report["ddp_records"] = [r["step"] for r in cb.records]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    report["n_frozen"] = len(frozen)
    report["n_trainable"] = sum(p.requires_grad for p in model.parameters())
    report["frozen_max_change"] = max(
        float((p - start[n]).abs().max()) for n, p in model.named_parameters() if n in frozen
    )
    report["trained_max_change"] = max(
        float((p - start[n]).abs().max()) for n, p in model.named_parameters() if n not in frozen
    )
    ids = torch.tensor([data(1, 9)[0]["input_ids"].tolist()])
    report["dk_sink"] = {str(k): v["dk_sink"] for k, v in prot.report(model, ids).items()}
    report["lowest_layer"] = plan.lowest_layer
    digest = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        digest.update(p.detach().numpy().tobytes())
    report["weights_sha256"] = digest.hexdigest()
    late = Trainer(model=build(), args=args_for("ddp-late"), train_dataset=data(12, 0))
    late.add_callback(SinkProtection(plan))  # after the Trainer was built: no on_init_end, so no early freeze
    try:
        late.train()
        report["late_refusal"] = None
    except UserError as e:
        report["late_refusal"] = e.line()


def fsdp_part(report: dict, rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import TrainerControl, TrainerState

    model = build()
    report["s_unsharded_start"] = measure(model, tok, strength, progress=False).sink_strength
    plan = select_sink_heads(model, tok, StrengthSettings(last_k=2, n_prompts=5), progress=False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report["param_type"] = type(next(model.parameters())).__name__
    try:
        SinkProtection(plan).freeze(model)
        report["protection_refusal"] = None
    except UserError as e:
        report["protection_refusal"] = e.line()
    cb = SinkStrengthCallback(tok, strength, every_n_steps=1, output_dir=out / f"fsdp-rank{rank}")
    args, state, control = args_for("fsdp"), TrainerState(), TrainerControl()
    state.is_world_process_zero = state.is_local_process_zero = rank == 0
    cb.on_train_begin(args, state, control, model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for step, batch in enumerate(data(2, 100 + rank), start=1):
        model.train()
        model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
        opt.step()
        opt.zero_grad()
        state.global_step, state.epoch = step, step / 2
        cb.on_step_end(args, state, control, model=model)
    cb.on_train_end(args, state, control, model=model)
    # full_tensor is a collective (every rank); the root's parameters stay unsharded after its forward
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    plain = build()
    plain.load_state_dict(full)
    report["s_unsharded_end"] = measure(plain, tok, strength, progress=False).sink_strength
    report["records"] = [(r["step"], r["sink_strength"]) for r in cb.records]
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel(build(), device_id=torch.device("cpu"))
    try:
        SinkStrengthCallback(tok, strength, output_dir=out / "fsdp1").on_train_begin(
            args, TrainerState(), control, model=fsdp1
        )
        report["fsdp1_refusal"] = None
    except UserError as e:
        report["fsdp1_refusal"] = e.line()


def main() -> None:
    args_for("init")  # accelerate's state: the gloo process group of the torchrun processes
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict = {"rank": rank, "world_size": world}
    ddp_part(report)
    fsdp_part(report, rank, world)
    (out / f"rank{rank}.json").write_text(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    main()
