"""Benchmarks that print a table and log it to MLflow (not timed tests).

    python -m coopstudy.bench objective --preset tiny|smollm2-135m-cpu [--updates 2]

`objective`: the batched training update (the control arm's microbatches,
length-sorted and padded, one process) against the per-document reference
(each document alone) on the same documents from the same weights, in one
run, with torch.set_num_threads(train.threads_per_device): milliseconds per
update, their ratio, the loss of both (they must agree), and the padding
efficiency of the whole schedule for both arms' shapes, sorted and unsorted.

Documents come from the prepared inputs of the preset when they exist
(`prepare` has run); otherwise synthetic documents of realistic shape are
made and the table says so: task documents of 80-220 tokens whose last 2-10
tokens are answer tokens of weight 8, and replay documents of 150 tokens up to
data.max_context that alternate prompt (0) and assistant (1) segments, three
tasks to one replay document as in the protocol, in the preset's schedule
shape (train.updates global batches of train.global_batch).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from coopstudy import batching, config as config_mod, objective, tracking, update
from coopstudy.config import Config
from coopstudy.distributed import DistContext
from coopstudy.errors import UserError


@dataclass(frozen=True)
class SyntheticDoc:
    input_ids: tuple[int, ...]
    weights: tuple[float, ...]


def synthetic_documents(cfg: Config, vocab_size: int, seed: int = 0) -> tuple[list[SyntheticDoc], list[list[int]]]:
    rng = random.Random(seed)
    longest = cfg.data.max_context
    docs = []
    for i in range(cfg.train_documents):
        if i % 4 == 3:
            n = rng.randrange(min(150, longest - 1), longest + 1)
            weights, weight = [], 0.0
            while len(weights) < n:
                weights += [weight] * rng.randrange(10, 60)
                weight = 1.0 - weight
            weights = [0.0] + weights[1:n]
        else:
            n = min(rng.randrange(80, 221), longest)
            answer = rng.randrange(2, 11)
            weights = [0.0] * (n - answer) + [8.0] * answer
        docs.append(SyntheticDoc(tuple(rng.randrange(vocab_size) for _ in range(n)), tuple(weights)))
    order: list[int] = []
    while len(order) < cfg.train.updates * cfg.train.global_batch:
        order += rng.sample(range(len(docs)), len(docs))
    g = cfg.train.global_batch
    return docs, [order[k * g : (k + 1) * g] for k in range(cfg.train.updates)]


def _documents(cfg: Config, source: str, vocab_size: int) -> tuple[Sequence, list[list[int]], str]:
    if source in ("auto", "prepared"):
        from coopstudy import data

        try:
            prepared = data.load_prepared(cfg)
            return prepared.train, prepared.schedule, f"prepared inputs {prepared.digest[:12]}"
        except UserError:
            if source == "prepared":
                raise
            note = "synthetic (this preset has no prepared inputs; run prepare to use them)"
    else:
        note = "synthetic (asked for)"
    docs, schedule = synthetic_documents(cfg, vocab_size)
    return docs, schedule, note


def _load_seed(cfg: Config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from coopstudy.seed import resolve_seed

    hf_logging.disable_progress_bar()
    seed = resolve_seed(cfg)
    return update.cast_for_training(AutoModelForCausalLM.from_pretrained(seed.path), cfg.train.precision)


def bench_objective(cfg: Config, *, updates: int, source: str, console: Console) -> dict[str, float]:
    torch.set_num_threads(cfg.train.threads_per_device)
    lm = _load_seed(cfg)
    docs, schedule, note = _documents(cfg, source, lm.config.vocab_size)
    if updates + 1 > len(schedule):
        raise UserError(f"--updates: {updates} timed updates need {updates + 1} schedule rows, the schedule has {len(schedule)}")
    precision = cfg.train.precision
    microbatch = cfg.arms.control.microbatch
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    reference = copy.deepcopy(lm)
    net = objective.WeightedNLL(lm)
    opt = update.build_optimizer(lm.parameters(), cfg.train)
    sched = update.build_scheduler(opt, cfg.train.warmup_updates)
    ref_opt = update.build_optimizer(reference.parameters(), cfg.train)
    ref_sched = update.build_scheduler(ref_opt, cfg.train.warmup_updates)

    batched_s, reference_s, loss_gaps = [], [], []
    # Row 0 warms both paths up (allocator, lazy inits) and is not timed; the
    # two paths then alternate update by update, so both see the same machine.
    for k in range(updates + 1):
        row = schedule[k]
        plan = batching.plan_update(docs, row, 0, 1, microbatch)
        mbs = [
            batching.collate([docs[i] for i in mb], weight_dtype=objective.param_dtype(precision))
            for mb in plan.microbatches
        ]
        got = update.run_update(net, opt, sched, mbs, plan.total_weight, ctx, precision=precision, grad_clip=cfg.train.grad_clip)
        want = update.reference_update(
            reference, ref_opt, ref_sched, [docs[i] for i in row], plan.total_weight, precision=precision, grad_clip=cfg.train.grad_clip
        )
        console.print(f"update {k + 1}{' (warm-up)' if k == 0 else ''}: batched {got.seconds:.2f} s, per-document {want.seconds:.2f} s")
        if k:
            batched_s.append(got.seconds)
            reference_s.append(want.seconds)
        loss_gaps.append(abs(got.loss - want.loss) / abs(want.loss))

    lengths = [len(d.input_ids) for d in docs]
    padding = {
        (arm, sort): batching.padding_efficiency(
            lengths, schedule, getattr(cfg.arms, arm).workers, getattr(cfg.arms, arm).microbatch, sort=sort
        ).ratio
        for arm in ("control", "compressed")
        for sort in (True, False)
    }
    batched_ms = 1000 * statistics.mean(batched_s)
    reference_ms = 1000 * statistics.mean(reference_s)
    result = {
        tracking.M_BENCH_BATCHED_MS: batched_ms,
        tracking.M_BENCH_REFERENCE_MS: reference_ms,
        tracking.M_BENCH_SPEEDUP: reference_ms / batched_ms,
        tracking.M_BENCH_LOSS_REL_GAP: max(loss_gaps),
        **{
            f"{tracking.M_BENCH_PADDING_PREFIX}{'sorted' if sort else 'unsorted'}/{arm}": ratio
            for (arm, sort), ratio in padding.items()
        },
    }

    table = Table(title=f"objective benchmark, preset {cfg.preset}")
    table.add_column("quantity")
    table.add_column("value")
    table.add_row("documents", note)
    table.add_row("model", f"{sum(p.numel() for p in lm.parameters()) / 1e6:.1f} M parameters, {precision}, {torch.get_num_threads()} thread(s)")
    table.add_row("update", f"{cfg.train.global_batch} documents, control microbatch {microbatch}; {updates} timed updates after 1 warm-up")
    table.add_row("batched ms / update", f"{batched_ms:,.0f}")
    table.add_row("per-document ms / update", f"{reference_ms:,.0f}")
    table.add_row("ratio (per-document / batched)", f"{reference_ms / batched_ms:.2f}x")
    table.add_row("loss, max relative gap", f"{max(loss_gaps):.1e}")
    for arm in ("control", "compressed"):
        shape = getattr(cfg.arms, arm)
        table.add_row(
            f"padding efficiency, {arm} ({shape.workers} x mb {shape.microbatch})",
            f"sorted {padding[(arm, True)]:.3f} / unsorted {padding[(arm, False)]:.3f}",
        )
    console.print(table)
    rows = [{"quantity": r[0], "value": r[1]} for r in zip(table.columns[0].cells, table.columns[1].cells)]
    with tracking.stage_run(tracking.STAGE_BENCH, cfg, run_name=f"bench-objective-{cfg.preset}", tags={tracking.TAG_BENCH_DOCUMENTS: note}) as rec:
        rec.log_metrics(result)
        rec.log_table(rows, tracking.ART_BENCH_TABLE)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coopstudy.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = sub.add_parser("objective", help="batched update against the per-document reference")
    p.add_argument("--preset", default="smollm2-135m-cpu")
    p.add_argument("--set", dest="overrides", action="extend", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--updates", type=int, default=2, help="timed updates, after one warm-up update (default 2)")
    p.add_argument("--documents", choices=("auto", "prepared", "synthetic"), default="auto",
                   help="prepared inputs, synthetic documents, or prepared when they exist (default)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.updates < 1:
            raise UserError("--updates: at least 1")
        cfg = config_mod.load(args.preset, args.overrides)
        bench_objective(cfg, updates=args.updates, source=args.documents, console=Console(width=max(Console().width, 110)))
    except UserError as err:
        print(f"coopstudy.bench {args.bench}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
