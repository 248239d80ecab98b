"""How a call's outputs reach the master: as host replies, or through collectives.

Every output combines over the ranks by its op (:mod:`synkhronos.reduce_ops`).  It travels one
of two ways:

* **host** (every small output, and every output in CPU mode): each rank copies its value to
  host memory and replies it through shared memory; the master combines the replies in numpy.
* **collective** (GPU mode, outputs reduced by avg, sum, prod, max or min of at least
  :data:`MIN_BYTES` per rank): the ranks reduce the value into the master's GPU through NCCL,
  and only the master copies the result to the host: one device-to-host copy of the result
  instead of one per rank, and no pass through shared memory.  Under ``SYNK_EMULATE_GPUS`` the
  same steps run through the host collectives.  Gathered outputs always take the host path: the
  master has to copy every rank's part to the host either way, and through NCCL it also receives
  them all first (measured below).

Measured on 2x H200 (``benchmarks/bench_gpu.py``, ms per call of a function with one float32
output, host path / collective path): sum of 1 MiB per rank 1.50 / 1.69, 4 MiB 6.40 / 2.14,
16 MiB 19.2 / 5.2, 128 MiB 232 / 104; gather of 1 MiB 1.59 / 3.68, 16 MiB 30.1 / 37.0, 128 MiB
257 / 295.  Hence :data:`MIN_BYTES` = 2 MiB, and no gather through NCCL.

The master chooses before the call, from the size each output had in the previous call of the
same output subset (a first call takes the host path), and sends the choice with the command:
every rank must take the same path, or NCCL would wait forever.  :func:`choose` decides;
:func:`reduce_on_device` is what every rank runs after computing its share.

A collective output combines as the host path would (the same weights, the same ranks left out):

1. one small exchange of every rank's weight (its rows) and the shape of each such output; the
   shapes must agree, else every rank raises the same ValueError before anything moves;
2. ``avg``: each rank scales its value by ``w_r / sum(w)`` and the values are summed, giving
   ``sum_r w_r y_r / sum_r w_r``; ``sum``, ``prod``, ``max``, ``min``: NCCL's own op; a rank that
   had no rows contributes the op's identity (0, 1, the lowest or the highest value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from synkhronos.reduce_ops import common_shape, contribution
from synkhronos.runtime import Runtime

__all__ = ["MIN_BYTES", "choose", "chosen", "reduce_on_device"]

MIN_BYTES = 2 << 20
"""Outputs at least this large (per rank, in the previous call) go through collectives in GPU
mode; set it in the master to change the choice (0: every such output, ``float("inf")``: none)."""

_NCCL_KINDS = "iuf"  # NCCL reduces signed and unsigned integers and floats (not bool or complex)
_MAX_OUTPUTS = 63  # the choice travels as the bits of one int64 scratch slot


def choose(rt: Runtime, ops: Sequence[str], variables: Sequence[Any], last_nbytes: Sequence[int] | None) -> int:
    """The master's choice for a call: bit ``i`` set when output ``i`` (in the call's output
    order; ``variables``: the output variables) goes through collectives.  ``last_nbytes``: each
    output's size per rank in the previous call of the same output subset (None before the first)."""
    if last_nbytes is None or rt.size < 2 or not rt.device.use_gpu:
        return 0
    mask = 0
    for i, (op, var, nbytes) in enumerate(zip(ops, variables, last_nbytes)):
        kind = np.dtype(var.type.dtype).kind
        if (i < _MAX_OUTPUTS and op != "gather" and nbytes >= MIN_BYTES and kind in _NCCL_KINDS
                and (op != "avg" or kind == "f")):
            mask |= 1 << i
    return mask


def chosen(mask: int, n_outputs: int) -> list[int]:
    """The output positions whose bit is set in ``mask``."""
    return [i for i in range(min(n_outputs, _MAX_OUTPUTS)) if mask >> i & 1]


def reduce_on_device(rt: Runtime, weight: float, outputs: Sequence[Any], ops: Sequence[str],
                     variables: Sequence[Any], mask: int) -> dict[int, np.ndarray]:
    """Reduce the outputs chosen by ``mask`` through collectives (every rank runs it).

    ``outputs``: this rank's values (empty when it had no rows); ``variables``: the output
    variables (their static ndim and dtype).  Returns, in the master, ``{position: combined
    value as numpy}``; in the workers ``{}``.
    """
    positions = chosen(mask, len(ops))
    shapes, weights = _exchange(rt, weight, outputs, positions, variables)
    total = float(weights.sum())
    if total == 0:
        return {}  # no rank computed: the master's combine says so, as on the host path
    results: dict[int, np.ndarray] = {}
    for i in positions:
        op, dtype = ops[i], np.dtype(variables[i].type.dtype)
        shape = common_shape(op, [s for r in range(rt.size) if (s := shapes[r][i]) is not None], f"output {i}")
        xp = rt.device.xp if rt.device.nccl_capable else np
        value = outputs[i] if outputs and weight > 0 else None
        if value is not None and xp is np:
            value = np.asarray(value)
        value = contribution(op, value, weight, total, shape, dtype, xp=xp)
        combined = rt.group.reduce(value, "sum" if op == "avg" else op)
        if combined is not None:
            results[i] = np.asarray(combined, dtype=dtype)
    return results


def _exchange(rt: Runtime, weight: float, outputs: Sequence[Any], positions: list[int],
              variables: Sequence[Any]) -> tuple[list[dict[int, tuple[int, ...] | None]], np.ndarray]:
    """Every rank's weight and the shape of each chosen output (None where it had no rows)."""
    mine = [int(weight)]
    for i in positions:
        ndim = variables[i].type.ndim
        mine += [1, *outputs[i].shape] if outputs else [0] + [0] * ndim
    table = rt.group.host.all_gather(np.array(mine, dtype=np.int64))
    shapes: list[dict[int, tuple[int, ...] | None]] = []
    for row in table:
        j, seen = 1, {}
        for i in positions:
            ndim = variables[i].type.ndim
            seen[i] = tuple(int(v) for v in row[j + 1:j + 1 + ndim]) if row[j] else None
            j += 1 + ndim
        shapes.append(seen)
    return shapes, np.array([row[0] for row in table], dtype=np.float64)
