"""What a paired comparison could have detected: minimum detectable difference, power, documents needed.

One model per design (Connor 1987 for a 0/1 outcome; Wilcoxon-scaled normal approximation for a continuous metric):
docs/buckets.md ("Power"). numpy/scipy only (imported when used), no I/O.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

ALPHA = 0.05  # two-sided
TARGET_POWER = 0.8
MIN_N = 10  # fewer paired docs: too few to tell (and per-type rows: too few to test)
DEFAULT_EFFECT_SHARE = 0.05  # the default effect: this share of the metric's range (5 points for a 0/1 metric)
MAX_N = 10**12  # paired docs: a difference that would need more is said to need more than this
WILCOXON_ARE = 3 / math.pi  # Wilcoxon signed-rank vs the paired mean test, normal differences (Hodges-Lehmann 1956)


def _z(p: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(p))


def _phi(x: float) -> float:
    from scipy.stats import norm

    return float(norm.cdf(x))


def _check_feasible(psi: float, delta: float) -> None:
    if not (0 <= psi <= 1 and abs(delta) <= psi + 1e-12):
        raise ValueError(f"a paired 0/1 difference {delta} needs a discordant share psi >= |delta| (psi {psi})")


def connor_power(n: int, psi: float, delta: float, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired-proportions test to detect a difference `delta` with `n` pairs and discordant
    share `psi` (Connor 1987); needs |delta| <= psi. psi = 0 never rejects (no discordant pair)."""
    _check_feasible(psi, delta)
    if psi == 0:
        return 0.0
    za, d = _z(1 - alpha / 2), abs(delta)
    floor, spread = za * math.sqrt(psi), math.sqrt(max(psi - d * d, 0.0))
    if spread == 0:  # psi = |delta| = 1: every pair discordant one way, no variance left
        return 1.0 if d * math.sqrt(n) > floor else 0.0
    return _phi((d * math.sqrt(n) - floor) / spread) + _phi((-d * math.sqrt(n) - floor) / spread)


def _smallest_n(power_at, start: float, power: float) -> int | None:
    """The smallest n >= 1 with power_at(n) >= power, for a power rising with n (None: more than `MAX_N`): bisection
    from the closed-form estimate `start`, a few dozen evaluations at any n."""
    hi = max(1, math.ceil(min(start, MAX_N))) if math.isfinite(start) else MAX_N
    lo = 0  # power_at(lo) < power (0 docs: none)
    while power_at(hi) < power:
        if hi >= MAX_N:
            return None
        lo, hi = hi, min(2 * hi, MAX_N)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if power_at(mid) >= power else (mid, hi)
    return hi


def connor_n(psi: float, delta: float, alpha: float = ALPHA, power: float = TARGET_POWER) -> int | None:
    """The fewest pairs at which `connor_power` reaches `power` for `delta` at discordant share `psi` (None: more
    than `MAX_N`)."""
    _check_feasible(psi, delta)
    za, zb, d = _z(1 - alpha / 2), _z(power), abs(delta)
    root = (za * math.sqrt(psi) + zb * math.sqrt(max(psi - d * d, 0.0))) / d if d else math.inf
    start = root * root  # inf past float range (`**` raises OverflowError there)
    return _smallest_n(lambda n: connor_power(n, psi, d, alpha), start, power)


def connor_mde(n: int, psi: float, alpha: float = ALPHA, power: float = TARGET_POWER) -> float | None:
    """The smallest difference at which `connor_power` reaches `power` with `n` pairs and discordant share `psi`,
    in (0, psi]; None when even delta = psi does not reach it (not detectable at this n)."""
    from scipy.optimize import brentq

    if psi <= 0 or connor_power(n, psi, psi, alpha) < power:
        return None
    return float(brentq(lambda d: connor_power(n, psi, d, alpha) - power, 0.0, psi, xtol=1e-14, rtol=1e-12))


def exact_mcnemar_power(n: int, psi: float, delta: float, alpha: float = ALPHA) -> float:
    """Power of the exact conditional McNemar test (`buckets.stats.mcnemar_exact`) by enumeration over the discordant
    pairs m ~ Binomial(n, psi) and, given m, the regressions ~ Binomial(m, (psi + delta) / (2 psi)); |delta| <= psi."""
    import numpy as np
    from scipy.stats import binom

    _check_feasible(psi, delta)
    if psi == 0:
        return 0.0
    m = np.arange(n + 1)
    j = binom.ppf(alpha / 2, m, 0.5)  # the smallest j with P(K <= j) >= alpha/2 under the null
    crit = np.where(2 * binom.cdf(j, m, 0.5) <= alpha * (1 + 1e-7), j, j - 1)  # largest j with 2 P(K <= j) <= alpha
    q = min(max((psi + delta) / (2 * psi), 0.0), 1.0)
    reject = np.where(crit >= 0, binom.cdf(crit, m, q) + binom.sf(m - crit - 1, m, q), 0.0)
    return float(np.sum(binom.pmf(m, n, psi) * reject))


def mean_power(n: int, sd: float, delta: float, alpha: float = ALPHA, efficiency: float = WILCOXON_ARE) -> float:
    """Power of a two-sided test of a paired difference `delta` (normal approximation from the sd of the
    differences; `efficiency` scales n: the Wilcoxon signed-rank test's 3/pi by default)."""
    za, shift = _z(1 - alpha / 2), abs(delta) * math.sqrt(n * efficiency) / sd
    return _phi(shift - za) + _phi(-shift - za)


def mean_n(sd: float, delta: float, alpha: float = ALPHA, power: float = TARGET_POWER) -> int | None:
    """The fewest pairs at which `mean_power` reaches `power` for `delta` (None: more than `MAX_N`)."""
    root = (_z(1 - alpha / 2) + _z(power)) * sd / abs(delta) if delta else math.inf
    start = root * root / WILCOXON_ARE  # inf past float range (`**` raises OverflowError there)
    return _smallest_n(lambda n: mean_power(n, sd, delta, alpha), start, power)


def mean_mde(n: int, sd: float, alpha: float = ALPHA, power: float = TARGET_POWER) -> float:
    """The smallest paired difference at which `mean_power` reaches `power` with `n` pairs."""
    from scipy.optimize import brentq

    top = (_z(1 - alpha / 2) + _z(power) + 1) * sd / math.sqrt(n * WILCOXON_ARE)  # power > target there
    return float(brentq(lambda d: mean_power(n, sd, d, alpha) - power, 0.0, top, xtol=1e-14, rtol=1e-12))


def default_effect(values: np.ndarray | None, declared: tuple[float, float] | None = None) -> tuple[float, str]:
    """The default effect in the metric's unit, and where it comes from: `DEFAULT_EFFECT_SHARE` of the metric's
    range: the declared one (data/benchmarks.yaml), else 0-1 when every value lies there, else the values' own."""
    import numpy as np

    if declared is not None:
        (lo, hi), where = declared, "the metric's range"
    else:
        v = np.asarray(values, dtype=np.float64)
        if not v.size:
            raise ValueError("the default effect needs the metric's values or its declared range")
        lo, hi = float(v.min()), float(v.max())
        (lo, hi), where = ((0.0, 1.0), "a 0-1 score's range") if lo >= 0 and hi <= 1 else ((lo, hi), "both runs' range")
    return DEFAULT_EFFECT_SHARE * (hi - lo), f"default: {DEFAULT_EFFECT_SHARE:.0%} of {where}, {lo:g} to {hi:g}"


def _base(binary: bool, n: int, outcome: str | None, alpha: float) -> dict[str, Any]:
    test = "exact McNemar (binomial on the discordant docs)" if binary else "Wilcoxon signed-rank"
    return {
        "method": "Connor (1987) normal approximation for paired proportions, conditional on the observed discordant "
        "share"
        if binary
        else "normal approximation from the sd of the per-doc differences, n scaled by the Wilcoxon test's asymptotic "
        "relative efficiency 3/pi (normal differences)",
        "test": test + (f" of {outcome}" if outcome else ""),
        "alpha": alpha,
        "target_power": TARGET_POWER,
        "n": n,
        "unit": "share of docs (x100: points)" if binary else "the metric's own unit",
        "effect": None,
        "effect_shown": None,
        "effect_source": None,
        "discordant_share": None,
        "sd_difference": None,
        "mde": None,
        "not_detectable": None,
        "n_for_mde": None,
        "power_at_mde_exact": None,
        "power_at_effect": None,
        "power_at_effect_exact": None,
        "n_for_effect": None,
        "effect_impossible": None,
        "too_few": None,
    }


def comparison_power(
    kind: str,
    differences: np.ndarray,
    effect: float | None = None,
    *,
    values: np.ndarray | None = None,
    declared_range: tuple[float, float] | None = None,
    outcome: str | None = None,
    alpha: float = ALPHA,
) -> dict[str, Any]:
    """The record buckets.json keeps as `power`: what a paired comparison could detect, from its per-doc differences
    (candidate minus reference; `kind` binary: -1 / 0 / +1, `effect` in points, `outcome` a 0/1 outcome other than the
    metric; continuous: `effect` in the metric's unit). `effect` None: `default_effect` for the metric's scale."""
    import numpy as np

    d = np.asarray(differences, dtype=np.float64)
    n, binary = int(d.size), kind == "binary"
    out = _base(binary, n, outcome, alpha)
    scale = 100.0 if binary else 1.0
    if effect is None:
        shown, source = default_effect(values, (0.0, 1.0) if binary else declared_range)
        shown *= scale
    else:
        shown, source = float(effect), "--effect"
    out.update(effect=shown / scale, effect_shown=shown, effect_source=source)
    if binary:
        psi = float(np.count_nonzero(d)) / n if n else 0.0
        out["discordant_share"] = psi
        if n < MIN_N or psi == 0:
            out["too_few"] = too_few(n, "no doc where the runs disagree" if n >= MIN_N else None)
            return out
        out.update(_binary_figures(n, psi, out["effect"], alpha))
        return out
    sd = float(d.std(ddof=1)) if n > 1 else 0.0
    out["sd_difference"] = sd
    if n < MIN_N or sd == 0:
        out["too_few"] = too_few(n, "the per-doc differences do not vary" if n >= MIN_N else None)
        return out
    delta = out["effect"]
    out.update(
        mde=mean_mde(n, sd, alpha),
        power_at_effect=mean_power(n, sd, delta, alpha),
        n_for_effect=mean_n(sd, delta, alpha),
    )
    return out


def _binary_figures(n: int, psi: float, delta: float, alpha: float) -> dict[str, Any]:
    """MDE, power at the effect and documents needed of a 0/1 comparison at level `alpha`, all at the observed
    discordant share."""
    out: dict[str, Any] = {}
    mde = connor_mde(n, psi, alpha)
    if mde is None:
        out["n_for_mde"] = connor_n(psi, psi, alpha)
        at_most = connor_power(n, psi, psi, alpha)
        out["not_detectable"] = (
            f"not detectable at this n: even a difference as large as the discordant share ({100 * psi:.1f} points, "
            f"every disagreeing doc one way) has power {at_most:.0%}; {out['n_for_mde']} paired "
            f"docs at this discordant share would make it detectable"
        )
    else:
        out.update(mde=mde, power_at_mde_exact=exact_mcnemar_power(n, psi, mde, alpha))
    if delta > psi:
        out["effect_impossible"] = (
            f"a difference of {100 * delta:g} points needs at least {100 * delta:g}% of the docs to disagree; "
            f"{100 * psi:.1f}% do"
        )
        return out
    out.update(
        power_at_effect=connor_power(n, psi, delta, alpha),
        power_at_effect_exact=exact_mcnemar_power(n, psi, delta, alpha),
        n_for_effect=connor_n(psi, delta, alpha),
    )
    return out


def too_few(n: int, why: str | None = None) -> str:
    """The "too few to tell" sentence: `why`, else the number of paired docs against `MIN_N`."""
    return "too few to tell: " + (why or f"{n} paired docs (at least {MIN_N} are needed)")
