"""The most that data parallelism could give the main job's step on two cores: two independent
processes (no communication at all), each on one core with half the batch, against the one process
on both cores with the whole batch (diagnosis, not a benchmark of record: the main job's side-by-side
speedup is that; findings in the CPU guide, docs/guides/cpu.rst).

Every configuration trains the main job's model and step (``examples/mnist/train_mnist.py``'s
defaults: the 8 x 64 MLP, Adam, float32, ``batch=`` indices of the digits' training rows) as the main
job's single-process run does: ``synk.fork(1)`` and :func:`synk_lasagne.make_train_function`, in a
fresh interpreter pinned to its cores.  Timed after a warm-up, two ways: back to back (the median
step over blocks of 20) and as in the main job (``--as-the-job``: the validation call between two
steps, as the trainer's epochs of one step each run them; the median of the steps alone).

``one process, 2 cores``
    The main job's baseline: the whole batch, every core (JAX's threads spread over both).
``one process, 1 core``
    The whole batch on one core: what the second core gives the baseline.
``2 independent processes``
    One per core, half the batch each, started together and stepping at the same time, never
    meeting: a data-parallel step without its plan, all-reduce, second call and replies.  The
    ratio of the baseline to this is the bound of the main job's speedup on these cores.

Usage::

    python tools/probe_dp_bound.py [--cores 0,1] [--steps 400] [--rounds 3] [--as-the-job]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(cores: list[int], batch: int, steps: int, as_the_job: bool) -> None:
    """Pinned to ``cores``: build the main job's step, warm up, say ready, wait for "go" on stdin,
    step ``steps`` times, print the median step (s) as JSON: over blocks of 20 back-to-back steps,
    or ``as_the_job``, over steps each after a validation call (untimed)."""
    os.sched_setaffinity(0, set(cores))
    sys.path.insert(0, os.path.join(ROOT, "examples", "mnist"))
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    pytensor.config.floatX = "float32"
    import train_mnist as job

    import synkhronos as synk
    from synk_lasagne import make_eval_function, make_train_function, mnist, updates

    data = mnist.load(None, quiet=True).astype("float32")
    synk.fork(1)
    try:
        params, forward = job.build_mlp(data.x_train.shape[1], 64, 8, data.n_classes, 0)
        x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
        train = make_train_function(job.cross_entropy(forward(x), y), params, [x, y], updates.adam,
                                    learning_rate=3e-3)
        evaluate = make_eval_function({"loss": job.cross_entropy(forward(x), y)}, [x, y])
        xd, yd = synk.data(data.x_train), synk.data(data.y_train)
        valid = (synk.data(data.x_valid), synk.data(data.y_valid))
        synk.distribute()
        rng = np.random.default_rng(0)
        n = len(data.x_train)
        batches = [rng.permutation(n)[:batch] for _ in range(64)]
        for i in range(60):
            float(train(xd, yd, batch=batches[i % 64]))
        print("ready", flush=True)
        sys.stdin.readline()
        times, block = [], 1 if as_the_job else 20
        for b in range(steps // block):
            if as_the_job:
                evaluate(*valid, num_slices=2)
            t0 = time.perf_counter()
            for i in range(block):
                float(train(xd, yd, batch=batches[(b * block + i) % 64]))
            times.append((time.perf_counter() - t0) / block)
        print(json.dumps({"step_s": statistics.median(times)}), flush=True)
    finally:
        synk.close()


def run_configs(configs: list[tuple[list[int], int]], steps: int, as_the_job: bool) -> list[float]:
    """Start one child per ``(cores, batch)``, let them all go at once; their median steps (s)."""
    from together import run_together

    return [r["step_s"] for r in run_together([[sys.executable, __file__, "--child", ",".join(map(str, cores)),
                                                 str(batch), str(steps), str(int(as_the_job))]
                                                for cores, batch in configs])]


def main() -> None:
    from together import add_probe_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_arguments(parser)
    parser.add_argument("--as-the-job", action="store_true",
                        help="a validation call before each step, as the main job's epochs of one step")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from machine import two_cores

    a, b = two_cores(args.cores)
    full, half = args.batch_size, args.batch_size // 2
    rows: dict[str, list[float]] = {"one process, 2 cores": [], "one process, 1 core": [],
                                    "2 independent processes (slower of the two)": []}
    for _ in range(args.rounds):  # the configurations take turns, so that each meets the host's states
        rows["one process, 2 cores"] += run_configs([([a, b], full)], args.steps, args.as_the_job)
        rows["one process, 1 core"] += run_configs([([a], full)], args.steps, args.as_the_job)
        rows["2 independent processes (slower of the two)"].append(
            max(run_configs([([a], half), ([b], half)], args.steps, args.as_the_job)))
    how = "each step after a validation call" if args.as_the_job else "back to back"
    print(f"cores {a},{b}; batch {full}; steps {how}; ms per step, median over rounds (each round's figure)")
    for name, values in rows.items():
        print(f"  {name:45s} {statistics.median(values) * 1e3:7.3f}  ({', '.join(f'{v * 1e3:.3f}' for v in values)})")
    base, bound = statistics.median(rows["one process, 2 cores"]), statistics.median(
        rows["2 independent processes (slower of the two)"])
    print(f"bound of the data-parallel speedup on these cores: {base / bound:.2f}x "
          f"(the second core gives one process {statistics.median(rows['one process, 1 core']) / base:.2f}x)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child([int(c) for c in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
    else:
        main()
