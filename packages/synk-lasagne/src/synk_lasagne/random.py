"""The random generator of parameter initialisation and of noise layers' seeds (Lasagne's
``lasagne.random``): one numpy ``RandomState``, replaceable for reproducible models.

>>> import numpy as np
>>> from synk_lasagne import random
>>> random.set_rng(np.random.RandomState(42))
>>> random.get_rng().randint(10)
6
"""

from __future__ import annotations

import numpy as np

__all__ = ["get_rng", "set_rng"]

_rng = np.random.RandomState()


def get_rng() -> np.random.RandomState:
    """The generator that :mod:`synk_lasagne.init` and :class:`~synk_lasagne.layers.DropoutLayer` draw from."""
    return _rng


def set_rng(new_rng: np.random.RandomState) -> None:
    """Replace the generator (e.g. ``np.random.RandomState(seed)`` for a reproducible model)."""
    global _rng
    _rng = new_rng
