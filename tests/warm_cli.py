"""`python -m coopstudy ARGS` started by forking a warm interpreter.

Most of the suite's commands are refusals that take a second of their own
after 2-3 s of importing MLflow, its SQLite store and the CLI. A server per
xdist worker imports those once; each command is a child forked from it that
runs `coopstudy.__main__` as `python -m` would (argv, sys.path, the
environment and folder it is given, its output in files, exit handlers and
exit code its own). It is still a process of its own, so its exit code,
stderr and what it leaves behind are what a user sees.

Only where that holds: the interpreter's own variables (PYTHON*, the
loader's and malloc's) are the server's, PYTHONPATH aside; no other command
of this worker is in flight; and the server imported silently, with no
thread of Python's running (a fork copies only the one that forks). A
command started in another folder or with another PYTHONPATH (a copy of the
checkout, say, whose sources a test edits) takes the sys.path a fresh
interpreter would have there, asked of one once per folder and PYTHONPATH;
the project's modules the server loaded are dropped first, so the child
imports them from wherever that path finds them. Where an entry that path
adds is no folder (a zip), or holds a startup hook (sitecustomize,
usercustomize) or a module of a name the server has loaded, the command
runs fresh. Anything else runs fresh, and COOPSTUDY_TEST_FRESH=1 runs every
command fresh (tests/test_front_door.py checks that both ways say the same).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What a refusal imports before it speaks (an open store included), then the
# libraries a command that does work imports (torch and transformers' model
# code alone take 5-7 s of a prepare, verify or evaluate). No more of the
# project's own modules than the CLI's: a test may change the project's
# sources, never a library's.
PRELOAD = (
    "coopstudy.cli", "coopstudy.config", "mlflow", "mlflow.store.tracking.sqlalchemy_store",
    "torch", "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "reasoning_gym",
)  # fmt: skip
# Read when an interpreter starts or a library loads, so the server's values
# hold in its children. Not torch's own: no test sets one, and the two a test's
# process comes to hold are read when CUDA or the compiler is used (deepspeed,
# once a test imports it, sets TORCHINDUCTOR_CACHE_DIR and PYTORCH_NVML_BASED_CUDA_CHECK).
_AT_START = ("PYTHON", "LANG", "LC_", "LD_", "MALLOC_", "GLIBC_", "TCMALLOC", "OMP_", "MKL_", "KMP_", "HF_", "TRANSFORMERS_")
OWN = ("coopstudy", "analysis")
"""The project's top-level packages: a child whose sys.path is another imports them again."""
_HOOKS = ("sitecustomize", "usercustomize")


def _at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_AT_START) and k != "PYTHONPATH"}


def _provides(folder: str) -> set[str] | None:
    """The top-level module names a sys.path entry makes importable: none for
    one that does not exist; None for one that is no folder (a zip), whose
    names this does not read."""
    if not os.path.exists(folder or "."):
        return set()
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return None
    return {n.split(".")[0] for n in names if n.endswith((".py", ".so", ".pyc")) or os.path.isdir(os.path.join(folder, n))}


class Server:
    """The warm interpreter of this worker, started on first use."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._busy = threading.Lock()
        self._pending = b""
        """Bytes read from the server past the last reply line."""
        self._usable = True
        self._loaded: set[str] = set()
        """Top-level modules the server imported."""
        self._path: list[str] = []
        """The server's sys.path."""
        self._paths: dict[tuple[str, str | None], list[str] | None] = {}
        """sys.path of `python -m` per folder and PYTHONPATH; None where no interpreter said it."""
        self.served = 0
        """Commands it ran."""

    def _start(self) -> bool:
        self._env = dict(os.environ)
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            cwd=ROOT, env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        )  # fmt: skip
        try:
            ready = self._reply(None)
        except (RuntimeError, ValueError):  # it failed as it started: every command runs fresh
            ready = None
        if not (ready and ready.get("ready")):
            self._proc.wait()
            self._usable = False
        else:
            self._loaded, self._path = set(ready["loaded"]), ready["path"]
        return self._usable

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess | None:
        """What the command did, or None where it must run fresh."""
        if os.environ.get("COOPSTUDY_TEST_FRESH") or not self._usable:
            return None
        if self._proc is None and not self._start():
            return None
        if _at_start(env) != _at_start(self._env):
            return None
        cwd = Path(cwd).resolve()
        path = self._fresh_path(env, cwd)
        if path is None or not self._busy.acquire(blocking=False):
            return None
        try:
            self.served += 1
            return self._run(argv, env, cwd, path, timeout)
        finally:
            self._busy.release()

    def _fresh_path(self, env: dict[str, str], cwd: Path) -> list[str] | None:
        """The sys.path `python -m` started in `cwd` under `env` has, or None
        where a fork could not stand for it (see the module docstring)."""
        key = (str(cwd), env.get("PYTHONPATH"))
        if key not in self._paths:
            try:
                asked = subprocess.run(
                    [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                    cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
                )  # fmt: skip
            except (subprocess.TimeoutExpired, OSError):
                return None  # asked again next time
            try:  # its last line: a startup hook may print before it
                self._paths[key] = [str(cwd), *json.loads(asked.stdout.splitlines()[-1])] if asked.returncode == 0 else None
            except (IndexError, ValueError):
                self._paths[key] = None
        path = self._paths[key]
        if path is None:
            return None
        # Read on every call: a test may put a hook or a module there after the first.
        shadowed = (self._loaded - set(OWN)) | set(_HOOKS)
        for entry in (p for p in path if p not in self._path):
            names = _provides(entry)
            if names is None or names & shadowed:
                return None
        return path

    def _run(self, argv: list[str], env: dict[str, str], cwd: Path, path: list[str], timeout: float) -> subprocess.CompletedProcess:
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        with tempfile.TemporaryDirectory(prefix="coopstudy-warm-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": argv, "env": env, "cwd": str(cwd), "path": path, "own": path != self._path,
                       "stdout": str(out), "stderr": str(err)}  # fmt: skip
            message = memoryview((json.dumps(request) + "\n").encode())
            while message:
                message = message[os.write(self._proc.stdin.fileno(), message) :]
            pid = self._reply(None)["pid"]
            ended = self._reply(timeout)
            timed_out = ended is None
            if timed_out:
                os.kill(pid, signal.SIGKILL)  # not reaped yet: the server replies once it has waited for it
                ended = self._reply(None)
            cmd = [sys.executable, "-m", "coopstudy", *argv]
            said = out.read_text(errors="replace"), err.read_text(errors="replace")
            if timed_out:
                raise subprocess.TimeoutExpired(cmd, timeout, *said)
            return subprocess.CompletedProcess(cmd, ended["returncode"], *said)

    def _reply(self, timeout: float | None) -> dict | None:
        """The server's next reply line; None if none came within `timeout` s."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the warm server ended")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)


def _serve() -> dict | None:
    """Import, then fork a child per request; return the request in the child."""
    from coopstudy import machine

    machine.set_library_defaults()  # as coopstudy.cli.entry does
    sys.path[0] = str(ROOT)  # as for `python -m` started there
    with tempfile.TemporaryFile() as said:
        saved = os.dup(1), os.dup(2)
        os.dup2(said.fileno(), 1)
        os.dup2(said.fileno(), 2)
        try:
            import importlib

            for name in PRELOAD:
                importlib.import_module(name)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)  # a child must hold no end of the reply pipe
        # A library that prints as it loads, or starts a thread, would not do
        # so in each command as it does in a fresh process: then none is warm.
        silent = said.seek(0, os.SEEK_END) == 0
    # A fork copies only the thread that forks: no Python thread may be running.
    # (The native pools numpy and pyarrow start as they load re-form in a
    # child, as under multiprocessing's fork.)
    ready = silent and threading.active_count() == 1
    # Out of the collections a command's exit makes: a fresh process holds none of it unless it imports it.
    gc.freeze()
    _reply({"ready": ready, "loaded": sorted({m.split(".")[0] for m in sys.modules}), "path": sys.path})
    if not ready:
        return None
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        _reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"returncode": os.waitstatus_to_exitcode(status)})
    return None


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _become(request: dict) -> None:
    """In the child: take the request's place, then run the CLI as `python -m coopstudy`."""
    import importlib
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, for its whole life
    if request["own"]:
        for name in [m for m in sys.modules if m.split(".")[0] in OWN]:
            del sys.modules[name]
    sys.path[:] = request["path"]
    importlib.invalidate_caches()
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module("coopstudy", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    found = _serve()
    if found is not None:
        _become(found)  # its SystemExit ends this process as the CLI's own would
