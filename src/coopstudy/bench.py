"""Benchmarks that print a table and log it to MLflow (not timed tests).

    python -m coopstudy bench objective --preset tiny|smollm2-135m-cpu [--updates 2]
    python -m coopstudy bench arms --preset smollm2-135m-cpu [--updates 8] [--arm control|compressed|both]
    python -m coopstudy bench generate --preset smollm2-135m-cpu [--items 32]

(`python -m coopstudy.bench ...` is the same command.)

`objective`: the batched training update (the control arm's microbatches,
length-sorted and packed, one process) against the per-document reference
(each document alone) on the same documents from the same weights, in one
run, with torch.set_num_threads(train.threads_per_device): milliseconds per
update, their ratio, the loss of both (they must agree), the padding
efficiency of the updates it ran (real tokens / computed positions: 1.0,
packed) and, for scale, what right-padding each microbatch would compute,
for both arms' shapes, sorted and unsorted.

`arms`: both arms' real training loops, one after the other (control first),
each launched exactly as `train` launches it (coopstudy.run.launch: the
control one plain `python -m coopstudy worker` process, the compressed arm
that command under the DeepSpeed launcher, with the same environment and
thread settings), for --updates updates of the committed schedule without a
checkpoint, under the device lock. Launching both, rather than running the
control inside this process, keeps the measured loops the ones `train` runs
(their threads, allocator settings and environment), so the ratio is the
study's. Needs prepared inputs (`prepare`). Each arm writes a child run
(stage bench) with the per-update metrics and time breakdown of `train`;
the parent run bench-arms-<preset> gets, per phase (updates
1..powersgd.dense_updates dense, the rest compressed), the median seconds per
update of each arm, their ratio, the median breakdown, the compute-only
ratio (what the ratio would be if gradient communication and recording were
free), the training FLOP/s each device achieved and the single-thread
matmul peak measured in the same run (before and after the arms) that it is
a fraction of.

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
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from analysis import records
from coopstudy import scoring, ui
from coopstudy.commit import require
from coopstudy.config import ARMS, Config
from coopstudy.errors import UserError
from coopstudy.inputs import chat, tasks
from coopstudy.inputs.seed import resolve_seed
from coopstudy.numerics import batching, flops, objective, update
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
    real_tokens = computed_tokens = 0
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
        real_tokens += got.local_tokens
        computed_tokens += got.computed_tokens
        if k:
            batched_s.append(got.seconds)
            reference_s.append(want.seconds)
        loss_gaps.append(abs(got.loss - want.loss) / abs(want.loss))

    lengths = [len(d.input_ids) for d in docs]
    padding = {
        (arm, sort, packed): batching.padding_efficiency(
            lengths, schedule, cfg.arm(arm).workers, cfg.arm(arm).microbatch, sort=sort, packed=packed
        ).ratio
        for arm in ("control", "compressed")
        for sort in (True, False)
        for packed in (True, False)
    }
    measured = real_tokens / computed_tokens if computed_tokens else 1.0
    batched_ms = 1000 * statistics.mean(batched_s)
    reference_ms = 1000 * statistics.mean(reference_s)
    result = {
        schema.M_BENCH_BATCHED_MS: batched_ms,
        schema.M_BENCH_REFERENCE_MS: reference_ms,
        schema.M_BENCH_SPEEDUP: reference_ms / batched_ms,
        schema.M_BENCH_LOSS_REL_GAP: max(loss_gaps),
        **{
            f"{schema.M_BENCH_PADDING_PREFIX}{'sorted' if sort else 'unsorted'}/{arm}": ratio
            for (arm, sort, packed), ratio in padding.items()
            if packed
        },
    }

    table = Table(title=f"objective benchmark, preset {cfg.preset}")
    table.add_column("quantity")
    table.add_column("value")
    table.add_row("documents", note)
    table.add_row("model", f"{sum(p.numel() for p in lm.parameters()) / 1e6:.1f} M parameters, {precision.name}, {torch.get_num_threads()} thread(s)")
    table.add_row("update", f"{cfg.train.global_batch} documents, control microbatch {microbatch}; {updates} timed updates after 1 warm-up")
    table.add_row("batched ms / update", f"{batched_ms:,.0f}")
    table.add_row("per-document ms / update", f"{reference_ms:,.0f}")
    table.add_row("ratio (per-document / batched)", f"{reference_ms / batched_ms:.2f}x")
    table.add_row("loss, max relative gap", f"{max(loss_gaps):.1e}")
    table.add_row("padding efficiency, measured (real / computed tokens)", f"{measured:.3f} ({real_tokens:,} / {computed_tokens:,})")
    for arm in ("control", "compressed"):
        shape = cfg.arm(arm)
        table.add_row(
            f"padding efficiency, {arm} ({shape.workers} x mb {shape.microbatch})",
            f"packed {padding[(arm, True, True)]:.3f}; padded would be sorted {padding[(arm, True, False)]:.3f}"
            f" / unsorted {padding[(arm, False, False)]:.3f}",
        )
    console.print(table)
    rows = [{"quantity": r[0], "value": r[1]} for r in zip(table.columns[0].cells, table.columns[1].cells)]
    with writer.stage_run(schema.STAGE_BENCH, cfg, run_name=f"bench-objective-{cfg.preset}", tags={schema.TAG_BENCH_DOCUMENTS: note}) as rec:
        rec.log_metrics(result)
        rec.log_table(rows, schema.ART_BENCH_TABLE)
    return result


# --- bench arms ----------------------------------------------------------------

_PARTS = (
    ("update", schema.M_UPDATE_SECONDS),
    ("forward_backward", schema.M_FORWARD_BACKWARD_SECONDS),
    ("comm", schema.M_COMM_SECONDS),
    ("comm_arithmetic", schema.M_COMM_ARITHMETIC_SECONDS),
    ("optimizer", schema.M_OPTIMIZER_SECONDS),
    ("other", schema.M_OTHER_SECONDS),
    ("record", schema.M_RECORD_SECONDS),
    ("tokens", schema.M_TOKENS),
)
_SECONDS = [part for part, _ in _PARTS if part != "tokens"]
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def matmul_peak_gflops(dtype: torch.dtype, device: torch.device, *, seconds: float = 0.5) -> float:
    """The best GFLOP/s of a few matmuls (model-like, then larger square
    shapes) on `device`; on CPU with the current torch thread count (one, in
    the bench). About `seconds` per shape; a shape whose single call already
    takes longer ends the search (a CPU without native bf16 runs bf16 matmuls
    at a few GFLOP/s)."""
    best = 0.0
    shapes = ((512, 576, 1536), (1024, 1024, 1024), (2048, 2048, 2048)) if device.type == "cpu" else ((8192, 8192, 8192), (16384, 4096, 4096))
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        # The first call chooses kernels and allocates: timed only to decide.
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first = time.perf_counter() - start
        if first > seconds:
            return max(best, 2 * m * k * n / first / 1e9)
        calls, start = 0, time.perf_counter()
        while True:
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        best = max(best, 2 * m * k * n * calls / elapsed / 1e9)
    return best


def _history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def _run_arm(cfg: Config, arm: str, updates: int, held, console: Console) -> tuple[str, dict]:
    """One arm's real loop, launched as `train` launches it, into its own child run."""
    from coopstudy.record import store
    from coopstudy.run import launch

    workers = cfg.arm(arm).workers
    with writer.stage_run(schema.STAGE_BENCH, cfg, arm=arm, run_name=f"bench-arms-{arm}-{cfg.preset}", log_config=False) as rec:
        held.note(run_id=rec.run_id)
        cmd = launch.command(cfg, arm, rec.run_id, updates=updates, checkpoint=False)
        how = "1 process" if workers == 1 else f"{workers} ranks via the DeepSpeed launcher"
        console.print(f"bench arms: {arm}, {how}, {updates} updates, run {rec.run_id}")
        done = launch.run(cmd, launch.worker_environment(cfg, rec.run_id), workers, held=held)
        rec.log_metrics({schema.M_COMPLETE_SECONDS: done.complete_seconds, schema.M_DEVICE_SECONDS: workers * done.complete_seconds})
        if done.returncode != 0:
            raise UserError(f"bench arms: {launch.failure(rec.run_id, arm, workers, done.returncode)}")
        client = store.client()
        per_update = {part: _history(client, rec.run_id, key) for part, key in _PARTS}
        summary = store.artifact_json(rec.run_id, schema.ART_TRAIN_SUMMARY)
        final = client.get_run(rec.run_id).data.metrics
    return rec.run_id, {"per_update": per_update, "summary": summary, "complete_seconds": done.complete_seconds, "metrics": final}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def bench_arms(cfg: Config, *, updates: int | None, arms: tuple[str, ...], console: Console) -> dict[str, float]:
    from coopstudy.run import launch, lock

    dense = cfg.powersgd.dense_updates
    updates = updates if updates is not None else min(cfg.train.updates, dense + 5)
    if not 1 <= updates <= cfg.train.updates:
        raise UserError(f"--updates: between 1 and train.updates ({cfg.train.updates}), not {updates}")
    prepared, seed = require.seeded_inputs(cfg)
    shape = flops.ModelShape.of(seed.path)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.train.threads_per_device)
    try:
        peaks = {name: matmul_peak_gflops(dtype, device) for name, dtype in _DTYPES.items()}
        console.print("matmul peak before the arms: " + ", ".join(f"{n} {g:,.1f} GFLOP/s" for n, g in peaks.items()))
        phases = records.phases(dense, updates)
        update_flops = {k: shape.training_flops([prepared.train[i] for i in prepared.schedule[k - 1]]) for k in range(1, updates + 1)}

        results: dict[str, dict] = {}
        devices = launch.devices_of(cfg, arms, None)
        with writer.stage_run(schema.STAGE_BENCH, cfg, run_name=f"bench-arms-{cfg.preset}") as parent:
            with lock.device_lock(devices, f"coopstudy bench arms --preset {cfg.preset}") as held:
                for arm in arms:
                    _, results[arm] = _run_arm(cfg, arm, updates, held, console)
            after = {name: matmul_peak_gflops(dtype, device) for name, dtype in _DTYPES.items()}

            metrics: dict[str, float] = {}
            for name, gflops in peaks.items():
                metrics[f"{schema.M_BENCH_MATMUL_PEAK_PREFIX}{name}"] = gflops
                metrics[f"{schema.M_BENCH_MATMUL_PEAK_PREFIX}{name}/after"] = after[name]
            medians: dict[tuple[str, str, str], float] = {}
            ideal_compressed: dict[str, float] = {}
            for arm, got in results.items():
                per = got["per_update"]
                for phase, steps in phases.items():
                    for part in _SECONDS:
                        value = _median([per[part][k] for k in steps if k in per[part]])
                        medians[(phase, arm, part)] = value
                        metrics[f"{schema.M_BENCH_ARMS_PREFIX}{phase}/{arm}/{part}"] = value
                if arm == "compressed":
                    by_rank = got["summary"]["times_by_rank"]
                    for phase, steps in phases.items():
                        # Free communication and recording: the slowest rank's compute, rank 0's optimizer and rest.
                        ideal_compressed[phase] = _median(
                            [
                                max(r["forward_backward"][k - 1] for r in by_rank) + by_rank[0]["optimizer"][k - 1] + by_rank[0]["other"][k - 1]
                                for k in steps
                            ]
                        )
                workers = cfg.arm(arm).workers
                seconds = [per["update"][k] for k in range(1, updates + 1) if k in per["update"]]
                executed = sum(update_flops[k][0] for k in range(1, updates + 1) if k in per["update"])
                achieved = executed / sum(seconds) / workers / 1e9 if seconds else math.nan
                metrics[f"{schema.M_BENCH_ACHIEVED_PREFIX}{arm}"] = achieved
                tokens = sum(per["tokens"].get(k, 0) for k in range(1, updates + 1) if k in per["update"])
                metrics[f"{schema.M_BENCH_TOKENS_PER_S_PREFIX}{arm}"] = tokens / sum(seconds) if seconds else math.nan
                metrics[f"{schema.M_BENCH_PEAK_FRACTION_PREFIX}{arm}"] = achieved / peaks.get(cfg.train.precision, peaks["fp32"])
            if len(results) == 2:
                for phase in phases:
                    control = medians[(phase, "control", "update")]
                    metrics[f"{schema.M_BENCH_ARMS_RATIO_PREFIX}{phase}"] = control / medians[(phase, "compressed", "update")]
                    metrics[f"{schema.M_BENCH_ARMS_IDEAL_PREFIX}{phase}"] = control / ideal_compressed[phase]

            rows = _arms_tables(cfg, console, results, phases, medians, metrics, peaks, after, shape, update_flops, updates)
            parent.log_metrics({k: v for k, v in metrics.items() if not math.isnan(v)})
            parent.log_table(rows, schema.ART_BENCH_ARMS_TABLE)
        return metrics
    finally:
        torch.set_num_threads(threads)


def _arms_tables(cfg, console, results, phases, medians, metrics, peaks, after, shape, update_flops, updates) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []

    def add(table: Table, *cells: str) -> None:
        table.add_row(*cells)
        rows.append({"table": table.title or "", **{str(c.header): v for c, v in zip(table.columns, cells)}})

    arms = list(results)
    for phase, steps in phases.items():
        table = Table(title=f"{phase}, updates {steps[0]}-{steps[-1]}: median s/update (rank 0)")
        table.add_column("part")
        for arm in arms:
            table.add_column(arm, justify="right")
        for part in _SECONDS:
            add(table, part, *(f"{medians[(phase, arm, part)]:.3f}" for arm in arms))
        if len(arms) == 2:
            add(table, "ratio control / compressed", f"{metrics[f'{schema.M_BENCH_ARMS_RATIO_PREFIX}{phase}']:.3f}x", "")
            add(table, "compute-only ideal ratio", f"{metrics[f'{schema.M_BENCH_ARMS_IDEAL_PREFIX}{phase}']:.3f}x", "")
        console.print(table)
    if "compressed" in results:
        by_rank = results["compressed"]["summary"]["times_by_rank"]
        table = Table(title="compressed arm by rank: median s/update, all updates")
        table.add_column("rank")
        columns = ("forward_backward", "communication", "communication_arithmetic", "optimizer", "other")
        for part in columns:
            table.add_column(part, justify="right")
        for r, parts in enumerate(by_rank):
            add(table, str(r), *(f"{_median(parts[p]):.3f}" for p in columns))
        console.print(table)
    table = Table(title=f"training FLOP/s per device, {updates} updates, {cfg.train.precision}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for name in peaks:
        add(table, f"{name} matmul peak, {torch.get_num_threads()} thread(s): before / after the arms", f"{peaks[name]:,.1f} / {after[name]:,.1f} GFLOP/s")
    executed = sum(f[0] for f in update_flops.values())
    nominal = sum(f[1] for f in update_flops.values())
    add(table, "model", f"{shape.parameters / 1e6:,.1f} M parameters ({shape.matmul_parameters / 1e6:,.1f} M in every token's matmuls)")
    add(table, "training FLOPs, executed / nominal (6·N·T + attention)", f"{executed / 1e12:,.3f} / {nominal / 1e12:,.3f} TFLOP")
    for arm in results:
        workers = cfg.arm(arm).workers
        rate = metrics[f"{schema.M_BENCH_TOKENS_PER_S_PREFIX}{arm}"]
        add(table, f"{arm}: tokens/s (all {workers} device(s) / per device)", f"{rate:,.0f} / {rate / workers:,.0f}")
        final = results[arm]["metrics"]
        memory = f"peak RSS {final.get(schema.M_PEAK_RSS_MB, math.nan):,.0f} MiB"
        if schema.M_CUDA_MAX_ALLOCATED_MB in final:
            memory += (f", CUDA max allocated {final[schema.M_CUDA_MAX_ALLOCATED_MB]:,.0f} MiB,"
                       f" max reserved {final.get(schema.M_CUDA_MAX_RESERVED_MB, math.nan):,.0f} MiB")  # fmt: skip
        add(table, f"{arm}: memory (largest over ranks)", memory)
        achieved = metrics[f"{schema.M_BENCH_ACHIEVED_PREFIX}{arm}"]
        add(table, f"{arm}: achieved per device / fraction of the {cfg.train.precision} peak",
            f"{achieved:,.1f} GFLOP/s / {metrics[f'{schema.M_BENCH_PEAK_FRACTION_PREFIX}{arm}']:.1%}")  # fmt: skip
    console.print(table)
    return rows


HELP = "benchmarks: the packed update against the per-document reference; both arms' loops; batched generation"
DESCRIPTION = __doc__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from coopstudy.cli import add_config_arguments

    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = sub.add_parser("objective", help="batched update against the per-document reference")
    add_config_arguments(p)
    p.add_argument("--updates", type=int, default=2, help="timed updates, after one warm-up update (default 2)")
    p.add_argument("--documents", choices=("auto", "prepared", "synthetic"), default="auto",
                   help="prepared inputs, synthetic documents, or prepared when they exist (default)")  # fmt: skip
    a = sub.add_parser("arms", help="both arms' real training loops, one after the other: seconds per update, breakdown, ratio")
    add_config_arguments(a)
    a.add_argument("--updates", type=int, default=None,
                   help="updates of each arm (default: powersgd.dense_updates + 5, at most train.updates)")  # fmt: skip
    a.add_argument("--arm", choices=(*ARMS, "both"), default="both", help="which arms to run (default: both, control first)")
    g = sub.add_parser("generate", help="batched against one-at-a-time greedy generation on the seed model")
    add_config_arguments(g)
    g.add_argument("--items", type=int, default=32, help="test cases to generate (default 32)")


def run(cfg: Config, args: argparse.Namespace) -> int:
    if args.bench == "generate":
        return bench_generate(cfg, args.items)
    if args.bench == "arms":
        arms = ARMS if args.arm == "both" else (args.arm,)
        bench_arms(cfg, updates=args.updates, arms=arms, console=ui.console(120))
        return 0
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
