"""The :class:`Trainer` and checkpoints: epochs of data-parallel training that can stop and resume.

=================================  ===============================================================
:class:`Trainer`                   epochs with shuffling, validation, a progress bar, per-epoch
                                   records, callbacks, the best and the last checkpoint, early
                                   stopping; :meth:`Trainer.save` / :meth:`Trainer.load` resume a
                                   run exactly where it stopped
:class:`Callback`                  code at the start and end of each epoch and step
:class:`Schedule`                  a hyperparameter (e.g. the learning rate) set in EVERY rank per
                                   epoch or per step
:class:`CSVLogger`                 the epoch records as a CSV file
:class:`TensorBoardLogger`         the epoch records as TensorBoard scalars
:func:`set_in_every_rank`          set a shared variable's value in every rank
:func:`save_checkpoint`            the master writes named variables (``.npz``)
:func:`load_checkpoint`            read them back, by name, into every rank
=================================  ===============================================================

Shared variables and ``set_value``
----------------------------------
Every rank holds its own copy of each shared variable.  ``var.set_value(v)`` in the master changes
the master's copy ONLY: a learning rate set that way (Lasagne's way of scheduling it) leaves the
other ranks on the old value, and the ranks' parameters drift apart.  Set a value in every rank with
:func:`set_in_every_rank` (one :func:`synkhronos.broadcast` of the value), or let a
:class:`Schedule` do it each epoch.

Example
-------
>>> import numpy as np, pytensor
>>> from synk_lasagne import Schedule, Trainer, make_train_function, updates
>>> lr = pytensor.shared(np.float64(0.1), name="learning_rate")
>>> train = make_train_function(loss, params, [x, y], updates.sgd, learning_rate=lr)   # doctest: +SKIP
>>> trainer = Trainer(train, batch_size=64, checkpoint="run/model.npz",              # doctest: +SKIP
...                   callbacks=[Schedule(lr, lambda epoch: 0.1 * 0.5 ** (epoch // 10))])
>>> trainer.fit((x_data, y_data), epochs=20)                                        # doctest: +SKIP
>>> resumed = Trainer(train, batch_size=64, checkpoint="run/model.npz", callbacks=[...])  # doctest: +SKIP
>>> resumed.load("run/model.last.npz")                                              # doctest: +SKIP
>>> resumed.fit((x_data, y_data), epochs=10)    # epochs 21..30, as one run of 30   # doctest: +SKIP
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from synk_lasagne.callbacks import Callback as Callback
from synk_lasagne.callbacks import CSVLogger as CSVLogger
from synk_lasagne.callbacks import Schedule as Schedule
from synk_lasagne.callbacks import TensorBoardLogger as TensorBoardLogger
from synk_lasagne.checkpoints import _read_meta, _window_depth, set_in_every_rank
from synk_lasagne.checkpoints import load_checkpoint as load_checkpoint
from synk_lasagne.checkpoints import save_checkpoint as save_checkpoint
from synk_lasagne.trainer_state import TrainerState

__all__ = ["Trainer"]  # and, from the modules that define them, its parts: Callback ... set_in_every_rank

log = logging.getLogger(__name__)


# --- the trainer ----------------------------------------------------------------------------------

class Trainer(TrainerState):
    """Epochs of data-parallel training, with validation, progress, callbacks, checkpoints, early
    stopping, and an exact resume.

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
        Show a tqdm progress bar (loss and samples/s) per epoch on stderr; None: only when stderr
        is a terminal (not in logs).
    verbose : bool or int
        Write one summary line per epoch (and a line when early stopping ends the run) to stdout;
        an int ``k``: the lines of epoch 1 and of every ``k``-th epoch only.
        ``progress=False, verbose=False`` train silently; the library's other messages go to
        :mod:`logging` (logger ``synk_lasagne.trainer``).
    checkpoint : str or path, optional
        After each epoch, the whole state (:meth:`save`) goes to ``<root>.last<ext>`` beside it
        (:attr:`last_checkpoint`; ``run/model.npz`` -> ``run/model.last.npz``), and, when the
        epoch is the best so far by ``monitor``, to ``checkpoint`` itself (every epoch when nothing
        is monitored).  A file that holds a better ``monitor`` score is never overwritten.
    monitor : str
        The metric for early stopping and best checkpoints (a key of the epoch records, e.g.
        ``"valid_loss"`` or ``"valid_accuracy"``).
    mode : {"min", "max"}
        Whether smaller or larger values of ``monitor`` are better.
    patience : int, optional
        Stop after this many epochs in a row without improvement (None: never stop early).
    restore_best : bool
        At the end of :meth:`fit`, put back the parameters and state of the best epoch.
    callbacks : list of Callback, optional
        Run at the start and end of each epoch and step (:class:`Callback`, :class:`Schedule`,
        :class:`CSVLogger`, :class:`TensorBoardLogger`).

    Attributes
    ----------
    history : list of dict
        Every epoch's record (see :meth:`fit`).
    epoch, step : int
        Epochs and steps done (a resumed run counts on).
    best, best_epoch : float or None, int or None
        The best ``monitor`` value so far and its epoch.
    epochs_without_improvement : int
        The early-stopping counter.

    Data patterns
    -------------
    Host shared memory: ``fit((x_data, y_data), ...)`` -- each step passes ``batch=`` indices of a
    shuffled order; each rank gathers its own rows.  Scattered data: ``fit((), ...)`` with a train
    function over ``sliceable_shareds`` (filled once by :func:`synkhronos.scatter`) -- each rank
    shuffles its own rows and each step passes ``batch_s=`` one index array per rank.

    Resuming
    --------
    :meth:`save` writes the whole state and :meth:`load`, on a new Trainer over the same model,
    puts it back: the next :meth:`fit` goes on exactly as the run would have without the stop
    (the same shuffled orders, steps and values, bit for bit in CPU mode).  The state: the
    parameters (by name), the update rule's state, each rank's own layer state (batch norm's
    running averages), the epoch and step counts, the best score, its epoch and its values, the
    early-stopping counter, the history, and the shuffling generator.  Not in it: dropout's random
    generators inside the ranks (a resumed run draws other masks; a warning says so once) and the
    hyperparameters' shared variables (a :class:`Schedule` sets them again from the epoch).
    """

    # -- the loop -------------------------------------------------------------------------------
    def fit(self, train: Sequence[Any] = (), epochs: int = 1, valid: Sequence[Any] | None = None, *,
            restore_best: bool | None = None) -> list[dict[str, Any]]:
        """Train for ``epochs`` epochs (fewer if early stopping or a callback ends the run).

        A later call, or one after :meth:`load`, goes on from where the run stopped (epochs and
        steps count on; the best epoch, the early-stopping counter and the shuffled orders go on).

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
            ``samples_per_s``, after validation ``valid_<metric>`` and ``valid_seconds``, and what
            callbacks add (a :class:`Schedule`'s value).  A step with a number of rows that the
            Trainer has not run yet compiles (JAX compiles a program per shape): the epoch's
            record then has ``warmup_seconds``, the time of those steps, and its
            ``samples_per_s`` counts the epoch's other steps only (all of them when every step
            was such a step).
        """
        from tqdm.auto import tqdm

        train = tuple(train)
        if valid is not None and self.eval_fn is None:
            raise ValueError("valid= data given but this Trainer has no eval_fn to run on them")
        names = self.train_fn.output_names
        first = self.epoch + 1
        records: list[dict[str, Any]] = []
        self.stopped_early = False
        self.stop_training = False
        try:
            for epoch in range(first, first + epochs):
                for cb in self.callbacks:
                    cb.on_epoch_begin(self, epoch)
                batches = self._host_batches(train) if train else self._scattered_batches()
                if not batches:
                    have = f"the {len(train[0])} rows of the training data" if train else "a rank's scattered rows"
                    raise ValueError(f"an epoch has no batch: batch_size={self.batch_size} is more than {have}, "
                                     "and drop_last=True drops the one smaller batch; pass a smaller batch_size "
                                     "or drop_last=False")
                record = self._train_epoch(epoch, train, batches, names, tqdm)
                if valid is not None:
                    t1 = time.perf_counter()
                    record.update({f"valid_{k}": v for k, v in self.evaluate(tuple(valid)).items()})
                    record["valid_seconds"] = time.perf_counter() - t1
                for cb in self.callbacks:
                    cb.add_to_record(self, record)
                self.history.append(record)
                records.append(record)
                if self._writes(epoch):
                    tqdm.write(_summary(record))
                self._after_epoch(record)
                for cb in self.callbacks:
                    cb.on_epoch_end(self, record)
                if self.patience is not None and self.epochs_without_improvement >= self.patience:
                    self.stopped_early = True
                    message = (f"early stop after epoch {epoch}: no better {self.monitor} than {self.best:.6g} "
                               f"(epoch {self.best_epoch}) for {self.epochs_without_improvement} epoch(s)")
                    log.info("%s", message)
                    if self.verbose:
                        tqdm.write(message)
                    break
                if self.stop_training:
                    log.info("a callback stopped the run after epoch %d", epoch)
                    break
        finally:
            for cb in self.callbacks:
                cb.on_fit_end(self)
        if self.restore_best if restore_best is None else restore_best:
            self.restore_best_epoch()
        return records

    def _writes(self, epoch: int) -> bool:
        if isinstance(self.verbose, bool):
            return self.verbose
        return epoch == 1 or epoch % int(self.verbose) == 0

    def _train_epoch(self, epoch: int, train: tuple[Any, ...], batches: list[tuple[dict[str, Any], int]],
                     names: list[str], tqdm: Any) -> dict[str, Any]:
        total = sum(n for _, n in batches)
        sums = np.zeros(len(names))
        rows = 0
        warmup_seconds, warmup_rows = 0.0, 0
        bar = tqdm(total=total, desc=f"epoch {epoch}", unit="sample", unit_scale=True, leave=False,
                   disable=None if self.progress is None else not self.progress, mininterval=0.5)
        t0 = time.perf_counter()
        lag = _window_depth() - 1
        pending: collections.deque[tuple[Future[Any], int, int]] = collections.deque()

        def finish(future: Future[Any], n: int, step: int) -> None:
            nonlocal rows
            out = future.result()
            values = [float(np.asarray(v)) for v in ([out] if len(names) == 1 else out)]
            sums[:] += [v * n for v in values]
            rows += n
            bar.update(n)
            bar.set_postfix(loss=f"{sums[0] / rows:.4f}", refresh=False)
            for cb in self.callbacks:
                cb.on_step_end(self, step, dict(zip(names, values)))

        try:
            for kwargs, n in batches:
                step = self.step + 1
                for cb in self.callbacks:
                    cb.on_step_begin(self, step)
                if n in self._sizes:  # submitted: its loss is read up to ``lag`` steps later
                    pending.append((self.train_fn.submit(*train, **kwargs), n, step))
                    self.step = step
                    while len(pending) > lag:
                        finish(*pending.popleft())
                    continue
                while pending:  # a step of a new size compiles: timed alone, after the steps before it
                    finish(*pending.popleft())
                ts = time.perf_counter()
                done: Future[Any] = Future()
                done.set_result(self.train_fn(*train, **kwargs))
                warmup_seconds += time.perf_counter() - ts
                warmup_rows += n
                self._sizes.add(n)
                self.step = step
                finish(done, n, step)
            while pending:
                finish(*pending.popleft())
        finally:
            bar.close()
        seconds = time.perf_counter() - t0
        record: dict[str, Any] = {"epoch": epoch}
        record.update({f"train_{name}": s / max(rows, 1) for name, s in zip(names, sums)})
        timed_seconds, timed_rows = seconds, rows
        if warmup_rows and warmup_rows < rows:
            timed_seconds, timed_rows = seconds - warmup_seconds, rows - warmup_rows
        record.update({"samples": rows, "seconds": seconds,
                       "samples_per_s": timed_rows / timed_seconds if timed_seconds > 0 else 0.0})
        if warmup_rows:
            record["warmup_seconds"] = warmup_seconds
        return record

    def restore_best_epoch(self) -> bool:
        """Put back the parameters and optimizer state of the best epoch so far in every rank (what
        :meth:`fit` ends with); True if they changed.  The Trainer keeps them only when its
        ``restore_best`` is True."""
        if self._best_values is None or not self.history or self.best_epoch == self.history[-1]["epoch"]:
            return False
        set_in_every_rank(self.train_fn.variables, self._best_values)
        return True

    def _after_epoch(self, record: dict[str, Any]) -> None:
        """Track the best epoch and the early-stopping counter; write the checkpoints."""
        if self.monitor not in record:
            if self.patience is not None:
                raise ValueError(f"cannot stop early on {self.monitor!r}: the epoch records have "
                                 f"{sorted(record)} (give valid= data and an eval_fn, or another monitor)")
            improved = True
        else:
            value = float(record[self.monitor])
            improved = self._improved(value)
            if improved:
                self.best, self.best_epoch = value, int(record["epoch"])
                if self.restore_best:
                    self._best_values = self._values()
        self.epochs_without_improvement = 0 if improved else self.epochs_without_improvement + 1
        if self.checkpoint is None:
            return
        last = self.last_checkpoint
        assert last is not None
        self.save(last)
        if improved and not self._better_on_disk():
            tmp = f"{self.checkpoint}.tmp{os.getpid()}"
            shutil.copyfile(last, tmp)
            os.replace(tmp, self.checkpoint)
            log.info("epoch %d: best %s so far, saved to %s", record["epoch"], self.monitor, self.checkpoint)

    def _better_on_disk(self) -> bool:
        """Whether the best checkpoint's file holds a better score than this Trainer's best (a file
        of another run: it is kept, with a warning)."""
        assert self.checkpoint is not None
        if self.best is None or not os.path.exists(self.checkpoint):
            return False
        try:
            meta = _read_meta(self.checkpoint)
        except (OSError, ValueError, KeyError):
            return False
        theirs = meta.get("best")
        if meta.get("monitor") != self.monitor or meta.get("mode") != self.mode or theirs is None:
            return False
        if not (theirs < self.best if self.mode == "min" else theirs > self.best):
            return False
        log.warning("%s holds %s %.6g (epoch %s), better than this run's best %.6g: it is kept, this run's best goes "
                    "to %s only (load the file with Trainer.load to go on from it, or give another checkpoint=)",
                    self.checkpoint, self.monitor, theirs, meta.get("best_epoch"), self.best, self.last_checkpoint)
        return True


def _duration(seconds: float) -> str:
    """``"812 ms"``, ``"3.47 s"``: never ``"0.00 s"``."""
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.2f} s"


def _summary(record: Mapping[str, Any]) -> str:
    parts = [f"epoch {record['epoch']}"]
    for key, value in record.items():
        if key.startswith(("train_", "valid_")) and not key.endswith("_seconds"):
            parts.append(f"{key} {value:.4f}")
    parts.append(f"{record['samples_per_s']:.0f} samples/s")
    parts.append(_duration(record["seconds"]))
    text = ", ".join(parts)
    if "warmup_seconds" in record:
        text += f" ({_duration(record['warmup_seconds'])} of it in steps that compile)"
    return text
