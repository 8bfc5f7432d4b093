"""Merging controls: TSV/STAR math, bundled configs through the real mergekit, strict validation."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import make_tiny_lm
from safetensors.torch import load_file

from lm_eval_sink.cli import main
from lm_eval_sink.merging.configs import bundled_names, render, validate_text
from lm_eval_sink.merging.methods import register, star_delta, tsv_delta

EIGHT = ["linear_95_5", "linear_uniform", "task_arithmetic", "tsv", "star", "ties", "dare_linear", "slerp"]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _merge(tmp_path: Path, name: str, trio: dict[str, Path], lineage: str, seed: int | None = 0) -> Path:
    from lm_eval_sink.merging.merge import merge_config

    r = render(name, trio["reference"], trio["candidate"], base=trio["base"] if lineage == "siblings" else None)
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / f"{name}-{lineage}.yaml"
    cfg.write_text(r.text)
    out = tmp_path / f"{name}-{lineage}"
    merge_config(cfg, out, random_seed=seed)
    return out


def _error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2, captured
    lines = [x for x in captured.err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def _render(name: str, reference: Path, candidate: Path, out: Path) -> list[str]:
    """The argv of `configs render NAME --reference R --candidate C -o OUT`."""
    return ["configs", "render", name, "--reference", str(reference), "--candidate", str(candidate), "-o", str(out)]


# --- TSV / STAR against independent closed forms ---------------------------------------------


def _orthonormal(n: int, k: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, k)))
    return q


def _via_mergekit(method: str, base: torch.Tensor, tasks: list[torch.Tensor], **params) -> torch.Tensor:
    from mergekit.merge_methods import merge_tensors

    register()
    return merge_tensors([base, *[base + t for t in tasks]], method, base_index=0, parameters=params or None)


def test_tsv_rank1_orthogonal_tasks_add_up():
    u, v = _orthonormal(6, 2, 0), _orthonormal(5, 2, 1)
    t1 = torch.tensor(3.0 * np.outer(u[:, 0], v[:, 0]), dtype=torch.float32)
    t2 = torch.tensor(2.0 * np.outer(u[:, 1], v[:, 1]), dtype=torch.float32)
    base = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tsv_delta([t1, t2]), t1 + t2, atol=1e-5, rtol=0)
    torch.testing.assert_close(_via_mergekit("tsv", base, [t1, t2]), base + t1 + t2, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        _via_mergekit("tsv", base, [t1, t2], alpha=0.5), base + 0.5 * (t1 + t2), atol=1e-5, rtol=0
    )


def test_tsv_rank1_overlapping_tasks_follow_symmetric_orthogonalisation():
    # Two unit vectors with inner product c: the polar factor of [a b] is [a b] G^(-1/2),
    # G = [[1, c], [c, 1]], i.e. a' = p a + q b, b' = q a + p b with p, q below (Loewdin).
    rng = np.random.default_rng(3)
    a_u, b_u = (x / np.linalg.norm(x) for x in rng.standard_normal((2, 7)))
    a_v, b_v = (x / np.linalg.norm(x) for x in rng.standard_normal((2, 4)))

    def loewdin(a, b):
        c = float(a @ b)
        p = (1 / math.sqrt(1 + c) + 1 / math.sqrt(1 - c)) / 2
        q = (1 / math.sqrt(1 + c) - 1 / math.sqrt(1 - c)) / 2
        return p * a + q * b, q * a + p * b

    s1, s2 = 2.0, 0.5
    ua, ub = loewdin(a_u, b_u)
    va, vb = loewdin(a_v, b_v)
    expected = s1 * np.outer(ua, va) + s2 * np.outer(ub, vb)
    t1 = torch.tensor(s1 * np.outer(a_u, a_v), dtype=torch.float32)
    t2 = torch.tensor(s2 * np.outer(b_u, b_v), dtype=torch.float32)
    got = tsv_delta([t1, t2])
    np.testing.assert_allclose(got.numpy(), expected, atol=2e-5)
    assert not np.allclose(got.numpy(), (t1 + t2).numpy(), atol=1e-3)  # decorrelation changed the sum


def test_tsv_one_task_is_the_task_vector_and_truncation_matches_numpy():
    rng = np.random.default_rng(5)
    rank2 = torch.tensor(_orthonormal(5, 2, 7) @ np.diag([4.0, 1.5]) @ _orthonormal(4, 2, 8).T, dtype=torch.float32)
    torch.testing.assert_close(tsv_delta([rank2]), rank2, atol=1e-5, rtol=0)
    # Two rank-3 tasks on 4x4: each keeps floor(4 / 2) = 2 components (independent numpy float64).
    tasks = [rng.standard_normal((4, 3)) @ rng.standard_normal((3, 4)) for _ in range(2)]
    us, ss, vs = [], [], []
    for t in tasks:
        u, s, vt = np.linalg.svd(t)
        us.append(u[:, :2]), ss.append(s[:2]), vs.append(vt[:2].T)

    def polar(m):
        p, _, qt = np.linalg.svd(m, full_matrices=False)
        return p @ qt

    expected = polar(np.hstack(us)) @ np.diag(np.concatenate(ss)) @ polar(np.hstack(vs)).T
    got = tsv_delta([torch.tensor(t, dtype=torch.float32) for t in tasks])
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-4)
    base = torch.zeros(4, 4)
    np.testing.assert_allclose(
        _via_mergekit("tsv", base, [torch.tensor(t, dtype=torch.float32) for t in tasks]).numpy(), expected, atol=1e-4
    )


def test_tsv_and_star_one_dimensional_parameters_average():
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 0.0, -1.0])
    torch.testing.assert_close(tsv_delta([a, b]), torch.tensor([2.0, 1.0, 1.0]))
    torch.testing.assert_close(star_delta([a, b], 0.4), torch.tensor([2.0, 1.0, 1.0]))
    torch.testing.assert_close(
        _via_mergekit("tsv", torch.ones(3), [a, b], alpha=2.0), torch.ones(3) + 2 * torch.tensor([2.0, 1.0, 1.0])
    )


@pytest.mark.parametrize(
    ("eta", "kept"),
    [
        (0.4, [10.0, 0, 0, 0]),
        (0.6, [6.25, 3.75, 0, 0]),
        (0.75, [6.25, 3.75, 0, 0]),
        (0.85, [5 * 10 / 9.5, 3 * 10 / 9.5, 1.5 * 10 / 9.5, 0]),
        (1.0, [5.0, 3.0, 1.5, 0.5]),
    ],
)
def test_star_truncates_and_keeps_the_nuclear_norm(eta, kept):
    # Singular values (5, 3, 1.5, 0.5), sum 10: eta picks the smallest rank whose sum reaches
    # 10 * eta (5 | 8 | 9.5 | 10), and the kept values are scaled by 10 / (their sum).
    u, v = _orthonormal(5, 4, 11), _orthonormal(6, 4, 12)
    task = torch.tensor(u @ np.diag([5.0, 3.0, 1.5, 0.5]) @ v.T, dtype=torch.float32)
    expected = u @ np.diag(kept) @ v.T
    got = star_delta([task], eta)
    np.testing.assert_allclose(got.numpy(), expected, atol=2e-5)
    assert float(torch.linalg.matrix_norm(got, ord="nuc")) == pytest.approx(10.0, rel=1e-5)
    np.testing.assert_allclose(_via_mergekit("star", torch.zeros(5, 6), [task], eta=eta).numpy(), expected, atol=2e-5)


def test_star_averages_tasks_and_computes_in_float32_for_bf16():
    u, v = _orthonormal(5, 4, 21), _orthonormal(5, 4, 22)
    t1 = torch.tensor(u @ np.diag([5.0, 3.0, 1.5, 0.5]) @ v.T, dtype=torch.float32)
    t2 = torch.tensor(v @ np.diag([3.0, 1.0, 0.0, 0.0]) @ u.T, dtype=torch.float32)
    expected = (u @ np.diag([10.0, 0, 0, 0]) @ v.T + v @ np.diag([4.0, 0, 0, 0]) @ u.T) / 2
    np.testing.assert_allclose(star_delta([t1, t2], 0.4).numpy(), expected, atol=2e-5)
    base = torch.randn(5, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tasks = [t.to(torch.bfloat16) for t in (t1, t2)]
    got = _via_mergekit("star", base, [(base + t) - base for t in tasks], eta=0.4)
    assert got.dtype == torch.bfloat16
    ref = base.float() + star_delta([(base + t).float() - base.float() for t in tasks], 0.4)
    torch.testing.assert_close(got, ref.to(torch.bfloat16))


def test_register_is_idempotent_and_methods_module_imports_no_mergekit():
    from mergekit.merge_methods import registry

    register()
    register()
    names = [m.spec.name for m in registry.registered_methods()]
    assert names.count("tsv") == 1 and names.count("star") == 1
    spec = registry.get("star").spec
    assert [p.name for p in spec.parameters] == ["eta"] and spec.parameters[0].default == 0.4
    code = (
        "import sys, lm_eval_sink.merging.methods, lm_eval_sink.merging.configs; "
        "print(sorted(m for m in sys.modules if m.startswith('mergekit')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- bundled configs through the real mergekit ---------------------------------------------


def test_eight_bundled_configs_ship_as_package_data(capsys):
    import importlib.resources

    assert bundled_names() == EIGHT
    files = {p.name for p in importlib.resources.files("lm_eval_sink.merge_configs").iterdir()}
    assert {f"{n}.yaml" for n in EIGHT} <= files
    assert main(["configs", "list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == EIGHT


@pytest.mark.parametrize("lineage", ["chain", "siblings"])
@pytest.mark.parametrize("name", EIGHT)
def test_bundled_config_merges_loads_and_matches_its_formula(tmp_path, tiny_trio, name, lineage):
    from transformers import AutoModelForCausalLM

    from lm_eval_sink.outputs import read_complete

    out = _merge(tmp_path, name, tiny_trio, lineage)
    assert (
        read_complete(out)["merge_method"] == name
        if name not in ("linear_95_5", "linear_uniform")
        else read_complete(out)["merge_method"] == "linear"
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    logits = model(torch.tensor([[2, 10, 11, 12]])).logits
    assert torch.isfinite(logits).all()
    w, r, c, b = (_weights(p) for p in (out, tiny_trio["reference"], tiny_trio["candidate"], tiny_trio["base"]))
    assert set(w) == set(c)
    key = "model.layers.1.self_attn.q_proj.weight"
    base = r if lineage == "chain" else b
    taus = [c[key] - base[key]] if lineage == "chain" else [r[key] - b[key], c[key] - b[key]]
    got = w[key]
    if name == "linear_95_5":
        torch.testing.assert_close(got, 0.95 * c[key] + 0.05 * r[key])
    elif name == "linear_uniform":
        torch.testing.assert_close(got, 0.5 * c[key] + 0.5 * r[key])
    elif name == "task_arithmetic":
        torch.testing.assert_close(got, base[key] + sum(taus))
    elif name == "tsv":
        torch.testing.assert_close(got, base[key] + tsv_delta(taus), atol=1e-5, rtol=1e-5)
    elif name == "star":
        torch.testing.assert_close(got, base[key] + star_delta(taus, 0.4), atol=1e-5, rtol=1e-5)
    elif name == "ties" and lineage == "chain":
        tau = taus[0]
        k = int(0.2 * tau.numel())
        keep = tau.abs() >= tau.abs().flatten().topk(k).values[-1]
        torch.testing.assert_close(got, base[key] + tau * keep)
    elif name == "dare_linear" and lineage == "chain":
        moved = got - base[key]
        kept = moved != 0
        assert 0.03 < kept.float().mean() < 0.2  # about 10% kept
        scale = taus[0].abs().sum() / taus[0][kept].abs().sum()  # mergekit's DARE keeps the L1 norm
        assert 5 < float(scale) < 20
        torch.testing.assert_close(moved[kept], scale * taus[0][kept], rtol=1e-4, atol=1e-6)
    elif name == "slerp":
        a, bb = r[key].double().flatten(), c[key].double().flatten()
        theta = torch.arccos(torch.dot(a / a.norm(), bb / bb.norm()))
        expected = (torch.sin(0.5 * theta) * (a + bb) / torch.sin(theta)).reshape(got.shape)
        torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)
    else:  # ties / dare siblings: the merge moved away from every input
        assert all(not torch.allclose(got, x[key]) for x in (r, c, b))


def test_qwen2_tied_embeddings_merge_and_load(tmp_path):
    from transformers import AutoModelForCausalLM

    trio = {
        role: make_tiny_lm(tmp_path / role, "qwen2", seed)
        for role, seed in (("base", None), ("reference", 3), ("candidate", 4))
    }
    for name in ("tsv", "ties", "star"):
        out = _merge(tmp_path, name, trio, "siblings")
        model = AutoModelForCausalLM.from_pretrained(out)
        assert torch.isfinite(model(torch.tensor([[2, 10, 11]])).logits).all()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_chain_identities_return_the_candidate_and_render_warns(tmp_path, tiny_trio, capsys):
    c = _weights(tiny_trio["candidate"])
    for name in ("task_arithmetic", "tsv"):
        out = tmp_path / f"{name}.yaml"
        assert main(_render(name, tiny_trio["reference"], tiny_trio["candidate"], out)) == 0
        err = capsys.readouterr().err
        assert err.startswith("warning: ") and "returns the candidate unchanged" in err
        assert main(["merge", str(out), str(tmp_path / name), "--quiet"]) == 0
        w = _weights(tmp_path / name)
        for k in c:  # float32 rounding of reference + (candidate - reference) only
            torch.testing.assert_close(w[k], c[k], atol=2e-6, rtol=1e-6)
    for name in ("ties", "dare_linear", "star"):
        assert main(_render(name, tiny_trio["reference"], tiny_trio["candidate"], tmp_path / f"{name}.yaml")) == 0
        assert "warning" not in capsys.readouterr().err
        assert (
            main(["merge", str(tmp_path / f"{name}.yaml"), str(tmp_path / name), "--random-seed", "0", "--quiet"]) == 0
        )
        w = _weights(tmp_path / name)
        assert max(float((w[k] - c[k]).abs().max()) for k in c) > 1e-3


def test_seeded_merges_are_bit_identical_and_leave_rng_alone(tmp_path, tiny_trio):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = _merge(tmp_path / "a", "dare_linear", tiny_trio, "siblings", seed=7)
    b = _merge(tmp_path / "b", "dare_linear", tiny_trio, "siblings", seed=7)
    c = _merge(tmp_path / "c", "dare_linear", tiny_trio, "siblings", seed=8)
    assert torch.equal(torch.random.get_rng_state(), before)
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    t1, t2 = (
        _weights(_merge(tmp_path / "d", "tsv", tiny_trio, "siblings")),
        _weights(_merge(tmp_path / "e", "tsv", tiny_trio, "siblings")),
    )
    assert all(torch.equal(t1[k], t2[k]) for k in t1)


def test_merge_picks_up_rewritten_inputs(tmp_path, tiny_trio):
    """mergekit's LoaderCache is process-wide; a rewritten model folder must be read again."""
    ref = tmp_path / "ref"
    shutil.copytree(tiny_trio["reference"], ref)
    trio = {**tiny_trio, "reference": ref}
    first = _weights(_merge(tmp_path / "1", "linear_uniform", trio, "chain"))
    shutil.rmtree(ref)
    make_tiny_lm(ref, "llama", delta_seed=9)
    second = _weights(_merge(tmp_path / "2", "linear_uniform", trio, "chain"))
    expected = 0.5 * _weights(ref)["model.norm.weight"] + 0.5 * _weights(tiny_trio["candidate"])["model.norm.weight"]
    torch.testing.assert_close(second["model.norm.weight"], expected)
    assert not torch.equal(first["model.norm.weight"], second["model.norm.weight"])


@pytest.mark.slow
def test_plain_mergekit_yaml_runs_a_rendered_tsv_config(tmp_path, tiny_trio):
    """The import hook installed with the package registers tsv/star under plain mergekit-yaml."""
    cfg = tmp_path / "tsv.yaml"
    cfg.write_text(render("tsv", tiny_trio["reference"], tiny_trio["candidate"], base=tiny_trio["base"]).text)
    exe = Path(sys.executable).with_name("mergekit-yaml")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [str(exe), str(cfg), str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    w, r, c, b = (
        _weights(p) for p in (tmp_path / "out", tiny_trio["reference"], tiny_trio["candidate"], tiny_trio["base"])
    )
    key = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(w[key], b[key] + tsv_delta([r[key] - b[key], c[key] - b[key]]), atol=1e-5, rtol=1e-5)


# --- validation: one line, exit 2, nothing written ------------------------------------------


def _config(trio, **override):
    data = {
        "merge_method": "ties",
        "base_model": str(trio["reference"]),
        "models": [{"model": str(trio["candidate"]), "parameters": {"weight": 1.0, "density": 0.2}}],
        "parameters": {"lambda": 1.0},
        "dtype": "float32",
    }
    data.update(override)
    return {k: v for k, v in data.items() if v is not None}


BAD_CONFIGS = {
    "unknown_top_key": (
        lambda t: {**_config(t), "merge_methd": "ties"},
        ["merge_methd", "did you mean 'merge_method'"],
    ),
    "unknown_method": (lambda t: _config(t, merge_method="dare-ties"), ["merge_method", "did you mean 'dare_ties'"]),
    "misspelled_parameter": (
        lambda t: _config(t, models=[{"model": str(t["candidate"]), "parameters": {"weight": 1.0, "densty": 0.2}}]),
        ["models[0].parameters.densty", "did you mean 'density'"],
    ),
    "misspelled_global": (
        lambda t: _config(t, parameters={"lamda": 1.0}),
        ["parameters.lamda", "did you mean 'lambda'"],
    ),
    "global_on_model": (
        lambda t: _config(t, models=[{"model": str(t["candidate"]), "parameters": {"weight": 1.0, "lambda": 0.5}}]),
        ["models[0].parameters.lambda", "global parameter"],
    ),
    "task_param_on_base": (
        lambda t: _config(
            t,
            models=[
                {"model": str(t["reference"]), "parameters": {"weight": 1.0}},
                {"model": str(t["candidate"]), "parameters": {"weight": 1.0}},
            ],
        ),
        ["models[0].parameters.weight", "base model"],
    ),
    "missing_base": (lambda t: _config(t, base_model=None), ["base_model", "needs a base_model"]),
    "missing_weight": (
        lambda t: _config(t, merge_method="task_arithmetic", models=[{"model": str(t["candidate"])}]),
        ["models[0].parameters.weight", "missing"],
    ),
    "missing_t": (
        lambda t: {
            "merge_method": "slerp",
            "base_model": str(t["reference"]),
            "models": [{"model": str(t["reference"])}, {"model": str(t["candidate"])}],
        },
        ["parameters", "'t'"],
    ),
    "slerp_three_inputs": (
        lambda t: {
            "merge_method": "slerp",
            "base_model": str(t["reference"]),
            "models": [{"model": str(t[r])} for r in ("reference", "candidate", "base")],
            "parameters": {"t": 0.5},
        },
        ["models", "exactly 2 inputs"],
    ),
    "wrong_type": (
        lambda t: _config(t, models=[{"model": str(t["candidate"]), "parameters": {"weight": 1.0, "density": "high"}}]),
        ["models[0].parameters.density", "expected a number", "'high'"],
    ),
    "bool_for_number": (lambda t: _config(t, parameters={"lambda": True}), ["parameters.lambda", "expected a number"]),
    "density_above_one": (
        lambda t: _config(t, models=[{"model": str(t["candidate"]), "parameters": {"weight": 1.0, "density": 1.5}}]),
        ["density", "<= 1", "1.5"],
    ),
    "density_zero_in_gradient": (
        lambda t: _config(
            t, models=[{"model": str(t["candidate"]), "parameters": {"weight": 1.0, "density": [0.5, 0.0]}}]
        ),
        ["density[1]", "> 0"],
    ),
    "star_eta_percent": (
        lambda t: _config(t, merge_method="star", models=[{"model": str(t["candidate"])}], parameters={"eta": 40}),
        ["parameters.eta", "<= 1.0", "40"],
    ),
    "tsv_alpha_nan": (
        lambda t: _config(
            t, merge_method="tsv", models=[{"model": str(t["candidate"])}], parameters={"alpha": float("nan")}
        ),
        ["parameters.alpha", "finite"],
    ),
    "slerp_t_range": (
        lambda t: {
            "merge_method": "slerp",
            "base_model": str(t["reference"]),
            "models": [{"model": str(t["reference"])}, {"model": str(t["candidate"])}],
            "parameters": {"t": 1.5},
        },
        ["parameters.t", "<= 1"],
    ),
    "linear_weights_sum_zero": (
        lambda t: {
            "merge_method": "linear",
            "models": [
                {"model": str(t["reference"]), "parameters": {"weight": 1.0}},
                {"model": str(t["candidate"]), "parameters": {"weight": -1.0}},
            ],
        },
        ["sum to 0"],
    ),
    "linear_base_without_weight": (
        lambda t: {
            "merge_method": "linear",
            "base_model": str(t["base"]),
            "models": [
                {"model": str(t["reference"]), "parameters": {"weight": 1.0}},
                {"model": str(t["candidate"]), "parameters": {"weight": 1.0}},
            ],
        },
        ["base_model", "weight"],
    ),
    "missing_model_path": (
        lambda t: _config(t, models=[{"model": "/nonexistent/model", "parameters": {"weight": 1.0}}]),
        ["models[0].model", "/nonexistent/model"],
    ),
    "unknown_model_key": (
        lambda t: _config(t, models=[{"model": str(t["candidate"]), "parameter": {"weight": 1.0}}]),
        ["models[0].parameter", "did you mean 'parameters'"],
    ),
    "bad_dtype": (lambda t: _config(t, dtype="fp32"), ["dtype", "float32"]),
    "both_tokenizer_keys": (
        lambda t: _config(t, tokenizer_source="union", tokenizer={"source": "union"}),
        ["tokenizer", "not both"],
    ),
    "duplicate_model": (
        lambda t: _config(
            t,
            models=[
                {"model": str(t["candidate"]), "parameters": {"weight": 1.0}},
                {"model": str(t["candidate"]), "parameters": {"weight": 1.0}},
            ],
        ),
        ["listed twice"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_validation_rejects_bad_config_with_one_line(tmp_path, tiny_trio, capsys, case):
    build, needles = BAD_CONFIGS[case]
    cfg = tmp_path / f"{case}.yaml"
    cfg.write_text(yaml.safe_dump(build(tiny_trio), sort_keys=False))
    line = _error(capsys, ["configs", "validate", str(cfg)])
    assert str(cfg) in line
    for needle in needles:
        assert needle in line, (needle, line)
    line2 = _error(capsys, ["merge", str(cfg), str(tmp_path / "out")])
    assert line2 == line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.partial-*"))


def test_good_config_validates(tmp_path, tiny_trio, capsys):
    cfg = tmp_path / "good.yaml"
    data = _config(tiny_trio, parameters={"lambda": [0.5, 1.0]})
    data["models"][0]["parameters"]["density"] = [{"filter": "self_attn", "value": 0.3}, {"value": 0.2}]
    cfg.write_text(yaml.safe_dump(data))
    assert main(["configs", "validate", str(cfg)]) == 0
    assert "ok (merge_method ties, 2 inputs" in capsys.readouterr().out


def test_vocabulary_mismatch_names_both_sizes_unless_tokenizer_source(tmp_path, tiny_trio, capsys):
    bigger = make_tiny_lm(tmp_path / "vlm", "llama", delta_seed=5, vocab_extra=4)
    out = tmp_path / "r.yaml"
    argv = _render("ties", tiny_trio["reference"], bigger, out)
    line = _error(capsys, argv)
    assert (
        "vocab_size 46" in line
        and "vocab_size 50" in line
        and "reference" in line
        and "candidate" in line
        and "tokenizer_source" in line
    )
    assert not out.exists()
    assert main([*argv, "--tokenizer-source", "reference"]) == 0
    assert yaml.safe_load(out.read_text())["tokenizer_source"] == str(tiny_trio["reference"].resolve())
    assert main(["configs", "validate", str(out)]) == 0


def test_architecture_mismatch_and_render_errors(tmp_path, tiny_trio, capsys):
    qwen = make_tiny_lm(tmp_path / "qwen", "qwen2", delta_seed=1)
    line = _error(capsys, _render("linear_uniform", tiny_trio["reference"], qwen, tmp_path / "x.yaml"))
    assert "model_type differs" in line and "llama" in line and "qwen2" in line
    line = _error(capsys, _render("tsv", tmp_path / "nope", tiny_trio["candidate"], tmp_path / "x.yaml"))
    assert "--reference" in line and "nope" in line
    line = _error(capsys, _render("tiess", tiny_trio["reference"], tiny_trio["candidate"], tmp_path / "x.yaml"))
    assert "did you mean 'ties'" in line
    assert not (tmp_path / "x.yaml").exists()
    (tmp_path / "x.yaml").write_text("keep me")
    line = _error(capsys, _render("ties", tiny_trio["reference"], tiny_trio["candidate"], tmp_path / "x.yaml"))
    assert "already exists" in line and (tmp_path / "x.yaml").read_text() == "keep me"


def test_merge_refuses_existing_output_and_replaces_with_force(tmp_path, tiny_trio, capsys):
    cfg = tmp_path / "u.yaml"
    cfg.write_text(render("linear_uniform", tiny_trio["reference"], tiny_trio["candidate"]).text)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    line = _error(capsys, ["merge", str(cfg), str(out)])
    assert "already exists" in line and (out / "old.txt").exists()
    assert main(["merge", str(cfg), str(out), "--force", "--quiet"]) == 0
    assert not (out / "old.txt").exists() and (out / "COMPLETE.json").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "mergekit_config.yml").read_text() == cfg.read_text()


def test_merge_key_holds_the_code_and_package_versions(tmp_path, tiny_trio, capsys, monkeypatch):
    """Another mergekit changes a merge's key (its code: `tests/test_keys.py`); `merge` refuses an output made by
    other versions naming them, and one made by the same as 'already exists'."""
    from helpers import set_package_version
    from lm_eval_sink.keys import key_of
    from lm_eval_sink.merging.merge import MergeWork

    def merge_key(config, seed):
        return key_of(MergeWork(config, seed)).key

    linear = validate_text(render("linear_uniform", tiny_trio["reference"], tiny_trio["candidate"]).text)
    before = merge_key(linear, 0)

    cfg, out = tmp_path / "u.yaml", tmp_path / "out"
    cfg.write_text(linear.text)
    assert main(["merge", str(cfg), str(out), "--quiet"]) == 0
    complete = json.loads((out / "COMPLETE.json").read_text())
    assert complete["key"] == merge_key(linear, complete["random_seed"]) and complete["key_versions"]["mergekit"]
    assert "already exists" in _error(capsys, ["merge", str(cfg), str(out)])
    installed = set_package_version(monkeypatch, "mergekit", "99.0")
    assert merge_key(linear, 0) != before  # another mergekit: another key
    line = _error(capsys, ["merge", str(cfg), str(out)])
    assert f"made by other versions (mergekit {installed} -> 99.0)" in line and "--force" in line
    assert json.loads((out / "COMPLETE.json").read_text()) == complete  # refused: untouched
    assert main(["merge", str(cfg), str(out), "--force", "--quiet"]) == 0
    assert json.loads((out / "COMPLETE.json").read_text())["key_versions"]["mergekit"] == "99.0"


def test_a_tokenizer_source_outside_the_inputs_is_keyed_by_its_content(tmp_path, tiny_trio):
    """A merge's tokenizer_source that is none of its inputs: its tokenizer files' bytes changed at the same path,
    size and mtime give another key (the merge is not reused), put back the same key."""
    from lm_eval_sink.keys import key_of
    from lm_eval_sink.merging.merge import MergeWork

    tok = tmp_path / "tok"
    shutil.copytree(tiny_trio["base"], tok)  # the base is no input of a chain merge
    config = render("linear_uniform", tiny_trio["reference"], tiny_trio["candidate"], tokenizer_source=str(tok))
    assert str(tok) not in config.validated.inputs
    before = key_of(MergeWork(config.validated, 0)).key
    file = tok / "tokenizer.json"
    data, st = file.read_bytes(), file.stat()
    for content in (data.replace(b"<", b">", 1), data):
        file.write_bytes(content)
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (key_of(MergeWork(config.validated, 0)).key == before) == (content == data)


def test_rendered_siblings_config_is_plain_mergekit_yaml(tmp_path, tiny_trio):
    from mergekit.config import MergeConfiguration

    for name in EIGHT:
        r = render(name, tiny_trio["reference"], tiny_trio["candidate"], base=tiny_trio["base"])
        assert "${" not in r.text
        cfg = MergeConfiguration.model_validate(yaml.safe_load(r.text))
        assert cfg.merge_method in (name, "linear")
        uses_base = name not in ("linear_95_5", "linear_uniform", "slerp")
        assert (str(cfg.base_model) == str(tiny_trio["base"].resolve())) == uses_base
        assert any("does not use the base" in w for w in r.warnings) == (not uses_base)


def test_hub_id_inputs_are_merged_at_their_pinned_commits(tmp_path, tiny_trio):
    """An offline HF cache with two commits of org/tiny (old: the reference, main: the candidate): a linear
    merge of `org/tiny@<old sha>` and `org/tiny` is their mean only if each input loads at its own
    commit; COMPLETE.json and mergekit_config.yml name both commits. Bad revisions are one line each."""
    from helpers import hf_cache_snapshot

    old, new = "1" * 40, "2" * 40
    hub = tmp_path / "hf" / "hub"
    hf_cache_snapshot(hub, "org/tiny", tiny_trio["reference"], old, refs=("v1",))
    hf_cache_snapshot(hub, "org/tiny", tiny_trio["candidate"], new)
    local = str(tiny_trio["base"])
    configs = {
        "merge": [f"org/tiny@{old}", "org/tiny"],
        "tag": ["org/tiny@v1", local],
        "uncached_sha": [f"org/tiny@{'3' * 40}", local],
        "unknown_ref": ["org/tiny@v2", local],
        "local_with_rev": [f"{local}@main", "org/tiny"],
        "two_ats": ["org/tiny@v1@main", local],
    }
    for name, refs in configs.items():
        (tmp_path / f"{name}.yaml").write_text(
            yaml.safe_dump(
                {
                    "merge_method": "linear",
                    "dtype": "float32",
                    "models": [{"model": r, "parameters": {"weight": 0.5}} for r in refs],
                }
            )
        )
    driver = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from lm_eval_sink.cli import main
        res = {{}}
        for name in {sorted(configs)!r}:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                merge = ["merge", f"{tmp_path}/{{name}}.yaml", f"{tmp_path}/out-{{name}}", "--quiet"]
                argv = merge if name == "merge" else ["configs", "validate", f"{tmp_path}/{{name}}.yaml"]
                res[name] = [main(argv), err.getvalue()]
        print(json.dumps(res))
    """)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["merge"][0] == 0 and res["tag"][0] == 0, res
    for name, needle in (
        ("uncached_sha", "not in the local Hugging Face cache"),
        ("unknown_ref", "org/tiny@v2: not in the local"),
        ("local_with_rev", "names a revision of a hub model"),
        ("two_ats", "more than one '@'"),
    ):
        rc, err = res[name]
        lines = err.strip().splitlines()
        assert (
            rc == 2
            and len(lines) == 1
            and lines[0].startswith("error: ")
            and needle in lines[0]
            and "(fix: " in lines[0]
        ), (name, err)
    out = tmp_path / "out-merge"
    w, r, c = (_weights(p) for p in (out, tiny_trio["reference"], tiny_trio["candidate"]))
    assert set(w) == set(r)
    for key in w:
        torch.testing.assert_close(w[key], 0.5 * r[key] + 0.5 * c[key], atol=1e-6, rtol=0)
    complete = json.loads((out / "COMPLETE.json").read_text())
    assert complete["hub_revisions"] == {f"org/tiny@{old}": old, "org/tiny": new}
    assert {i["model"]: i["revision"] for i in complete["provenance"]["inputs"]} == {
        f"org/tiny@{old}": old,
        "org/tiny": new,
    }
    from mergekit.config import MergeConfiguration

    recipe = MergeConfiguration.model_validate(yaml.safe_load((out / "mergekit_config.yml").read_text()))
    assert sorted((m.model.model.path, m.model.model.revision) for m in recipe.models) == [
        ("org/tiny", old),
        ("org/tiny", new),
    ]
    assert (out / "tokenizer.json").is_file()


def test_revision_syntax_is_mergekits():
    """`split_revision` reads a reference as mergekit's ModelPath does."""
    from mergekit.common import ModelPath

    from lm_eval_sink.identity import split_revision

    for ref in ("org/name", f"org/name@{'a' * 40}", "org/name@main", "org/name@refs/pr/1", "./local/folder"):
        parsed = ModelPath.model_validate(ref)
        assert split_revision(ref) == (parsed.path, parsed.revision), ref
