"""The S -> delta predictor: exact figures on the shipped paper table, PAIRS validation, `fit` CLI."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import yaml
from scipy import stats

from lm_eval_sink.cli import main
from lm_eval_sink.commands.fit import read_pairs
from lm_eval_sink.predict import (
    fit_pairs,
    fit_table_markdown,
    fit_task,
    permutation_test,
    rounding_envelope,
    spearman_rho,
    task_arrays,
)

S = [2.36, 2.36, 1.44, 1.18, 1.18, 0.24]
D = [-1.8, -5.4, -7.9, -8.9, -9.6, -18.7]


def _pair(name, s, d, **extra):
    return {
        "name": name,
        "reference": f"{name}-llm",
        "candidate": name,
        "sink_strength": s,
        "deltas": d,
        "source": "test",
        **extra,
    }


def _write(tmp_path, obj, name="pairs.yaml"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else yaml.safe_dump(obj), encoding="utf-8")
    return p


# ---------------------------------------------------------------------------- the shipped table


def test_shipped_table_is_the_papers_six_pairs(tmp_path):
    from importlib import resources

    table = read_pairs()
    assert table.shipped and len(table.pairs) == 6
    _, s, d = task_arrays(table, "ifeval")
    assert list(s) == S and list(d) == D
    assert [p.qk_norm for p in table.pairs] == ["per_head", "per_head", "none", "none", "none", "layerwise"]
    copy = tmp_path / "paper.yaml"  # a copy of the shipped file is recognised by its bytes
    copy.write_bytes(resources.files("lm_eval_sink").joinpath("data/paper_pairs.yaml").read_bytes())
    assert read_pairs(copy).shipped and read_pairs(copy).reported == table.reported


def test_exact_statistics_of_the_shipped_table():
    fit = fit_pairs(read_pairs()).tasks["ifeval"]
    # ranks: S has two ties; rho = 16.5 / sqrt(16.5 * 17.5) = sqrt(33/35) = 0.97101 (reported 0.97, "0.971")
    assert fit.spearman_rho == pytest.approx(math.sqrt(33 / 35), abs=1e-12)
    assert round(fit.spearman_rho, 2) == 0.97
    # exact permutation test over 6! = 720 orderings: 4 reach rho (the ties' swaps), 4 reach -rho
    assert fit.permutation_method == "exact" and fit.n_permutations == 720
    assert fit.permutation_p == pytest.approx(8 / 720, abs=1e-15)
    assert fit.permutation_p_one_sided == pytest.approx(4 / 720, abs=1e-15)
    assert fit.slope == pytest.approx(6.636452719255267, abs=1e-9)
    assert fit.intercept == pytest.approx(-18.405887636779354, abs=1e-9)
    np.testing.assert_allclose(
        fit.loo_errors,
        [
            1.6126264387861873,
            4.538137425880711,
            1.1394423482138496,
            2.0694682675814775,
            1.2045504994450624,
            4.997620850005406,
        ],
        atol=1e-9,
    )
    assert fit.loo_mae == pytest.approx(2.5936409716521154, abs=1e-9)  # reported 2.54
    np.testing.assert_allclose(fit.baseline_errors, [8.3, 3.98, 0.98, 0.22, 1.06, 11.98], atol=1e-9)
    assert fit.baseline_mae == pytest.approx(4.42, abs=1e-9)  # reported 4.40


def test_swapping_the_tied_rows_changes_no_statistic():
    a = fit_task("ifeval", tuple("abcdef"), np.array(S), np.array(D))
    swapped = [D[1], D[0], *D[2:]]
    b = fit_task("ifeval", tuple("abcdef"), np.array(S), np.array(swapped))
    for k in (
        "spearman_rho",
        "permutation_p",
        "permutation_p_one_sided",
        "slope",
        "intercept",
        "loo_mae",
        "baseline_mae",
    ):
        assert getattr(a, k) == pytest.approx(getattr(b, k), abs=1e-12), k
    assert sorted(a.loo_errors) == pytest.approx(sorted(b.loo_errors), abs=1e-12)


def test_reported_figures_lie_inside_the_rounding_envelope():
    env = fit_pairs(read_pairs()).rounding_envelope["ifeval"]
    assert env["corners"] == 2 ** (4 + 6)  # 4 distinct S values, 6 deltas
    lo, hi = env["loo_mae"]
    assert lo < 2.54 < hi and lo == pytest.approx(2.48267, abs=1e-4) and hi == pytest.approx(2.70409, abs=1e-4)
    lo, hi = env["baseline_mae"]
    assert lo < 4.40 < hi and lo == pytest.approx(4.36, abs=1e-9) and hi == pytest.approx(4.48, abs=1e-9)
    # without rounding the envelope is the point itself
    point = rounding_envelope(np.array(S), np.array(D), 0.0, 0.0)
    assert point["loo_mae"][0] == pytest.approx(2.5936409716521154) == point["loo_mae"][1]


# ---------------------------------------------------------------------------- statistics


def test_eight_pairs_enumerate_their_orderings_once():
    """The exact test over 8 pairs permutes the deltas only: 8! orderings, p as by brute force. Permuting both
    samples (main) made scipy enumerate (8!)^2 pairings; at 7 pairs that already took over 6 GB."""
    rng = np.random.default_rng(5)
    s = rng.normal(size=8)
    d = s + rng.normal(size=8)
    rank = stats.rankdata(s) - 4.5
    orderings = np.array(list(itertools.permutations(stats.rankdata(d) - 4.5)))
    perms = orderings @ rank / np.sqrt((rank**2).sum() * (orderings[0] ** 2).sum())
    rho = spearman_rho(s, d)
    p2, p1, method, n = permutation_test(s, d)
    assert (method, n) == ("exact", 40320)
    assert p2 == pytest.approx(np.mean(np.abs(perms) >= abs(rho) - 1e-9), abs=1e-12)
    assert p1 == pytest.approx(np.mean(perms >= rho - 1e-9), abs=1e-12)


def test_monte_carlo_permutations_beyond_the_exact_limit_are_seeded():
    rng = np.random.default_rng(3)
    s = rng.normal(size=12)
    d = 2 * s + rng.normal(size=12)
    a, b = permutation_test(s, d, seed=0), permutation_test(s, d, seed=0)
    assert a == b and a[2] == "monte_carlo" and 0 < a[0] < 0.01


# ---------------------------------------------------------------------------- PAIRS files


def test_user_pairs_with_strength_json_and_skipped_task(tmp_path):
    (tmp_path / "m.strength.json").write_text(json.dumps({"sink_strength": 1.5}))
    pairs = [
        _pair("a", 0.5, {"ifeval": -10.0, "gsm8k": -1.0}),
        _pair("b", "m.strength.json", {"ifeval": -6.0}),
        _pair("c", 2.5, {"ifeval": -1.0}),
    ]
    table = read_pairs(_write(tmp_path, pairs))
    assert not table.shipped and table.pairs[1].sink_strength == 1.5
    result = fit_pairs(table)
    assert set(result.tasks) == {"ifeval"} and "1 pair(s)" in result.skipped_tasks["gsm8k"]
    assert result.table.reported is None
    assert result.tasks["ifeval"].slope == pytest.approx(4.5)


def _three(s=1.0, d=-1.0, second_s=2.0, **extra):
    """Three pairs of one task whose first (`s`, `d`, `extra`) or second S (`second_s`) a case changes."""
    return [
        _pair("a", s, {"ifeval": d}, **extra),
        _pair("b", second_s, {"ifeval": -2.0}),
        _pair("c", 3.0, {"ifeval": -3.0}),
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("- name: a\n  deltas: {ifeval: -1\n", "pairs.yaml:3: not valid YAML"),
        ([1, 2, 3], "pair 1 is not a mapping"),
        ({"name": "a"}, "must be a YAML list of pairs"),
        (_three()[:2], "2 pair(s); a fit needs at least 3"),
        (
            [
                *_three()[:2],
                {"name": "c", "reference": "x", "candidate": "c", "sink_strength": 1.0, "deltas": {"ifeval": 1.0}},
            ],
            "missing key(s) source",
        ),
        (_three(sink_strenght=2.0), "did you mean 'sink_strength'"),
        (_three(s="high"), "sink_strength file"),
        (_three(d="bad"), "deltas[ifeval] must be a finite number"),
        (  # an OverflowError traceback in the prediction interval's width
            _three(s=1e308),
            "sink_strength is 1e+308, past any S (a log-odds) or delta (points): at most 1e+06 in size",
        ),
        ([*_three()[:2], _pair("a", 3.0, {"ifeval": -3.0})], "appears twice"),
        (_three(qk_norm="perhead"), "qk_norm 'perhead'"),
        (_three(second_s=1.0), "leave-one-out line is undefined"),
    ],
)
def test_malformed_pairs_files_are_one_line_errors(tmp_path, user_error, content, message):
    path = _write(tmp_path, content)
    out = tmp_path / "out"
    assert message in user_error(["fit", path, "--output", out], out)


def test_a_missing_pairs_file_is_one_line(tmp_path, user_error):
    assert "nope.yaml: no such PAIRS file" in user_error(["fit", tmp_path / "nope.yaml"])


# ---------------------------------------------------------------------------- the fit command


def test_fit_cli_writes_json_and_refuses_to_overwrite(tmp_path, capsys):
    assert main(["fit"]) == 0 and "not saved (pass --output DIR" in capsys.readouterr().out
    out = tmp_path / "fit"
    assert main(["fit", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| ifeval | 6 | 0.9710 | 0.0111 (exact)" in printed and "2.594" in printed and "4.420" in printed
    data = json.loads((out / "fit.json").read_text())
    task = data["tasks"]["ifeval"]
    assert task["spearman_rho"] == pytest.approx(math.sqrt(33 / 35))
    assert task["loo_mae"] == pytest.approx(2.5936409716521154) and task["baseline_mae"] == pytest.approx(4.42)
    assert data["reported"]["tasks"]["ifeval"] == {"spearman_rho": 0.97, "loo_mae": 2.54, "baseline_mae": 4.40}
    assert data["pairs_file"] == "builtin:data/paper_pairs.yaml" and data["schema_version"] == 1
    assert "versions" in data["provenance"]
    assert (out / "fit_ifeval.png").stat().st_size > 0 and "reported_rho" in (out / "fit.md").read_text()
    before = (out / "fit.json").read_bytes()
    assert main(["fit", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: output already exists") and len(err.strip().splitlines()) == 1
    assert (out / "fit.json").read_bytes() == before
    assert main(["fit", "--output", str(out), "--force"]) == 0
    again = json.loads((out / "fit.json").read_text())
    assert {k: v for k, v in again.items() if k != "provenance"} == {k: v for k, v in data.items() if k != "provenance"}


def test_prediction_interval_is_the_ols_interval_and_widens_with_distance():
    """The interval against the matrix form of the OLS prediction variance, s^2 (1 + x0' (X'X)^-1 x0), with
    scipy's t quantile at n - 2 degrees of freedom; narrowest at the pairs' mean S and wider on both sides."""
    result = fit_pairs(read_pairs())
    fit = result.tasks["ifeval"]
    s, d = np.array(S), np.array(D)
    x = np.column_stack([np.ones_like(s), s])
    beta = np.linalg.lstsq(x, d, rcond=None)[0]
    sigma2 = float((d - x @ beta) @ (d - x @ beta)) / (len(s) - 2)
    inverse = np.linalg.inv(x.T @ x)
    for at in (0.24, 1.18, 1.7321, 2.36, 4.4, -1.9):
        x0 = np.array([1.0, at])
        half = stats.t.ppf(0.975, len(s) - 2) * math.sqrt(sigma2 * (1 + x0 @ inverse @ x0))
        assert fit.prediction_interval(at) == pytest.approx((beta @ x0 - half, beta @ x0 + half), abs=1e-9)
    assert fit.residual_se == pytest.approx(math.sqrt(sigma2)) and fit.t_quantile == pytest.approx(2.7764451)
    mean = float(s.mean())
    widths = [fit.interval_half_width(mean + 0.5 * k) for k in range(6)]
    assert all(a < b for a, b in itertools.pairwise(widths))
    assert fit.interval_half_width(mean - 1.3) == pytest.approx(fit.interval_half_width(mean + 1.3))
    assert fit.outside(2.37) and fit.outside(0.2) and not fit.outside(1.0)
    # the paper's pairs were measured in a setting of their own: a fit that says so
    assert result.settings["ifeval"][0] is None and "paper's own calibration prompts" in result.settings["ifeval"][1]
    data = result.to_json()["tasks"]["ifeval"]
    assert data["interval_level"] == 0.95 and data["setting"] is None and data["residual_se"] == fit.residual_se
    md = fit_table_markdown(result)
    assert "95% PI half-width at mean S" in md and "not an interval for a new model" in md
    assert f"| {fit.interval_half_width(mean):.2f} | {fit.interval_half_width(0.24):.2f} |" in md
