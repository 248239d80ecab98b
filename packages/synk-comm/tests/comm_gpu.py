"""SPMD functions of the GPU tests (importable by the workers): NCCL collectives on device
arrays of each framework, checked in every rank against numpy on the host."""

from __future__ import annotations

from typing import Any

import numpy as np


def _to_device(kind: str, a: np.ndarray) -> Any:
    if kind == "jax":
        import jax

        return jax.device_put(a, jax.devices()[0])
    if kind == "cupy":
        import cupy

        return cupy.asarray(a)
    import torch

    return torch.as_tensor(a, device="cuda")


def nccl_collectives(group: Any, kind: str) -> list[str]:
    """Run every collective on ``kind`` arrays; return the names of those that were wrong."""
    from synk_comm.nccl import to_host

    nc = group.nccl
    r, n = group.rank, group.size
    wrong = []

    def local(rank: int, shape: tuple[int, ...] = (4, 3)) -> np.ndarray:
        return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 10 * rank + 1)

    x = _to_device(kind, local(r))
    refs = [local(k) for k in range(n)]
    checks = {
        "all_reduce sum": (to_host(nc.all_reduce(x, "sum")), np.sum(refs, axis=0)),
        "all_reduce avg": (to_host(nc.all_reduce(x, "avg")), np.mean(refs, axis=0)),
        "all_reduce max": (to_host(nc.all_reduce(x, "max")), np.max(refs, axis=0)),
        "all_reduce min": (to_host(nc.all_reduce(x, "min")), np.min(refs, axis=0)),
        "all_reduce prod": (to_host(nc.all_reduce(x, "prod")), np.prod(refs, axis=0)),
        "broadcast": (to_host(nc.broadcast(x, root=n - 1)), refs[n - 1]),
        "reduce_scatter": (to_host(nc.reduce_scatter(_to_device(kind, np.tile(local(r), (n, 1))), "sum")),
                           np.split(np.sum([np.tile(a, (n, 1)) for a in refs], axis=0), n)[r]),
    }
    reduced = nc.reduce(x, "sum", root=0)
    if r == 0:
        checks["reduce"] = (to_host(reduced), np.sum(refs, axis=0))
    parts = nc.all_gather(x)
    checks["all_gather"] = (np.stack([to_host(p) for p in parts]), np.stack(refs))
    uneven = _to_device(kind, local(r, (r + 1, 2)))
    parts = nc.all_gather(uneven)
    checks["all_gather uneven"] = (np.concatenate([to_host(p) for p in parts]),
                                   np.concatenate([local(k, (k + 1, 2)) for k in range(n)]))
    gathered = nc.gather(uneven, root=0)
    if r == 0:
        checks["gather uneven"] = (np.concatenate([to_host(p) for p in gathered]),
                                   np.concatenate([local(k, (k + 1, 2)) for k in range(n)]))
    try:  # different shapes: every rank refuses before NCCL runs, and the group goes on
        nc.all_reduce(uneven, "sum")
        wrong.append(f"{kind} all_reduce of different shapes: no error")
    except ValueError:
        pass
    mixed = _to_device(kind, local(r).astype(np.int32 if r == n - 1 else np.float32))
    refused = [("all_reduce", lambda: nc.all_reduce(mixed, "sum")), ("all_gather", lambda: nc.all_gather(mixed))]
    for name, run in refused:
        try:  # different dtypes: NCCL would move different byte counts; every rank refuses instead
            run()
            wrong.append(f"{kind} {name} of different dtypes: no error")
        except ValueError:
            pass
    checks["all_reduce after a refused one"] = (to_host(nc.all_reduce(x, "sum")), np.sum(refs, axis=0))
    for name, (got, want) in checks.items():
        if got.shape != want.shape or not np.allclose(got, want):
            wrong.append(f"{kind} {name}: got {got.tolist()} want {want.tolist()}")
    return wrong


def group_dispatch(group: Any) -> list[str]:
    """group.all_reduce on a jax array goes through NCCL and returns a device array."""
    import jax

    x = jax.device_put(np.full(5, group.rank + 1.0, np.float32), jax.devices()[0])
    out = group.all_reduce(x, "sum")
    expected = sum(range(1, group.size + 1))
    ok = isinstance(out, jax.Array) and np.allclose(np.asarray(out), expected)
    return [] if ok else [f"dispatch: {type(out).__name__} {np.asarray(out).tolist()}"]


def jax_stream_order(group: Any) -> list[str]:
    """JAX all-reduces are queued behind the program that computes their input, on the GPU: an
    input still being computed, a result read at once by a JAX program, in-place reductions
    chained on their own results, out-of-place inputs dropped right after the call -- every value
    as numpy computes it."""
    import jax
    import jax.numpy as jnp

    import synk_comm.nccl

    synk_comm.nccl.ASYNC_MIN_BYTES = 0  # every size takes the queued path (its small sizes are quick)

    wrong = []
    n, r = group.size, group.rank
    big = jnp.full((4096, 4096), 1.0 / 4096, jnp.float32)
    slow = jax.jit(lambda a, v: (a @ a @ a @ a)[0, 0] * v)  # ~4 matmuls before v is written
    ones = jnp.ones(1 << 20, jnp.float32)
    pending = slow(big, ones * (r + 1))  # not ready when the all-reduce is queued
    summed = group.all_reduce(pending, "sum")
    doubled = jax.jit(lambda v: v * 2)(summed)  # reads the result at once
    want = 2.0 * sum(range(1, n + 1)) * float(np.asarray(big @ big @ big @ big)[0, 0])
    if not np.allclose(np.asarray(doubled), want, rtol=1e-4):
        wrong.append(f"ordered read: got {np.asarray(doubled)[:3]} want {want}")
    x = jnp.full(1 << 20, r + 1.0, jnp.float32)
    for _ in range(5):  # in place, each on the result of the last
        x = group.all_reduce(x, "max", out=x)
    if not np.all(np.asarray(x) == n):
        wrong.append(f"chained in place: got {np.asarray(x)[:3]} want {n}")
    results = [group.all_reduce(jnp.full(1 << 18, float(k + r), jnp.float32), "sum") for k in range(8)]
    for k, res in enumerate(results):  # inputs dropped by the caller while NCCL may still read them
        expected = sum(k + q for q in range(n))
        if not np.all(np.asarray(res) == expected):
            wrong.append(f"dropped input {k}: got {np.asarray(res)[:3]} want {expected}")
    group.nccl.synchronize()
    return wrong


def jax_result_memory(group: Any) -> list[str]:
    """Results live in synk_comm's memory, reused once JAX lets go of it: a result dropped while a
    slow JAX program still reads it keeps its value for that program; a loop of all-reduces runs
    in a few buffers; a result handed on to another JAX program and dropped stays correct."""
    import jax
    import jax.numpy as jnp

    import synk_comm.nccl

    synk_comm.nccl.ASYNC_MIN_BYTES = 0  # every size takes the queued path (its small sizes are quick)

    wrong = []
    n, r = group.size, group.rank
    total = sum(range(1, n + 1))
    big = jnp.full((4096, 4096), 1.0 / 4096, jnp.float32)
    c = float(np.asarray(big @ big @ big @ big)[0, 0])
    slow_read = jax.jit(lambda a, v: (a @ a @ a @ a)[0, 0] * v)  # reads v after ~4 matmuls
    late = []
    for k in range(6):  # each result dropped at once; the next all-reduce wants memory of its size
        res = group.all_reduce(jnp.full(1 << 20, float(r + 1 + k), jnp.float32), "sum")
        late.append(slow_read(big, res))
        del res
    for k, value in enumerate(late):
        want = (total + n * k) * c
        if not np.allclose(np.asarray(value), want, rtol=1e-4):
            wrong.append(f"read after drop {k}: got {np.asarray(value)[:3]} want {want}")
    addresses = set()
    g = jnp.full(1 << 20, float(r), jnp.float32)
    for _ in range(20):  # a training loop's shape: reduce, use, drop
        res = group.all_reduce(g, "avg")
        addresses.add(res.unsafe_buffer_pointer())
        g = res * 0 + float(r)
    allocations = group.nccl._jax_stream.results.allocations
    if len(addresses) > 6 or allocations > 8:
        wrong.append(f"20 all-reduces of one size used {len(addresses)} buffers, {allocations} allocations in all "
                     "(expected reuse)")
    if not np.allclose(np.asarray(res), (n - 1) / 2):
        wrong.append(f"loop result {np.asarray(res)[:3]} want {(n - 1) / 2}")
    for dtype in ("float16", "int32", "float32"):
        x = jnp.full((3, 5), r + 1, dtype)
        res = group.all_reduce(x, "sum")
        if res.dtype != x.dtype or res.shape != x.shape or not np.all(np.asarray(res, np.float64) == total):
            wrong.append(f"{dtype}: got {res.dtype} {res.shape} {np.asarray(res, np.float64).ravel()[:3]}")
    scalar = group.all_reduce(jnp.float32(r + 1), "max")
    if scalar.shape != () or float(scalar) != n:
        wrong.append(f"scalar: got {scalar!r}")
    group.nccl.synchronize()
    return wrong

