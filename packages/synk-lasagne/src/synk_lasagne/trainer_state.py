"""What a :class:`~synk_lasagne.Trainer` holds besides its loop (:class:`TrainerState`): its settings,
the batches of an epoch (host shared memory or scattered data), and its whole state, which
:meth:`TrainerState.save` writes and :meth:`TrainerState.load` puts back in every rank."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from synk_lasagne.callbacks import Callback
from synk_lasagne.checkpoints import (
    CHECKPOINT_FORMAT,
    _forked,
    _master_only,
    _names,
    _rank_count,
    _read,
    _suffixed,
    _take,
    _write,
    set_in_every_rank,
)
from synk_lasagne.training import TrainFunction

__all__ = ["TrainerState"]

log = logging.getLogger("synk_lasagne.trainer")  # the Trainer's logger (its docs name it), for every part of it


class TrainerState:
    """The settings, batches and state of a :class:`~synk_lasagne.Trainer` (its base: see there for the
    parameters, and *Resuming* for what :meth:`save` keeps)."""

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

