"""Numba backend of the Ops of synk_lasagne: their ``perform`` (numpy, BLAS) in Numba's object mode.

PyTensor's Numba linker (its default mode) runs an Op without a Numba implementation through its
``perform`` in object mode, with a warning at every compilation; our Ops' ``perform`` is that
implementation by design (whole-array numpy calls, im2col + BLAS), so it is registered as such.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["register_perform"]


def register_perform(*op_classes: type) -> None:
    """Register ``perform`` in object mode as the Numba implementation of ``op_classes``."""
    try:
        from pytensor.link.numba.dispatch.basic import generate_fallback_impl, numba_funcify
    except ImportError:  # no numba: the Numba mode is unavailable anyway
        return

    def funcify(op: Any, node: Any = None, storage_map: Any = None, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Numba will use object mode", category=UserWarning)
            return generate_fallback_impl(op, node, storage_map, **kwargs)

    for cls in op_classes:
        numba_funcify.register(cls)(funcify)
