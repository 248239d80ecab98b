"""Training with Synkhronos: one call per data-parallel step, a small trainer, and checkpoints.

=================================  ===============================================================
:func:`make_train_function`        gradient, all-reduce and update in ONE function ->
                                   :class:`TrainFunction` (``batch=`` / ``batch_s=`` /
                                   ``num_slices=`` as any Synkhronos function)
:func:`make_eval_function`         named metrics over a whole data set -> :class:`EvalFunction`
                                   (returns a dict; ``num_slices`` to bound memory)
:class:`Trainer`                   epochs with shuffling, validation, a progress bar, per-epoch
                                   metrics, checkpoints, early stopping
:func:`save_checkpoint`            the master writes parameters and optimizer state (``.npz``)
:func:`load_checkpoint`            read them back into every rank
=================================  ===============================================================

Exact averages
--------------
The loss is a mean over the rows of each rank's share, and the shares can differ by a row (a
batch of 100 over 3 ranks is 34 + 33 + 33).  The training function passes the rank's row count as
the weight of :func:`synk_lasagne.updates.flat_gradient`: each rank's flat gradient holds
``rows * gradient`` and ``rows``, the step all-reduces it (sum) inside its graph
(:func:`synkhronos.ops.all_reduce`) and the update divides the sums, so the step is the one a
single process takes on the whole batch; the loss output is averaged with the same weights by
Synkhronos.  A rank that gets no rows (a batch smaller than the number of ranks) adds nothing:
it contributes zeros to the all-reduce, and applies the same update as the others.

Example
-------
>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> import synkhronos as synk
>>> from synk_lasagne import Trainer, make_eval_function, make_train_function, updates
>>> synk.fork(2, use_gpu=False)                                                 # doctest: +SKIP
2
>>> x, y = pt.matrix("x"), pt.ivector("y")
>>> w = pytensor.shared(np.zeros((4, 3)), name="w")
>>> logp = pt.special.log_softmax(x @ w, axis=1)
>>> loss = -pt.mean(logp[pt.arange(y.shape[0]), y])
>>> accuracy = pt.mean(pt.eq(pt.argmax(logp, axis=1), y))
>>> train = make_train_function(loss, [w], [x, y], updates.adam, learning_rate=0.01)  # doctest: +SKIP
>>> evaluate = make_eval_function({"loss": loss, "accuracy": accuracy}, [x, y])      # doctest: +SKIP
>>> rng = np.random.default_rng(0)
>>> x_data = synk.data(rng.normal(size=(300, 4)))                              # doctest: +SKIP
>>> y_data = synk.data(rng.integers(0, 3, 300).astype("int32"))                # doctest: +SKIP
>>> trainer = Trainer(train, eval_fn=evaluate, batch_size=32, patience=3)      # doctest: +SKIP
>>> history = trainer.fit((x_data, y_data), epochs=5, valid=(x_data, y_data))  # doctest: +SKIP
>>> sorted(history[-1])                                                        # doctest: +SKIP
['epoch', 'samples', 'samples_per_s', 'seconds', 'train_loss', 'valid_accuracy', 'valid_loss', 'valid_seconds']
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np

from synk_lasagne import updates as _updates
from synkhronos.engine import NotOneProgramError

__all__ = ["EvalFunction", "TrainFunction", "in_graph_all_reduce_pays", "make_eval_function", "make_train_function"]

Rule = Callable[..., Any]
"""An update rule of :mod:`synk_lasagne.updates` (or one with its signature and return value)."""


def _outputs(named: Mapping[str, Any] | None) -> tuple[list[str], list[Any]]:
    """Names and Synkhronos outputs (``var`` or ``(var, op)``) of a mapping ``name -> output``."""
    if named is None:
        return [], []
    if not isinstance(named, Mapping):
        raise TypeError(f"outputs must be a mapping name -> expression (or (expression, op)), got {named!r}")
    return list(named), list(named.values())


def _empty(batch: Any) -> bool:
    if batch is None or isinstance(batch, slice):
        return False
    if isinstance(batch, (int, np.integer)) and not isinstance(batch, bool):
        return int(batch) == 0
    return hasattr(batch, "__len__") and len(batch) == 0


class TrainFunction:
    """One data-parallel training step per call: made by :func:`make_train_function`.

    Attributes
    ----------
    function : synkhronos.Function
        The step as ONE Synkhronos function: the loss (and outputs) and its gradient on each
        rank's rows, the in-graph all-reduce of the flat gradient
        (:func:`synkhronos.ops.all_reduce`), the update rule (the function's updates).  What a
        call with ``num_slices=1`` runs (on 2+ GPUs: :attr:`chain`, see
        :func:`in_graph_all_reduce_pays`): one command, one compiled function per rank.
    chain : synkhronos.Chain
        The step for ``num_slices`` > 1 (built on first use): ``grad_fn`` accumulates the flat
        gradient over the slices, the chain all-reduces it (sum) and runs ``step_fn``.
    grad_fn, step_fn : synkhronos.Function
        The two functions of :attr:`chain` (built on first use).
    updates : OrderedDict
        What the update rule returned, reading the all-reduced :attr:`flat_grad`.
    flat_grad : shared variable
        The flat gradient of the chain, ``[rows * g, rows]`` (see
        :func:`synk_lasagne.updates.flat_gradient`).
    params : list of shared variables
    state : list of shared variables
        The rule's state (velocities, moments, the step counter), in update order.
    output_names : list of str
        ``"loss"`` then the names of the extra outputs.
    """

    def __init__(self, function: Any, updates: Mapping[Any, Any], flat_grad: Any, params: list[Any],
                 output_names: list[str], inputs: list[Any], sliceable_shareds: list[Any],
                 build_sliced: Callable[[], tuple[Any, Any]], own_mode: bool = False) -> None:
        self.function = function
        self.own_mode = own_mode
        """Whether the functions compile in a PyTensor mode given by ``function_kwargs`` (see
        :func:`in_graph_all_reduce_pays`)."""
        self.updates = updates
        self.flat_grad = flat_grad
        self.params = params
        kept = set(params)
        self.state = [var for var in updates if var not in kept]
        self.output_names = output_names
        self.inputs = inputs
        self.sliceable_shareds = sliceable_shareds
        self._build_sliced = build_sliced
        self._sliced: tuple[Any, Any, Any] | None = None
        self._whole: bool | None = None
        """Whether a call of :attr:`function` ran (True) or the engine refused it as one program
        (False); None before the first call (see :meth:`submit`)."""

    @property
    def precision(self) -> str:
        """The step's precision policy (:mod:`synkhronos.precision`)."""
        return str(self.function.precision)

    def _sliced_step(self) -> tuple[Any, Any, Any]:
        if self._sliced is None:
            import synkhronos as synk

            grad_fn, step_fn = self._build_sliced()
            chain = synk.chain(grad_fn, all_reduce=self.flat_grad, op="sum", then=step_fn, zeros_if_idle=True)
            self._sliced = (grad_fn, step_fn, chain)
        return self._sliced

    @property
    def grad_fn(self) -> Any:
        """Computes the loss (and outputs) and writes each rank's gradient into ``flat_grad``."""
        return self._sliced_step()[0]

    @property
    def step_fn(self) -> Any:
        """Applies the update from the all-reduced ``flat_grad`` in every rank."""
        return self._sliced_step()[1]

    @property
    def chain(self) -> Any:
        """``grad_fn``, the all-reduce of ``flat_grad`` (sum) and ``step_fn`` as one command."""
        return self._sliced_step()[2]

    @property
    def variables(self) -> list[Any]:
        """Parameters then state: what a checkpoint holds."""
        return [*self.params, *self.state]

    def __call__(self, *data: Any, batch: Any = None, batch_s: Any = None, num_slices: int = 1,
                 **named: Any) -> Any:
        """One step: gradient of this batch in every rank, all-reduce, the same update everywhere.

        Parameters
        ----------
        *data, **named : synkhronos.Data
            The inputs, then the broadcast inputs, as for the Synkhronos function.
        batch : int, slice, list or int array, optional
            Rows of the inputs (selected before the split over ranks).
        batch_s : as in Synkhronos, optional
            Rows of each rank's sliceable shared variables (selected after the split).
        num_slices : int, optional
            Accumulate each rank's gradient over this many slices (to bound memory); > 1 runs
            :attr:`chain` instead of :attr:`function` (as does a call that the JAX engine cannot
            run as one program, see :func:`synkhronos.engine.program.per_rank_reason`; a batch
            that splits unevenly over the ranks runs as one program there).

        Returns
        -------
        The loss (a 0-d array), or a list ``[loss, *outputs]`` when the function has outputs:
        each the value over the whole batch.

        Raises
        ------
        ValueError
            For an empty batch (no rank would have anything to learn from), and every error of a
            Synkhronos call.
        """
        if _empty(batch):
            raise ValueError("the batch is empty: a training step needs at least one row")
        whole = num_slices == 1 and in_graph_all_reduce_pays(self.own_mode)
        step = self.function if whole else self.chain
        try:
            out = step(*data, batch=batch, batch_s=batch_s, num_slices=num_slices, **named)
        except NotOneProgramError:  # the JAX engine, a call it cannot run as one program (uneven shares with
            # sliceable shared variables, a random generator): refused before any rank acted
            self._whole = False
            out = self.chain(*data, batch=batch, batch_s=batch_s, num_slices=num_slices, **named)
        else:
            if whole and self._whole is None:
                self._whole = True
        return self._shape(out)

    def _shape(self, out: Any) -> Any:
        return out[0] if len(self.output_names) == 1 else out

    def submit(self, *data: Any, batch: Any = None, batch_s: Any = None, num_slices: int = 1,
               **named: Any) -> Future[Any]:
        """One step, submitted (:meth:`synkhronos.Function.submit`): returns at once a
        :class:`concurrent.futures.Future` of what :meth:`__call__` returns.

        Steps run in submission order with at most ``max_in_flight`` (a :func:`synkhronos.fork`
        option) pending; on the JAX engine the next step's program is dispatched while this one
        runs (see the GPU guide).  The parameters after submitted steps are those after the same
        synchronous steps, bit for bit.

        The step is submitted when it runs as :attr:`function` (one call: ``num_slices=1``, see
        :func:`in_graph_all_reduce_pays`), the engine ran an earlier step of it so (the first step
        is synchronous: it compiles, and tells whether the JAX engine takes the step as one program),
        and it reads no sliceable shared variables or reads them through a ``batch_s`` slice (the same
        rows in every rank; other selections the JAX engine runs as :attr:`chain`).
        Otherwise it runs synchronously here and the future returned is done.

        Raises
        ------
        ValueError
            For an empty batch; the step's own errors are raised by its future.
        """
        if _empty(batch):
            raise ValueError("the batch is empty: a training step needs at least one row")
        if (num_slices == 1 and self._whole and (not self.sliceable_shareds or type(batch_s) is slice)
                and in_graph_all_reduce_pays(self.own_mode)):
            return _StepFuture(self.function.submit(*data, batch=batch, batch_s=batch_s, **named), self._shape)
        done: Future[Any] = Future()
        try:
            done.set_result(self(*data, batch=batch, batch_s=batch_s, num_slices=num_slices, **named))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def __repr__(self) -> str:
        return f"<synk_lasagne.TrainFunction of {len(self.params)} params, outputs {self.output_names}>"


class _StepFuture(Future):  # type: ignore[type-arg]
    """A submitted step's future: the Synkhronos call's future, its result shaped as the step's."""

    def __init__(self, inner: Future[Any], shape: Callable[[Any], Any]) -> None:
        super().__init__()
        self._inner = inner
        self._shape = shape
        self.set_running_or_notify_cancel()
        inner.add_done_callback(self._copy)

    def _copy(self, inner: Future[Any]) -> None:
        if inner.cancelled():
            self.set_exception(CancelledError("the step was cancelled"))
            return
        exc = inner.exception()
        if exc is not None:
            self.set_exception(exc)
        else:
            self.set_result(self._shape(inner.result()))

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:  # waiting on the call's own future asks the window for it (a fetch where needed)
                self._inner.result(timeout)
            except BaseException:  # raised below, from this future
                pass
        return super().result(timeout)


def in_graph_all_reduce_pays(own_mode: bool = False) -> bool:
    """Whether a training step runs as :attr:`TrainFunction.function` (the in-graph all-reduce)
    rather than :attr:`TrainFunction.chain`: with one rank, under the JAX engine (GPU mode's),
    in CPU mode with PyTensor's default backend or a mode of the function's own (``own_mode``),
    in CPU mode's JAX backend where the all-reduce runs inside each rank's program (a C++
    compiler built :mod:`synk_comm.xla_cpu`), and in GPU mode under the per-rank engine
    (``engine="ranks"``); not in CPU mode's JAX backend without it (``SYNK_CPU_IN_PROGRAM=0``).

    With PyTensor's default backend the in-graph all-reduce takes the same shared-memory path as
    the chain's, and one function saves a call and a barrier (``benchmarks/RESULTS.md``).  CPU
    mode's JAX backend runs the all-reduce inside the rank's XLA program, so the step is one JAX
    call (the main job: a median of 1.46x over one process against the chain's 1.37x,
    ``benchmarks/RESULTS.md``, "The main job"); without that it compiles a graph with in-graph
    collectives in the default mode (see :meth:`synkhronos.device.Device.in_graph_collectives_pay`),
    which would cost the step JAX's speed, and the chain keeps both of its functions in JAX.  Under
    the JAX engine a function is one program over the
    ranks' devices (``jax_funcify(..., synk_axis=...)``), where the in-graph all-reduce is XLA's
    own.  GPU mode's per-rank engine runs it as a host callback (the gradient through host
    memory), which is what the chain's all-reduce does too there (through host shared memory):
    one function saves a command.
    """
    from synkhronos.runtime import current

    rt = current()
    if rt is None or rt.size == 1 or rt.engine is not None:
        return True
    return rt.device.in_graph_collectives_pay(own_mode)  # where the collectives run: the device decides


def make_train_function(loss: Any, params: Sequence[Any], inputs: Sequence[Any], rule: Rule = _updates.sgd, *,
                        outputs: Mapping[str, Any] | None = None, bcast_inputs: Sequence[Any] | None = None,
                        sliceable_shareds: Sequence[Any] | None = None, givens: Any = None, weight: Any = None,
                        function_kwargs: Mapping[str, Any] | None = None, precision: str | None = None,
                        all_reduce_dtype: str | None = None, **hyperparameters: Any) -> TrainFunction:
    """A callable that runs one data-parallel training step: gradient, all-reduce, update.

    ONE Synkhronos function, one command per call: every rank computes the loss and its gradient
    on its share of the batch, the flat gradient (``[weight * g, weight]``, see
    :mod:`synk_lasagne.updates`) is all-reduced INSIDE the graph
    (``synkhronos.ops.all_reduce(flat, "sum")``), and the update rule, reading the all-reduced
    gradient, is the function's updates: the same step in every rank.  Call it as a Synkhronos
    function: ``train(x_data, y_data, batch=indices)`` for data in host shared memory, or
    ``train(batch_s=rows)`` for data scattered into sliceable shared variables.  With
    ``num_slices`` > 1 the step runs as a chain (:attr:`TrainFunction.chain`): the gradient
    accumulated over the slices, then all-reduced, then the update.  The state updates of the
    layers the loss is built on (:func:`synk_lasagne.layers.get_state_updates`: batch norm's
    running averages from each rank's own share of the batch, dropout's generators) are applied in
    each rank with the step.

    Parameters
    ----------
    loss : scalar expression
        The loss as a MEAN over the rows of the inputs (plus any row-independent terms).
    params : list of shared variables
        The variables to train.
    inputs : list of variables
        Scattered over the ranks (e.g. ``[x, y]``); may be empty when the data are
        ``sliceable_shareds``.
    rule : callable, optional
        An update rule with Lasagne's signature, ``rule(loss_or_grads, params, **hyperparameters)``
        returning an ``OrderedDict`` of updates: any of :mod:`synk_lasagne.updates` (default
        :func:`~synk_lasagne.updates.sgd`) or one of the user's.  It is called once, on the
        gradients of the whole batch (views of the all-reduced flat gradient), inside
        :func:`~synk_lasagne.updates.no_all_reduce`.
    outputs : mapping of str to expression or (expression, op), optional
        Extra outputs, returned after the loss (e.g. ``{"accuracy": acc}``); op default "avg".
    bcast_inputs, sliceable_shareds, givens : optional
        As for :func:`synkhronos.function`.
    weight : symbolic scalar, optional
        The rank's weight in the gradient average.  Default: its number of rows,
        ``inputs[0].shape[0]`` (or ``sliceable_shareds[0].shape[0]``), which makes the step exact
        for any split of the batch; see :mod:`synk_lasagne.updates`.
    function_kwargs : mapping, optional
        Passed to every :func:`synkhronos.function` call (e.g. ``{"mode": "FAST_COMPILE"}``).
    precision : {"default", "highest", "bf16"}, optional
        The precision policy of the step (:mod:`synkhronos.precision`; default: the fork's).
        ``"bf16"``: bfloat16 activations (products accumulating in float32); reductions, the
        parameters, the rule's state and the updates stay float32.
    all_reduce_dtype : {None, "bfloat16"}, optional
        ``"bfloat16"``: the ranks exchange the gradient as bfloat16 (half the bytes, as PyTorch DDP's
        ``bf16_compress_hook``; :func:`synkhronos.ops.all_reduce`'s ``dtype``): the summed gradient
        has a relative error up to about 2**-8 per element; the rows' weights, the parameters and the
        rule's state stay float32.  Any ``precision``; the one-call step only (``num_slices`` > 1
        sums its chain's flat gradient in float32).  None (the default): float32.
    **hyperparameters
        Passed to ``rule`` (``learning_rate=...``, ``momentum=...``, ``grad_transform=...``).

    Returns
    -------
    TrainFunction

    Raises
    ------
    RuntimeError
        If Synkhronos is not forked.
    TypeError, ValueError
        For bad arguments (as :func:`synkhronos.function` and the rule raise them).

    Notes
    -----
    Why ``sum`` and not ``avg``: the flat gradient carries each rank's weight, ``[w_r g_r, w_r]``,
    and the rule reads ``sum_r w_r g_r / sum_r w_r``, exact for any ``weight``.  (``avg`` would
    weight each rank by its rows a second time.)  A rank without rows contributes zeros, as
    every in-graph collective does, and applies the same update as the others.

    On the JAX engine (GPU mode) the step all-reduces each parameter's part of the flat gradient
    on its own (the parts that :func:`synk_lasagne.updates.flat_gradient` concatenates): XLA
    combines them into a few
    collectives and starts each while the rest of the backward pass runs (one all-reduce of the
    whole vector could only start after it); measured on 2 H100s in ``benchmarks/RESULTS.md``.
    Elsewhere (CPU mode's shared-memory collectives) one all-reduce of the flat vector is cheaper.
    """
    import pytensor.tensor as pt
    from pytensor.graph.replace import clone_replace
    from pytensor.tensor.basic import Join

    import synkhronos as synk
    from synk_lasagne.layers.base import get_state_updates
    from synkhronos.runtime import current

    inputs = list(inputs)
    sliceable = list(sliceable_shareds or [])
    params = list(params)
    if weight is None:
        if inputs:
            weight = inputs[0].shape[0]
        elif sliceable:
            weight = sliceable[0].shape[0]
        else:
            weight = 1.0
    # the rule reads the views of the flat gradient [rows * g, rows] summed over the ranks (its
    # own average off); the one-function step replaces that vector by its in-graph all-reduce
    flat, local_flat, views = _updates.flat_gradient(loss, params, weight)
    with _updates.no_all_reduce():
        step = rule(views, params, **hyperparameters)
    if not isinstance(step, Mapping):
        raise TypeError(f"the rule must return Lasagne's OrderedDict of updates, got {type(step).__name__}")
    step = OrderedDict(step)
    names, extra = _outputs(outputs)
    fkw = dict(function_kwargs or {})
    if precision is not None:
        fkw["precision"] = precision
    common = {"bcast_inputs": bcast_inputs, "givens": givens, "sliceable_shareds": sliceable or None, **fkw}
    outs = [(loss, "avg"), *extra]
    state = get_state_updates([loss, *(e[0] if isinstance(e, tuple) else e for e in extra)])
    targets = list(step)
    rt = current()
    node = local_flat.owner
    if rt is not None and rt.engine is not None and rt.size > 1 and node is not None and isinstance(node.op, Join):
        # one all-reduce per part of the flat gradient's concatenation (a sum all-reduce of each part,
        # concatenated, is the all-reduce of the whole), see Notes; the parts are the vectors it joins
        # (PyTensor before 3.3 passes the axis as a 0-d first input)
        parts = [part for part in node.inputs if part.ndim == 1]  # the last: the weight, summed in float32
        reduced = pt.concatenate([synk.ops.all_reduce(part, "sum", all_reduce_dtype) for part in parts[:-1]]
                                 + [synk.ops.all_reduce(parts[-1], "sum")])
    elif all_reduce_dtype is not None:  # the gradient in all_reduce_dtype, the weight (the last value) in float32
        reduced = pt.concatenate([synk.ops.all_reduce(local_flat[:-1], "sum", all_reduce_dtype),
                                  synk.ops.all_reduce(local_flat[-1:], "sum")])
    else:
        reduced = synk.ops.all_reduce(local_flat, "sum")
    stepped = clone_replace(list(step.values()), replace={flat: reduced})
    function = synk.function(inputs, outputs=outs, updates=[*zip(targets, stepped), *state], **common)

    def build_sliced() -> tuple[Any, Any]:
        grad_fn = synk.function(inputs, outputs=outs, updates=[(flat, local_flat, "sum"), *state], **common)
        return grad_fn, synk.function([], updates=list(step.items()), **fkw)

    return TrainFunction(function, step, flat, params, ["loss", *names], inputs, sliceable, build_sliced,
                         own_mode=fkw.get("mode") is not None)


class EvalFunction:
    """Named metrics over a data set: made by :func:`make_eval_function`.

    Calling it returns ``{name: float}``; each metric is combined over the ranks (and slices) by
    its op (default avg, weighted by rows: the mean over the whole data set).
    """

    def __init__(self, fn: Any, names: list[str]) -> None:
        self.fn = fn
        self.names = names

    def __call__(self, *data: Any, batch: Any = None, batch_s: Any = None, num_slices: int = 1,
                 **named: Any) -> dict[str, float]:
        values = self.fn(*data, batch=batch, batch_s=batch_s, num_slices=num_slices, **named)
        return {name: float(np.asarray(v)) for name, v in zip(self.names, values)}

    def __repr__(self) -> str:
        return f"<synk_lasagne.EvalFunction {self.names}>"


def make_eval_function(metrics: Mapping[str, Any], inputs: Sequence[Any], *,
                       bcast_inputs: Sequence[Any] | None = None, sliceable_shareds: Sequence[Any] | None = None,
                       givens: Any = None, function_kwargs: Mapping[str, Any] | None = None,
                       precision: str | None = None) -> EvalFunction:
    """A Synkhronos function of named scalar metrics (e.g. loss and accuracy), returning a dict.

    Parameters
    ----------
    metrics : mapping of str to scalar expression or (expression, op)
        Op default "avg" (the mean over all rows, weighted exactly).
    inputs, bcast_inputs, sliceable_shareds, givens
        As for :func:`synkhronos.function`.
    function_kwargs : mapping, optional
        Passed to :func:`synkhronos.function`.
    precision : {"default", "highest", "bf16"}, optional
        As for :func:`make_train_function`.

    Returns
    -------
    EvalFunction
        ``evaluate(x_data, y_data, num_slices=4) -> {"loss": ..., "accuracy": ...}``
    """
    import synkhronos as synk

    names, outs = _outputs(metrics)
    if not names:
        raise ValueError("make_eval_function needs at least one metric")
    fn = synk.function(list(inputs), outputs=outs, bcast_inputs=bcast_inputs, givens=givens,
                       sliceable_shareds=list(sliceable_shareds) if sliceable_shareds else None,
                       **dict(function_kwargs or {}), **({} if precision is None else {"precision": precision}))
    return EvalFunction(fn, names)
