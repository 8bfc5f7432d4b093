"""Predict post-VL degradation from Sink Strength: fit and check the paper's predictor.

Per task of a PAIRS file: Spearman's rho with an exact (or seeded Monte Carlo) permutation p, the least-squares line
with its prediction interval, and leave-one-pair-out errors of the line and of a constant mean (the file format and
the figures: docs/screening.md, "fit"). numpy and scipy.stats: no torch and no file I/O (commands/fit.py's).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field
from scipy import stats

from lm_eval_sink.comparability import Setting, compare
from lm_eval_sink.errors import UserError
from lm_eval_sink.schema import Strict, parse
from lm_eval_sink.tables import markdown_lines

SCHEMA_VERSION = 1
MIN_PAIRS = 3
EXACT_PERMUTATION_MAX_N = 10
MONTE_CARLO_PERMUTATIONS = 200_000
PERMUTATION_BATCH = 50_000  # orderings ranked at once: bounds memory (10! orderings at once took 3.4 GB)
SHIPPED_PAIRS = "data/paper_pairs.yaml"
SHIPPED_REPORTED = "data/paper_reported.json"
_TIE_TOL = 1e-12
# The largest |S| or |delta| a fit takes: S is a median of float32 log-odds (within about 104), a delta at most 100
# points; past this a value is a typo or a unit error, and its square would overflow the fit's float64 sums.
LARGEST = 1e6
PI_LEVEL = 0.95  # the prediction intervals' coverage


@dataclass(frozen=True, slots=True)
class PairTable:
    """The pairs of one PAIRS file, with where they came from."""

    pairs: tuple[Pair, ...]
    source: str  # the file path, or "builtin:data/paper_pairs.yaml"
    sha256: str  # of the file's bytes
    shipped: bool  # byte-identical to the shipped paper table
    reported: dict[str, Any] | None = None  # the paper's reported statistics, for the shipped table


@dataclass(frozen=True, slots=True)
class TaskFit:
    """Spearman rho, permutation p, linear fit and leave-one-pair-out errors for one task."""

    task: str
    n_pairs: int
    names: tuple[str, ...]
    sink_strength: tuple[float, ...]
    deltas: tuple[float, ...]
    spearman_rho: float
    permutation_p: float  # two-sided: P(|rho_perm| >= |rho|)
    permutation_p_one_sided: float  # P(rho_perm >= rho): higher S goes with smaller losses
    permutation_method: str  # "exact" or "monte_carlo"
    n_permutations: int
    slope: float
    intercept: float
    loo_predictions: tuple[float, ...]
    loo_errors: tuple[float, ...]  # |delta - prediction of the line fitted without that pair|
    loo_mae: float
    baseline_errors: tuple[float, ...]  # |delta - mean delta of the other pairs|
    baseline_mae: float
    s_min: float
    s_max: float
    residual_se: float  # sqrt(sum of squared residuals / (n - 2)): the line's residual standard error
    s_mean: float
    s_sxx: float  # sum of (S - mean S)^2
    t_quantile: float  # Student t quantile (1 + PI_LEVEL) / 2 with n - 2 degrees of freedom

    def predict(self, s: float) -> float:
        return self.slope * s + self.intercept

    def interval_half_width(self, s: float) -> float:
        """Half-width of the PI_LEVEL prediction interval at S = s: t * se * sqrt(1 + 1/n + (s - mean)^2 / Sxx)."""
        spread = 1 + 1 / self.n_pairs + (s - self.s_mean) ** 2 / self.s_sxx
        return self.t_quantile * self.residual_se * math.sqrt(spread)

    def prediction_interval(self, s: float) -> tuple[float, float]:
        """The PI_LEVEL prediction interval of a new pair's delta at S = s (ordinary least squares)."""
        y, h = self.predict(s), self.interval_half_width(s)
        return y - h, y + h

    def outside(self, s: float) -> bool:
        """Whether s lies outside the fitted S range (a prediction there is an extrapolation)."""
        return not self.s_min <= s <= self.s_max


@dataclass(frozen=True, slots=True)
class FitResult:
    """Fits of every task with at least MIN_PAIRS pairs; other tasks are listed with the reason."""

    tasks: dict[str, TaskFit]
    skipped_tasks: dict[str, str]
    table: PairTable  # its `reported`: the paper's figures, when the shipped table was fitted
    rounding_envelope: dict[str, Any] | None = None
    settings: dict[str, tuple[Setting | None, str | None]] = field(default_factory=dict)  # task -> `pairs_setting`

    def to_json(self) -> dict[str, Any]:
        tasks = {
            t: {
                **asdict(f),
                "interval_level": PI_LEVEL,
                "setting": None if self.settings[t][0] is None else self.settings[t][0].to_json(),
                "setting_unknown": self.settings[t][1],
            }
            for t, f in sorted(self.tasks.items())
        }
        return {
            "schema_version": SCHEMA_VERSION,
            "tasks": tasks,
            "skipped_tasks": dict(sorted(self.skipped_tasks.items())),
            "pairs": [p.model_dump() for p in self.table.pairs],
            "pairs_file": self.table.source,
            "pairs_sha256": self.table.sha256,
            "reported": self.table.reported,
            "rounding_envelope": self.rounding_envelope,
        }


# ---------------------------------------------------------------------------- PAIRS files


def finite(value: Any, where: str, what: str) -> float:
    """`value` as a float, refused unless a finite number of magnitude at most LARGEST."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise UserError(f"{where}: {what} must be a finite number, got {value!r}", "write a plain number such as 1.18")
    if abs(value) > LARGEST:
        raise UserError(
            f"{where}: {what} is {value:g}, past any S (a log-odds) or delta (points): at most {LARGEST:g} in size",
            "write the measured value (S as `lm-eval-sink strength` gives it, e.g. 1.18; deltas in points)",
        )
    return float(value)


class _PairIn(Strict):
    what: ClassVar[str] = "pair"
    name: str = Field(min_length=1)
    reference: str = Field(min_length=1)
    candidate: str = Field(min_length=1)
    sink_strength: float | str = Field(description="must be a number or the path of a *.strength.json")
    deltas: dict[str, Any] = Field(
        min_length=1, description="must be a non-empty mapping task -> points, e.g. deltas: {ifeval: -9.6}"
    )
    source: str = Field(min_length=1)
    qk_norm: Literal["per_head", "layerwise", "none"] | None = None
    notes: Any = None


class Pair(_PairIn):
    """One reference LLM / VLM pair: the reference's S and the candidate's deltas (points)."""

    sink_strength: float
    deltas: dict[str, float]
    notes: str | None = None
    setting: Setting | None = None  # the setting of its S, when read from a *.strength.json; None: unknown


def parse_pairs(obj: Any, where: str, read_strength: Callable[[str, str], tuple[float, Setting]]) -> tuple[Pair, ...]:
    """Validate a parsed PAIRS document (a list of mappings); `where` names it in errors. A `sink_strength` given as a
    path is read by `read_strength(path, where)` (the command's reader): (S, the Setting it was measured in)."""
    if not isinstance(obj, list):
        raise UserError(
            f"{where}: a PAIRS file must be a YAML list of pairs, got {type(obj).__name__}",
            "start each pair with '- name: ...' (see the shipped lm_eval_sink/data/paper_pairs.yaml)",
        )
    pairs, names = [], set()
    for i, item in enumerate(obj, 1):
        if not isinstance(item, dict):
            required = [name for name, f in _PairIn.model_fields.items() if f.is_required()]
            raise UserError(f"{where}: pair {i} is not a mapping", "each pair needs the keys " + ", ".join(required))
        p = parse(_PairIn, item, f"{where}: pair {i}")
        at = f"{where}: pair {p.name!r}"
        if p.name in names:
            raise UserError(f"{at} appears twice", "give every pair a unique name")
        names.add(p.name)
        s, setting = read_strength(p.sink_strength, at) if isinstance(p.sink_strength, str) else (p.sink_strength, None)
        s = finite(s, at, "sink_strength")
        clean = {task: finite(v, at, f"deltas[{task}]") for task, v in p.deltas.items()}
        notes = None if p.notes is None else str(p.notes)
        pairs.append(Pair(**{**dict(p), "sink_strength": s, "deltas": clean, "notes": notes, "setting": setting}))
    if len(pairs) < MIN_PAIRS:
        raise UserError(f"{where}: {len(pairs)} pair(s); a fit needs at least {MIN_PAIRS}", "add more pairs")
    return tuple(pairs)


# ---------------------------------------------------------------------------- statistics


def spearman_rho(s: np.ndarray, d: np.ndarray) -> float:
    """Spearman's rho (scipy's spearmanr: Pearson correlation of average ranks)."""
    if np.ptp(s) == 0 or np.ptp(d) == 0:
        raise UserError(
            "Spearman's rho is undefined when all S values or all deltas are equal", "use pairs with different values"
        )
    return float(stats.spearmanr(s, d).statistic)


def permutation_test(s: np.ndarray, d: np.ndarray, seed: int = 0) -> tuple[float, float, str, int]:
    """(two-sided p, one-sided p, method, permutations) for Spearman's rho: all n! orderings of the deltas against S
    up to EXACT_PERMUTATION_MAX_N pairs, else a seeded Monte Carlo with p = (1 + hits) / (1 + permutations). Only the
    deltas are permuted: both samples would make scipy enumerate (n!)^2 pairings (over 6 GB at 7 pairs)."""
    s, d = np.asarray(s, dtype=np.float64), np.asarray(d, dtype=np.float64)
    n = len(d)
    exact = n <= EXACT_PERMUTATION_MAX_N
    resamples = np.inf if exact else MONTE_CARLO_PERMUTATIONS

    def rho_against_s(x: np.ndarray, axis: int = -1) -> np.ndarray:  # Spearman's rho of each ordering x, vectorized
        rs, rx = stats.rankdata(np.broadcast_to(s, x.shape), axis=axis), stats.rankdata(x, axis=axis)
        rs, rx = rs - rs.mean(axis=axis, keepdims=True), rx - rx.mean(axis=axis, keepdims=True)
        return (rs * rx).sum(axis=axis) / np.sqrt((rs**2).sum(axis=axis) * (rx**2).sum(axis=axis))

    res = stats.permutation_test(
        (d,),
        rho_against_s,
        permutation_type="pairings",
        n_resamples=resamples,
        vectorized=True,
        batch=PERMUTATION_BATCH,
        alternative="greater",
        rng=np.random.default_rng(seed),
    )
    observed, null = float(res.statistic), np.asarray(res.null_distribution)
    hits2 = int((np.abs(null) >= abs(observed) - 1e-9).sum())  # two-sided from the same orderings
    p2 = hits2 / len(null) if exact else (1 + hits2) / (1 + len(null))
    return (
        p2,
        float(res.pvalue),
        "exact" if exact else "monte_carlo",
        math.factorial(n) if exact else MONTE_CARLO_PERMUTATIONS,
    )


def linear_fit(s: np.ndarray, d: np.ndarray) -> tuple[float, float]:
    """Least-squares (slope, intercept) of d = slope * s + intercept (scipy's linregress)."""
    s, d = np.asarray(s, dtype=np.float64), np.asarray(d, dtype=np.float64)
    if float(((s - s.mean()) ** 2).sum()) <= _TIE_TOL:
        raise UserError(
            "a linear fit needs at least two different S values", "add pairs whose references have different S"
        )
    fit = stats.linregress(s, d)
    return float(fit.slope), float(fit.intercept)


def leave_one_out(s: np.ndarray, d: np.ndarray, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(line predictions, constant-mean predictions) for each pair from the other pairs."""
    n = len(s)
    line, const = np.empty(n), np.empty(n)
    for i in range(n):
        keep = np.arange(n) != i
        if np.ptp(s[keep]) <= _TIE_TOL:
            raise UserError(
                f"without pair {names[i]!r} all remaining S values are equal, so the leave-one-out line is undefined",
                "add pairs with different S",
            )
        slope, intercept = linear_fit(s[keep], d[keep])
        line[i] = slope * s[i] + intercept
        const[i] = d[keep].mean()
    return line, const


def fit_task(task: str, names: tuple[str, ...], s: np.ndarray, d: np.ndarray, seed: int = 0) -> TaskFit:
    """Every statistic of one task's pairs (at least MIN_PAIRS)."""
    s, d = np.asarray(s, dtype=np.float64), np.asarray(d, dtype=np.float64)
    if len(s) < MIN_PAIRS:
        raise UserError(f"task {task}: {len(s)} pair(s); a fit needs at least {MIN_PAIRS}", "add more pairs")
    rho = spearman_rho(s, d)
    p2, p1, method, n_perm = permutation_test(s, d, seed)
    slope, intercept = linear_fit(s, d)
    line, const = leave_one_out(s, d, names)
    loo_err, base_err = np.abs(d - line), np.abs(d - const)
    n = len(s)
    sse = float(((d - (slope * s + intercept)) ** 2).sum())
    return TaskFit(
        task=task,
        n_pairs=len(s),
        names=tuple(names),
        sink_strength=tuple(float(x) for x in s),
        deltas=tuple(float(x) for x in d),
        spearman_rho=rho,
        permutation_p=p2,
        permutation_p_one_sided=p1,
        permutation_method=method,
        n_permutations=n_perm,
        slope=slope,
        intercept=intercept,
        loo_predictions=tuple(float(x) for x in line),
        loo_errors=tuple(float(x) for x in loo_err),
        loo_mae=float(loo_err.mean()),
        baseline_errors=tuple(float(x) for x in base_err),
        baseline_mae=float(base_err.mean()),
        s_min=float(s.min()),
        s_max=float(s.max()),
        residual_se=math.sqrt(sse / (n - 2)),
        s_mean=float(s.mean()),
        s_sxx=float(((s - s.mean()) ** 2).sum()),
        t_quantile=float(stats.t.ppf((1 + PI_LEVEL) / 2, n - 2)),
    )


def pairs_setting(pairs: tuple[Pair, ...], shipped: bool = False) -> tuple[Setting | None, str | None]:
    """(the setting all `pairs` were measured in, None) when they share one; else (None, why not, in words)."""
    if shipped:
        return None, (
            "the paper's pairs: their S were measured with the paper's own calibration prompts (which this project "
            "does not have), so no S measured here is in their setting"
        )
    unknown = [p.name for p in pairs if p.setting is None]
    if unknown:
        return None, (
            f"pair(s) {', '.join(unknown)} give S as a number, so the setting it was measured in is unknown "
            "(give each pair's sink_strength as the path of its *.strength.json)"
        )
    comparison = compare([p.name for p in pairs], [p.setting for p in pairs])
    if not comparison.comparable:
        return None, f"the pairs' S were measured in {len(comparison.groups)} different settings"
    return pairs[0].setting, None


def task_arrays(table: PairTable, task: str) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    rows = [p for p in table.pairs if task in p.deltas]
    return (
        tuple(p.name for p in rows),
        np.array([p.sink_strength for p in rows]),
        np.array([p.deltas[task] for p in rows]),
    )


def rounding_envelope(s: np.ndarray, d: np.ndarray, s_half: float, d_half: float) -> dict[str, list[float]]:
    """Range of loo_mae and baseline_mae over the corners of the rounding box of (S, delta), +-s_half and +-d_half:
    equal S move together (one reference LLM), each delta alone; not a bound over the whole box."""
    s, d = np.asarray(s, dtype=np.float64), np.asarray(d, dtype=np.float64)
    groups = np.unique(np.round(s, 12), return_inverse=True)[1]
    n_dims = int(groups.max()) + 1 + len(d)
    if 2**n_dims > 1 << 14:
        raise UserError(
            f"{2**n_dims} corners exceed the limit of {1 << 14}", "use fewer pairs for the rounding envelope"
        )
    names = tuple(str(i) for i in range(len(s)))
    loo, base = [], []
    for signs in itertools.product((-1.0, 1.0), repeat=n_dims):
        sg = np.array(signs)
        ss = s + s_half * sg[: groups.max() + 1][groups]
        dd = d + d_half * sg[groups.max() + 1 :]
        line, const = leave_one_out(ss, dd, names)
        loo.append(float(np.abs(dd - line).mean()))
        base.append(float(np.abs(dd - const).mean()))
    return {
        "loo_mae": [min(loo), max(loo)],
        "baseline_mae": [min(base), max(base)],
        "corners": 2**n_dims,
        "sink_strength_half_width": s_half,
        "delta_half_width": d_half,
    }


def fit_pairs(table: PairTable, seed: int = 0) -> FitResult:
    """Fit every task of the table; tasks with fewer than MIN_PAIRS pairs are skipped with a reason."""
    fits, skipped = {}, {}
    for task in sorted({t for p in table.pairs for t in p.deltas}):
        names, s, d = task_arrays(table, task)
        if len(names) < MIN_PAIRS:
            skipped[task] = f"{len(names)} pair(s) have a delta for this task; a fit needs at least {MIN_PAIRS}"
            continue
        fits[task] = fit_task(task, names, s, d, seed)
    if not fits:
        raise UserError(
            f"{table.source}: no task has deltas for at least {MIN_PAIRS} pairs",
            "give each pair deltas for the same task(s)",
        )
    envelope = None
    if table.reported is not None:  # the shipped table: its rounding, half a published digit either way
        halves = (table.reported["rounding"]["sink_strength"] / 2, table.reported["rounding"]["delta"] / 2)
        tasks = [t for t in table.reported["tasks"] if t in fits]
        envelope = {t: rounding_envelope(fits[t].sink_strength, fits[t].deltas, *halves) for t in tasks}
    settings = {task: pairs_setting(tuple(p for p in table.pairs if task in p.deltas), table.shipped) for task in fits}
    return FitResult(tasks=fits, skipped_tasks=skipped, table=table, rounding_envelope=envelope, settings=settings)


# ---------------------------------------------------------------------------- reports


_FIT_COLUMNS: tuple[tuple[str, Callable[[TaskFit], str]], ...] = (  # fit.md's columns after `task`
    ("pairs", lambda f: str(f.n_pairs)),
    ("spearman_rho", lambda f: f"{f.spearman_rho:.4f}"),
    ("permutation_p", lambda f: f"{f.permutation_p:.4f} ({f.permutation_method})"),
    ("p_one_sided", lambda f: f"{f.permutation_p_one_sided:.4f}"),
    ("slope", lambda f: f"{f.slope:.3f}"),
    ("intercept", lambda f: f"{f.intercept:.3f}"),
    ("loo_mae", lambda f: f"{f.loo_mae:.3f}"),
    ("baseline_mae", lambda f: f"{f.baseline_mae:.3f}"),
    (f"{PI_LEVEL:.0%} PI half-width at mean S", lambda f: f"{f.interval_half_width(f.s_mean):.2f}"),
    ("at the fitted ends", lambda f: f"{max(f.interval_half_width(f.s_min), f.interval_half_width(f.s_max)):.2f}"),
)
_REPORTED = {"reported_rho": "spearman_rho", "reported_loo_mae": "loo_mae", "reported_baseline_mae": "baseline_mae"}


def fit_table_markdown(result: FitResult) -> str:
    """One row per task, with the paper's figures beside ours when the shipped table was fitted."""
    rep = (result.table.reported or {}).get("tasks", {})
    head = ["task", *(name for name, _ in _FIT_COLUMNS), *(_REPORTED if rep else ())]
    rows = []
    for task, f in sorted(result.tasks.items()):
        paper = rep.get(task, {})
        reported = [f"{paper[k]:.2f}" if paper.get(k) is not None else "n/a" for k in _REPORTED.values()] if rep else []
        rows.append([task, *(cell(f) for _, cell in _FIT_COLUMNS), *reported])
    lines = markdown_lines(head, rows)
    for task, why in sorted(result.skipped_tasks.items()):
        lines.append(f"\n{task}: not fitted ({why})")
    return "\n".join([*lines, "", *fit_notes(result)]) + "\n"


def fit_notes(result: FitResult) -> list[str]:
    """What the columns are, and the setting of each task's pairs (a prediction needs S measured in it)."""
    lines = [
        "note: loo_mae / baseline_mae: mean absolute error on each pair left out of the fit (the line's / the mean's); "
        "a check of the fit, not an interval for a new model",
        f"note: a new model's predicted delta carries the {PI_LEVEL:.0%} prediction interval of the line (ordinary "
        "least squares, t with n - 2 degrees of freedom), which widens with the distance of its S from the pairs' "
        "mean S; outside the fitted S range it is an extrapolation",
    ]
    for task, (setting, why) in sorted(result.settings.items()):
        where = f"measured in one setting: {setting.describe()}" if setting is not None else why
        lines.append(f"note: {task} pairs: {where}")
    return lines
