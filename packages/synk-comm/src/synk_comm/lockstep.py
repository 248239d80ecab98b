"""Lock-step between the ranks of a group: POSIX semaphores with timeouts, and a shared control block.

Semaphores (all created by the master, named under the group's prefix):

* ``go[r]``      the master starts a command in worker ``r``;
* ``done``       a worker finished its command (the master takes one per worker);
* ``arrive``     a worker reached a barrier (the master, the coordinator, takes one per worker);
* ``release[r]`` the master lets worker ``r`` out of the barrier.

Every wait is a loop of short timed waits; between two, ``check()`` looks at liveness (are the
other processes alive?) and at the abort flag (did a rank fail during this command?), so a wait
never hangs on a dead peer.  The abort flag, the command id and the hot-path arguments live in
the control block, a shared int64 header followed by one row per rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from os import sched_yield

import numpy as np
import posix_ipc

from synk_shm import SharedArray, naming

__all__ = ["ControlBlock", "POLL_S", "REPLY_VALUES", "Semaphores", "wait"]

POLL_S = 0.05
"""Seconds between liveness checks while waiting."""

# header slots; LAYOUTS + k (k < NBUF): how often any rank wrote a new message layout into its buffer k
CMD, PAYLOAD_NBYTES, ABORT, STARTED, LAYOUTS = range(5)
HEADER_LEN = 16

NBUF = 3  # per rank: two alternating collective buffers and a mailbox
MAILBOX = 2
REPLY_VALUES = 8
"""Numbers a rank can leave in its row for the master at the end of a command
(:meth:`synk_comm.Group.reply_values`)."""
ROW = np.dtype([("pid", "<i8"), ("status", "<i8"), ("buf_tag", "<i8", (NBUF,)), ("buf_cap", "<i8", (NBUF,)),
                ("msg_nbytes", "<i8"), ("values", "<f8", (REPLY_VALUES,))])
# status values
OK, ERROR, ABORTED = 0, 1, 2


class ControlBlock:
    """The shared control segment: ``header`` (int64), ``scratch`` (int64) and ``rows`` (one per rank)."""

    def __init__(self, segment: SharedArray, size: int, scratch_size: int) -> None:
        self.segment = segment
        self.header = segment.view(HEADER_LEN, np.int64)
        self.scratch = segment.view(scratch_size, np.int64, offset=8 * HEADER_LEN)
        self.rows = segment.view(size, ROW, offset=8 * (HEADER_LEN + scratch_size))

    @staticmethod
    def nbytes(size: int, scratch_size: int) -> int:
        return 8 * (HEADER_LEN + scratch_size) + size * ROW.itemsize

    @classmethod
    def create(cls, name: str, size: int, scratch_size: int) -> ControlBlock:
        seg = SharedArray.create(cls.nbytes(size, scratch_size), np.uint8, name=name,
                                 purpose="the group's control block")
        return cls(seg, size, scratch_size)

    @classmethod
    def attach(cls, name: str, size: int, scratch_size: int) -> ControlBlock:
        return cls(SharedArray.attach(name, cls.nbytes(size, scratch_size), np.uint8), size, scratch_size)

    def close(self) -> None:
        del self.header, self.scratch, self.rows
        self.segment.close()


class Semaphores:
    """The group's semaphores (see the module docstring)."""

    def __init__(self, prefix: str, size: int, create: bool) -> None:
        flags = posix_ipc.O_CREX if create else 0
        self.names: list[str] = []

        def sem(tag: str) -> posix_ipc.Semaphore:
            name = f"{prefix}s{tag}"
            s = posix_ipc.Semaphore(name, flags, mode=0o600, initial_value=0)
            if create:
                naming.register(name, "sem")
            self.names.append(name)
            return s

        self.done = sem("done")
        self.arrive = sem("arrive")
        self.go = [sem(f"go{r}") for r in range(size)]
        self.release = [sem(f"rel{r}") for r in range(size)]

    def drain(self) -> None:
        """Set the barrier semaphores back to zero (only while every worker is idle)."""
        for s in [self.arrive, *self.release]:
            while s.value > 0:
                try:
                    s.acquire(0)
                except posix_ipc.BusyError:
                    break

    def close(self, unlink: bool) -> None:
        for s in [self.done, self.arrive, *self.go, *self.release]:
            try:
                s.close()
            except posix_ipc.ExistentialError:
                pass
        if unlink:
            for name in self.names:
                naming.unlink_name(name, "sem")


SPIN_S = float(os.environ.get("SYNK_SPIN_US", "200")) * 1e-6
"""Seconds a wait polls before it sleeps: waking a sleeping process costs tens of microseconds
on virtual machines, far more than the barrier itself (``SYNK_SPIN_US`` sets it; 0 never spins).
Groups with more ranks than cores never spin (a spinning rank would hold the core of the rank it
waits for)."""


TIGHT_S = 50e-6
"""Seconds of a wait's polling that do not yield the core between polls: a yield is a system call
(about a microsecond on a virtual machine) that a wait of a few microseconds does not need."""


def wait(sem: posix_ipc.Semaphore, check: Callable[[], None], timeout: float | None = None,
         what: str = "", spin: float = SPIN_S) -> None:
    """Take ``sem``, calling ``check()`` every :data:`POLL_S` seconds while it is not available.

    ``check`` raises to stop waiting (a dead peer, an abort).  ``timeout`` (seconds) bounds the
    whole wait with a TimeoutError.  The first ``spin`` seconds poll without sleeping: the first
    :data:`TIGHT_S` of them back to back (the next command of a loop of small calls comes within
    them), the rest yielding the core between two polls to any other thread that is ready to run
    on it.
    """
    if spin > 0:
        now = time.perf_counter()
        spin_end, tight_end = now + spin, now + TIGHT_S
        while True:
            if sem.value > 0:
                try:
                    sem.acquire(0)
                    return
                except posix_ipc.BusyError:
                    pass
            now = time.perf_counter()
            if now > spin_end:
                break
            if now > tight_end:
                # Let the process's other threads have the core: a rank pinned to one core still runs
                # work there while it waits (JAX computes asynchronously on threads of its own).
                sched_yield()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            sem.acquire(POLL_S)
            return
        except posix_ipc.BusyError:
            check()
            if deadline is not None and time.monotonic() > deadline:
                what = what or "the group"
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}") from None
