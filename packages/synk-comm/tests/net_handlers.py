"""Command handlers of the synk_comm.net tests (the workers of every host import this module by name).

A worker's rank in the group spanning hosts is ``group.rank + group.span_offset``.
"""

from __future__ import annotations

import os

import numpy as np

import synk_comm

RANK = "net.rank"
FAIL = "net.fail"
GATHER = "net.gather"
ALL_GATHER = "net.all_gather"
BARRIER = "net.barrier"
SLEEP = "net.sleep"
ALL_REDUCE = "net.all_reduce"
NUMBERS = "net.numbers"


def span_rank(group: synk_comm.Group) -> int:
    return group.rank + group.span_offset


@synk_comm.handler(RANK)
def _rank(group: synk_comm.Group, payload: int) -> None:
    if not group.is_master:
        group.reply([np.array([span_rank(group), payload, os.getpid()])])


@synk_comm.handler(NUMBERS)
def _numbers(group: synk_comm.Group, payload: None) -> None:
    """Workers reply 1 where ``reply_values`` refused them (a group spanning hosts), else 0."""
    if group.is_master:
        return
    try:
        group.reply_values([1.0])
    except RuntimeError:
        group.reply([np.array([1])])
    else:
        group.reply([np.array([0])])


@synk_comm.handler(FAIL)
def _fail(group: synk_comm.Group, rank: int) -> None:
    if not group.is_master and span_rank(group) == rank:
        raise ValueError(f"rank {rank} fails on purpose")


@synk_comm.handler(GATHER)
def _gather(group: synk_comm.Group, _payload: None) -> list[object] | None:
    return group.gather_object(None if group.is_master else ("rank", span_rank(group)))


@synk_comm.handler(ALL_GATHER)
def _all_gather(group: synk_comm.Group, _payload: None) -> list[np.ndarray]:
    me = 0 if group.is_master else span_rank(group)
    everything = group.host.all_gather(np.arange(me))  # rank r gives r values: shapes differ
    if not group.is_master:
        group.reply([np.array([len(everything), *(len(a) for a in everything)])])
    return everything


@synk_comm.handler(BARRIER)
def _barrier(group: synk_comm.Group, _payload: None) -> None:
    group.barrier()


@synk_comm.handler(SLEEP)
def _sleep(group: synk_comm.Group, seconds: float) -> None:
    import time

    if not group.is_master:
        group.reply([np.array([os.getpid()])])
        time.sleep(seconds)


def rank_values(rank: int, n: int) -> np.ndarray:
    """Rank ``rank``'s input of the all-reduce test (the master is rank 0)."""
    return np.random.default_rng([rank, n]).normal(size=n)


@synk_comm.handler(ALL_REDUCE)
def _all_reduce(group: synk_comm.Group, payload: tuple[str, int]) -> np.ndarray:
    op, n = payload
    me = 0 if group.is_master else span_rank(group)
    result = group.all_reduce(rank_values(me, n), op)
    if not group.is_master:
        group.reply([result])
    return result
