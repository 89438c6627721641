"""Each screen against hand-computed cases: one that passes, one that fails."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest
from scipy import stats as sps

from analysis import screens as sc
from analysis.stats import PairedTable, newcombe_interval, tango_interval
from coopstudy.config import ScreensConfig

CFG = ScreensConfig()  # the frozen plan's thresholds: +10 pts, +0.02 nats at 99%, -3 pts at 95%, 1.10x


def _pairs(n11: int, n10: int, n01: int, n00: int) -> tuple[list[bool], list[bool]]:
    """Outcomes of models a and b that form this paired table."""
    a = [True] * n11 + [True] * n10 + [False] * n01 + [False] * n00
    b = [True] * n11 + [False] * n10 + [True] * n01 + [False] * n00
    return a, b


def _cases(outcomes: dict[str, list[bool]], partial: set[int] = frozenset()) -> pd.DataFrame:
    """A tidy case table; cases listed in `partial` get score 0.5 (not correct) for every model."""
    rows = []
    for model, correct in outcomes.items():
        for i, ok in enumerate(correct):
            score = 0.5 if i in partial else float(ok)
            rows.append({"model": model, "run_id": f"run-{model}", "case_id": f"c{i}", "family": ("gcd", "products")[i % 2],
                         "score": score, "correct": score >= 1.0})
    return pd.DataFrame(rows)


def _gain_cases(n11: int, n10: int, n01: int, n00: int) -> pd.DataFrame:
    compressed, seed = _pairs(n11, n10, n01, n00)
    return _cases({"seed": seed, "control": compressed, "compressed": compressed})


def _noninf_cases(n11: int, n10: int, n01: int, n00: int) -> pd.DataFrame:
    compressed, control = _pairs(n11, n10, n01, n00)
    return _cases({"seed": [False] * len(compressed), "control": control, "compressed": compressed})


# --- screen 1: accuracy gain over the seed ----------------------------------


def test_accuracy_gain_passes_on_the_point_estimate():
    # 20 cases: compressed right on 16, seed on 11 -> +5/20 = +25 points.
    s = sc.accuracy_gain(_gain_cases(10, 6, 1, 3), CFG)
    assert s.estimate == pytest.approx(0.25)
    assert s.details["accuracy_compressed"] == pytest.approx(16 / 20)
    assert s.details["accuracy_seed"] == pytest.approx(11 / 20)
    assert s.details["paired_table"] == {"both_correct": 10, "only_compressed": 6, "only_seed": 1, "neither": 3}
    assert s.passed and s.verdict == "pass" and s.decided_on == "estimate" and s.bound is None
    table = PairedTable(10, 6, 1, 3)
    assert s.interval == pytest.approx(tuple(tango_interval(table, 0.95)[1:]))
    assert s.details["newcombe_interval"] == pytest.approx(list(newcombe_interval(table, 0.95)[1:]))
    assert s.details["tango_lower_clears_threshold"] is (s.interval[0] >= 0.10)
    assert s.run_ids == {"evaluate/compressed": "run-compressed", "evaluate/seed": "run-seed"}


def test_accuracy_gain_of_exactly_ten_points_passes():
    # "at least 10 points": 3 - 1 = 2 of 20 cases is exactly +0.10.
    s = sc.accuracy_gain(_gain_cases(5, 3, 1, 11), CFG)
    assert s.estimate == 0.10
    assert s.passed
    assert s.details["tango_lower_clears_threshold"] is False


def test_accuracy_gain_fails_below_ten_points():
    # Cavo et al. (Fagerland et al. 2017, ch. 8) with the arms swapped:
    # +0.0621, Tango [0.0054, 0.1240], Newcombe [0.0046, 0.1186].
    s = sc.accuracy_gain(_gain_cases(59, 16, 6, 80), CFG)
    assert s.estimate == pytest.approx(10 / 161)
    assert s.interval == pytest.approx((0.0054, 0.1240), abs=5e-5)
    assert s.details["newcombe_interval"] == pytest.approx([0.0046, 0.1186], abs=5e-5)
    assert not s.passed and s.verdict == "fail"


def test_partial_credit_is_not_correct():
    # Compressed "solves" 4 cases only with partial credit: they count for nobody.
    compressed, seed = _pairs(0, 4, 0, 16)
    s = sc.accuracy_gain(_cases({"seed": seed, "control": compressed, "compressed": compressed}, partial={0, 1, 2, 3}), CFG)
    assert s.estimate == 0.0
    assert not s.passed


@pytest.mark.parametrize("given", [0.5, float("nan")])
def test_a_correct_column_that_is_not_boolean_is_refused_not_taken_as_truthy(given):
    # Before, the screen made each value a bool first: 0.5 and NaN counted as correct.
    cases = _cases({"seed": [False] * 20, "control": [False] * 20, "compressed": [False] * 20})
    cases["correct"] = cases["correct"].astype(object)
    cases.loc[(cases["model"] == "compressed") & (cases["case_id"] == "c3"), "correct"] = given
    with pytest.raises(TypeError, match=f"= {given!r} is not a bool"):
        sc.accuracy_gain(cases, CFG)


# --- screen 3: non-inferiority against the control ---------------------------


def test_noninferiority_fails_on_the_published_lower_limit():
    # Cavo: compressed - control = -0.0621, Tango 95% [-0.1240, -0.0054];
    # the lower limit is below -3 points.
    s = sc.noninferiority(_noninf_cases(59, 6, 16, 80), CFG)
    assert s.estimate == pytest.approx(-10 / 161)
    assert s.bound == pytest.approx(-0.1240, abs=5e-5)
    assert s.interval == pytest.approx((-0.1240, -0.0054), abs=5e-5)
    assert s.details["newcombe_interval"] == pytest.approx([-0.1186, -0.0046], abs=5e-5)
    assert s.decided_on == "lower bound" and s.comparison == ">"
    assert not s.passed


def test_noninferiority_passes_when_the_lower_limit_clears_the_margin():
    # 400 identical outcomes: no discordant pair, so Tango's limits are the
    # closed form -/+ z^2 / (n + z^2) = -0.0095, above -0.03.
    s = sc.noninferiority(_noninf_cases(300, 0, 0, 100), CFG)
    z = sps.norm.ppf(0.975)
    assert s.estimate == 0.0
    assert s.bound == pytest.approx(-z * z / (400 + z * z), abs=1e-9)
    assert s.passed
    assert s.run_ids == {"evaluate/compressed": "run-compressed", "evaluate/control": "run-control"}


def test_noninferiority_with_few_cases_fails_even_when_equal():
    # 16 identical outcomes: -z^2/(16 + z^2) = -0.194; too few cases to show it.
    assert not sc.noninferiority(_noninf_cases(10, 0, 0, 6), CFG).passed


# --- screen 2: retention ------------------------------------------------------


def _retention(diffs: list[float], tokens: list[int], base: float = 2.0) -> pd.DataFrame:
    rows = []
    for model, shift in (("seed", [0.0] * len(diffs)), ("control", [0.0] * len(diffs)), ("compressed", diffs)):
        for i, (d, t) in enumerate(zip(shift, tokens)):
            mean = base + 0.1 * i + d
            rows.append({"model": model, "run_id": f"run-{model}", "doc_id": f"d{i}", "tokens": t,
                         "nll_sum": mean * t, "mean_nll": mean})
    return pd.DataFrame(rows)


def test_retention_fails_on_the_bound_although_the_mean_is_small():
    # diffs 0.01, -0.01, 0, 0.02: mean 0.005; deviations 0.005, -0.015, -0.005,
    # 0.015 -> s^2 = 500e-6 / 3, se = s / 2 = 0.0064550; t(0.99, 3) = 4.5407
    # -> bound 0.005 + 0.029310 = 0.03431 > 0.02.
    s = sc.retention(_retention([0.01, -0.01, 0.0, 0.02], [10, 20, 30, 40]), CFG)
    assert s.estimate == pytest.approx(0.005)
    assert s.bound == pytest.approx(0.005 + 4.540703 * math.sqrt(500e-6 / 3) / 2, rel=1e-6)
    assert s.bound == pytest.approx(0.03431, abs=1e-5)
    # token-weighted: (0.1 - 0.2 + 0 + 0.8) / 100 tokens = 0.007
    assert s.details["token_weighted_estimate"] == pytest.approx(0.007)
    assert s.details["documents"] == 4
    assert s.decided_on == "upper bound" and s.comparison == "<"
    assert not s.passed


def test_retention_passes_when_the_bound_is_below_the_limit():
    # diffs 0.001, 0.002, 0.003, 0.002: mean 0.002, s^2 = 2e-6 / 3, se = s / 2
    # -> bound 0.002 + 4.5407 * 0.00040825 = 0.003854 < 0.02.
    s = sc.retention(_retention([0.001, 0.002, 0.003, 0.002], [5, 5, 5, 5]), CFG)
    assert s.estimate == pytest.approx(0.002)
    assert s.bound == pytest.approx(0.003854, abs=1e-6)
    assert s.details["token_weighted_estimate"] == pytest.approx(0.002)
    assert s.passed
    assert s.run_ids == {"evaluate/compressed": "run-compressed", "evaluate/seed": "run-seed"}


def test_retention_leaves_out_documents_without_tokens():
    table = _retention([0.001, 0.002, 0.003, 0.002, 0.0], [5, 5, 5, 5, 0])
    table.loc[table["doc_id"] == "d4", ["nll_sum", "mean_nll"]] = [0.0, None]
    s = sc.retention(table, CFG)
    assert s.details["documents"] == 4 and s.details["documents_without_tokens"] == 1
    assert s.bound == pytest.approx(0.003854, abs=1e-6)


def test_retention_refuses_unpaired_documents():
    table = _retention([0.0, 0.0, 0.0], [5, 5, 5])
    table = table[~((table["model"] == "seed") & (table["doc_id"] == "d2"))]
    with pytest.raises(ValueError, match="same retention documents"):
        sc.retention(table, CFG)


# --- screens 4 and 5: speed --------------------------------------------------


def _train(control: tuple[float, float], compressed: tuple[float, float], waited: float = 0.4) -> pd.DataFrame:
    rows = []
    for arm, (active, complete), devices in (("control", control, 1), ("compressed", compressed, 2)):
        rows.append({"arm": arm, "run_id": f"run-{arm}", "active_seconds": active, "complete_seconds": complete,
                     "rendezvous_seconds": 0.0 if devices == 1 else waited,
                     "device_seconds": devices * complete, "checkpoint_seconds": 1.5, "bytes_dense": 0.0 if devices == 1 else 4e6,
                     "bytes_compressed": 0.0 if devices == 1 else 1e6, "bytes_total": 0.0 if devices == 1 else 5e6, "bytes_setup": 0.0 if devices == 1 else 2e5,
                     "cost_usd": 0.25 * devices, "peak_rss_mb": 900.0, "others_cores": 0.9 if devices == 1 else float("nan"),
                     "steal_seconds": 0.0, })
    return pd.DataFrame(rows)


def test_speedups_pass_and_fail_by_hand():
    active, complete = sc.speedups(_train((120.0, 130.0), (100.0, 125.0)), CFG)
    assert active.estimate == pytest.approx(1.2) and active.passed
    assert complete.estimate == pytest.approx(1.04) and not complete.passed
    assert complete.details == {"control_seconds": 130.0, "compressed_seconds": 125.0, "compressed_rendezvous_seconds": 0.4}
    assert active.run_ids == {"train/control": "run-control", "train/compressed": "run-compressed"}


def test_the_complete_speedup_says_how_long_the_compressed_ranks_waited_to_meet():
    # Started node by node, the complete seconds hold the time until someone
    # started the other node's command: said beside the screen, not hidden in it.
    _, complete = sc.speedups(_train((120.0, 130.0), (100.0, 400.0), waited=280.0), CFG)
    assert complete.details["compressed_rendezvous_seconds"] == 280.0 and not complete.passed
    assert complete.sensitivity["note"].endswith(
        "; 280.0 s of the compressed run's 400.0 s its ranks waited to meet (their start-up skew; node by node, until the other node's command was started)"
    )
    # A start-up skew of one host is not worth a word.
    _, quick = sc.speedups(_train((120.0, 130.0), (100.0, 125.0), waited=6.0), CFG)
    assert "waited" not in quick.sensitivity["note"]


def test_speedup_of_exactly_the_threshold_passes():
    active, _ = sc.speedups(_train((110.0, 110.0), (100.0, 100.0)), CFG)
    assert active.estimate == 1.1 and active.passed


# --- verdicts and the figures beside ------------------------------------------


def test_one_failing_screen_fails_its_group_only():
    screens = sc.compute(_gain_cases(10, 6, 1, 3), _retention([0.001] * 4, [5] * 4),
                         _train((120.0, 130.0), (100.0, 125.0)), CFG)
    assert [s.name for s in screens] == [sc.ACCURACY_GAIN, sc.RETENTION, sc.NONINFERIORITY, sc.ACTIVE_SPEEDUP, sc.COMPLETE_SPEEDUP]
    # Non-inferiority fails on 20 cases; complete-process speedup is 1.04.
    assert sc.verdicts(screens) == {"quality": "fail", "speed": "fail"}
    passing = [s for s in screens if s.passed]
    assert sc.verdicts(passing) == {"quality": "fail", "speed": "fail"}, "a screen left out fails its group"
    mended = [dataclasses.replace(s, passed=True) for s in screens]
    assert sc.verdicts(mended) == {"quality": "pass", "speed": "pass"}
    assert sc.verdicts([s for s in mended if s.name != sc.RETENTION]) == {"quality": "fail", "speed": "pass"}


def test_resources_are_reported_not_judged():
    res = sc.resources(_train((120.0, 130.0), (100.0, 125.0)))
    assert res["arms"]["control"]["device_seconds"] == 130.0
    assert res["arms"]["compressed"]["device_seconds"] == 250.0
    # Two devices finishing sooner hold more device time: 250 / 130.
    assert res["device_seconds_ratio"] == pytest.approx(250 / 130)
    assert res["arms"]["compressed"]["bytes_dense"] == 4e6
    assert res["arms"]["compressed"]["run_id"] == "run-compressed"
    # How busy other processes kept the host, beside: a run that did not measure it has none.
    assert (res["arms"]["control"]["others_cores"], res["arms"]["compressed"]["others_cores"]) == (0.9, None)


# --- sensitivity beside every verdict -------------------------------------------


def test_noninferiority_at_128_cases_passes_only_on_full_agreement():
    # The CPU preset's old size: a PASS, but one discordant case each way fails it.
    s = sc.noninferiority(_noninf_cases(20, 0, 0, 108), CFG)
    assert s.passed and s.powered is False
    assert s.sensitivity["breakpoint_k"] == 1 and s.sensitivity["discordant"] == 0
    assert s.sensitivity["half_width"] == pytest.approx((s.interval[1] - s.interval[0]) / 2)
    assert s.sensitivity["lower_at_breakpoint"] <= CFG.noninferiority_margin
    assert s.verdict_reads.startswith("PASS (no power: one discordant case each way fails it at n=128")
    assert s.to_dict()["verdict"] == "pass" and s.to_dict()["verdict_reads"] == s.verdict_reads
    assert not sc.noninferiority(_noninf_cases(20, 1, 1, 106), CFG).passed


def test_noninferiority_at_512_cases_passes_with_real_disagreement():
    s = sc.noninferiority(_noninf_cases(100, 29, 29, 354), CFG)
    assert s.passed and s.powered is True and s.verdict_reads == "PASS"
    assert s.sensitivity["breakpoint_k"] == 30 and s.sensitivity["discordant"] == 58
    assert "fails at 30 discordant each way (n=512; observed 29+29)" in s.sensitivity["note"]
    assert s.sensitivity["distance"] == pytest.approx(-s.bound)
    assert not sc.noninferiority(_noninf_cases(100, 30, 30, 352), CFG).passed


def test_noninferiority_that_cannot_pass_says_so():
    s = sc.noninferiority(_noninf_cases(10, 0, 0, 6), CFG)
    assert not s.passed and s.sensitivity["breakpoint_k"] == 0 and s.powered is False
    assert s.verdict_reads == "FAIL" and "fails even with full agreement (n=16)" in s.sensitivity["note"]


def test_gain_sensitivity_is_the_band_where_the_verdict_is_a_coin_toss():
    s = sc.accuracy_gain(_gain_cases(6, 14, 4, 104), CFG)
    se = math.sqrt((18 / 128 - (10 / 128) ** 2) / 128)
    z = sps.norm.ppf(0.8)
    assert s.sensitivity["se"] == pytest.approx(se)
    assert s.sensitivity["pass_likely_above"] == pytest.approx(0.10 + z * se)
    assert s.sensitivity["fail_likely_below"] == pytest.approx(0.10 - z * se)
    assert s.sensitivity["half_width"] == pytest.approx((s.interval[1] - s.interval[0]) / 2)
    assert s.sensitivity["lower_minus_threshold"] == pytest.approx(s.interval[0] - 0.10)


@pytest.mark.parametrize(
    "table",
    [(0, 0, 0, 16), (0, 160, 0, 0), (0, 0, 40, 0)],
    ids=["no discordant case", "every case right for the compressed alone", "every case right for the seed alone"],
)
def test_gain_sensitivity_where_the_paired_se_is_0_is_not_the_threshold_itself(table):
    # The observed se is 0, and "passes w.p. 80% from a true +10.0 pts" would
    # be false (at the threshold it is a coin toss). Before, a table discordant
    # only one way kept the observed 0.
    s = sc.accuracy_gain(_gain_cases(*table), CFG)
    half = (s.interval[1] - s.interval[0]) / 2
    se = half / sps.norm.ppf(0.975)
    assert s.sensitivity["se"] == pytest.approx(se) and se > 0.005
    assert s.sensitivity["pass_likely_above"] == pytest.approx(0.10 + sps.norm.ppf(0.8) * se)
    assert s.sensitivity["fail_likely_below"] < 0.10 < s.sensitivity["pass_likely_above"]
    assert s.sensitivity["note"].endswith(f"from a true {100 * (0.10 + sps.norm.ppf(0.8) * se):+.1f} pts")
    assert s.sensitivity["se_from"] == "Tango's interval (the paired cases' standard error is 0)"


def test_gain_sensitivity_of_a_table_with_a_pass_without_power():
    # A pass whose interval still holds "no gain" has no power.
    small = sc.accuracy_gain(_gain_cases(5, 3, 1, 11), CFG)
    assert small.passed and small.interval[0] < 0 and small.powered is False
    assert small.verdict_reads.startswith("PASS (no power: the interval [") and "includes no gain" in small.verdict_reads
    big = sc.accuracy_gain(_gain_cases(10, 60, 2, 128), CFG)
    assert big.passed and big.powered is True and big.verdict_reads == "PASS"


def test_retention_sensitivity_is_the_bounds_distance_from_the_mean():
    diffs = [0.001, 0.002, 0.003, 0.002]
    s = sc.retention(_retention(diffs, [5, 5, 5, 5]), CFG)
    sd = float(pd.Series(diffs).std(ddof=1))
    t = sps.t.ppf(0.99, 3)
    assert s.sensitivity["margin"] == pytest.approx(s.bound - s.estimate) == pytest.approx(t * sd / 2)
    assert s.sensitivity["headroom"] == pytest.approx(0.02 - s.bound)
    assert s.sensitivity["pass_likely_below"] == pytest.approx(0.02 - (t + sps.norm.ppf(0.8)) * sd / 2)
    assert s.sensitivity["sd"] == pytest.approx(sd) and s.sensitivity["documents"] == 4
    assert s.passed and s.powered is True


def test_retention_that_passes_only_on_a_falling_mean_has_no_power():
    # The CPU study's case: 32 documents, sd ~0.1, so the bound sits ~0.042 above
    # the mean, twice the 0.02 allowed: only a mean that fell could pass.
    diffs = list(-0.42 + 0.1 * sps.norm.ppf([(i + 0.5) / 32 for i in range(32)]))
    s = sc.retention(_retention(diffs, [50] * 32), CFG)
    assert s.passed and s.powered is False
    assert s.sensitivity["margin"] == pytest.approx(0.042, abs=0.003)
    assert s.verdict_reads.startswith("PASS (no power: the bound sits 0.04")
    assert s.sensitivity["documents_for_power"] > 200


def test_speed_screens_have_no_power_figure():
    active, _ = sc.speedups(_train((120.0, 130.0), (100.0, 125.0)), CFG)
    assert active.powered is None and active.verdict_reads == "PASS"
    assert active.sensitivity["relative_distance"] == pytest.approx(1.2 / 1.1 - 1)
    assert "one run per arm, no interval" in active.sensitivity["note"]


def test_bytes_are_per_worker_with_all_workers_beside():
    res = sc.resources(_train((120.0, 130.0), (100.0, 125.0)), {"control": 1, "compressed": 2})
    compressed = res["arms"]["compressed"]
    assert compressed["bytes_dense"] == 4e6 and compressed["bytes_dense_all_workers"] == 8e6
    # The setup broadcast is sent by rank 0 alone: once in the total, not once per worker.
    assert compressed["bytes_total_all_workers"] == 2 * (5e6 - 2e5) + 2e5 and compressed["workers"] == 2
    assert res["arms"]["control"]["bytes_total_all_workers"] == 0.0
    # A record without bytes/setup: one worker's total is still exact, two workers' is not known.
    older = sc.resources(_train((1.0, 1.0), (1.0, 1.0)).assign(bytes_setup=float("nan")), {"control": 1, "compressed": 2})["arms"]
    assert (older["compressed"]["bytes_total_all_workers"], older["control"]["bytes_total_all_workers"]) == (None, 0.0)
    assert sc.resources(_train((1.0, 1.0), (1.0, 1.0)))["arms"]["compressed"]["bytes_total_all_workers"] is None
