"""The report: `report.json` (the record of the verdicts), `report.md` and an
HTML page with plots.

`build` turns the records and screens into one JSON-ready dict. It holds no
time of its own making (only the runs' recorded starts and ends) and no id of
the report's own run, so rebuilding it from the same tracking store gives the
same bytes (`dumps`). The Markdown is written from
that dict alone; the HTML adds plots drawn from the records' tables.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from typing import Any

from analysis import screens as sc
from analysis.records import BREAKDOWN, BREAKDOWN_JSON, MODELS, Records
from analysis.screens import evaluate_role
from coopstudy import config as config_mod
from coopstudy.config import ARMS, Config, ScreensConfig
from coopstudy.errors import ConfigError
from coopstudy.record import schema, store

SCHEMA = 1

NO_DENSE_ARM = (
    "There is no dense distributed arm: the bytes above are the compressed arm's own, by phase, "
    "and are not set against any dense-communication figure."
)
BYTES_NOTE = (
    "Bytes per worker are rank 0's collective payload (the record's bytes/*); every rank of the gradient "
    "collectives sends as much, so all workers send the workers' count times it, DDP's setup broadcast "
    "(rank 0 alone) once."
)
BREAKDOWN_NOTE = (
    "Update = forward and backward + comm (the gradient comm hook, waits for the other worker included) "
    "+ optimizer + other; record is the writing of the record inside the training window just before an "
    "update, outside its seconds. Per-update figures are in the train runs' train/* metrics."
)
POWER_NOTE = (
    "Sensitivity says what each screen could detect at this size; a PASS without power "
    "(power: no) says the rule held, not that the data could have shown otherwise."
)
DEVICE_SECONDS_NOTE = (
    "Device-seconds are allocated devices x complete-process seconds; faster parallel execution "
    "may hold more device time, not less."
)


def _plain(value: Any) -> Any:
    """JSON-safe and canonical: numpy scalars to Python, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _training(records: Records) -> dict[str, Any]:
    out = {}
    for arm, group in records.updates.groupby("arm", sort=True):
        group = group.sort_values("update")
        out[str(arm)] = {
            "run_id": str(group["run_id"].iloc[0]),
            "updates": int(len(group)),
            "first_loss": float(group["loss"].iloc[0]),
            "final_loss": float(group["loss"].iloc[-1]),
            "median_update_seconds": float(group["update_seconds"].median()),
            # Rank 0's first touch over the window: memory new to its process, and the
            # operating system's seconds (README, "What stays on CPU, and why").
            "new_memory_mb": _logged(group["new_memory_mb"], "sum"),
            "system_seconds": _logged(group["system_seconds"], "sum"),
            # The least free memory the machine had ready for first touches after an update:
            # near zero, later first touches waited for the VM's host.
            "ready_memory_low_mb": _logged(group["ready_memory_mb"], "min"),
        }
    return out


def _breakdown(records: Records, cfg: Config) -> dict[str, Any]:
    """Per phase, each arm's median seconds per update and per part of it (rank 0's)."""
    out: dict[str, Any] = {}
    for phase, steps in schema.phases(cfg.powersgd.dense_updates, cfg.train.updates).items():
        rows = records.updates[records.updates["update"].isin(steps)]
        out[phase] = {"updates": [steps[0], steps[-1]]}
        for arm in ARMS:
            group = rows[rows["arm"] == arm]
            out[phase][arm] = {part: _logged(group[part], "median") for part in BREAKDOWN_JSON}
    return out


def _logged(values, statistic: str) -> float | None:
    """The pandas `statistic` (sum, min, median) of the values the record holds; None where it
    holds none (runs from before a metric was recorded, ready memory without procfs)."""
    values = values.dropna()
    return float(getattr(values, statistic)()) if len(values) else None


def _accuracy(records: Records) -> dict[str, Any]:
    table = sc.accuracy_by_family(records.cases)
    out: dict[str, Any] = {}
    for model in MODELS:
        rows = table[table["model"] == model]
        out[model] = {
            "run_id": records.runs[evaluate_role(model)],
            "families": {
                str(r.family): {"cases": int(r.cases), "correct": int(r.correct), "accuracy": float(r.accuracy)}
                for r in rows.itertuples()
            },
        }
    return out


def _retention_nll(records: Records) -> dict[str, Any]:
    out = {}
    for model in MODELS:
        rows = records.retention[records.retention["model"] == model]
        out[model] = {
            "run_id": records.runs[evaluate_role(model)],
            "documents": int(len(rows)),
            "mean_over_documents": float(rows["mean_nll"].astype(float).mean()),
            "token_weighted": float(rows["nll_sum"].astype(float).sum() / rows["tokens"].astype(float).sum()),
        }
    return out


def _budget(records: Records) -> dict[str, Any] | None:
    """What the study spent against the allocation its plan committed: the
    probes, and every train and evaluate run under the plan that logged a cost
    (failed and stopped ones too). None without a plan, which holds both."""
    planned = records.budget
    if planned is None:
        return None
    (train, train_runs), (evaluate, evaluate_runs) = records.spent[schema.STAGE_TRAIN], records.spent[schema.STAGE_EVALUATE]
    return {
        "allocation_usd": planned["allocation_usd"],
        "deadline": planned["deadline"],
        "hourly_price_usd": planned["hourly_price_usd"],
        "probes_cost_usd": planned["probes_cost_usd"],
        "train_cost_usd": train,
        "train_runs": train_runs,
        "evaluate_cost_usd": evaluate,
        "evaluate_runs": evaluate_runs,
        "spent_usd": planned["probes_cost_usd"] + sum(cost for cost, _ in records.spent.values()),
        "projected_cost_usd": planned["projected_cost_usd"],
    }


def budget_line(report: dict[str, Any]) -> str:
    """The budget beside the screens: spent against the allocation and the plan's projection."""
    b = report["budget"]
    if b is None:
        return "Budget: no plan in this study's record, so no allocation or projection to set its cost against."
    deadline = f", deadline {b['deadline']}" if b["deadline"] else ", no deadline"
    over = b["spent_usd"] - b["allocation_usd"]
    return (
        f"Budget: spent ${b['spent_usd']:.2f} of the plan's allocation ${b['allocation_usd']:.2f}"
        f"{f' (over by ${over:.2f})' if over > 0 else ''}{deadline}, at ${b['hourly_price_usd']:.2f} per device-hour: "
        f"probes ${b['probes_cost_usd']:.2f}, {b['train_runs']} train and {b['evaluate_runs']} evaluate run(s) that "
        f"logged a cost ${b['train_cost_usd']:.2f} and ${b['evaluate_cost_usd']:.2f}. "
        f"The plan projected ${b['projected_cost_usd']:.2f} for the probes and one run of each arm."
    )


def _differs_from_preset(cfg: Config) -> dict[str, dict[str, str]] | str:
    """The settings the study changed (`--set`) from its preset's file: a report
    titled with a preset says which of the preset's numbers it did not run.
    Why they cannot be told, where the preset's file does not load alone."""
    try:
        preset = config_mod.flatten(config_mod.load(cfg.preset_argument))
    except ConfigError as err:
        return f"its file does not load alone ({err})"
    own = config_mod.flatten(cfg)
    return {key: {"preset": preset.get(key, "(none)"), "study": value} for key, value in own.items() if preset.get(key) != value}


def _off_protocol(cfg: Config) -> dict[str, dict[str, float]]:
    """The screens' thresholds that are not the protocol's (ScreensConfig's
    defaults): a preset file may set its own, and its report would otherwise
    say "every setting is the preset's own" under a verdict the protocol would not give."""
    protocol, study = ScreensConfig().model_dump(), cfg.screens.model_dump()
    return {f"screens.{key}": {"protocol": value, "study": study[key]} for key, value in protocol.items() if study[key] != value}


def build(records: Records, screens: list[sc.Screen], cfg: Config) -> dict[str, Any]:
    """Every screen's value, bound, threshold, method, verdict and run ids, and the figures beside."""
    return _plain(
        {
            "schema": SCHEMA,
            "study": {
                "preset": cfg.preset,
                "experiment": cfg.experiment,
                "grouped_by": records.key.kind,
                "key": records.key.value,
                "plan_sha256": records.plan,
                "config_sha256": store.config_sha256(cfg),
                "differs_from_preset": _differs_from_preset(cfg),
                "thresholds_off_protocol": _off_protocol(cfg),
            },
            "runs": dict(sorted(records.runs.items())),
            "train_attempts": records.attempts.to_dict("records"),
            "train_runs_elsewhere": records.elsewhere.to_dict("records"),
            "evaluate_attempts": records.evaluations.to_dict("records"),
            "candidates": dict(sorted(records.candidates.items())),
            "thresholds": cfg.screens.model_dump(),
            "verdicts": sc.verdicts(screens),
            "screens": [s.to_dict() for s in screens],
            "resources": sc.resources(records.train, {arm: cfg.arm(arm).workers for arm in ARMS}),
            "inputs": records.inputs,
            "budget": _budget(records),
            "training": _training(records),
            "breakdown": _breakdown(records, cfg),
            "accuracy": _accuracy(records),
            "retention_nll": _retention_nll(records),
        }
    )


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n"


# --- tables shared by Markdown, HTML and the terminal -----------------------

_PRINTED = {sc.POINTS: (100.0, 1), sc.NATS: (1.0, 4), sc.RATIO: (1.0, 3)}
"""Per unit: the scale it is printed at and its usual digits after the point."""


def fmt(value: float | None, unit: str, extra: int = 0) -> str:
    """The value as the report prints it in `unit`, with `extra` digits beyond the usual."""
    if value is None:
        return "n/a"
    digits = _PRINTED.get(unit, (1.0, 1))[1] + extra
    if unit == sc.POINTS:
        return f"{value * 100:+.{digits}f} pts"
    if unit == sc.NATS:
        return f"{value:+.{digits}f} nats"
    if unit == sc.RATIO:
        return f"{value:.{digits}f}x"
    return f"{value:,.{digits}f}"


def told_apart(s: dict[str, Any]) -> int:
    """The digits beyond the usual that a screen's figures need for the decisive one
    and the threshold, as printed, to stand as the verdict says: a gain of 9.96 points
    prints as +9.96 against a threshold of +10.00, not as +10.0 against +10.0."""
    decisive = s["bound"] if s["bound"] is not None else s["estimate"]
    scale, digits = _PRINTED.get(s["unit"], (1.0, 1))
    for extra in range(9):
        shown, threshold = (round(x * scale, digits + extra) for x in (decisive, s["threshold"]))
        if sc.decide(shown, s["comparison"], threshold) == (s["verdict"] == "pass"):
            return extra
    return 9


def _bracket(pair: list[float] | None, unit: str, extra: int = 0) -> str:
    if pair is None:
        return "n/a"
    return f"[{fmt(pair[0], unit, extra)}, {fmt(pair[1], unit, extra)}]"


def _screen_bounds(s: dict[str, Any], extra: int = 0) -> str:
    unit, d = s["unit"], s["details"]
    if s["name"] in (sc.ACCURACY_GAIN, sc.NONINFERIORITY):
        clears = ""
        if s["name"] == sc.ACCURACY_GAIN:
            clears = f"; Tango lower limit clears the threshold: {'yes' if d['tango_lower_clears_threshold'] else 'no'}"
        return f"Tango {_bracket(s['interval'], unit, extra)}, Newcombe {_bracket(d['newcombe_interval'], unit, extra)}{clears}"
    if s["name"] == sc.RETENTION:
        return (
            f"paired t upper bound {fmt(s['bound'], unit, extra)}; token-weighted {fmt(d['token_weighted_estimate'], unit, extra)} "
            f"(clustered SE {d['token_weighted_se']:.4f}, upper {fmt(d['token_weighted_upper'], unit, extra)})"
        )
    return f"control {d['control_seconds']:,.1f} s / compressed {d['compressed_seconds']:,.1f} s"


def _rule(s: dict[str, Any], extra: int = 0) -> str:
    return f"{s['decided_on']} {s['comparison']} {fmt(s['threshold'], s['unit'], extra)}"


def power_cell(s: dict[str, Any]) -> str:
    """yes, no (and why), or n/a where a screen has no power figure."""
    if s.get("powered") is None:
        return "n/a"
    return "yes" if s["powered"] else f"no: {s['power_note']}"


def screen_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["#", "screen", "estimate", "interval / bound (beside)", "rule", "sensitivity at this size", "power", "verdict"]
    rows = []
    for i, s in enumerate(report["screens"], start=1):
        extra = told_apart(s)
        rows.append([
            str(i),
            s["title"],
            fmt(s["estimate"], s["unit"], extra),
            _screen_bounds(s, extra),
            _rule(s, extra),
            s.get("sensitivity", {}).get("note", "n/a"),
            power_cell(s),
            s["verdict"].upper(),
        ])  # fmt: skip
    return headers, rows


def _count(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def resource_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    arms = report["resources"]["arms"]
    lines = [
        ("active seconds", "active_seconds", 1),
        ("complete-process seconds", "complete_seconds", 1),
        ("device-seconds", "device_seconds", 1),
        ("checkpoint seconds", "checkpoint_seconds", 1),
        ("bytes sent per worker (rank 0), dense phase", "bytes_dense", 0),
        ("bytes sent per worker (rank 0), compressed phase", "bytes_compressed", 0),
        ("bytes sent by rank 0, DDP's setup broadcast", "bytes_setup", 0),
        ("bytes sent per worker (rank 0), scalar sums", "bytes_scalar_sums", 0),
        ("bytes sent per worker (rank 0), total", "bytes_total", 0),
        ("bytes sent, all workers, dense phase", "bytes_dense_all_workers", 0),
        ("bytes sent, all workers, compressed phase", "bytes_compressed_all_workers", 0),
        ("bytes sent, all workers, total", "bytes_total_all_workers", 0),
        ("workers", "workers", 0),
        ("spent cost (USD)", "cost_usd", 2),
        ("peak RSS (MiB)", "peak_rss_mb", 0),
        ("cores other processes kept busy (quiet: 0)", "others_cores", 2),
        ("CPU seconds the hypervisor stole", "steal_seconds", 1),
    ]
    rows = [[label, *(_count(arms[arm].get(key), d) for arm in ARMS)] for label, key, d in lines]
    ratio = report["resources"]["device_seconds_ratio"]
    rows.append(["device-seconds, compressed / control", "", "n/a" if ratio is None else f"{ratio:.3f}"])
    return ["figure (decides nothing)", *ARMS], rows


def breakdown_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Median seconds per update by part, each arm in each phase (the same updates in both arms)."""
    phase_arms = [(phase, arm) for phase in report["breakdown"] for arm in ARMS]
    headers = ["median s/update (rank 0)"] + [
        f"{arm}, {phase} phase (updates {report['breakdown'][phase]['updates'][0]}-{report['breakdown'][phase]['updates'][1]})"
        for phase, arm in phase_arms
    ]
    rows = [
        [part.removesuffix("_seconds").replace("_", " "), *(_count(report["breakdown"][phase][arm][part], 3) for phase, arm in phase_arms)]
        for part in ("update_seconds", *BREAKDOWN)
    ]
    return headers, rows


def accuracy_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    acc = report["accuracy"]
    families = sorted(acc[MODELS[0]]["families"], key=lambda f: (f == sc.ALL_FAMILIES, f))
    rows = []
    for family in families:
        cells = []
        for model in MODELS:
            f = acc[model]["families"][family]
            cells.append(f"{f['accuracy'] * 100:.1f}% ({f['correct']}/{f['cases']})")
        rows.append([family, *cells])
    return ["family", *MODELS], rows


def paired_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The 2x2 table of the non-inferiority test (compressed against control, by case)."""
    counts = _screen(report, sc.NONINFERIORITY)["details"]["paired_table"]
    return (
        ["", "control correct", "control not correct"],
        [
            ["compressed correct", str(counts["both_correct"]), str(counts["only_compressed"])],
            ["compressed not correct", str(counts["only_control"]), str(counts["neither"])],
        ],
    )


def run_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = [[role, run_id] for role, run_id in report["runs"].items()]
    rows += [[f"candidate weights, {arm}", sha] for arm, sha in report["candidates"].items()]
    return ["role", "run id / sha256"], rows


def attempt_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = [
        [
            a["arm"], a["run_id"], a["status"] + (" (refused)" if a["refused"] else ""), a["started"][:19].replace("T", " "),
            _count(a["active_seconds"]), _count(a["complete_seconds"]), "yes" if a["timed"] else "",
        ]  # fmt: skip
        for a in report["train_attempts"]
    ]
    return ["arm", "train run", "status", "started (UTC)", "active s", "complete s", "timed by the screens"], rows


def attempts_line(report: dict[str, Any]) -> str:
    """How many train runs each arm made under the study, said beside the speed
    screens, how many were refused before they trained, and whether the timed
    runs kept the protocol's order (the control, then the compressed arm, never
    both at once)."""
    attempts = report["train_attempts"]
    counts = {arm: sum(a["arm"] == arm and not a["refused"] for a in attempts) for arm in ARMS}
    if all(n == 1 for n in counts.values()):
        said = "Each arm trained once under this study; the speed screens time those runs."
    else:
        said = (
            f"Train runs under this study: {', '.join(f'{arm} {n}' for arm, n in counts.items())}. The speed screens "
            "time only the run select took; every other attempt, finished or not, is listed here as evidence."
        )
    refused = {arm: n for arm in ARMS if (n := sum(a["arm"] == arm and a["refused"] for a in attempts))}
    if refused:
        said += f" Refused before training (counted apart): {', '.join(f'{arm} {n}' for arm, n in refused.items())}."
    return " ".join(filter(None, (said, _order(attempts), _elsewhere(report))))


def _elsewhere(report: dict[str, Any]) -> str:
    """The preset's train runs outside this study (another plan, else another
    config), counted: a new plan is not a clean slate for the speed screens."""
    runs, preset = report["train_runs_elsewhere"], report["study"]["preset"]
    if not runs:
        return f"No other study of preset {preset} trained an arm in this experiment."
    studies = len({r["study"] for r in runs})
    arms = ", ".join(f"{arm} {n}" for arm in ARMS if (n := sum(r["arm"] == arm for r in runs)))
    finished = sum(r["status"] == "FINISHED" for r in runs)
    cost = sum(r["cost_usd"] or 0.0 for r in runs)  # None: logged no cost
    return (
        f"Outside this study, {studies} other stud{'ies' if studies != 1 else 'y'} of preset {preset} trained "
        f"{len(runs)} run{'s' * (len(runs) != 1)} ({arms}; {finished} finished), spending ${cost:.2f}: "
        f"not timed here, listed in report.json (train_runs_elsewhere)."
    )


def _order(attempts: list[dict[str, Any]]) -> str:
    """Whether the timed runs kept the protocol's order, by their MLflow start and
    end (the clocks of the hosts that opened them); nothing unless both arms have one."""
    timed = {a["arm"]: a for a in attempts if a["timed"]}
    if set(timed) != set(ARMS):
        return ""
    first, second = (timed[arm] for arm in ARMS)
    if second["started"] < first["started"]:
        return f"The timed runs trained out of the protocol's order: {second['arm']} before {first['arm']}."
    if second["started"] < first["ended"]:
        return f"The timed runs overlapped: {second['arm']} started before {first['arm']} ended."
    return f"The timed runs kept the protocol's order: {first['arm']}, then {second['arm']}."


def evaluation_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = [
        [e["model"], e["run_id"], e["status"], e["weights"][:12], _count(e["accuracy"], 3), "yes" if e["scored"] else ""]
        for e in report["evaluate_attempts"]
    ]
    return ["model", "evaluate run", "status", "weights", "accuracy", "read by the screens"], rows


def evaluations_line(report: dict[str, Any]) -> str:
    """How many evaluate runs each model had under the study, and whether
    finished runs of the same weights agree (scoring is deterministic)."""
    done = [e for e in report["evaluate_attempts"] if e["status"] == "FINISHED"]
    counts = {model: sum(e["model"] == model for e in report["evaluate_attempts"]) for model in MODELS}
    said = (
        "Each model was evaluated once under this study."
        if all(n == 1 for n in counts.values())
        else f"Evaluate runs under this study: {', '.join(f'{m} {n}' for m, n in counts.items())}. "
        "The screens read only the first finished run of each model's committed weights; every other is listed here."
    )
    by_weights: dict[tuple[str, str], set[float]] = {}
    for e in done:
        if e["accuracy"] is not None:
            by_weights.setdefault((e["model"], e["weights"]), set()).add(round(e["accuracy"], 9))
    split = [f"{m} weights {w[:12]}: {', '.join(f'{a:.3f}' for a in sorted(acc))}" for (m, w), acc in by_weights.items() if len(acc) > 1]
    if split:
        said += f" Finished evaluate runs of the same weights disagree on accuracy ({'; '.join(split)}): scoring is not repeatable."
    return said


def _screen(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in report["screens"] if s["name"] == name)


# --- Markdown ----------------------------------------------------------------

def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *map(line, rows)])


def _title(report: dict[str, Any]) -> str:
    study = report["study"]
    differs = study["differs_from_preset"]
    changed = len(differs) if isinstance(differs, dict) else 0
    own = f" with {changed} setting{'s' if changed != 1 else ''} of its own" if changed else ""
    return f"Study report: preset {study['preset']}{own}, {study['grouped_by']} sha {study['key'][:12]}"


def preset_line(report: dict[str, Any]) -> str:
    """Which of the preset's settings the study changed, and which screen
    thresholds are not the protocol's, in a sentence each."""
    study = report["study"]
    differs = study["differs_from_preset"]
    if isinstance(differs, str):
        said = f"Which settings differ from preset {study['preset']}'s cannot be told: {differs}."
    elif not differs:
        said = f"Every setting is preset {study['preset']}'s own."
    else:
        changes = "; ".join(f"{key} {d['preset']} -> {d['study']}" for key, d in sorted(differs.items()))
        said = f"Settings that differ from preset {study['preset']}'s file (--set): {changes}."
    off = study["thresholds_off_protocol"]
    if not off:
        return f"{said} Every screen's threshold is the protocol's (STUDY.md)."
    changes = "; ".join(f"{key} {d['study']:g} (the protocol's {d['protocol']:g})" for key, d in sorted(off.items()))
    return f"{said} Screen thresholds other than the protocol's, as the plan committed them: {changes}; the verdicts are judged by these."


def _verdict_line(report: dict[str, Any]) -> str:
    said = [f"{group.capitalize()} verdict: {verdict.upper()}." for group, verdict in report["verdicts"].items()]
    return " ".join([*said, *_unpowered(report)])


def _needs(report: dict[str, Any]) -> str:
    """Which screens, by their number in the table, each verdict needs."""
    numbers = {g: [i for i, s in enumerate(report["screens"], start=1) if s["name"] in names] for g, names in sc.GROUPS.items()}
    said = [f"the {g} verdict needs screen{'s' * (len(n) > 1)} {', '.join(map(str, n))}" for g, n in numbers.items()]
    text = "; ".join(said)
    return text[0].upper() + text[1:] + "."


def _unpowered(report: dict[str, Any]) -> list[str]:
    """One sentence per screen that passed without the power to mean it."""
    return [
        f"Screen {i} ({s['title']}) passed without power: {s['power_note']}."
        for i, s in enumerate(report["screens"], start=1)
        if s["unpowered_pass"]
    ]


_OVERLAP = {
    "retention_ids_in_replay": "shared ids",
    "retention_in_replay": "identical conversations",
    "replay_sharing_topic_with_retention": "shared topics",
    "replay_sharing_13gram_with_retention": "replay documents sharing a word 13-gram",
    "replay_sharing_long_message_with_retention": "replay documents sharing a 40+ character message",
}


def inputs_lines(report: dict[str, Any]) -> list[str]:
    """Where replay and retention come from, how many, and the overlap check, in words."""
    inputs = report.get("inputs")
    if not inputs or not inputs.get("split"):
        return ["The record holds no prepare run with the manifest of these inputs: their sources and overlap check are not stated."]
    info, split, checks, counts = inputs["conversations"], inputs["split"], inputs["checks"] or {}, inputs["counts"] or {}
    source = info["source"]
    made = info.get("package") or source
    digest = f", sha256 {info['sha256'][:12]}" if info.get("sha256") else ""
    topics = split.get("retention_topics") or []
    held = (
        f"{split['retention_groups']} held-out topics ({'; '.join(topics)})"
        if topics
        else f"{split['retention_groups']} held-out groups"
    )
    named = [k for k in _OVERLAP if k in checks] + sorted(k for k in checks if k not in _OVERLAP and k != "test_questions_in_training")
    overlap = ", ".join(f"{_OVERLAP.get(k, k)} {checks[k]}" for k in named)
    return [
        f"Replay: {split['replay']} conversations from {source} ({made}{digest}; {info.get('usable', '?')} usable), "
        f"{split.get('replay_topics', '?')} topics; trained at data.replay_weight.",
        f"Retention probes: {split['retention']} conversations from {source}, drawn from {held} that replay never shows; "
        f"scored only, never trained on.",
        f"Overlap check, probes against replay (each must be 0): {overlap}; "
        f"{split['replay_skipped_for_overlap']} replay candidates skipped for shared text. Rule: {split.get('overlap_rule', '')}.",
        f"Training documents {counts.get('train', '?')} ({counts.get('tasks', '?')} tasks, {counts.get('replay', '?')} replay); "
        f"final test {counts.get('test', '?')} cases, {checks.get('test_questions_in_training', '?')} of them in training. "
        f"Inputs sha256 {inputs['sha256'][:12]} (prepare run {inputs['prepare_run']}).",
    ]


def _methods(report: dict[str, Any]) -> list[str]:
    return [
        f"{i}. {s['title']}: {s['method']}. Inputs: "
        + ", ".join(f"{role} {run_id}" for role, run_id in sorted(s["run_ids"].items()))
        for i, s in enumerate(report["screens"], start=1)
    ]


def to_markdown(report: dict[str, Any]) -> str:
    parts = [
        f"# {_title(report)}",
        f"**{_verdict_line(report)}** {_needs(report)}",
        preset_line(report),
        "## Screens (pre-registered)",
        _md_table(*screen_rows(report)),
        POWER_NOTE,
        "### Methods and inputs",
        "\n".join(_methods(report)),
        "## Beside the screens",
        _md_table(*resource_rows(report)),
        DEVICE_SECONDS_NOTE + " " + BYTES_NOTE + " " + NO_DENSE_ARM,
        budget_line(report),
        "## Where an update's seconds went",
        _md_table(*breakdown_rows(report)),
        BREAKDOWN_NOTE,
        "## Replay and retention probes",
        "\n".join(f"- {line}" for line in inputs_lines(report)),
        "## Accuracy per family",
        _md_table(*accuracy_rows(report)),
        "## Paired outcomes of the non-inferiority test",
        _md_table(*paired_rows(report)),
        "## Train runs under this study",
        attempts_line(report),
        _md_table(*attempt_rows(report)),
        "## Evaluate runs under this study",
        evaluations_line(report),
        _md_table(*evaluation_rows(report)),
        "## Runs",
        _md_table(*run_rows(report)),
    ]
    return "\n\n".join(parts) + "\n"


# --- HTML ----------------------------------------------------------------------

def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def figures(records: Records, report: dict[str, Any]) -> dict[str, str]:
    """Plot title -> base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    arms = ARMS
    updates = records.updates.sort_values(["arm", "update"])

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm in arms:
        rows = updates[updates["arm"] == arm]
        ax.plot(rows["update"], rows["loss"], marker=".", label=arm)
    ax.set(xlabel="update", ylabel="loss (globally normalized)", title="Loss per update")
    ax.legend()
    out["Loss per update, both arms"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([updates.loc[updates["arm"] == arm, "update_seconds"] for arm in arms], tick_labels=list(arms))
    for i, arm in enumerate(arms, start=1):
        values = updates.loc[updates["arm"] == arm, "update_seconds"]
        ax.scatter([i] * len(values), values, s=8, alpha=0.5)
    ax.set(ylabel="seconds", title="Seconds per update")
    out["Update-seconds distributions"] = _png(fig)
    plt.close(fig)

    parts = [p for p in BREAKDOWN if updates[p].notna().any()]
    if parts:
        fig, axes = plt.subplots(1, len(arms), figsize=(10, 3.5), sharey=True)
        for ax, arm in zip(axes, arms):
            rows = updates[updates["arm"] == arm]
            bottom = [0.0] * len(rows)
            for part in parts:
                values = rows[part].fillna(0.0).tolist()
                ax.bar(rows["update"], values, bottom=bottom, label=part.removesuffix("_seconds").replace("_", " "))
                bottom = [b + v for b, v in zip(bottom, values)]
            ax.set(xlabel="update", title=arm)
        axes[0].set(ylabel="seconds (rank 0)")
        axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.suptitle("Where each update's seconds went")
        out["Time breakdown per update, each arm"] = _png(fig)
        plt.close(fig)

    acc = sc.accuracy_by_family(records.cases)
    families = sorted(acc["family"].unique(), key=lambda f: (f == sc.ALL_FAMILIES, f))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(MODELS)
    for j, model in enumerate(MODELS):
        rows = acc[acc["model"] == model].set_index("family").reindex(families)
        ax.bar([i + j * width for i in range(len(families))], rows["accuracy"] * 100, width, label=model)
    ax.set_xticks([i + width * (len(MODELS) - 1) / 2 for i in range(len(families))], families)
    ax.set(ylabel="accuracy (%)", ylim=(0, 100), title="Accuracy per family and model")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    out["Accuracy per family per model"] = _png(fig)
    plt.close(fig)

    headers, rows = paired_rows(report)
    counts = [[int(c) for c in row[1:]] for row in rows]
    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    ax.imshow(counts, cmap="Blues")
    darkest = max(max(row) for row in counts)
    for r in range(2):
        for c in range(2):
            ax.text(c, r, str(counts[r][c]), ha="center", va="center", color="white" if counts[r][c] > darkest / 2 else "black")
    ax.set_xticks([0, 1], headers[1:])
    ax.set_yticks([0, 1], [row[0] for row in rows])
    ax.set_title("Paired outcomes, compressed vs control")
    out["Paired outcome table of the non-inferiority test"] = _png(fig)
    plt.close(fig)

    diffs = sc.retention_differences(records.retention).sort_values("diff_mean")
    ret = _screen(report, sc.RETENTION)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.scatter(range(len(diffs)), diffs["diff_mean"], s=10, label="document")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.axhline(ret["estimate"], color="C1", label="mean")
    ax.axhline(ret["bound"], color="C2", ls="--", label="upper bound")
    ax.axhline(ret["threshold"], color="C3", ls=":", label="threshold")
    ax.set(xlabel="document (sorted)", ylabel="compressed - seed mean NLL (nats)", title="Retention NLL differences")
    ax.legend(fontsize="small")
    out["Retention NLL differences, per document"] = _png(fig)
    plt.close(fig)
    return out


_CSS = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}"
    "th{background:#f3f3f3}.pass{color:#1a7f37}.fail{color:#cf222e}img{max-width:100%}"
)


def to_html(report: dict[str, Any], plots: dict[str, str]) -> str:
    verdicts = " ".join(f'<span class="{v}">{html.escape(g)}: {v.upper()}</span>' for g, v in report["verdicts"].items())
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(_title(report))}</title>"
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(_title(report))}</h1>",
        f"<p><strong>{verdicts}</strong></p>",
        *(f"<p>{html.escape(line)}</p>" for line in _unpowered(report)),
        f"<p>{html.escape(preset_line(report))}</p>",
        "<h2>Screens (pre-registered)</h2>",
        _html_table(*screen_rows(report)),
        f"<p>{html.escape(POWER_NOTE)}</p>",
        "<h3>Methods and inputs</h3><ol>",
        *(f"<li>{html.escape(m.split('. ', 1)[1])}</li>" for m in _methods(report)),
        "</ol><h2>Beside the screens</h2>",
        _html_table(*resource_rows(report)),
        f"<p>{html.escape(DEVICE_SECONDS_NOTE)} {html.escape(BYTES_NOTE)} {html.escape(NO_DENSE_ARM)}</p>",
        f"<p>{html.escape(budget_line(report))}</p>",
        "<h2>Where an update's seconds went</h2>",
        _html_table(*breakdown_rows(report)),
        f"<p>{html.escape(BREAKDOWN_NOTE)}</p>",
        "<h2>Replay and retention probes</h2><ul>",
        *(f"<li>{html.escape(line)}</li>" for line in inputs_lines(report)),
        "</ul>",
        "<h2>Accuracy per family</h2>",
        _html_table(*accuracy_rows(report)),
        "<h2>Paired outcomes of the non-inferiority test</h2>",
        _html_table(*paired_rows(report)),
        "<h2>Plots</h2>",
        *(f"<h3>{html.escape(title)}</h3><img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>"
          for title, data in plots.items()),
        "<h2>Train runs under this study</h2>",
        f"<p>{html.escape(attempts_line(report))}</p>",
        _html_table(*attempt_rows(report)),
        "<h2>Evaluate runs under this study</h2>",
        f"<p>{html.escape(evaluations_line(report))}</p>",
        _html_table(*evaluation_rows(report)),
        "<h2>Runs</h2>",
        _html_table(*run_rows(report)),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
