"""Statistics behind the pre-registered screens (STUDY.md, "The screens").

Pure functions: no I/O, no tracking. Every interval is for a *paired* design,
paired by test case (accuracy) or by document (retention NLL); nothing here
treats tokens as independent.

- accuracy difference, paired by case: Tango's score interval (primary) and
  Newcombe's hybrid score interval (shown beside it);
- retention, paired by document: one-sided paired t upper bound of the
  document-weighted mean difference (the screen), and the token-weighted ratio
  estimate with a document-clustered standard error (shown beside it);
- speed: a plain ratio of seconds.

And what each screen could detect at its size (`balanced_table`,
`noninferiority_breakpoint`, `paired_se`, `documents_for_power`): the report
shows them beside every verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
from scipy import optimize, stats
from statsmodels.stats.proportion import proportion_confint

__all__ = [
    "PairedTable",
    "Interval",
    "UpperBound",
    "RatioBound",
    "paired_table",
    "tango_interval",
    "newcombe_interval",
    "paired_t_upper_bound",
    "ratio_difference_clustered",
    "speedup",
    "paired_se",
    "balanced_table",
    "noninferiority_breakpoint",
    "t_margin",
    "documents_for_power",
]


@dataclass(frozen=True)
class PairedTable:
    """Counts of paired binary outcomes of arms ``a`` and ``b`` on the same cases.

    ``n11``: both correct; ``n10``: only ``a`` correct; ``n01``: only ``b``
    correct; ``n00``: neither.
    """

    n11: int
    n10: int
    n01: int
    n00: int

    def __post_init__(self) -> None:
        for name in ("n11", "n10", "n01", "n00"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"PairedTable.{name} must be a non-negative integer, got {value!r}")

    @property
    def n(self) -> int:
        return self.n11 + self.n10 + self.n01 + self.n00

    @property
    def difference(self) -> float:
        """p_a - p_b = (n10 - n01) / n."""
        if self.n == 0:
            raise ValueError("empty paired table (n = 0): the difference is undefined")
        return (self.n10 - self.n01) / self.n


class Interval(NamedTuple):
    estimate: float
    lower: float
    upper: float


class UpperBound(NamedTuple):
    estimate: float
    upper: float


class RatioBound(NamedTuple):
    estimate: float
    se: float
    upper: float


def paired_table(a: Sequence[bool], b: Sequence[bool]) -> PairedTable:
    """Cross-tabulate paired outcomes; ``a[i]`` and ``b[i]`` are the same case.

    Outcomes must be real booleans: a verifier's partial credit (0.5) is truthy,
    so silently accepting numbers would count it as correct. Thresholding at 1.0
    is the caller's job.
    """
    a_list, b_list = list(a), list(b)
    if len(a_list) != len(b_list):
        raise ValueError(f"paired outcomes differ in length: {len(a_list)} vs {len(b_list)}")
    for side, values in (("a", a_list), ("b", b_list)):
        for i, v in enumerate(values):
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{side}[{i}] = {v!r} is not a bool")
    n11 = n10 = n01 = n00 = 0
    for x, y in zip(a_list, b_list):
        if x and y:
            n11 += 1
        elif x:
            n10 += 1
        elif y:
            n01 += 1
        else:
            n00 += 1
    return PairedTable(n11=n11, n10=n10, n01=n01, n00=n00)


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")


def _check_nonempty(table: PairedTable) -> None:
    if table.n == 0:
        raise ValueError("empty paired table (n = 0): no interval can be formed")


def _tango_restricted_p01(delta: float, n10: float, n01: float, n: float) -> float:
    """Restricted MLE of p01 given p10 - p01 = delta (Tango 1998, eq. 4).

    Positive root of 2n p^2 + B p + C = 0 with
    B = -n10 - n01 + (2n - n10 + n01) delta and C = -n01 delta (1 - delta).
    """
    b_coef = -n10 - n01 + (2.0 * n - n10 + n01) * delta
    c_coef = -n01 * delta * (1.0 - delta)
    # The discriminant is non-negative in exact arithmetic; clamp rounding.
    disc = max(b_coef * b_coef - 8.0 * n * c_coef, 0.0)
    return (-b_coef + math.sqrt(disc)) / (4.0 * n)


def _tango_sd(delta: float, n10: float, n01: float, n: float) -> float:
    """sqrt(n * Var) under delta, so Z(delta) = (n10 - n01 - n delta) / sd."""
    p01 = _tango_restricted_p01(delta, n10, n01, n)
    # Var of (n10 - n01)/n under the null is (p10 + p01 - delta^2)/n with
    # p10 = p01 + delta; clamp rounding near the boundaries where it is 0.
    return math.sqrt(n * max(2.0 * p01 + delta * (1.0 - delta), 0.0))


def tango_interval(table: PairedTable, level: float = 0.95) -> Interval:
    """Tango's (1998) asymptotic score interval for p_a - p_b, paired data.

    Reference: Tango T. Equivalence test and confidence interval for the
    difference in proportions for the paired-sample design. Stat Med 1998;
    17:891-908 (and the 1999 correction). The interval is the set of delta for
    which the score statistic

        Z(delta) = (n10 - n01 - n delta) / sqrt(n (2 p01~ + delta (1 - delta)))

    satisfies |Z| <= z_{(1+level)/2}, where p01~ is the MLE of p01 restricted to
    p10 - p01 = delta (closed form, a quadratic root). Z is decreasing in delta,
    so each limit is the single root of one side, found by ``brentq``.

    Two-sided at ``level``: the lower limit alone is a one-sided bound at
    (1 + level) / 2. With no discordant pairs the interval is not degenerate:
    it is +/- z^2 / (n + z^2).
    """
    _check_level(level)
    _check_nonempty(table)
    n, n10, n01 = float(table.n), float(table.n10), float(table.n01)
    z = float(stats.norm.ppf(0.5 + level / 2.0))
    est = (n10 - n01) / n

    # Root-find on numerator -/+ z * sd instead of Z -/+ z: both are finite at
    # delta = +/-1, where the variance vanishes and Z itself is infinite.
    def lower_fn(d: float) -> float:
        return (n10 - n01 - n * d) - z * _tango_sd(d, n10, n01, n)

    def upper_fn(d: float) -> float:
        return (n10 - n01 - n * d) + z * _tango_sd(d, n10, n01, n)

    # When the variance is 0 at the estimate (no discordant pairs, or all pairs
    # discordant one way) the root functions are 0 there too; start the bracket
    # just inside so brentq finds the real limit, not the estimate.
    step = 1e-12

    if table.n01 == table.n:
        lower = -1.0
    else:
        inner = est if lower_fn(est) < 0.0 else est - step
        lower = optimize.brentq(lower_fn, -1.0, inner, xtol=1e-13)
    if table.n10 == table.n:
        upper = 1.0
    else:
        inner = est if upper_fn(est) > 0.0 else est + step
        upper = optimize.brentq(upper_fn, inner, 1.0, xtol=1e-13)
    return Interval(est, float(lower), float(upper))


def newcombe_interval(table: PairedTable, level: float = 0.95) -> Interval:
    """Newcombe's (1998) method 10 for p_a - p_b, paired data.

    Reference: Newcombe RG. Improved confidence intervals for the difference
    between binomial proportions based on paired data. Stat Med 1998;
    17:2635-2650 (method 10; also Fagerland, Lydersen & Laake 2017, sec. 8.5,
    "Newcombe square-and-add").

    Hybrid score ("square-and-add") interval: with Wilson limits (l1, u1) for
    p_a and (l2, u2) for p_b,

        L = D - sqrt((p_a - l1)^2 - 2 phi (p_a - l1)(u2 - p_b) + (u2 - p_b)^2)
        U = D + sqrt((p_b - l2)^2 - 2 phi (p_b - l2)(u1 - p_a) + (u1 - p_a)^2)

    phi estimates the correlation of the two marginal proportions from the
    table; as in Newcombe's paper, its numerator n11 n00 - n10 n01 is reduced
    by n/2 when it exceeds n/2, set to 0 when it lies in [0, n/2], and kept
    when negative; phi = 0 when any margin is empty.
    """
    _check_level(level)
    _check_nonempty(table)
    n = table.n
    x_a, x_b = table.n11 + table.n10, table.n11 + table.n01
    p_a, p_b = x_a / n, x_b / n
    alpha = 1.0 - level
    l1, u1 = proportion_confint(x_a, n, alpha=alpha, method="wilson")
    l2, u2 = proportion_confint(x_b, n, alpha=alpha, method="wilson")

    margins = (x_a, n - x_a, x_b, n - x_b)
    if min(margins) == 0:
        phi = 0.0
    else:
        cross = table.n11 * table.n00 - table.n10 * table.n01
        if cross > n / 2:
            cross = cross - n / 2
        elif cross >= 0:
            cross = 0.0
        phi = cross / math.sqrt(float(np.prod(np.asarray(margins, dtype=float))))

    d_lo_a, d_hi_b = p_a - l1, u2 - p_b
    d_lo_b, d_hi_a = p_b - l2, u1 - p_a
    est = p_a - p_b
    # max(0, .) guards rounding only: |phi| <= 1 keeps both sums non-negative.
    lower = est - math.sqrt(max(d_lo_a**2 - 2 * phi * d_lo_a * d_hi_b + d_hi_b**2, 0.0))
    upper = est + math.sqrt(max(d_lo_b**2 - 2 * phi * d_lo_b * d_hi_a + d_hi_a**2, 0.0))
    return Interval(float(est), float(lower), float(upper))


def _finite_1d(values: Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite values")
    return arr


def paired_t_upper_bound(diffs: Sequence[float], level: float = 0.99) -> UpperBound:
    """One-sided upper confidence bound for the mean of per-document differences.

    Each document counts once (document-weighted), whatever its length:
    ``mean + t_{level, n-1} * s / sqrt(n)``. Documents, not tokens, are the
    independent units. Equals the upper end of
    ``scipy.stats.ttest_1samp(diffs, 0, alternative="less").confidence_interval(level)``.
    """
    _check_level(level)
    d = _finite_1d(diffs, "diffs")
    n = d.size
    if n < 2:
        raise ValueError(f"paired t bound needs at least 2 documents, got {n}")
    mean = float(d.mean())
    return UpperBound(mean, mean + t_margin(float(d.std(ddof=1)), n, level))


def ratio_difference_clustered(
    sum_diff: Sequence[float], tokens: Sequence[float], level: float = 0.99
) -> RatioBound:
    """Token-weighted mean NLL difference with a document-clustered SE.

    Inputs per document i: ``sum_diff[i]`` = sum over its tokens of
    (nll_a - nll_b), the same tokens scored by both models, and ``tokens[i]``,
    their count. The estimate is the ratio estimator

        R = sum_i sum_diff_i / sum_i tokens_i,

    i.e. (mean token NLL of a) - (mean token NLL of b) over all tokens. Its
    standard error treats documents as the sampled clusters and linearizes
    the ratio (delta method; Cochran, Sampling Techniques, 3rd ed., sec. 6.4):
    with residuals e_i = sum_diff_i - R tokens_i,

        se = sqrt(n / (n - 1) * sum_i e_i^2) / sum_i tokens_i.

    This equals the CR1 cluster-robust SE of a token-level intercept-only
    regression clustered by document (statsmodels' default small-sample
    factor for one regressor). The bound is one-sided: R + t_{level, n-1} se.
    """
    _check_level(level)
    num = _finite_1d(sum_diff, "sum_diff")
    den = _finite_1d(tokens, "tokens")
    if num.shape != den.shape:
        raise ValueError(f"sum_diff and tokens differ in length: {num.size} vs {den.size}")
    n = num.size
    if n < 2:
        raise ValueError(f"clustered SE needs at least 2 documents, got {n}")
    if np.any(den <= 0):
        raise ValueError("every document must have a positive token count")
    total = float(den.sum())
    est = float(num.sum()) / total
    resid = num - est * den
    se = math.sqrt(n / (n - 1) * float(np.sum(resid**2))) / total
    return RatioBound(est, se, est + float(stats.t.ppf(level, n - 1)) * se)


def speedup(control_seconds: float, compressed_seconds: float) -> float:
    """Speedup of compressed over control: control / compressed (> 1 is faster)."""
    for name, value in (("control_seconds", control_seconds), ("compressed_seconds", compressed_seconds)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return control_seconds / compressed_seconds


# --- sensitivity: what a screen could detect at its size ---------------------


def paired_se(table: PairedTable) -> float:
    """Unrestricted standard error of the paired difference (n10 - n01) / n:
    sqrt(((n10 + n01) / n - d^2) / n)."""
    _check_nonempty(table)
    d = table.difference
    return math.sqrt(max((table.n10 + table.n01) / table.n - d * d, 0.0) / table.n)


def balanced_table(n: int, k: int, accuracy: float = 0.5) -> PairedTable:
    """n cases, k discordant each way (difference 0), the concordant rest split
    at `accuracy` (Tango's interval does not depend on the split)."""
    if not 0 <= 2 * k <= n:
        raise ValueError(f"2k = {2 * k} discordant pairs do not fit in n = {n} cases")
    concordant = n - 2 * k
    both = round(concordant * accuracy)
    return PairedTable(n11=both, n10=k, n01=k, n00=concordant - both)


def noninferiority_breakpoint(n: int, margin: float, level: float = 0.95) -> int | None:
    """The smallest balanced discordance k (k cases only one model gets right,
    k only the other, difference 0) at which Tango's lower limit is at or below
    `margin`, so a non-inferiority screen (lower > margin) fails on n cases:
    0 when it fails even with full agreement, None when no k <= n // 2 fails it.

    At difference 0 the lower limit falls as k grows (the variance 2 p01 grows),
    so the first failing k is found by bisection."""
    _check_level(level)
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")

    def fails(k: int) -> bool:
        return tango_interval(balanced_table(n, k), level).lower <= margin

    if fails(0):
        return 0
    hi = n // 2
    if not fails(hi):
        return None
    lo = 0  # passes at lo, fails at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid
    return hi


def t_margin(sd: float, n: int, level: float = 0.99) -> float:
    """How far a one-sided paired t bound sits above the mean: t_{level, n-1} sd / sqrt(n)."""
    _check_level(level)
    if n < 2:
        raise ValueError(f"a paired t bound needs at least 2 documents, got {n}")
    return float(stats.t.ppf(level, n - 1)) * sd / math.sqrt(n)


def documents_for_power(sd: float, threshold: float, level: float = 0.99, power: float = 0.8, true_mean: float = 0.0, n_max: int = 1 << 20) -> int | None:
    """The fewest documents n at which a bound screen (mean + t_{level,n-1} sd/sqrt(n)
    < threshold) passes with probability `power` when the true mean is
    `true_mean`, approximately: (t_{level,n-1} + z_power) sd / sqrt(n) <= threshold - true_mean.
    None when no n up to n_max does (true_mean at or above the threshold)."""
    _check_level(level)
    _check_level(power)
    room = threshold - true_mean
    if room <= 0:
        return None
    if sd <= 0:
        return 2
    z = float(stats.norm.ppf(power))

    def enough(n: int) -> bool:
        return (float(stats.t.ppf(level, n - 1)) + z) * sd / math.sqrt(n) <= room

    hi = 2
    while not enough(hi):
        hi *= 2
        if hi > n_max:
            return None
    lo = max(hi // 2, 1)  # lo may be 1: not enough by definition
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid >= 2 and enough(mid):
            hi = mid
        else:
            lo = mid
    return hi
