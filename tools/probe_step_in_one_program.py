"""Would the chain's step run faster as ONE XLA program, its all-reduce a custom call into Python?
(A diagnosis, not a benchmark of record; its finding is in the CPU guide, docs/guides/cpu.rst.)

One process, JAX on the CPU, asynchronous dispatch off (as a one-core rank): the main job's model
(8 x 64 ReLU, 10 classes) and a rank's share of its step (512 rows), Adam over one flat gradient,
three ways, in blocks of 100 steps taking turns (medians, us):

``fused``        gradient and update in one program; the other rank's gradient added as a constant
                 (what a free all-reduce would cost: the floor);
``custom call``  the same program with the sum done by a custom call (XLA's original custom-call
                 API, a ctypes callback into numpy) between the gradient and the update, where an
                 in-graph all-reduce over shared memory would run;
``separate``     what ``synk.chain`` does in each rank without the other ranks: the gradient call,
                 a numpy sum, the update call.

Run it pinned to one core, e.g. ``taskset -c 0 python tools/probe_step_in_one_program.py``.
The original custom-call API is deprecated in XLA:CPU (it logs so); this probes a design, it is not one.
"""

from __future__ import annotations

import ctypes
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def main(blocks: int = 15, calls: int = 100) -> None:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    rng = np.random.default_rng(0)
    sizes = [64] * 9 + [10]
    params = []
    for a, b in itertools.pairwise(sizes):
        params += [jnp.asarray(rng.uniform(-0.2, 0.2, (a, b)).astype("float32")), jnp.zeros(b, "float32")]
    n = sum(p.size for p in params)
    x = rng.random((512, 64)).astype("float32")
    y = rng.integers(0, 10, 512).astype("int32")
    peer = rng.random(n).astype("float32")  # stands for the other rank's gradient

    def loss(ps: list[Any], x: Any, y: Any) -> Any:
        h = x
        for i in range(0, len(ps) - 2, 2):
            h = jnp.maximum(h @ ps[i] + ps[i + 1], 0)
        logp = jax.nn.log_softmax(h @ ps[-2] + ps[-1])
        return -logp[jnp.arange(y.shape[0]), y].mean()

    def flat_grad(ps: list[Any], x: Any, y: Any) -> tuple[Any, Any]:
        value, grads = jax.value_and_grad(loss)(ps, x, y)
        return value, jnp.concatenate([g.ravel() for g in grads])

    def adam(ps: list[Any], m: Any, v: Any, t: Any, g: Any) -> tuple[Any, ...]:
        t = t + 1
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        step = 3e-3 * jnp.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m / (jnp.sqrt(v) + 1e-8)
        out, k = [], 0
        for p in ps:
            out.append(p - step[k:k + p.size].reshape(p.shape))
            k += p.size
        return out, m, v, t

    floats = ctypes.POINTER(ctypes.c_float)

    def add_peer(out: int, ins: Any) -> None:  # XLA's original custom-call signature: (out, ins)
        src = np.ctypeslib.as_array(ctypes.cast(ins[0], floats), (n,))
        np.add(src, peer, out=np.ctypeslib.as_array(ctypes.cast(out, floats), (n,)))

    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))(add_peer)
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype, capsule_new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    jax.ffi.register_ffi_target("synk_probe_add_peer", capsule_new(ctypes.cast(callback, ctypes.c_void_p).value,
                                                                   b"xla._CUSTOM_CALL_TARGET", None),
                                platform="cpu", api_version=0)

    def summed_by_callback(g: Any) -> Any:
        return jax.ffi.ffi_call("synk_probe_add_peer", jax.ShapeDtypeStruct(g.shape, g.dtype), has_side_effect=True,
                                custom_call_api_version=1)(g)

    @jax.jit
    def fused(ps: Any, m: Any, v: Any, t: Any, x: Any, y: Any) -> Any:
        value, g = flat_grad(ps, x, y)
        return (value, *adam(ps, m, v, t, g + jnp.asarray(peer)))

    @jax.jit
    def fused_custom_call(ps: Any, m: Any, v: Any, t: Any, x: Any, y: Any) -> Any:
        value, g = flat_grad(ps, x, y)
        return (value, *adam(ps, m, v, t, summed_by_callback(g)))

    grad_call, update_call = jax.jit(flat_grad), jax.jit(adam)
    state: list[Any] = [list(params), jnp.zeros(n), jnp.zeros(n), jnp.zeros(())]

    def one_program(program: Callable[..., Any]) -> Callable[[], None]:
        def step() -> None:
            _, *state[:] = program(*state, x, y)
        return step

    def separate() -> None:
        _, g = grad_call(state[0], x, y)
        state[:] = update_call(*state, np.add(np.asarray(g), peer))

    ways = {"fused (free all-reduce)": one_program(fused), "custom call": one_program(fused_custom_call),
            "separate (the chain)": separate}
    _, g = grad_call(state[0], x, y)
    np.testing.assert_allclose(np.asarray(jax.jit(summed_by_callback)(g)), np.asarray(g) + peer, rtol=1e-6)
    for step in ways.values():
        for _ in range(calls):
            step()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(blocks):
        for name, step in ways.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    for name, values in times.items():
        print(f"{name:24s} step median {statistics.median(values):7.1f} us, min {min(values):7.1f}")


if __name__ == "__main__":
    main()
