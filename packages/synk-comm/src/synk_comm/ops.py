"""Reduction operations of the collectives."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = ["ReduceOp", "as_op", "identity"]


class ReduceOp(enum.Enum):
    """How a reduction combines the ranks' values, element by element."""

    SUM = "sum"
    """``x_0 + x_1 + ... + x_{n-1}``"""
    PROD = "prod"
    """``x_0 * x_1 * ... * x_{n-1}``"""
    MAX = "max"
    """``max(x_0, ..., x_{n-1})``"""
    MIN = "min"
    """``min(x_0, ..., x_{n-1})``"""
    AVG = "avg"
    """``(x_0 + ... + x_{n-1}) / n``; floating and complex dtypes only."""

    @property
    def ufunc(self) -> np.ufunc:
        """The numpy ufunc that combines two operands (``avg`` sums, then divides)."""
        return _UFUNCS[self]


_UFUNCS: dict[ReduceOp, np.ufunc] = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply,
                                     ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
                                     ReduceOp.AVG: np.add}


def as_op(op: ReduceOp | str, dtype: Any = None) -> ReduceOp:
    """``"sum"`` -> ``ReduceOp.SUM``; checks that ``avg`` is not asked of an integer dtype.

    Raises
    ------
    ValueError
        For a name that is not one of sum, prod, max, min, avg.
    TypeError
        For ``avg`` on integer or boolean data (the mean would not fit the dtype).
    """
    if not isinstance(op, ReduceOp):
        try:
            op = ReduceOp(str(op).lower())
        except ValueError:
            names = ", ".join(repr(o.value) for o in ReduceOp)
            raise ValueError(f"unknown reduce op {op!r}: use one of {names}") from None
    if op is ReduceOp.AVG and dtype is not None and _numpy_dtype(dtype).kind in "biu":
        raise TypeError(f"op 'avg' needs a floating or complex dtype, not {np.dtype(dtype)}: use 'sum' "
                        "and divide, or cast to float first")
    return op


def _numpy_dtype(dtype: Any) -> np.dtype[Any]:
    """numpy's dtype for a numpy, JAX or PyTorch dtype (``torch.float32`` -> ``float32``)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype(str(dtype).removeprefix("torch."))


def identity(op: ReduceOp, dtype: Any) -> Any:
    """The value that ``op`` leaves unchanged for ``dtype``: 0 (sum, avg), 1 (prod), the lowest value
    (max: -inf, the integer minimum, False) or the highest (min)."""
    dt = _numpy_dtype(dtype)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return dt.type(0)
    if op is ReduceOp.PROD:
        return dt.type(1)
    low = op is ReduceOp.MAX
    if dt.kind == "b":
        return not low
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return info.min if low else info.max
    return dt.type(-np.inf if low else np.inf)
