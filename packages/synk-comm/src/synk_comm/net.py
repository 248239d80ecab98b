"""Groups that span hosts: one host's shared-memory group per host, joined over pyzmq.

Within a host, a group is what :func:`synk_comm.start` makes (lock-step over POSIX semaphores,
data through shared memory).  Between hosts, this module relays the master's commands:

* The **master** (the user's process, on node 0) binds a :class:`Hub` (a ZeroMQ ROUTER socket on
  ``tcp://ADDRESS:PORT``, the interface it is given) and drives a :class:`SpanGroup`: its own
  host's group (node 0's workers) and one :class:`Peer` per other host.  A :class:`SpanGroup`
  offers the master's side of a :class:`~synk_comm.Group` (``command``, ``run``, ``replies``, ``scratch``, ``barrier``,
  ``gather_object``, ``all_gather``, ``all_reduce``, ``close``), with the ranks of every host: node
  0's workers first, then each other node's in node order.
* On every other host a **node agent** (:class:`Agent`, a DEALER socket connected to the hub)
  starts that host's workers as its own shared-memory group (its own shared-memory names), in
  which the agent plays the master: it replays each command of the master into its group (the
  scratch slots, the payload, the master's part of the command: barriers and ``gather_object``)
  and sends back its workers' replies and errors.  The workers learn their ranks in the span from
  their environment (:attr:`Group.span_offset`, :attr:`Group.span_size`).

Collectives of the workers of every host: ``all_gather`` and ``all_reduce`` of a group spanning
hosts go through each host's master (shared memory within the host, one array per host over
pyzmq); fast collectives across hosts belong to an existing distributed runtime (synkhronos' engine:
JAX's, NCCL across hosts on GPU, gloo on CPU).  Messages are pickles (protocol 5, numpy arrays as
out-of-band frames: no copy into the pickle).

Who may talk to whom: one secret per run
    Every message between the master and the agents carries an HMAC-SHA256 of its bytes under the
    run's secret (:func:`run_secret`: the ``secret`` argument, else ``SYNK_RUN_SECRET``; every host
    of the run has the same one), of the sender's (or the recipient's) ZeroMQ identity and of a
    sequence number.  A receiver checks it (:func:`hmac.compare_digest`) *before* anything is
    unpickled: a message without this run's signature, or one already seen (a replay), is dropped
    unread, and logged once per source address.  So a process that can reach the port but does not
    know the secret cannot run code in the master or an agent (a pickle is code), nor pose as a
    host, nor keep a lost host alive with heartbeats (they are signed too).  Not protected: the
    bytes are signed, not encrypted (someone who can read the network reads the data), and a flood
    of messages costs the receiver the time to check them.

    Why an HMAC rather than ZeroMQ's CURVE: CURVE needs a libzmq built with libsodium (pyzmq's own
    wheels have it, ``zmq.has("curve")``; distribution and source builds may not), and it proves
    nothing about the client by itself: the master would need a ZAP authenticator thread holding
    the allowed client keys, and every host a key pair handed out beforehand.  An HMAC needs one
    shared string and works with any libzmq; its cost is one SHA-256 pass over each message on each
    side (about 1-2 GB/s per core with the CPU's SHA extensions), against CURVE's encryption of
    every byte.

Relay hooks (:func:`relay`) let a framework rewrite a command for another host: the master's hook
gives each host its own payload and extra data (e.g. the input rows its ranks read), the agent's
hook applies them to the host's own copies (e.g. its shared-memory Data) before the command runs.

Failure, within :data:`HOST_TIMEOUT_S` (3 s) and no hang
    A worker that dies on another host: :class:`~synk_comm.WorkerDiedError` in the master (rank
    in the span, host named).  A worker's exception: :class:`~synk_comm.WorkerError` (rank and
    host in the message; the group stays usable unless the command was one program over every
    rank, see :attr:`Group.abort_grace_s`).  An agent that stops answering (killed, host down, network):
    :class:`~synk_comm.HostLostError` naming the host (agents send heartbeats every
    :data:`HEARTBEAT_S`).  After any of the fatal ones the master closes its own group and tells
    every agent to close its group (their workers are stopped); the agents stay, ready for the
    next group.  An agent whose master is gone (its connection drops) stops its workers and exits
    with status 1; when the master's process ends normally, every agent exits with status 0.

Example
-------
The master's side; each other host runs ``Agent(address, node, nproc).serve()``, every process
with the same ``SYNK_RUN_SECRET``.

>>> hub = Hub("tcp://10.0.0.1:29500")                          # doctest: +SKIP
>>> group = SpanGroup.start(hub, nnodes=2, nproc=2)              # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hmac
import logging
import os
import pickle
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from synk_comm import group as group_mod
from synk_comm.errors import GroupBrokenError, HostLostError, RemoteError, WorkerDiedError, WorkerError
from synk_comm.ops import ReduceOp, as_op, identity
from synk_comm.shm_collectives import _reduce_into

__all__ = ["Agent", "HEARTBEAT_S", "HOST_TIMEOUT_S", "Hub", "Peer", "SECRET_ENV", "SpanGroup", "new_secret", "relay",
           "run_secret"]

log = logging.getLogger(__name__)

HEARTBEAT_S = float(os.environ.get("SYNK_NET_HEARTBEAT_S", "0.25"))
"""Seconds between two heartbeats of an agent."""
HOST_TIMEOUT_S = float(os.environ.get("SYNK_HOST_TIMEOUT_S", "3"))
"""Seconds without a heartbeat after which the master counts a host as lost."""
CONNECT_TIMEOUT_S = 300.0
"""Seconds the master waits for every agent at a fork, and an agent for its master (default of
:func:`connect_timeout`)."""


def connect_timeout() -> float:
    """``SYNK_CONNECT_TIMEOUT_S`` (read when used), else :data:`CONNECT_TIMEOUT_S`."""
    return float(os.environ.get("SYNK_CONNECT_TIMEOUT_S", "") or CONNECT_TIMEOUT_S)
CLOSE_TIMEOUT_S = 10.0
POLL_S = 0.05
PROTOCOL = 2
SECRET_ENV = "SYNK_RUN_SECRET"
"""The environment variable holding the run's secret (the same on every host of the run)."""
MIN_SECRET_BYTES = 16


def new_secret() -> str:
    """A fresh secret for a run: 64 hexadecimal digits (256 random bits)."""
    return secrets.token_hex(32)


def run_secret(secret: str | bytes | None = None) -> bytes:
    """The run's secret: ``secret`` if given, else the ``SYNK_RUN_SECRET`` environment variable.

    Raises
    ------
    ValueError
        If there is none, or it is shorter than 16 bytes (say what to set).
    """
    value = os.environ.get(SECRET_ENV, "") if secret is None else secret
    key = value.encode() if isinstance(value, str) else bytes(value)
    if len(key) < MIN_SECRET_BYTES:
        what = "is not set" if not key else f"has {len(key)} bytes, fewer than {MIN_SECRET_BYTES}"
        raise ValueError(f"a run over several hosts needs a secret shared by its hosts, and {SECRET_ENV} {what}: "
                         f"set it to the same random value on every host, e.g. `export {SECRET_ENV}=$(python -c "
                         "'import secrets; print(secrets.token_hex(32))')` before starting the launchers "
                         "(srun passes the environment on)")
    return key


_TAG = struct.Struct(">Q")
_MAC_BYTES = 32


def _view(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


class _Seal:
    """HMAC-SHA256 signatures of messages, with a sequence number per sender against replays.

    A sealed message is ``[tag, *frames]``, ``tag`` = the sequence number (8 bytes) + the HMAC of
    (the party's label, the number, each frame with its length).  The label is the sender's ZeroMQ
    identity (agent to master) or ``b"to:" +`` the recipient's (master to agent): a message signed
    for one party is refused by another.
    """

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.sent = 0
        self.seen: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def _mac(self, label: bytes, seq: bytes, frames: Sequence[Any]) -> bytes:
        h = hmac.new(self.key, digestmod="sha256")
        h.update(_TAG.pack(len(label)))
        h.update(label)
        h.update(seq)
        for frame in frames:
            view = _view(frame)
            h.update(_TAG.pack(view.nbytes))
            h.update(view)
        return h.digest()

    def seal(self, label: bytes, frames: list[Any]) -> list[Any]:
        with self._lock:
            self.sent += 1
            seq = _TAG.pack(self.sent)
        return [seq + self._mac(label, seq, frames), *frames]

    def open(self, label: bytes, frames: Sequence[Any]) -> Sequence[Any] | None:
        """The frames after the tag if the tag is this run's and new; None otherwise (nothing read)."""
        if not frames:
            return None
        tag = bytes(_view(frames[0]))
        if len(tag) != _TAG.size + _MAC_BYTES:
            return None
        seq, body = tag[:_TAG.size], frames[1:]
        if not hmac.compare_digest(tag[_TAG.size:], self._mac(label, seq, body)):
            return None
        number = _TAG.unpack(seq)[0]
        if number <= self.seen.get(label, 0):
            return None  # a replay
        self.seen[label] = number
        return body


class _Refusals:
    """Messages dropped for a missing or wrong signature: logged once per source address."""

    LIMIT = 1000

    def __init__(self, where: str) -> None:
        self.where = where
        self.sources: set[str] = set()
        self.count = 0

    def __call__(self, frames: Sequence[Any]) -> None:
        self.count += 1
        source = "an unknown address"
        with contextlib.suppress(Exception):
            source = str(frames[-1].get("Peer-Address"))
        if source in self.sources or len(self.sources) >= self.LIMIT:
            log.debug("synk_comm.net: %s dropped another unsigned message from %s", self.where, source)
            return
        self.sources.add(source)
        log.warning("synk_comm.net: %s dropped a message from %s without this run's signature, unread: a "
                    "process outside the run, or a host started with another %s (further ones from there are "
                    "dropped silently)", self.where, source, SECRET_ENV)

MasterHook = Callable[["SpanGroup", "Peer", Any], tuple[Any, Any]]
AgentHook = Callable[["Agent", Any, Any], Any]
_MASTER_HOOKS: dict[str, MasterHook] = {}
_REPLIES: dict[str, Callable[[Any], bool]] = {}
_AGENT_HOOKS: dict[str, AgentHook] = {}
_FORK_HOOKS: list[Callable[[Agent], None]] = []


def relay(name: str, *, master: MasterHook | None = None, agent: AgentHook | None = None,
          replies: Callable[[Any], bool] | None = None) -> None:
    """Register how command ``name`` crosses hosts.

    ``master(span, peer, payload) -> (payload for that host, extra)`` runs in the master for every
    other host before the command starts; ``agent(agent, payload, extra) -> payload`` runs in that
    host's agent before it starts the command in its own group.  Without hooks the payload goes
    unchanged.  ``replies(payload) -> bool``: whether every worker replies to this command (the
    replies then come back with its end, saving :meth:`SpanGroup.replies` a round trip).
    """
    if master is not None:
        _MASTER_HOOKS[name] = master
    if agent is not None:
        _AGENT_HOOKS[name] = agent
    if replies is not None:
        _REPLIES[name] = replies


def on_agent_fork(fn: Callable[[Agent], None]) -> None:
    """Call ``fn(agent)`` in every agent before it starts a new group (to drop per-group state)."""
    _FORK_HOOKS.append(fn)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:  # pragma: no cover - the dependency is declared
        raise ImportError("groups across hosts need pyzmq: pip install 'synk-comm[net]' (or pyzmq)") from exc
    return zmq


def _pack(obj: Any) -> list[Any]:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers)]


def _unpack(frames: Sequence[Any]) -> Any:
    return pickle.loads(frames[0], buffers=[f.buffer if hasattr(f, "buffer") else f for f in frames[1:]])


def _remote_error(exc: BaseException, rank: int, host: str) -> RemoteError:
    import traceback

    return RemoteError(rank, type(exc).__name__, str(exc), traceback.format_exc(), host=host)


# --- the master's end -----------------------------------------------------------------------------

@dataclass
class Peer:
    """Another host, as the master knows it."""

    ident: bytes
    node: int
    host: str
    nproc: int
    pid: int
    first: int = 0
    """The span rank of its first worker, minus one (its :attr:`Group.span_offset`)."""
    last_seen: float = field(default_factory=time.monotonic)
    inbox: collections.deque[Any] = field(default_factory=collections.deque)

    @property
    def ranks(self) -> list[int]:
        """Its workers' ranks in the span."""
        return list(range(self.first + 1, self.first + 1 + self.nproc))


class Hub:
    """The master's socket that the node agents connect to (one per process, kept across groups).

    Parameters
    ----------
    address : str
        Where to bind: the interface the agents reach, e.g. ``tcp://10.0.0.1:29500`` (``tcp://*:PORT``,
        every interface, works but exposes the port wherever the host is reachable).
    secret : str or bytes, optional
        The run's secret (default: :func:`run_secret`, ``SYNK_RUN_SECRET``): every message is signed
        with it and messages without it are dropped unread.

    Raises
    ------
    ValueError
        Without a secret (:func:`run_secret`).
    OSError
        If the address cannot be bound.
    """

    def __init__(self, address: str, *, secret: str | bytes | None = None) -> None:
        zmq = _zmq()
        self.address = address
        self._seal = _Seal(run_secret(secret))
        self._refused = _Refusals("the master")
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if address.startswith("tcp://["):
            self.sock.setsockopt(zmq.IPV6, 1)
        try:
            self.sock.bind(address)
        except zmq.ZMQError as exc:
            self.context.destroy(linger=0)
            raise OSError(f"cannot bind the master's endpoint {address}: {exc}; is another run using the port? "
                          "Pick another --coordinator port") from exc
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.peers: dict[bytes, Peer] = {}
        self.epoch = 0
        """Counts the groups; messages of an older group are dropped."""
        self.closed = False
        atexit.register(self.shutdown)

    def by_node(self) -> dict[int, Peer]:
        return {p.node: p for p in self.peers.values()}

    def send(self, peer: Peer, obj: Any) -> None:
        zmq = _zmq()
        try:
            self.sock.send_multipart([peer.ident, *self._seal.seal(b"to:" + peer.ident, _pack(obj))], copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: its connection is gone
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.debug("synk_comm.net: %s unreachable: %s", peer.host, exc)

    def pump(self, timeout: float = 0.0) -> bool:
        """Receive what has arrived (waiting up to ``timeout`` seconds for the first message)."""
        got = False
        wait_ms = int(timeout * 1000)
        while self.poller.poll(wait_ms):
            wait_ms = 0
            frames = self.sock.recv_multipart(copy=False)
            ident = bytes(frames[0].bytes)
            body = self._seal.open(ident, frames[1:])
            if body is None:  # not from this run: never unpickled
                self._refused(frames)
                continue
            now = time.monotonic()
            if ident.endswith(b".hb"):
                peer = self.peers.get(ident[:-3])
                if peer is not None:
                    peer.last_seen = now
                continue
            msg = _unpack(body)
            got = True
            if msg[0] == "hello":
                _, node, host, nproc, pid, protocol = msg
                if protocol != PROTOCOL:
                    log.error("synk_comm.net: agent of node %d (%s) speaks protocol %s, this master %s: ignored",
                              node, host, protocol, PROTOCOL)
                    continue
                for old in [p for p in self.peers.values() if p.node == node and p.ident != ident]:
                    del self.peers[old.ident]
                self.peers[ident] = Peer(ident, node, host, nproc, pid, last_seen=now)
                log.info("synk_comm.net: node %d (%s, %d ranks, pid %d) connected", node, host, nproc, pid)
                continue
            peer = self.peers.get(ident)
            if peer is None:
                continue
            peer.last_seen = now
            if msg[0] == "bye":
                del self.peers[ident]
                continue
            if msg[1] == self.epoch:
                peer.inbox.append(msg)
        return got

    def wait_nodes(self, nodes: Sequence[int], timeout: float | None = None) -> list[Peer]:
        """The peers of ``nodes`` once each has sent a heartbeat since this call (in node order),
        waiting up to ``timeout`` seconds (default :func:`connect_timeout`).

        Raises
        ------
        TimeoutError
            Naming the nodes that did not connect.
        """
        timeout = connect_timeout() if timeout is None else timeout
        start = time.monotonic()
        deadline = start + timeout
        while True:
            self.pump(POLL_S)
            found = self.by_node()
            missing = [n for n in nodes if n not in found or found[n].last_seen < start]
            if not missing:
                return [found[n] for n in nodes]
            if time.monotonic() > deadline:
                raise TimeoutError(f"node(s) {missing} did not connect to the master at {self.address} within "
                                   f"{timeout:g} s: start `python -m synkhronos.launch ... --node-rank R` on those "
                                   "hosts (the same --nnodes and --coordinator), and check that the port is open")

    def shutdown(self) -> None:
        """Tell every agent that the master is done (they exit 0), and close the socket."""
        if self.closed:
            return
        self.closed = True
        for peer in list(self.peers.values()):
            with contextlib.suppress(Exception):
                self.send(peer, ("shutdown", self.epoch))
        time.sleep(0.05)  # let the I/O thread hand the last messages to the kernel
        self.context.destroy(linger=200)


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


# --- a node's end -------------------------------------------------------------------------------

class _Aborted(Exception):
    """The master told this agent to stop its group."""


class MasterLostError(RuntimeError):
    """The agent's connection to its master dropped (the master's process ended, or the network)."""


class Agent:
    """A node agent: serves one host's workers to a master on another host.

    Parameters
    ----------
    address : str
        The master's endpoint, e.g. ``tcp://node0:29500``.
    node : int
        This node's rank (1.. ; node 0 is the master's).
    nproc : int
        Workers to start on this host.
    host : str, optional
        The name the master reports for this host (default: the host name).
    start : callable, optional
        ``start(spec) -> Group`` starts this host's group from the master's fork message (default:
        :func:`synk_comm.start` with its ``env``, ``imports``, ``scratch_size``, ``spin_us``); a
        framework binding passes its own (devices, thread counts of this host).
    secret : str or bytes, optional
        The run's secret, the master's (default: :func:`run_secret`, ``SYNK_RUN_SECRET``).

    Raises
    ------
    ValueError
        Without a secret (:func:`run_secret`).
    """

    def __init__(self, address: str, node: int, nproc: int, host: str | None = None,
                 start: Callable[[dict[str, Any]], group_mod.Group] | None = None, *,
                 secret: str | bytes | None = None) -> None:
        self.address = address
        key = run_secret(secret)
        self._seal = _Seal(key)
        self._beat_seal = _Seal(key)
        self._refused = _Refusals(f"node {node}'s agent")
        self.node = node
        self.nproc = nproc
        self.host = host or socket.gethostname()
        self._start = start or _default_start
        self.group: group_mod.Group | None = None
        self.epoch = -1
        self.span_offset = 0
        self.state: dict[str, Any] = {}
        """Per-group state of the framework's hooks (emptied at every fork)."""
        self._pending: collections.deque[Any] = collections.deque()
        self._extent = 0
        self._stop = threading.Event()
        self._connected = False

    # -- sockets -----------------------------------------------------------------------------------
    def _connect(self) -> None:
        zmq = _zmq()
        self.context = zmq.Context()
        ident = f"node{self.node}-{os.getpid()}".encode()
        self.ident = ident
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, ident)
        self.sock.setsockopt(zmq.LINGER, 1000)
        for opt, value in (("HEARTBEAT_IVL", 1000), ("HEARTBEAT_TIMEOUT", int(HOST_TIMEOUT_S * 1000)),
                           ("HEARTBEAT_TTL", int(HOST_TIMEOUT_S * 1000))):
            if hasattr(zmq, opt):
                self.sock.setsockopt(getattr(zmq, opt), value)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.address)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self._send(("hello", self.node, self.host, self.nproc, os.getpid(), PROTOCOL))
        self._beat = threading.Thread(target=self._heartbeat, args=(ident + b".hb",), daemon=True,
                                      name="synk-net-heartbeat")
        self._beat.start()

    def _heartbeat(self, ident: bytes) -> None:
        zmq = _zmq()
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, ident)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self.address)
        try:
            while not self._stop.wait(HEARTBEAT_S):
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(self._beat_seal.seal(ident, []), zmq.NOBLOCK)
        finally:
            sock.close(0)

    def _send(self, obj: Any) -> None:
        self.sock.send_multipart(self._seal.seal(self.ident, _pack(obj)), copy=False)

    def _recv(self) -> Any | None:
        """The master's next message (unpickled once its signature is checked), None for one dropped."""
        frames = self.sock.recv_multipart(copy=False)
        body = self._seal.open(b"to:" + self.ident, frames)
        if body is None:
            self._refused(frames)
            return None
        return _unpack(body)

    def _poll(self, timeout: float) -> Any | None:
        """The next message of the current group (or a control message), None after ``timeout``."""
        zmq = _zmq()
        from zmq.utils.monitor import recv_monitor_message

        deadline = time.monotonic() + timeout
        while True:
            events = dict(self.poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self.monitor in events:
                event = recv_monitor_message(self.monitor)["event"]
                if event == zmq.EVENT_CONNECTED:
                    self._connected = True
                elif event == zmq.EVENT_DISCONNECTED and self._connected:
                    # The master's last words may have come with the end of its connection: read them first.
                    while self.sock.poll(0):
                        msg = self._recv()
                        if msg is not None and msg[0] == "shutdown":
                            return msg
                    raise MasterLostError(f"the connection to the master at {self.address} dropped")
            if self.sock in events:
                msg = self._recv()
                if msg is not None and (msg[0] in ("shutdown", "fork") or msg[1] == self.epoch):
                    return msg
                continue  # a late message of an older group
            if time.monotonic() >= deadline:
                return None

    def _next(self, timeout: float) -> Any | None:
        if self._pending:
            return self._pending.popleft()
        msg = self._poll(timeout)
        if msg is not None and msg[0] in ("abort", "shutdown"):
            raise _Aborted(msg[0])
        return msg

    def _watch(self) -> None:
        """Between two polls of this host's waits: the master may abort the command, or be gone."""
        msg = self._poll(0)
        if msg is None:
            return
        if msg[0] in ("abort", "shutdown", "fork"):
            if msg[0] == "fork":  # served once this group is stopped
                self._pending.appendleft(msg)
            raise _Aborted(msg[0])
        self._pending.append(msg)

    # -- serving -----------------------------------------------------------------------------------
    def serve(self) -> int:
        """Serve the master until it ends: 0 when it ended normally, 1 when it was lost or never came."""
        self._connect()
        log.info("synk_comm.net: node %d (%s) waiting for the master at %s", self.node, self.host, self.address)
        idle_since = time.monotonic()
        patience = connect_timeout()
        try:
            while True:
                try:
                    msg = self._pending.popleft() if self._pending else self._poll(1.0)
                except MasterLostError as exc:
                    log.error("synk_comm.net: node %d: %s; stopping", self.node, exc)
                    return 1
                if msg is None:
                    if not self._connected and time.monotonic() - idle_since > patience:
                        log.error("synk_comm.net: node %d: no master at %s after %g s; stopping", self.node,
                                  self.address, patience)
                        return 1
                    continue
                kind = msg[0]
                if kind == "shutdown":
                    return 0
                try:
                    if kind == "fork":
                        self._fork(msg)
                    elif kind == "cmd":
                        self._command(msg)
                    elif kind == "close":
                        self._close_group(kill=False)
                        self._send(("closed", self.epoch))
                    elif kind == "abort":
                        self._close_group(kill=True)
                    elif kind == "replies":
                        self._send_replies(msg)
                except _Aborted as exc:
                    self._close_group(kill=True)
                    if str(exc) == "shutdown":
                        return 0
                except MasterLostError as exc:
                    log.error("synk_comm.net: node %d: %s; stopping its workers", self.node, exc)
                    return 1
        finally:
            self._close_group(kill=True)
            self._stop.set()
            with contextlib.suppress(Exception):
                self._send(("bye", self.epoch))
            self.context.destroy(linger=500)

    def _close_group(self, kill: bool) -> None:
        self.state = {}  # the hooks' per-group objects (e.g. shared memory) go with the group
        g, self.group = self.group, None
        if g is not None and not g.closed:
            g.watch = None
            if kill:
                g._shutdown(timeout=0.5)
            else:
                g.close()

    def _fork(self, msg: Any) -> None:
        _, epoch, spec = msg
        self._close_group(kill=True)
        self.epoch = epoch
        self._pending.clear()
        self.state = {}
        self._extent = 0
        for fn in _FORK_HOOKS:
            fn(self)
        self.span_offset = int(spec["span_offset"])
        env = dict(spec["env"], **{group_mod.SPAN_OFFSET_ENV: str(self.span_offset),
                                   group_mod.SPAN_SIZE_ENV: str(spec["span_size"])})
        try:
            self.group = self._start(dict(spec, env=env, nproc=self.nproc))
        except WorkerError as exc:
            self._send(("forked", epoch, [self._globalise(e) for e in exc.errors]))
            return
        except Exception as exc:
            self._send(("forked", epoch, [_remote_error(exc, 0, self.host)]))
            return
        self.group.watch = self._watch
        self._send(("forked", epoch, None))

    def _globalise(self, err: RemoteError) -> RemoteError:
        err.rank = err.rank + self.span_offset if err.rank > 0 else err.rank
        err.host = self.host
        return err

    def _replies(self, g: group_mod.Group) -> dict[int, list[np.ndarray]]:
        return {r + self.span_offset: arrays for r, arrays in g.replies().items()}

    def _send_replies(self, msg: Any) -> None:
        g = self.group
        try:
            if g is None or g.closed:
                raise GroupBrokenError(f"the group on host {self.host} is closed")
            self._send(("replies", msg[1], msg[2], self._replies(g), None))
        except Exception as exc:
            self._send(("replies", msg[1], msg[2], {}, _remote_error(exc, 0, self.host)))

    def _command(self, msg: Any) -> None:
        _, epoch, seq, name, payload, scratch, extra, grace, eager = msg
        g = self.group
        if g is None or g.closed:
            done: tuple[Any, ...] = ("done", epoch, seq, {}, [], ("error", [RemoteError(0, "GroupBrokenError",
                    f"the group on host {self.host} is closed", "", host=self.host)],
                    "The group on that host was closed before this command."))
            self._send(done)
            return
        errors: list[RemoteError] = []
        fatal: Any = None
        replies: dict[int, list[np.ndarray]] = {}
        try:
            hook = _AGENT_HOOKS.get(name)
            if hook is not None:
                payload = hook(self, payload, extra)
            n = len(scratch)
            g.scratch[:n] = scratch
            if self._extent > n:
                g.scratch[n:self._extent] = 0
            self._extent = n
            g.abort_grace_s = grace
            with g.command(name, payload):
                self._master_part(g, seq)
            if eager:
                replies = self._replies(g)
        except WorkerDiedError as exc:
            fatal = ("died", exc.rank + self.span_offset, exc.pid, exc.returncode, exc.detail)
        except WorkerError as exc:
            errors = [self._globalise(e) for e in exc.errors]
            if g.closed:
                fatal = ("stuck", errors, "The workers of that host did not finish (stuck in a collective with "
                         "the failed rank): the group is closed; start a new one.")
                errors = []
        except (_Aborted, MasterLostError):
            raise
        except Exception as exc:  # the hook failed before the command started
            errors = [_remote_error(exc, 0, self.host)]
        self._send(("done", epoch, seq, replies, errors, fatal))
        if fatal is not None:
            self._close_group(kill=True)

    def _master_part(self, g: group_mod.Group, seq: int) -> None:
        """The master's part of the current command, replayed here: its collectives with the workers,
        until it says the part is over."""
        while True:
            msg = self._next(POLL_S)
            if msg is None:
                g._check_workers()  # a worker that dies while the master's part goes on
                continue
            if msg[0] == "end":
                g.abort_grace_s = msg[3]
                return
            if msg[0] != "coll":
                raise RuntimeError(f"synk_comm.net: unexpected {msg[0]!r} during a command")
            what = msg[3]
            if what == "barrier":
                g.barrier()
                self._send(("coll", self.epoch, seq, None))
            elif what == "gather_object":
                result = g.gather_object(None)
                self._send(("coll", self.epoch, seq, list(result or [])[1:]))
            elif what == "all_gather":  # see SpanGroup.all_gather
                parts = g.host.gather(np.empty(0), root=0)
                self._send(("coll", self.epoch, seq, list(parts or [])[1:]))
            elif what == "all_gather:result":
                g.host.broadcast_object(msg[4], root=0)
            elif what == "all_reduce":  # see SpanGroup.all_reduce: this host's partial result
                op, shape, dtype = ReduceOp(msg[4]), msg[5], np.dtype(msg[6])
                partial = g.host.reduce(np.full(shape, identity(op, dtype), dtype), op, root=0)
                self._send(("coll", self.epoch, seq, partial))
            elif what == "all_reduce:result":
                g.host.broadcast(msg[4], root=0)
            else:
                raise RuntimeError(f"synk_comm.net: unknown collective {what!r}")


def _default_start(spec: dict[str, Any]) -> group_mod.Group:
    return group_mod.start(spec["nproc"] + 1, imports=spec.get("imports", ()), env=spec["env"],
                           scratch_size=spec.get("scratch_size", 4096), spin_us=spec.get("spin_us"))


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - synkhronos.launch is the CLI
    """``python -m synk_comm.net ADDRESS NODE NPROC``: a bare agent (framework-free handlers; the
    run's secret from ``SYNK_RUN_SECRET``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return Agent(args[0], int(args[1]), int(args[2])).serve()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
