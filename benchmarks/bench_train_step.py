"""synk_lasagne's training step, two ways side by side in one run: ONE function with the in-graph
all-reduce (``TrainFunction.function``, what a call with ``num_slices=1`` runs) against the chain
of the first design (``TrainFunction.chain``: gradient function, all-reduce of the flat gradient
shared variable, update function, as one command).  Both are built from the same rule and update
the same parameters; blocks of steps alternate, median over blocks.

Model: a tanh MLP with softmax cross-entropy, Adam, float32, at three sizes (the gradient's size
decides what the all-reduce costs; the tiny one shows the per-call overhead).

    python benchmarks/bench_train_step.py                  # CPU mode, 2 ranks
    python benchmarks/bench_train_step.py --ranks 3
    python benchmarks/bench_train_step.py --gpu --ranks 1  # GPU mode (one rank: no all-reduce at all)
    python benchmarks/bench_train_step.py --engine jax --uneven  # the JAX engine, batches of batch + 1 rows

``--uneven`` takes batches of one row more than the global batch (uneven over the ranks): under
the JAX engine the fused step then runs as one program cut at its all-reduce (issue 17, before
which it raised NotOneProgramError and the train function fell back to its chain).

In GPU mode (the per-rank JAX engine of today) the in-graph all-reduce of 2+ ranks is a host
callback (device -> host -> shared memory -> device) while the chain all-reduces through NCCL:
compare them there before choosing.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

SIZES = {  # name: (layer widths, global batch)
    "tiny": ([8, 16, 4], 64),
    "medium": ([256, 512, 10], 1024),
    "large": ([1024, 1024, 1024, 10], 2048),
}


def build(widths: list[int], batch: int, n_rows: int) -> tuple:
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synk_lasagne import make_train_function, updates

    rng = np.random.default_rng(0)
    x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
    params, h = [], x
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        w = pytensor.shared((rng.standard_normal((a, b)) / np.sqrt(a)).astype("float32"), name=f"W{i}")
        c = pytensor.shared(np.zeros(b, dtype="float32"), name=f"b{i}")
        params += [w, c]
        h = h @ w + c
        if i < len(widths) - 2:
            h = pt.tanh(h)
    logp = pt.special.log_softmax(h, axis=1)
    loss = -pt.mean(logp[pt.arange(y.shape[0]), y])
    train = make_train_function(loss, params, [x, y], updates.adam, learning_rate=np.float32(1e-3))
    x_data = synk.data(rng.standard_normal((n_rows, widths[0])).astype("float32"))
    y_data = synk.data(rng.integers(0, widths[-1], n_rows).astype("int32"))
    return train, x_data, y_data


def measure(name: str, blocks: int, steps: int, extra: int = 0) -> dict[str, float]:
    import numpy as np

    widths, batch = SIZES[name]
    batch += extra
    n_rows = 4 * batch
    train, x_data, y_data = build(widths, batch, n_rows)
    order = np.random.default_rng(1)
    batches = [order.permutation(n_rows)[:batch] for _ in range(steps)]
    ways = {"fused": train.function, "chain": train.chain}
    for way in ways.values():  # compile and warm up
        for b in batches[:3]:
            way(x_data, y_data, batch=b)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(blocks):
        for key, way in ways.items():
            t0 = time.perf_counter()
            for b in batches:
                way(x_data, y_data, batch=b)
            times[key].append((time.perf_counter() - t0) / steps)
    grad_values = sum(int(np.prod(p.get_value(borrow=True).shape)) for p in train.params)
    return {"grad_values": grad_values, **{k: statistics.median(v) * 1e3 for k, v in times.items()}}


def main() -> None:
    import synkhronos as synk

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="GPU mode (default: CPU mode)")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--engine", default=None, help="synk.fork's engine (default: the mode's)")
    parser.add_argument("--uneven", action="store_true", help="batches of one row more than the global batch")
    args = parser.parse_args()
    synk.fork(args.ranks, use_gpu=args.gpu, engine=args.engine)
    import pytensor
    from machine import cpu_model
    from pytensor.compile.mode import get_default_mode

    linker = "JAX" if args.gpu else type(get_default_mode().linker).__name__
    print(f"{'GPU' if args.gpu else 'CPU'} mode, engine {synk.engine.choose(args.engine, args.gpu)!r}, "
          f"{args.ranks} ranks{', uneven batches' if args.uneven else ''}; PyTensor {pytensor.__version__} ({linker}); "
          f"{cpu_model()}")
    print(f"{'model':>8} {'widths':>22} {'batch':>6} {'grad values':>12} {'fused ms':>9} {'chain ms':>9} "
          f"{'chain/fused':>11}")
    try:
        for name in args.sizes.split(","):
            r = measure(name, args.blocks, args.steps, int(args.uneven))
            widths, batch = SIZES[name]
            batch += int(args.uneven)
            print(f"{name:>8} {'-'.join(map(str, widths)):>22} {batch:>6} {r['grad_values']:>12} "
                  f"{r['fused']:>9.3f} {r['chain']:>9.3f} {r['chain'] / r['fused']:>10.2f}x", flush=True)
    finally:
        synk.close()


if __name__ == "__main__":
    main()
