"""Losses and metrics (Lasagne's ``lasagne.objectives``): elementwise or per-row terms, then
:func:`aggregate` to a scalar.

==================================  ================================================================
:func:`categorical_crossentropy`    ``-log(predictions[i, targets[i]])`` (or ``-sum(t log p)``)
:func:`categorical_accuracy`        whether the target is in the ``top_k`` predictions
:func:`binary_crossentropy`         ``-t log(p) - (1 - t) log(1 - p)``
:func:`binary_accuracy`             ``(predictions >= threshold) == targets``
:func:`squared_error`               ``(a - b) ** 2``
:func:`binary_hinge_loss`           ``max(0, delta - t * p)`` with ``t`` in {-1, 1}
:func:`multiclass_hinge_loss`       ``max(0, delta + max_{j != t} p_j - p_t)`` per row
:func:`huber_loss`                  ``0.5 d**2`` for ``|d| <= delta``, else ``delta (|d| - delta / 2)``
:func:`aggregate`                   mean, sum, or weighted sums of a loss
==================================  ================================================================

With synk_lasagne's training functions the loss must be a MEAN over rows (``aggregate(...,
mode="mean")``, the default): the data-parallel step weights each rank by its rows.

Example
-------
>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> from synk_lasagne import objectives
>>> p, t = pt.matrix("p"), pt.ivector("t")
>>> loss = objectives.aggregate(objectives.categorical_crossentropy(p, t))
>>> round(float(pytensor.function([p, t], loss)(np.array([[0.5, 0.5], [0.25, 0.75]]), np.array([0, 1], "int32"))), 4)
0.4904
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytensor.tensor as pt

__all__ = ["aggregate", "align_targets", "binary_accuracy", "binary_crossentropy", "binary_hinge_loss",
           "categorical_accuracy", "categorical_crossentropy", "huber_loss", "multiclass_hinge_loss",
           "squared_error"]


def align_targets(predictions: Any, targets: Any) -> tuple[Any, Any]:
    """``predictions`` and ``targets`` as expressions, a vector of targets made a column when the
    predictions are a column ``(rows, 1)`` (so that they pair row by row instead of broadcasting
    to ``(rows, rows)``)."""
    predictions, targets = pt.as_tensor_variable(predictions), pt.as_tensor_variable(targets)
    if predictions.ndim == 2 and predictions.type.shape[1] == 1 and targets.ndim == 1:
        targets = targets.dimshuffle(0, "x")
    return predictions, targets


def _one_hot_targets(predictions: Any, targets: Any) -> Any:
    """Class-index targets as one-hot rows like ``predictions``; one-hot targets as they are."""
    if targets.ndim == predictions.ndim - 1:
        return pt.eq(pt.arange(predictions.shape[-1])[None, :], targets[:, None])
    if targets.ndim != predictions.ndim:
        raise TypeError(f"rank mismatch between targets and predictions: {targets.ndim}-d targets for "
                        f"{predictions.ndim}-d predictions (give class indices or one-hot rows)")
    return targets


def _log_predictions(predictions: Any) -> Any:
    """``log(predictions)``, computed as ``log_softmax`` of the scores when ``predictions`` is a
    softmax (stable in float32, and one pass)."""
    from pytensor.tensor.special import Softmax

    owner = predictions.owner
    if owner is not None and isinstance(owner.op, Softmax):
        return pt.special.log_softmax(owner.inputs[0], axis=owner.op.axis)
    return pt.log(predictions)


def categorical_crossentropy(predictions: Any, targets: Any) -> Any:
    """Cross-entropy of each row's predicted distribution with its target.

    Parameters
    ----------
    predictions : matrix ``(rows, classes)``
        Probabilities (e.g. a softmax output).
    targets : int vector ``(rows,)`` of class indices, or a matrix of target distributions

    Returns
    -------
    vector ``(rows,)``
    """
    logp = _log_predictions(predictions)
    if targets.ndim == predictions.ndim:
        return -pt.sum(targets * logp, axis=-1)
    if targets.ndim == predictions.ndim - 1 and targets.dtype.startswith(("int", "uint")):
        return -logp[pt.arange(targets.shape[0]), targets]
    raise TypeError(f"targets must be class indices (an int vector) or distributions like the predictions; "
                    f"got {targets.ndim}-d {targets.dtype} for {predictions.ndim}-d predictions")


def categorical_accuracy(predictions: Any, targets: Any, top_k: int = 1) -> Any:
    """1 where the target class is among the ``top_k`` largest predictions of its row, else 0.

    ``targets`` are class indices or one-hot rows (their argmax is taken)."""
    predictions, targets = pt.as_tensor_variable(predictions), pt.as_tensor_variable(targets)
    if targets.ndim == predictions.ndim:
        targets = pt.argmax(targets, axis=-1)
    elif targets.ndim != predictions.ndim - 1:
        raise TypeError(f"rank mismatch between targets and predictions: {targets.ndim}-d targets for "
                        f"{predictions.ndim}-d predictions (give class indices or one-hot rows)")
    if top_k == 1:
        return pt.eq(pt.argmax(predictions, axis=-1), targets)
    top = pt.argsort(predictions, axis=-1)[..., -top_k:]
    return pt.any(pt.eq(top, targets[..., None]), axis=-1)


def binary_crossentropy(predictions: Any, targets: Any) -> Any:
    """``-targets * log(predictions) - (1 - targets) * log(1 - predictions)``, elementwise."""
    predictions, targets = align_targets(predictions, targets)
    return -(targets * pt.log(predictions) + (1 - targets) * pt.log1p(-predictions))


def binary_accuracy(predictions: Any, targets: Any, threshold: float = 0.5) -> Any:
    """1 where ``predictions >= threshold`` agrees with the 0/1 ``targets``, elementwise."""
    predictions, targets = align_targets(predictions, targets)
    return pt.eq(pt.ge(predictions, threshold), targets)


def squared_error(a: Any, b: Any) -> Any:
    """``(a - b) ** 2``, elementwise (``b`` a vector and ``a`` a column: row by row)."""
    a, b = align_targets(a, b)
    return pt.sqr(a - b)


def huber_loss(predictions: Any, targets: Any, delta: float = 1) -> Any:
    """Element-wise Huber loss of ``d = targets - predictions``: squared near 0, linear beyond
    ``delta`` (``delta=1``: the smooth L1 loss of Fast R-CNN).

    Parameters
    ----------
    predictions, targets : tensor expressions
        Of the same shape, or a column of predictions and a vector of targets.
    delta : float, optional
        Where the loss turns from quadratic to linear (default 1).

    Returns
    -------
    tensor expression
    """
    predictions, targets = align_targets(predictions, targets)
    diff = abs(targets - predictions)
    return pt.switch(diff <= delta, 0.5 * squared_error(targets, predictions), delta * (diff - delta / 2.0))


def binary_hinge_loss(predictions: Any, targets: Any, delta: float = 1, log_odds: bool | None = None,
                      binary: bool = True) -> Any:
    """``max(0, delta - t * predictions)``; ``binary=True`` maps 0/1 targets to -1/1 first.

    ``log_odds=False`` (predictions as probabilities) maps them to log-odds first."""
    predictions, targets = align_targets(predictions, targets)
    if log_odds is False:
        predictions = pt.log(predictions) - pt.log1p(-predictions)
    if binary:
        targets = 2 * targets - 1
    return pt.maximum(0, delta - targets * predictions)


def multiclass_hinge_loss(predictions: Any, targets: Any, delta: float = 1) -> Any:
    """``max(0, delta + max_{j != t} predictions[j] - predictions[t])`` for each row.

    Parameters
    ----------
    predictions : matrix ``(rows, classes)``
    targets : int vector of class indices, or one-hot rows
    delta : float
        The margin.

    Returns
    -------
    vector ``(rows,)``

    Raises
    ------
    TypeError
        For targets of another rank.
    """
    predictions, targets = pt.as_tensor_variable(predictions), pt.as_tensor_variable(targets)
    one_hot = _one_hot_targets(predictions, targets)
    correct = pt.sum(predictions * one_hot, axis=-1)
    rest = pt.max(pt.switch(one_hot, -np.inf, predictions), axis=-1)
    return pt.maximum(0, delta + rest - correct)


def aggregate(loss: Any, weights: Any = None, mode: str = "mean") -> Any:
    """A scalar from elementwise or per-row losses.

    Parameters
    ----------
    loss : tensor
    weights : tensor broadcastable to ``loss``, optional
    mode : {"mean", "sum", "normalized_sum"}
        ``mean(weights * loss)``, ``sum(weights * loss)``, or ``sum(weights * loss) / sum(weights)``
        (which needs weights).

    Returns
    -------
    scalar
    """
    if weights is not None:
        loss = loss * weights
    if mode == "mean":
        return loss.mean()
    if mode == "sum":
        return loss.sum()
    if mode == "normalized_sum":
        if weights is None:
            raise ValueError("mode='normalized_sum' require weights: give weights=...")
        return loss.sum() / pt.as_tensor_variable(weights).sum()
    raise ValueError(f"mode must be 'mean', 'sum' or 'normalized_sum', got {mode!r}")
