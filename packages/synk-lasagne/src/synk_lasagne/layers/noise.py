"""Noise layers: :class:`DropoutLayer`, :class:`GaussianNoiseLayer`.

The mask comes from a random generator of each training graph's own (a shared numpy
``Generator``, seeded from the layer's seed sequence, as each draw of Lasagne's random streams has
its own state), which each call advances, so that each call draws a new mask: as in Lasagne, a
plain ``pytensor.function`` does it with no updates given (the generator's ``default_update``);
the output also carries the update (:func:`~synk_lasagne.layers.get_state_updates`), which update
rules given the loss hold.  In a forked
Synkhronos program every rank's generator is reseeded from its state and its rank at
distribution, so the ranks draw different masks, as independent workers should.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from synk_lasagne.layers.base import Layer, add_state_updates, draw_generator
from synk_lasagne.random import get_rng

__all__ = ["DropoutLayer", "GaussianNoiseLayer", "dropout", "dropout_channels", "dropout_locations",
           "spatial_dropout"]


class DropoutLayer(Layer):
    """Sets values to zero with probability ``p`` in training (``deterministic=False``).

    Parameters
    ----------
    incoming : Layer or tuple
    p : float
        The probability of dropping a value.
    rescale : bool
        Divide the kept values by ``1 - p`` (the expected output unchanged; evaluation is then
        the identity).
    shared_axes : tuple of int
        Axes along which the mask is the same (e.g. ``(2, 3)``: whole feature maps).
    """

    def __init__(self, incoming: Any, p: float = 0.5, rescale: bool = True, shared_axes: Sequence[int] = (),
                 **kwargs: Any) -> None:

        super().__init__(incoming, **kwargs)
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability p must be in [0, 1), got {p}")
        self._seeds = np.random.SeedSequence(get_rng().randint(1, 2147462579))
        self.p = p
        self.rescale = rescale
        self.shared_axes = tuple(shared_axes)

    def get_output_for(self, input: Any, deterministic: bool = False, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        if deterministic or self.p == 0:
            return input
        keep = 1 - self.p
        if self.rescale:
            input = input / keep
        shared = [a % input.ndim for a in self.shared_axes]
        mask_shape = tuple(1 if a in shared else input.shape[a] for a in range(input.ndim))
        rng = draw_generator(self._seeds, f"{self.name}.rng" if self.name else "dropout.rng")
        # uniform draws, not binomial: PyTensor's JAX backend has binomial only with NumPyro installed
        next_rng, draws = pt.random.uniform(0.0, 1.0, size=mask_shape, rng=rng, return_next_rng=True)
        mask = pt.cast(pt.lt(draws, keep), input.dtype)  # float32 stays float32
        if shared:
            mask = pt.specify_broadcastable(mask, *shared)
        output = input * mask
        add_state_updates(output, [(rng, next_rng)], [rng])
        return output


dropout = DropoutLayer


def _ndim(incoming: Any) -> int:
    return len(incoming if isinstance(incoming, tuple) else incoming.output_shape)


def dropout_channels(incoming: Any, p: float = 0.5, rescale: bool = True, **kwargs: Any) -> DropoutLayer:
    """Dropout of whole channels: the mask shared over every axis after the second (spatial
    dropout, Tompson et al. 2015)."""
    return DropoutLayer(incoming, p, rescale, shared_axes=tuple(range(2, _ndim(incoming))), **kwargs)


spatial_dropout = dropout_channels


def dropout_locations(incoming: Any, p: float = 0.5, rescale: bool = True, **kwargs: Any) -> DropoutLayer:
    """Dropout of whole locations: the mask shared over the channels (axis 1)."""
    return DropoutLayer(incoming, p, rescale, shared_axes=(1,), **kwargs)


class GaussianNoiseLayer(Layer):
    """Adds ``N(0, sigma**2)`` noise in training (``deterministic=False``); the identity otherwise."""

    def __init__(self, incoming: Any, sigma: float = 0.1, **kwargs: Any) -> None:

        super().__init__(incoming, **kwargs)
        self._seeds = np.random.SeedSequence(get_rng().randint(1, 2147462579))
        self.sigma = sigma

    def get_output_for(self, input: Any, deterministic: bool = False, **kwargs: Any) -> Any:
        import pytensor.tensor as pt

        if deterministic or self.sigma == 0:
            return input
        rng = draw_generator(self._seeds, f"{self.name}.rng" if self.name else "noise.rng")
        next_rng, noise = pt.random.normal(0.0, self.sigma, size=input.shape, rng=rng, return_next_rng=True)
        output = input + pt.cast(noise, input.dtype)
        add_state_updates(output, [(rng, next_rng)], [rng])
        return output
