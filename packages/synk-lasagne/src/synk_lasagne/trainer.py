"""The :class:`Trainer` (epochs, validation, progress, checkpoints, early stopping) and checkpoints.

=================================  ===============================================================
:class:`Trainer`                   epochs with shuffling, validation, a progress bar, per-epoch
                                   metrics, checkpoints, early stopping
:func:`save_checkpoint`            the master writes parameters and optimizer state (``.npz``)
:func:`load_checkpoint`            read them back into every rank
=================================  ===============================================================
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from synk_lasagne.training import TrainFunction

__all__ = ["Trainer", "load_checkpoint", "save_checkpoint"]


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
