"""Tests for analysis.stats: hand computations, published examples, libraries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import statsmodels.api as sm
from scipy import optimize, stats

from analysis.stats import (
    PairedTable,
    balanced_table,
    documents_for_power,
    newcombe_interval,
    noninferiority_breakpoint,
    paired_se,
    paired_t_upper_bound,
    paired_table,
    ratio_difference_clustered,
    speedup,
    t_margin,
    tango_interval,
)

Z95 = stats.norm.ppf(0.975)

# Cavo et al. (2012) complete response before/after consolidation therapy, the
# paired 2x2 example of Fagerland, Lydersen & Laake, "Statistical Analysis of
# Contingency Tables" (2017), ch. 8: [[59, 6], [16, 80]], estimate -0.0621.
# Published 95% limits (4 decimals): Tango -0.1240 to -0.0054;
# Newcombe square-and-add -0.1186 to -0.0046.
CAVO = PairedTable(n11=59, n10=6, n01=16, n00=80)


# --- paired_table -----------------------------------------------------------


def test_paired_table_counts_each_cell():
    a = [True, True, True, False, False, True, False]
    b = [True, False, True, True, False, False, False]
    t = paired_table(a, b)
    assert (t.n11, t.n10, t.n01, t.n00) == (2, 2, 1, 2)
    assert t.n == 7
    assert t.difference == pytest.approx((2 - 1) / 7)


def test_paired_table_accepts_numpy_bools():
    t = paired_table(np.array([True, False]), np.array([False, False]))
    assert (t.n11, t.n10, t.n01, t.n00) == (0, 1, 0, 1)


def test_paired_table_rejects_length_mismatch():
    with pytest.raises(ValueError, match="length"):
        paired_table([True], [True, False])


def test_paired_table_rejects_partial_credit():
    # 0.5 is truthy; counting it as correct would inflate accuracy.
    with pytest.raises(TypeError):
        paired_table([0.5, 1.0], [True, False])


def test_paired_table_rejects_negative_count():
    with pytest.raises(ValueError):
        PairedTable(n11=1, n10=-1, n01=0, n00=0)


# --- Newcombe ---------------------------------------------------------------


def _wilson(x: int, n: int, z: float) -> tuple[float, float]:
    p = x / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    denom = 1 + z * z / n
    return (centre - half) / denom, (centre + half) / denom


def _newcombe_by_hand(n11, n10, n01, n00, z):
    n = n11 + n10 + n01 + n00
    xa, xb = n11 + n10, n11 + n01
    pa, pb = xa / n, xb / n
    l1, u1 = _wilson(xa, n, z)
    l2, u2 = _wilson(xb, n, z)
    cross = n11 * n00 - n10 * n01
    adj = cross - n / 2 if cross > n / 2 else (0.0 if cross >= 0 else cross)
    phi = adj / math.sqrt(xa * (n - xa) * xb * (n - xb))
    d = pa - pb
    lo = d - math.sqrt((pa - l1) ** 2 - 2 * phi * (pa - l1) * (u2 - pb) + (u2 - pb) ** 2)
    hi = d + math.sqrt((pb - l2) ** 2 - 2 * phi * (pb - l2) * (u1 - pa) + (u1 - pa) ** 2)
    return d, lo, hi


@pytest.mark.parametrize(
    "cells",
    [
        (10, 5, 2, 13),  # cross 120 > n/2: phi numerator reduced by n/2
        (3, 4, 5, 2),  # cross -14 < 0: phi numerator kept
        (2, 3, 1, 2),  # cross 1 in [0, n/2]: phi set to 0
    ],
)
def test_newcombe_matches_wilson_hand_computation(cells):
    got = newcombe_interval(PairedTable(*cells))
    want = _newcombe_by_hand(*cells, Z95)
    assert got == pytest.approx(want, abs=1e-12)


def test_newcombe_published_cavo_example():
    est, lo, hi = newcombe_interval(CAVO)
    assert est == pytest.approx(-0.0621, abs=5e-5)
    assert lo == pytest.approx(-0.1186, abs=5e-5)
    assert hi == pytest.approx(-0.0046, abs=5e-5)


def test_newcombe_level_widens_interval():
    t = PairedTable(10, 5, 2, 13)
    _, lo90, hi90 = newcombe_interval(t, level=0.90)
    _, lo99, hi99 = newcombe_interval(t, level=0.99)
    assert lo99 < lo90 and hi99 > hi90


# --- Tango ------------------------------------------------------------------


def test_tango_published_cavo_example():
    est, lo, hi = tango_interval(CAVO)
    assert est == pytest.approx(-0.0621, abs=5e-5)
    assert lo == pytest.approx(-0.1240, abs=5e-5)
    assert hi == pytest.approx(-0.0054, abs=5e-5)


def _score_by_numeric_mle(t: PairedTable, delta: float) -> float:
    """Tango's Z with p01 restricted by maximizing the multinomial likelihood
    numerically, independent of the closed-form root used in the module."""
    n, concordant = t.n, t.n11 + t.n00

    def neg_loglik(p01: float) -> float:
        p10 = p01 + delta
        pc = 1 - 2 * p01 - delta
        return -(t.n10 * math.log(p10) + t.n01 * math.log(p01) + concordant * math.log(pc))

    lo, hi = max(0.0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12
    p01 = optimize.minimize_scalar(neg_loglik, bounds=(lo, hi), method="bounded",
                                   options={"xatol": 1e-12}).x
    return (t.n10 - t.n01 - n * delta) / math.sqrt(n * (2 * p01 + delta * (1 - delta)))


@pytest.mark.parametrize("cells", [(59, 6, 16, 80), (1, 1, 7, 12), (20, 9, 3, 8), (4, 2, 1, 0)])
def test_tango_limits_are_where_score_statistic_hits_z(cells):
    t = PairedTable(*cells)
    _, lo, hi = tango_interval(t)
    assert _score_by_numeric_mle(t, lo) == pytest.approx(Z95, abs=1e-4)
    assert _score_by_numeric_mle(t, hi) == pytest.approx(-Z95, abs=1e-4)


def test_tango_no_discordant_pairs_closed_form():
    # With n10 = n01 = 0, Z(delta)^2 = n |delta| / (1 - |delta|), so the
    # limits are +/- z^2 / (n + z^2), not a zero-width interval.
    t = PairedTable(n11=7, n10=0, n01=0, n00=3)
    est, lo, hi = tango_interval(t)
    bound = Z95**2 / (10 + Z95**2)
    assert est == 0.0
    assert lo == pytest.approx(-bound, abs=1e-10)
    assert hi == pytest.approx(bound, abs=1e-10)


def test_tango_all_discordant_one_way_closed_form():
    # n10 = n: Z(delta)^2 = n (1 - delta) / (1 + delta), lower = (n - z^2)/(n + z^2).
    n = 10
    est, lo, hi = tango_interval(PairedTable(0, n, 0, 0))
    assert (est, hi) == (1.0, 1.0)
    assert lo == pytest.approx((n - Z95**2) / (n + Z95**2), abs=1e-10)
    est, lo, hi = tango_interval(PairedTable(0, 0, n, 0))
    assert (est, lo) == (-1.0, -1.0)
    assert hi == pytest.approx(-(n - Z95**2) / (n + Z95**2), abs=1e-10)


@pytest.mark.parametrize("method", [tango_interval, newcombe_interval])
def test_swapping_arms_negates_interval(method):
    est, lo, hi = method(PairedTable(20, 9, 3, 8))
    est2, lo2, hi2 = method(PairedTable(20, 3, 9, 8))
    assert (est2, lo2, hi2) == pytest.approx((-est, -hi, -lo), abs=1e-10)


@pytest.mark.parametrize("method", [tango_interval, newcombe_interval])
def test_empty_table_raises(method):
    with pytest.raises(ValueError, match="n = 0"):
        method(PairedTable(0, 0, 0, 0))


@pytest.mark.parametrize("method", [tango_interval, newcombe_interval])
@pytest.mark.parametrize("level", [0.0, 1.0, 95])
def test_bad_level_raises(method, level):
    with pytest.raises(ValueError, match="level"):
        method(CAVO, level=level)


# --- paired t bound -----------------------------------------------------------


def test_paired_t_matches_scipy_one_sided_interval():
    rng = np.random.default_rng(0)
    diffs = rng.normal(0.01, 0.03, size=37)
    mean, upper = paired_t_upper_bound(diffs, level=0.99)
    ci = stats.ttest_1samp(diffs, 0.0, alternative="less").confidence_interval(0.99)
    assert mean == pytest.approx(diffs.mean(), rel=1e-12)
    assert upper == pytest.approx(ci.high, rel=1e-12)


def test_paired_t_two_documents_by_hand():
    # mean 0.5, s = sqrt(0.5), se = 0.5; t_{0.99, 1} = 31.821 (table value).
    mean, upper = paired_t_upper_bound([0.0, 1.0], level=0.99)
    assert mean == 0.5
    assert upper == pytest.approx(0.5 + 31.821 * 0.5, abs=1e-3)


@pytest.mark.parametrize("diffs", [[], [0.1], [0.1, float("nan")]])
def test_paired_t_rejects_bad_input(diffs):
    with pytest.raises(ValueError):
        paired_t_upper_bound(diffs)


# --- clustered ratio -----------------------------------------------------------


def test_ratio_matches_statsmodels_cluster_robust_ols():
    # Token-level intercept-only OLS clustered by document gives the same
    # estimate (token mean), SE and t(G-1) bound as the ratio estimator.
    rng = np.random.default_rng(1)
    tokens = rng.integers(5, 60, size=12)
    token_diffs = [rng.normal(0.02 * (i % 3), 0.1, size=k) for i, k in enumerate(tokens)]
    sums = [float(d.sum()) for d in token_diffs]
    est, se, upper = ratio_difference_clustered(sums, tokens, level=0.99)

    y = np.concatenate(token_diffs)
    groups = np.repeat(np.arange(tokens.size), tokens)
    fit = sm.OLS(y, np.ones_like(y)).fit(cov_type="cluster", cov_kwds={"groups": groups}, use_t=True)
    assert est == pytest.approx(fit.params[0], rel=1e-10)
    assert se == pytest.approx(fit.bse[0], rel=1e-10)
    # A two-sided 98% interval's upper end is the one-sided 99% bound.
    assert upper == pytest.approx(fit.conf_int(alpha=0.02)[0, 1], rel=1e-10)


def test_ratio_by_hand_two_documents():
    # R = 4/2 = 2; residuals -1, +1; se = sqrt(2/1 * 2) / 2 = 1.
    est, se, upper = ratio_difference_clustered([1.0, 3.0], [1, 1], level=0.99)
    assert (est, se) == pytest.approx((2.0, 1.0))
    assert upper == pytest.approx(2.0 + stats.t.ppf(0.99, 1))


def test_ratio_weights_documents_by_tokens():
    # Per-token means 0.1 (1 token) and 0.0 (9 tokens): token-weighted 0.01,
    # whereas the document-weighted mean would be 0.05.
    est, _, _ = ratio_difference_clustered([0.1, 0.0], [1, 9])
    assert est == pytest.approx(0.01)


@pytest.mark.parametrize(
    "sums, tokens",
    [([0.1], [3]), ([0.1, 0.2], [3]), ([0.1, 0.2], [3, 0]), ([0.1, float("inf")], [3, 4])],
)
def test_ratio_rejects_bad_input(sums, tokens):
    with pytest.raises(ValueError):
        ratio_difference_clustered(sums, tokens)


# --- speedup ----------------------------------------------------------------


def test_speedup_is_control_over_compressed():
    assert speedup(110.0, 100.0) == pytest.approx(1.10)


@pytest.mark.parametrize("control, compressed", [(0.0, 1.0), (1.0, 0.0), (-1.0, 2.0), (1.0, float("nan"))])
def test_speedup_rejects_non_positive(control, compressed):
    with pytest.raises(ValueError):
        speedup(control, compressed)


# --- sensitivity ----------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(128, 1), (256, 6), (512, 30), (1024, 122)])
def test_breakpoint_is_the_first_balanced_discordance_that_fails(n, k):
    # At 128 cases one discordant case each way fails a -3 point margin; at 512, 29 each way still pass.
    assert noninferiority_breakpoint(n, -0.03, 0.95) == k
    assert tango_interval(balanced_table(n, k)).lower <= -0.03 < tango_interval(balanced_table(n, k - 1)).lower


def test_breakpoint_edges():
    # -z^2 / (n + z^2) is the lower limit with full agreement: -3.70 points at n = 100.
    assert noninferiority_breakpoint(100, -0.03) == 0
    assert noninferiority_breakpoint(64, -0.99) is None
    with pytest.raises(ValueError):
        noninferiority_breakpoint(0, -0.03)


def test_balanced_table_has_no_difference_and_tango_ignores_the_split():
    t = balanced_table(100, 7, accuracy=0.3)
    assert (t.n, t.n10, t.n01, t.difference) == (100, 7, 7, 0.0) and t.n11 == round(86 * 0.3)
    assert tango_interval(t) == pytest.approx(tango_interval(balanced_table(100, 7, accuracy=0.9)))
    with pytest.raises(ValueError, match="do not fit"):
        balanced_table(10, 6)


def test_paired_se_by_hand():
    t = PairedTable(n11=6, n10=14, n01=4, n00=104)
    d = 10 / 128
    assert paired_se(t) == pytest.approx(math.sqrt((18 / 128 - d * d) / 128))
    assert paired_se(balanced_table(100, 0)) == 0.0


def test_t_margin_is_the_bounds_distance_from_the_mean():
    diffs = np.random.default_rng(3).normal(0.01, 0.1, 40)
    bound = paired_t_upper_bound(diffs, 0.99)
    assert t_margin(float(np.std(diffs, ddof=1)), 40, 0.99) == pytest.approx(bound.upper - bound.estimate)
    # 128 documents at sd 0.1: the bound alone sits 0.0208 nats above the mean, more than 0.02.
    assert t_margin(0.1, 128, 0.99) == pytest.approx(stats.t.ppf(0.99, 127) * 0.1 / math.sqrt(128)) and t_margin(0.1, 128) > 0.02


@pytest.mark.parametrize("sd", [0.05, 0.1, 0.2])
def test_documents_for_power_is_the_fewest_that_suffice(sd):
    n = documents_for_power(sd, 0.02, 0.99, 0.8)
    need = lambda m: (stats.t.ppf(0.99, m - 1) + stats.norm.ppf(0.8)) * sd / math.sqrt(m)
    assert need(n) <= 0.02 < need(n - 1)
    assert documents_for_power(0.1, 0.02, true_mean=0.02) is None
    assert documents_for_power(0.0, 0.02) == 2
