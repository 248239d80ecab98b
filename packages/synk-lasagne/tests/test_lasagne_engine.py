"""The training step under the JAX engine (``synk.fork(engine="jax")``) equals single-process
training: every batch, whether it splits evenly over the ranks or not (a rank without rows
included), runs as one program (gradient, in-graph all-reduce, update), never the train
function's chain, and gives the single-process step.  Needs JAX (skipped without it); 2 worker
processes on JAX's CPU devices.
"""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

import pytensor.tensor as pt
from lasagne_testutil import TIMEOUT, NumpyRule, Reference, initial_params, loss_graph, make_data, shared_params
from test_lasagne_parallel import N_ROWS, assert_every_rank, batches

import synkhronos as synk
from synk_lasagne import make_train_function, updates

pytestmark = pytest.mark.timeout(TIMEOUT)
RANKS = 2


@pytest.fixture(scope="module")
def engine():
    synk.fork(RANKS, use_gpu=False, engine="jax")
    yield RANKS
    synk.close()


def test_adam_under_the_engine_matches_single_process(engine, monkeypatch):
    import numpy as np

    from synk_lasagne.training import TrainFunction

    # Uneven batches used to fall back to the chain (NotOneProgramError): now one program each
    monkeypatch.setattr(TrainFunction, "chain", property(lambda self: pytest.fail("the step ran its chain")))

    x, y = make_data(N_ROWS)
    x_data, y_data = synk.data(x), synk.data(y)
    xs, ys = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    train = make_train_function(loss_graph(xs, ys, params), params, [xs, ys], updates.adam,
                                learning_rate=0.01)  # the engine compiles with mode="JAX"
    reference, ref_rule, ref = Reference(), NumpyRule("adam", learning_rate=0.01), initial_params()
    sizes = []
    for step, idx in enumerate(batches()):  # 7, 10, 1 (a rank without rows), 5, 8 rows over 2 ranks
        loss = train(x_data, y_data, batch=idx)
        ref_loss, grads = reference(x[idx], y[idx], ref)
        ref = ref_rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-9, err_msg=f"loss of step {step}")
        assert_every_rank(params, ref, engine, f"engine, step {step} ({len(idx)} rows)")
        sizes.append(len(idx))
    assert {s % RANKS for s in sizes} == {0, 1} and min(sizes) < RANKS  # even, uneven, a rank without rows


def test_a_rank_without_rows_keeps_its_batch_norm_statistics(engine):
    """A batch smaller than the ranks, in one program: the rank without rows applies the same
    parameter update as the others (it reads its rows only through the all-reduce) and keeps its
    batch norm running statistics (its rows would have made them: a mean over no rows is NaN), as
    the per-rank engine's chain does."""
    import numpy as np
    from test_lasagne_cnn_parallel import cnn, data, loss_of

    from synk_lasagne import layers

    net = cnn(batch_norm=True)
    bn = next(lay for lay in layers.get_all_layers(net) if isinstance(lay, layers.BatchNormLayer))
    params = layers.get_all_params(net, trainable=True)
    x, y = pt.tensor4("x"), pt.ivector("y")
    train = make_train_function(loss_of(net, x, y), params, [x, y], updates.momentum, learning_rate=0.1,
                                momentum=0.5)
    xd, yd = (synk.data(v) for v in data(4))
    train(xd, yd, batch=[0, 1, 2])  # 2 + 1 rows
    before = synk.gather(bn.mean, nd_up=1)
    train(xd, yd, batch=[3])  # 1 + 0 rows
    after = synk.gather(bn.mean, nd_up=1)
    assert np.isfinite(after).all() and not np.allclose(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    for p in params:
        gathered = synk.gather(p, nd_up=1)
        np.testing.assert_array_equal(gathered[0], gathered[1], err_msg=p.name)


def test_the_engines_step_all_reduces_each_parameter_on_its_own(engine):
    """On the engine the step's graph holds one all-reduce per parameter (and one of the weight),
    which XLA can start while the backward pass goes on, instead of one of the whole flat vector."""
    from pytensor.graph.basic import ancestors

    from synkhronos.ops import AllReduce

    xs, ys = pt.matrix("x"), pt.ivector("y")
    params = shared_params(initial_params())
    train = make_train_function(loss_graph(xs, ys, params), params, [xs, ys], updates.sgd, learning_rate=0.1)
    exprs = [expr for _, expr in train.function._replica.spec.updates]
    reduces = {v.owner for v in ancestors(exprs) if v.owner is not None and isinstance(v.owner.op, AllReduce)}
    assert len(reduces) == len(params) + 1
    assert all(node.op.op == "sum" and node.inputs[0].ndim == 1 for node in reduces)


def test_batch_norm_running_averages_in_lasagnes_idioms_under_the_engine(engine):
    """The running averages' alias (its default update) in one JAX program per call: each rank's
    averages advance once, from its own rows (:mod:`lasagne_cnn`)."""
    from lasagne_cnn import assert_batch_norm_idioms_advance_each_ranks_averages

    assert_batch_norm_idioms_advance_each_ranks_averages(engine, {})
