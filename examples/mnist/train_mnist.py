"""The main job: train an MNIST classifier data-parallel with Synkhronos and synk-lasagne.

On every GPU when the machine has any (one rank per GPU, PyTensor's JAX backend), else on CPU
worker processes (Synkhronos's CPU mode: its default number of ranks, each on cores of its own,
compiled with JAX when it is installed -- ``pip install "synk-theano[cpu]"``).  Beside it, to
measure the speedup, the same epochs in one process of the same backend on every core (a fresh
interpreter, so that its thread pools take the whole machine): the two take turns, a block of
``TURN_EPOCHS`` epochs each, so that both meet the machine in the same state (a busy neighbour or
a slower clock slows both alike).  Each run's output comes under its own header: the
data-parallel run's as it trains, the single process's when both have finished.  Then a PNG plot
of loss and throughput per epoch.

An epoch is a pass over the training set (every row once, in a new random order; ``--drop-last``
skips each epoch's last, smaller batch).  The time to build and compile the functions, and the
first step (which compiles what is left), are reported apart from the throughput.

Data: the MNIST IDX files from ``--data-dir`` or ``$SYNK_MNIST_DIR`` (gzipped or not); without
them, the 8x8 handwritten digits bundled with scikit-learn (``pip install synk-lasagne[mnist]``).

Models (``--model``):

``mlp``  ReLU hidden layers, softmax output, Glorot-uniform weights (Lasagne's ``DenseLayer``).
``cnn``  Lasagne's MNIST CNN in shape, built with :mod:`synk_lasagne.layers`: two blocks of a
         convolution (``--filters``, ReLU; 3x3 with same padding where Lasagne's has 5x5 valid, so
         that the 8x8 digits fit) and a 2x2 max pooling, dropout, a dense layer of ``--hidden``
         units, dropout, softmax (on the digits: 8 -> 4 -> 2; on MNIST: 28 -> 14 -> 7).  Its
         convolutions and poolings are synk_lasagne's Ops: on GPUs through PyTensor's JAX
         backend, on CPUs im2col + BLAS.

Data patterns (``--pattern``), the two of Synkhronos's MNIST demos:

``host``     the training set lives once in host shared memory (``synk.data``); each step passes
             ``batch=`` indices of a shuffled order, and every rank gathers its own rows in place.
``scatter``  the training set is scattered once into each rank's memory (sliceable shared
             variables: the GPU's memory in GPU mode); each step passes ``batch_s=`` rows of each
             rank's own part.

Every step: the gradient of each rank's share of the batch goes into one flat vector, one
all-reduce combines them (weighted by rows: exact for any split), every rank applies the same
update.  Validation and test run over whole sets with ``num_slices``.

Examples::

    python examples/mnist/train_mnist.py                       # digits, all cores / GPUs
    python examples/mnist/train_mnist.py --data-dir ~/mnist --epochs 10 --pattern scatter
    python examples/mnist/train_mnist.py --n-parallel 2 --batch-size 256 --no-baseline
    python examples/mnist/train_mnist.py --model cnn --epochs 15 --pattern scatter
    python examples/mnist/train_mnist.py --epochs 5 --min-accuracy 0.5   # exit status 1 below 50%
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pytensor
import pytensor.tensor as pt

import synk_lasagne.init
import synkhronos as synk
from synk_lasagne import Trainer, layers, make_eval_function, make_train_function, mnist, updates
from synk_lasagne.random import set_rng

TURN_EPOCHS = 20
"""Epochs of each turn of the data-parallel and the single-process runs."""
DIGITS_EPOCHS = 250
"""Default epochs on scikit-learn's digits: >= 95% test accuracy."""
MNIST_EPOCHS = 10
"""Default epochs on MNIST (50,000 training images)."""
RULES = ["sgd", "momentum", "nesterov_momentum", "adagrad", "rmsprop", "adadelta", "adam", "adamax", "amsgrad"]


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help says it (or it is a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help)
    parser.add_argument("--data-dir", default=None,
                        help=f"directory of the MNIST IDX files (default ${mnist.ENV_VAR}; without either: "
                             "scikit-learn's digits)")
    # The defaults: a deep, narrow MLP whose matrix products are too small for XLA to spread over
    # threads, so that ranks on cores of their own beat one process on all of them (wide layers are
    # split over threads well by XLA, and data parallelism then only matches one process), >= 95%
    # test accuracy on the digits.  A batch of 629 makes an epoch of the digits (1258 rows) two
    # equal steps: every row once, one shape to compile, and no step of a few rows that would
    # cost a whole round trip between the ranks.
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"passes over the training set (default: {DIGITS_EPOCHS} on the 8x8 digits, "
                             f"{MNIST_EPOCHS} on MNIST)")
    parser.add_argument("--batch-size", type=int, default=629,
                        help="rows per step over all ranks (629: the digits' 1258 training rows in two equal steps)")
    parser.add_argument("--n-parallel", type=int, default=None,
                        help="ranks (default: every GPU, or synkhronos.cpu.default_ranks of the cores)")
    parser.add_argument("--pattern", choices=["host", "scatter"], default="host",
                        help="host: Data in shared memory + batch= indices; scatter: data scattered once into "
                             "sliceable shareds + batch_s")
    parser.add_argument("--cpu", action="store_true", help="CPU worker processes even on a machine with GPUs")
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                        help="mlp: dense layers; cnn: convolutions, as Lasagne's MNIST CNN (synk_lasagne.layers)")
    parser.add_argument("--filters", type=int, default=32, help="cnn: filters of each convolution")
    parser.add_argument("--dropout", type=float, default=0.25, help="cnn: dropout probability")
    parser.add_argument("--hidden", type=int, default=64, help="units per hidden layer")
    parser.add_argument("--layers", type=int, default=8, help="hidden layers")
    parser.add_argument("--rule", choices=RULES, default="adam", help="update rule (synk_lasagne.updates)")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="the update rule's learning rate")
    parser.add_argument("--drop-last", action="store_true",
                        help="skip each epoch's last, smaller batch (default: every row trains)")
    parser.add_argument("--eval-slices", type=int, default=2, help="num_slices of validation and test calls")
    parser.add_argument("--no-baseline", action="store_true", help="skip the single-process run (no speedup)")
    parser.add_argument("--plot", default=os.path.join("out", "mnist_training.png"), help="PNG file to write")
    parser.add_argument("--seed", type=int, default=0, help="of the initial weights and the shuffling")
    parser.add_argument("--precision", choices=["default", "highest", "bf16"], default="default",
                        help="precision policy (synkhronos.precision): bf16 = bfloat16 activations, "
                             "reductions, parameters and state float32; needs JAX")
    parser.add_argument("--min-accuracy", type=float, default=None,
                        help="exit with status 1 if the data-parallel test accuracy (0-1) is lower (default: "
                             "not checked)")
    parser.add_argument("--print-every", type=int, default=None,
                        help="a line for epoch 1 and every N-th epoch (default: about 10 lines per run)")
    parser.add_argument("--mode", default=None,
                        help="PyTensor mode (default: Synkhronos's choice: JAX on GPUs, and on CPUs when JAX is "
                             "installed, else PyTensor's default)")
    parser.add_argument("--baseline-json", default=None, help=argparse.SUPPRESS)  # the single-process child:
    parser.add_argument("--turns", default=None, help=argparse.SUPPRESS)  # its result file and its turns' pipes
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (they show only on a terminal anyway)")
    args = parser.parse_args(argv)
    if (args.epochs is not None and args.epochs < 1) or args.batch_size < 1 or args.layers < 1 or args.hidden < 1:
        parser.error("--epochs, --batch-size, --layers and --hidden must be >= 1")
    if args.print_every is not None and args.print_every < 1:
        parser.error("--print-every must be >= 1")
    if args.min_accuracy is not None and not 0 <= args.min_accuracy <= 1:
        parser.error("--min-accuracy is a fraction: 0.95 for 95%")
    return args


def build_mlp(n_in: int, n_hidden: int, n_layers: int, n_out: int, seed: int) -> tuple[list[Any], Any]:
    """Parameters and ``forward(x) -> logits`` of an MLP (Glorot-uniform weights, zero biases)."""
    rng = np.random.default_rng(seed)
    floatx = pytensor.config.floatX
    sizes = [n_in] + [n_hidden] * n_layers + [n_out]
    params = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        bound = np.sqrt(6.0 / (a + b))
        params.append(pytensor.shared(rng.uniform(-bound, bound, (a, b)).astype(floatx), name=f"W{i + 1}"))
        params.append(pytensor.shared(np.zeros(b, dtype=floatx), name=f"b{i + 1}"))

    def forward(x: Any) -> Any:
        h = x
        for i in range(0, len(params) - 2, 2):
            h = pt.maximum(h @ params[i] + params[i + 1], 0)
        return h @ params[-2] + params[-1]

    return params, forward


def build_cnn(image_shape: tuple[int, int], n_filters: int, n_hidden: int, n_out: int, dropout: float,
              seed: int) -> tuple[list[Any], Any]:
    """Parameters and ``forward(x, deterministic) -> logits`` of the CNN (Lasagne's MNIST CNN's shape)
    (``x``: ``(batch, 1, rows, columns)``)."""
    set_rng(np.random.RandomState(seed))
    net = layers.InputLayer((None, 1, *image_shape))
    for _ in range(2):
        net = layers.Conv2DLayer(net, n_filters, 3, pad="same", W=synk_lasagne.init.GlorotUniform("relu"))
        net = layers.MaxPool2DLayer(net, 2)
    net = layers.DenseLayer(layers.DropoutLayer(net, p=dropout), n_hidden)
    net = layers.DenseLayer(layers.DropoutLayer(net, p=dropout), n_out, nonlinearity=None)

    def forward(x: Any, deterministic: bool = False) -> Any:
        return layers.get_output(net, x, deterministic=deterministic)

    return layers.get_all_params(net, trainable=True), forward


def cross_entropy(logits: Any, y: Any) -> Any:
    logp = pt.special.log_softmax(logits, axis=1)
    return -pt.mean(logp[pt.arange(y.shape[0]), y])


def accuracy(logits: Any, y: Any) -> Any:
    return pt.mean(pt.eq(pt.argmax(logits, axis=1), y))


def train_and_test(args: argparse.Namespace, data: mnist.Dataset, label: str,
                   turns: Iterable[int]) -> tuple[list[dict[str, Any]], dict[str, float], float]:
    """Build the model and its functions in the forked group, train (``turns``: the epochs of each
    turn), test: (history, test metrics, seconds to build and compile the functions)."""
    t0 = time.perf_counter()
    fkw = {"mode": args.mode} if args.mode else {}
    floatx = pytensor.config.floatX
    if args.model == "cnn":
        params, forward = build_cnn(data.image_shape, args.filters, args.hidden, data.n_classes, args.dropout,
                                    args.seed)
        row_shape: tuple[int, ...] = (1, *data.image_shape)
    else:
        params, mlp = build_mlp(data.x_train.shape[1], args.hidden, args.layers, data.n_classes, args.seed)
        forward = lambda x, deterministic=False: mlp(x)  # noqa: E731
        row_shape = (data.x_train.shape[1],)
    x, y = pt.tensor("x", dtype=floatx, shape=(None, *row_shape)), pt.ivector("y")
    images = {part: getattr(data, f"x_{part}").reshape(-1, *row_shape) for part in ("train", "valid", "test")}
    rule = getattr(updates, args.rule)
    lr = {"learning_rate": args.learning_rate}
    if args.pattern == "host":  # the data once in shared memory; each step: batch= indices
        loss = cross_entropy(forward(x), y)
        train = make_train_function(loss, params, [x, y], rule, function_kwargs=fkw, **lr)
        train_data: tuple[Any, ...] = (synk.data(images["train"]), synk.data(data.y_train))
    else:  # the data scattered once into each rank's memory; each step: batch_s= rows of each rank's part
        x_s = pytensor.shared(np.zeros((0, *row_shape), dtype=floatx), name="x_train", shape=(None, *row_shape))
        y_s = pytensor.shared(np.zeros(0, dtype="int32"), name="y_train")
        loss = cross_entropy(forward(x_s), y_s)
        train = make_train_function(loss, params, [], rule, sliceable_shareds=[x_s, y_s], function_kwargs=fkw, **lr)
        synk.scatter([x_s, y_s], [images["train"], data.y_train])
        train_data = ()
    logits = forward(x, deterministic=True)
    evaluate = make_eval_function({"loss": cross_entropy(logits, y), "accuracy": accuracy(logits, y)}, [x, y],
                                  function_kwargs=fkw)
    valid = (synk.data(images["valid"]), synk.data(data.y_valid))
    test = (synk.data(images["test"]), synk.data(data.y_test))
    synk.distribute()  # every rank compiles its functions now (if the scatter did not), outside the timed epochs
    build_seconds = time.perf_counter() - t0
    main_run = not args.baseline_json  # the single-process child trains quietly; its parent prints its results
    if main_run:
        print(f"functions built, distributed and compiled in every rank: {duration(build_seconds)}", flush=True)
    trainer = Trainer(train, eval_fn=evaluate, batch_size=args.batch_size, seed=args.seed,
                      eval_slices=args.eval_slices, drop_last=args.drop_last,
                      progress=False if args.no_progress or not main_run else None,
                      verbose=print_every(args) if main_run else False)
    if main_run:
        print(f"{args.epochs} epochs of {describe_epoch(trainer, train_data)}", flush=True)
    for epochs in turns:
        trainer.fit(train_data, epochs=epochs, valid=valid, restore_best=False)  # the next turn trains on
    trainer.restore_best_epoch()  # tested: the epoch of the best validation loss
    return trainer.history, evaluate(*test, num_slices=args.eval_slices), build_seconds


def run(args: argparse.Namespace, data: mnist.Dataset, n_parallel: int | None, label: str,
        turns: Iterable[int]) -> dict[str, Any]:
    """Fork, train and test, close: one complete run with ``n_parallel`` ranks."""
    from synkhronos.runtime import current

    cores = len(os.sched_getaffinity(0))  # before fork, which pins the master to its own share until close
    n = synk.fork(n_parallel, use_gpu=False if args.cpu else None, precision=args.precision)
    rt = current()
    assert rt is not None
    kind = "GPUs" if rt.device.use_gpu else f"CPU processes (backend {getattr(rt.device, 'backend', '?')})"
    result = {"label": label, "ranks": n, "kind": kind, "cores": cores, "pattern": args.pattern,
              "gpus": bool(rt.device.use_gpu), "one_core_ranks": cores <= n}
    if not args.baseline_json:
        print(header(result), flush=True)
    try:
        history, test, build_seconds = train_and_test(args, data, label, turns)
    finally:
        synk.close()
    result.update({"history": history, "test": test, "build_seconds": build_seconds,
                   "epoch_seconds": statistics.median(h["seconds"] for h in history),
                   "samples_per_s": statistics.median(h["samples_per_s"] for h in history)})
    if not args.baseline_json:
        print(outcome(result), flush=True)
    return result


def header(run: dict[str, Any]) -> str:
    return f"\n== {run['label']}: {run['ranks']} rank(s), {run['kind']}, pattern {run['pattern']!r} =="


def outcome(run: dict[str, Any]) -> str:
    """A run's result line: test accuracy and loss, the first step and the throughput."""
    warmup = sum(h.get("warmup_seconds", 0.0) for h in run["history"])
    text = (f"{run['label']}: test accuracy {run['test']['accuracy']:.2%}, test loss {run['test']['loss']:.4f}; "
            f"median epoch {duration(run['epoch_seconds'])} ({run['samples_per_s']:.0f} samples/s")
    if warmup:
        text += f"; not counted: {duration(warmup)} in the first step of each batch size, which compiles"
    return text + ")"


def plot(runs: list[dict[str, Any]], path: str, title: str) -> None:
    """Loss (train and validation) and throughput per epoch of every run, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'synk-lasagne[mnist]'): no plot")
        return
    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, r in enumerate(runs):
        epochs = [h["epoch"] for h in r["history"]]
        color = f"C{i}"
        name = f"{r['label']} ({r['ranks']} rank{'s' if r['ranks'] > 1 else ''})"
        width = max(1.5, 4 - 2 * i)  # wide, then narrower lines: equal runs (the same steps) stay visible
        ax_loss.plot(epochs, [h["train_loss"] for h in r["history"]], color=color, lw=width, alpha=0.8,
                     label=f"{name}: train")
        ax_loss.plot(epochs, [h["valid_loss"] for h in r["history"]], color=color, lw=width, alpha=0.8,
                     linestyle="--", label=f"{name}: validation")
        ax_speed.plot(epochs, [h["samples_per_s"] for h in r["history"]], color=color, marker="o", markersize=3,
                      label=name)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", yscale="log", title="loss")
    ax_speed.set(xlabel="epoch", ylabel="training samples / s", title="throughput")
    ax_speed.set_ylim(bottom=0)
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def describe_model(args: argparse.Namespace, data: mnist.Dataset) -> str:
    if args.model == "cnn":
        return (f"CNN 2x(conv 3x3 x{args.filters}, max-pool 2) -> dense {args.hidden} -> 10, dropout "
                f"{args.dropout}")
    return f"MLP {data.x_train.shape[1]} -> {' -> '.join([str(args.hidden)] * args.layers)} -> 10"


def epochs_default(args: argparse.Namespace, data: mnist.Dataset) -> int:
    """``--epochs``, or its default for the data: :data:`DIGITS_EPOCHS` on the digits, else
    :data:`MNIST_EPOCHS`."""
    if args.epochs is not None:
        return int(args.epochs)
    return DIGITS_EPOCHS if data.image_shape == (8, 8) else MNIST_EPOCHS


def print_every(args: argparse.Namespace) -> int:
    """``--print-every``, or about 10 lines per run."""
    return args.print_every or max(1, args.epochs // 10)


def duration(seconds: float) -> str:
    """``seconds`` to read at a glance: ``"2.31 ms"`` under a second, else ``"1.23 s"``."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.2f} s"


def describe_epoch(trainer: Trainer, train: tuple[Any, ...]) -> str:
    """An epoch's steps and training rows (:meth:`Trainer.epoch_size`), e.g. ``1 step (1024 of
    1258 rows; ...)``."""
    steps, trained, rows = trainer.epoch_size(train)
    text = f"{steps} step{'s' if steps != 1 else ''} ({trained} of {rows} rows"
    if trained < rows:
        text += "; the last, smaller batch dropped (--drop-last)"
    return text + ")"


class SingleProcessRun:
    """The single-process run, in a child interpreter started before this process forks: its
    thread pools (XLA's is sized when JAX starts) take every core, as in a plain script; this
    process's are sized to the master's cores by fork.  It trains when this process tells it to
    (:meth:`train`), so that the two runs take turns; its output goes to the terminal, its results
    come back through a file (:meth:`finish`).  Use it as a context manager: leaving early ends
    the child too (it tests and exits as after its last turn)."""

    def __init__(self, argv: list[str]) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self._json = os.path.join(self._tmp.name, "baseline.json")
        go_read, self._go = os.pipe()
        reply_read, reply_write = os.pipe()
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--baseline-json",
                                       self._json, "--turns", f"{go_read},{reply_write}"],
                                      pass_fds=(go_read, reply_write))
        os.close(go_read)
        os.close(reply_write)
        self._replies = os.fdopen(reply_read)

    def _expect(self, word: str) -> None:
        if self._replies.readline().strip() != word:
            self._ended_early()

    def _ended_early(self) -> None:
        raise RuntimeError(f"the single-process run ended early (exit status {self._proc.wait()}); its output "
                           "is above")

    def train(self, epochs: int) -> None:
        """Its next ``epochs`` epochs; returns when it has trained them."""
        try:
            os.write(self._go, f"{epochs}\n".encode())
        except BrokenPipeError:
            self._ended_early()
        self._expect("done")

    def turns(self, epochs: int) -> Iterator[int]:
        """The data-parallel run's turns (see :func:`turn_blocks`); after each, the child's same turn."""
        self._expect("ready")  # compiled: this run's timed epochs do not share the cores with its compiler
        for block in turn_blocks(epochs):
            yield block
            self.train(block)

    def finish(self) -> dict[str, Any]:
        """Its test results and history, once it has tested and exited."""
        self.close()
        if self._proc.returncode:
            raise RuntimeError(f"the single-process run failed (exit status {self._proc.returncode}); its output "
                               "is above")
        with open(self._json) as f:
            return dict(json.load(f))

    def close(self) -> None:
        if self._go >= 0:
            os.close(self._go)  # its last turn: it tests, writes its results and exits
            self._go = -1
        try:
            self._proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._replies.close()

    def __enter__(self) -> SingleProcessRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._tmp.cleanup()


def why_faster_than_cores(run: dict[str, Any], cores: int) -> str:
    """One line on a speedup above the number of cores: the ranks' and the single process's
    matrix products are not the same code (:mod:`synkhronos.blas`)."""
    from synkhronos import blas

    if run["one_core_ranks"] and blas.wanted(one_core=True) and not blas.wanted(one_core=False):
        return (f"why more than {cores}x: each rank, on one core of its own, multiplies matrices with numpy's "
                "BLAS, faster per core than XLA's own product, which the single process spreads over its "
                f"{cores} cores with little gain at this size (SYNK_CPU_BLAS=0 gives the ranks XLA's product too)")
    return (f"why more than {cores}x: the single process's XLA thread pool spreads this model's small products "
            f"over all {cores} cores, and handing work between its threads costs more than it saves; each rank's "
            "pool spans only its own cores")


def turn_blocks(epochs: int) -> list[int]:
    """``epochs`` in turns of :data:`TURN_EPOCHS` (the last one shorter)."""
    return [min(TURN_EPOCHS, epochs - start) for start in range(0, epochs, TURN_EPOCHS)]


def turns_from_parent(pipes: str) -> Iterator[int]:
    """The child's turns, as its parent's :class:`SingleProcessRun` sends them (``pipes``: the file
    descriptors ``"read,write"``), until the parent says 0 or closes the pipe."""
    go, reply = (int(fd) for fd in pipes.split(","))
    with os.fdopen(go) as commands, os.fdopen(reply, "w", buffering=1) as replies:
        try:
            replies.write("ready\n")
            for line in commands:
                epochs = int(line)
                if epochs <= 0:
                    break
                yield epochs
                replies.write("done\n")
        except BrokenPipeError:  # the parent is gone: test and exit as after the last turn
            return


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    pytensor.config.floatX = "float32"  # set before fork: the workers take the master's configuration
    t0 = time.perf_counter()
    quiet = bool(args.baseline_json)  # the digits' note once: the parent's
    data = mnist.load(args.data_dir, quiet=quiet).astype(pytensor.config.floatX)
    args.epochs = epochs_default(args, data)
    if not args.baseline_json:
        argv = [*argv, "--epochs", str(args.epochs)]  # the single process: the same epochs
    if args.baseline_json:  # the child of SingleProcessRun
        single = run(args, data, 1, "single process", turns_from_parent(args.turns))
        with open(args.baseline_json, "w") as f:
            json.dump(single, f, default=float)  # numpy scalars as floats
        return 0
    print(f"data: {data.source}: {len(data.x_train)} train, {len(data.x_valid)} validation, {len(data.x_test)} "
          f"test images of {data.image_shape[0]}x{data.image_shape[1]}")
    print(f"model: {describe_model(args, data)}, {args.rule} (learning rate {args.learning_rate}), batch "
          f"{args.batch_size}")
    if args.no_baseline:
        runs = [run(args, data, args.n_parallel, "data-parallel", turn_blocks(args.epochs))]
    else:
        with SingleProcessRun(argv) as baseline:  # started before fork: every core is still ours
            runs = [run(args, data, args.n_parallel, "data-parallel", baseline.turns(args.epochs))]
            runs.append(baseline.finish())
    main_run = runs[0]
    if len(runs) > 1:  # the single process's output, under its own header, once both have finished
        print(header(runs[1]))
        print(f"functions built and compiled: {duration(runs[1]['build_seconds'])}")
        print(outcome(runs[1]))
    acc = main_run["test"]["accuracy"]
    print(f"\nfinal test accuracy ({main_run['ranks']} ranks): {acc:.2%}")
    speedup = None
    if len(runs) > 1:
        speedup = runs[1]["epoch_seconds"] / main_run["epoch_seconds"]
        cores = runs[1]["cores"]  # what the single process could run on (its own affinity)
        single = "one process on one GPU" if main_run["gpus"] else f"one process on all {cores} cores"
        print(f"speedup of {main_run['ranks']} {main_run['kind']} over {single} (same "
              f"backend, model and steps): {speedup:.2f}x (median training epoch {duration(runs[1]['epoch_seconds'])} "
              f"-> {duration(main_run['epoch_seconds'])})")
        if speedup > cores and not main_run["gpus"]:
            print(why_faster_than_cores(main_run, cores))
        elif speedup < 1.2:
            print("note: each step of this model is too little work for several ranks to pay off (every "
                  "step is a round trip between the ranks): a larger model (--hidden) or batch (--batch-size) "
                  "gives each rank more to do per step")
    title = (f"{data.source}, {describe_model(args, data)}, {args.rule}, batch {args.batch_size}, "
             f"pattern {args.pattern}" + (f", speedup {speedup:.2f}x" if speedup else ""))
    plot(runs, args.plot, title)
    print(f"total time {time.perf_counter() - t0:.1f} s")
    if args.min_accuracy is not None and acc < args.min_accuracy:
        print(f"FAILED: test accuracy {acc:.2%} is below --min-accuracy {args.min_accuracy:.0%}")
        return 1
    print("Done.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
