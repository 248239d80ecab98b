"""One group of observed variables split over the ranks (:class:`_Split`): the analysis of the model
that refuses a term the ranks cannot split, the rows scattered once, and the compiled likelihood."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from synkhronos.errors import SplitError
from synkhronos.pymc.batched import _Batched
from synkhronos.pymc.graph import _leading, _rebuild, _rv_name, _without_checks

_log = logging.getLogger(__name__)


_SPLITS: dict[int, _Split] = {}
"""Split likelihoods by id (the id is what the graph's node holds)."""
_IDS = itertools.count(1)


class _RowsIn(NamedTuple):
    """How a likelihood's functions read the observed rows: ``build``, the arguments of
    :func:`synkhronos.function` that name them; ``shared``, the sliceable shared variables that
    hold them in the ranks."""

    build: dict[str, Any]
    shared: list[Any]


def _rows_in(row_ph: list[Any]) -> _RowsIn:
    """Where the rows live: in the ranks, in sliceable shared variables (each rank its own part,
    scattered once by the caller): on the GPU in GPU mode, read in place by CPU mode's JAX ranks
    (:func:`synkhronos.rank_functions.lend_to_jax`).  As scattered inputs they would cross into XLA at every
    evaluation: 1,000,000 rows of 20 features on one H200, 4.63 ms per evaluation as inputs
    against 1.06 ms in the ranks."""
    import pytensor

    shared = [pytensor.shared(np.empty((0, *ph.type.shape[1:]), dtype=ph.type.dtype), name=ph.name,
                              shape=ph.type.shape) for ph in row_ph]
    return _RowsIn({"inputs": [], "givens": list(zip(row_ph, shared)), "sliceable_shareds": shared}, shared)


class _Split:
    """One group of observed variables with the same number of rows, split over the ranks.

    Holds the synk function (the row arrays, scattered into the ranks once: :class:`_RowsIn`;
    broadcast inputs: the parameters; outputs: the summed log-probability and its gradient by each
    float parameter, reduced with ``sum``) and one Data per parameter (written at each call).
    """

    def __init__(self, model: Any, rvs: Sequence[Any], terms: Sequence[Any]) -> None:
        import pytensor
        import pytensor.tensor as pt
        from pytensor.compile.sharedvalue import SharedVariable
        from pytensor.graph.basic import Constant
        from pytensor.graph.traversal import graph_inputs

        import synkhronos as synk
        from synkhronos.runtime import get_runtime

        self.names = [rv.name for rv in rvs]
        values = [model.rvs_to_values[rv] for rv in rvs]
        rows = _leading(values[0])
        if rows is None:
            raise SplitError(f"likelihood term {_rv_name(rvs[0])} has no rows: its observed value is a scalar "
                             "or not data; data_parallel splits observed data along axis 0")
        self.rows = rows
        row_dims = self._row_dims(model, rvs)
        for rv, term in zip(rvs, terms):
            if term.ndim < 1:
                raise SplitError(f"likelihood term {_rv_name(rv)} is not a sum over rows of independent "
                                 f"observations: its log-probability is one value over all {rows} rows (a "
                                 "multivariate or time-series likelihood over the rows); data_parallel cannot "
                                 "split it: leave this model outside the block")
        row_roots: list[Any] = []
        params: list[Any] = []
        for var in graph_inputs(list(terms)):
            if isinstance(var, (SharedVariable, Constant)):
                n = _leading(var)
                dims = model.named_vars_to_dims.get(var.name, ()) if var.name else ()
                if dims and row_dims and dims[0] == row_dims and n != rows:
                    raise SplitError(f"data container {var.name!r} (dims {dims}) has {n} rows but likelihood "
                                     f"term(s) {self.names} have {rows}: data containers of different lengths; "
                                     "set them to the same rows (pm.set_data) before the block")
                if n == rows:
                    row_roots.append(var)
                elif isinstance(var, SharedVariable):
                    params.append(var)
            else:
                params.append(var)
        if not row_roots:
            raise SplitError(f"likelihood term(s) {self.names}: no data of {rows} rows found in the graph")
        # Symbolic stand-ins: the row arrays (any number of rows) and the shared parameters.
        row_ph = [pt.tensor(dtype=v.type.dtype, shape=(None, *v.type.shape[1:]), name=f"rows_{v.name or i}")
                  for i, v in enumerate(row_roots)]
        param_ph = [p.type() if isinstance(p, SharedVariable) else p for p in params]
        for ph, p in zip(param_ph, params):
            if ph is not p:
                ph.name = p.name
        replace = dict(zip(row_roots, row_ph)) | {p: ph for p, ph in zip(params, param_ph) if ph is not p}
        local_terms = _rebuild(list(terms), replace, rows, row_ph[0].shape[0])
        used = set(graph_inputs(local_terms))  # a dimension's length made a rank's rows is no parameter
        params, param_ph = [p for p, ph in zip(params, param_ph) if ph in used], [ph for ph in param_ph if ph in used]
        self.params = params
        self.float_params = [i for i, p in enumerate(params) if p.type.dtype.startswith("float")]
        rows_all = [np.asarray(v.get_value(borrow=True) if isinstance(v, SharedVariable) else v.data)
                    for v in row_roots]
        self._dry_run(model, rvs, rows_all, row_ph, params, param_ph, local_terms)
        self.check_bounds = bool(model.check_bounds)
        self._graph = (row_ph, param_ph, local_terms)
        total = pt.add(*(pt.sum(t, dtype="float64") for t in local_terms)) if len(local_terms) > 1 \
            else pt.sum(local_terms[0], dtype="float64")
        wrt = [param_ph[i] for i in self.float_params]
        grads: Any = pytensor.grad(total, wrt, disconnected_inputs="ignore", return_disconnected="zero") \
            if wrt else []
        # one output for the value, one flat vector for every gradient: two sums per call
        packed = [pt.concatenate([pt.cast(g, "float64").ravel() for g in grads])] if len(grads) else []
        outs = _without_checks(self.check_bounds, [total, *packed])
        self.dtype = outs[0].type.dtype
        self.rows_in = _rows_in(row_ph)
        self.fn = synk.function(bcast_inputs=param_ph, outputs=[(o, "sum") for o in outs],
                                name=f"pymc_likelihood_{'_'.join(self.names)}", **self.rows_in.build)
        synk.scatter(self.rows_in.shared, rows_all)
        self._batched: dict[int, _Batched] = {}
        self.param_data: list[Any] = [None] * len(params)
        self.pid = os.getpid()
        self.value_only = [0]
        _log.info("data_parallel: likelihood %s split over %d ranks (%d rows; %d row arrays scattered, %d "
                  "parameters broadcast)", self.names, get_runtime().size, rows, len(row_roots),
                  len(params))

    @staticmethod
    def _row_dims(model: Any, rvs: Sequence[Any]) -> str | None:
        dims = model.named_vars_to_dims.get(rvs[0].name) if rvs[0].name else None
        return dims[0] if dims else None

    def _dry_run(self, model: Any, rvs: Sequence[Any], rows_all: list[np.ndarray], row_ph: list[Any],
                 params: list[Any], param_ph: list[Any], local_terms: list[Any]) -> None:
        """Refuse a term whose row ``i`` is not a function of row ``i`` alone: evaluate the terms
        (in the master, on a few rows, at the model's initial point) on rows ``[0, k)`` and on rows
        ``[1, k)``; each must give one value per row, and the same values for the rows in both."""
        import pytensor
        from pytensor.compile.sharedvalue import SharedVariable
        from pytensor.graph.basic import Constant

        k = min(self.rows, 4)
        if k < 2:
            return
        point = model.initial_point(0)
        values = []
        for p in params:
            if isinstance(p, SharedVariable):
                values.append(p.get_value(borrow=True))
            elif isinstance(p, Constant):
                values.append(p.data)
            elif p.name in point:
                values.append(point[p.name])
            else:
                raise SplitError(f"likelihood term(s) {self.names} read {p} (not a model variable nor data): "
                                 "data_parallel cannot give it to the ranks")
        fn = pytensor.function([*row_ph, *[ph for ph in param_ph]], local_terms, mode="FAST_COMPILE",
                               on_unused_input="ignore")
        others = [f"{p.name or p} ({np.shape(v)[0]} rows)" for p, v in zip(params, values) if np.ndim(v)]
        why = ("the log-probability of a row depends on other rows, or on a parameter or data of another "
               f"length ({', '.join(others) or 'none'}: per-row latent variables and data containers of "
               f"another length than the {self.rows} rows are not split)")
        try:
            full_rows = fn(*[r[:k] for r in rows_all], *values)
            part_rows = fn(*[r[1:k] for r in rows_all], *values)
        except ValueError as exc:
            raise SplitError(f"likelihood term(s) {', '.join(map(_rv_name, rvs))} are not sums over rows of "
                             f"independent observations: {why}; data_parallel cannot split them ({exc})") from None
        for rv, full, part in zip(rvs, full_rows, part_rows):
            full, part = np.asarray(full), np.asarray(part)
            if full.shape[:1] != (k,) or part.shape[:1] != (k - 1,) or not np.allclose(full[1:], part,
                                                                                     equal_nan=True):
                raise SplitError(f"likelihood term {_rv_name(rv)} is not a sum over rows of independent "
                                 f"observations: {why}; data_parallel cannot split it")

    def __call__(self, values: Sequence[Any], with_grad: bool) -> list[Any]:
        import synkhronos as synk

        data = self.param_data
        for i, v in enumerate(values):
            d = data[i]
            if d is None or d.shape != np.shape(v):
                data[i] = synk.data(np.array(v, dtype=self.params[i].type.dtype))
            else:
                d.data[...] = v
        if not self.float_params:  # one output: the value
            return [self.fn(*data)]
        if not with_grad:
            out = self.fn(*data, output_subset=self.value_only)
            return out if isinstance(out, list) else [out]
        value, flat = self.fn(*data)
        return [value, *self._unpack(values, flat)]

    def _unpack(self, values: Sequence[Any], flat: np.ndarray) -> list[np.ndarray]:
        grads, start = [], 0
        for i in self.float_params:
            size = int(np.size(values[i]))
            grads.append(flat[start:start + size].reshape(np.shape(values[i])))
            start += size
        return grads

    def batched(self, width: int) -> _Batched:
        """The likelihood of ``width`` parameter points in one call (made on first use)."""
        found = self._batched.get(width)
        if found is None:
            found = self._batched[width] = _Batched(self, width)
        return found

    def evaluate_many(self, points: dict[int, Sequence[Any]], width: int, with_grad: bool) -> dict[int, list[Any]]:
        """The value (and gradients) at each point of ``points`` (by slot, slots below ``width``), in
        one call of the batched likelihood."""
        return self.batched(width)(points, with_grad)

    def free(self) -> None:
        import synkhronos as synk

        try:  # the ranks' parts of the rows: emptied
            synk.scatter(self.rows_in.shared, [np.empty((0, *v.get_value(borrow=True).shape[1:]), v.dtype)
                                               for v in self.rows_in.shared])
        except Exception as exc:  # a group that broke while the block ran
            _log.debug("data_parallel: emptying the rows: %r", exc)
        for d in [*self.param_data, *(d for b in self._batched.values() for d in b.param_data)]:
            if d is not None:
                try:
                    d.free_memory()
                except Exception as exc:  # a group that broke while the block ran
                    _log.debug("data_parallel: freeing %r: %r", d, exc)
