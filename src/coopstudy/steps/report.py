"""`report`: the pre-registered screens, computed from the tracked runs alone."""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coopstudy import ui, workspace
from coopstudy.config import Config
from coopstudy.errors import UserError
from coopstudy.record import schema, writer

if TYPE_CHECKING:
    from analysis.screens import Screen

NOTE_LIMIT = 8000
"""MLflow's longest tag value."""
NOTE_CUT = f"MLflow keeping {NOTE_LIMIT:,} characters of a description"
"""Why the run's description stops short of report.md."""
REPORT_FOLDER = "<home>/reports/<plan|config>-<first 12 digits of the sha>/"
"""Where the report's files go unless --out names a folder."""
WRITING = ".report-being-written"
"""In a report folder: the report being written, moved in once every file of it is whole."""
WRITING_LOCK = ".report-lock"
"""In a report folder: held by the report writing it (two reports never write one folder at once)."""


HELP = "compute the pre-registered screens from the tracked runs and write the report"
DESCRIPTION = f"""\
Judges the study by its pre-registered screens and writes the report.

Reads, from the tracking store (a server's record is enough), the runs of one
study (tagged with --plan SHA, else with this config's sha): the newest
FINISHED select run (the candidates' hashes), the train runs whose weights it
selected (per-update and per-run metrics) and the first FINISHED evaluate run
under its plan of seed, control and compressed (test-case and retention
tables; later ones are listed, not read).
Refuses, naming what is missing, when a role has no such run, and when a
source the study's plan binds differs from the one on disk here.

Computes the five screens (accuracy gain, retention, non-inferiority, active and
complete-process speedup) and the cost figures beside them.

Writes {schema.ART_REPORT_JSON} (every screen's estimate, bound, threshold, verdict and input
run ids; the quality and speed verdicts; the budget; every train and evaluate
attempt; no time of its own making, only the runs' recorded starts and ends, so
rebuilding it from the same store gives the same file), {schema.ART_REPORT_MD},
{schema.ART_REPORT_HTML} (with plots) and the plots as PNG files ({schema.ART_FIGURES}/) to --out
(default: {REPORT_FOLDER}) and to this
step's run, with the verdicts as tags, the screens as metrics and report.md as the
run's description (whole sections up to the {NOTE_LIMIT:,} characters MLflow keeps);
prints the screens."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", metavar="SHA", help="report the study committed under this plan sha, whole or its first 12 or more digits, "
        "with the study's --preset and --set (default: this config's runs)")
    parser.add_argument("--out", metavar="DIR", help=f"folder for the report files (default: {REPORT_FOLDER})")


def _key_metrics(screens: list[Screen]) -> dict[str, float]:
    metrics = {}
    for s in screens:
        prefix = f"{schema.M_SCREEN_PREFIX}{s.name}/"
        metrics[prefix + "estimate"] = s.estimate
        metrics[prefix + "passed"] = float(s.passed)
        if s.bound is not None:
            metrics[prefix + "bound"] = s.bound
    return metrics


def _print(report: dict[str, Any], folder: Path) -> None:
    from rich.table import Table

    from analysis import report as rep

    # Wide enough that no word breaks when the output goes to a file or a pipe.
    console = ui.console(160)
    headers, rows = rep.screen_rows(report)
    table = Table(title="Pre-registered screens")
    for h in headers:
        table.add_column(h, overflow="fold")
    for row in rows:
        style = "green" if row[-1] == "PASS" else "red"
        table.add_row(*row[:-1], f"[{style}]{row[-1]}[/]")
    console.print(table)
    for title, (headers, rows) in (
        ("Beside the screens", rep.resource_rows(report)),
        ("Where an update's seconds went", rep.breakdown_rows(report)),
    ):
        beside = Table(title=title)
        for h in headers:
            beside.add_column(h, overflow="fold")
        for row in rows:
            beside.add_row(*row)
        console.print(beside)
    console.print(rep.budget_line(report), soft_wrap=True)
    console.print(rep.attempts_line(report), soft_wrap=True)
    console.print(rep.evaluations_line(report), soft_wrap=True)
    console.print(rep.preset_line(report), soft_wrap=True, markup=False)  # values such as [gcd, products] are no markup
    console.print("  ".join(f"{group}: [bold]{verdict.upper()}[/]" for group, verdict in report["verdicts"].items()))
    console.print(f"report written to {folder}", soft_wrap=True)


def _note(markdown: str) -> str:
    """The report as its run's description: whole where MLflow keeps it, else cut
    before the first section that does not fit, naming the sections left out
    (where not even the first fits, between its paragraphs)."""
    if len(markdown) <= NOTE_LIMIT:
        return markdown
    def tail(what: str) -> str:
        return f"\n\n... ({what} in {schema.ART_REPORT_MD} among this run's artifacts, {NOTE_CUT})"

    # A cut keeps at least the first section; one that cannot fit whole is cut between paragraphs.
    for cut in reversed([m.start() for m in re.finditer(r"^## ", markdown, re.M)][1:]):
        left = [line.removeprefix("## ") for line in markdown[cut:].splitlines() if line.startswith("## ")]
        said = tail(f"{'; '.join(left)}:")
        if cut + len(said) <= NOTE_LIMIT:
            return markdown[:cut].rstrip() + said
    said = tail("the rest is")
    head = markdown[: NOTE_LIMIT - len(said)]
    return head[: head.rfind("\n\n")].rstrip() + said if "\n\n" in head else head + said


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _in_the_way(folder: Path) -> None:
    """mkdir says "File exists" of a file (or a device, /dev/null) at the folder's name: say what is there."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"report folder {folder}: cannot make it (a file is there, not a folder)")


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _in_the_way(folder)
        raise UserError(f"report folder {folder}: cannot make it ({err.strerror})") from None


@contextlib.contextmanager
def _folder_held(folder: Path) -> Iterator[None]:
    """The report folder, written by one report at a time; made again where it
    was removed while the record was read (minutes, from a remote server)."""
    _make_folder(folder)
    with open(folder / WRITING_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write_whole(folder: Path, files: dict[str, str], images: dict[str, bytes]) -> None:
    """This report's files and figures in `folder`, or, where writing them is cut
    short (a full disk, a stop), the last report's as they were: never the
    JSON of one report beside the HTML of another. Other files in the folder
    (and in its figures/) are left alone."""
    writing = folder / WRITING
    shutil.rmtree(writing, ignore_errors=True)  # left by a report killed as it wrote
    try:
        (writing / schema.ART_FIGURES).mkdir(parents=True)
        for name, text in files.items():
            _write_synced(writing / name, text.encode())
        for name, png in images.items():
            _write_synced(writing / schema.ART_FIGURES / name, png)
        (folder / schema.ART_FIGURES).mkdir(exist_ok=True)  # a file in the way is said before anything moves
        # Renames take no room, so a full disk cannot stop them halfway; a stop waits for them.
        with _stops_held():
            for name in files:
                _move(writing / name, folder / name)
            for name in images:
                _move(writing / schema.ART_FIGURES / name, folder / schema.ART_FIGURES / name)
    finally:
        shutil.rmtree(writing, ignore_errors=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        os.fsync(fh.fileno())  # whole on disk before its name says it is


def _move(src: Path, dst: Path) -> None:
    # A seam of its own: a test stops the report between two moves, which
    # patching os.replace would do to the whole process.
    os.replace(src, dst)


@contextlib.contextmanager
def _stops_held() -> Iterator[None]:
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) that comes inside acts once the
    block is done, as it would have. Handlers, not a signal mask: a mask holds
    only the thread that sets it, and the kernel may hand the signal to another."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; signals reach it alone
        return
    came: list[int] = []
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in stops if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if came:
            signal.raise_signal(came[0])


def check_arguments(cfg: Config, args: argparse.Namespace) -> None:
    """What report refuses in its arguments, before its run opens (and under --dry-run)."""
    from analysis import records as records_mod

    out = getattr(args, "out", None)
    if out is not None and not out.strip():
        raise UserError("--out: an empty path; name a folder (or leave --out out for the default)")
    if out is not None:
        _in_the_way(Path(out))  # as the step would say it once its run opened, under --dry-run too
    if getattr(args, "plan", None) is not None:
        records_mod.check_plan_argument(args.plan)


def run(cfg: Config, args: argparse.Namespace) -> int:
    from analysis import records as records_mod
    from analysis import report as rep
    from analysis import screens as sc

    check_arguments(cfg, args)
    plan = getattr(args, "plan", None)
    out = getattr(args, "out", None)
    # The run opens first so that a refusal stays on record as a FAILED report run.
    with writer.stage_run(schema.STAGE_REPORT, cfg) as rec:
        if out:
            # A folder that cannot be made is said before the record is read.
            folder = Path(out)
            _make_folder(folder)
        records = records_mod.load(cfg, plan)
        if records.plan:
            rec.set_tags({schema.TAG_PLAN: records.plan})
        screens = sc.compute(records.cases, records.retention, records.train, cfg.screens)
        report = rep.build(records, screens, cfg)
        if not out:
            folder = workspace.home() / "reports" / records.key.folder
            _make_folder(folder)
        plots = rep.figures(records, report)
        markdown = rep.to_markdown(report)
        files = {
            schema.ART_REPORT_JSON: rep.dumps(report),
            schema.ART_REPORT_MD: markdown,
            schema.ART_REPORT_HTML: rep.to_html(report, plots),
        }
        # The figures as images of the run too, not only inside the HTML.
        images = {f"{_slug(title)}.png": base64.b64decode(png) for title, png in plots.items()}
        with _folder_held(folder):
            _write_whole(folder, files, images)
            # Still held: what the run keeps is what this report wrote.
            for name in files:
                rec.log_artifact(folder / name)
            for name in images:
                rec.log_artifact(folder / schema.ART_FIGURES / name, schema.ART_FIGURES)
        # What the run page shows first: the report itself.
        rec.set_tags({writer.NOTE_TAG: _note(markdown)})
        rec.log_metrics(_key_metrics(screens))
        rec.set_tags(
            {schema.TAG_VERDICT_PREFIX + group: verdict for group, verdict in report["verdicts"].items()}
            | {schema.TAG_VERDICT_PREFIX + s.name: s.verdict for s in screens}
        )
    _print(report, folder)
    return 0
