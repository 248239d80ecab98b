"""Replica: a Synkhronos function compiled in one rank, and the rank's share of a call.

Two compiled forms, each per output subset (PyTensor has no ``output_subset`` any more, so a
subset is a function of its own, compiled on first use and cached):

* ``full``  -- ``pytensor.function(inputs + bcast_inputs, outputs, updates=...)``: one pass,
  updates applied by PyTensor.  Used when the call has one slice and no ``batch_s``.
* ``parts`` -- the same graph with every sliceable shared variable replaced by an explicit
  input and the update expressions returned as outputs: the rank calls it once per slice, combines
  outputs and updates slice by slice (each slice sees the original shared values), and applies
  the combined updates once at the end -- except a random generator's, which advances after each
  slice so that every slice draws new numbers.
* ``selected`` -- GPU mode: as ``parts``, but the rows of the sliceable shared variables are
  selected inside the compiled function, from their whole values, instead of by one JAX dispatch
  per variable and call before it: a slice of step 1 as a :class:`~synkhronos.rows.RowWindow`
  from a start given per call (one compiled form per row count), an index array as a gather
  (one compiled form; JAX traces each index length once).  Other slices take ``parts``.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from synk_comm.lockstep import REPLY_VALUES
from synkhronos.device import Device
from synkhronos.reduce_ops import combine
from synkhronos.spec import FunctionSpec

__all__ = ["Replica"]

log = logging.getLogger("synkhronos")

Subset = tuple[int, ...] | None


class Replica:
    """A :class:`FunctionSpec` compiled in this rank."""

    def __init__(self, spec: FunctionSpec, device: Device) -> None:
        self.spec = spec
        self.device = device
        self._full: dict[Subset, Any] = {}
        self._parts: dict[Subset, Any] = {}
        self._selected: dict[tuple[Subset, int], Any] = {}
        self.compile_seconds = 0.0
        self._collectives: list[Any] | None = None
        self._in_program: bool | None = None
        self._exact: set[Any] = set()
        """The kinds of values (``("outputs", subset)``, ``"updates"``) found in their declared
        dtypes once: the compiled function's output dtypes follow from its input dtypes, which
        are fixed, so later calls skip the check (:meth:`_in_declared`)."""
        self._value_dtypes: dict[Subset, tuple[np.dtype, ...] | None] = {}  # see value_dtypes

    @property
    def collectives(self) -> list[Any]:
        """The nodes of in-graph collectives (:mod:`synkhronos.ops`, or any Op marked
        ``synk_collective = True``) in the function's graph."""
        if self._collectives is None:
            from synkhronos.ops import collective_nodes

            spec = self.spec
            graph = [*spec.outputs, *(e for _, e in spec.updates), *(v for _, v in spec.givens)]
            self._collectives = collective_nodes(graph)
        return self._collectives

    @property
    def has_collectives(self) -> bool:
        """Whether a call of this function communicates from inside its graph: then every rank
        computes, even one without rows, in one slice."""
        return bool(self.collectives)

    @property
    def all_reduces_in_program(self) -> bool:
        """Whether every in-graph collective of this function is an all-reduce that can run inside
        a CPU rank's JAX program (:func:`synkhronos.ops.runs_in_program`; there, where the group has
        a segment for them)."""
        if self._in_program is None:
            from synkhronos.ops import all_run_in_program

            self._in_program = all_run_in_program(self.collectives)
        return self._in_program

    def wait(self, outputs: Sequence[Any]) -> None:
        """Until ``outputs`` and the updated shared values are computed (GPU mode: JAX dispatches
        asynchronously)."""
        self.device.wait(itertools.chain(outputs, (var.container.storage[0] for var, _ in self.spec.updates)))

    def output_variables(self, subset: Subset) -> list[Any]:
        """The outputs of a call with ``subset``, in the call's order."""
        outs = self.spec.outputs
        return list(outs) if subset is None else [outs[i] for i in subset]

    def output_ops(self, subset: Subset) -> Sequence[str]:
        """Their reduce ops, in the same order (all of them: the spec's own list, not a copy; every
        call of a function asks, and none changes it)."""
        ops = self.spec.output_ops
        return ops if subset is None else [ops[i] for i in subset]

    def value_dtypes(self, subset: Subset) -> tuple[np.dtype, ...] | None:
        """The dtypes of a call's outputs where its ranks reply them as numbers in the control
        block (:meth:`synk_comm.Group.reply_values`, :func:`synkhronos.calls.reply`) instead of a
        message; None where they reply a message.  Numbers: every output a real floating-point
        scalar of at most 8 bytes (exact in float64) combined by a reduce op other than gather --
        a loss, an accuracy -- and with the rank's weight they fit the row's slots.  Every rank
        gives the same answer: it reads only the function's declared outputs."""
        if subset in self._value_dtypes:
            return self._value_dtypes[subset]
        outputs = self.output_variables(subset)
        dtypes = [np.dtype(getattr(var.type, "dtype", "O")) for var in outputs]
        numbers = (len(dtypes) < REPLY_VALUES and "gather" not in self.output_ops(subset)
                   and all(getattr(var.type, "ndim", None) == 0 for var in outputs)
                   and all(d.kind == "f" and d.itemsize <= 8 for d in dtypes))
        known = self._value_dtypes[subset] = tuple(dtypes) if numbers else None
        return known

    def _kwargs(self, subset: Subset) -> dict[str, Any]:
        kwargs = self.device.compile_kwargs(self.spec.kwargs)
        if subset is not None:  # a subset of the outputs may leave some inputs unused
            kwargs.setdefault("on_unused_input", "ignore")
        return kwargs

    def full(self, subset: Subset = None) -> Any:
        """``inputs + bcast_inputs -> outputs``, updates applied by PyTensor (one pass)."""
        fn = self._full.get(subset)
        if fn is None:
            spec = self.spec
            fn = self._full[subset] = self._compile(spec.all_inputs, self.output_variables(subset), spec.updates,
                                                    spec.givens, subset)
        return fn

    def parts(self, subset: Subset = None) -> Any:
        """``inputs + bcast_inputs + sliceable stand-ins -> outputs + update values`` (per slice)."""
        fn = self._parts.get(subset)
        if fn is None:
            stand_ins = [var.type() for var in self.spec.sliceable]
            fn = self._parts[subset] = self._compile_per_slice(subset, stand_ins, stand_ins)
        return fn

    def selected(self, subset: Subset, count: int) -> Any:
        """``inputs + bcast_inputs + whole sliceable values + selection -> outputs + update values``.

        ``count`` > 0: each sliceable variable is read as ``count`` rows from its own int32 start
        (the selection: one start per variable); ``count`` = 0: all are read at the rows of one
        int32 index vector (the selection)."""
        key = (subset, count)
        fn = self._selected.get(key)
        if fn is None:
            import pytensor.tensor as pt

            from synkhronos.rows import RowWindow

            wholes = [var.type() for var in self.spec.sliceable]
            if count:
                selection = [pt.iscalar(f"start{i}") for i in range(len(wholes))]
                stand_ins = [RowWindow(count)(whole, start) for whole, start in zip(wholes, selection)]
            else:
                selection = [pt.ivector("rows")]
                stand_ins = [whole[selection[0]] for whole in wholes]
            fn = self._selected[key] = self._compile_per_slice(subset, [*wholes, *selection], stand_ins)
        return fn

    def _compile_per_slice(self, subset: Subset, extra_inputs: list[Any], stand_ins: list[Any]) -> Any:
        """``inputs + bcast_inputs + extra_inputs -> outputs + update values``, each sliceable
        variable replaced by its stand-in (an expression of ``extra_inputs``).  The updated
        variables' ``default_update`` (a generator's next state) stays out: their values are outputs."""
        spec = self.spec
        outputs = self.output_variables(subset) + [e for _, e in spec.updates]
        return self._compile([*spec.all_inputs, *extra_inputs], outputs, [],
                             [*spec.givens, *zip(spec.sliceable, stand_ins)], subset,
                             no_default_updates=[v for v, _ in spec.updates])

    def _compile(self, inputs: list[Any], outputs: list[Any], updates: list[Any], givens: list[Any],
                 subset: Subset, no_default_updates: list[Any] | None = None) -> Any:
        import warnings

        import pytensor

        from synkhronos import precision

        def build(**kwargs: Any) -> Any:
            kwargs = precision.compile_kwargs(self.spec.precision, kwargs, self.device)  # the policy's one hook
            if no_default_updates:
                kwargs["no_default_updates"] = no_default_updates
            with warnings.catch_warnings():  # PyTensor 3.3 deprecates no_default_updates (not yet removed)
                warnings.simplefilter("ignore", DeprecationWarning)
                return pytensor.function(inputs, outputs, updates=updates, givens=givens or None,
                                         name=self.spec.name, **kwargs)

        t0 = time.perf_counter()
        from synkhronos.ops import in_program_collectives

        with in_program_collectives(self.collectives):
            fn = self.device.compile(build, self._kwargs(subset), self.spec.name, collectives=self.has_collectives,
                                     in_program=self.all_reduces_in_program)
        self.compile_seconds += time.perf_counter() - t0
        fn.trust_input = True  # inputs are checked in the master (dtype, ndim) before any call
        return fn

    def shared_vars(self) -> list[Any]:
        """Every shared variable the function reads or updates."""
        seen: dict[Any, None] = {}
        for var in [*self.full().get_shared(), *self.spec.sliceable, *(v for v, _ in self.spec.updates)]:
            seen.setdefault(var, None)
        return list(seen)

    @property
    def uses_random_state(self) -> bool:
        """Whether a random generator is among the function's shared variables (computed once)."""
        found = self.__dict__.get("_uses_random_state")
        if found is None:
            found = self.__dict__["_uses_random_state"] = any(_is_random_state(v) for v in self.shared_vars())
        return bool(found)

    def settle_updates(self) -> None:
        """After PyTensor applied the updates itself (a one-pass call): where values are computed
        by JAX (GPU mode, CPU mode's JAX backend), each updated value in its variable's declared
        dtype (see :func:`_declared`).  Every rank must hold the same dtype, or NCCL would move a
        different number of bytes in each."""
        if self.device.computes_in_jax and "updates" not in self._exact:
            updated = [var for var, _ in self.spec.updates]
            values = [var.container.storage[0] for var in updated]
            for var, value in zip(updated, self._in_declared("updates", values, updated)):
                var.container.storage[0] = value

    def _in_declared(self, kind: Any, values: list[Any], variables: Sequence[Any]) -> list[Any]:
        """``values`` in their variables' declared dtypes (:func:`_declared`), checked until one
        call of this ``kind`` finds them all so."""
        if kind in self._exact:
            return values
        out = _declared(values, variables)
        if all(map(operator.is_, out, values)):
            self._exact.add(kind)
        return out

    # -- a rank's share of a call ---------------------------------------------------------------
    def run(self, scattered: Sequence[Any], bcast: Sequence[Any], sliceable_rows: Sequence[Any] | None,
            subset: Subset, num_slices: int, n_rows: int) -> list[Any]:
        """Compute this rank's outputs (combined over slices) and apply its updates locally.

        ``scattered`` are this rank's rows of the scattered inputs, ``bcast`` the whole broadcast
        inputs, ``sliceable_rows`` the row selection (a slice with concrete bounds, or an index
        array) of each sliceable shared variable, None when the call has no ``batch_s``;
        ``n_rows`` the rows this rank computes on.  The outputs stay where they were computed
        (on a GPU: not waited for); :func:`synkhronos.calls.reply` brings them to the host.
        """
        spec = self.spec
        if num_slices == 1 and sliceable_rows is None:
            outs = self.full(subset)(*scattered, *bcast)
            if not isinstance(outs, list):
                outs = [outs]
            kind = ("outputs", subset)
            if kind not in self._exact:  # once a call found them declared, they stay so
                outs = self._in_declared(kind, outs, self.output_variables(subset))
            self.settle_updates()
            return outs
        device = self.device
        n_out = len(self.output_variables(subset))
        ops = self.output_ops(subset)
        if sliceable_rows is None:  # several slices, no batch_s: every row of each sliceable shared
            sliceable_rows = [slice(0, device.length(var), 1) for var in spec.sliceable]
        in_function = device.use_gpu and bool(spec.sliceable) and all(
            not isinstance(rows, slice) or rows.step == 1 for rows in sliceable_rows)
        wholes = [device.raw(var) for var in spec.sliceable] if in_function else []
        positions = np.arange(n_rows)
        outs_per_slice: list[list[Any]] = []
        weights: list[int] = []
        streams = [j for j, (var, _) in enumerate(spec.updates) if _is_random_state(var)]
        for chunk in np.array_split(positions, num_slices):
            if len(chunk) == 0 and not self.has_collectives:
                continue
            lo, hi = (int(chunk[0]), int(chunk[-1]) + 1) if len(chunk) else (0, 0)  # a rank without rows
            xs = [x[lo:hi] for x in scattered]                                       # still meets the collectives
            selections = [_subrows(rows, lo, hi) for rows in sliceable_rows]
            if in_function and isinstance(selections[0], slice) and hi > lo:
                starts = [np.int32(sel.start) for sel in selections]
                outs = self.selected(subset, hi - lo)(*xs, *bcast, *wholes, *starts)
            elif in_function:  # batch_s indices: the same for every sliceable variable (or no rows)
                rows = selections[0] if hi > lo else np.empty(0, dtype=np.int32)
                outs = self.selected(subset, 0)(*xs, *bcast, *wholes, np.asarray(rows, dtype=np.int32))
            else:
                ss = [device.take(var, sel) for var, sel in zip(spec.sliceable, selections)]
                outs = self.parts(subset)(*xs, *bcast, *ss)
            for j in streams:  # a random stream advances slice by slice: each slice draws new numbers
                device.put_update(spec.updates[j][0], outs[n_out + j])
            outs_per_slice.append(outs)
            weights.append(hi - lo)
        if not outs_per_slice:
            return []

        def combined(op: str, values: list[Any]) -> Any:  # one slice of no rows (collectives): as it is
            return values[0] if weights == [0] else combine(op, values, weights, xp=device.xp)

        outputs = _declared([combined(ops[i], [o[i] for o in outs_per_slice]) for i in range(n_out)],
                            self.output_variables(subset))
        for j, (var, _) in enumerate(spec.updates):  # combined where they live (GPU: no host round trip)
            if j in streams:
                continue
            device.put_update(var, combined(spec.update_ops[j], [o[n_out + j] for o in outs_per_slice]))
        return outputs


def _is_random_state(var: Any) -> bool:
    """Whether ``var`` holds a random generator's state (its updates are not combined over slices)."""
    from pytensor.tensor.random.type import RandomType

    return isinstance(var.type, RandomType)


def _declared(values: list[Any], variables: Sequence[Any]) -> list[Any]:
    """Each array value in its variable's declared dtype.  PyTensor's JAX backend returns a reduction
    in its accumulator dtype (a float32 sum as float64 when jax x64 is on, i.e. under floatX=float64)."""
    out = []
    for value, var in zip(values, variables):
        dtype = _declared_dtype(var)
        out.append(value.astype(dtype) if dtype is not None and getattr(value, "dtype", dtype) != dtype else value)
    return out


def _declared_dtype(var: Any) -> Any:
    """``var``'s dtype (None for a non-array type): a numpy dtype where the type has one (a
    tensor's), since comparing a value's dtype with a dtype name parses the name every time."""
    vtype = var.type
    dtype = getattr(vtype, "numpy_dtype", None)
    return getattr(vtype, "dtype", None) if dtype is None else dtype


def _subrows(rows: Any, lo: int, hi: int) -> Any:
    """Positions ``lo:hi`` of a row selection (a slice or an index array)."""
    if isinstance(rows, slice):
        start, step = rows.start or 0, rows.step or 1
        stop = start + hi * step  # -1 for a negative step that ends at row 0: that is None, not the last row
        return slice(start + lo * step, stop if stop >= 0 else None, step)
    return rows[lo:hi]
