"""The shared-variable example of Synkhronos 1.0: a function that updates a shared variable
locally in each rank, then gather, reduce, broadcast and all_reduce to move the values around.

With x = [[1,1],[2,2],[3,3],[4,4]] on 2 ranks, rank 0 gets rows 0-1 and rank 1 rows 2-3, and
the update s := sum(x * s, axis=0) gives s = [3,3] in rank 0 and [7,7] in rank 1.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk

synk.fork(2, use_gpu=False)
s_init = np.ones(2, dtype="float32")
x = pt.matrix("x", dtype="float32")
s = pytensor.shared(s_init, name="s")
f = synk.function([x], updates=[(s, pt.sum(x * s, axis=0))])
synk.distribute()
x_dat = synk.data(np.array([[1, 1], [2, 2], [3, 3], [4, 4]], dtype="float32"))

print("s initial:\n", s.get_value())
f.as_theano(x_dat.data)
print("s after PyTensor call (master only):\n", s.get_value())
assert np.array_equal(s.get_value(), [10, 10])

s.set_value(s_init)
f(x_dat)
print("local s after reset and Synkhronos call:\n", s.get_value())
gathered = synk.gather(s, nd_up=1)
print("gathered s:\n", gathered)
assert np.array_equal(s.get_value(), [3, 3]) and np.array_equal(gathered, [[3, 3], [7, 7]])

synk.reduce(s, op="sum")
print("local s after in-place reduce:\n", s.get_value())
gathered = synk.gather(s, nd_up=1)
print("gathered s after reduce:\n", gathered)
assert np.array_equal(s.get_value(), [10, 10]) and np.array_equal(gathered, [[10, 10], [7, 7]])

synk.broadcast(s, s_init)
f(x_dat)
synk.all_reduce(s, op="sum")
gathered = synk.gather(s, nd_up=1)
print("gathered s after reset broadcast, Synkhronos call, and all-reduce:\n", gathered)
assert np.array_equal(gathered, [[10, 10], [10, 10]])
print("All assertions passed.")
