"""`recovery`: the statistics core on generated per-doc outcomes (properties, hypothesis `ci` profile; Holm against
statsmodels), then the command on constructed runs with known outcomes (exact shares, Holm p, verdicts, parquet)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.recovery import ALL, ALL_FLOOR, NO_LOSS, NONE, PART, WORSE, TaskOutcomes, fieller_share, recover

FAST = BucketSettings(n_bootstrap=200, failure_kinds=False)


@st.composite
def _three(draw, binary: bool = True):
    """Reference, candidate and a control over n docs: the candidate loses a drawn share of the reference's passes
    (flips a few more), the control takes each doc's outcome from either, or its own."""
    n = draw(st.integers(20, 80))
    if binary:
        ref = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), float)
        lost = draw(st.floats(0.3, 1.0))
        cand = np.where(np.arange(n) < lost * n, 0.0, ref)
        flips = draw(st.lists(st.integers(0, n - 1), max_size=5))
        cand[flips] = 1 - cand[flips]
    else:
        score = st.floats(0.0, 100.0, allow_nan=False)
        ref = np.array(draw(st.lists(score, min_size=n, max_size=n)))
        cand = ref - np.array(draw(st.lists(st.floats(0.0, 50.0), min_size=n, max_size=n)))
    pick = np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    own = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), float) if binary else cand + 5.0
    return ref, cand, np.choose(pick, [ref, cand, own])


def _task(ref, cand, controls: dict[str, np.ndarray], kind: str = "binary", name: str = "t") -> TaskOutcomes:
    return TaskOutcomes(name, "acc", kind, list(range(len(ref))), {"reference": ref, "candidate": cand, **controls})


def _holds(ci, x) -> bool:
    return ci[0] - 1e-9 <= x <= ci[1] + 1e-9


@pytest.mark.parametrize("binary", [True, False])
@settings(max_examples=10)  # each example runs recover(): 7 comparisons with their power
@given(data=st.data())
def test_a_control_equal_to_the_reference_recovers_1_equal_to_the_candidate_0(binary, data):
    """Shares 1 and 0 exactly, each interval holding its estimate (and 1 or 0), never zero width for 0/1 outcomes."""
    ref, cand, ctrl = data.draw(_three(binary))
    kind = "binary" if binary else "continuous"
    controls = {"same_ref": ref.copy(), "same_cand": cand.copy(), "x": ctrl}
    tasks, cells = recover([_task(ref, cand, controls, kind)], list(controls), FAST)
    for name, expected in (("same_ref", 1.0), ("same_cand", 0.0)):
        cell = cells[name]["t"]
        if cell["recovered_share"] is None:  # the gap not detectable: no share, and the reason says so
            assert cell["recovered_share_note"] and tasks["t"]["gap"]["p_holm"] >= 0.05
            continue
        assert cell["recovered_share"] == pytest.approx(expected, abs=1e-12)
        ci = cell["recovered_share_ci"]
        assert ci is None or (_holds(ci, expected) and (ci[1] > ci[0] or not binary))
    x = cells["x"]["t"]
    if x["recovered_share_ci"] is not None:
        assert _holds(x["recovered_share_ci"], x["recovered_share"])


@given(ref_cand_ctrl=_three(), t=st.floats(-3, 3))
def test_fiellers_interval_is_the_set_of_shares_its_test_does_not_reject(ref_cand_ctrl, t):
    """Fieller by construction: at each end (mean a - theta mean b)^2 = q var(a - theta b) (pseudo-docs counted),
    inside it <=, and the estimate inside."""
    ref, cand, ctrl = ref_cand_ctrl
    ci = fieller_share(ref, cand, ctrl, True, 0.95)
    assume(ci is not None)
    estimate = np.mean(ctrl - cand) / np.mean(ref - cand)
    assert _holds(ci, estimate)
    from scipy.stats import t as student

    patterns = np.array(list(itertools.product((0, 1), repeat=3)), float)
    a = np.concatenate([ctrl - cand, patterns[:, 2] - patterns[:, 1]])
    b = np.concatenate([ref - cand, patterns[:, 0] - patterns[:, 1]])
    w = np.concatenate([np.ones(len(ref)), np.full(8, 0.25)])
    q = student.ppf(0.975, len(ref) - 1) ** 2 / len(ref)

    def gap(theta: float) -> float:  # <= 0 inside the interval
        d = a - theta * b
        return np.mean(d[: len(ref)]) ** 2 - q * np.cov(d, aweights=w, ddof=1)

    scale = max(1.0, abs(ci[0]), abs(ci[1]))
    assert abs(gap(ci[0])) < 1e-9 * scale**2 and abs(gap(ci[1])) < 1e-9 * scale**2
    inside = ci[0] + (ci[1] - ci[0]) * (t % 1.0)
    assert gap(inside) <= 1e-12 * scale**2


@settings(max_examples=6)  # each example runs recover(): up to 10 comparisons with their power
@given(triples=st.lists(_three(), min_size=1, max_size=2))
def test_holm_is_adjusted_within_each_family_as_statsmodels_does(triples):
    """Each family (the gaps over tasks; vs_candidate and vs_reference over every control x task) is adjusted on its
    own, as statsmodels' Holm does; adjusted p >= raw and monotone in it."""
    from statsmodels.stats.multitest import multipletests

    tasks = [
        _task(ref, cand, {"a": ctrl, "b": ref[::-1].copy()}, name=f"t{i}")
        for i, (ref, cand, ctrl) in enumerate(triples)
    ]
    gaps, cells = recover(tasks, ["a", "b"], FAST)
    families = [
        [gaps[t.task]["gap"] for t in tasks],
        *([cells[c][t.task][f] for c in "ab" for t in tasks] for f in ("vs_candidate", "vs_reference")),
    ]
    for family in families:
        raw, adjusted = [c["p"] for c in family], [c["p_holm"] for c in family]
        assert adjusted == pytest.approx(list(multipletests(raw, method="holm")[1]), abs=1e-12)
        assert all(p <= a <= 1 for p, a in zip(raw, adjusted, strict=True))
        order = np.argsort(raw, kind="stable")
        assert all(adjusted[i] <= adjusted[j] for i, j in itertools.pairwise(order))


def test_all_of_the_gap_needs_the_shares_interval_and_a_gain_is_no_loss():
    """40 docs, 12 lost: a control that takes back 8 differs from the reference on 4 docs only (not detectable), yet
    its share 0.67 has an interval reaching far below 1: part of it, not all; the reference itself: all (for a
    continuous metric too, with the zero-width interval Fieller gives). A candidate
    better than the reference (higher is better, or lower is better) lost nothing: no share, no recovery."""
    ref = np.r_[np.ones(24), np.zeros(16)]
    cand, eight = ref.copy(), ref.copy()
    cand[:12], eight[:4] = 0, 0
    cells = recover([_task(ref, cand, {"eight": eight, "same": ref.copy()})], ["eight", "same"], FAST)[1]
    assert (cells["eight"]["t"]["verdict"], cells["same"]["t"]["verdict"]) == (PART, ALL)
    assert cells["eight"]["t"]["vs_reference"]["p_holm"] >= 0.05
    assert cells["eight"]["t"]["recovered_share_ci"][0] < ALL_FLOOR <= cells["same"]["t"]["recovered_share_ci"][0]
    scores = np.linspace(50.0, 100.0, 40)  # a continuous metric: the reference itself, a zero-width interval at 1
    _, same = recover(
        [_task(scores, scores - np.linspace(5, 25, 40), {"same": scores.copy()}, "continuous")], ["same"], FAST
    )
    assert same["same"]["t"]["verdict"] == ALL and same["same"]["t"]["recovered_share_ci"] == [1, 1]
    for higher, runs in ((True, {"reference": cand, "candidate": ref}), (False, {"reference": ref, "candidate": cand})):
        t = TaskOutcomes("t", "acc", "binary", list(range(40)), {**runs, "x": eight}, higher)
        cell = recover([t], ["x"], FAST)[1]["x"]["t"]
        assert cell["verdict"] == NO_LOSS and cell["recovered_share"] is None, cell["verdict"]


# --- the command on constructed runs ---------------------------------------------------------------------------------

# 100 IFEval docs: the reference passes 0-59, the candidate lost 0-39 (a gap of 40 points); the controls take back all
# 40, 30, 2 of them, or lose 20 more (docs 40-59)
_REF = [1] * 60 + [0] * 40
_CAND = [0] * 40 + [1] * 20 + [0] * 40
_CONTROLS = {
    "all": _REF,
    "part": [1] * 30 + [0] * 10 + [1] * 20 + [0] * 40,
    "two": [1] * 2 + [0] * 38 + [1] * 20 + [0] * 40,
    "worse": [0] * 100,
}


@pytest.fixture(scope="module")
def six_runs(tmp_path_factory):
    """The reference, the candidate and four controls as lm-eval 0.4.13 run folders (constructed_runs)."""
    from constructed_runs import write_run

    root = tmp_path_factory.mktemp("recovery_runs")
    for name, outcome in {"reference": _REF, "candidate": _CAND, **_CONTROLS}.items():
        write_run(root / name, {"ifeval": (outcome, outcome)}, model=f"/models/{name}")
    return root


def test_recovery_on_constructed_runs_gives_the_exact_shares_holm_p_and_verdicts(six_runs, tmp_path, capsys):
    """Exact McNemar p of k discordant docs all one way is 2^(1-k); Holm over the four controls (statsmodels); shares
    1, 0.75, 0.05, -0.5 and their verdicts, in recovery.json, recovery.md and the console; 600 rows in
    prompts.parquet."""
    import pyarrow.parquet as pq
    from statsmodels.stats.multitest import multipletests

    from lm_eval_sink.cli import main
    from lm_eval_sink.io import read_json

    out = tmp_path / "rec"
    controls = [f"{name}={six_runs / name}" for name in _CONTROLS]
    argv = ["recovery", "--reference", six_runs / "reference", "--candidate", six_runs / "candidate", *controls]
    assert main([str(a) for a in [*argv, "--output", out]]) == 0
    data = read_json(out / "recovery.json")
    gap = data["tasks"]["ifeval"]["gap"]
    assert gap["p"] == pytest.approx(2.0**-39, rel=1e-9) and gap["delta"] == pytest.approx(-0.4)
    vs_cand = {"all": 2.0**-39, "part": 2.0**-29, "two": 0.5, "worse": 2.0**-19}
    vs_ref = {"all": 1.0, "part": 2.0**-9, "two": 2.0**-37, "worse": 2.0**-59}
    for family, raw in (("vs_candidate", vs_cand), ("vs_reference", vs_ref)):
        got = {c: data["controls"][c]["ifeval"][family] for c in _CONTROLS}
        assert {c: g["p"] for c, g in got.items()} == pytest.approx(raw, rel=1e-9)
        expected = dict(zip(raw, multipletests(list(raw.values()), method="holm")[1], strict=True))
        assert {c: g["p_holm"] for c, g in got.items()} == pytest.approx(expected, rel=1e-9)
    cells = {c: data["controls"][c]["ifeval"] for c in _CONTROLS}
    assert {c: x["recovered_share"] for c, x in cells.items()} == pytest.approx(
        {"all": 1.0, "part": 0.75, "two": 0.05, "worse": -0.5}
    )
    verdicts = {"all": ALL, "part": PART, "two": NONE, "worse": WORSE}
    assert {c: x["verdict"] for c, x in cells.items()} == verdicts
    assert "not detectable at this n" in cells["two"]["verdict_reason"]  # what it could have detected
    assert [p["doc_id"] for p in cells["part"]["prompts"]["recovered"]] == list(range(30))
    assert [p["doc_id"] for p in cells["worse"]["prompts"]["broke"]] == list(range(40, 60))
    md, console = (out / "recovery.md").read_text(), capsys.readouterr().out
    for c, word in verdicts.items():
        assert f"recovery: {c} on ifeval: {word}" in md and f"recovery: {c} on ifeval: {word}" in console
    table = pq.read_table(out / "prompts.parquet").to_pandas()
    assert len(table) == 600 and set(table["run"]) == {"reference", "candidate", *_CONTROLS}
    part = table[(table["run"] == "part")].sort_values("doc_id")
    assert part["prompt_level_strict_acc"].tolist() == [float(x) for x in _CONTROLS["part"]]
    assert (out / "recovery.png").stat().st_size > 0


def test_runs_that_do_not_pair_are_refused_as_buckets_refuses_them(six_runs, tmp_path, user_error):
    """A control over other docs: one line, exit 2, nothing written; a bare path takes its folder's name."""
    from constructed_runs import write_run

    write_run(tmp_path / "short", {"ifeval": ([1] * 99, [1] * 99)})
    out = tmp_path / "rec"
    ref, cand = six_runs / "reference", six_runs / "candidate"
    line = user_error(["recovery", "--reference", ref, "--candidate", cand, tmp_path / "short", "--output", out], out)
    assert "short" in line and "doc" in line
    line = user_error(["recovery", "--reference", ref, "--candidate", cand, f"all={ref}", f"all={cand}"], out)
    assert "all" in line


def test_the_metrics_direction_comes_from_the_references_results(six_runs, tmp_path):
    """The reference's results JSON declares lower is better: the candidate's 40 fewer passes are a gain, not a loss,
    so nothing is recovered; undeclared (the constructed runs), a 0/1 outcome counts higher as better."""
    import json
    import shutil

    from lm_eval_sink.commands.recovery import run_recovery

    ref = shutil.copytree(six_runs / "reference", tmp_path / "reference")
    results = next(ref.glob("results_*.json"))
    data = json.loads(results.read_text())
    data["higher_is_better"] = {"ifeval": {"prompt_level_strict_acc": False}}
    results.write_text(json.dumps(data))
    for reference, higher, word in ((six_runs / "reference", True, ALL), (ref, False, NO_LOSS)):
        got, _ = run_recovery(reference, six_runs / "candidate", [f"all={six_runs / 'all'}"], FAST)
        assert (
            got["tasks"]["ifeval"]["higher_is_better"] is higher and got["controls"]["all"]["ifeval"]["verdict"] == word
        )


def test_the_forest_plot_draws_a_name_with_tex_markup_as_text():
    """A control's name is data: "$\\frac$" is drawn as text (matplotlib's mathtext would fail to parse it)."""
    from lm_eval_sink.plots import recovery_forest

    ref, cand = np.r_[np.ones(24), np.zeros(16)], np.zeros(40)
    tasks, cells = recover([_task(ref, cand, {"$\\frac$": ref.copy()})], ["$\\frac$"], FAST)
    png = recovery_forest({"controls": cells, "tasks": tasks, "confidence": FAST.confidence}, None)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
