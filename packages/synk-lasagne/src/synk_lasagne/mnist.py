"""Data for the MNIST example: the standard MNIST IDX files, or scikit-learn's digits.

=========================  =====================================================================
:func:`load`               MNIST from ``data_dir`` (or ``$SYNK_MNIST_DIR``); without either, the
                           8x8 handwritten digits bundled with scikit-learn (and it says so)
:func:`load_mnist`         the four IDX files of a directory (gzipped or not)
:func:`load_digits`        scikit-learn's digits, split into train / validation / test
:func:`read_idx`           one IDX file as a numpy array
:class:`Dataset`           what they return: float images in [0, 1], int32 labels
=========================  =====================================================================

The IDX files are the ones of http://yann.lecun.com/exdb/mnist/ under their usual names
(``train-images-idx3-ubyte`` and ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
``t10k-labels-idx1-ubyte``, each possibly with ``.gz``; the dotted variant ``train-images.idx3-ubyte``
works too).  The last 10,000 training images are the validation set, as in Lasagne's example.

Example
-------
>>> from synk_lasagne import mnist
>>> data = mnist.load(quiet=True)      # no MNIST files here: scikit-learn's digits  # doctest: +SKIP
>>> data.x_train.shape, data.source                                                  # doctest: +SKIP
((1257, 64), 'scikit-learn digits (8x8)')
"""

from __future__ import annotations

import gzip
import os
import sys
from dataclasses import dataclass

import numpy as np

__all__ = ["Dataset", "ENV_VAR", "load", "load_digits", "load_mnist", "read_idx"]

ENV_VAR = "SYNK_MNIST_DIR"
"""The environment variable that names a directory of MNIST IDX files."""

FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}

_IDX_TYPES: dict[int, str] = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


@dataclass
class Dataset:
    """Images (rows of ``prod(image_shape)`` floats in [0, 1]) and int32 labels 0..9."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_valid: np.ndarray
    y_valid: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    image_shape: tuple[int, int]
    source: str

    @property
    def n_classes(self) -> int:
        return 10

    def astype(self, dtype: str) -> Dataset:
        """The same data with images of ``dtype`` (e.g. ``pytensor.config.floatX``)."""
        return Dataset(self.x_train.astype(dtype), self.y_train, self.x_valid.astype(dtype), self.y_valid,
                       self.x_test.astype(dtype), self.y_test, self.image_shape, self.source)


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """One IDX file (gzipped when its name ends in ``.gz``) as a numpy array.

    Raises
    ------
    ValueError
        If the file is not IDX (bad magic number, unknown type, or the wrong size).
    """
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an IDX file (magic bytes {raw[:4]!r})")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(int)
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    offset = 4 + 4 * ndim
    count = int(np.prod(dims))
    if len(raw) - offset != count * dtype.itemsize:
        raise ValueError(f"{path}: the header announces {tuple(dims)} values of {dtype}, the file has "
                         f"{len(raw) - offset} bytes of data")
    values = np.frombuffer(raw, dtype=dtype, count=count, offset=offset).reshape(tuple(dims))
    return values.astype(values.dtype.newbyteorder("="))


def _find(directory: str, stem: str) -> str | None:
    dotted = stem.replace("-idx", ".idx")
    for name in (stem, stem + ".gz", dotted, dotted + ".gz"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def load_mnist(directory: str | os.PathLike[str], n_valid: int | None = None) -> Dataset:
    """MNIST from the four IDX files in ``directory``.

    Parameters
    ----------
    directory : str or path
    n_valid : int, optional
        The last ``n_valid`` training images become the validation set; default 10,000 (a sixth
        of the training images when there are fewer than 60,000).

    Raises
    ------
    FileNotFoundError
        Naming the files that are missing.
    """
    directory = os.fspath(directory)
    paths = {key: _find(directory, stem) for key, stem in FILES.items()}
    missing = [FILES[key] for key, path in paths.items() if path is None]
    if missing:
        raise FileNotFoundError(f"no MNIST files {missing} (optionally .gz) in {directory!r}")
    arrays = {key: read_idx(path) for key, path in paths.items() if path is not None}
    x_train, x_test = arrays["x_train"], arrays["x_test"]
    if x_train.ndim != 3 or x_test.ndim != 3 or x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"MNIST images must be (n, rows, cols); got {x_train.shape} and {x_test.shape}")
    if len(arrays["y_train"]) != len(x_train) or len(arrays["y_test"]) != len(x_test):
        raise ValueError("MNIST labels and images differ in number")
    if n_valid is None:
        n_valid = min(10000, len(x_train) // 6)
    if not 0 < n_valid < len(x_train):
        raise ValueError(f"n_valid={n_valid} must be in (0, {len(x_train)})")
    shape = (int(x_train.shape[1]), int(x_train.shape[2]))
    flat = [x.reshape(len(x), -1).astype(np.float32) / 255.0 for x in (x_train, x_test)]
    y_train, y_test = (arrays[k].astype(np.int32) for k in ("y_train", "y_test"))
    cut = len(x_train) - n_valid
    return Dataset(flat[0][:cut], y_train[:cut], flat[0][cut:], y_train[cut:], flat[1], y_test, shape,
                   f"MNIST ({directory})")


def load_digits(seed: int = 0, test_fraction: float = 0.2, valid_fraction: float = 0.1) -> Dataset:
    """scikit-learn's 1,797 handwritten digits (8x8, values 0..16), shuffled and split.

    Raises
    ------
    ImportError
        Without scikit-learn (``pip install synk-lasagne[mnist]``).
    """
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the digits fallback needs scikit-learn: pip install 'synk-lasagne[mnist]' (or give "
                          f"MNIST IDX files with --data-dir / ${ENV_VAR})") from exc
    digits = sk_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = round(test_fraction * len(x))
    n_valid = round(valid_fraction * len(x))
    n_train = len(x) - n_test - n_valid
    a, b = n_train, n_train + n_valid
    return Dataset(x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:], (8, 8), "scikit-learn digits (8x8)")


def load(data_dir: str | os.PathLike[str] | None = None, quiet: bool = False) -> Dataset:
    """MNIST from ``data_dir`` or ``$SYNK_MNIST_DIR``; otherwise scikit-learn's digits, with a note.

    Raises
    ------
    FileNotFoundError
        If a directory is given (argument or environment) but lacks the MNIST files.
    """
    directory = os.fspath(data_dir) if data_dir is not None else os.environ.get(ENV_VAR) or None
    if directory is not None:
        return load_mnist(directory)
    if not quiet:
        sys.stdout.write(f"note: no MNIST directory given (--data-dir or ${ENV_VAR}): using the 8x8 handwritten "
                         "digits bundled with scikit-learn instead (1,797 images)\n")
        sys.stdout.flush()
    return load_digits()
