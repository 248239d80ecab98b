"""``synk.chain`` in 2 and 3 CPU ranks: one command equals ``first(...)``, ``all_reduce``, ``then()``
issued one by one (against numpy and against the three separate operations), for every op, with
``batch``, ``batch_s``, ``num_slices`` and ``output_subset``; bad chains are refused before any
command, and a chain whose first call fails in a rank changes nothing and leaves the group usable."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from synk_testutil import ON_ENGINE, TIMEOUT, parts

import synkhronos as synk

pytestmark = pytest.mark.timeout(TIMEOUT)

NP_OPS = {"avg": np.mean, "sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}


class Step:
    """``acc := column sums of x`` (per rank), all-reduced, then ``w := w + acc`` and ``acc := 0``."""

    def __init__(self) -> None:
        self.x = pt.matrix("x")
        self.w = pytensor.shared(np.zeros(3), name="w")
        self.acc = pytensor.shared(np.zeros(3), name="acc")
        self.rows = pytensor.shared(np.zeros((0, 3)), name="rows")
        self.first = synk.function([self.x], outputs=[pt.mean(self.x), (pt.max(self.x), "max")],
                                   updates=[(self.acc, self.x.sum(axis=0))])
        self.first_s = synk.function([], outputs=pt.sum(self.rows), updates=[(self.acc, self.rows.sum(axis=0))],
                                     sliceable_shareds=[self.rows])
        self.then = synk.function([], updates=[(self.w, self.w + self.acc), (self.acc, pt.zeros_like(self.acc))])

    def reset(self, ranks: int) -> None:
        synk.broadcast([self.w, self.acc], [np.zeros(3), np.zeros(3)])


@pytest.fixture(scope="module")
def s(ranks):
    return Step()


def _in_ranks(var, ranks: int) -> list[np.ndarray]:
    return [synk.get_value(r, var) for r in range(ranks)]


@pytest.mark.parametrize("op", list(NP_OPS))
def test_chain_equals_numpy_for_every_op(s, ranks, op):
    s.reset(ranks)
    rng = np.random.default_rng(1)
    x = rng.uniform(0.5, 1.5, (7 * ranks + 1, 3))
    step = synk.chain(s.first, all_reduce=s.acc, op=op, then=s.then)
    mean, biggest = step(synk.data(x))
    np.testing.assert_allclose(mean, x.mean())
    np.testing.assert_allclose(biggest, x.max())
    sums = np.stack([p.sum(axis=0) for p in parts(x, ranks)])
    expected = NP_OPS[op](sums, axis=0)
    for value in _in_ranks(s.w, ranks):
        np.testing.assert_allclose(value, expected)
    for value in _in_ranks(s.acc, ranks):
        np.testing.assert_array_equal(value, np.zeros(3))


def test_chain_equals_the_three_operations_one_by_one(s, ranks):
    rng = np.random.default_rng(2)
    x = synk.data(rng.normal(size=(40, 3)))
    batches = [[3, 1, 4, 1, 5, 9, 2, 6], slice(2, 30, 3), 11]
    step = synk.chain(s.first, all_reduce=[s.acc], op="sum", then=s.then)
    s.reset(ranks)
    chained = [step(x, batch=b) for b in batches]
    w_chained = _in_ranks(s.w, ranks)
    s.reset(ranks)
    separate = []
    for b in batches:
        separate.append(s.first(x, batch=b))
        synk.all_reduce(s.acc, op="sum")
        s.then()
    for a, b in zip(chained, separate):
        np.testing.assert_allclose(a, b)
    for a, b in zip(w_chained, _in_ranks(s.w, ranks)):
        np.testing.assert_allclose(a, b)


def test_chain_with_batch_s_num_slices_and_output_subset(s, ranks):
    rng = np.random.default_rng(3)
    data = rng.normal(size=(12 * ranks, 3))
    synk.scatter(s.rows, data)
    step = synk.chain(s.first_s, all_reduce=s.acc, op="sum", then=s.then)
    s.reset(ranks)
    total = step(batch_s=slice(2, 10), num_slices=2)
    mine = [p[2:10] for p in parts(data, ranks)]
    # the output (avg) is averaged over the 2 slices of 4 rows, then over the ranks
    np.testing.assert_allclose(total, sum(m.sum() for m in mine) / (2 * ranks))
    for value in _in_ranks(s.w, ranks):  # the update (avg) likewise over the slices, then summed
        np.testing.assert_allclose(value, sum(m.sum(axis=0) for m in mine) / 2)
    x = rng.normal(size=(9, 3))
    only_max = synk.chain(s.first, all_reduce=s.acc, op="sum")(synk.data(x), output_subset=[1])
    np.testing.assert_allclose(only_max[0], x.max())


def test_without_then_the_chain_is_a_call_and_an_all_reduce(s, ranks):
    s.reset(ranks)
    x = np.arange(12.0 * ranks).reshape(-1, 3)
    synk.chain(s.first, all_reduce=s.acc, op="max")(synk.data(x))
    expected = np.max([p.sum(axis=0) for p in parts(x, ranks)], axis=0)
    for value in _in_ranks(s.acc, ranks):
        np.testing.assert_allclose(value, expected)


def test_bad_chains_are_refused(s, ranks):
    with pytest.raises(TypeError, match="first must be"):
        synk.chain(lambda: None, all_reduce=s.acc)
    with pytest.raises(TypeError, match="then must be"):
        synk.chain(s.first, all_reduce=s.acc, then=print)
    with pytest.raises(ValueError, match="no inputs and return no outputs"):
        synk.chain(s.first, all_reduce=s.acc, then=s.first)
    with pytest.raises(TypeError, match="shared variables"):
        synk.chain(s.first, all_reduce=np.zeros(3))
    with pytest.raises(ValueError, match="at least one"):
        synk.chain(s.first, all_reduce=[])
    with pytest.raises(ValueError, match="op must be"):
        synk.chain(s.first, all_reduce=s.acc, op="mean")


def test_a_failing_first_call_changes_nothing_and_the_group_goes_on(s, ranks):
    rng = np.random.default_rng(4)
    synk.scatter(s.rows, rng.normal(size=(4 * ranks, 3)))
    s.reset(ranks)
    synk.broadcast(s.w, np.ones(3))
    step = synk.chain(s.first_s, all_reduce=s.acc, op="sum", then=s.then)
    with pytest.raises(synk.SelectionError):
        step(batch_s=[0, 1, 99])  # out of range in every rank: found by each, before any computes
    for value in _in_ranks(s.w, ranks):
        np.testing.assert_array_equal(value, np.ones(3))
    with pytest.raises(TypeError):
        step(synk.data(np.zeros((3, 3))))  # first takes no inputs: refused in the master
    step(batch_s=slice(0, 2))
    expected = 1 + sum(p[:2].sum(axis=0) for p in parts(synk.gather(s.rows, nd_up=0), ranks))
    for value in _in_ranks(s.w, ranks):
        np.testing.assert_allclose(value, expected)


class RefusePositive(Op):
    """``x`` as it is, raising in ``perform`` where it is positive (a rank-dependent failure)."""

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        if inputs[0] > 0:
            raise ValueError("then refused: flag is set in this rank")
        output_storage[0][0] = np.asarray(inputs[0], dtype=node.outputs[0].dtype)


@pytest.mark.skipif(ON_ENGINE, reason="the per-rank engine's chain (one command, replies through shared memory); "
                    "the JAX engine runs the three operations one by one")
def test_a_then_failing_in_a_worker_after_its_reply_raises_its_error_and_the_group_goes_on(s, ranks):
    """A worker replies ``first``'s outputs before the all-reduce: a failure after that (here its
    ``then``) still reaches the master as that worker's error, not as a result."""
    flag = pytensor.shared(np.float64(0), name="flag")
    then = synk.function([], updates=[(s.w, s.w + s.acc + RefusePositive()(flag))])
    step = synk.chain(s.first, all_reduce=s.acc, op="sum", then=then)
    x = np.random.default_rng(5).normal(size=(2 * ranks, 3))
    s.reset(ranks)
    synk.distribute()
    synk.set_value(ranks - 1, flag, np.float64(1))  # the last worker refuses
    with pytest.raises(synk.WorkerError, match="flag is set"):
        step(synk.data(x))
    synk.set_value(ranks - 1, flag, np.float64(0))
    s.reset(ranks)
    out = step(synk.data(x))
    np.testing.assert_allclose(out[0], x.mean())
    for value in _in_ranks(s.w, ranks):
        np.testing.assert_allclose(value, x.sum(axis=0))


@pytest.mark.parametrize("zeros_if_idle", [False, True])
def test_idle_ranks_keep_their_values_or_contribute_zeros(s, ranks, zeros_if_idle):
    synk.broadcast(s.acc, np.ones(3))
    x = np.array([[1.0, 2.0, 3.0]])  # one row: rank 0 computes, every other rank is idle
    synk.chain(s.first, all_reduce=s.acc, op="sum", zeros_if_idle=zeros_if_idle)(synk.data(x))
    expected = x[0] if zeros_if_idle else x[0] + (ranks - 1)
    for value in _in_ranks(s.acc, ranks):
        np.testing.assert_allclose(value, expected)
