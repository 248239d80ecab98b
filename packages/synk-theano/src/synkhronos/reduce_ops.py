"""How the ranks' results of a call combine into the one result the master returns.

Every rank that computed returns, per output, its local value and its weight (the number of rows
it computed on: scattered input rows, or sliceable-shared rows after ``batch_s``; 1 each when
nothing is split).  Per output op:

=========  ===================================================================================
avg        ``sum_r w_r * y_r / sum_r w_r`` -- a mean over rows equals the single-process mean
sum        ``sum_r y_r``
prod       ``prod_r y_r``
max, min   element-wise over the ranks
gather     concatenation along axis 0 in rank order (0-d values stack to shape ``(n,)``);
           ``None`` means the same
=========  ===================================================================================

A rank with weight 0 (no rows) computed nothing and is left out.  Within a rank, ``num_slices``
slices combine by the same rules, each weighted by its rows, before the ranks combine.

When the ranks combine through a collective instead of in the master (the in-graph collectives
of :mod:`synkhronos.ops`; the JAX engine's program, :mod:`synkhronos.engine.program`), each rank puts in
its :func:`contribution` and the collective applies the op (``avg`` as a sum):
``avg``: ``y_r * (w_r / sum_r w_r)``; the others ``y_r`` itself; a rank of weight 0 puts in the
op's :func:`identity` (0, 1, the lowest or the highest value), selected, never multiplied, so
that a NaN computed on no rows cannot leak into the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["OUTPUT_OPS", "UPDATE_OPS", "check_op", "combine", "combine_numbers", "common_shape", "contribution",
           "identity"]

OUTPUT_OPS = ("avg", "sum", "prod", "max", "min", "gather")
UPDATE_OPS = ("avg", "sum", "prod", "max", "min")


NUMPY_OPS: dict[str, Any] = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}

def check_op(op: Any, what: str, allowed: Sequence[str] = OUTPUT_OPS) -> str:
    """Normalise a reduce op name (``None`` -> ``"gather"``); ValueError names the choices."""
    name = "gather" if op is None else op
    if not isinstance(name, str) or name.lower() not in allowed:
        choices = ", ".join(repr(a) for a in allowed) + (", None" if "gather" in allowed else "")
        raise ValueError(f"unknown reduce op {op!r} for {what}: use one of {choices}")
    return name.lower()


def common_shape(op: str, shapes: Sequence[tuple[int, ...]], what: str) -> tuple[int, ...]:
    """The one shape of the parts' values (``gather``: beyond axis 0, where the rows may differ).

    Raises
    ------
    ValueError
        If the parts' shapes differ: their values cannot be combined by ``op``.
    """
    key = (lambda s: s[1:]) if op == "gather" else (lambda s: s)
    if len({key(s) for s in shapes}) > 1:
        where = "beyond axis 0 " if op == "gather" else ""
        raise ValueError(f"{what} (op {op!r}) has different shapes {where}in the ranks or slices: "
                         f"{list(shapes)}; its values cannot be combined")
    return tuple(shapes[0])


def combine(op: str, values: Sequence[Any], weights: Sequence[float], xp: Any = np,
            what: str = "a value") -> Any:
    """Combine per-part values by ``op`` (see the module docstring); parts of weight 0 are skipped.

    ``xp`` is the array module of the values: numpy (host), or ``jax.numpy`` for update values
    that stay on the GPU.  A single part is returned as it is.  ``what`` names the value in the
    ValueError raised when the parts' shapes differ.
    """
    if xp is np and op != "gather":
        return _combine_host(op, values, weights, what)
    parts = [(v if xp is not np else np.asarray(v), w) for v, w in zip(values, weights) if w > 0]
    if not parts:
        raise ValueError("no part computed anything (every rank had 0 rows)")
    common_shape(op, [tuple(v.shape) for v, _ in parts], what)
    if op == "gather":
        arrays = [v for v, _ in parts]
        return xp.stack(arrays) if arrays[0].ndim == 0 else xp.concatenate(arrays, axis=0)
    if len(parts) == 1:
        return parts[0][0]
    first = parts[0][0]
    if op == "avg":
        total = float(sum(w for _, w in parts))
        dtype = first.dtype if np.dtype(first.dtype).kind in "fc" else np.float64
        acc = sum(v * (w / total) for v, w in parts)
        return xp.asarray(acc, dtype=dtype)
    binary = {"sum": xp.add, "prod": xp.multiply, "max": xp.maximum, "min": xp.minimum}[op]
    out = first
    for v, _ in parts[1:]:
        out = binary(out, v)
    return xp.asarray(out, dtype=first.dtype)


def _combine_host(op: str, values: Sequence[Any], weights: Sequence[float], what: str) -> np.ndarray:
    """:func:`combine` of numpy values by a reduce op (not gather): one numpy operation over the
    parts stacked, whatever their number (a call's hot path in the master, one part per rank)."""
    if weights and min(weights) > 0:  # every part computed (the common case): nothing to skip
        parts, kept = values, weights
    else:
        parts = [v for v, w in zip(values, weights) if w > 0]
        kept = [w for w in weights if w > 0]
        if not parts:
            raise ValueError("no part computed anything (every rank had 0 rows)")
    first = np.asarray(parts[0])
    if len(parts) == 1:
        return first
    try:
        stacked = np.array(parts)
    except ValueError:  # numpy refuses parts of different shapes
        stacked = None
    if stacked is None or stacked.shape[1:] != first.shape:
        common_shape(op, [np.shape(a) for a in parts], what)  # raises, naming the shapes
    assert stacked is not None
    shape, dtype = first.shape, first.dtype
    if op == "avg" and not shape and stacked.dtype.kind == "f" and stacked.dtype.itemsize <= 8:
        # real scalars (a loss, an accuracy), the common case: summed in float64 by Python (no
        # BLAS call: it costs more than the sum itself), rounded once to their dtype; a long
        # double keeps numpy's path, in its own precision
        return np.asarray(_weighted_mean(stacked.tolist(), kept), dtype=dtype)
    if op == "avg":
        dtype = dtype if dtype.kind in "fc" else np.dtype(np.float64)
        total = sum(kept)
        scale = np.array([w / total for w in kept], dtype=dtype)
        if not shape:  # complex, integer or long double scalars: one dot product
            return np.asarray(stacked @ scale, dtype=dtype)
        return np.asarray((scale @ stacked.reshape(len(kept), -1)).reshape(shape), dtype=dtype)
    return np.asarray(NUMPY_OPS[op].reduce(stacked, axis=0), dtype=dtype)


def combine_numbers(ops: Sequence[str], parts: Sequence[Sequence[float]]) -> list[float]:
    """:func:`combine` of real scalars held as Python floats: each part is ``[weight, *values]``,
    one value per output, combined by its op in ``ops`` (not gather); parts of weight 0 are
    skipped (whatever else they hold).

    What a call's ranks replied as numbers (:meth:`synk_comm.Group.reply_values`), read by the
    master in one ``tolist()`` of the control block: a few float operations per rank, no numpy
    operation per output (each costs more than the arithmetic of 16 ranks).  Computed in
    float64; the caller rounds each result once to its output's dtype.

    Parameters
    ----------
    ops : sequence of str
        The reduce op of each output (``avg``, ``sum``, ``prod``, ``max``, ``min``).
    parts : sequence of sequences of float
        One ``[weight, value 0, value 1, ...]`` per part (a part may hold more values than
        ``ops``: they are ignored); the weight is the rows it computed on.

    Returns
    -------
    list of float
        One number per output: ``avg`` is ``sum_r w_r y_r / sum_r w_r``, ``max`` and ``min``
        NaN when any part's value is NaN (as numpy's ``maximum``); a lone part's values as
        they are.

    Raises
    ------
    ValueError
        If every part has weight 0.

    Examples
    --------
    >>> combine_numbers(["avg", "max"], [[1.0, 2.0, 5.0], [3.0, 6.0, 1.0]])
    [5.0, 5.0]
    """
    kept = [p for p in parts if p[0] > 0]
    if not kept:
        raise ValueError("no part computed anything (every rank had 0 rows)")
    if len(kept) == 1:
        return list(kept[0][1:1 + len(ops)])
    weights = [p[0] for p in kept]
    out = []
    for i, op in enumerate(ops, 1):
        column = [p[i] for p in kept]
        if op == "avg":
            out.append(_weighted_mean(column, weights))
        elif op == "sum":
            out.append(sum(column))
        elif op == "prod":
            out.append(math.prod(column))
        elif any(v != v for v in column):  # max, min: NaN wins, as in numpy
            out.append(math.nan)
        else:
            out.append(max(column) if op == "max" else min(column))
    return out


def _weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    """``sum_r w_r y_r / sum_r w_r`` in Python floats (float64), summed in order: the real-scalar
    avg of both :func:`combine` and :func:`combine_numbers`, so the two give the same bits."""
    acc = 0.0
    for v, w in zip(values, weights):
        acc += v * w
    return acc / sum(weights)


def identity(op: str, dtype: Any) -> Any:
    """The value that leaves ``op`` unchanged: 0 (avg, sum), 1 (prod), the lowest value of
    ``dtype`` (max: -inf for floats) or its highest (min)."""
    dtype = np.dtype(dtype)
    if op in ("avg", "sum"):
        return dtype.type(0)
    if op == "prod":
        return dtype.type(1)
    if dtype.kind == "f":
        return dtype.type(-np.inf if op == "max" else np.inf)
    if dtype.kind == "b":
        return np.bool_(op != "max")
    info = np.iinfo(dtype)
    return dtype.type(info.min if op == "max" else info.max)


def contribution(op: str, value: Any, weight: float, total: float, shape: tuple[int, ...] | None = None,
                 dtype: Any = None, xp: Any = np) -> Any:
    """What a rank of weight ``weight`` (of ``total`` over the ranks) puts into a collective that
    combines by ``op`` (``avg`` travels as a sum: see the module docstring).

    ``value`` may be None for a rank that computed nothing; then ``shape`` and ``dtype`` say what
    to fill.  A rank of weight 0 puts in :func:`identity`, whatever its value holds.
    """
    if weight == 0 or value is None:
        dtype = np.dtype(dtype if dtype is not None else value.dtype)
        return xp.full(tuple(shape if shape is not None else value.shape), identity(op, dtype), dtype=dtype)
    if op == "avg":
        return value * xp.asarray(weight / total, dtype=value.dtype)
    return value
