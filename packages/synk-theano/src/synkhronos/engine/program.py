"""A Synkhronos function as one ``jax.jit(shard_map(...))`` program over the mesh of every rank.

Built in each worker from the function's compiled PyTensor graph (``pytensor.function(...,
mode="JAX").maker.fgraph`` of :meth:`Replica.full <synkhronos.replica.Replica.full>`: its inputs
are the call's inputs, then the shared variables; its outputs the function's outputs, then the
updated values) translated by ``jax_funcify(fgraph, synk_axis="ranks", synk_counts=None)``, which
passes ``synk_axis`` on to every Op's translation (in-graph collectives use it as their axis
name; ``synk_counts``, each rank's rows of an uneven call, reaches the collectives of an uneven
program, see :func:`_uneven_body`).  One program per output subset; ``jax.jit`` keeps one executable per input shapes.

Operands, over the 1-D mesh ``"ranks"``:

=======================  ======================================================================
scattered inputs         ``P("ranks")``: a global array whose block ``r`` is rank ``r``'s rows
broadcast inputs         ``P()``: the same value in every rank
shared variables         ``P()``: each rank's own value (updates apply locally, so values may
                         differ between ranks; inside ``shard_map`` a rank reads only its own)
sliceable variables      with a ``batch_s`` window: ``P()``, each rank's whole value, and its
                         first row as a ``P("ranks")`` block; the graph reads the window with
                         :class:`~synkhronos.rows.RowWindow` (``Replica.selected``), one
                         program per row count
=======================  ======================================================================

Uneven shares (ranks with different numbers of rows): one branch per share size, see
:func:`_uneven_body`; a graph with in-graph collectives is cut at them into segments
(:mod:`synkhronos.engine.segments`), each run in its branches, the collectives between them.

Results, all ``P()``: every output reduced over the ranks inside the program (``sum``: ``psum``;
``avg``: ``pmean`` with even shares, a sum weighted by rows with uneven ones; ``max``/``min``:
``pmax``/``pmin``; ``prod`` and ``None`` (gather): an ``all_gather``, then the product or the
concatenation in rank order), and each rank's updated values, whose input buffers are donated.
Only compute rank 0 copies the outputs to the host.  Outputs that XLA cannot reduce as the host
would (an integer ``avg``, which is a float64 mean; a boolean ``max``/``min``) are gathered in the
program and combined by :func:`synkhronos.reduce_ops.combine` in the master.
"""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from synkhronos import precision
from synkhronos.calls import NONE, CallPlan
from synkhronos.engine.outputs import AXIS, _alone, _output_form, _reduce, _shard_map
from synkhronos.engine.outputs import STACKED as STACKED
from synkhronos.engine.phases import PHASES
from synkhronos.engine.segments import Segment, split
from synkhronos.engine.uneven import _uneven_body
from synkhronos.errors import ShapesDiffer
from synkhronos.replica import Replica

if TYPE_CHECKING:
    from synkhronos.engine.device import EngineDevice

__all__ = ["AXIS", "Program", "ShapesDiffer", "fit_reason", "per_rank_reason", "shapes_of", "shares", "window"]

log = logging.getLogger("synkhronos")


def per_rank_reason(rep: Replica, plan: CallPlan) -> str | None:
    """Why a call runs the per-rank programs instead of the one program (None: it may run the
    program; with sliceable shared variables, if their shapes fit too, :func:`fit_reason`).

    The same answer in the master and in every worker: it depends on the function and the plan.
    """
    spec = rep.spec
    if plan.num_slices > 1:
        return "num_slices > 1"
    counts = {int(p1 - p0) for p0, p1 in plan.positions}
    if spec.inputs and len(counts) > 1 and spec.sliceable:
        total = sum(int(p1 - p0) for p0, p1 in plan.positions)
        return f"uneven shares ({total} rows over {len(plan.positions)} ranks) with sliceable shared variables"
    if rep.uses_random_state:
        return "it uses a random generator shared variable"
    if spec.sliceable:
        found = window(plan)
        if found is None:
            return ("its sliceable shared variables are read without a batch_s slice start:stop of explicit, "
                    "non-negative bounds and the same row count in every rank")
        if spec.inputs and counts != {found[1]}:
            return "the batch_s rows differ from the scattered rows"
    return None


def shares(rep: Replica, plan: CallPlan) -> list[int] | None:
    """Each rank's rows of the scattered inputs when they differ between ranks (an uneven call, run
    by the program's branches: see :class:`Program`); None when every rank has the same rows."""
    counts = [int(p1 - p0) for p0, p1 in plan.positions]
    return counts if rep.spec.inputs and len(set(counts)) > 1 else None


def window(plan: CallPlan) -> tuple[list[int], int] | None:
    """Each rank's first row and the common row count of a ``batch_s`` given as slices
    ``start:stop`` (step 1 or none, explicit bounds >= 0, the same count in every rank); else None."""
    if plan.bs_kind != 1 or plan.bs is None:
        return None
    starts, counts = [], set()
    for a, b, c in plan.bs.tolist():
        if a == NONE or b == NONE or c not in (NONE, 1) or a < 0 or b <= a:
            return None
        starts.append(int(a))
        counts.add(int(b - a))
    return (starts, counts.pop()) if len(counts) == 1 else None


def shapes_of(rep: Replica, device: Any) -> np.ndarray:
    """This rank's shapes of the sliceable shared variables, flat (``ndim, *shape`` each), for
    :func:`fit_reason`."""
    flat: list[int] = []
    for var in rep.spec.sliceable:
        shape = tuple(device.raw(var).shape)
        flat += [len(shape), *shape]
    return np.array(flat, dtype=np.int64)


def fit_reason(shapes: list[np.ndarray], plan: CallPlan) -> str | None:
    """Why the sliceable shared variables do not fit one program: every rank's :func:`shapes_of`
    (in rank order) must be the same, and every rank's window within the rows (None: they fit)."""
    if any(not np.array_equal(s, shapes[0]) for s in shapes[1:]):
        return "its sliceable shared variables have different shapes in the ranks"
    found = window(plan)
    assert found is not None
    last = max(found[0]) + found[1]
    i, flat = 0, shapes[0]
    while i < len(flat):
        ndim = int(flat[i])
        if last > int(flat[i + 1]):
            return "a batch_s slice reaches beyond the rows of a sliceable shared variable"
        i += 1 + ndim
    return None


class Program:
    """One function (one output subset) compiled as one program over the ranks.

    Parameters
    ----------
    rep : Replica
        The function in this worker (its JAX-mode PyTensor function is the source).
    subset : tuple of int or None
        The output subset.
    mesh : jax.sharding.Mesh
        The ranks' 1-D mesh (axis :data:`AXIS`).
    count : int
        Rows of the sliceable shared variables' ``batch_s`` window (0: none).
    branches : tuple of int
        An uneven call's distinct row counts, ascending (see :func:`_uneven_body`); () when even.
    counts : tuple of int
        Each rank's rows of an uneven call whose graph holds in-graph collectives (they weigh by
        them: :meth:`synkhronos.ops.Collective.in_program`); () otherwise.
    """

    def __init__(self, rep: Replica, subset: tuple[int, ...] | None, mesh: Any, count: int = 0,
                 branches: tuple[int, ...] = (), counts: tuple[int, ...] = ()) -> None:
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        spec = rep.spec
        self.n_scattered = len(spec.inputs)
        n_explicit = len(spec.all_inputs)
        self.sliceable = list(spec.sliceable) if count else []
        if count:  # the sliceable variables whole, then a start each (RowWindow(count) in the graph)
            fn = rep.selected(subset, count)
            fgraph = fn.maker.fgraph
            n_explicit += 2 * len(self.sliceable)
            self.n_out = len(rep.output_variables(subset))
            self.updated = [var for var, _ in spec.updates]
            self.shared = list(fgraph.inputs[n_explicit:])
            donate = [n_explicit + self.shared.index(v) for v in self.updated if v in self.shared]
        else:  # updates as PyTensor compiles them: extra outputs, mapped to their inputs
            fn = rep.full(subset)
            fgraph = fn.maker.fgraph
            self.shared = list(fgraph.inputs[n_explicit:])
            updates = dict(fgraph.update_mapping)  # output position -> input position
            self.n_out = len(fgraph.outputs) - len(updates)
            donate = [updates[self.n_out + j] for j in range(len(updates))]
            self.updated = [fgraph.inputs[i] for i in donate]
        self.takes_shapes = bool(getattr(fn.maker.linker, "scalar_shape_inputs", ()))
        variables = rep.output_variables(subset)
        self.dtypes = [np.dtype(v.type.dtype) for v in variables]
        self.forms = [_output_form(op, dt) for op, dt in zip(rep.output_ops(subset), self.dtypes)]
        self.update_dtypes = [np.dtype(v.type.dtype) for v in self.updated]
        local = funcify(fgraph)
        n_out, forms, dtypes, update_dtypes = self.n_out, self.forms, self.dtypes, self.update_dtypes
        reduce = _reduce if mesh.devices.size > 1 else _alone
        asarray = jax.numpy.asarray  # an output may be a Python number (a static shape) or another dtype
        first_start = len(spec.all_inputs) + len(self.sliceable)
        starts = range(first_start, first_start + len(self.sliceable))

        def body(*args: Any) -> tuple[Any, ...]:
            args = tuple(a[0] if i in starts else a for i, a in enumerate(args))  # each start: a (1,) block
            outs = local(*args)
            results = [reduce(asarray(o, dtype=dt), form, dt) for o, form, dt in zip(outs[:n_out], forms, dtypes)]
            news = [asarray(u, dtype=dt) for u, dt in zip(outs[n_out:], update_dtypes)]
            return (*results, *news)

        self.branches = branches
        self.shapes_differ: str | None = None
        """What tracing found, where it raised :class:`ShapesDiffer` (the call then runs per rank)."""
        n_in = len(fgraph.inputs)
        if branches:
            stages = split(fgraph, funcify) if rep.has_collectives else [Segment(list(fgraph.inputs),
                                                                                list(fgraph.outputs), local)]
            body = _uneven_body(fgraph, stages, branches, counts, self.n_scattered, donate, forms, dtypes,
                                update_dtypes)
        # Every operand is "replicated" (``P()``): each rank's host arrays (its rows, the broadcast
        # values, its start and branch) and its own shared values.  Inside ``shard_map`` a rank reads
        # its own buffer, so its rows are its block; the jitted call moves host arrays onto the device
        # itself, where ``device_put`` and a global array per operand cost 130-400 us a call on GPUs.
        in_specs = [P()] * n_in
        out_specs = tuple([P()] * (self.n_out + len(self.updated)))
        if branches:  # the rank's branch (an int32 (1,) array); the gathered outputs' lengths
            in_specs.append(P())
            out_specs += (P(),)
        body = precision.apply(body, spec.precision)  # the products under the function's policy
        mapped = _shard_map()(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)
        self.jitted = jax.jit(mapped, donate_argnums=tuple(donate))
        self.replicated = NamedSharding(mesh, P())
        self._last: Any = ()
        # The shared variables' operands of the last call and the local values they stand for: the
        # next call reuses them while every variable still holds that value (no per-variable lookup).
        self._operands: list[Any] = []
        self._values: list[Any] = []
        self._position = {i: self.shared.index(v) for i, v in enumerate(self.updated) if v in self.shared}
        self.reshaped = False
        """Whether the last run's updates gave a shared variable another shape (the master then has the
        ranks compare their sliceable variables' shapes again: :attr:`Orchestrator.quiet_at
        <synkhronos.engine.master.Orchestrator.quiet_at>`)."""

    def __call__(self, device: EngineDevice, scattered: list[np.ndarray], bcast: list[Any],
                 start: int = 0) -> list[Any]:
        """Run this rank's part: ``scattered`` its rows, ``bcast`` the broadcast values, ``start`` its
        first row of the sliceable variables.  Stores the updated values; returns the outputs (global
        arrays, replicated; not waited for), and with :attr:`branches` last the gathered outputs'
        lengths in every rank (see :func:`_uneven_body`)."""
        if self.branches:  # this rank's rows, padded to the largest share (the branch reads its own rows)
            branch = self.branches.index(len(scattered[0]))
            scattered = [_padded(x, self.branches[-1]) for x in scattered]
        args = [*scattered, *(np.asarray(b) for b in bcast)]
        if self.sliceable:
            args += [device.global_value(var, self.replicated) for var in self.sliceable]
            args += [np.array([start], dtype=np.int32)] * len(self.sliceable)
        if PHASES is not None:
            PHASES.mark("put")
        values = [var.container.storage[0] for var in self.shared]
        if len(values) != len(self._values) or any(map(operator.is_not, values, self._values)):
            self._operands = [device.global_value(var, self.replicated) for var in self.shared]
            self._values = [var.container.storage[0] for var in self.shared]
        args += self._operands
        if self.branches:  # the rank's branch index: the program's last operand
            args.append(np.array([branch], dtype=np.int32))
        if PHASES is not None:
            PHASES.mark("operands")
        outs = self.jitted(*args)
        if PHASES is not None:
            PHASES.mark("launch")
        self._last = outs
        n_new = len(self.updated)
        reshaped = False
        for i, (var, new) in enumerate(zip(self.updated, outs[self.n_out:self.n_out + n_new])):
            reshaped = reshaped or new.shape != var.container.storage[0].shape
            local = device.store(var, new)
            j = self._position.get(i)
            if j is not None:
                self._operands[j], self._values[j] = new, local
        self.reshaped = reshaped
        return list(outs[:self.n_out]) + list(outs[self.n_out + n_new:])

    @property
    def last(self) -> Any:
        """What the last run returned (its outputs and updated values; () once waited for or forgotten)."""
        return self._last

    def wait(self) -> None:
        """Until the last run has finished (its outputs and updated values)."""
        import jax

        jax.block_until_ready(self._last)
        self._last = ()

    def forget(self) -> None:
        """The last run has finished (the caller read an output of it): nothing to wait for."""
        self._last = ()

def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` with zero rows appended up to ``rows`` (no copy when it has them already)."""
    if len(x) == rows:
        return x
    out = np.zeros((rows, *x.shape[1:]), dtype=x.dtype)
    out[:len(x)] = x
    return out


def funcify(fgraph: Any) -> Any:
    """A compiled FunctionGraph (or a segment of one, :mod:`synkhronos.engine.segments`) as a JAX
    function that returns a tuple: PyTensor's ``jax_funcify`` with the program's mesh axis
    (``synk_axis``: in-graph collectives become the program's own)."""
    from pytensor.link.jax.dispatch import jax_funcify

    fn = jax_funcify(fgraph, synk_axis=AXIS, synk_counts=None)

    def run(*args: Any) -> tuple[Any, ...]:
        outs = fn(*args)
        return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)

    return run

