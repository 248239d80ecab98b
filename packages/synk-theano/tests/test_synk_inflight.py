"""Calls in flight (:meth:`synkhronos.Function.submit`, :mod:`synkhronos.inflight`): futures give
what synchronous calls give, in order against every other operation; a failing call cancels the
calls queued behind it and leaves the group usable; a worker killed with calls in flight fails
them within seconds, leaving no worker and no shared memory behind (the ``ranks`` fixture checks
both when it closes)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from synk_testutil import worker_pids

import synkhronos as synk
from synkhronos import inflight, ops
from synkhronos.inflight import Window
from synkhronos.runtime import current

FLOAT = pytensor.config.floatX


@contextlib.contextmanager
def wide_window(depth: int = 8) -> Iterator[Window]:
    """The running group's window replaced by a deeper one, so that a test can queue calls behind a
    gate (a first item that waits for an event) without blocking its own thread."""
    rt = current()
    old, rt.window = rt.window, Window(depth)
    try:
        yield rt.window
    finally:
        rt.window.close()
        rt.window = old


def _gated(window: Window) -> threading.Event:
    gate = threading.Event()
    window.submit(lambda: gate.wait(30))
    return gate


def _train_step(w: pt.sharedvar.SharedVariable) -> synk.Function:
    x, y = pt.matrix("x"), pt.vector("y")
    loss = pt.mean((x.dot(w) - y) ** 2)
    update = w - 0.05 * ops.all_reduce(pytensor.grad(loss, w), "avg")
    return synk.function([x, y], outputs=loss, updates=[(w, update)])


def test_futures_equal_synchronous_calls(ranks):
    rng = np.random.default_rng(0)
    x = synk.data(rng.normal(size=(25, 3)).astype(FLOAT))
    y = synk.data(rng.normal(size=25).astype(FLOAT))
    w0 = np.array([0.1, -0.2, 0.3], dtype=FLOAT)
    w = pytensor.shared(w0.copy(), name="w")
    step = _train_step(w)
    batches = [np.sort(rng.choice(25, size=10, replace=False)) for _ in range(100)]
    sync = [step(x, y, batch=b) for b in batches]
    w_sync = [synk.get_value(r, w) for r in range(ranks)]
    w.set_value(w0)
    synk.broadcast(w)
    futures = [step.submit(x, y, batch=b) for b in batches]
    submitted = [f.result() for f in futures]
    assert all(np.array_equal(a, b) for a, b in zip(sync, submitted))
    for r in range(ranks):
        assert np.array_equal(synk.get_value(r, w), w_sync[r])
        assert np.array_equal(w_sync[r], w_sync[0])
    # the reference: full-batch gradient descent in numpy, the same 100 steps
    ref, xs, ys = w0.astype(np.float64), np.asarray(x.data, np.float64), np.asarray(y.data, np.float64)
    for b in batches:
        ref = ref - 0.05 * 2 * xs[b].T @ (xs[b] @ ref - ys[b]) / len(b)
    np.testing.assert_allclose(w_sync[0], ref, rtol=1e-4 if FLOAT == "float32" else 1e-9)


def test_operations_come_after_pending_calls(ranks):
    c = pytensor.shared(np.zeros(2, dtype=FLOAT), name="c")
    x = pt.matrix("x")
    inc = synk.function([x], outputs=(x.sum(), "sum"), updates=[(c, c + 1)])
    ones = synk.data(np.ones((6, 2), dtype=FLOAT))
    with wide_window() as window:
        gate = _gated(window)
        pending = [inc.submit(ones) for _ in range(5)]
        gate.set()
        got = [synk.get_value(r, c) for r in range(ranks)]  # waits for the five calls
        assert all(f.done() for f in pending)
        assert all(np.array_equal(v, np.full(2, 5.0)) for v in got)
        pending = [inc.submit(ones) for _ in range(3)]
        synk.all_reduce(c, "sum")  # after the three: every rank holds 8, summed over the ranks
        assert np.array_equal(synk.get_value(0, c), np.full(2, 8.0 * ranks))
        synk.set_value(0, c, np.zeros(2, dtype=FLOAT))
        synk.broadcast(c)
        gate = _gated(window)
        early = inc.submit(ones)
        opener = threading.Timer(0.2, gate.set)  # opens the gate while set_value waits
        opener.start()
        ones.set_value(np.full((6, 2), 2.0, dtype=FLOAT))  # waits for ``early``, which reads the old rows
        opener.join()
        assert early.done() and float(early.result()) == 12.0
        assert float(inc(ones)) == 24.0
        assert np.array_equal(synk.get_value(ranks - 1, c), np.full(2, 2.0))


def test_a_failing_call_cancels_the_queue_and_leaves_the_group_usable(ranks):
    x = pt.matrix("x")
    f = synk.function([x], outputs=(x.sum(axis=0), "sum"))
    d = synk.data(np.arange(12, dtype=FLOAT).reshape(6, 2))
    with pytest.raises(ValueError) as sync_error:
        f(d, batch=[0, 99])
    with wide_window() as window:
        gate = _gated(window)
        before = [f.submit(d) for _ in range(2)]
        bad = f.submit(d, batch=[0, 99])
        after = [f.submit(d, batch=2) for _ in range(3)]
        gate.set()
        expected = np.arange(12).reshape(6, 2).sum(axis=0)
        assert all(np.array_equal(b.result(), expected) for b in before)
        with pytest.raises(ValueError) as error:
            bad.result()
        assert type(error.value) is type(sync_error.value) and str(error.value) == str(sync_error.value)
        for a in after:
            with pytest.raises(CancelledError) as cancelled:
                a.result()
            assert cancelled.value.__cause__ is error.value
        assert np.array_equal(f.submit(d, batch=2).result(), np.array([2.0, 4.0]))
    assert np.array_equal(f(d), expected)


def test_a_call_failing_in_the_workers_mid_window(ranks):
    """A failure that the workers find (a ``batch_s`` index beyond the sliceable rows) while the call
    before it is pipelined on the JAX engine: that call completes, the failing one raises what the
    synchronous call raises, the ones behind it are cancelled and change nothing."""
    s = pytensor.shared(np.arange(8.0, dtype=FLOAT).reshape(4, 2), name="s")
    c = pytensor.shared(np.zeros((), dtype=FLOAT), name="c")
    g = synk.function([], outputs=(s.sum(), "sum"), updates=[(c, c + 1)], sliceable_shareds=[s])
    with pytest.raises(synk.SelectionError) as sync_error:
        g(batch_s=[0, 1, 99])
    with wide_window() as window:
        gate = _gated(window)
        before = [g.submit(batch_s=slice(1, 3)) for _ in range(2)]
        bad = g.submit(batch_s=[0, 1, 99])
        after = [g.submit(batch_s=slice(0, 2)) for _ in range(2)]
        gate.set()
        assert [float(b.result()) for b in before] == [ranks * 14.0] * 2
        with pytest.raises(synk.SelectionError) as error:
            bad.result()
        assert str(error.value) == str(sync_error.value)
        for a in after:
            with pytest.raises(CancelledError) as cancelled:
                a.result()
            assert cancelled.value.__cause__ is error.value
        assert float(g.submit(batch_s=slice(0, 2)).result()) == ranks * 6.0
    assert all(float(synk.get_value(r, c)) == 3.0 for r in range(ranks))


def test_a_call_failing_while_it_runs_cancels_the_call_dispatched_behind_it(ranks):
    """A call whose computation fails in every rank (on the JAX engine a host callback inside its
    program: on GPUs seen when its outputs are read, while the next call's command runs and that
    call is dispatched already; JAX's CPU device raises it when dispatching): its future raises
    what the synchronous call raises, the calls behind it are cancelled, and the group goes on."""
    if current().driver.name != "jax":
        pytest.skip("the per-rank engine's failures: test_a_failing_call_cancels_the_queue_...")
    from synk_engine_ops import Stall

    x = pt.vector("x")
    fails = x
    for r in range(ranks):  # each rank's own Stall raises on a negative sum
        fails = Stall(0.0, fail_rank=r)(fails)
    f = synk.function([x], outputs=(fails.sum(), "sum"))
    good, bad = synk.data(np.ones(2 * ranks, dtype=FLOAT)), synk.data(-np.ones(2 * ranks, dtype=FLOAT))
    assert float(f(good)) == 2.0 * ranks
    with pytest.raises(Exception) as sync_error:
        f(bad)
    with wide_window() as window:
        gate = _gated(window)
        before = [f.submit(good) for _ in range(2)]
        failing = f.submit(bad)
        after = [f.submit(good) for _ in range(2)]
        gate.set()
        assert [float(b.result()) for b in before] == [2.0 * ranks] * 2
        with pytest.raises(Exception) as error:
            failing.result()
        assert type(error.value) is type(sync_error.value) and "fails on purpose" in str(error.value)
        for a in after:
            with pytest.raises(CancelledError) as cancelled:
                a.result()
            assert cancelled.value.__cause__ is error.value
        assert float(f.submit(good).result()) == 2.0 * ranks
    assert float(f(good)) == 2.0 * ranks


def test_jax_engine_pipelines_submitted_calls(ranks, monkeypatch):
    """On the JAX engine a submitted call's command brings back the call before it: after two
    submits, the first is done while the second's outputs are still held by the workers (fetched
    when someone waits, or after IDLE_FETCH_S without a new call)."""
    rt = current()
    if rt.driver.name != "jax":
        pytest.skip("the per-rank engine runs submitted calls one by one")
    x = pt.matrix("x")
    f = synk.function([x], outputs=(x.sum(), "sum"))
    d = synk.data(np.ones((4, 2), dtype=FLOAT))
    monkeypatch.setattr(inflight, "IDLE_FETCH_S", 30.0)
    first, second = f.submit(d), f.submit(d)
    assert float(first.result(timeout=10)) == 8.0
    time.sleep(0.05)  # the dispatch thread is idle now, holding the second call pipelined
    assert not second.done() and rt.engine.pipelined is not None
    assert float(second.result(timeout=10)) == 8.0 and rt.engine.pipelined is None
    monkeypatch.setattr(inflight, "IDLE_FETCH_S", 0.01)
    third = f.submit(d)
    done, _ = concurrent.futures.wait([third], timeout=10)  # no result(): fetched after the idle time
    assert third in done and float(third.result()) == 8.0


def test_submitted_collectives_run_in_order_with_the_calls(ranks):
    """``synk.<collective>.submit``: the same values as the synchronous sequence, in submission order
    with the calls (each rank adds its own rows' sum, the all-reduce makes the ranks agree)."""
    x = pt.matrix("x")
    c = pytensor.shared(np.zeros(2, dtype=FLOAT), name="c_sub")
    add = synk.function([x], outputs=(x.sum(), "sum"), updates=[(c, c + x.sum(axis=0))])
    d = synk.data(np.arange(2 * 7, dtype=FLOAT).reshape(7, 2))

    def sequence(submit: bool) -> list[np.ndarray]:
        synk.set_value(0, c, np.zeros(2, dtype=FLOAT))
        synk.broadcast(c)
        run = (lambda fn, *a, **k: fn.submit(*a, **k)) if submit else (lambda fn, *a, **k: fn(*a, **k))
        got = []
        for _ in range(3):
            got.append(run(add, d))
            got.append(run(synk.all_reduce, c, op="sum"))
            got.append(run(synk.gather, c))
        got = [g.result(timeout=30) if submit else g for g in got]
        return [*got, *(synk.get_value(r, c) for r in range(ranks))]

    sync, submitted = sequence(False), sequence(True)
    assert all(a is None and b is None if a is None else np.array_equal(a, b) for a, b in zip(sync, submitted))
    # the reference: each rank adds its own rows, then every rank holds the sum over the ranks
    ref = np.zeros(2)
    for _ in range(3):
        ref = ranks * ref + np.asarray(d.data, np.float64).sum(axis=0)
    for r in range(ranks):
        np.testing.assert_allclose(submitted[-ranks + r], ref)


def test_a_submitted_collective_that_fails_leaves_the_group_usable(ranks):
    c = pytensor.shared(np.ones(3, dtype=FLOAT), name="c_fail")
    synk.function([], outputs=(c.sum(), "sum"))()
    with pytest.raises(ValueError) as sync_error:
        synk.all_reduce(c, op="median")
    bad = synk.all_reduce.submit(c, op="median")
    with pytest.raises(ValueError) as error:
        bad.result(timeout=30)
    assert str(error.value) == str(sync_error.value)
    assert synk.all_reduce.submit(c, op="sum").result(timeout=30) is None
    assert np.array_equal(synk.get_value(ranks - 1, c), np.full(3, float(ranks)))


def test_jax_engine_queues_submitted_all_reduces_and_asks_shapes_once(ranks, monkeypatch):
    """On the JAX engine a submitted all-reduce is done once the workers have queued it (each keeps
    at most QUEUED_COLLECTIVES unfinished; a pipelined call held before it comes back with its
    command); a loop of all-reduces asks the ranks' shapes once, and a call in between makes them
    ask again (it may have changed a shape: here it does, per rank)."""
    rt = current()
    if rt.driver.name != "jax":
        pytest.skip("the per-rank engine runs submitted collectives one by one")
    c = pytensor.shared(np.ones(4, dtype=FLOAT), name="c_pipe")
    total = synk.function([], outputs=(c.sum(), "sum"))
    total()
    synk.all_reduce(c, "sum")
    before = rt.group.commands
    for _ in range(3):
        synk.all_reduce(c, "sum")
    assert rt.group.commands - before == 3  # one command each: the shapes are known equal
    monkeypatch.setattr(inflight, "IDLE_FETCH_S", 30.0)
    held = total.submit()  # pipelined: its outputs stay in the workers
    futures = [synk.all_reduce.submit(c, op="sum") for _ in range(5)]
    assert float(held.result(timeout=10)) == 4.0 * ranks ** 4 * ranks  # came back with the first all-reduce
    assert all(f.result(timeout=10) is None for f in futures)
    assert rt.engine.pipelined is None
    np.testing.assert_allclose(synk.get_value(0, c), np.full(4, float(ranks) ** 9))
    np.testing.assert_allclose(synk.get_value(ranks - 1, c), np.full(4, float(ranks) ** 9))
    x = pt.vector("x")
    take = synk.function([x], updates=[(c, x)])  # each rank keeps its own rows: 3 and 2 of 5 (2 ranks)
    take(synk.data(np.arange(2 * ranks + 1, dtype=FLOAT)))
    with pytest.raises(ValueError, match="same shape"):
        synk.all_reduce(c, "sum")
    with pytest.raises(ValueError, match="same shape"):
        synk.all_reduce.submit(c, op="sum").result(timeout=10)
    synk.broadcast(c)
    synk.all_reduce(c, "sum")


def test_window_orders_deferred_calls_and_cancels_after_a_late_failure():
    """The window alone, with a fake engine: a deferred call resolved by the next call's command
    completes first; a deferred call that fails when the next call runs fails with its error, that
    next call raises CancelledError chained to it, and the rest are cancelled."""
    window = Window(5)  # the gate and four calls
    held: list[tuple[int, inflight.Deferred]] = []
    boom = RuntimeError("call 2 failed on the device")

    def call(i: int):
        def run():
            if held:
                j, d = held.pop()
                if j == 2:
                    d.fail(boom)
                    raise CancelledError("cancelled") from boom
                d.resolve(j)
            d = inflight.Deferred(lambda: held and held.pop()[1].resolve(-1))
            held.append((i, d))
            return d.then(lambda v: v * 10)
        return run

    gate = _gated(window)
    futures = [window.submit(call(i)) for i in range(1, 5)]
    gate.set()
    assert futures[0].result(timeout=10) == 10
    with pytest.raises(RuntimeError) as error:
        futures[1].result(timeout=10)
    assert error.value is boom
    for f in futures[2:]:
        with pytest.raises(CancelledError) as cancelled:
            f.result(timeout=10)
        assert cancelled.value.__cause__ is boom
    assert window.submit(call(5)).result(timeout=10) == -10  # fetched: the group goes on
    window.close()


def test_max_in_flight_is_checked_and_bounds_the_window():
    with pytest.raises(ValueError, match="max_in_flight"):
        Window(0)
    window = Window(2)
    gate = threading.Event()
    started = [window.submit(gate.wait) for _ in range(2)]
    blocked = threading.Thread(target=lambda: window.submit(lambda: None))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive() and window.pending == 2  # submit waits while two are pending
    gate.set()
    blocked.join(10)
    assert not blocked.is_alive() and all(f.result() for f in started)
    window.close()


def test_worker_killed_with_calls_in_flight(ranks, monkeypatch):
    """Last in the module: it ends the group (the fixture then checks that no worker process and
    no shared-memory object is left).  On the JAX engine a first call is held pipelined in the
    workers when the worker dies: it fails with WorkerDiedError and every call behind it is
    cancelled; on the per-rank engine the first queued call fails."""
    x = pt.matrix("x")
    f = synk.function([x], outputs=(x.sum(), "sum"))
    d = synk.data(np.ones((8, 2), dtype=FLOAT))
    assert float(f(d)) == 16.0
    rt = current()
    if rt.driver.name == "jax":  # the default window: one call held by the workers, the next one sent
        monkeypatch.setattr(inflight, "IDLE_FETCH_S", 30.0)
        held = f.submit(d)
        deadline = time.monotonic() + 10
        while rt.engine.pipelined is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rt.engine.pipelined is not None and not held.done()
        os.kill(worker_pids()[-1], signal.SIGKILL)
        t0 = time.monotonic()
        behind = f.submit(d)
        with pytest.raises(synk.WorkerDiedError):
            held.result(timeout=5)
        with pytest.raises(CancelledError):
            behind.result(timeout=5)
        assert time.monotonic() - t0 < 5
    else:
        with wide_window() as window:
            gate = _gated(window)
            pending = [f.submit(d) for _ in range(4)]
            os.kill(worker_pids()[-1], signal.SIGKILL)
            t0 = time.monotonic()
            gate.set()
            with pytest.raises(synk.WorkerDiedError):
                pending[0].result(timeout=5)
            for p in pending[1:]:
                with pytest.raises(CancelledError):
                    p.result(timeout=5)
            assert time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match="closed"):
        f.submit(d)
