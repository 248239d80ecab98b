"""Weight penalties (Lasagne's ``lasagne.regularization``).

=========================================  =========================================================
:func:`l2`, :func:`l1`                     ``sum(x ** 2)``, ``sum(|x|)``
:func:`apply_penalty`                      the sum of a penalty over tensors
:func:`regularize_layer_params`            over the parameters of some layers (``regularizable`` ones)
:func:`regularize_layer_params_weighted`   a coefficient per layer
:func:`regularize_network_params`          over every layer of a network
=========================================  =========================================================

Penalties do not depend on the rows, so they belong in the loss of a data-parallel step as they
are: each rank adds the same term, and the weighted average of the ranks keeps it once.

>>> import numpy as np
>>> from synk_lasagne import layers, regularization
>>> net = layers.DenseLayer(layers.InputLayer((None, 3)), 2, W=np.ones((3, 2)), b=None)
>>> float(regularization.regularize_network_params(net, regularization.l2).eval())
6.0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytensor.tensor as pt

__all__ = ["apply_penalty", "l1", "l2", "regularize_layer_params", "regularize_layer_params_weighted",
           "regularize_network_params"]


def l1(x: Any) -> Any:
    """``sum(|x|)``."""
    return pt.sum(abs(x))


def l2(x: Any) -> Any:
    """``sum(x ** 2)``."""
    return pt.sum(x ** 2)


def apply_penalty(tensor_or_tensors: Any, penalty: Callable[..., Any], **kwargs: Any) -> Any:
    """``penalty(tensor)``, or the sum of it over a list of tensors (0 for an empty list)."""
    if isinstance(tensor_or_tensors, (list, tuple)):
        return sum(penalty(x, **kwargs) for x in tensor_or_tensors)
    return penalty(tensor_or_tensors, **kwargs)


def regularize_layer_params(layer: Any, penalty: Callable[..., Any], tags: Mapping[str, bool] | None = None,
                            **kwargs: Any) -> Any:
    """The penalty over the parameters of ``layer`` (or a list of layers) with ``tags``
    (default ``regularizable=True``: weights, not biases or batch-norm scales)."""
    layers = layer if isinstance(layer, (list, tuple)) else [layer]
    tags = {"regularizable": True} if tags is None else dict(tags)
    params = [p for lay in layers for p in lay.get_params(**tags)]
    return apply_penalty(params, penalty, **kwargs)


def regularize_layer_params_weighted(layers: Mapping[Any, float], penalty: Callable[..., Any],
                                     tags: Mapping[str, bool] | None = None, **kwargs: Any) -> Any:
    """``sum(coefficient * penalty(params of layer))`` over a mapping ``layer -> coefficient``."""
    return sum(coefficient * regularize_layer_params(layer, penalty, tags, **kwargs)
               for layer, coefficient in layers.items())


def regularize_network_params(layer: Any, penalty: Callable[..., Any], tags: Mapping[str, bool] | None = None,
                              **kwargs: Any) -> Any:
    """The penalty over the parameters of every layer below ``layer`` (see
    :func:`synk_lasagne.layers.get_all_params`), ``regularizable=True`` by default."""
    from synk_lasagne.layers import get_all_params

    tags = {"regularizable": True} if tags is None else dict(tags)
    return apply_penalty(get_all_params(layer, **tags), penalty, **kwargs)
