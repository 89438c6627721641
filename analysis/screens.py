"""The pre-registered screens (STUDY.md, "The screens"), from tidy tables.

Pure functions: the tables of `analysis.records` in, `Screen` results out, no
I/O. Each result carries its estimate, the bound or interval its verdict rests
on, the threshold, the method in words and the run ids of its inputs, and its
sensitivity: what the screen could detect at this size, and whether a PASS had
the power to mean anything (`powered`; False reads "no power" in the report).
The quality verdict needs all three quality screens, the speed verdict both
speed screens; cost figures (`resources`) sit beside them and decide nothing.
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd
from scipy import stats as sps

from analysis import stats
from coopstudy.config import ARMS, COMPRESSED, CONTROL, ScreensConfig
from coopstudy.record.schema import MODEL_NAME_SEED as SEED

QUALITY, SPEED = "quality", "speed"
ACCURACY_GAIN = "accuracy_gain"
RETENTION = "retention"
NONINFERIORITY = "noninferiority"
ACTIVE_SPEEDUP = "active_speedup"
COMPLETE_SPEEDUP = "complete_speedup"
GROUPS = {QUALITY: (ACCURACY_GAIN, RETENTION, NONINFERIORITY), SPEED: (ACTIVE_SPEEDUP, COMPLETE_SPEEDUP)}
"""The screens each verdict needs, every one of them passed."""

# Units tell the report how to print a number: accuracy differences in
# percentage points, NLL in nats, speedups as ratios.
POINTS, NATS, RATIO = "points", "nats", "ratio"

_COMPARE = {">=": operator.ge, ">": operator.gt, "<": operator.lt}

POWER = 0.8
"""The power the sensitivity figures are quoted at."""


def train_role(arm: str) -> str:
    """The key of an arm's train run in a screen's `run_ids` and the record's runs."""
    return f"train/{arm}"


def evaluate_role(model: str) -> str:
    """The key of a model's evaluate run in a screen's `run_ids` and the record's runs."""
    return f"evaluate/{model}"


RETENTION_COLUMNS = ("doc_id", "tokens", "nll_sum", "mean_nll")
"""What the retention screen reads of each scored document (records reads them from each evaluate run's table)."""

ALL_FAMILIES = "all"
"""The family name of every test case together, beside each family's own."""

@dataclass(frozen=True)
class Screen:
    name: str
    title: str
    unit: str
    estimate: float
    threshold: float
    comparison: str
    """How the decisive statistic must stand to the threshold: '>=', '>' or '<'."""
    decided_on: str
    """'estimate', 'lower bound' or 'upper bound'."""
    passed: bool
    method: str
    run_ids: dict[str, str]
    """Role -> run id of every run whose numbers went in."""
    bound: float | None = None
    """The one-sided limit the verdict compares (None when it rests on the estimate)."""
    interval: tuple[float, float] | None = None
    """The two-sided interval, where the method gives one."""
    details: dict[str, Any] = field(default_factory=dict)
    """Figures shown beside: the other interval, counts, the other estimator."""
    sensitivity: dict[str, Any] = field(default_factory=dict)
    """What the screen could detect at this size (half-widths, the breakpoint,
    the bound's distance from the mean) and `note`, the same in words."""
    powered: bool | None = None
    """Whether the screen had the power for its verdict to say something (the
    rule per screen is in `power_note`); None: not defined (one run per arm)."""
    power_note: str = ""
    """Why it has or has not the power, in words."""

    @property
    def group(self) -> str:
        """The verdict this screen counts towards (GROUPS)."""
        return next(group for group, names in GROUPS.items() if self.name in names)

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"

    @property
    def unpowered_pass(self) -> bool:
        """Passed without the power to mean it (see `power_note`)."""
        return self.passed and self.powered is False

    @property
    def verdict_reads(self) -> str:
        """The verdict in one phrase for report.json's readers (a PASS without
        power says so there; the report's tables print power in its own column)."""
        if self.unpowered_pass:
            return f"PASS (no power: {self.power_note})"
        return self.verdict.upper()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["interval"] = list(self.interval) if self.interval is not None else None
        out["group"] = self.group
        out["verdict"] = self.verdict
        out["verdict_reads"] = self.verdict_reads
        out["unpowered_pass"] = self.unpowered_pass
        return out


def decide(statistic: float, comparison: str, threshold: float) -> bool:
    return bool(_COMPARE[comparison](statistic, threshold))


def _run_id(frame: pd.DataFrame, column: str, value: str) -> str:
    ids = frame.loc[frame[column] == value, "run_id"].unique()
    if len(ids) != 1:
        raise ValueError(f"{column}={value}: expected rows from one run, found {len(ids)}")
    return str(ids[0])


def paired_outcomes(cases: pd.DataFrame, a: str, b: str) -> pd.DataFrame:
    """case_id, family and one boolean column per model, one row per test case both scored."""
    left = cases.loc[cases["model"] == a, ["case_id", "family", "correct"]].rename(columns={"correct": a})
    right = cases.loc[cases["model"] == b, ["case_id", "correct"]].rename(columns={"correct": b})
    pairs = left.merge(right, on="case_id", how="inner", validate="one_to_one")
    if not len(pairs) == len(left) == len(right):
        raise ValueError(f"models {a} and {b} were not scored on the same test cases")
    if pairs.empty:
        raise ValueError(f"no test cases scored for models {a} and {b}")
    return pairs


def _paired_accuracy(cases: pd.DataFrame, a: str, b: str, level: float) -> tuple[stats.PairedTable, stats.Interval, stats.Interval]:
    pairs = paired_outcomes(cases, a, b)
    table = stats.paired_table(list(pairs[a]), list(pairs[b]))  # its own guard refuses what is not a bool
    return table, stats.tango_interval(table, level), stats.newcombe_interval(table, level)


def _accuracy_details(table: stats.PairedTable, a: str, b: str, newcombe: stats.Interval) -> dict[str, Any]:
    return {
        "cases": table.n,
        "paired_table": {"both_correct": table.n11, f"only_{a}": table.n10, f"only_{b}": table.n01, "neither": table.n00},
        f"accuracy_{a}": (table.n11 + table.n10) / table.n,
        f"accuracy_{b}": (table.n11 + table.n01) / table.n,
        "newcombe_interval": [newcombe.lower, newcombe.upper],
    }


# --- sensitivity ---------------------------------------------------------------


def _pts(x: float) -> str:
    return f"{100 * x:+.1f} pts"


def gain_sensitivity(
    table: stats.PairedTable, tango: stats.Interval, newcombe: stats.Interval, threshold: float, level: float
) -> tuple[dict[str, Any], bool, str]:
    """The accuracy-gain screen passes on its point estimate: the interval's
    half-width, the estimate's standard error and the band of true gains where
    the verdict is a coin toss (it passes with probability POWER only from
    threshold + z se, fails so only below threshold - z se). A PASS has power
    when the interval excludes no gain (Tango's lower limit above 0).

    Where the observed standard error is 0 (no discordant case, or every case
    discordant the same way) it would put the band at the threshold itself;
    the standard error Tango's interval implies (half-width / z of the level)
    stands in, and `se_from` says so."""
    half = (tango.upper - tango.lower) / 2
    observed = stats.paired_se(table)
    se = observed or half / float(sps.norm.ppf((1 + level) / 2))
    z = float(sps.norm.ppf(POWER))
    sens = {
        "half_width": half,
        "newcombe_half_width": (newcombe.upper - newcombe.lower) / 2,
        "se": se,
        "se_from": "paired cases" if observed else "Tango's interval (the paired cases' standard error is 0)",
        "lower_minus_threshold": tango.lower - threshold,
        "pass_likely_above": threshold + z * se,
        "fail_likely_below": threshold - z * se,
        "power": POWER,
        "note": f"±{100 * half:.1f} pts; passes w.p. {POWER:.0%} from a true {_pts(threshold + z * se)}",
    }
    powered = tango.lower > 0
    why = (
        f"Tango's lower limit {_pts(tango.lower)} is above no gain"
        if powered
        else f"the interval [{_pts(tango.lower)}, {_pts(tango.upper)}] includes no gain"
    )
    return sens, powered, why


def noninferiority_sensitivity(
    table: stats.PairedTable, tango: stats.Interval, newcombe: stats.Interval, margin: float, level: float
) -> tuple[dict[str, Any], bool, str]:
    """Non-inferiority passes on Tango's lower limit: the half-width, the lower
    limit's distance from the estimate and the breakpoint, the smallest balanced
    discordance k (k cases only one model gets right, k only the other) that
    fails it at this many cases. A PASS has power when the screen could pass
    with real disagreement: k >= 2 (at k = 1 a single case each way fails it,
    so a PASS says the two models answered alike, nothing more)."""
    k = stats.noninferiority_breakpoint(table.n, margin, level)
    half = (tango.upper - tango.lower) / 2
    at_k = tango_lower_at(table.n, k, level)
    sens = {
        "half_width": half,
        "newcombe_half_width": (newcombe.upper - newcombe.lower) / 2,
        "distance": tango.estimate - tango.lower,
        "breakpoint_k": k,
        "lower_at_breakpoint": at_k,
        "discordant": table.n10 + table.n01,
        "cases": table.n,
        "note": (
            f"±{100 * half:.1f} pts; "
            + (
                f"fails even with full agreement (n={table.n})"
                if k == 0
                else f"fails at {k} discordant each way (n={table.n}; observed {table.n10}+{table.n01})"
                if k is not None
                else f"no balanced discordance fails it (n={table.n})"
            )
        ),
    }
    powered = k is None or k >= 2
    if k == 0:
        why = f"it fails even with full agreement at n={table.n}"
    elif k == 1:
        why = f"one discordant case each way fails it at n={table.n}; a PASS means the models answered alike"
    else:
        why = f"it passes with up to {k - 1 if k else table.n // 2} discordant cases each way at n={table.n}"
    return sens, powered, why


def tango_lower_at(n: int, k: int | None, level: float) -> float | None:
    """Tango's lower limit with k discordant cases each way out of n (None for no k)."""
    return None if k is None else stats.tango_interval(stats.balanced_table(n, k), level).lower


def retention_sensitivity(
    diffs: list[float], bound: stats.UpperBound, threshold: float, level: float
) -> tuple[dict[str, Any], bool, str]:
    """Retention passes on a one-sided paired t bound: the bound's distance from
    the mean (t se), the headroom to the threshold, the largest true mean
    increase at which it still passes with probability POWER, and the documents
    it would need to pass so with no change at all at this spread. A PASS has
    power when the distance is below the threshold (with a distance at or above
    it, only a falling mean can pass: the screen cannot show an increase below
    the threshold, only a decrease)."""
    n = len(diffs)
    sd = float(pd.Series(diffs).std(ddof=1)) if n > 1 else float("nan")
    margin = bound.upper - bound.estimate
    se = sd / math.sqrt(n)
    t = float(sps.t.ppf(level, n - 1))
    z = float(sps.norm.ppf(POWER))
    needed = stats.documents_for_power(sd, threshold, level, POWER) if math.isfinite(sd) else None
    sens = {
        "margin": margin,
        "headroom": threshold - bound.upper,
        "sd": sd,
        "se": se,
        "documents": n,
        "pass_likely_below": threshold - (t + z) * se,
        "documents_for_power": needed,
        "power": POWER,
        "note": f"bound - mean {margin:.4f} nats (sd {sd:.3f}, {n} docs); {POWER:.0%} power at no change needs "
        f"{needed if needed is not None else 'no number of'} docs",
    }
    powered = margin < threshold
    why = (
        f"the bound sits {margin:.4f} nats above the mean, less than the {threshold:g} allowed"
        if powered
        else f"the bound sits {margin:.4f} nats above the mean, more than the {threshold:g} allowed: only a falling mean passes"
    )
    return sens, powered, why


def accuracy_gain(cases: pd.DataFrame, cfg: ScreensConfig) -> Screen:
    """Screen 1: compressed - seed accuracy, paired by test case, at least min_accuracy_gain."""
    table, tango, newcombe = _paired_accuracy(cases, COMPRESSED, SEED, cfg.interval_level)
    threshold = cfg.min_accuracy_gain
    details = _accuracy_details(table, COMPRESSED, SEED, newcombe)
    # Decided on the point estimate; whether the interval also clears the bar
    # is shown, never substituted for the verdict.
    details["tango_lower_clears_threshold"] = bool(tango.lower >= threshold)
    sens, powered, why = gain_sensitivity(table, tango, newcombe, threshold, cfg.interval_level)
    return Screen(
        name=ACCURACY_GAIN,
        title="accuracy gain over the seed model",
        unit=POINTS,
        estimate=tango.estimate,
        threshold=threshold,
        comparison=">=",
        decided_on="estimate",
        passed=decide(tango.estimate, ">=", threshold),
        method=(
            f"compressed - seed accuracy on the final test, paired by test case (n={table.n}); a case is correct "
            f"when its verifier scores 1.0; Tango's score interval, two-sided {cfg.interval_level:.0%} "
            "(Newcombe's hybrid score interval beside); the verdict rests on the point estimate"
        ),
        run_ids={evaluate_role(m): _run_id(cases, "model", m) for m in (COMPRESSED, SEED)},
        interval=(tango.lower, tango.upper),
        details=details,
        sensitivity=sens,
        powered=powered,
        power_note=why,
    )


def noninferiority(cases: pd.DataFrame, cfg: ScreensConfig) -> Screen:
    """Screen 3: the lower limit of compressed - control accuracy above the margin."""
    table, tango, newcombe = _paired_accuracy(cases, COMPRESSED, CONTROL, cfg.interval_level)
    sens, powered, why = noninferiority_sensitivity(table, tango, newcombe, cfg.noninferiority_margin, cfg.interval_level)
    return Screen(
        name=NONINFERIORITY,
        title="non-inferiority against the control",
        unit=POINTS,
        estimate=tango.estimate,
        threshold=cfg.noninferiority_margin,
        comparison=">",
        decided_on="lower bound",
        passed=decide(tango.lower, ">", cfg.noninferiority_margin),
        method=(
            f"compressed - control accuracy on the final test, paired by test case (n={table.n}); lower limit of "
            f"Tango's two-sided {cfg.interval_level:.0%} score interval (Newcombe's hybrid score interval beside)"
        ),
        run_ids={evaluate_role(m): _run_id(cases, "model", m) for m in (COMPRESSED, CONTROL)},
        bound=tango.lower,
        interval=(tango.lower, tango.upper),
        details=_accuracy_details(table, COMPRESSED, CONTROL, newcombe),
        sensitivity=sens,
        powered=powered,
        power_note=why,
    )


def retention_differences(retention: pd.DataFrame, a: str = COMPRESSED, b: str = SEED) -> pd.DataFrame:
    """Per scored document: doc_id, tokens, a - b mean NLL (diff_mean) and summed NLL (diff_sum).

    A document with no target tokens has no mean NLL and carries no evidence
    either way; it is left out (the same one for both models).
    """
    cols = list(RETENTION_COLUMNS)
    left = retention.loc[retention["model"] == a, cols]
    right = retention.loc[retention["model"] == b, cols]
    pairs = left.merge(right, on="doc_id", how="inner", suffixes=("_a", "_b"), validate="one_to_one")
    if not len(pairs) == len(left) == len(right):
        raise ValueError(f"models {a} and {b} were not scored on the same retention documents")
    if not (pairs["tokens_a"] == pairs["tokens_b"]).all():
        raise ValueError(f"models {a} and {b} were scored on different tokens of the same documents")
    pairs = pairs[pairs["tokens_a"].astype(float) > 0]
    return pd.DataFrame(
        {
            "doc_id": pairs["doc_id"],
            "tokens": pairs["tokens_a"].astype(float),
            "diff_mean": pairs["mean_nll_a"].astype(float) - pairs["mean_nll_b"].astype(float),
            "diff_sum": pairs["nll_sum_a"].astype(float) - pairs["nll_sum_b"].astype(float),
        }
    ).reset_index(drop=True)


def retention(retention: pd.DataFrame, cfg: ScreensConfig) -> Screen:
    """Screen 2: the paired-t upper bound of compressed - seed mean NLL below the limit."""
    diffs = retention_differences(retention)
    level = cfg.retention_level
    t_bound = stats.paired_t_upper_bound(diffs["diff_mean"].tolist(), level)
    ratio = stats.ratio_difference_clustered(diffs["diff_sum"].tolist(), diffs["tokens"].tolist(), level)
    sens, powered, why = retention_sensitivity(diffs["diff_mean"].tolist(), t_bound, cfg.retention_max_nll_increase, level)
    return Screen(
        name=RETENTION,
        title="retention (NLL increase over the seed model)",
        unit=NATS,
        estimate=t_bound.estimate,
        threshold=cfg.retention_max_nll_increase,
        comparison="<",
        decided_on="upper bound",
        passed=decide(t_bound.upper, "<", cfg.retention_max_nll_increase),
        method=(
            f"per retention document (n={len(diffs)}), compressed - seed mean per-token NLL of its assistant "
            f"tokens; one-sided {level:.0%} paired t upper bound of the mean over documents (each document "
            "weighs the same); beside it the token-weighted ratio estimate with a document-clustered standard "
            "error; tokens are never treated as independent"
        ),
        run_ids={evaluate_role(m): _run_id(retention, "model", m) for m in (COMPRESSED, SEED)},
        bound=t_bound.upper,
        details={
            "documents": len(diffs),
            "documents_without_tokens": int((retention["model"] == SEED).sum()) - len(diffs),
            "tokens": float(diffs["tokens"].sum()),
            "token_weighted_estimate": ratio.estimate,
            "token_weighted_se": ratio.se,
            "token_weighted_upper": ratio.upper,
        },
        sensitivity=sens,
        powered=powered,
        power_note=why,
    )


def _speedup(
    train: pd.DataFrame, column: str, name: str, title: str, what: str, cfg: ScreensConfig, details: dict[str, Any] | None = None, said: str = ""
) -> Screen:
    seconds = {arm: float(train.loc[train["arm"] == arm, column].iloc[0]) for arm in ARMS}
    value = stats.speedup(seconds[CONTROL], seconds[COMPRESSED])
    return Screen(
        name=name,
        title=title,
        unit=RATIO,
        estimate=value,
        threshold=cfg.min_speedup,
        comparison=">=",
        decided_on="estimate",
        passed=decide(value, ">=", cfg.min_speedup),
        method=f"control seconds / compressed seconds, {what}; one measured run per arm",
        run_ids={train_role(arm): _run_id(train, "arm", arm) for arm in ARMS},
        details={f"{arm}_seconds": seconds[arm] for arm in ARMS} | (details or {}),
        sensitivity={
            "relative_distance": value / cfg.min_speedup - 1,
            "note": f"one run per arm, no interval; {value / cfg.min_speedup - 1:+.1%} from the threshold{said}",
        },
        power_note="one measured run per arm: no interval, no power figure",
    )


RENDEZVOUS_SAID = 0.05
"""The share of the compressed run's complete seconds its ranks' wait to meet must reach for screen 5's note to name it."""


def speedups(train: pd.DataFrame, cfg: ScreensConfig) -> list[Screen]:
    """Screens 4 and 5: active and complete-process speedup of compressed over
    control. Screen 5 keeps beside it how long the compressed ranks waited to
    meet, which it includes: started node by node, the time until someone
    started the other node's command."""
    row = train.loc[train["arm"] == COMPRESSED].iloc[0]
    waited, complete = _number(row.get("rendezvous_seconds", float("nan"))), float(row["complete_seconds"])
    said = ""
    if waited is not None and waited >= RENDEZVOUS_SAID * complete:
        said = (f"; {waited:.1f} s of the compressed run's {complete:.1f} s its ranks waited to meet (their start-up skew; node by node, "
                "until the other node's command was started)")  # fmt: skip
    return [
        _speedup(
            train, "active_seconds", ACTIVE_SPEEDUP, "active speedup",
            "training-active time (first update start to last update end)", cfg,
        ),
        _speedup(
            train, "complete_seconds", COMPLETE_SPEEDUP, "complete-process speedup",
            "process launch to process exit, everything included", cfg,
            details={"compressed_rendezvous_seconds": waited}, said=said,
        ),
    ]


def compute(cases: pd.DataFrame, retention_table: pd.DataFrame, train: pd.DataFrame, cfg: ScreensConfig) -> list[Screen]:
    """All five screens, in the protocol's order."""
    return [accuracy_gain(cases, cfg), retention(retention_table, cfg), noninferiority(cases, cfg), *speedups(train, cfg)]


def verdicts(screens: list[Screen]) -> dict[str, str]:
    """Quality and speed verdicts: a group passes only when every one of its
    screens is there and passed; a screen left out fails its group."""
    passed = {s.name for s in screens if s.passed}
    return {group: "pass" if passed.issuperset(names) else "fail" for group, names in GROUPS.items()}


def _number(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


BYTES_PER_WORKER = ("bytes_dense", "bytes_compressed", "bytes_total")
"""The record's bytes/* metrics: one worker's (rank 0's) collective payload."""


def resources(train: pd.DataFrame, workers: dict[str, int] | None = None) -> dict[str, Any]:
    """Cost figures per arm, reported beside the screens and never folded in.

    Device-seconds are allocated devices x complete seconds: two workers that
    finish sooner may still hold more device time than one.

    Bytes: the record's bytes/* metrics are rank 0's collective payload, one
    worker's. Every rank of the gradient collectives sends a payload of the
    same size, so all workers together send `workers` times it:
    `<name>_all_workers` beside each (None when `workers` is not given). DDP's
    setup broadcast, a part of the total, is sent once, by rank 0 alone (None
    for the total of a record without bytes/setup). `bytes_scalar_sums`: the
    rest of rank 0's total, the few scalars summed across ranks, so that the
    parts add up to the total on the page.
    """
    columns = ["active_seconds", "complete_seconds", "device_seconds", "checkpoint_seconds",
               *BYTES_PER_WORKER, "bytes_setup", "cost_usd", "peak_rss_mb", "others_cores", "steal_seconds"]
    arms = {}
    for _, row in train.iterrows():
        arm = str(row["arm"])
        figures = {c: _number(row[c]) for c in columns}
        count = (workers or {}).get(arm)
        figures["workers"] = count
        parts = [figures[c] for c in ("bytes_total", "bytes_dense", "bytes_compressed", "bytes_setup")]
        figures["bytes_scalar_sums"] = None if None in parts else parts[0] - sum(parts[1:])
        for c in BYTES_PER_WORKER:
            figures[f"{c}_all_workers"] = None if count is None or figures[c] is None else figures[c] * count
        if figures["bytes_total_all_workers"] is not None:
            if figures["bytes_setup"] is not None:
                figures["bytes_total_all_workers"] -= (count - 1) * figures["bytes_setup"]
            elif count > 1:
                # An older record, without bytes/setup: several workers' total is not known.
                figures["bytes_total_all_workers"] = None
        arms[arm] = {"run_id": str(row["run_id"])} | figures
    control, compressed = arms[CONTROL]["device_seconds"], arms[COMPRESSED]["device_seconds"]
    ratio = compressed / control if control and compressed is not None else None
    return {"arms": arms, "device_seconds_ratio": ratio}


def accuracy_by_family(cases: pd.DataFrame) -> pd.DataFrame:
    """model, family, cases, correct, accuracy; family 'all' is the whole test."""
    whole = cases.assign(family=ALL_FAMILIES)
    grouped = pd.concat([cases, whole]).groupby(["model", "family"], sort=True)["correct"]
    table = grouped.agg(cases="size", correct="sum").reset_index()
    table["accuracy"] = table["correct"] / table["cases"]
    return table
