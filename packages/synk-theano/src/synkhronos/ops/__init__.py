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

from typing import Any, cast

from pytensor.graph.basic import Variable

from synkhronos.ops.backends import without_empty_collective
from synkhronos.ops.base import REDUCE_OPS, WIRE_DTYPES, Collective, check_group, collective_nodes, round_bfloat16
from synkhronos.ops.core import AllGather, AllReduce, Broadcast, _vary_replicated
from synkhronos.ops.core import Pvary as Pvary
from synkhronos.ops.core import divergent_gradients as divergent_gradients
from synkhronos.ops.core import same_on_every_rank as same_on_every_rank
from synkhronos.ops.gradients import AllGatherGrad as AllGatherGrad
from synkhronos.ops.gradients import BroadcastGrad as BroadcastGrad
from synkhronos.ops.gradients import WeightShare as WeightShare
from synkhronos.ops.in_program import IN_PROGRAM_DTYPES, all_run_in_program, in_program_collectives, runs_in_program

__all__ = ["IN_PROGRAM_DTYPES", "REDUCE_OPS", "WIRE_DTYPES", "AllGather", "AllReduce", "Broadcast", "Collective",
           "all_gather", "all_reduce", "all_run_in_program", "broadcast", "collective_nodes", "check_group",
           "in_program_collectives", "round_bfloat16", "runs_in_program", "without_empty_collective"]


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
