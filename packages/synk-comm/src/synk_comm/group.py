"""A group of processes on one machine that run in lock-step.

Two ways in:

* :func:`spawn` (SPMD, like ``torch.multiprocessing.spawn``): ``fn(group, *args)`` runs in every
  rank, the calling process included (as the master rank), and the list of return values comes
  back in rank order.
* :func:`start` (master-driven, what :mod:`synkhronos` uses): the master sends commands;
  each worker runs the handler registered under the command's name (:func:`handler`), while the
  master runs its own part inside ``with group.command(name, payload):``.  The start and the end
  of every command are barriers.

Workers are fresh interpreters (``python -m synk_comm.worker``) with their environment set at
launch (``CUDA_VISIBLE_DEVICES`` among it), never forks of the master and never re-runs of its
``__main__``.  A worker's exception reaches the master as :class:`~synk_comm.errors.WorkerError`
(rank and traceback) and the group stays usable; a worker that dies makes the master's next wait
fail within a fraction of a second with :class:`~synk_comm.errors.WorkerDiedError`; workers
exit, cleaning up the run's shared memory, when the master dies.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import posix_ipc

from synk_comm import cores as cores_mod
from synk_comm.buffers import Buffers
from synk_comm.devices import pin
from synk_comm.errors import (
    GroupAborted,
    GroupBrokenError,
    RemoteError,
    WorkerDiedError,
    WorkerError,
    describe_exit,
)
from synk_comm.lockstep import (
    ABORT,
    ABORTED,
    CMD,
    ERROR,
    MAILBOX,
    OK,
    PAYLOAD_NBYTES,
    REPLY_VALUES,
    SPIN_S,
    ControlBlock,
    Semaphores,
    wait,
)
from synk_comm.ops import ReduceOp
from synk_comm.shm_collectives import ShmCollectives
from synk_shm import naming

__all__ = ["Group", "start", "spawn", "handler", "current_group"]

log = logging.getLogger(__name__)

EXIT = -1
SPAN_OFFSET_ENV = "SYNK_SPAN_OFFSET"
SPAN_SIZE_ENV = "SYNK_SPAN_SIZE"
ABANDONED_GRACE_S = 0.5
"""Seconds :meth:`Group.close` waits for workers still busy with an interrupted command before it
kills them."""
HANDLERS: dict[str, Callable[[Group, Any], Any]] = {}
F = TypeVar("F", bound=Callable[..., Any])


def handler(name: str | None = None) -> Callable[[F], F]:
    """Register ``fn(group, payload)`` as the handler of command ``name`` (default: its qualified name).

    The module that defines it must be importable in the workers: pass it in ``imports`` of
    :func:`start`.
    """

    def register(fn: F) -> F:
        HANDLERS[name or f"{fn.__module__}.{fn.__qualname__}"] = fn
        return fn

    return register


_current: Group | None = None


def current_group() -> Group | None:
    """The group this process belongs to (in a worker: its group; in the master: the last started)."""
    return _current


class Group:
    """The ranks of a group as seen from one of them; made by :func:`start`, :func:`spawn`, or
    the worker entry point.

    Attributes
    ----------
    rank, size, master_rank : int
        Who we are, how many there are, and which rank drives the commands.
    device : str or None
        This rank's entry of the ``devices`` given to :func:`start` (its ``CUDA_VISIBLE_DEVICES``).
    scratch : numpy.ndarray
        Shared int64 slots for a command's small arguments, written by the master before the
        command (the hot path: no pickling, no allocation).
    """

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
        self.host = ShmCollectives(self)
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

    # -- lock-step ------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every rank reaches its barrier (coordinated by the master rank)."""
        self._require_usable()
        if self.size == 1:
            return
        sems = self.sems
        if self.is_master:
            for _ in self.workers:
                wait(sems.arrive, self._check, what="the other ranks at a barrier", spin=self._spin)
            for r in self.workers:
                sems.release[r].release()
        else:
            sems.arrive.release()
            wait(sems.release[self.rank], self._check, what="the master at a barrier", spin=self._spin)

    @contextlib.contextmanager
    def command(self, name: str, payload: Any = None) -> Iterator[None]:
        """Run command ``name`` in every worker while the body runs the master's part.

        ``payload`` (any picklable object, or None for the hot path) reaches each worker's
        handler.  On exit the master waits for every worker; a worker's exception is raised here
        as :class:`WorkerError`, after which the group is usable again.  The same as
        :meth:`start_command`, the body, then :meth:`finish_command`.

        Raises
        ------
        WorkerError
            If a worker's handler raised.
        WorkerDiedError
            If a worker process died.
        ValueError
            If no handler is registered under ``name``.
        """
        self.start_command(name, payload)
        try:
            yield
        except BaseException as exc:
            self.finish_command(exc)
            raise  # pragma: no cover - finish_command raised it
        self.finish_command(None)

    def start_command(self, name: str, payload: Any = None) -> None:
        """The first half of :meth:`command` (for hot paths that avoid a context manager): the
        workers start command ``name``; the caller must call :meth:`finish_command` next, with
        the exception its own part raised or None."""
        self._require_master()
        self._require_usable()
        self._settle()
        try:
            cmd = self._command_names.index(name)
        except ValueError:
            raise ValueError(f"no handler named {name!r} was registered in the workers; registered: "
                             f"{', '.join(self._command_names)}") from None
        header = self.control.header
        if payload is None:
            header[PAYLOAD_NBYTES] = 0
        else:
            data = pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
            self.buffers.publish_bytes(MAILBOX, data)
            header[PAYLOAD_NBYTES] = len(data)
        header[CMD] = cmd
        self.commands += 1
        self._buffer_turn = 0
        self._pending = len(self.workers)
        for sem in self._go_workers:
            sem.release()
        if self._watchdog is not None:
            self._watchdog.arm()

    def finish_command(self, master_exc: BaseException | None) -> None:
        """The second half of :meth:`command`: wait for every worker; raise ``master_exc`` (the
        master's own failure, if any) or the workers' errors."""
        if (self._watchdog is not None and self._watchdog.disarm()) or isinstance(master_exc, _WorkerGone):
            # the watchdog found a dead worker while the master computed its own part
            self._check_workers()  # raises WorkerDiedError, the group closed
            raise RuntimeError("synk_comm: a worker was seen dead during this command but has a live "
                               "process now; the group is in an unknown state: start a new one")
        if master_exc is not None:
            if self._closed:  # a worker died and the group shut down: nothing is left to collect
                raise master_exc
            if not isinstance(master_exc, GroupAborted):
                self.control.header[ABORT] = self.rank + 1
            if isinstance(master_exc, KeyboardInterrupt):
                raise master_exc  # the workers' completions are collected before the next command
        self._finish(master_exc)

    def reply(self, arrays: Sequence[np.ndarray]) -> None:
        """In a worker's handler: leave ``arrays`` for the master to read when the command ends.

        No barrier: the end of the command is one.  Cheaper than a gather for a command's
        results (synkhronos returns function outputs this way).
        """
        self.buffers.publish(MAILBOX, [np.asarray(a) for a in arrays])

    def reply_values(self, values: Sequence[float]) -> None:
        """In any rank's part of a command: leave up to :data:`~synk_comm.lockstep.REPLY_VALUES`
        numbers (stored as float64) in this rank's row of the shared control block, where the
        master reads every rank's at once when the command ends (:meth:`replied_values`).

        For a few scalars a command returns (a loss, an accuracy, the rows a rank computed on): no
        message to lay out, and no read per rank.  Slots past ``len(values)`` keep what an earlier
        command left there.

        Raises
        ------
        ValueError
            If there are more than ``REPLY_VALUES`` values: :meth:`reply` takes any arrays.
        RuntimeError
            In a group that is one host's part of a group spanning hosts, whose master reads its
            workers' replies by message (:mod:`synk_comm.net`).
        """
        n = len(values)
        if n > REPLY_VALUES:
            raise ValueError(f"reply_values takes at most {REPLY_VALUES} values, got {n}: use reply() for more")
        if self.spans_hosts:
            raise RuntimeError("reply_values is for groups on one host; this group spans hosts: use reply()")
        row = self._values[self.rank]
        for i, v in enumerate(values):  # item by item: a third of a slice assignment's cost for a few
            row[i] = v

    def replied_values(self) -> np.ndarray:
        """In the master, after a command: every rank's :meth:`reply_values`, the master's own
        included, as a ``(size, REPLY_VALUES)`` float64 view of the control block, row ``r`` for
        rank ``r`` (valid until the next command; copy what you keep)."""
        return self._values

    def replies(self, copy: bool = True) -> dict[int, list[np.ndarray]]:
        """In the master, after a command: each worker's :meth:`reply`, by rank: copies, or with
        ``copy=False`` views of the workers' buffers, valid until the next command."""
        views = self.buffers.read_each(self.workers, MAILBOX)
        if not copy:
            return dict(zip(self.workers, views))
        return {r: [v.copy() for v in arrays] for r, arrays in zip(self.workers, views)}

    def run(self, name: str, payload: Any = None) -> Any:
        """Run handler ``name`` in every rank (master included); returns the master's result."""
        self._require_master()
        with self.command(name, payload):  # raises ValueError for an unknown name
            return HANDLERS[name](self, payload)

    def _collect(self) -> None:
        error_seen: list[float] = []  # when a worker's error was first seen

        def check() -> None:
            self._check_workers()
            if self.abort_grace_s is not None and self.control.header[ABORT] and self._status.any():
                now = time.monotonic()
                if not error_seen:
                    error_seen.append(now)
                elif now - error_seen[0] > self.abort_grace_s:
                    self._fail_stuck()

        done = self.sems.done
        while self._pending > 0:
            try:
                done.acquire(0)  # already finished: no wait loop (one call per worker and command)
            except posix_ipc.BusyError:
                pass
            else:
                self._pending -= 1
                continue
            try:
                wait(done, check, what="the workers to finish", spin=self._spin)
            except KeyboardInterrupt:
                self.control.header[ABORT] = self.rank + 1
                raise
            self._pending -= 1

    def _finish(self, master_exc: BaseException | None) -> None:
        self._collect()
        header = self.control.header
        if master_exc is None and not header[ABORT]:
            return  # no worker failed: a worker sets the abort flag before it reports an error
        errors = self._take_errors()
        if header[ABORT] or errors:
            self.sems.drain()
            header[ABORT] = 0
        self._failed()
        if master_exc is not None and not isinstance(master_exc, GroupAborted):
            for e in errors:
                log.error("rank %d also raised %s: %s", e.rank, e.type_name, e.message)
            raise master_exc
        if errors:
            raise WorkerError(errors) from None
        if master_exc is not None:
            raise master_exc

    def _settle(self) -> None:
        """Collect the completions of an interrupted command before starting another."""
        if self._pending == 0:
            return
        log.warning("synk_comm: waiting for the workers to finish the interrupted command")
        self._collect()
        for e in self._take_errors():
            log.warning("rank %d raised %s during the interrupted command: %s",
                        e.rank, e.type_name, e.message)
        self.sems.drain()
        self.control.header[ABORT] = 0
        self._failed()

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

    def _require_master(self) -> None:
        if not self.is_master:
            raise RuntimeError("only the master rank can send commands")

    # -- worker side ----------------------------------------------------------------------------
    def _serve(self) -> None:
        """The worker loop: wait for a command, run its handler, report, repeat until EXIT."""
        header, row = self.control.header, self.control.rows[self.rank]
        handlers = [HANDLERS[n] for n in self._command_names]

        def check_master() -> None:
            if os.getppid() != self._master_pid:
                _master_gone(self.prefix)

        while True:
            wait(self.sems.go[self.rank], check_master, spin=self._spin)
            cmd = int(header[CMD])
            if cmd == EXIT:
                return
            self._buffer_turn = 0
            status = OK
            try:
                payload = None
                if header[PAYLOAD_NBYTES]:
                    payload = pickle.loads(self.buffers.read_bytes(self.master_rank, MAILBOX))
                handlers[cmd](self, payload)
            except GroupAborted:
                status = ABORTED
            except BaseException as exc:
                status = ERROR
                self._report(exc)
                header[ABORT] = self.rank + 1
            if status != OK:  # OK stays OK: the master resets every status after a failed command
                row["status"] = status
            self.sems.done.release()

    def _report(self, exc: BaseException) -> None:
        err = RemoteError(self.rank, type(exc).__name__, str(exc), traceback.format_exc())
        self.buffers.publish_bytes(MAILBOX, pickle.dumps(err, pickle.HIGHEST_PROTOCOL))

    # -- collectives (numpy arrays through shared memory; CUDA arrays through NCCL) -------------
    def _backend(self, array: Any) -> Any:
        self._require_usable()  # a closed group's buffers and semaphores are gone
        if array is not None and not isinstance(array, np.ndarray) and _is_cuda_array(array):
            self._one_host_only("a collective on CUDA arrays (NCCL)")
            if self._nccl is None:
                from synk_comm.nccl import NcclCollectives

                self._nccl = NcclCollectives(self)
            return self._nccl
        return self.host

    def _one_host_only(self, name: str) -> None:
        if self.spans_hosts:
            raise NotImplementedError(f"{name} is not carried across hosts in a group spanning hosts (synk_comm.net): "
                                      "all_reduce, all_gather, gather_object and barrier are")

    def broadcast(self, array: Any, *, root: int | None = None) -> Any:
        """Every rank returns ``root``'s array (see :mod:`synk_comm.collectives`)."""
        self._one_host_only("broadcast")
        root = self.master_rank if root is None else root
        return self._backend(array).broadcast(array, root=root)

    def reduce(self, array: Any, op: ReduceOp | str = "sum", *, root: int | None = None) -> Any:
        """``root`` (default: the master) returns ``op`` over every rank's array; others None."""
        self._one_host_only("reduce")
        root = self.master_rank if root is None else root
        return self._backend(array).reduce(array, op, root=root)

    def all_reduce(self, array: Any, op: ReduceOp | str = "sum", *, out: Any = None) -> Any:
        """Every rank returns ``op`` over every rank's array."""
        return self._backend(array).all_reduce(array, op, out=out)

    def gather(self, array: Any, *, root: int | None = None) -> list[Any] | None:
        """``root`` returns every rank's array in rank order (shapes may differ); others None."""
        self._one_host_only("gather")
        root = self.master_rank if root is None else root
        return self._backend(array).gather(array, root=root)

    def all_gather(self, array: Any) -> list[Any]:
        """Every rank returns every rank's array in rank order (shapes may differ)."""
        return self._backend(array).all_gather(array)

    def scatter(self, arrays: Sequence[Any] | None, *, root: int | None = None) -> Any:
        """Rank ``r`` returns ``arrays[r]`` of ``root``'s list."""
        self._one_host_only("scatter")
        root = self.master_rank if root is None else root
        probe = arrays[0] if arrays else None
        return self._backend(probe).scatter(arrays, root=root)

    def reduce_scatter(self, array: Any, op: ReduceOp | str = "sum") -> Any:
        """Rank ``r`` returns ``op`` over every rank's chunk ``r`` (``array_split`` on axis 0)."""
        self._one_host_only("reduce_scatter")
        return self._backend(array).reduce_scatter(array, op)

    def broadcast_object(self, obj: object = None, *, root: int | None = None) -> object:
        """Every rank returns ``root``'s picklable object."""
        self._one_host_only("broadcast_object")
        self._require_usable()
        return self.host.broadcast_object(obj, root=self.master_rank if root is None else root)

    def gather_object(self, obj: object, *, root: int | None = None) -> list[object] | None:
        """``root`` returns every rank's picklable object in rank order; others None."""
        self._require_usable()
        return self.host.gather_object(obj, root=self.master_rank if root is None else root)

    @property
    def nccl(self) -> Any:
        """The NCCL backend (made on first use; needs ``synk-comm[nccl]`` and a GPU per rank)."""
        if self._nccl is None:
            from synk_comm.nccl import NcclCollectives

            self._nccl = NcclCollectives(self)
        return self._nccl

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
        """Give the master's threads the cores they had before :func:`start` pinned them."""
        if self._affinity is not None:
            cores_mod.restore(self._affinity)
            self._affinity = None

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


def _is_cuda_array(obj: Any) -> bool:
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    devices = getattr(obj, "devices", None)  # jax.Array
    if callable(devices):
        try:
            return any(d.platform == "gpu" for d in devices())
        except Exception:
            return False
    return bool(getattr(obj, "is_cuda", False))  # torch.Tensor


def _master_gone(prefix: str) -> None:
    """In a worker whose master died: remove every shared-memory object of the run, then exit."""
    run = os.environ.get(naming.RUN_PREFIX_ENV, prefix)
    naming.unlink_prefix(run)
    naming.cleanup()
    os._exit(3)


# --- the master's watchdog ---------------------------------------------------------------------

class _WorkerGone(BaseException):
    """Raised in the master's thread, by its watchdog, inside the master's own part of a command
    when a worker died meanwhile; :meth:`Group.finish_command` turns it into WorkerDiedError.  A
    BaseException, so that code that retries on ``Exception`` (a backend's fallback) lets it pass."""


WATCH_AFTER_S = 0.2
"""Seconds into the master's own part of a command before its watchdog starts looking."""
WATCH_EVERY_S = 0.1
"""Seconds between two looks of the watchdog at the workers."""


class _Watchdog:
    """A daemon thread of the master that notices a worker's death while the master computes its
    own part of a command (the wait for the workers notices it otherwise, but only once that part
    ends).

    While a command runs for more than :data:`WATCH_AFTER_S`, it polls the worker processes every
    :data:`WATCH_EVERY_S`; when one has died, it raises :class:`_WorkerGone` asynchronously in the
    thread that started the command (``PyThreadState_SetAsyncExc``).  Python delivers it between
    two bytecodes: at once in Python code (a PyTensor Op's ``perform``, numpy in steps), but only
    when a long call into compiled code (one XLA program, one BLAS product) returns.  Arming and
    disarming cost two lock operations on the hot path; a command that ends before
    :data:`WATCH_AFTER_S` never meets the thread.
    """

    def __init__(self, group: Group) -> None:
        self._procs = list(group._procs.values())
        self._lock = threading.Lock()
        self._armed_at = 0.0  # monotonic time of arm(); 0 while disarmed
        self._thread_id = 0
        self._fired = False
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="synk-watchdog", daemon=True).start()

    def arm(self) -> None:
        """The master's own part of a command starts (in this thread)."""
        self._thread_id = threading.get_ident()
        self._armed_at = time.monotonic()

    def disarm(self) -> bool:
        """The master's part ended: True if the watchdog fired (a worker died); then any exception
        it raised and Python has not yet delivered is withdrawn (the caller raises instead)."""
        with self._lock:
            self._armed_at = 0.0
            fired, self._fired = self._fired, False
        if fired:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), None)
        return fired

    def stop(self) -> None:
        """For good (the group closes): disarmed, and the thread ends."""
        self.disarm()
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_EVERY_S):
            armed_at = self._armed_at
            if not armed_at or time.monotonic() - armed_at < WATCH_AFTER_S:
                continue
            if all(proc.poll() is None for proc in self._procs):
                continue
            with self._lock:
                if self._armed_at == armed_at and not self._fired:  # still the same command
                    self._fired = True
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id),
                                                               ctypes.py_object(_WorkerGone))


# --- starting a group ---------------------------------------------------------------------------

def start(size: int, *, imports: Sequence[str] = (), master_rank: int = 0,
          devices: Sequence[str | int] | None = None, env: dict[str, str] | None = None,
          scratch_size: int = 4096, startup_timeout: float = 300.0, main_path: str | None = None,
          spin_us: float | None = None, cores: Sequence[Sequence[int]] | None = None) -> Group:
    """Start ``size - 1`` worker processes and return the master's :class:`Group` (rank ``master_rank``).

    Parameters
    ----------
    size : int
        Number of ranks, the master included (>= 1).
    imports : sequence of str
        Modules every worker imports before serving; they register the command handlers
        (:func:`handler`).  The master imports them too.
    master_rank : int
        The master's rank, in ``[0, size)``.
    devices : sequence, optional
        One entry per rank: rank ``r`` gets ``CUDA_VISIBLE_DEVICES=devices[r]`` before it starts.
    env : dict, optional
        Extra environment variables for the workers.
    scratch_size : int
        Number of int64 hot-path argument slots (:attr:`Group.scratch`).
    startup_timeout : float
        Seconds to wait for every worker to be ready.
    spin_us : float, optional
        Microseconds each wait polls before it sleeps, in every rank (default ``SYNK_SPIN_US``
        or 200; never with more ranks than cores).
    cores : sequence of sequences of int, optional
        One set of CPU cores per rank (disjoint, e.g. :func:`synk_comm.cores.split`): every
        thread of rank ``r`` runs on ``cores[r]`` (the master's until the group closes), and a
        worker's BLAS/OpenMP/Numba pools are sized to it unless the environment sets their
        variables (:mod:`synk_comm.cores`).

    Raises
    ------
    ValueError
        For a bad ``size``, ``master_rank`` or ``devices``.
    RuntimeError
        If called in a worker of a running group (only a master starts groups).
    WorkerError, WorkerDiedError
        If a worker failed to start (its traceback is in the message).
    """
    global _current
    if _current is not None and not _current.is_master and not _current.closed:
        raise RuntimeError(f"synk_comm.start() was called in worker rank {_current.rank} of a running group "
                           f"(pid {os.getpid()}): only the master process starts groups; do this in the master")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not 0 <= master_rank < size:
        raise ValueError(f"master_rank must be in [0, {size}), got {master_rank}")
    if devices is not None and len(devices) != size:
        raise ValueError(f"devices must have one entry per rank ({size}), got {len(devices)}")
    if cores is not None and (len(cores) != size or not all(cores)):
        raise ValueError(f"cores must have one non-empty set of cores per rank ({size}), got {cores!r}")
    for module in imports:
        importlib.import_module(module)
    if devices is not None:  # the master's own GPU, in effect if CUDA is not initialised yet
        pin(str(devices[master_rank]))
    naming.sweep()
    prefix = naming.new_name("g") + "."
    group = Group(prefix=prefix, rank=master_rank, size=size, master_rank=master_rank,
                  scratch_size=scratch_size, device=None if devices is None else str(devices[master_rank]),
                  create=True)
    group._command_names = sorted(HANDLERS)
    if spin_us is not None and group._spin > 0:
        group._spin = spin_us * 1e-6
    config = {"imports": list(imports), "handlers": group._command_names, "sys_path": list(sys.path),
              "main_path": main_path}
    group.buffers.publish_bytes(MAILBOX, pickle.dumps(config, pickle.HIGHEST_PROTOCOL))
    base_env = dict(os.environ)
    base_env.update(env or {})
    base_env.update({naming.RUN_PREFIX_ENV: naming.run_prefix(), "SYNK_GROUP_PREFIX": prefix,
                     "SYNK_SIZE": str(size), "SYNK_MASTER_RANK": str(master_rank),
                     "SYNK_MASTER_PID": str(os.getpid()), "SYNK_SCRATCH_SIZE": str(scratch_size)})
    base_env["SYNK_SPIN_US"] = str(group._spin * 1e6)
    try:
        for r in group.workers:
            wenv = dict(base_env, SYNK_RANK=str(r))
            if devices is not None:
                wenv["CUDA_VISIBLE_DEVICES"] = str(devices[r])
            if cores is not None:
                wenv[cores_mod.CORES_ENV] = ",".join(str(c) for c in cores[r])
                wenv.update(cores_mod.thread_env(len(cores[r]), base_env))
            group._procs[r] = subprocess.Popen([sys.executable, "-m", "synk_comm.worker"], env=wenv,
                                               stdin=subprocess.DEVNULL)
        if cores is not None:  # after the launches: a child starts with the mask of its parent's thread
            group._affinity = cores_mod.pin_process(cores[master_rank])
        group._pending = len(group.workers)
        t0 = time.monotonic()
        while group._pending:
            wait(group.sems.done, group._check_workers, timeout=startup_timeout, what="the workers to start")
            group._pending -= 1
        errors = group._take_errors()
        if errors:
            raise WorkerError(errors)
    except BaseException:
        if not group.closed:
            group._shutdown(timeout=5.0)
        raise
    if group._procs:
        group._watchdog = _Watchdog(group)
    log.info("synk_comm: %d ranks ready in %.2f s (master rank %d, pid %d)", size, time.monotonic() - t0,
             master_rank, os.getpid())
    _register_exit(group)
    _current = group
    return group


def _register_exit(group: Group) -> None:
    ref = weakref.ref(group)

    def close() -> None:
        g = ref()
        if g is not None:
            g.close(timeout=5.0)

    atexit.register(close)
    naming.on_termination(close)


# --- SPMD ---------------------------------------------------------------------------------------

_SPMD = "synk_comm.spmd"


@handler(_SPMD)
def _run_spmd(group: Group, payload: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
    fn, args = payload
    result = fn(group, *args)
    results = group.gather_object(result)
    return results


def spawn(fn: Callable[..., Any], size: int, args: Sequence[Any] = (), **start_kwargs: Any) -> list[Any]:
    """Run ``fn(group, *args)`` in ``size`` ranks (this process is rank 0) and return their results.

    ``fn`` and ``args`` travel by pickle, so ``fn`` must be importable: a module-level function of
    a module, or of the main script if that script guards its top level with
    ``if __name__ == "__main__":``.  The group is closed on return.

    Examples
    --------
    >>> def total(group, x):                                # doctest: +SKIP
    ...     return group.all_reduce(np.full(3, x + group.rank), "sum")
    >>> spawn(total, 4, args=(1.0,))                          # doctest: +SKIP
    [array([10., 10., 10.]), array([10., ...]), ...]
    """
    main_path = None
    if getattr(fn, "__module__", None) == "__main__":
        main_path = getattr(sys.modules["__main__"], "__file__", None)
        if main_path is None:
            raise ValueError("spawn: fn is defined in an interactive session; workers cannot import it. "
                             "Define it in a module (or a script with a main guard).")
    group = start(size, main_path=main_path, **start_kwargs)
    try:
        results = group.run(_SPMD, (fn, tuple(args)))
    finally:
        group.close()
    return list(results)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
