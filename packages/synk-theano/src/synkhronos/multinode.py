"""Synkhronos on several hosts: the JAX engine's ranks on every host, one run driven by one master.

Started by the launcher (:mod:`synkhronos.launch`, ``python -m synkhronos.launch``): on node 0 it
runs the user's script with the environment below, whose :func:`synkhronos.fork` (no arguments)
then forms one run over every host's ranks; on every other node it runs a node agent
(:class:`synk_comm.net.Agent`) that starts that host's workers and serves them to the master.

Who does what
    * Every rank is a worker of the JAX engine (:mod:`synkhronos.engine`); all of them, on all
      hosts, join one ``jax.distributed`` runtime whose coordination service runs in compute rank 0
      (node 0) at the coordinator's host, port ``PORT + 1``.  A call is one program over every
      rank: its collectives cross hosts inside JAX (gloo on CPU, NCCL on GPU).
    * The master (the user's process) drives a :class:`synk_comm.net.SpanGroup`: node 0's workers
      through shared memory as on one host, every other host through its agent over pyzmq (port
      ``PORT``): the commands, function definitions, shared values, and the rows of
      :func:`synkhronos.data` that the host's ranks read.
    * Data lives in node 0's shared memory.  Each agent keeps a copy per Data in its own host's
      shared memory (same shape, allocated lazily by the kernel: pages a host never writes take no
      memory) and writes into it, before each call, the rows its ranks read in that call (their
      ``batch`` / contiguous rows; whole broadcast inputs; the batch indices).  Values of
      :func:`synkhronos.scatter` reach each host once, only its own ranks' parts.

Environment (set by the launcher on node 0)
    ``SYNK_NNODES``, ``SYNK_NPROC_PER_NODE`` (node 0's workers), ``SYNK_COORDINATOR`` (``HOST:PORT``),
    ``SYNK_BIND_ADDRESS`` (the interface the master binds, default the coordinator's host).  On
    every host: ``SYNK_RUN_SECRET``, the run's secret (:func:`synk_comm.net.run_secret`): the master
    and the agents sign every message with it and drop, unread, what is not signed with it.

Limits
    GPU mode is the same code with NCCL inside JAX; it is untested beyond one host here.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import numpy as np

from synk_comm import net
from synk_shm import Data, DataHandle

__all__ = ["BIND_ENV", "COORDINATOR_ENV", "NNODES_ENV", "NPROC_ENV", "bind_address", "coordinator", "launched",
           "start_group", "total_ranks"]

log = logging.getLogger("synkhronos")

NNODES_ENV = "SYNK_NNODES"
NPROC_ENV = "SYNK_NPROC_PER_NODE"
COORDINATOR_ENV = "SYNK_COORDINATOR"
BIND_ENV = "SYNK_BIND_ADDRESS"
DEFAULT_PORT = 29500

_hub: net.Hub | None = None


def launched() -> bool:
    """Whether this process is the master of a launch over several hosts (``SYNK_NNODES`` > 1)."""
    return int(os.environ.get(NNODES_ENV, "1") or 1) > 1


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)`` (default port :data:`DEFAULT_PORT`).

    Raises
    ------
    ValueError
        For a port that is not a number.
    """
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, DEFAULT_PORT
    if not port.isdigit():
        raise ValueError(f"coordinator {address!r}: the port must be a number (HOST:PORT)")
    return host, int(port)


def coordinator() -> str:
    """JAX's coordination service for a launch over hosts: the coordinator's host, port + 1."""
    host, port = split_address(os.environ[COORDINATOR_ENV])
    return f"{host}:{port + 1}"


def _nnodes() -> int:
    return int(os.environ[NNODES_ENV])


def _local_ranks() -> int:
    return int(os.environ[NPROC_ENV])


def bind_address() -> str:
    """Where the master binds: ``tcp://IP:PORT``, the interface of ``SYNK_BIND_ADDRESS`` if set, else of
    the coordinator's host (its name resolved here), never every interface.

    Raises
    ------
    OSError
        If the host name does not resolve here (say what to set).
    """
    host, port = split_address(os.environ[COORDINATOR_ENV])
    host = os.environ.get(BIND_ENV) or host
    if host.startswith("["):  # an IPv6 literal, [addr]
        return f"tcp://{host}:{port}"
    try:
        ip = socket.gethostbyname(host)
    except OSError as exc:
        raise OSError(f"the master binds the coordinator's host {host!r}, which does not resolve here ({exc}): "
                      f"pass --bind with this host's address on the network the other hosts use (or set "
                      f"{BIND_ENV})") from exc
    return f"tcp://{ip}:{port}"


def hub() -> net.Hub:
    """The master's endpoint for the agents (bound on first use, kept until the process ends), signed
    with the run's secret (``SYNK_RUN_SECRET``)."""
    global _hub
    if _hub is None or _hub.closed:
        _hub = net.Hub(bind_address())
    return _hub


def reset() -> None:
    """End the master's endpoint, if bound: every agent exits 0 (the master's process ending does it too)."""
    global _hub
    if _hub is not None:
        _hub.shutdown()
    _hub = None


def total_ranks(n_parallel: int | None) -> int:
    """Every host's ranks, once every agent has connected; ``n_parallel`` (if given) must equal it.

    Raises
    ------
    ValueError
        If ``n_parallel`` differs from the ranks of the launch.
    TimeoutError
        If an agent does not connect in time (its node is named).
    """
    peers = hub().wait_nodes(range(1, _nnodes()))
    total = _local_ranks() + sum(p.nproc for p in peers)
    if n_parallel is not None and n_parallel != total:
        raise ValueError(f"n_parallel={n_parallel}, but this launch has {total} ranks on {_nnodes()} hosts "
                         f"({_local_ranks()} here, {', '.join(f'{p.nproc} on {p.host}' for p in peers)}): "
                         "call synk.fork() without n_parallel (or change --nproc-per-node)")
    return total


def start_group(size: int, **start_kwargs: Any) -> net.SpanGroup:
    """:func:`synk_comm.start`'s place in :func:`synkhronos.forking._fork_engine` for a launch over
    hosts: node 0's workers here, the others through their agents (``size`` counts every rank)."""
    use_gpu = (start_kwargs.get("env") or {}).get("SYNK_USE_GPU") == "1"  # each agent picks its host's GPUs
    span = net.SpanGroup.start(hub(), _nnodes(), _local_ranks(), spec={"use_gpu": use_gpu}, **start_kwargs)
    if span.size != size:  # pragma: no cover - total_ranks checked it
        span.close()
        raise RuntimeError(f"the launch has {span.size - 1} ranks, expected {size - 1}")
    return span


# --- the agent's side ------------------------------------------------------------------------------

def _start_local(spec: dict[str, Any]) -> Any:
    """An agent starts its host's workers: the master's settings, this host's GPUs and cores."""
    import synk_comm
    from synk_comm import cores as cores_mod

    nproc = int(spec["nproc"])
    env = dict(spec["env"])
    devices = None
    if spec.get("use_gpu"):
        from synkhronos.gpu import visible_devices

        gpus = visible_devices()
        if len(gpus) < nproc:
            raise ValueError(f"--nproc-per-node {nproc} but this host sees {len(gpus)} GPU(s)")
        devices = [",".join(gpus), *gpus[:nproc]]
    else:
        env.update(cores_mod.thread_env(max(1, len(os.sched_getaffinity(0)) // nproc), {}))
    return synk_comm.start(nproc + 1, imports=spec.get("imports", ()), master_rank=0, devices=devices, env=env,
                           scratch_size=spec["scratch_size"], spin_us=spec.get("spin_us"))


def _mirrors(agent: net.Agent) -> dict[int, Data]:
    return agent.state.setdefault("data", {})  # type: ignore[no-any-return]


def _update_on_agent(agent: net.Agent, items: list[tuple[int, DataHandle | None]], _extra: Any) -> Any:
    """A Data registered or changed in the master: the same shape in this host's copy, whose handle
    the host's workers get instead."""
    mirrors = _mirrors(agent)
    out: list[tuple[int, DataHandle | None]] = []
    for did, handle in items:
        if handle is None:
            old = mirrors.pop(did, None)
            if old is not None:
                old.close()  # unlinked; the workers unmap their views with this update
            out.append((did, None))
            continue
        ndim = handle.ndim if handle.ndim is not None else len(handle.shape or ())
        mirror = mirrors.get(did)
        if mirror is None or mirror.dtype != np.dtype(handle.dtype) or mirror.ndim != ndim:
            mirror = mirrors[did] = Data(dtype=handle.dtype, ndim=ndim, minibatch=handle.minibatch, name=handle.name)
        mirror.minibatch, mirror.name = handle.minibatch, handle.name
        if handle.shape is None:
            mirror.free_memory()
        else:
            mirror.set_shape(handle.shape)
        out.append((did, mirror.handle()))
    return out


def _call_rows(span: net.SpanGroup, peer: net.Peer, payload: Any) -> tuple[Any, Any]:
    """In the master, before a call: the rows of each Data that ``peer``'s ranks read in it."""
    from synkhronos import calls
    from synkhronos.runtime import current

    rt = current()
    assert rt is not None
    plan = calls.decode(span.scratch, rt.size)
    rep = rt.replicas[plan.fid]
    n_in = len(rep.spec.inputs)
    lo, hi = peer.first, peer.first + peer.nproc
    p0, p1 = int(plan.positions[lo][0]), int(plan.positions[hi - 1][1])
    index = rt.data[plan.index_did].data if plan.index_did >= 0 else None
    rows: list[tuple[int, Any, np.ndarray]] = []
    for k, did in enumerate(plan.data_ids):
        d = rt.data[did]
        arr = d.data
        assert arr is not None
        if k >= n_in:
            rows.append((did, None, arr))  # a broadcast input: all of it
        elif d.minibatch:
            rows.append((did, slice(p0, p1), arr[p0:p1]))
        elif plan.batch_kind == 0:
            sel = slice(plan.batch_start + p0, plan.batch_start + p1)
            rows.append((did, sel, arr[sel]))
        else:
            assert index is not None
            idx = np.array(index[p0:p1])
            rows.append((did, idx, arr[idx]))
    if index is not None:
        extent = p1 if plan.batch_kind == 1 else 0
        if plan.bs_kind == 2 and plan.bs is not None:
            extent = max([extent, *(int(a + b) for a, b, _ in plan.bs[lo:hi])])
        rows.append((plan.index_did, slice(0, extent), index[:extent]))
    return payload, rows


def _call_on_agent(agent: net.Agent, payload: Any, rows: list[tuple[int, Any, np.ndarray]]) -> Any:
    """Before a call on this host: write the rows its ranks read into this host's copies."""
    mirrors = _mirrors(agent)
    for did, sel, values in rows:
        arr = mirrors[did].data
        assert arr is not None
        if sel is None:
            arr[...] = values
        else:
            arr[sel] = values
    return payload


def _value_for(span: net.SpanGroup, peer: net.Peer, payload: Any) -> tuple[Any, Any]:
    """Values set per rank (``scatter``, ``set_value``...): each host gets only its own ranks' parts."""
    action, sids, arg = payload
    if action == "assign" and arg[0] is not None:
        per_rank, every = arg
        lo, hi = peer.first, peer.first + peer.nproc
        arg = ([v if lo <= r < hi else None for r, v in enumerate(per_rank)], every)
    return (action, sids, arg), None


def _register() -> None:
    from synkhronos.data_registry import UPDATE
    from synkhronos.engine import CALL, VALUE

    net.relay(UPDATE, agent=_update_on_agent)
    net.relay(CALL, master=_call_rows, agent=_call_on_agent, replies=lambda _payload: True)
    net.relay(VALUE, master=_value_for, replies=lambda payload: payload[0] != "assign")


def serve(address: str, node: int, nproc: int, host: str | None = None) -> int:
    """Run this host's node agent until the master ends (the launcher's part on nodes 1..);
    returns the exit status: 0 when the master ended normally, 1 when it was lost."""
    import synkhronos.worker  # noqa: F401 - the command handlers, as in the master

    return net.Agent(address, node, nproc, host=host, start=_start_local).serve()


_register()
