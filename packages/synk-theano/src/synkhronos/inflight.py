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
    submitted before that failure was seen whose result had not come back is cancelled -- its
    future raises :class:`concurrent.futures.CancelledError` whose ``__cause__`` is the failure --
    and the group stays usable (calls submitted afterwards run).  A pipelined call (below) whose
    program fails on the device is seen failing while the next call's command runs: that next call
    (dispatched behind it, on what it left) is cancelled.  A worker's death fails the oldest
    pending call with :class:`~synkhronos.WorkerDiedError` and cancels the rest the same way.

Pipelined calls (the JAX engine)
    A call may return a :class:`Deferred` instead of its result: its command went out, the
    workers dispatched its program (JAX's asynchronous dispatch) and its outputs come back with
    the *next* call's command, or with a fetch when no call follows.  So while call N runs on the
    devices, the master sends call N+1 and the workers queue its program behind N's: the device
    queue never drains and the launch of the next program hides behind the running one.  The
    dispatch thread fetches the last deferred call when someone waits for it (``result()``,
    ``exception()``, :meth:`Window.drain`, a ``submit`` that finds the window full) or after
    :data:`IDLE_FETCH_S` seconds without a new call.  The futures complete in submission order.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "IDLE_FETCH_S", "Deferred", "Window"]

DEFAULT_MAX_IN_FLIGHT = 2
"""The window's default depth.  Two calls in flight are what hides the master's round trip and
the workers' program launch behind the previous step's compute (measured with hand-written JAX on
2x H200: reading the loss two steps late took the MLP step from 6.17-6.26 to 5.52-5.60 ms); a
deeper window adds memory (each pending call holds its arguments and outputs) and delays the
report of a failure, and gains nothing once the device queue is never empty."""

IDLE_FETCH_S = 0.01
"""Seconds the dispatch thread leaves a deferred call's outputs in the workers when nobody waits
for them and no call follows; then it fetches them (so that a future watched only through
:func:`concurrent.futures.wait` or a callback completes too)."""


class Deferred:
    """A call whose command went out and whose outputs come later (see the module docstring).

    The engine that returns it resolves it, in the dispatch thread, with :meth:`resolve` or
    :meth:`fail`; ``fetch`` (a callable of no arguments, run in the dispatch thread) makes it do so
    now.  :meth:`then` adds a function applied to the outputs before they reach the future.
    """

    def __init__(self, fetch: Callable[[], None]) -> None:
        self.fetch = fetch
        self._then: list[Callable[[Any], Any]] = []
        self._sink: Callable[[bool, Any], None] | None = None
        self._outcome: tuple[bool, Any] | None = None

    @property
    def resolved(self) -> bool:
        """Whether :meth:`resolve` or :meth:`fail` was called."""
        return self._outcome is not None

    def then(self, fn: Callable[[Any], Any]) -> Deferred:
        """Apply ``fn`` to the outputs when they come; returns self."""
        self._then.append(fn)
        return self

    def resolve(self, value: Any) -> None:
        """The call's outputs came back."""
        try:
            for fn in self._then:
                value = fn(value)
        except BaseException as exc:
            self.fail(exc)
            return
        self._deliver((True, value))

    def fail(self, exc: BaseException) -> None:
        """The call failed with ``exc`` (what the synchronous call raises)."""
        self._deliver((False, exc))

    def _deliver(self, outcome: tuple[bool, Any]) -> None:
        if self._outcome is not None:
            return
        self._outcome = outcome
        if self._sink is not None:
            self._sink(*outcome)

    def _attach(self, sink: Callable[[bool, Any], None]) -> None:
        self._sink = sink
        if self._outcome is not None:
            sink(*self._outcome)


class _Future(Future):  # type: ignore[type-arg]
    """A submitted call's future: waiting for it asks the window to fetch a deferred call."""

    def __init__(self, window: Window) -> None:
        super().__init__()
        self._window = window

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._window.want(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._window.want(self)
        return super().exception(timeout)


class Window:
    """The master's calls in flight: a FIFO served by one dispatch thread (started on first use)."""

    def __init__(self, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self._slots = threading.Semaphore(max_in_flight)
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, Future[Any], Callable[[], Any]]] = collections.deque()
        self._open: collections.deque[Deferred] = collections.deque()  # deferred calls, oldest first
        self._waiters: list[Future[Any]] = []  # futures someone waits for (result(), exception())
        self._blocked = 0  # submits waiting for a slot, drains waiting for the window to empty
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

    def want(self, future: Future[Any]) -> None:
        """Someone waits for ``future``: while it is not done and no submitted call is left to send,
        the dispatch thread fetches the deferred calls."""
        with self._cond:
            self._waiters = [f for f in self._waiters if not f.done()]
            self._waiters.append(future)
            self._cond.notify_all()

    def _fetch_wanted(self) -> bool:
        """Whether anyone waits for a deferred call (called with the lock held, the queue empty)."""
        return bool(self._blocked or self._closed or any(not f.done() for f in self._waiters))

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn`` (a call; it returns its result, or a :class:`Deferred` of it); blocks while
        ``max_in_flight`` calls are pending."""
        if self.in_dispatch():
            raise RuntimeError("a call cannot be submitted from inside another call")
        if not self._slots.acquire(blocking=False):
            with self._cond:  # the window is full: if every pending call is deferred, fetch one
                self._blocked += 1
                self._cond.notify_all()
            try:
                self._slots.acquire()
            finally:
                with self._cond:
                    self._blocked -= 1
        future: Future[Any] = _Future(self)
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
            self._blocked += 1
            self._cond.notify_all()
            while self._pending:
                self._cond.wait()
            self._blocked -= 1

    def close(self) -> None:
        """Drain, then stop the dispatch thread; later submits raise RuntimeError."""
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _next(self) -> tuple[int, Future[Any], Callable[[], Any]] | Deferred | None:
        """The next call to send, else the oldest deferred call to fetch, else None (closed)."""
        with self._cond:
            while not self._queue:
                if self._open:
                    if self._fetch_wanted():
                        return self._open[0]
                    if not self._cond.wait(IDLE_FETCH_S) and not self._queue:
                        return self._open[0]  # nobody came: fetch it anyway
                elif self._closed:
                    return None
                else:
                    self._cond.wait()
            return self._queue.popleft()

    def _serve(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            if isinstance(item, Deferred):
                self._fetch(item)
                continue
            seq, future, fn = item
            with self._cond:
                cancelled = seq <= self._cancel_upto
                failure = self._failure
            if cancelled:
                exc = CancelledError("cancelled: a call submitted before it failed")
                exc.__cause__ = failure
                future.set_exception(exc)
                self._finished()
            elif future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as error:
                    while self._open:  # the calls before it complete first
                        self._fetch(self._open[0])
                    self._settle(future, False, error)
                else:
                    if isinstance(result, Deferred):
                        with self._cond:
                            self._open.append(result)
                        result._attach(self._sink(future, result))
                    else:
                        self._settle(future, True, result)
            else:
                self._finished()

    @staticmethod
    def _fetch(item: Deferred) -> None:
        try:
            item.fetch()
        except BaseException as error:  # the engine could not fetch it: the call failed
            item.fail(error)
        if not item.resolved:
            item.fail(RuntimeError("synkhronos: a call's outputs were fetched but did not come"))

    def _sink(self, future: Future[Any], deferred: Deferred) -> Callable[[bool, Any], None]:
        def sink(ok: bool, value: Any) -> None:
            self._settle(future, ok, value, deferred)

        return sink

    def _settle(self, future: Future[Any], ok: bool, value: Any, deferred: Deferred | None = None) -> None:
        """A call's outcome: its future completes; a failure cancels the calls submitted so far."""
        if deferred is not None:
            with self._cond:
                self._open.remove(deferred)
        if ok:
            future.set_result(value)
        else:
            failure = value
            if isinstance(value, CancelledError) and value.__cause__ is not None:
                failure = value.__cause__  # cancelled by an earlier call's failure (a pipelined call)
            with self._cond:
                self._cancel_upto = self._seq
                self._failure = failure
            future.set_exception(value)
        self._finished()

    def _finished(self) -> None:
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()
        self._slots.release()
