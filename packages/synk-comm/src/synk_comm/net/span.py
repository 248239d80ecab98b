"""The master's group spanning hosts (:class:`SpanGroup`): node 0's own group plus the other hosts'
agents, with the master's side of a :class:`~synk_comm.Group`."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from synk_comm import group as group_mod
from synk_comm.errors import GroupBrokenError, HostLostError, WorkerDiedError, WorkerError
from synk_comm.net.hooks import _MASTER_HOOKS, _REPLIES
from synk_comm.net.hub import Hub, Peer
from synk_comm.net.wire import CLOSE_TIMEOUT_S, HOST_TIMEOUT_S, POLL_S
from synk_comm.ops import ReduceOp, as_op
from synk_comm.shm_collectives import _reduce_into

log = logging.getLogger(__name__)


class SpanGroup:
    """The master's group spanning hosts: node 0's own group plus the other hosts' agents.

    Rank 0 is the master; ranks ``1..k0`` node 0's workers, then every other node's workers in
    node order.  Made by :meth:`start`.
    """

    is_master = True
    rank = 0
    master_rank = 0
    spans_hosts = True
    span_offset = 0

    def __init__(self, local: group_mod.Group, hub: Hub, peers: list[Peer]) -> None:
        self.local = local
        self.hub = hub
        self.peers = peers
        self.size = local.size + sum(p.nproc for p in peers)
        self.span_size = self.size
        self.workers = list(range(1, self.size))
        self.scratch = local.scratch
        self.prefix = local.prefix
        self.epoch = hub.epoch
        self._seq = 0
        self._grace: float | None = None
        self._broken: str | None = None
        self._closed = False
        self._remote_replies: dict[int, list[np.ndarray]] | None = {}
        self._watching: list[Peer] = []
        local.watch = self._watch

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("broken" if self._broken else "open")
        hosts = ", ".join(p.host for p in self.peers)
        return f"<synk_comm.net.SpanGroup {self.size} ranks on {1 + len(self.peers)} hosts (+ {hosts}), {state}>"

    # -- start -------------------------------------------------------------------------------------
    @classmethod
    def start(cls, hub: Hub, nnodes: int, nproc: int, *, spec: dict[str, Any] | None = None,
              timeout: float | None = None, **start_kwargs: Any) -> SpanGroup:
        """Wait for the agents of nodes ``1..nnodes-1``, start node 0's ``nproc`` workers here
        (:func:`synk_comm.start` with ``start_kwargs``) and each other node's through its agent.

        ``spec`` (picklable) reaches each agent's start function with the span's layout added.

        Raises
        ------
        TimeoutError
            If an agent does not connect within ``timeout`` seconds.
        WorkerError, WorkerDiedError, HostLostError
            If a worker fails to start (here or on another host).
        """
        peers = hub.wait_nodes(range(1, nnodes), timeout)
        hub.epoch += 1
        first = nproc
        for peer in peers:
            peer.first, first = first, first + peer.nproc
            peer.inbox.clear()
        size = 1 + first
        env = dict(start_kwargs.pop("env", None) or {})
        env.update({group_mod.SPAN_OFFSET_ENV: "0", group_mod.SPAN_SIZE_ENV: str(size)})
        spec = dict(spec or {}, env=env, scratch_size=start_kwargs.get("scratch_size", 4096),
                    spin_us=start_kwargs.get("spin_us"), imports=list(start_kwargs.get("imports", ())))
        for peer in peers:
            hub.send(peer, ("fork", hub.epoch, dict(spec, span_offset=peer.first, span_size=size, node=peer.node)))
        try:
            local = group_mod.start(nproc + 1, env=env, **start_kwargs)
        except BaseException:
            for peer in peers:
                hub.send(peer, ("abort", hub.epoch))
            raise
        span = cls(local, hub, peers)
        try:
            with span._watched():
                for peer in peers:
                    msg = span._next(peer, "forked")
                    if msg[2] is not None:
                        raise WorkerError(msg[2])
        except BaseException as exc:
            span._abort(f"the group did not start ({type(exc).__name__})")
            raise
        # At exit (and SIGTERM), before node 0's own group (registered earlier, closed later): every host's
        # workers stop together (JAX's runtime, say, waits at exit for every rank of the span).
        group_mod._register_exit(span)  # type: ignore[arg-type]
        log.info("synk_comm.net: %d ranks on %d hosts (%s)", size, nnodes,
                 ", ".join([socket.gethostname(), *(p.host for p in peers)]))
        return span

    # -- state -------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed or self.local.closed

    @property
    def abort_grace_s(self) -> float | None:
        return self._grace

    @abort_grace_s.setter
    def abort_grace_s(self, value: float | None) -> None:
        self._grace = value
        self.local.abort_grace_s = value

    def _require_usable(self) -> None:
        if self._broken:
            raise GroupBrokenError(self._broken)
        if self.closed:
            raise GroupBrokenError("the group is closed: start a new one")

    def _abort(self, reason: str) -> None:
        """A fatal failure: stop node 0's workers and tell every agent to stop its group."""
        if self._closed:
            return
        self._broken = f"{reason}; the group is closed: start a new one"
        self.local.watch = None
        for peer in self.peers:
            self.hub.send(peer, ("abort", self.epoch))
        if not self.local.closed:
            self.local._shutdown(timeout=0.5)
        self._closed = True

    # -- waiting on the other hosts ------------------------------------------------------------------
    def _check_hosts(self) -> None:
        now = time.monotonic()
        for peer in self._watching:
            if now - peer.last_seen > HOST_TIMEOUT_S:
                detail = f"no heartbeat from its node agent (pid {peer.pid}) for {now - peer.last_seen:.1f} s."
                self._abort(f"host {peer.host} was lost")
                raise HostLostError(peer.host, peer.ranks, detail)
            if peer.inbox and peer.inbox[0][0] == "done" and peer.inbox[0][5] is not None:
                self._fatal(peer, peer.inbox.popleft())

    def _fatal(self, peer: Peer, msg: Any) -> None:
        kind, *info = msg[5]
        if kind == "died":
            rank, pid, returncode, detail = info
            self._abort(f"rank {rank} on host {peer.host} died")
            raise WorkerDiedError(rank, pid, returncode, f" It ran on host {peer.host}.{detail}")
        errors, note = info
        self._abort(f"a worker on host {peer.host} failed")
        exc = WorkerError(errors)
        exc.add_note(note)
        raise exc

    def _watch(self) -> None:
        """Between two polls of node 0's waits: read the other hosts' messages, raise a fatal one."""
        self.hub.pump()
        self._check_hosts()

    def _next(self, peer: Peer, kind: str) -> Any:
        """The next message of ``peer`` (of ``kind``), watching every host and node 0's workers."""
        while True:
            if peer.inbox:
                msg = peer.inbox[0]
                if msg[0] == "done" and msg[5] is not None:
                    self._fatal(peer, peer.inbox.popleft())
                peer.inbox.popleft()
                if msg[0] != kind:
                    raise RuntimeError(f"synk_comm.net: expected {kind!r} from host {peer.host}, got {msg[0]!r}")
                return msg
            self.hub.pump(POLL_S)
            if not self.local.closed:
                self.local._check_workers()  # also self._watch
            else:
                self._check_hosts()

    @contextlib.contextmanager
    def _watched(self) -> Iterator[None]:
        now = time.monotonic()
        self.hub.pump()
        for peer in self.peers:
            peer.last_seen = max(peer.last_seen, now)  # idle time between two operations does not count
        self._watching = self.peers
        try:
            yield
        finally:
            self._watching = []

    @property
    def commands(self) -> int:
        """How many commands the master has started (:attr:`synk_comm.Group.commands`)."""
        return self.local.commands

    # -- commands ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def command(self, name: str, payload: Any = None) -> Iterator[None]:
        """As :meth:`synk_comm.Group.command`, over every host: the command starts on the other hosts
        (through their agents) and here; the body is the master's part; on exit every worker of
        every host has finished.  Errors: as there, with the rank in the span and its host."""
        self._require_usable()
        if name not in self.local._command_names:  # before any host is told: the group stays usable
            raise ValueError(f"no handler named {name!r} was registered in the workers; registered: "
                             f"{', '.join(self.local._command_names)}")
        with self._watched():
            self._seq += 1
            seq = self._seq
            used = np.flatnonzero(self.scratch)
            scratch = self.scratch[:int(used[-1]) + 1 if used.size else 0].copy()
            hook = _MASTER_HOOKS.get(name)
            want = _REPLIES.get(name)
            eager = bool(want(payload)) if want is not None else False
            self._remote_replies = None
            for peer in self.peers:
                body, extra = hook(self, peer, payload) if hook is not None else (payload, None)
                self.hub.send(peer, ("cmd", self.epoch, seq, name, body, scratch, extra, self._grace, eager))
            local_error: WorkerError | None = None
            try:
                with self.local.command(name, payload):
                    try:
                        yield
                    finally:  # the master's part may have set abort_grace_s: it holds from here
                        for peer in self.peers:
                            self.hub.send(peer, ("end", self.epoch, seq, self._grace))
            except WorkerError as exc:
                if self.local.closed:  # one program, stuck workers: fatal
                    self._abort("a worker failed")
                    raise
                local_error = exc
            except BaseException as exc:
                self._abort(f"the command failed ({type(exc).__name__})")
                raise
            remote: dict[int, list[np.ndarray]] = {}
            errors = list(local_error.errors) if local_error is not None else []
            for peer in self.peers:
                msg = self._next(peer, "done")
                errors.extend(msg[4])
                remote.update(msg[3])
            self._remote_replies = remote if eager else None
            if errors:
                raise WorkerError(sorted(errors, key=lambda e: e.rank))

    def run(self, name: str, payload: Any = None) -> Any:
        """Run handler ``name`` in every rank of every host (master included); the master's result."""
        with self.command(name, payload):
            return group_mod.HANDLERS[name](self, payload)  # type: ignore[arg-type]

    def replies(self) -> dict[int, list[np.ndarray]]:
        """After a command: each worker's reply (copies), by rank in the span."""
        result = self.local.replies()
        remote = self._remote_replies
        if remote is None:  # not sent with the command's end: ask for them
            self._require_usable()
            remote = {}
            with self._watched():
                for peer in self.peers:
                    self.hub.send(peer, ("replies", self.epoch, self._seq))
                for peer in self.peers:
                    msg = self._next(peer, "replies")
                    if msg[4] is not None:
                        raise WorkerError([msg[4]])
                    remote.update(msg[3])
            self._remote_replies = remote
        for rank, arrays in remote.items():
            result[rank] = [np.array(a) for a in arrays]
        return result

    # -- the master's part of a command: collectives with the workers ------------------------------
    def _relay(self, what: str, local: Callable[[], Any], *args: Any) -> tuple[Any, list[Any]]:
        for peer in self.peers:
            self.hub.send(peer, ("coll", self.epoch, self._seq, what, *args))
        mine = local()
        return mine, [self._next(peer, "coll")[3] for peer in self.peers]

    def barrier(self) -> None:
        """Every host's workers reach the barrier, each host's group with its own master (the agent):
        the workers of a host wait for their host, not for the others."""
        self._require_usable()
        self._relay("barrier", self.local.barrier)

    def gather_object(self, obj: object, *, root: int | None = None) -> list[object] | None:
        """The master gets every rank's object in rank order (the workers: None)."""
        self._require_usable()
        mine, others = self._relay("gather_object", lambda: self.local.gather_object(obj))
        result = list(mine or [])
        for part in others:
            result.extend(part)
        return result

    @property
    def host(self) -> SpanGroup:
        return self

    def all_gather(self, array: np.ndarray) -> list[np.ndarray]:
        """Every rank of every host gets every rank's array, in rank order (the master's first).

        Two steps on each host: its master (this process, or the host's agent) gathers the host's
        arrays, the hosts exchange them through this master, and each host's master broadcasts
        the whole list to its workers (:meth:`synk_comm.shm_collectives.ShmCollectives.all_gather`
        of a group that spans hosts).  For small arrays (shapes, flags): everything goes through
        the master.
        """
        self._require_usable()
        mine, others = self._relay("all_gather", lambda: self.local.host.gather(array, root=0))
        everything = list(mine or [])
        for part in others:
            everything.extend(part)
        for peer in self.peers:
            self.hub.send(peer, ("coll", self.epoch, self._seq, "all_gather:result", everything))
        self.local.host.broadcast_object(everything, root=0)
        return everything

    def all_reduce(self, array: Any, op: ReduceOp | str = "sum", *, out: np.ndarray | None = None) -> np.ndarray:
        """Every rank of every host gets ``op`` over every rank's array (the master's included):
        within each host through shared memory, then across hosts through this master.

        Three steps: each host's master (this process, or the host's agent, which gives the op's
        identity) reduces its host's arrays, read in place in shared memory (rank order); the agents
        send their host's partial result here, where the partials are reduced (host order, so in rank
        order up to the grouping); the result goes back to every host's master, which broadcasts it
        through shared memory.  Across hosts one array per host travels each way.  ``avg``: the sum
        over every rank divided by :attr:`size`.  Every rank gets the same bits.
        """
        self._require_usable()
        a = np.asarray(array)
        rop = as_op(op, a.dtype)
        local_op = ReduceOp.SUM if rop is ReduceOp.AVG else rop
        mine, partials = self._relay("all_reduce", lambda: self.local.host.reduce(a, local_op, root=0),
                                     local_op.value, a.shape, a.dtype.str)
        parts = [mine, *(p for p in partials if p is not None)]
        result = _reduce_into(local_op, parts, np.empty_like(a) if out is None else out)
        if rop is ReduceOp.AVG:
            np.divide(result, self.size, out=result)
        for peer in self.peers:
            self.hub.send(peer, ("coll", self.epoch, self._seq, "all_reduce:result", result))
        self.local.host.broadcast(result, root=0)
        return result

    # -- shutdown ----------------------------------------------------------------------------------
    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop every host's workers (the agents stay, ready for the next group).  Idempotent."""
        if self._closed:
            return
        self.local.watch = None
        for peer in self.peers:
            self.hub.send(peer, ("close", self.epoch))
        if not self.local.closed:
            self.local.close(timeout)
        deadline = time.monotonic() + timeout
        for peer in self.peers:  # wait for their workers to be gone (a lost host: no answer, no wait)
            while time.monotonic() < deadline and time.monotonic() - peer.last_seen < HOST_TIMEOUT_S:
                if any(m[0] == "closed" for m in peer.inbox):
                    break
                self.hub.pump(POLL_S)
        self._closed = True


