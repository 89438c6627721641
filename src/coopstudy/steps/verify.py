"""verify: the CPU equivalence gate before training."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from coopstudy import ui
from coopstudy.commit import ledger as ledger_mod
from coopstudy.commit import receipts, sources
from coopstudy.config import Config
from coopstudy.record import schema, writer
from coopstudy.run import lock


def _wrapped(names: Iterable[str]) -> str:
    return textwrap.fill(", ".join(names), 70, subsequent_indent=" " * 9)


# coopstudy.numerics.gate (torch, transformers) is imported when the step runs, so
# `--help` stays fast; tests/test_gate.py keeps this text in step with it.
HELP = "equivalence gate: the batched two-rank DDP update must match the per-document reference"
DESCRIPTION = f"""\
Runs the equivalence gate on CPU: two gloo ranks run the training update
(length-sorted packed microbatches: documents back to back, no padding,
positions and attention per document; global normalization, no_sync
accumulation, DDP all-reduce, fused AdamW) and one process runs the
per-document reference from the same start, in float64. After one and after
two updates, every parameter, both AdamW moments, the loss and the gradient
norm must agree within a relative error of 1e-09. Cases: unequal-lengths,
weights-on-one-rank, weights-on-the-other-rank, prompt-and-padding-masks,
partial-final-microbatch, clipped-gradient, nonzero-first-weight,
adjacent-one-token-documents, one-document-microbatch.

Reads:  the numerical sources, every module of coopstudy/numerics/
        ({_wrapped(Path(name).name for name in sources.numerical_sources())});
        the preset's optimizer settings (train.lr, adam_*, weight_decay,
        warmup_updates, grad_clip).
Writes: on success, a `{ledger_mod.GATE}` entry (subject {sources.GATE_SUBJECT!r}) in the
        ledger, which `train` requires; an MLflow run (stage {schema.STAGE_VERIFY!r}) with
        {schema.ART_GATE_RECEIPT}, metric {schema.M_GATE_MAX_REL_ERROR} and tag {schema.TAG_GATE}.
        A failed gate leaves a FAILED run with its receipt and appends nothing.
"""


def _table(summary: list[dict[str, Any]], tolerance: float):
    from rich.table import Table

    from coopstudy.numerics import gate

    table = Table(title=f"equivalence gate (float64, 2 gloo ranks, tolerance {tolerance:g})")
    for col in ("case", "update", *gate.TENSORS, *gate.SCALARS, "result"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for row in summary:
        table.add_row(
            row["case"],
            str(row["update"]),
            *(f"{row[k]:.1e}" for k in (*gate.TENSORS, *gate.SCALARS)),
            "[green]pass[/green]" if row["passed"] else "[red]FAIL[/red]",
        )
    return table


def run(cfg: Config, args: argparse.Namespace) -> int:
    from coopstudy.numerics import gate

    # Wide enough for the table when output goes to a file or a pipe (80 columns by default).
    console = ui.console(110)
    book = ledger_mod.Ledger()
    # Two gloo ranks and the reference compute on the CPU, whatever the devices:
    # beside a training job they would spoil its timings, as any job would (run.lock).
    with lock.one_process_job(f"coopstudy verify --preset {cfg.preset_argument}", ["cpu"]) as held, writer.stage_run(schema.STAGE_VERIFY, cfg) as rec:
        held.note(run_id=rec.run_id)
        # A ledger that cannot take the receipt is refused before the gate's minutes, not after them.
        with book.locked():
            book.entries()
        result = gate.run_gate(cfg)
        receipt = receipts.gate_receipt(result, cfg)
        digest = receipts.gate_receipt_digest(receipt)
        rec.log_dict(receipt, schema.ART_GATE_RECEIPT)
        rec.log_metrics({schema.M_GATE_MAX_REL_ERROR: result.max_rel_error})
        console.print(_table(gate.case_summary(result.rows), gate.TOLERANCE))
        if not result.passed:
            shown = "; ".join(result.failures[:3])
            more = f" (and {len(result.failures) - 3} more)" if len(result.failures) > 3 else ""
            raise gate.GateFailed(f"equivalence gate failed: {shown}{more}")
        entry, _ = book.commit(
            rec,
            ledger_mod.GATE,
            sources.GATE_SUBJECT,
            digest,
            {
                "sources_sha256": receipt["sources_sha256"],
                "sources": receipt["sources"],
                "libraries": receipt["libraries"],
                "max_rel_error": receipt["max_rel_error"],
                "run_id": rec.run_id,
            },
            tags={schema.TAG_GATE: digest},
        )
    console.print(
        f"gate passed: max relative error {result.max_rel_error:.2e} over {len(result.rows)} comparisons "
        f"in {result.seconds:.1f} s; receipt {digest[:12]} (ledger entry {entry.seq}, sources {receipt['sources_sha256'][:12]})"
    )
    return 0
