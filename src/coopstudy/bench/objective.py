"""`bench objective`: the packed training update against the per-document
reference, on the same documents from the same weights (see `coopstudy.bench`)."""

from __future__ import annotations

import copy
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from coopstudy import ui
from coopstudy.commit import ledger, require
from coopstudy.config import ARMS, Config
from coopstudy.inputs import data
from coopstudy.inputs.seed import resolve_seed
from coopstudy.numerics import batching, objective, update
from coopstudy.numerics.distributed import DistContext
from coopstudy.record import schema, writer
from coopstudy.run import lock


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


def _prepared(cfg: Config, source: str) -> tuple[Sequence, list[list[int]], str] | None:
    """The prepared inputs where they are asked for or committed, else None.
    Checked before the seed is loaded (on a GGUF preset, minutes of conversion)."""
    if source == "prepared" or (source == "auto" and ledger.Ledger().latest(ledger.INPUTS, data.inputs_key(cfg))):
        # Inputs committed but failing their check are refused, never swapped
        # for synthetic ones under a note that says there are none.
        prepared = require.inputs(cfg)
        return prepared.train, prepared.schedule, f"prepared inputs {prepared.digest[:12]}"
    return None


def _synthetic(cfg: Config, source: str, vocab_size: int) -> tuple[Sequence, list[list[int]], str]:
    if source == "auto":
        note = "synthetic (this preset has no prepared inputs; run prepare to use them)"
    else:
        note = "synthetic (asked for)"
    docs, schedule = synthetic_documents(cfg, vocab_size)
    return docs, schedule, note


def _load_seed(cfg: Config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    ui.hide_transformers_bars()
    seed = resolve_seed(cfg)
    return objective.Precision.of(cfg.train.precision).cast(AutoModelForCausalLM.from_pretrained(seed.path))


def measure(cfg: Config, *, updates: int, source: str, console: Console) -> dict[str, float]:
    # Its updates run on the CPU whatever the host has.
    with lock.one_process_job(f"coopstudy bench objective --preset {cfg.preset_argument}", ["cpu"]) as held:
        return _measure(cfg, updates=updates, source=source, console=console, held=held)


def _measure(cfg: Config, *, updates: int, source: str, console: Console, held: lock.Held) -> dict[str, float]:
    torch.set_num_threads(cfg.train.threads_per_device)
    prepared = _prepared(cfg, source)
    lm = _load_seed(cfg)
    docs, schedule, note = prepared or _synthetic(cfg, source, lm.config.vocab_size)
    precision = objective.Precision.of(cfg.train.precision)
    microbatch = cfg.arms.control.microbatch
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    reference = copy.deepcopy(lm)
    net = objective.WeightedNLL(lm)
    opt = update.build_optimizer(lm.parameters(), cfg.train)
    sched = update.build_scheduler(opt, cfg.train.warmup_updates)
    ref_opt = update.build_optimizer(reference.parameters(), cfg.train)
    ref_sched = update.build_scheduler(ref_opt, cfg.train.warmup_updates)

    # The run opens before the first update: an interrupt or a tracking outage
    # while measuring ends it KILLED or FAILED, as in the other benches.
    with writer.stage_run(schema.STAGE_BENCH, cfg, run_name=f"bench-objective-{cfg.preset}", tags={schema.TAG_BENCH_DOCUMENTS: note}) as rec:
        held.note(run_id=rec.run_id)
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
            # Tokens and the kernel's seconds (memory first touched) say why one
            # update is slower than another: the rows are not the same size.
            console.print(
                f"update {k + 1}{' (warm-up)' if k == 0 else ''}: {got.local_tokens:,} tokens;"
                f" batched {got.seconds:.2f} s ({got.times.system:.2f} s of it the kernel's),"
                f" per-document {want.seconds:.2f} s: {want.seconds / got.seconds:.2f}x"
            )
            real_tokens += got.local_tokens
            computed_tokens += got.computed_tokens
            if k:
                batched_s.append(got.seconds)
                reference_s.append(want.seconds)
            loss_gaps.append(abs(got.loss - want.loss) / abs(want.loss))

        lengths = [len(d.input_ids) for d in docs]
        padded = {
            (arm, sort): batching.padding_efficiency(lengths, schedule, cfg.arm(arm).workers, cfg.arm(arm).microbatch, sort=sort).ratio
            for arm in ARMS
            for sort in (True, False)
        }
        measured = real_tokens / computed_tokens if computed_tokens else 1.0
        batched_ms = 1000 * statistics.mean(batched_s)
        reference_ms = 1000 * statistics.mean(reference_s)
        result = {
            schema.M_BENCH_BATCHED_MS: batched_ms,
            schema.M_BENCH_REFERENCE_MS: reference_ms,
            schema.M_BENCH_SPEEDUP: reference_ms / batched_ms,
            schema.M_BENCH_LOSS_REL_GAP: max(loss_gaps),
            schema.M_BENCH_PADDING_PREFIX + "measured": measured,
            **{
                f"{schema.M_BENCH_PADDING_PREFIX}padded_{'sorted' if sort else 'unsorted'}/{arm}": ratio
                for (arm, sort), ratio in padded.items()
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
        for arm in ARMS:
            shape = cfg.arm(arm)
            table.add_row(
                f"padding efficiency, {arm} ({shape.workers} x mb {shape.microbatch}), were it padded",
                f"sorted {padded[(arm, True)]:.3f} / unsorted {padded[(arm, False)]:.3f}",
            )
        console.print(table)
        rows = [{"quantity": r[0], "value": r[1]} for r in zip(table.columns[0].cells, table.columns[1].cells)]
        rec.log_metrics(result)
        rec.log_table(rows, schema.ART_BENCH_TABLE)
    return result
