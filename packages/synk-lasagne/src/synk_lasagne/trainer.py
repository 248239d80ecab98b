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
import csv
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from synk_lasagne.training import TrainFunction

__all__ = ["CSVLogger", "Callback", "Schedule", "TensorBoardLogger", "Trainer", "load_checkpoint",
           "save_checkpoint", "set_in_every_rank"]

log = logging.getLogger(__name__)


# --- values in every rank -------------------------------------------------------------------------

def _forked() -> bool:
    from synkhronos.runtime import current

    rt = current()
    return rt is not None and not rt.group.closed


def _rank_count() -> int:
    from synkhronos.runtime import current

    rt = current()
    return rt.size if rt is not None and not rt.group.closed else 1


def _window_depth() -> int:
    """The group's ``max_in_flight`` (1 when not forked: nothing to overlap)."""
    from synkhronos.runtime import current

    rt = current()
    return rt.window.max_in_flight if rt is not None and not rt.group.closed else 1


def _master_only(what: str) -> None:
    from synkhronos.runtime import current

    rt = current()
    if rt is not None and not rt.is_master:
        raise RuntimeError(f"{what} runs in the master")


def set_in_every_rank(variables: Any, values: Any) -> None:
    """Set shared variables to the same values in EVERY rank (the master's copy included).

    ``var.set_value(value)`` in the master changes the master's copy only; this is the way to
    change a hyperparameter (a learning rate held in a shared variable, a dropout probability...)
    for the whole group: one :func:`synkhronos.broadcast` of the values.  Without a forked group
    it is ``var.set_value``, as it is for a variable that no Synkhronos function uses yet (the
    workers receive it, with its value, with the first function that does).

    Parameters
    ----------
    variables : shared variable or list of them
    values : array-like or list of them
        Cast to each variable's dtype; each must have the variable's shape.

    Raises
    ------
    ValueError
        If a value's shape differs from its variable's.
    """
    _master_only("set_in_every_rank")
    single = not isinstance(variables, (list, tuple))
    variables = [variables] if single else list(variables)
    values = [values] if single else list(values)
    if len(values) != len(variables):
        raise ValueError(f"{len(variables)} variables but {len(values)} values")
    cast = []
    for var, value in zip(variables, values):
        array = np.asarray(value, dtype=var.type.dtype)
        shape = np.shape(var.get_value(borrow=True))
        if array.shape != shape:
            raise ValueError(f"the value for {var.name or var!r} has shape {array.shape}; the variable has {shape}")
        cast.append(array)
    known: list[Any] = []
    if _forked():
        from synkhronos.distribution import ensure_distributed
        from synkhronos.runtime import current

        rt = current()
        assert rt is not None
        ensure_distributed(rt)
        known = [var for var in variables if var in rt.shared_ids]
    for var, array in zip(variables, cast):
        if var not in known:  # in no Synkhronos function yet: the workers get it, with this value, when one is built
            var.set_value(array)
    if known:
        import synkhronos as synk

        synk.broadcast(known, values=[a for var, a in zip(variables, cast) if var in known])


# --- checkpoints ----------------------------------------------------------------------------------

CHECKPOINT_FORMAT = 2
"""Version of the checkpoint files: arrays stored under the variables' names (1: by position)."""


def _names(variables: Sequence[Any], what: str) -> list[str]:
    """The variables' names, refused when one has none or two share one (a checkpoint matches
    values to variables by name)."""
    names = [var.name for var in variables]
    unnamed = [i for i, name in enumerate(names) if not name]
    if unnamed:
        raise ValueError(f"{what}: the variables at positions {unnamed} have no name, and a checkpoint stores "
                         "values by name: name them (pytensor.shared(..., name='W1'), or a layer's name=)")
    seen: dict[str, int] = {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
    twice = sorted(name for name, count in seen.items() if count > 1)
    if twice:
        raise ValueError(f"{what}: the names {twice} are used by more than one variable, so a checkpoint could "
                         "not tell their values apart: give each a name of its own (e.g. name the layers: "
                         "DenseLayer(..., name='hidden1') names its parameters 'hidden1.W', 'hidden1.b')")
    return names


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"checkpoint metadata must be JSON-serialisable, got {type(value).__name__}")


def _write(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """``arrays`` and ``meta`` as an ``.npz`` file, written to a temporary file and renamed."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, __meta__=np.array(json.dumps(dict(meta), default=_jsonable)), **dict(arrays))  # type: ignore[arg-type]
    os.replace(tmp, path)


def _read(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays (by name) and metadata of a checkpoint file (either format)."""
    with np.load(os.fspath(path), allow_pickle=False) as f:
        meta = json.loads(str(f["__meta__"]))
        if meta.get("format", 1) == 1:  # by position: v0, v1... in the order of meta["names"]
            names = meta["names"]
            if len(set(names)) != len(names):
                raise ValueError(f"{os.fspath(path)!r} is a checkpoint of format 1 whose variables share names "
                                 f"({names}): it can only be read by position, np.load(path)['v0']...")
            arrays = {name: f[f"v{i}"] for i, name in enumerate(names)}
        else:
            arrays = {key: f[key] for key in f.files if key != "__meta__"}
    return arrays, meta


def _read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    with np.load(os.fspath(path), allow_pickle=False) as f:
        return dict(json.loads(str(f["__meta__"])))


def _take(arrays: Mapping[str, np.ndarray], keys: Sequence[str], variables: Sequence[Any],
          path: str | os.PathLike[str]) -> list[np.ndarray]:
    """The values of ``keys`` for ``variables``, checked against their shapes and cast."""
    missing = [key for key in keys if key not in arrays]
    if missing:
        raise ValueError(f"the checkpoint {os.fspath(path)!r} has no values for {missing}; it holds "
                         f"{sorted(arrays)}")
    values = []
    for key, var in zip(keys, variables):
        shape = np.shape(var.get_value(borrow=True))
        if arrays[key].shape != shape:
            raise ValueError(f"the checkpoint's {key!r} has shape {arrays[key].shape}; the variable {var.name!r} "
                             f"has shape {shape}")
        values.append(np.asarray(arrays[key], dtype=var.type.dtype))
    return values


def save_checkpoint(path: str | os.PathLike[str], variables: Sequence[Any], **metadata: Any) -> None:
    """Write the values of ``variables`` (the master's, which every rank shares) to ``path``.

    A numpy ``.npz`` file: one array per variable, stored under the variable's name, and
    ``__meta__``, a JSON string with the names, shapes, dtypes and ``metadata``.  Written to a
    temporary file first and renamed, so that a crash never leaves half a checkpoint.  (A
    :class:`Trainer` saves more: :meth:`Trainer.save`.)

    Parameters
    ----------
    path : str or path
        The file (written as given; no suffix is added).
    variables : list of shared variables
        Each with a name of its own (the values are matched to variables by name on loading).
    **metadata
        JSON-serialisable values stored with them.

    Raises
    ------
    ValueError
        If a variable has no name, or two share one.
    """
    _master_only("save_checkpoint")
    variables = list(variables)
    names = _names(variables, "save_checkpoint")
    values = [np.asarray(var.get_value(borrow=False)) for var in variables]
    meta = {"format": CHECKPOINT_FORMAT, "names": names, "shapes": [list(v.shape) for v in values],
            "dtypes": [str(v.dtype) for v in values], **metadata}
    _write(path, dict(zip(names, values)), meta)


def load_checkpoint(path: str | os.PathLike[str], variables: Sequence[Any]) -> dict[str, Any]:
    """Read the values of ``variables``, by name, from a checkpoint of :func:`save_checkpoint`
    into EVERY rank.

    The values go to every rank with one :func:`synkhronos.broadcast` (or into the variables of
    this process when Synkhronos is not forked).  The checkpoint may hold more variables than
    those asked for.

    Parameters
    ----------
    path : str or path
    variables : list of shared variables
        Named as when they were saved (any order).

    Returns
    -------
    dict
        The metadata stored with the values.

    Raises
    ------
    ValueError
        If a variable has no name or shares one, the checkpoint has no value of that name, or a
        value's shape differs from its variable's.
    """
    _master_only("load_checkpoint")
    variables = list(variables)
    names = _names(variables, "load_checkpoint")
    arrays, meta = _read(path)
    if meta.get("kind") == "trainer":
        names = [f"param/{n}" if f"param/{n}" in arrays else f"optimizer/{n}" for n in names]
    set_in_every_rank(variables, _take(arrays, names, variables, path))
    return meta


def _suffixed(path: str | os.PathLike[str], suffix: str) -> str:
    """``run/model.npz`` -> ``run/model.last.npz`` (``suffix`` "last")."""
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.{suffix}{ext or '.npz'}"


# --- callbacks ------------------------------------------------------------------------------------

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
    epoch or step number, so a resumed run (:meth:`Trainer.load`) gets the same values.

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
    :meth:`Trainer.load`) appends to it, so that the file holds the whole run.

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


# --- the trainer ----------------------------------------------------------------------------------

class Trainer:
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

    def __init__(self, train_fn: TrainFunction, *, eval_fn: Callable[..., Mapping[str, float]] | None = None,
                 batch_size: int = 128, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 eval_slices: int = 1, progress: bool | None = True, verbose: bool | int = True,
                 checkpoint: str | os.PathLike[str] | None = None, monitor: str = "valid_loss",
                 mode: str = "min", patience: int | None = None, restore_best: bool = True,
                 callbacks: Sequence[Callback] | None = None) -> None:
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if patience is not None and patience < 1:
            raise ValueError(f"patience must be >= 1 (or None), got {patience!r}")
        if not isinstance(verbose, (bool, int, np.integer)) or (not isinstance(verbose, bool) and verbose < 1):
            raise ValueError(f"verbose must be True, False or an int >= 1 (a line every k epochs), got {verbose!r}")
        callbacks = list(callbacks or [])
        bad = [cb for cb in callbacks if not isinstance(cb, Callback)]
        if bad:
            raise TypeError(f"callbacks must be Callback instances (subclass synk_lasagne.Callback), got {bad!r}")
        self.train_fn = train_fn
        self.eval_fn = eval_fn
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.rng = np.random.default_rng(seed)
        self.drop_last = drop_last
        self.eval_slices = eval_slices
        self.progress = progress
        self.verbose = verbose
        self.checkpoint = None if checkpoint is None else os.fspath(checkpoint)
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.restore_best = restore_best
        self.callbacks = callbacks
        self.history: list[dict[str, Any]] = []
        self.step = 0
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.epochs_without_improvement = 0
        self.stopped_early = False
        self.stop_training = False
        self._best_values: list[np.ndarray] | None = None
        self._sizes: set[int] = set()  # the batch sizes this Trainer has run (a new one compiles)
        self._warned_generators = False

    @property
    def epoch(self) -> int:
        """The last epoch done (0 before the first)."""
        return int(self.history[-1]["epoch"]) if self.history else 0

    @property
    def last_checkpoint(self) -> str | None:
        """Where each epoch's state goes: beside ``checkpoint``, ``<root>.last<ext>``."""
        return None if self.checkpoint is None else _suffixed(self.checkpoint, "last")

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

    # -- state ----------------------------------------------------------------------------------
    def _values(self) -> list[np.ndarray]:
        return [np.array(var.get_value(borrow=False)) for var in self.train_fn.variables]

    def _improved(self, value: float) -> bool:
        if self.best is None or math.isnan(self.best):
            return not math.isnan(value)
        return value < self.best if self.mode == "min" else value > self.best

    def _rank_state(self) -> tuple[list[Any], list[Any]]:
        """The train function's other updated variables, each rank's own: (arrays, generators)."""
        spec = getattr(self.train_fn.function, "_spec", None)
        known = {*self.train_fn.variables, self.train_fn.flat_grad}
        others = [var for var, _ in (spec.updates if spec is not None else []) if var not in known]
        return [v for v in others if hasattr(v.type, "dtype")], [v for v in others if not hasattr(v.type, "dtype")]

    def _keys(self) -> list[str]:
        """The checkpoint keys of ``train_fn.variables`` (``param/<name>``, ``optimizer/<name>``)."""
        params = _names(self.train_fn.params, "Trainer.save: the parameters")
        state = _names(self.train_fn.state, "Trainer.save: the update rule's state")
        return [f"param/{n}" for n in params] + [f"optimizer/{n}" for n in state]

    def save(self, path: str | os.PathLike[str], **metadata: Any) -> None:
        """Write the whole training state to ``path`` (an ``.npz`` file, see *Resuming*).

        Parameters
        ----------
        path : str or path
        **metadata
            JSON-serialisable values stored with it (returned by :meth:`load`).

        Raises
        ------
        ValueError
            If a parameter has no name or shares one with another (values are stored by name).
        """
        _master_only("Trainer.save")
        keys = self._keys()
        arrays = dict(zip(keys, self._values()))
        per_rank, generators = self._rank_state()
        if generators and not self._warned_generators:
            self._warned_generators = True
            log.warning("Trainer.save: the random generators of %s inside the ranks are not saved: a run resumed "
                        "from this checkpoint draws other random numbers there (e.g. dropout masks)",
                        [g.name for g in generators])
        if per_rank:
            import synkhronos as synk

            names = _names(per_rank, "Trainer.save: the layers' state (batch norm averages...)")
            gathered = synk.gather(per_rank, nd_up=1) if _forked() else \
                [np.asarray(v.get_value())[None] for v in per_rank]
            arrays.update({f"rank/{n}": np.asarray(g) for n, g in zip(names, gathered)})
        if self._best_values is not None:
            arrays.update({f"best/{k}": v for k, v in zip(keys, self._best_values)})
        meta = {"format": CHECKPOINT_FORMAT, "kind": "trainer", "epoch": self.epoch, "step": self.step,
                "best": self.best, "best_epoch": self.best_epoch, "monitor": self.monitor, "mode": self.mode,
                "epochs_without_improvement": self.epochs_without_improvement,
                "stopped_early": self.stopped_early, "shuffle_rng": self.rng.bit_generator.state,
                "ranks": _rank_count(), "names": keys, "history": self.history, **metadata}
        _write(path, arrays, meta)

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Put back the whole state of :meth:`save` into this Trainer and every rank.

        The parameters are matched by name; the update rule's state needs the same rule over the
        parameters in the same order (its state is laid out in their order).

        Returns
        -------
        dict
            The checkpoint's metadata.

        Raises
        ------
        ValueError
            If the file is not a Trainer's checkpoint, or its parameters or rule differ from this
            Trainer's (names, order, shapes).
        """
        _master_only("Trainer.load")
        arrays, meta = _read(path)
        where = os.fspath(path)
        if meta.get("kind") != "trainer":
            raise ValueError(f"{where!r} was written by save_checkpoint, not Trainer.save: read it with "
                             "load_checkpoint(path, variables)")
        keys = self._keys()
        saved_params = [k for k in meta["names"] if k.startswith("param/")]
        params = [k for k in keys if k.startswith("param/")]
        if sorted(saved_params) != sorted(params):
            raise ValueError(f"{where!r} holds the parameters {[k[6:] for k in saved_params]}; this Trainer's are "
                             f"{[k[6:] for k in params]}")
        saved_state = [k for k in meta["names"] if k.startswith("optimizer/")]
        state = [k for k in keys if k.startswith("optimizer/")]
        if saved_state != state:
            raise ValueError(f"{where!r} holds the state {saved_state} of another update rule than this Trainer's "
                             f"({state})")
        if saved_params != params:
            raise ValueError(f"{where!r} was saved with the parameters in the order {[k[6:] for k in saved_params]}; "
                             f"the update rule's state follows that order: build the train function with params "
                             f"in it (now {[k[6:] for k in params]})")
        variables = self.train_fn.variables
        values = _take(arrays, keys, variables, path)
        best = [f"best/{k}" for k in keys]
        best_values = _take(arrays, best, variables, path) if all(b in arrays for b in best) else None
        per_rank, _ = self._rank_state()
        rank_values = []
        if per_rank:
            names = [f"rank/{n}" for n in _names(per_rank, "Trainer.load: the layers' state")]
            missing = [n for n in names if n not in arrays]
            if missing:
                raise ValueError(f"{where!r} has no values for the layers' state {missing}")
            rank_values = [arrays[n] for n in names]
        set_in_every_rank(variables, values)
        self._set_rank_state(per_rank, rank_values, meta.get("ranks", 1))
        self.history = [dict(h) for h in meta.get("history", [])]
        self.step = int(meta.get("step", 0))
        self.best = meta.get("best")
        self.best_epoch = meta.get("best_epoch")
        self.epochs_without_improvement = int(meta.get("epochs_without_improvement", 0))
        self.stopped_early = bool(meta.get("stopped_early", False))
        if "shuffle_rng" in meta:
            self.rng.bit_generator.state = meta["shuffle_rng"]
        self._best_values = best_values if self.restore_best else None
        if meta.get("monitor") not in (None, self.monitor) or meta.get("mode") not in (None, self.mode):
            log.warning("Trainer.load: %r was saved monitoring %s (%s) and this Trainer monitors %s (%s): its best "
                        "score %s is compared with this Trainer's metric", where, meta.get("monitor"),
                        meta.get("mode"), self.monitor, self.mode, self.best)
        log.info("Trainer.load: resumed from %r after epoch %d (step %d)", where, self.epoch, self.step)
        return meta

    def _set_rank_state(self, variables: list[Any], stacked: list[np.ndarray], saved_ranks: int) -> None:
        if not variables:
            return
        size = _rank_count()
        if saved_ranks != size or any(len(s) != size for s in stacked):
            log.warning("Trainer.load: the layers' state was saved by %d rank(s) and this group has %d: every rank "
                        "takes rank 0's", saved_ranks, size)
            set_in_every_rank(variables, [s[0] for s in stacked])
            return
        if not _forked():
            for var, s in zip(variables, stacked):
                var.set_value(np.asarray(s[0], dtype=var.type.dtype))
            return
        import synkhronos as synk

        for rank in range(size):
            synk.set_value(rank, variables,
                           [np.asarray(s[rank], dtype=v.type.dtype) for v, s in zip(variables, stacked)])

    def evaluate(self, data: Sequence[Any] = (), num_slices: int | None = None) -> dict[str, float]:
        """Run ``eval_fn`` over the whole of ``data`` (``num_slices`` default ``eval_slices``)."""
        if self.eval_fn is None:
            raise ValueError("this Trainer has no eval_fn")
        return dict(self.eval_fn(*data, num_slices=num_slices or self.eval_slices))

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
