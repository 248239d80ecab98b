"""Lasagne's update rules, built for data-parallel training: one flat gradient, all-reduced once.

A data-parallel step has three parts (the seed's "Update Rules" scheme):

1. every rank computes the raw gradient of its share of the batch into ONE flat shared vector,
   ``flat_grad`` (one collective call instead of one per parameter);
2. ``synk.all_reduce(flat_grad, op="sum")`` makes that vector the same in every rank (``"avg"``
   too: the weight in its last entry cancels the factor, see below);
3. every rank applies the same update, reading the gradients as views of ``flat_grad``.

Every rule below therefore returns three things, as a :class:`RuleUpdates` named tuple:

``grad_updates``
    ``[(flat_grad, expression, "sum")]``: the update that writes this rank's gradient (for the
    synk function that computes the loss; ``"sum"`` accumulates it over ``num_slices``);
``param_updates``
    an ordered dict ``{shared variable: expression}`` for the parameters and the rule's state
    (velocities, moment estimates, the step counter), read from the all-reduced ``flat_grad``;
``flat_grad``
    the flat shared vector to all-reduce between the two.

Rules (Lasagne's names, defaults and maths):

=============================  ==================================================================
:func:`sgd`                    ``param := param - learning_rate * g``
:func:`momentum`               ``velocity := momentum * velocity - learning_rate * g``; ``param += velocity``
:func:`nesterov_momentum`      the same, ``param += momentum * velocity - learning_rate * g``
:func:`adagrad`                ``param := param - learning_rate * g / sqrt(sum of g**2 + epsilon)``
:func:`rmsprop`                the same with a moving average of ``g**2``
:func:`adadelta`               ``param := param - learning_rate * g * rms(updates) / rms(g)``
:func:`adam`                   bias-corrected moving averages of ``g`` and ``g**2``
:func:`adamax`                 Adam with the infinity norm
:func:`amsgrad`                Adam with the running maximum of the second moment
=============================  ==================================================================

Modifiers and helpers:

=================================  ==================================================================
:func:`apply_momentum`             ``velocity := momentum * velocity + updates[param] - param``
:func:`apply_nesterov_momentum`    Nesterov's variant of the same
:func:`norm_constraint`            rescale weight vectors whose norm exceeds ``max_norm``
:func:`total_norm_constraint`      rescale a list of tensors so that their joint norm is <= ``max_norm``
:func:`flat_gradient`              the building block: the flat gradient update and its views
:func:`weighted_gradient_parts`    the pieces of the flat gradient, one per parameter, then the weight
:func:`get_or_compute_grads`       ``pytensor.grad(loss, params)``, or the given gradients
=================================  ==================================================================

The flat gradient and exact averages
------------------------------------
``flat_grad`` has one entry more than the parameters have values: ``flat_grad[:P]`` holds
``weight * g_r`` (the concatenated, raveled gradients of rank ``r`` times its weight) and
``flat_grad[P]`` holds ``weight`` itself.  The views the rules read are
``flat_grad[:P] / flat_grad[P]``.  After an all-reduce (avg or sum: the factor ``1/n`` cancels),
that is ``sum_r w_r g_r / sum_r w_r``.  With ``weight`` the number of rows of the rank's share of
the batch (``x.shape[0]``, what :func:`synk_lasagne.make_train_function` passes), and a loss that
is a mean over rows (plus any terms that do not depend on the rows, such as weight decay), this is
exactly the gradient of the loss over the whole batch, however unevenly the batch splits over the
ranks.  Without ``weight`` every rank counts the same (Synkhronos 1.0's behaviour: exact only
when the ranks have equal rows).  The all-reduce may also run inside one function: replace
``flat_grad`` in ``param_updates`` by ``synkhronos.ops.all_reduce(expression, "sum")`` of the
``grad_updates`` expression (what :func:`synk_lasagne.make_train_function` does); a rank with no
rows then contributes zeros.  Run as separate functions, a rank with no rows does not run the
gradient function and keeps its previous ``flat_grad``: make it add nothing by chaining the steps
with ``synk.chain(..., zeros_if_idle=True)`` or by resetting ``flat_grad`` to zeros after each step.

The rules' state as flat vectors
--------------------------------
Each rule computes on ONE vector per quantity: the average gradient ``g = flat_grad[:P] /
flat_grad[P]`` and its state (velocities, moment estimates, accumulators) are flat shared vectors
of ``P`` values in the same order as ``flat_grad`` (parameter ``i`` at its offset, raveled), and
each parameter moves by its part of the rule's step.  A compiled update then has a few long
element-wise loops and one output per state vector, instead of a loop and an output per parameter
and state: the update function of an 18-parameter MLP under Adam has 21 outputs instead of 55,
and took 38-55 us against 98-187 us per call on one core (PyTensor's JAX mode;
``benchmarks/RESULTS.md``).  :func:`apply_momentum` and :func:`apply_nesterov_momentum`, which add
momentum to any updates (Lasagne's API), keep a velocity per parameter.

Gradient clipping belongs after the all-reduce (the norm of the global gradient): pass
``grad_transform=lambda g: total_norm_constraint(g, 5.0)`` to any rule.

Example
-------
One process (plain PyTensor), to see the maths: ``loss = mean((x @ w - 1) ** 2)`` at ``w = 0``
has gradient ``-2`` in each entry, so one SGD step of 0.1 gives ``w = 0.2``.

>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> from synk_lasagne import updates
>>> w = pytensor.shared(np.zeros(3), name="w")
>>> x = pt.matrix("x")
>>> loss = pt.mean((x @ w - 1) ** 2)
>>> rule = updates.sgd(loss, [w], learning_rate=0.1, weight=x.shape[0])
>>> f_grad = pytensor.function([x], loss, updates=[u[:2] for u in rule.grad_updates])
>>> f_step = pytensor.function([], updates=rule.param_updates)
>>> float(f_grad(np.ones((4, 3))))
1.0
>>> f_step()
[]
>>> w.get_value()
array([0.2, 0.2, 0.2])

Data-parallel, every rank computing its share (what :func:`synk_lasagne.make_train_function`
wraps in one call):

>>> import synkhronos as synk
>>> synk.fork(2, use_gpu=False)                                              # doctest: +SKIP
2
>>> rule = updates.adam(loss, [w], weight=x.shape[0])                        # doctest: +SKIP
>>> f_grad = synk.function([x], outputs=loss, updates=rule.grad_updates)     # doctest: +SKIP
>>> f_step = synk.function([], updates=rule.param_updates)                   # doctest: +SKIP
>>> x_data = synk.data(np.ones((5, 3)))                                      # doctest: +SKIP
>>> loss_value = f_grad(x_data)                  # each rank: its rows      # doctest: +SKIP
>>> synk.all_reduce(rule.flat_grad, op="sum")    # one collective call      # doctest: +SKIP
>>> f_step()                                     # the same step everywhere # doctest: +SKIP

Every hyperparameter may be a symbolic scalar (e.g. a shared variable) to change it during
training without recompiling; its dtype should match the parameters' (``floatX``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "RuleUpdates",
    "flat_gradient",
    "weighted_gradient_parts",
    "get_or_compute_grads",
    "sgd",
    "apply_momentum",
    "momentum",
    "apply_nesterov_momentum",
    "nesterov_momentum",
    "adagrad",
    "rmsprop",
    "adadelta",
    "adam",
    "adamax",
    "amsgrad",
    "norm_constraint",
    "total_norm_constraint",
]

GradTransform = Callable[[list[Any]], Sequence[Any]]
"""A function of the list of (all-reduced) gradients that returns a list of the same length."""


class RuleUpdates(NamedTuple):
    """What every rule returns: unpack it as ``grad_updates, param_updates, flat_grad``.

    Attributes
    ----------
    grad_updates : list of (shared variable, expression, str)
        ``[(flat_grad, weight * gradients ++ [weight], "sum")]``: the update of the function that
        computes the gradient (a Synkhronos update triple; for a plain PyTensor function use
        ``[u[:2] for u in grad_updates]``).
    param_updates : OrderedDict
        ``{shared variable: expression}`` for the parameters, then the rule's state (flat vectors
        in ``flat_grad``'s order, and Adam's step counter), computed from the all-reduced
        ``flat_grad``.
    flat_grad : shared variable
        The flat gradient vector (one entry more than the parameters' values: the weight).
    """

    grad_updates: list[tuple[Any, Any, str]]
    param_updates: OrderedDict[Any, Any]
    flat_grad: Any


# --- helpers --------------------------------------------------------------------------------------

def _check_params(params: Iterable[Any]) -> list[Any]:
    from pytensor.compile.sharedvalue import SharedVariable

    params = list(params)
    if not params:
        raise ValueError("params is empty: give the shared variables to train")
    bad = [p for p in params if not isinstance(p, SharedVariable)]
    if bad:
        raise ValueError(f"params must contain shared variables only (they are updated in place), got {bad!r}")
    if len(set(params)) != len(params):
        raise ValueError("params has the same shared variable more than once")
    return params


def _zeros_like(param: Any, what: str) -> Any:
    """A new shared variable of zeros with ``param``'s shape, dtype and static shape."""
    import pytensor

    value = param.get_value(borrow=True)
    name = f"{param.name}.{what}" if param.name else what
    return pytensor.shared(np.zeros(np.shape(value), dtype=param.type.dtype), name=name, shape=param.type.shape)


class _FlatLayout:
    """Where each parameter's values sit in the flat vectors: the gradient's and the rules' state.

    Parameter ``i`` holds entries ``offsets[i]:offsets[i] + sizes[i]`` (raveled, C order), in the
    order of ``params``; ``total`` entries in all, of the parameters' common dtype."""

    def __init__(self, params: Sequence[Any]) -> None:
        self.params = list(params)
        self.dtype = _grad_dtype(self.params)
        self.shapes = [tuple(np.shape(p.get_value(borrow=True))) for p in self.params]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = [int(o) for o in np.cumsum([0, *self.sizes[:-1]])]
        self.total = sum(self.sizes)

    def views(self, vector: Any) -> list[Any]:
        """``vector``'s part of each parameter, in its shape (and dtype)."""
        return [_as_type_of(p, vector[a:a + n].reshape(shape))
                for p, a, n, shape in zip(self.params, self.offsets, self.sizes, self.shapes)]

    def zeros(self, what: str) -> Any:
        """A new flat shared vector of zeros: one entry of a rule's state per parameter value."""
        import pytensor

        return pytensor.shared(np.zeros(self.total, dtype=self.dtype), name=what, shape=(self.total,))

    def moved(self, delta: Any) -> OrderedDict[Any, Any]:
        """``{param: param + delta's view}``: every parameter moved by its part of ``delta``."""
        return OrderedDict((p, _as_type_of(p, p + view)) for p, view in zip(self.params, self.views(delta)))


def _flat_average(loss_or_grads: Any, params: Sequence[Any], weight: Any,
                  grad_transform: GradTransform | None) -> tuple[list[tuple[Any, Any, str]], Any, Any, _FlatLayout]:
    """What a rule reads: ``(grad_updates, g, flat_grad, layout)``, ``g`` the all-reduced average
    gradient as ONE vector (``flat_grad[:P] / flat_grad[P]``, or the transformed gradients
    raveled and joined), so that the rule's maths runs on a few long vectors."""
    import pytensor.tensor as pt

    grad_updates, views, flat, layout = _flat_gradient(loss_or_grads, params, weight, grad_transform)
    if grad_transform is None:
        g = flat[:layout.total] / flat[layout.total]
    else:
        g = pt.concatenate([pt.as_tensor_variable(v).ravel() for v in views])
    return grad_updates, _as_type_of(flat, g), flat, layout


def _as_type_of(var: Any, expr: Any) -> Any:
    """``expr`` cast to ``var``'s dtype (python-float hyperparameters may upcast it)."""
    import pytensor.tensor as pt

    expr = pt.as_tensor_variable(expr)
    return expr if expr.dtype == var.type.dtype else pt.cast(expr, var.type.dtype)


def _counter(dtype: str) -> Any:
    """ONE step counter ``t`` for all parameters of a rule (0-d shared variable, starts at 0)."""
    import pytensor

    return pytensor.shared(np.zeros((), dtype=dtype), name="t")


def _grad_dtype(params: Sequence[Any]) -> str:
    dtypes = {p.type.dtype for p in params}
    for dtype in dtypes:
        if np.dtype(dtype).kind != "f":
            raise ValueError(f"params must be floating point to be trained, got dtype {dtype}")
    return str(np.result_type(*dtypes))


def get_or_compute_grads(loss_or_grads: Any, params: Sequence[Any]) -> list[Any]:
    """The gradients: ``pytensor.grad(loss, params)``, or ``loss_or_grads`` if it is a list.

    Parameters
    ----------
    loss_or_grads : scalar expression or list of expressions
        A scalar loss, or one gradient expression per parameter.
    params : list of shared variables

    Returns
    -------
    list of expressions

    Raises
    ------
    ValueError
        If a parameter is not a shared variable, or the list of gradients has the wrong length.
    """
    import pytensor

    params = _check_params(params)
    if isinstance(loss_or_grads, (list, tuple)):
        if len(loss_or_grads) != len(params):
            raise ValueError(f"got {len(loss_or_grads)} gradient expressions for {len(params)} parameters")
        return list(loss_or_grads)
    if getattr(loss_or_grads, "ndim", None) != 0:
        raise ValueError(f"the loss must be a scalar expression (or give a list of gradients), got {loss_or_grads!r}")
    grads: Any = pytensor.grad(loss_or_grads, params)
    return list(grads)


def flat_gradient(loss_or_grads: Any, params: Sequence[Any], *, weight: Any = None,
                  grad_transform: GradTransform | None = None) -> tuple[list[tuple[Any, Any, str]], list[Any], Any]:
    """The flat gradient of every rule: its update, the views the rules read, and the vector.

    ``flat_grad := concatenate([weight * ravel(g) for g in grads] + [weight])``, and the view of
    parameter ``i`` is ``reshape(flat_grad[a_i:b_i] / flat_grad[P], shape_i)``.

    Parameters
    ----------
    loss_or_grads : scalar expression or list of expressions
        The loss (a mean over the rank's rows) or its gradients.
    params : list of shared variables
    weight : symbolic or numeric scalar, optional
        This rank's weight in the average, normally its number of rows (``x.shape[0]``);
        default 1 (every rank counts the same).
    grad_transform : callable, optional
        Applied to the list of views (the all-reduced gradients), e.g. clipping with
        :func:`total_norm_constraint`; must return a list of the same length.

    Returns
    -------
    grad_updates : list
        ``[(flat_grad, expression, "sum")]``.
    grads : list of expressions
        One per parameter, its shape and dtype: the global gradient once ``flat_grad`` is
        all-reduced.
    flat_grad : shared variable
        A vector of ``P + 1`` values (``P`` = total size of the parameters).
    """
    grad_updates, views, flat, _ = _flat_gradient(loss_or_grads, params, weight, grad_transform)
    return grad_updates, views, flat


def _flat_gradient(loss_or_grads: Any, params: Sequence[Any], weight: Any, grad_transform: GradTransform | None
                   ) -> tuple[list[tuple[Any, Any, str]], list[Any], Any, _FlatLayout]:
    """:func:`flat_gradient`, and the layout it built (which the flat rules read again)."""
    import pytensor
    import pytensor.tensor as pt

    layout = _FlatLayout(_check_params(params))
    total = layout.total
    flat = pytensor.shared(np.zeros(total + 1, dtype=layout.dtype), name="flat_grad")
    expr = pt.concatenate(weighted_gradient_parts(loss_or_grads, params, weight=weight))
    # divided view by view: no whole-vector temporary
    views = [_as_type_of(param, (flat[a:a + n] / flat[total]).reshape(shape))
             for param, a, n, shape in zip(layout.params, layout.offsets, layout.sizes, layout.shapes)]
    if grad_transform is not None:
        views = list(grad_transform(views))
        if len(views) != len(params):
            raise ValueError(f"grad_transform returned {len(views)} gradients for {len(params)} parameters")
    return [(flat, expr, "sum")], views, flat, layout


def weighted_gradient_parts(loss_or_grads: Any, params: Sequence[Any], *, weight: Any = None) -> list[Any]:
    """The pieces of the flat gradient's expression (:func:`flat_gradient`), in its order:
    ``weight * ravel(g_i)`` for each parameter, then ``[weight]``.

    ``concatenate(parts)`` is the expression that :func:`flat_gradient` writes into ``flat_grad``.
    A function that all-reduces inside its graph may all-reduce each part on its own and
    concatenate the results: the same values, and a compiler that sees one collective per
    parameter can start each as soon as that gradient exists, while the backward pass goes on
    (what :func:`synk_lasagne.make_train_function` does on the JAX engine).

    Parameters
    ----------
    loss_or_grads : scalar expression or list of expressions
        The loss (a mean over the rank's rows) or its gradients.
    params : list of shared variables
    weight : symbolic or numeric scalar, optional
        This rank's weight in the average (see :func:`flat_gradient`); default 1.

    Returns
    -------
    list of vectors
        One per parameter (its size), then the weight (a vector of one value), in the
        parameters' common dtype.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> w = pytensor.shared(np.zeros(3), name="w")
    >>> x = pt.matrix("x")
    >>> parts = weighted_gradient_parts(pt.mean((x @ w - 1) ** 2), [w], weight=x.shape[0])
    >>> [p.eval({x: np.ones((4, 3))}).tolist() for p in parts]
    [[-8.0, -8.0, -8.0], [4.0]]
    """
    import pytensor.tensor as pt

    params = _check_params(params)
    grads = get_or_compute_grads(loss_or_grads, params)
    dtype = _grad_dtype(params)
    w = pt.constant(np.ones((), dtype=dtype)) if weight is None else pt.cast(pt.as_tensor_variable(weight), dtype)
    if w.ndim != 0:
        raise ValueError(f"weight must be a scalar, got an expression of ndim {w.ndim}")
    return [pt.cast(g, dtype).ravel() * w for g in grads] + [pt.shape_padleft(w)]


# --- the rules ----------------------------------------------------------------------------------

def sgd(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any, *, weight: Any = None,
        grad_transform: GradTransform | None = None) -> RuleUpdates:
    """Stochastic gradient descent.

    ``param := param - learning_rate * g``

    Parameters
    ----------
    loss_or_grads : scalar expression or list of expressions
        A scalar loss (a mean over the rank's rows), or one gradient expression per parameter.
    params : list of shared variables
        The variables to train.
    learning_rate : float or symbolic scalar
        The size of the steps.
    weight : symbolic scalar, optional
        This rank's weight in the gradient average: its rows (``x.shape[0]``) for exact averages
        under uneven splits; see :func:`flat_gradient`.
    grad_transform : callable, optional
        Applied to the all-reduced gradients before the rule (e.g. clipping).

    Returns
    -------
    RuleUpdates
        ``(grad_updates, param_updates, flat_grad)``.
    """
    grad_updates, g, flat, layout = _flat_average(loss_or_grads, params, weight, grad_transform)
    return RuleUpdates(grad_updates, layout.moved(-(learning_rate * g)), flat)


def apply_momentum(updates: Any, params: Iterable[Any] | None = None, momentum: Any = 0.9) -> Any:
    """Add momentum to existing updates.

    ``velocity := momentum * velocity + updates[param] - param``;
    ``param := param + velocity``

    Parameters
    ----------
    updates : OrderedDict or RuleUpdates
        Parameter updates (``{param: expression}``), or what a rule returned.
    params : iterable of shared variables, optional
        The variables to add momentum to; default every key of ``updates`` (as in Lasagne: give
        the parameters when ``updates`` also holds a rule's state).
    momentum : float or symbolic scalar, optional
        How much of the previous velocity is kept (default 0.9).

    Returns
    -------
    OrderedDict or RuleUpdates
        A copy of ``updates`` (of the same kind) with a velocity per parameter.

    Notes
    -----
    Momentum also makes the steps larger; scale the learning rate by ``1 - momentum`` to
    compensate if needed.
    """
    if isinstance(updates, RuleUpdates):
        return updates._replace(param_updates=apply_momentum(updates.param_updates, params, momentum))
    new = OrderedDict(updates)
    for param in list(new.keys()) if params is None else list(params):
        velocity = _zeros_like(param, "velocity")
        x = momentum * velocity + new[param]
        new[velocity] = _as_type_of(velocity, x - param)
        new[param] = _as_type_of(param, x)
    return new


def momentum(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any, momentum: Any = 0.9, *,
             weight: Any = None, grad_transform: GradTransform | None = None) -> RuleUpdates:
    """Stochastic gradient descent with momentum: the maths of :func:`sgd` then
    :func:`apply_momentum`, with ONE flat velocity vector.

    ``velocity := momentum * velocity - learning_rate * g``;
    ``param := param + velocity``

    Parameters
    ----------
    loss_or_grads, params, learning_rate, weight, grad_transform
        As for :func:`sgd`.
    momentum : float or symbolic scalar, optional
        How much of the previous velocity is kept (default 0.9).

    Returns
    -------
    RuleUpdates
    """
    grad_updates, g, flat, layout = _flat_average(loss_or_grads, params, weight, grad_transform)
    velocity = layout.zeros("velocity")
    velocity_t = momentum * velocity - learning_rate * g
    updates = layout.moved(velocity_t)
    updates[velocity] = _as_type_of(velocity, velocity_t)
    return RuleUpdates(grad_updates, updates, flat)


def apply_nesterov_momentum(updates: Any, params: Iterable[Any] | None = None, momentum: Any = 0.9) -> Any:
    """Add Nesterov momentum to existing updates.

    ``velocity := momentum * velocity + updates[param] - param``;
    ``param := param + momentum * velocity + updates[param] - param``

    Parameters
    ----------
    updates : OrderedDict or RuleUpdates
        Parameter updates, or what a rule returned.
    params : iterable of shared variables, optional
        Default every key of ``updates``.
    momentum : float or symbolic scalar, optional
        Default 0.9.

    Returns
    -------
    OrderedDict or RuleUpdates
        A copy of ``updates`` with a velocity per parameter.

    Notes
    -----
    The formulation of pylearn2 (Lasagne's): the gradient is evaluated at the current
    parameters, not at the look-ahead point.
    """
    if isinstance(updates, RuleUpdates):
        return updates._replace(param_updates=apply_nesterov_momentum(updates.param_updates, params, momentum))
    new = OrderedDict(updates)
    for param in list(new.keys()) if params is None else list(params):
        velocity = _zeros_like(param, "velocity")
        x = momentum * velocity + new[param] - param
        new[velocity] = _as_type_of(velocity, x)
        new[param] = _as_type_of(param, momentum * x + new[param])
    return new


def nesterov_momentum(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any, momentum: Any = 0.9, *,
                      weight: Any = None, grad_transform: GradTransform | None = None) -> RuleUpdates:
    """SGD with Nesterov momentum: the maths of :func:`sgd` then :func:`apply_nesterov_momentum`,
    with ONE flat velocity vector.

    ``velocity := momentum * velocity - learning_rate * g``;
    ``param := param + momentum * velocity - learning_rate * g``

    Parameters
    ----------
    loss_or_grads, params, learning_rate, weight, grad_transform
        As for :func:`sgd`.
    momentum : float or symbolic scalar, optional
        Default 0.9.

    Returns
    -------
    RuleUpdates
    """
    grad_updates, g, flat, layout = _flat_average(loss_or_grads, params, weight, grad_transform)
    velocity = layout.zeros("velocity")
    velocity_t = momentum * velocity - learning_rate * g
    updates = layout.moved(momentum * velocity_t - learning_rate * g)
    updates[velocity] = _as_type_of(velocity, velocity_t)
    return RuleUpdates(grad_updates, updates, flat)


def adagrad(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 1.0, epsilon: Any = 1e-6, *,
            weight: Any = None, grad_transform: GradTransform | None = None) -> RuleUpdates:
    """Adagrad (Duchi, Hazan & Singer, 2011): steps shrink with the accumulated squared gradient.

    ``accu := accu + g**2``;
    ``param := param - learning_rate * g / sqrt(accu + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, weight, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 1.0.
    epsilon : float or symbolic scalar, optional
        Added for numerical stability (default 1e-6).

    Returns
    -------
    RuleUpdates
    """
    grad_updates, g, flat, layout = _flat_average(loss_or_grads, params, weight, grad_transform)
    import pytensor.tensor as pt

    accu = layout.zeros("accu")
    accu_t = accu + g ** 2
    updates = layout.moved(-(learning_rate * g / pt.sqrt(accu_t + epsilon)))
    updates[accu] = _as_type_of(accu, accu_t)
    return RuleUpdates(grad_updates, updates, flat)


def rmsprop(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 1.0, rho: Any = 0.9,
            epsilon: Any = 1e-6, *, weight: Any = None, grad_transform: GradTransform | None = None) -> RuleUpdates:
    """RMSProp (Tieleman & Hinton, 2012): steps scaled by a moving RMS of the gradient.

    ``accu := rho * accu + (1 - rho) * g**2``;
    ``param := param - learning_rate * g / sqrt(accu + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, weight, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 1.0.
    rho : float or symbolic scalar, optional
        Decay of the moving average, in [0, 1) (default 0.9).
    epsilon : float or symbolic scalar, optional
        Default 1e-6.

    Returns
    -------
    RuleUpdates
    """
    grad_updates, g, flat, layout = _flat_average(loss_or_grads, params, weight, grad_transform)
    import pytensor.tensor as pt

    accu = layout.zeros("accu")
    accu_t = rho * accu + (1 - rho) * g ** 2
    updates = layout.moved(-(learning_rate * g / pt.sqrt(accu_t + epsilon)))
    updates[accu] = _as_type_of(accu, accu_t)
    return RuleUpdates(grad_updates, updates, flat)


def adadelta(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 1.0, rho: Any = 0.95,
             epsilon: Any = 1e-6, *, weight: Any = None, grad_transform: GradTransform | None = None) -> RuleUpdates:
    """Adadelta (Zeiler, 2012): steps scaled by the ratio of the RMS of past updates to that of
    the gradients.

    ``accu := rho * accu + (1 - rho) * g**2``;
    ``update = g * sqrt(delta_accu + epsilon) / sqrt(accu + epsilon)``;
    ``param := param - learning_rate * update``;
    ``delta_accu := rho * delta_accu + (1 - rho) * update**2``

    Parameters
    ----------
    loss_or_grads, params, weight, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 1.0 (the paper has none; keep it).
    rho : float or symbolic scalar, optional
        Default 0.95.
    epsilon : float or symbolic scalar, optional
        Default 1e-6 (it makes the very first step non-zero).

    Returns
    -------
    RuleUpdates
    """
    grad_updates, g, flat, layout = _flat_average(loss_or_grads, params, weight, grad_transform)
    import pytensor.tensor as pt

    accu = layout.zeros("accu")
    delta_accu = layout.zeros("delta_accu")
    accu_t = rho * accu + (1 - rho) * g ** 2
    update = g * pt.sqrt(delta_accu + epsilon) / pt.sqrt(accu_t + epsilon)
    updates = layout.moved(-(learning_rate * update))
    updates[accu] = _as_type_of(accu, accu_t)
    updates[delta_accu] = _as_type_of(delta_accu, rho * delta_accu + (1 - rho) * update ** 2)
    return RuleUpdates(grad_updates, updates, flat)


def adam(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 0.001, beta1: Any = 0.9,
         beta2: Any = 0.999, epsilon: Any = 1e-8, *, weight: Any = None,
         grad_transform: GradTransform | None = None) -> RuleUpdates:
    """Adam (Kingma & Ba, 2014): bias-corrected moving averages of the gradient and its square.

    ``t := t + 1`` (ONE counter for all parameters);
    ``m := beta1 * m + (1 - beta1) * g``;
    ``v := beta2 * v + (1 - beta2) * g**2``;
    ``param := param - learning_rate * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, weight, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 0.001.
    beta1 : float or symbolic scalar, optional
        Decay of the first moment estimate (default 0.9).
    beta2 : float or symbolic scalar, optional
        Decay of the second moment estimate (default 0.999).
    epsilon : float or symbolic scalar, optional
        Default 1e-8.

    Returns
    -------
    RuleUpdates
        Its ``param_updates`` hold the parameters, ``m`` and ``v`` (flat vectors, one entry per
        parameter value) and one counter ``t``.

    Notes
    -----
    Synkhronos 1.0's adaptation added the counter's update once per parameter, which PyTensor
    refuses for more than one parameter; here it is one update.
    """
    grad_updates, g, flat, layout = _flat_average(loss_or_grads, params, weight, grad_transform)
    import pytensor.tensor as pt

    t_prev = _counter(layout.dtype)
    t = t_prev + 1
    a_t = learning_rate * pt.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
    m_prev, v_prev = layout.zeros("m"), layout.zeros("v")
    m_t = beta1 * m_prev + (1 - beta1) * g
    v_t = beta2 * v_prev + (1 - beta2) * g ** 2
    updates = layout.moved(-(a_t * m_t / (pt.sqrt(v_t) + epsilon)))
    updates[m_prev] = _as_type_of(m_prev, m_t)
    updates[v_prev] = _as_type_of(v_prev, v_t)
    updates[t_prev] = _as_type_of(t_prev, t)
    return RuleUpdates(grad_updates, updates, flat)


def adamax(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 0.002, beta1: Any = 0.9,
           beta2: Any = 0.999, epsilon: Any = 1e-8, *, weight: Any = None,
           grad_transform: GradTransform | None = None) -> RuleUpdates:
    """Adamax (Kingma & Ba, 2014): Adam with the infinity norm.

    ``t := t + 1`` (ONE counter);
    ``m := beta1 * m + (1 - beta1) * g``;
    ``u := max(beta2 * u, abs(g))``;
    ``param := param - learning_rate / (1 - beta1**t) * m / (u + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, weight, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 0.002.
    beta1 : float or symbolic scalar, optional
        Default 0.9.
    beta2 : float or symbolic scalar, optional
        Decay of the weighted infinity norm (default 0.999).
    epsilon : float or symbolic scalar, optional
        Default 1e-8.

    Returns
    -------
    RuleUpdates
    """
    grad_updates, g, flat, layout = _flat_average(loss_or_grads, params, weight, grad_transform)
    import pytensor.tensor as pt

    t_prev = _counter(layout.dtype)
    t = t_prev + 1
    a_t = learning_rate / (1 - beta1 ** t)
    m_prev, u_prev = layout.zeros("m"), layout.zeros("u")
    m_t = beta1 * m_prev + (1 - beta1) * g
    u_t = pt.maximum(beta2 * u_prev, abs(g))
    updates = layout.moved(-(a_t * m_t / (u_t + epsilon)))
    updates[m_prev] = _as_type_of(m_prev, m_t)
    updates[u_prev] = _as_type_of(u_prev, u_t)
    updates[t_prev] = _as_type_of(t_prev, t)
    return RuleUpdates(grad_updates, updates, flat)


def amsgrad(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 0.001, beta1: Any = 0.9,
            beta2: Any = 0.999, epsilon: Any = 1e-8, *, weight: Any = None,
            grad_transform: GradTransform | None = None) -> RuleUpdates:
    """AMSGrad (Reddi, Kale & Kumar, 2018): Adam with the running maximum of the second moment.

    ``t := t + 1`` (ONE counter);
    ``m := beta1 * m + (1 - beta1) * g``;
    ``v := beta2 * v + (1 - beta2) * g**2``;
    ``v_hat := max(v_hat, v)``;
    ``param := param - learning_rate * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v_hat) + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, weight, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 0.001.
    beta1, beta2 : float or symbolic scalar, optional
        Defaults 0.9 and 0.999.
    epsilon : float or symbolic scalar, optional
        Default 1e-8.

    Returns
    -------
    RuleUpdates
    """
    grad_updates, g, flat, layout = _flat_average(loss_or_grads, params, weight, grad_transform)
    import pytensor.tensor as pt

    t_prev = _counter(layout.dtype)
    t = t_prev + 1
    a_t = learning_rate * pt.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
    m_prev, v_prev, v_hat_prev = layout.zeros("m"), layout.zeros("v"), layout.zeros("v_hat")
    m_t = beta1 * m_prev + (1 - beta1) * g
    v_t = beta2 * v_prev + (1 - beta2) * g ** 2
    v_hat_t = pt.maximum(v_hat_prev, v_t)
    updates = layout.moved(-(a_t * m_t / (pt.sqrt(v_hat_t) + epsilon)))
    updates[m_prev] = _as_type_of(m_prev, m_t)
    updates[v_prev] = _as_type_of(v_prev, v_t)
    updates[v_hat_prev] = _as_type_of(v_hat_prev, v_hat_t)
    updates[t_prev] = _as_type_of(t_prev, t)
    return RuleUpdates(grad_updates, updates, flat)


# --- constraints ----------------------------------------------------------------------------------

def norm_constraint(tensor_var: Any, max_norm: Any, norm_axes: Sequence[int] | None = None,
                    epsilon: float = 1e-7) -> Any:
    """Rescale the weight vectors of ``tensor_var`` whose norm exceeds ``max_norm``.

    ``norms = sqrt(sum(tensor_var**2, axis=norm_axes, keepdims=True))``;
    ``result = tensor_var * clip(norms, 0, max_norm) / (epsilon + norms)``

    Parameters
    ----------
    tensor_var : tensor expression
        An update, a gradient, or another quantity (e.g. ``rule.param_updates[W]``).
    max_norm : scalar
        The largest norm allowed.
    norm_axes : sequence of int, optional
        The axes of the norm.  Default: ``(0,)`` for a matrix (a dense layer's weights: the
        norm of each unit's incoming weights), every axis but 0 for 3-, 4- and 5-d tensors
        (convolution filters).
    epsilon : float, optional
        Guards the division for very small norms (default 1e-7).

    Returns
    -------
    tensor expression
        ``tensor_var`` with its over-long vectors rescaled to norm ``max_norm``.

    Raises
    ------
    ValueError
        If ``norm_axes`` is not given and ``tensor_var`` is not 2-, 3-, 4- or 5-d.

    Examples
    --------
    Constrain a parameter after its update:

    >>> import numpy as np, pytensor
    >>> from synk_lasagne.updates import norm_constraint
    >>> w = pytensor.shared(np.full((4, 2), 10.0))
    >>> f = pytensor.function([], updates=[(w, norm_constraint(w + 1, 3.0))])
    >>> _ = f()
    >>> np.round(np.sqrt((w.get_value() ** 2).sum(axis=0)), 6)
    array([3., 3.])
    """
    import pytensor.tensor as pt

    tensor_var = pt.as_tensor_variable(tensor_var)
    ndim = tensor_var.ndim
    if norm_axes is not None:
        sum_over = tuple(norm_axes)
    elif ndim == 2:
        sum_over = (0,)
    elif ndim in (3, 4, 5):
        sum_over = tuple(range(1, ndim))
    else:
        raise ValueError(f"norm_constraint: no default norm axes for a {ndim}-d tensor; give norm_axes")
    dtype = np.dtype(tensor_var.dtype).type
    norms = pt.sqrt(pt.sum(pt.sqr(tensor_var), axis=sum_over, keepdims=True))
    target = pt.clip(norms, 0, dtype(max_norm) if isinstance(max_norm, (int, float)) else max_norm)
    return tensor_var * (target / (dtype(epsilon) + norms))


def total_norm_constraint(tensor_vars: Sequence[Any], max_norm: Any, epsilon: float = 1e-7,
                          return_norm: bool = False) -> Any:
    """Rescale a list of tensors together so that their joint norm is at most ``max_norm``.

    ``norm = sqrt(sum over tensors of sum(t**2))``;
    ``t := t * clip(norm, 0, max_norm) / (epsilon + norm)`` for each tensor

    Typically gradient clipping (Sutskever, Vinyals & Le, 2014).  In data-parallel training,
    clip the all-reduced gradient, as one process would: pass
    ``grad_transform=lambda g: total_norm_constraint(g, max_norm)`` to a rule.

    Parameters
    ----------
    tensor_vars : list of tensor expressions
    max_norm : float
        The largest joint norm allowed.
    epsilon : float, optional
        Default 1e-7.
    return_norm : bool, optional
        Also return the joint norm before rescaling.

    Returns
    -------
    list of tensor expressions, or (that list, the norm)
    """
    import pytensor.tensor as pt

    tensor_vars = [pt.as_tensor_variable(t) for t in tensor_vars]
    if not tensor_vars:
        raise ValueError("total_norm_constraint needs at least one tensor")
    norm = pt.sqrt(sum(pt.sum(t ** 2) for t in tensor_vars))
    dtype = np.dtype(tensor_vars[0].dtype).type
    target = pt.clip(norm, 0, dtype(max_norm) if isinstance(max_norm, (int, float)) else max_norm)
    multiplier = target / (dtype(epsilon) + norm)
    scaled = [t * multiplier for t in tensor_vars]
    return (scaled, norm) if return_norm else scaled
