"""``distribute()``: replicate the functions (and their shared variables) in every worker.

All functions not yet distributed travel in ONE pickle, so a shared variable used by several of
them is one variable in each worker.  Shared variables distributed earlier travel as references
(pickle persistent ids) to the worker's existing variable, which is why ``distribute`` can run
any number of times; a function built after a distribution is distributed on its first call.

Each worker compiles its replicas itself (with the master's PyTensor configuration and compile
cache).  Shared random generators are reseeded in each worker from their state combined with the
rank, so random streams (e.g. dropout masks) differ between ranks.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from typing import Any

import numpy as np

from synk_comm import Group, handler
from synkhronos.protocol import DISTRIBUTE
from synkhronos.replica import Replica
from synkhronos.runtime import Runtime, get_runtime, rank_runtime

__all__ = ["distribute", "ensure_distributed"]

log = logging.getLogger("synkhronos")


_REF = "synkhronos-shared"


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, known: dict[Any, int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.known = known

    def persistent_id(self, obj: Any) -> Any:
        sid = self.known.get(obj) if type(obj).__name__.endswith("SharedVariable") else None
        return None if sid is None else (_REF, sid)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, rt: Runtime) -> None:
        super().__init__(file)
        self.rt = rt

    def persistent_load(self, pid: Any) -> Any:
        tag, sid = pid
        if tag != _REF:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self.rt.shared[sid]


def distribute() -> None:
    """Replicate every function not yet distributed, and the shared variables they use, in the
    workers.  Callable any number of times; calls and collectives run it when needed.

    Raises
    ------
    RuntimeError
        If Synkhronos is not forked.
    """
    rt = get_runtime()
    if not rt.is_master:
        raise RuntimeError("distribute() is for the master process")
    pending = [rep for fid, rep in sorted(rt.replicas.items()) if fid not in rt.distributed]
    if not pending:
        return
    t0 = time.perf_counter()
    known = dict(rt.shared_ids)
    new_shared: list[tuple[int, Any]] = []
    for rep in pending:
        for var in rep.shared_vars():
            if var not in rt.shared_ids:
                rt.counter += 1
                rt.add_shared(rt.counter, var)
                new_shared.append((rt.counter, var))
    for _, var in new_shared:
        if _holds_array(var):  # a random generator stays where it is (GPU mode: JAX's linker copies it)
            rt.device.adopt(var)
    buf = io.BytesIO()
    _Pickler(buf, known).dump({"specs": [rep.spec for rep in pending], "new_shared": new_shared})
    payload = buf.getvalue()
    try:
        compile_seconds = rt.group.run(DISTRIBUTE, payload)
    except BaseException:
        # Not distributed: forget the new ids, so that the next attempt sends these variables in full
        # (a rank that failed never made them; a rank that did keeps an entry nothing refers to).
        for sid, var in new_shared:
            del rt.shared[sid], rt.shared_ids[var]
        raise
    rt.distributed.update(rep.spec.fid for rep in pending)
    log.info("synkhronos: distributed %d function(s) and %d new shared variable(s) (%.1f kB) in %.2f s; "
             "slowest worker compiled for %.2f s", len(pending), len(new_shared), len(payload) / 1e3,
             time.perf_counter() - t0, max(compile_seconds or [0.0]))


def _holds_array(var: Any) -> bool:
    """Whether a shared variable's value is an array that the device keeps (not a random generator)."""
    return hasattr(var.type, "dtype")


def ensure_distributed(rt: Runtime) -> None:
    """Distribute pending functions (called before every call and collective)."""
    if len(rt.distributed) != len(rt.replicas):
        distribute()


@handler(DISTRIBUTE)
def _distribute(group: Group, payload: bytes) -> list[float] | None:
    seconds = 0.0
    if not group.is_master:
        rt = rank_runtime(group)
        content = _Unpickler(io.BytesIO(payload), rt).load()
        for sid, var in content["new_shared"]:
            rt.add_shared(sid, var)
            value = var.get_value(borrow=True)
            if isinstance(value, np.random.Generator):
                seed = int(value.integers(2**63))
                var.set_value(np.random.default_rng(np.random.SeedSequence([seed, rt.rank])), borrow=True)
            else:
                rt.device.set(var, value)
        for spec in content["specs"]:
            rep = Replica(spec, rt.device)
            rep.full()
            rt.replicas[spec.fid] = rep
            seconds += rep.compile_seconds
    result = group.gather_object(seconds)
    return None if result is None else [float(s) for s in result]  # type: ignore[arg-type]
