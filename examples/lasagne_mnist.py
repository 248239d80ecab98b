"""Lasagne's MNIST example (its ``examples/mnist.py``: the MLP and the CNN) on synk_lasagne.

The model, loss, updates and loop are Lasagne's; what differs is the imports (``theano`` ->
``pytensor``, ``lasagne`` -> ``synk_lasagne``), the data (scikit-learn's 8x8 digits scaled up to
28x28, or MNIST's IDX files with ``--data DIR``, from :mod:`synk_lasagne.mnist`), and, with
``--ranks N``, the two lines that make it data-parallel::

    train_fn = synk.function([input_var, target_var], loss, updates=updates)   # was theano.function
    train_err += train_fn(synk.data(inputs), synk.data(targets))               # was train_fn(inputs, targets)

    python examples/lasagne_mnist.py mlp 5              # one process
    python examples/lasagne_mnist.py cnn 5 --ranks 2    # two CPU ranks
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import pytensor as theano
import pytensor.tensor as T

import synk_lasagne as lasagne
import synkhronos as synk
from synk_lasagne import mnist


def load_dataset(data_dir: str | None = None) -> tuple[np.ndarray, ...]:
    """``X_train, y_train, X_val, y_val, X_test, y_test`` as Lasagne's example has them:
    ``(n, 1, 28, 28)`` float32 images in [0, 1] and int32 labels."""
    data = mnist.load(data_dir, quiet=True)

    def images(x: np.ndarray) -> np.ndarray:
        x = x.reshape(-1, 1, *data.image_shape).astype("float32")
        if data.image_shape == (8, 8):  # the digits: each pixel 3x3, padded to 28x28
            x = np.pad(np.kron(x, np.ones((1, 1, 3, 3), dtype="float32")), ((0, 0), (0, 0), (2, 2), (2, 2)))
        return x / max(float(x.max()), 1.0)

    return (images(data.x_train), data.y_train.astype("int32"), images(data.x_valid), data.y_valid.astype("int32"),
            images(data.x_test), data.y_test.astype("int32"))


def build_mlp(input_var: Any = None) -> Any:
    l_in = lasagne.layers.InputLayer(shape=(None, 1, 28, 28), input_var=input_var)
    l_in_drop = lasagne.layers.DropoutLayer(l_in, p=0.2)
    l_hid1 = lasagne.layers.DenseLayer(l_in_drop, num_units=800, nonlinearity=lasagne.nonlinearities.rectify,
                                       W=lasagne.init.GlorotUniform())
    l_hid1_drop = lasagne.layers.DropoutLayer(l_hid1, p=0.5)
    l_hid2 = lasagne.layers.DenseLayer(l_hid1_drop, num_units=800, nonlinearity=lasagne.nonlinearities.rectify)
    l_hid2_drop = lasagne.layers.DropoutLayer(l_hid2, p=0.5)
    return lasagne.layers.DenseLayer(l_hid2_drop, num_units=10, nonlinearity=lasagne.nonlinearities.softmax)


def build_cnn(input_var: Any = None) -> Any:
    network = lasagne.layers.InputLayer(shape=(None, 1, 28, 28), input_var=input_var)
    network = lasagne.layers.Conv2DLayer(network, num_filters=32, filter_size=(5, 5),
                                         nonlinearity=lasagne.nonlinearities.rectify, W=lasagne.init.GlorotUniform())
    network = lasagne.layers.MaxPool2DLayer(network, pool_size=(2, 2))
    network = lasagne.layers.Conv2DLayer(network, num_filters=32, filter_size=(5, 5),
                                         nonlinearity=lasagne.nonlinearities.rectify)
    network = lasagne.layers.MaxPool2DLayer(network, pool_size=(2, 2))
    network = lasagne.layers.DenseLayer(lasagne.layers.dropout(network, p=.5), num_units=256,
                                        nonlinearity=lasagne.nonlinearities.rectify)
    return lasagne.layers.DenseLayer(lasagne.layers.dropout(network, p=.5), num_units=10,
                                     nonlinearity=lasagne.nonlinearities.softmax)


def iterate_minibatches(inputs: np.ndarray, targets: np.ndarray, batchsize: int, shuffle: bool = False) -> Any:
    assert len(inputs) == len(targets)
    if shuffle:
        indices = np.arange(len(inputs))
        np.random.shuffle(indices)
    for start_idx in range(0, len(inputs) - batchsize + 1, batchsize):
        excerpt = indices[start_idx:start_idx + batchsize] if shuffle else slice(start_idx, start_idx + batchsize)
        yield inputs[excerpt], targets[excerpt]


def main(model: str = "mlp", num_epochs: int = 500, ranks: int = 0, data_dir: str | None = None,
         batch_size: int = 500, seed: int = 0) -> float:
    """Train ``model`` for ``num_epochs`` (in ``ranks`` CPU ranks; 0: one process, Lasagne's
    ``theano.function``); the test accuracy."""
    np.random.seed(seed)
    lasagne.random.set_rng(np.random.RandomState(seed))
    print("Loading data...")
    X_train, y_train, X_val, y_val, X_test, y_test = load_dataset(data_dir)
    input_var = T.tensor4("inputs")
    target_var = T.ivector("targets")
    print("Building model and compiling functions...")
    network = build_mlp(input_var) if model == "mlp" else build_cnn(input_var)
    prediction = lasagne.layers.get_output(network)
    loss = lasagne.objectives.categorical_crossentropy(prediction, target_var)
    loss = loss.mean()
    params = lasagne.layers.get_all_params(network, trainable=True)
    updates = lasagne.updates.nesterov_momentum(loss, params, learning_rate=0.01, momentum=0.9)
    test_prediction = lasagne.layers.get_output(network, deterministic=True)
    test_loss = lasagne.objectives.categorical_crossentropy(test_prediction, target_var)
    test_loss = test_loss.mean()
    test_acc = T.mean(T.eq(T.argmax(test_prediction, axis=1), target_var), dtype=theano.config.floatX)
    if ranks:
        train_fn = synk.function([input_var, target_var], loss, updates=updates)
    else:
        train_fn = theano.function([input_var, target_var], loss, updates=updates)
    val_fn = theano.function([input_var, target_var], [test_loss, test_acc])
    print("Starting training...")
    for epoch in range(num_epochs):
        train_err = 0
        train_batches = 0
        start_time = time.time()
        for batch in iterate_minibatches(X_train, y_train, batch_size, shuffle=True):
            inputs, targets = batch
            if ranks:
                inputs, targets = synk.data(inputs), synk.data(targets)
            train_err += train_fn(inputs, targets)
            train_batches += 1
        val_err = 0
        val_acc = 0
        val_batches = 0
        for batch in iterate_minibatches(X_val, y_val, len(X_val), shuffle=False):
            inputs, targets = batch
            err, acc = val_fn(inputs, targets)
            val_err += err
            val_acc += acc
            val_batches += 1
        print(f"Epoch {epoch + 1} of {num_epochs} took {time.time() - start_time:.3f}s")
        print(f"  training loss:\t\t{train_err / train_batches:.6f}")
        print(f"  validation loss:\t\t{val_err / val_batches:.6f}")
        print(f"  validation accuracy:\t\t{val_acc / val_batches * 100:.2f} %")
    test_err, test_acc_value = val_fn(X_test, y_test)
    print("Final results:")
    print(f"  test loss:\t\t\t{float(test_err):.6f}")
    print(f"  test accuracy:\t\t{float(test_acc_value) * 100:.2f} %")
    return float(test_acc_value)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="mlp", choices=["mlp", "cnn"])
    parser.add_argument("epochs", nargs="?", type=int, default=500)
    parser.add_argument("--ranks", type=int, default=0, help="CPU ranks (0: one process, plain PyTensor)")
    parser.add_argument("--data", default=None, help="a directory of MNIST's IDX files (default: the digits)")
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args()
    theano.config.floatX = "float32"
    if args.ranks:
        synk.fork(args.ranks, use_gpu=False)
    try:
        main(args.model, args.epochs, args.ranks, args.data, args.batch_size)
    finally:
        if args.ranks:
            synk.close()
