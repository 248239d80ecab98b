"""Per-rank shared values (the spirit of the seed's demo_3): each rank holds its own value of a
shared variable -- even of a different shape -- read and written by rank, gathered, and reduced.
"""

import numpy as np
import pytensor

import synkhronos as synk

n = synk.fork(3, use_gpu=False)
s = pytensor.shared(np.zeros((2, 2)), name="s")
f = synk.function([], outputs=(s.sum(), None), updates=[(s, s + 1)])  # each rank: sum, then add 1
f()
print("per-rank sums after the first call:", f())  # [4, 4, 4]: every rank added 1 to its zeros

for rank in range(n):  # give each rank a value of its own, of its own length
    synk.set_value(rank, s, np.full((rank + 1, 2), float(rank)))
print("shapes:", synk.get_shapes(s), "lengths:", synk.get_lengths(s))
assert synk.get_lengths(s) == [1, 2, 3]
print("rank 2's value:\n", synk.get_value(2, s))
print("gathered (nd_up=0, the form for unequal shapes):\n", synk.gather(s, nd_up=0))
assert np.array_equal(synk.gather(s, nd_up=0)[:, 0], [0, 1, 1, 2, 2, 2])

synk.scatter(s, np.arange(12.0).reshape(6, 2))  # rank r gets rows [2r, 2r+2)
assert synk.get_lengths(s) == [2, 2, 2]
synk.all_reduce(s, op="sum")  # now equal shapes: every rank gets the sum
print("after scatter and all_reduce(sum):\n", synk.get_value(1, s))
assert np.array_equal(synk.get_value(1, s), np.arange(12.0).reshape(3, 2, 2).sum(axis=0))
assert np.array_equal(s.get_value(), synk.get_value(0, s))  # the master is rank 0
print("All assertions passed.")
