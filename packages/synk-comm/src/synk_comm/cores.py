"""Ranks on their own cores: each rank of a group pinned to a disjoint set of CPU cores.

A group started with ``cores=`` (:func:`synk_comm.start`) gives rank ``r`` the cores
``cores[r]``: every thread of the process is pinned to them (``os.sched_setaffinity``), the
worker's at start-up and the master's by ``start`` until the group closes, and a worker's thread
pools are sized to them (``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``,
``NUMBA_NUM_THREADS`` at launch, unless the environment already sets them).  XLA's CPU thread
pool needs no variable: it is as wide as the affinity mask it finds when JAX starts (measured
with jax 0.10 and 0.12: ``XLA_FLAGS`` ``intra_op_parallelism_threads`` and
``--xla_cpu_multi_thread_eigen=false`` left a matmul at full-machine speed; the mask set it).

Pinning applies to the threads that exist when it runs and to every thread they start later;
a pool that was started before is pinned too, but keeps its size.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

__all__ = ["CORES_ENV", "THREAD_VARS", "available", "env_cores", "physical_core", "pin_from_env", "pin_process",
           "restore", "split", "thread_env"]

log = logging.getLogger(__name__)

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
"""The variables that size a worker's BLAS, OpenMP and Numba thread pools."""
CORES_ENV = "SYNK_CORES"
"""A worker's cores, comma-separated, set at launch by :func:`synk_comm.start`."""


def physical_core(cpu: int) -> tuple[int, int]:
    """``(package, core)`` of logical CPU ``cpu`` (Linux sysfs); ``(0, cpu)`` where unknown.  The
    hyperthreads of one physical core share it."""
    top = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(top + "physical_package_id") as package, open(top + "core_id") as core:
            return int(package.read()), int(core.read())
    except (OSError, ValueError):
        return 0, cpu


def available() -> list[int]:
    """The cores this process may run on, the hyperthreads of each physical core side by side
    (so that :func:`split` gives each rank whole physical cores where it can: Linux often numbers
    a core's two hyperthreads ``i`` and ``i + n/2``, and consecutive ids would give two ranks the
    two halves of the same cores)."""
    return sorted(os.sched_getaffinity(0), key=lambda c: (*physical_core(c), c))


def split(cores: Sequence[int], n: int) -> list[list[int]]:
    """``cores`` cut into ``n`` disjoint runs of consecutive entries, as even as possible (the
    first ``len(cores) % n`` one core more).

    Parameters
    ----------
    cores : sequence of int
        Core ids (as :func:`available` gives them).
    n : int
        How many sets; at most ``len(cores)``.

    Returns
    -------
    list of list of int
        Set ``r`` for rank ``r``.

    Raises
    ------
    ValueError
        If ``n`` is not in ``[1, len(cores)]``.

    Examples
    --------
    >>> split([0, 1, 2, 3, 4], 2)
    [[0, 1, 2], [3, 4]]
    """
    if not 1 <= n <= len(cores):
        raise ValueError(f"cannot give {n} ranks disjoint sets of {len(cores)} cores: use at most "
                         f"{len(cores)} ranks, or no pinning")
    base, extra = divmod(len(cores), n)
    sets, start = [], 0
    for r in range(n):
        stop = start + base + (r < extra)
        sets.append(list(cores[start:stop]))
        start = stop
    return sets


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread alone
        return [0]


def pin_process(cores: Sequence[int]) -> dict[int, set[int]]:
    """Pin every thread of this process to ``cores``; returns each thread's previous mask (for
    :func:`restore`).  Threads started later inherit the mask of the thread that starts them."""
    before: dict[int, set[int]] = {}
    target = set(cores)
    for tid in _threads():
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, target)
        except OSError:  # the thread ended meanwhile
            continue
    return before


def restore(before: dict[int, set[int]], default: set[int] | None = None) -> None:
    """Give the threads pinned by :func:`pin_process` their masks back; threads started since
    get ``default`` (the main thread's mask before pinning, when None)."""
    fallback = default if default is not None else before.get(os.getpid())
    for tid in _threads():
        mask = before.get(tid, fallback)
        if mask is None:
            continue
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:
            continue


def thread_env(n_cores: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Thread-pool variables for a process of ``n_cores`` cores: each of :data:`THREAD_VARS` as
    ``n_cores``, except those ``environ`` (default: ``os.environ``) already sets."""
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    assert environ is not None
    return {var: environ.get(var, str(n_cores)) for var in THREAD_VARS}


def env_cores() -> list[int] | None:
    """The cores that :data:`CORES_ENV` gives this process (a worker pinned at launch), None where
    it is not set (the master, or a worker of a group without ``cores=``)."""
    value = os.environ.get(CORES_ENV, "").strip()
    return [int(c) for c in value.split(",")] if value else None


def pin_from_env() -> list[int] | None:
    """In a worker at start-up: pin the process to the cores of :data:`CORES_ENV`, if set; returns
    them."""
    cores = env_cores()
    if cores is not None:
        pin_process(cores)
    return cores
