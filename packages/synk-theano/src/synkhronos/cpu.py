"""CPU mode's speed: the backend that compiles each rank's functions, the cores of each rank, and
how many ranks a fork starts by default (see ``docs/guides/cpu.rst`` for the measurements).

Backend
    Each rank compiles with PyTensor's JAX mode (XLA's CPU backend) when JAX is installed
    (``pip install "synk-theano[cpu]"``), else with PyTensor's default mode.  A mode the user
    chose wins: ``mode=`` of :func:`synkhronos.function`, ``mode=`` in ``PYTENSOR_FLAGS``, or
    ``pytensor.config.mode`` set before :func:`synkhronos.fork`.  ``SYNK_CPU_BACKEND=jax`` or
    ``=pytensor`` forces the choice.  A function that JAX cannot compile or run (an Op without a
    JAX implementation, a shape JAX cannot trace) falls back to the default mode, with one log
    line (:class:`synkhronos.rank_functions.JaxOrDefault`).
Matrix products
    A rank pinned to one core computes the products of float matrices with numpy's BLAS inside
    its JAX programs (:mod:`synkhronos.blas`; ``SYNK_CPU_BLAS=0`` or ``=1``: in no rank, in every
    rank).
Cores
    With at most as many ranks as cores, every rank runs on its own disjoint set of cores
    (:mod:`synk_comm.cores`); ``SYNK_CPU_PIN=0`` turns it off.  A rank pinned to one core
    computes each JAX call on the thread that makes it (:func:`compute_on_calling_thread`);
    ``SYNK_CPU_ASYNC=1`` keeps JAX's asynchronous dispatch.
Ranks
    :func:`default_ranks`: one rank per core up to 4 cores, else one per 4 cores (at least 4).
    ``fork(n_parallel=...)`` or ``SYNK_CPU_RANKS`` choose otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import numpy as np

__all__ = ["ASYNC_ENV", "BACKEND_ENV", "PIN_ENV", "RANKS_ENV", "choose_backend", "compute_on_calling_thread",
           "default_ranks", "jax_importable", "pinning_enabled", "user_mode"]

log = logging.getLogger("synkhronos")

BACKEND_ENV = "SYNK_CPU_BACKEND"
"""``jax`` or ``pytensor``: forces CPU mode's backend (the master decides at fork; workers read it)."""
PIN_ENV = "SYNK_CPU_PIN"
"""``0``: CPU ranks are not pinned to cores of their own."""
RANKS_ENV = "SYNK_CPU_RANKS"
"""The number of CPU ranks when ``fork`` is not given ``n_parallel``."""
IN_PROGRAM_ENV = "SYNK_CPU_IN_PROGRAM"
"""``0``: in-graph all-reduces of a JAX-backend group do not run inside the ranks' programs (they
make the graph compile in PyTensor's default mode, as without a C++ compiler)."""
SEGMENT_ENV = "SYNK_CPU_SEGMENT"
"""Set by fork for the workers: the name of the group's segment for in-program all-reduces."""
ASYNC_ENV = "SYNK_CPU_ASYNC"
"""``1``: CPU ranks pinned to one core keep JAX's asynchronous dispatch
(see :func:`compute_on_calling_thread`)."""
SKIPPED_ASSERT = "Skipping .*Assert"
"""PyTensor's warning, at every JAX compile of a graph with shape checks, that JAX drops them (the
master checks every call's inputs before the ranks compute): not shown for CPU mode's own choice."""
CORES_PER_RANK = 4
"""Cores per rank of the default rank count on machines of more than 4 cores."""


def jax_importable() -> bool:
    """Whether JAX (and its compiled library) is installed."""
    return importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jaxlib") is not None


def user_mode() -> str | None:
    """The PyTensor mode the user chose (``PYTENSOR_FLAGS`` or ``pytensor.config.mode``), None for
    PyTensor's default."""
    for item in os.environ.get("PYTENSOR_FLAGS", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "mode" and value.strip():
            return value.strip()
    import pytensor

    mode = pytensor.config.mode
    return None if mode == "Mode" else str(mode)


def choose_backend() -> str:
    """CPU mode's backend for this run: ``"jax"`` or ``"pytensor"`` (see the module docstring).

    Raises
    ------
    ValueError
        For a ``SYNK_CPU_BACKEND`` other than ``jax`` or ``pytensor``, or ``jax`` without JAX.
    """
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced == "jax" and not jax_importable():
        raise ValueError(f"{BACKEND_ENV}=jax but JAX is not installed: pip install 'synk-theano[cpu]', "
                         f"or unset {BACKEND_ENV}")
    if forced in ("jax", "pytensor"):
        return forced
    if forced:
        raise ValueError(f"{BACKEND_ENV}={forced!r}: use 'jax' or 'pytensor' (or unset it)")
    if user_mode() is not None:
        return "pytensor"
    return "jax" if jax_importable() else "pytensor"


def default_ranks(n_cores: int) -> int:
    """CPU ranks of a fork without ``n_parallel``: one per core up to 4 cores, else one per
    :data:`CORES_PER_RANK` cores, at least 4 (measured on 2 and 16 cores: docs/guides/cpu.rst).

    ``SYNK_CPU_RANKS`` overrides it.

    Examples
    --------
    >>> [default_ranks(c) for c in (1, 2, 4, 8, 16, 64)]
    [1, 2, 4, 4, 4, 16]
    """
    forced = os.environ.get(RANKS_ENV, "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{RANKS_ENV}={forced!r}: give a number of ranks >= 1 (or unset it)")
        return int(forced)
    if n_cores <= CORES_PER_RANK:
        return max(1, n_cores)
    return max(CORES_PER_RANK, n_cores // CORES_PER_RANK)


def _env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``
    (any case); unset, empty or anything else: ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return default


def pinning_enabled() -> bool:
    """Whether CPU ranks are pinned to cores of their own (``SYNK_CPU_PIN``, default on)."""
    return _env_flag(PIN_ENV, True)


def _jax_started() -> bool:
    """Whether JAX has made its backends (clients) in this process: their settings are fixed."""
    import sys

    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def use_cpu_platform() -> None:
    """Make XLA's CPU backend JAX's default in this process, if JAX has not started yet (the
    workers get ``JAX_PLATFORMS=cpu`` at launch): CPU mode computes on the CPU also on a machine
    with GPUs."""
    if _jax_started():
        return  # JAX already chose its backends in this process: left as they are
    import jax

    jax.config.update("jax_platforms", "cpu")


def compute_on_calling_thread() -> bool:
    """Make JAX compute each call of this process on the thread that makes it
    (``jax_cpu_enable_async_dispatch=False``): what a CPU rank pinned to one core of its own does.

    With JAX's default asynchronous dispatch a call returns at once and XLA computes on a thread
    of its own, while the rank's thread goes on to wait for the other ranks, polling.  On one core
    the two threads take turns: the master, which returns from its dispatch first, finished its
    share of the main job's step about 0.1 ms after the worker, which waited for it at the
    barrier (docs/guides/cpu.rst).  A rank needs every result before it exchanges it, so on one
    core the asynchrony buys nothing.  Ranks of several cores keep it (the benchmark MLP's step
    at 2 ranks of 8 cores was about 3% slower inline).

    Returns whether it applies: not with ``SYNK_CPU_ASYNC=1``, nor where JAX has already made its
    CPU client in this process (its dispatch is fixed then: a master that used JAX before
    :func:`synkhronos.fork` keeps it, and so does the rest of this process after
    :func:`synkhronos.close` where it applied).  It changes when JAX's results are ready, never
    what they are, and it is not a promise that they are ready when a call returns: JAX copies an
    input of more than 100 KB on a thread of its own and may run the program there, after the call
    (:meth:`synkhronos.device.Device.wait`).
    """
    if _env_flag(ASYNC_ENV, False):
        return False
    if _jax_started():
        log.debug("synkhronos: JAX had started in this process: its asynchronous dispatch is kept")
        return False
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


def enable_x64_if_float64() -> None:
    """JAX computes in float64 only when asked: as PyTensor does, ask when floatX is float64 (and
    otherwise do not repeat JAX's note about each 64-bit request computed in 32 bits)."""
    import jax
    import pytensor

    x64 = pytensor.config.floatX == "float64"
    jax.config.update("jax_enable_x64", x64)
    if not x64:
        from synkhronos.quiet import drop_32bit_notes

        drop_32bit_notes()  # int64 indices, float64 casts computed in 32 bits, as documented


def _group_errors() -> tuple[type[BaseException], ...]:
    from synk_comm.errors import GroupAborted, GroupBrokenError, WorkerDiedError, WorkerError

    return (GroupAborted, GroupBrokenError, WorkerDiedError, WorkerError)


_GROUP_ERRORS = _group_errors()


def backport_jax_arange() -> None:
    """PyTensor < 3.3: make JAX mode's ``arange`` take integer literals in the Op's dtype.

    PyTensor types the literals 0 and 1 of ``pt.arange(n)`` as int8, and its JAX implementation
    passes them on as such: ``jnp.arange`` then overflows for ``n > 127`` (PyTensor 3.3 casts
    them to the Op's dtype; this registers that implementation on older versions).  Without it
    the usual ``logp[pt.arange(y.shape[0]), y]`` of a cross-entropy fails in JAX mode.
    """
    import pytensor

    if tuple(int(v) for v in pytensor.__version__.split(".")[:2] if v.isdigit()) >= (3, 3):
        return
    import jax.numpy as jnp
    from pytensor.graph.basic import Constant
    from pytensor.link.jax.dispatch.basic import jax_funcify
    from pytensor.tensor.basic import ARange
    from pytensor.tensor.shape import Shape_i

    @jax_funcify.register(ARange)
    def jax_funcify_ARange(op: Any, node: Any, **kwargs: Any) -> Any:
        constants: list[Any] = []
        for arg in node.inputs:
            if arg.owner is not None and isinstance(arg.owner.op, Shape_i):
                constants.append(None)  # a shape: concrete while JAX traces
            elif isinstance(arg, Constant):
                constants.append(np.asarray(arg.value, op.dtype))
            else:
                raise NotImplementedError("JAX needs the bounds of arange to be constants or shapes")

        def arange(start: Any, stop: Any, step: Any) -> Any:
            bounds = [v if c is None else c for v, c in zip((start, stop, step), constants)]
            return jnp.arange(bounds[0], bounds[1], bounds[2], dtype=op.dtype)

        return arange


def create_all_reduce_segment(backend: str, ranks: int) -> Any:
    """The master's :class:`synk_comm.xla_cpu.Segment` for a group of ``ranks`` on ``backend``:
    where in-graph all-reduces run inside each rank's JAX program (backend ``"jax"``, several ranks,
    ``SYNK_CPU_IN_PROGRAM`` not 0, and the handler built: a C++ compiler; else None, and such
    graphs compile in PyTensor's default mode as before)."""
    if backend != "jax" or ranks < 2 or not _env_flag(IN_PROGRAM_ENV, True):
        return None
    from synk_comm import xla_cpu

    if ranks > xla_cpu.MAX_RANKS or not xla_cpu.available():
        return None
    return xla_cpu.Segment.create(ranks)


def attach_all_reduce_segment(size: int) -> Any:
    """A worker's view of the master's segment (:func:`create_all_reduce_segment`), or None."""
    name = os.environ.get(SEGMENT_ENV)
    if not name:
        return None
    from synk_comm import xla_cpu

    if not xla_cpu.available():  # the master built it: this fails only if the library went away
        raise RuntimeError("synkhronos: the master runs all-reduces inside the JAX programs, but this worker "
                           "cannot load the handler; set SYNK_CPU_IN_PROGRAM=0")
    return xla_cpu.Segment.attach(name, size)
