"""The lock-step commands of a :class:`~synk_comm.group.Group` (:class:`GroupCommands`): the master starts
a command in every worker and runs its own part, the workers run the handler registered under its name
(:func:`handler`) and reply, and the end of every command is a barrier."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import posix_ipc

from synk_comm.errors import GroupAborted, RemoteError, WorkerError
from synk_comm.group_base import EXIT, _master_gone
from synk_comm.group_collectives import GroupCollectives
from synk_comm.lockstep import (
    ABORT,
    ABORTED,
    CMD,
    ERROR,
    MAILBOX,
    OK,
    PAYLOAD_NBYTES,
    REPLY_VALUES,
    wait,
)
from synk_comm.watchdog import _WorkerGone

if TYPE_CHECKING:
    from synk_comm.group import Group

__all__ = ["GroupCommands", "handler"]

log = logging.getLogger("synk_comm.group")  # the logger of synk_comm.group, whose part this is

HANDLERS: dict[str, Callable[[Group, Any], Any]] = {}
F = TypeVar("F", bound=Callable[..., Any])


def handler(name: str | None = None) -> Callable[[F], F]:
    """Register ``fn(group, payload)`` as the handler of command ``name`` (default: its qualified name).

    The module that defines it must be importable in the workers: pass it in ``imports`` of
    :func:`~synk_comm.group.start`.
    """

    def register(fn: F) -> F:
        HANDLERS[name or f"{fn.__module__}.{fn.__qualname__}"] = fn
        return fn

    return register


class GroupCommands(GroupCollectives):
    """A group's commands: the master's side, and the worker's loop."""

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
            return HANDLERS[name](cast("Group", self), payload)

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
                handlers[cmd](cast("Group", self), payload)
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

