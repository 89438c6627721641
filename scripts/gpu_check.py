"""`make gpu-check`: the CUDA path of the study on one GPU, in under five minutes.

    .venv/bin/python scripts/gpu_check.py [--skip-cpu-preset] [--keep DIR]

Without CUDA it says so and exits 0 after the checks a CPU can make (the
packed objective against the per-document reference in float64 on CPU, the
configs, the commands it would run). With CUDA, on device 0:

1. packed vs reference on CUDA: the packed microbatch (documents back to
   back, per-document positions and attention) against each document alone,
   loss and every gradient, in float64 (gate tolerance), float32 (TF32 off)
   and bf16 autocast (bf16 rounding: loose bounds, the figures printed);
2. in a store of its own (DIR, default <home>/gpu-check/<time>/, the home
   being COOPSTUDY_HOME or .coopstudy: an MLflow SQLite store and a study
   home; the seed conversion reused from <home>/seeds when it is there): `prepare` and `verify` of tiny, then
   `probe` of tiny with two control candidates, microbatch 4 (fits) and
   microbatch 8 on a device held to 16 MiB by
   torch.cuda.set_per_process_memory_fraction (run.capacity): the second must
   end out_of_memory, its receipt carrying the CUDA memory figures;
3. the control arm of tiny on CUDA through `bench arms --arm control`
   (the worker's real loop, allocator expandable_segments): the record must
   carry the allocator and CUDA max allocated/reserved memory, and the bench
   prints tokens/s and the fraction of the device's measured matmul peak in the
   run's precision;
4. the same for the CPU preset's model (SmolLM2-135M, `prepare` of
   smollm2-135m-cpu first), unless --skip-cpu-preset.

Exit 0 when every check passed, 1 otherwise (each failure named).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from coopstudy import workspace
from coopstudy.inputs.seed import SEEDS
from coopstudy.record import schema
from coopstudy.record.store import DEFAULT_EXPERIMENT
from coopstudy.run.launch import EXPANDABLE

ROOT = Path(__file__).resolve().parents[1]
CPU_PRESET = "smollm2-135m-cpu"
PROBE_CANDIDATES = (
    '[{"arm":"control","microbatch":4,"allocator":"expandable"},'
    '{"arm":"control","microbatch":8,"allocator":"expandable","device_capacity_mb":16}]'
)
BF16_GRAD_BOUND = 0.1
"""Packed vs per-document in bf16 autocast: the matmuls see other shapes, so the bf16 roundings differ; a
real error (attention across documents, a first token that counts) is of order 1."""


@dataclass
class Checks:
    failures: list[str]

    def expect(self, ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failures.append(what)


def packed_against_reference(device: str, precision: str) -> tuple[float, float]:
    """(loss relative error, worst gradient relative error) of the packed
    objective against each document alone, on the gate's model."""
    import random

    import torch

    from coopstudy.numerics import batching, objective
    from coopstudy.numerics.gate import GateDoc, gate_model

    p = objective.Precision.of(precision)
    rng = random.Random(14)
    docs = []
    for n in (1, 7, 1, 30, 12, 58, 2, 21):
        weights = [rng.choice((0.0, 1.0, 8.0)) for _ in range(n)]
        weights[0] = 8.0  # never a target
        docs.append(GateDoc(tuple(rng.randrange(1, 256) for _ in range(n)), tuple(weights)))
    total = batching.total_weight(docs, range(len(docs)))

    def model():
        return p.cast(gate_model(0)).to(device)

    ref = model()
    ref_loss = objective.reference_backward(ref, docs, total, precision=p, device=device)
    lm = model()
    net = objective.WeightedNLL(lm)
    loss = 0.0
    for k in range(0, len(docs), 3):
        mb = batching.pack(docs[k : k + 3], device=device, weight_dtype=p.param_dtype)
        with p.forward(torch.device(device).type):
            back, share = objective.microbatch_loss(net, mb, total, 1)
        back.backward()
        loss += float(share)
    grads = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max()) for a, b in zip(lm.parameters(), ref.parameters()))
    return abs(loss - ref_loss) / abs(ref_loss), grads


def cli(store: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, workspace.HOME_VARIABLE: str(store / "home"), "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"}
    env.pop("MLFLOW_RUN_ID", None)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "coopstudy", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"  $ python -m coopstudy {' '.join(args)}   ({time.perf_counter() - start:.0f} s, exit {done.returncode})", flush=True)
    if done.returncode != 0:
        print("\n".join(done.stderr.strip().splitlines()[-15:]), flush=True)
    return done


def _runs(folder: Path, name: str):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    exp = client.get_experiment_by_name(DEFAULT_EXPERIMENT)
    return client, client.search_runs([exp.experiment_id], f"attributes.run_name = '{name}'")


def check_control(store: Path, preset: str, updates: int, checks: Checks) -> None:
    done = cli(store, "bench", "arms", "--preset", preset, "--arm", "control", "--updates", str(updates))
    checks.expect(done.returncode == 0, f"{preset}: control arm on CUDA ran {updates} updates (bench arms)")
    if done.returncode != 0:
        return
    print("\n".join(line for line in done.stdout.splitlines() if "│" in line and ("tokens/s" in line or "peak" in line or "memory" in line)))
    client, found = _runs(store, f"bench-arms-control-{preset}")
    (child,) = found
    m = child.data.metrics
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        from mlflow.artifacts import download_artifacts

        path = download_artifacts(run_id=child.info.run_id, artifact_path=schema.ART_TRAIN_SUMMARY, dst_path=tmp,
                                  tracking_uri=f"sqlite:///{store / 'mlflow.db'}")  # fmt: skip
        summary = json.loads(Path(path).read_text())
    checks.expect(summary["device"].startswith("cuda"), f"{preset}: trained on {summary['device']}")
    checks.expect(summary["allocator"] == EXPANDABLE, f"{preset}: allocator {summary['allocator']}")
    allocated, reserved = m.get(schema.M_CUDA_MAX_ALLOCATED_MB, 0.0), m.get(schema.M_CUDA_MAX_RESERVED_MB, 0.0)
    checks.expect(0 < allocated <= reserved, f"{preset}: CUDA memory in the record, max allocated {allocated:,.0f} MiB <= reserved {reserved:,.0f} MiB")
    (parent,) = _runs(store, f"bench-arms-{preset}")[1]
    pm = parent.data.metrics
    rate = pm.get(f"{schema.M_BENCH_TOKENS_PER_S_PREFIX}control", math.nan)
    fraction = pm.get(f"{schema.M_BENCH_PEAK_FRACTION_PREFIX}control", math.nan)
    # The fraction is of the peak of the precision the run trained in (tiny: fp32).
    precision = parent.data.params["train.precision"]
    peak = pm.get(f"{schema.M_BENCH_MATMUL_PEAK_PREFIX}{precision}", math.nan)
    checks.expect(rate > 0 and fraction > 0, f"{preset}: {rate:,.0f} tokens/s, {fraction:.1%} of the device's {precision} matmul peak ({peak / 1000:,.0f} TFLOP/s)")


def check_probe(store: Path, checks: Checks) -> None:
    done = cli(store, "probe", "--preset", "tiny", "--set", f"probe.candidates={PROBE_CANDIDATES}")
    checks.expect(done.returncode == 0, "tiny: probe sweep of two candidates finished")
    if done.returncode != 0:
        return
    receipts = {}
    for path in sorted((store / "home").rglob("probes/**/*.json")):
        receipt = json.loads(path.read_text())
        if isinstance(receipt, dict) and "outcome" in receipt:
            receipts[path.stem] = receipt
    outcomes = {name: r["outcome"] for name, r in receipts.items()}
    print(f"  receipts: {outcomes}")
    fits = [r for r in receipts.values() if r.get("setting", {}).get("microbatch") == 4]
    held = [r for r in receipts.values() if r.get("setting", {}).get("microbatch") == 8]
    checks.expect(bool(fits) and fits[0]["outcome"] == schema.OUTCOME_COMPLETED, "tiny: control microbatch 4 completed")
    checks.expect(bool(held) and held[0]["outcome"] == schema.OUTCOME_OUT_OF_MEMORY,
                  "tiny: control microbatch 8 on a 16 MiB device (set_per_process_memory_fraction) ended out_of_memory")  # fmt: skip
    if held:
        text = json.dumps(held[0])
        checks.expect("cuda_reserved_unallocated_mb" in text and "cuda_total_mb" in text, "tiny: the out-of-memory receipt carries the CUDA memory figures")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-cpu-preset", action="store_true", help="only the tiny preset (no SmolLM2-135M prepare and run)")
    parser.add_argument("--keep", type=Path, default=None, help="the store folder (default: <home>/gpu-check/<time>, home COOPSTUDY_HOME or .coopstudy)")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    import torch

    from coopstudy import config

    checks = Checks([])
    for preset in ("tiny", CPU_PRESET):
        config.load(preset)
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}): the CUDA checks are skipped, nothing failed.")
        print("gpu-check: what a CPU can check:")
        loss, grads = packed_against_reference("cpu", "fp64")
        checks.expect(loss < 1e-12 and grads < 1e-9, f"packed vs per-document on CPU, float64: loss {loss:.1e}, gradients {grads:.1e}")
        print("gpu-check: on a CUDA machine it runs prepare/verify/probe/bench arms of tiny"
              + ("" if args.skip_cpu_preset else f" and prepare/bench arms of {CPU_PRESET}") + " in a store of its own.")  # fmt: skip
        return 1 if checks.failures else 0

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE)
    print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    print("1. packed microbatches against each document alone, on CUDA", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for precision, loss_bound, grad_bound in (("fp64", 1e-12, 1e-9), ("fp32", 1e-5, 1e-4), ("bf16", 2e-2, BF16_GRAD_BOUND)):
        loss, grads = packed_against_reference("cuda", precision)
        checks.expect(loss < loss_bound and grads < grad_bound,
                      f"{precision}: loss rel. error {loss:.1e} (< {loss_bound:g}), worst gradient {grads:.1e} (< {grad_bound:g})")  # fmt: skip

    # The user's study home (COOPSTUDY_HOME, or the project's .coopstudy): its seed conversion, and room for this store.
    store = args.keep or workspace.home() / "gpu-check" / time.strftime("%Y%m%d-%H%M%S")
    store.mkdir(parents=True, exist_ok=True)
    seeds = workspace.home() / SEEDS
    if seeds.is_dir() and not (store / "home" / SEEDS).exists():
        (store / "home").mkdir(parents=True, exist_ok=True)
        shutil.copytree(seeds, store / "home" / SEEDS)
    print(f"2. tiny: prepare, verify, probe with a held device (store {store})", flush=True)
    ready = cli(store, "prepare", "--preset", "tiny").returncode == 0
    ready = ready and cli(store, "verify", "--preset", "tiny").returncode == 0
    checks.expect(ready, "tiny: prepared and verified")
    if ready:
        check_probe(store, checks)
        print("3. tiny: the control arm on CUDA", flush=True)
        check_control(store, "tiny", 6, checks)
    if not args.skip_cpu_preset:
        print(f"4. {CPU_PRESET}: the control arm of SmolLM2-135M on CUDA", flush=True)
        if cli(store, "prepare", "--preset", CPU_PRESET, timeout=900).returncode == 0:
            check_control(store, CPU_PRESET, 8, checks)
        else:
            checks.expect(False, f"{CPU_PRESET}: prepared")
    took = time.perf_counter() - start
    checks.expect(took < 300, f"finished in {took:.0f} s (target: under 300 s)")
    print(f"gpu-check: {'passed' if not checks.failures else 'FAILED: ' + '; '.join(checks.failures)}")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
