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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["OUTPUT_OPS", "UPDATE_OPS", "check_op", "combine", "common_shape"]

OUTPUT_OPS = ("avg", "sum", "prod", "max", "min", "gather")
UPDATE_OPS = ("avg", "sum", "prod", "max", "min")


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
        acc = sum(v * (w / total) for v, w in parts)
        dtype = first.dtype if np.dtype(first.dtype).kind in "fc" else np.float64
        return xp.asarray(acc, dtype=dtype)
    binary = {"sum": xp.add, "prod": xp.multiply, "max": xp.maximum, "min": xp.minimum}[op]
    out = first
    for v, _ in parts[1:]:
        out = binary(out, v)
    return xp.asarray(out, dtype=first.dtype)
