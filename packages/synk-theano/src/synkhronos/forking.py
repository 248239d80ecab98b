"""``fork()`` and ``close()``: start and stop the ranks of a Synkhronos run.

The master is rank ``master_rank``; every other rank is a fresh interpreter started by
:func:`synk_comm.start` from ``synk_comm``'s entry module (never a fork of the master, never a
re-run of its ``__main__``: scripts without a main guard work).  Each worker gets, at launch, the
master's PyTensor configuration (``PYTENSOR_FLAGS``: floatX, mode, linker, optimizer, compile
directory -- so it reuses the master's compile cache) and, in CPU mode, the backend the master
chose and a disjoint set of cores of its own, with its BLAS/OpenMP/Numba/XLA threads sized to it
(:mod:`synkhronos.cpu`, :mod:`synk_comm.cores`); the master runs on its own set too, and its
BLAS is limited likewise (threadpoolctl), until :func:`close`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import synk_comm
from synk_comm import cores as cores_mod
from synkhronos import cpu
from synkhronos.calls import CallPlan
from synkhronos.device import CpuDevice
from synkhronos.inflight import DEFAULT_MAX_IN_FLIGHT, Window
from synkhronos.runtime import Runtime, current, set_current

__all__ = ["fork", "close"]

log = logging.getLogger("synkhronos")


def _pytensor_flags() -> str:
    """The master's PyTensor configuration as a PYTENSOR_FLAGS string for the workers."""
    import pytensor

    cfg = pytensor.config
    flags = [f"floatX={cfg.floatX}", f"base_compiledir={cfg.base_compiledir}"]
    for key in ("mode", "linker", "optimizer", "optimizer_including", "optimizer_excluding"):
        value = getattr(cfg, key, None)
        if value not in (None, ""):
            flags.append(f"{key}={value}")
    inherited = os.environ.get("PYTENSOR_FLAGS", "")
    return ",".join(filter(None, [inherited, *flags]))


def gpu_count() -> int:
    """GPUs this run may use (0 without NVIDIA's driver; ``n`` under ``SYNK_EMULATE_GPUS=n``)."""
    from synkhronos.emulation import emulated_gpus

    if not emulated_gpus() and not os.path.isdir("/proc/driver/nvidia/gpus"):
        return 0
    from synkhronos.gpu import visible_devices

    return len(visible_devices())


def fork(n_parallel: int | None = None, use_gpu: bool | None = None, master_rank: int = 0,
         profile_workers: bool = False, max_n_var: int = 1000, max_dim: int = 16,
         engine: str | None = None, precision: str = "default",
         max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> int:
    """Start the ranks: the master (this process) and ``n_parallel - 1`` workers.

    Parameters
    ----------
    n_parallel : int, optional
        Ranks, the master included.  Default: every GPU (GPU mode); in CPU mode
        ``SYNK_CPU_RANKS`` if set, else :func:`synkhronos.cpu.default_ranks` of the cores in
        ``os.sched_getaffinity(0)`` (one per core up to 4 cores, else one per 4 cores, at
        least 4).  In CPU mode, ranks get disjoint sets of cores (``SYNK_CPU_PIN=0``: not
        pinned) and compile with JAX when it is installed (see :mod:`synkhronos.cpu`).  Under
        ``python -m synkhronos.launch`` over several hosts: every host's ranks, on the JAX
        engine (:mod:`synkhronos.multinode`; given, it must equal their number).
    use_gpu : bool, optional
        None: GPU mode on a machine with GPUs, else CPU mode.  False: CPU mode with
        ``n_parallel`` worker processes.  True: GPU mode (an error without GPUs).
    master_rank : int
        The master's rank, in ``[0, n_parallel)``, under the per-rank engine (in GPU mode with
        ``engine="ranks"``, the index of its GPU).  The JAX engine's master has no rank: leave 0.
    profile_workers : bool
        Write a cProfile file per worker (``synkhronos_worker_rank<r>.prof`` in the working
        directory) when it exits.
    max_n_var : int
        Argument slots of a call (Data arguments and output indices): a call that needs more is
        a ValueError that names this parameter.
    max_dim : int
        The most dimensions of any input, output or sliceable shared of a function: more is a
        ValueError in :func:`synkhronos.function` that names this parameter.
    engine : {"jax", "ranks"}, optional
        Default ``$SYNK_ENGINE``, else ``"jax"`` in GPU mode and ``"ranks"`` in CPU mode.
        ``"jax"``: every call is one program over all ranks on JAX's multi-process runtime
        (:mod:`synkhronos.engine`): the ``n_parallel`` ranks are worker processes (one GPU each in
        GPU mode; JAX's CPU device otherwise) and the master computes nothing; ``master_rank``
        must then be 0.  ``"ranks"``: every rank, the master included, runs its own programs; the
        master glues them over shared memory (CPU mode's engine: its shared-memory collectives
        beat JAX's on the CPU; in GPU mode the switch back to the per-rank engine, see
        :data:`synkhronos.engine.ENGINES`).

    precision : {"default", "highest", "bf16"}
        The precision policy of every function built until :func:`close` that does not give its
        own (:func:`synkhronos.function`'s ``precision``; see :mod:`synkhronos.precision`).
    max_in_flight : int
        The most calls :meth:`Function.submit <synkhronos.function.Function.submit>` keeps pending
        (default 2); ``submit`` blocks while that many are (see :mod:`synkhronos.inflight`).

    Returns
    -------
    int
        The number of ranks.

    Raises
    ------
    RuntimeError
        If already forked (call close() first), or called in a worker (only the master forks).
    ValueError
        For a bad ``n_parallel``/``master_rank``, or ``use_gpu=True`` without enough GPUs.
    """
    group = synk_comm.current_group()
    if group is not None and not group.is_master and not group.closed:
        raise RuntimeError(f"synk.fork() was called in worker rank {group.rank} (pid {os.getpid()}): only the "
                           "master process forks; this process is already a rank of the master's group")
    if current() is not None and not current().group.closed:  # type: ignore[union-attr]
        raise RuntimeError("Synkhronos is already forked: call synk.close() before forking again")
    from synkhronos import multinode

    spanning = multinode.launched()
    if spanning:  # under synkhronos.launch over several hosts: every host's ranks, on the JAX engine
        if engine not in (None, "jax"):
            raise ValueError(f"engine={engine!r}: a run over several hosts (synkhronos.launch) runs on the JAX "
                             "engine; leave engine unset")
        engine = "jax"
        n_parallel = multinode.total_ranks(n_parallel)
    n_gpus = gpu_count()
    if use_gpu is None:
        use_gpu = n_gpus > 0
    if n_parallel is None:
        n_parallel = n_gpus if use_gpu else cpu.default_ranks(len(os.sched_getaffinity(0)))
    if not isinstance(n_parallel, int) or n_parallel < 1:
        raise ValueError(f"n_parallel must be an int >= 1, got {n_parallel!r}")
    if not isinstance(master_rank, int) or not 0 <= master_rank < n_parallel:
        raise ValueError(f"master_rank must be in [0, n_parallel={n_parallel}), got {master_rank!r}")
    if max_n_var < 1:
        raise ValueError(f"max_n_var must be >= 1, got {max_n_var}")
    if max_dim < 1:
        raise ValueError(f"max_dim must be >= 1, got {max_dim}")
    from synkhronos import precision as precisions

    precision = precisions.check(precision)
    window = Window(max_in_flight)  # checks max_in_flight before anything starts
    from synkhronos import engine as engines

    engine = engines.choose(engine, use_gpu)
    if engine == "jax" and master_rank != 0:
        raise ValueError(f"master_rank={master_rank}: with engine='jax' the master computes nothing and has no "
                         "rank of its own; leave master_rank at 0")
    if use_gpu:
        if n_gpus == 0:
            raise ValueError("use_gpu=True but this machine has no visible NVIDIA GPU; use use_gpu=False")
        if n_parallel > n_gpus and not spanning:
            raise ValueError(f"n_parallel={n_parallel} but only {n_gpus} GPU(s) are visible")
    t0 = time.perf_counter()
    env: dict[str, Any] = {"PYTENSOR_FLAGS": _pytensor_flags(), "SYNK_USE_GPU": "1" if use_gpu else "0"}
    if engine == "jax":
        rt = _fork_engine(n_parallel, use_gpu, env, profile_workers, max_n_var)
        rt.max_dim = max_dim
        rt.precision = precision
        rt.window = window
        set_current(rt)
        log.info("synkhronos: %d ranks on the JAX engine (%s) ready in %.2f s", n_parallel,
                 "GPU" if use_gpu else "CPU", time.perf_counter() - t0)
        return n_parallel
    devices = None
    core_sets = None
    if use_gpu:
        from synkhronos.gpu import prepare_master

        devices = prepare_master(n_parallel, master_rank)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        device = _gpu_device()
    else:
        backend = cpu.choose_backend()
        env[cpu.BACKEND_ENV] = backend
        if backend == "jax":
            env["JAX_PLATFORMS"] = "cpu"  # CPU mode on a machine with GPUs too: XLA's CPU backend
        core_sets = _core_sets(n_parallel)
        # not pinned: each rank's pools a share of the cores; pinned: synk_comm sizes each worker's
        # pools to its own set
        threads = _shared_threads(n_parallel, env) if core_sets is None else len(core_sets[master_rank])
        device = CpuDevice(backend, ranks=n_parallel, one_core=threads == 1 and core_sets is not None)
        device.all_reduce_segment = cpu.create_all_reduce_segment(backend, n_parallel)
        if device.all_reduce_segment is not None:
            env[cpu.SEGMENT_ENV] = device.all_reduce_segment.name
    # GPU ranks have cores to spare: poll longer before sleeping, as a sleeping rank wakes slowly.
    # CPU ranks pinned to cores of their own too: a rank that polls takes no core from another
    # rank, while a rank that slept between two calls wakes tens of microseconds late (and the
    # master wakes the ranks one after the other).
    segment = device.all_reduce_segment
    try:
        group = _start_group(n_parallel, n_parallel, master_rank, devices, env, profile_workers, max_n_var,
                             long_spin=use_gpu or core_sets is not None, cores=core_sets)
    except BaseException:
        if segment is not None:
            segment.close()
        raise
    if segment is not None:  # a rank that failed inside a program left the others' counters ahead
        group.after_failed_command(segment.realign)
    from synkhronos.engines.ranks import RanksEngine

    rt = Runtime(group, device, driver=RanksEngine())
    rt.max_dim = max_dim
    rt.precision = precision
    rt.window = window
    rt.cores = tuple(sorted({c for cores in core_sets for c in cores})) if core_sets else ()
    if not use_gpu and n_parallel > 1:
        # The master computes a share too: its BLAS gets its share of the cores, like each worker's
        # (set at the workers' launch); close() gives the master its threads back.
        from threadpoolctl import threadpool_limits

        rt.thread_limits = threadpool_limits(limits=threads, user_api="blas")
    set_current(rt)
    where = f", GPUs {devices}" if devices else ""
    if not use_gpu:
        where = f", backend {device.backend}, " + (f"cores {core_sets}" if core_sets else "not pinned")
        if device.inline:
            where += ", JAX computing inline"  # one-core ranks: synkhronos.cpu.compute_on_calling_thread
    log.info("synkhronos: %d ranks in %s mode (master rank %d%s) ready in %.2f s", n_parallel,
             "GPU" if use_gpu else "CPU", master_rank, where, time.perf_counter() - t0)
    return n_parallel


def _fork_engine(n_parallel: int, use_gpu: bool, env: dict[str, Any], profile_workers: bool,
                 max_n_var: int) -> Runtime:
    """Start the engine's ``n_parallel`` workers (group ranks 1..n; the master is group rank 0) and
    join them into JAX's runtime (:mod:`synkhronos.engine`)."""
    from synkhronos import multinode
    from synkhronos.engine import JOIN, launch
    from synkhronos.engine.device import HostDevice
    from synkhronos.engine.master import Orchestrator

    spanning = multinode.launched()
    n_local = int(os.environ[multinode.NPROC_ENV]) if spanning else n_parallel
    on_gpu = launch.runs_on_gpu(use_gpu)
    env.update(launch.worker_env(on_gpu))
    devices = None
    if use_gpu:
        from synkhronos.gpu import visible_devices

        gpus = visible_devices()
        devices = [",".join(gpus), *gpus[:n_local]]  # the master keeps what it sees
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX in the master: no GPU hoarding
    else:
        _shared_threads(n_local, env)
    # Over several hosts (synkhronos.launch): node 0's workers here, the others' through their agents.
    group = _start_group(n_parallel + 1, n_parallel, 0, devices, env, profile_workers, max_n_var, long_spin=use_gpu,
                         start=multinode.start_group if spanning else synk_comm.start)
    group.abort_grace_s = launch.ABORT_GRACE_S  # a worker that fails to join leaves the others waiting
    coordinator = multinode.coordinator() if spanning else launch.coordinator_address()
    try:
        group.run(JOIN, (coordinator, on_gpu))
    except BaseException:
        group.close()
        raise
    group.abort_grace_s = None  # set per call (synkhronos.engine.master)
    from synkhronos.engines.jax_engine import JaxEngine

    return Runtime(group, HostDevice(use_gpu), engine=Orchestrator(), driver=JaxEngine())


def _shared_threads(n_parallel: int, env: dict[str, Any]) -> int:
    """Ranks not pinned to cores of their own: each worker's thread pools get an even share of the
    cores (set in ``env``, unless the environment sets them); returns that share."""
    threads = max(1, len(os.sched_getaffinity(0)) // n_parallel)
    env.update(cores_mod.thread_env(threads))
    return threads


def _start_group(size: int, n_parallel: int, master_rank: int, devices: Any, env: dict[str, Any],
                 profile_workers: bool, max_n_var: int, long_spin: bool,
                 cores: list[list[int]] | None = None, start: Any = None) -> synk_comm.Group:
    """:func:`synk_comm.start` with what every engine's workers get at launch: the worker module,
    ``SYNK_PROFILE_DIR`` (``profile_workers``), the call plan's scratch slots (``max_n_var`` Data
    ids and output indices over ``n_parallel`` ranks), and the time a waiting rank polls before
    it sleeps (``SYNK_SPIN_US``, else 2 ms with ``long_spin``, 200 us without).  ``start``: what
    starts the group (:func:`synk_comm.start`, or over several hosts
    :func:`synkhronos.multinode.start_group`)."""
    if profile_workers:
        env["SYNK_PROFILE_DIR"] = os.getcwd()
    spin = float(os.environ.get("SYNK_SPIN_US", 2000 if long_spin else 200))
    kwargs: dict[str, Any] = {"cores": cores} if cores is not None else {}
    return (start or synk_comm.start)(size, imports=["synkhronos.worker"], master_rank=master_rank, devices=devices,
                                      env=env, scratch_size=CallPlan.length(max_n_var, 0, n_parallel), spin_us=spin,
                                      **kwargs)


def _core_sets(n_parallel: int) -> list[list[int]] | None:
    """CPU mode: each rank's cores (disjoint), or None where ranks are not pinned (one rank,
    ``SYNK_CPU_PIN=0``, or more ranks than cores)."""
    cores = cores_mod.available()
    if n_parallel == 1 or not cpu.pinning_enabled():
        return None
    if n_parallel > len(cores):
        log.info("synkhronos: %d CPU ranks on %d cores: not pinned (they share the cores)", n_parallel, len(cores))
        return None
    return cores_mod.split(cores, n_parallel)


def _gpu_device() -> Any:
    from synkhronos.gpu import GpuDevice

    return GpuDevice()


def close() -> None:
    """Stop the workers and free every shared-memory object of the run (idempotent; also at exit).

    Data made by :func:`synkhronos.data` stay usable in the master; a later :func:`fork` knows
    them again when they are next used.
    """
    rt = current()
    if rt is None:
        return
    rt.window.close()  # the calls in flight finish first
    if rt.driver is not None and not rt.group.closed:
        try:
            rt.driver.close(rt)  # e.g. the JAX engine reads the shared values before the workers stop
        except Exception as exc:  # the group is broken: the values last read stay
            log.warning("synkhronos: could not read the shared values before closing: %s", exc)
    set_current(None)
    rt.group.close()
    segment = rt.device.all_reduce_segment  # CPU mode's in-program all-reduces
    if segment is not None:
        segment.close()
    if rt.thread_limits is not None:
        rt.thread_limits.restore_original_limits()
    log.info("synkhronos: closed")
