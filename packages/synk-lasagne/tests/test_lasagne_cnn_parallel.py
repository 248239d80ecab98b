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
from lasagne_cnn import (
    N_ROWS,
    assert_batch_norm_idioms_advance_each_ranks_averages,
    assert_momentum_steps_equal_the_single_process_steps,
    cnn,
    data,
    loss_of,
)
from lasagne_testutil import FAST, TIMEOUT, assert_no_workers_left, own_entries

import synkhronos as synk
from synk_lasagne import layers, make_train_function, updates
from synkhronos.runtime import current

pytestmark = pytest.mark.timeout(TIMEOUT)

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


def test_cnn_step_equals_the_single_process_step(two_ranks):
    order = np.random.default_rng(5).permutation(N_ROWS)
    assert_momentum_steps_equal_the_single_process_steps(two_ranks, order, loss_rtol=RTOL, rtol=RTOL, atol=ATOL,
                                                         function_kwargs=FAST)


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
    # (a plain function of the training loss advances the running averages, as in Lasagne: not this one)
    single = pytensor.function([x, y], loss_of(net, x, y, batch_norm_update_averages=False), **FAST)
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


def test_batch_norm_running_averages_in_lasagnes_idioms(two_ranks):
    assert_batch_norm_idioms_advance_each_ranks_averages(two_ranks, FAST)
