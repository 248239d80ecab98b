"""Constant padding of a tensor (Lasagne's ``lasagne.theano_extensions.padding``)."""

from __future__ import annotations

from typing import Any

from synk_lasagne.utils import int_types

__all__ = ["pad"]


def pad(x: Any, width: Any, val: float = 0, batch_ndim: int = 1) -> Any:
    """``x`` padded with ``val`` along every axis after the first ``batch_ndim``.

    Parameters
    ----------
    x : tensor expression
    width : int, iterable of int, or iterable of (int, int)
        The same width on both sides of every padded axis; one per axis; or ``(before, after)``
        per axis.
    val : float, optional
        The value of the padding (default 0).
    batch_ndim : int, optional
        The leading axes left alone (default 1).

    Returns
    -------
    tensor expression
    """
    import pytensor.tensor as pt

    x = pt.as_tensor_variable(x)
    widths = [width] * (x.ndim - batch_ndim) if isinstance(width, int_types) else list(width)
    shape = [x.shape[i] for i in range(x.ndim)]
    index: list[Any] = [slice(None)] * x.ndim
    for k, w in enumerate(widths):
        axis = k + batch_ndim
        before, after = (w, w) if isinstance(w, int_types) else w
        index[axis] = slice(before, before + shape[axis])
        shape[axis] = shape[axis] + before + after
    out = pt.full(shape, pt.cast(val, x.dtype), dtype=x.dtype)
    return pt.set_subtensor(out[tuple(index)], x)
