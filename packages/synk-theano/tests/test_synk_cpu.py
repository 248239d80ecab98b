"""CPU mode's backend, cores and rank count (synkhronos.cpu, synk_comm.cores), with real workers.

Every result is checked against plain PyTensor in PyTensor's default mode (or numpy); no timing.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from synk_testutil import TIMEOUT, USE_GPU, TwiceInPython, assert_no_workers_left, own_entries, worker_pids

import synkhronos as synk
from synk_comm import WorkerError, cores
from synkhronos import blas, cpu, ops, rank_functions
from synkhronos.runtime import current

pytestmark = [pytest.mark.timeout(TIMEOUT),
              pytest.mark.skipif(USE_GPU, reason="CPU mode only: the CPU backend, pinning and rank count")]
needs_jax = pytest.mark.skipif(not cpu.jax_importable(), reason="JAX is not installed (synk-theano[cpu])")
needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")


@pytest.fixture(autouse=True)
def closed_after():
    yield
    synk.close()


@pytest.fixture
def default_backend_choice(monkeypatch):
    """No backend forced and no mode chosen by the environment: synkhronos's own choice."""
    monkeypatch.delenv(cpu.BACKEND_ENV, raising=False)
    flags = ",".join(f for f in os.environ.get("PYTENSOR_FLAGS", "").split(",") if not f.startswith("mode="))
    monkeypatch.setenv("PYTENSOR_FLAGS", flags)


def worker_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def regression_step() -> tuple[list, object, object, object]:
    """A least-squares SGD step with outputs and updates of shared variables (a reduction, an
    ``arange`` index longer than 127 rows as in a cross-entropy)."""
    rng = np.random.default_rng(3)
    w = pytensor.shared(rng.standard_normal((4, 3)), name="w")
    b = pytensor.shared(np.zeros(3), name="b")
    x, y = pt.matrix("x"), pt.ivector("y")
    scores = x @ w + b
    logp = pt.special.log_softmax(scores, axis=1)
    loss = -pt.mean(logp[pt.arange(y.shape[0]), y])
    gw, gb = pytensor.grad(loss, [w, b])
    return [x, y], loss, [(w, w - 0.5 * gw), (b, b - 0.5 * gb)], (w, b)


def data(n_rows: int = 300) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    return rng.standard_normal((n_rows, 4)), rng.integers(0, 3, n_rows).astype("int32")


@needs_jax
def test_jax_backend_computes_as_plain_pytensor(default_backend_choice):
    """Each rank compiles in JAX mode; the output and the averaged updates of shared variables
    equal plain PyTensor's (default mode) on the whole batch (even halves: the mean of the
    halves' losses and gradients is the whole batch's)."""
    xd, yd = data()
    ref_inputs, ref_loss, ref_updates, (ref_w, ref_b) = regression_step()
    reference = pytensor.function(ref_inputs, ref_loss, updates=ref_updates, mode="FAST_RUN")
    expected = float(reference(xd, yd))

    inputs, loss, updates, (w, b) = regression_step()  # the same start, other shared variables
    synk.fork(2, use_gpu=False)
    f = synk.function(inputs, outputs=(loss, "avg"), updates=updates)
    got = float(f(synk.data(xd), synk.data(yd)))
    assert current().device.backend == "jax"
    assert f._replica.full().mode == "JAX"  # the master's share ran in JAX mode
    if len(os.sched_getaffinity(0)) == 2 and cpu.pinning_enabled() and blas.available():  # a core each: the BLAS
        assert any(isinstance(node.op, blas.BlasDot) for node in f._replica.full().fn.maker.fgraph.apply_nodes)
    for pid in worker_pids():
        assert worker_environ(pid)[cpu.BACKEND_ENV] == "jax"
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    synk.all_reduce([w, b], op="avg")
    for var, ref in ((w, ref_w), (b, ref_b)):
        value = var.get_value()
        assert isinstance(value, np.ndarray) and value.dtype == np.float64
        np.testing.assert_allclose(value, ref.get_value(), rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(synk.get_value(1, var), value)


def all_reduced_step(n_ranks: int) -> tuple:
    """The regression step with its gradients all-reduced (avg) in the graph, in a fork of
    ``n_ranks`` CPU ranks, and plain PyTensor's full-batch step as its reference:
    ``(f, params, reference, reference_params, (x_data, y_data), (xs, ys))``."""
    from synkhronos import ops

    xd, yd = data()
    ref_inputs, ref_loss, _, ref_params = regression_step()
    ref_grads = pytensor.grad(ref_loss, list(ref_params))
    reference = pytensor.function(ref_inputs, ref_loss,
                                  updates=[(v, v - 0.5 * g) for v, g in zip(ref_params, ref_grads)])
    inputs, loss, _, params = regression_step()
    grads = [ops.all_reduce(g, "avg") for g in pytensor.grad(loss, list(params))]
    synk.fork(n_ranks, use_gpu=False)
    f = synk.function(inputs, outputs=(loss, "avg"), updates=[(v, v - 0.5 * g) for v, g in zip(params, grads)])
    return f, params, reference, ref_params, (synk.data(xd), synk.data(yd)), (xd, yd)


def in_program_available() -> bool:
    from synk_comm import xla_cpu

    return cpu.jax_importable() and xla_cpu.available()


needs_in_program = pytest.mark.skipif(not in_program_available(),
                                      reason="needs JAX and a C++ compiler (synk_comm.xla_cpu)")


@needs_jax
@pytest.mark.parametrize("in_program", [True, False], ids=["in_program", "SYNK_CPU_IN_PROGRAM=0"])
def test_a_graph_of_in_graph_all_reduces_runs_them_in_program_or_in_the_default_mode(default_backend_choice,
                                                                                     monkeypatch, in_program):
    """With a C++ compiler the all-reduces run inside each rank's JAX program (synk_comm.xla_cpu);
    with ``SYNK_CPU_IN_PROGRAM=0`` the graph compiles in the default mode and they run through
    ``perform`` (never as JAX host callbacks on a pinned rank's one XLA thread).  Either way the
    step equals plain PyTensor's full-batch step (the all-reduced avg gradient), 300 calls without
    a stall."""
    if in_program and not in_program_available():
        pytest.skip("needs a C++ compiler (synk_comm.xla_cpu)")
    if not in_program:
        monkeypatch.setenv(cpu.IN_PROGRAM_ENV, "0")
    f, params, reference, ref_params, datas, arrays = all_reduced_step(2)
    for _ in range(300):
        got = float(f(*datas))
        expected = float(reference(*arrays))
    device = current().device
    assert device.backend == "jax" and (device.all_reduce_segment is not None) == in_program
    assert (getattr(f._replica.full(), "mode", None) == "JAX") == in_program
    if in_program:  # the ranks met in the segment: 300 calls of 2 all-reduces
        assert device.all_reduce_segment._counters[0].tolist() == [600, 600]
    np.testing.assert_allclose(got, expected, rtol=1e-9)
    for var, ref in zip(params, ref_params):
        np.testing.assert_allclose(var.get_value(), ref.get_value(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(synk.get_value(1, var), ref.get_value(), rtol=1e-9, atol=1e-12)


@pytest.mark.process
@needs_in_program
def test_ranks_pair_in_program_when_jax_copies_their_inputs_on_its_own_thread(default_backend_choice):
    """The main job's step in small: each call gathers 512 float32 rows of 64 a rank (128 KB)
    by ``batch=`` indices.  JAX copies such an input on a thread of its own and sometimes runs the
    program there after the call has returned (seen with jaxlib 0.10: the main job hung); every
    rank still takes part in each all-reduce (its weight stays set until its program has run)
    and the parameters follow plain numpy's full-batch gradient steps."""
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((1258, 64)).astype("float32")
    w = pytensor.shared(np.zeros((64, 10), "float32"), name="w")
    x = pt.matrix("x", dtype="float32")
    loss = pt.mean((x @ w - 1) ** 2)
    grad = ops.all_reduce(pytensor.grad(loss, w), "avg")
    synk.fork(2, use_gpu=False)
    step = synk.function([x], outputs=(loss, "avg"), updates=[(w, w - np.float32(0.01) * grad)])
    data_x = synk.data(xs)
    w_ref = np.zeros((64, 10))
    for _ in range(300):
        batch = rng.permutation(len(xs))[:1024]
        step(data_x, batch=batch)
        rows = xs[batch].astype(np.float64)
        w_ref -= 0.01 * rows.T @ (2 * (rows @ w_ref - 1)) / (len(rows) * 10)
    assert current().device.all_reduce_segment._counters[0].tolist() == [300, 300]
    np.testing.assert_allclose(w.get_value(), w_ref, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(synk.get_value(1, w), w.get_value())


@pytest.mark.process
@needs_jax
@pytest.mark.parametrize("with_output", [False, True], ids=["updates only", "an output too"])
def test_a_function_reads_its_data_before_the_call_returns(default_backend_choice, with_output):
    """A function of updates (and an output or not), its Data rewritten right after each call (a
    training loop filling one buffer with the next batch): each call sums the rows it was given.
    JAX copies an input of more than 100 KB on a thread of its own (jaxlib 0.10), so a rank's
    program ends before the call returns (before, a function without outputs summed some of the
    next call's rows)."""
    rows = 2 * 30001  # 120 KB of float32 a rank; rank 1's rows start off a 64-byte boundary
    x = pt.vector("x", dtype="float32")
    total = pytensor.shared(np.zeros((), "float32"), name="total")
    synk.fork(2, use_gpu=False)
    count = synk.function([x], outputs=(x.sum(), "sum") if with_output else None,
                          updates=[(total, total + x.sum())])
    data_x = synk.data(np.zeros(rows, "float32"))
    expected = 0
    for k in range(200):
        data_x[:] = k % 2
        out = count(data_x)
        expected += (k % 2) * rows
        if with_output:
            assert float(out) == (k % 2) * rows
    assert float(total.get_value()) + float(synk.get_value(1, total)) == expected


def stalled_sum(fail_rank: int, seconds: float = 0.0) -> Any:
    """``f(x)``: the sum of ``x`` over the ranks, all-reduced inside the program after a host step
    (:class:`synk_engine_ops.Stall`) that waits ``seconds`` and, in rank ``fail_rank`` only, raises
    where its rows sum below 0."""
    from synk_engine_ops import Stall

    x = pt.vector("x")
    return synk.function([x], outputs=(ops.all_reduce(Stall(seconds, fail_rank)(x).sum(), "sum"), "max"))


@pytest.mark.process
@needs_in_program
def test_a_rank_that_fails_inside_its_program_stops_the_call_and_the_next_call_pairs_the_ranks_again(
        default_backend_choice):
    """Rank 2 raises inside its program before the all-reduce that ranks 0 and 1 wait in: they stop
    (the group's abort word), the master raises rank 2's error, and the next calls are right (the
    segment's counters realigned)."""
    synk.fork(3, use_gpu=False)
    f = stalled_sum(fail_rank=2)
    xd = np.arange(1.0, 10.0)
    assert float(f(synk.data(xd))) == pytest.approx(xd.sum())
    with pytest.raises(WorkerError, match="fails on purpose") as info:
        f(synk.data(-xd))
    assert [e.rank for e in info.value.errors] == [2]
    for k in range(3):  # each call pairs the ranks' all-reduces again
        assert float(f(synk.data(xd + k))) == pytest.approx((xd + k).sum())
    assert getattr(f._replica.full(), "mode", None) == "JAX"


@pytest.mark.process
@needs_in_program
def test_a_worker_killed_inside_its_program_fails_the_call_quickly(default_backend_choice):
    """The master waits in the all-reduce for a worker that is killed before it gets there: the wait
    ends (a peer's process is gone), the call raises WorkerDiedError within seconds, nothing of the
    group is left, and a new group works."""
    synk.fork(2, use_gpu=False)
    prefix = current().group.prefix
    f = stalled_sum(fail_rank=-2, seconds=3.0)
    xd = np.arange(4.0)
    victim = worker_pids()[0]
    timer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
    t0 = time.monotonic()
    timer.start()
    with pytest.raises(synk.WorkerDiedError, match="died"):
        f(synk.data(xd))
    timer.join()
    assert time.monotonic() - t0 < 8
    synk.close()
    assert_no_workers_left()
    assert own_entries(prefix) == []
    synk.fork(2, use_gpu=False)
    assert float(stalled_sum(fail_rank=-2)(synk.data(xd))) == pytest.approx(xd.sum())


@needs_jax
def test_with_one_rank_a_graph_with_in_graph_collectives_compiles_in_jax(default_backend_choice):
    """One rank: the collectives are the identity, so the graph keeps the JAX backend (in the default
    mode the benchmark MLP's step was 3.6x slower than plain PyTensor JAX), and the step equals plain
    PyTensor's; synk_lasagne's train function takes it (no chain)."""
    from synk_lasagne import make_train_function, updates

    f, params, reference, ref_params, datas, arrays = all_reduced_step(1)
    for _ in range(3):
        np.testing.assert_allclose(float(f(*datas)), float(reference(*arrays)), rtol=1e-9)
    assert f._replica.full().mode == "JAX"
    for var, ref in zip(params, ref_params):
        np.testing.assert_allclose(var.get_value(), ref.get_value(), rtol=1e-9, atol=1e-12)
    inputs, loss, _, params = regression_step()
    train = make_train_function(loss, params, inputs, updates.sgd, learning_rate=0.5)
    train(*datas)
    assert train.function._replica.full().mode == "JAX"


@needs_jax
def test_an_op_without_jax_falls_back_to_the_default_mode_and_still_matches(default_backend_choice, caplog):
    xd = np.arange(24.0).reshape(8, 3)
    x = pt.matrix("x")
    s = pytensor.shared(np.ones(3), name="s")
    out = TwiceInPython()(x).sum(axis=0)
    synk.fork(2, use_gpu=False)
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        f = synk.function([x], outputs=(out, "sum"), updates=[(s, s + TwiceInPython()(x).sum())], name="twice")
        got = f(synk.data(xd))
    np.testing.assert_allclose(got, 2 * xd.sum(axis=0))
    assert f._replica.full().mode == "default"
    assert any("twice" in r.getMessage() and "default mode" in r.getMessage() for r in caplog.records)
    halves = np.array_split(xd, 2)
    for r in range(2):
        np.testing.assert_allclose(synk.get_value(r, s), 1 + 2 * halves[r].sum())


@needs_jax
@pytest.mark.parametrize("why", ["fallback", "collectives", "own mode"])
def test_a_function_of_another_mode_reads_shared_values_that_a_jax_function_updated(default_backend_choice, why,
                                                                                   monkeypatch):
    """A JAX-mode function leaves JAX arrays in the shared variables it updates; a function of the
    default mode -- fallen back (an Op without JAX), compiled apart (in-graph collectives), or of
    the user's own mode -- reads them as numpy (seen: the main job's CNN, whose dropout keeps its
    gradient function in the default mode while the update rule runs in JAX, raised Numba's
    "Unknown attribute 'shape' of type readonly buffer")."""
    monkeypatch.setenv(cpu.IN_PROGRAM_ENV, "0")  # else the all-reduce runs in the JAX program
    xd = np.arange(24.0).reshape(8, 3)
    x = pt.matrix("x")
    w = pytensor.shared(np.ones(3), name="w")
    synk.fork(2, use_gpu=False)
    scale = synk.function([], updates=[(w, 2 * w + 1)], name="scale")
    column_sums = {"fallback": lambda: TwiceInPython()(x).sum(axis=0) / 2,
                   "collectives": lambda: ops.all_reduce(x.sum(axis=0), "sum") / 2,
                   "own mode": lambda: x.sum(axis=0)}[why]()
    kwargs = {"mode": "FAST_RUN"} if why == "own mode" else {}
    other = synk.function([x], outputs=(column_sums * w, "sum"), updates=[(w, w - 1)], name="other", **kwargs)
    expected_w = np.ones(3)
    for _ in range(3):
        scale()
        expected_w = 2 * expected_w + 1
        np.testing.assert_allclose(other(synk.data(xd)), xd.sum(axis=0) * expected_w)  # each way: summed over ranks
        expected_w = expected_w - 1
    assert scale._replica.full().mode == "JAX" and getattr(other._replica.full(), "mode", None) != "JAX"
    for r in range(2):
        np.testing.assert_allclose(synk.get_value(r, w), expected_w)


@needs_jax
def test_jax_functions_read_large_shared_values_in_place(default_backend_choice, monkeypatch):
    """Backend JAX: a JAX-mode function reads a large shared value that it does not update (here a
    rank's scattered rows) in place, lent to it for the call: the variable holds numpy before and
    after, a function of another mode reads it as it is, ``get_value`` gives numpy, and a value
    changed in place (an all-reduce) is what the next call reads."""
    import jax

    monkeypatch.setattr(rank_functions, "LEND_BYTES", 64)
    rows = np.arange(60.0).reshape(20, 3)
    x = pytensor.shared(np.zeros((0, 3)), name="rows")
    w = pt.vector("w")
    synk.fork(2, use_gpu=False)
    in_jax = synk.function([], bcast_inputs=[w], outputs=((x @ w).sum(), "sum"), sliceable_shareds=[x], name="in_jax")
    in_c = synk.function([], bcast_inputs=[w], outputs=((x @ w).sum(), "sum"), sliceable_shareds=[x], mode="FAST_RUN",
                         name="in_c")
    synk.scatter(x, rows)
    seen = []
    lend = rank_functions.lend_to_jax
    monkeypatch.setattr(rank_functions, "lend_to_jax", lambda cells: seen.append(lend(cells)) or seen[-1])
    wd = synk.data(np.array([1.0, 2.0, 3.0]))
    for f in (in_jax, in_c, in_jax):
        np.testing.assert_allclose(f(wd), (rows @ [1.0, 2.0, 3.0]).sum())
    assert in_jax._replica.full().mode == "JAX"
    assert seen and all(isinstance(view, jax.Array) for lent in seen for _, _, view in lent) and seen[0]
    assert type(x.container.storage[0]) is np.ndarray and type(x.get_value()) is np.ndarray
    synk.all_reduce(x, "sum")  # in place, in each rank: both halves of the rows added
    halves = rows[:10] + rows[10:]
    np.testing.assert_allclose(in_jax(wd), 2 * (halves @ [1.0, 2.0, 3.0]).sum())
    np.testing.assert_array_equal(synk.get_value(1, x), halves)


def test_jax_or_default_recompiles_when_a_jax_call_fails_and_reruns_the_call():
    """A function that JAX compiles but cannot run (here: raises on its first call) falls back
    once; later calls use the default-mode function."""
    built = []

    def compile_fn(mode):
        built.append(mode)
        if mode == "JAX":
            def broken(*args):
                raise TypeError("JAX cannot trace this")
            broken.maker = None  # type: ignore[attr-defined]
            return _Fn(broken)
        return _Fn(lambda a: a + 1)

    wrapped = rank_functions.JaxOrDefault.__new__(rank_functions.JaxOrDefault)
    wrapped._compile_fn, wrapped._name, wrapped._trust_input, wrapped.mode = compile_fn, "f", True, "JAX"
    wrapped._fall_back_on_run = True
    wrapped.fn = compile_fn("JAX")
    assert wrapped(1) == 2 and wrapped(5) == 6
    assert built == ["JAX", None] and wrapped.mode == "default" and wrapped.fn.trust_input is True


class _Fn:
    def __init__(self, call):
        self.call, self.trust_input = call, False

    def __call__(self, *args):
        return self.call(*args)


@pytest.mark.process
@needs_two_cores
def test_ranks_run_on_disjoint_cores_with_their_thread_pools_sized_to_them(default_backend_choice, monkeypatch):
    for var in cores.THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    before = os.sched_getaffinity(0)
    available = cores.available()
    synk.fork(2, use_gpu=False)
    sets = cores.split(available, 2)
    assert os.sched_getaffinity(0) == set(sets[0])  # the master: rank 0's set
    (pid,) = worker_pids()
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    assert len(tids) > 1  # its interpreter's threads, the master watch, any pools
    for tid in tids:
        assert os.sched_getaffinity(tid) == set(sets[1]), tid
    env = worker_environ(pid)
    assert env["SYNK_CORES"] == ",".join(map(str, sets[1]))
    for var in cores.THREAD_VARS:
        assert env[var] == str(len(sets[1])), var
    assert not set(sets[0]) & set(sets[1])
    xd = np.arange(12.0).reshape(6, 2)
    x = pt.matrix("x")
    np.testing.assert_allclose(synk.function([x], outputs=(x.sum(), "sum"))(synk.data(xd)), xd.sum())
    synk.close()
    assert os.sched_getaffinity(0) == before  # the master's cores back


class AsyncDispatchOf(Op):
    """One row per call: 1.0 where this process's JAX dispatches CPU calls asynchronously, else 0.0
    (Python only, no JAX implementation: CPU mode's JAX backend runs it in the default mode)."""

    __props__ = ()

    def make_node(self, x: Any) -> Apply:
        return Apply(self, [pt.as_tensor_variable(x)], [pt.dvector()])

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        from jax._src import xla_bridge

        output_storage[0][0] = np.array([float(xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value)])


@pytest.mark.process
@needs_jax
@needs_two_cores
@pytest.mark.parametrize("keep_async", [False, True])
def test_a_rank_on_one_core_computes_jax_calls_on_its_calling_thread(default_backend_choice, monkeypatch, caplog,
                                                                      keep_async):
    """A worker pinned to one core turns JAX's asynchronous dispatch off (SYNK_CPU_ASYNC=1 keeps it;
    a rank of several cores keeps it too); the results are the plain function's either way."""
    if keep_async:
        monkeypatch.setenv(cpu.ASYNC_ENV, "1")
    else:
        monkeypatch.delenv(cpu.ASYNC_ENV, raising=False)
    worker_cores = cores.split(cores.available(), 2)[1]
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        synk.fork(2, use_gpu=False)
    master = current().device
    assert ("JAX computing inline" in caplog.text) == master.inline  # the master: inline unless JAX ran here first
    assert not (keep_async and master.inline)
    x = pt.matrix("x")
    flags = synk.function([x], outputs=(AsyncDispatchOf()(x), "gather"))(synk.data(np.ones((4, 2))))
    assert flags[1] == float(keep_async or len(worker_cores) > 1)
    inputs, loss, updates, _ = regression_step()
    xd, yd = data()
    expected = pytensor.function(inputs, loss, mode="FAST_COMPILE")(xd, yd)  # before the step's updates
    step = synk.function(inputs, (loss, "avg"), updates=updates)
    np.testing.assert_allclose(step(synk.data(xd), synk.data(yd)), expected, rtol=1e-6)


@pytest.mark.process
@needs_jax
def test_a_rank_that_computes_inline_still_waits_for_its_values():
    """A call can return before its program has run even where JAX computes inline (JAX defers a
    program whose input it is still copying): the wait blocks on every value, numpy ones pass
    (before, an inline master skipped it, cleared its all-reduce weight before its deferred
    program read it, and its peer waited in the all-reduce forever)."""
    from synkhronos.device import CpuDevice

    class Pending:
        """A value that is ready once blocked on (what JAX's arrays are)."""
        ready = False

        def block_until_ready(self) -> Pending:
            self.ready = True
            return self

    values = [np.zeros(3), Pending(), Pending()]
    device = CpuDevice("pytensor")
    device.inline = True
    device.wait(iter(values))
    assert [v.ready for v in values[1:]] == [True, True]


@pytest.mark.process
@needs_jax
@pytest.mark.parametrize("case", ["fresh", "jax started", "kept async"])
def test_compute_on_calling_thread_applies_only_before_jax_starts(case):
    """In a fresh interpreter: applied (JAX's flag off, results unchanged); after JAX made its CPU
    client, or with SYNK_CPU_ASYNC=1: not applied, JAX's dispatch unchanged."""
    script = (
        "import jax, jax.numpy as jnp\n"
        "from jax._src import xla_bridge\n"
        "from synkhronos import cpu\n"
        + ("jnp.ones(2).block_until_ready()\n" if case == "jax started" else "")
        + "applied = cpu.compute_on_calling_thread()\n"
        "print(applied, xla_bridge._CPU_ENABLE_ASYNC_DISPATCH.value, float(jnp.ones(3).sum()))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(cpu.ASYNC_ENV, None)
    if case == "kept async":
        env[cpu.ASYNC_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = "True False 3.0" if case == "fresh" else "False True 3.0"
    assert out.stdout.split("\n")[0] == expected


@pytest.mark.process
@needs_two_cores
def test_pinning_can_be_turned_off(default_backend_choice, monkeypatch):
    monkeypatch.setenv(cpu.PIN_ENV, "0")
    before = os.sched_getaffinity(0)
    synk.fork(2, use_gpu=False)
    assert os.sched_getaffinity(0) == before
    (pid,) = worker_pids()
    assert os.sched_getaffinity(pid) == before and "SYNK_CORES" not in worker_environ(pid)


@pytest.mark.process
def test_the_default_rank_rule(monkeypatch):
    monkeypatch.delenv(cpu.RANKS_ENV, raising=False)
    assert [cpu.default_ranks(c) for c in (1, 2, 3, 4, 5, 8, 16, 32, 64)] == [1, 2, 3, 4, 4, 4, 4, 8, 16]
    monkeypatch.setenv(cpu.RANKS_ENV, "3")
    assert cpu.default_ranks(16) == 3
    monkeypatch.setenv(cpu.RANKS_ENV, "zero")
    with pytest.raises(ValueError, match=cpu.RANKS_ENV):
        cpu.default_ranks(16)


@pytest.mark.process
def test_fork_without_n_parallel_follows_synk_cpu_ranks(default_backend_choice, monkeypatch):
    monkeypatch.setenv(cpu.RANKS_ENV, "3")
    assert synk.fork(use_gpu=False) == 3
    assert len(worker_pids()) == 2


@pytest.mark.process
def test_split_gives_disjoint_even_runs():
    assert cores.split([0, 1, 2, 3, 4, 5, 6], 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert cores.split([4, 9], 2) == [[4], [9]]
    with pytest.raises(ValueError, match="at most 2 ranks"):
        cores.split([0, 1], 3)


@pytest.mark.process
def test_env_cores_reads_the_cores_a_worker_was_launched_with(monkeypatch):
    monkeypatch.setenv(cores.CORES_ENV, "3,5")
    assert cores.env_cores() == [3, 5]
    monkeypatch.setenv(cores.CORES_ENV, " 7 ")
    assert cores.env_cores() == [7]
    monkeypatch.delenv(cores.CORES_ENV)
    assert cores.env_cores() is None


@pytest.mark.process
def test_available_puts_a_physical_cores_hyperthreads_side_by_side(monkeypatch):
    # 8 logical CPUs, core c's two hyperthreads numbered c and c + 4 (as Linux often numbers them):
    # two ranks get two whole physical cores each, not the two halves of the same four
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(cores, "physical_core", lambda cpu: (0, cpu % 4))
    assert cores.available() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert cores.split(cores.available(), 2) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    monkeypatch.undo()
    assert sorted(cores.available()) == sorted(os.sched_getaffinity(0))  # this machine's own, every core once
    assert all(len(cores.physical_core(c)) == 2 for c in cores.available())


@pytest.mark.process
def test_without_jax_the_ranks_use_pytensors_default_mode(default_backend_choice, monkeypatch):
    """JAX not importable (simulated in the master, which decides for every rank): PyTensor's
    default mode everywhere, same results."""
    monkeypatch.setattr(cpu, "jax_importable", lambda: False)
    assert cpu.choose_backend() == "pytensor"
    xd, yd = data(40)
    inputs, loss, _, _ = regression_step()
    synk.fork(2, use_gpu=False)
    assert current().device.backend == "pytensor"
    (pid,) = worker_pids()
    assert worker_environ(pid)[cpu.BACKEND_ENV] == "pytensor"
    f = synk.function(inputs, outputs=(loss, "avg"))
    assert not isinstance(f._replica.full(), rank_functions.JaxOrDefault)
    reference = pytensor.function(inputs, loss, mode="FAST_RUN")
    np.testing.assert_allclose(f(synk.data(xd), synk.data(yd)), reference(xd, yd), rtol=1e-12)


@pytest.mark.process
def test_the_users_mode_wins(default_backend_choice, monkeypatch):
    monkeypatch.setenv("PYTENSOR_FLAGS", os.environ["PYTENSOR_FLAGS"] + ",mode=FAST_COMPILE")
    assert cpu.user_mode() == "FAST_COMPILE" and cpu.choose_backend() == "pytensor"
    monkeypatch.setenv("PYTENSOR_FLAGS", "")
    if cpu.jax_importable():
        assert cpu.choose_backend() == "jax"
        synk.fork(2, use_gpu=False)
        x = pt.matrix("x")
        f = synk.function([x], outputs=(x.sum(), "sum"), mode="FAST_RUN")  # a function's own mode
        assert not isinstance(f._replica.full(), rank_functions.JaxOrDefault)
        np.testing.assert_allclose(f(synk.data(np.ones((4, 2)))), 8.0)


@pytest.mark.process
def test_a_bad_backend_name_is_an_error_that_says_what_to_use(monkeypatch):
    monkeypatch.setenv(cpu.BACKEND_ENV, "numba")
    with pytest.raises(ValueError, match="'jax' or 'pytensor'"):
        cpu.choose_backend()
