"""Where one rank's time goes in the PyMC likelihood (diagnosis, not a benchmark of record:
``bench_pymc.py --evals`` is that).

One rank's share of ``bench_pymc.py``'s logistic regression (``--rows`` rows of 20 float64
features), its value and gradient at ``--chains`` points in one call, on one core (XLA's CPU
backend single-threaded), three ways:

``synk``                 the batched call of :mod:`synkhronos.pymc` on one CPU rank: PyMC's
                         Bernoulli graph vectorised over the chains, compiled by PyTensor to JAX
``JAX, rows``            the same likelihood written by hand in JAX, ``y * eta - log1p(exp(eta))``,
                         the rows as stored (rows x features)
``JAX, features-major``  the same with the rows stored transposed (features x rows) and the
                         products chains-major (``B @ XT``)

and, with ``check_bounds=False``, synk's call without PyMC's parameter checks.  Each is timed as
the best of 8 interleaved rounds of 30 calls; the values and gradients are checked against each
other (1e-9 relative).  Then the pieces, in plain JAX on the same shapes: each product in the
orientation PyTensor's graph computes it (chains-major) and in the hand-written one, and the
elementwise part as PyMC's graph lowers (two softplus in PyTensor's JAX form, a sigmoid, switches
on the observation) against the hand-written one.

Usage: ``taskset -c 1 python tools/probe_pymc_rank.py [--rows 62500] [--chains 4]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


def hand_written(chains_major: bool) -> Callable[..., Any]:
    """The logistic likelihood's per-chain values and gradients by (intercept, beta), in JAX."""
    import jax
    import jax.numpy as jnp

    def values(a: Any, b: Any, x: Any, y: Any) -> Any:
        if chains_major:  # x: features x rows; eta: chains x rows
            eta = a[:, None] + b @ x
            return jnp.sum(y[None, :] * eta - jnp.log1p(jnp.exp(eta)), axis=1)
        eta = a[None, :] + x @ b.T  # x: rows x features; eta: rows x chains
        return jnp.sum(y[:, None] * eta - jnp.log1p(jnp.exp(eta)), axis=0)

    def value_and_grad(a: Any, b: Any, x: Any, y: Any) -> Any:
        def total(a: Any, b: Any) -> Any:
            v = values(a, b, x, y)
            return v.sum(), v

        (ga, gb), v = jax.grad(total, argnums=(0, 1), has_aux=True)(a, b)
        return v, ga, gb

    return jax.jit(value_and_grad)


def interleaved_best(cases: dict[str, Callable[[], Any]], rounds: int, calls: int = 30) -> dict[str, float]:
    """Milliseconds per call of each case: the best of ``rounds`` rounds, each timing ``calls``
    calls of every case in turn (waiting for JAX's last result before the clock stops)."""
    import jax

    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn()
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e3)
    return best


def pieces(rows: int, k: int) -> dict[str, float]:
    """Milliseconds of each piece of the evaluation in plain JAX (best of 10 interleaved rounds)."""
    import jax
    import jax.numpy as jnp

    def pytensor_softplus(x: Any) -> Any:  # PyTensor's JAX form of Softplus: every branch is computed
        return jnp.where(x < -37.0, jnp.exp(x), jnp.where(x < 18.0, jnp.log1p(jnp.exp(x)),
                                                           jnp.where(x < 33.3, x + jnp.exp(-x), x)))

    def pymc_like(e: Any, y: Any) -> Any:
        c = y[None] > 0
        s = jax.nn.sigmoid(e)
        return jnp.where(c, -pytensor_softplus(-e), -pytensor_softplus(e)).sum(1), jnp.where(c, 1 - s, -s)

    def hand(e: Any, y: Any) -> Any:
        z = jnp.exp(e)
        return (y[None] * e - jnp.log1p(z)).sum(1), y[None] - z / (1 + z)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, 20)))
    b = jnp.asarray(rng.standard_normal((k, 20)) * 0.1)
    e = jnp.asarray(rng.standard_normal((k, rows)))
    g_rows = jnp.asarray(rng.standard_normal((rows, k)))
    y = jnp.asarray((rng.random(rows) < 0.5).astype(float))
    cases: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "forward product, chains-major (B @ X.T)": (jax.jit(lambda b, x: b @ x.T), (b, x)),
        "forward product, rows-major (X @ B.T)": (jax.jit(lambda b, x: x @ b.T), (b, x)),
        "gradient product, chains-major (G @ X)": (jax.jit(lambda g, x: g @ x), (e, x)),
        "gradient product, rows-major (G.T @ X)": (jax.jit(lambda g, x: g.T @ x), (g_rows, x)),
        "elementwise, as PyMC's graph lowers": (jax.jit(pymc_like), (e, y)),
        "elementwise, hand-written": (jax.jit(hand), (e, y)),
    }
    for fn, fn_args in cases.values():
        jax.block_until_ready(fn(*fn_args))
    return interleaved_best({name: lambda fn=fn, a=fn_args: fn(*a) for name, (fn, fn_args) in cases.items()}, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=62_500, help="one rank's rows (1,000,000 over 16 ranks)")
    parser.add_argument("--chains", type=int, default=4)
    args = parser.parse_args()
    import bench_pymc
    import jax

    import synkhronos as synk
    import synkhronos.pymc as synk_pymc
    from synkhronos.pymc.split import _SPLITS, _Split

    jax.config.update("jax_enable_x64", True)
    k = args.chains
    synk.fork(1, use_gpu=False)
    try:
        model = bench_pymc.make_model(args.rows, 20)
        x, y = bench_pymc.make_data(args.rows, 20)
        rng = np.random.default_rng(1)
        a, b = rng.normal(size=k) * 0.1, rng.normal(size=(k, 20)) * 0.1
        with synk_pymc.data_parallel(model):
            model.logp_dlogp_function(ravel_inputs=True)(np.zeros(21))  # the split exists once a function is built
            split = next(iter(_SPLITS.values()))
            split_rvs = [model[name] for name in split.names]
            order = [p.name for p in split.params]
            points = {s: [a[s] if name == "intercept" else b[s] for name in order] for s in range(k)}
            rows_fn, major_fn = hand_written(False), hand_written(True)
            model.check_bounds = False
            unchecked = _Split(model, split_rvs, model.logp(vars=split_rvs, jacobian=True, sum=False))
            unchecked.evaluate_many(points, k, True)
            xr, xt, yj = jax.device_put(x), jax.device_put(np.ascontiguousarray(x.T)), jax.device_put(y.astype(float))
            variants: dict[str, Callable[[], Any]] = {
                "synk": lambda: split.evaluate_many(points, k, True),
                "synk, check_bounds=False": lambda: unchecked.evaluate_many(points, k, True),
                "JAX, rows": lambda: jax.block_until_ready(rows_fn(a, b, xr, yj)),
                "JAX, features-major": lambda: jax.block_until_ready(major_fn(a, b, xt, yj)),
            }
            results = {name: fn() for name, fn in variants.items()}
            best = interleaved_best(variants, 8)
    finally:
        synk.close()
    got = results["synk"]
    value = np.array([got[s][0] for s in range(k)])
    grads = {name: np.array([got[s][1 + i] for s in range(k)]) for i, name in enumerate(order)}
    for name in ("JAX, rows", "JAX, features-major"):
        v, ga, gb = (np.asarray(r) for r in results[name])
        np.testing.assert_allclose(v, value, rtol=1e-9, err_msg=name)
        np.testing.assert_allclose(ga, grads["intercept"].reshape(ga.shape), rtol=1e-9, err_msg=name)
        np.testing.assert_allclose(gb, grads["beta"], rtol=1e-9, err_msg=name)
    print(f"\none rank: {args.rows} rows x 20 features, float64, {k} chains' value and gradient, one core")
    print("| evaluation | ms per call |\n|---|---:|")
    for name, ms in {**best, **pieces(args.rows, k)}.items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
