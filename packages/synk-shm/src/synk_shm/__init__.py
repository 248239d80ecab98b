"""synk_shm: OS shared memory that other processes see in place.

* :class:`SharedArray` - a named POSIX shared-memory segment mapped as a numpy array: create,
  attach by name from another process, close, unlink.
* :class:`Data` - a typed, resizable array in shared memory with a picklable
  :class:`DataHandle`; the input container of :mod:`synkhronos` functions.
* :func:`sweep` - remove what dead runs left in ``/dev/shm``.

Linux only (POSIX shared memory and semaphores with timeouts through ``posix_ipc``).

Example
-------
>>> import numpy as np, synk_shm
>>> d = synk_shm.Data(np.zeros((4, 3), dtype="float32"))
>>> h = d.handle()                    # pickle this, send it to another process...
>>> other = synk_shm.Data.attach(h)   # ...which attaches and sees writes in place
>>> d[0] = 7
>>> float(other[0, 0])
7.0
>>> other.close(); d.free_memory()
"""

from synk_shm.data import Data, DataHandle
from synk_shm.naming import run_prefix, sweep
from synk_shm.segment import SharedArray, SharedMemoryFullError, shm_free_bytes

__all__ = ["Data", "DataHandle", "SharedArray", "SharedMemoryFullError", "run_prefix", "shm_free_bytes",
           "sweep"]
__version__ = "0.1.0"
