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
from typing import Any

import numpy as np

from synk_lasagne import updates as _updates
from synk_lasagne.train_function import TrainFunction as TrainFunction
from synk_lasagne.train_function import in_graph_all_reduce_pays as in_graph_all_reduce_pays

__all__ = ["EvalFunction", "make_eval_function", "make_train_function"]  # and TrainFunction, in_graph_all_reduce_pays

Rule = Callable[..., Any]
"""An update rule of :mod:`synk_lasagne.updates` (or one with its signature and return value)."""


def _outputs(named: Mapping[str, Any] | None) -> tuple[list[str], list[Any]]:
    """Names and Synkhronos outputs (``var`` or ``(var, op)``) of a mapping ``name -> output``."""
    if named is None:
        return [], []
    if not isinstance(named, Mapping):
        raise TypeError(f"outputs must be a mapping name -> expression (or (expression, op)), got {named!r}")
    return list(named), list(named.values())


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
