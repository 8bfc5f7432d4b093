"""What a paired comparison could have detected: minimum detectable difference, power, documents needed.

A delta of -20 points over 5 prompts and one over 500 read the same in a table; what tells them apart is
what each comparison could have detected. For the paired designs `buckets` tests:

- a 0/1 metric per doc (McNemar): Connor's (1987) normal approximation for paired proportions
  (R. J. Connor, "Sample size for testing differences in proportions for the paired-sample design",
  Biometrics 43(1):207-211, p. 209), from the discordant share psi (docs where the runs disagree) and the
  difference delta = p10 - p01 (regressions minus recoveries, as shares of docs):
      n = ((z_{1-a/2} sqrt(psi) + z_{1-b} sqrt(psi - delta^2)) / delta)^2
      power = Phi((delta sqrt(n) - z_{1-a/2} sqrt(psi)) / sqrt(psi - delta^2)) + (the same with -delta)
  and the minimum detectable difference solves the first for delta at the run's n. `buckets` itself runs
  the exact conditional McNemar test (binomial on the discordant pairs), which is conservative at small
  counts: `exact_mcnemar_power` gives that test's power by enumeration, always at most Connor's.
- a continuous metric: the paired mean difference under a normal approximation, from the standard
  deviation sd of the per-doc differences: mde = (z_{1-a/2} + z_{1-b}) sd / sqrt(n).

psi = 0 (sd = 0) or fewer than `MIN_N` paired docs give "too few to tell": the variance the formulas need
is not estimable. Values are in the metric's own unit (shares of docs for a 0/1 metric, as in
buckets.json; x100 is points). numpy/scipy only (imported when used: the CLI reads the defaults), no I/O.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

ALPHA = 0.05  # two-sided
TARGET_POWER = 0.8
MIN_N = 10  # fewer paired docs: too few to tell (and per-type rows: too few to test)
DEFAULT_EFFECT_POINTS = 5.0  # the drop `--effect` asks about, in points


def _z(p: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(p))


def _phi(x: float) -> float:
    from scipy.stats import norm

    return float(norm.cdf(x))


def connor_power(n: int, psi: float, delta: float, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired-proportions test to detect a difference `delta` with `n` pairs and discordant
    share `psi` (Connor 1987); needs psi > delta^2."""
    za, d = _z(1 - alpha / 2), abs(delta)
    spread, floor = math.sqrt(psi - d * d), za * math.sqrt(psi)
    return _phi((d * math.sqrt(n) - floor) / spread) + _phi((-d * math.sqrt(n) - floor) / spread)


def connor_n(psi: float, delta: float, alpha: float = ALPHA, power: float = TARGET_POWER) -> int:
    """Pairs needed to detect `delta` at `power` with discordant share `psi` (Connor 1987), rounded up."""
    za, zb, d = _z(1 - alpha / 2), _z(power), abs(delta)
    return math.ceil(((za * math.sqrt(psi) + zb * math.sqrt(psi - d * d)) / d) ** 2 - 1e-9)


def connor_mde(n: int, psi: float, alpha: float = ALPHA, power: float = TARGET_POWER) -> float:
    """The smallest difference detectable at `power` with `n` pairs and discordant share `psi`: the root in
    (0, sqrt(psi)) of delta sqrt(n) = z_{1-a/2} sqrt(psi) + z_{1-b} sqrt(psi - delta^2)."""
    from scipy.optimize import brentq

    za, zb = _z(1 - alpha / 2), _z(power)

    def gap(d: float) -> float:
        return d * math.sqrt(n) - za * math.sqrt(psi) - zb * math.sqrt(max(psi - d * d, 0.0))

    return float(brentq(gap, 0.0, math.sqrt(psi), xtol=1e-12))


def exact_mcnemar_power(n: int, psi: float, delta: float, alpha: float = ALPHA) -> float:
    """Power of the exact conditional McNemar test (`buckets.mcnemar_exact`: two-sided binomial test of the
    discordant pairs against 1/2) by enumeration: the number of discordant pairs m ~ Binomial(n, psi), and given
    m the regressions ~ Binomial(m, (psi + delta) / (2 psi)); needs |delta| <= psi."""
    import numpy as np
    from scipy.stats import binom

    m = np.arange(n + 1)
    j = binom.ppf(alpha / 2, m, 0.5)  # the smallest j with P(K <= j) >= alpha/2 under the null
    crit = np.where(2 * binom.cdf(j, m, 0.5) <= alpha * (1 + 1e-7), j, j - 1)  # largest j with 2 P(K <= j) <= alpha
    q = (psi + delta) / (2 * psi)
    reject = np.where(crit >= 0, binom.cdf(crit, m, q) + binom.sf(m - crit - 1, m, q), 0.0)
    return float(np.sum(binom.pmf(m, n, psi) * reject))


def mean_power(n: int, sd: float, delta: float, alpha: float = ALPHA) -> float:
    """Power of a two-sided test of a paired mean difference `delta` (normal approximation, sd of the differences)."""
    za, shift = _z(1 - alpha / 2), abs(delta) * math.sqrt(n) / sd
    return _phi(shift - za) + _phi(-shift - za)


def mean_n(sd: float, delta: float, alpha: float = ALPHA, power: float = TARGET_POWER) -> int:
    """Pairs needed to detect a paired mean difference `delta` at `power`, rounded up."""
    return math.ceil(((_z(1 - alpha / 2) + _z(power)) * sd / abs(delta)) ** 2 - 1e-9)


def mean_mde(n: int, sd: float, alpha: float = ALPHA, power: float = TARGET_POWER) -> float:
    """The smallest paired mean difference detectable at `power` with `n` pairs."""
    return (_z(1 - alpha / 2) + _z(power)) * sd / math.sqrt(n)


def _base(kind: str, n: int, effect: float, scale: float) -> dict[str, Any]:
    binary = kind == "binary"
    return {
        "method": "Connor (1987) normal approximation for paired proportions, from the observed discordant share"
        if binary
        else "normal approximation for a paired mean difference, from the sd of the per-doc differences",
        "alpha": ALPHA,
        "target_power": TARGET_POWER,
        "n": n,
        "effect": effect / scale,
        "effect_shown": effect,
        "unit": "share of docs (x100: points)" if binary else "the metric's own unit",
        "discordant_share": None,
        "sd_difference": None,
        "mde": None,
        "power_at_effect": None,
        "power_at_effect_exact": None,
        "n_for_effect": None,
        "discordant_share_assumed": None,
        "too_few": None,
    }


def comparison_power(kind: str, differences: np.ndarray, effect: float = DEFAULT_EFFECT_POINTS) -> dict[str, Any]:
    """What a paired comparison could detect, from its per-doc differences (candidate minus reference).

    `kind` binary: differences are -1 / 0 / +1 and `effect` is in points (a drop of `effect` / 100 as a share of
    docs); continuous: `effect` is in the metric's unit. Returns the record buckets.json keeps as `power`.
    """
    import numpy as np

    d = np.asarray(differences, dtype=np.float64)
    n, binary = int(d.size), kind == "binary"
    out = _base(kind, n, effect, 100.0 if binary else 1.0)
    delta = out["effect"]
    if binary:
        psi = float(np.count_nonzero(d)) / n if n else 0.0
        out["discordant_share"] = psi
        if n < MIN_N or psi == 0:
            out["too_few"] = _too_few(n, "no doc where the runs disagree" if n >= MIN_N else None)
            return out
        assumed = max(psi, delta)  # a drop of delta needs at least that share of discordant docs
        out["discordant_share_assumed"] = assumed if assumed != psi else None
        out.update(
            mde=connor_mde(n, psi),
            power_at_effect=connor_power(n, assumed, delta),
            power_at_effect_exact=exact_mcnemar_power(n, assumed, delta),
            n_for_effect=connor_n(assumed, delta),
        )
        return out
    sd = float(d.std(ddof=1)) if n > 1 else 0.0
    out["sd_difference"] = sd
    if n < MIN_N or sd == 0:
        out["too_few"] = _too_few(n, "the per-doc differences do not vary" if n >= MIN_N else None)
        return out
    out.update(mde=mean_mde(n, sd), power_at_effect=mean_power(n, sd, delta), n_for_effect=mean_n(sd, delta))
    return out


def _too_few(n: int, why: str | None) -> str:
    return "too few to tell: " + (why or f"{n} paired docs (at least {MIN_N} are needed)")
