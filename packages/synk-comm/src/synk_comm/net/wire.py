"""What travels between the master and the node agents: the run's secret (:func:`run_secret`), the
HMAC signature of every message (:class:`_Seal`) checked before anything is unpickled, the messages
themselves (pickles, numpy arrays as out-of-band frames), and the timeouts both ends keep."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import pickle
import secrets
import struct
import threading
from collections.abc import Sequence
from typing import Any

from synk_comm.errors import RemoteError

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

