"""Command handlers and SPMD functions of the synk-comm tests (workers import this module by name).

Collective cases travel as small specs, never as arrays: every rank builds its own input with
:func:`make_input` from ``(dtype, shape, seed, rank)``, and the test builds the same inputs in the
master to compute the numpy reference.  Each case handler returns, through ``gather_object``,
one ``("ok", result)`` or ``("error", type name, message)`` per rank, so a test sees what every
rank got.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import synk_comm

# --- inputs ---------------------------------------------------------------------------------------


def make_input(dtype: Any, shape: tuple[int, ...], seed: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s input of a case: deterministic in its arguments, any numpy dtype; always an
    ndarray (0-d for ``shape == ()``)."""
    return np.array(_values(np.dtype(dtype), shape, np.random.default_rng([seed, rank])), dtype=dtype)


def _values(dt: np.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if dt.kind == "f":
        return rng.uniform(-2.0, 2.0, size=shape).astype(dt)
    if dt.kind == "c":
        return (rng.uniform(-2.0, 2.0, size=shape) + 1j * rng.uniform(-2.0, 2.0, size=shape)).astype(dt)
    raise TypeError(f"make_input: no inputs for dtype {dt}")


def _shape_of(spec: dict[str, Any], rank: int) -> tuple[int, ...]:
    shapes = spec.get("shapes")
    return tuple(shapes[rank]) if shapes is not None else tuple(spec["shape"])


def _dtype_of(spec: dict[str, Any], rank: int) -> Any:
    dtypes = spec.get("dtypes")
    return dtypes[rank] if dtypes is not None else spec["dtype"]


def rank_input(spec: dict[str, Any], rank: int) -> np.ndarray:
    """The input of ``rank`` for a case (per-rank ``shapes``/``dtypes`` override ``shape``/``dtype``)."""
    return make_input(_dtype_of(spec, rank), _shape_of(spec, rank), spec["seed"], rank)


# --- one collective -------------------------------------------------------------------------------


def _run_collective(group: synk_comm.Group, spec: dict[str, Any]) -> Any:
    kind = spec["kind"]
    root = spec.get("root")
    if kind == "broadcast_object":
        obj = spec["objects"][group.rank] if group.rank == root else None
        return group.broadcast_object(obj, root=root)
    if kind == "gather_object":
        return group.gather_object(spec["objects"][group.rank], root=root)
    x = rank_input(spec, group.rank)
    if kind == "all_reduce":
        out = spec.get("out")
        if out == "inplace":
            res = group.all_reduce(x, spec["op"], out=x)
            assert res is x, "all_reduce(out=x) must return x"
            return x
        if out == "strided":
            # a non-contiguous destination (every other row of a larger array)
            big = np.zeros((2 * x.shape[0], *x.shape[1:]), x.dtype)
            view = big[::2]
            res = group.all_reduce(x, spec["op"], out=view)
            assert res is view, "all_reduce(out=view) must return the view"
            return big[::2].copy()
        if out == "overlap":
            # ``out`` overlaps the input, shifted by one row: the input must be read before
            # ``out`` is written
            buf = np.zeros((x.shape[0] + 1, *x.shape[1:]), x.dtype)
            buf[1:] = x
            dest = buf[:-1]
            res = group.all_reduce(buf[1:], spec["op"], out=dest)
            assert res is dest, "all_reduce(out=view) must return the view"
            return dest.copy()
        if out == "noncontig_input":
            big = np.zeros((2 * x.shape[0], *x.shape[1:]), x.dtype)
            big[::2] = x
            return group.all_reduce(big[::2], spec["op"])
        return group.all_reduce(x, spec["op"])
    if kind == "reduce":
        return group.reduce(x, spec["op"], root=root)
    if kind == "reduce_scatter":
        return group.reduce_scatter(x, spec["op"])
    if kind == "broadcast":
        if group.rank == root:
            return group.broadcast(x, root=root)
        if spec.get("give") == "array":  # same shape and dtype: overwritten in place
            mine = np.zeros_like(x)
            res = group.broadcast(mine, root=root)
            assert res is mine
            return res
        return group.broadcast(None, root=root)
    if kind == "gather":
        return group.gather(x, root=root)
    if kind == "all_gather":
        return group.all_gather(x)
    if kind == "scatter":
        if group.rank == root:
            arrays = [rank_input(spec, r) for r in range(group.size)]
            return group.scatter(arrays, root=root)
        return group.scatter(None, root=root)
    raise ValueError(f"unknown case kind {kind!r}")


@synk_comm.handler("case")
def case(group: synk_comm.Group, spec: dict[str, Any]) -> list[Any]:
    """Run the collective ``spec`` describes; every rank's outcome, in rank order (in the master).

    ``spec["repeat"]`` runs it that many times (each rank keeps the last outcome), which walks
    both alternating buffers and their growth.
    """
    outcome: tuple[Any, ...] = ()
    for _ in range(spec.get("repeat", 1)):
        try:
            outcome = ("ok", _run_collective(group, spec))
        except (ValueError, TypeError) as exc:
            outcome = ("error", type(exc).__name__, str(exc))
    results = group.gather_object(outcome)
    return results  # type: ignore[return-value]


@synk_comm.handler("case_raw")
def case_raw(group: synk_comm.Group, spec: dict[str, Any]) -> Any:
    """Run the collective without catching: an error propagates as it would in user code."""
    return _run_collective(group, spec)


# --- group behaviour ------------------------------------------------------------------------------


@synk_comm.handler("echo")
def echo(group: synk_comm.Group, payload: Any) -> list[Any]:
    """Every rank's ``(rank, payload)``, gathered in the master."""
    return group.gather_object((group.rank, payload))  # type: ignore[return-value]


@synk_comm.handler("sum_ranks")
def sum_ranks(group: synk_comm.Group, payload: Any) -> np.ndarray:
    """``all_reduce`` of ``[rank, rank, ...]`` (length ``payload``): ``n (n - 1) / 2`` everywhere."""
    return group.all_reduce(np.full(int(payload or 4), float(group.rank)), "sum")


@synk_comm.handler("reply_shapes")
def reply_shapes(group: synk_comm.Group, payload: Any) -> None:
    """Workers reply ``base + rank + arange(n)`` for each ``n`` of ``payload[rank]`` (float64;
    ``base``: ``payload.get("base", 0)``), or, when ``payload[rank]`` is None, an error message (a
    pickle in the same mailbox)."""
    if group.is_master:
        return
    sizes = payload[group.rank]
    if sizes is None:
        raise ValueError(f"no reply from rank {group.rank}")
    base = payload.get("base", 0)
    group.reply([base + group.rank + np.arange(n, dtype=np.float64) for n in sizes])


@synk_comm.handler("reply_values")
def reply_values(group: synk_comm.Group, payload: Any) -> None:
    """Every rank, the master included, replies ``payload[rank]`` as numbers
    (:meth:`synk_comm.Group.reply_values`); a ValueError from a rank asked for too many."""
    group.reply_values(payload[group.rank])


@synk_comm.handler("pids")
def pids(group: synk_comm.Group, payload: Any) -> list[Any]:
    return group.gather_object(os.getpid())  # type: ignore[return-value]


@synk_comm.handler("noop")
def noop(group: synk_comm.Group, payload: Any) -> None:
    return None


@synk_comm.handler("fail_on_rank")
def fail_on_rank(group: synk_comm.Group, payload: dict[str, Any]) -> str:
    """Rank ``payload["rank"]`` raises; with ``barrier``, the others wait at a barrier meanwhile."""
    if group.rank == payload["rank"]:
        raise RuntimeError(f"boom from rank {group.rank}")
    if payload.get("barrier"):
        group.barrier()
    return "ok"


@synk_comm.handler("barrier")
def barrier(group: synk_comm.Group, payload: Any) -> None:
    for _ in range(int(payload or 1)):
        group.barrier()


@synk_comm.handler("sleep")
def sleep(group: synk_comm.Group, payload: Any) -> None:
    """Workers sleep ``payload`` seconds (the master's part is the ``with`` body)."""
    if not group.is_master:
        time.sleep(float(payload))


@synk_comm.handler("sleep_barrier")
def sleep_barrier(group: synk_comm.Group, payload: Any) -> None:
    """Workers sleep ``payload`` seconds, then every rank meets at a barrier."""
    sleep(group, payload)
    group.barrier()


@synk_comm.handler("all_reduce_loop")
def all_reduce_loop(group: synk_comm.Group, payload: Any) -> None:
    """``payload`` all-reduces of a small array, back to back."""
    x = np.ones(16)
    for _ in range(int(payload)):
        group.all_reduce(x, "sum")


# --- SPMD functions (synk_comm.spawn) -------------------------------------------------------------


def rank_plus(group: synk_comm.Group, offset: int) -> tuple[int, int, int]:
    return (group.rank + offset, group.size, os.getpid())


def raise_on_rank(group: synk_comm.Group, bad_rank: int) -> int:
    if group.rank == bad_rank:
        raise RuntimeError(f"boom from rank {group.rank}")
    return group.rank


def modules_loaded(group: synk_comm.Group, names: list[str]) -> list[bool]:
    import sys

    return [name in sys.modules for name in names]


def all_reduce_ranks(group: synk_comm.Group) -> np.ndarray:
    return group.all_reduce(np.full(3, float(group.rank)), "sum")


@synk_comm.handler("set_pipeline")
def set_pipeline(group: synk_comm.Group, payload: Any) -> None:
    """Force (True, False) or restore (None) the pipelined all-reduce in every rank; a list gives
    each rank its own value."""
    group.host.pipeline = payload[group.rank] if isinstance(payload, list) else payload


@synk_comm.handler("big_all_reduce_loop")
def big_all_reduce_loop(group: synk_comm.Group, payload: Any) -> None:
    """``payload["calls"]`` all-reduces of ``payload["n"]`` float32 into ``out``, pipelined."""
    group.host.pipeline = True
    x = np.ones(int(payload["n"]), np.float32)
    out = np.empty_like(x)
    for _ in range(int(payload["calls"])):
        group.all_reduce(x, "sum", out=out)


# --- synk_comm.xla_cpu ----------------------------------------------------------------------------


def xla_cpu_all_reduce(group: synk_comm.Group, name: str, capacity: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Every case (``op``, ``dtype``, ``shape``, ``seed``, per-rank ``weights``) as
    :func:`synk_comm.xla_cpu.all_reduce` inside a jitted program, in order: this rank's results."""
    import jax

    from synk_comm import xla_cpu

    jax.config.update("jax_enable_x64", True)
    assert xla_cpu.available()
    segment = xla_cpu.Segment.attach(name, group.size, capacity)
    try:
        out = []
        for case in cases:
            segment.set_weight(group.rank, case["weights"][group.rank])
            x = make_input(case["dtype"], tuple(case["shape"]), case["seed"], group.rank)
            step = jax.jit(lambda v, op=case["op"]: xla_cpu.all_reduce(v * 1, op, segment, group.rank, group.size))
            out.append(np.asarray(step(x)))
        return out
    finally:
        segment.close()
