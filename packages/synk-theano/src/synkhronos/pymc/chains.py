"""``pm.sample``'s chains inside a ``data_parallel`` block: threads of this process whose likelihood
evaluations go to the ranks together, one call per batch (:class:`_Batcher`, :func:`_batched_mp_sample`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from synkhronos.errors import ChainStopped

if TYPE_CHECKING:
    from synkhronos.pymc.split import _Split

_log = logging.getLogger(__name__)


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
