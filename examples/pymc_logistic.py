"""A PyMC logistic regression sampled with its likelihood split over every core.

The model is ordinary PyMC.  Inside ``synkhronos.pymc.data_parallel(model)``, PyMC's NUTS
evaluates the likelihood of the observed rows and its gradient on every rank (each rank its own
rows, scattered once), and the priors once; the chains run at once in PyMC's chain processes, and
each round of their evaluations is one call into the ranks; the result is PyMC's
``InferenceData``.

    python examples/pymc_logistic.py --rows 200000 --ranks 2 --draws 500 --tune 500

Needs ``pip install "synk-theano[pymc]"`` (PyMC 6: Python >= 3.12).
"""

from __future__ import annotations

import argparse
import time

import arviz as az
import numpy as np
import pymc as pm

import synkhronos as synk
from synkhronos.pymc import data_parallel


def make_data(rows: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features, 0/1 outcomes and the coefficients that made them (the intercept is -0.5)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features))
    beta = rng.normal(size=features) * 0.5
    p = 1 / (1 + np.exp(-(x @ beta - 0.5)))
    return x, (rng.random(rows) < p).astype("int64"), beta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--tune", type=int, default=300)
    parser.add_argument("--chains", type=int, default=2)
    args = parser.parse_args()

    x, y, beta_true = make_data(args.rows, args.features)
    with pm.Model() as model:
        intercept = pm.Normal("intercept", 0, 2)
        beta = pm.Normal("beta", 0, 1, shape=args.features)
        pm.Bernoulli("y", logit_p=intercept + x @ beta, observed=y)

    synk.fork(args.ranks, use_gpu=False)
    start = time.perf_counter()
    with data_parallel(model):
        # cores=chains: every chain at once, their evaluations batched (cores=1: one after another)
        idata = pm.sample(draws=args.draws, tune=args.tune, chains=args.chains, cores=args.chains, random_seed=1,
                          progressbar=False, model=model)
    seconds = time.perf_counter() - start
    synk.close()

    post = idata.posterior
    error = np.abs(post["beta"].mean(("chain", "draw")).values - beta_true).max()
    ess = az.ess(idata, method="bulk")
    min_ess = min(float(ess[v].min()) for v in ("intercept", "beta"))
    print(f"{args.rows} rows, {args.ranks} ranks, {args.chains} chains x {args.draws} draws: {seconds:.1f} s, "
          f"smallest bulk ESS {min_ess:.0f}")
    print(f"intercept {float(post['intercept'].mean()):.3f} (true -0.500); largest |beta - true| {error:.3f}")


if __name__ == "__main__":
    main()
