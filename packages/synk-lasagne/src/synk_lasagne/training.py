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

import json
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from synk_lasagne import updates as _updates
from synkhronos.engine import NotOneProgramError

__all__ = ["EvalFunction", "TrainFunction", "Trainer", "in_graph_all_reduce_pays", "load_checkpoint",
           "make_eval_function", "make_train_function", "save_checkpoint"]

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
        step = self.function if num_slices == 1 and in_graph_all_reduce_pays(self.own_mode) else self.chain
        try:
            out = step(*data, batch=batch, batch_s=batch_s, num_slices=num_slices, **named)
        except NotOneProgramError:  # the JAX engine, a call it cannot run as one program (uneven shares with
            # sliceable shared variables, a random generator): refused before any rank acted
            out = self.chain(*data, batch=batch, batch_s=batch_s, num_slices=num_slices, **named)
        return out[0] if len(self.output_names) == 1 else out

    def __repr__(self) -> str:
        return f"<synk_lasagne.TrainFunction of {len(self.params)} params, outputs {self.output_names}>"


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
    ``benchmarks/RESULTS.md`` session 19); without that it compiles a graph with in-graph
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
                        function_kwargs: Mapping[str, Any] | None = None, **hyperparameters: Any) -> TrainFunction:
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
        parts = [part for part in node.inputs if part.ndim == 1]
        reduced = pt.concatenate([synk.ops.all_reduce(part, "sum") for part in parts])
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
                       givens: Any = None, function_kwargs: Mapping[str, Any] | None = None) -> EvalFunction:
    """A Synkhronos function of named scalar metrics (e.g. loss and accuracy), returning a dict.

    Parameters
    ----------
    metrics : mapping of str to scalar expression or (expression, op)
        Op default "avg" (the mean over all rows, weighted exactly).
    inputs, bcast_inputs, sliceable_shareds, givens
        As for :func:`synkhronos.function`.
    function_kwargs : mapping, optional
        Passed to :func:`synkhronos.function`.

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
                       **dict(function_kwargs or {}))
    return EvalFunction(fn, names)


# --- checkpoints ----------------------------------------------------------------------------------

CHECKPOINT_FORMAT = 1


def _master_only(what: str) -> None:
    from synkhronos.runtime import current

    rt = current()
    if rt is not None and not rt.is_master:
        raise RuntimeError(f"{what} runs in the master")


def save_checkpoint(path: str | os.PathLike[str], variables: Sequence[Any], **metadata: Any) -> None:
    """Write the values of ``variables`` (the master's, which every rank shares) to ``path``.

    A numpy ``.npz`` file: ``v0``, ``v1``... in the order of ``variables``, and ``__meta__``, a
    JSON string with their names, shapes and dtypes and ``metadata`` (e.g. the epoch).  Written
    to a temporary file first and renamed, so a crash never leaves half a checkpoint.

    Parameters
    ----------
    path : str or path
        The file (written as given; no suffix is added).
    variables : list of shared variables
        Typically ``train_fn.variables`` (parameters, then optimizer state).
    **metadata
        JSON-serialisable values stored with them.
    """
    _master_only("save_checkpoint")
    path = os.fspath(path)
    values = [np.asarray(var.get_value(borrow=False)) for var in variables]
    meta = {"format": CHECKPOINT_FORMAT, "names": [var.name for var in variables],
            "shapes": [list(v.shape) for v in values], "dtypes": [str(v.dtype) for v in values], **metadata}
    arrays: dict[str, Any] = {f"v{i}": v for i, v in enumerate(values)}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, __meta__=np.array(json.dumps(meta, default=_jsonable)), **arrays)
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"checkpoint metadata must be JSON-serialisable, got {type(value).__name__}")


def load_checkpoint(path: str | os.PathLike[str], variables: Sequence[Any]) -> dict[str, Any]:
    """Read a checkpoint of :func:`save_checkpoint` into ``variables`` in EVERY rank.

    The values go to every rank with one :func:`synkhronos.broadcast` (or into the variables of
    this process when Synkhronos is not forked).

    Parameters
    ----------
    path : str or path
    variables : list of shared variables
        The same variables, in the same order, as when it was saved.

    Returns
    -------
    dict
        The metadata stored with the values.

    Raises
    ------
    ValueError
        If the checkpoint holds a different number of variables or a different shape.
    """
    from synkhronos.runtime import current

    _master_only("load_checkpoint")
    variables = list(variables)
    with np.load(os.fspath(path), allow_pickle=False) as f:
        meta = json.loads(str(f["__meta__"]))
        count = len(meta["names"])
        if count != len(variables):
            raise ValueError(f"the checkpoint {os.fspath(path)!r} holds {count} variables ({meta['names']}); "
                             f"{len(variables)} were given")
        values = [f[f"v{i}"] for i in range(count)]
    for var, value, name in zip(variables, values, meta["names"]):
        shape = np.shape(var.get_value(borrow=True))
        if value.shape != shape:
            raise ValueError(f"the checkpoint's {name!r} has shape {value.shape}; the variable {var.name!r} has "
                             f"shape {shape}")
    values = [np.asarray(v, dtype=var.type.dtype) for var, v in zip(variables, values)]
    rt = current()
    if rt is not None and not rt.group.closed:
        import synkhronos as synk

        synk.broadcast(variables, values=values)
    else:
        for var, value in zip(variables, values):
            var.set_value(value)
    return meta


# --- the trainer ----------------------------------------------------------------------------------

class Trainer:
    """Epochs of data-parallel training, with validation, progress, checkpoints and early stopping.

    Parameters
    ----------
    train_fn : TrainFunction
        From :func:`make_train_function`.
    eval_fn : callable, optional
        ``eval_fn(*valid, num_slices=...) -> {name: value}`` (an :class:`EvalFunction`), run on the
        whole validation set after each epoch; its metrics are recorded as ``valid_<name>``.
    batch_size : int
        Rows per step over all ranks (the global batch).
    shuffle : bool
        A new random order of the rows every epoch (``numpy.random.default_rng(seed)``).
    seed : int
    drop_last : bool
        Skip the last, smaller batch of an epoch (it is exact either way).  In data-parallel training
        that batch costs a whole step's round trip between the ranks for a few rows; Lasagne's MNIST
        example drops it too.  With fewer rows than ``batch_size``, :meth:`fit` raises ValueError.
    eval_slices : int
        ``num_slices`` of the validation call (bounds memory on a large validation set).
    progress : bool or None
        Show a tqdm progress bar (loss and samples/s) per epoch; None: only when stderr is a
        terminal (not in logs).
    verbose : bool
        Write one summary line per epoch.
    checkpoint : str or path, optional
        Save parameters and optimizer state here after each epoch that improves the monitored
        metric (after every epoch when nothing is monitored).
    monitor : str
        The metric for early stopping and best checkpoints (a key of the epoch records, e.g.
        ``"valid_loss"`` or ``"valid_accuracy"``).
    mode : {"min", "max"}
        Whether smaller or larger values of ``monitor`` are better.
    patience : int, optional
        Stop after this many epochs without improvement (None: never stop early).
    restore_best : bool
        At the end of :meth:`fit`, put back the parameters and state of the best epoch.

    Data patterns
    -------------
    Host shared memory: ``fit((x_data, y_data), ...)`` -- each step passes ``batch=`` indices of a
    shuffled order; each rank gathers its own rows.  Scattered data: ``fit((), ...)`` with a train
    function over ``sliceable_shareds`` (filled once by :func:`synkhronos.scatter`) -- each rank
    shuffles its own rows and each step passes ``batch_s=`` one index array per rank.
    """

    def __init__(self, train_fn: TrainFunction, *, eval_fn: Callable[..., Mapping[str, float]] | None = None,
                 batch_size: int = 128, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 eval_slices: int = 1, progress: bool | None = True, verbose: bool = True,
                 checkpoint: str | os.PathLike[str] | None = None, monitor: str = "valid_loss",
                 mode: str = "min", patience: int | None = None, restore_best: bool = True) -> None:
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if patience is not None and patience < 1:
            raise ValueError(f"patience must be >= 1 (or None), got {patience!r}")
        self.train_fn = train_fn
        self.eval_fn = eval_fn
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.rng = np.random.default_rng(seed)
        self.drop_last = drop_last
        self.eval_slices = eval_slices
        self.progress = progress
        self.verbose = verbose
        self.checkpoint = checkpoint
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.restore_best = restore_best
        self.history: list[dict[str, Any]] = []
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.stopped_early = False
        self._best_values: list[np.ndarray] | None = None

    # -- batches --------------------------------------------------------------------------------
    def epoch_size(self, train: Sequence[Any] = ()) -> tuple[int, int, int]:
        """One epoch of :meth:`fit` over ``train``: ``(steps, rows trained, rows available)``.

        The same arithmetic as :meth:`fit`'s batches, without drawing an order: with
        ``drop_last`` the rows trained are fewer than the rows available by the last, smaller
        batch.  ``train`` as in :meth:`fit`: the host pattern's Data, or empty for scattered data
        (then the rows are every rank's).

        Examples
        --------
        >>> Trainer(train, batch_size=1024, drop_last=True).epoch_size((x_data, y_data))  # doctest: +SKIP
        (1, 1024, 1258)
        """
        if train:
            n = self._host_rows(train)
            spans = self._host_spans(n)
            return len(spans), sum(stop - start for start, stop in spans), n
        lengths, shares, steps = self._scattered_split()
        trained = sum(min(n, steps * b) for n, b in zip(lengths, shares))
        return steps, trained, sum(lengths)

    def _host_rows(self, train: Sequence[Any]) -> int:
        n = len(train[0])
        if any(len(d) != n for d in train):
            raise ValueError(f"the training Data have different lengths {[len(d) for d in train]}")
        return n

    def _host_spans(self, n: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each step's positions in an epoch's order of ``n`` rows."""
        bs = self.batch_size
        stops = range(bs, n + 1, bs) if self.drop_last else range(bs, n + bs, bs)
        return [(s - bs, min(s, n)) for s in stops]

    def _host_batches(self, train: Sequence[Any]) -> list[tuple[dict[str, Any], int]]:
        n = self._host_rows(train)
        spans = self._host_spans(n)
        if self.shuffle:
            order = self.rng.permutation(n)
            return [({"batch": order[start:stop]}, stop - start) for start, stop in spans]
        return [({"batch": slice(start, stop)}, stop - start) for start, stop in spans]

    def _scattered_split(self) -> tuple[list[int], list[int], int]:
        """Each rank's rows, its rows per step, and the steps of an epoch (scattered data)."""
        import synkhronos as synk

        sliceable = self.train_fn.sliceable_shareds
        if not sliceable:
            raise ValueError("no training Data given and the train function has no sliceable_shareds: pass "
                             "fit((x_data, y_data), ...), or build the function over scattered shared variables")
        lengths = [int(n) for n in synk.get_lengths(sliceable[0])]
        size = len(lengths)
        if self.batch_size < size:
            raise ValueError(f"batch_size={self.batch_size} is smaller than the number of ranks ({size}) for "
                             "scattered data: each rank needs rows in every step")
        shares = [self.batch_size // size + (r < self.batch_size % size) for r in range(size)]
        if self.drop_last:
            steps = min(n // b for n, b in zip(lengths, shares))
        else:
            steps = max(math.ceil(n / b) for n, b in zip(lengths, shares))
        return lengths, shares, steps

    def _scattered_batches(self) -> list[tuple[dict[str, Any], int]]:
        lengths, shares, steps = self._scattered_split()
        orders = [self.rng.permutation(n) if self.shuffle else np.arange(n) for n in lengths]
        batches = []
        for k in range(steps):
            rows = [o[k * b:(k + 1) * b].astype(np.int64) for o, b in zip(orders, shares)]
            batches.append(({"batch_s": rows}, sum(len(r) for r in rows)))
        return batches

    # -- values for early stopping / checkpoints -----------------------------------------------
    def _values(self) -> list[np.ndarray]:
        return [np.array(var.get_value(borrow=False)) for var in self.train_fn.variables]

    def _improved(self, value: float) -> bool:
        if self.best is None or math.isnan(self.best):
            return not math.isnan(value)
        return value < self.best if self.mode == "min" else value > self.best

    def save(self, path: str | os.PathLike[str], **metadata: Any) -> None:
        """Save parameters and optimizer state (see :func:`save_checkpoint`), with the history."""
        meta = {"epoch": self.history[-1]["epoch"] if self.history else 0, "history": self.history, **metadata}
        save_checkpoint(path, self.train_fn.variables, **meta)

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Load parameters and optimizer state into every rank; returns the checkpoint's metadata
        (and takes its history, so that epochs continue counting)."""
        meta = load_checkpoint(path, self.train_fn.variables)
        if isinstance(meta.get("history"), list):
            self.history = list(meta["history"])
        return meta

    def evaluate(self, data: Sequence[Any] = (), num_slices: int | None = None) -> dict[str, float]:
        """Run ``eval_fn`` over the whole of ``data`` (``num_slices`` default ``eval_slices``)."""
        if self.eval_fn is None:
            raise ValueError("this Trainer has no eval_fn")
        return dict(self.eval_fn(*data, num_slices=num_slices or self.eval_slices))

    # -- the loop -------------------------------------------------------------------------------
    def fit(self, train: Sequence[Any] = (), epochs: int = 1, valid: Sequence[Any] | None = None, *,
            restore_best: bool | None = None) -> list[dict[str, Any]]:
        """Train for ``epochs`` epochs (fewer if early stopping triggers).

        A later call goes on from where this one ended (epochs count on, the best epoch so far is
        remembered).

        Parameters
        ----------
        train : tuple of synkhronos.Data
            The train function's inputs (host pattern); empty for scattered data (``batch_s``).
        epochs : int
        valid : tuple of synkhronos.Data, optional
            The eval function's inputs (empty for an eval function over sliceable shareds);
            None: no validation.
        restore_best : bool, optional
            Whether this call ends with :meth:`restore_best_epoch`; default the Trainer's
            ``restore_best``.  False keeps the last epoch's parameters, e.g. to train on with
            another call: training in several calls then ends with :meth:`restore_best_epoch`.

        Returns
        -------
        list of dict
            One record per epoch of this call (also appended to :attr:`history`): ``epoch``,
            ``train_loss`` (and ``train_<output>``), ``samples``, ``seconds`` (training time),
            ``samples_per_s``, and after validation ``valid_<metric>`` and ``valid_seconds``.
        """
        from tqdm.auto import tqdm

        train = tuple(train)
        if valid is not None and self.eval_fn is None:
            raise ValueError("valid= data given but this Trainer has no eval_fn to run on them")
        names = self.train_fn.output_names
        first = (self.history[-1]["epoch"] if self.history else 0) + 1
        records: list[dict[str, Any]] = []
        self.stopped_early = False
        since_best = 0
        for epoch in range(first, first + epochs):
            batches = self._host_batches(train) if train else self._scattered_batches()
            if not batches:
                have = f"the {len(train[0])} rows of the training data" if train else "a rank's scattered rows"
                raise ValueError(f"an epoch has no batch: batch_size={self.batch_size} is more than {have}, and "
                                 "drop_last=True drops the one smaller batch; pass a smaller batch_size or "
                                 "drop_last=False")
            total = sum(n for _, n in batches)
            sums = np.zeros(len(names))
            rows = 0
            bar = tqdm(total=total, desc=f"epoch {epoch}", unit="sample", unit_scale=True, leave=False,
                       disable=None if self.progress is None else not self.progress, mininterval=0.5)
            t0 = time.perf_counter()
            for kwargs, n in batches:
                out = self.train_fn(*train, **kwargs)
                values = [out] if len(names) == 1 else out
                sums += [float(np.asarray(v)) * n for v in values]
                rows += n
                bar.update(n)
                bar.set_postfix(loss=f"{sums[0] / rows:.4f}", refresh=False)
            seconds = time.perf_counter() - t0
            bar.close()
            record: dict[str, Any] = {"epoch": epoch}
            record.update({f"train_{name}": s / max(rows, 1) for name, s in zip(names, sums)})
            record.update({"samples": rows, "seconds": seconds, "samples_per_s": rows / seconds if seconds else 0.0})
            if valid is not None:
                t1 = time.perf_counter()
                record.update({f"valid_{k}": v for k, v in self.evaluate(tuple(valid)).items()})
                record["valid_seconds"] = time.perf_counter() - t1
            self.history.append(record)
            records.append(record)
            if self.verbose:
                tqdm.write(_summary(record))
            if self._after_epoch(record):
                since_best = 0
            else:
                since_best += 1
                if self.patience is not None and since_best >= self.patience:
                    self.stopped_early = True
                    if self.verbose:
                        tqdm.write(f"early stop after epoch {epoch}: no better {self.monitor} than "
                                   f"{self.best:.6g} (epoch {self.best_epoch}) for {since_best} epoch(s)")
                    break
        if self.restore_best if restore_best is None else restore_best:
            self.restore_best_epoch()
        return records

    def restore_best_epoch(self) -> bool:
        """Put back the parameters and optimizer state of the best epoch so far in every rank (what
        :meth:`fit` ends with); True if they changed.  The Trainer keeps them only when its
        ``restore_best`` is True."""
        if self._best_values is None or not self.history or self.best_epoch == self.history[-1]["epoch"]:
            return False
        self._restore(self._best_values)
        return True

    def _after_epoch(self, record: dict[str, Any]) -> bool:
        """Track the best epoch; save / remember it.  True when this epoch is the best so far."""
        if self.monitor not in record:
            if self.patience is not None:
                raise ValueError(f"cannot stop early on {self.monitor!r}: the epoch records have "
                                 f"{sorted(record)} (give valid= data and an eval_fn, or another monitor)")
            if self.checkpoint is not None:
                self.save(self.checkpoint)
            return True
        value = float(record[self.monitor])
        if not self._improved(value):
            return False
        self.best, self.best_epoch = value, int(record["epoch"])
        if self.restore_best:
            self._best_values = self._values()
        if self.checkpoint is not None:
            self.save(self.checkpoint, best=value, monitor=self.monitor)
        return True

    def _restore(self, values: list[np.ndarray]) -> None:
        import synkhronos as synk

        synk.broadcast(self.train_fn.variables, values=values)


def _summary(record: Mapping[str, Any]) -> str:
    parts = [f"epoch {record['epoch']}"]
    for key, value in record.items():
        if key.startswith(("train_", "valid_")) and not key.endswith("_seconds"):
            parts.append(f"{key} {value:.4f}")
    parts.append(f"{record['samples_per_s']:.0f} samples/s")
    parts.append(f"{record['seconds']:.2f} s")
    return ", ".join(parts)
