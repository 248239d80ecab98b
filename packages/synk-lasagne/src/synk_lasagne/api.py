"""Which Lasagne release's behaviour synk_lasagne follows where Lasagne 0.1 and 0.2 disagree.

synk_lasagne follows Lasagne 0.2 (the development API of Lasagne's repository), which changed a
few things that Lasagne 0.1 allowed.  A script written for Lasagne 0.1 that relies on them selects
0.1's behaviour, either in the environment (for a script run unmodified)::

    SYNK_LASAGNE_API=0.1 python train.py

or in the script, before it builds its model::

    import synk_lasagne as lasagne
    lasagne.set_lasagne_api("0.1")

Under ``"0.1"`` (everything else stays 0.2's):

* :class:`~synk_lasagne.layers.DenseLayer` accepts an input with no axis after its
  ``num_leading_axes`` (e.g. a 1-d input, one number per example): each example is one input
  feature, ``W`` is ``(1, num_units)``, as Lasagne 0.1 built it (0.2 raises ``ValueError``).
* :func:`~synk_lasagne.updates.get_or_compute_grads` accepts parameters that are not shared
  variables and returns their gradients (0.2 raises ``ValueError``; the update rules still need
  shared variables, which they update).
* A convolution layer with ``pad="same"`` and an even filter size pads ``size // 2`` before and
  ``(size - 1) // 2`` after, so the output is as long as the input (0.2 raises
  ``NotImplementedError``).
"""

from __future__ import annotations

import os

__all__ = ["API_VERSIONS", "lasagne_api", "set_lasagne_api"]

API_VERSIONS = ("0.1", "0.2")
"""The Lasagne releases whose behaviour can be selected."""

ENV = "SYNK_LASAGNE_API"
"""The environment variable that gives the starting value (default ``"0.2"``)."""


def _checked(version: str, where: str) -> str:
    if version not in API_VERSIONS:
        raise ValueError(f"{where}={version!r}: the Lasagne API must be one of {', '.join(API_VERSIONS)}")
    return version


_api = _checked(os.environ.get(ENV, "0.2"), ENV)


def lasagne_api() -> str:
    """The Lasagne release whose behaviour is followed where 0.1 and 0.2 disagree: ``"0.1"`` or ``"0.2"``."""
    return _api


def set_lasagne_api(version: str) -> None:
    """Follow Lasagne ``version``'s behaviour (``"0.1"`` or ``"0.2"``) where the two disagree.

    It applies to the layers built and the functions called afterwards (a layer built before keeps
    its shapes).  The starting value is the environment variable ``SYNK_LASAGNE_API``, else ``"0.2"``.

    Parameters
    ----------
    version : str
        ``"0.1"`` or ``"0.2"``.

    Raises
    ------
    ValueError
        For another version.
    """
    global _api
    _api = _checked(version, "version")
