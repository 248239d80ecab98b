"""Where the main job's data-parallel step spends its time, and what packing the parameters into
one vector would save (diagnosis, not a benchmark of record: the main job's side-by-side speedup
is that; findings in the CPU guide, docs/guides/cpu.rst).

``phases``
    Runs the main job (``examples/mnist/train_mnist.py --cpu --no-baseline``) with
    ``probe_site/sitecustomize.py`` stamping each phase of every ``synk.chain`` step in the
    master and the worker (one clock for both), then prints each phase's median and quartiles
    over the steps (us): the master's plan, its share (``share``: gathering its rows and the
    gradient call, ``jax grad``), the barrier, the all-reduce, the update call (``then``, of it
    ``jax update``), combining the outputs; the worker's wake-up after the command starts, its
    share, its reply, and how long before the master's end of the command it was done.
``packed``
    The main job's model and step (Adam, 1024 rows over 2 ranks, ``batch=`` indices) as
    ``TrainFunction.chain`` builds it, against a prototype of the same step over ONE packed
    parameter vector: the gradient function reads the parameters as views of it (``givens``),
    and the update function writes it as one output instead of one per parameter (4 outputs in
    all instead of 21).  Blocks of steps alternate; medians.  The prototype leaves the model's
    own parameter variables stale: it measures the step, not a way to keep them current.  With
    ``SYNK_PROBE_NO_REDUCE=1`` a third step joins the turns: the same chain all-reducing a
    one-element variable instead of the gradient (wrong maths; the bound of what a cheaper
    all-reduce could save).

Usage::

    python tools/probe_chain_step.py phases [--epochs 400]
    python tools/probe_chain_step.py packed [--blocks 15]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
Events = list[tuple[str, float]]

MASTER = [  # (label, tag, occurrence within a step)
    ("plan", "plan", 0), ("share", "share", 0), ("  jax grad", "jax", 0), ("barrier", "barrier", 0),
    ("all-reduce", "all_reduce", 0), ("then", "compute", 1), ("  jax update", "jax", 1),
    ("finish (wait for the workers)", "finish", 0), ("combine", "combine", 0), ("whole step", "step", 0),
]
WORKER = [("share", "share", 0), ("  jax grad", "jax", 0), ("reply", "reply", 0), ("barrier", "barrier", 0),
          ("all-reduce", "all_reduce", 0), ("then", "compute", 1), ("  jax update", "jax", 1)]


def _steps(events: Events, first: str, needs: str) -> list[Events]:
    """The events cut into steps, each starting at tag ``first``; only those that hold ``needs``."""
    steps: list[Events] = []
    for tag, t in events:
        if tag == first:
            steps.append([])
        if steps:
            steps[-1].append((tag, t))
    return [s for s in steps if any(tag == needs for tag, _ in s)]


def _at(step: Events, tag: str, k: int = 0) -> float:
    return [t for name, t in step if name == tag][k]


def _span(step: Events, tag: str, k: int) -> float:
    return (_at(step, tag + "<", k) - _at(step, tag + ">", k)) * 1e6


def phases(epochs: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, SYNK_PROBE_PHASES_DIR=out,
                   PYTHONPATH=os.pathsep.join([os.path.join(HERE, "probe_site"), os.environ.get("PYTHONPATH", "")]))
        job = [sys.executable, os.path.join(ROOT, "examples", "mnist", "train_mnist.py"), "--cpu", "--no-progress",
               "--no-baseline", "--epochs", str(epochs), "--plot", os.path.join(out, "plot.png")]
        done = subprocess.run(job, env=env, capture_output=True, text=True, check=True)
        print("\n".join(line for line in done.stdout.splitlines() if "median epoch" in line))
        runs = []
        for path in glob.glob(os.path.join(out, "*.json")):
            with open(path) as f:
                runs.append(json.load(f))
    master = next(r for r in runs if any(tag == "step>" for tag, _ in r))
    worker = next(r for r in runs if r is not master and any(tag == "all_reduce>" for tag, _ in r))
    m_steps = _steps(master, "step>", "all_reduce>")
    w_steps = _steps(worker, "decode>", "all_reduce>")
    n = min(len(m_steps), len(w_steps))
    skip = n // 8  # the first steps compile and warm up
    pairs = list(zip(m_steps[len(m_steps) - n:], w_steps[len(w_steps) - n:]))[skip:]
    rows: dict[str, list[float]] = {}
    for m, w in pairs:
        for label, tag, k in MASTER:
            rows.setdefault("master " + label, []).append(_span(m, tag, k))
        rows.setdefault("worker wake-up after the command starts", []).append(
            (_at(w, "decode>") - _at(m, "start<")) * 1e6)
        for label, tag, k in WORKER:
            rows.setdefault("worker " + label, []).append(_span(w, tag, k))
        rows.setdefault("worker done before the master's finish ends", []).append(
            (_at(m, "finish<") - _at(w, "compute<", 1)) * 1e6)
    print(f"{len(pairs)} steps; us: median (quartiles)")
    for label, values in rows.items():
        q = statistics.quantiles(values, n=4)
        print(f"  {label:44s} {statistics.median(values):8.1f}  ({q[0]:.1f}-{q[2]:.1f})")


def packed(blocks: int) -> None:
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    pytensor.config.floatX = "float32"  # as the main job
    sys.path.insert(0, os.path.join(ROOT, "examples", "mnist"))
    import train_mnist as job

    import synkhronos as synk
    from synk_lasagne import make_train_function, mnist, updates

    synk.fork(2, use_gpu=False)
    try:
        data = mnist.load(None, quiet=True).astype("float32")
        params, mlp = job.build_mlp(data.x_train.shape[1], 64, 8, data.n_classes, 0)
        x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
        train = make_train_function(job.cross_entropy(mlp(x), y), params, [x, y], updates.adam, learning_rate=3e-3)
        flat_grad, local_flat, grad_views = updates.flat_gradient(job.cross_entropy(mlp(x), y), params, x.shape[0])
        with updates.no_all_reduce():
            moved = updates.adam(grad_views, params, learning_rate=3e-3)
        shapes = [p.get_value().shape for p in params]
        bounds = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
        flat = pytensor.shared(np.concatenate([p.get_value().ravel() for p in params]), name="packed_params")
        whole = pt.specify_shape(flat, (int(bounds[-1]),))  # static shapes: the views' gradients trace in JAX
        views = [(p, whole[bounds[i]:bounds[i + 1]].reshape(s)) for i, (p, s) in enumerate(zip(params, shapes))]
        grad_fn = synk.function([x, y], job.cross_entropy(mlp(x), y), updates=[(flat_grad, local_flat, "sum")],
                                givens=views)
        state = [(var, value) for var, value in moved.items() if var not in dict(views)]
        step_fn = synk.function([], None, updates=[(flat, pt.concatenate([moved[p].ravel() for p in params])),
                                                   *state], givens=views)
        steps: dict[str, Any] = {
            "per parameter (TrainFunction.chain)": train.chain,
            "packed (prototype)": synk.chain(grad_fn, all_reduce=flat_grad, op="sum", then=step_fn,
                                             zeros_if_idle=True),
        }
        if os.environ.get("SYNK_PROBE_NO_REDUCE"):  # what a free all-reduce would save (wrong maths)
            tiny = pytensor.shared(np.zeros(1, dtype="float32"), name="tiny")
            synk.function([], tiny * 2)  # the workers hold only the shared variables of functions
            steps["tiny all-reduce (bound)"] = synk.chain(train.chain.first, all_reduce=tiny, op="sum",
                                                          then=train.chain.then)
        x_data, y_data = synk.data(data.x_train), synk.data(data.y_train)
        synk.distribute()
        rng = np.random.default_rng(0)
        n = len(data.x_train)

        def block(step: Any, calls: int = 100) -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                step(x_data, y_data, batch=rng.permutation(n)[:1024])
            return (time.perf_counter() - t0) / calls * 1e6

        for step in steps.values():
            block(step, 30)
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(blocks):
            for name, step in steps.items():
                times[name].append(block(step))
        for name, values in times.items():
            print(f"{name:38s} step median {statistics.median(values):7.1f} us, min {min(values):7.1f}")
        base, *others = (statistics.median(v) for v in times.values())
        for name, value in zip(list(times)[1:], others):
            print(f"{name} / per parameter: {value / base:.3f}")
    finally:
        synk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["phases", "packed"])
    parser.add_argument("--epochs", type=int, default=400, help="phases: epochs of the main job (one step each)")
    parser.add_argument("--blocks", type=int, default=15, help="packed: blocks of 100 steps of each")
    args = parser.parse_args()
    if args.what == "phases":
        phases(args.epochs)
    else:
        packed(args.blocks)


if __name__ == "__main__":
    main()
