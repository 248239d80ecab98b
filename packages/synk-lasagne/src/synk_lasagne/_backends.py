"""Registration of our Ops with PyTensor's JAX and Numba backends, when those are first imported.

PyTensor's JAX dispatch module decides at its import whether JAX computes in 64 bits
(``jax_enable_x64`` from ``floatX`` at that moment), so importing it early -- when
``synk_lasagne.layers`` is imported, before a script sets ``floatX = "float32"`` -- would make a
float32 program run partly in float64 (and import JAX and Numba into programs that never use
them).  :func:`when_imported` runs a registration once the backend's dispatch module is imported
by PyTensor itself (at the first compilation for that backend), or at once if it already is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["JAX_DISPATCH", "NUMBA_DISPATCH", "register_jax", "register_perform", "when_imported"]

JAX_DISPATCH = "pytensor.link.jax.dispatch"
NUMBA_DISPATCH = "pytensor.link.numba.dispatch"

_pending: dict[str, list[Callable[[Any], None]]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a watched module so that the callbacks waiting
    for it run right after it executes."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_then_register(module: Any) -> None:
            execute(module)
            for callback in _pending.pop(fullname, []):
                callback(module)

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


_finder = _AfterImport()


def when_imported(module_name: str, callback: Callable[[Any], None]) -> None:
    """``callback(module)`` once ``module_name`` is imported (now, if it already is)."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    _pending.setdefault(module_name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def register_jax(op_class: type, funcify: Callable[..., Any]) -> None:
    """``funcify(op, node=..., **kwargs) -> jax function`` as the JAX implementation of ``op_class``."""
    when_imported(JAX_DISPATCH, lambda module: module.jax_funcify.register(op_class)(funcify))


def register_perform(*op_classes: type) -> None:
    """``perform`` (numpy, BLAS) in Numba's object mode as the Numba implementation of
    ``op_classes``: what PyTensor's Numba linker would fall back to, registered to say so once
    here rather than warn at every compilation."""

    def register(module: Any) -> None:
        from pytensor.link.numba.dispatch.basic import generate_fallback_impl

        def funcify(op: Any, node: Any = None, storage_map: Any = None, **kwargs: Any) -> Any:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Numba will use object mode", category=UserWarning)
                return generate_fallback_impl(op, node, storage_map, **kwargs)

        for cls in op_classes:
            module.numba_funcify.register(cls)(funcify)

    when_imported(NUMBA_DISPATCH, register)
