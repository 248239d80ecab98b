"""A compiled graph cut at its in-graph collectives: the stages of an uneven call's program.

An uneven call (ranks holding different numbers of rows) runs the graph inside ``lax.switch``,
one branch per share size (:func:`synkhronos.engine.program._uneven_body`); ranks take different
branches, so a collective inside a branch would not be the same instruction in every rank.  The
graph is therefore cut at its collectives (Ops marked ``synk_collective = True``,
:mod:`synkhronos.ops`) by *collective depth*: a node's depth is the largest number of collective
nodes on any path from the graph's inputs to it.  :class:`Segment` ``d`` holds the
non-collective nodes of depth ``d``, as one JAX function (PyTensor's ``jax_funcify`` of a
FunctionGraph whose inputs are the values it reads: graph inputs, earlier segments' and
collectives' outputs, each replaced by a fresh variable of its type), and after it the collective
nodes of depth ``d`` (their outputs have depth ``d + 1``), which the program runs outside the
switch, the same instructions in every rank.  A graph without collectives is one segment.

Shape values (``Shape``, ``Shape_i`` and what is computed from them alone, e.g. ``x.shape[0]``)
are not passed from one segment to a later one: the later segment computes them again from their
source.  A value passed between segments crosses ``lax.switch`` as a traced array, and a shape
must stay a concrete number where the graph builds an array of that shape (``Alloc``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.fg import FunctionGraph

__all__ = ["Segment", "from_rows", "is_collective", "split"]


def is_collective(node: Apply) -> bool:
    """Whether ``node`` is an in-graph collective (its Op is marked ``synk_collective = True``)."""
    return bool(getattr(node.op, "synk_collective", False))


@dataclass
class Segment:
    """The nodes of one collective depth, and the collectives that follow them."""

    inputs: list[Variable]
    """The values it reads, in the order :attr:`fn` takes them."""
    outputs: list[Variable]
    """The values it makes that the collectives, later segments or the graph's outputs read."""
    fn: Callable[..., tuple[Any, ...]] | None
    """Its JAX function, ``inputs -> outputs`` (a tuple); None when it has no outputs."""
    collectives: list[Apply] = field(default_factory=list)
    """The collective nodes of this depth, in the graph's order: they run after the segment."""


def from_rows(fgraph: FunctionGraph, inputs: Sequence[Variable]) -> set[Variable]:
    """The variables of ``fgraph`` that depend on ``inputs`` (a rank's rows) along a path that
    passes no collective: what a rank computes from its own rows alone."""
    found = set(inputs)
    for node in fgraph.toposort():
        if not is_collective(node) and any(v in found for v in node.inputs):
            found.update(node.outputs)
    return found


def _is_shape_op(node: Apply) -> bool:
    from pytensor.tensor.shape import Shape, Shape_i

    return isinstance(node.op, (Shape, Shape_i))


def split(fgraph: FunctionGraph, funcify: Callable[[FunctionGraph], Callable[..., tuple[Any, ...]]]) -> list[Segment]:
    """``fgraph`` cut into segments by collective depth (see the module docstring), each made a
    JAX function by ``funcify``; the last one ends with no collectives."""
    nodes = fgraph.toposort()
    level: dict[Variable, int] = {}  # a variable's depth: collectives on the longest path to it
    depth: dict[Apply, int] = {}
    shape: set[Variable] = set()  # shape values: computed again by every segment that reads them
    for node in nodes:
        d = max((level.get(v, 0) for v in node.inputs), default=0)
        depth[node] = d
        collective = is_collective(node)
        for out in node.outputs:
            level[out] = d + 1 if collective else d
        if not collective and (_is_shape_op(node) or (node.inputs and all(
                isinstance(v, Constant) or v in shape for v in node.inputs))):
            shape.update(node.outputs)
    n = max((depth[node] + is_collective(node) for node in nodes), default=0) + 1
    members: list[list[Apply]] = [[] for _ in range(n)]
    for node in nodes:
        if is_collective(node):
            continue
        members[depth[node]].append(node)
    made = {out: depth[node] for node in nodes if not is_collective(node) for out in node.outputs}
    wanted: set[Variable] = set(fgraph.outputs)  # read outside the segment that makes it
    for node in nodes:
        for v in node.inputs:  # a shape value is made again where it is read, except by a collective
            if v in made and (is_collective(node) or (v not in shape and made[v] != depth[node])):
                wanted.add(v)
    segments = []
    for d in range(n):
        inputs = _inputs_of(members[d], made, shape, d)
        outputs = list(dict.fromkeys(out for node in members[d] for out in node.outputs if out in wanted))
        fn = funcify(FunctionGraph(inputs, outputs, clone=True)) if outputs else None
        collectives = [node for node in nodes if is_collective(node) and depth[node] == d]
        segments.append(Segment(inputs, outputs, fn, collectives))
    return segments


def _inputs_of(members: Sequence[Apply], made: dict[Variable, int], shape: set[Variable], d: int) -> list[Variable]:
    """The values that the nodes ``members`` (of depth ``d``) read from outside: a shape value made
    elsewhere is followed back to the values it is computed from (the segment computes it again)."""
    found: dict[Variable, None] = {}
    stack = [v for node in reversed(members) for v in reversed(node.inputs)]
    seen: set[Variable] = set()
    while stack:
        v = stack.pop()
        if v in seen or isinstance(v, Constant):
            continue
        seen.add(v)
        if made.get(v) == d:
            continue
        if v in shape and v.owner is not None and v in made:
            stack.extend(reversed(v.owner.inputs))
        else:
            found[v] = None
    return list(found)
