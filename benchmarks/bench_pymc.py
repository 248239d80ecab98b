"""A PyMC logistic regression sampled with NUTS: Synkhronos (the likelihood split over ranks, the
chains' evaluations batched) against PyMC's default sampler and the JAX/Rust samplers, side by side
in one run, each sampler in a fresh interpreter with a time limit of its own.

The model: ``rows`` rows of ``features`` standard-normal features, 0/1 outcomes, an intercept with
a Normal(0, 2) prior and coefficients with Normal(0, 1) priors.  Samplers (``--samplers``, in
that order):

``synk``
    ``synkhronos.pymc.data_parallel(model)`` over ``--ranks`` CPU ranks, PyMC's NUTS; the chains run
    at once in the master, each evaluation of all of them in one call into the ranks
    (``cores=chains``).
``synk-seq``
    The same with ``cores=1``: the chains one after another, every evaluation on every rank.
``pymc``
    ``pm.sample`` as a user runs it: PyMC's NUTS, its default compile mode, its default chain
    processes (``cores=min(4, cpu_count)``).
``numpyro``, ``nutpie``
    ``pm.sample(nuts_sampler=...)`` on the CPU (numpyro: one XLA host device per chain, its chains
    in parallel), when the package is importable (else the row says "not installed").

Each row is printed as soon as its sampler finishes: wall seconds of ``pm.sample`` (compilation
included; for synk, ``synk.fork`` is the setup column), seconds of the sampling alone where the
sampler reports them, the smallest bulk effective sample size over the parameters (arviz), and ESS
per wall second.  ``--json PATH`` writes the rows too.

Usage (repository root, the packages and PyMC importable)::

    python benchmarks/bench_pymc.py --rows 100000 --draws 100 --tune 100 --chains 1 --ranks 2 --samplers synk,pymc
    python benchmarks/bench_pymc.py --rows 1000000 --draws 200 --tune 200 --chains 4 --ranks 16 \\
        --samplers synk,pymc,numpyro,nutpie --timeout 200
    python benchmarks/bench_pymc.py --evals --rows 100000 --ranks 2     # milliseconds per evaluation
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def make_data(rows: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features))
    beta = rng.normal(size=features) * 0.5
    p = 1 / (1 + np.exp(-(x @ beta - 0.5)))
    return x, (rng.random(rows) < p).astype("int64")


def make_model(rows: int, features: int) -> Any:
    import pymc as pm

    x, y = make_data(rows, features)
    with pm.Model() as model:
        intercept = pm.Normal("intercept", 0, 2)
        beta = pm.Normal("beta", 0, 1, shape=features)
        pm.Bernoulli("y", logit_p=intercept + x @ beta, observed=y)
    return model


def run_one(sampler: str, args: argparse.Namespace) -> dict[str, Any]:
    """Sample with one sampler in this process; returns its row."""
    import arviz as az
    import pymc as pm

    model = make_model(args.rows, args.features)
    kwargs: dict[str, Any] = dict(draws=args.draws, tune=args.tune, chains=args.chains, random_seed=1,
                                  progressbar=False, compute_convergence_checks=False, model=model)
    row: dict[str, Any] = {"sampler": sampler}
    setup = None
    if sampler in ("synk", "synk-seq"):
        import synkhronos as synk
        from synkhronos.pymc import data_parallel

        start = time.perf_counter()
        synk.fork(args.ranks, use_gpu=False)
        setup = time.perf_counter() - start
        kwargs["cores"] = args.chains if sampler == "synk" else 1
        start = time.perf_counter()
        with data_parallel(model):
            idata = pm.sample(**kwargs)
        wall = time.perf_counter() - start
        synk.close()
        chains = ("one chain" if args.chains == 1 else f"{args.chains} chains batched" if sampler == "synk"
                  else "chains in turn")
        row["sampler"] = f"synk, {args.ranks} ranks, {chains}"
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
        else:
            row["sampler"] = f"{sampler} (CPU)"
    sampling = idata.sample_stats.attrs.get("sampling_time")
    ess = az.ess(idata, method="bulk")
    min_ess = float(min(float(ess[v].min()) for v in ("intercept", "beta")))
    row.update(wall_s=wall, setup_s=setup, sampling_s=None if sampling is None else float(sampling),
               min_ess=min_ess, ess_per_s=min_ess / wall)
    return row


def per_evaluation(args: argparse.Namespace) -> None:
    """Milliseconds per evaluation of the log-probability and its gradient (``logp_dlogp_function``,
    what NUTS calls): PyMC's own function, the split one at ``rows`` rows, the split one for
    ``--batch`` chains at once (``--batch`` threads, one call into the ranks for all of them, as
    ``pm.sample`` runs its chains inside the block; per call and per chain's evaluation), and the
    split one at one row per rank (the call path: master to ranks and back, with almost no rows)."""
    import synkhronos as synk
    from synkhronos.pymc import _Batcher, data_parallel

    def timed(fn: Any, q: np.ndarray, calls: int) -> float:
        fn(q)
        start = time.perf_counter()
        for _ in range(calls):
            fn(q)
        return (time.perf_counter() - start) / calls * 1e3

    def timed_batched(model: Any, q: np.ndarray, calls: int, k: int) -> float:
        fns = [model.logp_dlogp_function(ravel_inputs=True) for _ in range(k)]
        points = [q + 0.01 * i for i in range(k)]
        _Batcher(k).run([lambda f=f, p=p: f(p) for f, p in zip(fns, points)])  # compiles the batched call
        start = time.perf_counter()
        _Batcher(k).run([lambda f=f, p=p: [f(p) for _ in range(calls)] for f, p in zip(fns, points)])
        return (time.perf_counter() - start) / calls * 1e3

    print(f"logp and gradient, {args.rows} rows x {args.features} features, float64; {platform.node()}, "
          f"{os.cpu_count()} CPUs; {args.calls} calls each\n", flush=True)
    print("| evaluation | ms per call |", flush=True)
    print("|---|---|", flush=True)
    q = np.full(args.features + 1, 0.01)
    model = make_model(args.rows, args.features)
    plain = timed(model.logp_dlogp_function(ravel_inputs=True), q, args.calls)
    print(f"| PyMC's own (default mode), one process | {plain:.2f} |", flush=True)
    synk.fork(args.ranks, use_gpu=False)
    with data_parallel(model):
        split = timed(model.logp_dlogp_function(ravel_inputs=True), q, args.calls)
        print(f"| synk, {args.ranks} ranks | {split:.2f} |", flush=True)
        if args.batch > 1:
            batched = timed_batched(model, q, args.calls, args.batch)
            print(f"| synk, {args.ranks} ranks, {args.batch} chains in one call (per call) | {batched:.2f} |",
                  flush=True)
            print(f"| the same, per chain's evaluation | {batched / args.batch:.2f} |", flush=True)
    tiny = make_model(args.ranks, args.features)
    with data_parallel(tiny):
        floor = timed(tiny.logp_dlogp_function(ravel_inputs=True), q, args.calls)
    print(f"| synk, {args.ranks} ranks, one row per rank (the call path) | {floor:.2f} |", flush=True)
    synk.close()


def print_row(r: dict[str, Any]) -> None:
    if "skipped" in r:
        print(f"| {r['sampler']} | {r['skipped']} | | | | |", flush=True)
        return
    sampling = "" if r["sampling_s"] is None else f"{r['sampling_s']:.1f}"
    setup = "" if r.get("setup_s") is None else f"{r['setup_s']:.1f}"
    print(f"| {r['sampler']} | {r['wall_s']:.1f} | {setup} | {sampling} | {r['min_ess']:.0f} | "
          f"{r['ess_per_s']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="PyMC logistic regression: synk against PyMC's samplers")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--tune", type=int, default=200)
    parser.add_argument("--chains", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samplers", default="synk,pymc,numpyro,nutpie")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each sampler may take (its row says "
                        "'timed out' past them)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--evals", action="store_true",
                        help="instead: milliseconds per logp-and-gradient evaluation (plain, split, batched, "
                        "call path)")
    parser.add_argument("--calls", type=int, default=100, help="evaluations timed with --evals")
    parser.add_argument("--batch", type=int, default=4, help="chains in one call with --evals")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run this sampler
    args = parser.parse_args()
    if args.evals:
        per_evaluation(args)
        return
    if args.one:
        print("ROW " + json.dumps(run_one(args.one, args)), flush=True)
        return
    from machine import cpu_model

    print(f"PyMC logistic regression, {args.rows} rows x {args.features} features, {args.chains} chain(s) x "
          f"({args.draws} draws + {args.tune} tune); {platform.node()}, {os.cpu_count()} CPUs ({cpu_model()})\n",
          flush=True)
    print("| sampler | wall s | setup s | sampling s | min bulk ESS | ESS/s |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    rows = []
    for sampler in args.samplers.split(","):
        child = [sys.executable, os.path.abspath(__file__), "--one", sampler, "--rows", str(args.rows),
                 "--features", str(args.features), "--draws", str(args.draws), "--tune", str(args.tune),
                 "--chains", str(args.chains), "--ranks", str(args.ranks)]
        env = dict(os.environ)
        if sampler == "numpyro" and "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
            flag = f"--xla_force_host_platform_device_count={args.chains}"
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
        # its own session: a timed-out sampler is ended with every process it started
        proc = subprocess.Popen(child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
            row: dict[str, Any] = {"sampler": sampler, "skipped": f"timed out after {args.timeout:.0f} s"}
        else:
            found = [line[4:] for line in out.splitlines() if line.startswith("ROW ")]
            if proc.returncode or not found:
                row = {"sampler": sampler, "skipped": f"failed: {err.strip().splitlines()[-1:]}"}
            else:
                row = json.loads(found[0])
        rows.append(row)
        print_row(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
