"""A split likelihood at several parameter points (the running chains') in one call (:class:`_Batched`)."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from synkhronos.pymc.graph import _without_checks

if TYPE_CHECKING:
    from synkhronos.pymc.split import _Split

_log = logging.getLogger(__name__)


def _rank_mode() -> dict[str, Any]:
    """``mode=`` for the batched likelihood in CPU mode's JAX ranks: JAX with
    :func:`synkhronos.pymc.graph.likelihood_mode`'s rewrites (one softplus an element and chain,
    computed in one pass), and XLA's own product, not numpy's BLAS (:mod:`synkhronos.blas`).

    The chains' products are tall and thin (rows by features times features by chains), where the
    BLAS call took about 1.8x XLA's time: 4 chains' logistic regression at 200,000 rows on 2 ranks,
    35 against 19 ms per call (2-core VM, ``bench_pymc.py --evals --batch 4`` with
    ``SYNK_CPU_BLAS=1`` and ``=0``).  ``SYNK_CPU_BLAS=1`` keeps the BLAS (and PyTensor's graph as
    it compiles it).  On GPUs the engine compiles the graph as it is."""
    from synkhronos import blas
    from synkhronos.pymc.graph import likelihood_mode
    from synkhronos.runtime import get_runtime

    device = get_runtime().device
    if device.use_gpu or getattr(device, "backend", None) != "jax" or os.environ.get(blas.BLAS_ENV, "").strip() == "1":
        return {}
    return {"mode": likelihood_mode()}


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
        mode = _rank_mode()
        try:
            with warnings.catch_warnings():  # compiled in JAX mode: JAX drops PyTensor's shape asserts
                warnings.filterwarnings("ignore", message=SKIPPED_ASSERT)
                self.fn = synk.function(bcast_inputs=batched_ph, outputs=[(o, "sum") for o in outs], name=name,
                                        **split.rows_in.build, **mode)
        except Exception as exc:
            if not mode:
                raise
            _log.info("data_parallel: %s does not compile in JAX mode (%r): the ranks' own choice", name, exc)
            self.fn = synk.function(bcast_inputs=batched_ph, outputs=[(o, "sum") for o in outs], name=name,
                                    **split.rows_in.build)
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
