"""The JAX engine's call path (issue 17, item 3) on JAX's CPU device: one rank (whose host rows are
the program's operands, moved by the program's own dispatch), calls that repeat a plan (the
worker's :attr:`~synkhronos.engine.worker.Ranks.known` plans), Data that change between calls, and
the registration of the inputs' memory with the device, forced on (``SYNK_PIN_INPUTS=1``) where it
is impossible: it falls back to pageable memory and every result equals plain PyTensor's.

Needs JAX (skipped without it).
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

pytest.importorskip("jax")

from synk_testutil import TIMEOUT, assert_no_workers_left

import synkhronos as synk
from synkhronos.engine import worker as engine_worker
from synkhronos.runtime import current

pytestmark = [pytest.mark.timeout(TIMEOUT),
              pytest.mark.filterwarnings("ignore:Numba will use object mode:UserWarning")]


@pytest.fixture(scope="module")
def one_rank():
    """One engine worker that tries to register its inputs' memory (JAX's CPU device refuses)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(engine_worker.PIN_ENV, "1")
        synk.fork(1, use_gpu=False, engine="jax")
    assert current().engine is not None and current().size == 1
    yield
    synk.close()
    assert_no_workers_left()


def _step(n_in: int, params: list[np.ndarray]):
    """A softmax-regression step with an MLP layer: (loss, updates) over shared ``params``."""
    x, y, lr = pt.matrix("x"), pt.ivector("y"), pt.scalar("lr")
    w1, b1, w2 = (pytensor.shared(p.copy()) for p in params)
    h = pt.tanh(x.dot(w1) + b1)
    logp = pt.special.log_softmax(h.dot(w2), axis=1)
    loss = -pt.mean(logp[pt.arange(y.shape[0]), y])
    shared = [w1, b1, w2]
    updates = [(p, p - lr * g) for p, g in zip(shared, pytensor.grad(loss, shared))]
    return (x, y, lr), loss, updates, shared


def test_one_rank_steps_equal_plain_pytensor_over_changing_batches_and_data(one_rank):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal((5, 7)) * 0.3, np.zeros(7), rng.standard_normal((7, 3)) * 0.3]
    xs, ys = rng.standard_normal((40, 5)), rng.integers(0, 3, 40).astype("int32")
    (x, y, lr), loss, updates, shared = _step(5, params)
    f = synk.function([x, y], bcast_inputs=[lr], outputs=[loss, (x.sum(axis=0), "sum")], updates=updates)
    (px, py, plr), ploss, pupdates, pshared = _step(5, params)
    g = pytensor.function([px, py, plr], [ploss, px.sum(axis=0)], updates=pupdates)
    xd, yd, lrd = synk.data(xs), synk.data(ys), synk.data(np.float64(0.1))
    # the same plan again and again (looked up, not decoded), other plans, then the Data changed:
    # new values in place, and a reallocation (a longer Data: a new segment)
    batches = [8, 8, slice(8, 24), 8, rng.permutation(40)[:12], slice(8, 24)]
    for i, batch in enumerate([*batches, "grow", 8, slice(30, 50)]):
        if isinstance(batch, str):  # "grow"
            xs, ys = np.concatenate([xs, rng.standard_normal((20, 5))]), np.concatenate(
                [ys, rng.integers(0, 3, 20).astype("int32")])
            xd.set_value(xs)
            yd.set_value(ys)
            continue
        if i == 3:
            xs[:] = rng.standard_normal(xs.shape)
            xd.data[:] = xs  # written in place: no new segment
        rows = np.arange(len(xs))[batch] if not isinstance(batch, int) else np.arange(batch)
        got = f(xd, yd, lrd, batch=batch)
        want = g(xs[rows], ys[rows], 0.1)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-10)
    for s, p in zip(shared, pshared):
        np.testing.assert_allclose(s.get_value(), p.get_value(), rtol=1e-10)
    assert f._plans  # the master reused checked plans
    xd.free_memory()  # a known plan's Data changed: the call is checked again
    with pytest.raises(ValueError, match="holds no memory"):
        f(xd, yd, lrd, batch=8)


def test_a_stepped_slice_batch_reads_its_own_indices_after_a_list_batch(one_rank):
    # A slice with a step is an index batch: its indices sit in the shared index buffer, which a
    # list batch in between overwrites, so its checked plan must not be reused as it is.
    data = np.arange(80.0).reshape(40, 2)
    x = pt.matrix("x")
    f = synk.function([x], outputs=(x.sum(axis=0), "sum"))
    d = synk.data(data)
    for batch in [slice(2, 30, 3), [3, 1, 4, 1, 5], slice(2, 30, 3), 11, slice(2, 30, 3)]:
        rows = data[:batch] if isinstance(batch, int) else data[batch]  # an int k: rows [:k]
        np.testing.assert_allclose(f(d, batch=batch), rows.sum(axis=0))


def test_one_rank_windows_subsets_and_no_outputs(one_rank):
    rng = np.random.default_rng(1)
    values = rng.standard_normal((12, 3))
    s = pytensor.shared(np.zeros((1, 3)), name="s")
    w = pytensor.shared(np.zeros(3), name="w")
    x = pt.matrix("x")
    f = synk.function([], outputs=[(s.sum(axis=0), "sum"), (s, None)], updates=[(w, w + s.sum(axis=0))],
                      sliceable_shareds=[s])
    h = synk.function([x], outputs=[(x.sum(), "sum"), (x.max(), "max")])
    u = synk.function([x], updates=[(w, w + x.sum(axis=0))])
    synk.scatter(s, synk.data(values))
    for sel in (slice(1, 4), slice(1, 4), slice(5, 8)):
        got = f(batch_s=sel)
        np.testing.assert_allclose(got[1], values[sel], rtol=1e-12)
    np.testing.assert_allclose(w.get_value(), 2 * values[1:4].sum(axis=0) + values[5:8].sum(axis=0), rtol=1e-12)
    xd = synk.data(rng.standard_normal((6, 3)))
    # outputs that leave a one-rank program without a collective: an integer avg and a boolean max
    # (combined by the master), a 0-d gather, a prod
    k = synk.function([x], outputs=[(x.shape[0], "avg"), ((x > 0).any(), "max"), (pt.mean(x), None),
                                    (1 + 0.1 * x.sum(), "prod")])
    got = k(xd)
    assert got[0] == 6  # one part is returned as it is (synkhronos.reduce_ops.combine)
    assert bool(got[1]) == bool((xd.data > 0).any())
    np.testing.assert_allclose(got[2], [xd.data.mean()], rtol=1e-12)
    assert got[3] == pytest.approx(1 + 0.1 * xd.data.sum())
    assert h(xd, output_subset=[1]) == [pytest.approx(xd.data.max())]
    assert h(xd)[0] == pytest.approx(xd.data.sum())
    before = w.get_value()
    assert u(xd) is None
    np.testing.assert_allclose(w.get_value(), before + xd.data.sum(axis=0), rtol=1e-12)


def test_a_large_input_falls_back_to_pageable_memory_where_registration_fails(one_rank):
    rng = np.random.default_rng(2)
    values = rng.standard_normal((300, 512))  # 1.2 MB: registration is tried, JAX's CPU device refuses it
    x = pt.matrix("x")
    f = synk.function([x], outputs=[(x.sum(axis=0), "sum"), (x[:, :3], None)])
    d = synk.data(values)
    for batch in (slice(0, 256), 100, slice(0, 256)):
        got = f(d, batch=batch)
        rows = values[batch] if isinstance(batch, slice) else values[:batch]
        np.testing.assert_allclose(got[0], rows.sum(axis=0), rtol=1e-12)
        np.testing.assert_allclose(got[1], rows[:, :3], rtol=1e-12)


class _Client:
    """A device client that registers memory (or refuses to), recording what it was asked."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.mapped: dict[int, int] = {}
        self.calls = 0

    def dma_map(self, address: int, nbytes: int) -> None:
        self.calls += 1
        if self.refuse:
            raise RuntimeError("UNIMPLEMENTED: DmaMap is not supported.")
        self.mapped[address] = nbytes

    def dma_unmap(self, address: int) -> None:
        del self.mapped[address]


class _Device:
    def __init__(self, client: _Client) -> None:
        self.client = client


class _Runtime:
    def __init__(self, data: dict[int, object]) -> None:
        self.data = data


def _ranks(client: _Client) -> engine_worker.Ranks:
    ranks = engine_worker.Ranks.__new__(engine_worker.Ranks)
    ranks.device, ranks.pinning, ranks.pinned, ranks.known = _Device(client), True, {}, {}
    return ranks


def test_registration_once_per_data_undone_before_it_changes_and_off_after_a_refusal(monkeypatch):
    from synk_shm import Data

    monkeypatch.setattr(engine_worker, "PIN_MIN_BYTES", 40)
    a, b, small = Data(np.ones((4, 3), "float32")), Data(np.ones(5, "int32"), oversize=2), Data(np.ones(9, "int32"))
    try:
        client = _Client()
        ranks, rt = _ranks(client), _Runtime({1: a, 2: b, 3: small})
        for _ in range(3):
            ranks.pin(rt, [1, 2, 3])  # type: ignore[arg-type]
        assert client.calls == 2 and ranks.pinned[3] == 0  # 36 bytes: below PIN_MIN_BYTES, not registered
        assert client.mapped == {a.data.__array_interface__["data"][0]: 48,
                                 b.data.__array_interface__["data"][0]: 40}  # the whole allocation
        ranks.unpin(1)  # before Data 1 changes (synkhronos.data_registry)
        assert list(client.mapped) == [b.data.__array_interface__["data"][0]] and 1 not in ranks.pinned
        ranks.unpin(1)  # nothing left to undo
        ranks.unpin(3)  # looked at again at its next call
        assert 3 not in ranks.pinned
        refusing = _Client(refuse=True)
        ranks = _ranks(refusing)
        ranks.pin(rt, [1, 2])  # type: ignore[arg-type]
        ranks.pin(rt, [1, 2])  # type: ignore[arg-type]
        assert refusing.calls == 1 and not ranks.pinning and not ranks.pinned
    finally:
        for d in (a, b, small):
            d.free_memory()


@pytest.mark.parametrize(("value", "on_gpu", "expected"), [("", True, True), ("", False, False), ("0", True, False),
                                                           ("1", False, True)])
def test_pin_inputs_switch(monkeypatch, value, on_gpu, expected):
    monkeypatch.setenv(engine_worker.PIN_ENV, value)
    assert engine_worker.pins_inputs(on_gpu) is expected
