"""``synkhronos.pymc``: a PyMC model's likelihood evaluated data-parallel over the ranks.

:func:`data_parallel` is a context manager.  Inside it, every log-probability graph that PyMC
builds from the model (``model.logp``, and so ``compile_logp``, ``compile_dlogp``,
``logp_dlogp_function``, the functions of ``pm.sample``'s NUTS, ``pm.find_MAP`` and ``pm.fit``)
holds the observed variables' likelihood as one node whose value and gradient come from a
:func:`synkhronos.function`:

* the observed data and every array of the same number of rows that the likelihood reads
  (``pm.Data`` containers, numpy arrays in the graph, group indices) are scattered once into the
  ranks (:func:`synkhronos.data`);
* at each evaluation the parameters go whole to every rank, each rank sums the log-probability of
  its own rows and its gradient, the ranks' sums are added (output reduce op ``sum``);
* every other term (priors, Jacobians of transforms, potentials) is computed once, in the master,
  by PyMC's own compiled function.

The value is the same sum as PyMC's (to rounding: the rows are added in another order).

Example
-------
>>> import numpy as np, pymc as pm
>>> import synkhronos as synk, synkhronos.pymc as synk_pymc
>>> synk.fork(2, use_gpu=False)                                                # doctest: +SKIP
>>> with pm.Model() as model:                                                   # doctest: +SKIP
...     beta = pm.Normal("beta", 0, 1, shape=20)
...     pm.Bernoulli("y", logit_p=X @ beta, observed=y)
>>> with synk_pymc.data_parallel(model):                                        # doctest: +SKIP
...     idata = pm.sample(draws=1000, chains=4)

What is split and what is not
    A likelihood term is split when its log-probability is one value per row of its observed
    data (rows independent given the parameters).  Terms that are one value over all rows (a
    multivariate or time-series likelihood over the rows), terms whose row ``i`` reads other rows,
    and observed variables whose row-aligned data containers have another length are refused with
    a :class:`SplitError` naming the term.  Second derivatives (``compile_d2logp``) of a split
    term are refused too.  ``model.logp(sum=False)`` (per-row values) is not split.

Chains
    ``pm.sample(chains=k, cores=c)`` runs PyMC's own chain processes, ``min(c, k)`` at a time as
    PyMC runs them (``cores`` keeps its default, ``min(4, cpu_count)``), each chain's NUTS step in
    its process, on any of the group's cores.  The master gathers the running chains'
    evaluations and makes one call into the ranks for all of them: the likelihood vectorised over
    the chains' parameter points, the rows read once for all of them.  A chain's draws do not
    depend on which other chains' points went with its own (two runs from the same seed give the
    same draws), and equal its unbatched ones to rounding.  ``cores=1`` runs the chains one after
    another in this process, each evaluation on every rank.  ``mp_ctx`` is PyMC's (by default
    ``"fork"`` on Linux; with ``"spawn"`` or ``"forkserver"`` the script needs its
    ``if __name__ == "__main__":``, as outside the block).  Other NUTS implementations
    (``nuts_sampler="nutpie"``, ``"numpyro"``) compile the model their own way and are refused
    inside the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from synkhronos.errors import SplitError
from synkhronos.pymc.chains import _sample_in_chain_processes
from synkhronos.pymc.likelihood import _Hook
from synkhronos.pymc.split import _SPLITS

__all__ = ["SplitError", "data_parallel"]


@contextmanager
def data_parallel(model: Any) -> Iterator[Any]:
    """Evaluate ``model``'s likelihood data-parallel over the ranks inside the block.

    Parameters
    ----------
    model : pymc.Model
        A model whose observed variables' log-probability is a sum over rows of their data.

    Yields
    ------
    pymc.Model
        ``model`` itself.

    Raises
    ------
    RuntimeError
        Before :func:`synkhronos.fork`, or in a worker.
    SplitError
        When PyMC first builds the model's log-probability inside the block, for a likelihood term
        that is not a sum over rows of independent observations, or row data of different lengths;
        the message names the term.  Nothing has run in the ranks then.

    Notes
    -----
    Splitting happens the first time PyMC builds the model's ``logp`` inside the block (its row
    arrays are scattered then, once).  Functions compiled inside the block call the ranks and work
    only inside it, and in the chain processes of a ``pm.sample`` inside it.  ``pm.sample`` inside
    the block samples with PyMC's own NUTS (``nuts_sampler`` other than ``"pymc"`` is refused): with
    ``cores > 1`` and several chains in PyMC's chain processes, their evaluations batched in one
    call into the ranks; with ``cores=1`` one chain after another in this process.
    """
    import pymc

    from synkhronos.runtime import get_runtime

    rt = get_runtime()
    if not rt.is_master:
        raise RuntimeError("synkhronos.pymc.data_parallel() is for the master process")
    if "logp" in vars(model):
        raise RuntimeError("data_parallel blocks of one model cannot nest")
    from pymc.sampling import mcmc

    hook = _Hook(model)
    original_sample, original_mp_sample = pymc.sample, mcmc._mp_sample

    def sample(*args: Any, **kwargs: Any) -> Any:
        try:
            ours = pymc.modelcontext(kwargs.get("model")) is model
        except TypeError:  # no model: PyMC says so
            ours = False
        if not ours:
            return original_sample(*args, **kwargs)
        sampler = kwargs.get("nuts_sampler")
        if sampler not in (None, "pymc"):
            raise ValueError(f"nuts_sampler={sampler!r} compiles the model its own way: inside "
                             "synkhronos.pymc.data_parallel use PyMC's NUTS (nuts_sampler='pymc')")
        kwargs["nuts_sampler"] = "pymc"  # never nutpie by default here
        return original_sample(*args, **kwargs)

    def mp_sample(**kwargs: Any) -> Any:
        if kwargs.get("model") is not model:  # another model's pm.sample: PyMC's chain processes
            return original_mp_sample(**kwargs)
        return _sample_in_chain_processes(original_mp_sample, _evaluate_many, rt.cores, **kwargs)

    model.logp = hook.logp
    pymc.sample = sample
    mcmc._mp_sample = mp_sample
    try:
        yield model
    finally:
        pymc.sample = original_sample
        mcmc._mp_sample = original_mp_sample
        vars(model).pop("logp", None)
        hook.close()


def _evaluate_many(split_id: int, points: dict[int, Any], width: int, with_grad: bool) -> dict[int, list[Any]]:
    """The chain server's evaluation: split ``split_id`` at each slot's point, in one call."""
    return _SPLITS[split_id].evaluate_many(points, width, with_grad)
