"""Test-local PyTensor Ops for the engine's tests and the multi-host tests (tests/multinode) (a
module of its own: the workers unpickle the graphs that use them, so it must import by name there:
this directory is on the master's ``sys.path``, which the workers and a launcher of another host
receive; its JAX translations import JAX, which the other tests need not).

* :class:`RankSum` -- the sum of ``x`` over the ranks: ``jax.lax.psum`` over the ``synk_axis``
  that the engine passes to every Op's JAX translation; the identity in one process.  Its gradient
  is itself (the gradient of a sum over ranks is the sum of the gradients).
* :class:`Stall` -- ``x`` unchanged after sleeping ``seconds`` on the host (a long call to kill a
  worker or a launcher during); in compute rank ``fail_rank`` (its rank over every host), when
  ``x`` sums to less than 0, it raises instead (a failure in one rank only, after a first call has
  compiled the program).
"""

from __future__ import annotations

import time

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.jax.dispatch import jax_funcify


class RankSum(Op):
    __props__ = ()
    synk_collective = True  # the engine refuses to run it per rank, where it would mean nothing

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = np.asarray(inputs[0])

    def grad(self, inputs, output_grads):
        return [RankSum()(output_grads[0])]


@jax_funcify.register(RankSum)
def _rank_sum(op, synk_axis=None, **kwargs):
    import jax

    if synk_axis is None:
        return lambda x: x
    return lambda x: jax.lax.psum(x, synk_axis)


def compute_rank() -> int:
    """This process's compute rank under the engine, over every host (-1 in the master)."""
    from synkhronos.runtime import current

    rt = current()
    return -1 if rt is None else rt.rank


class Stall(Op):
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
            raise RuntimeError(f"Stall: compute rank {self.fail_rank} fails on purpose")
        time.sleep(self.seconds)
        return np.asarray(x)


@jax_funcify.register(Stall)
def _stall(op, **kwargs):
    import jax

    def stall(x):
        return jax.pure_callback(op._host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    return stall
