"""All-reduce numpy arrays across 4 processes with synk_comm alone (no PyTensor, no GPU).

``synk_comm.spawn`` runs :func:`work` in 4 ranks: this process is rank 0, the other three are
fresh interpreters that import this file as a module (hence the main guard below).  Each rank
builds its own array, then all-reduces it with every op; every rank gets the same result, which
the master checks against numpy.

Run: ``python examples/allreduce_numpy.py``
"""

from __future__ import annotations

import numpy as np

import synk_comm

SIZE = 4
OPS = ["sum", "prod", "max", "min", "avg"]


def local_array(rank: int) -> np.ndarray:
    """Rank ``rank``'s data: a small matrix that differs from rank to rank."""
    return np.arange(6, dtype=np.float64).reshape(2, 3) + rank


def work(group: synk_comm.Group) -> dict[str, np.ndarray]:
    x = local_array(group.rank)
    results = {op: group.all_reduce(x, op) for op in OPS}
    # in place, and a large array (over 256 KiB: each rank reduces one chunk of it)
    y = np.full(100_000, float(group.rank + 1), dtype=np.float32)
    group.all_reduce(y, "sum", out=y)
    results["sum of a large array, in place (first 3)"] = y[:3]
    return results


def main() -> None:
    results = synk_comm.spawn(work, SIZE)
    stack = np.stack([local_array(r) for r in range(SIZE)])
    expected = {"sum": stack.sum(0), "prod": stack.prod(0), "max": stack.max(0), "min": stack.min(0),
                "avg": stack.mean(0),
                "sum of a large array, in place (first 3)": np.full(3, sum(range(1, SIZE + 1)), np.float32)}
    for name, value in results[0].items():
        print(f"{name}:\n{value}\n")
    for rank, res in enumerate(results):
        for name, value in expected.items():
            np.testing.assert_allclose(res[name], value, rtol=1e-12, err_msg=f"rank {rank}, {name}")
    print(f"all {SIZE} ranks agree with numpy")


if __name__ == "__main__":
    main()
