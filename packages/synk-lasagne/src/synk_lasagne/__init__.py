"""synk_lasagne: Lasagne on PyTensor, for data-parallel training with Synkhronos.

Lasagne itself does not run on PyTensor (it imports ``theano.tensor.nnet``); this package gives
its API on PyTensor graphs -- layers, initialisers, nonlinearities, objectives, regularization,
and update rules that are data-parallel for free (inside a Synkhronos function they average the
gradients over the ranks with one in-graph all-reduce; in a plain function they are Lasagne's) -- the convolution and
pooling Ops that networks need, and what a user needs around them.  A Lasagne model file ports
by changing its imports (``import synk_lasagne as lasagne``).

Layers (:mod:`synk_lasagne.layers`)
    Lasagne's layers and helpers: ``InputLayer``, ``DenseLayer``, ``Conv2DLayer``,
    ``MaxPool2DLayer``, ``BatchNormLayer``, ... ``get_output``, ``get_all_params``, ...
Around them
    :mod:`~synk_lasagne.init`, :mod:`~synk_lasagne.nonlinearities`,
    :mod:`~synk_lasagne.objectives`, :mod:`~synk_lasagne.regularization`,
    :mod:`~synk_lasagne.random`, :mod:`~synk_lasagne.utils`
Ops (:mod:`synk_lasagne.conv`, :mod:`synk_lasagne.pool`)
    ``conv2d`` and ``pool2d`` with gradients, on PyTensor's JAX backend (GPU) and the others

Update rules (:mod:`synk_lasagne.updates`)
    :func:`~synk_lasagne.updates.sgd`, ``momentum``, ``nesterov_momentum``, ``apply_momentum``,
    ``apply_nesterov_momentum``, ``adagrad``, ``rmsprop``, ``adadelta``, ``adam``, ``adamax``,
    ``amsgrad``, ``norm_constraint``, ``total_norm_constraint``: Lasagne's ``OrderedDict`` of
    updates, which average the gradients over the ranks inside a Synkhronos function
Training (:mod:`synk_lasagne.training`, :mod:`synk_lasagne.trainer`)
    :func:`make_train_function` -> :class:`TrainFunction` (one step per call),
    :func:`make_eval_function` -> :class:`EvalFunction` (named metrics), :class:`Trainer`
    (epochs, validation, progress bar, checkpoints, early stopping, exact resume), its callbacks
    :class:`Schedule`, :class:`CSVLogger`, :class:`TensorBoardLogger`, :func:`set_in_every_rank`
    (a shared variable's value in every rank), :func:`save_checkpoint`, :func:`load_checkpoint`
Lasagne 0.1 (:mod:`synk_lasagne.api`)
    :func:`set_lasagne_api` (or ``SYNK_LASAGNE_API=0.1``): Lasagne 0.1's behaviour where 0.2 changed
    it, for a script written for Lasagne 0.1
Data (:mod:`synk_lasagne.mnist`)
    MNIST IDX files, or scikit-learn's digits (extra ``synk-lasagne[mnist]``)

Example
-------
>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> import synkhronos as synk
>>> from synk_lasagne import make_train_function, updates
>>> synk.fork(2, use_gpu=False)                                             # doctest: +SKIP
2
>>> x, y = pt.matrix("x"), pt.vector("y")
>>> w = pytensor.shared(np.zeros(3), name="w")
>>> loss = pt.mean((x @ w - y) ** 2)
>>> train = make_train_function(loss, [w], [x, y], updates.adam, learning_rate=0.1)  # doctest: +SKIP
>>> x_data, y_data = synk.data(np.ones((10, 3))), synk.data(np.ones(10))   # doctest: +SKIP
>>> loss_value = train(x_data, y_data, batch=[0, 3, 5, 7, 9])              # doctest: +SKIP
"""

from typing import Any

from synk_lasagne import mnist, updates
from synk_lasagne.api import lasagne_api, set_lasagne_api
from synk_lasagne.trainer import (
    Callback,
    CSVLogger,
    Schedule,
    TensorBoardLogger,
    Trainer,
    load_checkpoint,
    save_checkpoint,
    set_in_every_rank,
)
from synk_lasagne.training import EvalFunction, TrainFunction, make_eval_function, make_train_function

__all__ = ["CSVLogger", "Callback", "EvalFunction", "Schedule", "TensorBoardLogger", "TrainFunction",
           "Trainer", "api", "conv", "init", "lasagne_api", "layers", "load_checkpoint", "make_eval_function",
           "make_train_function", "mnist", "nonlinearities", "objectives", "pool", "random", "regularization",
           "save_checkpoint", "set_in_every_rank", "set_lasagne_api", "theano_extensions", "updates", "utils"]

_LAZY = {"conv", "init", "layers", "nonlinearities", "objectives", "pool", "random", "regularization",
         "theano_extensions", "utils"}
"""Submodules imported on first use (``synk_lasagne.layers``...): importing synk_lasagne stays light."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"synk_lasagne.{name}")
    raise AttributeError(f"module 'synk_lasagne' has no attribute {name!r}")
__version__ = "0.1.0"
