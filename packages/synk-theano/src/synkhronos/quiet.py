"""Output a user cannot act on, stopped where it starts.

:func:`drop_gloo_connect_lines`
    JAX's CPU collectives are gloo's (JAX engine workers on the CPU: runs over several hosts,
    ``SYNK_EMULATE_GPUS``).  The gloo that jaxlib bundles writes, with ``std::cout`` and no switch
    (newer gloo logs it at INFO level under ``GLOO_LOG_LEVEL``), one line per rank each time it
    connects a set of ranks::

        [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1

    A worker that runs on gloo passes its file descriptor 1 through a filter that drops those lines
    and forwards everything else (the user's prints in worker code, other libraries' output)
    unchanged, a partial line as soon as it cannot be one of them.  Gloo's line naming ranks it
    could *not* connect stays.

:func:`shutdown_runtime_quietly`
    A GPU worker's JAX client polls the coordination service (``WatchTasks``); when the run ends,
    the service (in worker 0) goes away before the other clients have disconnected, whatever the
    order, and each of them logs, once a second until it is gone, a block like::

        W1128 15:50:24.714234   46532 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: CANCELLED
        Additional GRPC error information from remote target coordination_service while calling ...
        :CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']
        === Source Location Trace: ===
        external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89

    The engine's workers leave the runtime at exit through this function, their file descriptor 2
    passed through a filter that drops those blocks (up to the blank line that ends each) for the
    time of the shutdown only: a worker's errors while it works reach the terminal unfiltered.

:func:`request_canonical_dtypes`
    With ``floatX=float32`` JAX runs without 64-bit types (``jax_enable_x64`` off), and PyTensor's
    JAX translation still asks for them: a float32 ``Sum``/``Prod`` accumulates in float64
    (``acc_dtype``) and a shape vector (``MakeVector``) is int64, so JAX warns at every trace
    "Explicitly requested dtype float64 ... will be truncated to dtype float32" and computes in 32
    bits anyway.  This makes those translations ask for the type JAX computes in
    (:func:`jax.dtypes.canonicalize_dtype`): the same program, no warning.  Under x64 nothing changes.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["drop_gloo_connect_lines", "request_canonical_dtypes", "shutdown_runtime_quietly"]

GLOO_PREFIX = b"[Gloo] Rank "
"""The start of gloo's lines dropped from standard output."""

WATCH_FAILED = b"WatchTasksAsync failed"
"""In the first line of the blocks dropped from standard error at the runtime's shutdown."""

BLOCK_LINES = 8
"""The most lines of one dropped block after its first (the blocks hold 5, then a blank line)."""

_filter: threading.Thread | None = None
log = logging.getLogger(__name__)


class LineFilter:
    """Which lines of a stream pass: every line but those :meth:`drop` names, and after a line that
    :meth:`starts_block` names, the lines that follow it up to a blank one (at most
    :data:`BLOCK_LINES`).  ``held(tail)``: whether a partial line waits for its end (it may still
    become a dropped line) rather than pass at once (a progress bar, a prompt)."""

    def __init__(self, drop: Callable[[bytes], bool], starts_block: Callable[[bytes], bool] | None = None,
                 held: Callable[[bytes], bool] | None = None) -> None:
        self.drop, self.starts_block = drop, starts_block
        self.held = held or (lambda tail: False)
        self._in_block = 0

    def keep(self, line: bytes) -> bool:
        """Whether ``line`` (without its newline) passes; called once per line, in order."""
        if self._in_block:
            self._in_block = 0 if not line.strip() else self._in_block - 1
            return False
        if self.starts_block is not None and self.starts_block(line):
            self._in_block = BLOCK_LINES
            return False
        return not self.drop(line)

    @property
    def in_block(self) -> bool:
        """Whether the lines that follow are dropped (a block has begun)."""
        return self._in_block > 0


def _gloo_filter() -> LineFilter:
    """All but gloo's "connected" lines ("[Gloo] Rank r is NOT connected to: [...]" stays: it says
    which ranks could not be reached)."""
    return LineFilter(drop=lambda line: line.startswith(GLOO_PREFIX) and b" is connected to " in line,
                      held=lambda tail: GLOO_PREFIX.startswith(tail[:len(GLOO_PREFIX)]) or tail.startswith(GLOO_PREFIX))


def _shutdown_filter() -> LineFilter:
    """All but the coordination service's ``WatchTasksAsync failed`` blocks; a partial line waits
    only while it could be a log line's start (``W`` and the date)."""
    return LineFilter(drop=lambda line: False, starts_block=lambda line: WATCH_FAILED in line,
                      held=lambda tail: tail[:1] == b"W" or tail[:1] == b":" or tail.startswith(b"=== "))


def _forward(read_fd: int, write_fd: int, lines: LineFilter) -> None:
    """Copy ``read_fd`` to ``write_fd`` until end of file, the lines ``lines`` keeps only."""
    tail = b""
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        split = (tail + chunk).split(b"\n")
        tail = split.pop()
        out = b"".join(line + b"\n" for line in split if lines.keep(line))
        if tail and not lines.in_block and not lines.held(tail):
            out, tail = out + tail, b""  # a partial line that cannot be a dropped one: now
        if out:
            try:
                os.write(write_fd, out)
            except OSError:
                pass
    if tail and lines.keep(tail):
        try:
            os.write(write_fd, tail)
        except OSError:
            pass
    os.close(read_fd)


class _Redirect:
    """File descriptor ``fd`` through a :class:`LineFilter` in a thread, until :meth:`restore`."""

    def __init__(self, fd: int, lines: LineFilter, name: str) -> None:
        self.fd = fd
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self.original = os.dup(fd)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, fd)
        os.close(write_fd)
        self.thread = threading.Thread(target=_forward, args=(read_fd, self.original, lines), daemon=True, name=name)
        self.thread.start()

    def restore(self, timeout: float = 2.0) -> None:
        """Put the original descriptor back; the filter forwards what is left and ends."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(self.original, self.fd)  # closes the pipe's last writer: the filter sees its end
        self.thread.join(timeout)
        os.close(self.original)


def drop_gloo_connect_lines() -> None:
    """From now on, this process's standard output (file descriptor 1) goes through a filter that
    drops gloo's ``[Gloo] Rank r is connected to ...`` lines.  Idempotent; undone at exit (after
    the filter forwarded what was written)."""
    global _filter
    if _filter is not None:
        return
    redirect = _Redirect(1, _gloo_filter(), "synk-gloo-filter")
    _filter = redirect.thread
    atexit.register(_restore, redirect)


def _restore(redirect: _Redirect) -> None:
    global _filter
    _filter = None
    redirect.restore()


def shutdown_runtime_quietly(shutdown: Callable[[], Any] | None = None) -> None:
    """Leave JAX's multi-process runtime (``shutdown``: :func:`jax.distributed.shutdown` by default)
    with standard error through the filter of :func:`_shutdown_filter` for that time only.  A worker
    registers this at exit after joining: it runs before JAX's own exit handler, which then finds
    nothing to do."""
    if shutdown is None:
        import jax

        shutdown = jax.distributed.shutdown
    redirect = _Redirect(2, _shutdown_filter(), "synk-shutdown-filter")
    try:
        shutdown()
    except Exception as exc:  # the run is over (a peer gone first): nothing left to act on
        log.debug("leaving JAX's runtime at exit: %s", exc)
    finally:
        redirect.restore()


_DTYPE_ATTRS = {"CAReduce": ("acc_dtype", "dtype"), "MakeVector": ("dtype",)}
"""The Ops whose JAX translation requests the dtypes named in these attributes."""


def request_canonical_dtypes() -> None:
    """Make PyTensor's JAX translation of the Ops of :data:`_DTYPE_ATTRS` request the dtypes JAX
    computes in (64-bit ones narrowed while ``jax_enable_x64`` is off).  Idempotent."""
    import jax
    import numpy as np
    from pytensor.link.jax.dispatch import jax_funcify
    from pytensor.tensor.basic import MakeVector
    from pytensor.tensor.elemwise import CAReduce

    for cls in (CAReduce, MakeVector):
        original = jax_funcify.dispatch(cls)
        if getattr(original, "synk_canonical", False):
            continue
        attrs = _DTYPE_ATTRS[cls.__name__]

        def translate(op: Any, _original: Any = original, _attrs: tuple[str, ...] = attrs, **kwargs: Any) -> Any:
            changes = {}
            for attr in _attrs:
                value = getattr(op, attr, None)
                if value is not None:
                    canonical = np.dtype(jax.dtypes.canonicalize_dtype(value))
                    if canonical != np.dtype(value):
                        changes[attr] = canonical.name
            if changes:  # a copy for the translation only: the graph's Op keeps its type
                op = copy.copy(op)
                for attr, value in changes.items():
                    object.__setattr__(op, attr, value)
            return _original(op, **kwargs)

        translate.synk_canonical = True  # type: ignore[attr-defined]
        jax_funcify.register(cls)(translate)
