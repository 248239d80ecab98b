"""Train a ResNet (ResNet-50 by default) data-parallel with Synkhronos and synk-lasagne.

The seed's second deep-learning demo: Lasagne's model-zoo ResNet-50 (bottleneck blocks, batch
norm, 224x224x3 input; :func:`synk_lasagne.models.build_resnet`) trained with SGD and momentum
on every GPU (one rank per GPU, PyTensor's JAX backend), else on CPU worker processes.  Then the
same steps on one rank, for the speedup.

Data: synthetic ImageNet-shaped images by default (each class a fixed random pattern plus noise:
learnable, so the loss falls); or an image folder (``--data-dir``: one sub-directory per class,
read with Pillow, else matplotlib, whichever is installed).

Data patterns (``--pattern``), as in the MNIST demo: ``host`` (images in host shared memory,
``batch=`` indices of a random batch each step) or ``scatter`` (images scattered once into each
rank's memory -- the GPU's in GPU mode -- and ``batch_s=`` rows of each rank's part).

Batch norm: each rank normalizes with its own share of the batch and keeps its own running
averages, as Synkhronos 1.0 did; before the evaluation they are averaged over the ranks
(``--no-average-bn``: not).

``--batch-size`` is per rank: a step of n ranks trains on n times as many images (weak scaling,
as the Synkhronos paper measured ResNet-50); the speedup is images/s over one rank's.

Examples::

    python examples/resnet/train_resnet.py                                  # ResNet-50, 224x224, every GPU
    python examples/resnet/train_resnet.py --depth 18 --image-size 64 --width 16 --cpu --steps 20
    python examples/resnet/train_resnet.py --data-dir ~/imagenette/train --classes 10 --pattern scatter
    python examples/resnet/train_resnet.py --precision bf16 --batch-size 128     # bfloat16 products
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synk_lasagne import layers, make_eval_function, make_train_function, objectives, regularization, updates
from synk_lasagne.models import DEPTHS, build_resnet
from synk_lasagne.random import set_rng

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".tif", ".tiff", ".webp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--depth", type=int, default=50, choices=sorted(DEPTHS))
    parser.add_argument("--width", type=int, default=64, help="filters of the first stage (64: the paper's)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--classes", type=int, default=1000, help="classes of the synthetic data")
    parser.add_argument("--batch-size", type=int, default=64, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=30, help="training steps (the first --warmup not timed)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the clock starts (compilation)")
    parser.add_argument("--n-images", type=int, default=None,
                        help="synthetic images in the pool (default: 2 steps' worth over all ranks)")
    parser.add_argument("--data-dir", default=None, help="an image folder: one sub-directory per class")
    parser.add_argument("--n-parallel", type=int, default=None, help="ranks (default: every GPU, or every core)")
    parser.add_argument("--cpu", action="store_true", help="CPU worker processes even on a machine with GPUs")
    parser.add_argument("--pattern", choices=["host", "scatter"], default="host")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--no-average-bn", action="store_true",
                        help="keep each rank's batch-norm running averages (no averaging before evaluation)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the one-rank run (no speedup)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--mode", default=None, help="PyTensor mode (default: JAX on GPUs, PyTensor's on CPUs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["default", "highest", "bf16"], default="default",
                        help="precision policy (synkhronos.precision): bf16 = bfloat16 activations, "
                             "reductions, parameters and state float32; needs JAX")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.steps, args.image_size, args.width, args.classes) < 1 or args.warmup < 0:
        parser.error("--batch-size, --steps, --image-size, --width and --classes must be >= 1, --warmup >= 0")
    if args.warmup >= args.steps:
        parser.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup}): nothing would be timed")
    if args.image_size < 32:
        parser.error("--image-size must be >= 32 (a ResNet shrinks the image 32x)")
    return args


# --- data -------------------------------------------------------------------------------------------

def synthetic_images(n: int, n_classes: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` float32 images ``(3, size, size)``: each class a fixed random pattern (smooth, 8x8
    blocks) plus noise, so that the network can learn them; int32 labels."""
    rng = np.random.default_rng(seed)
    blocks = -(-size // 8)
    patterns = np.repeat(np.repeat(rng.normal(size=(n_classes, 3, blocks, blocks)), 8, axis=2), 8, axis=3)
    labels = rng.integers(0, n_classes, n).astype("int32")
    images = np.empty((n, 3, size, size), dtype="float32")
    for start in range(0, n, 256):  # in chunks: no float64 copy of the whole pool
        part = labels[start:start + 256]
        images[start:start + 256] = patterns[part, :, :size, :size] + rng.normal(size=(len(part), 3, size, size))
    return images, labels


def image_reader() -> tuple[str, Any]:
    """``(name, read(path, size) -> float32 (3, size, size) in [0, 1])`` with Pillow, else matplotlib."""
    try:
        from PIL import Image

        def read_pil(path: str, size: int) -> np.ndarray:
            with Image.open(path) as img:
                rgb = img.convert("RGB").resize((size, size), Image.BILINEAR)
            return np.asarray(rgb, dtype="float32").transpose(2, 0, 1) / 255.0

        return "Pillow", read_pil
    except ImportError:
        pass
    try:
        import matplotlib.image as mpimg
    except ImportError:
        raise SystemExit("reading an image folder needs Pillow or matplotlib: pip install pillow") from None

    def read_mpl(path: str, size: int) -> np.ndarray:
        img = np.asarray(mpimg.imread(path), dtype="float32")
        if img.max() > 1:
            img = img / 255.0
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        rows = (np.arange(size) * img.shape[0] / size).astype(int)  # nearest-neighbour resize
        cols = (np.arange(size) * img.shape[1] / size).astype(int)
        return img[rows][:, cols, :3].transpose(2, 0, 1)

    return "matplotlib (PNG only without Pillow; nearest-neighbour resize)", read_mpl


def folder_images(directory: str, size: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Every image of ``directory/<class>/*``: float32 ``(n, 3, size, size)``, int32 labels, class names."""
    classes = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d)))
    if not classes:
        raise SystemExit(f"{directory} has no sub-directories: give a folder with one sub-directory per class")
    name, read = image_reader()
    paths = [(os.path.join(directory, c, f), k) for k, c in enumerate(classes)
             for f in sorted(os.listdir(os.path.join(directory, c))) if f.lower().endswith(IMAGE_SUFFIXES)]
    if not paths:
        raise SystemExit(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {directory}/<class>/")
    print(f"reading {len(paths)} images of {len(classes)} classes with {name}", flush=True)
    images = np.stack([read(p, size) for p, _ in paths]).astype("float32")
    mean, std = images.mean(axis=(0, 2, 3), keepdims=True), images.std(axis=(0, 2, 3), keepdims=True) + 1e-6
    return (images - mean) / std, np.array([k for _, k in paths], dtype="int32"), classes


# --- training ---------------------------------------------------------------------------------------

def build(args: argparse.Namespace, n_classes: int, train_x: Any, train_y: Any) -> tuple[Any, Any, Any]:
    """The network, its training function (SGD with momentum, weight decay) over ``train_x`` /
    ``train_y`` (variables, or sliceable shared variables), and an evaluation function."""
    set_rng(np.random.RandomState(args.seed))
    net = build_resnet(args.depth, args.image_size, n_classes, args.width)
    fkw = {"mode": args.mode} if args.mode else {}

    def loss_and_accuracy(x: Any, y: Any, deterministic: bool) -> tuple[Any, Any]:
        probabilities = pt.special.softmax(layers.get_output(net, x, deterministic=deterministic), axis=-1)
        loss = objectives.aggregate(objectives.categorical_crossentropy(probabilities, y))
        return loss, objectives.aggregate(objectives.categorical_accuracy(probabilities, y))

    loss, accuracy = loss_and_accuracy(train_x, train_y, deterministic=False)
    penalty = args.weight_decay * regularization.regularize_network_params(net, regularization.l2)
    params = layers.get_all_params(net, trainable=True)
    hyper = {"learning_rate": np.float32(args.learning_rate), "momentum": np.float32(args.momentum)}
    if args.pattern == "host":
        train = make_train_function(loss + penalty, params, [train_x, train_y], updates.momentum,
                                    outputs={"accuracy": accuracy}, function_kwargs=fkw, **hyper)
    else:
        train = make_train_function(loss + penalty, params, [], updates.momentum, outputs={"accuracy": accuracy},
                                    sliceable_shareds=[train_x, train_y], function_kwargs=fkw, **hyper)
    x, y = pt.tensor4("x", shape=(None, 3, args.image_size, args.image_size)), pt.ivector("y")
    eval_loss, eval_accuracy = loss_and_accuracy(x, y, deterministic=True)
    evaluate = make_eval_function({"loss": eval_loss, "accuracy": eval_accuracy}, [x, y], function_kwargs=fkw)
    return net, train, evaluate


def run(args: argparse.Namespace, images: np.ndarray, labels: np.ndarray, n_classes: int,
        n_parallel: int | None, label: str) -> dict[str, Any]:
    """Fork, build, train ``--steps`` steps, evaluate, close: one run with ``n_parallel`` ranks."""
    from tqdm.auto import tqdm

    from synkhronos.runtime import current

    n = synk.fork(n_parallel, use_gpu=False if args.cpu else None, precision=args.precision)
    rt = current()
    assert rt is not None
    kind = "GPUs" if rt.device.use_gpu else "CPU processes"
    global_batch = args.batch_size * n
    print(f"\n== {label}: {n} rank(s), {kind}, pattern {args.pattern!r}, {global_batch} images per step ==",
          flush=True)
    try:
        t0 = time.perf_counter()
        size = args.image_size
        if args.pattern == "host":
            train_x, train_y = pt.tensor4("x", shape=(None, 3, size, size)), pt.ivector("y")
        else:
            train_x = pytensor.shared(np.zeros((0, 3, size, size), "float32"), name="x_train",
                                      shape=(None, 3, size, size))
            train_y = pytensor.shared(np.zeros(0, "int32"), name="y_train")
        net, train, evaluate = build(args, n_classes, train_x, train_y)
        x_data, y_data = synk.data(images), synk.data(labels)
        if args.pattern == "scatter":
            synk.scatter([train_x, train_y], [images, labels])
        synk.distribute()
        print(f"ResNet-{args.depth} ({layers.count_params(net, trainable=True):,} parameters) built and distributed "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        losses, seconds = train_steps(args, train, n, x_data, y_data, tqdm)
        if not args.no_average_bn:
            layers.average_running_statistics(net)
        metrics = evaluate(x_data, y_data, num_slices=max(1, len(images) // (args.batch_size * n)))
    finally:
        synk.close()
    timed = args.steps - args.warmup
    rate = global_batch * timed / seconds
    print(f"{label}: {rate:.1f} images/s ({seconds / timed * 1000:.1f} ms per step of {global_batch} images); "
          f"training loss {np.mean(losses[:2]):.3f} (first 2 steps) -> {np.mean(losses[-2:]):.3f} (last 2); "
          f"evaluation loss {metrics['loss']:.3f}, accuracy {metrics['accuracy']:.2%}", flush=True)
    return {"label": label, "ranks": n, "kind": kind, "images_per_s": rate, "losses": losses, "eval": metrics}


def train_steps(args: argparse.Namespace, train: Any, n: int, x_data: Any, y_data: Any,
                tqdm: Any) -> tuple[list[float], float]:
    """``--steps`` steps of random batches; returns the losses and the seconds of the timed steps."""
    rng = np.random.default_rng(args.seed)
    n_images = len(x_data)
    lengths = [int(v) for v in synk.get_lengths(train.sliceable_shareds[0])] if args.pattern == "scatter" else []
    losses: list[float] = []
    bar = tqdm(total=args.steps, desc="steps", unit="step", disable=args.no_progress or None)
    t0 = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:
            t0 = time.perf_counter()
        if args.pattern == "host":
            loss, acc = train(x_data, y_data, batch=rng.choice(n_images, args.batch_size * n, replace=False))
        else:
            rows = [rng.choice(length, min(args.batch_size, length), replace=False) for length in lengths]
            loss, acc = train(batch_s=rows)
        losses.append(float(np.asarray(loss)))
        if step >= args.warmup:
            rate = args.batch_size * n * (step + 1 - args.warmup) / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc=f"{float(np.asarray(acc)):.2f}", img_s=f"{rate:.0f}")
        bar.update(1)
    seconds = time.perf_counter() - t0
    bar.close()
    return losses, seconds


def expected_ranks(args: argparse.Namespace) -> int:
    """The ranks that ``synk.fork`` will start: ``--n-parallel``, else every GPU, else every core."""
    if args.n_parallel:
        return args.n_parallel
    from synkhronos.gpu import visible_devices

    gpus = [] if args.cpu else visible_devices()
    return len(gpus) or os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pytensor.config.floatX = "float32"  # before fork: the workers take the master's configuration
    if args.data_dir:
        images, labels, classes = folder_images(args.data_dir, args.image_size)
        n_classes, source = len(classes), f"image folder {args.data_dir}"
    else:
        n = args.n_images or 2 * args.batch_size * expected_ranks(args)
        images, labels = synthetic_images(n, args.classes, args.image_size, args.seed)
        n_classes, source = args.classes, "synthetic ImageNet-shaped images"
    print(f"data: {source}: {len(images)} images of 3x{args.image_size}x{args.image_size}, {n_classes} classes "
          f"({images.nbytes / 2**20:.0f} MiB)")
    print(f"model: ResNet-{args.depth} (width {args.width}), SGD momentum {args.momentum}, learning rate "
          f"{args.learning_rate}, weight decay {args.weight_decay}, {args.batch_size} images per rank per step, "
          f"{args.steps} steps ({args.warmup} untimed)")
    runs = [run(args, images, labels, n_classes, args.n_parallel, "data-parallel")]
    if not args.no_baseline:
        runs.append(run(args, images, labels, n_classes, 1, "one rank"))
    main_run = runs[0]
    if len(runs) > 1:
        speedup = main_run["images_per_s"] / runs[1]["images_per_s"]
        print(f"\nspeedup of {main_run['ranks']} {main_run['kind']} over 1: {speedup:.2f}x "
              f"({runs[1]['images_per_s']:.1f} -> {main_run['images_per_s']:.1f} images/s)")
    print("Done.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
