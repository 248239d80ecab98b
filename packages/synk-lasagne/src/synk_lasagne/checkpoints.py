"""Values in every rank and checkpoints: :func:`set_in_every_rank`, :func:`save_checkpoint`,
:func:`load_checkpoint` (the master writes named variables to an ``.npz`` file; every rank reads them
back by name).  :class:`~synk_lasagne.Trainer` keeps its whole state with them."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["load_checkpoint", "save_checkpoint", "set_in_every_rank"]

log = logging.getLogger("synk_lasagne.trainer")  # the Trainer's logger (its docs name it), for every part of it


# --- values in every rank -------------------------------------------------------------------------

def _forked() -> bool:
    from synkhronos.runtime import current

    rt = current()
    return rt is not None and not rt.group.closed


def _rank_count() -> int:
    from synkhronos.runtime import current

    rt = current()
    return rt.size if rt is not None and not rt.group.closed else 1


def _window_depth() -> int:
    """The group's ``max_in_flight`` (1 when not forked: nothing to overlap)."""
    from synkhronos.runtime import current

    rt = current()
    return rt.window.max_in_flight if rt is not None and not rt.group.closed else 1


def _master_only(what: str) -> None:
    from synkhronos.runtime import current

    rt = current()
    if rt is not None and not rt.is_master:
        raise RuntimeError(f"{what} runs in the master")


def set_in_every_rank(variables: Any, values: Any) -> None:
    """Set shared variables to the same values in EVERY rank (the master's copy included).

    ``var.set_value(value)`` in the master changes the master's copy only; this is the way to
    change a hyperparameter (a learning rate held in a shared variable, a dropout probability...)
    for the whole group: one :func:`synkhronos.broadcast` of the values.  Without a forked group
    it is ``var.set_value``, as it is for a variable that no Synkhronos function uses yet (the
    workers receive it, with its value, with the first function that does).

    Parameters
    ----------
    variables : shared variable or list of them
    values : array-like or list of them
        Cast to each variable's dtype; each must have the variable's shape.

    Raises
    ------
    ValueError
        If a value's shape differs from its variable's.
    """
    _master_only("set_in_every_rank")
    single = not isinstance(variables, (list, tuple))
    variables = [variables] if single else list(variables)
    values = [values] if single else list(values)
    if len(values) != len(variables):
        raise ValueError(f"{len(variables)} variables but {len(values)} values")
    cast = []
    for var, value in zip(variables, values):
        array = np.asarray(value, dtype=var.type.dtype)
        shape = np.shape(var.get_value(borrow=True))
        if array.shape != shape:
            raise ValueError(f"the value for {var.name or var!r} has shape {array.shape}; the variable has {shape}")
        cast.append(array)
    known: list[Any] = []
    if _forked():
        from synkhronos.distribution import ensure_distributed
        from synkhronos.runtime import current

        rt = current()
        assert rt is not None
        ensure_distributed(rt)
        known = [var for var in variables if var in rt.shared_ids]
    for var, array in zip(variables, cast):
        if var not in known:  # in no Synkhronos function yet: the workers get it, with this value, when one is built
            var.set_value(array)
    if known:
        import synkhronos as synk

        synk.broadcast(known, values=[a for var, a in zip(variables, cast) if var in known])


# --- checkpoints ----------------------------------------------------------------------------------

CHECKPOINT_FORMAT = 2
"""Version of the checkpoint files: arrays stored under the variables' names (1: by position)."""


def _names(variables: Sequence[Any], what: str) -> list[str]:
    """The variables' names, refused when one has none or two share one (a checkpoint matches
    values to variables by name)."""
    names = [var.name for var in variables]
    unnamed = [i for i, name in enumerate(names) if not name]
    if unnamed:
        raise ValueError(f"{what}: the variables at positions {unnamed} have no name, and a checkpoint stores "
                         "values by name: name them (pytensor.shared(..., name='W1'), or a layer's name=)")
    seen: dict[str, int] = {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
    twice = sorted(name for name, count in seen.items() if count > 1)
    if twice:
        raise ValueError(f"{what}: the names {twice} are used by more than one variable, so a checkpoint could "
                         "not tell their values apart: give each a name of its own (e.g. name the layers: "
                         "DenseLayer(..., name='hidden1') names its parameters 'hidden1.W', 'hidden1.b')")
    return names


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"checkpoint metadata must be JSON-serialisable, got {type(value).__name__}")


def _write(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """``arrays`` and ``meta`` as an ``.npz`` file, written to a temporary file and renamed."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, __meta__=np.array(json.dumps(dict(meta), default=_jsonable)), **dict(arrays))  # type: ignore[arg-type]
    os.replace(tmp, path)


def _read(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays (by name) and metadata of a checkpoint file (either format)."""
    with np.load(os.fspath(path), allow_pickle=False) as f:
        meta = json.loads(str(f["__meta__"]))
        if meta.get("format", 1) == 1:  # by position: v0, v1... in the order of meta["names"]
            names = meta["names"]
            if len(set(names)) != len(names):
                raise ValueError(f"{os.fspath(path)!r} is a checkpoint of format 1 whose variables share names "
                                 f"({names}): it can only be read by position, np.load(path)['v0']...")
            arrays = {name: f[f"v{i}"] for i, name in enumerate(names)}
        else:
            arrays = {key: f[key] for key in f.files if key != "__meta__"}
    return arrays, meta


def _read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    with np.load(os.fspath(path), allow_pickle=False) as f:
        return dict(json.loads(str(f["__meta__"])))


def _take(arrays: Mapping[str, np.ndarray], keys: Sequence[str], variables: Sequence[Any],
          path: str | os.PathLike[str]) -> list[np.ndarray]:
    """The values of ``keys`` for ``variables``, checked against their shapes and cast."""
    missing = [key for key in keys if key not in arrays]
    if missing:
        raise ValueError(f"the checkpoint {os.fspath(path)!r} has no values for {missing}; it holds "
                         f"{sorted(arrays)}")
    values = []
    for key, var in zip(keys, variables):
        shape = np.shape(var.get_value(borrow=True))
        if arrays[key].shape != shape:
            raise ValueError(f"the checkpoint's {key!r} has shape {arrays[key].shape}; the variable {var.name!r} "
                             f"has shape {shape}")
        values.append(np.asarray(arrays[key], dtype=var.type.dtype))
    return values


def save_checkpoint(path: str | os.PathLike[str], variables: Sequence[Any], **metadata: Any) -> None:
    """Write the values of ``variables`` (the master's, which every rank shares) to ``path``.

    A numpy ``.npz`` file: one array per variable, stored under the variable's name, and
    ``__meta__``, a JSON string with the names, shapes, dtypes and ``metadata``.  Written to a
    temporary file first and renamed, so that a crash never leaves half a checkpoint.  (A
    :class:`Trainer` saves more: :meth:`~synk_lasagne.Trainer.save`.)

    Parameters
    ----------
    path : str or path
        The file (written as given; no suffix is added).
    variables : list of shared variables
        Each with a name of its own (the values are matched to variables by name on loading).
    **metadata
        JSON-serialisable values stored with them.

    Raises
    ------
    ValueError
        If a variable has no name, or two share one.
    """
    _master_only("save_checkpoint")
    variables = list(variables)
    names = _names(variables, "save_checkpoint")
    values = [np.asarray(var.get_value(borrow=False)) for var in variables]
    meta = {"format": CHECKPOINT_FORMAT, "names": names, "shapes": [list(v.shape) for v in values],
            "dtypes": [str(v.dtype) for v in values], **metadata}
    _write(path, dict(zip(names, values)), meta)


def load_checkpoint(path: str | os.PathLike[str], variables: Sequence[Any]) -> dict[str, Any]:
    """Read the values of ``variables``, by name, from a checkpoint of :func:`save_checkpoint`
    into EVERY rank.

    The values go to every rank with one :func:`synkhronos.broadcast` (or into the variables of
    this process when Synkhronos is not forked).  The checkpoint may hold more variables than
    those asked for.

    Parameters
    ----------
    path : str or path
    variables : list of shared variables
        Named as when they were saved (any order).

    Returns
    -------
    dict
        The metadata stored with the values.

    Raises
    ------
    ValueError
        If a variable has no name or shares one, the checkpoint has no value of that name, or a
        value's shape differs from its variable's.
    """
    _master_only("load_checkpoint")
    variables = list(variables)
    names = _names(variables, "load_checkpoint")
    arrays, meta = _read(path)
    if meta.get("kind") == "trainer":
        names = [f"param/{n}" if f"param/{n}" in arrays else f"optimizer/{n}" for n in names]
    set_in_every_rank(variables, _take(arrays, names, variables, path))
    return meta


def _suffixed(path: str | os.PathLike[str], suffix: str) -> str:
    """``run/model.npz`` -> ``run/model.last.npz`` (``suffix`` "last")."""
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.{suffix}{ext or '.npz'}"


