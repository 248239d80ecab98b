"""GPU mode on 2+ GPUs (``gpu`` marker): a CNN of synk_lasagne.layers trained data-parallel, one
rank per GPU (PyTensor's JAX backend: the convolution and pooling Ops as lax convolutions and
reduce_window), equals the single-process step on the whole batch computed on the CPU.  float64
(as the synkhronos GPU suite runs), so that the GPU's convolutions compare tightly with numpy's.
With ``SYNK_EMULATE_GPUS=2`` it runs on JAX's CPU backend (a developer check of the code path)."""

from __future__ import annotations

import numpy as np
import pytensor
import pytest
from lasagne_cnn import N_ROWS, assert_momentum_steps_equal_the_single_process_steps


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
    order = np.arange(N_ROWS)
    assert_momentum_steps_equal_the_single_process_steps(gpus, order, loss_rtol=1e-7, rtol=1e-6, atol=1e-9)
