"""DeepSpeed's per-node launcher (`deepspeed.launcher.launch`) for a job on
one host, started without the `deepspeed` runner in front of it.

On one host the runner only turns --num_gpus into the launcher's
--world_info and starts it: a second Python process, one after the other,
each importing all of deepspeed before any rank starts. Neither uses MLflow,
which deepspeed imports when it can (for its autotuner): here it cannot.
Together about 6.5 s of every launch on the avx512_bf16 EPYC (a launch of
two trivial ranks, five times each: 10.5–11.9 s through the runner,
4.1–4.7 s this way). The ranks are
processes of their own and import what they need.

The launch also ends sooner after its ranks: the launcher looks at them
every POLL_S seconds, not DeepSpeed's one second (it looks at the ranks in
turn and sleeps between looks, so two ranks that end apart cost up to two
of them), and once every rank has ended well it leaves without Python's
finalization of torch and deepspeed, having nothing left to write. On the
AMX Xeon (2026-12-05, quiet, `bench arms --arm compressed --updates 1`
three times each way) the ranks' last record to the launch's end took
1.42–1.60 s this way against 2.93–3.19 s; 1.1 s of it is the ranks' own
exit. A rank that fails still ends the launch through DeepSpeed's handler,
with the rank's exit code."""

import os
import runpy
import sys
import time

POLL_S = 0.1
"""Seconds between the launcher's looks at its ranks (DeepSpeed's loop sleeps 1 s)."""


def _poll_sleep(seconds: float, _sleep=time.sleep) -> None:
    _sleep(min(seconds, POLL_S))


if __name__ == "__main__":
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    # The launcher's only sleep is its poll loop's, and this process runs nothing else.
    time.sleep = _poll_sleep
    runpy.run_module("deepspeed.launcher.launch", run_name="__main__", alter_sys=True)
    # Reached only when every rank exited 0: on a failure DeepSpeed's handler calls sys.exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
