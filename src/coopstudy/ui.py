"""What a person watching sees: one progress display and the console tables
print to. At a terminal the display is a live bar, redrawn only when work
advances (no display thread competes with training for the device's core);
anywhere else (a file, a pipe, CI) it is a log line per twentieth of the
work (per training update: `each`)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from rich.console import Console

T = TypeVar("T")
LOG_LINES = 20
"""Off a terminal: at most about this many lines per display, and one at the end."""
LOG_EVERY_SECONDS = 30.0
"""Off a terminal: the longest silence while work advances slowly."""
LOG_QUIET_SECONDS = 2.0
"""Off a terminal: work done sooner says only its last line (48 tokenized tasks
in a fraction of a second were 16 lines of "ETA 0 s")."""
Advance = Callable[..., None]
"""advance(n=1, **fields): n more items done; fields (loss=..., ...) are shown beside the count."""


def hide_transformers_bars() -> None:
    """Turn off transformers' own bars (per-tensor loading, writing model
    shards): the display a person watches is this module's, and theirs would sit
    among its lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def console(min_width: int = 110) -> Console:
    """A console at least `min_width` columns wide, so tables stay whole in a file or a pipe
    (rich assumes 80 columns there). There a line is never broken either: a path
    or a sha split over two lines is lost to grep and to copy and paste (rich
    then sets a table's title flush left, not centred; its cells wrap as before)."""
    return Console(width=max(Console().width, min_width), soft_wrap=not sys.stdout.isatty())


def _shown(fields: dict[str, Any]) -> str:
    return " ".join(f"{k.replace('_', ' ')} {v:.4g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}" for k, v in fields.items())


@contextlib.contextmanager
def progress(label: str, total: int, *, enabled: bool = True, unit: str = "", each: bool = False) -> Iterator[Advance]:
    """A display of `total` items of work; yields the function that advances it.

    each=True logs every advance off a terminal: training updates are few,
    each one a result a person (or a test) waits for. The last line says the
    seconds the work took."""
    if not enabled:
        yield lambda n=1, **fields: None
        return
    started = time.perf_counter()
    done = 0
    if not sys.stderr.isatty():
        # A log gets a line per twentieth of the work, and one at least every
        # LOG_EVERY_SECONDS while it is slow, not one per item (320 tokenized
        # tasks were 320 lines).
        step = 1 if each else max(1, -(-total // LOG_LINES))
        shown_at, shown_time = 0, started

        def line(n: int = 1, **fields: Any) -> None:
            nonlocal done, shown_at, shown_time
            done += n
            now = time.perf_counter()
            if done < total and (
                (done // step == shown_at // step and now - shown_time < LOG_EVERY_SECONDS)
                or (not each and now - started < LOG_QUIET_SECONDS)
            ):
                return
            shown_at, shown_time = done, now
            extra = f" {_shown(fields)}" if fields else ""
            when = f"ETA {(now - started) / done * (total - done):.0f} s" if done < total else f"in {now - started:.1f} s"
            print(f"{label}: {unit}{' ' if unit else ''}{done}/{total}{extra} {when}", file=sys.stderr, flush=True)

        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[shown]}"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=Console(stderr=True), auto_refresh=False, transient=True,
    )  # fmt: skip
    task = bar.add_task(label, total=total, shown="")
    with bar:
        yield lambda n=1, **fields: bar.update(task, advance=n, shown=_shown(fields), refresh=True)


def track(items: Sequence[T], label: str) -> Iterable[T]:
    """The items, with a progress display while they are iterated."""
    with progress(label, len(items)) as advance:
        for item in items:
            yield item
            advance()
