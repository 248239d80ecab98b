"""synk_lasagne: Lasagne's update rules for data-parallel training with Synkhronos, and a trainer.

Lasagne itself does not run on PyTensor (it imports ``theano.tensor.nnet``); this package gives
its update-rule API on PyTensor graphs, built for data parallelism -- every rank writes its
gradient into ONE flat vector, one all-reduce combines them, every rank applies the same update
-- and what a user needs around it.

Update rules (:mod:`synk_lasagne.updates`)
    :func:`~synk_lasagne.updates.sgd`, ``momentum``, ``nesterov_momentum``, ``apply_momentum``,
    ``apply_nesterov_momentum``, ``adagrad``, ``rmsprop``, ``adadelta``, ``adam``, ``adamax``,
    ``amsgrad``, ``norm_constraint``, ``total_norm_constraint`` -> :class:`RuleUpdates`
Training (:mod:`synk_lasagne.training`)
    :func:`make_train_function` -> :class:`TrainFunction` (one step per call),
    :func:`make_eval_function` -> :class:`EvalFunction` (named metrics), :class:`Trainer`
    (epochs, validation, progress bar, checkpoints, early stopping), :func:`save_checkpoint`,
    :func:`load_checkpoint`
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

from synk_lasagne import mnist, updates
from synk_lasagne.training import (
    EvalFunction,
    Trainer,
    TrainFunction,
    load_checkpoint,
    make_eval_function,
    make_train_function,
    save_checkpoint,
)
from synk_lasagne.updates import RuleUpdates

__all__ = ["EvalFunction", "RuleUpdates", "TrainFunction", "Trainer", "load_checkpoint", "make_eval_function",
           "make_train_function", "mnist", "save_checkpoint", "updates"]
__version__ = "0.1.0"
