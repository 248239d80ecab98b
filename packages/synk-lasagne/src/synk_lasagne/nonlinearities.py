"""Nonlinearities (Lasagne's ``lasagne.nonlinearities``): functions of one tensor.

``sigmoid``, ``softmax`` (over the last axis of a matrix), ``tanh``, :class:`ScaledTanH`
(``scaled_tanh``), ``rectify`` (ReLU), :class:`LeakyRectify` (``leaky_rectify``,
``very_leaky_rectify``), ``elu``, :class:`SELU` (``selu``), ``softplus``, ``linear``
(``identity``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytensor.tensor as pt

__all__ = ["LeakyRectify", "SELU", "ScaledTanH", "ScaledTanh", "elu", "identity", "leaky_rectify", "linear",
           "rectify", "scaled_tanh", "selu", "sigmoid", "softmax", "softplus", "tanh", "very_leaky_rectify"]


def sigmoid(x: Any) -> Any:
    """``1 / (1 + exp(-x))``."""
    return pt.sigmoid(x)


def softmax(x: Any) -> Any:
    """``exp(x) / sum(exp(x))`` along the last axis (rows of a matrix of scores)."""
    return pt.special.softmax(x, axis=-1)


def tanh(x: Any) -> Any:
    """The hyperbolic tangent."""
    return pt.tanh(x)


class ScaledTanH:
    """``scale_out * tanh(scale_in * x)``."""

    def __init__(self, scale_in: float = 1.0, scale_out: float = 1.0) -> None:
        self.scale_in, self.scale_out = scale_in, scale_out

    def __call__(self, x: Any) -> Any:
        return self.scale_out * pt.tanh(self.scale_in * x)


ScaledTanh = ScaledTanH
scaled_tanh = ScaledTanH(scale_in=2.0 / 3, scale_out=1.7159)


def rectify(x: Any) -> Any:
    """``max(x, 0)`` (ReLU); of a numpy array, a numpy array (as Lasagne's, on Theano's ``relu``)."""
    if isinstance(x, np.ndarray):
        return np.maximum(x, 0)
    return pt.maximum(x, 0)


class LeakyRectify:
    """``max(x, leakiness * x)``."""

    def __init__(self, leakiness: float = 0.01) -> None:
        self.leakiness = leakiness

    def __call__(self, x: Any) -> Any:
        return pt.switch(x > 0, x, self.leakiness * x)


leaky_rectify = LeakyRectify()
very_leaky_rectify = LeakyRectify(1.0 / 3)


def elu(x: Any) -> Any:
    """``x`` where positive, else ``exp(x) - 1``."""
    return pt.switch(x > 0, x, pt.expm1(x))


class SELU:
    """``scale * (x if x > 0 else scale_neg * (exp(x) - 1))``; the defaults (1, 1) make it
    :func:`elu`, :data:`selu` has the paper's self-normalising constants."""

    def __init__(self, scale: float = 1.0, scale_neg: float = 1.0) -> None:
        self.scale, self.scale_neg = scale, scale_neg

    def __call__(self, x: Any) -> Any:
        return self.scale * pt.switch(x > 0, x, self.scale_neg * pt.expm1(x))


selu = SELU(scale=1.0507009873554805, scale_neg=1.6732632423543772)


def softplus(x: Any) -> Any:
    """``log(1 + exp(x))``."""
    return pt.softplus(x)


def linear(x: Any) -> Any:
    """``x`` itself."""
    return x


identity = linear
