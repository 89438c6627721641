"""Every name the study writes to its record: tags, params, metrics,
artifacts, and the values of the stage and probe-outcome tags.

Each constant's docstring (the string right after it) is its meaning, and
the `# --- section ---` comments group them. The README's schema section is
generated from this file (`python -m coopstudy.record.schema` prints it), a
constant without a docstring makes that fail, and a test fails when the README
and this file drift apart. Analysis imports these instead of spelling them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

# --- tags: every run -------------------------------------------------------
TAG_STAGE = "coopstudy.stage"
"""On every run: the stage that opened it, one of the STAGE_ values."""
TAG_PRESET = "coopstudy.preset"
"""On every run opened with a config: the config's `preset`, by default the preset file's name without .yaml."""
TAG_ARM = "coopstudy.arm"
"""On train arm, probe candidate and bench-arms child runs: `control` or `compressed`."""
TAG_GIT_COMMIT = "coopstudy.git_commit"
"""On every run: the checkout's `git rev-parse HEAD`; absent outside a git checkout."""
TAG_CONFIG_SHA = "coopstudy.config_sha256"
"""On every run opened with a config: sha256 of the resolved config's YAML (the text of config.yaml). A probe
candidate run's config holds that candidate's settings, so its sha is not the study's: find a study's probe
candidates by their probe run (mlflow.parentRunId)."""
TAG_PLAN = "coopstudy.plan_sha256"
"""On the plan run and the runs after it (train, select, evaluate; report when the runs it reads
carry one): sha256 of the committed plan."""
TAG_ERROR = "coopstudy.error"
"""On a FAILED or KILLED run: the error's message (first 4000 characters), or its type name if it has none."""
TAG_ERROR_KIND = "coopstudy.error_kind"
"""On a FAILED or KILLED run: the error's type name (`RefusedError`, `TrainingFailed`, ...), or
ERROR_KIND_STALE_LOCK."""
ERROR_KIND_STALE_LOCK = "StaleLock"
"""coopstudy.error_kind of a run that the next job on its devices ended KILLED: the job that ran it died
without releasing them (killed, or its machine restarted)."""
TAG_COMMITMENT_PREFIX = "coopstudy.commitment."
"""+ ledger kind (inputs, gate, probe, plan): the digest this run committed to the ledger."""
TAG_REQUIRES_PREFIX = "coopstudy.requires."
"""+ ledger kind (inputs, gate, plan): the digest of a commitment the run checked before starting."""
TAG_PREFLIGHT = "coopstudy.preflight"
"""On the experiment, not a run: `<host> <UTC time>` of the last preflight against a tracking server
(once per stage process on an http(s) URI, and `python -m coopstudy remote check`)."""

TAG_RECORD_URI = "coopstudy.record_uri"
"""On a pointer run (the run `mlflow run` made, when the study records in another store or
experiment): the tracking URI of the store that holds the step's real run."""
TAG_RECORD_RUN = "coopstudy.record_run_id"
"""On a pointer run: the id of the step's real run, in the store TAG_RECORD_URI names."""

# --- stages ----------------------------------------------------------------
STAGE_PREPARE = "prepare"
"""The prepare run: seed model resolved, inputs generated, hashed and committed."""
STAGE_VERIFY = "verify"
"""The verify run: the equivalence gate (two gloo ranks against the per-document reference, float64)."""
STAGE_PROBE = "probe"
"""The probe-<preset> parent run and its child runs, one per candidate setting."""
STAGE_PLAN = "plan"
"""The plan-<preset> run that commits the frozen plan."""
STAGE_TRAIN = "train"
"""A train-<arm>-<preset> run per arm, and with `--arm both` their train-both-<preset> parent."""
STAGE_SELECT = "select"
"""The select run that commits both arms' final candidates, once per plan."""
STAGE_EVALUATE = "evaluate"
"""The evaluate parent run and its three child runs, one per model (seed, control, compressed)."""
STAGE_REPORT = "report"
"""The report run: screens as metrics, verdicts as tags, the report files as artifacts."""
STAGE_STUDY = "study"
"""The run of the `study` command (study-<preset>; study-train-<arm>-<preset>
with --through train), parent of the step runs it starts."""
STAGE_BENCH = "bench"
"""The runs of `python -m coopstudy bench`: bench-objective-<preset>, bench-arms-<preset> (with a child run per
arm) and bench-generate-<preset>."""
STAGE_DEV_SPLIT = "dev-split"
"""The dev-split-<preset> run of `python -m coopstudy dev-split`: families and learning rate measured on a
development split, outside any study."""

# --- study: step reuse -------------------------------------------------------
TAG_STEP_KEY = "coopstudy.step_key"
"""On the first run a step opens, under `study` or started by itself with the study's arguments (`train
--arm both`: on each arm run): sha256 of the step's arguments, config, sources and upstream keys; a
FINISHED run with the same key (and still valid) is reused by a study instead of run again. Train and
select steps are reused by plan instead: an arm's first finished run under the plan, the plan's selection."""
M_STUDY_SECONDS = "study/seconds"
"""On the study run: wall seconds of the whole command, reused steps included."""
ART_STEP_KEYS = "step_keys.json"
"""On the study run: step name -> step key, for every step it ran or reused."""

# --- artifacts: every run --------------------------------------------------
ART_CONFIG = "config.yaml"
"""On every run opened with a config but a bench-arms child run (its parent holds it): the resolved
config as YAML (also logged as dotted params)."""
ART_ERROR = "error.txt"
"""On a FAILED or KILLED run: the error's full traceback (for a run that the next job ended, the
reason it gives)."""

# --- prepare ---------------------------------------------------------------
TAG_INPUTS = "coopstudy.inputs_sha256"
"""On the prepare run: the sha256 of manifest.json, which names every prepared file: the inputs commitment."""
TAG_SEED_SHA = "coopstudy.seed_weights_sha256"
"""On prepare, probe and train runs: sha256 of the seed's safetensors
(with shards: of their `name<TAB>sha256` lines)."""
PARAM_SEED_PARAMETERS = "seed.parameters"
"""On the prepare run: the seed model's distinct parameters (tied embeddings count once)."""
ART_MANIFEST = "manifest.json"
"""On the prepare run: sha256 and bytes of every prepared file, counts, token
statistics, truncation, dropped test questions, the seed."""
M_PREPARE_SECONDS = "prepare/seconds"
"""On the prepare run: wall seconds of the whole stage."""
M_PREPARE_TRUNCATED = "prepare/truncated_documents"
"""On the prepare run: documents (train and retention) cut to data.max_context tokens."""
M_PREPARE_TRUNCATED_TOKENS = "prepare/truncated_tokens"
"""On the prepare run: tokens cut off those documents, in total."""
M_SEED_PARAMETERS = "seed/parameters"
"""On the prepare run: the seed's distinct parameters, as a metric (the same number as the param)."""
TAG_INPUTS_KEY = "coopstudy.inputs_key"
"""On the prepare run: the ledger subject of its inputs commitment, a
hash of data.*, model.* and the schedule's shape."""
M_PREPARE_SEED_SECONDS = "prepare/seed_seconds"
"""On the prepare run: seconds to resolve the seed model (download or conversion, unless cached, and hashing)."""
M_PREPARE_BUILD_SECONDS = "prepare/build_seconds"
"""On the prepare run: seconds to generate, tokenize, schedule, hash and write the inputs."""
M_PREPARE_TEST_DROPPED = "prepare/test_dropped"
"""On the prepare run: generated final-test questions dropped, being in training or repeated in the test."""
M_PREPARE_TRAIN_TOKENS = "prepare/train_tokens"
"""On the prepare run: tokens of train.jsonl (task and replay documents, each once, after truncation)."""

# --- verify (the equivalence gate) ------------------------------------------
ART_GATE_RECEIPT = "gate_receipt.json"
"""On the verify run, passed or failed: the gate's receipt (sources, libraries, every comparison, failures)."""
TAG_GATE = "coopstudy.gate_sha256"
"""On a verify run that passed: sha256 of its receipt (canonical JSON), the gate commitment."""
M_GATE_MAX_REL_ERROR = "gate/max_rel_error"
"""On the verify run: the largest relative error, max|batched - reference| /
max|reference| per tensor, over every comparison."""

# --- probe (a parent run per sweep, a child run per candidate) ----------------
TAG_PROBE_SETTING = "coopstudy.probe.setting"
"""On a candidate run: <arm>-mb<microbatch>-<allocator>, also its receipt's file name."""
TAG_PROBE_OUTCOME = "coopstudy.probe.outcome"
"""On a candidate run: how it ended, one of the three OUTCOME_ values."""
OUTCOME_COMPLETED = "completed"
"""Every rank reported finishing every probe update and the launch exited 0."""
OUTCOME_OUT_OF_MEMORY = "out_of_memory"
"""A rank exceeded the device's capacity (CUDA's allocator, or the CPU
peak-RSS check), or the host ran out of memory (MemoryError)."""
OUTCOME_ERROR = "error"
"""Any other failure, a rank that left no report included."""
TAG_PROBE_RECEIPT = "coopstudy.probe.receipt_sha256"
"""On a candidate run: sha256 of its receipt file in <home>/probes/, the probe commitment."""
ART_PROBE_RECEIPT = "probe_receipt.json"
"""On a candidate run: its receipt (setting, outcome, update seconds, memory by rank, cost, hashes, versions)."""
ART_PROBE_RANK_PREFIX = "probe_ranks/rank"
"""+ rank + .json, on a candidate run: what one training process measured (outcome, error, update
seconds, memory, device), written by that process however it ended."""
ART_PROBE_RECEIPTS = "probe_receipts.json"
"""On the probe parent run: every candidate's receipt, in sweep order."""
ART_PROBE_CHOICE = "probe_choice.json"
"""On the probe parent run: per arm and allocator, the largest microbatch that completed, its median
update seconds, its receipt's name, and the microbatches that failed."""
M_PROBE_MEDIAN_SECONDS = "probe/median_update_seconds"
"""On a candidate run that completed: the median of rank 0's update seconds over probe.updates updates."""
M_PROBE_COMPLETED = "probe/completed"
"""On the probe parent run: how many candidates completed."""
M_PROBE_FAILED = "probe/failed"
"""On the probe parent run: how many candidates did not (out of memory or error)."""
M_CUDA_ALLOC_RETRIES = "memory/cuda_alloc_retries"
"""On a candidate run on CUDA: the caching allocator's retries (num_alloc_retries), the largest over ranks."""
M_CUDA_RESERVED_UNALLOCATED_MB = "memory/cuda_reserved_unallocated_mb"
"""On a candidate run on CUDA that failed: MiB reserved by the caching allocator
but not allocated at the failure, the largest over ranks."""

# --- plan ---------------------------------------------------------------------
ART_PLAN = "plan.json"
"""On the plan run: the frozen plan document (also <home>/plans/<sha>.json); its sha256 is the plan commitment."""
M_PLAN_SECONDS_PREFIX = "plan/projected_seconds/"
"""+ arm, on the plan run: the projected seconds of that arm's full run (probe
overhead + median update seconds x train.updates)."""
M_PLAN_COST_PREFIX = "plan/projected_cost_usd/"
"""+ arm, on the plan run: that arm's projected cost, workers x projected
seconds / 3600 x budget.hourly_price_usd, USD."""
M_PROJECTED_SECONDS = "time/projected_seconds"
"""On a train arm run: the plan's projected seconds for this arm (on a train-both parent: both arms, summed)."""
M_PROJECTED_COST_USD = "cost/projected_usd"
"""On a train arm run: the plan's projected cost of this arm, USD (on a train-both parent: both arms, summed)."""
M_SPENT_BEFORE_USD = "cost/spent_before_usd"
"""On a train run: what the plan had spent (probes and earlier train runs, failed ones too) when it started, USD."""

# --- bench objective (python -m coopstudy.bench objective) -------------------
M_BENCH_BATCHED_MS = "bench/batched_ms_per_update"
"""On the bench run: mean milliseconds of the batched update (control microbatches, one process), warm-up excluded."""
M_BENCH_REFERENCE_MS = "bench/reference_ms_per_update"
"""On the bench run: mean milliseconds of the per-document reference update on the same documents."""
M_BENCH_SPEEDUP = "bench/speedup"
"""On the bench-objective run: per-document ms / batched ms; on the bench-generate run: one-at-a-time seconds /
batched seconds."""
M_BENCH_LOSS_REL_GAP = "bench/loss_max_rel_gap"
"""On the bench run: the largest |batched loss - reference loss| / |reference loss| over the updates,
warm-up included."""
M_BENCH_PADDING_PREFIX = "bench/padding_efficiency/"
"""On the bench run, real tokens / computed tokens: + `measured`, of the benchmark's own batched
updates (1.0: packed microbatches compute no padding); + padded_sorted|padded_unsorted + / + arm,
what the whole schedule would compute were each of that arm's microbatches right-padded to its
longest document (documents sorted by length first, or not): what packing saves."""
TAG_BENCH_DOCUMENTS = "coopstudy.bench_documents"
"""On the bench run: where its documents came from (`prepared inputs <sha>`, or `synthetic (...)` and why)."""
ART_BENCH_TABLE = "bench_objective.json"
"""On the bench run: the printed table, one row per quantity (MLflow table)."""

# --- bench arms (python -m coopstudy bench arms) -----------------------------
PHASE_DENSE = "dense"
"""Updates 1 to `powersgd.dense_updates`, where every arm all-reduces whole gradients (in `bench/arms/` names and `bytes/dense_total`)."""
PHASE_COMPRESSED = "compressed"
"""The updates after the dense ones, where the compressed arm sends PowerSGD factors (in `bench/arms/` names and `bytes/compressed_total`)."""


def phases(dense_updates: int, updates: int) -> dict[str, list[int]]:
    """Updates 1..dense_updates are the dense phase, the rest the compressed one.

    The control arm has no phases of its own; its same updates (the same
    documents) are set beside the compressed arm's. An empty phase is left out.
    """
    spans = {
        PHASE_DENSE: range(1, min(dense_updates, updates) + 1),
        PHASE_COMPRESSED: range(dense_updates + 1, updates + 1),
    }
    return {name: list(steps) for name, steps in spans.items() if len(steps)}


M_BENCH_ARMS_PREFIX = "bench/arms/"
"""+ phase (dense|compressed) + / + arm + / + part, on the bench-arms-<preset> parent run: the median over
that phase's updates of rank 0's seconds per update; part is update, forward_backward, comm,
comm_arithmetic, optimizer, other, record or system (the train/ metrics of the arm's child run)."""
M_BENCH_ARMS_RATIO_PREFIX = "bench/arms_ratio/"
"""+ phase, on the bench-arms parent run: control median update seconds / compressed median update seconds."""
M_BENCH_ARMS_IDEAL_PREFIX = "bench/arms_ideal_ratio/"
"""+ phase, on the bench-arms parent run: the compute-only ratio, control median update seconds / the
compressed arm's median of (slowest rank's forward_backward + rank 0's optimizer and other seconds):
the ratio with free gradient communication and recording."""
M_BENCH_ARMS_SPLIT_PREFIX = "bench/arms_split_ratio/"
"""+ phase, on the bench-arms parent run: control median update seconds / the median over the phase's
updates of (the control's forward_backward x the control's workers / the compressed arm's + its comm on
the rank that waited least + rank 0's optimizer and other seconds): the ratio if splitting the batch
divided the forward and backward exactly, so that no rank waited, and left the rest as measured. Below a
target, no faster forward and backward reaches it."""
M_BENCH_MATMUL_PEAK_PREFIX = "bench/matmul_peak_gflops/"
"""+ dtype (bf16|fp32), on the bench-arms parent run: the best matmul GFLOP/s of one device (on CPU,
train.threads_per_device threads: 1 in the presets) measured in the run (on CUDA: the device's), before
the arms ran (after them: + `/after`)."""
M_BENCH_ACHIEVED_PREFIX = "bench/achieved_gflops/"
"""+ arm, on the bench-arms parent run: training GFLOP/s per device over all timed updates (6 x matmul
parameters x tokens, the output layer at target tokens only, plus causal attention within documents)."""
M_BENCH_TOKENS_PER_S_PREFIX = "bench/tokens_per_second/"
"""+ arm, on the bench-arms parent run: real tokens trained per second over all timed updates (the arm's, all devices)."""
M_BENCH_PEAK_FRACTION_PREFIX = "bench/peak_fraction/"
"""+ arm, on the bench-arms parent run: achieved GFLOP/s per device / the matmul peak of train.precision
(fp64 against the fp32 peak, which is all the bench measures)."""
M_BENCH_NEW_MEMORY_PREFIX = "bench/new_memory_mb/"
"""+ arm, on the bench-arms parent run: train/new_memory_mb summed over the arm's updates and ranks, MiB:
the memory its processes touched for the first time inside the training window."""
M_BENCH_SYSTEM_PREFIX = "bench/system_seconds/"
"""+ arm, on the bench-arms parent run: train/system_seconds summed over the arm's updates and ranks: what
the operating system took of its processes inside the training window (mostly the first touch of that memory)."""
M_BENCH_READY_MEMORY_PREFIX = "bench/ready_memory_mb/"
"""+ arm, on the bench-arms parent run: train/ready_memory_mb before the arm's first update, MiB: what
first touches could take without waiting for the VM's host when the arm began."""
M_BENCH_GENERATE_SECONDS_PREFIX = "bench/generate_seconds/"
"""+ mode (one_at_a_time|batched), on the bench-generate-<preset> run: seconds of greedy generation over its cases."""
M_BENCH_GENERATE_RATE_PREFIX = "bench/generate_cases_per_second/"
"""+ mode (one_at_a_time|batched), on the bench-generate run: its cases / that mode's seconds."""
M_BENCH_GENERATE_CASES = "bench/generate_cases"
"""On the bench-generate run: the development-split cases generated (`--items`)."""
M_BENCH_GENERATE_IDENTICAL = "bench/generate_identical_outputs"
"""On the bench-generate run: the cases whose batched tokens equal their one-at-a-time tokens (all, or exit 1)."""
M_BENCH_GENERATE_THREADS = "bench/generate_threads"
"""On the bench-generate run: torch's thread count while it generated (evaluation is not a timed arm)."""
M_BENCH_READY_MEMORY_LOW_PREFIX = "bench/ready_memory_low_mb/"
"""+ arm, on the bench-arms parent run: the lowest train/ready_memory_mb after one of the arm's updates, MiB;
near zero, the arm's later first touches waited for the host."""
ART_BENCH_ARMS_TABLE = "bench_arms.json"
"""On the bench-arms parent run: the printed tables, one row per quantity (MLflow table)."""
# --- dev-split ----------------------------------------------------------------
M_DEV_PREFIX = "dev/"
"""+ model (seed, or lr_<rate>) + / + an evaluate metric (eval/accuracy, eval/accuracy/<family>,
eval/retention_nll, ...), on the dev-split-<preset> run: that model scored on the development split; for a
rate also + retention_bound and + gain, the retention and accuracy-gain screens against the seed there."""
ART_DEV_SPLIT = "dev_split.json"
"""On the dev-split-<preset> run: families, dev seed, updates, the seed's and each rate's accuracy per
family, retention change and bound, and what the rule chose."""

# --- train: per update (step = update number, from 1) -----------------------
M_LOSS = "train/loss"
"""On train arm, probe candidate and bench-arms runs: the update's global weighted loss
L_k (the same in both arms for the same weights)."""
M_GRAD_NORM = "train/grad_norm"
"""On train arm, probe candidate and bench-arms runs: the L2 norm of the gradient the update applies, before clipping: the global gradient, except in the compressed arm's compressed phase, where it is PowerSGD's approximation of it, error feedback included (not comparable with the control's there)."""
M_LR = "train/lr"
"""On train arm, probe candidate and bench-arms runs: the learning rate the update used (linear warmup, then constant)."""
M_UPDATE_SECONDS = "train/update_seconds"
"""On train arm, probe candidate and bench-arms runs: rank 0's wall seconds for the update, until its loss was read
off the device."""
M_TOKENS = "train/tokens"
"""On train arm, probe candidate and bench-arms runs: real (unpadded) tokens of the update's global batch."""
M_BYTES = "train/bytes"
"""On train arm, probe candidate and bench-arms runs: rank 0's collective payload in the update
(gradient + scalar sums), bytes; 0 in the control."""
# --- train: time breakdown per update ---
M_FORWARD_BACKWARD_SECONDS = "train/forward_backward_seconds"
"""On train arm, probe candidate and bench-arms runs, per update: rank 0's seconds in the forwards and
backwards of its microbatches, less the gradient communication."""
M_COMM_SECONDS = "train/comm_seconds"
"""On train arm, probe candidate and bench-arms runs, per update: rank 0's seconds in the gradient comm
hook (dense all-reduce, or PowerSGD: compression, all-reduces, decompression, error feedback), from its
call to its future's completion, waits for the other rank included; 0 in the control. On CUDA (NCCL)
the future completes once the work is queued: the host's share, the device's time falls in
train/forward_backward_seconds."""
M_COMM_ARITHMETIC_SECONDS = "train/comm_arithmetic_seconds"
"""On train arm, probe candidate and bench-arms runs, per update: the part of train/comm_seconds that
rank 0 spent in PowerSGD's own arithmetic (error feedback, the P and Q products, orthogonalizations,
decompression); the rest of it is collectives and waits. 0 for dense updates and in the control."""
M_OPTIMIZER_SECONDS = "train/optimizer_seconds"
"""On train arm, probe candidate and bench-arms runs, per update: rank 0's seconds zeroing gradients,
taking their norm, clipping, and the AdamW and schedule steps."""
M_OTHER_SECONDS = "train/other_seconds"
"""On train arm, probe candidate and bench-arms runs, per update: rank 0's remaining update seconds
(packing the microbatches, reading the loss, the loss and token sums across ranks, freeing the update's
tensors), so that the parts add up to train/update_seconds."""
M_SYSTEM_SECONDS = "train/system_seconds"
"""On train arm, probe candidate and bench-arms runs, per update: CPU seconds the operating system spent
on rank 0's process (all its threads) from zeroing the gradients to the loss and token sums across ranks,
across the parts rather than beside them (packing the microbatches, before, is outside it); on
CPU mostly page faults of memory new to the process (its first updates, and any later one that grows
its heap)."""
M_NEW_MEMORY_MB = "train/new_memory_mb"
"""On train arm, probe candidate and bench-arms runs, per update: how much rank 0's peak resident set grew
during the update, MiB: memory the process touched for the first time (the arms' malloc keeps what they
free), whose page faults train/system_seconds holds. Every rank's is in train_summary.json
(new_memory_mb_by_rank)."""
M_READY_MEMORY_MB = "train/ready_memory_mb"
"""On train arm, probe candidate and bench-arms runs, per update: the free memory of rank 0's machine in
blocks smaller than a VM's balloon reports to its host (under 2 MiB), MiB, when the update ended
(machine.ready_memory_mb): what first touches can still take at the guest's cost. Where the host takes
back the larger blocks (free_page_reporting in train_summary.json), memory new to the processes beyond it
costs seconds per GiB of train/system_seconds. train_summary.json's ready_memory_mb starts with the value
before update 1."""
M_RECORD_SECONDS = "train/record_seconds"
"""On train arm, probe candidate and bench-arms runs, per update: rank 0's seconds writing the record
inside the training window just before the update started (per-update metrics wait in memory and are
written at most once a minute, and after the last update, outside the window); 0 for most updates."""
# --- train: per run ---------------------------------------------------------
M_ACTIVE_SECONDS = "time/active_seconds"
"""On train arm, probe candidate and bench-arms runs whose workers finished their updates: rank 0's seconds from the first update's start to the last update's end."""
M_COMPLETE_SECONDS = "time/complete_seconds"
"""On train arm, probe candidate and bench-arms runs: seconds from launching the processes to their exit, timed by the stage (on a train run stopped by a signal, to the stop); on an evaluate run (the parent): seconds it held the device, failed and stopped runs too."""
M_RENDEZVOUS_SECONDS = "time/rendezvous_seconds"
"""On train arm, probe candidate and bench-arms runs whose workers finished their updates: seconds rank 0 waited for every rank
to join its process group, inside time/complete_seconds (0 in the control): on one host, its ranks' start-up skew; node by
node, the time until the other node's command was started and its ranks had loaded."""
M_CHECKPOINT_SECONDS = "time/checkpoint_seconds"
"""On a train arm run: seconds to write, hash, read back and verify the final checkpoint and log it as an artifact."""
M_DEVICE_SECONDS = "time/device_seconds"
"""On train arm, probe candidate, bench-arms and evaluate (parent) runs: workers (evaluate: 1) x complete seconds."""
M_BYTES_DENSE = "bytes/dense_total"
"""On train arm, probe candidate and bench-arms runs whose workers finished their updates: rank 0's gradient payload over the dense updates, bytes; 0 in the control."""
M_BYTES_COMPRESSED = "bytes/compressed_total"
"""On train arm, probe candidate and bench-arms runs whose workers finished their updates: rank 0's gradient payload over the
PowerSGD-compressed updates, bytes; 0 in the control."""
M_BYTES_TOTAL = "bytes/total"
"""On train arm, probe candidate and bench-arms runs whose workers finished their updates: rank 0's whole collective payload (dense +
compressed + scalar sums + DDP's setup broadcast), bytes."""
M_BYTES_SETUP = "bytes/setup"
"""On train arm, probe candidate and bench-arms runs whose workers finished their updates: DDP's one broadcast of parameters and buffers when it is built,
bytes, a part of bytes/total; rank 0 sends it and the other ranks only receive it; 0 in the control."""
M_PEAK_RSS_MB = "memory/peak_rss_mb"
"""On train arm, probe candidate and bench-arms runs: the largest peak resident set (VmHWM) over ranks, MiB
(a failed probe candidate's from its receipt, where its ranks reported it)."""
M_CUDA_MAX_ALLOCATED_MB = "memory/cuda_max_allocated_mb"
"""On train arm, probe candidate and bench-arms runs on CUDA: torch's max_memory_allocated, the largest over ranks, MiB."""
M_CUDA_MAX_RESERVED_MB = "memory/cuda_max_reserved_mb"
"""On train arm, probe candidate and bench-arms runs on CUDA: torch's max_memory_reserved, the largest over ranks, MiB."""
M_COST_USD = "cost/spent_usd"
"""On train arm, probe candidate and evaluate (parent) runs, failed and stopped train and evaluate runs too: device seconds / 3600 x budget.hourly_price_usd, USD."""
M_OTHERS_CORES = "machine/others_cores"
"""On train arm, probe candidate and bench arms runs: the cores that processes other than the arm's own kept busy on
rank 0's host while the arm's processes ran, on average (their CPU seconds / complete seconds, from
/proc/stat less the arm's and the stage's own): about 0 on a quiet machine; above it, the arm's timings are
a loaded machine's. Not on a run whose ranks the DeepSpeed runner started over ssh (--hostfile)."""
M_STEAL_SECONDS = "machine/steal_seconds"
"""On train arm, probe candidate and bench arms runs: CPU seconds the hypervisor gave other machines while the arm's
processes ran on rank 0's host (/proc/stat's steal): time the arm waited for cores it had."""
TAG_CHECKPOINT_SHA = "coopstudy.checkpoint_sha256"
"""On a train arm run: sha256 of the final checkpoint's model.safetensors; on
an evaluate child run: of the weights it scored."""
TAG_CHECKPOINT_PATH = "coopstudy.checkpoint_path"
"""On a train arm run: the final checkpoint's directory on rank 0's local disk, <home>/checkpoints/<run id>/
(HF format); select and evaluate re-hash the weights in it, and bring the folder back from the run's `checkpoint`
artifact where the weights are gone."""
ART_CHECKPOINT = "checkpoint"
"""On a train arm run: the final checkpoint's folder (model.safetensors, config, tokenizer)."""
ART_TRAIN_SUMMARY = "train_summary.json"
"""On train arm, probe candidate and bench-arms runs whose workers finished their updates: rank 0's summary (setting, host, device, malloc,
phases, assignment, memory by rank, every rank's per-update times and new memory, bytes, checkpoint)."""
TAG_WORKER_ERROR_PREFIX = "coopstudy.worker_error.rank"
"""+ rank, on train arm, probe candidate and bench-arms runs: `<type>: <first line>` of the error that training
process hit (the run's own error tag says what the stage saw)."""
ART_WORKER_ERROR_PREFIX = "worker_errors/rank"
"""+ rank + .txt, on train arm, probe candidate and bench-arms runs: that training process's traceback."""

# --- select / evaluate ------------------------------------------------------
TAG_CANDIDATE_PREFIX = "coopstudy.candidate."
"""+ arm, on the select run and the evaluate parent: the sha256 of that arm's selected final weights."""
TAG_MODEL = "coopstudy.model"
"""On an evaluate child run, and on the logged model it logs: the model it scored, seed, control or compressed."""
MODEL_NAME_SEED = "seed"
"""The value of `coopstudy.model` for the seed model, which evaluate scores beside the arms' models (each named by its arm)."""
MODEL_TYPE_CHECKPOINT = "checkpoint"
"""The type of the logged model (the *Models* tab) each evaluate child run logs, named seed, control or compressed:
its params are the MODEL_PARAM_* below, its tag `coopstudy.model`, its metrics the run's `eval/*` (one value each), each
linked to the file it was measured on: `eval/retention_nll` to retention.jsonl, `eval/threads` to none, the rest to test.jsonl."""
MODEL_PARAM_WEIGHTS = "weights"
"""On a logged model: the folder of the weights it scored."""
MODEL_PARAM_WEIGHTS_SHA = "weights_sha256"
"""On a logged model: the sha256 of those weights (`coopstudy.checkpoint_sha256` on its run)."""
M_ACCURACY = "eval/accuracy"
"""On an evaluate child run: the fraction (0 to 1) of final-test cases whose verifier scored 1.0."""
M_ACCURACY_PREFIX = "eval/accuracy/"
"""+ family, on an evaluate child run: the same fraction over that family's cases."""
M_RETENTION_NLL = "eval/retention_nll"
"""On an evaluate child run: the mean over retention documents of their mean NLL per target token, nats."""
ART_TEST_TABLE = "test_cases.json"
"""On an evaluate child run: one row per final-test case (prompt, output, answer, expected, score, correct)."""
ART_RETENTION_TABLE = "retention.json"
"""On an evaluate child run: one row per retention document (target tokens, NLL sum, mean NLL)."""
TAG_CANDIDATE_RUN_PREFIX = "coopstudy.candidate_run."
"""+ arm, on the select run: the train run whose final checkpoint is that arm's candidate."""
TAG_SELECT_RUN = "coopstudy.select_run_id"
"""On the evaluate parent run: the select run that committed the candidates it scored."""
TAG_SCORED_BY_PREFIX = "coopstudy.scored_by."
"""On the evaluate parent run, per model (`coopstudy.scored_by.<model>`): the child run of an
earlier evaluate, stopped or failed after it, that had scored the model's weights under the
plan; taken as it is, not scored again (the first finished evaluation is the one the report reads)."""
M_TEST_CASES = "eval/test_cases"
"""On an evaluate child run: the number of final-test cases scored."""
M_GENERATE_SECONDS = "eval/generate_seconds"
"""On an evaluate child run: seconds of greedy generation over the whole final test."""
M_GENERATE_ITEMS_PER_SECOND = "eval/generate_items_per_second"
"""On an evaluate child run: test cases / generate seconds."""
M_EVAL_THREADS = "eval/threads"
"""On an evaluate child run: torch's thread count while it scored."""

# --- report -----------------------------------------------------------------
ART_REPORT_JSON = "report.json"
"""On the report run: every screen's estimate, bound, threshold, verdict and input run ids; no time of its own making (only the runs' recorded starts and ends), so rebuilt from the same store it is the same file."""
ART_REPORT_MD = "report.md"
"""On the report run: the report as Markdown."""
ART_REPORT_HTML = "report.html"
"""On the report run: the report as HTML, with plots."""
ART_FIGURES = "figures"
"""On the report run: a folder of the report's figures as PNG images (the same as in report.html)."""
TAG_VERDICT_PREFIX = "coopstudy.verdict."
"""+ quality, speed or a screen's name, on the report run: pass or fail."""
M_SCREEN_PREFIX = "screen/"
"""+ screen name (accuracy_gain, retention, noninferiority, active_speedup, complete_speedup) + /estimate,
/bound (the limit the verdict used, if any) or /passed (1 or 0), on the report run. Units: accuracy differences
as fractions (0.05 is the report's +5.0 pts), retention in nats per token, speedups as ratios."""


# The README's schema section, built from this file's own source: the
# constants above, their docstrings and the section comments.

_SECTION = re.compile(r"^# --- (.+?) -*$")
_CONSTANT = re.compile(r"^[A-Z][A-Z0-9_]*$")
_KINDS = (
    ("TAG_", "tag"),
    ("PARAM_", "param"),
    ("M_", "metric"),
    ("ART_", "artifact"),
    ("STAGE_", "stage value"),
    ("OUTCOME_", "outcome value"),
    ("ERROR_KIND_", "error kind value"),
    ("MODEL_PARAM_", "logged-model param"),
    ("MODEL_NAME_", "tag value"),
    ("PHASE_", "phase name"),
    ("MODEL_", "logged-model type"),
)
"""Constant prefix -> the kind the README shows. A constant with any other
prefix is refused: give its kind a prefix here first."""


class Name(NamedTuple):
    """One constant of this module, as the README shows it."""

    section: str
    constant: str
    value: str
    kind: str
    meaning: str
    """The docstring, its lines joined by single spaces."""
    line: int


def names(source: str | None = None) -> list[Name]:
    """Every constant of `source` (default: this file) in file order, or a
    ValueError naming each one without a docstring, a section, a string value
    or a known prefix, and each string that documents nothing."""
    import ast

    text = Path(__file__).read_text() if source is None else source
    sections = [(n, m.group(1)) for n, line in enumerate(text.splitlines(), 1) if (m := _SECTION.match(line))]
    body = ast.parse(text).body
    found: list[Name] = []
    problems: list[str] = []
    documented: set[int] = set()

    def string(node: ast.stmt | None) -> str | None:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return node.value.value
        return None

    if string(body[0] if body else None) is not None:
        documented.add(0)  # the module docstring
    for i, node in enumerate(body):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        doc = string(body[i + 1]) if i + 1 < len(body) else None
        if doc is not None:
            documented.add(i + 1)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        constants = [t.id for t in targets if isinstance(t, ast.Name) and _CONSTANT.match(t.id)]
        if not constants:
            continue
        name = constants[0]
        where = f"line {node.lineno}: {name}"
        if doc is None or not doc.strip():
            problems.append(f"{where} has no docstring (a string literal on the line after it, saying what it means)")
            continue
        if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            problems.append(f"{where} is not a string")
            continue
        kind = next((k for prefix, k in _KINDS if name.startswith(prefix)), None)
        if kind is None:
            problems.append(f"{where} has none of the prefixes {', '.join(p for p, _ in _KINDS)}")
            continue
        section = next((title for n, title in reversed(sections) if n < node.lineno), None)
        if section is None:
            problems.append(f"{where} comes before the first `# --- section ---` comment")
            continue
        found.append(Name(section, name, node.value.value, kind, " ".join(doc.split()), node.lineno))
    for i, node in enumerate(body):
        if string(node) is not None and i not in documented:
            problems.append(f"line {node.lineno}: a string that documents no constant")
    if problems:
        raise ValueError("coopstudy/record/schema.py: " + "; ".join(problems))
    return found


def _cell(text: str) -> str:
    """`text` as a Markdown table cell: `|` escaped everywhere; outside code
    spans `<` (or `<arm>` would be read as HTML) and `*` (as in `data.*`)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("*", "\\*").replace("<", "&lt;")
    return "`".join(parts).replace("|", "\\|")


def _intro() -> str:
    return (
        "Every name below is a constant in `src/coopstudy/record/schema.py`, which analysis imports, and its "
        "meaning is that constant's docstring (`python -m coopstudy.record.schema` prints this section). "
        f"Every run a step opens carries `{TAG_STAGE}`, `{TAG_PRESET}`, `{TAG_CONFIG_SHA}`, the git commit (`{TAG_GIT_COMMIT}`), "
        f"the whole resolved config as params (dotted keys, e.g. `train.lr`; each value as `{ART_CONFIG}` writes it, "
        f"so `--set train.lr=2e-4` is the param `0.0002`; `preset` is the tag alone) and `{ART_CONFIG}`; "
        f"runs from the plan on also carry `{TAG_PLAN}`. "
        "Query the record with MLflow's search API, e.g. "
        f"``mlflow.search_runs(experiment_names=[\"coopstudy\"], filter_string=\"tags.`{TAG_STAGE}` = '{STAGE_TRAIN}' "
        f"and tags.`{TAG_PLAN}` = '<sha>' and tags.`{TAG_ARM}` != ''\")`` for the arms' train runs of a plan "
        f"(without the arm filter, the `train-both-<preset>` parent of `train --arm both`, finished or refused, is among them). `<sha>` is all 64 digits (the "
        f"`plan ... committed` line, report.json's `study.plan_sha256`, the plan run's `{TAG_PLAN}`); with the 12 "
        f"digits the steps print, write `LIKE '<12 digits>%'`. The timed runs are the select run's "
        f"`{TAG_CANDIDATE_RUN_PREFIX}<arm>` tags. `mlflow.load_table(\"{ART_TEST_TABLE}\", run_ids=[...])` searches "
        "the active experiment: call `mlflow.set_experiment(\"coopstudy\")` first."
    )


def markdown() -> str:
    """The README's schema section: the intro, then per section a bold
    heading and a table of its names, kinds, constants and meanings."""
    found = names()
    lines = [_intro()]
    for section in dict.fromkeys(n.section for n in found):
        lines += ["", f"**{section}**", "", "| name | kind | constant | meaning |", "|---|---|---|---|"]
        rows = [n for n in found if n.section == section]
        lines += [f"| {_cell(f'`{n.value}`')} | {n.kind} | `{n.constant}` | {_cell(n.meaning)} |" for n in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
