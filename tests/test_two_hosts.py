"""The compressed arm across two hosts, proved on one machine: two network
namespaces joined by a veth pair stand for two hosts, each with its own
address and nothing else in common but the filesystem (the SQLite tracking
store and the workspace) -- each namespace has its own loopback, so the ranks
meet only over the veth, at the first host's address.

Each host's node is started by hand, as on hosts without ssh between them,
through the study's own `train` stage: `--nodes 2 --node-rank K --master-addr
ADDR0 --master-port P`; node 0 opens the arm's run and prints the command for
node 1 with its --run-id; node 1 runs from its own copy of the study folder.
The run's losses must be those of the one-host run of the same arm, and the
run is selected and evaluated like any other.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from fixtures import ROOT, run_cli

from coopstudy import config, workspace
from coopstudy.record import schema

pytestmark = pytest.mark.slow

ADDRESSES = ("10.231.0.1", "10.231.0.2")
"""Private addresses that exist only inside the two namespaces."""
RANK_TIMEOUT_S = 300
LATE_S = 5.0
"""How long after node 0 printed it node 1's command is started."""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True)


@pytest.fixture(scope="session")
def namespaces_allowed() -> None:
    """Skip, saying why, where this machine cannot make network namespaces
    (checked before the expensive fixtures: session scope sets up first)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (Debian: apt-get install -y iproute2)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    name = f"coopcheck{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"this machine does not allow network namespaces: `ip netns add` says {err.stderr.strip()!r}")
    _ip("netns", "del", name)


@dataclass(frozen=True)
class Hosts:
    namespaces: tuple[str, str]
    devices: tuple[str, str]
    """The veth end inside each namespace: gloo must use it (GLOO_SOCKET_IFNAME), as the
    machine's hostname resolves to an address neither namespace has."""


def _remove(names: tuple[str, str], devices: tuple[str, str]) -> None:
    for ns in names:
        with contextlib.suppress(subprocess.CalledProcessError):
            # Only processes this module started run in its namespaces.
            for pid in _ip("netns", "pids", ns).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", ns)
    # A veth left in the root namespace by a half-finished set-up (deleting a
    # namespace deletes the veth inside it, and with it its peer).
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("link", "del", devices[0])


@pytest.fixture(scope="module")
def two_hosts(namespaces_allowed) -> Hosts:
    tag = os.getpid()
    names = (f"coop{tag}a", f"coop{tag}b")
    devices = (f"cv{tag}a", f"cv{tag}b")  # interface names hold 15 characters
    steps = [
        ("netns", "add", names[0]),
        ("netns", "add", names[1]),
        ("link", "add", devices[0], "type", "veth", "peer", "name", devices[1]),
    ]
    for ns, dev, addr in zip(names, devices, ADDRESSES):
        steps += [
            ("link", "set", dev, "netns", ns),
            ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
            ("-n", ns, "link", "set", dev, "up"),
            ("-n", ns, "link", "set", "lo", "up"),
        ]
    try:
        for step in steps:
            _ip(*step)
    except subprocess.CalledProcessError as err:
        _remove(names, devices)
        pytest.skip(f"cannot join two namespaces with a veth pair: `ip {' '.join(err.cmd[1:])}` says {err.stderr.strip()!r}")
    try:
        yield Hosts(names, devices)
    finally:
        _remove(names, devices)


@dataclass(frozen=True)
class Planned:
    home: Path
    db: Path
    one_host_losses: list[float]
    """The compressed arm's losses, trained on one host by `coopstudy train`
    (in the session's trained store: an arm trains once per plan)."""

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.db}"

    def env(self, home: Path | None = None, **extra: str) -> dict[str, str]:
        return {"MLFLOW_TRACKING_URI": self.uri, "COOPSTUDY_HOME": str(home or self.home), **extra}


@pytest.fixture(scope="module")
def planned(planned_tiny_store, trained_tiny_store, tmp_path_factory) -> Planned:
    copied = planned_tiny_store.copy(tmp_path_factory.mktemp("two-hosts"))
    done = run_cli("train", "--arm", "control", "--preset", "tiny", env=copied.env())
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(trained_tiny_store.tracking_uri)
    exp = client.get_experiment_by_name("coopstudy")
    (run,) = client.search_runs(
        [exp.experiment_id], f"tags.`{schema.TAG_STAGE}` = 'train' and tags.`{schema.TAG_ARM}` = 'compressed' and attributes.status = 'FINISHED'"
    )
    return Planned(copied.home, copied.db, _losses(client, run.info.run_id))


def _losses(client: mlflow.MlflowClient, run_id: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, schema.M_LOSS), key=lambda m: m.step)]


def _in_namespace(ns: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv], env={**os.environ, **env}, cwd=ROOT,
            stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip


def _join_command(node0: subprocess.Popen, log: Path) -> list[str]:
    """The command node 0 prints for node 1, once it has opened the run."""
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("train compressed: on node 1 run: "):
                return shlex.split(line.removeprefix("train compressed: on node 1 run: "))
        assert node0.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"node 0 printed no command for node 1: {log.read_text()[-3000:]}")


def test_compressed_arm_started_node_by_node_is_the_record_selected_and_evaluated(two_hosts, planned, tmp_path):
    """`coopstudy train --nodes 2 --node-rank K` on each host, by hand: node 0
    opens the arm's run and prints node 1's command (with --run-id); node 1,
    with a copy of the workspace as another host would have, joins it. The
    run is the study's record: select takes it, evaluate scores it."""
    cfg = config.load("tiny")
    client = mlflow.MlflowClient(planned.uri)
    # The second host: its own copy of the study folder (prepared inputs, gate
    # receipt, ledger), the same tracking store.
    home_b = tmp_path / "host-b-home"
    shutil.copytree(planned.home, home_b, ignore=shutil.ignore_patterns("locks", "checkpoints", "outbox"))
    port = str(workspace.free_port())
    node0_argv = [
        sys.executable, "-m", "coopstudy", "train", "--preset", "tiny", "--arm", "compressed",
        "--nodes", "2", "--node-rank", "0", "--master-addr", ADDRESSES[0], "--master-port", port,
    ]  # fmt: skip
    logs = [tmp_path / "host0.log", tmp_path / "host1.log"]
    procs = []
    try:
        procs.append(_in_namespace(two_hosts.namespaces[0], node0_argv, planned.env(GLOO_SOCKET_IFNAME=two_hosts.devices[0]), logs[0]))
        joined = _join_command(procs[0], logs[0])
        assert joined[:4] == ["python", "-m", "coopstudy", "train"], joined
        run_id = joined[joined.index("--run-id") + 1]
        node1_argv = [sys.executable, *joined[1:]]
        time.sleep(LATE_S)  # a person reads the command, then types it on the other host
        procs.append(_in_namespace(two_hosts.namespaces[1], node1_argv, planned.env(home_b, GLOO_SOCKET_IFNAME=two_hosts.devices[1]), logs[1]))
        codes = [p.wait(timeout=RANK_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    said = {n: log.read_text()[-3000:] for n, log in enumerate(logs)}
    assert codes == [0, 0], said
    assert f"train compressed: node 1 of 2 (ranks 1-1 of 2), rendezvous {ADDRESSES[0]}:{port}, run {run_id}" in said[1]
    assert f"train compressed: node 1 finished; node 0 ends run {run_id}" in said[1]

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "train-compressed-tiny"
    assert run.data.tags[schema.TAG_CHECKPOINT_PATH] == str(planned.home / "checkpoints" / run_id)  # rank 0, node 0
    # Each node says it runs one of the two ranks: neither can know the other
    # shares this machine, so neither pins its rank to a core.
    summary = json.loads(Path(client.download_artifacts(run_id, schema.ART_TRAIN_SUMMARY, str(tmp_path))).read_text())
    assert summary["cores_by_rank"] == [None, None]
    # Node 0's rank waited for node 1 inside the complete seconds, and the record says how long.
    waited = run.data.metrics[schema.M_RENDEZVOUS_SECONDS]
    assert waited == summary["rendezvous_seconds"] and LATE_S <= waited < run.data.metrics[schema.M_COMPLETE_SECONDS]
    two = _losses(client, run_id)
    one = planned.one_host_losses
    assert len(two) == len(one) == cfg.train.updates, (one, two)
    for k, (a, b) in enumerate(zip(one, two), start=1):
        assert abs(a - b) <= 1e-6 * abs(a), (k, a, b)

    # The record like any other: select takes it (the arm's one finished run
    # under the plan), evaluate scores its weights.
    env = planned.env()
    selected = run_cli("select", "--preset", "tiny", env=env)
    assert selected.returncode == 0, selected.stderr[-3000:]
    exp = client.get_experiment_by_name("coopstudy").experiment_id
    (select_run,) = client.search_runs([exp], f"tags.`{schema.TAG_STAGE}` = 'select' and attributes.status = 'FINISHED'")
    assert select_run.data.tags[schema.TAG_CANDIDATE_RUN_PREFIX + "compressed"] == run_id
    evaluated = run_cli("evaluate", "--preset", "tiny", env=env)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (scored,) = client.search_runs([exp], f"tags.`{schema.TAG_MODEL}` = 'compressed' and attributes.status = 'FINISHED'")
    assert scored.data.tags[schema.TAG_CHECKPOINT_SHA] == run.data.tags[schema.TAG_CHECKPOINT_SHA]
    assert schema.M_ACCURACY in scored.data.metrics
