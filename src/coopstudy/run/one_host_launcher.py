"""DeepSpeed's per-node launcher (`deepspeed.launcher.launch`) for a job on
one host, started without the `deepspeed` runner in front of it.

On one host the runner only turns --num_gpus into the launcher's
--world_info and starts it: a second Python process, one after the other,
each importing all of deepspeed before any rank starts. Neither uses MLflow,
which deepspeed imports when it can (for its autotuner): here it cannot.
Together about 6.5 s of every launch on the avx512_bf16 EPYC (a launch of
two trivial ranks, five times each: 10.5–11.9 s through the runner,
4.1–4.7 s this way). The ranks are
processes of their own and import what they need."""

import runpy
import sys

if __name__ == "__main__":
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    runpy.run_module("deepspeed.launcher.launch", run_name="__main__", alter_sys=True)
