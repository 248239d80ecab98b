"""An all-reduce that runs INSIDE a compiled JAX program on the CPU: an XLA FFI handler in C++
over a shared-memory segment of the group (``xla_cpu_all_reduce.cc``, compiled at first use).

With it a data-parallel step -- gradient, all-reduce, update -- is one XLA program per rank: no
second call, no all-reduce in Python between two (``python tools/probe_in_program_all_reduce.py``
measures it).  It needs JAX and a C++ compiler (``c++``, C++17); without either
:func:`available` is False and callers keep their other path.

=============================  ==============================================================
:func:`available`              whether the handler is (or can be) built and registered here
:func:`register_handler`       build, load and register any FFI handler source (also others')
:class:`Segment`               the group's shared segment: counters, weights, buffers
:func:`all_reduce`             the JAX expression: ``op`` over every rank's array, in a program
=============================  ==============================================================

Every rank of the group must run the same sequence of these all-reduces, on arrays of the same
shape and dtype (float32, float64, int32 or int64), each after setting its weight for the call
(:meth:`Segment.set_weight`: 0 contributes the op's identity; ``avg`` weighs by it).  A wait in
the handler ends with an error when the group's abort word is set (a rank failed its command) or
a peer's process is gone; after such an error the ranks' counters disagree: once no rank is
inside a program, :meth:`Segment.realign` puts them in step again.

Large arrays (a chunk of 256 KB or more) are copied and reduced by a team of threads in each rank,
one per core of the rank's pinning (none when the process is not pinned;
``$SYNK_ALL_REDUCE_THREADS`` sets the number), and from 3 ranks reduced split: each rank reduces
its slice of every rank's chunk into a shared result, which every rank then copies whole.

Example (every rank; ``segment`` made by rank 0 with :meth:`Segment.create`, attached by the
others with :meth:`Segment.attach`)::

    segment.set_weight(group.rank, rows)
    step = jax.jit(lambda g: xla_cpu.all_reduce(g, "sum", segment, group.rank, group.size))
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["MAX_RANKS", "OPS", "Segment", "all_reduce", "available", "build_handler", "register_handler"]

SOURCE = Path(__file__).with_name("xla_cpu_all_reduce.cc")
TARGET = "synk_comm_all_reduce"
MAX_RANKS = 64
"""Ranks a segment has room for (a cache line per rank on each of its four control pages)."""
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
"""The ops and their codes in the handler."""
PAGE = 4096
ABORTED = "synk_comm all-reduce: another rank failed"
"""How the error of an all-reduce that the group's abort word stopped begins (a peer failed)."""
_state: dict[str, Any] = {}


def cache_dir() -> Path:
    """Where built handlers are kept: ``$SYNK_CACHE_DIR``, else ``$XDG_CACHE_HOME/synk_comm``
    (``~/.cache/synk_comm``)."""
    if os.environ.get("SYNK_CACHE_DIR"):
        return Path(os.environ["SYNK_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "synk_comm"


def build_handler(source: Path) -> Path:
    """The shared library of the XLA FFI handler(s) in the C++ file ``source``, built with the
    machine's C++ compiler (``c++``, or ``$CXX``; C++17) against jaxlib's FFI headers, once per
    source and jaxlib version, into :func:`cache_dir` (several processes may build at once: each
    writes a file of its own and renames it into place).

    Raises
    ------
    RuntimeError
        Without a C++ compiler, or when the build fails (with the compiler's messages).
    """
    import jax.ffi
    import jaxlib

    key = hashlib.sha256(source.read_bytes() + jaxlib.__version__.encode()).hexdigest()[:16]
    library = cache_dir() / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, or $CXX) on PATH")
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=library.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
                        str(source), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, library)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{compiler} failed on {source.name}:\n{exc.stderr}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return library


def register_handler(source: Path, symbol: str, target: str) -> ctypes.CDLL:
    """Build ``source`` (:func:`build_handler`), load it, and register its handler ``symbol``
    (an ``XLA_FFI_DEFINE_HANDLER_SYMBOL``) with JAX as the CPU custom call ``target``.

    Raises
    ------
    RuntimeError
        As :func:`build_handler`; ImportError without JAX.
    """
    import jax

    library = ctypes.cdll.LoadLibrary(str(build_handler(source)))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return library


def available() -> bool:
    """Whether the handler is registered with JAX in this process (built and registered at the
    first call; False, with one log line saying why, without JAX or a compiler)."""
    if "ok" not in _state:
        try:
            _state["library"] = register_handler(SOURCE, "SynkCommAllReduce", TARGET)
            _state["ok"] = True
        except Exception as exc:  # no JAX, no compiler, a failed build: the caller's other path
            log.info("synk_comm.xla_cpu: the in-program all-reduce is not available (%s)", exc)
            _state["ok"] = False
    return bool(_state["ok"])


class Segment:
    """A group's shared segment for :func:`all_reduce`: three pages of counters, a page of weights
    and process ids, then two buffers of ``capacity`` bytes per rank and two result buffers (see
    ``xla_cpu_all_reduce.cc``).

    Make it with :meth:`create` in one rank, :meth:`attach` in the others (by :attr:`name`);
    :meth:`close` in each, the creator last (it unlinks).
    """

    def __init__(self, shared: Any, size: int, capacity: int) -> None:
        self._shared = shared
        self.size = size
        self.capacity = capacity
        self.address = int(shared.array.ctypes.data)
        self._rows = shared.view((size, 8), "float64", offset=3 * PAGE)  # a cache line per rank
        self._counters = shared.view((3, PAGE // 8), "uint64")[:, :8 * size:8]  # posted, done, reduced: a line per rank

    @staticmethod
    def nbytes(size: int, capacity: int) -> int:
        return 4 * PAGE + 2 * (size + 1) * capacity

    @classmethod
    def create(cls, size: int, capacity: int = 1 << 22) -> Segment:
        """A new zeroed segment for ``size`` ranks, ``capacity`` bytes a buffer (arrays larger than
        that take one exchange per ``capacity`` bytes)."""
        from synk_shm import SharedArray

        if not 1 <= size <= MAX_RANKS:
            raise ValueError(f"a segment holds 1 to {MAX_RANKS} ranks, not {size}")
        if capacity < 64 or capacity % 64:
            raise ValueError(f"capacity must be a positive multiple of 64 bytes, not {capacity}")
        shared = SharedArray.create(cls.nbytes(size, capacity), "uint8")
        shared.array[:4 * PAGE] = 0
        segment = cls(shared, size, capacity)
        segment._rows[:, 0] = np.nan  # no rank in a call yet
        return segment

    @classmethod
    def attach(cls, name: str, size: int, capacity: int = 1 << 22) -> Segment:
        from synk_shm import SharedArray

        return cls(SharedArray.attach(name, cls.nbytes(size, capacity), "uint8"), size, capacity)

    @property
    def name(self) -> str:
        return str(self._shared.name)

    def set_weight(self, rank: int, weight: float) -> None:
        """Rank ``rank``'s weight for its next all-reduces (and its process id, which its peers
        check while they wait)."""
        row = self._rows[rank]
        row[0] = weight
        row[1:2].view(np.int64)[0] = os.getpid()

    def clear_weight(self, rank: int) -> None:
        """Rank ``rank`` is out of its call: its all-reduces are the identity until the next
        :meth:`set_weight` (a program called outside a call of the group)."""
        self._rows[rank, 0] = np.nan

    def realign(self) -> None:
        """After an all-reduce stopped with an error (some ranks posted a call that others never
        reached): every rank's counters to the furthest call posted, so that the next all-reduce
        pairs the ranks again.  Only while no rank is inside a program of the group (the master,
        once every rank has ended the failed command)."""
        self._counters[:] = self._counters[0].max()

    def close(self) -> None:
        del self._rows, self._counters  # no view may outlive the mapping
        if self._shared.owner:
            self._shared.unlink()
        self._shared.close()


def all_reduce(x: Any, op: str, segment: Segment, rank: int, size: int, abort_address: int = 0,
               ordered: bool = True) -> Any:
    """``op`` (``"sum"``, ``"prod"``, ``"max"``, ``"min"``, ``"avg"``) of every rank's ``x``, as a JAX
    expression to use inside a jitted function (a custom call; :func:`available` first).

    A rank of weight 0 contributes the op's identity; ``avg`` is ``sum_r w_r x_r / sum_r w_r``
    (NaN where every weight is 0).  ``abort_address``: an int64 word in shared memory that, once
    non-zero, stops the waits (the group's abort flag); 0 for none.  ``ordered``: declare the call
    with side effects, so that JAX runs a program's all-reduces in its order and never merges two;
    without (60-190 us a call faster) only for a program that holds exactly one.
    """
    import jax

    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, not {op!r}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=ordered)
    return call(x, segment=np.int64(segment.address), abort=np.int64(abort_address), rank=np.int64(rank),
                size=np.int64(size), capacity=np.int64(segment.capacity), op=np.int64(OPS[op]))
