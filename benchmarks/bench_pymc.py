"""A PyMC logistic regression sampled with NUTS: Synkhronos (the likelihood split over ranks, the
chains' evaluations batched) against PyMC's default sampler and the JAX/Rust samplers, side by side
in one run, each sampler in a fresh interpreter with a time limit of its own.

The model: ``rows`` rows of ``features`` standard-normal features, 0/1 outcomes, an intercept with
a Normal(0, 2) prior and coefficients with Normal(0, 1) priors.  Samplers (``--samplers``, in
that order):

``synk``
    ``synkhronos.pymc.data_parallel(model)`` over ``--ranks`` CPU ranks, PyMC's NUTS; the chains run
    at once in PyMC's chain processes, each round of their evaluations in one call into the ranks
    (``cores=chains``).
``synk-seq``
    The same with ``cores=1``: the chains one after another, every evaluation on every rank.
``pymc``
    ``pm.sample`` as a user runs it: PyMC's NUTS, its default compile mode, its default chain
    processes (``cores=min(4, cpu_count)``).
``numpyro``, ``nutpie``
    ``pm.sample(nuts_sampler=...)`` on the CPU (numpyro: one XLA host device per chain, its chains
    in parallel), when the package is importable (else the row says "not installed").
``numpyro-vec``
    ``pm.sample(nuts_sampler="numpyro", nuts_sampler_kwargs={"chain_method": "vectorized"})``: the
    chains vectorised on one device.

With ``--gpu`` the run is on one GPU: ``synk`` forks ``--ranks`` ranks (default 1) in GPU mode (the
JAX engine, each rank on a GPU of its own), ``numpyro`` and ``numpyro-vec`` run on the GPU (numpyro's
default chain method, ``"parallel"``, finds one device and draws the chains one after another);
``pymc`` and ``nutpie`` stay on the CPU cores (a reference).

A sampler stopped by ``--timeout`` gets a row of what it reached: for ``synk`` and ``pymc`` (PyMC's
NUTS, which calls a per-draw callback) the draws it finished (all chains, tuning included) and the
seconds it had sampled; for the others the seconds alone.  Its wall time is at least the seconds it
ran (a lower bound, not an estimate).  ``--report`` puts the rows of several runs (``--json`` files,
e.g. one sampler per device call) in one table and compares each with the first ``synk`` row: the
ratio of wall times (a lower bound where the other sampler was stopped), and, where both report their
draws, the ratio of the seconds each took to reach the same number of draws.

Each row is printed as soon as its sampler finishes: wall seconds of ``pm.sample`` (compilation
included; for synk, ``synk.fork`` is the setup column), seconds of the sampling alone where the
sampler reports them, the smallest bulk effective sample size over the parameters (arviz), and ESS
per wall second.  ``--json PATH`` writes the rows too.

Usage (repository root, the packages and PyMC importable)::

    python benchmarks/bench_pymc.py --rows 100000 --draws 100 --tune 100 --chains 1 --ranks 2 --samplers synk,pymc
    python benchmarks/bench_pymc.py --rows 1000000 --draws 200 --tune 200 --chains 4 --ranks 16 \\
        --samplers synk,pymc,numpyro,nutpie --timeout 200
    python benchmarks/bench_pymc.py --evals --rows 100000 --ranks 2     # milliseconds per evaluation
    python benchmarks/bench_pymc.py --gpu --rows 1000000 --draws 1000 --tune 1000 --chains 4 \\
        --samplers synk,numpyro-vec,numpyro --timeout 240                 # one GPU
    python benchmarks/bench_pymc.py --report synk.json pymc.json numpyro.json   # rows of several runs
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


class Progress:
    """``pm.sample``'s per-draw callback (PyMC's NUTS): prints ``PROGRESS draws grad_evals seconds``
    (every chain's draws and gradient evaluations so far, tuning included; seconds since
    ``pm.sample`` began) about every hundredth of the draws, for the parent to read where the
    sampler is stopped; :attr:`marks` holds the same for this process's row."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.every = max(1, total // 100)
        self.draws = 0
        self.evals = 0.0
        self.start = time.monotonic()
        self.marks: list[tuple[int, float, float]] = []
        print(f"START {self.start!r}", flush=True)

    def __call__(self, trace: Any = None, draw: Any = None) -> None:
        self.draws += 1
        stats = getattr(draw, "stats", None) or []
        self.evals += sum(float(s.get("tree_size", 0)) for s in stats if isinstance(s, dict))
        if self.draws % self.every == 0 or self.draws == self.total:
            mark = (self.draws, self.evals, time.monotonic() - self.start)
            self.marks.append(mark)
            print(f"PROGRESS {mark[0]} {mark[1]:.0f} {mark[2]:.3f}", flush=True)


def label(sampler: str, args: argparse.Namespace) -> str:
    """A sampler's name in the table."""
    if sampler in ("synk", "synk-seq"):
        chains = ("one chain" if args.chains == 1 else f"{args.chains} chains batched" if sampler == "synk"
                  else "chains in turn")
        ranks = f"{args.ranks} GPU{'s' if args.ranks > 1 else ''}" if args.gpu else f"{args.ranks} ranks"
        return f"synk, {ranks}, {chains}"
    if sampler == "pymc":
        procs = min(4, os.cpu_count() or 1, args.chains)
        return f"pymc default ({procs} chain process{'es' if procs > 1 else ''}, CPU)"
    if sampler == "numpyro-vec":
        return f"numpyro ({'GPU' if args.gpu else 'CPU'}, chains vectorized)"
    if sampler == "numpyro" and args.gpu:
        return "numpyro (GPU, default chain method: one device, chains in turn)"
    return f"{sampler} (CPU)"


def run_one(sampler: str, args: argparse.Namespace) -> dict[str, Any]:
    """Sample with one sampler in this process; returns its row."""
    import arviz as az
    import pymc as pm

    model = make_model(args.rows, args.features)
    kwargs: dict[str, Any] = dict(draws=args.draws, tune=args.tune, chains=args.chains, random_seed=1,
                                  progressbar=False, compute_convergence_checks=False, model=model)
    row: dict[str, Any] = {"sampler": label(sampler, args)}
    setup = None
    progress = None
    if sampler in ("synk", "synk-seq"):
        import logging

        import synkhronos as synk
        from synkhronos.pymc import data_parallel

        chains_log = logging.getLogger("synkhronos.pymc.chains")  # its summary: calls, points, ms
        chains_log.setLevel(logging.INFO)
        chains_log.addHandler(logging.StreamHandler(sys.stderr))
        start = time.perf_counter()
        synk.fork(args.ranks, use_gpu=args.gpu)
        setup = time.perf_counter() - start
        kwargs["cores"] = args.chains if sampler == "synk" else 1
        progress = kwargs["callback"] = Progress(args.chains * (args.draws + args.tune))
        start = time.perf_counter()
        with data_parallel(model):
            idata = pm.sample(**kwargs)
        wall = time.perf_counter() - start
        synk.close()
    else:
        name = "numpyro" if sampler == "numpyro-vec" else sampler
        if name != "pymc":
            try:
                __import__(name)
            except ImportError:
                return {"sampler": label(sampler, args), "key": sampler, "skipped": "not installed"}
        kwargs["nuts_sampler"] = name
        if sampler == "numpyro-vec":
            kwargs["nuts_sampler_kwargs"] = {"chain_method": "vectorized"}
        if name == "pymc":
            progress = kwargs["callback"] = Progress(args.chains * (args.draws + args.tune))
        else:
            print(f"START {time.monotonic()!r}", flush=True)
        start = time.perf_counter()
        idata = pm.sample(**kwargs)
        wall = time.perf_counter() - start
    sampling = idata.sample_stats.attrs.get("sampling_time")
    ess = az.ess(idata, method="bulk")
    min_ess = float(min(float(ess[v].min()) for v in ("intercept", "beta")))
    row.update(wall_s=wall, setup_s=setup, sampling_s=None if sampling is None else float(sampling),
               min_ess=min_ess, ess_per_s=min_ess / wall, key=sampler,
               draws=args.chains * (args.draws + args.tune))
    if progress is not None:
        row["progress"] = progress.marks
    return row


def per_evaluation(args: argparse.Namespace) -> None:
    """Milliseconds per evaluation of the log-probability and its gradient (``logp_dlogp_function``,
    what NUTS calls): PyMC's own function, the split one at ``rows`` rows, the split one for
    ``--batch`` chains' points in one call into the ranks (the call alone, as the master makes it
    for ``pm.sample``'s chain processes inside the block; per call and per chain's evaluation), and the
    split one at one row per rank (the call path: master to ranks and back, with almost no rows).
    With ``--gpu`` the ranks are GPUs, and PyMC's function compiled for PyTensor's JAX backend on
    the GPU (one process, what numpyro evaluates) is timed last."""
    import synkhronos as synk
    from synkhronos.pymc import data_parallel

    def timed(fn: Any, q: np.ndarray, calls: int) -> float:
        fn(q)
        start = time.perf_counter()
        for _ in range(calls):
            fn(q)
        return (time.perf_counter() - start) / calls * 1e3

    def timed_batched(model: Any, q: np.ndarray, calls: int, k: int) -> float:
        from synkhronos.pymc.split import _SPLITS

        model.logp_dlogp_function(ravel_inputs=True)(q)  # the split exists once a function is built
        split = next(iter(_SPLITS.values()))
        initial = model.initial_point()
        point = [np.full(np.shape(initial[p.name]), 0.01) for p in split.params]
        points = {s: [p + 0.01 * s for p in point] for s in range(k)}
        split.evaluate_many(points, k, True)  # compiles the batched call
        start = time.perf_counter()
        for _ in range(calls):
            split.evaluate_many(points, k, True)
        return (time.perf_counter() - start) / calls * 1e3

    ranks = f"{args.ranks} GPU{'s' if args.ranks > 1 else ''}" if args.gpu else f"{args.ranks} ranks"
    print(f"logp and gradient, {args.rows} rows x {args.features} features, float64; {platform.node()}, "
          f"{os.cpu_count()} CPUs; {args.calls} calls each\n", flush=True)
    print("| evaluation | ms per call |", flush=True)
    print("|---|---|", flush=True)
    q = np.full(args.features + 1, 0.01)
    model = make_model(args.rows, args.features)
    plain = timed(model.logp_dlogp_function(ravel_inputs=True), q, args.calls)
    print(f"| PyMC's own (default mode), one process | {plain:.2f} |", flush=True)
    synk.fork(args.ranks, use_gpu=args.gpu)
    with data_parallel(model):
        split = timed(model.logp_dlogp_function(ravel_inputs=True), q, args.calls)
        print(f"| synk, {ranks} | {split:.2f} |", flush=True)
        if args.batch > 1:
            batched = timed_batched(model, q, args.calls, args.batch)
            print(f"| synk, {ranks}, {args.batch} chains in one call (per call) | {batched:.2f} |", flush=True)
            print(f"| the same, per chain's evaluation | {batched / args.batch:.2f} |", flush=True)
    tiny = make_model(args.ranks, args.features)
    with data_parallel(tiny):
        floor = timed(tiny.logp_dlogp_function(ravel_inputs=True), q, args.calls)
    print(f"| synk, {ranks}, one row per rank (the call path) | {floor:.2f} |", flush=True)
    synk.close()
    if args.gpu:
        what = "PyMC's own in PyTensor's JAX mode, one process on the GPU"
        try:
            on_gpu = f"{timed(model.logp_dlogp_function(ravel_inputs=True, mode='JAX'), q, args.calls):.2f}"
        except Exception as exc:  # the rows above stand
            on_gpu = f"failed: {exc!r}"[:200]
        print(f"| {what} | {on_gpu} |", flush=True)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def print_row(r: dict[str, Any]) -> None:
    if "stopped_s" in r:
        reached = f", {r['reached']} of {r['draws']} draws" if r.get("reached") is not None else ""
        print(f"| {r['sampler']} | over {r['stopped_s']:.0f} (stopped{reached}) | | | | |", flush=True)
        return
    if "skipped" in r:
        print(f"| {r['sampler']} | {r['skipped']} | | | | |", flush=True)
        return
    print(f"| {r['sampler']} | {r['wall_s']:.1f} | {_fmt(r.get('setup_s'))} | {_fmt(r['sampling_s'])} | "
          f"{r['min_ess']:.0f} | {r['ess_per_s']:.2f} |", flush=True)


def _seconds_to(marks: list[Any], draws: int) -> float | None:
    """Seconds a sampler took to finish ``draws`` draws, from its progress marks: the first mark at or
    past ``draws`` (for the faster sampler's side, an upper bound)."""
    for d, _, t in marks:
        if d >= draws:
            return float(t)
    return None


def report(paths: list[str]) -> None:
    """The rows of several runs' ``--json`` files in one table, each compared with the first
    ``synk`` row (wall time and, where both have progress marks, the time to the same draws)."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)
    base = next((r for r in rows if r.get("key", r["sampler"]).startswith("synk") and "wall_s" in r), None)
    print("| sampler | wall s | min bulk ESS | ESS/s | synk faster by (wall) | at equal draws |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r and "stopped_s" not in r:
            print(f"| {r['sampler']} | {r['skipped']} | | | | |")
            continue
        stopped = "stopped_s" in r
        reached = f", {r['reached']} of {r['draws']} draws" if r.get("reached") is not None else ""
        wall = f"over {r['stopped_s']:.0f} (stopped{reached})" if stopped else f"{r['wall_s']:.1f}"
        ess = "" if stopped else f"{r['min_ess']:.0f} | {r['ess_per_s']:.2f}"
        ratio = equal = ""
        if base is not None and r is not base:
            own = r["stopped_s"] if stopped else r["wall_s"]
            ratio = f"{'at least ' if stopped else ''}{own / base['wall_s']:.2f}x"
            marks = r.get("progress") or []
            if marks and base.get("progress"):
                d, _, t = marks[-1]
                t_base = _seconds_to(base["progress"], d)
                if t_base:
                    equal = f"{t / t_base:.2f}x (first {d} draws: {t:.0f} s against {t_base:.0f} s)"
        print(f"| {r['sampler']} | {wall} | {ess or ' | '} | {ratio} | {equal} |")
    if base is not None:
        print(f"\nbase: {base['sampler']}, {base['wall_s']:.1f} s for {base.get('draws', '?')} draws (all chains, "
              "tuning included).  Wall ratios of stopped samplers are lower bounds (they ran at least that long); "
              "'at equal draws' compares the seconds since pm.sample began at which each finished the stopped "
              "sampler's last reported number of draws (synk's side read at its first mark past it).")


def _progress_of(out: str) -> tuple[float | None, list[list[float]]]:
    """The child's ``START`` time and its ``PROGRESS`` marks, from its output."""
    start = None
    marks: list[list[float]] = []
    for line in out.splitlines():
        if line.startswith("START "):
            start = float(line.split()[1])
        elif line.startswith("PROGRESS "):
            d, e, t = line.split()[1:]
            marks.append([int(d), float(e), float(t)])
    return start, marks


def main() -> None:
    parser = argparse.ArgumentParser(description="PyMC logistic regression: synk against PyMC's samplers")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--tune", type=int, default=200)
    parser.add_argument("--chains", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=None, help="synk's ranks (default 2; with --gpu 1)")
    parser.add_argument("--gpu", action="store_true", help="synk in GPU mode, numpyro on the GPU")
    parser.add_argument("--samplers", default="synk,pymc,numpyro,nutpie")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each sampler may take (its row says "
                        "how far it got past them)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all the samplers: each is stopped "
                        "in time for the run to end within them")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--report", nargs="+", default=None, metavar="JSON",
                        help="instead: the rows of these --json files in one table, compared with synk's")
    parser.add_argument("--evals", action="store_true",
                        help="instead: milliseconds per logp-and-gradient evaluation (plain, split, batched, "
                        "call path)")
    parser.add_argument("--calls", type=int, default=100, help="evaluations timed with --evals")
    parser.add_argument("--batch", type=int, default=4, help="chains in one call with --evals")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run this sampler
    args = parser.parse_args()
    if args.ranks is None:
        args.ranks = 1 if args.gpu else 2
    if args.report:
        report(args.report)
        return
    if args.evals:
        per_evaluation(args)
        return
    if args.one:
        print("ROW " + json.dumps(run_one(args.one, args)), flush=True)
        return
    from machine import cpu_model

    where = "one GPU and " if args.gpu else ""
    print(f"PyMC logistic regression, {args.rows} rows x {args.features} features, {args.chains} chain(s) x "
          f"({args.draws} draws + {args.tune} tune); {platform.node()}, {where}{os.cpu_count()} CPUs "
          f"({cpu_model()}); each sampler {args.timeout:.0f} s at most\n", flush=True)
    print("| sampler | wall s | setup s | sampling s | min bulk ESS | ESS/s |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    rows: list[dict[str, Any]] = []
    begun = time.monotonic()

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        print_row(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    for sampler in args.samplers.split(","):
        timeout = args.timeout
        if args.budget is not None:  # 15 s kept for ending a stopped sampler
            left = args.budget - (time.monotonic() - begun) - 15
            if left < 20:
                add({"sampler": label(sampler, args), "key": sampler, "skipped": "not run: --budget spent"})
                continue
            timeout = min(timeout, left)
        child = [sys.executable, os.path.abspath(__file__), "--one", sampler, "--rows", str(args.rows),
                 "--features", str(args.features), "--draws", str(args.draws), "--tune", str(args.tune),
                 "--chains", str(args.chains), "--ranks", str(args.ranks), *(["--gpu"] if args.gpu else [])]
        env = dict(os.environ)
        on_gpu = args.gpu and sampler in ("synk", "synk-seq", "numpyro", "numpyro-vec")
        if not on_gpu:  # the CPU samplers (and CPU mode's ranks) never touch a GPU
            env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
        flags = env.get("XLA_FLAGS", "")
        if sampler == "numpyro" and not on_gpu and "xla_force_host_platform_device_count" not in flags:
            flag = f"--xla_force_host_platform_device_count={args.chains}"
            env["XLA_FLAGS"] = f"{flags} {flag}".strip()
        # its own session: a stopped sampler is ended with every process it started
        proc = subprocess.Popen(child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stopped_at = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            start, marks = _progress_of(out)
            row: dict[str, Any] = {"sampler": label(sampler, args), "key": sampler, "skipped": "stopped",
                                   "draws": args.chains * (args.draws + args.tune)}
            if start is None:
                row["skipped"] = f"stopped after {timeout:.0f} s, before pm.sample began"
            else:
                # pm.sample had run this long when stopped: its wall time is at least this
                row["stopped_s"] = stopped_at - start
                row["reached"] = int(marks[-1][0]) if marks else None
                row["progress"] = marks
        else:
            found = [line[4:] for line in out.splitlines() if line.startswith("ROW ")]
            if proc.returncode or not found:
                row = {"sampler": label(sampler, args), "key": sampler,
                       "skipped": f"failed: {err.strip().splitlines()[-1:]}"}
            else:
                row = json.loads(found[0])
                for line in err.splitlines():  # synk's batched calls: how many, what they took
                    if "batched calls" in line:
                        print(f"  {sampler}: {line.strip()}", flush=True)
        add(row)
    if args.json and len(rows) > 1:
        print("", flush=True)
        report([args.json])


if __name__ == "__main__":
    main()
