"""``synkhronos.pymc``: a PyMC model's likelihood evaluated data-parallel over the ranks.

:func:`data_parallel` is a context manager.  Inside it, every log-probability graph that PyMC
builds from the model (``model.logp``, and so ``compile_logp``, ``compile_dlogp``,
``logp_dlogp_function``, the functions of ``pm.sample``'s NUTS, ``pm.find_MAP`` and ``pm.fit``)
holds the observed variables' likelihood as one node whose value and gradient come from a
:func:`synkhronos.function`:

* the observed data and every array of the same number of rows that the likelihood reads
  (``pm.Data`` containers, numpy arrays in the graph, group indices) are scattered once into the
  ranks (:func:`synkhronos.data`);
* at each evaluation the parameters go whole to every rank, each rank sums the log-probability of
  its own rows and its gradient, the ranks' sums are added (output reduce op ``sum``);
* every other term (priors, Jacobians of transforms, potentials) is computed once, in the master,
  by PyMC's own compiled function.

The value is the same sum as PyMC's (to rounding: the rows are added in another order).

Example
-------
>>> import numpy as np, pymc as pm
>>> import synkhronos as synk, synkhronos.pymc as synk_pymc
>>> synk.fork(2, use_gpu=False)                                                # doctest: +SKIP
>>> with pm.Model() as model:                                                   # doctest: +SKIP
...     beta = pm.Normal("beta", 0, 1, shape=20)
...     pm.Bernoulli("y", logit_p=X @ beta, observed=y)
>>> with synk_pymc.data_parallel(model):                                        # doctest: +SKIP
...     idata = pm.sample(draws=1000, chains=4)

What is split and what is not
    A likelihood term is split when its log-probability is one value per row of its observed
    data (rows independent given the parameters).  Terms that are one value over all rows (a
    multivariate or time-series likelihood over the rows), terms whose row ``i`` reads other rows,
    and observed variables whose row-aligned data containers have another length are refused with
    a :class:`SplitError` naming the term.  Second derivatives (``compile_d2logp``) of a split
    term are refused too.  ``model.logp(sum=False)`` (per-row values) is not split.

Chains
    ``pm.sample(chains=k, cores=c)`` runs ``min(c, k)`` chains at once in this process (threads,
    each with its own copy of the step method, each chain PyMC's own sampling loop), and every
    evaluation of the running chains goes to the ranks in one call: the likelihood vectorised over
    the chains' parameter points, the rows read once for all of them.  ``cores`` keeps its default
    (``min(4, cpu_count)``); ``cores=1`` runs the chains one after another, each evaluation on
    every rank.  Each chain's values equal its unbatched ones to rounding.  Other NUTS
    implementations (``nuts_sampler="nutpie"``, ``"numpyro"``) compile the model their own way and
    are refused inside the block.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

from synkhronos.errors import ChainStopped, SplitError

__all__ = ["SplitError", "data_parallel"]

_log = logging.getLogger(__name__)


_SPLITS: dict[int, _Split] = {}
"""Split likelihoods by id (the id is what the graph's node holds)."""
_IDS = itertools.count(1)


def _rv_name(rv: Any) -> str:
    op = getattr(rv.owner, "op", None)
    kind = getattr(op, "name", None) or type(op).__name__
    return f"{rv.name!r} ({kind})"


def _leading(value: Any) -> int | None:
    """Rows of a root variable's value (its axis-0 length), None for a scalar or a non-array."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Constant

    if isinstance(value, SharedVariable):
        arr = value.get_value(borrow=True)
    elif isinstance(value, Constant):
        arr = value.data
    else:
        return None
    shape = np.shape(arr)
    return int(shape[0]) if len(shape) else None


def _rebuild(outputs: list[Any], replace: dict[Any, Any], rows: int, local_rows: Any) -> list[Any]:
    """``outputs`` with the variables of ``replace`` replaced, every ``SpecifyShape`` dropped and
    every ``Alloc`` to ``rows`` rows made an ``Alloc`` to ``local_rows`` (PyMC's graphs hold the full
    data's shapes; a rank holds some of the rows)."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.traversal import toposort
    from pytensor.tensor.basic import Alloc, get_underlying_scalar_constant_value
    from pytensor.tensor.exceptions import NotScalarConstantError
    from pytensor.tensor.shape import SpecifyShape

    memo = dict(replace)
    for node in toposort(outputs):
        inputs = [memo.get(i, i) for i in node.inputs]
        if isinstance(node.op, SpecifyShape):
            memo[node.outputs[0]] = inputs[0]
            continue
        if isinstance(node.op, Alloc) and len(inputs) > 1:
            try:
                first = int(get_underlying_scalar_constant_value(inputs[1]))
            except NotScalarConstantError:
                # a dimension's length (``pm.Model(coords=...)``: a shared scalar)
                shared = node.inputs[1]
                value = shared.get_value(borrow=True) if isinstance(shared, SharedVariable) else None
                first = int(value) if value is not None and np.ndim(value) == 0 else -1
            if first == rows:
                inputs[1] = local_rows
        if all(a is b for a, b in zip(inputs, node.inputs)):
            continue
        new = node.op.make_node(*inputs)
        memo.update(zip(node.outputs, new.outputs))
    return [memo.get(o, o) for o in outputs]


class _Split:
    """One group of observed variables with the same number of rows, split over the ranks.

    Holds the synk function (the row arrays: sliceable shared variables, scattered into the ranks
    once; broadcast inputs: the parameters; outputs: the summed log-probability and its gradient by
    each float parameter, reduced with ``sum``) and one Data per parameter (written at each call).
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
        self._dry_run(model, rvs, row_roots, row_ph, params, param_ph, local_terms)
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
        # The rows live in the ranks: sliceable shared variables, each rank holding its own part,
        # scattered once (on its GPU in GPU mode), not inputs that travel to the device at every call.
        rows_all = [np.asarray(v.get_value(borrow=True) if isinstance(v, SharedVariable) else v.data)
                    for v in row_roots]
        self.row_shared = [pytensor.shared(np.empty((0, *r.shape[1:]), dtype=ph.type.dtype), name=ph.name,
                                           shape=ph.type.shape) for r, ph in zip(rows_all, row_ph)]
        self.givens = list(zip(row_ph, self.row_shared))
        self.fn = synk.function(inputs=[], bcast_inputs=param_ph, givens=self.givens,
                                sliceable_shareds=self.row_shared,
                                outputs=[(o, "sum") for o in outs], name=f"pymc_likelihood_{'_'.join(self.names)}")
        synk.scatter(self.row_shared, rows_all)
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

    def _dry_run(self, model: Any, rvs: Sequence[Any], row_roots: list[Any], row_ph: list[Any], params: list[Any],
                 param_ph: list[Any], local_terms: list[Any]) -> None:
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
        rows_all = [np.asarray(v.get_value(borrow=True) if isinstance(v, SharedVariable) else v.data)
                    for v in row_roots]
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

        batcher = getattr(_LOCAL, "batcher", None)
        if batcher is not None:  # a chain's thread: evaluated with the other chains' points, in one call
            return batcher.evaluate(_LOCAL.slot, self, values, with_grad)
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
            synk.scatter(self.row_shared, [np.empty((0, *v.get_value(borrow=True).shape[1:]), v.dtype)
                                           for v in self.row_shared])
        except Exception as exc:  # a group that broke while the block ran
            _log.debug("data_parallel: emptying the rows: %r", exc)
        for d in [*self.param_data, *(d for b in self._batched.values() for d in b.param_data)]:
            if d is not None:
                try:
                    d.free_memory()
                except Exception as exc:  # a group that broke while the block ran
                    _log.debug("data_parallel: freeing %r: %r", d, exc)


def _without_checks(check_bounds: bool, outs: list[Any]) -> list[Any]:
    """PyMC's parameter checks as PyMC compiles them: ``-inf`` where a check fails (or removed,
    ``check_bounds=False``), so that every rank's backend can compile the graph."""
    from pymc.logprob.utils import local_check_parameter_to_ninf_switch, local_remove_check_parameter
    from pytensor.graph.fg import FunctionGraph
    from pytensor.graph.rewriting.basic import in2out

    rewrite = local_check_parameter_to_ninf_switch if check_bounds else local_remove_check_parameter
    fgraph = FunctionGraph(outputs=outs, clone=False)
    in2out(rewrite).rewrite(fgraph)
    return list(fgraph.outputs)


def _xla_dot() -> dict[str, Any]:
    """``mode="JAX"`` for the batched likelihood in CPU mode's JAX ranks: XLA's own product, not
    numpy's BLAS (:mod:`synkhronos.blas`).  The chains' products are tall and thin (rows by
    features times features by chains), where the BLAS call took about 1.8x XLA's time: 4 chains'
    logistic regression at 200,000 rows on 2 ranks, 35 against 19 ms per call (2-core VM,
    ``bench_pymc.py --evals --batch 4`` with ``SYNK_CPU_BLAS=1`` and ``=0``).  ``SYNK_CPU_BLAS=1``
    keeps the BLAS."""
    from synkhronos import blas
    from synkhronos.runtime import get_runtime

    device = get_runtime().device
    if device.use_gpu or getattr(device, "backend", None) != "jax" or os.environ.get(blas.BLAS_ENV, "").strip() == "1":
        return {}
    return {"mode": "JAX"}


class _Batched:
    """A :class:`_Split`'s likelihood at ``width`` parameter points in one call: every parameter
    takes a leading axis of ``width`` (one slot per chain), the per-row terms are the same graph
    vectorised over it (``pytensor.graph.replace.vectorize_graph``: the rows are read once for all
    points, a matrix-vector product becomes a matrix-matrix one), the outputs are the ``width``
    values and the ``width`` packed gradients, reduced with ``sum`` over the ranks.  Slot ``s``'s
    results depend on slot ``s``'s point alone (the gradient of the sum of the values by slot
    ``s``'s parameters is that slot's gradient); slots without a point take another slot's point."""

    def __init__(self, split: _Split, width: int) -> None:
        import pytensor
        import pytensor.tensor as pt

        import synkhronos as synk
        from synkhronos.cpu import SKIPPED_ASSERT

        self.split = split
        self.width = width
        _, param_ph, local_terms = split._graph
        batched_ph = [pt.tensor(dtype=p.type.dtype, shape=(width, *p.type.shape), name=f"{p.name or 'param'}_chains")
                      for p in param_ph]
        terms = self._vectorised(local_terms, param_ph, batched_ph, width)
        values = pt.add(*terms) if len(terms) > 1 else terms[0]
        wrt = [batched_ph[i] for i in split.float_params]
        grads: Any = pytensor.grad(values.sum(), wrt, disconnected_inputs="ignore", return_disconnected="zero") \
            if wrt else []
        packed = [pt.concatenate([pt.cast(g, "float64").reshape((width, -1)) for g in grads], axis=1)] \
            if len(grads) else []
        outs = _without_checks(split.check_bounds, [values, *packed])
        name = f"pymc_likelihood_{'_'.join(split.names)}_x{width}"
        mode = _xla_dot()
        try:
            with warnings.catch_warnings():  # compiled in JAX mode: JAX drops PyTensor's shape asserts
                warnings.filterwarnings("ignore", message=SKIPPED_ASSERT)
                self.fn = synk.function(inputs=[], bcast_inputs=batched_ph, givens=split.givens,
                                        sliceable_shareds=split.row_shared, outputs=[(o, "sum") for o in outs],
                                        name=name, **mode)
        except Exception as exc:
            if not mode:
                raise
            _log.info("data_parallel: %s does not compile in JAX mode (%r): the ranks' own choice", name, exc)
            self.fn = synk.function(inputs=[], bcast_inputs=batched_ph, givens=split.givens,
                                    sliceable_shareds=split.row_shared, outputs=[(o, "sum") for o in outs],
                                    name=name)
        self.param_data: list[Any] = [None] * len(param_ph)
        self.called = False

    @staticmethod
    def _vectorised(local_terms: list[Any], param_ph: list[Any], batched_ph: list[Any], width: int) -> list[Any]:
        """Each term's per-point sum, shape ``(width,)``: the terms vectorised over the parameters'
        leading axis, or, where PyTensor cannot vectorise an operation, ``width`` copies of them."""
        import pytensor.tensor as pt
        from pytensor.graph.replace import graph_replace, vectorize_graph

        def per_point(t: Any, term: Any) -> Any:
            if t.ndim == term.ndim:  # a term that reads no parameter: the same at every point
                return pt.alloc(pt.sum(t, dtype="float64"), width)
            return pt.sum(t, axis=tuple(range(1, t.ndim)), dtype="float64")

        try:
            vectorised = vectorize_graph(list(local_terms), replace=dict(zip(param_ph, batched_ph)))
            return [per_point(t, term) for t, term in zip(vectorised, local_terms)]
        except NotImplementedError as exc:
            _log.info("data_parallel: likelihood not vectorised over chains (%s): one copy per chain in the call", exc)
        copies = [graph_replace(list(local_terms), {p: b[c] for p, b in zip(param_ph, batched_ph)}, strict=False)
                  for c in range(width)]
        return [pt.stack([pt.sum(copy[j], dtype="float64") for copy in copies]) for j in range(len(local_terms))]

    def __call__(self, points: dict[int, Sequence[Any]], with_grad: bool) -> dict[int, list[Any]]:
        import synkhronos as synk

        split = self.split
        first = points[min(points)]
        for i, p in enumerate(split.params):
            shape = (self.width, *np.shape(first[i]))
            d = self.param_data[i]
            if d is None or d.shape != shape:
                if d is not None:
                    d.free_memory()
                d = self.param_data[i] = synk.data(np.zeros(shape, dtype=p.type.dtype))
            arr = d.data
            for slot in range(self.width):
                arr[slot] = points.get(slot, first)[i]
        data = self.param_data
        if not split.float_params:
            values = self._call(*data)
            return {slot: [values[slot]] for slot in points}
        if not with_grad:
            out = self._call(*data, output_subset=[0])
            values = out[0] if isinstance(out, list) else out
            return {slot: [values[slot]] for slot in points}
        values, flat = self._call(*data)
        return {slot: [values[slot], *split._unpack(points[slot], flat[slot])] for slot in points}

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self.called:
            return self.fn(*args, **kwargs)
        from synkhronos.cpu import SKIPPED_ASSERT

        with warnings.catch_warnings():  # the first call compiles (JAX drops PyTensor's shape asserts)
            warnings.filterwarnings("ignore", message=SKIPPED_ASSERT)
            out = self.fn(*args, **kwargs)
        self.called = True
        return out


class SplitLikelihood(Op):
    """The graph node of a split likelihood.  Outputs: the summed log-likelihood of a
    :class:`_Split`, then (``with_grad``) its gradient by each float parameter.  Inputs: the
    parameters.  A class of the module (not of a function) so that a step method holding it
    pickles by reference: the chains' copies of ``pm.sample``'s step method share the split."""

    __props__ = ("split_id", "with_grad")

    def __init__(self, split_id: int, with_grad: bool = True) -> None:
        self.split_id = split_id
        self.with_grad = with_grad

    def make_node(self, *params: Any) -> Apply:
        import pytensor.tensor as pt

        split = _SPLITS[self.split_id]
        inputs = [pt.as_tensor_variable(p) for p in params]
        outputs = [pt.scalar(dtype=split.dtype)]
        if self.with_grad:
            outputs += [inputs[i].type() for i in split.float_params]
        return Apply(self, inputs, outputs)

    def perform(self, node: Any, inputs: Any, output_storage: Any) -> None:
        split = _SPLITS.get(self.split_id)
        if split is None:
            raise RuntimeError(f"likelihood split {self.split_id} is gone: its data_parallel block has ended "
                               "(a function compiled inside the block runs only inside it)")
        if os.getpid() != split.pid:
            raise RuntimeError("a function compiled inside synkhronos.pymc.data_parallel ran in another process: "
                               "it runs in the process that forked the ranks")
        res = split(inputs, self.with_grad)
        for storage, value, var in zip(output_storage, res, node.outputs):
            storage[0] = np.asarray(value, dtype=var.type.dtype).reshape(var.type.shape if all(
                s is not None for s in var.type.shape) else np.shape(value))

    def pullback(self, inputs: Any, outputs: Any, output_grads: Any) -> list[Any]:
        from pytensor.gradient import DisconnectedType

        if any(not isinstance(g.type, DisconnectedType) for g in output_grads[1:]):
            raise SplitError("second derivatives of a likelihood split by data_parallel are not supported "
                             "(compile_d2logp, Hessians): compile them outside the block")
        split = _SPLITS[self.split_id]
        grads_of = outputs if self.with_grad else SplitLikelihood(self.split_id, True).make_node(*inputs).outputs
        g = output_grads[0]
        result: list[Any] = []
        j = 1
        for i, inp in enumerate(inputs):
            if i in split.float_params:
                result.append(g * grads_of[j])
                j += 1
            else:
                result.append(inp.zeros_like(dtype=g.dtype))
        return result

    def connection_pattern(self, node: Any) -> list[list[bool]]:
        return [[True] * len(node.outputs) for _ in node.inputs]


_REGISTERED: list[bool] = []


def _op_class() -> type[SplitLikelihood]:
    """:class:`SplitLikelihood`, its rewrite and its Numba fallback registered on first use."""
    if not _REGISTERED:
        _register_rewrite(SplitLikelihood)
        _register_numba(SplitLikelihood)
        _REGISTERED.append(True)
    return SplitLikelihood


def _register_numba(op_class: type) -> None:
    """PyTensor's Numba backend (PyMC's default) runs the node's ``perform`` in object mode, as it
    does for any Op without a Numba implementation, here without its warning: the node's work is
    a call into the ranks."""
    import warnings

    try:
        from pytensor.link.numba.dispatch.basic import generate_fallback_impl, numba_funcify
    except ImportError:  # pragma: no cover - PyTensor without its Numba backend
        return

    @numba_funcify.register(op_class)
    def _funcify(op: Any, node: Any = None, storage_map: Any = None, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Numba will use object mode", category=UserWarning)
            return generate_fallback_impl(op, node, storage_map, **kwargs)


def _register_rewrite(op_class: type) -> None:
    """A rewrite that computes no gradient where the compiled function reads only the value
    (``compile_logp``): one call per evaluation either way."""
    from pytensor.graph.rewriting.basic import node_rewriter
    from pytensor.tensor.rewriting.basic import register_specialize

    @node_rewriter([op_class])
    def synk_likelihood_value_only(fgraph: Any, node: Any) -> Any:
        op = node.op
        if not op.with_grad or any(fgraph.clients.get(o) for o in node.outputs[1:]):
            return None
        return {node.outputs[0]: op_class(op.split_id, False).make_node(*node.inputs).outputs[0]}

    register_specialize(synk_likelihood_value_only)


class _Hook:
    """The model's ``logp`` inside a :func:`data_parallel` block (an attribute of the model
    object, removed at the block's end)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.original = model.logp
        self.splits: dict[tuple[int, ...], int] = {}

    def logp(self, vars: Any = None, jacobian: bool = True, sum: bool = True) -> Any:
        from pytensor.tensor import as_tensor
        from pytensor.tensor.math import variadic_add

        model = self.model
        if not sum:
            return self.original(vars=vars, jacobian=jacobian, sum=False)
        if vars is None:
            varlist = [*model.free_RVs, *model.observed_RVs, *model.potentials]
        elif not isinstance(vars, (list, tuple)):
            varlist = [vars]
        else:
            varlist = list(vars)
        observed = set(model.observed_RVs)
        obs = [v for v in varlist if v in observed]
        rest = [v for v in varlist if v not in observed]
        factors = [as_tensor(f, allow_xtensor_conversion=True).sum()
                   for f in (self.original(vars=rest, jacobian=jacobian, sum=False) if rest else [])]
        op = _op_class()
        for split_id, params in self._splits(obs):
            factors.append(op(split_id, True).make_node(*params).outputs[0])
        total = variadic_add(*factors)
        name = "__logp" if jacobian else "__logp_nojac"
        total.name = f"{name}_{model.name}" if model.name else name
        return total

    def _splits(self, obs: list[Any]) -> Iterator[tuple[int, list[Any]]]:
        """(split id, parameters) of each group of ``obs`` with the same number of rows."""
        groups: dict[int | None, list[Any]] = {}
        for rv in obs:
            groups.setdefault(_leading(self.model.rvs_to_values[rv]), []).append(rv)
        for rvs in groups.values():
            key = tuple(sorted(id(rv) for rv in rvs))
            split_id = self.splits.get(key)
            if split_id is None:
                terms = self.original(vars=rvs, jacobian=True, sum=False)
                split_id = next(_IDS)
                _SPLITS[split_id] = _Split(self.model, rvs, terms)
                self.splits[key] = split_id
            yield split_id, _SPLITS[split_id].params

    def close(self) -> None:
        for split_id in self.splits.values():
            split = _SPLITS.pop(split_id, None)
            if split is not None:
                split.free()


_LOCAL = threading.local()
"""A chain's thread: ``batcher`` (its :class:`_Batcher`) and ``slot`` (its slot in the batched calls)."""


class _Request:
    """One chain's evaluation, waiting for its batch: ``done`` is set when ``result`` is there, or
    ``stopped`` (the chains are stopping)."""

    __slots__ = ("done", "result", "split", "stopped", "values", "with_grad")

    def __init__(self, split: _Split, values: Sequence[Any], with_grad: bool) -> None:
        self.split, self.values, self.with_grad = split, values, with_grad
        self.result: list[Any] = []
        self.stopped = False
        self.done = threading.Event()


class _Batcher:
    """Runs tasks (chains) in threads of this process, one slot each, and evaluates their split
    likelihoods together: a chain's evaluation waits until every running chain waits for one, then
    this (the calling) thread evaluates them in one call per split (:meth:`_Split.evaluate_many`)
    and hands each chain its results.  Which evaluations go together depends on the chains alone
    (each batch holds the next evaluation of every running chain), never on the threads' timing;
    the group is called from this thread only."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.lock = threading.Lock()
        self.full = threading.Condition(self.lock)  # every running chain waits (or one ended)
        self.waiting: dict[int, _Request] = {}
        self.live: set[int] = set()
        self.error: BaseException | None = None
        self.calls = 0

    def evaluate(self, slot: int, split: _Split, values: Sequence[Any], with_grad: bool) -> list[Any]:
        """In a chain's thread: ``split``'s results at ``values``, evaluated with the other chains'."""
        request = _Request(split, [np.array(v, copy=True) for v in values], with_grad)
        with self.lock:
            if self.error is not None:
                raise ChainStopped("another chain failed")
            self.waiting[slot] = request
            if len(self.waiting) >= len(self.live):
                self.full.notify()
        request.done.wait()
        if request.stopped:
            raise ChainStopped("another chain failed")
        return request.result

    def run(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``tasks[s]`` in slot ``s``'s thread, all at once; their results, or the first error
        (raised here once every thread has ended: the others stop at their next evaluation)."""
        if len(tasks) > self.slots:
            raise ValueError(f"{len(tasks)} tasks for {self.slots} slots")
        results: list[Any] = [None] * len(tasks)

        def body(slot: int) -> None:
            _LOCAL.batcher, _LOCAL.slot = self, slot
            try:
                results[slot] = tasks[slot]()
            except BaseException as exc:  # handed to the calling thread
                if not isinstance(exc, ChainStopped):
                    self._stop(exc)
            finally:
                with self.lock:
                    self.live.discard(slot)
                    self.full.notify()

        self.live = set(range(len(tasks)))
        threads = [threading.Thread(target=body, args=(slot,), name=f"synk-pymc-chain-{slot}", daemon=True)
                   for slot in range(len(tasks))]
        for t in threads:
            t.start()
        try:
            self._serve()
        except BaseException as exc:  # KeyboardInterrupt here: stop the chains
            self._stop(exc)
        finally:
            for t in threads:
                t.join()
        if self.error is not None:
            raise self.error
        return results

    def _stop(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
            stopped, self.waiting = self.waiting, {}
            self.full.notify()
        for request in stopped.values():
            request.stopped = True
            request.done.set()

    def _serve(self) -> None:
        while True:
            with self.lock:
                while self.live and self.error is None and len(self.waiting) < len(self.live):
                    self.full.wait()
                if self.error is not None or not self.live:
                    return
                batch, self.waiting = self.waiting, {}
            by_split: dict[int, dict[int, _Request]] = {}
            for slot, request in batch.items():
                by_split.setdefault(id(request.split), {})[slot] = request
            try:
                for requests in by_split.values():
                    split = next(iter(requests.values())).split
                    with_grad = any(r.with_grad for r in requests.values())
                    out = split.evaluate_many({s: r.values for s, r in requests.items()}, self.slots, with_grad)
                    for slot, request in requests.items():
                        request.result = out[slot] if with_grad == request.with_grad else out[slot][:1]
                self.calls += 1
            except BaseException as exc:  # the chains stop, run() raises it
                with self.lock:
                    self.waiting.update(batch)
                self._stop(exc)
                return
            for request in batch.values():
                request.done.set()


def _batched_mp_sample(*, draws: int, tune: int, step: Any, chains: int, cores: int, rngs: Sequence[Any],
                       start: Sequence[Any], traces: Sequence[Any], progressbar: Any = True,
                       progressbar_theme: Any = None, model: Any = None, callback: Any = None,
                       **kwargs: Any) -> None:
    """``pm.sample``'s multi-chain sampling inside the block, in place of its chain processes:
    ``min(cores, chains)`` chains at a time, each in a thread of this process with its own copy of
    the step method (as PyMC's processes have: pickled and loaded), each chain PyMC's own
    ``_sample``; their likelihood evaluations go to the ranks batched (:class:`_Batcher`).  Slot
    ``s`` runs chains ``s``, ``s + slots``, ..."""
    import cloudpickle
    from pymc.sampling import mcmc

    kwargs.pop("blas_cores", None)
    kwargs.pop("mp_ctx", None)
    slots = min(cores, chains)
    initial_state = step.sampling_state
    blob = cloudpickle.dumps(step, protocol=-1)
    steps = [step, *(cloudpickle.loads(blob) for _ in range(slots - 1))]
    lock = threading.Lock()

    def one_at_a_time(**kw: Any) -> Any:
        with lock:
            return callback(**kw)

    progress = mcmc.MCMCProgressBarManager(step_method=step, chains=chains, draws=draws - tune, tune=tune,
                                           progressbar=progressbar, progressbar_theme=progressbar_theme)

    def slot_task(slot: int) -> Callable[[], None]:
        def run() -> None:
            for chain in range(slot, chains, slots):
                steps[slot].sampling_state = initial_state
                mcmc._sample(draws=draws, chain=chain, start=start[chain], step=steps[slot], trace=traces[chain],
                             rng=rngs[chain], tune=tune, model=model, progress_manager=progress,
                             callback=None if callback is None else one_at_a_time, **kwargs)
        return run

    _log.info("data_parallel: %d chains, %d at a time in this process, their evaluations batched", chains, slots)
    batcher = _Batcher(slots)
    try:
        with progress:
            batcher.run([slot_task(s) for s in range(slots)])
    finally:
        for trace in traces:
            trace.close()
    _log.info("data_parallel: %d batched calls", batcher.calls)


@contextmanager
def data_parallel(model: Any) -> Iterator[Any]:
    """Evaluate ``model``'s likelihood data-parallel over the ranks inside the block.

    Parameters
    ----------
    model : pymc.Model
        A model whose observed variables' log-probability is a sum over rows of their data.

    Yields
    ------
    pymc.Model
        ``model`` itself.

    Raises
    ------
    RuntimeError
        Before :func:`synkhronos.fork`, or in a worker.
    SplitError
        When PyMC first builds the model's log-probability inside the block, for a likelihood term
        that is not a sum over rows of independent observations, or row data of different lengths;
        the message names the term.  Nothing has run in the ranks then.

    Notes
    -----
    Splitting happens the first time PyMC builds the model's ``logp`` inside the block (its row
    arrays are scattered then, once).  Functions compiled inside the block call the ranks and work
    only inside it.  ``pm.sample`` inside the block samples with PyMC's own NUTS
    (``nuts_sampler`` other than ``"pymc"`` is refused) in this process: with ``cores > 1`` and
    several chains, ``min(cores, chains)`` chains at once in threads, their evaluations batched in
    one call into the ranks (in place of PyMC's chain processes); with ``cores=1`` one chain after
    another.  A draw ``callback`` is called from the chain's thread, one call at a time.
    """
    import pymc

    from synkhronos.runtime import get_runtime

    rt = get_runtime()
    if not rt.is_master:
        raise RuntimeError("synkhronos.pymc.data_parallel() is for the master process")
    if "logp" in vars(model):
        raise RuntimeError("data_parallel blocks of one model cannot nest")
    from pymc.sampling import mcmc

    hook = _Hook(model)
    original_sample, original_mp_sample = pymc.sample, mcmc._mp_sample

    def sample(*args: Any, **kwargs: Any) -> Any:
        try:
            ours = pymc.modelcontext(kwargs.get("model")) is model
        except TypeError:  # no model: PyMC says so
            ours = False
        if not ours:
            return original_sample(*args, **kwargs)
        sampler = kwargs.get("nuts_sampler")
        if sampler not in (None, "pymc"):
            raise ValueError(f"nuts_sampler={sampler!r} compiles the model its own way: inside "
                             "synkhronos.pymc.data_parallel use PyMC's NUTS (nuts_sampler='pymc')")
        kwargs["nuts_sampler"] = "pymc"  # never nutpie by default here
        return original_sample(*args, **kwargs)

    def mp_sample(**kwargs: Any) -> Any:
        if kwargs.get("model") is not model:  # another model's pm.sample: PyMC's chain processes
            return original_mp_sample(**kwargs)
        return _batched_mp_sample(**kwargs)

    model.logp = hook.logp
    pymc.sample = sample
    mcmc._mp_sample = mp_sample
    try:
        yield model
    finally:
        pymc.sample = original_sample
        mcmc._mp_sample = original_mp_sample
        vars(model).pop("logp", None)
        hook.close()
