"""Benchmarks that print a table and log it to MLflow (not timed tests).

    python -m coopstudy bench objective --preset tiny|smollm2-135m-cpu [--updates 2]
    python -m coopstudy bench generate --preset smollm2-135m-cpu [--items 32]

(`python -m coopstudy.bench ...` is the same command.)

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

`generate`: batched against one-at-a-time greedy generation on the seed model.
Draws test-like cases (the families and test seed of the preset, the prompt
form of the final test; nothing from the prepared files is needed), generates
their answers once prompt by prompt and once in batches of
evaluate.batch_size, prints cases/s for both and the speed-up, and checks that
both give the same tokens for every case (exit 1 if not). Also prints the
seed's strict accuracy per family on these cases. Evaluation is not a timed
arm: torch keeps its default thread count, which is printed.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from coopstudy import scoring, ui
from coopstudy.commit import require
from coopstudy.config import Config
from coopstudy.errors import UserError
from coopstudy.inputs import chat, tasks
from coopstudy.inputs.seed import resolve_seed
from coopstudy.numerics import batching, objective, update
from coopstudy.numerics.distributed import DistContext
from coopstudy.record import schema, writer


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

        try:
            prepared = require.inputs(cfg)
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


    hf_logging.disable_progress_bar()
    seed = resolve_seed(cfg)
    return objective.Precision.of(cfg.train.precision).cast(AutoModelForCausalLM.from_pretrained(seed.path))


def bench_objective(cfg: Config, *, updates: int, source: str, console: Console) -> dict[str, float]:
    torch.set_num_threads(cfg.train.threads_per_device)
    lm = _load_seed(cfg)
    docs, schedule, note = _documents(cfg, source, lm.config.vocab_size)
    if updates + 1 > len(schedule):
        raise UserError(f"--updates: {updates} timed updates need {updates + 1} schedule rows, the schedule has {len(schedule)}")
    precision = objective.Precision.of(cfg.train.precision)
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
        got = update.worker_update(net, opt, sched, docs, row, ctx, microbatch=microbatch, precision=precision, grad_clip=cfg.train.grad_clip)
        want = update.reference_update(
            reference, ref_opt, ref_sched, [docs[i] for i in row], batching.total_weight(docs, row),
            precision=precision, grad_clip=cfg.train.grad_clip,
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
        schema.M_BENCH_BATCHED_MS: batched_ms,
        schema.M_BENCH_REFERENCE_MS: reference_ms,
        schema.M_BENCH_SPEEDUP: reference_ms / batched_ms,
        schema.M_BENCH_LOSS_REL_GAP: max(loss_gaps),
        **{
            f"{schema.M_BENCH_PADDING_PREFIX}{'sorted' if sort else 'unsorted'}/{arm}": ratio
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
    with writer.stage_run(schema.STAGE_BENCH, cfg, run_name=f"bench-objective-{cfg.preset}", tags={schema.TAG_BENCH_DOCUMENTS: note}) as rec:
        rec.log_metrics(result)
        rec.log_table(rows, schema.ART_BENCH_TABLE)
    return result


HELP = "benchmarks: the batched update against the per-document reference; batched generation"
DESCRIPTION = __doc__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from coopstudy.cli import add_config_arguments

    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = sub.add_parser("objective", help="batched update against the per-document reference")
    add_config_arguments(p)
    p.add_argument("--updates", type=int, default=2, help="timed updates, after one warm-up update (default 2)")
    p.add_argument("--documents", choices=("auto", "prepared", "synthetic"), default="auto",
                   help="prepared inputs, synthetic documents, or prepared when they exist (default)")  # fmt: skip
    g = sub.add_parser("generate", help="batched against one-at-a-time greedy generation on the seed model")
    add_config_arguments(g)
    g.add_argument("--items", type=int, default=32, help="test cases to generate (default 32)")


def run(cfg: Config, args: argparse.Namespace) -> int:
    if args.bench == "generate":
        return bench_generate(cfg, args.items)
    if args.updates < 1:
        raise UserError("--updates: at least 1")
    bench_objective(cfg, updates=args.updates, source=args.documents, console=ui.console(110))
    return 0


def generation_cases(cfg: Config, items: int) -> list[dict]:
    """`items` cases spread evenly over the families, as the final test asks them."""
    families = cfg.data.families
    per_family = -(-items // len(families))
    out = []
    for pos, fam in enumerate(families):
        ds = tasks.dataset(fam, tasks.family_seed(cfg.data.test_seed, pos), per_family)
        out += [
            {"case_id": f"{fam}/{i}", "family": fam, "messages": tasks.task_messages(ds[i]["question"]), "entry": ds[i]}
            for i in range(per_family)
        ]
    return out[:items]


def bench_generate(cfg: Config, items: int) -> int:
    seed = resolve_seed(cfg)
    tokenizer = scoring.load_tokenizer(seed.path, "seed")
    model = scoring.load_model(seed.path, "seed", tokenizer)
    test = generation_cases(cfg, items)
    prompts = [chat.prompt_ids(tokenizer, c["messages"]) for c in test]
    common = {"max_new_tokens": cfg.evaluate.max_new_tokens, "stop": scoring.stop_ids(tokenizer), "pad_id": scoring.padding_id(tokenizer)}
    print(
        f"seed {seed.path} ({seed.parameters:,} parameters), {len(test)} cases, max_new_tokens "
        f"{cfg.evaluate.max_new_tokens}, torch threads {torch.get_num_threads()}, device {next(model.parameters()).device}",
        flush=True,
    )

    timings = {}
    outputs = {}
    for label, batch in (("one at a time", 1), ("batched", cfg.evaluate.batch_size)):
        start = time.perf_counter()
        with ui.progress(label, len(test)) as advance:
            outputs[label] = scoring.generate(model, prompts, batch_size=batch, progress=advance, **common)
        timings[label] = (batch, time.perf_counter() - start)

    print(f"\n{'mode':<14} {'batch':>5} {'seconds':>8} {'cases/s':>8} {'new tokens':>10}")
    for label, (batch, seconds) in timings.items():
        new_tokens = sum(len(g.tokens) + g.finished for g in outputs[label])
        print(f"{label:<14} {batch:>5} {seconds:>8.2f} {len(test) / seconds:>8.2f} {new_tokens:>10}")
    speedup = timings["one at a time"][1] / timings["batched"][1]
    differing = [c["case_id"] for c, a, b in zip(test, outputs["one at a time"], outputs["batched"]) if a != b]
    print(f"speed-up {speedup:.1f}x (target at least 4x: {'met' if speedup >= 4 else 'NOT met'})")
    print(f"identical outputs: {len(test) - len(differing)}/{len(test)}" + (f" (differ: {', '.join(differing)})" if differing else ""))

    rows = [scoring.score_case(c, tokenizer.decode(g.tokens, skip_special_tokens=True)) for c, g in zip(test, outputs["batched"])]
    print("\nseed strict accuracy (score 1.0) per family:")
    for fam in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == fam]
        print(f"  {fam:<16} {sum(r['correct'] for r in mine)}/{len(mine)}")
    return 1 if differing else 0



if __name__ == "__main__":
    from coopstudy import cli

    sys.exit(cli.main(["bench", *sys.argv[1:]]))
