"""Lasagne's update rules: an ``OrderedDict`` of updates, data-parallel inside a Synkhronos function.

Every rule has Lasagne's signature and returns Lasagne's value, an ``OrderedDict`` ``{shared
variable: expression}``, so a Lasagne step is unchanged::

    updates = nesterov_momentum(loss, params, learning_rate=0.01, momentum=0.9)
    train = pytensor.function([x, y], loss, updates=updates)     # one process: Lasagne's step
    train = synk.function([x, y], loss, updates=updates)         # every rank: its rows, one step

The rules average the gradients over the ranks inside the graph (:func:`average_over_ranks`,
:func:`synkhronos.ops.all_reduce` with ``"avg"``, weighted by each rank's rows), which is the
identity in a plain ``pytensor.function``: the same updates are Lasagne's step in one process
and, in a Synkhronos function, the step one process takes on the whole batch, however unevenly
the batch splits over the ranks (the loss must be a MEAN over the rows, as Lasagne's objectives
with ``aggregate`` give it).

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
:func:`get_or_compute_grads`       ``pytensor.grad(loss, params)``, or the given gradients
:func:`average_over_ranks`         the gradients averaged over the ranks (identity in one process)
:func:`no_all_reduce`              a context in which the rules read their gradients as given
:func:`flat_gradient`              the flat gradient ``[w * g, w]`` of a step split into functions
=================================  ==================================================================

One all-reduce, flat state
--------------------------
Where the collectives are the shared-memory ones (CPU mode, the per-rank engine) the rules
all-reduce ONE flat vector, every gradient raveled and joined, instead of one per parameter
(one collective call per step); on the JAX engine each parameter's gradient is all-reduced on
its own (XLA combines them and overlaps them with the backward pass).  The rules' state
(velocities, moment estimates, accumulators) is likewise one flat shared vector per quantity, in
the parameters' order, so a compiled update has a few long element-wise loops and one output per
state vector: the update function of an 18-parameter MLP under Adam has 21 outputs instead of 55
(``benchmarks/bench_update_rules.py``).  The maths is Lasagne's, entry by entry.

Given a loss, a rule's updates also hold the state updates that the loss carries (batch norm's
running averages, dropout's random generators: :func:`synk_lasagne.layers.get_state_updates`),
so ``function(..., updates=rule(loss, params))`` advances them as Lasagne's graph does.

Gradient clipping belongs after the average (the norm of the whole batch's gradient): pass
``grad_transform=lambda g: total_norm_constraint(g, 5.0)`` to any rule (a keyword that Lasagne's
rules lack; clipping the gradients before passing them clips each rank's own).

Example
-------
``loss = mean((x @ w - 1) ** 2)`` at ``w = 0`` has gradient ``-2`` in each entry, so one SGD
step of 0.1 gives ``w = 0.2``:

>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> from synk_lasagne import updates
>>> w = pytensor.shared(np.zeros(3), name="w")
>>> x = pt.matrix("x")
>>> loss = pt.mean((x @ w - 1) ** 2)
>>> step = pytensor.function([x], loss, updates=updates.sgd(loss, [w], learning_rate=0.1))
>>> float(step(np.ones((4, 3))))
1.0
>>> w.get_value()
array([0.2, 0.2, 0.2])

Data-parallel: the same updates in a Synkhronos function, every rank computing its rows:

>>> import synkhronos as synk
>>> synk.fork(2, use_gpu=False)                                                 # doctest: +SKIP
2
>>> step = synk.function([x], loss, updates=updates.adam(loss, [w]))            # doctest: +SKIP
>>> loss_value = step(synk.data(np.ones((5, 3))))          # 3 + 2 rows: exact # doctest: +SKIP

Every hyperparameter may be a symbolic scalar (e.g. a shared variable) to change it during
training without recompiling; its dtype should match the parameters' (``floatX``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "average_over_ranks",
    "no_all_reduce",
    "flat_gradient",
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
"""A function of the list of (averaged) gradients that returns a list of the same length."""

_LOCAL: contextvars.ContextVar[bool] = contextvars.ContextVar("synk_lasagne_no_all_reduce", default=False)


@contextlib.contextmanager
def no_all_reduce() -> Iterator[None]:
    """A context in which the rules use their gradients as given, without averaging them.

    For gradients that are averaged already (e.g. views of a vector all-reduced by
    :func:`synkhronos.chain`, what :func:`synk_lasagne.make_train_function` builds for
    ``num_slices`` > 1), or a rule applied in a function that runs without rows.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> from synk_lasagne import updates
    >>> w = pytensor.shared(np.ones(2))
    >>> from synkhronos import ops
    >>> len(ops.collective_nodes(updates.sgd([pytensor.tensor.ones(2)], [w], 0.5).values()))
    1
    >>> with updates.no_all_reduce():
    ...     step = updates.sgd([pytensor.tensor.ones(2)], [w], 0.5)
    >>> len(ops.collective_nodes(step.values()))
    0
    """
    token = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(token)


# --- helpers --------------------------------------------------------------------------------------

def _check_params(params: Iterable[Any]) -> list[Any]:
    from pytensor.compile.sharedvalue import SharedVariable

    params = list(params)
    if not params:
        raise ValueError("params is empty: give the shared variables to train")
    bad = [p for p in params if not isinstance(p, SharedVariable)]
    if bad:
        raise ValueError(f"params must contain shared variables only (they are updated in place), got {bad!r}; "
                         "if it holds other variables, use pytensor.grad and pass the gradients instead")
    if len(set(params)) != len(params):
        raise ValueError("params has the same shared variable more than once")
    return params


def _zeros_like(param: Any, what: str) -> Any:
    """A new shared variable of zeros with ``param``'s shape, dtype and static shape."""
    import pytensor

    value = param.get_value(borrow=True)
    name = f"{param.name}.{what}" if param.name else what
    return pytensor.shared(np.zeros(np.shape(value), dtype=param.type.dtype), name=name, shape=param.type.shape)


def _grad_dtype(params: Sequence[Any]) -> str:
    dtypes = {p.type.dtype for p in params}
    for dtype in dtypes:
        if np.dtype(dtype).kind != "f":
            raise ValueError(f"params must be floating point to be trained, got dtype {dtype}")
    return str(np.result_type(*dtypes))


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

    def join(self, grads: Sequence[Any]) -> Any:
        """One vector of the parameters' parts (each raveled, cast to the common dtype)."""
        import pytensor.tensor as pt

        parts = [pt.cast(pt.as_tensor_variable(g), self.dtype).ravel() for g in grads]
        return parts[0] if len(parts) == 1 else pt.concatenate(parts)

    def zeros(self, what: str) -> Any:
        """A new flat shared vector of zeros: one entry of a rule's state per parameter value."""
        import pytensor

        return pytensor.shared(np.zeros(self.total, dtype=self.dtype), name=what, shape=(self.total,))

    def moved(self, delta: Any) -> OrderedDict[Any, Any]:
        """``{param: param + delta's view}``: every parameter moved by its part of ``delta``."""
        return OrderedDict((p, _as_type_of(p, p + view)) for p, view in zip(self.params, self.views(delta)))


def _as_type_of(var: Any, expr: Any) -> Any:
    """``expr`` cast to ``var``'s dtype (python-float hyperparameters may upcast it)."""
    import pytensor.tensor as pt

    expr = pt.as_tensor_variable(expr)
    return expr if expr.dtype == var.type.dtype else pt.cast(expr, var.type.dtype)


def _counter(dtype: str) -> Any:
    """ONE step counter ``t`` for all parameters of a rule (0-d shared variable, starts at 0)."""
    import pytensor

    return pytensor.shared(np.zeros((), dtype=dtype), name="t")


def _flat_all_reduce_pays() -> bool:
    """One all-reduce of the joined gradients (shared-memory collectives: one call), rather than
    one per parameter (the JAX engine, where XLA overlaps them with the backward pass)."""
    from synkhronos.runtime import current

    rt = current()
    return rt is None or rt.engine is None


def get_or_compute_grads(loss_or_grads: Any, params: Sequence[Any]) -> Any:
    """The gradients: ``pytensor.grad(loss, params)``, or ``loss_or_grads`` itself if it is a list.

    Parameters
    ----------
    loss_or_grads : scalar expression or list of expressions
        A scalar loss, or one gradient expression per parameter.
    params : list of shared variables

    Returns
    -------
    list of expressions
        ``loss_or_grads`` unchanged (the same object) when it is a list or tuple.

    Raises
    ------
    ValueError
        If a parameter is not a shared variable (under Lasagne 0.1's behaviour,
        :func:`synk_lasagne.set_lasagne_api`, any variable is taken), or the list of gradients has
        the wrong length.
    """
    import pytensor
    from pytensor.compile.sharedvalue import SharedVariable

    from synk_lasagne.api import lasagne_api

    params = list(params)
    if lasagne_api() != "0.1" and any(not isinstance(p, SharedVariable) for p in params):
        raise ValueError("params must contain shared variables only (they are updated in place); if it holds "
                         "other variables, compute the gradients with pytensor.grad and pass them instead (or "
                         "follow Lasagne 0.1, which took any variable: synk_lasagne.set_lasagne_api('0.1'))")
    if isinstance(loss_or_grads, (list, tuple)):
        if len(loss_or_grads) != len(params):
            raise ValueError(f"Got {len(loss_or_grads)} gradient expressions for {len(params)} parameters")
        return loss_or_grads
    if getattr(loss_or_grads, "ndim", None) != 0:
        raise ValueError(f"the loss must be a scalar expression (or give a list of gradients), got {loss_or_grads!r}")
    grads: Any = pytensor.grad(loss_or_grads, params)
    return list(grads)


def average_over_ranks(grads: Sequence[Any]) -> list[Any]:
    """Each gradient averaged over the ranks of a Synkhronos call, weighted by their rows.

    ``synkhronos.ops.all_reduce(g, "avg")``: in a Synkhronos function, ``sum_r n_r g_r / sum_r
    n_r`` (``n_r`` the rows of rank ``r``), the gradient of the whole batch for a loss that is a
    mean over rows; in a plain ``pytensor.function``, ``g`` itself.  Where the collectives are
    shared-memory ones (CPU mode, the per-rank engine) the gradients are joined into ONE vector
    for one all-reduce; on the JAX engine each is all-reduced on its own.  Inside
    :func:`no_all_reduce`, the gradients unchanged.

    Parameters
    ----------
    grads : list of expressions

    Returns
    -------
    list of expressions
        One per gradient, its shape and dtype.
    """
    import pytensor.tensor as pt

    from synkhronos import ops

    grads = [pt.as_tensor_variable(g) for g in grads]
    if _LOCAL.get() or not grads:
        return grads
    if len(grads) == 1 or not _flat_all_reduce_pays():
        return [ops.all_reduce(g, "avg") for g in grads]
    dtype = str(np.result_type(*(g.dtype for g in grads)))
    reduced: Any = ops.all_reduce(pt.concatenate([pt.cast(g, dtype).ravel() for g in grads]), "avg")
    out, offset = [], 0
    for g in grads:
        size = pt.prod(g.shape) if g.ndim else 1
        part = reduced[offset:offset + size].reshape(g.shape)
        out.append(part if part.dtype == g.dtype else pt.cast(part, g.dtype))
        offset = offset + size
    return out


def _average(loss_or_grads: Any, params: Sequence[Any],
             grad_transform: GradTransform | None) -> tuple[Any, _FlatLayout]:
    """What a rule reads: the averaged gradient as ONE vector, and the parameters' layout."""
    from synkhronos import ops

    layout = _FlatLayout(_check_params(params))
    grads = list(get_or_compute_grads(loss_or_grads, layout.params))
    if _LOCAL.get():
        g = layout.join(grads)
    elif _flat_all_reduce_pays():
        g = ops.all_reduce(layout.join(grads), "avg")
    else:
        g = layout.join([ops.all_reduce(grad, "avg") for grad in grads])
    if grad_transform is not None:
        views = list(grad_transform(layout.views(g)))
        if len(views) != len(layout.params):
            raise ValueError(f"grad_transform returned {len(views)} gradients for {len(layout.params)} parameters")
        g = layout.join(views)
    return g, layout


def flat_gradient(loss_or_grads: Any, params: Sequence[Any], weight: Any) -> tuple[Any, Any, list[Any]]:
    """The flat gradient of a step split into functions: ``[weight * g, weight]`` and its views.

    For a step run as :func:`synkhronos.chain` (``num_slices`` > 1 in
    :func:`synk_lasagne.make_train_function`): a gradient function accumulates ``flat_grad :=
    concatenate([weight * ravel(g) for g in grads] + [weight])`` (op ``"sum"``), the chain
    all-reduces it (sum), and the update reads the views ``flat_grad[a_i:b_i] / flat_grad[P]``
    (a rule called inside :func:`no_all_reduce`): with ``weight`` the rows of the rank, the
    gradient of the whole batch.

    Parameters
    ----------
    loss_or_grads : scalar expression or list of expressions
        The loss (a mean over the rank's rows) or its gradients.
    params : list of shared variables
    weight : symbolic or numeric scalar
        This rank's weight, normally its rows (``x.shape[0]``).

    Returns
    -------
    flat_grad : shared variable
        A vector of ``P + 1`` values (``P`` = total size of the parameters).
    expression : vector expression
        What a rank writes into it.
    views : list of expressions
        One per parameter, its shape and dtype: the average gradient once ``flat_grad`` holds
        the sums.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> w = pytensor.shared(np.zeros(3), name="w")
    >>> x = pt.matrix("x")
    >>> flat, expr, views = flat_gradient(pt.mean((x @ w - 1) ** 2), [w], x.shape[0])
    >>> expr.eval({x: np.ones((4, 3))}).tolist()
    [-8.0, -8.0, -8.0, 4.0]
    """
    import pytensor
    import pytensor.tensor as pt

    layout = _FlatLayout(_check_params(params))
    grads = get_or_compute_grads(loss_or_grads, layout.params)
    w = pt.cast(pt.as_tensor_variable(weight), layout.dtype)
    if w.ndim != 0:
        raise ValueError(f"weight must be a scalar, got an expression of ndim {w.ndim}")
    expr = pt.concatenate([pt.cast(g, layout.dtype).ravel() * w for g in grads] + [pt.shape_padleft(w)])
    flat = pytensor.shared(np.zeros(layout.total + 1, dtype=layout.dtype), name="flat_grad")
    views = [_as_type_of(p, (flat[a:a + n] / flat[layout.total]).reshape(shape))
             for p, a, n, shape in zip(layout.params, layout.offsets, layout.sizes, layout.shapes)]
    return flat, expr, views


def _lasagne_rule(rule: Callable[..., OrderedDict[Any, Any]]) -> Callable[..., OrderedDict[Any, Any]]:
    """A rule that also applies the state updates its loss carries (batch norm's running averages,
    dropout's generators: :func:`synk_lasagne.layers.get_state_updates`), as Lasagne's graph does
    in a plain function: given a loss (not gradients), ``rule(loss, params, ...)`` holds them after
    its own updates."""

    @functools.wraps(rule)
    def wrapped(loss_or_grads: Any, params: Sequence[Any], *args: Any, **kwargs: Any) -> OrderedDict[Any, Any]:
        updates = rule(loss_or_grads, params, *args, **kwargs)
        if not isinstance(loss_or_grads, (list, tuple)):
            from synk_lasagne.layers.base import get_state_updates

            for var, expr in get_state_updates(loss_or_grads):
                updates.setdefault(var, expr)
        return updates

    return wrapped


# --- the rules ----------------------------------------------------------------------------------

@_lasagne_rule
def sgd(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any, *,
        grad_transform: GradTransform | None = None) -> OrderedDict[Any, Any]:
    """Stochastic gradient descent.

    ``param := param - learning_rate * g``

    Parameters
    ----------
    loss_or_grads : scalar expression or list of expressions
        A scalar loss (a mean over the rows), or one gradient expression per parameter.
    params : list of shared variables
        The variables to train.
    learning_rate : float or symbolic scalar
        The size of the steps.
    grad_transform : callable, optional
        Applied to the averaged gradients before the rule (e.g. clipping); not in Lasagne.

    Returns
    -------
    OrderedDict
        ``{shared variable: expression}``: the parameters, then the rule's state.
    """
    g, layout = _average(loss_or_grads, params, grad_transform)
    return layout.moved(-(learning_rate * g))


def apply_momentum(updates: Any, params: Iterable[Any] | None = None, momentum: Any = 0.9) -> OrderedDict[Any, Any]:
    """Add momentum to existing updates.

    ``velocity := momentum * velocity + updates[param] - param``;
    ``param := param + velocity``

    Parameters
    ----------
    updates : OrderedDict
        Parameter updates (``{param: expression}``), e.g. what :func:`sgd` returned.
    params : iterable of shared variables, optional
        The variables to add momentum to; default every key of ``updates`` (give the
        parameters when ``updates`` also holds a rule's state).
    momentum : float or symbolic scalar, optional
        How much of the previous velocity is kept (default 0.9).

    Returns
    -------
    OrderedDict
        A copy of ``updates`` with a velocity per parameter.
    """
    new = OrderedDict(updates)
    for param in list(new.keys()) if params is None else list(params):
        velocity = _zeros_like(param, "velocity")
        x = momentum * velocity + new[param]
        new[velocity] = _as_type_of(velocity, x - param)
        new[param] = _as_type_of(param, x)
    return new


@_lasagne_rule
def momentum(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any, momentum: Any = 0.9, *,
             grad_transform: GradTransform | None = None) -> OrderedDict[Any, Any]:
    """Stochastic gradient descent with momentum, ONE flat velocity vector.

    ``velocity := momentum * velocity - learning_rate * g``;
    ``param := param + velocity``

    Parameters
    ----------
    loss_or_grads, params, learning_rate, grad_transform
        As for :func:`sgd`.
    momentum : float or symbolic scalar, optional
        How much of the previous velocity is kept (default 0.9).

    Returns
    -------
    OrderedDict
    """
    g, layout = _average(loss_or_grads, params, grad_transform)
    velocity = layout.zeros("velocity")
    velocity_t = momentum * velocity - learning_rate * g
    updates = layout.moved(velocity_t)
    updates[velocity] = _as_type_of(velocity, velocity_t)
    return updates


def apply_nesterov_momentum(updates: Any, params: Iterable[Any] | None = None,
                            momentum: Any = 0.9) -> OrderedDict[Any, Any]:
    """Add Nesterov momentum to existing updates.

    ``velocity := momentum * velocity + updates[param] - param``;
    ``param := param + momentum * velocity + updates[param] - param``

    Parameters
    ----------
    updates : OrderedDict
        Parameter updates.
    params : iterable of shared variables, optional
        Default every key of ``updates``.
    momentum : float or symbolic scalar, optional
        Default 0.9.

    Returns
    -------
    OrderedDict
        A copy of ``updates`` with a velocity per parameter.

    Notes
    -----
    The formulation of pylearn2 (Lasagne's): the gradient is evaluated at the current
    parameters, not at the look-ahead point.
    """
    new = OrderedDict(updates)
    for param in list(new.keys()) if params is None else list(params):
        velocity = _zeros_like(param, "velocity")
        x = momentum * velocity + new[param] - param
        new[velocity] = _as_type_of(velocity, x)
        new[param] = _as_type_of(param, momentum * x + new[param])
    return new


@_lasagne_rule
def nesterov_momentum(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any, momentum: Any = 0.9, *,
                      grad_transform: GradTransform | None = None) -> OrderedDict[Any, Any]:
    """SGD with Nesterov momentum, ONE flat velocity vector.

    ``velocity := momentum * velocity - learning_rate * g``;
    ``param := param + momentum * velocity - learning_rate * g``

    Parameters
    ----------
    loss_or_grads, params, learning_rate, grad_transform
        As for :func:`sgd`.
    momentum : float or symbolic scalar, optional
        Default 0.9.

    Returns
    -------
    OrderedDict
    """
    g, layout = _average(loss_or_grads, params, grad_transform)
    velocity = layout.zeros("velocity")
    velocity_t = momentum * velocity - learning_rate * g
    updates = layout.moved(momentum * velocity_t - learning_rate * g)
    updates[velocity] = _as_type_of(velocity, velocity_t)
    return updates


@_lasagne_rule
def adagrad(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 1.0, epsilon: Any = 1e-6, *,
            grad_transform: GradTransform | None = None) -> OrderedDict[Any, Any]:
    """Adagrad (Duchi, Hazan & Singer, 2011): steps shrink with the accumulated squared gradient.

    ``accu := accu + g**2``;
    ``param := param - learning_rate * g / sqrt(accu + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 1.0.
    epsilon : float or symbolic scalar, optional
        Added for numerical stability (default 1e-6).

    Returns
    -------
    OrderedDict
    """
    import pytensor.tensor as pt

    g, layout = _average(loss_or_grads, params, grad_transform)
    accu = layout.zeros("accu")
    accu_t = accu + g ** 2
    updates = layout.moved(-(learning_rate * g / pt.sqrt(accu_t + epsilon)))
    updates[accu] = _as_type_of(accu, accu_t)
    return updates


@_lasagne_rule
def rmsprop(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 1.0, rho: Any = 0.9,
            epsilon: Any = 1e-6, *, grad_transform: GradTransform | None = None) -> OrderedDict[Any, Any]:
    """RMSProp (Tieleman & Hinton, 2012): steps scaled by a moving RMS of the gradient.

    ``accu := rho * accu + (1 - rho) * g**2``;
    ``param := param - learning_rate * g / sqrt(accu + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 1.0.
    rho : float or symbolic scalar, optional
        Decay of the moving average, in [0, 1) (default 0.9).
    epsilon : float or symbolic scalar, optional
        Default 1e-6.

    Returns
    -------
    OrderedDict
    """
    import pytensor.tensor as pt

    g, layout = _average(loss_or_grads, params, grad_transform)
    accu = layout.zeros("accu")
    accu_t = rho * accu + (1 - rho) * g ** 2
    updates = layout.moved(-(learning_rate * g / pt.sqrt(accu_t + epsilon)))
    updates[accu] = _as_type_of(accu, accu_t)
    return updates


@_lasagne_rule
def adadelta(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 1.0, rho: Any = 0.95,
             epsilon: Any = 1e-6, *, grad_transform: GradTransform | None = None) -> OrderedDict[Any, Any]:
    """Adadelta (Zeiler, 2012): steps scaled by the ratio of the RMS of past updates to that of
    the gradients.

    ``accu := rho * accu + (1 - rho) * g**2``;
    ``update = g * sqrt(delta_accu + epsilon) / sqrt(accu + epsilon)``;
    ``param := param - learning_rate * update``;
    ``delta_accu := rho * delta_accu + (1 - rho) * update**2``

    Parameters
    ----------
    loss_or_grads, params, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 1.0.
    rho : float or symbolic scalar, optional
        Default 0.95.
    epsilon : float or symbolic scalar, optional
        Default 1e-6 (it makes the very first step non-zero).

    Returns
    -------
    OrderedDict
    """
    import pytensor.tensor as pt

    g, layout = _average(loss_or_grads, params, grad_transform)
    accu = layout.zeros("accu")
    delta_accu = layout.zeros("delta_accu")
    accu_t = rho * accu + (1 - rho) * g ** 2
    update = g * pt.sqrt(delta_accu + epsilon) / pt.sqrt(accu_t + epsilon)
    updates = layout.moved(-(learning_rate * update))
    updates[accu] = _as_type_of(accu, accu_t)
    updates[delta_accu] = _as_type_of(delta_accu, rho * delta_accu + (1 - rho) * update ** 2)
    return updates


@_lasagne_rule
def adam(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 0.001, beta1: Any = 0.9,
         beta2: Any = 0.999, epsilon: Any = 1e-8, *,
         grad_transform: GradTransform | None = None) -> OrderedDict[Any, Any]:
    """Adam (Kingma & Ba, 2014): bias-corrected moving averages of the gradient and its square.

    ``t := t + 1`` (ONE counter for all parameters);
    ``m := beta1 * m + (1 - beta1) * g``;
    ``v := beta2 * v + (1 - beta2) * g**2``;
    ``param := param - learning_rate * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, grad_transform
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
    OrderedDict
        The parameters, ``m`` and ``v`` (flat vectors, one entry per parameter value) and one
        counter ``t``.
    """
    import pytensor.tensor as pt

    g, layout = _average(loss_or_grads, params, grad_transform)
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
    return updates


@_lasagne_rule
def adamax(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 0.002, beta1: Any = 0.9,
           beta2: Any = 0.999, epsilon: Any = 1e-8, *,
           grad_transform: GradTransform | None = None) -> OrderedDict[Any, Any]:
    """Adamax (Kingma & Ba, 2014): Adam with the infinity norm.

    ``t := t + 1`` (ONE counter);
    ``m := beta1 * m + (1 - beta1) * g``;
    ``u := max(beta2 * u, abs(g))``;
    ``param := param - learning_rate / (1 - beta1**t) * m / (u + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, grad_transform
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
    OrderedDict
    """
    import pytensor.tensor as pt

    g, layout = _average(loss_or_grads, params, grad_transform)
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
    return updates


@_lasagne_rule
def amsgrad(loss_or_grads: Any, params: Sequence[Any], learning_rate: Any = 0.001, beta1: Any = 0.9,
            beta2: Any = 0.999, epsilon: Any = 1e-8, *,
            grad_transform: GradTransform | None = None) -> OrderedDict[Any, Any]:
    """AMSGrad (Reddi, Kale & Kumar, 2018): Adam with the running maximum of the second moment.

    ``t := t + 1`` (ONE counter);
    ``m := beta1 * m + (1 - beta1) * g``;
    ``v := beta2 * v + (1 - beta2) * g**2``;
    ``v_hat := max(v_hat, v)``;
    ``param := param - learning_rate * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v_hat) + epsilon)``

    Parameters
    ----------
    loss_or_grads, params, grad_transform
        As for :func:`sgd`.
    learning_rate : float or symbolic scalar, optional
        Default 0.001.
    beta1, beta2 : float or symbolic scalar, optional
        Defaults 0.9 and 0.999.
    epsilon : float or symbolic scalar, optional
        Default 1e-8.

    Returns
    -------
    OrderedDict
    """
    import pytensor.tensor as pt

    g, layout = _average(loss_or_grads, params, grad_transform)
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
    return updates


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
        raise ValueError(f"Unsupported tensor dimensionality {ndim}: norm_constraint has no default norm axes "
                         "for it, give norm_axes")
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
