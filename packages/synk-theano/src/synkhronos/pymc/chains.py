"""``pm.sample``'s chains inside a ``data_parallel`` block: PyMC's own chain processes, whose likelihood
evaluations the master gathers and evaluates in the ranks together, one call per round.

The master runs a :class:`_ChainServer` (a thread and a Unix socket) while PyMC's
``_mp_sample`` runs; each chain process reaches it through a :class:`_ChainClient`, made on its
first evaluation (:func:`client`).  A chain's NUTS step (its Python) runs in its own process, on
any of the group's cores, in parallel with the other chains', where chains in threads of the
master took turns under the interpreter's lock on the master's one core.

Which points go together: the server evaluates when every connected chain has sent a point, or
:data:`GRACE_S` after the first one came (a chain between two draws, or ending).  Each chain keeps
its slot (a position in the batched call) while it runs, and a slot's results depend on its own
point alone (:class:`~synkhronos.pymc.batched._Batched`), so the draws do not depend on which
points happened to go together: two runs from the same seed give the same draws.
"""

from __future__ import annotations

import hmac
import logging
import os
import pickle
import secrets
import selectors
import socket
import struct
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from synkhronos.errors import ChainStopped

_log = logging.getLogger(__name__)

GRACE_S = 0.005
"""Seconds the server waits, after a round's first point, for the other chains' points before it
evaluates without them (a chain's step between two evaluations takes about 1 ms of Python)."""


class _Address(NamedTuple):
    """How a chain process reaches the server: an abstract Unix socket (no file to clean up), the
    token it authenticates with, and the cores its Python may run on."""

    path: str
    token: bytes
    cpus: tuple[int, ...]


_CHANNEL: _Address | None = None
"""The server's address: in the master while a server runs; in a chain process, inherited (fork)
or set when the step method's likelihood node is unpickled (spawn, forkserver)."""


def channel() -> _Address | None:
    return _CHANNEL


def adopt_channel(address: _Address) -> None:
    """In a chain process: the server that its unpickled likelihood nodes evaluate through."""
    global _CHANNEL
    _CHANNEL = address


# -- messages: a length, then a pickle ---------------------------------------------------------
_HEADER = struct.Struct("<Q")


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    return pickle.loads(_exactly(sock, n))


# -- the master's side -------------------------------------------------------------------------
class _ChainServer:
    """Evaluates the chain processes' points in the ranks, ``width`` slots per call.

    Parameters
    ----------
    width : int
        Chains that run at once (PyMC runs ``min(cores, chains)``): the batched call's slots.
    evaluate : callable
        ``evaluate(split_id, points, width, with_grad)``: the results of each slot's point
        (:meth:`_Split.evaluate_many <synkhronos.pymc.split._Split.evaluate_many>`); called from
        the server's thread, the only thread that calls the group while the server runs.
    cpus : sequence of int
        The cores the chains' Python may run on.
    """

    def __init__(self, width: int, evaluate: Callable[[int, dict[int, Any], int, bool], dict[int, list[Any]]],
                 cpus: Sequence[int]) -> None:
        self.width = width
        self._evaluate_many = evaluate
        self.address = _Address(f"\0synk-pymc-{os.getpid()}-{secrets.token_hex(8)}", secrets.token_bytes(16),
                                tuple(cpus))
        self.error: BaseException | None = None
        self.calls = 0
        self.points = 0
        self.seconds_in_ranks = 0.0
        """Seconds of the calls into the ranks (the rest of the sampling: the chains' steps)."""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address.path)
        self._listener.listen(64)
        self._stop_r, self._stop_w = os.pipe()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._stop_r, selectors.EVENT_READ, "stop")
        self._slot_of: dict[socket.socket, int] = {}
        self._queued: list[socket.socket] = []  # connected while every slot was taken
        self._thread = threading.Thread(target=self._serve, name="synk-pymc-chains", daemon=True)

    def __enter__(self) -> _ChainServer:
        global _CHANNEL
        _CHANNEL = self.address
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        global _CHANNEL
        _CHANNEL = None
        os.write(self._stop_w, b"x")
        self._thread.join()
        for sock in [*self._slot_of, *self._queued, self._listener]:
            sock.close()
        self._selector.close()
        os.close(self._stop_r)
        os.close(self._stop_w)

    def _serve(self) -> None:
        pending: dict[int, tuple[socket.socket, Any]] = {}
        first = 0.0
        while True:
            timeout = None if not pending else max(0.0, first + GRACE_S - time.monotonic())
            for key, _ in self._selector.select(timeout):
                if key.data == "stop":
                    return
                if key.data == "accept":
                    self._accept()
                    continue
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                slot = self._slot_of[sock]
                try:
                    request = _recv(sock)
                except (EOFError, OSError):  # the chain ended (or died): its slot is free
                    pending.pop(slot, None)
                    self._drop(sock)
                    continue
                if not pending:
                    first = time.monotonic()
                pending[slot] = (sock, request)
            if pending and (len(pending) >= len(self._slot_of) or time.monotonic() >= first + GRACE_S):
                self._evaluate(pending)
                pending = {}

    def _accept(self) -> None:
        conn, _ = self._listener.accept()
        conn.settimeout(5.0)
        try:
            ok = hmac.compare_digest(_exactly(conn, len(self.address.token)), self.address.token)
        except (EOFError, OSError):
            ok = False
        if not ok:
            conn.close()
            return
        conn.settimeout(None)
        free = sorted(set(range(self.width)) - set(self._slot_of.values()))
        if not free:
            self._queued.append(conn)  # its first point waits in the socket until a slot is free
            return
        self._take_slot(conn, free[0])

    def _take_slot(self, conn: socket.socket, slot: int) -> None:
        self._slot_of[conn] = slot
        self._selector.register(conn, selectors.EVENT_READ, "chain")

    def _drop(self, sock: socket.socket) -> None:
        slot = self._slot_of.pop(sock)
        self._selector.unregister(sock)
        sock.close()
        if self._queued:
            self._take_slot(self._queued.pop(0), slot)

    def _evaluate(self, pending: dict[int, tuple[socket.socket, Any]]) -> None:
        start = time.perf_counter()
        by_split: dict[int, dict[int, tuple[socket.socket, bool, Any]]] = {}
        for slot, (sock, (split_id, with_grad, values)) in pending.items():
            by_split.setdefault(split_id, {})[slot] = (sock, with_grad, values)
        for split_id, requests in by_split.items():
            replies: dict[int, Any]
            try:
                if self.error is not None:
                    raise self.error
                with_grad = any(w for _, w, _ in requests.values())
                out = self._evaluate_many(split_id, {s: v for s, (_, _, v) in requests.items()}, self.width,
                                          with_grad)
                replies = {s: ("ok", out[s] if with_grad == w else out[s][:1]) for s, (_, w, _) in requests.items()}
                self.seconds_in_ranks += time.perf_counter() - start
            except BaseException as exc:  # every chain's evaluation fails from now on; the master raises it
                if self.error is None:
                    self.error = exc
                    _log.debug("data_parallel: the chains' evaluation failed: %r", exc)
                replies = {s: ("error", f"{type(exc).__name__}: {exc}") for s in requests}
            for slot, (sock, _, _) in requests.items():
                try:
                    _send(sock, replies[slot])
                except OSError:  # the chain is gone: its socket closes in the next select
                    pass
        self.calls += 1
        self.points += len(pending)


# -- a chain process's side --------------------------------------------------------------------
class _ChainClient:
    """A chain process's connection to the master's :class:`_ChainServer`."""

    def __init__(self, address: _Address) -> None:
        if address.cpus:  # the master runs pinned to rank 0's core; a chain runs anywhere in the group's
            try:
                os.sched_setaffinity(0, address.cpus)
            except OSError as exc:
                _log.debug("data_parallel: chain process affinity: %r", exc)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(address.path)
        self.sock.sendall(address.token)

    def evaluate(self, split_id: int, values: Sequence[Any], with_grad: bool) -> list[Any]:
        _send(self.sock, (split_id, with_grad, [np.asarray(v) for v in values]))
        try:
            status, payload = _recv(self.sock)
        except EOFError:
            raise ChainStopped("the master of the synkhronos group stopped serving this chain") from None
        if status != "ok":
            raise ChainStopped(f"the ranks' evaluation failed: {payload}")
        return list(payload)


_CLIENT: tuple[int, _ChainClient] | None = None


def client() -> _ChainClient | None:
    """This chain process's client, made on first use; None where no server is known."""
    global _CLIENT
    if _CHANNEL is None:
        return None
    if _CLIENT is None or _CLIENT[0] != os.getpid():  # a fork's copy of its parent's is not its own
        _CLIENT = (os.getpid(), _ChainClient(_CHANNEL))
    return _CLIENT[1]


# -- pm.sample's multi-chain sampling ----------------------------------------------------------
def _sample_in_chain_processes(original: Callable[..., Any], evaluate: Callable[..., Any],
                               cpus: Sequence[int], **kwargs: Any) -> Any:
    """PyMC's ``_mp_sample`` (its chain processes, ``min(cores, chains)`` at a time), with a
    :class:`_ChainServer` evaluating their points in the ranks; an error of the ranks (a rank that
    died) is raised as it is, not as PyMC's report of a failed chain.

    The server's thread computes the master's share of each call on the master's core(s); this
    thread, where PyMC's sampler answers each chain at each draw, moves to the group's other cores
    while the chains run (else a chain's draw waits for the master's share of a call to end, and
    misses the next round)."""
    width = min(int(kwargs["cores"]), int(kwargs["chains"]))
    _log.info("data_parallel: %d chains in PyMC's chain processes, %d at a time, their evaluations batched",
              kwargs["chains"], width)
    own = os.sched_getaffinity(0)
    others = sorted(set(cpus) - own)
    start = time.perf_counter()
    with _ChainServer(width, evaluate, others or cpus) as server, warnings.catch_warnings():
        # PyMC forks its chain processes (its default on Linux, as outside the block): they never call
        # JAX, whose warning at every fork of a process that runs it would tell the user nothing to do
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        if others:
            os.sched_setaffinity(0, others)  # this thread only (Linux): the server's stays where it is
        try:
            return original(**kwargs)
        except BaseException as exc:
            if server.error is not None and server.error is not exc:
                raise server.error from exc
            raise
        finally:
            if others:
                os.sched_setaffinity(0, own)
            if server.calls:
                _log.info("data_parallel: %d batched calls of %.2f chains' points on average, %.2f ms each in the "
                          "ranks; %.2f ms a call in the chains' steps between them", server.calls,
                          server.points / server.calls, 1e3 * server.seconds_in_ranks / server.calls,
                          1e3 * (time.perf_counter() - start - server.seconds_in_ranks) / server.calls)
