"""Pooling layers: :class:`MaxPool2DLayer`, :class:`Pool2DLayer`, :class:`GlobalPoolLayer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from synk_lasagne.conv import _pair
from synk_lasagne.layers.base import Layer
from synk_lasagne.pool import pool2d, pool_output_length

__all__ = ["GlobalPoolLayer", "MaxPool2DLayer", "Pool2DLayer"]


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
        Only True (Lasagne's default: windows that cross the padded border are dropped).
    mode : {"max", "average_inc_pad", "average_exc_pad"}
    """

    def __init__(self, incoming: Any, pool_size: Any, stride: Any = None, pad: Any = (0, 0),
                 ignore_border: bool = True, mode: str = "max", **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        if not ignore_border:
            raise ValueError("ignore_border=False (partial windows at the border) is not supported: pad the "
                             "input (pad=...) to keep the border")
        self.pool_size = _pair(pool_size, "pool_size")
        self.stride = self.pool_size if stride is None else _pair(stride, "stride")
        self.pad = _pair(pad, "pad")
        self.ignore_border = ignore_border
        self.mode = mode
        pool2d(_probe(len(self.input_shape)), self.pool_size, self.stride, self.pad, mode)  # checks the arguments

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        spatial = (pool_output_length(n, w, s, p) for n, w, s, p in
                   zip(input_shape[-2:], self.pool_size, self.stride, self.pad))
        return (*input_shape[:-2], *spatial)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return pool2d(input, self.pool_size, self.stride, self.pad, self.mode)


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
