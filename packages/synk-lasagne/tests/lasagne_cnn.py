"""The small CNN of the data-parallel CNN tests (CPU ranks in ``test_lasagne_cnn_parallel.py``, GPUs
in ``test_lasagne_gpu.py``) and the check that both make: every momentum step of the data-parallel
training equals the single-process step on the whole batch (a second CNN with the same initial
values, its loss and gradients in one PyTensor function, the update in numpy).  And the check that
every way a Lasagne script builds its step advances each rank's batch-norm running averages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytensor
import pytensor.tensor as pt
from lasagne_testutil import FAST, NumpyRule

import synkhronos as synk
from synk_lasagne import layers, make_train_function, nonlinearities, objectives, regularization, updates
from synk_lasagne.random import set_rng

N_ROWS, SIZES = 30, [7, 10, 5]
"""The rows of :func:`data` and the batch size of each checked step."""


def cnn(batch_norm: bool = False) -> Any:
    set_rng(np.random.RandomState(3))
    net = layers.InputLayer((None, 1, 8, 8))
    conv = layers.Conv2DLayer(net, 3, 3, pad="same", nonlinearity=nonlinearities.tanh)
    net = layers.batch_norm(conv) if batch_norm else conv
    net = layers.MaxPool2DLayer(net, 3, stride=2, pad=1)
    net = layers.Conv2DLayer(net, 4, 2, stride=2, nonlinearity=nonlinearities.tanh)
    net = layers.Pool2DLayer(net, 2, mode="average_inc_pad")
    return layers.DenseLayer(net, 3, nonlinearity=nonlinearities.softmax)


def loss_of(net: Any, x: Any, y: Any, **kwargs: Any) -> Any:
    p = layers.get_output(net, x, **kwargs)
    return objectives.aggregate(objectives.categorical_crossentropy(p, y)) \
        + 1e-3 * regularization.regularize_network_params(net, regularization.l2)


def data(n: int = N_ROWS, seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 1, 8, 8)), rng.integers(0, 3, n).astype("int32")


def assert_momentum_steps_equal_the_single_process_steps(ranks: int, order: Sequence[int], *, loss_rtol: float,
                                                         rtol: float, atol: float,
                                                         function_kwargs: dict[str, Any] | None = None) -> None:
    """Train :func:`cnn` data-parallel (momentum, in the forked ``ranks``) on the rows of ``order``
    (:data:`SIZES` rows a step) and assert that each step's loss, and every rank's parameters after
    it, equal the single-process step's."""
    net = cnn()
    params = layers.get_all_params(net, trainable=True)
    x, y = pt.tensor4("x"), pt.ivector("y")
    train = make_train_function(loss_of(net, x, y), params, [x, y], updates.momentum, learning_rate=0.1,
                                momentum=0.5, function_kwargs=function_kwargs)
    reference_net = cnn()  # the same initial values, its own variables
    ref_params = layers.get_all_params(reference_net, trainable=True)
    ref_loss = loss_of(reference_net, x, y)
    ref_fn = pytensor.function([x, y], [ref_loss, *pytensor.grad(ref_loss, ref_params)], **FAST)
    rule = NumpyRule("momentum", learning_rate=0.1, momentum=0.5)
    x_value, y_value = data()
    x_data, y_data = synk.data(x_value), synk.data(y_value)
    start = 0
    for step, size in enumerate(SIZES):
        idx = np.asarray(order[start:start + size])
        start += size
        loss = train(x_data, y_data, batch=idx)
        expected_loss, *grads = ref_fn(x_value[idx], y_value[idx])
        for p, v in zip(ref_params, rule.step([p.get_value() for p in ref_params], grads)):
            p.set_value(v)
        np.testing.assert_allclose(np.asarray(loss), expected_loss, rtol=loss_rtol, err_msg=f"loss of step {step}")
        for p, ref, gathered in zip(params, ref_params, synk.gather(params, nd_up=1)):
            for rank in range(ranks):
                np.testing.assert_allclose(np.asarray(gathered[rank]), ref.get_value(), rtol=rtol, atol=atol,
                                           err_msg=f"{p.name} in rank {rank} after step {step}")


def assert_batch_norm_idioms_advance_each_ranks_averages(n_ranks: int, function_kwargs: dict[str, Any]) -> None:
    """Every way a Lasagne script builds its step advances each rank's running averages once, from
    its own rows, as numpy's ``(1 - alpha) * running + alpha * batch_value`` says: the update rule
    given the loss (after an evaluation function distributed the averages), a second training
    graph built later, and a rule given gradients (the alias's default update, as in PyTensor)."""
    alpha = 0.5
    x = pt.matrix("x")
    bn = layers.BatchNormLayer(layers.InputLayer((None, 3), x), alpha=alpha)
    net = layers.DenseLayer(bn, 1)
    params = layers.get_all_params(net, trainable=True)
    rows = np.random.default_rng(7).normal(size=(3, 8, 3)) * 2 + 1  # three batches of 8 rows: 4 per rank
    running = [(np.zeros(3), np.ones(3))] * n_ranks

    def advance(batch):
        shares = np.array_split(batch, n_ranks)
        return [((1 - alpha) * m + alpha * s.mean(axis=0),
                 (1 - alpha) * v + alpha / np.sqrt(s.var(axis=0) + bn.epsilon)) for (m, v), s in zip(running, shares)]

    def assert_running(expected):
        for got, want in zip((synk.gather(bn.mean, nd_up=1), synk.gather(bn.inv_std, nd_up=1)), zip(*expected)):
            np.testing.assert_allclose(got, np.array(want), rtol=1e-10)

    evaluate = synk.function([x], layers.get_output(net, deterministic=True), **function_kwargs)
    evaluate(synk.data(rows[0]))  # distributes the running averages before any training graph
    loss = pt.mean(layers.get_output(net) ** 2)
    synk.function([x], loss, updates=updates.sgd(loss, params, 0.0), **function_kwargs)(synk.data(rows[0]))
    running = advance(rows[0])
    assert_running(running)
    later = pt.mean(layers.get_output(net) ** 2)  # another training graph, distributed after training began
    synk.function([x], later, updates=updates.sgd(later, params, 0.0), **function_kwargs)(synk.data(rows[1]))
    running = advance(rows[1])
    assert_running(running)
    grads = pt.mean(layers.get_output(net) ** 2)
    step = updates.sgd(pytensor.grad(grads, params), params, 0.0)  # no state updates among them
    synk.function([x], grads, updates=step, **function_kwargs)(synk.data(rows[2]))
    running = advance(rows[2])
    assert_running(running)
