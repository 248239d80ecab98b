"""A CNN built with synk_lasagne.layers, trained data-parallel in 2 CPU ranks (real worker
processes): every step equals the single-process step on the whole batch (convolution, pooling,
dense layers, weight decay; uneven splits), and batch norm uses each rank's own statistics, whose
running averages average over the ranks on request."""

from __future__ import annotations

import gc

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST, TIMEOUT, NumpyRule, assert_no_workers_left, own_entries

import synkhronos as synk
from synk_lasagne import layers, make_train_function, nonlinearities, objectives, regularization, updates
from synk_lasagne.random import set_rng
from synkhronos.runtime import current

pytestmark = pytest.mark.timeout(TIMEOUT)

N_ROWS, SIZES = 30, [7, 10, 5]
RTOL, ATOL = 1e-9, 1e-12


@pytest.fixture(scope="module")
def two_ranks():
    old = pytensor.config.floatX
    pytensor.config.floatX = "float64"  # before fork: the workers take the master's configuration
    n = synk.fork(2, use_gpu=False)
    prefix = current().group.prefix
    yield n
    synk.close()
    pytensor.config.floatX = old
    gc.collect()
    assert_no_workers_left()
    assert not own_entries(prefix)


def cnn(batch_norm: bool = False):
    set_rng(np.random.RandomState(3))
    net = layers.InputLayer((None, 1, 8, 8))
    conv = layers.Conv2DLayer(net, 3, 3, pad="same", nonlinearity=nonlinearities.tanh)
    net = layers.batch_norm(conv) if batch_norm else conv
    net = layers.MaxPool2DLayer(net, 3, stride=2, pad=1)
    net = layers.Conv2DLayer(net, 4, 2, stride=2, nonlinearity=nonlinearities.tanh)
    net = layers.Pool2DLayer(net, 2, mode="average_inc_pad")
    return layers.DenseLayer(net, 3, nonlinearity=nonlinearities.softmax)


def loss_of(net, x, y, **kwargs):
    p = layers.get_output(net, x, **kwargs)
    return objectives.aggregate(objectives.categorical_crossentropy(p, y)) \
        + 1e-3 * regularization.regularize_network_params(net, regularization.l2)


def data(n=N_ROWS, seed=4):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 1, 8, 8)), rng.integers(0, 3, n).astype("int32")


def test_cnn_step_equals_the_single_process_step(two_ranks):
    net = cnn()
    params = layers.get_all_params(net, trainable=True)
    x, y = pt.tensor4("x"), pt.ivector("y")
    train = make_train_function(loss_of(net, x, y), params, [x, y], updates.momentum, learning_rate=0.1,
                                momentum=0.5, function_kwargs=FAST)
    reference_net = cnn()  # the same initial values, its own variables
    ref_params = layers.get_all_params(reference_net, trainable=True)
    ref_loss = loss_of(reference_net, x, y)
    ref_fn = pytensor.function([x, y], [ref_loss, *pytensor.grad(ref_loss, ref_params)], **FAST)
    rule = NumpyRule("momentum", learning_rate=0.1, momentum=0.5)
    x_value, y_value = data()
    x_data, y_data = synk.data(x_value), synk.data(y_value)
    order = np.random.default_rng(5).permutation(N_ROWS)
    start = 0
    for step, size in enumerate(SIZES):
        idx = order[start:start + size]
        start += size
        loss = train(x_data, y_data, batch=idx)
        expected_loss, *grads = ref_fn(x_value[idx], y_value[idx])
        new = rule.step([p.get_value() for p in ref_params], grads)
        for p, v in zip(ref_params, new):
            p.set_value(v)
        np.testing.assert_allclose(loss, expected_loss, rtol=RTOL, err_msg=f"loss of step {step}")
        for p, ref, gathered in zip(params, ref_params, synk.gather(params, nd_up=1)):
            for rank in range(two_ranks):
                np.testing.assert_allclose(gathered[rank], ref.get_value(), rtol=RTOL, atol=ATOL,
                                           err_msg=f"{p.name} in rank {rank} after step {step}")


def test_batch_norm_uses_each_ranks_statistics(two_ranks):
    net = cnn(batch_norm=True)
    bn = next(lay for lay in layers.get_all_layers(net) if isinstance(lay, layers.BatchNormLayer))
    params = layers.get_all_params(net, trainable=True)
    x, y = pt.tensor4("x"), pt.ivector("y")
    train = make_train_function(loss_of(net, x, y), params, [x, y], updates.sgd, learning_rate=0.0,
                                function_kwargs=FAST)
    x_value, y_value = data(8)
    halves = [np.arange(4), np.arange(4, 8)]  # a batch of 8 rows splits 4 + 4, in order
    # the reference: each half on its own (its own batch statistics), in one process
    shard_mean = [x_value[h] for h in halves]
    single = pytensor.function([x, y], loss_of(net, x, y), **FAST)
    conv_out = pytensor.function([x], layers.get_output(bn.input_layer, x), **FAST)
    expected_loss = np.mean([single(x_value[h], y_value[h]) for h in halves])
    expected_means = [0.1 * conv_out(s).mean(axis=(0, 2, 3)) for s in shard_mean]

    loss = train(synk.data(x_value), synk.data(y_value))
    np.testing.assert_allclose(loss, expected_loss, rtol=RTOL)
    gathered = synk.gather(bn.mean, nd_up=1)
    for rank in range(two_ranks):
        np.testing.assert_allclose(gathered[rank], expected_means[rank], rtol=RTOL, atol=ATOL)
    assert not np.allclose(gathered[0], gathered[1])
    layers.average_running_statistics(net)
    averaged = synk.gather(bn.mean, nd_up=1)
    for rank in range(two_ranks):
        np.testing.assert_allclose(averaged[rank], np.mean(expected_means, axis=0), rtol=RTOL, atol=ATOL)
