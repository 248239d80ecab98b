"""Where a rank keeps shared-variable values and how it compiles: the CPU template.

A :class:`Device` answers the few questions that differ between CPU mode and GPU mode:
how to compile (``mode``), how to read a shared variable's value to host memory, how to set it
from host memory, and how to turn an input array into what the compiled function takes.  CPU
mode keeps values in the variables' own containers (numpy arrays, or JAX arrays on the CPU where
a function compiled in JAX mode updated them) and compiles with the backend that
:mod:`synkhronos.cpu` chose.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pytensor.compile.sharedvalue import SharedVariable

__all__ = ["Device", "CpuDevice"]


class Device:
    """Template; see :class:`CpuDevice`."""

    kind = "abstract"
    use_gpu = False
    xp: Any = np
    """The array module of values computed in this rank (numpy; jax.numpy on GPUs)."""
    computes_in_jax = False
    """Whether compiled functions may return JAX arrays, in JAX's dtypes (GPU mode; CPU mode's JAX
    backend): updates applied by PyTensor are cast back to their variables' declared dtypes."""
    all_reduce_segment: Any = None
    """The group's :class:`synk_comm.xla_cpu.Segment` where in-graph all-reduces run inside the
    rank's JAX program (CPU mode: backend ``"jax"``, several ranks, a C++ compiler; set by fork and
    a worker's first command), else None."""

    def compile_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments for ``pytensor.function`` in this mode."""
        raise NotImplementedError

    def compile(self, build: Callable[..., Any], kwargs: dict[str, Any], name: str | None,
                collectives: bool = False, in_program: bool = False) -> Any:
        """``build(**kwargs)``: the compiled function (``kwargs`` from :meth:`compile_kwargs`);
        ``collectives``: the graph holds in-graph collectives (:mod:`synkhronos.ops`); ``in_program``:
        all of them can run inside a CPU rank's JAX program (:func:`synkhronos.ops.runs_in_program`)."""
        return build(**kwargs)

    def collectives_compile_apart(self, own_mode: bool = False) -> bool:
        """Whether a graph that holds in-graph collectives compiles in another backend than this
        rank's own (CPU mode's JAX backend: see :meth:`CpuDevice.compile`); ``own_mode``: the
        function has a ``mode`` of its own, which is always kept.  The one place that decides
        where in-graph collectives run; :meth:`compile` and :meth:`in_graph_collectives_pay`
        follow it."""
        return False

    def in_graph_collectives_pay(self, own_mode: bool = False) -> bool:
        """Whether a step whose graph holds its collectives (one function) runs as fast as the
        same step with separate collectives (``synk.chain``): not where such a graph compiles
        apart from the rank's fast backend (:meth:`collectives_compile_apart`).  On GPUs under the
        per-rank engine (``engine="ranks"``) both ways move the values through host memory, so the
        one function (one command) pays.  See
        :func:`synk_lasagne.training.in_graph_all_reduce_pays`."""
        if self.use_gpu:
            return True
        return not self.collectives_compile_apart(own_mode)

    def get(self, var: SharedVariable) -> np.ndarray:
        """The variable's value in this rank, as a numpy array (no copy where possible)."""
        raise NotImplementedError

    def set(self, var: SharedVariable, value: Any) -> None:
        """Set the variable's value in this rank from host memory (copies ``value``; GPU mode
        also takes a value already on its GPU)."""
        raise NotImplementedError

    def take(self, var: SharedVariable, rows: Any) -> Any:
        """``value[rows]`` of a sliceable shared variable, as the compiled function's input."""
        raise NotImplementedError

    def length(self, var: SharedVariable) -> int:
        raise NotImplementedError

    def raw(self, var: SharedVariable) -> Any:
        """The value as it is stored in this rank (what the device collectives move)."""
        raise NotImplementedError

    def adopt(self, var: SharedVariable) -> None:
        """Take charge of a shared variable when it is first distributed (GPU: move it there)."""

    def put_update(self, var: SharedVariable, value: Any) -> None:
        """Store a value computed by a compiled function (already in this device's memory)."""
        raise NotImplementedError

    def wait(self, values: Iterable[Any]) -> None:
        """Return when ``values`` (computed by compiled functions) are ready: JAX arrays (any
        ``mode="JAX"`` function) are waited for, numpy ones are ready.

        Even a rank whose JAX computes on its calling thread (:attr:`CpuDevice.inline`) waits:
        JAX copies an input of more than 100 KB on a thread of its own, and a program whose input
        is not yet copied runs when the copy ends, on that thread, after the call has returned
        (about 1 call in 10 of a 160 KB input, jaxlib 0.10).  One batched wait on a train step's
        ~40 ready values costs about 8 us."""
        jax = sys.modules.get("jax")
        if jax is not None:
            jax.block_until_ready(list(values))  # numpy values pass through


class CpuDevice(Device):
    """CPU mode: values in the shared variables' containers, compiled by ``backend``.

    Parameters
    ----------
    backend : str
        ``"jax"``: PyTensor's JAX mode (XLA CPU) for every function without a ``mode`` of its
        own, falling back per function to the default mode where JAX fails
        (:class:`~synkhronos.rank_functions.JaxOrDefault`); ``"pytensor"``: PyTensor's configured mode.
        The master chooses (:func:`synkhronos.cpu.choose_backend`), the workers follow.
    ranks : int
        The group's ranks; 0 where not known (a worker: a group of several).  With one rank the
        in-graph collectives are the identity, which JAX traces away: such graphs compile in JAX too.
    one_core : bool
        Whether this rank runs pinned to one core of its own: with backend ``"jax"`` it then
        computes each call on the calling thread (:func:`~synkhronos.cpu.compute_on_calling_thread`;
        :attr:`inline` says whether that applied).
    """

    kind = "cpu"

    def __init__(self, backend: str = "pytensor", ranks: int = 0, one_core: bool = False) -> None:
        if backend not in ("jax", "pytensor"):
            raise ValueError(f"CPU backend must be 'jax' or 'pytensor', got {backend!r}")
        self.backend = backend
        self.ranks = ranks
        self.computes_in_jax = backend == "jax"
        self.inline = False
        """Whether JAX computes this rank's calls on the calling thread (see ``one_core``)."""
        self.jax_mode: Any = "JAX"
        """The mode of this rank's JAX-compiled functions (:func:`synkhronos.blas.jax_mode`)."""
        if backend == "jax":
            from synkhronos import blas, cpu, quiet

            cpu.use_cpu_platform()
            self.inline = one_core and cpu.compute_on_calling_thread()
            cpu.enable_x64_if_float64()
            cpu.backport_jax_arange()
            quiet.request_canonical_dtypes()  # float32 work asks JAX for no float64
            self.jax_mode = blas.jax_mode(one_core)

    def compile_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return dict(kwargs)

    def compile(self, build: Callable[..., Any], kwargs: dict[str, Any], name: str | None,
                collectives: bool = False, in_program: bool = False) -> Any:
        """JAX mode with a per-function fallback (backend ``"jax"``, no ``mode`` given), else
        ``build(**kwargs)``.

        A graph with in-graph collectives over several ranks (:meth:`collectives_compile_apart`)
        takes PyTensor's default mode: their ``perform`` calls
        the shared-memory collectives directly, where under JAX they would run in host callbacks
        on XLA's threads -- and a rank pinned to one core has one such thread, which a callback
        reading its own arguments can wait on forever (seen: the main job's train step hung after
        about 30 epochs).  Backend ``"jax"``: a function compiled in another mode reads the shared
        values that JAX-mode functions updated as numpy (:class:`~synkhronos.rank_functions.NumpySharedInputs`); a
        JAX-mode function reads large values in place (:class:`~synkhronos.rank_functions.JaxSharedInputs`)."""
        own_mode = kwargs.get("mode") is not None
        if self.backend != "jax":
            return build(**kwargs)
        from synkhronos.rank_functions import JaxOrDefault, for_rank

        if own_mode or (collectives and self.collectives_compile_apart(own_mode, in_program)):
            return for_rank(build(**kwargs))
        in_segment = collectives and in_program and self.all_reduce_segment is not None
        return JaxOrDefault(lambda mode: build(**kwargs) if mode is None else build(**kwargs, mode=mode),
                            name or "(unnamed)", fall_back_on_run=not in_segment, jax_mode=self.jax_mode)

    def in_graph_collectives_pay(self, own_mode: bool = False) -> bool:
        """With in-program all-reduces (:attr:`all_reduce_segment`), a step of one function pays."""
        if self.all_reduce_segment is not None and not own_mode:
            return True
        return super().in_graph_collectives_pay(own_mode)

    def collectives_compile_apart(self, own_mode: bool = False, in_program: bool = False) -> bool:
        """Backend ``"jax"`` over several ranks: PyTensor's default mode, unless the function has a
        mode of its own, or every collective of the graph is an all-reduce that runs inside the
        JAX program (``in_program``, with :attr:`all_reduce_segment` set).  A group of one rank keeps JAX: its
        collectives are the identity, traced away (no host callback; measured on 16 cores: the
        benchmark MLP's step took 412 ms in the default mode against 113 ms for plain PyTensor JAX)."""
        if in_program and self.all_reduce_segment is not None:
            return False
        return self.backend == "jax" and not own_mode and self.ranks != 1

    def adopt(self, var: SharedVariable) -> None:
        """Backend ``"jax"``: the master's ``get_value()`` returns numpy, as in PyTensor's default
        mode, also where a JAX-mode update left a JAX array in the container."""
        if self.backend != "jax" or not hasattr(var.type, "dtype"):
            return

        def get_value(self_: Any, borrow: bool = False, return_internal_type: bool = False) -> Any:
            value = self_.container.storage[0]
            if return_internal_type:
                return value
            return np.asarray(value) if borrow else np.array(value)

        var.get_value = types.MethodType(get_value, var)  # type: ignore[method-assign]

    def get(self, var: SharedVariable) -> np.ndarray:
        return np.asarray(var.container.storage[0])

    def set(self, var: SharedVariable, value: Any) -> None:
        """A copy of ``value`` in aligned memory, which a JAX-mode function reads in place
        (:func:`synkhronos.rank_functions.aligned_copy`)."""
        from synkhronos.rank_functions import aligned_copy

        if not hasattr(var.type, "dtype"):
            var.set_value(value, borrow=True)
            return
        var.set_value(aligned_copy(value, var.type.dtype), borrow=True)

    def take(self, var: SharedVariable, rows: Any) -> Any:
        return var.get_value(borrow=True)[rows]

    def raw(self, var: SharedVariable) -> Any:
        return self.get(var)

    def length(self, var: SharedVariable) -> int:
        return len(var.get_value(borrow=True))

    def put_update(self, var: SharedVariable, value: Any) -> None:
        if not hasattr(var.type, "dtype"):  # a random generator: stored as it is
            var.set_value(value, borrow=True)
            return
        var.set_value(np.asarray(value, dtype=var.type.dtype), borrow=True)
