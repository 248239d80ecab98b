"""Data-parallel training of a small MLP classifier with Synkhronos alone, the loop written by hand
(what synk-lasagne's ``make_train_function`` and ``Trainer`` wrap; the main job is
``examples/mnist/train_mnist.py``), on every GPU when the machine has two or more, else on CPU
worker processes (``synkhronos.cpu.default_ranks``: 4 on 16 cores).

The data live once in OS shared memory (``synk.data``); each step every rank computes the
gradient of its share of a shuffled minibatch (``batch=`` indices: each rank gathers its own
rows), the gradients are all-reduced (avg), and every rank applies the same SGD step.  At the end
the script checks the accuracy on held-out data and compares the time per epoch with one process.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk


def make_data(n: int, dim: int, classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters, one per class: a problem an MLP learns to > 95% in a few epochs."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 1.0, (classes, dim))
    y = rng.integers(0, classes, n)
    x = centers[y] + rng.normal(0, 1.2, (n, dim))
    return x.astype(pytensor.config.floatX), y.astype("int32")


def build(dim: int, hidden: int, classes: int, lr: float) -> tuple[synk.Function, synk.Function, list]:
    rng = np.random.default_rng(1)
    floatx = pytensor.config.floatX
    w1 = pytensor.shared((rng.normal(0, 1, (dim, hidden)) / np.sqrt(dim)).astype(floatx), name="w1")
    b1 = pytensor.shared(np.zeros(hidden, floatx), name="b1")
    w2 = pytensor.shared((rng.normal(0, 1, (hidden, classes)) / np.sqrt(hidden)).astype(floatx), name="w2")
    b2 = pytensor.shared(np.zeros(classes, floatx), name="b2")
    params = [w1, b1, w2, b2]
    x, y = pt.matrix("x"), pt.ivector("y")
    logits = pt.tanh(x @ w1 + b1) @ w2 + b2
    logp = pt.special.log_softmax(logits, axis=1)
    loss = -pt.mean(logp[pt.arange(y.shape[0]), y])
    accuracy = pt.mean(pt.eq(pt.argmax(logits, axis=1), y))
    grads = pytensor.grad(loss, params)
    # Gradients go into shared accumulators; all_reduce(avg) makes them global; then the step.
    grad_vars = [pytensor.shared(np.zeros_like(p.get_value()), name=f"g_{p.name}") for p in params]
    f_grad = synk.function([x, y], outputs=loss, updates=list(zip(grad_vars, grads)))
    f_step = synk.function([], updates=[(p, p - lr * g) for p, g in zip(params, grad_vars)])
    f_eval = synk.function([x, y], outputs=[loss, accuracy])
    return f_grad, f_eval, [f_step, grad_vars]


def train(epochs: int, batch_size: int, x_train: synk.Data, y_train: synk.Data, fns: tuple) -> float:
    f_grad, _, (f_step, grad_vars) = fns
    n = len(x_train)
    rng = np.random.default_rng(2)
    t0 = time.perf_counter()
    for epoch in range(epochs):
        order = rng.permutation(n)
        losses = []
        for start in range(0, n - batch_size + 1, batch_size):
            losses.append(f_grad(x_train, y_train, batch=order[start:start + batch_size]))
            synk.all_reduce(grad_vars, op="avg")
            f_step()
        print(f"  epoch {epoch + 1}/{epochs}: train loss {np.mean(losses):.4f}", flush=True)
    return (time.perf_counter() - t0) / epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--n-parallel", type=int, default=None, help="ranks (default: all GPUs or cores)")
    parser.add_argument("--samples", type=int, default=60000)
    parser.add_argument("--no-baseline", action="store_true", help="skip the single-process timing")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="Synkhronos's own log: ranks started, functions distributed, close")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")

    dim, hidden, classes = 64, 256, 10
    x, y = make_data(args.samples + 10000, dim, classes)
    results = {}
    for label, n_parallel in [("data-parallel", args.n_parallel), ("single process", 1)]:
        if label == "single process" and args.no_baseline:
            break
        n = synk.fork(n_parallel)
        print(f"{label}: {n} rank(s)")
        fns = build(dim, hidden, classes, lr=0.1)
        x_train, y_train = synk.data(x[:args.samples]), synk.data(y[:args.samples])
        x_test, y_test = synk.data(x[args.samples:]), synk.data(y[args.samples:])
        seconds = train(args.epochs, args.batch_size, x_train, y_train, fns)
        loss, acc = fns[1](x_test, y_test, num_slices=4)
        print(f"  test loss {float(loss):.4f}, test accuracy {float(acc):.2%}, {seconds:.2f} s per epoch")
        results[label] = (n, seconds, float(acc))
        synk.close()
    n, par_s, acc = results["data-parallel"]
    if "single process" in results:
        print(f"speedup of {n} ranks over 1 process: {results['single process'][1] / par_s:.2f}x")
    assert acc >= 0.95, f"test accuracy {acc:.2%} is below 95%"
    print(f"Done: test accuracy {acc:.2%}.")


if __name__ == "__main__":
    main()
