"""The introductory example of Synkhronos 1.0, on PyTensor: a scattered input, a broadcast input,
and the result of the data-parallel function equal to the plain PyTensor function's.

Written like the seed's script (no main guard): workers are started from Synkhronos's own
entry module, so this file is never re-run in them.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk

n = synk.fork(2, use_gpu=False)
x = pt.matrix("x")
y = pt.vector("y")
z = pt.mean(x.dot(y), axis=0)
f_th = pytensor.function(inputs=[x, y], outputs=z)
f = synk.function(inputs=[x], bcast_inputs=[y], outputs=z)
synk.distribute()

x_dat = np.random.randn(100, 10).astype(pytensor.config.floatX)
y_dat = np.random.randn(10).astype(pytensor.config.floatX)
x_synk = synk.data(x_dat)
y_synk = synk.data(y_dat)
r_th = f_th(x_dat, y_dat)
r = f(x_synk, y_synk)

print(f"{n} ranks: synkhronos {float(r):.6f}, pytensor {float(r_th):.6f}")
assert np.allclose(r, r_th)
print("All assertions passed.")
