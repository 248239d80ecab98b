"""The body of a program whose ranks hold different numbers of rows (:func:`_uneven_body`): one branch
per share size, a graph with in-graph collectives run segment by segment with the collectives between."""

from __future__ import annotations

from typing import Any

import numpy as np

from synkhronos.engine.outputs import AXIS, STACKED, _reduce
from synkhronos.engine.segments import Segment, from_rows
from synkhronos.errors import ShapesDiffer
from synkhronos.ops import without_empty_collective


def _cut(value: Any, shape: tuple[int, ...]) -> Any:
    """``value`` (padded) cut back to ``shape``."""
    return value if tuple(value.shape) == shape else value[tuple(slice(0, n) for n in shape)]


def _pad(value: Any, shape: tuple[int, ...]) -> Any:
    """``value`` padded with zeros at the end of each axis up to ``shape``."""
    import jax.numpy as jnp

    if tuple(value.shape) == shape:
        return value
    return jnp.pad(value, [(0, t - n) for n, t in zip(value.shape, shape)])


def _uneven_body(fgraph: Any, stages: list[Segment], branches: tuple[int, ...], counts: tuple[int, ...],
                 n_scattered: int, donate: list[int], forms: list[str], dtypes: list[np.dtype],
                 update_dtypes: list[np.dtype]) -> Any:
    """The body of a program whose ranks hold different numbers of rows (``branches``: the distinct
    row counts, ascending; ``counts``: each rank's, where the graph holds in-graph collectives).

    Every rank's scattered blocks are padded to the largest count; the rank's branch index (its
    last operand) selects, through ``lax.switch``, the branch that runs the graph on exactly its own
    rows ``[:k]`` (static shapes in each branch).  No padded row ever reaches the graph, so the
    result is exact for any graph (a ``mean`` over the rows, a row-count-dependent shape), which
    padding the graph's input could not be.

    A graph with in-graph collectives runs in ``stages`` (:mod:`synkhronos.engine.segments`): each
    segment in its own ``lax.switch``, each collective between two switches, outside them, the same
    instruction in every rank (:meth:`~synkhronos.ops.Collective.in_program` with ``counts``: avg
    weighted by rows, a rank of 0 rows puts in the op's identity, as in the per-rank engine).  A
    value whose shape differs between branches (rows of an intermediate) leaves a switch padded to
    the largest shape and the next segment's branch ``k`` cuts it back to branch ``k``'s shape,
    known from tracing every branch (``jax.eval_shape``).  A collective whose operand has other
    shapes in other branches runs only where its op can take padded operands
    (:meth:`~synkhronos.ops.Collective.in_uneven`: ``all_gather`` and its gradient), else
    :class:`ShapesDiffer`.  Without collectives the graph is one segment.

    Outside the switches the outputs reduce as in the even program, weighted by rows: ``avg`` is
    ``psum(y_r * k_r / sum k)``; a rank of 0 rows puts in the op's identity.  Without collectives
    such a rank computes nothing and keeps its shared values (as in the per-rank engine); with
    them it runs the graph on zero rows and takes part in every collective (as CPU mode does),
    and applies the updates that read its rows only through collectives (or not at all: the
    training step's, from the all-reduced gradient), so that it stays in step with the others;
    an update that reads its rows along a path without a collective (a batch norm's running
    statistics, NaN over zero rows) keeps its value (:func:`~synkhronos.engine.segments.from_rows`).
    ``gather`` outputs (and the ones the master combines) leave the program stacked, padded to the
    longest along axis 0, with every rank's length (the last result) for the master to cut.
    """
    import jax
    import jax.numpy as jnp
    from pytensor.link.jax.dispatch import jax_funcify

    from synkhronos.reduce_ops import common_shape, identity

    lax = jax.lax
    n_out = len(forms)
    gathered = [i for i, f in enumerate(forms) if f in ("gather", STACKED)]
    weights = np.array(branches, dtype=np.float64)
    collectives = any(stage.collectives for stage in stages)
    run = [k for k in branches if k > 0 or collectives]  # the branches that compute
    rows = from_rows(fgraph, fgraph.inputs[:n_scattered])
    kept = [not collectives or v in rows for v in fgraph.outputs[n_out:]]  # kept by a rank without rows
    all_dtypes = [*dtypes, *update_dtypes]

    def body(*operands: Any) -> tuple[Any, ...]:
        args, index = tuple(operands[:-1]), operands[-1][0]
        env: dict[Any, Any] = dict(zip(fgraph.inputs, args))  # variable -> value (padded where shapes differ)
        shapes = {k: {v: (k, *a.shape[1:]) if i < n_scattered else tuple(a.shape)
                      for i, (v, a) in enumerate(zip(fgraph.inputs, args))} for k in branches}

        def value(v: Any) -> Any:
            return env[v] if v in env else jnp.asarray(v.data)

        def switch(stage: Segment, ins: list[Any]) -> Any:
            """The segment in its branches: ``ins`` (padded) cut to branch ``k``'s shapes, its outputs
            padded to the largest shape over the branches (a branch that computes nothing: zeros).
            A segment that reads nothing whose shape follows the rows (the update rule after the
            gradient's all-reduce) runs once, outside any switch."""
            fn = stage.fn
            assert fn is not None
            if run == list(branches) and all(len({shapes[k][v] for k in run}) == 1 for v in stage.inputs):
                outs = fn(*ins)  # no input follows the rows: every branch would compute the same, run it once
                for k in run:
                    shapes[k].update((v, tuple(jnp.shape(o))) for v, o in zip(stage.outputs, outs))
                return outs
            traced = {}
            for k in run:
                structs = [jax.ShapeDtypeStruct(shapes[k][v], x.dtype) for v, x in zip(stage.inputs, ins)]
                try:
                    traced[k] = jax.eval_shape(fn, *structs)
                except Exception as exc:
                    if k:
                        raise
                    raise ShapesDiffer(f"the graph cannot run on zero rows ({type(exc).__name__}: {exc}), which a "
                                       "rank without rows must, for its in-graph collectives: give every rank "
                                       "rows (a batch of at least as many rows as ranks)") from exc
            top, kinds = [], []
            for j, v in enumerate(stage.outputs):
                found = [tuple(traced[k][j].shape) for k in run]
                top.append(tuple(max(dims) for dims in zip(*found)))
                kinds.append(jnp.result_type(*(traced[k][j].dtype for k in run)))
                for k, shape in zip(run, found):
                    shapes[k][v] = shape

            def branch(k: int) -> Any:
                def go(*xs: Any) -> tuple[Any, ...]:
                    if k not in traced:
                        return tuple(jnp.zeros(s, dt) for s, dt in zip(top, kinds))
                    outs = fn(*(_cut(x, shapes[k][v]) for v, x in zip(stage.inputs, xs)))
                    return tuple(_pad(jnp.asarray(o, dtype=dt), s) for o, s, dt in zip(outs, top, kinds))
                return go

            return lax.switch(index, [branch(k) for k in branches], *ins)

        for stage in stages:
            if stage.fn is not None:
                env.update(zip(stage.outputs, switch(stage, [value(v) for v in stage.inputs])))
            for node in stage.collectives:
                ins = [value(v) for v in node.inputs]
                held = [{k: shapes[k].get(v, tuple(x.shape)) for k in run} for v, x in zip(node.inputs, ins)]
                if any(len(set(h.values())) > 1 for h in held):  # an operand whose shape follows the rows
                    fn = getattr(node.op, "in_uneven", lambda *a: None)(AXIS, node, counts,
                                                                         [[h[c] for c in counts] for h in held])
                    if fn is None:
                        found = sorted({s for h in held for s in h.values()})
                        raise ShapesDiffer(
                            f"in-graph collective {node.op} of a value whose shape follows the rows: under uneven "
                            f"shares its ranks would hold shapes {found}. Reduce over the rows before the "
                            "collective, or split the rows evenly over the ranks (batch=)")
                    out = jnp.asarray(without_empty_collective(fn)(*ins))
                    env[node.outputs[0]] = out
                    for k in branches:
                        shapes[k][node.outputs[0]] = node.op.uneven_shape([h[k] for h in held], tuple(out.shape))
                    continue
                outs = jax_funcify(node.op, node=node, synk_axis=AXIS, synk_counts=counts or None)(*ins)
                for var, out in zip(node.outputs, outs if isinstance(outs, (tuple, list)) else (outs,)):
                    env[var] = jnp.asarray(out)
                    for k in branches:
                        shapes[k][var] = tuple(env[var].shape)

        outs = [value(v) for v in fgraph.outputs]
        out_shapes = []
        for i, v in enumerate(fgraph.outputs):
            found = [shapes[k].get(v, tuple(outs[i].shape)) for k in branches if k > 0]
            what = f"output {i}" if i < n_out else f"updated value {i - n_out}"
            try:
                if i in gathered and forms[i] == "gather":
                    common_shape("gather", found, what)
                    out_shapes.append((max(s[0] for s in found), *found[0][1:]) if found[0] else ())
                else:
                    out_shapes.append(common_shape("avg", found, what))
            except ValueError as exc:
                raise ShapesDiffer(str(exc)) from None
        outs = [jnp.asarray(_cut(o, s), dtype=dt) for o, s, dt in zip(outs, out_shapes, all_dtypes)]
        weight = jnp.asarray(weights)[index]
        has_rows = weight > 0
        table = [[0 if k == 0 else (shapes[k].get(fgraph.outputs[i], out_shapes[i])[:1] or (1,))[0]
                  for i in gathered] for k in branches]
        lengths = jnp.asarray(np.array(table, dtype=np.int32).reshape(len(branches), len(gathered)))[index]
        total = lax.psum(weight, AXIS)
        results = []
        for i, (out, form, dt) in enumerate(zip(outs[:n_out], forms, dtypes)):
            if 0 in branches:  # a rank without rows: the identity, whatever it computed
                out = jnp.where(has_rows, out, jnp.zeros_like(out) if i in gathered else identity(form, dt))
            if i in gathered:
                results.append(lax.all_gather(out, AXIS))
            elif form == "avg":
                results.append(lax.psum(out * (weight / total).astype(dt), AXIS))
            else:
                results.append(_reduce(out, form, dt))
        news = outs[n_out:]
        if 0 in branches:  # a rank without rows keeps the shared values that its rows would have made
            news = [jnp.where(has_rows, new, jnp.asarray(args[j], dtype=dt)) if keep else new
                    for new, j, dt, keep in zip(news, donate, update_dtypes, kept)]
        # Without gathered outputs there are no lengths to send: no all-gather of an empty array (it
        # crashes XLA's GPU compiler), a constant in its place.
        return (*results, *news, lax.all_gather(lengths, AXIS) if gathered else jnp.zeros((1, 0), jnp.int32))

    return body
