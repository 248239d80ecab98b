"""Layers without a family: :class:`NonlinearityLayer`, :class:`ExpressionLayer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from synk_lasagne import nonlinearities
from synk_lasagne.init import ONES, ZEROS
from synk_lasagne.layers.base import Layer

__all__ = ["BiasLayer", "ExpressionLayer", "NonlinearityLayer", "ScaleLayer", "standardize"]


class NonlinearityLayer(Layer):
    """``nonlinearity(input)`` (default rectify; None: identity)."""

    def __init__(self, incoming: Any, nonlinearity: Any = nonlinearities.rectify, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return self.nonlinearity(input)


class ExpressionLayer(Layer):
    """``function(input)`` for any expression; ``output_shape`` a tuple, a callable of the input
    shape, or None (the input's shape)."""

    def __init__(self, incoming: Any, function: Callable[[Any], Any], output_shape: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.function = function
        self._output_shape = output_shape

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        if self._output_shape is None:
            return tuple(input_shape)
        if callable(self._output_shape):
            return tuple(self._output_shape(input_shape))
        return tuple(self._output_shape)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return self.function(input)


def _shared_axes(shared_axes: Any, ndim: int) -> tuple[int, ...]:
    from synk_lasagne.utils import int_types

    if shared_axes == "auto":  # every axis but the second (the channels)
        return (0, *range(2, ndim))
    if isinstance(shared_axes, int_types):
        return (int(shared_axes),)
    return tuple(shared_axes)


def _broadcast(param: Any, shared_axes: tuple[int, ...], ndim: int) -> Any:
    """``param`` (the axes not shared) dimshuffled to ``ndim`` axes, broadcast along ``shared_axes``."""
    axes = iter(range(param.ndim))
    return param.dimshuffle(*("x" if axis in shared_axes else next(axes) for axis in range(ndim)))


class BiasLayer(Layer):
    """``input + b``, ``b`` shared along ``shared_axes`` (default: every axis but the second)."""

    def __init__(self, incoming: Any, b: Any = ZEROS, shared_axes: Any = "auto", **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.shared_axes = _shared_axes(shared_axes, len(self.input_shape))
        if b is None:
            self.b = None
            return
        shape = [n for axis, n in enumerate(self.input_shape) if axis not in self.shared_axes]
        if any(n is None for n in shape):
            raise ValueError("BiasLayer needs specified input sizes for all axes that biases are not shared over.")
        self.b = self.add_param(b, shape, name="b", regularizable=False)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return input if self.b is None else input + _broadcast(self.b, self.shared_axes, input.ndim)


class ScaleLayer(Layer):
    """``input * scales``, ``scales`` shared along ``shared_axes`` (default: every axis but the second)."""

    def __init__(self, incoming: Any, scales: Any = ONES, shared_axes: Any = "auto", **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.shared_axes = _shared_axes(shared_axes, len(self.input_shape))
        shape = [n for axis, n in enumerate(self.input_shape) if axis not in self.shared_axes]
        if any(n is None for n in shape):
            raise ValueError("ScaleLayer needs specified input sizes for all axes that scales are not shared over.")
        self.scales = self.add_param(scales, shape, name="scales", regularizable=False)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        return input * _broadcast(self.scales, self.shared_axes, input.ndim)


def standardize(layer: Any, offset: Any, scale: Any, shared_axes: Any = "auto") -> Any:
    """``(layer's output - offset) / scale`` as a :class:`BiasLayer` then a :class:`ScaleLayer`,
    their parameters not trainable (e.g. the training data's mean and standard deviation)."""
    from synk_lasagne.utils import floatX

    layer = BiasLayer(layer, -offset, shared_axes)
    layer.params[layer.b].discard("trainable")
    layer = ScaleLayer(layer, floatX(1.0) / scale, shared_axes)
    layer.params[layer.scales].discard("trainable")
    return layer
