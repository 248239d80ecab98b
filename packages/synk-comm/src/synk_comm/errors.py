"""Exceptions of synk_comm.

Two kinds, as in nccl4py: mistakes in the call (``TypeError``/``ValueError``, raised in the
calling process before any other rank is asked to act) and failures of the group at run time
(:class:`WorkerError`, :class:`WorkerDiedError`, :class:`GroupBrokenError`).
"""

from __future__ import annotations

__all__ = ["WorkerError", "WorkerDiedError", "HostLostError", "GroupBrokenError", "GroupAborted", "RemoteError"]


class RemoteError:
    """An exception raised in another rank, as it travels (picklable)."""

    def __init__(self, rank: int, type_name: str, message: str, traceback: str, host: str | None = None) -> None:
        self.rank = rank
        self.type_name = type_name
        self.message = message
        self.traceback = traceback
        self.host = host
        """The host the rank runs on, where the group spans hosts (:mod:`synk_comm.net`); else None."""

    @property
    def where(self) -> str:
        """``rank 3`` or, on another host, ``rank 3 (host node1)``."""
        return f"rank {self.rank}" + (f" (host {self.host})" if getattr(self, "host", None) else "")

    def __repr__(self) -> str:
        return f"RemoteError({self.where}, {self.type_name}: {self.message})"


class WorkerError(RuntimeError):
    """A handler raised in one or more worker ranks; the group is still usable.

    Attributes
    ----------
    errors : list of RemoteError
        One per failing rank, with the rank, the exception type and the worker's traceback.
    """

    def __init__(self, errors: list[RemoteError]) -> None:
        self.errors = errors
        parts = [f"{e.where} raised {e.type_name}: {e.message}\n--- traceback in {e.where} ---\n"
                 f"{e.traceback.rstrip()}" for e in errors]
        super().__init__("\n".join(parts))

    @property
    def ranks(self) -> list[int]:
        return [e.rank for e in self.errors]

    def __reduce__(self) -> tuple[type, tuple[list[RemoteError]]]:
        return (type(self), (self.errors,))


class WorkerDiedError(RuntimeError):
    """A worker process ended without being asked to (crash, kill, OOM); the group is closed."""

    def __init__(self, rank: int, pid: int, returncode: int | None, detail: str = "") -> None:
        self.rank, self.pid, self.returncode = rank, pid, returncode
        self.detail = detail
        super().__init__(f"rank {rank} (pid {pid}) died: {describe_exit(returncode)}.{detail} The group "
                         "is closed; start a new one (synkhronos: call fork() again).")

    def __reduce__(self) -> tuple[type, tuple[int, int, int | None, str]]:
        return (type(self), (self.rank, self.pid, self.returncode, self.detail))


class HostLostError(WorkerDiedError):
    """A host of a group that spans hosts (:mod:`synk_comm.net`) stopped answering: its node agent
    died, or the network between the hosts failed.  The group is closed.

    Attributes
    ----------
    host : str
        The lost host's name.
    ranks : list of int
        The group ranks that ran there.
    """

    def __init__(self, host: str, ranks: list[int], detail: str = "") -> None:
        self.host, self.ranks = host, list(ranks)
        self.rank, self.pid, self.returncode, self.detail = (ranks[0] if ranks else -1), -1, None, detail
        RuntimeError.__init__(self, f"host {host} (ranks {_span(ranks)}) was lost: {detail} The group is closed; "
                              "start a new one (synkhronos: call fork() again once the host's launcher runs).")

    def __reduce__(self) -> tuple[type, tuple[str, list[int], str]]:  # type: ignore[override]
        return (type(self), (self.host, self.ranks, self.detail))


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else (str(ranks[0]) if ranks else "none")


class GroupBrokenError(RuntimeError):
    """The group can no longer be used (a rank died, or it was closed)."""


class GroupAborted(RuntimeError):
    """Raised inside a rank's code when another rank failed during the same command.

    The master turns it into the other rank's error; user code rarely sees it.
    """


def describe_exit(returncode: int | None) -> str:
    """``-9`` -> ``'killed by signal 9 (SIGKILL)'``."""
    import signal

    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        hint = "; out of memory?" if -returncode == signal.SIGKILL else ""
        return f"killed by signal {-returncode} ({name}{hint})"
    return f"exited with code {returncode}"
