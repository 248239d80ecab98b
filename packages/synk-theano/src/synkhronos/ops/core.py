"""The ops :class:`AllReduce`, :class:`AllGather` and :class:`Broadcast`: their checks, host forms
(the group's shared-memory collectives), gradients and JAX forms over a mesh axis, and the rule for
replicated variables (:class:`Pvary`, :func:`same_on_every_rank`, :func:`divergent_gradients`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

from synkhronos.call_context import CallContext
from synkhronos.ops.base import (
    REDUCE_OPS,
    WIRE_DTYPES,
    Collective,
    _check_root,
    _contiguous,
    _empty_along,
    _rows,
    round_bfloat16,
)
from synkhronos.ops.gradients import AllGatherGrad, BroadcastGrad, WeightShare
from synkhronos.reduce_ops import check_op, contribution
from synkhronos.reduce_ops import identity as identity_of


def _vary_replicated(x: Any) -> Any:
    """A 0-d floating ``x`` (a loss) that reads shared variables and rows: ``x`` with each floating
    shared variable ``w`` seen through :class:`Pvary` (so that ``pytensor.grad`` through the
    all-reduce gives ``w`` the sum of every rank's part); else ``x``."""
    import pytensor.tensor as pt
    from pytensor.graph.basic import Constant
    from pytensor.graph.replace import clone_replace

    x = pt.as_tensor_variable(x)
    if x.type.ndim != 0 or np.dtype(x.type.dtype).kind != "f":
        return x
    roots = _graph_inputs(x)
    shared = [v for v in roots if _is_shared(v) and np.dtype(getattr(v.type, "dtype", "O")).kind in "fc"
              and getattr(v.type, "ndim", None) is not None]
    varying = [v for v in roots if not _is_shared(v) and not isinstance(v, Constant)]
    if not shared or not varying:
        return x
    return clone_replace(x, {w: Pvary()(w) for w in shared})


class Pvary(Op):
    """A replicated value (a shared variable) entering a rank's own computation, as JAX's ``pvary``:
    the identity, whose gradient is the all-reduce (sum) of the ranks' gradients.  :func:`all_reduce`
    of a loss puts it in; it leaves the graph when a function compiles (``pytensor.grad`` has seen it
    then), so the loss and its all-reduced form share one computation."""

    __props__ = ()
    view_map = {0: [0]}

    def make_node(self, x: Any) -> Apply:  # type: ignore[override]
        import pytensor.tensor as pt

        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node: Apply, inputs: Sequence[Any], output_storage: list[list[Any]]) -> None:
        output_storage[0][0] = inputs[0]

    def infer_shape(self, *args: Any) -> list[Any]:
        return [args[-1][0]]

    def pullback(self, inputs: Sequence[Any], outputs: Sequence[Any], output_grads: Sequence[Any]) -> list[Any]:
        return [AllReduce("sum")(output_grads[0])]


def _has_pvary(x: Any) -> bool:
    try:
        from pytensor.graph.traversal import applys_between
    except ImportError:  # PyTensor < 3.3
        from pytensor.graph.basic import applys_between  # type: ignore[no-redef]

    return any(isinstance(node.op, Pvary) for node in applys_between(_graph_inputs(x), [x]))


def _graph_inputs(x: Any) -> list[Any]:
    try:
        from pytensor.graph.traversal import graph_inputs
    except ImportError:  # PyTensor < 3.3
        from pytensor.graph.basic import graph_inputs  # type: ignore[no-redef]

    return list(graph_inputs([x]))


def _register_pvary_removal() -> None:
    """:class:`Pvary` is the identity once the gradients are built: every compiled function drops it."""
    from pytensor.graph.rewriting.basic import node_rewriter
    from pytensor.tensor.rewriting.basic import register_canonicalize

    @node_rewriter([Pvary])
    def remove_pvary(fgraph: Any, node: Apply) -> list[Any]:
        return [node.inputs[0]]

    register_canonicalize(remove_pvary, name="synk_remove_pvary")


_register_pvary_removal()


class AllReduce(Collective):
    """``all_reduce(x, op)`` (see :func:`all_reduce`)."""

    __props__ = ("op", "dtype")

    def __init__(self, op: str = "sum", dtype: str | None = None) -> None:
        self.op = check_op(op, "all_reduce", REDUCE_OPS)
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"all_reduce(dtype={dtype!r}): use one of {WIRE_DTYPES}")
        if dtype is not None and self.op not in ("sum", "avg"):
            raise ValueError(f"all_reduce(op={self.op!r}, dtype={dtype!r}): a {dtype} all-reduce sums; use op='sum' "
                             "or 'avg', or leave dtype out")
        self.dtype = dtype

    def make_node(self, x: Any) -> Apply:  # type: ignore[override]
        import pytensor.tensor as pt

        x = pt.as_tensor_variable(x)
        kind = np.dtype(x.type.dtype).kind
        if kind == "b":
            raise TypeError(f"all_reduce of bool {x}: cast it to an integer dtype first")
        if self.op == "avg" and kind not in "fc":
            raise TypeError(f"all_reduce(op='avg') needs a floating or complex dtype, not {x.type.dtype}: use 'sum' "
                            "and divide, or cast to float first")
        if self.op in ("max", "min") and kind == "c":
            raise TypeError(f"all_reduce(op={self.op!r}) of complex {x}: complex numbers have no order")
        if self.dtype is not None and x.type.dtype != "float32":
            raise TypeError(f"all_reduce(dtype={self.dtype!r}) of {x.type.dtype} {x}: it sends float32 values as "
                            f"{self.dtype}; cast x to float32 or leave dtype out")
        return Apply(self, [x], [x.type()])

    def infer_shape(self, *args: Any) -> list[Any]:
        return [args[-1][0]]

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        (x,) = arrays
        total = ctx.total_weight() if self.op == "avg" else 1.0
        if total == 0:  # no rank has rows: a mean over nothing
            return np.full(x.shape, np.nan, dtype=x.dtype)
        part = contribution(self.op, _contiguous(x), ctx.weight, total)
        if self.dtype is not None:  # the values the ranks would exchange, summed in float32 here
            return round_bfloat16(ctx.group.all_reduce(round_bfloat16(part), "sum"))
        return ctx.group.all_reduce(part, "sum" if self.op == "avg" else self.op)

    def pullback(self, inputs: Sequence[Any], outputs: Sequence[Any], output_grads: Sequence[Any]) -> list[Any]:
        from pytensor import config

        (x,), (y,), (g,) = inputs, outputs, output_grads
        if np.dtype(x.type.dtype).kind not in "fc":
            return [x.zeros_like(dtype=config.floatX)]
        if same_on_every_rank(g):
            if _has_pvary(x):  # the gradient of the ranks' one cost: each rank's part; Pvary sums them
                return [self._pullback(x, y, g, g)]
            if _reads_shared(x):
                grad = self._pullback(x, y, g)
                grad.tag.synk_divergent = f"all_reduce(..., {self.op!r})"  # refused by synkhronos.function
                return [grad]
        return [self._pullback(x, y, g)]

    def _pullback(self, x: Any, y: Any, g: Any, summed: Any = None) -> Any:
        import pytensor.tensor as pt

        if summed is None:
            summed = AllReduce("sum")(g)
        share: Any = WeightShare(g.type.dtype)()
        if self.op == "avg":
            return summed * share
        active = pt.gt(share, 0)
        if self.op == "sum":
            return pt.switch(active, summed, pt.zeros_like(summed))
        if self.op in ("max", "min"):
            return pt.switch(pt.and_(active, pt.eq(x, y)), summed, pt.zeros_like(summed))
        zero = pt.eq(x, 0)  # prod: the product of the others, exact where some values are zero
        nonzero = pt.switch(zero, pt.ones_like(x), x)
        zeros_elsewhere = pt.gt(AllReduce("sum")(pt.cast(zero, "int64")) - pt.cast(zero, "int64"), 0)
        product: Any = AllReduce("prod")(nonzero)
        others = pt.switch(zeros_elsewhere, pt.zeros_like(x), product / nonzero)
        return pt.switch(active, summed * others, pt.zeros_like(summed))

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        lax = jax.lax
        if self.dtype is not None:  # the program's all-reduce in bfloat16, its result back to float32
            exact = AllReduce(self.op).in_program(axis_name, node, counts)
            wire = jnp.dtype(self.dtype)
            return lambda x: exact(x.astype(wire)).astype(x.dtype)
        if counts is not None:
            even = AllReduce("sum" if self.op == "avg" else self.op).in_program(axis_name, node)
            op, total = self.op, float(sum(counts))

            def weighted(x: Any) -> Any:
                rows = _rows(axis_name, counts)
                part = x * (rows / total).astype(x.dtype) if op == "avg" else x
                if 0 in counts:
                    part = jnp.where(rows > 0, part, identity_of(op, x.dtype))
                return even(part)

            return weighted
        if self.op == "sum":
            return lambda x: lax.psum(x, axis_name)
        if self.op == "avg":
            return lambda x: (lax.psum(x, axis_name) / lax.psum(1, axis_name)).astype(x.dtype)
        if self.op == "max":
            return lambda x: lax.pmax(x, axis_name)
        if self.op == "min":
            return lambda x: lax.pmin(x, axis_name)
        # prod: every rank's value, multiplied in rank order (exact, as the host path does)
        return lambda x: jnp.prod(lax.all_gather(x, axis_name), axis=0).astype(x.dtype)


def same_on_every_rank(var: Any) -> bool:
    """Whether ``var`` holds the same value in every rank by construction (JAX's *invariant*
    values): built only from shared variables, constants and the results of :func:`all_reduce`,
    :func:`all_gather` and :func:`broadcast` (a ``fill``/``ones_like``'s value is its fill value).
    The gradient that ``pytensor.grad`` starts from a cost is such a value when the cost is."""
    from pytensor.graph.basic import Constant
    from pytensor.scalar.basic import Second
    from pytensor.tensor.elemwise import Elemwise

    seen: set[int] = set()
    stack = [var]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        node = v.owner
        if node is None:
            if isinstance(v, Constant) or _is_shared(v):
                continue
            return False
        if isinstance(node.op, (AllReduce, AllGather, Broadcast)):
            continue
        if isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, Second):
            stack.append(node.inputs[1])
            continue
        stack.extend(node.inputs)
    return True


def _is_shared(v: Any) -> bool:
    from pytensor.compile.sharedvalue import SharedVariable

    return isinstance(v, SharedVariable)


def _reads_shared(x: Any) -> bool:
    return any(_is_shared(v) for v in _graph_inputs(x))


def divergent_gradients(variables: Iterable[Any]) -> list[str]:
    """The in-graph collectives through which ``pytensor.grad`` went in a form that is not exact
    over several ranks, found among the ancestors of ``variables`` (see "Gradients" above)."""
    try:
        from pytensor.graph.traversal import ancestors
    except ImportError:  # PyTensor < 3.3
        from pytensor.graph.basic import ancestors  # type: ignore[no-redef]

    return sorted({v.tag.synk_divergent for v in ancestors(list(variables))
                   if getattr(v.tag, "synk_divergent", None)})


class AllGather(Collective):
    """``all_gather(x, axis)`` (see :func:`all_gather`)."""

    __props__ = ("axis",)

    def __init__(self, axis: int = 0) -> None:
        if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
            raise TypeError(f"all_gather: axis must be an int, got {axis!r}")
        self.axis = int(axis)

    def make_node(self, x: Any) -> Apply:  # type: ignore[override]
        import pytensor.tensor as pt

        x = pt.as_tensor_variable(x)
        if x.type.ndim == 0:
            raise ValueError(f"all_gather of 0-d {x}: there is no axis to concatenate; gather x[None] to stack "
                             "the ranks' scalars")
        if not -x.type.ndim <= self.axis < x.type.ndim:
            raise ValueError(f"all_gather: axis {self.axis} is out of range for {x} of ndim {x.type.ndim}")
        axis = self.axis % x.type.ndim
        shape = tuple(None if i == axis else s for i, s in enumerate(x.type.shape))
        return Apply(self, [x], [x.type.clone(shape=shape)()])

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        (x,) = arrays
        axis = self.axis % x.ndim
        block = x if ctx.has_rows else _empty_along(x, axis)
        parts = ctx.group.all_gather(_contiguous(block))
        lengths = [p.shape[axis] for p in parts]
        if even and len(set(lengths)) > 1:
            raise ValueError(f"all_gather along axis {axis} under mode='JAX': the ranks hold lengths {lengths}; a "
                             "JAX function's shapes are fixed when it is traced, so every rank must hold the same "
                             "length (or compile with PyTensor's default backend)")
        kept = [p for p in parts if p.shape[axis] > 0] or [block]
        beyond = [p.shape[:axis] + p.shape[axis + 1:] for p in kept]
        if len(set(beyond)) > 1:
            raise ValueError(f"all_gather along axis {axis}: the ranks' blocks have shapes {[p.shape for p in parts]}; "
                             f"they may differ along axis {axis} only")
        return np.concatenate(kept, axis=axis)

    def pullback(self, inputs: Sequence[Any], outputs: Sequence[Any], output_grads: Sequence[Any]) -> list[Any]:
        return [AllGatherGrad(self.axis)(inputs[0], output_grads[0])]

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        axis = self.axis % node.inputs[0].type.ndim
        kept = [r for r, c in enumerate(counts) if c > 0] if counts is not None else []
        if counts is None or len(kept) == len(counts):
            return lambda x: jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)
        # ranks without rows put in an empty block: their blocks are left out (known when traced)
        return lambda x: jnp.concatenate([jax.lax.all_gather(x, axis_name)[r] for r in kept], axis=axis)

    def in_uneven(self, axis_name: str, node: Apply, counts: Sequence[int],
                  shapes: list[list[tuple[int, ...]]]) -> Callable[..., Any] | None:
        """Blocks whose lengths along ``axis`` differ (each rank's rows): every rank's padded block
        gathered, each cut to its rank's shape (known when traced), concatenated in rank order."""
        import jax
        import jax.numpy as jnp

        axis = self.axis % node.inputs[0].type.ndim
        held = [(r, s) for r, (s, c) in enumerate(zip(shapes[0], counts)) if c > 0 and s[axis] > 0]
        if len({s[:axis] + s[axis + 1:] for _, s in held}) > 1:
            return None  # blocks that differ beyond the axis: no concatenation

        def gather(x: Any) -> Any:
            stacked = jax.lax.all_gather(x, axis_name)
            blocks = [stacked[r][tuple(slice(0, n) for n in s)] for r, s in held]
            return jnp.concatenate(blocks, axis=axis) if blocks else x[tuple(slice(0, 0) for _ in x.shape)]

        return gather

    def jax_shape(self, shapes: list[tuple[int, ...]], size: int) -> tuple[int, ...]:
        shape = list(shapes[0])
        shape[self.axis % len(shape)] *= size
        return tuple(shape)


class Broadcast(Collective):
    """``broadcast(x, root)`` (see :func:`broadcast`)."""

    __props__ = ("root",)

    def __init__(self, root: int = 0) -> None:
        if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or root < 0:
            raise ValueError(f"broadcast: root must be a rank (an int >= 0), got {root!r}")
        self.root = int(root)

    def make_node(self, x: Any) -> Apply:  # type: ignore[override]
        import pytensor.tensor as pt

        from synkhronos.runtime import current

        x = pt.as_tensor_variable(x)
        rt = current()
        if rt is not None:
            _check_root(self.root, rt.size)
        return Apply(self, [x], [x.type()])

    def infer_shape(self, *args: Any) -> list[Any]:
        return [args[-1][0]]

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        (x,) = arrays
        _check_root(self.root, ctx.size)
        if ctx.rank == self.root:
            ctx.group.broadcast(_contiguous(x), root=self.root)
            return np.array(x, copy=True)
        value = ctx.group.broadcast(None, root=self.root)
        if value.shape != x.shape:
            raise ValueError(f"broadcast(root={self.root}): rank {ctx.rank} holds shape {x.shape}, the root "
                             f"{value.shape}; every rank must hold the same shape")
        return value

    def pullback(self, inputs: Sequence[Any], outputs: Sequence[Any], output_grads: Sequence[Any]) -> list[Any]:
        return [BroadcastGrad(self.root)(inputs[0], output_grads[0])]

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        lax, root = jax.lax, self.root
        if np.dtype(node.inputs[0].type.dtype).kind == "b":
            return lambda x: lax.all_gather(x, axis_name)[root]
        return lambda x: lax.psum(jnp.where(lax.axis_index(axis_name) == root, x, jnp.zeros_like(x)), axis_name)


