"""The Data interface (the spirit of the seed's demo_2): a typed array in OS shared memory that
every rank reads in place.  Creating, indexing, growing, reallocating and freeing a Data, with a
function reading it after each change (every change of allocation reaches the workers at once).
"""

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk

synk.fork(2, use_gpu=False)
x = pt.matrix("x", dtype="float64")
f = synk.function([x], outputs=(x.sum(axis=1), None))  # gather each row's sum, in rank order

d = synk.data(var=x)  # dtype and ndim from the variable; no memory yet
print("empty:", d, "allocated:", d.allocated)
d.set_value(np.arange(12.0).reshape(6, 2))
print("after set_value:", d.shape, "alloc_size", d.alloc_size)
assert np.array_equal(f(d), np.arange(12.0).reshape(6, 2).sum(axis=1))

d[0] = [100, 100]  # writes go straight to shared memory: every rank sees them
assert f(d)[0] == 200

d.set_length(8, oversize=2)  # grow: the first 6 rows are kept, new rows are zero
print("after set_length(8):", d.shape, "alloc_size", d.alloc_size, "rows 5-7:", d[5:].tolist())
assert np.array_equal(f(d)[6:], [0, 0])

d.set_length(10)  # fits in the oversized allocation: no reallocation
assert d.alloc_size == 32 and len(f(d)) == 10  # items: 16 rows x 2

try:
    d.set_value(np.ones((3, 2), dtype="int64") + 0.5)  # float64 values: fine
    d.set_value(np.ones(3))  # wrong ndim
except TypeError as err:
    print("TypeError:", err)

d.free_memory()
print("after free_memory:", d.shape, "allocated:", d.allocated)
d.set_value(np.full((4, 2), 7.0))  # a freed Data can be filled again
assert np.array_equal(f(d), np.full(4, 14.0))
print("All assertions passed.")
