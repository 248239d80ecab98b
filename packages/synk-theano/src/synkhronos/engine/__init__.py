"""The engine: a Synkhronos function as ONE compiled program over every rank, on JAX's
multi-process runtime: GPU mode's engine (``synk.fork()`` on GPUs), and CPU mode's with
``synk.fork(..., engine="jax")``; ``SYNK_ENGINE`` sets the default (:func:`choose`).

Who does what
    * The **master** (the user's process) never joins JAX's runtime.  It checks a call's
      arguments, writes the call's plan into the shared scratch slots (:mod:`synkhronos.calls`),
      starts the command over the existing shared-memory control plane and reads the result
      that compute rank 0 replies.  Its call path: :mod:`synkhronos.engine.master`.
    * The **workers** are the ranks that compute: ``fork(n)`` starts ``n`` of them, each a fresh
      interpreter with one device (one GPU; or JAX's CPU device, collectives over gloo), joined
      by ``jax.distributed.initialize`` (:mod:`synkhronos.engine.launch`; the coordination
      service runs in compute rank 0).  Their call path: :mod:`synkhronos.engine.worker`.
    * A call runs one ``jax.jit(shard_map(...))`` program over the 1-D mesh ``"ranks"`` of every
      rank's device (:mod:`synkhronos.engine.program`): each rank's rows, the function (PyTensor's
      own JAX translation of the compiled graph), the output reductions, and the shared variables'
      updates (donated buffers); ``batch_s`` windows ``start:stop`` of the sliceable shared
      variables inside it.  Uneven shares run in the program, one branch per share size
      (:func:`synkhronos.engine.program._uneven_body`; a graph with in-graph collectives cut at
      them, :mod:`synkhronos.engine.segments`).  Calls the program cannot express exactly
      (``num_slices`` > 1, other ``batch_s`` selections, random generators, uneven shares with
      sliceable variables) run the per-rank
      programs of :mod:`synkhronos.replica` in the workers and the master combines the replies
      (:func:`synkhronos.engine.program.per_rank_reason` and ``fit_reason`` say which and why).

Failure (evidence in ``tests/reliability/probe_engine_failure.py``, summarised in the GPU guide)
    A worker's death (SIGKILL, segfault, OOM) is seen by the master's wait on the command, which
    polls every worker process: :class:`~synk_comm.WorkerDiedError` within a fraction of a second,
    then every other worker is told to exit and killed after half a second (a survivor may be
    stuck inside a collective that will never complete).  Nothing of JAX's runtime lives in the
    master, so nothing can abort it or leave it waiting, and ``synk.fork()`` works again in the
    same process (a process cannot ``jax.distributed.initialize`` twice: measured).  As a second
    line, the workers keep the runtime's default behaviour (no ``jax_enable_recoverability``) with
    a short heartbeat timeout: survivors of a dead peer are aborted by the runtime itself within
    :data:`~synkhronos.engine.launch.HEARTBEAT_S` seconds even if the master is gone too.
"""

from __future__ import annotations

import os

from synkhronos.errors import NotOneProgramError
from synkhronos.protocol import ENGINE_CALL, ENGINE_COLLECT, ENGINE_FETCH, ENGINE_JOIN, ENGINE_VALUE

__all__ = ["CALL", "COLLECT", "ENGINES", "ENV", "FETCH", "JOIN", "NotOneProgramError", "PER_RANK", "PROGRAM",
           "RESHAPED", "VALUE", "choose"]

ENGINES = ("ranks", "jax")
"""``"jax"``: one program over every rank on JAX's multi-process runtime (this package), GPU mode's
default; ``"ranks"``: one program per rank, glued by the master over shared memory, CPU mode's
default (its shared-memory collectives beat JAX's gloo on the CPU: measured with ``bench_comm.py``: 7.6 us
against 181 us for an 8-byte all-reduce).  In GPU mode ``"ranks"`` is the one switch back to the
per-rank engine, whose single rank computes in the master (faster at one GPU: ``bench_engine.py``
in ``benchmarks/RESULTS.md``); its values move between ranks through host shared memory."""
ENV = "SYNK_ENGINE"

# The commands between the master (engine.master) and the workers (engine.worker, their handlers).
JOIN = ENGINE_JOIN
CALL = ENGINE_CALL
VALUE = ENGINE_VALUE
COLLECT = ENGINE_COLLECT
FETCH = ENGINE_FETCH
PROGRAM = 1
"""A call's reply form: it ran as one program; compute rank 0 carries the combined outputs."""
PER_RANK = 0
"""A call's reply form: it ran per rank; every rank carries its own share."""
RESHAPED = 2
"""A call's reply form: it ran as one program (as :data:`PROGRAM`), and an update gave a shared
variable another shape."""


def choose(engine: str | None, use_gpu: bool = False) -> str:
    """The engine of a :func:`synkhronos.fork`: ``engine``, else ``$SYNK_ENGINE``, else the mode's
    default: ``"jax"`` in GPU mode, ``"ranks"`` in CPU mode (see :data:`ENGINES`).

    Raises
    ------
    ValueError
        For a name not in :data:`ENGINES`.
    """
    default = "jax" if use_gpu else "ranks"
    name = engine if engine is not None else (os.environ.get(ENV, "").strip() or default)
    if name not in ENGINES:
        source = "engine" if engine is not None else ENV
        raise ValueError(f"{source}={name!r} is not an engine: use one of {', '.join(map(repr, ENGINES))}")
    return name

