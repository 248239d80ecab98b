"""Joining the compute ranks into JAX's multi-process runtime.

The master picks the coordinator's address (a free local port) at :func:`synkhronos.fork` and
sends it with the first command; every worker then calls :func:`join` before anything in it runs
JAX.  Compute rank 0 hosts the coordination service.  The master itself never joins (see
:mod:`synkhronos.engine`).

GPU workers get XLA flags for overlap (:data:`XLA_GPU_FLAGS`), added to their ``XLA_FLAGS`` at
launch unless ``SYNK_XLA_FLAGS`` replaces them (``SYNK_XLA_FLAGS=`` sets none):

``--xla_gpu_enable_latency_hiding_scheduler=true``
    XLA schedules an all-reduce (an in-graph collective) to run while later compute proceeds
    instead of where it sits in program order.
``--xla_gpu_all_reduce_combine_threshold_bytes=134217728``
    Small all-reduces of one program (one per gradient) are combined into few large ones, up to
    128 MiB each: one launch and full bandwidth instead of a latency-bound collective per tensor.
"""

from __future__ import annotations

import atexit
import os
import socket
import warnings
from typing import Any

from synkhronos import emulation

__all__ = ["HEARTBEAT_S", "XLA_GPU_FLAGS", "coordinator_address", "join", "worker_env"]

HEARTBEAT_S = 10
"""The runtime's heartbeat timeout: a worker whose peer died is aborted by JAX's coordination
service after this many seconds, should the master not have stopped it first (it does at once)."""
INIT_TIMEOUT_S = 120
ABORT_GRACE_S = 3.0
"""Seconds the master lets the other workers finish a call that runs as one program (or the join)
in which one worker failed; then it counts them as stuck in a collective with the failed rank and
stops the group (:attr:`synk_comm.Group.abort_grace_s`).  Per-rank calls wait for every share."""
XLA_GPU_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true "
                 "--xla_gpu_all_reduce_combine_threshold_bytes=134217728")
XLA_FLAGS_ENV = "SYNK_XLA_FLAGS"


def coordinator_address() -> str:
    """``127.0.0.1:<port>`` of a port free now (compute rank 0 binds it when it joins)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def worker_env(on_gpu: bool) -> dict[str, str]:
    """Environment variables for the engine's workers (set at their launch)."""
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if on_gpu:
        extra = os.environ.get(XLA_FLAGS_ENV, XLA_GPU_FLAGS)
        flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), extra]))
        if flags:
            env["XLA_FLAGS"] = flags
    return env


def runs_on_gpu(use_gpu: bool) -> bool:
    """Whether the workers' JAX uses GPUs (not in CPU mode, nor under ``SYNK_EMULATE_GPUS``)."""
    return use_gpu and not emulation.emulated_gpus()


def join(coordinator: str, num_processes: int, process_id: int, on_gpu: bool) -> Any:
    """Join this worker to the runtime (before anything runs JAX); returns its one device.

    On the CPU (no GPUs, or ``SYNK_EMULATE_GPUS``), JAX's CPU device with gloo collectives.
    """
    import jax
    import pytensor

    if not on_gpu:
        from synkhronos.quiet import drop_gloo_connect_lines

        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        drop_gloo_connect_lines()  # gloo's "[Gloo] Rank r is connected to ..." lines on stdout
    if pytensor.config.floatX == "float64":
        jax.config.update("jax_enable_x64", True)
    else:  # float32 work computes 64-bit requests (int64 indices, float64 casts) in 32 bits, as documented
        from synkhronos.quiet import drop_32bit_notes

        drop_32bit_notes()
    # PyTensor's note, at every compilation of every worker, that JAX checks no Assert (the GPU guide says so)
    warnings.filterwarnings("ignore", message=r"Skipping Assert")
    from synkhronos.quiet import request_canonical_dtypes

    request_canonical_dtypes()  # float32 work asks JAX for no float64
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               local_device_ids=[0], initialization_timeout=INIT_TIMEOUT_S,
                               heartbeat_timeout_seconds=HEARTBEAT_S)
    from synkhronos.quiet import shutdown_runtime_quietly

    atexit.register(shutdown_runtime_quietly)  # runs before JAX's own handler: the runtime's goodbye noise dropped
    return jax.local_devices()[0]
