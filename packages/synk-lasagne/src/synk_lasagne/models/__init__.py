"""Model builders on :mod:`synk_lasagne.layers` (Lasagne's model zoo, rebuilt):
:func:`~synk_lasagne.models.resnet.build_resnet` (ResNet-18/34/50/101/152 and smaller ones)."""

from synk_lasagne.models.resnet import DEPTHS, build_resnet

__all__ = ["DEPTHS", "build_resnet"]
