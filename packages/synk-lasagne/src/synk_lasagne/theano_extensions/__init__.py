"""Lasagne's ``lasagne.theano_extensions`` on PyTensor: 1-d convolutions and constant padding.

:mod:`~synk_lasagne.theano_extensions.conv`
    ``conv1d_sc``, ``conv1d_mc0``, ``conv1d_mc1``, ``conv1d_unstrided``, ``conv1d_sd``,
    ``conv1d_md``: Lasagne's names of its 1-d convolution implementations, here all one
    computation (:func:`synk_lasagne.conv.conv2d` over ``(batch, channels, 1, length)``), with each
    one's signature and checks.
:mod:`~synk_lasagne.theano_extensions.padding`
    ``pad``: a tensor padded with a constant.
"""

__all__ = ["conv", "padding"]
