"""Where the time of a data-parallel training step goes on GPUs (phase by phase).

Run on a GPU machine (``bash gpu/run_device.sh profile``).  Part 1, one GPU, plain PyTensor JAX
functions of the DDP-anchor MLP: the fused step (gradient + update in one function), the
gradient program alone (flat gradient as an output), the update program alone, and the
pipeline synkhronos runs (gradient, host read of the loss, update).  Part 2, every GPU through
``synk_comm.spawn``: the NCCL all-reduce of the flat gradient alone, the gradient program
alone, and both at once (the all-reduce of the previous bucket overlapping the computation),
which says what overlapping communication with the backward pass can win.  Part 3, Synkhronos'
own step (``synk_lasagne``'s training function) on 1 and every GPU: the chained step, its gradient
and update calls alone, and a cProfile of the master, with 2048 or 16384 rows scattered.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_gpu import WIDTHS, C, D, mlp, synk_training


def build(batch: int):
    import jax
    import pytensor
    import pytensor.tensor as pt

    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    x, y = pt.matrix("x"), pt.ivector("y")
    loss, params = mlp(x, y, rng, WIDTHS)
    grads = pytensor.grad(loss, params)
    flat_g = pt.concatenate([g.flatten() for g in grads])
    sizes = [int(np.prod(p.get_value().shape)) for p in params]
    offsets = np.cumsum([0, *sizes])
    flat = pt.vector("flat", dtype="float32")
    fused = pytensor.function([x, y], loss, updates=[(p, p - np.float32(1e-3) * g) for p, g in zip(params, grads)],
                              mode="JAX")
    grad_fn = pytensor.function([x, y], [loss, flat_g], mode="JAX")
    step_fn = pytensor.function([flat], [], updates=[(p, p - np.float32(1e-3) * flat[a:b].reshape(p.shape))
                                                    for p, a, b in zip(params, offsets[:-1], offsets[1:])], mode="JAX")
    for f in (fused, grad_fn, step_fn):
        f.trust_input = True
    for p in params:
        p.container.storage[0] = jax.device_put(p.get_value(), dev)
    xd = jax.device_put(rng.standard_normal((batch, D)).astype("float32"), dev)
    yd = jax.device_put(rng.integers(0, C, batch).astype("int32"), dev)
    return params, fused, grad_fn, step_fn, xd, yd


def timeit(fn, reps: int = 20, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def one_gpu() -> None:
    for batch in (8192, 4096):
        phases(batch)


def phases(batch: int) -> None:
    import jax

    params, fused, grad_fn, step_fn, xd, yd = build(batch)
    last = params[0].container.storage
    t_fused_async = timeit(lambda: fused(xd, yd))
    jax.block_until_ready(last[0])
    t_fused_sync = timeit(lambda: np.asarray(fused(xd, yd)))
    t_grad = timeit(lambda: jax.block_until_ready(grad_fn(xd, yd)))
    _, flat = grad_fn(xd, yd)
    t_step = timeit(lambda: (step_fn(flat), jax.block_until_ready(last[0])))

    def pipeline():
        loss, flat = grad_fn(xd, yd)
        jax.block_until_ready(flat)
        np.asarray(loss)
        step_fn(flat)

    t_pipe = timeit(pipeline)
    jax.block_until_ready(last[0])
    t_call = timeit(lambda: step_fn(flat), reps=50)  # dispatch only (queued)
    jax.block_until_ready(last[0])
    print(f"1 GPU batch {batch}: fused async {t_fused_async * 1e3:.2f} ms, fused + loss read "
          f"{t_fused_sync * 1e3:.2f} ms, grad program {t_grad * 1e3:.2f} ms, update program "
          f"{t_step * 1e3:.2f} ms, grad+sync+update {t_pipe * 1e3:.2f} ms, update dispatch "
          f"{t_call * 1e6:.0f} us", flush=True)


def ranks(group, batch: int) -> dict:
    import jax
    import nccl.core as nc

    from synk_comm.nccl import CudaBuffer

    _, _, grad_fn, _, xd, yd = build(batch // group.size)
    comm, stream = group.nccl.comm, group.nccl._stream
    _, flat = grad_fn(xd, yd)
    other = jax.numpy.ones_like(flat)
    jax.block_until_ready((flat, other))
    cf, co = CudaBuffer(flat), CudaBuffer(other)

    def allreduce():
        comm.allreduce(cf, cf, nc.SUM, stream=stream)
        stream.sync()

    def grad():
        jax.block_until_ready(grad_fn(xd, yd))

    def overlapped():
        out = grad_fn(xd, yd)  # queued on XLA's stream
        comm.allreduce(co, co, nc.SUM, stream=stream)  # the previous bucket, on NCCL's stream
        stream.sync()
        jax.block_until_ready(out)

    res = {}
    for name, fn in [("allreduce", allreduce), ("grad", grad), ("overlapped", overlapped)]:
        group.barrier()
        res[name] = timeit(fn)
    return res


def synk_phases(n: int, batch: int, scattered: int, steps: int = 20) -> None:
    """Part 3: Synkhronos' own step (``synk_lasagne``, one ``synk.chain`` command) on ``n`` GPUs: the
    chained step, its gradient call alone and its update call alone, then where the master's time
    goes (cProfile).  ``scattered`` rows are scattered, ``batch // n`` selected with ``batch_s``."""
    import cProfile
    import pstats

    import synkhronos as synk

    train, params = synk_training(n, scattered)
    rows = slice(0, batch // n)

    def done() -> None:
        synk.get_value(0, params[-1])

    t_step = timeit(lambda: train(batch_s=rows), reps=steps, warm=10)
    t_grad = timeit(lambda: train.grad_fn(batch_s=rows), reps=steps)
    t_update = timeit(train.step_fn, reps=steps)
    done()
    print(f"synk {n} GPU(s), batch {batch} of {scattered} scattered rows: chained step {t_step * 1e3:.2f} ms, "
          f"gradient call {t_grad * 1e3:.2f} ms, update call {t_update * 1e3:.2f} ms (queued)", flush=True)
    with cProfile.Profile() as prof:
        for _ in range(steps):
            train(batch_s=rows)
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(12)
    stats.sort_stats("cumulative").print_stats(30)
    synk.close()


def main() -> None:
    import subprocess
    import sys

    import synk_comm

    if os.environ.get("SYNK_PROFILE_ONE_GPU") == "1":  # the child below: part 1 only
        one_gpu()
        return
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", XLA_PYTHON_CLIENT_PREALLOCATE="false", SYNK_PROFILE_ONE_GPU="1")
    subprocess.run([sys.executable, __file__], env=env, check=False, timeout=300)
    n = len(os.listdir("/proc/driver/nvidia/gpus"))
    for k in sorted({1, n}):
        for scattered in (2048, 16384):
            synk_phases(k, 2048, scattered)
    r = synk_comm.spawn(ranks, n, args=(8192,), devices=list(range(n)))[0]
    print(f"{n} GPUs batch 8192 ({8192 // n} per GPU), rank 0: flat-gradient all-reduce "
          f"{r['allreduce'] * 1e3:.2f} ms, grad program {r['grad'] * 1e3:.2f} ms, both at once "
          f"{r['overlapped'] * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
