"""The pieces of a tiny Synkhronos call, each timed alone in the master (diagnosis, not a benchmark
of record: ``bench_cpu_scaling.py --only tiny`` is that).

Forks 2 CPU ranks, builds ``bench_cpu_scaling``'s tiny function (one scalar out of a 4n x 2 input),
calls it until warm, then times each piece of the call path on its own -- the checked-plan lookup,
a worker's decoding of the plan, the rank's share (its rows, its compiled call, its reply: numbers
in the control block for this scalar output), a message reply's write, the master's combining --
as the best of 7 means of 5000 runs, next to the whole call and the plain PyTensor call in JAX
mode.  The pieces run hot and alone, so they add up to less than the whole call (which wakes a
worker and waits for it).

Usage: ``taskset -c 0,1 python tools/probe_call_pieces.py``
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def best_us(fn: Callable[[], Any], n: int = 5000) -> float:
    """Best of 7 means of ``n`` runs of ``fn``, in us."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
    return best


def main() -> None:
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synk_comm.lockstep import MAILBOX
    from synkhronos import calls
    from synkhronos.reduce_ops import combine
    from synkhronos.runtime import get_runtime

    synk.fork(2, use_gpu=False)
    x = pt.matrix("x")
    f = synk.function([x], outputs=pt.sum(x))
    a = np.ones((8, 2), dtype=x.dtype)
    xd = synk.data(a)
    plain = pytensor.function([x], pt.sum(x), mode="JAX")
    for _ in range(200):
        f(xd)
    rt = get_runtime()
    fm = importlib.import_module("synkhronos.function")
    key = fm.Function._plan_key((xd,), {}, None, None, None, 1)
    known = f._known_plan(rt, key)
    assert known is not None
    plan = known[2]
    rep = rt.replicas[plan.fid]
    own = calls.share(rt, plan)
    scattered, bcast = calls.rank_inputs(rt, plan)
    outputs = rep.run(scattered, bcast, None, None, 1, len(scattered[0]))
    reply = [np.array(4.0), *(np.asarray(o) for o in outputs)]
    pieces: dict[str, Callable[[], Any]] = {
        "whole call": lambda: f(xd),
        "plain PyTensor call, JAX mode": lambda: plain(a[:4]),
        "master: plan key and checked-plan lookup": lambda: f._known_plan(
            rt, fm.Function._plan_key((xd,), {}, None, None, None, 1)),
        "worker: decode the plan": lambda: calls.decode(rt.group.scratch, rt.size),
        "a rank's share (execute)": lambda: calls.execute(rt, plan),
        "  of it: its rows": lambda: calls.rank_inputs(rt, plan),
        "  of it: the compiled call": lambda: rep.full(None)(*scattered),
        "reply (as numbers where the outputs are scalars)": lambda: calls.reply(rt, plan, 4.0, outputs),
        "  a message: write it": lambda: rt.group.buffers.publish(MAILBOX, reply),
        "master: combine the shares": lambda: importlib.import_module("synkhronos.engines.ranks").combine_replies(
            rt, rep, own, plan),
    }
    if own is not None:  # replied as a message (a tree before numbers replies)
        pieces["  of it: one output's parts"] = lambda: combine("avg", [own[1], own[1].copy()], [4.0, 4.0])
    for name, fn in pieces.items():
        print(f"{name:44s} {best_us(fn, 2000 if name == 'whole call' else 5000):8.2f} us", flush=True)
    synk.close()


if __name__ == "__main__":
    main()
