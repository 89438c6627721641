"""distributed.py on two real gloo ranks: PowerSGD's dense-to-compressed switch
under gradient accumulation, error feedback precision, one bucket, the byte
count against what the ranks really hand to all-reduce, the hook's timing,
the cores each rank and its threads are pinned to, and the project's
PowerSGD hook against torch's: bit for bit with torch's kernels for P and Q,
to fp32 rounding with oneDNN's (the training default on CPU)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from coopstudy import config
from coopstudy.errors import ConfigError, UserError
from coopstudy.numerics import distributed, objective, update
from coopstudy.numerics.gate import GateDoc
from coopstudy.record import schema

DENSE_UPDATES = 2
UPDATES = 5
RANK = 4
MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL, tie_word_embeddings=True))


def _documents():
    rng = random.Random(5)
    docs = []
    for _ in range(8):
        n = rng.randrange(8, 40)
        docs.append(GateDoc(tuple(rng.randrange(1, 512) for _ in range(n)), (0.0,) * (n - 4) + (8.0,) * 4))
    return docs


def _train(cfg, ctx, measured: list[int], buckets: set[int]) -> dict:
    precision = objective.Precision.of("bf16")
    lm = precision.cast(_model())
    net, counter = distributed.wrap_model(objective.WeightedNLL(lm), cfg, ctx)
    optimizer = update.build_optimizer(lm.parameters(), cfg.train)
    scheduler = update.build_scheduler(optimizer, cfg.train.warmup_updates)
    docs = _documents()
    rows = []
    for _ in range(UPDATES):
        measured.clear()
        # Local batch 4 in microbatches of 2: every update accumulates over
        # two backward passes, only the second of which synchronizes.
        result = update.worker_update(net, optimizer, scheduler, docs, range(8), ctx, microbatch=2, precision=precision, counter=counter)
        rows.append(
            {
                "phase": result.comm.phase,
                "gradient_bytes": result.comm.gradient_bytes,
                "scalar_bytes": result.comm.scalar_bytes,
                "counted": result.comm.total,
                "measured": sum(measured),
                "iter": counter.powersgd.iter,
                "error_dtypes": sorted({str(e.dtype) for e in counter.powersgd.error_dict.values()}),
                "loss": result.loss,
                "hook_seconds": result.comm.hook_seconds,
                "communication": result.times.communication,
                "arithmetic": result.times.communication_arithmetic,
                "forward_backward": result.times.forward_backward,
                "seconds": result.seconds,
                "times_total": result.times.total,
            }
        )
    totals = counter.totals()
    return {
        "rows": rows,
        "totals": {"dense": totals.dense, "compressed": totals.compressed, "scalar": totals.scalar, "setup": totals.setup},
        "buckets": sorted(buckets),
        "param_sum": float(sum(p.double().sum() for p in lm.parameters())),
        "param_sha256": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in lm.parameters())).hexdigest(),
        "_params": torch.cat([p.detach().flatten() for p in lm.parameters()]),
        "error_sha256": hashlib.sha256(b"".join(e.numpy().tobytes() for e in counter.powersgd.error_dict.values())).hexdigest(),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in lm.parameters()}),
        "shapes": {n: list(p.shape) for n, p in lm.named_parameters()},
        "sum": distributed.all_reduce_sums([float(ctx.rank + 1)])[0],
    }


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    cfg = config.load("tiny", [f"powersgd.rank={RANK}", f"powersgd.dense_updates={DENSE_UPDATES}", "train.precision=bf16"])
    # What each rank really hands to all-reduce, whoever calls it (the DDP
    # hooks and the scalar sums look the function up on the module).
    measured: list[int] = []
    real_all_reduce = torch.distributed.all_reduce

    def tally(tensor, *args, **kwargs):
        measured.append(tensor.numel() * tensor.element_size())
        return real_all_reduce(tensor, *args, **kwargs)

    torch.distributed.all_reduce = tally
    buckets: set[int] = set()
    real_hook = distributed._counting_hook

    def spy(counter, bucket):
        buckets.add(bucket.index())
        return real_hook(counter, bucket)

    distributed._counting_hook = spy
    with distributed.session(cfg) as ctx:
        # Everything that holds the process group (DDP, its hook state) is
        # dropped inside _train, before the group is destroyed.
        result = _train(cfg, ctx, measured, buckets)
        # The same training with torch's own hook in place of the project's.
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        ours = distributed.powersgd_hook
        # torch's hook takes no clock for its arithmetic.
        distributed.powersgd_hook = lambda state, bucket, arithmetic: powerSGD_hook(state, bucket)
        try:
            result["torch_hook"] = _train(cfg, ctx, measured, set())
            # The project's hook with torch's kernels for P and Q.
            distributed.powersgd_hook = lambda state, bucket, arithmetic: ours(state, bucket, arithmetic, distributed.BMM)
            result["bmm_hook"] = _train(cfg, ctx, measured, set())
        finally:
            distributed.powersgd_hook = ours
        result["cores"] = ctx.cores
        # Every thread of the rank (gloo's included), by the kernel's account.
        result["thread_cores"] = sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})
        result["params"] = [p.tolist() for p in (result.pop("_params"), result["torch_hook"].pop("_params"))]
        result["bmm_hook"].pop("_params")
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(out)), nprocs=2, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_compression_starts_exactly_at_update_dense_updates_plus_one(two_ranks):
    for result in two_ranks:
        phases = [row["phase"] for row in result["rows"]]
        assert phases == ["dense"] * DENSE_UPDATES + ["compressed"] * (UPDATES - DENSE_UPDATES)
        # The hook's counter counts updates, not the 2 microbatches of each
        # update: no hook runs under no_sync.
        assert [row["iter"] for row in result["rows"]] == list(range(1, UPDATES + 1))


def test_error_feedback_is_fp32_under_bf16_autocast(two_ranks):
    for result in two_ranks:
        assert result["grad_dtypes"] == ["torch.float32"]
        rows = result["rows"]
        assert all(row["error_dtypes"] == [] for row in rows[:DENSE_UPDATES])
        assert all(row["error_dtypes"] == ["torch.float32"] for row in rows[DENSE_UPDATES:])


def test_one_bucket_on_gloo_and_the_ranks_stay_identical(two_ranks):
    assert two_ranks[0]["buckets"] == two_ranks[1]["buckets"] == [0]
    # Compressed updates keep every replica equal (all ranks apply the same
    # decompressed gradient), and the logged loss is the same global number.
    assert two_ranks[0]["param_sum"] == two_ranks[1]["param_sum"]
    assert [r["loss"] for r in two_ranks[0]["rows"]] == [r["loss"] for r in two_ranks[1]["rows"]]
    assert two_ranks[0]["sum"] == two_ranks[1]["sum"] == 3.0


def test_the_projects_powersgd_hook_is_torchs_bit_for_bit(two_ranks):
    # Kept buffers instead of fresh ones change no number: with torch's
    # kernels for P and Q, weights, error feedback and losses after dense and
    # compressed updates are identical.
    for result in two_ranks:
        theirs, ours = result["torch_hook"], result["bmm_hook"]
        assert ours["param_sha256"] == theirs["param_sha256"]
        assert ours["error_sha256"] == theirs["error_sha256"]
        assert [r["loss"] for r in ours["rows"]] == [r["loss"] for r in theirs["rows"]]
        assert [r["phase"] for r in ours["rows"]] == [r["phase"] for r in theirs["rows"]]


def test_onednn_products_round_differently_and_train_the_same_weights(two_ranks):
    # The training default on CPU: P and Q through oneDNN. The weights after
    # three compressed updates are torch's to fp32 rounding, not bit for bit.
    assert distributed._low_rank_products(torch.zeros(2)) == distributed.ONEDNN
    assert distributed._low_rank_products(torch.zeros(2, dtype=torch.float64)) == distributed.BMM
    for result in two_ranks:
        ours, theirs = (torch.tensor(p) for p in result["params"])
        assert result["param_sha256"] != result["torch_hook"]["param_sha256"]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
        assert [r["phase"] for r in result["rows"]] == [r["phase"] for r in result["torch_hook"]["rows"]]


@pytest.mark.parametrize("n, m", [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 576)])
def test_onednn_products_are_the_bmm_products_to_fp32_rounding(n, m):
    torch.manual_seed(n + m)
    a, q, p = torch.randn(1, n, m), torch.randn(1, m, 32), torch.randn(1, n, 32)
    for product, factor, shape, reference in (
        (distributed._project, q, (1, n, 32), torch.bmm(a, q)),
        (distributed._project_back, p, (1, m, 32), torch.bmm(a.transpose(1, 2), p)),
    ):
        out = torch.empty(shape)
        product(a, factor, out, distributed.ONEDNN)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


def test_the_hook_is_timed_and_the_update_seconds_add_up(two_ranks):
    for result in two_ranks:
        for row in result["rows"]:
            assert 0 < row["hook_seconds"] == row["communication"] < row["seconds"]
            # PowerSGD's own arithmetic is a part of the hook's seconds; a dense all-reduce has none.
            if row["phase"] == schema.PHASE_COMPRESSED:
                assert 0 < row["arithmetic"] < row["hook_seconds"]
            else:
                assert row["arithmetic"] == 0.0
            assert row["forward_backward"] > 0
            assert row["times_total"] == pytest.approx(row["seconds"], rel=1e-9)


def _analytic(shapes: dict[str, list[int]]) -> tuple[int, int]:
    """fp32 bytes per update: dense, and compressed at RANK with the study's
    rule (a matrix is sent as rank-r factors when they are smaller)."""
    dense = compressed = 0
    for shape in shapes.values():
        numel = 1
        for s in shape:
            numel *= s
        dense += numel
        if len(shape) == 2:
            n, m = shape
            assert (n + m) * RANK < n * m, f"expected every weight matrix to be compressed, {shape} is not"
            compressed += (n + m) * RANK
        else:
            compressed += numel
    return 4 * dense, 4 * compressed


def test_bytes_counted_match_the_payload_handed_to_all_reduce_and_the_analytic_size(two_ranks):
    for result in two_ranks:
        dense, compressed = _analytic(result["shapes"])
        for row in result["rows"]:
            assert row["counted"] == row["measured"]
            assert row["scalar_bytes"] == 16  # loss and tokens, two float64
            assert row["gradient_bytes"] == (dense if row["phase"] == "dense" else compressed)
        assert result["totals"]["dense"] == DENSE_UPDATES * dense
        assert result["totals"]["compressed"] == (UPDATES - DENSE_UPDATES) * compressed
        assert result["totals"]["setup"] >= dense


def test_each_rank_and_every_thread_it_starts_run_on_a_core_of_its_own(two_ranks):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    assert [r["cores"] for r in two_ranks] == [[cores[0]], [cores[1]]]
    assert [r["thread_cores"] for r in two_ranks] == [[[cores[0]]], [[cores[1]]]]


@pytest.mark.parametrize(
    ("launcher_env", "overrides", "pinned"),
    [
        ({"LOCAL_SIZE": "2"}, [], True),  # DeepSpeed's launcher, both ranks here
        ({"LOCAL_WORLD_SIZE": "2"}, [], True),  # torchrun's
        ({"LOCAL_WORLD_SIZE": "2"}, ["distributed.pin_cores=false"], False),
        ({"LOCAL_SIZE": "1"}, [], False),  # a node started by itself: the other may share the host
        ({}, [], False),  # a launcher that does not say
    ],
)
def test_ranks_are_pinned_only_when_all_run_here_and_the_config_asks(monkeypatch, launcher_env, overrides, pinned):
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    rank_env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in (rank_env | launcher_env).items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(distributed.machine, "pin_rank", lambda *args: calls.append(args) or (7,))
    # Only the decision is under test here: no process group is joined.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    ctx = distributed.init(config.load("tiny", overrides))
    assert calls == ([(1, 2, 1)] if pinned else [])
    assert ctx.cores == ((7,) if pinned else None)


def test_a_rank_cannot_be_pinned_to_more_cores_than_the_process_may_use():
    code = (
        "import os; from coopstudy import machine; before = os.sched_getaffinity(0);"
        "print(machine.pin_rank(0, len(before) + 1, 1), os.sched_getaffinity(0) == before)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["None", "True"]


def test_compression_plan_follows_the_hooks_rule():
    plans = distributed.compression_plan([(576, 576), (192, 576), (576,), (8, 8)], rank=32)
    assert [p.compressed for p in plans] == [True, True, False, False]
    assert [p.elements for p in plans] == [(576 + 576) * 32, (192 + 576) * 32, 576, 64]


def test_one_process_without_launcher_environment_has_no_process_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    cfg = config.load("tiny")
    ctx = distributed.init(cfg)
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.distributed) == (0, 1, None, False)
    assert not torch.distributed.is_initialized()
    net = torch.nn.Linear(2, 2)
    assert distributed.wrap_model(net, cfg, ctx) == (net, None)
    assert distributed.all_reduce_sums([1.5, 2.0]) == [1.5, 2.0]


def test_a_rank_without_its_environment_is_a_user_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UserError, match="RANK is not set"):
        distributed.init(config.load("tiny"))


def test_fewer_than_two_dense_updates_are_refused_when_the_config_loads():
    # torch refuses start_powerSGD_iter <= 1 with error feedback or warm start.
    with pytest.raises(ConfigError, match="powersgd.dense_updates"):
        config.load("tiny", ["powersgd.dense_updates=1"])