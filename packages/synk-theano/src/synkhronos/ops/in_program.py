"""CPU mode's all-reduces inside a rank's JAX program: a custom call over the group's shared segment
(:mod:`synk_comm.xla_cpu`), chosen while a graph whose collectives can all run there compiles."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pytensor.graph.basic import Apply

from synkhronos.ops.core import AllReduce

IN_PROGRAM_DTYPES = ("float32", "float64", "int32", "int64")
"""The dtypes of the all-reduces that run inside a CPU rank's JAX program (:mod:`synk_comm.xla_cpu`)."""


def runs_in_program(node: Apply) -> bool:
    """Whether this collective can run inside a CPU rank's JAX program, where the group has a
    segment for it (:attr:`synkhronos.device.CpuDevice.all_reduce_segment`): an all-reduce of one of
    :data:`IN_PROGRAM_DTYPES`."""
    return isinstance(node.op, AllReduce) and node.outputs[0].type.dtype in IN_PROGRAM_DTYPES


def all_run_in_program(nodes: Sequence[Apply]) -> bool:
    """Whether a graph's collectives ``nodes`` are some and all run in program (:func:`runs_in_program`)."""
    return bool(nodes) and all(runs_in_program(n) for n in nodes)


_IN_PROGRAM: contextvars.ContextVar[bool | None] = contextvars.ContextVar("synk_in_program", default=None)


@contextlib.contextmanager
def in_program_collectives(nodes: Sequence[Apply]) -> Iterator[None]:
    """While the graph of ``nodes`` (its collectives) compiles: its all-reduces run inside the JAX
    program where every one of its collectives can (:func:`runs_in_program`; a graph that also
    holds another collective keeps host callbacks for all, in one order).  With several, they are
    declared with side effects (JAX runs them in graph order; each call of the program costs 60-190
    us more): XLA could otherwise merge two whose operands it proves equal in one rank and not in
    another (a rank of one row: its mean is its sum), or order them otherwise there, and the ranks
    would pair the wrong ones.  One all-reduce needs no order."""
    token = _IN_PROGRAM.set(len(nodes) > 1 if all_run_in_program(nodes) else None)
    try:
        yield
    finally:
        _IN_PROGRAM.reset(token)


def _in_program_runtime() -> Any:
    """This rank's runtime where its group has a segment for in-program all-reduces, else None."""
    from synkhronos.runtime import current

    rt = current()
    if rt is None or rt.size == 1 or rt.engine is not None or rt.device.all_reduce_segment is None:
        return None
    return rt


def _in_program_all_reduce(op: AllReduce, rt: Any) -> Callable[..., Any]:
    """The all-reduce as a custom call over the group's segment (:func:`synk_comm.xla_cpu.all_reduce`):
    each rank's weight for the call is in the segment (``calls.compute`` sets it), a rank of weight 0
    contributes the identity, ``avg`` weighs by rows, as :meth:`AllReduce.host` does."""
    import jax.numpy as jnp

    from synk_comm import xla_cpu

    segment, abort, ordered = rt.device.all_reduce_segment, rt.group.abort_address(), bool(_IN_PROGRAM.get())

    def run(x: Any) -> Any:
        x = jnp.asarray(x)
        if op.dtype is None:
            return xla_cpu.all_reduce(x, op.op, segment, rt.rank, rt.size, abort_address=abort, ordered=ordered)
        wire = jnp.dtype(op.dtype)  # rounded as a bfloat16 all-reduce would, summed in float32 (the segment's)
        summed = xla_cpu.all_reduce(x.astype(wire).astype(x.dtype), op.op, segment, rt.rank, rt.size,
                                    abort_address=abort, ordered=ordered)
        return summed.astype(wire).astype(x.dtype)

    return run


