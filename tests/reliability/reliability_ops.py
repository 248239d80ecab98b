"""Fault injection in synkhronos workers, and two small PyTensor Ops that carry it there.

Workers import this module when a graph that holds :class:`Probe` or :class:`SlowSum` is
distributed to them (they inherit the master's ``sys.path``, on which the suite's conftest puts
this directory).

Fault injection
    The master sets ``SYNK_REL_FAULT_FILE`` (a path) in its environment before it forks; workers
    inherit it.  Imported in a worker, this module wraps the worker side of every synkhronos
    collective; :class:`Probe` checks the file when it is unpickled (distribution) and when it runs
    (calls).  At each point the worker reads the fault file, if there is one: a JSON
    ``{"where": ..., "rank": r, "action": "raise" | "kill"}``.  Rank ``r`` removes the file (a
    fault fires once) and raises :class:`InjectedFault`, or SIGKILLs itself.  ``where`` is a
    collective's name (``"all_reduce"``, ``"broadcast"``...), ``"all_reduce/1"`` (between the first
    and the second variable of an all_reduce of several), ``"distribute"``, ``"compile"`` (a
    worker compiling a graph that holds a :class:`Probe`) or ``"call"``; on the engine, a
    collective program's kind (see below).
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from typing import Any

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.tensor.type import TensorType
from reliability_lib import FAULT_ENV, ON_ENGINE, USE_GPU, InjectedFault

import synk_comm

# The Ops below have no Numba implementation: PyTensor's default CPU mode runs them in object mode.
warnings.filterwarnings("ignore", message="Numba will use object mode")

__all__ = ["ForkInWorker", "InjectedFault", "Probe", "SlowSum", "set_fault"]


def set_fault(path: str, where: str, rank: int, action: str) -> None:
    """Arm one fault (see the module docstring); written atomically."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"where": where, "rank": rank, "action": action}, f)
    os.replace(tmp, path)


def fire(where: str) -> None:
    """Raise or die here if the armed fault names this point and this rank."""
    path = os.environ.get(FAULT_ENV)
    if not path:
        return
    try:
        with open(path) as f:
            fault = json.load(f)
    except (OSError, ValueError):
        return
    rank = int(os.environ.get("SYNK_RANK", "-1"))
    if fault.get("where") != where or fault.get("rank") != rank:
        return
    try:
        os.unlink(path)
    except OSError:
        return
    if fault["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # pragma: no cover - the signal is on its way
    raise InjectedFault(f"injected fault at {where!r} in rank {rank}")


def _install_collective_faults() -> None:
    from synkhronos import collectives

    for name, local in list(collectives._LOCAL.items()):
        if getattr(local, "rel_wrapped", False):
            continue

        def wrapped(rt: Any, variables: list[Any], *args: Any, _name: str = name, _local: Any = local,
                    **kwargs: Any) -> Any:
            fire(_name)
            if _name == "all_reduce" and len(variables) > 1:
                collectives._agree_on_shapes(rt, variables, "all_reduce")  # as the whole-list call does
                _local(rt, variables[:1], *args, **kwargs)
                fire("all_reduce/1")
                return _local(rt, variables[1:], *args, **kwargs)
            return _local(rt, variables, *args, **kwargs)

        wrapped.rel_wrapped = True  # type: ignore[attr-defined]
        collectives._LOCAL[name] = wrapped


def _install_engine_collective_faults() -> None:
    """The engine's fault points: every collective program of a worker, named by its kind
    (``"broadcast"``, ``"reduce"`` for reduce and all_reduce, ``"all_gather"``), fired before it runs.
    (The worker's command table is fixed when it starts serving, before this module is imported:
    the program builder is wrapped, not the ``COLLECT`` handler.)"""
    from synkhronos.engine import collectives as engine_collectives

    local = engine_collectives._jitted
    if getattr(local, "rel_wrapped", False):
        return

    def wrapped(rt: Any, key: tuple[Any, ...], *args: Any, **kwargs: Any) -> Any:
        fire(str(key[0]))
        return local(rt, key, *args, **kwargs)

    wrapped.rel_wrapped = True  # type: ignore[attr-defined]
    engine_collectives._jitted = wrapped


if os.environ.get("SYNK_RANK") is not None and os.environ.get(FAULT_ENV):
    _install_collective_faults()
    if ON_ENGINE:
        _install_engine_collective_faults()


class Probe(Op):
    """Identity (a copy); the injection point of ``"call"``, ``"compile"`` and ``"distribute"``
    faults."""

    __props__ = ("label",)

    def __init__(self, label: str = "probe") -> None:
        self.label = label  # some state, so that unpickling calls __setstate__

    def make_node(self, x: Any) -> Apply:
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        output_storage[0][0] = self.compute(inputs[0])

    def make_thunk(self, *args: Any, **kwargs: Any) -> Any:
        fire("compile")  # PyTensor's own linkers make each node's thunk as they compile
        return super().make_thunk(*args, **kwargs)

    def compute(self, x: np.ndarray) -> np.ndarray:
        fire("call")
        return np.array(x, copy=True)

    def __setstate__(self, state: dict[str, Any]) -> None:
        fire("distribute")  # unpickled in the workers only: while the graph is distributed
        self.__dict__.update(state)


class SlowSum(Op):
    """``sum(x)`` after ``seconds`` of CPU work (short numpy steps, so that a signal is handled
    within milliseconds): a stand-in for a call that computes for a while.  A rank with no rows
    does no work."""

    __props__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def make_node(self, x: Any) -> Apply:
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [TensorType(x.type.dtype, shape=())()])

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        output_storage[0][0] = self.compute(inputs[0])

    def compute(self, x: np.ndarray) -> np.ndarray:
        if len(x):
            a = np.full((64, 64), 0.01)
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                a = np.tanh(a @ a)
        return np.asarray(x.sum(), dtype=x.dtype)


class ForkInWorker(Op):
    """Identity that calls ``synk.fork()`` when it runs in a worker: a misuse that must raise clearly."""

    __props__ = ("label",)

    def __init__(self, label: str = "fork") -> None:
        self.label = label

    def make_node(self, x: Any) -> Apply:
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        output_storage[0][0] = self.compute(inputs[0])

    def compute(self, x: np.ndarray) -> np.ndarray:
        group = synk_comm.current_group()
        if group is not None and not group.is_master:
            import synkhronos

            synkhronos.fork(2, use_gpu=USE_GPU)
        return np.array(x, copy=True)


def _register_jax() -> None:
    """The JAX form of each Op here: a host callback that runs its ``compute`` (the engine runs a
    call as one JAX program, in which ``perform`` never runs)."""
    try:
        import jax
        from pytensor.link.jax.dispatch import jax_funcify
    except ImportError:  # no JAX: CPU mode's per-rank engine needs none
        return

    def funcify(op: Any, node: Any, **kwargs: Any) -> Any:
        if isinstance(op, Probe):
            fire("compile")  # the JAX linker translates each node as it compiles
        out = node.outputs[0].type

        def fn(x: Any) -> Any:
            shape = x.shape if out.ndim else ()
            return jax.pure_callback(op.compute, jax.ShapeDtypeStruct(shape, out.dtype), x)

        return fn

    for cls in (Probe, SlowSum, ForkInWorker):
        jax_funcify.register(cls)(funcify)


_register_jax()
