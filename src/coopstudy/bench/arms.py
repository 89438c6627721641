"""`bench arms`: both arms' real training loops, launched as `train` launches
them, through the dense and compressed phases (see `coopstudy.bench`)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

from coopstudy.commit import require
from coopstudy.config import COMPRESSED, CONTROL, Config
from coopstudy.errors import UserError
from coopstudy.numerics import flops
from coopstudy.record import schema, writer


_PARTS = (
    ("update", schema.M_UPDATE_SECONDS),
    ("forward_backward", schema.M_FORWARD_BACKWARD_SECONDS),
    ("comm", schema.M_COMM_SECONDS),
    ("comm_arithmetic", schema.M_COMM_ARITHMETIC_SECONDS),
    ("optimizer", schema.M_OPTIMIZER_SECONDS),
    ("other", schema.M_OTHER_SECONDS),
    ("system", schema.M_SYSTEM_SECONDS),
    ("record", schema.M_RECORD_SECONDS),
    ("tokens", schema.M_TOKENS),
)
_SECONDS = [part for part, _ in _PARTS if part != "tokens"]
_GREW_MB = 64.0
"""The first-touch table lists the updates that grew a process's peak by at least this much."""
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
        console.print(f"bench arms: {arm}, {cmd.how}, {updates} updates, run {rec.run_id}")
        done = launch.run(cmd, launch.worker_environment(cfg, rec.run_id), label=f"bench arms: {arm}", held=held)
        rec.log_metrics(
            {schema.M_COMPLETE_SECONDS: done.complete_seconds, schema.M_DEVICE_SECONDS: workers * done.complete_seconds}
            | launch.machine_metrics(done)
        )
        if done.returncode != 0:
            raise UserError(f"bench arms: {launch.failure(rec.run_id, arm, workers, done.returncode)}")
        client = store.client()
        per_update = {part: _history(client, rec.run_id, key) for part, key in _PARTS}
        summary = store.artifact_json(rec.run_id, schema.ART_TRAIN_SUMMARY)
        final = client.get_run(rec.run_id).data.metrics
    return rec.run_id, {"per_update": per_update, "summary": summary, "complete_seconds": done.complete_seconds, "metrics": final}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def measure(cfg: Config, *, updates: int | None, arms: tuple[str, ...], console: Console) -> dict[str, float]:
    from coopstudy.run import launch, lock

    dense = cfg.powersgd.dense_updates
    updates = updates if updates is not None else cfg.train.updates
    prepared, seed = require.seeded_inputs(cfg)
    shape = flops.ModelShape.of(seed.path)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.train.threads_per_device)
    try:
        phases = schema.phases(dense, updates)
        update_flops = {k: shape.training_flops([prepared.train[i] for i in prepared.schedule[k - 1]]) for k in range(1, updates + 1)}

        results: dict[str, dict] = {}
        devices = launch.devices_of(cfg, arms, None)
        with writer.stage_run(schema.STAGE_BENCH, cfg, run_name=f"bench-arms-{cfg.preset}") as parent:
            # The peaks under the arms' lock too: another job's matmuls on the
            # same cores would lower them and every fraction of them.
            with lock.device_lock(devices, f"coopstudy bench arms --preset {cfg.preset_argument}") as held:
                peaks = {name: matmul_peak_gflops(dtype, device) for name, dtype in _DTYPES.items()}
                console.print("matmul peak before the arms: " + ", ".join(f"{n} {g:,.1f} GFLOP/s" for n, g in peaks.items()))
                for arm in arms:
                    _, results[arm] = _run_arm(cfg, arm, updates, held, console)
                after = {name: matmul_peak_gflops(dtype, device) for name, dtype in _DTYPES.items()}

            metrics: dict[str, float] = {}
            for name, gflops in peaks.items():
                metrics[f"{schema.M_BENCH_MATMUL_PEAK_PREFIX}{name}"] = gflops
                metrics[f"{schema.M_BENCH_MATMUL_PEAK_PREFIX}{name}/after"] = after[name]
            medians: dict[tuple[str, str, str], float] = {}
            for arm, got in results.items():
                per = got["per_update"]
                for phase, steps in phases.items():
                    for part in _SECONDS:
                        value = _median([per[part][k] for k in steps if k in per[part]])
                        medians[(phase, arm, part)] = value
                        metrics[f"{schema.M_BENCH_ARMS_PREFIX}{phase}/{arm}/{part}"] = value
                workers = cfg.arm(arm).workers
                seconds = [per["update"][k] for k in range(1, updates + 1) if k in per["update"]]
                executed = sum(update_flops[k][0] for k in range(1, updates + 1) if k in per["update"])
                achieved = executed / sum(seconds) / workers / 1e9 if seconds else math.nan
                metrics[f"{schema.M_BENCH_ACHIEVED_PREFIX}{arm}"] = achieved
                tokens = sum(per["tokens"].get(k, 0) for k in range(1, updates + 1) if k in per["update"])
                metrics[f"{schema.M_BENCH_TOKENS_PER_S_PREFIX}{arm}"] = tokens / sum(seconds) if seconds else math.nan
                metrics[f"{schema.M_BENCH_PEAK_FRACTION_PREFIX}{arm}"] = achieved / peaks.get(cfg.train.precision, peaks["fp32"])
                summary = got["summary"]
                metrics[f"{schema.M_BENCH_NEW_MEMORY_PREFIX}{arm}"] = sum(map(sum, summary["new_memory_mb_by_rank"]))
                metrics[f"{schema.M_BENCH_SYSTEM_PREFIX}{arm}"] = sum(sum(r["system"]) for r in summary["times_by_rank"])
                # Before update 1, then after each; None throughout without procfs.
                ready = summary["ready_memory_mb"]
                if ready[0] is not None:
                    metrics[f"{schema.M_BENCH_READY_MEMORY_PREFIX}{arm}"] = ready[0]
                    metrics[f"{schema.M_BENCH_READY_MEMORY_LOW_PREFIX}{arm}"] = min(ready[1:])
            if len(results) == 2:
                split = cfg.arm(COMPRESSED).workers / cfg.arm(CONTROL).workers
                theirs = results[CONTROL]["per_update"]["forward_backward"]
                by_rank = results[COMPRESSED]["summary"]["times_by_rank"]

                def rest(k: int) -> float:
                    return by_rank[0]["optimizer"][k - 1] + by_rank[0]["other"][k - 1]

                for phase, steps in phases.items():
                    control = medians[(phase, CONTROL, "update")]
                    metrics[f"{schema.M_BENCH_ARMS_RATIO_PREFIX}{phase}"] = control / medians[(phase, COMPRESSED, "update")]
                    # Free communication and recording: the slowest rank's compute, rank 0's optimizer and rest.
                    ideal = _median([max(r["forward_backward"][k - 1] for r in by_rank) + rest(k) for k in steps])
                    metrics[f"{schema.M_BENCH_ARMS_IDEAL_PREFIX}{phase}"] = control / ideal
                    # What does not shrink with the split: the hook as the rank that waited least paid
                    # it (equal halves would leave no one waiting), rank 0's optimizer and rest.
                    split_exactly = _median(
                        [theirs[k] / split + min(r["communication"][k - 1] for r in by_rank) + rest(k) for k in steps if k in theirs]
                    )
                    metrics[f"{schema.M_BENCH_ARMS_SPLIT_PREFIX}{phase}"] = control / split_exactly

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
            add(table, "ratio if forward/backward split exactly", f"{metrics[f'{schema.M_BENCH_ARMS_SPLIT_PREFIX}{phase}']:.3f}x", "")
        console.print(table)
    if COMPRESSED in results:
        by_rank = results[COMPRESSED]["summary"]["times_by_rank"]
        table = Table(title="compressed arm by rank: median s/update, all updates")
        table.add_column("rank")
        columns = ("forward_backward", "communication", "communication_arithmetic", "optimizer", "other", "system")
        for part in columns:
            table.add_column(part, justify="right")
        for r, parts in enumerate(by_rank):
            add(table, str(r), *(f"{_median(parts[p]):.3f}" for p in columns))
        console.print(table)
    table = Table(title=f"memory new to each process (first touch), updates 1-{updates}")
    for column in ("arm", "rank", "new MiB", "system s", "system s per GiB", f"updates that grew it by {_GREW_MB:.0f} MiB or more: MiB / system s"):
        table.add_column(column, justify="left" if column in ("arm", "rank") or column.startswith("updates") else "right")
    for arm, got in results.items():
        summary = got["summary"]
        for r, (grown, parts) in enumerate(zip(summary["new_memory_mb_by_rank"], summary["times_by_rank"])):
            new_mb, system = sum(grown), sum(parts["system"])
            grew = [f"{k}: {mb:,.0f} / {s:.1f}" for k, (mb, s) in enumerate(zip(grown, parts["system"]), start=1) if mb >= _GREW_MB]
            per_gib = system / (new_mb / 1024) if new_mb > 0 else math.nan
            add(table, arm, str(r), f"{new_mb:,.0f}", f"{system:.1f}", f"{per_gib:.1f}", "; ".join(grew) or "none")
    console.print(table)
    measured = [arm for arm in results if f"{schema.M_BENCH_READY_MEMORY_PREFIX}{arm}" in metrics]
    if measured:
        reporting = "it takes back larger ones" if results[arms[0]]["summary"]["free_page_reporting"] else "it takes back none"
        table = Table(title=f"memory the machine had ready for first touch: free, in blocks under 2 MiB (the VM's host: {reporting})")
        for column in ("arm", "MiB before update 1", "lowest after an update, MiB", "at update"):
            table.add_column(column, justify="left" if column == "arm" else "right")
        for arm in measured:
            first, low = metrics[f"{schema.M_BENCH_READY_MEMORY_PREFIX}{arm}"], metrics[f"{schema.M_BENCH_READY_MEMORY_LOW_PREFIX}{arm}"]
            add(table, arm, f"{first:,.0f}", f"{low:,.0f}", str(results[arm]["summary"]["ready_memory_mb"].index(low, 1)))
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
