"""Every command between the master and the workers, in one list.

A command is a name that :func:`synk_comm.handler` registers in the workers; the master starts it
with :meth:`synk_comm.Group.run` / ``command``.  The per-rank engine (CPU mode) uses the first
group, the JAX engine (:mod:`synkhronos.engine`) the second; both use the Data and distribution
commands.

Per-rank engine
    :data:`CALL` a function's call (plan in the scratch slots), :data:`CHAIN` a call, an all-reduce
    and a second call, :data:`COLLECTIVE` a collective on shared variables.
Both engines
    :data:`DISTRIBUTE` the functions' graphs and shared values, :data:`DATA_UPDATE` Data made,
    resized or freed.
JAX engine
    :data:`ENGINE_JOIN` join JAX's runtime, :data:`ENGINE_CALL` a call as one program (or per rank),
    :data:`ENGINE_VALUE` read / set shared values, :data:`ENGINE_COLLECT` a collective as a program,
    :data:`ENGINE_FETCH` the outputs of a pipelined call that no later call brought back.
"""

from __future__ import annotations

__all__ = ["CALL", "CHAIN", "COLLECTIVE", "DATA_UPDATE", "DISTRIBUTE", "ENGINE_CALL", "ENGINE_COLLECT",
           "ENGINE_FETCH", "ENGINE_JOIN", "ENGINE_VALUE"]

CALL = "synkhronos.call"
CHAIN = "synkhronos.chain"
COLLECTIVE = "synkhronos.collective"
DISTRIBUTE = "synkhronos.distribute"
DATA_UPDATE = "synkhronos.data_update"
ENGINE_JOIN = "synkhronos.engine.join"
ENGINE_CALL = "synkhronos.engine.call"
ENGINE_VALUE = "synkhronos.engine.value"
ENGINE_COLLECT = "synkhronos.engine.collect"
ENGINE_FETCH = "synkhronos.engine.fetch"
