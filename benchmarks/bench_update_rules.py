"""synk_lasagne's update rules, their state as flat vectors against one state variable per
parameter, side by side in one run.

The update function of a data-parallel step (what :attr:`synk_lasagne.TrainFunction.step_fn`
runs after the all-reduce, and what the one-process step computes after its gradient) reads the
averaged gradient from ``flat_grad`` and updates the parameters and the rule's state.  The rules
keep that state as ONE shared vector per quantity (Adam's ``m`` and ``v``, a velocity); Lasagne
keeps one per parameter.  Both are built here on the same parameters and flat gradient (the
per-parameter one written out below, Lasagne's maths), checked to compute the same values, then
timed in alternating blocks: median microseconds per call of each, and their ratio.

Model: the main job's MLP (``examples/mnist/train_mnist.py``: 64 -> 8 x 64 -> 10, 18
parameters), float32; the gradient in ``flat_grad`` is a numpy array, as after the chain's
all-reduce.  PyTensor's JAX mode (CPU mode's backend) when JAX is installed, else PyTensor's
default mode.

    python benchmarks/bench_update_rules.py                   # every core
    taskset -c 0 python benchmarks/bench_update_rules.py      # one core, as a CPU rank of 2 cores
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections import OrderedDict
from typing import Any

import numpy as np

WIDTHS = [64] + [64] * 8 + [10]


def per_parameter_rule(name: str, params: list[Any], flat: Any, lr: float) -> OrderedDict[Any, Any]:
    """Lasagne's formulation: one state variable per parameter and quantity, reading each
    parameter's gradient as its view of ``flat`` (``flat[a:b] / flat[P]``)."""
    import pytensor
    import pytensor.tensor as pt

    total = sum(int(np.prod(p.get_value().shape)) for p in params)
    updates: OrderedDict[Any, Any] = OrderedDict()
    t_prev = pytensor.shared(np.zeros((), dtype="float32"), name="t")
    t = t_prev + 1
    a_t = lr * pt.sqrt(1 - 0.999**t) / (1 - 0.9**t)
    start = 0
    for p in params:
        value = p.get_value()
        g = (flat[start:start + value.size] / flat[total]).reshape(value.shape)
        start += value.size
        zeros = [pytensor.shared(np.zeros_like(value)) for _ in range(2)]
        if name == "momentum":
            velocity = zeros[0]
            velocity_t = 0.9 * velocity - lr * g
            updates[velocity] = velocity_t
            updates[p] = p + velocity_t
        else:  # adam
            m, v = zeros
            m_t = 0.9 * m + 0.1 * g
            v_t = 0.999 * v + 0.001 * g**2
            updates[m], updates[v] = m_t, v_t
            updates[p] = p - a_t * m_t / (pt.sqrt(v_t) + 1e-8)
    if name == "adam":
        updates[t_prev] = t
    return OrderedDict((var, pt.cast(expr, var.type.dtype)) for var, expr in updates.items())


def build(name: str, mode: str | None, lr: float) -> tuple[Any, Any, list[Any], list[Any], Any]:
    """The two update functions of rule ``name`` over two copies of the same parameters."""
    import pytensor
    import pytensor.tensor as pt

    from synk_lasagne import updates

    rng = np.random.default_rng(0)
    values = []
    for a, b in itertools.pairwise(WIDTHS):
        values += [rng.uniform(-0.1, 0.1, (a, b)).astype("float32"), np.zeros(b, dtype="float32")]
    x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")

    def model() -> tuple[list[Any], Any]:
        params = [pytensor.shared(v.copy()) for v in values]
        h = x
        for i in range(0, len(params) - 2, 2):
            h = pt.maximum(h @ params[i] + params[i + 1], 0)
        logits = h @ params[-2] + params[-1]
        return params, -pt.mean(pt.special.log_softmax(logits, axis=1)[pt.arange(y.shape[0]), y])

    flat_params, loss = model()
    # the step function of make_train_function's chain: the rule on the views of the all-reduced flat gradient
    flat_grad, _, views = updates.flat_gradient(loss, flat_params, 1.0)
    with updates.no_all_reduce():
        rule = getattr(updates, name)(views, flat_params, learning_rate=lr)
    gradient = np.concatenate([rng.normal(0, 1e-2, flat_grad.get_value().size - 1), [1.0]]).astype("float32")
    flat_grad.set_value(gradient)
    flat_fn = pytensor.function([], [], updates=list(rule.items()), mode=mode)
    per_params, _ = model()
    per_fn = pytensor.function([], [], updates=list(per_parameter_rule(name, per_params, flat_grad, lr).items()),
                               mode=mode)
    return flat_fn, per_fn, flat_params, per_params, (flat_grad, gradient)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", default="adam,momentum")
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--calls", type=int, default=300, help="calls per block")
    args = parser.parse_args()
    import pytensor

    pytensor.config.floatX = "float32"
    try:
        import jax  # noqa: F401

        mode: str | None = "JAX"
    except ImportError:
        mode = None
    print(f"update functions of the main job's MLP, {len(os.sched_getaffinity(0))} core(s), mode {mode or 'default'}; "
          f"median us per call over {args.blocks} blocks of {args.calls}")
    print(f"{'rule':<10} {'outputs flat / per-param':>26} {'flat state':>12} {'per parameter':>14} {'ratio':>7}")
    for name in args.rules.split(","):
        flat_fn, per_fn, flat_params, per_params, (flat_grad, gradient) = build(name, mode, 1e-3)
        for _ in range(3):  # the same values, step after step
            flat_fn()
            per_fn()
        for a, b in zip(flat_params, per_params):
            np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()), rtol=2e-5, atol=1e-7)
        times: dict[str, list[float]] = {"flat": [], "per": []}
        for _ in range(args.blocks):
            for key, fn in (("flat", flat_fn), ("per", per_fn)):
                samples = []
                for _ in range(args.calls):
                    flat_grad.set_value(gradient, borrow=True)  # numpy, as the all-reduce leaves it
                    t0 = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t0)
                times[key].append(statistics.median(samples) * 1e6)
        flat_us, per_us = statistics.median(times["flat"]), statistics.median(times["per"])
        outputs = f"{len(flat_fn.maker.fgraph.outputs)} / {len(per_fn.maker.fgraph.outputs)}"
        print(f"{name:<10} {outputs:>26} {flat_us:>12.1f} {per_us:>14.1f} {per_us / flat_us:>6.2f}x")


if __name__ == "__main__":
    main()
