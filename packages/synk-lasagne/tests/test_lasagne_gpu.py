"""GPU mode on 2+ GPUs (``gpu`` marker): a CNN of synk_lasagne.layers trained data-parallel, one
rank per GPU (PyTensor's JAX backend: the convolution and pooling Ops as lax convolutions and
reduce_window), equals the single-process step on the whole batch computed on the CPU.  float64
(as the synkhronos GPU suite runs), so that the GPU's convolutions compare tightly with numpy's.
With ``SYNK_EMULATE_GPUS=2`` it runs on JAX's CPU backend (a developer check of the code path)."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from lasagne_testutil import FAST, NumpyRule
from test_lasagne_cnn_parallel import SIZES, cnn, data, loss_of

from synk_lasagne import layers, make_train_function, updates


def _gpu_count() -> int:
    from synkhronos.forking import gpu_count

    return gpu_count()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs"),
              pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def gpus():
    import synkhronos

    old = pytensor.config.floatX
    pytensor.config.floatX = "float64"
    n = synkhronos.fork(use_gpu=True)
    yield n
    synkhronos.close()
    pytensor.config.floatX = old


def test_cnn_step_on_gpus_equals_the_single_process_step(gpus):
    import synkhronos as synk

    net = cnn(batch_norm=False)
    params = layers.get_all_params(net, trainable=True)
    x, y = pt.tensor4("x"), pt.ivector("y")
    train = make_train_function(loss_of(net, x, y), params, [x, y], updates.momentum, learning_rate=0.1,
                                momentum=0.5)
    reference_net = cnn(batch_norm=False)
    ref_params = layers.get_all_params(reference_net, trainable=True)
    ref_loss = loss_of(reference_net, x, y)
    ref_fn = pytensor.function([x, y], [ref_loss, *pytensor.grad(ref_loss, ref_params)], **FAST)
    rule = NumpyRule("momentum", learning_rate=0.1, momentum=0.5)
    x_value, y_value = data()
    x_data, y_data = synk.data(x_value), synk.data(y_value)
    start = 0
    for step, size in enumerate(SIZES):
        idx = np.arange(start, start + size)
        start += size
        loss = train(x_data, y_data, batch=idx)
        expected_loss, *grads = ref_fn(x_value[idx], y_value[idx])
        for p, v in zip(ref_params, rule.step([p.get_value() for p in ref_params], grads)):
            p.set_value(v)
        np.testing.assert_allclose(np.asarray(loss), expected_loss, rtol=1e-7, err_msg=f"loss of step {step}")
        for p, ref, gathered in zip(params, ref_params, synk.gather(params, nd_up=1)):
            for rank in range(gpus):
                np.testing.assert_allclose(np.asarray(gathered[rank]), ref.get_value(), rtol=1e-6, atol=1e-9,
                                           err_msg=f"{p.name} in rank {rank} after step {step}")
