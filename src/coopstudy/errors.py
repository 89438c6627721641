"""Errors a user can fix. The CLI prints them as one line and exits 2; any
other exception is a bug and keeps its traceback."""

import errno

INTERRUPTED = "interrupted (SIGINT)"
"""How a stop by Ctrl-C is told (its KeyboardInterrupt says nothing)."""
NCCL_WITHOUT_CUDA = "distributed.backend: nccl needs CUDA, and this machine has none; use gloo or auto"
"""Said by the stage before it starts ranks on this host, and by a rank started elsewhere."""


class UserError(Exception):
    """Bad input, a missing prerequisite or a refused action: `reason`, then
    the `hint` (what to run about it) where there is one, as one line. Kept
    apart because a study that runs that very command says the reason alone."""

    def __init__(self, reason: str, *, hint: str | None = None) -> None:
        super().__init__(reason if hint is None else f"{reason}; {hint}")
        self.reason = reason
        self.hint = hint


class ConfigError(UserError):
    """A preset or override that does not validate."""


class RefusedError(UserError):
    """A stage refused to run: a commitment it depends on is missing or changed."""


class Stopped(Exception):
    """The process was asked to stop (SIGTERM): the launcher stops every rank
    once one has failed, and the stage stops its processes when it is stopped."""


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
"""A full disk is the machine's state, not a defect: said in one line. What
was being written went to a temporary name and was never taken for valid."""
IN_THE_WAY = (errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS)
"""A path in the way (a folder where a file belongs, a file where a folder
does, no permission, a read-only disk) is the user's to move: said in one line."""

MACHINE_FAULT = (errno.EIO, errno.ESTALE)
"""A disk or a network filesystem that failed under a read or write is the
machine's state, not a defect of the study: said in one line (a run that was
open keeps the traceback in its error.txt)."""


def os_error_said(err: OSError) -> str | None:
    """A full disk, a path in the way or a failed disk, in the words every process
    says it (the command line, a training rank); None for any other OSError."""
    if err.errno in FULL_DISK:
        where = f" writing {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}; free some space and run it again"
    if err.errno in IN_THE_WAY and err.filename:
        # A rename's target, not its temporary source.
        return f"{err.filename2 or err.filename}: {err.strerror}"
    if err.errno in MACHINE_FAULT and err.filename:
        return f"{err.filename}: {err.strerror} (the disk or the network filesystem under it failed; check it, then run it again)"
    return None


def chain(err: BaseException, outer: BaseException | None = None) -> list[BaseException]:
    """`err` and the errors it was raised from or while handling, outermost first,
    down to `outer` (the error being handled where `err` was raised: not its cause).
    MLflow wraps a requests error in an MlflowException without `from`, so the
    cause may be only on __context__; a stage's error may wrap what its process saw."""
    found: list[BaseException] = []
    seen: BaseException | None = err
    while seen is not None and seen is not outer:
        found.append(seen)
        seen = seen.__cause__ or seen.__context__
    return found


def first_line(err: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def labelled(err: BaseException, where: str = "") -> str:
    """`Type: [where: ]first line`: how a process's error is told on the run."""
    message = (str(err).strip().splitlines() or [""])[0]
    return ": ".join(part for part in (type(err).__name__, where, message) if part)
