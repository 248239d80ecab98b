"""Synkhronos: PyTensor (Theano) functions run data-parallel on every GPU or CPU core of a machine.

Build graphs as usual, build functions with :func:`function` instead of ``pytensor.function``,
and call them as in a serial program: inputs are scattered through OS shared memory, every rank
computes its share, outputs are combined, and collectives keep shared variables in step.

Lifecycle
    :func:`fork`, :func:`close`, :func:`distribute`
Functions
    :func:`function` -> :class:`~synkhronos.function.Function` (call with Data; ``batch``,
    ``batch_s``, ``num_slices``, ``output_subset``; ``as_theano``, ``build_inputs``;
    ``f.submit(...)``: the call in flight, a :class:`concurrent.futures.Future`, see
    :mod:`synkhronos.inflight`);
    :func:`chain` -> :class:`Chain` (a call, an all-reduce and a second call as one command)
Data
    :func:`data` -> :class:`Data` (OS shared memory, seen in place by every rank)
Collectives on shared variables
    :func:`broadcast`, :func:`scatter`, :func:`gather`, :func:`all_gather`, :func:`reduce`,
    :func:`all_reduce`, :func:`set_value`, :func:`get_value`, :func:`get_lengths`,
    :func:`get_shapes`
In-graph collectives (inside a function's graph: outputs, updates)
    :mod:`synkhronos.ops`: ``ops.all_reduce``, ``ops.all_gather``, ``ops.broadcast``
    (imported on first use of ``synk.ops``)

Example
-------
>>> import numpy as np, pytensor.tensor as pt
>>> import synkhronos as synk
>>> synk.fork(2, use_gpu=False)                                   # doctest: +SKIP
2
>>> x, y = pt.matrix("x"), pt.vector("y")
>>> f = synk.function([x], bcast_inputs=[y], outputs=pt.mean(x.dot(y)))   # doctest: +SKIP
>>> r = f(synk.data(np.ones((100, 10))), synk.data(np.ones(10)))          # doctest: +SKIP
>>> float(r)                                                              # doctest: +SKIP
10.0
"""

from synk_shm import Data
from synkhronos.chain import Chain, chain
from synkhronos.collectives import (
                                    all_gather,
                                    all_reduce,
                                    broadcast,
                                    gather,
                                    get_lengths,
                                    get_shapes,
                                    get_value,
                                    reduce,
                                    scatter,
                                    set_value,
)
from synkhronos.data_registry import data
from synkhronos.distribution import distribute
from synkhronos.errors import DivergentGradientError, GroupBrokenError, SelectionError, WorkerDiedError, WorkerError
from synkhronos.forking import close, fork
from synkhronos.function import Function, function

__all__ = ["Chain", "Data", "DivergentGradientError", "Function", "GroupBrokenError", "SelectionError",
           "WorkerDiedError", "WorkerError", "all_gather", "all_reduce", "broadcast", "chain", "close", "data",
           "distribute", "fork", "function", "gather", "get_lengths", "get_shapes", "get_value", "reduce", "scatter",
           "set_value"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``synk.ops``: the in-graph collectives, imported on first use."""
    if name == "ops":
        import importlib

        return importlib.import_module("synkhronos.ops")
    raise AttributeError(f"module 'synkhronos' has no attribute {name!r}")
