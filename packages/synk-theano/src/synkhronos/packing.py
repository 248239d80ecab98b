"""Shared variables packed into one vector: the values of the members are views of ONE host buffer.

A function that updates many small shared variables (an update rule over a model's parameters)
returns one array per variable; compiled by XLA each is a kernel and an array of its own, and in
CPU mode they cost more than the arithmetic (the main job's update: 21 outputs, 214 us in the
step, against about 110 us for 4).  :func:`pack` makes one shared vector of the members' values;
a function built with :func:`views` as ``givens`` reads every member as a slice of it, and an
update of the vector writes all of them as one output.

In each rank the members' values stay current, as views of the vector's buffer:

* before a function that reads the vector runs, :func:`sync` makes the buffer its value and
  each member's value a view of the buffer (copying in any member value that was set since, by
  ``set_value``, a collective, or a function that updated the member itself);
* after a function updated the vector, :func:`store` copies the new value into the buffer (JAX
  returns a new array), so every member's view sees it.

Whoever reads a member -- any function, ``get_value``, a collective -- reads it as it is.  CPU
mode only (host buffers); :mod:`synkhronos.replica` calls :func:`sync` and :func:`store`.

Examples
--------
>>> flat = synk.packing.pack(params, name="params")                                # doctest: +SKIP
>>> givens = synk.packing.views(flat)                    # [(param, flat[a:b].reshape(shape)), ...]
>>> step = synk.function([], updates=[(flat, flat - lr * grad_flat)], givens=givens)  # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["is_packed", "members", "pack", "store", "sync", "views"]

TAG = "synk_packed"
"""The vector's ``tag`` attribute: ``[(member, start, shape), ...]`` (travels with the variable)."""

_buffers: weakref.WeakKeyDictionary[Any, tuple[np.ndarray, list[np.ndarray]]] = weakref.WeakKeyDictionary()
"""This rank's buffer of each packed vector, and the members' views of it."""


def pack(variables: Sequence[Any], name: str | None = None) -> Any:
    """A new shared vector holding the values of ``variables``, flattened and concatenated.

    Parameters
    ----------
    variables : list of shared variables
        Tensors of one dtype, each given once.
    name : str, optional
        The vector's name.

    Returns
    -------
    shared variable
        1-d, of the members' dtype; its ``tag.synk_packed`` lists ``(member, start, shape)``.

    Raises
    ------
    ValueError
        For no variables, a variable given twice, or variables of several dtypes.
    TypeError
        For a variable that is not a shared tensor.
    """
    import pytensor
    from pytensor.tensor.sharedvar import TensorSharedVariable

    variables = list(variables)
    if not variables:
        raise ValueError("pack needs at least one shared variable")
    if len(set(variables)) != len(variables):
        raise ValueError("pack: a shared variable is given more than once")
    for var in variables:
        if not isinstance(var, TensorSharedVariable):
            raise TypeError(f"pack takes shared tensors, got {var!r}")
    dtypes = sorted({var.type.dtype for var in variables})
    if len(dtypes) > 1:
        raise ValueError(f"pack: the variables have several dtypes {dtypes}; pack each dtype apart")
    values = [np.asarray(var.get_value(borrow=True)) for var in variables]
    layout, start = [], 0
    for var, value in zip(variables, values):
        layout.append((var, start, tuple(value.shape)))
        start += value.size
    flat = pytensor.shared(np.concatenate([v.ravel() for v in values]).astype(dtypes[0], copy=False), name=name)
    setattr(flat.tag, TAG, layout)
    return flat


def members(flat: Any) -> list[tuple[Any, int, tuple[int, ...]]]:
    """``[(member, start, shape), ...]`` of a packed vector (empty for any other variable)."""
    tag = getattr(flat, "tag", None)
    return list(getattr(tag, TAG, None) or [])


def is_packed(var: Any) -> bool:
    """Whether ``var`` is a vector made by :func:`pack`."""
    return bool(getattr(getattr(var, "tag", None), TAG, None))


def views(flat: Any) -> list[tuple[Any, Any]]:
    """``givens`` that read each member as its slice of ``flat``: ``[(member, expression), ...]``
    (static shapes, so that JAX traces the gradient of each slice)."""
    import pytensor.tensor as pt

    layout = members(flat)
    if not layout:
        raise ValueError(f"{flat!r} is not a packed vector (see synkhronos.packing.pack)")
    size = sum(int(np.prod(shape)) for _, _, shape in layout)
    whole = pt.specify_shape(flat, (size,))
    return [(var, whole[start:start + int(np.prod(shape))].reshape(shape)) for var, start, shape in layout]


def sync(flat: Any) -> None:
    """In this rank, before a function reads ``flat``: its value is its buffer, holding every
    member's current value, and each member's value is its view of the buffer.

    Raises
    ------
    ValueError
        If a member's value no longer has the shape it was packed with.
    """
    layout = members(flat)
    known = _buffers.get(flat)
    if known is None:
        buffer = np.array(flat.container.storage[0], copy=True)
        parts = [buffer[start:start + int(np.prod(shape))].reshape(shape) for _, start, shape in layout]
        _buffers[flat] = known = (buffer, parts)
    buffer, parts = known
    cell = flat.container.storage
    if cell[0] is not buffer:  # set from outside (a collective on the vector itself): its value counts
        np.copyto(buffer, np.asarray(cell[0]).reshape(buffer.shape))
        cell[0] = buffer
    for (var, _, shape), part in zip(layout, parts):
        own = var.container.storage
        if own[0] is part:
            continue
        value = np.asarray(own[0])
        if value.shape != shape:
            raise ValueError(f"{var!r} was packed with shape {shape} but its value now has shape {value.shape}: "
                             "a packed variable keeps its shape")
        np.copyto(part, value, casting="same_kind")
        own[0] = part


def store(flat: Any, value: Any) -> None:
    """In this rank, after a function computed ``flat``'s new ``value``: copied into its buffer,
    which every member views (or stored as it is where :func:`sync` never ran here)."""
    known = _buffers.get(flat)
    if known is None:
        flat.container.storage[0] = value
        return
    buffer = known[0]
    np.copyto(buffer, np.asarray(value).reshape(buffer.shape), casting="same_kind")
    flat.container.storage[0] = buffer
