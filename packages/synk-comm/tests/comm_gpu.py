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


def jax_all_reduce(group: Any) -> list[str]:
    """JAX all-reduces give numpy's values: an input still being computed (the call waits for it),
    a result read at once by a JAX program, in-place reductions chained on their own results,
    inputs dropped right after the call, several dtypes and a scalar."""
    import jax
    import jax.numpy as jnp

    wrong = []
    n, r = group.size, group.rank
    total = sum(range(1, n + 1))
    big = jnp.full((4096, 4096), 1.0 / 4096, jnp.float32)
    slow = jax.jit(lambda a, v: (a @ a @ a @ a)[0, 0] * v)  # ~4 matmuls before v is written
    pending = slow(big, jnp.ones(1 << 20, jnp.float32) * (r + 1))
    doubled = jax.jit(lambda v: v * 2)(group.all_reduce(pending, "sum"))
    want = 2.0 * total * float(np.asarray(big @ big @ big @ big)[0, 0])
    if not np.allclose(np.asarray(doubled), want, rtol=1e-4):
        wrong.append(f"pending input: got {np.asarray(doubled)[:3]} want {want}")
    x = jnp.full(1 << 20, r + 1.0, jnp.float32)
    for _ in range(5):  # in place, each on the result of the last
        x = group.all_reduce(x, "max", out=x)
    if not np.all(np.asarray(x) == n):
        wrong.append(f"chained in place: got {np.asarray(x)[:3]} want {n}")
    results = [group.all_reduce(jnp.full(1 << 18, float(k + r), jnp.float32), "sum") for k in range(8)]
    for k, res in enumerate(results):
        expected = sum(k + q for q in range(n))
        if not np.all(np.asarray(res) == expected):
            wrong.append(f"dropped input {k}: got {np.asarray(res)[:3]} want {expected}")
    for dtype in ("float16", "int32", "float32"):
        y = jnp.full((3, 5), r + 1, dtype)
        res = group.all_reduce(y, "sum")
        if res.dtype != y.dtype or res.shape != y.shape or not np.all(np.asarray(res, np.float64) == total):
            wrong.append(f"{dtype}: got {res.dtype} {res.shape} {np.asarray(res, np.float64).ravel()[:3]}")
    scalar = group.all_reduce(jnp.float32(r + 1), "max")
    if scalar.shape != () or float(scalar) != n:
        wrong.append(f"scalar: got {scalar!r}")
    group.nccl.synchronize()
    return wrong
