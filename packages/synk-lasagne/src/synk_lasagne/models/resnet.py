"""ResNets (He et al., 2016) on :mod:`synk_lasagne.layers`, the shape of Lasagne's model zoo
ResNet-50 and of torchvision's ``resnet50``.

A 7x7/2 convolution of 64 filters, batch norm, ReLU and a 3x3/2 max pooling; four stages of
residual blocks of widths 64, 128, 256, 512 (times ``width / 64``), the first block of stages
2-4 halving the image with stride 2 (on the 3x3 convolution, as torchvision's v1.5) and a
projection shortcut (1x1 convolution + batch norm) wherever the shape changes; global average
pooling and a dense layer of ``n_classes`` logits.  Depth 50, 101, 152: bottleneck blocks (1x1,
3x3, 1x1 with 4x expansion); depth 10, 18, 34: basic blocks (two 3x3).  Convolutions have no
bias (batch norm's beta takes its place) and no filter flip, He-normal weights; batch norm has
``epsilon=1e-5``.

>>> from synk_lasagne import layers
>>> from synk_lasagne.models import build_resnet
>>> net = build_resnet(50)
>>> net.output_shape, layers.count_params(net, trainable=True)
((None, 1000), 25557032)
"""

from __future__ import annotations

from typing import Any

from synk_lasagne import init, layers, nonlinearities

__all__ = ["DEPTHS", "build_resnet"]

DEPTHS: dict[int, tuple[str, tuple[int, ...]]] = {
    10: ("basic", (1, 1, 1, 1)),
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    26: ("bottleneck", (2, 2, 2, 2)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
"""Depth -> (block kind, blocks per stage)."""


def _conv_bn(incoming: Any, num_filters: int, filter_size: int, stride: int = 1, relu: bool = True,
             name: str | None = None) -> Any:
    """Convolution (same padding, no bias, no flip) and batch norm, then ReLU when ``relu``."""
    conv = layers.Conv2DLayer(incoming, num_filters, filter_size, stride=stride, pad="same", b=None,
                              nonlinearity=nonlinearities.rectify if relu else None, flip_filters=False,
                              W=init.HeNormal(gain="relu"), name=name)
    return layers.batch_norm(conv, epsilon=1e-5)


def _block(incoming: Any, width: int, stride: int, kind: str, name: str) -> Any:
    """One residual block: ``relu(residual(incoming) + shortcut(incoming))``."""
    out_channels = width * 4 if kind == "bottleneck" else width
    if kind == "bottleneck":
        h = _conv_bn(incoming, width, 1, name=f"{name}.conv1")
        h = _conv_bn(h, width, 3, stride, name=f"{name}.conv2")
        h = _conv_bn(h, out_channels, 1, relu=False, name=f"{name}.conv3")
    else:
        h = _conv_bn(incoming, width, 3, stride, name=f"{name}.conv1")
        h = _conv_bn(h, width, 3, relu=False, name=f"{name}.conv2")
    shortcut = incoming
    if stride != 1 or incoming.output_shape[1] != out_channels:
        shortcut = _conv_bn(incoming, out_channels, 1, stride, relu=False, name=f"{name}.proj")
    return layers.NonlinearityLayer(layers.ElemwiseSumLayer([h, shortcut]), nonlinearities.rectify)


def build_resnet(depth: int = 50, image_size: int = 224, n_classes: int = 1000, width: int = 64,
                 input_var: Any = None) -> Any:
    """A ResNet as a network of :mod:`synk_lasagne.layers`; its output is the logits.

    Parameters
    ----------
    depth : int
        A key of :data:`DEPTHS` (10, 18, 26, 34, 50, 101, 152).
    image_size : int
        Rows and columns of the input ``(batch, 3, image_size, image_size)`` (224 for ImageNet;
        any size >= 32 works: the image shrinks 32x before the global pooling).
    n_classes : int
    width : int
        Filters of the first stage (64 in the paper; smaller for quick CPU runs).
    input_var : variable, optional
        The InputLayer's variable.

    Returns
    -------
    Layer
        The final DenseLayer (linear: apply a softmax or ``log_softmax`` to its output).

    Raises
    ------
    ValueError
        For a depth not in :data:`DEPTHS`.
    """
    if depth not in DEPTHS:
        raise ValueError(f"depth must be one of {sorted(DEPTHS)}, got {depth}")
    kind, counts = DEPTHS[depth]
    net: layers.Layer = layers.InputLayer((None, 3, image_size, image_size), input_var=input_var, name="input")
    net = _conv_bn(net, width, 7, 2, name="conv1")
    net = layers.MaxPool2DLayer(net, 3, stride=2, pad=1)
    for stage, count in enumerate(counts):
        for i in range(count):
            stride = 2 if stage > 0 and i == 0 else 1
            net = _block(net, width * 2 ** stage, stride, kind, name=f"stage{stage + 1}.{i}")
    net = layers.GlobalPoolLayer(net)
    return layers.DenseLayer(net, n_classes, nonlinearity=None, W=init.HeNormal(), name="fc")
