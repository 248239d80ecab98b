"""Fully connected layers: :class:`DenseLayer`."""

from __future__ import annotations

from typing import Any

import numpy as np

from synk_lasagne import nonlinearities
from synk_lasagne.init import GLOROT_UNIFORM, ZEROS
from synk_lasagne.layers.base import Layer

__all__ = ["DenseLayer"]


class DenseLayer(Layer):
    """``nonlinearity(input @ W + b)``, the input flattened after its ``num_leading_axes`` axes.

    Parameters
    ----------
    incoming : Layer or tuple
    num_units : int
    W : initialiser, array or shared variable
        ``(inputs, num_units)``; default :class:`~synk_lasagne.init.GlorotUniform`.
    b : initialiser, array, shared variable or None
        ``(num_units,)`` (not regularizable); None: no bias.
    nonlinearity : callable or None
        Default :func:`~synk_lasagne.nonlinearities.rectify`; None: linear.
    num_leading_axes : int
        Axes kept (1: one row per example).
    """

    def __init__(self, incoming: Any, num_units: int, W: Any = GLOROT_UNIFORM,
                 b: Any = ZEROS, nonlinearity: Any = nonlinearities.rectify,
                 num_leading_axes: int = 1, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity
        self.num_units = int(num_units)
        if num_leading_axes < 0:
            num_leading_axes += len(self.input_shape)
        if not 0 < num_leading_axes < len(self.input_shape):
            raise ValueError(f"num_leading_axes={num_leading_axes} leaves no axis to multiply for input shape "
                             f"{self.input_shape}")
        self.num_leading_axes = num_leading_axes
        trailing = self.input_shape[num_leading_axes:]
        if any(s is None for s in trailing):
            raise ValueError(f"DenseLayer needs the lengths of the input's trailing axes {trailing} (input shape "
                             f"{self.input_shape}); give them to the InputLayer")
        num_inputs = int(np.prod(trailing))
        self.W = self.add_param(W, (num_inputs, self.num_units), name="W")
        self.b = None if b is None else self.add_param(b, (self.num_units,), name="b", regularizable=False)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        return (*input_shape[:self.num_leading_axes], self.num_units)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        if input.ndim > self.num_leading_axes + 1:
            input = input.flatten(self.num_leading_axes + 1)
        activation = pt.dot(input, self.W)
        if self.b is not None:
            activation = activation + self.b
        return self.nonlinearity(activation)
