"""Collectives on shared variables under the JAX engine, carried out by the master.

The master holds no value of its own (:mod:`synkhronos.engine.master`), so each collective is
two steps over the control plane: read the ranks' values (every rank's, or compute rank 0's
where the collective reads "the master's"), compute in numpy, set the ranks' new values.  The
semantics are those of :mod:`synkhronos.collectives` with compute rank 0 in the master's place;
the checks there run first.  Values travel through the master (pickled with the command): right
for parameters and small state, not fast for large values -- put such collectives inside the
function's graph (in-graph collectives), where they run in the program over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from synk_comm.ops import as_op
from synkhronos.calls import normalise_positions
from synkhronos.engine import VALUE
from synkhronos.runtime import Runtime

__all__ = ["run", "zero_ranks"]


def _values(rt: Runtime, sids: list[int]) -> list[list[np.ndarray]]:
    """Every compute rank's value of each variable: ``[rank][variable]``."""
    with rt.group.command(VALUE, ("read", sids, None)):
        pass
    replies = rt.group.replies()
    return [replies[r + 1] for r in range(rt.size)]


def _rank0(rt: Runtime, sids: list[int]) -> list[np.ndarray]:
    """Compute rank 0's value of each variable (the master's, in the per-rank engine)."""
    with rt.group.command(VALUE, ("get", sids, 0)):
        pass
    return rt.group.replies()[1]


def _assign(rt: Runtime, sids: list[int], per_rank: list[list[Any] | None] | None = None,
            every: list[Any] | None = None) -> None:
    """Set values: ``every[i]`` in every rank, or ``per_rank[r][i]`` in rank ``r`` (None: unchanged)."""
    with rt.group.command(VALUE, ("assign", sids, (per_rank, every))):
        pass


def _decode(rt: Runtime, encoded: tuple[str, Any]) -> np.ndarray:
    kind, value = encoded
    if kind == "data":
        arr = rt.data[value].data
        assert arr is not None
        return np.array(arr)
    return np.asarray(value)


def _reduce_values(parts: list[np.ndarray], op: str, dtype: Any) -> np.ndarray:
    shapes = {p.shape for p in parts}
    if len(shapes) > 1:
        raise ValueError(f"every rank must hold the same shape to reduce; the ranks hold {[p.shape for p in parts]} "
                         "(nothing was reduced)")
    reduce_op = as_op(op, dtype)
    stacked = np.stack(parts)
    if reduce_op.value == "avg":
        return np.asarray(stacked.sum(axis=0) / len(parts), dtype=dtype)
    return np.asarray(reduce_op.ufunc.reduce(stacked, axis=0), dtype=dtype)


def _broadcast(rt: Runtime, sids: list[int], dtypes: list[Any], values: list[Any] | None, **_: Any) -> None:
    source = _rank0(rt, sids) if values is None else [_decode(rt, v) for v in values]
    _assign(rt, sids, every=source)


def _scatter(rt: Runtime, sids: list[int], dtypes: list[Any], values: list[Any], rows: list[Any], **_: Any) -> None:
    per_rank: list[list[Any] | None] = [[] for _ in range(rt.size)]
    for encoded, sel in zip(values, rows):
        selected = _decode(rt, encoded)[sel]
        for r, (a, b) in enumerate(normalise_positions(len(selected), rt.size)):
            per_rank[r].append(selected[a:b])  # type: ignore[union-attr]
    _assign(rt, sids, per_rank=per_rank)


def _gather(rt: Runtime, sids: list[int], dtypes: list[Any], **_: Any) -> list[list[np.ndarray]]:
    return _values(rt, sids)


def _all_gather(rt: Runtime, sids: list[int], dtypes: list[Any], **_: Any) -> None:
    per_rank = _values(rt, sids)
    _assign(rt, sids, every=[np.concatenate([v[i] for v in per_rank], axis=0) for i in range(len(sids))])


def _reduce(rt: Runtime, sids: list[int], dtypes: list[Any], op: str, in_place: bool, **_: Any) -> list[np.ndarray]:
    per_rank = _values(rt, sids)
    results = [_reduce_values([v[i] for v in per_rank], op, dtype) for i, dtype in enumerate(dtypes)]
    if in_place:
        _assign(rt, sids, per_rank=[results] + [None] * (rt.size - 1))
    return results


def _all_reduce(rt: Runtime, sids: list[int], dtypes: list[Any], op: str, **_: Any) -> None:
    per_rank = _values(rt, sids)
    _assign(rt, sids, every=[_reduce_values([v[i] for v in per_rank], op, dtype) for i, dtype in enumerate(dtypes)])


def _set_value(rt: Runtime, sids: list[int], dtypes: list[Any], values: list[Any], rows: list[Any], target: int,
               **_: Any) -> None:
    chosen = [_decode(rt, v)[sel] for v, sel in zip(values, rows)]
    _assign(rt, sids, per_rank=[chosen if r == target else None for r in range(rt.size)])


def _get_value(rt: Runtime, sids: list[int], dtypes: list[Any], target: int, **_: Any) -> list[np.ndarray]:
    with rt.group.command(VALUE, ("get", sids, target)):
        pass
    return rt.group.replies()[target + 1]


def _get_shapes(rt: Runtime, sids: list[int], dtypes: list[Any], **_: Any) -> list[list[tuple[int, ...]]]:
    per_rank = _values(rt, sids)
    return [[tuple(v[i].shape) for v in per_rank] for i in range(len(sids))]


def zero_ranks(rt: Runtime, sids: list[int], ranks: list[int]) -> None:
    """Set the variables to zeros (of their shapes there) in compute ranks ``ranks``."""
    if not ranks:
        return
    per_rank = _values(rt, sids)
    _assign(rt, sids, per_rank=[[np.zeros_like(v) for v in per_rank[r]] if r in ranks else None
                                for r in range(rt.size)])


_RUN: dict[str, Callable[..., Any]] = {
    "broadcast": _broadcast, "scatter": _scatter, "gather": _gather, "all_gather": _all_gather, "reduce": _reduce,
    "all_reduce": _all_reduce, "set_value": _set_value, "get_value": _get_value, "get_shapes": _get_shapes,
}


def run(rt: Runtime, name: str, payload: dict[str, Any]) -> Any:
    """Collective ``name`` (checked by :mod:`synkhronos.collectives`) with its payload there;
    returns what the per-rank engine's command returns in the master."""
    sids = payload["sids"]
    dtypes = [rt.shared[sid].type.dtype for sid in sids]
    args = {k: v for k, v in payload.items() if k not in ("sids", "nccl")}
    return _RUN[name](rt, sids, dtypes, **args)
