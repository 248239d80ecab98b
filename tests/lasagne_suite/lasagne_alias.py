"""A pytest plugin that runs Lasagne's own tests against synk_lasagne: import renames only.

``import lasagne...`` imports ``synk_lasagne...`` and ``import theano...`` imports ``pytensor...``
(Theano's modules under their PyTensor names: :data:`RENAMES`); ``mock`` is ``unittest.mock``
(the Python 2 backport the suite imports).  No test and no assertion is changed.  Load it with
``-p lasagne_alias`` (this directory on ``PYTHONPATH``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

RENAMES = {
    "lasagne": "synk_lasagne",
    "theano": "pytensor",
    "theano.scan_module": "pytensor.scan",
    "theano.scan_module.scan_utils": "pytensor.graph.basic",
    "theano.tensor.shared_randomstreams": "pytensor.tensor.random.utils",
    "theano.sandbox.rng_mrg": "pytensor.tensor.random.utils",
    "mock": "unittest.mock",
}
"""Module names of the suite -> the modules they are; a name not listed renames its first part."""

THEANO_NAMES = {
    "Variable": ("lasagne_alias", "TheanoVariable"),
}
"""Names of Theano's top-level module -> where PyTensor has them (the rest: ``pytensor``'s own)."""


@functools.cache
def _variable_class() -> type:
    from pytensor.graph.basic import Variable

    class TheanoVariable(Variable):  # type: ignore[misc]
        """PyTensor's ``Variable`` with Theano's signature: ``owner`` defaults to None."""

        def __init__(self, type: Any, owner: Any = None, index: int | None = None, name: str | None = None) -> None:
            super().__init__(type, owner, index, name)

    return TheanoVariable


def __getattr__(name: str) -> Any:
    if name == "TheanoVariable":  # made on first use: the plugin imports PyTensor only when the suite does
        return _variable_class()
    raise AttributeError(name)


def _is_same_graph(var1: Any, var2: Any, givens: Any = None) -> bool:
    """Theano's ``gof.graph.is_same_graph`` under its PyTensor name, ``equal_computations``."""
    from pytensor.graph.basic import equal_computations

    if givens:
        raise NotImplementedError("is_same_graph with givens has no PyTensor counterpart")
    return bool(equal_computations([var1], [var2]))


def _gof() -> ModuleType:
    """``theano.gof``: PyTensor's ``pytensor.graph``, with ``gof.graph`` its ``basic`` module plus
    ``is_same_graph``."""
    import pytensor.graph
    import pytensor.graph.basic

    gof = ModuleType("theano.gof")
    vars(gof).update(vars(pytensor.graph))
    graph = ModuleType("theano.gof.graph")
    vars(graph).update(vars(pytensor.graph.basic))
    graph.is_same_graph = _is_same_graph  # type: ignore[attr-defined]
    gof.graph = graph  # type: ignore[attr-defined]
    return gof


ABSENT_BACKENDS = {"theano.gpuarray": {"pygpu_activated": False}}
"""Theano's GPU back ends, which PyTensor does not have: each a module that says it is not active
(the suite then takes its CPU paths, as on a Theano without a GPU)."""


class _TheanoModule(ModuleType):
    """``theano``: PyTensor's top-level module under Theano's name, with :data:`THEANO_NAMES`."""

    def __getattr__(self, name: str) -> Any:
        if name == "gof":
            return _gof()
        if name in THEANO_NAMES:
            module, attr = THEANO_NAMES[name]
            return getattr(importlib.import_module(module), attr)
        return getattr(importlib.import_module("pytensor"), name)


def target(name: str) -> str | None:
    """The module that ``name`` imports, or None for a name this plugin leaves alone."""
    if name in RENAMES:
        return RENAMES[name]
    head, _, rest = name.partition(".")
    if head in ("lasagne", "theano") and rest:
        return f"{RENAMES[head]}.{rest}"
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, real: str) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.real)
        self.spec = module.__spec__
        if spec.name == "theano":
            proxy = _TheanoModule("theano")
            proxy.__path__ = []  # a package: its submodules come from the finder
            return proxy
        return module

    def exec_module(self, module: ModuleType) -> None:
        if isinstance(module, _TheanoModule):
            return
        module.__spec__ = self.spec  # the import system set the alias's spec: the module keeps its own


class _AbsentLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = ModuleType(spec.name)
        vars(module).update(ABSENT_BACKENDS[spec.name])
        return module

    def exec_module(self, module: ModuleType) -> None:
        pass


class AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves the suite's module names to synk_lasagne's and PyTensor's modules."""

    def find_spec(self, fullname: str, path: Any = None, target_: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in ABSENT_BACKENDS:
            return importlib.machinery.ModuleSpec(fullname, _AbsentLoader())
        real = target(fullname)
        if real is None:
            return None
        try:
            importlib.import_module(real)
        except ImportError:
            return None  # the suite's own ImportError: a module PyTensor / synk_lasagne does not have
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(real))
        real_module = sys.modules[real]
        if hasattr(real_module, "__path__"):
            spec.submodule_search_locations = []
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())


install()
