"""The master's end of the network: the :class:`Hub` socket the node agents connect to, and each
other host as the master knows it (:class:`Peer`)."""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from synk_comm.net.wire import POLL_S, PROTOCOL, _pack, _Refusals, _Seal, _unpack, _zmq, connect_timeout, run_secret

log = logging.getLogger(__name__)


@dataclass
class Peer:
    """Another host, as the master knows it."""

    ident: bytes
    node: int
    host: str
    nproc: int
    pid: int
    first: int = 0
    """The span rank of its first worker, minus one (its
    :attr:`Group.span_offset <synk_comm.group_base.GroupBase.span_offset>`)."""
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


