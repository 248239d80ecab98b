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
import os
import sys
import threading
from typing import Any

__all__ = ["drop_gloo_connect_lines", "request_canonical_dtypes"]

GLOO_PREFIX = b"[Gloo] Rank "
"""The start of the lines dropped."""

_filter: threading.Thread | None = None


def _keep(line: bytes) -> bool:
    """All but gloo's "connected" lines ("[Gloo] Rank r is NOT connected to: [...]" stays: it says
    which ranks could not be reached)."""
    return not (line.startswith(GLOO_PREFIX) and b" is connected to " in line)


def _forward(read_fd: int, write_fd: int) -> None:
    """Copy ``read_fd`` to ``write_fd`` until end of file, without gloo's connection lines."""
    tail = b""
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        out = b"".join(line + b"\n" for line in lines if _keep(line))
        if tail and not GLOO_PREFIX.startswith(tail[:len(GLOO_PREFIX)]) and not tail.startswith(GLOO_PREFIX):
            out, tail = out + tail, b""  # a partial line that is not gloo's: now (a progress bar, a prompt)
        if out:
            try:
                os.write(write_fd, out)
            except OSError:
                pass
    if tail and _keep(tail):
        try:
            os.write(write_fd, tail)
        except OSError:
            pass
    os.close(read_fd)


def drop_gloo_connect_lines() -> None:
    """From now on, this process's standard output (file descriptor 1) goes through a filter that
    drops gloo's ``[Gloo] Rank r is connected to ...`` lines.  Idempotent; undone at exit (after
    the filter forwarded what was written)."""
    global _filter
    if _filter is not None:
        return
    sys.stdout.flush()
    original = os.dup(1)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 1)
    os.close(write_fd)
    _filter = threading.Thread(target=_forward, args=(read_fd, original), daemon=True, name="synk-gloo-filter")
    _filter.start()
    atexit.register(_restore, original)


def _restore(original: int) -> None:
    """Put the original standard output back; the filter forwards what is left and ends."""
    global _filter
    thread, _filter = _filter, None
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os.dup2(original, 1)  # closes the pipe's last writer: the filter sees its end
    if thread is not None:
        thread.join(2.0)
    os.close(original)


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
