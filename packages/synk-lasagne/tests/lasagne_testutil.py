"""Helpers of the synk-lasagne tests (a module of its own, uniquely named: every package's tests
run in one pytest session).

The reference for every update rule is plain numpy, written from the rules' equations (Lasagne's
maths), fed with gradients from a plain single-process PyTensor function of the same loss on the
same (whole) batch.  The data-parallel runs must match it step for step.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
TIMEOUT = 120
"""Seconds for any test that runs several processes (pytest.mark.timeout)."""
FAST = {"mode": "FAST_COMPILE"}
"""PyTensor mode of the test functions: compiles in a fraction of a second (the maths is the same)."""


@pytest.fixture(autouse=True)
def float64_and_seeded() -> Iterator[None]:
    """For a module that imports it: floatX float64 and synk_lasagne's random generator seeded (0)
    around each test."""
    import pytensor

    from synk_lasagne.random import set_rng

    old = pytensor.config.floatX
    pytensor.config.floatX = "float64"
    set_rng(np.random.RandomState(0))
    yield
    pytensor.config.floatX = old

COMM_TESTS = os.path.join(ROOT, "packages", "synk-comm", "tests")
if COMM_TESTS not in sys.path:  # the process and /dev/shm helpers (comm_testutil)
    sys.path.append(COMM_TESTS)

from comm_testutil import assert_no_workers_left, own_entries, worker_pids  # noqa: E402, F401

N_IN, N_HIDDEN, N_OUT = 5, 4, 3


# --- the model --------------------------------------------------------------------------------------

@contextlib.contextmanager
def forked_group(n: int) -> Iterator[int]:
    """A forked CPU-mode group of ``n`` ranks for the ``with`` block; on leaving it is closed and
    no worker process and no shared memory of the group may outlive it (what the module-scoped
    ``ranks`` fixture and the modules with a group of their own check)."""
    import gc

    import synkhronos as synk
    from synkhronos.runtime import current

    size = synk.fork(n, use_gpu=False)
    prefix = current().group.prefix
    try:
        yield size
    finally:
        synk.close()
        gc.collect()
    assert_no_workers_left()
    assert not own_entries(prefix), f"synk.close() left shared memory of its group: {own_entries(prefix)}"


def initial_params(seed: int = 0) -> list[np.ndarray]:
    """Values of W1 (5x4), b1 (4), W2 (4x3), b2 (3): several parameters of several shapes."""
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 0.5, (N_IN, N_HIDDEN)), rng.normal(0, 0.1, N_HIDDEN),
            rng.normal(0, 0.5, (N_HIDDEN, N_OUT)), rng.normal(0, 0.1, N_OUT)]


def make_data(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, N_IN)), rng.integers(0, N_OUT, n).astype("int32")


def loss_graph(x: Any, y: Any, params: Sequence[Any], decay: float = 1e-3) -> Any:
    """Mean cross-entropy of a tanh MLP, plus a weight decay term that does not depend on the rows."""
    import pytensor.tensor as pt

    w1, b1, w2, b2 = params
    logp = pt.special.log_softmax(pt.tanh(x @ w1 + b1) @ w2 + b2, axis=1)
    return -pt.mean(logp[pt.arange(y.shape[0]), y]) + decay * pt.sum(w1 ** 2)


def shared_params(values: Sequence[np.ndarray]) -> list[Any]:
    import pytensor

    return [pytensor.shared(v.copy(), name=name) for v, name in zip(values, ["W1", "b1", "W2", "b2"])]


class Reference:
    """Loss and gradients of the single-process model (plain PyTensor, parameters as inputs)."""

    def __init__(self) -> None:
        import pytensor
        import pytensor.tensor as pt

        x, y = pt.matrix("x"), pt.ivector("y")
        ps = [pt.matrix("W1"), pt.vector("b1"), pt.matrix("W2"), pt.vector("b2")]
        loss = loss_graph(x, y, ps)
        self.fn = pytensor.function([x, y, *ps], [loss, *pytensor.grad(loss, ps)], **FAST)

    def __call__(self, x: np.ndarray, y: np.ndarray, params: Sequence[np.ndarray]) -> tuple[float, list[np.ndarray]]:
        loss, *grads = self.fn(x, y, *params)
        return float(loss), [np.asarray(g) for g in grads]


# --- numpy references of the rules ------------------------------------------------------------------

class NumpyRule:
    """One update rule in numpy: ``step(params, grads) -> new params`` (keeps its own state)."""

    def __init__(self, name: str, **hyper: float) -> None:
        self.name = name
        self.hyper = hyper
        self.state: dict[str, list[np.ndarray]] = {}
        self.t = 0

    def _zeros(self, key: str, params: Sequence[np.ndarray]) -> list[np.ndarray]:
        if key not in self.state:
            self.state[key] = [np.zeros_like(p) for p in params]
        return self.state[key]

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        h = self.hyper
        name = self.name
        if "max_norm" in h:  # total_norm_constraint of the all-reduced gradient
            norm = np.sqrt(sum(float(np.sum(g ** 2)) for g in grads))
            grads = [g * (min(norm, h["max_norm"]) / (1e-7 + norm)) for g in grads]
        if name == "sgd":
            return [p - h["learning_rate"] * g for p, g in zip(params, grads)]
        if name in ("momentum", "nesterov_momentum"):
            mu, lr = h.get("momentum", 0.9), h["learning_rate"]
            vel = self._zeros("velocity", params)
            out = []
            for i, (p, g) in enumerate(zip(params, grads)):
                vel[i] = mu * vel[i] - lr * g
                out.append(p + vel[i] if name == "momentum" else p + mu * vel[i] - lr * g)
            return out
        if name == "adagrad":
            lr, eps = h.get("learning_rate", 1.0), h.get("epsilon", 1e-6)
            acc = self._zeros("accu", params)
            out = []
            for i, (p, g) in enumerate(zip(params, grads)):
                acc[i] = acc[i] + g ** 2
                out.append(p - lr * g / np.sqrt(acc[i] + eps))
            return out
        if name == "rmsprop":
            lr, rho, eps = h.get("learning_rate", 1.0), h.get("rho", 0.9), h.get("epsilon", 1e-6)
            acc = self._zeros("accu", params)
            out = []
            for i, (p, g) in enumerate(zip(params, grads)):
                acc[i] = rho * acc[i] + (1 - rho) * g ** 2
                out.append(p - lr * g / np.sqrt(acc[i] + eps))
            return out
        if name == "adadelta":
            lr, rho, eps = h.get("learning_rate", 1.0), h.get("rho", 0.95), h.get("epsilon", 1e-6)
            acc, dacc = self._zeros("accu", params), self._zeros("delta_accu", params)
            out = []
            for i, (p, g) in enumerate(zip(params, grads)):
                acc[i] = rho * acc[i] + (1 - rho) * g ** 2
                upd = g * np.sqrt(dacc[i] + eps) / np.sqrt(acc[i] + eps)
                dacc[i] = rho * dacc[i] + (1 - rho) * upd ** 2
                out.append(p - lr * upd)
            return out
        if name in ("adam", "adamax", "amsgrad"):
            default_lr = 0.002 if name == "adamax" else 0.001
            lr, b1, b2 = h.get("learning_rate", default_lr), h.get("beta1", 0.9), h.get("beta2", 0.999)
            eps = h.get("epsilon", 1e-8)
            self.t += 1
            t = self.t
            m, v, vmax = self._zeros("m", params), self._zeros("v", params), self._zeros("v_hat", params)
            out = []
            for i, (p, g) in enumerate(zip(params, grads)):
                m[i] = b1 * m[i] + (1 - b1) * g
                if name == "adamax":
                    v[i] = np.maximum(b2 * v[i], np.abs(g))
                    out.append(p - lr / (1 - b1 ** t) * m[i] / (v[i] + eps))
                    continue
                v[i] = b2 * v[i] + (1 - b2) * g ** 2
                if name == "amsgrad":
                    vmax[i] = np.maximum(vmax[i], v[i])
                    denom = np.sqrt(vmax[i]) + eps
                else:
                    denom = np.sqrt(v[i]) + eps
                out.append(p - lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m[i] / denom)
            return out
        raise ValueError(f"no numpy reference for rule {name!r}")


# --- numpy references of the convolution and pooling Ops -----------------------------------------

def reference_conv(x, w, stride=1, pad="valid", dilation=1, groups=1):
    """Direct loops over every output value: the definition of a grouped, dilated convolution."""
    sh, sw = (stride, stride) if np.isscalar(stride) else stride
    dh, dw = (dilation, dilation) if np.isscalar(dilation) else dilation
    f, cg, kh, kw = w.shape
    if pad == "valid":
        pads = ((0, 0), (0, 0))
    elif pad in ("full", "same"):
        eh, ew = dh * (kh - 1), dw * (kw - 1)  # the dilated filter's size, less one
        pads = ((eh, eh), (ew, ew)) if pad == "full" else (((eh + 1) // 2,) * 2, ((ew + 1) // 2,) * 2)
    elif np.isscalar(pad):
        pads = ((pad, pad), (pad, pad))
    elif np.isscalar(pad[0]):
        pads = ((pad[0], pad[0]), (pad[1], pad[1]))
    else:
        pads = pad
    xp = np.pad(x, ((0, 0), (0, 0), pads[0], pads[1]))
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((x.shape[0], f, oh, ow))
    per_group = f // groups
    for n in range(x.shape[0]):
        for o in range(f):
            g = o // per_group
            for i in range(oh):
                for j in range(ow):
                    patch = xp[n, g * cg:(g + 1) * cg, i * sh:i * sh + dh * (kh - 1) + 1:dh,
                               j * sw:j * sw + dw * (kw - 1) + 1:dw]
                    out[n, o, i, j] = np.sum(patch * w[o])
    return out


def reference_pool(x, ws, stride=None, pad=0, mode="max"):
    """Direct loops over every window."""
    wh, ww = (ws, ws) if np.isscalar(ws) else ws
    stride = (wh, ww) if stride is None else stride
    sh, sw = (stride, stride) if np.isscalar(stride) else stride
    ph, pw = (pad, pad) if np.isscalar(pad) else pad
    h, w = x.shape[-2:]
    oh, ow = (h + 2 * ph - wh) // sh + 1, (w + 2 * pw - ww) // sw + 1
    out = np.zeros((*x.shape[:-2], oh, ow))
    for i in range(oh):
        for j in range(ow):
            r0, c0 = i * sh - ph, j * sw - pw
            r_lo, r_hi, c_lo, c_hi = max(r0, 0), min(r0 + wh, h), max(c0, 0), min(c0 + ww, w)
            window = x[..., r_lo:r_hi, c_lo:c_hi]
            if mode == "max":
                out[..., i, j] = window.max(axis=(-2, -1))
            elif mode == "average_inc_pad":
                out[..., i, j] = window.sum(axis=(-2, -1)) / (wh * ww)
            else:
                out[..., i, j] = window.sum(axis=(-2, -1)) / ((r_hi - r_lo) * (c_hi - c_lo))
    return out



# --- subprocesses -----------------------------------------------------------------------------------

def run_script(args: Sequence[str], timeout: float = 240.0, cwd: str | None = None,
               env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run ``python *args`` as a run of its own (no inherited run prefix); capture its output.

    Returns the completed process and its pid (which names its shared-memory objects)."""
    full = dict(os.environ)
    full.pop("SYNK_RUN_PREFIX", None)
    full.update(env or {})
    with subprocess.Popen([sys.executable, *args], env=full, cwd=cwd or ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{args} ran past {timeout} s:\n{out}\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid
