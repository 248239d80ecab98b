"""The JAX engine on real GPUs (skipped without one): a training step against plain PyTensor JAX on
1 GPU, the in-graph all-reduce's full-batch gradient on 2, and a worker killed during a call
(inside an all-reduce over NCCL on 2 GPUs) -> WorkerDiedError within 5 s, then fork again.

Run in a pytest process of its own (the master must not start JAX on the GPUs first):
``python -m pytest packages/synk-theano/tests/test_synk_engine_gpu.py`` (``gpu/run_device.sh engine``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from synkhronos import emulation


def _real_gpus() -> int:
    if emulation.emulated_gpus():
        return 0
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


pytestmark = [pytest.mark.skipif(_real_gpus() < 1, reason="needs a GPU"), pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:Numba will use object mode:UserWarning")]

N = min(2, _real_gpus())


@pytest.fixture
def synk():
    import synkhronos

    yield synkhronos
    synkhronos.close()


def _problem(rng):
    x = rng.standard_normal((8 * N, 16)).astype("float32")
    y = rng.standard_normal((8 * N, 4)).astype("float32")
    w0 = (rng.standard_normal((16, 4)) / 4).astype("float32")
    return x, y, w0


def test_a_step_matches_plain_pytensor_and_the_all_reduce_gives_the_full_batch_gradient(synk):
    import pytensor
    import pytensor.tensor as pt
    from synk_engine_ops import RankSum

    rng = np.random.default_rng(0)
    xd, yd, w0 = _problem(rng)
    assert synk.fork(N, use_gpu=True, engine="jax") == N
    x, y = pt.matrix("x", dtype="float32"), pt.matrix("y", dtype="float32")
    w = pytensor.shared(w0.copy(), name="w")
    batch = len(xd)
    loss_local = pt.sum((pt.tanh(x.dot(w)) - y) ** 2)
    grad = RankSum()(pytensor.grad(loss_local, w)) / np.float32(batch)
    f = synk.function([x, y], outputs=(RankSum()(loss_local) / np.float32(batch), "avg"),
                      updates=[(w, w - np.float32(0.1) * grad)])
    loss = f(synk.data(xd), synk.data(yd))
    wp = pytensor.shared(w0.copy())
    full = pt.sum((pt.tanh(x.dot(wp)) - y) ** 2) / np.float32(batch)
    plain = pytensor.function([x, y], full, updates=[(wp, wp - np.float32(0.1) * pytensor.grad(full, wp))],
                              mode="JAX")
    expected = plain(xd, yd)
    assert loss == pytest.approx(float(expected), rel=2e-3)
    for r in range(N):
        np.testing.assert_allclose(synk.get_value(r, w), wp.get_value(), rtol=2e-3, atol=2e-4)


def test_a_worker_killed_during_a_call_on_gpus(synk):
    import pytensor.tensor as pt
    from synk_engine_ops import RankSum, Stall
    from synk_testutil import assert_no_workers_left, own_entries

    from synkhronos.runtime import current

    synk.fork(N, use_gpu=True, engine="jax")
    x = pt.vector("x", dtype="float32")
    f = synk.function([x], outputs=(RankSum()(Stall(3.0)(x).sum()), "avg"))
    group = current().group
    victim = group._procs[N]
    killed: list[float] = []

    def kill() -> None:
        os.kill(victim.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    nccl_before = {e for e in os.listdir("/dev/shm") if e.startswith("nccl")}
    timer = threading.Timer(1.0, kill)
    timer.start()
    with pytest.raises(synk.WorkerDiedError):
        f(synk.data(np.ones(2 * N, dtype="float32")))
    timer.join()
    assert time.monotonic() - killed[0] < 5
    synk.close()
    assert_no_workers_left()
    assert own_entries(group.prefix) == []
    left = sorted({e for e in os.listdir("/dev/shm") if e.startswith("nccl")} - nccl_before)
    print(f"NCCL entries left in /dev/shm after the kill: {left}")
    synk.fork(N, use_gpu=True, engine="jax")
    g = synk.function([x], outputs=(x.sum(), "sum"))
    assert g(synk.data(np.arange(2.0 * N, dtype="float32"))) == pytest.approx(np.arange(2.0 * N).sum())
