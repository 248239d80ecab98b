"""Parameter initialisers (Lasagne's ``lasagne.init``): ``initializer(shape) -> numpy array`` of floatX.

=======================  =========================================================================
:class:`Constant`        every value ``val``
:class:`Normal`          ``N(mean, std**2)``
:class:`Uniform`         ``U(low, high)`` (``range=r``: ``U(-r, r)``; or from ``std`` and ``mean``)
:class:`GlorotNormal`    ``std = gain * sqrt(2 / ((fan_in + fan_out) * receptive_field))``
:class:`GlorotUniform`   the uniform with that std (Lasagne's default for weights)
:class:`HeNormal`        ``std = gain * sqrt(1 / fan_in)`` (``gain="relu"``: ``sqrt(2)``)
:class:`HeUniform`       the uniform with that std
=======================  =========================================================================

Fans as Lasagne computes them: a dense weight ``(inputs, units)`` has ``fan_in = inputs``; a
convolution's filters ``(filters, channels, rows, columns)`` have ``fan_in = channels * rows *
columns``; Glorot uses ``(shape[0] + shape[1]) * prod(shape[2:])``.  Samples come from
:func:`synk_lasagne.random.get_rng`.

>>> from synk_lasagne import init
>>> init.Constant(0.5)((2, 2)).tolist()
[[0.5, 0.5], [0.5, 0.5]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from synk_lasagne.random import get_rng

__all__ = ["Constant", "Glorot", "GlorotNormal", "GlorotUniform", "He", "HeNormal", "HeUniform", "Initializer",
           "Normal", "Orthogonal", "Sparse", "Uniform"]


def _floatx(values: Any) -> np.ndarray:
    import pytensor

    return np.asarray(values, dtype=pytensor.config.floatX)


class Initializer:
    """Base class: ``initializer(shape)`` returns ``self.sample(shape)``."""

    def __call__(self, shape: Sequence[int]) -> np.ndarray:
        return self.sample(tuple(int(s) for s in shape))

    def sample(self, shape: tuple[int, ...]) -> np.ndarray:
        """A floatX array of ``shape``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class Constant(Initializer):
    """Every value ``val``."""

    def __init__(self, val: float = 0.0) -> None:
        self.val = val

    def sample(self, shape: tuple[int, ...]) -> np.ndarray:
        return _floatx(np.full(shape, self.val))


class Normal(Initializer):
    """Samples of ``N(mean, std**2)``."""

    def __init__(self, std: float = 0.01, mean: float = 0.0) -> None:
        self.std, self.mean = std, mean

    def sample(self, shape: tuple[int, ...]) -> np.ndarray:
        return _floatx(get_rng().normal(self.mean, self.std, size=shape))


class Uniform(Initializer):
    """Samples of ``U(low, high)``: ``range=r`` -> ``(-r, r)``, ``range=(low, high)``, or ``std``
    (and ``mean``) -> ``mean -+ sqrt(3) * std``."""

    def __init__(self, range: float | tuple[float, float] = 0.01, std: float | None = None,
                 mean: float = 0.0) -> None:
        if std is not None:
            a, b = mean - np.sqrt(3) * std, mean + np.sqrt(3) * std
        elif isinstance(range, tuple):
            a, b = range
        else:
            a, b = -range, range
        self.range = (a, b)

    def sample(self, shape: tuple[int, ...]) -> np.ndarray:
        return _floatx(get_rng().uniform(low=self.range[0], high=self.range[1], size=shape))


def _gain(gain: float | str) -> float:
    if gain == "relu":
        return float(np.sqrt(2))
    if isinstance(gain, str):
        raise ValueError(f"gain must be a number or 'relu', got {gain!r}")
    return float(gain)


def _check_c01b(shape: tuple[int, ...]) -> None:
    if len(shape) != 4:
        raise RuntimeError(f"If c01b is True, only shapes of length 4 are accepted, got {shape}")


def _check_ndim(shape: tuple[int, ...], what: str) -> None:
    if len(shape) < 2:
        raise RuntimeError(f"{what} only works with shapes of 2 or more dimensions, got {shape}")


class Glorot(Initializer):
    """Glorot/Xavier initialisation drawn by ``initializer`` (:class:`Normal` or :class:`Uniform`)
    with ``std = gain * sqrt(2 / ((shape[0] + shape[1]) * prod(shape[2:])))``."""

    def __init__(self, initializer: type[Initializer], gain: float | str = 1.0, c01b: bool = False) -> None:
        self.initializer = initializer
        self.gain = _gain(gain)
        self.c01b = c01b

    def sample(self, shape: tuple[int, ...]) -> np.ndarray:
        if self.c01b:  # (channels, rows, columns, batch) filters: fan-in channels, fan-out the last axis
            _check_c01b(shape)
            n1, n2, receptive_field = shape[0], shape[3], shape[1] * shape[2]
        else:
            _check_ndim(shape, "Glorot initialisation")
            n1, n2, receptive_field = shape[0], shape[1], int(np.prod(shape[2:]))
        std = self.gain * np.sqrt(2.0 / ((n1 + n2) * receptive_field))
        return self.initializer(std=std).sample(shape)  # type: ignore[call-arg]


class GlorotNormal(Glorot):
    """:class:`Glorot` with normal samples."""

    def __init__(self, gain: float | str = 1.0, c01b: bool = False) -> None:
        super().__init__(Normal, gain, c01b)


class GlorotUniform(Glorot):
    """:class:`Glorot` with uniform samples (Lasagne's default weights)."""

    def __init__(self, gain: float | str = 1.0, c01b: bool = False) -> None:
        super().__init__(Uniform, gain, c01b)


class He(Initializer):
    """He initialisation drawn by ``initializer`` with ``std = gain * sqrt(1 / fan_in)``."""

    def __init__(self, initializer: type[Initializer], gain: float | str = 1.0, c01b: bool = False) -> None:
        self.initializer = initializer
        self.gain = _gain(gain)
        self.c01b = c01b

    def sample(self, shape: tuple[int, ...]) -> np.ndarray:
        if self.c01b:
            _check_c01b(shape)
            fan_in = int(np.prod(shape[:3]))
        else:
            _check_ndim(shape, "He initialisation")
            fan_in = shape[0] if len(shape) == 2 else int(np.prod(shape[1:]))
        std = self.gain * np.sqrt(1.0 / fan_in)
        return self.initializer(std=std).sample(shape)  # type: ignore[call-arg]


class HeNormal(He):
    """:class:`He` with normal samples."""

    def __init__(self, gain: float | str = 1.0, c01b: bool = False) -> None:
        super().__init__(Normal, gain, c01b)


class HeUniform(He):
    """:class:`He` with uniform samples."""

    def __init__(self, gain: float | str = 1.0, c01b: bool = False) -> None:
        super().__init__(Uniform, gain, c01b)


class Sparse(Initializer):
    """A matrix with ``int(sparsity * rows)`` non-zero values of ``N(0, std**2)`` in each column."""

    def __init__(self, sparsity: float = 0.1, std: float = 0.01) -> None:
        self.sparsity, self.std = sparsity, std

    def sample(self, shape: tuple[int, ...]) -> np.ndarray:
        if len(shape) != 2:
            raise RuntimeError(f"sparse initializer only works with shapes of length 2, got {shape}")
        rows, columns = shape
        out = _floatx(np.zeros(shape))
        count = int(self.sparsity * rows)
        for column in range(columns):
            chosen = np.arange(rows)
            get_rng().shuffle(chosen)
            out[chosen[:count], column] = get_rng().normal(0.0, self.std, size=count)
        return out


class Orthogonal(Initializer):
    """An orthogonal matrix times ``gain`` (Saxe et al., 2013); for more than 2 dimensions, the
    axes after the first are flattened (the fan-in of convolution filters)."""

    def __init__(self, gain: float | str = 1.0) -> None:
        self.gain = _gain(gain)

    def sample(self, shape: tuple[int, ...]) -> np.ndarray:
        if len(shape) < 2:
            raise RuntimeError(f"Only shapes of length 2 or more are supported, got {shape}")
        flat = (shape[0], int(np.prod(shape[1:])))
        u, _, vt = np.linalg.svd(get_rng().normal(0.0, 1.0, flat), full_matrices=False)
        q = u if u.shape == flat else vt  # the factor of the flat shape has orthonormal rows or columns
        return _floatx(self.gain * q.reshape(shape))


# Shared default arguments of the layers (initialisers hold no state).
GLOROT_UNIFORM = GlorotUniform()
ZEROS = Constant(0.0)
ONES = Constant(1.0)
