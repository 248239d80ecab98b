"""Fully connected layers: :class:`DenseLayer`."""

from __future__ import annotations

from typing import Any

import numpy as np

from synk_lasagne import nonlinearities
from synk_lasagne.api import lasagne_api
from synk_lasagne.init import GLOROT_UNIFORM, ZEROS
from synk_lasagne.layers.base import Layer
from synk_lasagne.layers.shape import merge_trailing
from synk_lasagne.layers.special import NonlinearityLayer

__all__ = ["DenseLayer", "NINLayer", "NonlinearityLayer"]


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
        Axes kept (1: one row per example).  At most ``ndim - 1``; under Lasagne 0.1's behaviour
        (:func:`synk_lasagne.set_lasagne_api`) also ``ndim``: each value is one example of one
        input feature, ``W`` is ``(1, num_units)`` (Lasagne 0.1 built a dense layer on a 1-d input so).
    """

    def __init__(self, incoming: Any, num_units: int, W: Any = GLOROT_UNIFORM,
                 b: Any = ZEROS, nonlinearity: Any = nonlinearities.rectify,
                 num_leading_axes: int = 1, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity
        self.num_units = int(num_units)
        ndim = len(self.input_shape)
        if num_leading_axes == ndim and lasagne_api() == "0.1":
            self.num_leading_axes = ndim  # no trailing axes: one feature per example, as in Lasagne 0.1
        elif num_leading_axes >= ndim:
            raise ValueError(f"num_leading_axes={num_leading_axes} for a {ndim}-d input shape {self.input_shape}: "
                             "leaving no trailing axes for the dot product (use at most ndim - 1; Lasagne 0.1's "
                             "dense layer on a 1-d input: synk_lasagne.set_lasagne_api('0.1'))")
        elif num_leading_axes < -ndim + 1 or num_leading_axes == 0:
            raise ValueError(f"num_leading_axes={num_leading_axes} for a {ndim}-d input shape {self.input_shape}: "
                             "requesting more trailing axes than there are input dimensions, or none leading")
        else:
            self.num_leading_axes = num_leading_axes % ndim
        trailing = self.input_shape[self.num_leading_axes:]
        if any(s is None for s in trailing):
            raise ValueError(f"A DenseLayer requires a fixed input shape (except for the leading axes): the lengths "
                             f"of its trailing axes {trailing} (input shape {self.input_shape}); give them to the "
                             "InputLayer")
        num_inputs = int(np.prod(trailing))
        self.W = self.add_param(W, (num_inputs, self.num_units), name="W")
        self.b = None if b is None else self.add_param(b, (self.num_units,), name="b", regularizable=False)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        return (*input_shape[:self.num_leading_axes], self.num_units)

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        if input.ndim == self.num_leading_axes:  # no trailing axes (Lasagne 0.1): one feature per example
            input = pt.shape_padright(input)
        elif input.ndim > self.num_leading_axes + 1:
            input = merge_trailing(input, self.num_leading_axes + 1, self.input_shape)
        activation = pt.dot(input, self.W)
        if self.b is not None:
            activation = activation + self.b
        return self.nonlinearity(activation)


class NINLayer(Layer):
    """Network-in-network: a dense layer applied at every position, over axis 1 (the channels).

    ``W`` is ``(channels, num_units)``; ``b`` is ``(num_units,)`` or, with ``untie_biases``, one
    per unit and position ``(num_units, *spatial)``.
    """

    def __init__(self, incoming: Any, num_units: int, untie_biases: bool = False, W: Any = GLOROT_UNIFORM,
                 b: Any = ZEROS, nonlinearity: Any = nonlinearities.rectify, **kwargs: Any) -> None:
        super().__init__(incoming, **kwargs)
        self.nonlinearity = nonlinearities.identity if nonlinearity is None else nonlinearity
        self.num_units = int(num_units)
        self.untie_biases = untie_biases
        self.W = self.add_param(W, (self.input_shape[1], self.num_units), name="W")
        if b is None:
            self.b = None
        else:
            shape = (self.num_units, *self.input_shape[2:]) if untie_biases else (self.num_units,)
            self.b = self.add_param(b, shape, name="b", regularizable=False)

    def get_output_shape_for(self, input_shape: Any) -> tuple[Any, ...]:
        return (input_shape[0], self.num_units, *input_shape[2:])

    def get_output_for(self, input: Any, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        moved = pt.tensordot(self.W, input, axes=[[0], [1]])  # (units, batch, *spatial)
        out = moved.dimshuffle(1, 0, *range(2, input.ndim))
        if self.b is not None:
            spatial = input.ndim - 2
            out = out + (self.b.dimshuffle("x", *range(self.b.ndim)) if self.untie_biases
                         else self.b.dimshuffle("x", 0, *["x"] * spatial))
        return self.nonlinearity(out)
