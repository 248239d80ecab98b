"""GPU mode without GPUs, a developer aid: ``SYNK_EMULATE_GPUS=<n>``, documented in :mod:`synkhronos.gpu`.

The machine then counts as having ``n`` GPUs (narrowed by ``CUDA_VISIBLE_DEVICES`` as real ones are)
and every rank's JAX runs on its CPU backend.  Nothing here is measured or meant for production use.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ENV", "emulated_gpus", "select_platform"]

ENV = "SYNK_EMULATE_GPUS"


def emulated_gpus() -> int:
    """The number of GPUs emulated (0 when ``SYNK_EMULATE_GPUS`` is unset or empty)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return 0
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of GPUs to emulate, got {value!r}") from None
    if n < 0:
        raise ValueError(f"{ENV} must be >= 0, got {n}")
    return n


def select_platform(jax: Any) -> None:
    """Make this process's JAX use its CPU backend when emulating (before any JAX backend starts)."""
    if emulated_gpus():
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
