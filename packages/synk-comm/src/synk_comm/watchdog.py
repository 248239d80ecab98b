"""The master's watchdog (:class:`_Watchdog`): a thread that notices a worker's death while the master
computes its own part of a command, and stops that part (:class:`_WorkerGone`)."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from synk_comm.group import Group


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

