"""What every in-graph collective shares: the :class:`Collective` base class, finding collectives in a
graph (:func:`collective_nodes`, :func:`check_group`), the values ``all_reduce`` accepts, and the
helpers of the ops' host and JAX forms."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from pytensor.graph.basic import Apply, Variable
from pytensor.graph.op import Op

from synkhronos import call_context
from synkhronos.call_context import CallContext
from synkhronos.reduce_ops import UPDATE_OPS

REDUCE_OPS = UPDATE_OPS
"""The ops of :func:`all_reduce`: ``"avg"``, ``"sum"``, ``"prod"``, ``"max"``, ``"min"``."""

WIRE_DTYPES = (None, "bfloat16")
"""The ``dtype`` values of :func:`all_reduce` (None: the operand's own)."""


def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), as float32: numpy has no
    bfloat16 type, so the top 16 bits of each float32 are kept, rounded (infinities and NaNs kept)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), rounded, x).astype(np.float32)


# --- finding them in a graph ----------------------------------------------------------------------

def collective_nodes(variables: Iterable[Any]) -> list[Apply]:
    """The nodes of in-graph collectives (Ops marked ``synk_collective = True``: these ops, or one's
    own) that ``variables`` depend on (an empty list when none)."""
    found, seen = [], set()
    stack = [v for v in variables if isinstance(v, Variable)]
    while stack:
        node = stack.pop().owner
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node.op, "synk_collective", False):
            found.append(node)
        stack.extend(node.inputs)
    return found


def check_group(nodes: Iterable[Apply], size: int) -> None:
    """Refuse a graph that cannot run in a group of ``size`` ranks (a broadcast root >= size).

    Raises
    ------
    ValueError
        Naming the op and the group's size.
    """
    for node in nodes:
        root = getattr(node.op, "root", None)
        if root is not None:
            _check_root(root, size)


def _check_root(root: int, size: int) -> None:
    if root >= size:
        raise ValueError(f"broadcast(root={root}) in a group of {size} ranks: root must be a rank in [0, {size})")


# --- the base class ---------------------------------------------------------------------------------

class Collective(Op):
    """What every in-graph collective shares: identity outside a call, the group's collective in
    one, never constant-folded (its value depends on the other ranks), and its JAX forms.

    Subclasses fill in :meth:`identity`, :meth:`host` (numpy, in a call of several ranks) and
    :meth:`in_program` (JAX, over a mesh axis)."""

    __props__: tuple[str, ...] = ()
    synk_collective = True
    """The marker by which Synkhronos finds in-graph collectives (:func:`collective_nodes`); an Op of
    one's own that communicates over the ranks sets it too."""
    # infer_shape(*args): PyTensor before 3.3 passes (fgraph, node, input_shapes), 3.3 on (node, input_shapes)

    def do_constant_folding(self, fgraph: Any, node: Apply) -> bool:
        """Never: the value depends on the other ranks, even for constant inputs."""
        return False

    def perform(self, node: Apply, inputs: Sequence[Any], output_storage: list[list[Any]]) -> None:
        """PyTensor's default backends: :meth:`compute` on the input arrays."""
        output_storage[0][0] = np.asarray(self.compute(*inputs), dtype=node.outputs[0].type.dtype)

    def compute(self, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        """The op's value in this process: the identity, or the group's collective in a call.
        ``even``: every rank must hold the same shape (the JAX host callback's fixed shapes)."""
        ctx = call_context.active()
        if ctx is None or ctx.size == 1:
            return self.identity(*arrays)
        try:
            return self.host(ctx, *arrays, even=even)
        except Exception as exc:  # raised again as it is by the call path (JAX would wrap it)
            ctx.failure = exc
            raise

    def identity(self, *arrays: np.ndarray) -> np.ndarray:
        """The value with one rank (a new array: an op's output never aliases its input)."""
        return np.array(arrays[-1], copy=True)

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        raise NotImplementedError

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        """The op as a JAX function over the mesh axis ``axis_name`` (inside ``shard_map``).

        ``counts``: each rank's rows in the call, in rank order, where they differ (an uneven call,
        run outside the branches of :func:`synkhronos.engine.program._uneven_body`): ``avg`` is then
        weighted by rows and a rank of 0 rows puts in the op's identity (an empty block for
        ``all_gather``), as in the per-rank engine.  None: every rank holds the same rows."""
        raise NotImplementedError

    def in_uneven(self, axis_name: str, node: Apply, counts: Sequence[int],
                  shapes: list[list[tuple[int, ...]]]) -> Callable[..., Any] | None:
        """The op over operands whose shapes differ between the ranks (rows of an uneven call):
        ``shapes[i][r]`` is input ``i``'s shape in rank ``r``; each operand comes padded with zeros
        to the largest, and the result leaves padded (:meth:`uneven_shape` gives its exact shape).
        None (the default): the op cannot, and the engine says so."""
        return None

    def uneven_shape(self, shapes: list[tuple[int, ...]], padded: tuple[int, ...]) -> tuple[int, ...]:
        """The exact shape of :meth:`in_uneven`'s result in a rank whose inputs have ``shapes``
        (``padded``: the shape it leaves with)."""
        return padded

    def jax_shape(self, shapes: list[tuple[int, ...]], size: int) -> tuple[int, ...]:
        """The output's shape from the inputs' (JAX host callback; ``size`` ranks in the call)."""
        return shapes[-1]


def _rows(axis_name: str, counts: Sequence[int]) -> Any:
    """This rank's rows in the call (a float64 scalar in the program; ``counts`` in rank order)."""
    import jax
    import jax.numpy as jnp

    return jnp.asarray(np.asarray(counts, dtype=np.float64))[jax.lax.axis_index(axis_name)]


def _contiguous(x: np.ndarray) -> np.ndarray:
    """``x`` in C order (a copy only if it is not; 0-d stays 0-d, unlike ``np.ascontiguousarray``)."""
    x = np.asarray(x)
    return x if x.flags.c_contiguous else x.copy(order="C")


def _empty_along(x: np.ndarray, axis: int) -> np.ndarray:
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, 0)
    return x[tuple(index)]

