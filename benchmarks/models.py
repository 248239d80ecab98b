"""The benchmarks' model: one MLP builder, its layer widths given by each benchmark."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np


def mlp(x: Any, y: Any, rng: np.random.Generator, widths: Sequence[int]) -> tuple[Any, list[Any]]:
    """``widths[0] -> widths[1] -> ... -> widths[-1]``: tanh between the layers, softmax
    cross-entropy of the labels ``y`` at the end, float32 parameters (Glorot-like normal weights,
    zero biases) drawn from ``rng``.

    Returns
    -------
    (loss, params)
        The mean cross-entropy of ``x`` against ``y``, and the weights then the biases.
    """
    import pytensor
    import pytensor.tensor as pt

    ws = [pytensor.shared((rng.standard_normal((a, b)) / np.sqrt(a)).astype("float32"), name=f"w{i}")
          for i, (a, b) in enumerate(itertools.pairwise(widths))]
    bs = [pytensor.shared(np.zeros(b, dtype="float32"), name=f"b{i}") for i, b in enumerate(widths[1:])]
    h = x
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = h @ w + b
        if i < len(ws) - 1:
            h = pt.tanh(h)
    logp = pt.special.log_softmax(h, axis=1)
    return -pt.mean(logp[pt.arange(y.shape[0]), y]), ws + bs
