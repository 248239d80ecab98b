"""Calls in flight: the master's window of submitted calls (:meth:`synkhronos.Function.submit`).

A submitted call runs in the master's one dispatch thread, in submission order, and its
:class:`concurrent.futures.Future` completes with what the synchronous call returns or raises.
At most ``max_in_flight`` calls (a :func:`synkhronos.fork` option) are pending; ``submit`` blocks
while the window is full.  Meanwhile the user's thread runs on: it prepares the next batch, reads
finished losses, logs.

Order against everything else
    Every other operation of the group -- a synchronous call, a chain, a collective, a value read
    or written, a Data made, changed, resized or freed, :func:`synkhronos.distribute`,
    :func:`synkhronos.close` -- first waits until no call is pending (:meth:`Window.drain`, run by
    :func:`synkhronos.runtime.get_runtime` and the few paths that do not pass through it), so it
    sees exactly what the calls submitted before it left, and no pending call sees a change made
    after it was submitted.  A Data's *contents* written in place (``d[:] = ...``) are not
    ordered: write a Data a pending call reads only after its future is done (or use another Data).

Failure
    A call that raises: its future raises the same exception as the synchronous call; every call
    submitted before that failure was seen and not started yet is cancelled -- its future raises
    :class:`concurrent.futures.CancelledError` whose ``__cause__`` is the failure -- and the group
    stays usable (calls submitted afterwards run).  A worker's death fails the running call with
    :class:`~synkhronos.WorkerDiedError` and cancels the rest the same way.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "Window"]

DEFAULT_MAX_IN_FLIGHT = 2
"""The window's default depth.  Two calls in flight are what hides the master's round trip and
the workers' program launch behind the previous step's compute (measured with hand-written JAX on
2x H200: reading the loss two steps late took the MLP step from 6.17-6.26 to 5.52-5.60 ms); a
deeper window adds memory (each pending call holds its arguments and outputs) and delays the
report of a failure, and gains nothing once the device queue is never empty."""


class Window:
    """The master's calls in flight: a FIFO served by one dispatch thread (started on first use)."""

    def __init__(self, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self._slots = threading.Semaphore(max_in_flight)
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, Future[Any], Callable[[], Any]]] = collections.deque()
        self._pending = 0  # submitted and not finished
        self._seq = 0  # the last submitted call's number
        self._cancel_upto = 0  # calls numbered up to this one are cancelled when their turn comes
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Calls submitted and not finished."""
        return self._pending

    def in_dispatch(self) -> bool:
        """Whether this thread is the dispatch thread (where a call runs, it must not wait for itself)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn`` (a call); blocks while ``max_in_flight`` calls are pending."""
        if self.in_dispatch():
            raise RuntimeError("a call cannot be submitted from inside another call")
        self._slots.acquire()
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                self._slots.release()
                raise RuntimeError("the Synkhronos group is closed: call synk.fork() again")
            self._seq += 1
            self._queue.append((self._seq, future, fn))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="synkhronos-calls", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return future

    def drain(self) -> None:
        """Wait until no call is pending (returns at once in the dispatch thread)."""
        if not self._pending or self.in_dispatch():
            return
        with self._cond:
            while self._pending:
                self._cond.wait()

    def close(self) -> None:
        """Drain, then stop the dispatch thread; later submits raise RuntimeError."""
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                seq, future, fn = self._queue.popleft()
                cancelled = seq <= self._cancel_upto
                failure = self._failure
            try:
                if cancelled:
                    exc = CancelledError("cancelled: a call submitted before it failed")
                    exc.__cause__ = failure
                    future.set_exception(exc)
                elif future.set_running_or_notify_cancel():
                    try:
                        result = fn()
                    except BaseException as error:
                        with self._cond:
                            self._cancel_upto = self._seq
                            self._failure = error
                        future.set_exception(error)
                    else:
                        future.set_result(result)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
                self._slots.release()
