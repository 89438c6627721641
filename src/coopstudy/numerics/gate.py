"""The equivalence gate: the batched DDP update against the per-document reference.

Two real gloo ranks run the training update (`update.worker_update`:
work-balanced split, length-sorted packed microbatches with per-document
positions and attention, no_sync accumulation, global normalization, DDP
dense all-reduce through the timing comm hook, fused AdamW); one process runs
the per-document reference (`update.reference_update`: each document alone,
the LM's own attention, torch's per-tensor AdamW) from the same initial
weights. After each of two updates, every parameter, both AdamW moments, the
loss and the gradient norm must agree within TOLERANCE.

Cases: unequal lengths; unequal weights concentrated on one rank, then on
the other; prompt masks (and a microbatch
with no target at all); a partial final microbatch; a clip that binds; a
non-zero weight given to documents' first tokens (never a target: it must
count neither in the loss nor in W_k, and in a packed row it sits right after
the previous document's last token); adjacent one-token documents packed
with longer ones; microbatches of one document each.

Choices, and why:
- float64 (precision=fp64): summation-order differences between packed
  rows and single documents are then ~1e-15, so a tolerance of 1e-9
  separates rounding from any real error (a wrong denominator, a lost worker
  factor, attention across documents, a first token that counts) by many
  orders of magnitude.
- relative error of a tensor = max|a - b| / max|b| (per tensor, not per
  element: elements near zero would turn rounding into large ratios).
- a fixed small Llama (GATE_MODEL: 2 layers, width 32, grouped-query attention
  and tied embeddings as in SmolLM2, a 256-token vocabulary) whatever the
  preset: what the gate checks (batching, objective, accumulation, DDP's
  averaging, the optimizer step) does not depend on model size, a small
  model keeps the gate to seconds, and the receipt then binds only the
  numerical sources and library versions, so one receipt serves every preset.
  The optimizer hyperparameters and warmup are the preset's.
- DDP without PowerSGD: PowerSGD is lossy by design; the gate checks the
  dense path that the compressed arm also uses for its first updates.

The receipt is bound to the sha256 of the numerical sources
(`commit.sources.numerical_sources_sha256`) and to the torch and transformers
versions; `commit.require.gate_receipt` refuses training when no receipt
matches the current ones.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coopstudy import config as config_mod
from coopstudy import workspace
from coopstudy.config import Config
from coopstudy.errors import UserError
from coopstudy.numerics import batching, distributed, objective, update

TOLERANCE = 1e-9
PRECISION = "fp64"
"""The gate's precision, whatever the preset's (see "Choices" above)."""
WORLD_SIZE = 2
GATE_MODEL: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
_DOC_SEED = 20_240_601


TENSORS = ("param", "exp_avg", "exp_avg_sq")
"""What the gate compares per parameter: the weights and AdamW's two moments."""
SCALARS = ("loss", "grad_norm")
"""What it compares per update."""


class GateFailed(UserError):
    """The batched update does not match the reference."""


# --- cases -------------------------------------------------------------------


@dataclass(frozen=True)
class GateDoc:
    input_ids: tuple[int, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True)
class Case:
    name: str
    documents: tuple[GateDoc, ...]
    schedule: tuple[tuple[int, ...], ...]
    """One global batch per update, indices into documents."""
    microbatch: int
    grad_clip: float | None


def gate_cases(grad_clip: float | None = None) -> list[Case]:
    """The protocol's cases, each over two updates; `grad_clip` is the preset's."""
    rng = random.Random(_DOC_SEED)
    vocab = GATE_MODEL["vocab_size"]

    def doc(*segments: tuple[int, float]) -> GateDoc:
        # Segments of (tokens, weight); the first token is never a target.
        weights = [w for n, w in segments for _ in range(n)]
        weights[0] = 0.0
        return GateDoc(tuple(rng.randrange(1, vocab) for _ in weights), tuple(weights))

    def task(prompt: int, answer: int) -> GateDoc:
        return doc((prompt, 0.0), (answer, 8.0))

    spread = [(2, 1), (58, 2), (9, 3), (30, 1), (4, 4), (45, 5), (17, 2), (3, 1),
              (50, 3), (6, 2), (25, 4), (12, 1), (40, 2), (8, 8), (33, 1), (20, 3)]  # fmt: skip
    unequal = tuple(task(p, a) for p, a in spread)
    two_batches_of_8 = (tuple(range(8)), tuple(range(8, 16)))

    # One rank holds only documents with many answer tokens (weight 8), the
    # other only replay documents with a few weight-1 tokens, or none at all.
    # Which documents a rank holds is the split's choice (batching.shares, by
    # length), so the weights are given after the split.
    lengths = (30, 35, 35, 33, 43, 24, 24, 37, 15, 30, 18, 21, 11, 25, 12, 18)
    mixed = ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))

    def concentrated(rank: int) -> tuple[GateDoc, ...]:
        held = {i for row in mixed for i in batching.shares(row, lengths, 2)[rank]}
        return tuple(
            task(n // 3, n - n // 3) if i in held else doc((n, 0)) if i % 3 == 1 else doc((n - 3, 0), (3, 1))
            for i, n in enumerate(lengths)
        )

    # Prompt segments inside replay documents, and lengths chosen so that the
    # sorted cut still pads a short document against a long one; one of rank
    # 1's microbatches of update 1 has no target token at all.
    masks = (
        doc((50, 0), (6, 1), (8, 0), (5, 1)), task(2, 2), doc((3, 0), (1, 1)), task(1, 1),
        doc((40, 0)), doc((38, 0)), task(4, 1), doc((2, 0), (3, 1)),
        doc((20, 0), (10, 1), (20, 0), (10, 1)), task(3, 1), doc((5, 0), (1, 1)), task(2, 1),
        doc((44, 0), (2, 1)), doc((36, 0), (6, 8)), task(3, 2), doc((2, 0), (2, 1)),
    )  # fmt: skip

    # Microbatches of 2 over local batches of 6 and 4 (update 1) and of 5
    # each (update 2: 2 + 2 + a partial 1).
    partial = tuple(task(rng.randrange(1, 40), rng.randrange(1, 6)) for _ in range(20))

    def given(first: float, *segments: tuple[int, float]) -> GateDoc:
        # As doc(), but the first token keeps the weight it is given.
        weights = [first] + [w for n, w in segments for _ in range(n)]
        return GateDoc(tuple(rng.randrange(1, vocab) for _ in weights), tuple(weights))

    # Every document's first token weighs something; in microbatches of 3 the
    # first token of each packed document follows another document's last.
    first_weights = tuple(
        given(w, (p, 0.0), (a, aw))
        for w, p, a, aw in [(5.0, 6, 3, 8.0), (8.0, 20, 4, 8.0), (1.0, 3, 2, 1.0), (8.0, 11, 6, 8.0), (5.0, 2, 1, 8.0),
                            (1.0, 30, 2, 1.0), (8.0, 9, 9, 8.0), (2.0, 4, 3, 1.0), (8.0, 15, 2, 8.0), (1.0, 5, 5, 1.0),
                            (5.0, 25, 3, 8.0), (8.0, 7, 1, 1.0)]
    )  # fmt: skip
    # One-token documents (no target; some with a first weight) side by side,
    # packed with longer ones: sorted, rank 0's first row is six of them
    # (no target at all) and its second the longest document; rank 1's one
    # row starts with two of them.
    one_token = tuple(
        [given(8.0), doc((1, 0)), given(1.0), task(5, 3), doc((1, 0)), task(12, 4)]
        + [given(5.0), given(8.0), task(3, 2), doc((1, 0)), doc((1, 0)), task(20, 6)]
    )  # fmt: skip
    # Microbatches of one document: the packed row is the document alone.
    single = tuple(task(p, a) for p, a in [(9, 3), (30, 5), (2, 1), (14, 2), (40, 8), (5, 4), (22, 6), (1, 1)])

    return [
        Case("unequal-lengths", unequal, two_batches_of_8, 2, grad_clip),
        Case("weights-on-one-rank", concentrated(0), mixed, 2, grad_clip),
        Case("weights-on-the-other-rank", concentrated(1), mixed, 2, grad_clip),
        Case("prompt-and-padding-masks", masks, two_batches_of_8, 2, grad_clip),
        Case("partial-final-microbatch", partial, (tuple(range(10)), tuple(range(10, 20))), 2, grad_clip),
        # A clip that binds: the clipping path of both sides, whatever the preset says.
        Case("clipped-gradient", unequal, two_batches_of_8, 3, 0.05),
        Case("nonzero-first-weight", first_weights, (tuple(range(12)), tuple(range(12))[::-1]), 3, grad_clip),
        Case("adjacent-one-token-documents", one_token, (tuple(range(12)), tuple(range(6, 12)) + tuple(range(6))), 6, grad_clip),
        Case("one-document-microbatch", single, (tuple(range(8)), tuple(range(8))[::-1]), 1, grad_clip),
    ]


# --- the two sides -----------------------------------------------------------


def gate_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = LlamaForCausalLM(LlamaConfig(**GATE_MODEL))
    return objective.Precision.of(PRECISION).cast(lm)


def gate_config(cfg: Config) -> Config:
    """The preset with what the gate fixes: float64 and gloo."""
    raw = config_mod.apply_overrides(cfg.model_dump(mode="json"), [f"train.precision={PRECISION}", "distributed.backend=gloo"])
    return config_mod.from_dict(raw)


def _snapshot(lm: torch.nn.Module, optimizer: torch.optim.Optimizer, result: update.UpdateResult) -> dict[str, Any]:
    params = dict(lm.named_parameters())
    state = {name: optimizer.state[p] for name, p in params.items()}
    return {
        "param": {n: p.detach().clone() for n, p in params.items()},
        "exp_avg": {n: s["exp_avg"].clone() for n, s in state.items()},
        "exp_avg_sq": {n: s["exp_avg_sq"].clone() for n, s in state.items()},
        "loss": result.loss,
        "grad_norm": result.grad_norm,
    }


def _batched_side(case: Case, cfg: Config, ctx: distributed.DistContext) -> list[dict[str, Any]]:
    lm = gate_model(cfg.model.init_seed)
    net, counter = distributed.wrap_model(objective.WeightedNLL(lm), cfg, ctx, powersgd=False)
    optimizer = update.build_optimizer(lm.parameters(), cfg.train)
    scheduler = update.build_scheduler(optimizer, cfg.train.warmup_updates)
    precision = objective.Precision.of(cfg.train.precision)
    snapshots = []
    for row in case.schedule:
        result = update.worker_update(
            net, optimizer, scheduler, case.documents, row, ctx,
            microbatch=case.microbatch, precision=precision, grad_clip=case.grad_clip, counter=counter,
        )
        snapshots.append(_snapshot(lm, optimizer, result))
    return snapshots


def _reference_side(case: Case, cfg: Config) -> list[dict[str, Any]]:
    lm = gate_model(cfg.model.init_seed)
    optimizer = update.build_optimizer(lm.parameters(), cfg.train, implementation=update.PER_TENSOR)
    scheduler = update.build_scheduler(optimizer, cfg.train.warmup_updates)
    snapshots = []
    for row in case.schedule:
        docs = [case.documents[i] for i in row]
        total = batching.total_weight(case.documents, row)
        result = update.reference_update(
            lm, optimizer, scheduler, docs, total, precision=objective.Precision.of(cfg.train.precision), grad_clip=case.grad_clip
        )
        snapshots.append(_snapshot(lm, optimizer, result))
    return snapshots


def _rank_file(folder: str | Path, rank: int) -> Path:
    """Where a gate rank leaves its updates for the comparison."""
    return Path(folder) / f"rank{rank}.pt"


def _rank_main(
    rank: int, cfg: Config, cases: list[Case], port: int, out_dir: str, rank_setup: Callable[[], None] | None
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    if rank_setup is not None:
        rank_setup()
    with distributed.session(cfg) as ctx:
        results = {case.name: _batched_side(case, cfg, ctx) for case in cases}
    torch.save(results, _rank_file(out_dir, rank))


# --- comparison --------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One case, one update, one rank: the worst relative error of each quantity."""

    case: str
    update: int
    rank: int
    errors: dict[str, float]
    """param, exp_avg, exp_avg_sq, loss, grad_norm -> worst relative error."""
    worst: dict[str, str]
    """The same keys -> which tensor (or value) was worst, with both values for scalars."""

    @property
    def passed(self) -> bool:
        return all(e <= TOLERANCE for e in self.errors.values())


@dataclass(frozen=True)
class GateResult:
    rows: list[Row]
    seconds: float
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def max_rel_error(self) -> float:
        return max(e for row in self.rows for e in row.errors.values())


def _rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a_t, b_t = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = float(b_t.abs().max())
    diff = float((a_t - b_t).abs().max())
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def _compare(case: str, update_no: int, rank: int, got: dict[str, Any], want: dict[str, Any]) -> Row:
    errors: dict[str, float] = {}
    worst: dict[str, str] = {}
    for kind in TENSORS:
        per_tensor = {name: _rel(got[kind][name], want[kind][name]) for name in want[kind]}
        name = max(per_tensor, key=per_tensor.__getitem__)
        errors[kind], worst[kind] = per_tensor[name], name
    for kind in SCALARS:
        errors[kind] = _rel(got[kind], want[kind])
        worst[kind] = f"batched {got[kind]:.12g}, reference {want[kind]:.12g}"
    return Row(case, update_no, rank, errors, worst)


def _failure(row: Row) -> list[str]:
    out = []
    for kind, err in row.errors.items():
        if err > TOLERANCE:
            what = f"{kind} {row.worst[kind]}" if kind in TENSORS else f"{kind} ({row.worst[kind]})"
            out.append(
                f"case {row.case!r}, update {row.update}, rank {row.rank}: {what} differs by "
                f"{err:.3g} relative (tolerance {TOLERANCE:g})"
            )
    return out


def run_gate(cfg: Config, *, rank_setup: Callable[[], None] | None = None) -> GateResult:
    """Run every case on two gloo ranks and in one reference process; compare.

    `rank_setup`, when given, runs first in each rank process (a picklable
    function): tests use it to break the objective on purpose.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    start = time.perf_counter()
    cfg = gate_config(cfg)
    cases = gate_cases(cfg.train.grad_clip)
    with tempfile.TemporaryDirectory(prefix="coopstudy-gate-") as tmp:
        before = set(multiprocessing.active_children())
        try:
            ranks = mp.start_processes(
                _rank_main,
                args=(cfg, cases, workspace.free_port(), tmp, rank_setup),
                nprocs=WORLD_SIZE,
                join=False,
                start_method="spawn",
            )
            # The reference runs here while the ranks start and compute.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                reference = {case.name: _reference_side(case, cfg) for case in cases}
            finally:
                torch.set_num_threads(threads)
            try:
                while not ranks.join():
                    pass
            except mp.ProcessRaisedException as err:
                last = [line for line in str(err).strip().splitlines() if line.strip()][-1]
                raise GateFailed(f"a gate rank failed: {last}") from None
            except mp.ProcessExitedException as err:
                raise GateFailed(f"a gate rank died: {err}") from None
        finally:
            # Stopped here (a SIGTERM reaches this process alone), even while
            # they start, the ranks would compute on with their folder gone.
            _stop([p for p in multiprocessing.active_children() if p not in before])
        batched = [torch.load(_rank_file(tmp, r)) for r in range(WORLD_SIZE)]

    _refuse_a_diverged_reference(cases, reference, cfg)
    rows = [
        _compare(case.name, k + 1, rank, batched[rank][case.name][k], reference[case.name][k])
        for case in cases
        for k in range(len(case.schedule))
        for rank in range(WORLD_SIZE)
    ]
    failures = [msg for row in rows for msg in _failure(row)]
    return GateResult(rows=rows, seconds=time.perf_counter() - start, failures=failures)


def _stop(processes: Sequence[Any]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()


def _refuse_a_diverged_reference(cases: Sequence[Any], reference: dict[str, list[dict[str, Any]]], cfg: Config) -> None:
    """Where the reference itself left numbers that are not finite (a learning rate that
    diverges), the comparison says nothing of the numerics: said as training
    says it, not as a gate that failed by inf."""
    for case in cases:
        for k, want in enumerate(reference[case.name], start=1):
            scalars = [(kind, want[kind]) for kind in SCALARS if not math.isfinite(want[kind])]
            tensors = [(f"{kind} {name}", "not finite") for kind in TENSORS
                       for name, t in want[kind].items() if not bool(torch.isfinite(t).all())]  # fmt: skip
            if scalars or tensors:
                what, value = (scalars or tensors)[0]
                raise UserError(
                    f"the gate's updates diverged (case {case.name!r}, update {k}: {what} {value}) at learning rate "
                    f"train.lr={cfg.train.lr:g}; try a lower learning rate"
                )


def case_summary(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Worst error per (case, update) over ranks, for a table."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        entry = out.setdefault((row.case, row.update), {"case": row.case, "update": row.update, "passed": True})
        entry["passed"] &= row.passed
        for kind, err in row.errors.items():
            entry[kind] = max(entry.get(kind, 0.0), err)
    return list(out.values())
