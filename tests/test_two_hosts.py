"""The compressed arm across two hosts, proved on one machine: two network
namespaces joined by a veth pair stand for two hosts, each with its own
address and nothing else in common but the filesystem (the SQLite tracking
store and the workspace) -- each namespace has its own loopback, so the ranks
meet only over the veth, at the first host's address.

Each host's rank is started by hand, as on hosts without ssh between them:
the DeepSpeed launcher with `--no_ssh --node_rank N --master_addr ADDR0` and a
hostfile naming both addresses, in front of exactly the worker command that
`launch.command` builds for a hostfile. Its losses must be those of the
one-host run of the same arm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from fixtures import ROOT, run_cli

from coopstudy import config
from coopstudy.record import schema
from coopstudy.run import launch

pytestmark = pytest.mark.slow

ADDRESSES = ("10.231.0.1", "10.231.0.2")
"""Private addresses that exist only inside the two namespaces."""
RANK_TIMEOUT_S = 300


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
    one_host_run: str
    """The compressed arm's run, trained on one host by `coopstudy train`."""

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.db}"


@pytest.fixture(scope="module")
def planned(probed_tiny_store, tmp_path_factory) -> Planned:
    copied = probed_tiny_store.copy(tmp_path_factory.mktemp("two-hosts"))
    home, db, env = copied.home, copied.db, copied.env()
    for step in (("plan",), ("train", "--arm", "compressed")):
        done = run_cli(*step, "--preset", "tiny", env=env)
        assert done.returncode == 0, (step, done.stderr[-3000:])
    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("coopstudy")
    (run,) = client.search_runs([exp.experiment_id], f"tags.`{schema.TAG_STAGE}` = 'train' and attributes.status = 'FINISHED'")
    return Planned(home, db, run.info.run_id)


def _losses(client: mlflow.MlflowClient, run_id: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, schema.M_LOSS), key=lambda m: m.step)]


def test_compressed_arm_across_two_hosts_matches_one_host(two_hosts, planned, tmp_path):
    cfg = config.load("tiny")
    client = mlflow.MlflowClient(planned.uri)
    run_id = client.create_run(client.get_experiment_by_name("coopstudy").experiment_id, run_name="train-compressed-tiny-two-hosts").info.run_id
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{addr} slots=1\n" for addr in ADDRESSES))
    # The command `coopstudy train --hostfile` runs, with what a host started by hand adds.
    deepspeed, *rest = launch.command(cfg, "compressed", run_id, hostfile=hostfile)
    procs = []
    try:
        for node_rank, (ns, dev) in enumerate(zip(two_hosts.namespaces, two_hosts.devices)):
            env = launch.worker_environment(cfg, run_id) | {
                "MLFLOW_TRACKING_URI": planned.uri,
                "COOPSTUDY_HOME": str(planned.home),
                "GLOO_SOCKET_IFNAME": dev,
            }
            cmd = ["ip", "netns", "exec", ns, deepspeed, "--no_ssh", "--node_rank", str(node_rank), "--master_addr", ADDRESSES[0], *rest]
            log = open(tmp_path / f"host{node_rank}.log", "w")
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        codes = [p.wait(timeout=RANK_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = {n: (tmp_path / f"host{n}.log").read_text()[-3000:] for n in (0, 1)}
    assert codes == [0, 0], logs
    two = _losses(client, run_id)
    one = _losses(client, planned.one_host_run)
    assert len(two) == len(one) == cfg.train.updates, (one, two)
    for k, (a, b) in enumerate(zip(one, two), start=1):
        assert abs(a - b) <= 1e-6 * abs(a), (k, a, b)
    assert schema.TAG_CHECKPOINT_SHA in client.get_run(run_id).data.tags
