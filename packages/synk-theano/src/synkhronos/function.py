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

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from synk_shm import Data
from synkhronos import calls, data_registry
from synkhronos.engine.phases import PHASES
from synkhronos.errors import DivergentGradientError
from synkhronos.inflight import Deferred
from synkhronos.known_plans import KnownPlans
from synkhronos.replica import Replica
from synkhronos.runtime import Runtime, current, describe, get_runtime, submit
from synkhronos.spec import FunctionSpec, _fold_storage_aliases, parse_outputs, parse_updates

__all__ = ["Function", "function"]


class Function(KnownPlans):
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

    def _shape(self, results: list[Any], plan: calls.CallPlan) -> Any:
        """What a call returns: the one output, the list, or None without outputs."""
        if plan.subset is None and self._spec.single_output:
            return results[0]
        if not results:
            return None
        return results

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
