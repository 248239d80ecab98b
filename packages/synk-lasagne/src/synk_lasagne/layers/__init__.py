"""Lasagne's layer API on PyTensor: build a network from layers, get its output expression.

A Lasagne model file ports by changing its imports (``import lasagne`` -> ``import synk_lasagne
as lasagne``, or ``from synk_lasagne import layers``): the classes, functions and arguments are
Lasagne's.  See the "Lasagne layers" guide for the porting notes.

==============================  ===================================================================
input                           :class:`InputLayer`
dense                           :class:`DenseLayer`
convolution                     :class:`Conv1DLayer`, :class:`Conv2DLayer` (stride, pad, dilation, groups,
                                flip_filters), :class:`TransposedConv2DLayer` (:class:`Deconv2DLayer`),
                                :class:`DilatedConv2DLayer`, :class:`Conv3DLayer`, :class:`TransposedConv3DLayer`
                                (:class:`Deconv3DLayer`), :class:`LocallyConnected2DLayer`, their base
                                :class:`BaseConvLayer`
pooling                         :class:`MaxPool1DLayer`, :class:`Pool1DLayer`, :class:`MaxPool2DLayer`,
                                :class:`Pool2DLayer`, :class:`MaxPool3DLayer`, :class:`Pool3DLayer`,
                                :class:`GlobalPoolLayer`,
                                :class:`FeaturePoolLayer`, :class:`FeatureWTALayer`,
                                :class:`Upscale1DLayer`, :class:`Upscale2DLayer`, :class:`Upscale3DLayer`,
                                :class:`SpatialPyramidPoolingLayer`
normalization                   :class:`BatchNormLayer`, :func:`batch_norm`, :class:`StandardizationLayer`,
                                :func:`average_running_statistics`, :func:`get_running_statistics`,
                                :func:`instance_norm`, :func:`layer_norm`,
                                :class:`LocalResponseNormalization2DLayer`
merge                           :class:`ElemwiseSumLayer`, :class:`ElemwiseMergeLayer`, :class:`ConcatLayer`,
                                :func:`autocrop`
noise                           :class:`DropoutLayer` (:func:`dropout_channels`, :func:`dropout_locations`),
                                :class:`GaussianNoiseLayer`
embedding                       :class:`EmbeddingLayer`, :class:`NINLayer` (network in network)
recurrent                       :class:`CustomRecurrentLayer`, :class:`RecurrentLayer`, :class:`LSTMLayer`,
                                :class:`GRULayer`, :class:`Gate`
shape                           :class:`FlattenLayer`, :class:`ReshapeLayer`, :class:`DimshuffleLayer`,
                                :class:`PadLayer`, :class:`SliceLayer`
special                         :class:`NonlinearityLayer`, :class:`ExpressionLayer`, :class:`BiasLayer`,
                                :class:`ScaleLayer`, :func:`standardize`,
                                :class:`ParametricRectifierLayer` (:func:`prelu`),
                                :class:`RandomizedRectifierLayer` (:func:`rrelu`), :class:`InverseLayer`,
                                :class:`TransformerLayer`, :class:`TPSTransformerLayer`
state updates                   :func:`get_state_updates` (batch norm's running averages, dropout's
                                generators: what a training function applies),
                                :func:`add_state_updates`, :func:`state_alias`, :func:`draw_generator`
helpers                         :func:`get_output`, :func:`get_output_shape`, :func:`get_all_layers`,
                                :func:`get_all_params`, :func:`count_params`,
                                :func:`get_all_param_values`, :func:`set_all_param_values`
base classes                    :class:`Layer`, :class:`MergeLayer`
==============================  ===================================================================

Example
-------
>>> import numpy as np, pytensor
>>> from synk_lasagne import layers, nonlinearities
>>> net = layers.InputLayer((None, 1, 8, 8))
>>> net = layers.Conv2DLayer(net, 4, 3, pad="same")
>>> net = layers.MaxPool2DLayer(net, 2)
>>> net = layers.DenseLayer(net, 10, nonlinearity=nonlinearities.softmax)
>>> net.output_shape, layers.count_params(net)
((None, 10), 690)
>>> probabilities = layers.get_output(net, deterministic=True)
"""

from synk_lasagne.layers.base import (
    Layer,
    MergeLayer,
    add_state_updates,
    draw_generator,
    get_state_updates,
    state_alias,
)
from synk_lasagne.layers.conv import (
    BaseConvLayer,
    Conv1DLayer,
    Conv2DLayer,
    Conv3DLayer,
    Deconv2DLayer,
    Deconv3DLayer,
    DilatedConv2DLayer,
    TransposedConv2DLayer,
    TransposedConv3DLayer,
)
from synk_lasagne.layers.dense import DenseLayer, NINLayer
from synk_lasagne.layers.embedding import EmbeddingLayer
from synk_lasagne.layers.helper import (
    count_params,
    get_all_layers,
    get_all_param_values,
    get_all_params,
    get_output,
    get_output_shape,
    set_all_param_values,
)
from synk_lasagne.layers.input import InputLayer
from synk_lasagne.layers.local import LocallyConnected2DLayer
from synk_lasagne.layers.merge import (
    ConcatLayer,
    ElemwiseMergeLayer,
    ElemwiseSumLayer,
    autocrop,
    autocrop_array_shapes,
    concat,
)
from synk_lasagne.layers.noise import (
    DropoutLayer,
    GaussianNoiseLayer,
    dropout,
    dropout_channels,
    dropout_locations,
    spatial_dropout,
)
from synk_lasagne.layers.normalization import (
    BatchNormLayer,
    LocalResponseNormalization2DLayer,
    StandardizationLayer,
    average_running_statistics,
    batch_norm,
    get_running_statistics,
    instance_norm,
    layer_norm,
)
from synk_lasagne.layers.pool import (
    FeaturePoolLayer,
    FeatureWTALayer,
    GlobalPoolLayer,
    MaxPool1DLayer,
    MaxPool2DLayer,
    MaxPool3DLayer,
    Pool1DLayer,
    Pool2DLayer,
    Pool3DLayer,
    SpatialPyramidPoolingLayer,
    Upscale1DLayer,
    Upscale2DLayer,
    Upscale3DLayer,
)
from synk_lasagne.layers.recurrent import CustomRecurrentLayer, Gate, GRULayer, LSTMLayer, RecurrentLayer
from synk_lasagne.layers.shape import (
    DimshuffleLayer,
    FlattenLayer,
    PadLayer,
    ReshapeLayer,
    SliceLayer,
    dimshuffle,
    flatten,
    pad,
    reshape,
)
from synk_lasagne.layers.special import (
    BiasLayer,
    ExpressionLayer,
    InverseLayer,
    NonlinearityLayer,
    ParametricRectifierLayer,
    RandomizedRectifierLayer,
    ScaleLayer,
    TPSTransformerLayer,
    TransformerLayer,
    prelu,
    rrelu,
    standardize,
)

__all__ = ["BaseConvLayer", "BatchNormLayer", "BiasLayer", "ConcatLayer", "Conv1DLayer", "Conv2DLayer", "Conv3DLayer",
           "CustomRecurrentLayer", "Deconv2DLayer", "Deconv3DLayer", "DenseLayer", "DilatedConv2DLayer",
           "DimshuffleLayer", "DropoutLayer", "ElemwiseMergeLayer", "ElemwiseSumLayer", "EmbeddingLayer",
           "ExpressionLayer", "FeaturePoolLayer", "FeatureWTALayer", "FlattenLayer", "GRULayer", "Gate",
           "GaussianNoiseLayer", "GlobalPoolLayer", "InputLayer", "InverseLayer", "LSTMLayer", "Layer",
           "LocalResponseNormalization2DLayer", "LocallyConnected2DLayer", "MaxPool1DLayer", "MaxPool2DLayer",
           "MaxPool3DLayer", "MergeLayer", "NINLayer", "NonlinearityLayer", "PadLayer", "ParametricRectifierLayer",
           "Pool1DLayer", "Pool2DLayer", "Pool3DLayer", "RandomizedRectifierLayer", "RecurrentLayer", "ReshapeLayer",
           "ScaleLayer", "SliceLayer", "SpatialPyramidPoolingLayer", "StandardizationLayer", "TPSTransformerLayer",
           "TransformerLayer", "TransposedConv2DLayer", "TransposedConv3DLayer", "Upscale1DLayer", "Upscale2DLayer",
           "Upscale3DLayer", "add_state_updates", "autocrop", "autocrop_array_shapes", "average_running_statistics",
           "batch_norm", "concat", "count_params", "dimshuffle", "draw_generator", "dropout", "dropout_channels",
           "dropout_locations", "flatten", "get_all_layers", "get_all_param_values", "get_all_params", "get_output",
           "get_output_shape", "get_running_statistics", "get_state_updates", "instance_norm", "layer_norm", "pad",
           "prelu", "reshape", "rrelu", "set_all_param_values", "spatial_dropout", "standardize", "state_alias"]
