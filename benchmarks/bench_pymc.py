"""A PyMC logistic regression sampled with NUTS: Synkhronos (the likelihood split over ranks) against
PyMC's default sampler, side by side in one run, each sampler in a fresh interpreter.

The model: ``rows`` rows of ``features`` standard-normal features, 0/1 outcomes, an intercept with
a Normal(0, 2) prior and coefficients with Normal(0, 1) priors.  Samplers (``--samplers``):

``synk``
    ``synkhronos.pymc.data_parallel(model)`` over ``--ranks`` CPU ranks, PyMC's NUTS, the chains
    one after another (every evaluation on every rank).
``pymc``
    ``pm.sample`` as a user runs it: PyMC's NUTS, its default compile mode, its default chain
    processes (``cores=min(4, cpu_count)``).
``nutpie``, ``numpyro``
    ``pm.sample(nuts_sampler=...)`` on the CPU, when the package is importable (else the row says
    "not installed").

Each row: wall seconds of ``pm.sample`` (compilation included) and of the sampling alone where
the sampler reports it, the smallest bulk effective sample size over the parameters, and ESS per
wall second.  A markdown table goes to stdout; ``--json PATH`` writes the rows too.

Usage (repository root, the packages and PyMC importable)::

    python benchmarks/bench_pymc.py --rows 20000 --draws 200 --tune 200 --chains 1 --ranks 2
    python benchmarks/bench_pymc.py --rows 1000000 --draws 1000 --tune 1000 --chains 4 --ranks 16 \\
        --samplers synk,pymc,nutpie,numpyro
    python benchmarks/bench_pymc.py --evals --rows 100000 --ranks 2     # microseconds per evaluation
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def make_data(rows: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features))
    beta = rng.normal(size=features) * 0.5
    p = 1 / (1 + np.exp(-(x @ beta - 0.5)))
    return x, (rng.random(rows) < p).astype("int64")


def run_one(sampler: str, args: argparse.Namespace) -> dict[str, Any]:
    """Sample with one sampler in this process; returns its row."""
    import arviz as az
    import pymc as pm

    x, y = make_data(args.rows, args.features)
    with pm.Model() as model:
        intercept = pm.Normal("intercept", 0, 2)
        beta = pm.Normal("beta", 0, 1, shape=args.features)
        pm.Bernoulli("y", logit_p=intercept + x @ beta, observed=y)
    kwargs: dict[str, Any] = dict(draws=args.draws, tune=args.tune, chains=args.chains, random_seed=1,
                                  progressbar=False, compute_convergence_checks=False, model=model)
    row: dict[str, Any] = {"sampler": sampler}
    if sampler == "synk":
        import synkhronos as synk
        from synkhronos.pymc import data_parallel

        synk.fork(args.ranks, use_gpu=False)
        start = time.perf_counter()
        with data_parallel(model):
            idata = pm.sample(**kwargs)
        wall = time.perf_counter() - start
        synk.close()
        row["sampler"] = f"synk, {args.ranks} ranks, chains in turn"
    else:
        if sampler != "pymc":
            try:
                __import__(sampler)
            except ImportError:
                return {"sampler": sampler, "skipped": "not installed"}
            kwargs["nuts_sampler"] = sampler
        start = time.perf_counter()
        idata = pm.sample(**kwargs)
        wall = time.perf_counter() - start
        if sampler == "pymc":
            procs = min(4, os.cpu_count() or 1, args.chains)
            row["sampler"] = f"pymc default ({procs} chain process{'es' if procs > 1 else ''})"
    sampling = idata.sample_stats.attrs.get("sampling_time")
    ess = az.ess(idata, method="bulk")
    min_ess = float(min(float(ess[v].min()) for v in ("intercept", "beta")))
    row.update(wall_s=wall, sampling_s=None if sampling is None else float(sampling), min_ess=min_ess,
               ess_per_s=min_ess / wall)
    return row


def per_evaluation(args: argparse.Namespace) -> None:
    """Microseconds per evaluation of the log-probability and its gradient (``logp_dlogp_function``,
    what NUTS calls): PyMC's own function, the split one at ``rows`` rows, and the split one at one
    row per rank (the call path: master to ranks and back, with almost no rows to compute)."""
    import pymc as pm

    import synkhronos as synk
    from synkhronos.pymc import data_parallel

    def model_of(rows: int) -> Any:
        x, y = make_data(rows, args.features)
        with pm.Model() as model:
            intercept = pm.Normal("intercept", 0, 2)
            beta = pm.Normal("beta", 0, 1, shape=args.features)
            pm.Bernoulli("y", logit_p=intercept + x @ beta, observed=y)
        return model

    def timed(fn: Any, q: np.ndarray, calls: int) -> float:
        fn(q)
        start = time.perf_counter()
        for _ in range(calls):
            fn(q)
        return (time.perf_counter() - start) / calls * 1e6

    q = np.full(args.features + 1, 0.01)
    model = model_of(args.rows)
    plain = timed(model.logp_dlogp_function(ravel_inputs=True), q, args.calls)
    synk.fork(args.ranks, use_gpu=False)
    with data_parallel(model):
        split = timed(model.logp_dlogp_function(ravel_inputs=True), q, args.calls)
    tiny = model_of(args.ranks)
    with data_parallel(tiny):
        floor = timed(tiny.logp_dlogp_function(ravel_inputs=True), q, args.calls)
    synk.close()
    print(f"logp and gradient, {args.rows} rows x {args.features} features; {platform.node()}, "
          f"{os.cpu_count()} CPUs\n")
    print("| evaluation | us per call |")
    print("|---|---|")
    print(f"| PyMC's own (default mode), one process | {plain:.0f} |")
    print(f"| synk, {args.ranks} ranks | {split:.0f} |")
    print(f"| synk, {args.ranks} ranks, one row per rank (the call path) | {floor:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description="PyMC logistic regression: synk against PyMC's samplers")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--tune", type=int, default=200)
    parser.add_argument("--chains", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samplers", default="synk,pymc,nutpie,numpyro")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--evals", action="store_true",
                        help="instead: microseconds per logp-and-gradient evaluation (plain, split, call path)")
    parser.add_argument("--calls", type=int, default=300, help="evaluations timed with --evals")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run this sampler
    args = parser.parse_args()
    if args.evals:
        per_evaluation(args)
        return
    if args.one:
        print("ROW " + json.dumps(run_one(args.one, args)), flush=True)
        return
    rows = []
    for sampler in args.samplers.split(","):
        child = [sys.executable, os.path.abspath(__file__), "--one", sampler, "--rows", str(args.rows),
                 "--features", str(args.features), "--draws", str(args.draws), "--tune", str(args.tune),
                 "--chains", str(args.chains), "--ranks", str(args.ranks)]
        done = subprocess.run(child, capture_output=True, text=True)
        found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if done.returncode or not found:
            rows.append({"sampler": sampler, "skipped": f"failed: {done.stderr.strip().splitlines()[-1:]}"})
        else:
            rows.append(json.loads(found[0]))
    print(f"PyMC logistic regression, {args.rows} rows x {args.features} features, {args.chains} chain(s) x "
          f"{args.draws} draws + {args.tune} tune; {platform.node()}, {os.cpu_count()} CPUs\n")
    print("| sampler | wall s | sampling s | min bulk ESS | ESS/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['sampler']} | {r['skipped']} | | | |")
            continue
        sampling = "" if r["sampling_s"] is None else f"{r['sampling_s']:.1f}"
        print(f"| {r['sampler']} | {r['wall_s']:.1f} | {sampling} | {r['min_ess']:.0f} | {r['ess_per_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
