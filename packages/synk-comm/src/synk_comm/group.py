"""A group of processes on one machine that run in lock-step.

Two ways in:

* :func:`spawn` (SPMD, like ``torch.multiprocessing.spawn``): ``fn(group, *args)`` runs in every
  rank, the calling process included (as the master rank), and the list of return values comes
  back in rank order.
* :func:`start` (master-driven, what :mod:`synkhronos` uses): the master sends commands;
  each worker runs the handler registered under the command's name (:func:`handler`), while the
  master runs its own part inside ``with group.command(name, payload):``.  The start and the end
  of every command are barriers.

Workers are fresh interpreters (``python -m synk_comm.worker``) with their environment set at
launch (``CUDA_VISIBLE_DEVICES`` among it), never forks of the master and never re-runs of its
``__main__``.  A worker's exception reaches the master as :class:`~synk_comm.errors.WorkerError`
(rank and traceback) and the group stays usable; a worker that dies makes the master's next wait
fail within a fraction of a second with :class:`~synk_comm.errors.WorkerDiedError`; workers
exit, cleaning up the run's shared memory, when the master dies.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from synk_comm import cores as cores_mod
from synk_comm.devices import pin
from synk_comm.errors import WorkerError
from synk_comm.group_base import ABANDONED_GRACE_S as ABANDONED_GRACE_S
from synk_comm.group_base import EXIT as EXIT
from synk_comm.group_base import SPAN_OFFSET_ENV as SPAN_OFFSET_ENV
from synk_comm.group_base import SPAN_SIZE_ENV as SPAN_SIZE_ENV
from synk_comm.group_base import _master_gone as _master_gone
from synk_comm.group_commands import HANDLERS, GroupCommands
from synk_comm.group_commands import handler as handler
from synk_comm.lockstep import MAILBOX, wait
from synk_comm.watchdog import _Watchdog
from synk_shm import naming

__all__ = ["Group", "start", "spawn", "current_group"]  # and handler (synk_comm.group_commands)

log = logging.getLogger(__name__)


_current: Group | None = None


def current_group() -> Group | None:
    """The group this process belongs to (in a worker: its group; in the master: the last started)."""
    return _current


class Group(GroupCommands):
    """The ranks of a group as seen from one of them; made by :func:`start`, :func:`spawn`, or
    the worker entry point.

    Attributes
    ----------
    rank, size, master_rank : int
        Who we are, how many there are, and which rank drives the commands.
    device : str or None
        This rank's entry of the ``devices`` given to :func:`start` (its ``CUDA_VISIBLE_DEVICES``).
    scratch : numpy.ndarray
        Shared int64 slots for a command's small arguments, written by the master before the
        command (the hot path: no pickling, no allocation).
    """


# --- starting a group ---------------------------------------------------------------------------

def start(size: int, *, imports: Sequence[str] = (), master_rank: int = 0,
          devices: Sequence[str | int] | None = None, env: dict[str, str] | None = None,
          scratch_size: int = 4096, startup_timeout: float = 300.0, main_path: str | None = None,
          spin_us: float | None = None, cores: Sequence[Sequence[int]] | None = None) -> Group:
    """Start ``size - 1`` worker processes and return the master's :class:`Group` (rank ``master_rank``).

    Parameters
    ----------
    size : int
        Number of ranks, the master included (>= 1).
    imports : sequence of str
        Modules every worker imports before serving; they register the command handlers
        (:func:`handler`).  The master imports them too.
    master_rank : int
        The master's rank, in ``[0, size)``.
    devices : sequence, optional
        One entry per rank: rank ``r`` gets ``CUDA_VISIBLE_DEVICES=devices[r]`` before it starts.
    env : dict, optional
        Extra environment variables for the workers.
    scratch_size : int
        Number of int64 hot-path argument slots (:attr:`Group.scratch`).
    startup_timeout : float
        Seconds to wait for every worker to be ready.
    spin_us : float, optional
        Microseconds each wait polls before it sleeps, in every rank (default ``SYNK_SPIN_US``
        or 200; never with more ranks than cores).
    cores : sequence of sequences of int, optional
        One set of CPU cores per rank (disjoint, e.g. :func:`synk_comm.cores.split`): every
        thread of rank ``r`` runs on ``cores[r]`` (the master's until the group closes), and a
        worker's BLAS/OpenMP/Numba pools are sized to it unless the environment sets their
        variables (:mod:`synk_comm.cores`).

    Raises
    ------
    ValueError
        For a bad ``size``, ``master_rank`` or ``devices``.
    RuntimeError
        If called in a worker of a running group (only a master starts groups).
    WorkerError, WorkerDiedError
        If a worker failed to start (its traceback is in the message).
    """
    global _current
    if _current is not None and not _current.is_master and not _current.closed:
        raise RuntimeError(f"synk_comm.start() was called in worker rank {_current.rank} of a running group "
                           f"(pid {os.getpid()}): only the master process starts groups; do this in the master")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not 0 <= master_rank < size:
        raise ValueError(f"master_rank must be in [0, {size}), got {master_rank}")
    if devices is not None and len(devices) != size:
        raise ValueError(f"devices must have one entry per rank ({size}), got {len(devices)}")
    if cores is not None and (len(cores) != size or not all(cores)):
        raise ValueError(f"cores must have one non-empty set of cores per rank ({size}), got {cores!r}")
    for module in imports:
        importlib.import_module(module)
    if devices is not None:  # the master's own GPU, in effect if CUDA is not initialised yet
        pin(str(devices[master_rank]))
    naming.sweep()
    prefix = naming.new_name("g") + "."
    group = Group(prefix=prefix, rank=master_rank, size=size, master_rank=master_rank,
                  scratch_size=scratch_size, device=None if devices is None else str(devices[master_rank]),
                  create=True)
    group._command_names = sorted(HANDLERS)
    if spin_us is not None and group._spin > 0:
        group._spin = spin_us * 1e-6
    config = {"imports": list(imports), "handlers": group._command_names, "sys_path": list(sys.path),
              "main_path": main_path}
    group.buffers.publish_bytes(MAILBOX, pickle.dumps(config, pickle.HIGHEST_PROTOCOL))
    base_env = dict(os.environ)
    base_env.update(env or {})
    base_env.update({naming.RUN_PREFIX_ENV: naming.run_prefix(), "SYNK_GROUP_PREFIX": prefix,
                     "SYNK_SIZE": str(size), "SYNK_MASTER_RANK": str(master_rank),
                     "SYNK_MASTER_PID": str(os.getpid()), "SYNK_SCRATCH_SIZE": str(scratch_size)})
    base_env["SYNK_SPIN_US"] = str(group._spin * 1e6)
    try:
        for r in group.workers:
            wenv = dict(base_env, SYNK_RANK=str(r))
            if devices is not None:
                wenv["CUDA_VISIBLE_DEVICES"] = str(devices[r])
            if cores is not None:
                wenv[cores_mod.CORES_ENV] = ",".join(str(c) for c in cores[r])
                wenv.update(cores_mod.thread_env(len(cores[r]), base_env))
            group._procs[r] = subprocess.Popen([sys.executable, "-m", "synk_comm.worker"], env=wenv,
                                               stdin=subprocess.DEVNULL)
        if cores is not None:  # after the launches: a child starts with the mask of its parent's thread
            group._affinity = cores_mod.pin_process(cores[master_rank])
        group._pending = len(group.workers)
        t0 = time.monotonic()
        while group._pending:
            wait(group.sems.done, group._check_workers, timeout=startup_timeout, what="the workers to start")
            group._pending -= 1
        errors = group._take_errors()
        if errors:
            raise WorkerError(errors)
    except BaseException:
        if not group.closed:
            group._shutdown(timeout=5.0)
        raise
    if group._procs:
        group._watchdog = _Watchdog(group)
    log.info("synk_comm: %d ranks ready in %.2f s (master rank %d, pid %d)", size, time.monotonic() - t0,
             master_rank, os.getpid())
    _register_exit(group)
    _current = group
    return group


def _register_exit(group: Group) -> None:
    ref = weakref.ref(group)

    def close() -> None:
        g = ref()
        if g is not None:
            g.close(timeout=5.0)

    atexit.register(close)
    naming.on_termination(close)


# --- SPMD ---------------------------------------------------------------------------------------

_SPMD = "synk_comm.spmd"


@handler(_SPMD)
def _run_spmd(group: Group, payload: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
    fn, args = payload
    result = fn(group, *args)
    results = group.gather_object(result)
    return results


def spawn(fn: Callable[..., Any], size: int, args: Sequence[Any] = (), **start_kwargs: Any) -> list[Any]:
    """Run ``fn(group, *args)`` in ``size`` ranks (this process is rank 0) and return their results.

    ``fn`` and ``args`` travel by pickle, so ``fn`` must be importable: a module-level function of
    a module, or of the main script if that script guards its top level with
    ``if __name__ == "__main__":``.  The group is closed on return.

    Examples
    --------
    >>> def total(group, x):                                # doctest: +SKIP
    ...     return group.all_reduce(np.full(3, x + group.rank), "sum")
    >>> spawn(total, 4, args=(1.0,))                          # doctest: +SKIP
    [array([10., 10., 10.]), array([10., ...]), ...]
    """
    main_path = None
    if getattr(fn, "__module__", None) == "__main__":
        main_path = getattr(sys.modules["__main__"], "__file__", None)
        if main_path is None:
            raise ValueError("spawn: fn is defined in an interactive session; workers cannot import it. "
                             "Define it in a module (or a script with a main guard).")
    group = start(size, main_path=main_path, **start_kwargs)
    try:
        results = group.run(_SPMD, (fn, tuple(args)))
    finally:
        group.close()
    return list(results)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
