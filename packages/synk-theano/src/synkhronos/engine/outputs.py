"""How a function's outputs leave the one program: each reduced over the ranks inside it by its op
(:func:`_reduce`), or stacked for the master to combine (:data:`STACKED`), over the mesh axis
:data:`AXIS`; and JAX's ``shard_map`` (:func:`_shard_map`), whatever JAX version."""

from __future__ import annotations

from typing import Any

import numpy as np

from synkhronos.ops import without_empty_collective

__all__ = ["AXIS", "STACKED"]

AXIS = "ranks"
"""The mesh axis of the ranks: the axis name of every collective inside a program."""

STACKED = "stacked"
"""How an output leaves the program when the master combines it (see the module docstring)."""


def _shard_map() -> Any:
    try:
        from jax import shard_map
    except ImportError:  # jax < 0.7
        from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]
    return shard_map


def _output_form(op: str, dtype: np.dtype) -> str:
    """How an output is reduced in the program: its op, or :data:`STACKED`."""
    if op == "avg" and dtype.kind not in "fc":
        return STACKED
    if op in ("max", "min") and dtype.kind == "b":
        return STACKED
    return op


def _reduce(value: Any, form: str, dtype: np.dtype) -> Any:
    """One output of a rank, reduced over the ranks (inside ``shard_map``; an empty one without a
    collective: :func:`~synkhronos.ops.without_empty_collective`)."""
    return without_empty_collective(lambda v: _over_ranks(v, form, dtype))(value)


def _over_ranks(value: Any, form: str, dtype: np.dtype) -> Any:
    import jax

    lax = jax.lax
    if form == "sum":
        return lax.psum(value, AXIS)
    if form == "avg":
        return lax.pmean(value, AXIS).astype(dtype)
    if form == "max":
        return lax.pmax(value, AXIS)
    if form == "min":
        return lax.pmin(value, AXIS)
    if form == "prod":
        return jax.numpy.prod(lax.all_gather(value, AXIS), axis=0).astype(dtype)
    if form == "gather":
        return lax.all_gather(value, AXIS, tiled=value.ndim > 0)
    return lax.all_gather(value, AXIS)  # STACKED: the master combines the parts


def _alone(value: Any, form: str, dtype: np.dtype) -> Any:
    """One output of the only rank, as :func:`_reduce` gives it over one rank, without a collective
    (XLA keeps an all-reduce of one participant: on a GPU, a collective launch per call)."""
    if form == "gather":
        return value if value.ndim > 0 else value[None]
    if form == STACKED:
        return value[None]
    return value.astype(dtype)


