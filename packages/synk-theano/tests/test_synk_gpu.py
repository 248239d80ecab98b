"""GPU mode on 2+ GPUs (``gpu`` marker): the JAX engine, one program over the GPUs per call.

Run in its own pytest process (the master must not have started JAX on every GPU before
``fork``): ``gpu/run_device.sh`` does.  References are numpy or the plain PyTensor function.  The
tests give every variable its dtype (float32), so that they pass under any floatX; under
``SYNK_EMULATE_GPUS=2`` they run on JAX's CPU devices (collectives over gloo).
"""

from __future__ import annotations

import numpy as np
import pytest


def _gpu_count() -> int:
    from synkhronos.forking import gpu_count

    return gpu_count()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs"),
              pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def synk():
    import synkhronos

    n = synkhronos.fork(use_gpu=True)
    assert n == _gpu_count()
    yield synkhronos
    synkhronos.close()


def test_introductory_example_matches_pytensor(synk) -> None:
    import pytensor
    import pytensor.tensor as pt

    x, y = pt.matrix("x", dtype="float32"), pt.vector("y", dtype="float32")
    z = pt.mean(x.dot(y), axis=0)
    f_th = pytensor.function([x, y], z)
    f = synk.function([x], bcast_inputs=[y], outputs=z)
    xd = np.random.randn(101, 10).astype("float32")
    yd = np.random.randn(10).astype("float32")
    r = f(synk.data(xd), synk.data(yd))
    assert isinstance(r, np.ndarray) and r.dtype == np.float32
    np.testing.assert_allclose(r, f_th(xd, yd), rtol=2e-3, atol=2e-3)


def test_shared_variable_example_numbers(synk) -> None:
    import pytensor
    import pytensor.tensor as pt

    s_init = np.ones(2, dtype="float32")
    x = pt.matrix("x", dtype="float32")
    s = pytensor.shared(s_init, name="s_gpu")
    f = synk.function([x], updates=[(s, pt.sum(x * s, axis=0))])
    x_dat = synk.data(np.array([[1, 1], [2, 2], [3, 3], [4, 4]], dtype="float32"))
    f.as_theano(x_dat.data)
    assert np.array_equal(s.get_value(), [10, 10])
    s.set_value(s_init)
    f(x_dat)  # the first call distributes f: from now on s lives on each worker's GPU
    assert isinstance(s.get_value(), np.ndarray)  # worker 0's value (the seed's master's)
    local = np.stack([p.sum(0) for p in np.array_split(x_dat.data, _gpu_count())])  # [[3, 3], [7, 7]] on 2
    np.testing.assert_array_equal(s.get_value(), local[0])
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), local)
    synk.reduce(s, op="sum")
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), [[10, 10], *local[1:]])
    s.set_value(np.zeros(2, dtype="float32"))
    np.testing.assert_array_equal(synk.get_value(0, s), [0, 0])
    synk.broadcast(s, s_init)
    f(x_dat)
    synk.all_reduce(s, op="sum")
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), np.full((_gpu_count(), 2), 10))
    np.testing.assert_array_equal(synk.gather(s, nd_up=1, nccl=False), np.full((_gpu_count(), 2), 10))


def test_collectives_with_uneven_shapes(synk) -> None:
    import pytensor

    n = _gpu_count()
    v = pytensor.shared(np.zeros((0, 3), dtype="float32"), name="v_gpu")
    f = synk.function([], outputs=(v.sum(), "sum"), sliceable_shareds=[v])
    data = np.arange(3 * (2 * n + 1), dtype="float32").reshape(-1, 3)
    synk.scatter(v, synk.data(data))
    assert [s[0] for s in synk.get_shapes(v)] == [len(p) for p in np.array_split(data, n)]
    np.testing.assert_array_equal(synk.gather(v, nd_up=0), data)
    np.testing.assert_allclose(f(), data.sum())
    np.testing.assert_allclose(f(batch_s=slice(0, 2), num_slices=2),
                               sum(p[:2].sum() for p in np.array_split(data, n)))
    synk.all_gather(v)
    np.testing.assert_array_equal(synk.get_value(n - 1, v), data)
    w = pytensor.shared(np.ones(4, dtype="float32"), name="w_gpu")
    g = synk.function([], outputs=w.sum(), updates=[(w, w * 2)])
    g()
    np.testing.assert_array_equal(synk.reduce(w, op="avg", in_place=False), np.full(4, 2.0))
    synk.set_value(1, w, np.full(4, 5.0, dtype="float32"))
    synk.all_reduce(w, op="max")
    np.testing.assert_array_equal(synk.gather(w), np.full((n, 4), 5.0))


def test_output_ops_and_batches(synk) -> None:
    import pytensor.tensor as pt

    x = pt.matrix("xo", dtype="float32")
    f = synk.function([x], outputs=[pt.mean(x), (pt.sum(x), "sum"), (x.sum(axis=1), None), (pt.max(x), "max")])
    xd = np.random.randn(37, 5).astype("float32")
    X = synk.data(xd)
    mean, total, rows, top = f(X)
    np.testing.assert_allclose(mean, xd.mean(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(total, xd.sum(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rows, xd.sum(axis=1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(top, xd.max())
    idx = np.random.permutation(37)[:20]
    mean, total, rows, top = f(X, batch=idx, num_slices=3)
    np.testing.assert_allclose(rows, xd[idx].sum(axis=1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mean, xd[idx].mean(), rtol=1e-4, atol=1e-5)


def test_other_mode_is_refused(synk) -> None:
    import pytensor.tensor as pt

    x = pt.matrix("xm", dtype="float32")
    with pytest.raises(ValueError, match="mode='JAX'"):
        synk.function([x], outputs=x.sum(), mode="NUMBA")
