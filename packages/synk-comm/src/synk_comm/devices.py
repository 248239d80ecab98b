"""Pinning a process to its GPU, and remembering which GPUs it could see before.

A group gives every rank one GPU through ``CUDA_VISIBLE_DEVICES``, set before CUDA starts; the
master, which is a rank too, narrows its own variable the same way (:func:`pin`).  After that the
process's environment no longer says which GPUs the run may use, yet a later group started by the
same process (``synk_comm.spawn`` then ``synkhronos.fork``, say) needs to know:
:func:`visible_before_pin` answers from what the first pin saw.  It lives in this process only
(not in the environment), so that processes started while the group runs see only what they can
use.  When the group closes, :func:`unpin` puts the variable back as it was, so that a job started
afterwards (a subprocess, a script run from a notebook) sees every GPU again; the process's own
CUDA, once started, stays on the GPU it was pinned to (:func:`pinned_device`).
"""

from __future__ import annotations

import os

__all__ = ["pin", "pinned", "pinned_device", "unpin", "visible_before_pin"]

_BEFORE: list[str | None] = []  # CUDA_VISIBLE_DEVICES as the first pin found it (None: unset)
_LAST: list[str] = []  # the device of the latest pin


def pin(device: str) -> None:
    """Make ``device`` (one CUDA_VISIBLE_DEVICES entry) this process's only visible GPU; the first
    call remembers what was visible before.  In effect only if CUDA is not initialised yet."""
    if not _BEFORE:
        _BEFORE.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
    os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    _LAST[:] = [str(device)]


def unpin() -> None:
    """Put ``CUDA_VISIBLE_DEVICES`` back as the first :func:`pin` found it (a group closed: processes
    started from now on see every GPU the run could use).  Nothing if no pin ran."""
    if not _BEFORE:
        return
    if _BEFORE[0] is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = _BEFORE[0]


def pinned() -> bool:
    """Whether :func:`pin` ran in this process."""
    return bool(_BEFORE)


def pinned_device() -> str | None:
    """The device of the latest :func:`pin` (None: none ran), after :func:`unpin` too: where this
    process's CUDA runs if it started after that pin."""
    return _LAST[0] if _LAST else None


def visible_before_pin() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as it was before the first :func:`pin` (now, if none ran; None:
    unset, every GPU of the machine)."""
    return _BEFORE[0] if _BEFORE else os.environ.get("CUDA_VISIBLE_DEVICES")
