"""In-graph collectives: combine values over the ranks INSIDE a Synkhronos function's graph.

=====================================  ============================================================
:func:`all_reduce` ``(x, op="sum")``   every rank gets ``op`` over every rank's ``x``
                                       (``"sum"``, ``"avg"`` weighted by rows, ``"max"``,
                                       ``"min"``, ``"prod"``)
:func:`all_gather` ``(x, axis=0)``     every rank gets every rank's ``x`` concatenated along
                                       ``axis`` in rank order (lengths along ``axis`` may differ)
:func:`broadcast` ``(x, root=0)``      every rank gets rank ``root``'s ``x``
=====================================  ============================================================

Synkhronos applies a function's updates locally in each rank, and nothing is communicated
unless the user asks (the rule of Synkhronos 1.0).  Outside a function one asks with the
collectives on shared variables (:func:`synkhronos.all_reduce` ...), each a command of its own;
these ops are how one asks INSIDE a function: in its outputs, in its update expressions, at any
point of the graph.  A data-parallel training step becomes one function -- gradient, all-reduce,
update rule -- and one call::

    grads = pytensor.grad(loss, params)                    # loss: a mean over this rank's rows
    updates = [(p, p - lr * ops.all_reduce(g, "avg")) for p, g in zip(params, grads)]
    step = synk.function([x, y], outputs=loss, updates=updates)

Semantics
---------
* In a call of a Synkhronos function every rank's value combines with the ranks of the call
  (all the run's ranks, always all: a collective that some rank skipped would wait forever, so a
  rank without rows computes too, see below).
* ``"avg"`` is weighted by each rank's rows in the call, the weights of the output reduction
  ``avg`` (:mod:`synkhronos.reduce_ops`): ``sum_r w_r x_r / sum_r w_r``.  The all-reduced
  gradient of a loss that is a mean over rows is therefore exactly the full-batch gradient,
  however unevenly the batch splits.
* A rank with no rows in the call (a batch smaller than the number of ranks, an empty
  ``batch_s``) still runs the function -- on zero rows -- and takes part in every collective: it
  contributes the op's identity (weight 0 for avg, 0 for sum, 1 for prod, the lowest / highest
  value for max / min; selected, so that the NaN of a mean over no rows cannot leak), an empty
  block to ``all_gather``, and receives the result and applies its updates like the others.  Its
  outputs are left out of the call's output reduction.  The same on the JAX engine (GPU mode's),
  with two differences: a graph that cannot run on zero rows there (a ``max`` over the rows,
  which has no identity) fails with an error that says so, and such a rank keeps the shared
  values whose update reads its rows along a path without a collective (a batch norm's running
  statistics, NaN over zero rows), applying the others (an update from an all-reduced gradient).
* In a plain ``pytensor.function``, and in the master outside a call (``as_theano``), there is
  one rank: every op is the identity (``all_reduce(x, op) == x`` for every op, avg included).
* Collectives run in the graph's order, the same in every rank; do not put one in a branch
  (``ifelse``) that some ranks skip.  A call with collectives runs in one slice
  (``num_slices=1``): a collective per slice would not mean what the graph says.

Gradients
---------
``pytensor.grad`` goes through every op (rank ``s`` holds ``x_s``, every rank gets ``y``, and
``g_r`` is the gradient reaching rank ``r``'s ``y``; sums over the ranks with rows):

* ``all_reduce`` sum: ``dL/dx_s = sum_r g_r``, the all-reduce (sum) of the gradient;
* avg: ``y = sum_r w_r x_r / W`` so ``dy/dx_s = w_s / W``: ``dL/dx_s = (w_s / W) sum_r g_r``;
* max / min: ``sum_r g_r`` where ``x_s`` holds the extreme, 0 elsewhere; on a tie EVERY rank
  holding the extreme gets the whole gradient (PyTensor's ``max`` does the same along an axis);
* prod: ``sum_r g_r * prod_{r' != s} x_r'`` (exact where some ``x`` are zero);
* ``all_gather``: rank ``s``'s block of the all-reduce (sum) of the gradient;
* ``broadcast``: the root gets ``sum_r g_r``, the other ranks zero.

A rank without rows gets a zero gradient.  Second derivatives through these ops are not
implemented.

The rule for replicated variables (JAX's ``shard_map`` ``check_vma`` semantics, jax#3970): a
shared variable ``w`` is the same on every rank, so its gradient must be too.

* Exact (the form to use): differentiate each rank's own loss, all-reduce the gradient::

      g = ops.all_reduce(pytensor.grad(loss_local, w), "avg")   # loss_local: a mean over this rank's rows
      # every rank: the full-batch gradient (weighted by rows however unevenly the batch splits)

* Exact too: differentiate the all-reduced loss (a 0-d value that reads shared variables)::

      g = pytensor.grad(ops.all_reduce(loss_local, "avg"), w)
      # every rank: the same full-batch gradient

  :func:`all_reduce` of such a scalar sees each floating shared variable through :class:`Pvary`
  (JAX's ``pvary``: the identity, whose gradient is the all-reduce (sum) of the ranks' parts), and
  from a cost that is the same on every rank (:func:`same_on_every_rank`) the all-reduce passes
  the gradient on without summing it (the transpose of ``psum`` under ``check_vma``): each rank's
  part of ``dL/dw`` is summed once, at ``w``.  ``Pvary`` leaves the graph when a function compiles.

* Refused: the same through ``all_reduce`` of a non-scalar that reads shared variables::

      pytensor.grad(pt.sum(ops.all_reduce(x.T.dot(err), "sum") ** 2), w)
      # per the formulas above each rank would get n times its OWN part: the ranks would diverge

  :func:`synkhronos.function` raises :class:`~synkhronos.DivergentGradientError` for such a graph
  over several ranks (in a plain PyTensor function, one rank, it is the exact gradient).  A cost
  that differs between ranks (a statistic all-reduced inside each rank's loss, as a synchronised
  batch norm does) differentiates through the ops as the formulas say.

Execution
---------
PyTensor's default backends (C, Numba, Python) run each op's ``perform``, which calls the
group's shared-memory collectives (:mod:`synk_comm`) when a call is in progress in the process
(:mod:`synkhronos.call_context`).  Under ``mode="JAX"`` an op becomes a host callback
(``jax.experimental.io_callback``, ordered: correct, with a round trip through host memory), or,
when the function is translated with ``jax_funcify(fgraph, synk_axis=<mesh axis name>)`` (a
program over a mesh of the ranks' devices, ``shard_map``: the JAX engine), a collective of the
program itself: ``jax.lax.psum``, ``pmax``, ``pmin``, ``all_gather(tiled=True)``,
``psum_scatter``; with every rank holding the same rows ``avg`` is ``psum(x) / axis_size``.  On
uneven shares the engine runs the graph cut at its collectives (:mod:`synkhronos.engine.segments`)
and each op between the pieces with ``synk_counts`` (every rank's rows): ``avg`` weighted by rows,
a rank without rows putting in the identity (an empty block to ``all_gather``), as above; the
operand must then have the same shape in every rank (a clear error says so), except for
``all_gather`` and its gradient, whose blocks may differ along ``axis`` (each rank's rows:
:meth:`Collective.in_uneven`).  Under JAX per rank (CPU mode's ``mode="JAX"``, GPU mode's
per-rank engine) a host callback's result shape is fixed when the function is traced, so
``all_gather`` needs the same length along ``axis`` in every rank (a clear error otherwise).
CPU mode over several ranks runs an all-reduce inside the rank's JAX program instead, a custom
call over the group's shared segment (:mod:`synk_comm.xla_cpu`), where every collective of the
graph is an all-reduce of :data:`IN_PROGRAM_DTYPES` (:func:`in_program_collectives`); its other
graphs compile in PyTensor's default mode (the CPU mode guide says why).

Example
-------
>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> from synkhronos import ops
>>> x = pt.vector("x")
>>> f = pytensor.function([x], [ops.all_reduce(x, "avg"), ops.all_gather(x), ops.broadcast(x)])
>>> [v.tolist() for v in f(np.array([1.0, 2.0]))]      # one process: one rank, the identity
[[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np
from pytensor.graph.basic import Apply, Variable
from pytensor.graph.op import Op

from synkhronos import call_context
from synkhronos.call_context import CallContext
from synkhronos.reduce_ops import UPDATE_OPS, check_op, contribution
from synkhronos.reduce_ops import identity as identity_of

__all__ = ["IN_PROGRAM_DTYPES", "REDUCE_OPS", "WIRE_DTYPES", "AllGather", "AllReduce", "Broadcast", "Collective",
           "all_gather", "all_reduce", "all_run_in_program", "broadcast", "collective_nodes", "check_group",
           "in_program_collectives", "round_bfloat16", "runs_in_program", "without_empty_collective"]

REDUCE_OPS = UPDATE_OPS
"""The ops of :func:`all_reduce`: ``"avg"``, ``"sum"``, ``"prod"``, ``"max"``, ``"min"``."""


# --- what users call ------------------------------------------------------------------------------

def all_reduce(x: Any, op: str = "sum", dtype: str | None = None) -> Variable:
    """Every rank gets ``op`` over every rank's ``x``: ``y = x_0 op x_1 op ... op x_{n-1}``.

    Parameters
    ----------
    x : tensor-like
        This rank's value; the same shape and dtype in every rank (not bool).
    op : {"sum", "avg", "max", "min", "prod"}
        ``"avg"`` is ``sum_r w_r x_r / sum_r w_r`` with ``w_r`` rank ``r``'s rows in the call
        (floating or complex ``x`` only): the mean of per-row means, weighted as one process
        would weight them.  ``"max"``/``"min"``: element-wise (not complex).
    dtype : {None, "bfloat16"}, optional
        The values the ranks exchange: ``"bfloat16"`` sends float32 ``x`` (op ``"sum"`` or ``"avg"``)
        as bfloat16 (half the bytes, as PyTorch DDP's ``bf16_compress_hook``): each rank's value is
        rounded to bfloat16, summed, and the sum rounded to bfloat16 again, then returned as float32
        (a relative error up to about 2**-8 per element).  On the JAX engine the program's all-reduce
        runs in bfloat16; CPU ranks (shared memory) round the same way and sum in float32.  None (the
        default): ``x``'s own dtype.

    Returns
    -------
    TensorVariable
        ``x``'s type.  In a plain ``pytensor.function`` (one rank): ``x`` itself, for every op.

    Raises
    ------
    ValueError
        For an unknown ``op`` (when the graph is built).
    TypeError
        For ``avg`` of integers, ``max``/``min`` of complex numbers, or bool ``x``.

    Notes
    -----
    A rank without rows in the call contributes the op's identity (weight 0 for ``avg``, 0, 1,
    the lowest or the highest value).  Gradient: the all-reduce (sum) of the output's gradient,
    times ``w_s / W`` for ``avg`` (``d(sum_r w_r x_r / W)/dx_s = w_s / W``), masked to the ranks
    holding the extreme for ``max``/``min`` (ties: each such rank gets all of it).

    Examples
    --------
    The full-batch gradient from every rank's share, exactly, however the batch splits:

    >>> grads = [ops.all_reduce(g, "avg") for g in pytensor.grad(mean_loss, params)]  # doctest: +SKIP

    Or differentiate the all-reduced loss (a 0-d ``x``): every rank gets the full-batch gradient
    of each shared variable (see "Gradients" in :mod:`synkhronos.ops`):

    >>> grads = pytensor.grad(ops.all_reduce(mean_loss, "avg"), params)            # doctest: +SKIP
    """
    return cast(Variable, AllReduce(op, dtype)(_vary_replicated(x)))


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


def all_gather(x: Any, axis: int = 0) -> Variable:
    """Every rank gets every rank's ``x`` concatenated along ``axis``, in rank order.

    Parameters
    ----------
    x : tensor-like
        This rank's block, at least 1-d; its length along ``axis`` may differ from the other
        ranks' (default backends), its other dimensions may not.
    axis : int
        The axis to concatenate along (negative counts from the end).

    Returns
    -------
    TensorVariable
        ``x``'s dtype and ndim; its length along ``axis`` is the sum of the ranks' lengths.  In a
        plain ``pytensor.function``: ``x`` itself.

    Raises
    ------
    TypeError
        If ``axis`` is not an int.
    ValueError
        For a 0-d ``x`` (stack scalars with ``all_gather(x[None])``) or an axis out of range,
        when the graph is built; in a call, from every rank, if the ranks' blocks differ beyond
        ``axis`` (the group stays usable).

    Notes
    -----
    A rank without rows contributes nothing (an empty block).  Under ``mode="JAX"`` per rank
    (not the JAX engine) every rank must hold the same length along ``axis``.  Gradient: this
    rank's block of the all-reduce (sum) of the output's gradient.
    """
    return cast(Variable, AllGather(axis)(x))


def broadcast(x: Any, root: int = 0) -> Variable:
    """Every rank gets rank ``root``'s ``x``.

    Parameters
    ----------
    x : tensor-like
        This rank's value (only the root's is used); the same shape in every rank.
    root : int
        The rank whose value every rank gets (0 is the master).

    Returns
    -------
    TensorVariable
        ``x``'s type.  In a plain ``pytensor.function``: ``x`` itself.

    Raises
    ------
    ValueError
        For a negative ``root``, or one not below the group's size (when the graph is built, if
        Synkhronos is forked, else when :func:`synkhronos.function` is); in a call, in the
        ranks whose ``x`` has another shape than the root's.

    Notes
    -----
    Gradient: the root gets the sum over the ranks of the output's gradient, the others zero.
    """
    return cast(Variable, Broadcast(root)(x))


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


# --- the ops ----------------------------------------------------------------------------------------

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


# --- what their gradients need ----------------------------------------------------------------------

class WeightShare(Collective):
    """This rank's share of the call's rows, ``w_s / sum_r w_r``, as a scalar of ``dtype`` (1 with
    one rank): the factor of ``all_reduce(x, "avg")``'s gradient."""

    __props__ = ("dtype",)

    def __init__(self, dtype: str) -> None:
        self.dtype = str(dtype)

    def make_node(self) -> Apply:  # type: ignore[override]
        import pytensor.tensor as pt

        return Apply(self, [], [pt.scalar(dtype=self.dtype)])

    def identity(self, *arrays: np.ndarray) -> np.ndarray:
        return np.asarray(1, dtype=self.dtype)

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        return np.asarray(ctx.share(), dtype=self.dtype)

    def infer_shape(self, *args: Any) -> list[Any]:
        return [()]

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        dtype = self.dtype
        if counts is not None:
            total = float(sum(counts))
            return lambda: jnp.asarray(_rows(axis_name, counts) / total, dtype=dtype)
        return lambda: jnp.asarray(1.0 / jax.lax.psum(1, axis_name), dtype=dtype)

    def jax_shape(self, shapes: list[tuple[int, ...]], size: int) -> tuple[int, ...]:
        return ()


class _GradOp(Collective):
    """A gradient's collective ``(x, gy) -> gx``: ``x`` gives the shape only."""

    def make_node(self, x: Any, gy: Any) -> Apply:  # type: ignore[override]
        import pytensor.tensor as pt

        x, gy = pt.as_tensor_variable(x), pt.as_tensor_variable(gy)
        return Apply(self, [x, gy], [x.type.clone(dtype=gy.type.dtype)()])

    def infer_shape(self, *args: Any) -> list[Any]:
        return [args[-1][0]]

    def connection_pattern(self, node: Apply) -> list[list[bool]]:
        return [[False], [True]]

    def pullback(self, inputs: Sequence[Any], outputs: Sequence[Any], output_grads: Sequence[Any]) -> list[Any]:
        from pytensor.gradient import DisconnectedType, grad_not_implemented

        return [DisconnectedType()(), grad_not_implemented(self, 1, inputs[1], "second derivatives through "
                                                           "synkhronos.ops are not implemented")]

    def jax_shape(self, shapes: list[tuple[int, ...]], size: int) -> tuple[int, ...]:
        return shapes[0]


class AllGatherGrad(_GradOp):
    """The gradient of :func:`all_gather`: this rank's block of the all-reduce (sum) of ``gy``."""

    __props__ = ("axis",)

    def __init__(self, axis: int) -> None:
        self.axis = int(axis)

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        x, gy = arrays
        axis = self.axis % x.ndim
        part = gy if ctx.has_rows else np.zeros_like(gy)
        summed = ctx.group.all_reduce(_contiguous(part), "sum")
        length = x.shape[axis] if ctx.has_rows else 0
        lengths = [int(n[0]) for n in ctx.group.all_gather(np.array([length], dtype=np.int64))]
        if not ctx.has_rows:
            return np.zeros(x.shape, dtype=gy.dtype)
        start = sum(lengths[:ctx.rank])
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + length)
        return summed[tuple(index)]

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        lax = jax.lax
        axis = self.axis % node.inputs[0].type.ndim
        if counts is None or 0 not in counts:
            return lambda x, gy: lax.psum_scatter(gy, axis_name, scatter_dimension=axis, tiled=True)
        # the gathered value holds the blocks of the ranks with rows only: this rank's block by its place
        places = np.cumsum([c > 0 for c in counts]) - 1

        def grad(x: Any, gy: Any) -> Any:
            rows = _rows(axis_name, counts)
            summed = lax.psum(jnp.where(rows > 0, gy, jnp.zeros_like(gy)), axis_name)
            length = x.shape[axis]
            place = jnp.asarray(places)[lax.axis_index(axis_name)]
            block = lax.dynamic_slice_in_dim(summed, place * length, length, axis)
            return jnp.where(rows > 0, block, jnp.zeros_like(block))

        return grad

    def in_uneven(self, axis_name: str, node: Apply, counts: Sequence[int],
                  shapes: list[list[tuple[int, ...]]]) -> Callable[..., Any] | None:
        """Blocks whose lengths along ``axis`` differ: this rank's block of the summed gradient
        starts after the earlier ranks' (known when traced), padded to the longest block."""
        import jax
        import jax.numpy as jnp

        lax = jax.lax
        axis = self.axis % node.inputs[0].type.ndim
        lengths = [s[axis] if c > 0 else 0 for s, c in zip(shapes[0], counts)]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        longest = max(lengths)

        def grad(x: Any, gy: Any) -> Any:
            rows = _rows(axis_name, counts)
            summed = lax.psum(jnp.where(rows > 0, gy, jnp.zeros_like(gy)), axis_name)
            widths = [(0, longest if a == axis else 0) for a in range(gy.ndim)]
            start = jnp.asarray(starts)[lax.axis_index(axis_name)]
            block = lax.dynamic_slice_in_dim(jnp.pad(summed, widths), start, longest, axis)
            return jnp.where(rows > 0, block, jnp.zeros_like(block))  # past this rank's length: cut by the reader

        return grad

    def uneven_shape(self, shapes: list[tuple[int, ...]], padded: tuple[int, ...]) -> tuple[int, ...]:
        return shapes[0]


class BroadcastGrad(_GradOp):
    """The gradient of :func:`broadcast`: the root gets the sum of ``gy`` over the ranks, the
    others zero."""

    __props__ = ("root",)

    def __init__(self, root: int) -> None:
        self.root = int(root)

    def host(self, ctx: CallContext, *arrays: np.ndarray, even: bool = False) -> np.ndarray:
        x, gy = arrays
        part = gy if ctx.has_rows else np.zeros_like(gy)
        summed = ctx.group.reduce(_contiguous(part), "sum", root=self.root)
        return summed if ctx.rank == self.root else np.zeros(x.shape, dtype=gy.dtype)

    def in_program(self, axis_name: str, node: Apply, counts: Sequence[int] | None = None) -> Callable[..., Any]:
        import jax
        import jax.numpy as jnp

        lax, root = jax.lax, self.root

        def grad(x: Any, gy: Any) -> Any:
            if counts is not None and 0 in counts:  # a rank without rows puts in nothing
                gy = jnp.where(_rows(axis_name, counts) > 0, gy, jnp.zeros_like(gy))
            return jnp.where(lax.axis_index(axis_name) == root, lax.psum(gy, axis_name), jnp.zeros_like(gy))

        return grad


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


# --- backends: JAX and Numba ----------------------------------------------------------------------

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


WIRE_DTYPES = (None, "bfloat16")
"""The ``dtype`` values of :func:`all_reduce` (None: the operand's own)."""


def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), as float32: numpy has no
    bfloat16 type, so the top 16 bits of each float32 are kept, rounded (infinities and NaNs kept)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), rounded, x).astype(np.float32)


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
