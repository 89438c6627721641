"""Benchmarks that print a table and log it to MLflow (not timed tests).

    python -m coopstudy bench objective --preset tiny|smollm2-135m-cpu [--updates 2]
    python -m coopstudy bench arms --preset smollm2-135m-cpu [--updates 24] [--arm control|compressed|both]
    python -m coopstudy bench generate --preset smollm2-135m-cpu [--items 32]

(`python -m coopstudy.bench ...` is the same command.)

`objective`: the batched training update (the control arm's microbatches,
length-sorted and packed, one process) against the per-document reference
(each document alone) on the same documents from the same weights, in one
run, with torch.set_num_threads(train.threads_per_device): milliseconds per
update, their ratio, the loss of both (they must agree), the padding
efficiency of the updates it ran (real tokens / computed positions: 1.0,
packed) and, for scale, what right-padding each microbatch would compute,
for both arms' shapes, sorted and unsorted. Each update prints as it ends:
its real tokens (the rows differ in size, and the seconds follow them), both
times, their ratio, and the batched update's seconds in the kernel (memory
first touched, UpdateTimes.system). The run bench-objective-<preset> (stage
bench) gets the timings, loss gap and padding figures as bench/ metrics, the
printed table as bench_objective.json, and where its documents came from.

Documents come from the prepared inputs of the preset when they exist
(`prepare` has run); otherwise synthetic documents of realistic shape are
made and the table says so: task documents of 80-220 tokens whose last 2-10
tokens are answer tokens of weight 8, and replay documents of 150 tokens up to
data.max_context that alternate prompt (0) and assistant (1) segments, three
tasks to one replay document as in the protocol, in the preset's schedule
shape (train.updates global batches of train.global_batch).

`arms`: both arms' real training loops, one after the other (control first),
each launched exactly as `train` launches it (coopstudy.run.launch: the
control one plain `python -m coopstudy.run.worker` process, the compressed arm
that command under the DeepSpeed launcher, with the same environment and
thread settings), for --updates updates of the committed schedule (by
default all of it, so that each phase's medians are over the updates the
study's report takes them over) without a checkpoint, under the device
lock. Launching both, rather than running the control inside this process,
keeps the measured loops the ones `train` runs (their threads, allocator
settings and environment), so the ratio is the study's. Needs prepared
inputs (`prepare`). Each arm writes a child run (stage bench) with the
per-update metrics and time breakdown of `train`;
the parent run bench-arms-<preset> gets, per phase (updates
1..powersgd.dense_updates dense, the rest compressed), the median seconds per
update of each arm, their ratio, the median breakdown, the compute-only
ratio (what the ratio would be if gradient communication and recording were
free), the training FLOP/s each device achieved and the single-thread
matmul peak measured in the same run under the same device lock (before and
after the arms) that it is a fraction of, and per arm and rank the memory
new to the process inside the window (first touch: train/new_memory_mb) with
the system seconds it cost, and per arm the free memory the machine had ready
for first touches before update 1 and at its lowest after an update
(train/ready_memory_mb).

`generate`: batched against one-at-a-time greedy generation on the seed model.
Draws its cases from the development split, as `dev-split` draws it at its
default seed (the preset's families and family options, the prompt form of
the final test, never its questions; nothing from the prepared files is
needed), --items spread as evenly as the families allow (the count of each is
printed), generates their answers once prompt by prompt and once in batches of
evaluate.batch_size, prints cases/s for both and the speed-up, and checks that
both give the same tokens for every case (exit 1 if not). Also prints the
seed's strict accuracy per family on these cases. The run
bench-generate-<preset> gets each mode's seconds and cases/s, the speed-up and
the count of identical outputs. Evaluation is not a timed arm: torch keeps its
default thread count, which is printed.

Every bench holds the device lock that `train` and `probe` take (`objective`
the CPU's, whatever the host has): a bench beside a training job would spoil
both jobs' timings, so the one that comes second refuses.
"""

from __future__ import annotations

import argparse
import re

from coopstudy import ui
from coopstudy.config import ARMS, BOTH, Config, arms_of
from coopstudy.errors import UserError

# Each benchmark is a module of its own, imported when it runs: they import
# torch and the model code, and `coopstudy --help` reads this one.
HELP = "benchmarks: the packed update against the per-document reference; both arms' loops; batched generation"
DESCRIPTION = __doc__
MAX_ITEMS = 100_000
"""The most cases `generate` times: each is generated twice (batched and alone),
so a larger count is a typo, not a benchmark that ends."""


def _described(name: str) -> str:
    """What the module's docstring says of bench `name`: its paragraphs, from
    the one that starts with `name` to the next bench's."""
    text = __doc__.split(f"\n`{name}`: ", 1)[1]
    return f"{name}: " + re.split(r"\n\n`\w+`: ", text, maxsplit=1)[0].strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from coopstudy.cli import add_config_arguments, where_things_go

    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")

    def bench(name: str, summary: str) -> argparse.ArgumentParser:
        b = sub.add_parser(
            name, help=summary, description=_described(name), formatter_class=argparse.RawDescriptionHelpFormatter, epilog=where_things_go()
        )
        add_config_arguments(b)
        return b

    p = bench("objective", "batched update against the per-document reference")
    p.add_argument("--updates", type=int, default=2, help="timed updates, after one warm-up update (default 2; at most train.updates - 1)")
    p.add_argument("--documents", choices=("auto", "prepared", "synthetic"), default="auto",
                   help="prepared inputs, synthetic documents, or auto: prepared when they exist (default: auto)")  # fmt: skip
    a = bench("arms", "both arms' real training loops, one after the other: seconds per update, breakdown, ratio")
    a.add_argument("--updates", type=int, default=None,
                   help="updates of each arm (default: train.updates, the whole schedule, as the study runs it;"
                        " fewer give a quick look whose compressed phase is mostly its first, slowest updates)")  # fmt: skip
    a.add_argument("--arm", choices=(*ARMS, BOTH), default=BOTH, help="which arms to run (default: both, control first)")
    g = bench("generate", "batched against one-at-a-time greedy generation on the seed model")
    g.add_argument("--items", type=int, default=32, help=f"development-split cases to generate, spread over the families (default 32, at most {MAX_ITEMS:,})")


def check_arguments(cfg: Config, args: argparse.Namespace) -> None:
    """What each bench refuses in its arguments, before the lock or any load (and under --dry-run)."""
    if args.bench == "generate" and not 1 <= args.items <= MAX_ITEMS:
        raise UserError(f"--items: from 1 to {MAX_ITEMS:,} (got {args.items:,})")
    if args.bench == "arms" and args.updates is not None and not 1 <= args.updates <= cfg.train.updates:
        raise UserError(f"--updates: between 1 and train.updates ({cfg.train.updates}), not {args.updates}")
    # One warm-up update comes first, from the train.updates global batches of the schedule.
    if args.bench == "objective" and not 1 <= args.updates <= cfg.train.updates - 1:
        raise UserError(
            f"--updates: between 1 and train.updates - 1 ({cfg.train.updates - 1}; one warm-up update comes first), not {args.updates}"
        )


def run(cfg: Config, args: argparse.Namespace) -> int:
    check_arguments(cfg, args)
    if args.bench == "generate":
        from coopstudy.bench import generate

        return generate.measure(cfg, args.items)
    if args.bench == "arms":
        from coopstudy.bench import arms

        arms.measure(cfg, updates=args.updates, arms=arms_of(args.arm), console=ui.console(120))
        return 0
    from coopstudy.bench import objective

    objective.measure(cfg, updates=args.updates, source=args.documents, console=ui.console(110))
    return 0
