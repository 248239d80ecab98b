"""A data-parallel training step (:class:`TrainFunction`, made by
:func:`~synk_lasagne.training.make_train_function`): called, or submitted for its loss later; it runs
as one function with the all-reduce in its graph where that pays (:func:`in_graph_all_reduce_pays`),
else as a chain."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np

from synkhronos.engine import NotOneProgramError

__all__ = ["TrainFunction", "in_graph_all_reduce_pays"]


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
