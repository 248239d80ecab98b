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
    A GPU worker's JAX client watches the coordination service (``WatchTasks``); when the run ends,
    the service (in worker 0) goes away while the other workers' clients still live, whatever the
    order, and each of them logs, from native code and as late as the interpreter's finalisation,
    blocks like::

        W1128 15:50:24.714234   46532 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: CANCELLED
        Additional GRPC error information from remote target coordination_service while calling ...
        :CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']
        === Source Location Trace: ===
        external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89

    The engine's workers leave the runtime at exit through this function: from then until the
    process ends, their file descriptor 2 writes to a filter process that drops those blocks (up to
    the blank line that ends each) and forwards the rest.  A worker's errors while it works reach
    the terminal unfiltered.

:func:`drop_32bit_notes`
    The rest of JAX's notes about 64-bit requests computed in 32 bits (int64 indices, float64
    casts) under float32 work, not repeated at every trace of every rank.

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
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from synkhronos import linefilter

__all__ = ["drop_32bit_notes", "drop_gloo_connect_lines", "request_canonical_dtypes", "shutdown_runtime_quietly"]

_filter: threading.Thread | None = None
log = logging.getLogger(__name__)


def _flush_std() -> None:
    """Write out what Python buffers for standard output and error before their descriptors move."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class _Redirect:
    """File descriptor ``fd`` through a :class:`~synkhronos.linefilter.LineFilter` in a thread,
    until :meth:`restore`."""

    def __init__(self, fd: int, lines: linefilter.LineFilter, name: str) -> None:
        self.fd = fd
        _flush_std()
        self.original = os.dup(fd)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, fd)
        os.close(write_fd)
        self.thread = threading.Thread(target=linefilter.forward, args=(read_fd, self.original, lines), daemon=True,
                                       name=name)
        self.thread.start()

    def restore(self, timeout: float = 2.0) -> None:
        """Put the original descriptor back; the filter forwards what is left and ends."""
        _flush_std()
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
    redirect = _Redirect(1, linefilter.gloo_filter(), "synk-gloo-filter")
    _filter = redirect.thread
    atexit.register(_restore, redirect)


def _restore(redirect: _Redirect) -> None:
    global _filter
    _filter = None
    redirect.restore()


def shutdown_runtime_quietly(shutdown: Callable[[], Any] | None = None) -> None:
    """Leave JAX's multi-process runtime (``shutdown``: :func:`jax.distributed.shutdown` by default)
    with standard error, from now until the process ends, through a filter process that drops the
    coordination client's ``WatchTasksAsync failed`` blocks (:func:`synkhronos.linefilter.shutdown_filter`):
    its client logs them while the interpreter finalises, after every exit handler.  A worker registers
    this at exit after joining the runtime: it runs before JAX's own exit handler, which then finds
    nothing to do."""
    if shutdown is None:
        import jax

        shutdown = jax.distributed.shutdown
    _filter_process(2, "shutdown")
    try:
        shutdown()
    except Exception as exc:  # the run is over (a peer gone first): nothing left to act on
        log.debug("leaving JAX's runtime at exit: %s", exc)


def _filter_process(fd: int, kind: str) -> None:
    """From now on, file descriptor ``fd`` writes to a filter process (``linefilter.py kind``) that
    forwards to where ``fd`` wrote before, and ends once every writer is gone.  Without one (it
    cannot start), ``fd`` stays as it is."""
    _flush_std()
    read_fd, write_fd = os.pipe()
    try:
        subprocess.Popen([sys.executable, "-I", "-S", linefilter.__file__, kind], stdin=read_fd, stdout=fd,
                         stderr=subprocess.DEVNULL)
    except OSError as exc:
        log.debug("no filter process for fd %d: %s", fd, exc)
        os.close(write_fd)
        return
    finally:
        os.close(read_fd)
    os.dup2(write_fd, fd)
    os.close(write_fd)


def drop_32bit_notes() -> None:
    """With JAX's 64-bit mode off (float32 work: Synkhronos turns it on only under ``floatX=float64``),
    JAX computes the 64-bit types a graph asks for (int64 indices and shapes, float64 casts) in 32
    bits and says so at every trace ("Explicitly requested dtype int64 requested in arange is not
    available ..."): the documented behaviour, nothing to act on.  From now on this process does not
    show that note."""
    warnings.filterwarnings("ignore", message=r"Explicitly requested dtype \w+ requested in \w+ is not available")


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
