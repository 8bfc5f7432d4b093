"""Training-time tools: SinkStrengthCallback under a real Trainer, SinkProtection on hand-set sinks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

import sinkmodels as sm
from helpers import CHILD_ENV
from lm_eval_sink.cli import main
from lm_eval_sink.errors import SinkWarning, UserError
from lm_eval_sink.strength import StrengthSettings
from lm_eval_sink.training import SinkProtection, SinkStrengthCallback, select_sink_heads
from lm_eval_sink.training.protection import read_plan, sink_basis, sink_geometry


def _rule_k(delta: np.ndarray, x_hat: np.ndarray) -> np.ndarray:
    """Rule K as docs/training.md writes it, delta (I - x^ x^T): the oracle of the projection."""
    return delta - np.outer(delta @ x_hat, x_hat)


def _rule_q(delta: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Rule Q, (I - U U^T) delta."""
    return delta - u @ (u.T @ delta)


def test_sink_basis_keeps_planes_by_energy():
    k = np.zeros(8)
    k[3], k[7] = 3.0, 4.0  # plane (3, 7): 25
    k[0] = 1.0  # plane (0, 4): 1
    u, excluded = sink_basis(k, 8, tau=0.0)
    assert u.shape == (8, 4) and excluded == 0.0
    assert np.allclose(u.T @ u, np.eye(4)) and np.allclose(u @ (u.T @ k), k)
    u, excluded = sink_basis(k, 8, tau=0.05)  # 25 / 26 > 0.95: the small plane is dropped
    assert u.shape == (8, 2) and excluded == pytest.approx(1 / 26)
    k2 = np.zeros(8)
    k2[6] = 2.0  # rotary_dim 4: dims 4..7 unrotated, one direction along k's part there
    u, _ = sink_basis(k2, 4, tau=0.0)
    assert u.shape == (8, 1) and np.allclose(u[:, 0], np.eye(8)[6])


# ---------------------------------------------------------------------------- protect-plan


@pytest.fixture(scope="module")
def selective_dirs(tmp_path_factory, tiny_tokenizer):
    out = {}
    for fam in ("llama", "qwen3", "olmo2"):
        d = tmp_path_factory.mktemp(f"sel-{fam}")
        sm.build_selective(
            fam, n_layers=3, vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id
        ).save_pretrained(d)
        tiny_tokenizer.save_pretrained(d)
        out[fam] = d
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2"])
def test_protect_plan_selects_exactly_the_sink_heads(family, selective_dirs, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["protect-plan", str(selective_dirs[family]), "--quiet", "-o", str(plan_path)]) == 0
    assert capsys.readouterr().out.startswith("6 of 12 heads selected in 3 layers")
    doc = json.loads(plan_path.read_text())
    assert (
        doc["provenance"]["command"] == "protect-plan"
        and doc["qk_norm"] == {"llama": "none", "qwen3": "per_head", "olmo2": "layerwise"}[family]
    )
    selected = {(h["layer"], h["head"]) for h in doc["heads"] if h["selected"]}
    assert selected == {(l, h) for l in range(3) for h in sm.SINK_HEADS}
    for h in doc["heads"]:
        assert h["kv_head"] == h["head"] // 2 and h["sink_pos"] == 0
        if not h["selected"]:
            assert "threshold" in h["reason"] and h["median_logodds"] < 0
    for lp in doc["layers"]:
        assert lp["heads"] == [0, 1]
        assert lp["kv_heads"] == ([0, 1] if family == "olmo2" else [0])  # layerwise norm: Rule K on all of k_proj
        assert lp["u_rank"]["0"] == 2 and lp["max_u_rank"] == 2  # k_s lies in the rotary plane (3, 7) only
    assert read_plan(plan_path).lowest_layer == 0


def test_protect_plan_bad_inputs_one_line_exit_2(selective_dirs, tmp_path, user_error):
    model = str(selective_dirs["llama"])
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    cases = [
        ([str(tmp_path / "missing"), "-o", str(tmp_path / "a.json")], "no such model folder"),
        ([model, "--tau", "1.5", "-o", str(tmp_path / "b.json")], "--tau"),
        ([model, "--threshold", "-inf", "-o", str(tmp_path / "e.json")], "--threshold must be a finite log-odds"),
        ([model, "--min-pos0-fraction", "2", "-o", str(tmp_path / "c.json")], "--min-pos0-fraction"),
        ([model, "-o", str(existing)], "already exists"),
        ([model, "-o", str(tmp_path)], "is a folder"),
        ([model, "--last-k", "x", "-o", str(tmp_path / "d.json")], "--last-k"),
    ]
    for args, needle in cases:
        line = user_error(["protect-plan", *args])
        assert needle in line and "(fix: " in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"] and existing.read_text() == "{}"


# ---------------------------------------------------------------------------- protection after training


def _train(model, steps: int, protection: SinkProtection | None, vocab: int, bos: int, lr: float = 1e-2, seed: int = 0):
    """Real AdamW steps on random token sequences starting with the sink token; project after each."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        ids = torch.randint(3, vocab, (4, 12), generator=gen)
        ids[:, 0] = bos
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if protection is not None:
            protection.project_(model)
    model.eval()


def _rotated_logits(model, layer: int, q: torch.Tensor, k_s: torch.Tensor, positions: int = 24) -> torch.Tensor:
    """[position, head] logits q_h(at position i)^T k_s(at position 0) through the model's RoPE."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    pos = torch.arange(positions)[None]
    cos, sin = model.model.rotary_emb(q, pos)
    qs = q[None, :, None, :].expand(1, q.shape[0], positions, q.shape[1])  # [1, head, pos, d]
    q_rot, _ = apply_rotary_pos_emb(qs, qs, cos, sin)
    group = q.shape[0] // k_s.shape[0]
    return torch.einsum("hpd,hd->ph", q_rot[0].double(), k_s.repeat_interleave(group, 0).double())


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def trained(tiny_tokenizer):
    """Build a noisy hand-set model of a family, plan (last 2 layers, tau 0), freeze, train 6 steps."""

    def make(family: str, bias: bool = False, tied: bool = False, lora: bool = False):
        vocab, bos = len(tiny_tokenizer), tiny_tokenizer.bos_token_id
        model = sm.build_selective(family, n_layers=3, vocab=vocab, bos_id=bos, noise=0.05, bias=bias, tied=tied)
        plan = select_sink_heads(model, tiny_tokenizer, StrengthSettings(last_k=2), progress=False)
        assert {(c.layer, c.head) for c in plan.heads if c.selected} == {(l, h) for l in (1, 2) for h in sm.SINK_HEADS}
        start_geo = sink_geometry(model, bos, [1, 2])
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], lora_dropout=0.0)
            )
        base = model.get_base_model() if lora else model
        start = _snapshot(base)
        prot = SinkProtection(plan)
        frozen = prot.freeze(model)
        _train(model, 6, prot, vocab, bos)
        return {
            "model": base,
            "plan": plan,
            "prot": prot,
            "start": start,
            "start_geo": start_geo,
            "frozen": frozen,
            "bos": bos,
        }

    return make


def test_dense_protection_holds_sink_key_and_logit(trained):
    t = trained("llama", bias=True, tied=True)
    model, start, prot = t["model"], t["start"], t["prot"]
    now = _snapshot(model)
    # Frozen: every parameter of layer 0 except q/k, and layer 1's input norm: bit-identical.
    assert t["frozen"] and all(torch.equal(now[f"model.{n}"], start[f"model.{n}"]) for n in t["frozen"])
    assert not torch.equal(
        now["model.layers.0.self_attn.q_proj.weight"], start["model.layers.0.self_attn.q_proj.weight"]
    )
    # The sink row of the tied embedding / output head is reset after every step.
    assert torch.equal(now["model.embed_tokens.weight"][t["bos"]], start["model.embed_tokens.weight"][t["bos"]])
    geo = sink_geometry(model, t["bos"], [1, 2])
    np.testing.assert_allclose(geo[1][0], t["start_geo"][1][0], atol=1e-6)  # x_s fixed at the lowest protected layer
    np.testing.assert_allclose(geo[1][1][0], t["start_geo"][1][1][0], atol=1e-6)  # its KV head 0 sink key
    assert np.abs(geo[1][1][1] - t["start_geo"][1][1][1]).max() > 1e-3  # unprotected KV head 1 moved
    assert all(lp.u_rank == {0: 2} for lp in t["plan"].layers)
    rep = prot.report(model, torch.tensor([[t["bos"], 5, 6, 7]]))
    assert rep[1]["dk_sink"] < 1e-6 and rep[2]["q_norm_ratio"] is None
    d = sm.SEL_D
    for l in (1, 2):
        pre = f"model.layers.{l}.self_attn."
        assert torch.equal(now[pre + "k_proj.bias"][:d], start[pre + "k_proj.bias"][:d])
        assert not torch.equal(now[pre + "k_proj.bias"][d:], start[pre + "k_proj.bias"][d:])
        off_plane = [i for i in range(d) if i not in (sm.SEL_DIM, sm.SEL_DIM + d // 2)]
        w_now, w_start = now[pre + "q_proj.weight"], start[pre + "q_proj.weight"]
        for h in range(4):  # every query head learns; the protected ones off the sink planes (rank of U: 2 of 8)
            rows = off_plane if h in sm.SINK_HEADS else slice(None)
            assert not torch.equal(w_now[h * d : (h + 1) * d][rows], w_start[h * d : (h + 1) * d][rows])
        # Sink logit of a fixed query input through W_q (tau = 0), at every position: unchanged.
        x = torch.randn(sm.SEL_H, generator=torch.Generator().manual_seed(l))
        k_s0 = torch.tensor(t["start_geo"][l][1], dtype=torch.float32)
        q_now = (now[pre + "q_proj.weight"] @ x + now[pre + "q_proj.bias"]).view(-1, d)
        q_start = (start[pre + "q_proj.weight"] @ x + start[pre + "q_proj.bias"]).view(-1, d)
        l_now, l_start = _rotated_logits(model, l, q_now, k_s0), _rotated_logits(model, l, q_start, k_s0)
        np.testing.assert_allclose(l_now[:, :2], l_start[:, :2], atol=1e-5)
        assert (l_now[:, 2:] - l_start[:, 2:]).abs().max() > 1e-4  # heads 2, 3 (KV head 1) are not protected


def test_per_head_qk_norm_keeps_numerator(trained):
    t = trained("qwen3")
    model, start = t["model"], t["start"]
    d, l = sm.SEL_D, 1
    pre = f"model.layers.{l}.self_attn."
    now = _snapshot(model)
    for name in ("q_norm.weight", "k_norm.weight"):
        assert torch.equal(now[pre + name], start[pre + name])
    geo = sink_geometry(model, t["bos"], [1])
    np.testing.assert_allclose(geo[1][1][0], t["start_geo"][1][1][0], atol=1e-6)
    x = torch.randn(sm.SEL_H, generator=torch.Generator().manual_seed(3))
    k_s0 = torch.tensor(t["start_geo"][l][1], dtype=torch.float32)
    norm = model.model.layers[l].self_attn.q_norm
    u_now, u_start = (now[pre + "q_proj.weight"] @ x).view(-1, d), (start[pre + "q_proj.weight"] @ x).view(-1, d)
    with torch.no_grad():
        l_now, l_start = _rotated_logits(model, l, norm(u_now), k_s0), _rotated_logits(model, l, norm(u_start), k_s0)
    ratio = (u_start.norm(dim=-1) / u_now.norm(dim=-1)).double()
    np.testing.assert_allclose(
        l_now[:, :2], (l_start * ratio)[:, :2], rtol=1e-4, atol=1e-6
    )  # l_i = l_i0 |u_i0| / |u_i|
    assert not np.allclose(ratio[:2], 1.0, atol=1e-4)  # ... and not invariant
    lo, hi = t["prot"].report(model, torch.tensor([[t["bos"], 5, 6, 7]]))[1]["q_norm_ratio"]
    assert 0 < lo <= hi and (lo, hi) != (1.0, 1.0)


def test_layerwise_qk_norm_scales_by_layer_ratio(trained):
    t = trained("olmo2")
    model, start = t["model"], t["start"]
    assert all(lp.kv_heads == (0, 1) for lp in t["plan"].layers)
    d, l = sm.SEL_D, 1
    pre = f"model.layers.{l}.self_attn."
    now = _snapshot(model)
    geo = sink_geometry(model, t["bos"], [1])
    np.testing.assert_allclose(geo[1][1], t["start_geo"][1][1], atol=1e-6)  # all KV heads exact
    x = torch.randn(sm.SEL_H, generator=torch.Generator().manual_seed(4))
    k_s0 = torch.tensor(t["start_geo"][l][1], dtype=torch.float32)
    norm = model.model.layers[l].self_attn.q_norm
    q_now, q_start = now[pre + "q_proj.weight"] @ x, start[pre + "q_proj.weight"] @ x
    with torch.no_grad():
        l_now = _rotated_logits(model, l, norm(q_now).view(-1, d), k_s0)
        l_start = _rotated_logits(model, l, norm(q_start).view(-1, d), k_s0)
    ratio = float(q_start.norm() / q_now.norm())
    np.testing.assert_allclose(l_now[:, :2], l_start[:, :2] * ratio, rtol=1e-4, atol=1e-6)
    assert abs(ratio - 1.0) > 1e-4


def test_lora_projection_equals_dense_rule(trained):
    t = trained("llama", lora=True)
    model, plan, prot = t["model"], t["plan"], t["prot"]
    geo = sink_geometry(model, t["bos"], [1])
    np.testing.assert_allclose(geo[1][1][0], t["start_geo"][1][1][0], atol=1e-6)  # trained with LoRA: sink key held
    d = sm.SEL_D
    gen = torch.Generator().manual_seed(7)

    def lora_delta(mod) -> np.ndarray:  # dW = s B A
        delta = mod.scaling["default"] * mod.lora_B["default"].weight @ mod.lora_A["default"].weight
        return delta.detach().double().numpy()

    for lp in plan.layers:
        attn = model.model.layers[lp.layer].self_attn
        with torch.no_grad():
            for name in ("q_proj", "k_proj"):
                for w in (getattr(attn, name).lora_A["default"].weight, getattr(attn, name).lora_B["default"].weight):
                    w.copy_(torch.randn(w.shape, generator=gen))
        before = {n: lora_delta(getattr(attn, n)) for n in ("q_proj", "k_proj")}
        prot.project_(model)
        after = {n: lora_delta(getattr(attn, n)) for n in ("q_proj", "k_proj")}
        x_hat = np.asarray(lp.x_hat)
        np.testing.assert_allclose(
            after["k_proj"][:d], _rule_k(before["k_proj"][:d], x_hat), atol=1e-5
        )  # Rule K on KV head 0
        for h in lp.heads:
            rows = slice(h * d, (h + 1) * d)
            np.testing.assert_allclose(
                after["q_proj"][rows], _rule_q(before["q_proj"][rows], plan.basis(lp, 0)), atol=1e-5
            )
        for h in (2, 3):
            rows = slice(h * d, (h + 1) * d)
            np.testing.assert_allclose(after["q_proj"][rows], before["q_proj"][rows], atol=1e-6)


def _planned(tokenizer):
    """The hand-set selective Llama with q/k biases and its plan for the last 2 layers (KV head 0 in each)."""
    vocab, bos = len(tokenizer), tokenizer.bos_token_id
    model = sm.build_selective("llama", n_layers=3, vocab=vocab, bos_id=bos, noise=0.05, bias=True)
    return model, select_sink_heads(model, tokenizer, StrengthSettings(last_k=2), progress=False)


def test_projection_is_the_rules_on_the_cumulative_update(tiny_tokenizer):
    model, plan = _planned(tiny_tokenizer)
    prot, d, group = SinkProtection(plan), sm.SEL_D, sm.SEL_HEADS // sm.SEL_KV
    prot.freeze(model)
    start = {k: v.double().numpy() for k, v in _snapshot(model).items()}
    for seed in range(3):  # real AdamW steps, each projected: the rules apply to the update since the start
        _train(model, 1, None, len(tiny_tokenizer), tiny_tokenizer.bos_token_id, seed=seed)
        before = {k: v.double().numpy() for k, v in _snapshot(model).items()}
        prot.project_(model)
        after = {k: v.double().numpy() for k, v in _snapshot(model).items()}
        for lp in plan.layers:
            pre = f"model.layers.{lp.layer}.self_attn."
            w0, w = start[pre + "k_proj.weight"], before[pre + "k_proj.weight"]
            for g in lp.kv_heads:
                rows = slice(g * d, (g + 1) * d)
                want = w0[rows] + _rule_k(w[rows] - w0[rows], np.asarray(lp.x_hat))
                np.testing.assert_allclose(after[pre + "k_proj.weight"][rows], want, rtol=1e-6, atol=1e-7)
                assert np.array_equal(after[pre + "k_proj.bias"][rows], start[pre + "k_proj.bias"][rows])
            for name in ("q_proj.weight", "q_proj.bias"):
                w0, w = start[pre + name], before[pre + name]
                for h in lp.heads:
                    rows = slice(h * d, (h + 1) * d)
                    want = w0[rows] + _rule_q(w[rows] - w0[rows], plan.basis(lp, h // group))
                    np.testing.assert_allclose(after[pre + name][rows], want, rtol=1e-6, atol=1e-7)
            assert not np.allclose(after[pre + "q_proj.weight"], start[pre + "q_proj.weight"])  # not just undone


def test_projection_builds_each_kv_heads_basis_once(tiny_tokenizer, monkeypatch):
    from lm_eval_sink.training import protection

    model, plan = _planned(tiny_tokenizer)
    built = []
    real = protection.sink_basis
    monkeypatch.setattr(protection, "sink_basis", lambda *a: built.append(a) or real(*a))
    prot = SinkProtection(plan)
    prot.freeze(model)
    for seed in range(3):
        _train(model, 1, None, len(tiny_tokenizer), tiny_tokenizer.bos_token_id, seed=seed)
        prot.project_(model)
    assert sum(len(lp.heads) for lp in plan.layers) == 4  # two protected query heads share each KV head
    assert len(built) == sum(len(lp.kv_heads) for lp in plan.layers) == 2  # at binding, not at every step


def test_protection_refuses_other_weights_and_sharding(tiny_tokenizer, tmp_path):
    model = sm.build_selective("llama", vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id)
    plan = select_sink_heads(model, tiny_tokenizer, StrengthSettings(), progress=False)
    other = sm.build_selective("llama", vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id, noise=0.05)
    with pytest.raises(UserError, match="not the ones the plan was made from"):
        SinkProtection(plan).freeze(other)

    class Args:
        fsdp = "full_shard"

    with pytest.raises(UserError, match="FSDP / ZeRO-3") as e:
        SinkProtection(plan).on_train_begin(Args(), None, None, model=model)
    assert "\n" not in e.value.line()


# ---------------------------------------------------------------------------- callback under a real Trainer


class _Probe(TrainerCallback):
    """Saves the weights at chosen steps and records train mode / requires_grad after the S callback."""

    def __init__(self, folder, steps, tokenizer):
        self.folder, self.steps, self.tokenizer, self.seen = folder, steps, tokenizer, []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.seen.append((state.global_step, model.training, [p.requires_grad for p in model.parameters()]))
        if state.global_step in self.steps:
            model.save_pretrained(self.folder / f"step{state.global_step}")
            self.tokenizer.save_pretrained(self.folder / f"step{state.global_step}")


def _trainer(model, out, max_steps, callbacks=(), save_steps=None):
    from transformers import Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(max_steps * 2):
        ids = torch.randint(3, model.config.vocab_size, (10,), generator=gen)
        ids[0] = 2
        data.append({"input_ids": ids, "labels": ids.clone()})
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))


def test_callback_under_trainer_matches_strength_cli(tiny_tokenizer, tmp_path, capsys):
    from lm_eval_sink.training.callback import read_trajectory

    model = sm.build_selective("llama", vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id, noise=0.05)
    model.model.embed_tokens.weight.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    probe = _Probe(tmp_path, {2}, tiny_tokenizer)
    cb = SinkStrengthCallback(tiny_tokenizer, StrengthSettings(), every_n_steps=2)
    trainer = _trainer(model, tmp_path / "run", 5)
    cb.attach(trainer)
    trainer.add_callback(probe)  # after the S callback: sees the state it leaves
    trainer.train()
    records = read_trajectory(tmp_path / "run" / "sink_trajectory.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4, 5]  # step 0, every 2, and the last one once
    assert "provenance" not in records[0] and {
        "epoch",
        "sink_strength",
        "sink_strength_layer_head",
        "pos0_argmax_fraction",
    } <= set(records[0])
    assert (tmp_path / "run" / "sink_trajectory.png").stat().st_size > 1000
    assert all(training and seen == flags for _, training, seen in probe.seen)
    logged = [h for h in trainer.state.log_history if "sink_strength" in h]
    assert [h["step"] for h in logged] == [0, 2, 4, 5] and logged[1]["sink_strength"] == records[1]["sink_strength"]
    assert records[0]["sink_strength_layer_head"] != records[-1]["sink_strength_layer_head"]  # training moved the sinks
    assert main(["strength", str(tmp_path / "step2"), "--output", str(tmp_path / "cli"), "--quiet"]) == 0
    cli = json.loads(next((tmp_path / "cli").glob("*.strength.json")).read_text())
    assert cli["sink_strength"] == pytest.approx(records[1]["sink_strength"], abs=1e-6)
    np.testing.assert_allclose(cli["sink_strength_layer_head"], records[1]["sink_strength_layer_head"], atol=1e-6)


def test_callback_without_attach_warns_once_and_resume_drops_later_lines(tiny_tokenizer, tmp_path):
    from lm_eval_sink.io import atomic_write_text
    from lm_eval_sink.training.callback import read_trajectory

    model = sm.build_selective("llama", vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id, noise=0.05)
    cb = SinkStrengthCallback(tiny_tokenizer, StrengthSettings(n_prompts=5), every_n_steps=2)
    trainer = _trainer(model, tmp_path / "run", 4, callbacks=[cb], save_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert len([w for w in caught if issubclass(w.category, SinkWarning)]) == 1
    assert [h["step"] for h in trainer.state.log_history if "sink_strength" in h] == [0, 2, 4]
    path = tmp_path / "run" / "sink_trajectory.jsonl"
    lines = path.read_text().splitlines()
    fake = json.loads(lines[1]) | {"step": 3}  # a line later than checkpoint-2 that a resumed run would not rewrite
    atomic_write_text(path, "\n".join([*lines[:2], json.dumps(fake), *lines[2:]]) + "\n")
    resumed = _trainer(
        sm.build_selective("llama", vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id, noise=0.05),
        tmp_path / "run",
        4,
        callbacks=[SinkStrengthCallback(tiny_tokenizer, StrengthSettings(n_prompts=5), every_n_steps=2)],
        save_steps=2,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SinkWarning)
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    records = read_trajectory(path)
    assert [r["step"] for r in records] == [0, 2, 4]
    assert records[1]["sink_strength"] == json.loads(lines[1])["sink_strength"]  # kept, not re-measured


def test_protection_from_plan_as_trainer_callback(selective_dirs, tiny_tokenizer, tmp_path):
    from lm_eval_sink.io import atomic_write_json

    model = sm.build_selective("llama", vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id, noise=0.05)
    plan_path = atomic_write_json(
        tmp_path / "plan.json",
        select_sink_heads(model, tiny_tokenizer, StrengthSettings(last_k=2), progress=False).to_json(),
    )
    start, geo0 = _snapshot(model), sink_geometry(model, tiny_tokenizer.bos_token_id, [1])
    prot = SinkProtection.from_plan(plan_path)
    _trainer(model, tmp_path / "run", 4, callbacks=[prot]).train()
    now = _snapshot(model)
    assert torch.equal(now["model.layers.0.mlp.down_proj.weight"], start["model.layers.0.mlp.down_proj.weight"])
    assert not torch.equal(now["model.layers.2.mlp.down_proj.weight"], start["model.layers.2.mlp.down_proj.weight"])
    np.testing.assert_allclose(
        sink_geometry(model, tiny_tokenizer.bos_token_id, [1])[1][1][0], geo0[1][1][0], atol=1e-6
    )


# ---------------------------------------------------------------------------- distributed wrappers and learned sinks

DRIVER = Path(__file__).parent / "drivers" / "distributed_training.py"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """tests/drivers/distributed_training.py in 2 torchrun processes over gloo: DDP Trainer, then FSDP2."""
    out = tmp_path_factory.mktemp("two-ranks")
    env = {**os.environ, **CHILD_ENV, "ACCELERATE_USE_CPU": "true"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(DRIVER),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)  # a rank left waiting: fails
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ddp_trainer_freezes_before_wrapping_and_protection_holds_on_both_ranks(two_ranks):
    """SinkProtection in Trainer(callbacks=[...]) freezes at on_init_end: the optimizer never holds the
    frozen parameters and DDP (find_unused_parameters=False) wraps only the trainable ones, so the run
    finishes; a protection added after the Trainer was built is refused on every rank."""
    _, ranks = two_ranks
    for r in ranks:
        assert r["world_size"] == 2 and r["wrapped"] == "DistributedDataParallel"
        # layer 0 except q/k (2 norms, v, o, gate, up, down) and layer 1's input norm
        assert r["n_frozen"] == 8 and r["optimizer_params"] == r["n_trainable"] == 22
        assert r["frozen_max_change"] == 0.0 and r["trained_max_change"] > 1e-3
        assert r["lowest_layer"] == 1 and r["dk_sink"]["1"] < 1e-6  # the lowest protected layer's sink key holds
        assert "after DDP wrapped the model" in r["late_refusal"] and "\n" not in r["late_refusal"]
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]  # the same projection on every rank


def test_callback_under_fsdp2_measures_on_every_rank_and_writes_on_the_main_one(two_ranks):
    """Without the forward on every rank, rank 0's forward waits forever for the others' all-gathers."""
    out, (r0, r1) = two_ranks
    assert r0["param_type"] == "DTensor"
    assert [s for s, _ in r0["records"]] == [0, 1, 2] and r1["records"] == []
    assert r0["records"][0][1] == pytest.approx(r0["s_unsharded_start"], abs=1e-6)
    assert r0["records"][-1][1] == pytest.approx(r0["s_unsharded_end"], abs=1e-6)  # gathered weights, plain measure
    assert r0["s_unsharded_end"] != r0["s_unsharded_start"]  # the two steps moved S
    assert len((out / "fsdp-rank0" / "sink_trajectory.jsonl").read_text().splitlines()) == 3
    assert not (out / "fsdp-rank1").exists() and not (out / "ddp-rank1").exists()
    assert r0["ddp_records"] == [0, 3] and r1["ddp_records"] == []  # under DDP too: written by rank 0 only
    for r in (r0, r1):
        assert "FSDP / ZeRO-3" in r["protection_refusal"]
        assert "FSDP1 wrapper" in r["fsdp1_refusal"] and "\n" not in r["fsdp1_refusal"]
    assert not (out / "fsdp1").exists()


def _tiny_gpt_oss(vocab: int):
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return GptOssForCausalLM._from_config(config, attn_implementation="eager")


def test_protection_refuses_learned_sinks_with_one_line(tiny_tokenizer, tmp_path, user_error):
    d, plan_file = tmp_path / "gpt_oss", tmp_path / "plan.json"
    gpt = _tiny_gpt_oss(len(tiny_tokenizer))
    gpt.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    line = user_error(["protect-plan", d, "--quiet", "-o", plan_file], plan_file)
    assert "learned attention sinks" in line and "(fix: " in line
    llama = sm.build_selective("llama", vocab=len(tiny_tokenizer), bos_id=tiny_tokenizer.bos_token_id)
    plan = select_sink_heads(llama, tiny_tokenizer, StrengthSettings(n_prompts=5), progress=False)
    with pytest.raises(UserError, match="learned attention sinks"):
        SinkProtection(plan).freeze(gpt)


def test_protect_plan_chooses_the_attention_layers_s_is_measured_on(tiny_tokenizer):
    """On a hybrid (a conv layer between attention layers) the plan takes the last K attention layers, as S does, not
    the last K layers; LFM2's attention (q_layernorm, which the rules do not read) is then refused in one line naming
    the first of them, layer 0 (the last K layers would name the conv layer 1)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    from lm_eval_sink.strength import measure

    config = Lfm2Config(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["full_attention", "conv", "full_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Lfm2ForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    settings = StrengthSettings(last_k=2, n_prompts=5)
    assert list(measure(model, tiny_tokenizer, settings, progress=False).layers) == [0, 2]
    with pytest.raises(UserError) as refused:
        select_sink_heads(model, tiny_tokenizer, settings, progress=False)
    assert str(refused.value).startswith("layer 0's attention (Lfm2Attention) is not one SinkProtection reads")
    assert "not q_layernorm, k_layernorm" in str(refused.value)
