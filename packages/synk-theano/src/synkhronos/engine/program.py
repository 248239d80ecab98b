"""A Synkhronos function as one ``jax.jit(shard_map(...))`` program over the mesh of every rank.

Built in each worker from the function's compiled PyTensor graph (``pytensor.function(...,
mode="JAX").maker.fgraph`` of :meth:`Replica.full <synkhronos.replica.Replica.full>`: its inputs
are the call's inputs, then the shared variables; its outputs the function's outputs, then the
updated values) translated by ``jax_funcify(fgraph, synk_axis="ranks", synk_weight=None)``, which
passes ``synk_axis`` on to every Op's translation (in-graph collectives use it as their axis
name).  One program per output subset; ``jax.jit`` keeps one executable per input shapes.

Operands, over the 1-D mesh ``"ranks"``:

=======================  ======================================================================
scattered inputs         ``P("ranks")``: a global array whose block ``r`` is rank ``r``'s rows
broadcast inputs         ``P()``: the same value in every rank
shared variables         ``P()``: each rank's own value (updates apply locally, so values may
                         differ between ranks; inside ``shard_map`` a rank reads only its own)
=======================  ======================================================================

Results, all ``P()``: every output reduced over the ranks inside the program (``sum``: ``psum``;
``avg``: ``pmean``, exact because every rank has the same number of rows; ``max``/``min``:
``pmax``/``pmin``; ``prod`` and ``None`` (gather): an ``all_gather``, then the product or the
concatenation in rank order), and each rank's updated values, whose input buffers are donated.
Only compute rank 0 copies the outputs to the host.  Outputs that XLA cannot reduce as the host
would (an integer ``avg``, which is a float64 mean; a boolean ``max``/``min``) are gathered in the
program and combined by :func:`synkhronos.reduce_ops.combine` in the master.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from synkhronos.calls import CallPlan
from synkhronos.replica import Replica

if TYPE_CHECKING:
    from synkhronos.engine.device import EngineDevice

__all__ = ["AXIS", "Program", "per_rank_reason"]

log = logging.getLogger("synkhronos")

AXIS = "ranks"
"""The mesh axis of the ranks: the axis name of every collective inside a program."""

STACKED = "stacked"
"""How an output leaves the program when the master combines it (see the module docstring)."""


def per_rank_reason(rep: Replica, plan: CallPlan) -> str | None:
    """Why a call runs the per-rank programs instead of the one program (None: it runs the program).

    The same answer in the master and in every worker: it depends on the function and the plan.
    """
    spec = rep.spec
    if plan.num_slices > 1:
        return "num_slices > 1"
    if spec.sliceable:
        return "it has sliceable shared variables (batch_s)"
    counts = {int(p1 - p0) for p0, p1 in plan.positions}
    if spec.inputs and len(counts) > 1:
        total = int(plan.positions[-1][1])
        return f"uneven shares ({total} rows over {len(plan.positions)} ranks)"
    if rep.uses_random_state:
        return "it uses a random generator shared variable"
    return None


def _shard_map() -> Any:
    try:
        from jax import shard_map
    except ImportError:  # jax < 0.7
        from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]
    return shard_map


def _output_form(op: str, dtype: np.dtype) -> str:
    """How an output is reduced in the program: its op, or :data:`STACKED`."""
    if op == "avg" and dtype.kind not in "fc":
        return STACKED
    if op in ("max", "min") and dtype.kind == "b":
        return STACKED
    return op


def _reduce(value: Any, form: str, dtype: np.dtype) -> Any:
    """One output of a rank, reduced over the ranks (inside ``shard_map``)."""
    import jax

    lax = jax.lax
    if form == "sum":
        return lax.psum(value, AXIS)
    if form == "avg":
        return lax.pmean(value, AXIS).astype(dtype)
    if form == "max":
        return lax.pmax(value, AXIS)
    if form == "min":
        return lax.pmin(value, AXIS)
    if form == "prod":
        return jax.numpy.prod(lax.all_gather(value, AXIS), axis=0).astype(dtype)
    if form == "gather":
        return lax.all_gather(value, AXIS, tiled=value.ndim > 0)
    return lax.all_gather(value, AXIS)  # STACKED: the master combines the parts


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
    """

    def __init__(self, rep: Replica, subset: tuple[int, ...] | None, mesh: Any) -> None:
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from pytensor.link.jax.dispatch import jax_funcify

        fn = rep.full(subset)
        fgraph = fn.maker.fgraph
        spec = rep.spec
        self.n_scattered = len(spec.inputs)
        n_explicit = len(spec.all_inputs)
        self.shared = list(fgraph.inputs[n_explicit:])
        updates = dict(fgraph.update_mapping)  # output position -> input position
        self.n_out = len(fgraph.outputs) - len(updates)
        update_inputs = [updates[self.n_out + j] for j in range(len(updates))]
        self.updated = [fgraph.inputs[i] for i in update_inputs]
        self.takes_shapes = bool(getattr(fn.maker.linker, "scalar_shape_inputs", ()))
        variables = rep.output_variables(subset)
        self.dtypes = [np.dtype(v.type.dtype) for v in variables]
        self.forms = [_output_form(op, dt) for op, dt in zip(rep.output_ops(subset), self.dtypes)]
        self.update_dtypes = [np.dtype(v.type.dtype) for v in self.updated]
        local = jax_funcify(fgraph, synk_axis=AXIS, synk_weight=None)
        n_out, forms, dtypes, update_dtypes = self.n_out, self.forms, self.dtypes, self.update_dtypes
        asarray = jax.numpy.asarray  # an output may be a Python number (a static shape) or another dtype

        def body(*args: Any) -> tuple[Any, ...]:
            outs = local(*args)
            outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            results = [_reduce(asarray(o, dtype=dt), form, dt) for o, form, dt in zip(outs[:n_out], forms, dtypes)]
            news = [asarray(u, dtype=dt) for u, dt in zip(outs[n_out:], update_dtypes)]
            return (*results, *news)

        in_specs = (*[P(AXIS)] * self.n_scattered, *[P()] * (len(fgraph.inputs) - self.n_scattered))
        out_specs = tuple([P()] * (self.n_out + len(self.updated)))
        mapped = _shard_map()(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        self.jitted = jax.jit(mapped, donate_argnums=tuple(update_inputs))
        self.rows = NamedSharding(mesh, P(AXIS))
        self.replicated = NamedSharding(mesh, P())
        self.size = int(mesh.devices.size)
        self._last: Any = ()

    def __call__(self, device: EngineDevice, scattered: list[np.ndarray], bcast: list[Any]) -> list[Any]:
        """Run this rank's part: ``scattered`` its rows, ``bcast`` the broadcast values.  Stores the
        updated values; returns the outputs (global arrays, replicated; not waited for)."""
        jax = device.jax
        dev = device.device
        args = [jax.make_array_from_single_device_arrays((self.size * x.shape[0], *x.shape[1:]), self.rows,
                                                         [jax.device_put(x, dev)]) for x in scattered]
        args += [jax.make_array_from_single_device_arrays(np.shape(b), self.replicated, [jax.device_put(b, dev)])
                 for b in bcast]
        args += [device.global_value(var, self.replicated) for var in self.shared]
        outs = self.jitted(*args)
        self._last = outs
        for var, new in zip(self.updated, outs[self.n_out:]):
            device.store(var, new)
        return list(outs[:self.n_out])

    def wait(self) -> None:
        """Until the last run has finished (its outputs and updated values)."""
        import jax

        jax.block_until_ready(self._last)
        self._last = ()
