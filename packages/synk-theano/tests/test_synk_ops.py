"""``synkhronos.ops``: in-graph collectives against numpy, in 2 and 3 real ranks (CPU mode, and GPU
mode's JAX path under ``SYNK_TEST_GPU=1``), in outputs and in updates, with uneven splits (7 rows
on 3 ranks) and calls where some ranks have no rows; their gradients (one rank: PyTensor's
``verify_grad``; several: numpy); the identity in a plain ``pytensor.function``; errors when the
graph is built; and the in-program JAX form (``synk_axis``) under ``jax.vmap`` and ``shard_map``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from synk_testutil import ON_ENGINE, TIMEOUT, USE_GPU, n_workers, parts

import synkhronos as synk
from synk_comm import WorkerError
from synkhronos import ops

pytestmark = pytest.mark.timeout(TIMEOUT)

HAS_JAX = importlib.util.find_spec("jax") is not None
NP_OPS = {"sum": np.sum, "avg": None, "max": np.max, "min": np.min, "prod": np.prod}
OPS = list(NP_OPS)


def weighted_avg(values, weights):
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


def expected_all_reduce(op, values, weights):
    """numpy: ``op`` over the values of the ranks with rows (``avg`` weighted by rows)."""
    kept = [(v, w) for v, w in zip(values, weights) if w > 0]
    if op == "avg":
        return weighted_avg([v for v, _ in kept], [w for _, w in kept])
    return NP_OPS[op](np.stack([v for v, _ in kept]), axis=0)


# --- one process: the identity, gradients, errors --------------------------------------------------

def modes():
    found = [None, "FAST_COMPILE"]
    if HAS_JAX and not USE_GPU:
        found.append("JAX")
    return found


@pytest.mark.parametrize("mode", modes())
def test_identity_in_a_plain_function(mode):
    x = pt.matrix("x")
    outs = [*(ops.all_reduce(x, op) for op in OPS), ops.all_gather(x, axis=1), ops.broadcast(x)]
    f = pytensor.function([x], outs, mode=mode)
    value = np.arange(6.0).reshape(2, 3)
    for got in f(value):
        np.testing.assert_array_equal(np.asarray(got), value)


@pytest.mark.parametrize("op", OPS)
def test_single_rank_gradients_verify(op):
    rng = np.random.default_rng(0)
    pytensor.gradient.verify_grad(lambda a: ops.all_reduce(a, op), [rng.uniform(0.5, 1.5, (2, 3))], rng=rng)


def test_single_rank_gradients_of_gather_and_broadcast_verify():
    rng = np.random.default_rng(1)
    pytensor.gradient.verify_grad(lambda a: ops.all_gather(a, axis=-1), [rng.normal(size=(2, 3))], rng=rng)
    pytensor.gradient.verify_grad(lambda a: ops.broadcast(a, root=0), [rng.normal(size=(2, 3))], rng=rng)


def test_bad_arguments_are_refused_when_the_graph_is_built():
    x, i = pt.vector("x"), pt.ivector("i")
    with pytest.raises(ValueError, match="unknown reduce op 'mean'"):
        ops.all_reduce(x, "mean")
    with pytest.raises(TypeError, match="floating"):
        ops.all_reduce(i, "avg")
    with pytest.raises(TypeError, match="bool"):
        ops.all_reduce(pt.eq(x, 0), "sum")
    with pytest.raises(ValueError, match="out of range"):
        ops.all_gather(x, axis=1)
    with pytest.raises(ValueError, match="0-d"):
        ops.all_gather(x.sum())
    with pytest.raises(TypeError, match="axis must be an int"):
        ops.all_gather(x, axis=0.5)
    with pytest.raises(ValueError, match="root must be a rank"):
        ops.broadcast(x, root=-1)


def test_the_ops_are_never_constant_folded():
    """A collective of a constant still communicates in a call: PyTensor must not fold it to the
    constant when it compiles."""
    f = pytensor.function([], ops.all_reduce(pt.constant(np.ones(2)), "sum"))
    assert any(isinstance(node.op, ops.AllReduce) for node in f.maker.fgraph.toposort())


# --- several ranks ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph(ranks):
    """Per rank: ``m = mean(x, axis=0)`` and ``s = sum(x, axis=0)`` of its rows; the ops over them."""
    x = pt.matrix("x")
    m, s = pt.mean(x, axis=0), pt.sum(x, axis=0)
    fns = {op: synk.function([x], outputs=[(ops.all_reduce(m, op), "max"), (ops.all_reduce(s, op), "min")])
           for op in OPS}
    return x, m, fns


def rank_rows(n_rows, ranks):
    """Each rank's rows of a call over ``n_rows`` rows (numpy.array_split, as Synkhronos splits)."""
    return np.array_split(np.arange(n_rows), ranks)


@pytest.mark.parametrize("n_rows", [7, 1, 2], ids=["7rows", "1row", "2rows"])
@pytest.mark.parametrize("op", OPS)
def test_all_reduce_equals_numpy(graph, ranks, op, n_rows):
    """Every rank gets the same value (max and min of it agree), equal to numpy's ``op`` over the
    ranks that have rows; ``avg`` is weighted by rows, so that avg of per-rank means is the mean."""
    _, _, fns = graph
    rng = np.random.default_rng(n_rows)
    x = rng.uniform(0.5, 1.5, (n_rows, 3))
    biggest, smallest = fns[op](synk.data(x))
    split = parts(x, ranks)
    weights = [len(p) for p in split]
    means = [p.mean(axis=0) if len(p) else np.full(3, np.nan) for p in split]
    sums = [p.sum(axis=0) for p in split]
    np.testing.assert_allclose(biggest, expected_all_reduce(op, means, weights), rtol=1e-12)
    np.testing.assert_allclose(smallest, expected_all_reduce(op, sums, weights), rtol=1e-12)
    if op == "avg":
        np.testing.assert_allclose(biggest, x.mean(axis=0), rtol=1e-12)


PER_RANK_JAX = USE_GPU and not ON_ENGINE
"""GPU mode on the per-rank engine: each rank's JAX function has fixed shapes (host callbacks)."""


@pytest.mark.skipif(PER_RANK_JAX, reason="uneven blocks: under the per-rank engine's JAX an all_gather's shape is "
                                         "fixed when traced (tested below)")
@pytest.mark.parametrize("n_rows", [7, 2])
def test_all_gather_of_uneven_blocks_in_rank_order(ranks, n_rows):
    x = pt.matrix("x")
    f = synk.function([x], outputs=[(ops.all_gather(x), "max"), (ops.all_gather(2 * x.T, axis=1), "min")])
    value = np.random.default_rng(3).normal(size=(n_rows, 2))
    rows, cols = f(synk.data(value))
    np.testing.assert_array_equal(rows, value)
    np.testing.assert_array_equal(cols, 2 * value.T)


def test_all_gather_of_even_blocks(ranks):
    x = pt.matrix("x")
    f = synk.function([x], outputs=(ops.all_gather(x * 3), "max"))
    value = np.random.default_rng(4).normal(size=(2 * ranks, 3))
    np.testing.assert_allclose(f(synk.data(value)), 3 * value)


def test_all_gather_blocks_that_differ_beyond_the_axis_fail_in_every_rank(ranks):
    """Each rank gathers a block of its own width (its row count): a clear ValueError from every
    rank, and the group stays usable."""
    x = pt.matrix("x")
    f = synk.function([x], outputs=(ops.all_gather(pt.ones((2, x.shape[0]))), "max"))
    value = np.ones((ranks + 1, 2))  # rank 0 has 2 rows, the others 1
    differ = r"differ along axis 0 only|same length|follows the rows"
    with pytest.raises((WorkerError, ValueError), match=differ) as info:
        f(synk.data(value))
    if isinstance(info.value, WorkerError):  # every worker (the engine's: found when its program is traced)
        assert {e.rank for e in info.value.errors} == set(range(1, n_workers(ranks) + 1))
    ok = synk.function([x], outputs=(ops.all_reduce(x.sum(), "sum"), "max"))
    np.testing.assert_allclose(ok(synk.data(value)), value.sum())


@pytest.mark.parametrize("root", [0, 1, -1], ids=["root0", "root1", "last"])
def test_broadcast_gives_every_rank_the_roots_value(ranks, root):
    root = root % ranks
    x = pt.matrix("x")
    m = pt.mean(x, axis=0)
    f = synk.function([x], outputs=[(ops.broadcast(m, root=root), "max"), (ops.broadcast(m, root=root), "min")])
    value = np.random.default_rng(5).normal(size=(3 * ranks + 1, 2))
    biggest, smallest = f(synk.data(value))
    expected = parts(value, ranks)[root].mean(axis=0)
    np.testing.assert_allclose(biggest, expected, rtol=1e-12)
    np.testing.assert_allclose(smallest, expected, rtol=1e-12)


def test_broadcast_root_outside_the_group_is_refused_before_any_worker_acts(ranks):
    x = pt.matrix("x")
    with pytest.raises(ValueError, match=rf"root={ranks}\) in a group of {ranks} ranks"):
        ops.broadcast(x, root=ranks)  # Synkhronos is forked: refused when the graph is built
    built_before_fork = Apply(ops.Broadcast(ranks), [x], [x.type()]).outputs[0]  # as if built before fork
    with pytest.raises(ValueError, match=rf"root={ranks}\) in a group of {ranks} ranks"):
        synk.function([x], outputs=built_before_fork)
    ok = synk.function([x], outputs=(ops.broadcast(x.sum(), root=ranks - 1), "max"))
    np.testing.assert_allclose(ok(synk.data(np.ones((ranks, 2)))), 2.0)


@pytest.mark.parametrize("n_rows", [7, 1], ids=["7rows", "1row"])
def test_in_updates_every_rank_applies_the_same_value(ranks, n_rows):
    """The rule that updates apply locally, and the op that makes them agree: ``acc`` in every
    rank (even one without rows) becomes the full-batch column means."""
    x = pt.matrix("x")
    acc = pytensor.shared(np.zeros(3), name="acc")
    local = pytensor.shared(np.zeros(3), name="local")
    m = pt.mean(x, axis=0)
    f = synk.function([x], outputs=(x.shape[0], "sum"), updates=[(acc, acc + ops.all_reduce(m, "avg")),
                                                                 (local, m)])
    value = np.random.default_rng(6).normal(size=(n_rows, 3))
    assert int(f(synk.data(value))) == n_rows
    for r in range(ranks):
        np.testing.assert_allclose(synk.get_value(r, acc), value.mean(axis=0), rtol=1e-12)
    split = parts(value, ranks)
    for r in range(ranks):  # without the op each rank keeps its own (a rank without rows: NaN)
        if len(split[r]):
            np.testing.assert_allclose(synk.get_value(r, local), split[r].mean(axis=0), rtol=1e-12)


def test_all_reduce_avg_of_gradients_is_the_full_batch_gradient(ranks):
    """The data-parallel step in one function: per-rank gradient of a mean loss, all-reduced
    (avg), is the single-process gradient of the whole batch, under uneven splits."""
    x, t = pt.matrix("x"), pt.vector("t")
    w = pytensor.shared(np.array([0.5, -1.0, 2.0]), name="w")
    loss = pt.mean((pt.tanh(x @ w) - t) ** 2)
    g = ops.all_reduce(pytensor.grad(loss, w), "avg")
    f = synk.function([x, t], outputs=(g, "max"), updates=[(w, w - 0.1 * g)])
    wv = pt.vector("wv")
    reference = pytensor.function([x, t, wv], pytensor.grad(loss, w), givens=[(w, wv)])
    rng = np.random.default_rng(7)
    for n_rows in (7, 1, 10):
        xv, tv = rng.normal(size=(n_rows, 3)), rng.normal(size=n_rows)
        w0 = synk.get_value(0, w)  # rank 0's (under the JAX engine the master holds no value of its own)
        expected = reference(xv, tv, w0)
        np.testing.assert_allclose(f(synk.data(xv), synk.data(tv)), expected, rtol=1e-10)
        for r in range(ranks):
            np.testing.assert_allclose(synk.get_value(r, w), w0 - 0.1 * expected, rtol=1e-10)


@pytest.mark.parametrize("op", OPS)
def test_gradient_through_all_reduce_equals_numpy(ranks, op):
    """``d/dx_i`` of ``sum(c * all_reduce(m_r, op))`` in every rank, ``m_r`` the mean of tanh of its
    rows: numpy's ``sum over ranks with rows of c * dy/dm_s * dm_s/dx_i``."""
    x = pt.matrix("x")
    c = np.array([1.0, -2.0, 0.5])
    m = pt.mean(pt.tanh(x), axis=0)
    y = ops.all_reduce(m, op)
    f = synk.function([x], outputs=(pytensor.grad(pt.sum(c * y), x), None))
    value = np.random.default_rng(8).uniform(0.2, 1.2, (7, 3))
    got = f(synk.data(value))
    split = parts(value, ranks)
    means = [np.tanh(p).mean(axis=0) for p in split]
    weights = [len(p) for p in split]
    active = sum(w > 0 for w in weights)
    expected = []
    for s, p in enumerate(split):
        dm_dx = (1 - np.tanh(p) ** 2) / len(p)
        if op == "avg":
            dy_dm = weights[s] / sum(weights)
        elif op == "sum":
            dy_dm = 1.0
        elif op in ("max", "min"):  # the rank holding the extreme (no ties in these values)
            holder = (np.argmax if op == "max" else np.argmin)(np.stack(means), axis=0)
            dy_dm = (holder == s).astype(float)
        else:
            dy_dm = np.prod([mm for r, mm in enumerate(means) if r != s], axis=0)
        expected.append(active * c * dy_dm * dm_dx)
    np.testing.assert_allclose(got, np.concatenate(expected), rtol=1e-10, atol=1e-14)


@pytest.mark.skipif(PER_RANK_JAX, reason="uneven blocks: under the per-rank engine's JAX an all_gather's shape is "
                                         "fixed when traced")
def test_gradient_through_all_gather_and_broadcast_equals_numpy(ranks):
    x = pt.matrix("x")
    gathered = ops.all_gather(x)
    root = ranks - 1
    cost = pt.sum(gathered ** 2) + 3 * pt.sum(ops.broadcast(pt.sum(x, axis=0), root=root))
    f = synk.function([x], outputs=(pytensor.grad(cost, x), None))
    value = np.random.default_rng(9).normal(size=(7, 2))
    got = f(synk.data(value))
    split = parts(value, ranks)
    expected = [ranks * 2 * p + (3 * ranks if s == root else 0) for s, p in enumerate(split)]
    np.testing.assert_allclose(got, np.concatenate(expected), rtol=1e-12)


def test_num_slices_is_refused_before_any_worker_acts(ranks):
    x = pt.matrix("x")
    acc = pytensor.shared(np.zeros(2), name="acc")
    f = synk.function([x], outputs=(ops.all_reduce(x.sum(), "sum"), "max"), updates=[(acc, acc + 1)])
    with pytest.raises(ValueError, match="num_slices=1"):
        f(synk.data(np.ones((4, 2))), num_slices=2)
    for r in range(ranks):
        np.testing.assert_array_equal(synk.get_value(r, acc), np.zeros(2))


@pytest.mark.cpu_only("JAX clamps an out-of-range index instead of raising")
def test_a_rank_that_fails_before_a_collective_stops_the_call_without_a_hang(ranks):
    """Ranks 1.. index a row they do not have and raise before the all-reduce that rank 0 waits in:
    every rank leaves the call, the master raises, and the group stays usable.  In CPU mode the
    function is of PyTensor's default mode (which raises on an index out of range; JAX clamps it):
    its all-reduce runs on the host (test_synk_cpu has the case of an all-reduce inside the program)."""
    x = pt.matrix("x")
    f = synk.function([x], outputs=(ops.all_reduce(x[2], "sum"), "max"), mode="FAST_RUN")
    value = np.ones((2 * ranks + 1, 2))  # rank 0: 3 rows, the others 2
    with pytest.raises(WorkerError) as info:
        f(synk.data(value))
    assert {e.rank for e in info.value.errors} == set(range(1, ranks))
    ok = synk.function([x], outputs=(ops.all_reduce(x.sum(), "sum"), "max"))
    np.testing.assert_allclose(ok(synk.data(value)), value.sum())


def test_chain_runs_then_with_its_collectives(ranks):
    """``then`` of a chain runs in every rank inside the call: its in-graph collectives combine."""
    x = pt.matrix("x")
    acc = pytensor.shared(np.zeros(2), name="acc")
    total = pytensor.shared(np.zeros(2), name="total")
    first = synk.function([x], updates=[(acc, x.sum(axis=0))])
    then = synk.function([], updates=[(total, total + ops.all_reduce(acc, "sum"))])
    step = synk.chain(first, all_reduce=acc, op="max", then=then)
    value = np.random.default_rng(10).normal(size=(2 * ranks, 2))
    step(synk.data(value))
    biggest = np.max([p.sum(axis=0) for p in parts(value, ranks)], axis=0)
    for r in range(ranks):
        np.testing.assert_allclose(synk.get_value(r, total), ranks * biggest, rtol=1e-12)


@pytest.mark.skipif(not HAS_JAX, reason="needs jax")
@pytest.mark.cpu_only("CPU mode's ranks compiling with mode='JAX' (GPU mode always does)")
@pytest.mark.parametrize("n_rows", [7, 1], ids=["7rows", "1row"])
def test_cpu_mode_ranks_compiling_with_jax(ranks, n_rows):
    """CPU mode with ``mode="JAX"`` per rank (XLA on the CPU): the ops run as host callbacks, in
    outputs and updates, a rank without rows included (float32: JAX's default precision)."""
    x = pt.matrix("x", dtype="float32")
    acc = pytensor.shared(np.zeros(3, dtype="float32"), name="acc")
    m = pt.mean(x, axis=0)
    f = synk.function([x], outputs=[(ops.all_reduce(m, "avg"), "max"), (ops.broadcast(m, root=0), "min"),
                                    (ops.all_reduce(x.shape[0], "sum"), "max")],
                      updates=[(acc, acc + ops.all_reduce(m, "avg"))], mode="JAX")
    value = np.random.default_rng(12).normal(size=(n_rows, 3)).astype("float32")
    mean, root_mean, rows = f(synk.data(value))
    np.testing.assert_allclose(mean, value.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(root_mean, parts(value, ranks)[0].mean(axis=0), rtol=1e-5)
    assert int(rows) == n_rows
    for r in range(ranks):
        np.testing.assert_allclose(synk.get_value(r, acc), value.mean(axis=0), rtol=1e-5)
    synk.broadcast(acc, np.zeros(3, dtype="float32"))


@pytest.mark.skipif(not PER_RANK_JAX, reason="GPU mode on the per-rank engine (JAX per rank): run with "
                                             "SYNK_TEST_GPU=1 SYNK_ENGINE=ranks")
def test_jax_all_gather_of_uneven_blocks_says_why(ranks):
    x = pt.matrix("x")
    f = synk.function([x], outputs=(ops.all_gather(x), "max"))
    with pytest.raises(Exception, match="same length"):
        f(synk.data(np.ones((2 * ranks + 1, 2))))
    np.testing.assert_array_equal(f(synk.data(np.ones((2 * ranks, 2)))), np.ones((2 * ranks, 2)))


# --- the in-program JAX form (the engine's) -------------------------------------------------------

@pytest.mark.skipif(not HAS_JAX, reason="needs jax")
def test_in_program_form_under_vmap_equals_numpy():
    """``jax_funcify(fgraph, synk_axis="ranks")`` under ``jax.vmap(axis_name="ranks")``: values and
    gradients of every op against numpy (3 ranks, float32)."""
    import jax
    from pytensor.graph.fg import FunctionGraph
    from pytensor.link.jax.dispatch import jax_funcify

    x = pt.matrix("x", dtype="float32")
    outs = [*(ops.all_reduce(x, op) for op in OPS), ops.all_gather(x, axis=1), ops.broadcast(x, root=1)]
    cost = (pt.sum(ops.all_reduce(x, "avg")) + pt.sum(ops.all_gather(x) ** 2) + 3 * pt.sum(ops.broadcast(x, 1))
            + 5 * pt.sum(ops.all_reduce(x, "max")) + pt.sum(ops.all_reduce(x, "prod")))
    fgraph = FunctionGraph([x], [*outs, pytensor.grad(cost, x)], clone=True)
    fn = jax_funcify(fgraph, synk_axis="ranks", synk_counts=None)
    xs = np.random.default_rng(11).uniform(0.5, 1.5, (3, 2, 4)).astype("float32")
    got = [np.asarray(v) for v in jax.vmap(fn, axis_name="ranks")(xs)]
    expected = [xs.sum(0), xs.mean(0), xs.max(0), xs.min(0), xs.prod(0), np.concatenate(list(xs), axis=1), xs[1]]
    for g, e in zip(got, expected):
        for r in range(3):
            np.testing.assert_allclose(g[r], e, rtol=1e-5)
    grad = 1.0 + 6 * xs + 15 * (xs == xs.max(0)) + 3 * xs.prod(0) / xs
    grad[1] += 9
    np.testing.assert_allclose(got[-1], grad, rtol=1e-5)


SHARD_MAP_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np, pytensor, pytensor.tensor as pt
    from jax.sharding import Mesh, PartitionSpec as P
    from pytensor.graph.fg import FunctionGraph
    from pytensor.link.jax.dispatch import jax_funcify
    from synkhronos import ops
    import inspect
    from jax import shard_map
    # all_gather's result is not inferred replicated: the engine chooses the check (or out_specs)
    check = "check_vma" if "check_vma" in inspect.signature(shard_map).parameters else "check_rep"
    x, w = pt.matrix("x", dtype="float32"), pt.vector("w", dtype="float32")
    loss = pt.mean((x @ w) ** 2)
    g = ops.all_reduce(pytensor.grad(loss, w), "avg")
    fgraph = FunctionGraph([x, w], [g, ops.all_gather(x)], clone=True)
    fn = jax_funcify(fgraph, synk_axis="ranks", synk_counts=None)
    mesh = Mesh(np.array(jax.devices()[:2]), ("ranks",))
    step = jax.jit(shard_map(lambda a, b: tuple(fn(a, b)), mesh=mesh, in_specs=(P("ranks"), P()),
                             out_specs=(P(), P()), **{check: False}))
    xv = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    wv = np.array([0.5, -1.0, 2.0], dtype="float32")
    grad, gathered = step(xv, wv)
    np.testing.assert_allclose(np.asarray(grad), 2 * xv.T @ (xv @ wv) / 6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gathered), xv)
    print("shard_map ok")
""")


@pytest.mark.skipif(not HAS_JAX, reason="needs jax")
def test_in_program_form_under_shard_map_on_two_cpu_devices():
    """The engine's shape: the translated graph inside ``jax.jit(shard_map(...))`` over a mesh of 2
    JAX CPU devices; the all-reduced gradient equals the full batch's (a fresh interpreter: the
    device count is fixed when JAX starts)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", SHARD_MAP_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shard_map ok" in done.stdout
