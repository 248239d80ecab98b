"""Lasagne's ``lasagne.utils`` on PyTensor: the small helpers that layers and scripts use.

==================================  ==============================================================
:func:`floatX`                      a numpy array of ``pytensor.config.floatX``
:func:`shared_empty`                a shared variable of ``dim`` dimensions and no values
:func:`as_theano_expression`        a PyTensor expression of a value (name kept from Lasagne)
:func:`collect_shared_vars`         the shared variables an expression depends on
:func:`one_hot`                     one-hot rows of an integer vector
:func:`unique`                      the distinct elements of a list, first occurrence kept
:func:`as_tuple`                    a value or iterable as a tuple of ``N`` elements (type-checked)
:func:`inspect_kwargs`              the names of a callable's arguments that have defaults
:func:`compute_norms`               the norms of incoming weight vectors (numpy or symbolic)
:func:`create_param`                a parameter from a value, an expression or an initialiser
:func:`unroll_scan`                 a loop unrolled in the graph, as ``scan`` computes it
==================================  ==============================================================

>>> import numpy as np
>>> from synk_lasagne import utils
>>> utils.as_tuple(3, 2)
(3, 3)
>>> utils.compute_norms(np.ones((4, 3))).tolist()
[2.0, 2.0, 2.0]
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["ParamShapeError", "ParamTypeError", "as_theano_expression", "as_tuple", "collect_shared_vars",
           "compute_norms", "create_param", "floatX",
           "inspect_kwargs", "int_types", "one_hot", "shared_empty", "unique", "unroll_scan"]

class ParamTypeError(TypeError, RuntimeError):
    """A parameter spec of a type :func:`create_param` cannot use: a ``TypeError`` (Lasagne 0.2's)
    that is also a ``RuntimeError`` (Lasagne 0.1's)."""


class ParamShapeError(ValueError, RuntimeError):
    """A parameter value of the wrong shape: a ``ValueError`` (Lasagne 0.2's) that is also a
    ``RuntimeError`` (Lasagne 0.1's)."""


int_types = (numbers.Integral, np.integer)
"""The types an integer argument may have (Python's and numpy's)."""


def floatX(arr: Any) -> np.ndarray:
    """``arr`` as a numpy array of ``pytensor.config.floatX``.

    Parameters
    ----------
    arr : array_like

    Returns
    -------
    numpy array
    """
    import pytensor

    return np.asarray(arr, dtype=pytensor.config.floatX)


def shared_empty(dim: int = 2, dtype: str | None = None) -> Any:
    """A shared variable of ``dim`` dimensions, each of length 0 (to be set later).

    Parameters
    ----------
    dim : int, optional
        Default 2.
    dtype : str, optional
        Default ``floatX``.

    Returns
    -------
    shared variable
    """
    import pytensor

    dtype = pytensor.config.floatX if dtype is None else dtype
    return pytensor.shared(np.zeros((0,) * dim, dtype=dtype))


def as_theano_expression(input: Any) -> Any:
    """``input`` as a PyTensor expression: a variable as is, anything else as a constant.

    Parameters
    ----------
    input : variable, number or array_like

    Returns
    -------
    PyTensor variable

    Raises
    ------
    TypeError
        If ``input`` cannot become a tensor.
    """
    import pytensor.tensor as pt
    from pytensor.graph.basic import Variable

    if isinstance(input, Variable):
        return input
    try:
        return pt.constant(input)
    except Exception as err:
        raise TypeError(f"Input of type {type(input)} is not a PyTensor expression and cannot be wrapped "
                        f"as a constant ({err}); give a variable, a number or an array") from err


def collect_shared_vars(expressions: Any) -> list[Any]:
    """The shared variables that ``expressions`` depend on, each once, in the order of a
    left-to-right depth-first search.

    Parameters
    ----------
    expressions : variable or list of variables

    Returns
    -------
    list of shared variables
    """
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Variable

    if isinstance(expressions, Variable):
        expressions = [expressions]
    found: list[Any] = []
    seen: set[Any] = set()
    stack = list(reversed(list(expressions)))  # depth first, left to right
    while stack:
        var = stack.pop()
        if var in seen:
            continue
        seen.add(var)
        if var.owner is not None:
            stack.extend(reversed(var.owner.inputs))
        elif isinstance(var, SharedVariable):
            found.append(var)
    return found


def one_hot(x: Any, m: Any = None) -> Any:
    """One-hot rows of an integer vector: ``out[i, x[i]] = 1``.

    Parameters
    ----------
    x : integer vector expression
    m : int or scalar expression, optional
        The number of columns; default ``max(x) + 1``.

    Returns
    -------
    matrix expression of ``floatX``
    """
    import pytensor
    import pytensor.tensor as pt

    x = pt.as_tensor_variable(x)
    if m is None:
        m = pt.cast(pt.max(x) + 1, "int32")
    return pt.eye(m, dtype=pytensor.config.floatX)[pt.cast(x, "int64")]


def unique(items: Iterable[Any]) -> list[Any]:
    """The distinct elements of ``items`` (by identity of hash and equality), in first-seen order."""
    seen: set[Any] = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def as_tuple(x: Any, N: int, t: Any = None) -> tuple[Any, ...]:
    """``x`` as a tuple of ``N`` elements: an iterable as is, anything else repeated.

    Parameters
    ----------
    x : value or iterable
    N : int
        The length.
    t : type or tuple of types, optional
        The type every element must have.

    Returns
    -------
    tuple

    Raises
    ------
    TypeError
        If an element is not of type ``t``.
    ValueError
        If ``x`` is iterable and its length is not ``N``.
    """
    try:
        values = tuple(x)
    except TypeError:
        values = (x,) * N
    if t is not None and not all(isinstance(v, t) for v in values):
        what = "int" if t == int_types else " or ".join(getattr(tt, "__name__", str(tt)) for tt in
                                                       (t if isinstance(t, tuple) else (t,)))
        raise TypeError(f"expected a single value or an iterable of {what}, got {x} instead")
    if len(values) != N:
        raise ValueError(f"expected a single value or an iterable with length {N}, got {x} instead")
    return values


def inspect_kwargs(func: Callable[..., Any]) -> list[str]:
    """The names of ``func``'s arguments that have a default value, in order."""
    return [p.name for p in inspect.signature(func).parameters.values() if p.default is not p.empty]


def compute_norms(array: Any, norm_axes: Sequence[int] | None = None) -> Any:
    """The norms of incoming weight vectors (numpy arrays or PyTensor expressions).

    Parameters
    ----------
    array : numpy array or PyTensor expression
    norm_axes : sequence of int, optional
        The axes of the norm.  Default: none for a vector (the absolute values), ``(0,)`` for a
        matrix, every axis but 0 for 3-, 4- and 5-d arrays.

    Returns
    -------
    numpy array or expression

    Raises
    ------
    RuntimeError
        For another type of ``array``.
    ValueError
        For a 6-d or larger array without ``norm_axes``.
    """
    import pytensor.tensor as pt
    from pytensor.graph.basic import Variable

    if not isinstance(array, (Variable, np.ndarray)):
        raise RuntimeError(f"Unsupported type {type(array)}: compute_norms takes PyTensor variables and numpy arrays")
    ndim = int(getattr(array, "ndim"))  # noqa: B009 (a tensor variable's or an array's)
    if norm_axes is not None:
        sum_over = tuple(norm_axes)
    elif ndim == 1:
        sum_over = ()
    elif ndim == 2:
        sum_over = (0,)
    elif ndim in (3, 4, 5):
        sum_over = tuple(range(1, ndim))
    else:
        raise ValueError(f"Unsupported tensor dimensionality {ndim}: give norm_axes")
    if isinstance(array, Variable):
        var: Any = array
        return abs(var) if not sum_over else pt.sqrt(pt.sum(var ** 2, axis=sum_over))
    return abs(array) if not sum_over else np.sqrt(np.sum(array ** 2, axis=sum_over))


def create_param(spec: Any, shape: Iterable[int], name: str | None = None) -> Any:
    """A layer's parameter from ``spec``: Lasagne's rules.

    Parameters
    ----------
    spec : number, numpy array, PyTensor expression or shared variable, or callable
        A value becomes a new shared variable (its dtype kept; its static shape ``shape``, so that
        the shapes of the layers above are known); an expression or shared variable is returned
        as is (named ``name`` if it has no name); a callable (an initialiser of
        :mod:`synk_lasagne.init`) is called with ``shape`` and its result handled as above.
    shape : iterable of int
    name : str, optional

    Returns
    -------
    shared variable or expression

    Raises
    ------
    ValueError
        For a non-positive length in ``shape``; :class:`ParamShapeError` for a value of another
        shape or dimensionality.
    ParamTypeError
        For any other ``spec``.
    """
    import pytensor
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Variable

    shape = tuple(int(s) for s in shape)
    if any(d <= 0 for d in shape):
        raise ValueError(f"Cannot create param with a non-positive shape dimension. Tried to create param with "
                         f"shape={shape!r}, name={name!r}")
    what = f"cannot initialize parameter {name}: the "
    if callable(spec) and not isinstance(spec, Variable):
        spec = spec(shape)
        what += "{} returned by the provided callable"
    else:
        what += "provided {}"
    if isinstance(spec, numbers.Number) or (isinstance(spec, np.generic) and spec.dtype.kind in "biufc"):
        spec = np.asarray(spec)
    if isinstance(spec, np.ndarray):
        if spec.shape != shape:
            raise ParamShapeError(f"{what.format('numpy array')} has shape {spec.shape}, should be {shape}")
        spec = pytensor.shared(spec, shape=shape)
    if isinstance(spec, Variable):
        ndim = getattr(spec, "ndim", None)
        if ndim != len(shape):
            raise ParamShapeError(f"{what.format('PyTensor variable')} has {ndim} dimensions, should be {len(shape)}")
        if isinstance(spec, SharedVariable) and np.shape(spec.get_value(borrow=True)) != shape:
            value_shape = np.shape(spec.get_value(borrow=True))
            raise ParamShapeError(f"{what.format('shared variable')} has shape {value_shape}, should be {shape}")
        if not spec.name:
            spec.name = name
        return spec
    if "callable" in what:
        raise ParamTypeError(f"{what.format('value')} is not a numpy array or a PyTensor expression")
    raise ParamTypeError(f"{what.format('value')} is not a numpy array, a PyTensor expression, or a callable")


def unroll_scan(fn: Callable[..., Any], sequences: Sequence[Any], outputs_info: Sequence[Any],
                non_sequences: Sequence[Any], n_steps: int, go_backwards: bool = False) -> Any:
    """A loop over the first axis of ``sequences`` unrolled in the graph (``n_steps`` fixed).

    ``fn(*[s[t] for s in sequences], *previous outputs, *non_sequences)`` returns the outputs of
    step ``t`` (one or a list), as for ``pytensor.scan``; ``outputs_info`` holds the initial
    values.

    Parameters
    ----------
    fn : callable
    sequences : list of expressions
    outputs_info : list of expressions
    non_sequences : list of expressions
    n_steps : int
    go_backwards : bool, optional
        Step from the last element to the first (the outputs stay in the steps' order).

    Returns
    -------
    list of expressions
        Each output of every step, stacked along a new first axis, in the order of the steps.
    """
    import pytensor.tensor as pt

    if not isinstance(sequences, (list, tuple)):
        sequences = [sequences]
    counter = range(n_steps)
    if go_backwards:
        counter = counter[::-1]
    previous = list(outputs_info)
    steps: list[list[Any]] = []
    for t in counter:
        out = fn(*[s[t] for s in sequences], *previous, *non_sequences)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        steps.append(out)
        previous = out
    if not steps:
        raise ValueError("unroll_scan needs n_steps >= 1")
    return [pt.stack([step[i] for step in steps]) for i in range(len(steps[0]))]
