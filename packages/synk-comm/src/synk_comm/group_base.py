"""What a :class:`~synk_comm.group.Group` is made of (:class:`GroupBase`): its shared control block,
semaphores and buffers, its state, the liveness of its ranks (a dead or stuck worker closes the group),
the errors the ranks report, and its shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from synk_comm import cores as cores_mod
from synk_comm import devices
from synk_comm.buffers import Buffers
from synk_comm.errors import GroupAborted, GroupBrokenError, RemoteError, WorkerDiedError, WorkerError, describe_exit
from synk_comm.lockstep import (
    ABORT,
    CMD,
    ERROR,
    MAILBOX,
    OK,
    SPIN_S,
    ControlBlock,
    Semaphores,
)
from synk_comm.shm_collectives import ShmCollectives
from synk_comm.watchdog import _Watchdog
from synk_shm import naming

if TYPE_CHECKING:
    from synk_comm.group import Group

__all__ = ["GroupBase"]

log = logging.getLogger("synk_comm.group")  # the logger of synk_comm.group, whose part this is

EXIT = -1
SPAN_OFFSET_ENV = "SYNK_SPAN_OFFSET"
SPAN_SIZE_ENV = "SYNK_SPAN_SIZE"
ABANDONED_GRACE_S = 0.5
"""Seconds :meth:`Group.close` waits for workers still busy with an interrupted command before it
kills them."""


class GroupBase:
    """The state, liveness and shutdown of a group of ranks (the base of :class:`~synk_comm.group.Group`)."""

    def __init__(self, *, prefix: str, rank: int, size: int, master_rank: int, scratch_size: int,
                 device: str | None, create: bool) -> None:
        self.prefix = prefix
        self.rank = rank
        self.size = size
        self.master_rank = master_rank
        self.device = device
        self.is_master = rank == master_rank
        self._closed = False
        self._broken: str | None = None
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._pending = 0
        self._buffer_turn = 0
        self.commands = 0
        """In the master: how many commands it has started (the workers do not count).  A caller
        that keeps what it learnt in one command can tell from it whether another came in between."""
        self._command_names: list[str] = []
        self._after_failure: list[Callable[[], None]] = []
        self._nccl: Any = None
        self._affinity: dict[int, set[int]] | None = None  # the master's masks before start(cores=...)
        if create:
            self.control = ControlBlock.create(f"{prefix}ctl", size, scratch_size)
        else:
            self.control = ControlBlock.attach(f"{prefix}ctl", size, scratch_size)
        self.sems = Semaphores(prefix, size, create=create)
        self._go_workers = [self.sems.go[r] for r in range(size) if r != master_rank]
        self.buffers = Buffers(self.control, prefix, rank, size)
        self.scratch = self.control.scratch
        self._status = self.control.rows["status"]  # int64 view: one status per rank
        self._values = self.control.rows["values"]  # (size, REPLY_VALUES) float64 view: reply_values
        self.host = ShmCollectives(cast("Group", self))
        self.workers = [r for r in range(size) if r != master_rank]
        self._master_pid = os.getpid() if create else int(os.environ.get("SYNK_MASTER_PID", "0"))
        # The master decides (no spinning with more ranks than cores) and tells the workers at launch
        # (SYNK_SPIN_US): a worker pinned to its own cores cannot tell how many the group has.
        self._spin = SPIN_S if not create or size <= len(os.sched_getaffinity(0)) else 0.0
        # A group that is one host's part of a group spanning hosts (synk_comm.net): its worker ranks
        # 1.. are the span's ranks span_offset + 1.. of span_size.  Set in the workers at launch.
        spanned = not create and SPAN_SIZE_ENV in os.environ
        self.spans_hosts = spanned
        """Whether this group is one host's part of a group that spans hosts (:mod:`synk_comm.net`)."""
        self.span_offset = int(os.environ[SPAN_OFFSET_ENV]) if spanned else 0
        """Added to a worker's rank here: its rank in the group that spans hosts (0 otherwise)."""
        self.span_size = int(os.environ[SPAN_SIZE_ENV]) if spanned else size
        """Ranks of the group that spans hosts, its master included (``size`` otherwise)."""
        self.watch: Callable[[], None] | None = None
        """In the master: called between two polls of every wait on the workers (it may raise to
        stop waiting); :mod:`synk_comm.net` watches the other hosts with it."""
        self._watchdog: _Watchdog | None = None  # the master's, made by start()
        self.abort_grace_s: float | None = None
        """Seconds the master waits, once a worker has reported an error during a command, for the
        other workers to finish it; then it counts them as stuck (inside a collective that can no
        longer complete), closes the group and raises the error.  None (the default): wait for
        them as long as they run.  ``synkhronos``' JAX engine sets it."""

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return f"<synk_comm.Group rank {self.rank} of {self.size}, master {self.master_rank}, {state}>"

    # -- state ----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _require_usable(self) -> None:
        if self._broken:
            raise GroupBrokenError(self._broken)
        if self._closed:
            raise GroupBrokenError("the group is closed: start a new one")

    def abort_address(self) -> int:
        """The address of the group's abort word in this process (an int64 in shared memory, non-zero
        once a rank fails the current command): for waits outside Python to end on it
        (:mod:`synk_comm.xla_cpu`)."""
        return int(self.control.header.ctypes.data) + ABORT * self.control.header.itemsize

    def after_failed_command(self, fn: Callable[[], None]) -> None:
        """In the master: call ``fn()`` after each failed command, once every worker has ended it
        and before the next command starts: to put state that the ranks share outside the group
        back in step (:meth:`synk_comm.xla_cpu.Segment.realign`)."""
        self._after_failure.append(fn)

    def _failed(self) -> None:
        for fn in self._after_failure:
            fn()

    def _next_buffer(self) -> int:
        k = self._buffer_turn
        self._buffer_turn ^= 1
        return k

    # -- liveness -------------------------------------------------------------------------------
    def _check(self) -> None:
        """Called while waiting: raise if a peer died or the current command was aborted."""
        if self.is_master:
            self._check_workers()
        elif os.getppid() != self._master_pid:
            _master_gone(self.prefix)
        if self.control.header[ABORT]:
            raise GroupAborted(f"rank {int(self.control.header[ABORT]) - 1} failed during this command")

    def _check_workers(self) -> None:
        for r, proc in self._procs.items():
            if proc.poll() is not None:
                self._fail_dead(r, proc)
        if self.watch is not None:
            self.watch()

    def _fail_dead(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self._stop_watchdog()  # first: its exception must not land inside the shutdown below
        detail = ""
        if int(self.control.rows[rank]["status"]) == ERROR:
            err = self._read_error(rank)
            detail = f" It reported {err.type_name}: {err.message}\n{err.traceback}"
        self._broken = (f"rank {rank} died ({describe_exit(proc.returncode)}); the group is closed: "
                        "start a new one")
        self.control.header[ABORT] = self.rank + 1
        self._shutdown(timeout=0.5)  # the group is lost: the others get half a second to exit
        raise WorkerDiedError(rank, proc.pid, proc.returncode, detail)

    def _fail_stuck(self) -> None:
        """A worker failed and the others did not finish within :attr:`abort_grace_s`: stop the group
        and raise the failure (the group is closed)."""
        self._stop_watchdog()
        errors = self._take_errors()
        self._broken = ("a worker failed during a command while the others could not finish it; the group "
                        "is closed: start a new one")
        self._shutdown(timeout=0.5)
        exc = WorkerError(errors)
        exc.add_note(f"The other workers did not finish within {self.abort_grace_s:g} s (stuck in a collective "
                     "with the failed rank): the group is closed; start a new one.")
        raise exc

    def _take_errors(self) -> list[RemoteError]:
        status = self._status
        if not status.any():
            return []
        errors = [self._read_error(r) for r in self.workers if status[r] == ERROR]
        status[:] = OK
        return errors

    def _read_error(self, rank: int) -> RemoteError:
        try:
            err = pickle.loads(self.buffers.read_bytes(rank, MAILBOX))
            assert isinstance(err, RemoteError)
            return err
        except Exception as exc:  # pragma: no cover - the worker died while writing
            return RemoteError(rank, "unknown", f"(its error could not be read: {exc!r})", "")

    # -- shutdown -------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers, join them, and unlink every segment and semaphore of the group.

        Idempotent; runs at interpreter exit too.  Workers still busy after ``timeout`` seconds
        are killed.
        """
        if self._closed:
            return
        if self.is_master:
            self._shutdown(timeout)
        else:
            self._release_resources(unlink=False)
        self._closed = True

    def _stop_watchdog(self) -> None:
        """The group is closing: the watchdog stops, and an exception it raised that Python has not
        delivered yet is withdrawn."""
        if self._watchdog is not None:
            self._watchdog.stop()

    def _unpin(self) -> None:
        """Give the master's threads the cores they had before :func:`start` pinned them, and the
        processes it starts from now on the GPUs it saw before (:func:`synk_comm.devices.unpin`)."""
        if self._affinity is not None:
            cores_mod.restore(self._affinity)
            self._affinity = None
        if self.device is not None:
            devices.unpin()

    def _shutdown(self, timeout: float) -> None:
        """Tell every worker to exit (after aborting whatever it is doing), join, clean up."""
        self._stop_watchdog()
        if self._procs:
            header = self.control.header
            header[ABORT] = self.rank + 1  # a worker inside a command leaves its barriers...
            header[CMD] = EXIT  # ...and then finds EXIT waiting
            for r in self.workers:
                self.sems.go[r].release()
        if self._pending:
            # A command the master abandoned (KeyboardInterrupt) still runs in the workers: they would
            # finish it before they see EXIT.  Nothing will read its results: a short grace, then kill
            # (their segments are the group's, unlinked below).
            timeout = min(timeout, ABANDONED_GRACE_S)
        deadline = time.monotonic() + timeout
        for proc in self._procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("synk_comm: worker pid %d did not exit in time; killing it", proc.pid)
                proc.kill()
                proc.wait()
        self._procs.clear()
        self._pending = 0
        self._release_resources(unlink=True)
        self._unpin()
        self._closed = True

    def _release_resources(self, unlink: bool) -> None:
        if self._nccl is not None:
            with contextlib.suppress(Exception):
                self._nccl.close()
            self._nccl = None
        self.buffers.close()
        self.sems.close(unlink=unlink)
        if unlink:
            self.control.segment.unlink()
        self.control.close()
        if unlink:
            naming.unlink_prefix(self.prefix)


def _master_gone(prefix: str) -> None:
    """In a worker whose master died: remove every shared-memory object of the run, then exit."""
    run = os.environ.get(naming.RUN_PREFIX_ENV, prefix)
    naming.unlink_prefix(run)
    naming.cleanup()
    os._exit(3)

