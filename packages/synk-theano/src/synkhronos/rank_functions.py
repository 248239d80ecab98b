"""A CPU rank's compiled functions and their shared inputs under the JAX backend
(:mod:`synkhronos.cpu`): JAX mode with a per-function fallback to the default mode
(:class:`JaxOrDefault`), the numpy values that functions of other modes need
(:class:`NumpySharedInputs`), and large values lent in place to JAX-mode functions
(:class:`JaxSharedInputs`); :func:`for_rank` picks the wrapper of a function compiled in a mode
of its own."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from synkhronos.cpu import _GROUP_ERRORS, SKIPPED_ASSERT, log

__all__ = ["JaxOrDefault", "JaxSharedInputs", "NumpySharedInputs", "for_rank", "give_back", "lend_to_jax"]


def _draws_random_numbers(fn: Any) -> bool:
    """Whether a compiled function reads a random generator (a shared ``RandomType`` variable)."""
    from pytensor.tensor.random.type import RandomType

    return any(isinstance(getattr(v, "type", None), RandomType) for v in fn.maker.fgraph.inputs)


def _shared_input_cells(fn: Any, read_only: bool = False) -> list[list[Any]]:
    """The storage cells of a compiled function's shared-variable inputs (their containers');
    ``read_only``: only those of the variables it does not update."""
    maker = getattr(fn, "maker", None)
    if maker is None:
        return []
    return [container.storage for container, spec in zip(fn.input_storage, maker.inputs)
            if spec.implicit and not (read_only and spec.update is not None)]


def _numpy_in(cells: list[list[Any]]) -> None:
    """Replace each JAX array (any array but numpy's) in ``cells`` with a writable numpy copy."""
    for cell in cells:
        value = cell[0]
        if not isinstance(value, (np.ndarray, np.generic)) and hasattr(value, "__array__"):
            cell[0] = np.array(value)


class _SharedInputs:
    """A compiled function with something done to the values of some of its shared inputs (the
    storage cells that :meth:`cells` picks) around each call (:class:`NumpySharedInputs`,
    :class:`JaxSharedInputs`).

    Parameters
    ----------
    fn : callable
        The compiled PyTensor function; its other attributes are reached through this object.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._cells = self.cells(fn)

    @staticmethod
    def cells(fn: Any) -> list[list[Any]]:
        raise NotImplementedError

    @property
    def trust_input(self) -> bool:
        return bool(self.fn.trust_input)

    @trust_input.setter
    def trust_input(self, value: bool) -> None:
        self.fn.trust_input = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class NumpySharedInputs(_SharedInputs):
    """A function compiled in a mode other than JAX, in a rank whose other functions compute in
    JAX: before each call, every shared input that a JAX-mode function left as a JAX array becomes
    a numpy array again (Numba cannot read JAX arrays).  Only such values are copied: a value is
    copied each time a JAX-mode function has left a new one there, never again after that (this
    function's own updates leave numpy arrays).
    """

    cells = staticmethod(_shared_input_cells)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _numpy_in(self._cells)
        return self.fn(*args, **kwargs)


def for_rank(fn: Any) -> Any:
    """``fn`` in :class:`JaxSharedInputs` when it computes in JAX, else in :class:`NumpySharedInputs`."""
    from pytensor.link.jax.linker import JAXLinker

    maker = getattr(fn, "maker", None)
    return JaxSharedInputs(fn) if isinstance(getattr(maker, "linker", None), JAXLinker) else NumpySharedInputs(fn)


LEND_BYTES = 1 << 20
"""Shared values of at least this many bytes are lent to JAX-mode functions (:func:`lend_to_jax`);
below it, the copy that JAX makes costs less than lending (about 0.1 ms an array)."""


ALIGN_BYTES = 64
"""XLA's CPU backend reads host memory in place (no copy) where it starts on this boundary."""


def aligned_copy(value: Any, dtype: Any) -> np.ndarray:
    """A C-contiguous copy of ``value`` in ``dtype`` whose data starts on an :data:`ALIGN_BYTES`
    boundary: what :func:`lend_to_jax` lends (:meth:`synkhronos.device.CpuDevice.set` stores values
    so)."""
    src = np.asarray(value, dtype=dtype)
    nbytes = src.size * src.dtype.itemsize
    raw = np.empty(nbytes + ALIGN_BYTES, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN_BYTES
    out = raw[start:start + nbytes].view(src.dtype).reshape(src.shape)
    out[...] = src
    return out


def lend_to_jax(cells: list[list[Any]]) -> list[tuple[list[Any], Any, Any]]:
    """For one call of a JAX-mode function: each large numpy value of ``cells`` (aligned to
    :data:`ALIGN_BYTES`,
    C-contiguous, a dtype JAX keeps) replaced by a JAX array that reads it in place, where JAX would
    copy a numpy value into XLA at every call (62,500 rows of 20 float64 features, a logistic
    likelihood's value and gradient at 4 points on one core: 7.3 ms a call read in place, 11.0 ms
    copied).  :func:`aligned_copy` makes such values.  Returns what
    :func:`give_back` puts back after the call: the shared variables hold numpy again."""
    lent = []
    for cell in cells:
        value = cell[0]
        if (type(value) is np.ndarray and value.nbytes >= LEND_BYTES and value.ctypes.data % ALIGN_BYTES == 0
                and value.flags.c_contiguous and _jax_keeps(value.dtype)):
            import jax

            view = jax.device_put(value)
            cell[0] = view
            lent.append((cell, value, view))
    return lent


def give_back(lent: list[tuple[list[Any], Any, Any]]) -> None:
    for cell, value, view in lent:
        if cell[0] is view:
            cell[0] = value


def _jax_keeps(dtype: Any) -> bool:
    """Whether JAX holds an array of ``dtype`` in that dtype (float64 needs JAX's x64 mode)."""
    import jax

    return bool(jax.dtypes.canonicalize_dtype(dtype) == dtype)


class JaxSharedInputs(_SharedInputs):
    """A function compiled in JAX mode: for each call, its large shared inputs that it does not
    update are lent to it as JAX arrays that read their numpy values in place
    (:func:`lend_to_jax`), and given back after it.
    """

    @staticmethod
    def cells(fn: Any) -> list[list[Any]]:
        return _shared_input_cells(fn, read_only=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lent = lend_to_jax(self._cells) if self._cells else []
        try:
            return self.fn(*args, **kwargs)
        finally:
            give_back(lent)


class JaxOrDefault:
    """A function compiled in JAX mode, recompiled in PyTensor's default mode the first time JAX
    fails to compile or run it (one log line says so); the call that failed is run again there.

    A call that fails in both modes raises the default mode's error: the user's.  JAX computes
    without side effects, so a failed JAX call changed no shared variable.  The default-mode
    function reads shared values that JAX-mode functions updated as numpy
    (:class:`NumpySharedInputs`).

    Parameters
    ----------
    compile_fn : callable
        ``compile_fn(mode)`` -> a compiled PyTensor function (``mode`` None: the default).
    name : str
        The function's name, for the log line.
    fall_back_on_run : bool
        False for a function whose all-reduces run inside its JAX program (the other ranks wait
        for this one there): a failed call raises instead of running again in the default mode.
    jax_mode : str or Mode
        The JAX mode to compile in: ``"JAX"``, or CPU ranks' :func:`synkhronos.blas.jax_mode`.
    """

    def __init__(self, compile_fn: Any, name: str, fall_back_on_run: bool = True, jax_mode: Any = "JAX") -> None:
        self._compile_fn = compile_fn
        self._name = name
        self._fall_back_on_run = fall_back_on_run
        self._trust_input = False
        self.mode = "JAX"
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=SKIPPED_ASSERT)
                self.fn: _SharedInputs = JaxSharedInputs(compile_fn(jax_mode))
        except Exception as exc:  # an Op without a JAX implementation, or JAX not working here
            self._fall_back(exc, "compile")
            return
        if _draws_random_numbers(self.fn):
            self._fall_back(ValueError("JAX mode compiles a copy of each random generator, which the "
                                       "rank's slices and updates would not advance"), "use its random generators")

    def _fall_back(self, exc: BaseException, when: str) -> None:
        log.info("synkhronos: function %s could not %s in JAX mode (%s: %s); it runs in PyTensor's "
                 "default mode", self._name, when, type(exc).__name__, str(exc).splitlines()[0][:200])
        self.mode = "default"
        self.fn = NumpySharedInputs(self._compile_fn(None))
        self.fn.trust_input = self._trust_input

    @property
    def trust_input(self) -> bool:
        return self._trust_input

    @trust_input.setter
    def trust_input(self, value: bool) -> None:
        self._trust_input = value
        self.fn.trust_input = value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.mode != "JAX":
            return self.fn(*args, **kwargs)
        try:
            return self.fn(*args, **kwargs)
        except _GROUP_ERRORS:  # the group's, not JAX's: running the function again would not help
            raise
        except Exception as exc:
            if not self._fall_back_on_run:  # its all-reduces run in the program: the others wait there
                raise
            self._fall_back(exc, "run")
        return self.fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # get_shared, maker, ...: the compiled function's
        return getattr(self.fn, name)
