"""A node's end of the network: the node agent (:class:`Agent`) that starts its host's workers as a
group of its own and replays the master's commands into it; ``python -m synk_comm.net`` runs a bare one."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from synk_comm import group as group_mod
from synk_comm.errors import GroupBrokenError, RemoteError, WorkerDiedError, WorkerError
from synk_comm.net.hooks import _AGENT_HOOKS, _FORK_HOOKS
from synk_comm.net.wire import (
    HEARTBEAT_S,
    HOST_TIMEOUT_S,
    POLL_S,
    PROTOCOL,
    _pack,
    _Refusals,
    _remote_error,
    _Seal,
    _unpack,
    _zmq,
    connect_timeout,
    run_secret,
)
from synk_comm.ops import ReduceOp, identity

log = logging.getLogger(__name__)


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
