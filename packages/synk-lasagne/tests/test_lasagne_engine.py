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
