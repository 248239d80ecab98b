"""``synkhronos.function``: build a data-parallel function; :class:`Function`: call it.

A call (all in the master, before any worker is told to act, so that a bad argument changes
nothing anywhere):

1. bind the Data arguments (inputs, then broadcast inputs; keywords by the variable's name) and
   check their type (a :class:`~synk_shm.Data`, holding memory, of the input's dtype and ndim);
2. turn ``batch`` into each rank's rows and ``batch_s`` into each rank's selection;
3. write the plan into the shared scratch slots and start the call in every rank
   (:mod:`synkhronos.calls`), the master computing its own share;
4. combine the ranks' outputs by each output's op (:mod:`synkhronos.reduce_ops`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import numpy as np

from synk_comm import WorkerError
from synk_shm import Data
from synkhronos import calls, data_registry
from synkhronos.distribution import ensure_distributed
from synkhronos.engine.phases import PHASES
from synkhronos.errors import DivergentGradientError
from synkhronos.inflight import Deferred
from synkhronos.replica import Replica
from synkhronos.runtime import Runtime, current, describe, get_runtime, submit
from synkhronos.spec import FunctionSpec, parse_outputs, parse_updates

__all__ = ["Function", "function"]




@contextmanager
def _selection_errors() -> Iterator[None]:
    """A command whose every failing rank found a bad ``batch_s`` selection raises one
    :class:`~synkhronos.calls.SelectionError` (not a WorkerError)."""
    try:
        yield
    except WorkerError as exc:
        _raise_selection_error(exc)
        raise


def _raise_selection_error(exc: WorkerError) -> None:
    """Raise one :class:`~synkhronos.calls.SelectionError` where every failing rank found a bad
    ``batch_s`` selection (else return: the caller raises ``exc``)."""
    if all(e.type_name == "SelectionError" for e in exc.errors):
        raise calls.SelectionError("; ".join(e.message for e in exc.errors)) from None


def _finish_call(rt: Runtime, own_exc: BaseException | None) -> None:
    """End a call's command (:meth:`synk_comm.Group.finish_command`), a selection error as one."""
    try:
        rt.group.finish_command(own_exc)
    except WorkerError as exc:
        _raise_selection_error(exc)
        raise


def _row_limit(scattered: list[Data]) -> int | None:
    """The rows a batch's indices may address: the shortest scattered input that is not a
    minibatch Data (None when every one is: there the batch's positions read its rows)."""
    return min((len(d) for d in scattered if not d.minibatch), default=None)


class Function:
    """A data-parallel PyTensor function (made by :func:`synkhronos.function`).

    Call it as the PyTensor function, with :class:`~synk_shm.Data` arguments instead of numpy
    arrays; see :meth:`__call__`.
    """

    def __init__(self, spec: FunctionSpec, replica: Replica) -> None:
        self._spec = spec
        self._replica = replica
        self._by_name: dict[str, int] = {}
        self._plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # see _known_plan
        for i, var in enumerate(spec.all_inputs):
            if var.name:
                self._by_name.setdefault(var.name, i)

    # -- attributes of the seed -----------------------------------------------------------------
    @property
    def name(self) -> str | None:
        """As in PyTensor functions."""
        return self._spec.name

    @property
    def precision(self) -> str:
        """The precision policy its products compute under (:mod:`synkhronos.precision`)."""
        return self._spec.precision

    @property
    def output_modes(self) -> list[str | None]:
        """The reduce op of each output (``None`` for gather)."""
        return [None if op == "gather" else op for op in self._spec.output_ops]

    @property
    def update_modes(self) -> list[str]:
        """The op that combines each update over slices (``num_slices`` > 1)."""
        return list(self._spec.update_ops)

    @property
    def inputs(self) -> list[Any]:
        return list(self._spec.inputs)

    @property
    def bcast_inputs(self) -> list[Any]:
        return list(self._spec.bcast_inputs)

    def __repr__(self) -> str:
        return f"<synkhronos.Function {self.name or self._spec.fid}>"

    # -- the call -------------------------------------------------------------------------------
    def __call__(self, *args: Any, output_subset: Sequence[int] | None = None, batch: Any = None,
                 batch_s: Any = None, num_slices: int = 1, **kwargs: Any) -> Any:
        """Run on every rank and return the combined outputs.

        Parameters
        ----------
        *args, **kwargs : Data
            One per input, then one per broadcast input; keywords name the variable
            (its ``.name``).  Scattered inputs split along axis 0, as evenly as possible;
            broadcast inputs go whole to every rank.
        output_subset : list of int, optional
            Compute and return only these outputs, in this order.
        batch : int, slice, list or 1-d int array, optional
            Rows of the scattered inputs to use, selected before the split: an int ``k`` means
            ``[:k]``.  For a list or array, each rank gathers its own rows straight from the Data.
            A minibatch Data (``minibatch=True``) holds only the batch: position ``i`` of the
            batch reads its row ``i``.
        batch_s : slice, list or 1-d int array, or a list of those (one per rank), optional
            Rows of each rank's sliceable shared variables, selected after the split.
        num_slices : int, optional
            Each rank computes its rows in this many slices (to save memory), combining outputs
            and updates over the slices before the ranks combine theirs.  1 for a function whose
            graph holds in-graph collectives (:mod:`synkhronos.ops`).

        Returns
        -------
        An array for a single output, a list for a list of outputs (in ``output_subset`` order),
        None when the function has no outputs.

        Raises
        ------
        TypeError
            Wrong number of arguments, a non-Data argument, or a Data of the wrong dtype/ndim;
            a batch of floats or 2-d indices; a bad ``output_subset``.
        ValueError
            Inputs of different lengths without ``batch``; indices out of range; ``batch_s`` on a
            function without sliceable shareds; ``num_slices`` < 1, nothing to slice, or > 1 with
            in-graph collectives.
        """
        if PHASES is not None:
            PHASES.begin()
        rt = get_runtime()  # after every call submitted before this one (synkhronos.inflight)
        return self._run_now(rt, args, kwargs, output_subset, batch, batch_s, num_slices)

    def submit(self, *args: Any, output_subset: Sequence[int] | None = None, batch: Any = None,
               batch_s: Any = None, num_slices: int = 1, **kwargs: Any) -> Future[Any]:
        """Start the call and return at once: a :class:`concurrent.futures.Future` of its result.

        Arguments as for :meth:`__call__`; ``future.result()`` returns exactly what ``f(...)``
        returns, or raises what it raises (``f(...)`` is ``f.submit(...).result()``).  Calls run
        in submission order, at most ``max_in_flight`` (a :func:`synkhronos.fork` option) pending:
        ``submit`` blocks while the window is full.  Every other operation of the group (a
        collective, ``get_value``/``set_value``, a Data's ``set_value``/resize/free,
        ``distribute``, ``close``, a synchronous call) waits for the pending calls first.  A call
        that fails cancels the calls submitted before its failure was seen whose results had not
        come back (their futures raise :class:`concurrent.futures.CancelledError` whose
        ``__cause__`` is the failure); the group stays usable.  On the JAX engine the calls are
        pipelined: the workers dispatch a call's program while the one before it runs.  See
        :mod:`synkhronos.inflight`.

        Do not write into a Data that a pending call reads (``d[:] = ...``) before its future
        is done: its contents are read when the call runs.

        Returns
        -------
        concurrent.futures.Future

        Examples
        --------
        >>> pending = [step.submit(x_data, batch=b) for b in batches]    # doctest: +SKIP
        >>> losses = [float(p.result()) for p in pending]                 # doctest: +SKIP
        """
        if type(batch) is np.ndarray:
            batch = batch.copy()  # the caller may reuse its index array for the next batch
        args, kwargs = tuple(args), dict(kwargs)

        def run() -> Any:  # the group it was submitted to (synkhronos.runtime.submit checks)
            rt = current()
            assert rt is not None
            if PHASES is not None:
                PHASES.begin()
            return self._run_now(rt, args, kwargs, output_subset, batch, batch_s, num_slices, defer=True)

        return submit(repr(self), run)

    def _run_now(self, rt: Runtime, args: Sequence[Any], kwargs: Mapping[str, Any], output_subset: Any, batch: Any,
                 batch_s: Any, num_slices: Any, defer: bool = False) -> Any:
        """The call itself, in this thread: the plan (kept, or checked and made), then the engine;
        ``defer`` (a submitted call): the result may be a :class:`~synkhronos.inflight.Deferred`."""
        key = self._plan_key(args, kwargs, output_subset, batch, batch_s, num_slices)
        known = None if key is None else self._known_plan(rt, key)
        if known is not None:
            plan = known[2]
            if known[5] is not None:  # a batch of indices: this call's, checked, into the shared index buffer
                self._write_index_batch(rt, batch, plan, known[5])
        else:
            plan = self._prepare(rt, args, kwargs, self._subset(output_subset), batch, batch_s, num_slices)
            if key is not None:
                known = self._remember(rt, key, plan, index_batch=type(batch) is np.ndarray)
        out = rt.driver.call(rt, self._replica, plan, None if known is None else known[4], defer)
        if isinstance(out, Deferred):
            return out.then(lambda results: self._shape(results, plan))
        return self._shape(out, plan)

    # -- known plans: a call like an earlier one skips its checks --------------------------------
    @staticmethod
    def _plan_key(args: Sequence[Any], kwargs: Mapping[str, Any], output_subset: Any, batch: Any, batch_s: Any,
                  num_slices: Any) -> tuple[Any, ...] | None:
        """The key under which a call's checked plan is kept (see :meth:`_known_plan`), or None for a
        call whose plan is not kept: keywords, ``num_slices`` > 1, a batch other than None, an int, a
        slice or a 1-d numpy array of indices (a training loop's shuffled batch: the plan is kept for
        its length, each call writes its indices), or a ``batch_s`` other than None or one slice of
        int bounds (a training loop's window: the plan holds it whole, and the ranks check it against
        their rows)."""
        if kwargs or type(num_slices) is not int or num_slices != 1:
            return None
        if batch_s is not None and not (type(batch_s) is slice and all(
                v is None or type(v) is int for v in (batch_s.start, batch_s.stop, batch_s.step))):
            return None
        if type(batch) is np.ndarray:
            if batch.ndim != 1 or batch.dtype.kind not in "iu" or not len(batch):
                return None  # the full checks say what is wrong (or that an empty batch is)
            batch_key: Any = ("indices", len(batch))
        elif batch is not None and type(batch) not in (int, slice):
            return None
        else:
            batch_key = (batch.start, batch.stop, batch.step) if type(batch) is slice else batch
        if output_subset is not None and not (type(output_subset) in (list, tuple)
                                              and all(type(i) is int for i in output_subset)):
            return None
        subset_key = None if output_subset is None else tuple(output_subset)
        window_key = None if batch_s is None else (batch_s.start, batch_s.stop, batch_s.step)
        return (subset_key, batch_key, window_key, *map(id, args))

    def _known_plan(self, rt: Runtime, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The kept plan of a call like an earlier one -- the same Data objects, still registered and
        of the same shapes, the same output subset and batch -- with its scratch slots copied back
        into the group's (a dict lookup instead of every check and the plan); None if there is none."""
        known = self._plans.get(key)
        if known is None or known[0]() is not rt or rt.dropped or not self._still(rt, known[1]):
            return None
        self._require_current(rt)
        ensure_distributed(rt)
        slots = known[3]
        rt.group.scratch[:len(slots)] = slots
        return known

    def _remember(self, rt: Runtime, key: tuple[Any, ...], plan: calls.CallPlan,
                  index_batch: bool = False) -> tuple[Any, ...] | None:
        """Keep a checked plan under ``key`` (:meth:`_known_plan`); returns what is kept.

        A plan that reads the shared index buffer is kept only for a batch of indices
        (``index_batch``, a numpy array): each later call checks its own indices against the rows
        of the scattered inputs (kept here, ``known[5]``) and writes them there.  A slice with a
        step (an index batch too) is not kept."""
        index_rows = None
        if plan.index_did >= 0:
            if not index_batch or plan.bs_kind:
                return None
            limit = _row_limit([rt.data[did] for did in plan.data_ids[:len(self._spec.inputs)]])
            index_rows = -1 if limit is None else limit
        if len(self._plans) >= 64:
            self._plans.clear()
        datas = [(did, weakref.ref(rt.data[did]), rt.data[did].shape, rt.data[did].minibatch)
                 for did in plan.data_ids]
        slots = rt.group.scratch[:calls.CallPlan.length_of(rt.group.scratch, rt.size)].copy()
        reason = rt.driver.known_reason(self._replica, plan)
        known = (weakref.ref(rt), datas, plan, slots, reason, index_rows)
        self._plans[key] = known
        return known

    def _write_index_batch(self, rt: Runtime, batch: np.ndarray, plan: calls.CallPlan, rows: int) -> None:
        """A known plan's batch of indices (:meth:`_remember`): checked against ``rows`` (-1: only
        minibatch inputs, whose rows the batch's positions read) and written into the shared
        index buffer, where the plan's ranks read it."""
        index = calls.as_index_array(batch, "batch")
        if rows >= 0:
            index = self._in_range(index, rows, [rt.data[did] for did in plan.data_ids[:len(self._spec.inputs)]])
        data_registry.write_indices(rt, index)

    @staticmethod
    def _still(rt: Runtime, datas: list[tuple[int, weakref.ref[Data], Any, bool]]) -> bool:
        """Whether the Data of a known plan are still registered, of the same shapes and kinds."""
        for did, ref, shape, minibatch in datas:
            d = ref()
            if d is None:
                return False
            if rt.data.get(did) is not d or d.shape != shape or d.minibatch != minibatch:
                return False
        return True

    def _prepare(self, rt: Runtime, args: Sequence[Any], kwargs: Mapping[str, Any], subset: tuple[int, ...] | None,
                 batch: Any, batch_s: Any, num_slices: Any, extra_slots: int = 0) -> calls.CallPlan:
        """Every check of a call, then its plan written into the shared scratch slots (after which
        the command may start).  ``extra_slots``: scratch slots the caller writes after the plan."""
        if not rt.is_master:
            raise RuntimeError("synkhronos functions are called in the master only")
        self._require_current(rt)
        ensure_distributed(rt)
        data_registry.flush_dropped(rt)
        datas = self._bind(args, kwargs)
        group = rt.group
        length = calls.CallPlan.length(len(datas), len(subset or ()), rt.size) + extra_slots
        if length > len(group.scratch):  # before _plan, which may register Data with the workers
            raise ValueError(f"this call needs {length} argument slots; fork(max_n_var=...) reserved "
                             f"{len(group.scratch)}: fork with a larger max_n_var")
        plan = self._plan(rt, datas, subset, batch, batch_s, num_slices)
        calls.encode(plan, group.scratch, rt.size)
        return plan

    def _require_current(self, rt: Runtime) -> None:
        if rt.replicas.get(self._spec.fid) is not self._replica:  # its id may name another function now
            raise RuntimeError(f"{self!r} was built for a group that is closed: build it again with "
                               "synk.function() after synk.fork()")

    def _shape(self, results: list[Any], plan: calls.CallPlan) -> Any:
        """What a call returns: the one output, the list, or None without outputs."""
        if plan.subset is None and self._spec.single_output:
            return results[0]
        if not results:
            return None
        return results

    # -- argument checks ------------------------------------------------------------------------
    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Data]:
        spec = self._spec
        variables = spec.all_inputs
        slots: list[Any] = [None] * len(variables)
        if len(args) > len(variables):
            raise TypeError(f"{self!r} takes {len(variables)} Data arguments ({len(spec.inputs)} inputs, "
                            f"{len(spec.bcast_inputs)} broadcast inputs); got {len(args) + len(kwargs)}")
        for i, a in enumerate(args):
            slots[i] = a
        for key, value in kwargs.items():
            i = self._by_name.get(key, -1)
            if i < 0:
                raise TypeError(f"{self!r} has no input named {key!r}; its inputs are "
                                f"{[v.name for v in variables]}")
            if slots[i] is not None:
                raise TypeError(f"input {key!r} given twice (by position and by keyword)")
            slots[i] = value
        missing = [describe(v) for v, s in zip(variables, slots) if s is None]
        if missing:
            raise TypeError(f"{self!r}: missing Data for input(s) {', '.join(missing)}")
        for var, value in zip(variables, slots):
            data_registry.check_input(value, var)
        return slots

    def _subset(self, output_subset: Sequence[int] | None) -> tuple[int, ...] | None:
        if output_subset is None:
            return None
        n = len(self._spec.outputs)
        if isinstance(output_subset, (str, bytes)) or not isinstance(output_subset, (Sequence, np.ndarray)):
            raise TypeError(f"output_subset must be a list of output indices, got {output_subset!r}")
        subset = []
        for i in output_subset:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
                raise TypeError(f"output_subset must hold ints, got {i!r}")
            if not 0 <= i < n:
                raise ValueError(f"output_subset index {i} out of range: the function has {n} outputs")
            subset.append(int(i))
        if len(set(subset)) != len(subset):
            raise ValueError(f"output_subset has repeated indices: {list(output_subset)}")
        return tuple(subset)

    def _plan(self, rt: Runtime, datas: list[Data], subset: tuple[int, ...] | None, batch: Any,
              batch_s: Any, num_slices: Any) -> calls.CallPlan:
        spec = self._spec
        if not isinstance(num_slices, (int, np.integer)) or isinstance(num_slices, bool) or num_slices < 1:
            raise ValueError(f"num_slices must be an int >= 1, got {num_slices!r}")
        if num_slices > 1 and self._replica.has_collectives:
            raise ValueError("this function's graph holds in-graph collectives (synkhronos.ops), which run once per "
                             "call in every rank: call it with num_slices=1")
        if num_slices > 1 and not spec.inputs and not spec.sliceable:
            raise ValueError("num_slices > 1 needs something to slice: this function has no scattered "
                             "inputs and no sliceable_shareds")
        if batch_s is not None and not spec.sliceable:
            raise ValueError("batch_s selects rows of sliceable shared variables; this function has none "
                             "(declare them with synk.function(..., sliceable_shareds=[...]))")
        scattered = datas[:len(spec.inputs)]
        index_parts: list[np.ndarray] = []
        kind, start, total = self._batch(scattered, batch, index_parts)
        if scattered and total == 0:
            raise ValueError("the call selects no rows of the scattered inputs (empty Data or an empty batch): "
                             "nothing to compute")
        bs_kind, bs = self._batch_s(rt, batch_s, index_parts)
        index_did = -1
        if index_parts:
            indices = index_parts[0] if len(index_parts) == 1 else np.concatenate(index_parts)
            index_did = data_registry.write_indices(rt, indices)
        return calls.CallPlan(spec.fid, int(num_slices), kind, start,
                              [data_registry.data_id(rt, d) for d in datas], subset,
                              calls.normalise_positions(total, rt.size), bs_kind, bs, index_did)

    def _batch(self, scattered: list[Data], batch: Any, index_parts: list[np.ndarray]) -> tuple[int, int, int]:
        """(kind, start, total) of the scattered rows; index batches go into ``index_parts``."""
        if not scattered:
            if batch is not None:
                raise ValueError("batch selects rows of scattered inputs; this function has none")
            return 0, 0, 0
        if batch is None:
            n = len(scattered[0])
            if any(len(d) != n for d in scattered):
                raise ValueError(f"the scattered inputs have different lengths {self._lengths(scattered)}; pass "
                                 "batch= to select the same rows of each")
            return 0, 0, n
        limit = _row_limit(scattered)
        if isinstance(batch, (bool, np.bool_)):
            raise TypeError(f"batch must be an int, a slice, or integer indices, got {batch!r}")
        if isinstance(batch, (int, np.integer)):
            batch = slice(0, int(batch)) if batch >= 0 else batch
            if not isinstance(batch, slice):
                raise ValueError(f"batch={batch} is negative; it must be a count of rows >= 0")
            if limit is not None and batch.stop > limit:
                raise ValueError(f"batch={batch.stop} asks for more rows than the inputs have "
                                 f"({self._lengths(scattered)})")
            self._check_minibatch(scattered, batch.stop)  # batch=k needs k rows, not fewer after clipping
        if isinstance(batch, slice):
            if limit is None:  # only minibatch inputs: the slice counts positions
                limit = min(len(d) for d in scattered)
            start, stop, step = batch.indices(limit)
            rows = range(start, stop, step)
            total = len(rows)
            self._check_minibatch(scattered, total)
            if step == 1:
                return 0, start, total
            index = np.arange(start, stop, step, dtype=np.int64)
        else:
            if isinstance(batch, (float, np.floating, str, bytes)):
                raise TypeError(f"batch must be an int, a slice, or integer indices, got {batch!r}")
            index = calls.as_index_array(batch, "batch")
            total = len(index)
            if limit is not None and total:
                index = self._in_range(index, limit, scattered)
            self._check_minibatch(scattered, total)
        index_parts.append(index)
        return 1, 0, total

    def _in_range(self, index: np.ndarray, limit: int, scattered: list[Data]) -> np.ndarray:
        """``index`` (not empty) with its negative indices counted from the end, as in numpy;
        ValueError for an index out of range of ``limit`` rows."""
        low = int(index.min())
        if int(index.max()) >= limit or low < -limit:
            bad = index[(index >= limit) | (index < -limit)][:5].tolist()
            raise ValueError(f"batch indices {bad} out of range for inputs of lengths {self._lengths(scattered)}")
        return np.where(index < 0, index + limit, index) if low < 0 else index

    def _lengths(self, scattered: list[Data]) -> dict[str, int]:
        return {describe(v): len(d) for v, d in zip(self._spec.inputs, scattered)}

    def _check_minibatch(self, scattered: list[Data], total: int) -> None:
        for var, d in zip(self._spec.inputs, scattered):
            if d.minibatch and len(d) < total:
                raise ValueError(f"minibatch Data for input {describe(var)} has {len(d)} rows; the batch "
                                 f"selects {total} (a minibatch Data holds the batch: row i is position i)")

    def _batch_s(self, rt: Runtime, batch_s: Any, index_parts: list[np.ndarray]) -> tuple[int, np.ndarray | None]:
        if batch_s is None:
            return 0, None
        size = rt.size

        def is_one(sel: Any) -> bool:
            if isinstance(sel, slice):
                return True
            if isinstance(sel, np.ndarray):
                return True
            return isinstance(sel, (list, tuple)) and all(isinstance(i, (int, np.integer)) for i in sel)

        selections = [batch_s] * size if is_one(batch_s) else list(batch_s)
        if len(selections) != size or not all(is_one(s) for s in selections):
            raise TypeError(f"batch_s must be a slice, a list or 1-d int array of rows, or a list of {size} "
                            f"of those (one per rank); got {batch_s!r}")
        kinds = {isinstance(s, slice) for s in selections}
        if len(kinds) > 1:
            raise TypeError("batch_s per rank must be all slices or all index lists")
        bs = np.zeros((size, 3), dtype=np.int64)
        if kinds == {True}:
            for r, s in enumerate(selections):
                for j, v in enumerate((s.start, s.stop, s.step)):
                    if v is not None and not isinstance(v, (int, np.integer)):
                        raise TypeError(f"batch_s slice bounds must be ints or None, got {s!r}")
                    bs[r, j] = calls.NONE if v is None else int(v)
                if s.step == 0:
                    raise ValueError("batch_s slice step cannot be zero")
            return 1, bs
        offset = sum(len(p) for p in index_parts)
        for r, s in enumerate(selections):
            idx = calls.as_index_array(s, "batch_s")
            index_parts.append(idx)
            bs[r] = (offset, len(idx), 0)
            offset += len(idx)
        return 2, bs

    # -- master-only helpers --------------------------------------------------------------------
    def as_theano(self, *args: Any, **kwargs: Any) -> Any:
        """Call the underlying PyTensor function in the master only (inputs, then broadcast
        inputs; numpy arrays or Data).  Only the master's shared values change."""
        values = [np.asarray(a) for a in args]
        named = {k: np.asarray(v) for k, v in kwargs.items()}
        fn = self._replica.full()
        fn.trust_input = False  # user values: let PyTensor check and convert them
        try:
            return fn(*values, **named)
        finally:
            fn.trust_input = True
            self._replica.settle_updates()

    as_pytensor = as_theano

    def build_inputs(self, *args: Any, force_cast: bool = False, oversize: float = 1.0,
                     minibatch: bool | Sequence[bool] = False, **kwargs: Any) -> Data | tuple[Data, ...]:
        """Make one :func:`synkhronos.data` per input (broadcast inputs included) from values given
        as for the PyTensor function; ``minibatch`` may be one flag per input.

        Returns one Data, or a tuple of them.
        """
        variables = self._spec.all_inputs
        values: list[Any] = list(args) + [None] * (len(variables) - len(args))
        for key, value in kwargs.items():
            i = self._by_name.get(key, -1)
            if i < 0:
                raise TypeError(f"{self!r} has no input named {key!r}")
            values[i] = value
        flags = [minibatch] * len(variables) if isinstance(minibatch, bool) else list(minibatch)
        if len(flags) != len(variables):
            raise ValueError(f"minibatch needs one flag per input ({len(variables)}), got {len(flags)}")
        from synkhronos.data_registry import data

        made = tuple(data(value=v, var=var, force_cast=force_cast, oversize=oversize, minibatch=mb)
                     for v, var, mb in zip(values, variables, flags))
        return made[0] if len(made) == 1 else made


def _fold_storage_aliases(outs: list[Any], pairs: list[tuple[Any, Any]], update_ops: list[str],
                          given_pairs: list[tuple[Any, Any]], sliceable: list[Any], rt: Runtime) -> None:
    """Make the shared variables of a function that share one storage one variable (in place).

    ``SharedVariable.clone()`` makes an alias: another variable on the same container.  Lasagne's
    batch norm reads its running averages through such an alias, which carries their
    ``default_update``.  The workers hold each distributed variable's own value, so an alias
    becomes (in ``givens``, and as an update's target) the variable of its storage that the
    function slices, that is distributed already, that the function updates, or else the first
    met; the alias's ``default_update`` becomes that variable's update where it has none (PyTensor
    applies a default update only where no update is given).

    Raises
    ------
    ValueError
        If two updates target one storage.
    """
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Variable

    try:
        from pytensor.graph.traversal import ancestors
    except ImportError:  # PyTensor before 3.3
        from pytensor.graph.basic import ancestors  # type: ignore[no-redef]

    owner: dict[int, Any] = {}
    for var in [*sliceable, *rt.shared_ids]:
        owner.setdefault(id(var.container), var)
    pairs[:] = [(owner.setdefault(id(var.container), var), expr) for var, expr in pairs]
    updated = {id(var) for var, _ in pairs}
    if len(updated) < len(pairs):
        raise ValueError("two updates target one shared variable (or aliases of one, made by SharedVariable.clone()): "
                         "give each variable one update")
    replaced = {v for v, _ in given_pairs}
    roots = [v for v in [*outs, *(e for _, e in pairs), *(g for _, g in given_pairs)] if isinstance(v, Variable)]
    for var in list(ancestors(roots)):
        if not isinstance(var, SharedVariable) or var in replaced:
            continue
        twin = owner.setdefault(id(var.container), var)
        if twin is var:
            continue
        given_pairs.append((var, twin))
        replaced.add(var)
        if var.default_update is not None and id(twin) not in updated:
            more, ops = parse_updates([(twin, var.default_update)])
            pairs += more
            update_ops += ops
            updated.add(id(twin))


def function(inputs: Sequence[Any], outputs: Any = None, bcast_inputs: Sequence[Any] | None = None,
             updates: Any = None, givens: Any = None, sliceable_shareds: Sequence[Any] | None = None,
             precision: str | None = None, **kwargs: Any) -> Function:
    """Build a data-parallel function: the replacement for ``pytensor.function``.

    Parameters
    ----------
    inputs : list of variables
        Scattered along axis 0 over the ranks at each call (ndim >= 1).
    outputs : variable, (variable, op), or a list of those, optional
        ``op`` combines the ranks' values: ``"avg"`` (default; weighted by rows), ``"sum"``,
        ``"prod"``, ``"max"``, ``"min"``, or ``None``/``"gather"`` (concatenate in rank order).
    bcast_inputs : list of variables, optional
        Given whole to every rank.
    updates : list of (shared, expr) or (shared, expr, op), or a dict, optional
        Applied locally in each rank (nothing is communicated unless the graph asks, with the
        in-graph collectives of :mod:`synkhronos.ops`); ``op`` (default ``"avg"``) combines an
        update over slices when ``num_slices`` > 1.
    givens : as in PyTensor, optional
    sliceable_shareds : list of shared variables, optional
        Shared variables that hold data (subject to ``batch_s`` and slicing).
    precision : {"default", "highest", "bf16"}, optional
        How the function's matrix products and convolutions compute (:mod:`synkhronos.precision`):
        ``"default"`` XLA's default (TF32 on Hopper GPUs), ``"highest"`` strict float32, ``"bf16"``
        bfloat16 activations (reductions, parameters and outputs float32).  Default: ``fork``'s
        ``precision``.  A policy other than ``"default"`` needs the function to compile with JAX.
    **kwargs
        Passed to ``pytensor.function`` (``mode``, ``on_unused_input``, ``name``...).

    Returns
    -------
    Function

    Raises
    ------
    RuntimeError
        If Synkhronos is not forked.
    TypeError
        For arguments of the wrong form.
    ValueError
        For an unknown precision policy, or one that cannot apply (a ``mode`` or CPU backend
        without JAX); for an unknown reduce op, a scalar scattered input, a sliceable shared that the
        function does not use, or an in-graph ``broadcast`` whose root is not a rank.
    """
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Variable

    rt = get_runtime()
    if not rt.is_master:
        raise RuntimeError("synkhronos.function() is for the master process")
    inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    bcast = list(bcast_inputs or [])
    for var in [*inputs, *bcast]:
        if not isinstance(var, Variable) or isinstance(var, SharedVariable):
            raise TypeError(f"inputs and bcast_inputs must be symbolic (non-shared) variables, got {var!r}")
    for var in inputs:
        if var.type.ndim < 1:
            raise ValueError(f"scattered input {describe(var)} is 0-d: nothing to split; make it a "
                             "bcast_input")
    outs, output_ops, single = parse_outputs(outputs)
    pairs, update_ops = parse_updates(updates)
    if givens is None:
        given_pairs = []
    elif isinstance(givens, Mapping):
        given_pairs = list(givens.items())
    else:
        given_pairs = [tuple(g) for g in givens]
    sliceable = list(sliceable_shareds or [])
    for var in sliceable:
        if not isinstance(var, SharedVariable):
            raise TypeError(f"sliceable_shareds must be shared variables, got {var!r}")
        if var.type.ndim < 1:
            raise ValueError(f"sliceable shared {describe(var)} is 0-d: it has no rows to slice")
    for var in [*inputs, *bcast, *outs, *sliceable]:
        if getattr(var.type, "ndim", 0) > rt.max_dim:
            raise ValueError(f"{describe(var)} has ndim {var.type.ndim}, more than fork(max_dim={rt.max_dim}): "
                             "fork with a larger max_dim")
    from synkhronos import precision as precisions

    policy = precisions.check(rt.precision if precision is None else precision)
    precisions.check_backend(policy, rt.device, kwargs.get("mode"))
    name = kwargs.pop("name", None)
    _fold_storage_aliases(outs, pairs, update_ops, given_pairs, sliceable, rt)
    spec = FunctionSpec(fid=data_registry.next_function_id(rt), name=name, inputs=inputs, bcast_inputs=bcast,
                        outputs=outs, output_ops=output_ops, single_output=single, updates=pairs,
                        update_ops=update_ops, givens=given_pairs, sliceable=sliceable, kwargs=kwargs,
                        precision=policy)
    replica = Replica(spec, rt.device)
    if replica.has_collectives:
        from synkhronos.ops import check_group, divergent_gradients

        check_group(replica.collectives, rt.size)
        divergent = divergent_gradients([*outs, *(e for _, e in pairs)]) if rt.size > 1 else []
        if divergent:
            raise DivergentGradientError(
                f"this graph differentiates through {', '.join(divergent)} of a value that reads shared variables, "
                "starting from a cost that is the same on every rank: each rank would get its own gradient "
                f"(times {rt.size}), and a replicated variable updated from it would differ between the ranks. "
                "Differentiate each rank's own loss and all-reduce the gradient instead: "
                "ops.all_reduce(pytensor.grad(loss_local, w), 'sum') (or 'avg' for a mean loss), or differentiate "
                "the all-reduce of a scalar loss: pytensor.grad(ops.all_reduce(loss_local, 'avg'), w); see "
                "'Gradients' in synkhronos.ops")
    used = set(replica.full().get_shared())
    for var in sliceable:
        if var not in used:
            raise ValueError(f"sliceable shared {describe(var)} is not used by this function")
    rt.replicas[spec.fid] = replica
    return Function(spec, replica)
