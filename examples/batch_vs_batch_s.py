"""``batch`` against ``batch_s`` (the spirit of the seed's demos 4 and 5).

``batch`` selects rows of a Data input *before* the rows are split among the ranks: every rank
gathers its own share of the selected rows straight from shared memory.  ``batch_s`` selects
rows of each rank's sliceable shared variable *after* the split: the data were scattered once
(into GPU memory in GPU mode) and each rank picks from its own part.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk

n = synk.fork(2, use_gpu=False)
data = np.arange(20.0).reshape(10, 2)

# batch: rows of the whole data set, then split (rank 0 gets the first half of the selection).
x = pt.matrix("x", dtype="float64")
f = synk.function([x], outputs=(x[:, 0], None))
X = synk.data(data)
picked = [9, 0, 4, 4, 7, 1]
print("batch", picked, "->", f(X, batch=picked))
assert np.array_equal(f(X, batch=picked), data[picked, 0])
assert np.array_equal(f(X, batch=slice(2, 8, 3)), data[2:8:3, 0])
assert np.array_equal(f(X, batch=4), data[:4, 0])

# batch_s: scatter once, then each rank selects from its own rows.
S = pytensor.shared(np.zeros((0, 2)), name="S")
g = synk.function([], outputs=(S[:, 0], None), sliceable_shareds=[S])
synk.scatter(S, data)  # rank 0 holds rows 0-4, rank 1 rows 5-9
print("batch_s slice(0, 2) ->", g(batch_s=slice(0, 2)))  # the first two rows of EACH rank
assert np.array_equal(g(batch_s=slice(0, 2)), data[[0, 1, 5, 6], 0])
assert np.array_equal(g(batch_s=[[4], [0, 1]]), data[[4, 5, 6], 0])  # one selection per rank
mean = synk.function([], outputs=pt.mean(S), sliceable_shareds=[S])
assert np.isclose(mean(num_slices=2), data.mean())  # every row, two slices per rank, weighted by rows
print("All assertions passed.")
