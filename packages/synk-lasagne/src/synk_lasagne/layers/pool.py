"""Pooling layers: :class:`MaxPool1DLayer`, :class:`Pool1DLayer`, :class:`MaxPool2DLayer`,
:class:`Pool2DLayer`, :class:`GlobalPoolLayer`, :class:`SpatialPyramidPoolingLayer`, and
:func:`pool_2d` (pooling with window sizes known only at run time)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from synk_lasagne.conv import _pair
from synk_lasagne.layers.base import Layer
from synk_lasagne.pool import pool2d
from synk_lasagne.pool import pool_output_length as _full_windows

__all__ = ["FeaturePoolLayer", "FeatureWTALayer", "GlobalPoolLayer", "MaxPool1DLayer", "MaxPool2DLayer",
           "MaxPool3DLayer", "Pool1DLayer", "Pool2DLayer", "Pool3DLayer", "SpatialPyramidPoolingLayer",
           "Upscale1DLayer", "Upscale2DLayer", "Upscale3DLayer", "pool_2d", "pool_output_length"]

POOL_MODES = ("max", "average_inc_pad", "average_exc_pad")


def pool_output_length(input_length: Any, pool_size: int, stride: int, pad: int, ignore_border: bool) -> Any:
    """The length of a pooled axis (Lasagne's): windows crossing the border dropped
    (``ignore_border``), or kept as partial windows (no padding then)."""
    if input_length is None or pool_size is None:
        return None
    if ignore_border:
        return _full_windows(input_length, pool_size, stride, pad)
    if pad:
        raise ValueError("ignore_border=False needs pad=0 (partial windows already keep the border)")
    if stride >= pool_size:
        return (input_length + stride - 1) // stride
    steps = (input_length - pool_size + stride - 1) // stride
    if isinstance(steps, (int, np.integer)):
        return max(0, int(steps)) + 1
    import pytensor.tensor as pt

    return pt.maximum(0, steps) + 1


class Pool2DLayer(Layer):
    """Pooling over the last two axes (see :func:`synk_lasagne.pool.pool2d`).

    Parameters
    ----------
    incoming : Layer or tuple
    pool_size : int or (int, int)
    stride : int or (int, int), optional
        Default: ``pool_size``.
    pad : int or (int, int)
    ignore_border : bool
        True (Lasagne's default): windows that cross the padded border are dropped; False: kept as
        partial windows (``pad`` must be 0; ``mode="max"`` only).
    mode : {"max", "average_inc_pad", "average_exc_pad"}
    """

    def __init__(self, incoming: Any, pool_size: Any, stride: Any = None, pad: Any = (0, 0),
                 ignore_border: bool = True, mode: str = "max", **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        if len(self.input_shape) != 4:
            raise ValueError(f"Tried to create a 2D pooling layer with input shape {self.input_shape}. Expected 4 "
                             "input dimensions (batchsize, channels, 2 spatial dimensions).")
        self.pool_size = _pair(pool_size, "pool_size")
        self.stride = self.pool_size if stride is None else _pair(stride, "stride")
        self.pad = _pair(pad, "pad")
        self.ignore_border = ignore_border
        self.mode = mode
        if not ignore_border and (mode != "max" or any(self.pad)):
            raise NotImplementedError("ignore_border=False (partial windows) is implemented for mode='max' "
                                      "and pad=0: pad the input instead")
        pool2d(_probe(len(self.input_shape)), self.pool_size, self.stride, self.pad, mode)  # checks the arguments

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        spatial = (pool_output_length(n, w, s, p, self.ignore_border) for n, w, s, p in
                   zip(input_shape[-2:], self.pool_size, self.stride, self.pad))
        return (*input_shape[:-2], *spatial)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        if not self.ignore_border:
            input = _pad_partial(input, self.pool_size, self.stride)
        return pool2d(input, self.pool_size, self.stride, self.pad, self.mode)


def _pad_partial(x: Any, pool_size: tuple[int, int], stride: tuple[int, int]) -> Any:
    """``x`` padded after its last two axes with the lowest value, so that the full windows of the
    result are the partial windows of ``x`` (max pooling with ``ignore_border=False``)."""
    import pytensor.tensor as pt

    lengths = [x.shape[-2], x.shape[-1]]
    extra = []
    for n, w, s in zip(lengths, pool_size, stride):
        out = pool_output_length(n, w, s, 0, False)
        extra.append(pt.maximum((out - 1) * s + w - n, 0))
    dtype = x.dtype
    low = np.finfo(dtype).min if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min
    shape = (*[x.shape[i] for i in range(x.ndim - 2)], lengths[0] + extra[0], lengths[1] + extra[1])
    padded = pt.full(shape, np.asarray(low, dtype=dtype), dtype=dtype)
    return pt.set_subtensor(padded[..., :lengths[0], :lengths[1]], x)


class Pool1DLayer(Layer):
    """Pooling over the last axis of ``(batch, channels, length)`` input (Lasagne's).

    Parameters
    ----------
    incoming : Layer or tuple
    pool_size : int
    stride : int, optional
        Default: ``pool_size``.
    pad : int
    ignore_border : bool
        As for :class:`Pool2DLayer`.
    mode : {"max", "average_inc_pad", "average_exc_pad"}
    """

    def __init__(self, incoming: Any, pool_size: Any, stride: Any = None, pad: Any = 0,
                 ignore_border: bool = True, mode: str = "max", **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        if len(self.input_shape) != 3:
            raise ValueError(f"Tried to create a 1D pooling layer with input shape {self.input_shape}. Expected 3 "
                             "input dimensions (batchsize, channels, 1 spatial dimensions).")
        self.pool_size = _single(pool_size, "pool_size")
        self.stride = self.pool_size if stride is None else _single(stride, "stride")
        self.pad = _single(pad, "pad")
        self.ignore_border = ignore_border
        self.mode = mode
        self._pool = Pool2DLayer((None, None, 1, None), (1, *self.pool_size), (1, *self.stride), (0, *self.pad),
                                 ignore_border, mode)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        length = pool_output_length(input_shape[-1], self.pool_size[0], self.stride[0], self.pad[0],
                                    self.ignore_border)
        return (*input_shape[:-1], length)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return self._pool.get_output_for(input[:, :, None, :])[:, :, 0, :]


def _single(value: Any, what: str) -> tuple[int]:
    from synk_lasagne.utils import as_tuple, int_types

    (v,) = as_tuple(value, 1, int_types)
    return (int(v),)


class MaxPool1DLayer(Pool1DLayer):
    """Max pooling over the last axis (:class:`Pool1DLayer` with ``mode="max"``)."""

    def __init__(self, incoming: Any, pool_size: Any, stride: Any = None, pad: Any = 0,
                 ignore_border: bool = True, **kwargs: Any) -> None:
        super().__init__(incoming, pool_size, stride, pad, ignore_border, mode="max", **kwargs)


def _probe(ndim: int) -> Any:
    import pytensor.tensor as pt

    return pt.tensor(shape=(None,) * ndim)


class MaxPool2DLayer(Pool2DLayer):
    """Max pooling over the last two axes (:class:`Pool2DLayer` with ``mode="max"``)."""

    def __init__(self, incoming: Any, pool_size: Any, stride: Any = None, pad: Any = (0, 0),
                 ignore_border: bool = True, **kwargs: Any) -> None:
        super().__init__(incoming, pool_size, stride, pad, ignore_border, mode="max", **kwargs)


class GlobalPoolLayer(Layer):
    """``pool_function`` over every axis after the second: ``(batch, channels, ...) -> (batch, channels)``.

    Parameters
    ----------
    incoming : Layer or tuple
    pool_function : callable
        ``f(tensor, axis=2)``; default ``pytensor.tensor.mean`` (``pt.max`` for global max pooling).
    """

    def __init__(self, incoming: Any, pool_function: Callable[..., Any] | None = None, **kwargs: Any) -> None:
        import pytensor.tensor as pt

        super().__init__(incoming, **kwargs)
        self.pool_function = pt.mean if pool_function is None else pool_function

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        return tuple(input_shape[:2])

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return self.pool_function(input, axis=tuple(range(2, input.ndim)))  # no reshape: static shapes under JAX


class FeaturePoolLayer(Layer):
    """``pool_function`` over groups of ``pool_size`` consecutive features along ``axis`` (maxout)."""

    def __init__(self, incoming: Any, pool_size: int, axis: int = 1, pool_function: Callable[..., Any] | None = None,
                 **kwargs: Any) -> None:
        import pytensor.tensor as pt

        super().__init__(incoming, **kwargs)
        self.pool_size, self.axis = pool_size, axis
        self.pool_function = pt.max if pool_function is None else pool_function
        features = self.input_shape[axis]
        if features % pool_size:
            raise ValueError(f"Number of input feature maps ({features}) is not a multiple of the pool size "
                             f"(pool_size={pool_size})")

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        out = list(input_shape)
        out[self.axis] = input_shape[self.axis] // self.pool_size
        return tuple(out)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        shape = [input.shape[i] for i in range(input.ndim)]
        axis = self.axis % input.ndim
        grouped = (*shape[:axis], shape[axis] // self.pool_size, self.pool_size, *shape[axis + 1:])
        return self.pool_function(input.reshape(grouped), axis=axis + 1)


class FeatureWTALayer(Layer):
    """Winner takes all in groups of ``pool_size`` features along ``axis``: the largest kept, the
    others zero."""

    def __init__(self, incoming: Any, pool_size: int, axis: int = 1, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.pool_size, self.axis = pool_size, axis
        features = self.input_shape[axis]
        if features % pool_size:
            raise ValueError(f"Number of input feature maps ({features}) is not a multiple of the region size "
                             f"(pool_size={pool_size})")

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        shape = [input.shape[i] for i in range(input.ndim)]
        axis = self.axis % input.ndim
        grouped = input.reshape((*shape[:axis], shape[axis] // self.pool_size, self.pool_size, *shape[axis + 1:]))
        winner = pt.argmax(grouped, axis=axis + 1, keepdims=True)
        position = pt.arange(self.pool_size).reshape((*([1] * (axis + 1)), self.pool_size,
                                                      *([1] * (input.ndim - axis - 1))))
        return input * pt.cast(pt.eq(winner, position), input.dtype).reshape(input.shape)


class _UpscaleLayer(Layer):
    """Upscaling of the last ``n`` axes by integer factors: ``"repeat"`` repeats each value,
    ``"dilate"`` puts it at the first position of its block and zeros elsewhere."""

    n = 2

    def __init__(self, incoming: Any, scale_factor: Any, mode: str = "repeat", **kwargs: Any) -> None:
        from synk_lasagne.utils import as_tuple

        super().__init__(incoming, **kwargs)
        self.scale_factor = tuple(as_tuple(scale_factor, self.n))
        if any(f < 1 for f in self.scale_factor):
            raise ValueError(f"Scale factor must be >= 1, not {self.scale_factor}")
        if mode not in ("repeat", "dilate"):
            raise ValueError(f"Mode must be either 'repeat' or 'dilate', not {mode}")
        self.mode = mode

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        out = list(input_shape)
        for i, factor in enumerate(self.scale_factor):
            axis = len(out) - self.n + i
            if out[axis] is not None:
                out[axis] = out[axis] * factor
        return tuple(out)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        first = input.ndim - self.n
        if self.mode == "repeat":
            out = input
            for i, factor in enumerate(self.scale_factor):
                if factor > 1:
                    out = pt.repeat(out, factor, axis=first + i)
            return out
        if all(f == 1 for f in self.scale_factor):
            return input
        shape = [input.shape[a] for a in range(input.ndim)]
        for i, factor in enumerate(self.scale_factor):
            shape[first + i] = shape[first + i] * factor
        index = (slice(None),) * first + tuple(slice(None, None, f) for f in self.scale_factor)
        return pt.set_subtensor(pt.zeros(shape, dtype=input.dtype)[index], input)


class Upscale1DLayer(_UpscaleLayer):
    """Upscaling of the last axis of ``(batch, channels, length)`` input (Lasagne's)."""

    n = 1


class Upscale2DLayer(_UpscaleLayer):
    """Upscaling of the last two axes (Lasagne's)."""

    n = 2


class Upscale3DLayer(_UpscaleLayer):
    """Upscaling of the last three axes (Lasagne's)."""

    n = 3


def _reduce(windows: Any, axis: tuple[int, ...], mode: str) -> Any:
    import pytensor.tensor as pt

    return pt.max(windows, axis=axis) if mode == "max" else pt.mean(windows, axis=axis)


def pool_2d(input: Any, ws: Any, ignore_border: bool = True, stride: Any = None, pad: Any = None,
            mode: str = "max") -> Any:
    """Pooling over the last two axes of ``input`` with window size and stride that may be
    expressions (known only at run time; e.g. derived from the input's shape).

    ``out[..., y, x] = op(input[..., y*sy : y*sy + wy, x*sx : x*sx + wx])`` for the windows
    that fit (``ignore_border``); the windows are gathered by index.  For sizes known when the
    graph is built, :func:`synk_lasagne.pool.pool2d` (what the pooling layers use) is faster.

    Parameters
    ----------
    input : expression
        At least 2-d.
    ws : pair of int or int expressions (a length-2 vector too)
    ignore_border : bool
        Only True (windows that cross the border dropped).
    stride : pair, optional
        Default ``ws``.
    pad : None or (0, 0)
    mode : {"max", "average_inc_pad", "average_exc_pad"}
        Without padding both averages are the window's mean.

    Returns
    -------
    expression
    """
    import pytensor.tensor as pt

    if mode not in POOL_MODES:
        raise ValueError(f"Mode must be either 'max', 'average_inc_pad' or 'average_exc_pad'. Got {mode!r}")
    if not ignore_border:
        raise NotImplementedError("pool_2d with run-time window sizes drops partial windows only "
                                  "(ignore_border=True); use Pool2DLayer for ignore_border=False")
    if pad is not None and (hasattr(pad, "ndim") or any(int(p) for p in pad)):
        raise NotImplementedError("pool_2d with run-time window sizes does not pad: pad the input first")
    stride = ws if stride is None else stride
    x = pt.as_tensor_variable(input)
    rows, cols = ws[0], ws[1]
    row_step, col_step = stride[0], stride[1]
    out_rows = (x.shape[-2] - rows) // row_step + 1
    out_cols = (x.shape[-1] - cols) // col_step + 1
    row_index = pt.arange(out_rows)[:, None] * row_step + pt.arange(rows)[None, :]
    col_index = pt.arange(out_cols)[:, None] * col_step + pt.arange(cols)[None, :]
    lead = (slice(None),) * (x.ndim - 2)
    windows = x[(*lead, row_index)]  # (..., out_rows, rows, columns)
    windows = windows[(*lead, slice(None), slice(None), col_index)]  # (..., out_rows, rows, out_cols, cols)
    return _reduce(windows, (x.ndim - 1, x.ndim + 1), mode)


class SpatialPyramidPoolingLayer(Layer):
    """Spatial pyramid pooling (He et al. 2014): each map pooled into ``d x d`` cells for every ``d``
    of ``pool_dims``, concatenated: ``(batch, channels, rows, columns) -> (batch, channels,
    sum(d ** 2))`` whatever the rows and columns.

    Parameters
    ----------
    incoming : Layer or tuple
        4-d; the spatial lengths may be unknown.
    pool_dims : list of int
        Default ``[4, 2, 1]``.
    mode : {"max", "average_inc_pad", "average_exc_pad"}
    implementation : {"fast", "kaiming"}
        "fast": windows of ``ceil(n / d)`` at stride ``floor(n / d)``; "kaiming": cell ``i`` covers
        ``[floor(i n / d), ceil((i + 1) n / d))``, the paper's (cells of unequal sizes).
    """

    def __init__(self, incoming: Any, pool_dims: Any = None, mode: str = "max", implementation: str = "fast",
                 **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        if len(self.input_shape) != 4:
            raise ValueError(f"Tried to create a SPP layer with input shape {self.input_shape}. Expected 4 input "
                             "dimensions (batchsize, channels, 2 spatial dimensions).")
        if mode not in POOL_MODES:
            raise ValueError(f"Mode must be either 'max', 'average_inc_pad' or 'average_exc_pad'. Got {mode!r}")
        if implementation not in ("fast", "kaiming"):
            raise ValueError(f"implementation must be 'fast' or 'kaiming', got {implementation!r}")
        self.pool_dims = [4, 2, 1] if pool_dims is None else [int(d) for d in pool_dims]
        self.mode = mode
        self.implementation = implementation

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        return (input_shape[0], input_shape[1], sum(d * d for d in self.pool_dims))

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        rows, cols = input.shape[2], input.shape[3]
        parts = []
        for d in self.pool_dims:
            if self.implementation == "fast":
                pooled = pool_2d(input, ((rows + d - 1) // d, (cols + d - 1) // d), stride=(rows // d, cols // d),
                                 mode=self.mode)
                parts.append(pt.flatten(pooled, 3))
                continue
            cells = []
            for i in range(d):
                top = pt.cast(pt.floor(i / d * pt.cast(rows, "float64")), "int64")
                bottom = pt.cast(pt.ceil((i + 1) / d * pt.cast(rows, "float64")), "int64")
                for j in range(d):
                    left = pt.cast(pt.floor(j / d * pt.cast(cols, "float64")), "int64")
                    right = pt.cast(pt.ceil((j + 1) / d * pt.cast(cols, "float64")), "int64")
                    cells.append(_reduce(input[:, :, top:bottom, left:right], (2, 3), self.mode))
            parts.append(pt.stack(cells, axis=2))
        return pt.concatenate(parts, axis=2)


def _pool_axis(x: Any, axis: int, size: int, stride: int, pad: int, mode: str) -> Any:
    """``x`` pooled along one axis: windows of ``size`` every ``stride`` over ``x`` padded by ``pad``
    on both sides (with -inf for max, zeros for the average, which then counts the padding)."""
    import pytensor.tensor as pt

    if pad:
        fill = -np.inf if mode == "max" else 0
        widths = [(0, 0)] * x.ndim
        widths[axis] = (pad, pad)
        x = pt.pad(x, widths, mode="constant", constant_values=fill)
    count = (x.shape[axis] - size) // stride + 1
    windows = []
    for offset in range(size):
        index = [slice(None)] * x.ndim
        index[axis] = slice(offset, offset + stride * (count - 1) + 1, stride)
        windows.append(x[tuple(index)])
    stacked = pt.stack(windows)
    return pt.max(stacked, axis=0) if mode == "max" else pt.mean(stacked, axis=0)


class Pool3DLayer(Layer):
    """Pooling over the last three axes of ``(batch, channels, depth, rows, columns)`` input.

    Parameters
    ----------
    incoming : Layer or tuple
    pool_size : int or (int, int, int)
    stride : int or (int, int, int), optional
        Default ``pool_size``.
    pad : int or (int, int, int)
        Padding on both sides (ignored by max pooling's maximum; counted by ``average_inc_pad``).
    ignore_border : bool
        Only True: windows that cross the padded border are dropped.
    mode : {"max", "average_inc_pad", "average_exc_pad"}
        ``average_exc_pad`` only without padding.

    Raises
    ------
    ValueError
        For input that is not 5-d.
    NotImplementedError
        For ``ignore_border=False``, or ``average_exc_pad`` with padding.
    """

    def __init__(self, incoming: Any, pool_size: Any, stride: Any = None, pad: Any = (0, 0, 0),
                 ignore_border: bool = True, mode: str = "max", **kwargs: Any) -> None:
        from synk_lasagne.utils import as_tuple

        super().__init__(incoming, **kwargs)
        if len(self.input_shape) != 5:
            raise ValueError(f"Tried to create a 3D pooling layer with input shape {self.input_shape}. Expected 5 "
                             "input dimensions (batchsize, channels, 3 spatial dimensions).")
        if mode not in POOL_MODES:
            raise ValueError(f"Mode must be either 'max', 'average_inc_pad' or 'average_exc_pad'. Got {mode!r}")
        self.pool_size = as_tuple(pool_size, 3)
        self.stride = self.pool_size if stride is None else as_tuple(stride, 3)
        self.pad = as_tuple(pad, 3)
        if not ignore_border:
            raise NotImplementedError("Pool3DLayer drops windows that cross the border only (ignore_border=True)")
        if mode == "average_exc_pad" and any(self.pad):
            raise NotImplementedError("Pool3DLayer's average_exc_pad takes no padding: pad the input, or use "
                                      "average_inc_pad")
        self.ignore_border = ignore_border
        self.mode = mode

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        spatial = (pool_output_length(n, w, s, p, True) for n, w, s, p in
                   zip(input_shape[2:], self.pool_size, self.stride, self.pad))
        return (*input_shape[:2], *spatial)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        out = pt.as_tensor_variable(input)
        for axis, size, stride, pad in zip((2, 3, 4), self.pool_size, self.stride, self.pad):
            out = _pool_axis(out, axis, size, stride, pad, self.mode)
        return out


class MaxPool3DLayer(Pool3DLayer):
    """Max pooling over the last three axes (:class:`Pool3DLayer` with ``mode="max"``)."""

    def __init__(self, incoming: Any, pool_size: Any, stride: Any = None, pad: Any = (0, 0, 0),
                 ignore_border: bool = True, **kwargs: Any) -> None:
        super().__init__(incoming, pool_size, stride, pad, ignore_border, mode="max", **kwargs)
