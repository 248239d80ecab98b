"""Callbacks of the :class:`~synk_lasagne.Trainer`: :class:`Callback` (code at the start and end of
each epoch and step), :class:`Schedule` (a hyperparameter set in every rank), :class:`CSVLogger` and
:class:`TensorBoardLogger` (the epoch records)."""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from synk_lasagne.checkpoints import set_in_every_rank

if TYPE_CHECKING:
    from synk_lasagne.trainer import Trainer

__all__ = ["CSVLogger", "Callback", "Schedule", "TensorBoardLogger"]


class Callback:
    """Code that runs inside :meth:`Trainer.fit`: subclass it and override what you need.

    ``step`` counts the steps of the whole run (1, 2, ... across epochs, calls of ``fit`` and a
    resume).  Set ``trainer.stop_training = True`` to end ``fit`` after the current epoch.  The
    methods run in the master, in the order of the Trainer's ``callbacks``.
    """

    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None:
        """Before the epoch's first step."""

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        """Before each step."""

    def on_step_end(self, trainer: Trainer, step: int, outputs: Mapping[str, float]) -> None:
        """After each step; ``outputs``: ``{"loss": ..., <output>: ...}`` of this step's batch."""

    def add_to_record(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """Add entries to the epoch's record before anything reads it (loggers, checkpoints)."""

    def on_epoch_end(self, trainer: Trainer, record: Mapping[str, Any]) -> None:
        """After the epoch, its validation and its checkpoints; ``record``: the epoch's record."""

    def on_fit_end(self, trainer: Trainer) -> None:
        """When ``fit`` ends (also after early stopping or an error in a step)."""


class Schedule(Callback):
    """A hyperparameter held in a shared variable, set in EVERY rank from the epoch (or the step).

    Each epoch (``per="epoch"``) or step (``per="step"``) starts with ``variable`` set to
    ``fn(epoch)`` (or ``fn(step)``) in every rank (:func:`set_in_every_rank`); the value is
    recorded in the epoch's record under the variable's name.  The value depends only on the
    epoch or step number, so a resumed run (:meth:`~synk_lasagne.Trainer.load`) gets the same values.

    Parameters
    ----------
    variable : shared variable
        E.g. the ``learning_rate`` given to the update rule: ``lr = pytensor.shared(np.float32(0.01),
        name="learning_rate")``, ``make_train_function(..., learning_rate=lr)``.
    fn : callable
        ``fn(epoch) -> value`` (epochs count from 1), or ``fn(step) -> value``.
    per : {"epoch", "step"}
        A step schedule costs a broadcast per step; an epoch schedule one per epoch.
    name : str, optional
        Its key in the epoch records (default: the variable's name).

    Examples
    --------
    >>> decay = Schedule(lr, lambda epoch: 0.01 * 0.5 ** ((epoch - 1) // 10))       # doctest: +SKIP
    >>> warm_up = Schedule(lr, lambda step: 0.01 * min(1.0, step / 100), per="step")  # doctest: +SKIP
    """

    def __init__(self, variable: Any, fn: Callable[[int], Any], *, per: str = "epoch", name: str | None = None):
        if per not in ("epoch", "step"):
            raise ValueError(f"per must be 'epoch' or 'step', got {per!r}")
        if not hasattr(variable, "get_value") or not hasattr(variable.type, "dtype"):
            raise TypeError(f"Schedule needs a shared variable holding an array (e.g. the learning rate given to "
                            f"the update rule as pytensor.shared(...)), got {variable!r}")
        self.variable = variable
        self.fn = fn
        self.per = per
        self.name = name or variable.name or "schedule"
        self.value: float | None = None

    def _set(self, count: int) -> None:
        value = np.asarray(self.fn(count), dtype=self.variable.type.dtype)
        set_in_every_rank(self.variable, value)
        self.value = float(value) if value.ndim == 0 else None

    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None:
        if self.per == "epoch":
            self._set(epoch)

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        if self.per == "step":
            self._set(step)

    def add_to_record(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.value is not None:
            record[self.name] = self.value  # per step: the epoch's last value


class CSVLogger(Callback):
    """The epoch records as rows of a CSV file (one column per key of the first record).

    A fresh run writes the file anew; a run that goes on (a later ``fit``, or one resumed with
    :meth:`~synk_lasagne.Trainer.load`) appends to it, so that the file holds the whole run.

    Parameters
    ----------
    path : str or path
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._columns: list[str] | None = None

    def on_epoch_end(self, trainer: Trainer, record: Mapping[str, Any]) -> None:
        append = len(trainer.history) > 1 and os.path.exists(self.path)
        if self._columns is None and append:
            with open(self.path, newline="") as f:
                self._columns = next(csv.reader(f), None)
        if self._columns is None or not append:
            self._columns = list(record)
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(self._columns)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self._columns, extrasaction="ignore").writerow(record)


def _summary_writer() -> Callable[..., Any] | None:
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter  # type: ignore[no-any-return]
    except ImportError:
        pass
    try:
        from tensorboardX import SummaryWriter

        return SummaryWriter  # type: ignore[no-any-return]
    except ImportError:
        return None


class TensorBoardLogger(Callback):
    """The numbers of each epoch record as TensorBoard scalars (``tensorboard --logdir DIR``).

    Uses ``torch.utils.tensorboard`` or, without PyTorch, ``tensorboardX``.

    Parameters
    ----------
    logdir : str or path

    Raises
    ------
    ImportError
        When neither is installed, with what to install.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        writer = _summary_writer()
        if writer is None:
            raise ImportError("TensorBoardLogger needs torch.utils.tensorboard or tensorboardX: "
                              "pip install tensorboardX (or torch), or log with CSVLogger instead")
        self.writer = writer(os.fspath(logdir))

    def on_epoch_end(self, trainer: Trainer, record: Mapping[str, Any]) -> None:
        epoch = int(record["epoch"])
        for key, value in record.items():
            if key != "epoch" and isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
                self.writer.add_scalar(key, float(value), epoch)
        self.writer.flush()

    def on_fit_end(self, trainer: Trainer) -> None:
        self.writer.flush()


