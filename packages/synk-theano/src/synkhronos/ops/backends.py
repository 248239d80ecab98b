"""The ops under PyTensor's backends: JAX (a collective of the engine's program, an all-reduce in a CPU
rank's program, or an ordered host callback) and Numba (``perform`` in object mode), registered when
PyTensor's dispatch modules are first imported."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
from pytensor.graph.basic import Apply

from synkhronos import call_context
from synkhronos.ops.base import Collective
from synkhronos.ops.core import AllReduce, Pvary
from synkhronos.ops.in_program import _IN_PROGRAM, _in_program_all_reduce, _in_program_runtime, runs_in_program


def _jax_function(op: Collective, node: Apply, synk_axis: str | None = None,
                  synk_counts: Sequence[int] | None = None, **kwargs: Any) -> Callable[..., Any]:
    """The op under ``mode="JAX"``: in the program over ``synk_axis`` when the engine translates
    the graph with it (``jax_funcify(..., synk_axis=..., synk_counts=...)``: ``synk_counts`` each
    rank's rows of an uneven call, None when every rank holds the same rows; see
    :meth:`Collective.in_program`), else a host callback that does what ``perform`` does."""
    if synk_axis is not None:
        return without_empty_collective(op.in_program(synk_axis, node, synk_counts))
    rt = _in_program_runtime()
    if rt is not None and _IN_PROGRAM.get() is not None and runs_in_program(node):
        return _in_program_all_reduce(cast(AllReduce, op), rt)
    return _host_callback(op, node)

def without_empty_collective(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, a JAX function holding collectives over a mesh axis (inside ``shard_map``), that
    sends none where its result is empty: zeros of the result's shapes instead (an empty array has
    no values to exchange).  XLA's GPU compiler crashes (SIGSEGV, jax 0.11.2 on H100s) on a
    collective of an empty operand, which JAX's CPU runtime runs.  Shapes are known when tracing,
    so the choice costs nothing at run time."""
    def run(*args: Any) -> Any:
        import jax

        if not any(0 in np.shape(a) for a in args):
            return fn(*args)
        shapes = jax.eval_shape(fn, *args)
        if not all(0 in s.shape for s in jax.tree.leaves(shapes)):
            return fn(*args)  # (an empty operand, a result that is not: the collective runs)
        return jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)

    return run


def _host_callback(op: Collective, node: Apply) -> Callable[..., Any]:
    """The op as an ordered ``io_callback`` to :meth:`Collective.compute` (callbacks run in program
    order, so every rank meets the collectives in the same order).  Where the function can never
    run in a call of several ranks (no fork, or a group of one), the identity, without callback."""
    import jax
    from jax.experimental import io_callback

    from synkhronos.runtime import current

    out_dtype = node.outputs[0].type.dtype

    def run(*args: Any) -> Any:
        args = tuple(jax.numpy.asarray(a) for a in args)  # a static shape may come as a Python int
        ctx = call_context.active()
        rt = current()
        size = ctx.size if ctx is not None else 1
        if size == 1 and (rt is None or rt.size == 1):
            return jax.numpy.asarray(args[-1]) if args else jax.numpy.asarray(1, dtype=out_dtype)
        dtype = args[-1].dtype if args else jax.dtypes.canonicalize_dtype(out_dtype)
        shape = op.jax_shape([tuple(a.shape) for a in args], size)
        result = jax.ShapeDtypeStruct(shape, dtype)

        def on_host(*arrays: Any) -> np.ndarray:
            value = np.asarray(op.compute(*(np.asarray(a) for a in arrays), even=True), dtype=dtype)
            if value.shape != shape:
                raise ValueError(f"{op} returned shape {value.shape} where its JAX function was traced for "
                                 f"{shape}: a function traced outside a call of {size} rank(s) (as_theano) "
                                 "cannot run in one, and the reverse")
            return value

        return io_callback(on_host, result, *args, ordered=True)

    return run


def _register_jax() -> None:
    from pytensor.link.jax.dispatch import jax_funcify

    jax_funcify.register(Collective)(_jax_function)
    jax_funcify.register(Pvary)(lambda op, **kwargs: lambda x: x)


def _register_numba() -> None:
    """Under Numba (PyTensor's default backend) ``perform`` runs in object mode, as for any Op
    without a Numba implementation -- without the warning that says so."""
    from pytensor.link.numba.dispatch import numba_funcify
    from pytensor.link.numba.dispatch.basic import generate_fallback_impl

    @numba_funcify.register(Collective)
    def _numba_function(op: Collective, node: Apply, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Numba will use object mode", category=UserWarning)
            return generate_fallback_impl(op, node, **kwargs)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run ``callback`` right after module ``name`` is first imported.

    PyTensor's JAX dispatch imports JAX (more than a second): registering these ops with it must
    not import it in processes that never compile for JAX (CPU mode's workers)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                callback()

        spec.loader = Loader()
        return spec


def _register_when_imported(name: str, callback: Callable[[], None]) -> None:
    if name in sys.modules:
        callback()
    elif importlib.util.find_spec(name.split(".")[0]) is not None:
        sys.meta_path.insert(0, _AfterImport(name, callback))


_register_when_imported("pytensor.link.jax.dispatch", _register_jax)
_register_when_imported("pytensor.link.numba.dispatch", _register_numba)
