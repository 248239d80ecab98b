"""Layers without a family: :class:`NonlinearityLayer`, :class:`ExpressionLayer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from synk_lasagne import nonlinearities
from synk_lasagne.layers.base import Layer

__all__ = ["ExpressionLayer", "NonlinearityLayer"]


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
