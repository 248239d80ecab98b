"""A test-local PyTensor Op for the multi-host tests (a module of its own: the workers of every
host unpickle the graphs that use it, so it must import by name there).

:class:`Slow` -- ``x`` unchanged after sleeping ``seconds`` on the host (a long call, to kill a
process during it); in compute rank ``fail_rank`` (its rank over every host), when ``x`` sums to
less than 0, it raises instead.
"""

from __future__ import annotations

import time

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.jax.dispatch import jax_funcify


def compute_rank() -> int:
    """This worker's compute rank over every host (-1 in the master)."""
    from synkhronos.runtime import current

    rt = current()
    return -1 if rt is None else rt.rank


class Slow(Op):
    __props__ = ("seconds", "fail_rank")

    def __init__(self, seconds: float, fail_rank: int = -2):
        self.seconds = float(seconds)
        self.fail_rank = int(fail_rank)

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = np.asarray(self._host(inputs[0]))

    def _host(self, x):
        if compute_rank() == self.fail_rank and np.sum(x) < 0:
            raise RuntimeError(f"Slow: compute rank {self.fail_rank} fails on purpose")
        time.sleep(self.seconds)
        return np.asarray(x)


@jax_funcify.register(Slow)
def _slow(op, **kwargs):
    import jax

    def slow(x):
        return jax.pure_callback(op._host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    return slow
