"""Sphinx configuration of the Synkhronos documentation (built by ``nox -s docs``, warnings as errors).

Local additions, defined at the end of this file:

* the ``synk-package`` directive writes a package's API reference: its docstring, then one section per
  submodule that imports (``:optional:`` for a package still being written: what does not import is
  left out with a note instead of failing the build);
* a ``missing-reference`` handler that follows an object to where it is documented, so that a
  docstring may name ``synk_shm.Data`` while the reference documents ``synk_shm.data.Data``.  A name
  that imports but is documented nowhere (a private helper, numpy) becomes plain code; a name that
  does not import at all stays a broken reference, which ``-n -W`` turns into a failed build;
* small fixes of napoleon's reading of NumPy-style docstrings, and of class signatures;
* pages named in ``OPTIONAL_PAGES`` join the main table of contents once their file exists.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import pkgutil
import re
from importlib import metadata
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import make_refnode

log = logging.getLogger(__name__)

project = "Synkhronos"
author = "the Synkhronos developers"
copyright = "2017 Adam Stooke (Synkhronos 1.0); the Synkhronos developers"
try:
    release = metadata.version("synk-theano")
except metadata.PackageNotFoundError:  # pragma: no cover - the packages are not installed
    release = "unknown"
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []
pygments_style = "sphinx"

# --- API reference -------------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the docstrings give the types in words (NumPy style)
autodoc_preserve_defaults = True
add_module_names = False
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_param = False  # parameter types as plain text, not cross-references to "optional" & co
napoleon_use_rtype = False
napoleon_use_keyword = False
# "Attributes" as a field list like "Parameters": types in words stay text ("list of shared
# variables"), and "rank, size : int" documents several names at once.
napoleon_custom_sections = [("Attributes", "params_style")]

# Optional GPU libraries are not installed where the docs build: references to them stay plain text.
nitpick_ignore_regex = [(r"py:.*", r"(jax|jaxlib|nccl|cupy|torch|cuda)(\..*)?")]

# --- Markdown (benchmarks/RESULTS.md is included as it is) ---------------------------------------------
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# --- HTML ----------------------------------------------------------------------------------------------
html_theme = "alabaster"
html_static_path = ["_static"]
html_title = f"Synkhronos {release}"
html_theme_options = {
    "description": "Data-parallel PyTensor functions on the GPUs or CPU cores of a machine",
    "fixed_sidebar": True,
    "page_width": "1300px",
    "sidebar_width": "250px",
    "body_max_width": "none",
}
html_css_files = ["custom.css"]
html_sidebars = {"**": ["about.html", "navigation.html", "relations.html", "searchbox.html"]}


# --- the synk-package directive ------------------------------------------------------------------------

def _public_modules(package: Any) -> set[str]:
    """Submodules that define something in the package's ``__all__``."""
    found = set()
    for name in getattr(package, "__all__", []):
        obj = getattr(package, name, None)
        module = getattr(obj, "__module__", None)
        if isinstance(module, str) and module.startswith(package.__name__ + "."):
            found.add(module)
    return found


class SynkPackage(SphinxDirective):
    """``.. synk-package:: name``: the docstring of package ``name``, then its submodules' members.

    Each object is documented once, in the module that defines it (``:members:`` follows each
    module's ``__all__``).  Modules from which the package exports names come first.
    """

    required_arguments = 1
    option_spec = {"optional": directives.flag}

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        optional = "optional" in self.options
        try:
            package = importlib.import_module(name)
        except Exception as exc:
            if not optional:
                raise self.error(f"package {name} does not import: {exc!r}") from exc
            log.info("synk-package: %s does not import (%r); left out", name, exc)
            self._insert([".. note::", "",
                          f"   ``{name}`` is not part of this build yet (it does not import: "
                          f"``{type(exc).__name__}``); its reference appears here once it does.", ""])
            return []
        lines = [f".. automodule:: {name}", ""]
        modules = sorted(m.name for m in pkgutil.iter_modules(package.__path__, name + ".")
                         if not m.name.rsplit(".", 1)[1].startswith("_"))
        public = _public_modules(package)
        skipped = []
        if optional:
            importable = []
            for module in modules:
                try:
                    importlib.import_module(module)
                except Exception as exc:
                    skipped.append(f"``{module}`` ({type(exc).__name__})")
                    log.info("synk-package: %s does not import (%r); left out", module, exc)
                else:
                    importable.append(module)
            modules = importable
        groups = [("Public modules", [m for m in modules if m in public]),
                  ("Implementation modules", [m for m in modules if m not in public])]
        for title, members in groups:
            if not members:
                continue
            lines += [title, "-" * len(title), ""]
            for module in members:
                heading = f"``{module}``"
                lines += [heading, "~" * len(heading), "",
                          f".. automodule:: {module}", "   :members:", "   :special-members: __call__", ""]
        if skipped:
            lines += [".. note::", "", "   Not documented yet because they do not import in this build: "
                      + ", ".join(skipped) + ".", ""]
        self._insert(lines)
        return []

    def _insert(self, lines: list[str]) -> None:
        source = f"<synk-package {self.arguments[0]}>"
        self.state_machine.insert_input(StringList(lines, source), source)


# --- references that follow an object to where it is documented -------------------------------------

def _canonical(obj: Any) -> str | None:
    if inspect.ismodule(obj):
        return obj.__name__
    if inspect.isclass(obj) or inspect.isfunction(obj):
        qualname = getattr(obj, "__qualname__", "")
        if "<locals>" not in qualname:
            return f"{obj.__module__}.{qualname}"
    return None


def _sets_attribute(cls: type, attr: str) -> bool:
    """True if the source of ``cls`` or of a base assigns or annotates ``self.attr`` (an instance attribute)."""
    for klass in inspect.getmro(cls):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attr)}\b\s*[:=,]", source) is not None:
            return True
    return False


def _import_name(dotted: str) -> str | None:
    """The canonical dotted name of what ``dotted`` names, or None if it does not import."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception:
            continue
        name = module_name
        rest = parts[i:]
        for k, attr in enumerate(rest):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                # An instance attribute (set in __init__, described in the class docstring's
                # Attributes section) has no target of its own: the reference goes to its class.
                if k == len(rest) - 1 and inspect.isclass(obj) and _sets_attribute(obj, attr):
                    return name
                return None
            name = _canonical(obj) or f"{name}.{attr}"
        return name
    if len(parts) == 1 and hasattr(builtins, dotted):
        return f"builtins.{dotted}"
    return None


def _resolve(app: Sphinx, env: Any, node: Any, contnode: nodes.Node) -> nodes.Node | None:
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [c for c in (module and cls and f"{module}.{cls}.{target}", module and f"{module}.{target}",
                              target) if c]
    domain = env.get_domain("py")
    fromdoc = node["refdoc"]
    for candidate in candidates:
        canonical = _import_name(candidate)
        if canonical is None:
            continue
        if canonical in domain.objects:
            entry = domain.objects[canonical]
            return make_refnode(app.builder, fromdoc, entry.docname, entry.node_id, contnode, canonical)
        if canonical in domain.modules:
            entry = domain.modules[canonical]
            return make_refnode(app.builder, fromdoc, entry.docname, entry.node_id, contnode, canonical)
        return contnode  # a real object that the reference does not document: plain code, no link
    # A short name used in a module that does not import it (a docstring's "Raises" entry): the one
    # documented object of that name.
    matches = [name for name in domain.objects if name.endswith("." + target)]
    if len(matches) == 1:
        entry = domain.objects[matches[0]]
        return make_refnode(app.builder, fromdoc, entry.docname, entry.node_id, contnode, matches[0])
    return None


# --- napoleon and NumPy-style docstrings ------------------------------------------------------------

_SINGLE_COLON = re.compile(r"(?<!:):(?!:)")
_UNDERLINE = re.compile(r"^\s*(-{3,}|={3,})\s*$")
_known_sections: set[str] = set()


def _napoleon_sections(app: Sphinx) -> set[str]:
    if not _known_sections:
        from sphinx.ext.napoleon.docstring import NumpyDocstring

        _known_sections.update(NumpyDocstring([], app.config)._sections)
    return _known_sections


def _before_napoleon(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Two quirks of napoleon with NumPy-style docstrings, undone before it runs.

    * A property's first line "Text: more text" is prose, not Google style's "type: description";
      an empty comment in front keeps it as it is.
    * A section napoleon does not know ("Data patterns" under a dashed line) would become a section
      title inside a class or function, which docutils does not allow there: it becomes a rubric.
      (Module docstrings keep their sections: they are pages of their own.)
    """
    if what in {"attribute", "data", "property"} and lines and _SINGLE_COLON.search(lines[0]):
        lines[:0] = ["..", ""]
    if what == "module":
        return
    known = _napoleon_sections(app)
    for i in range(len(lines) - 1):
        title = lines[i].strip()
        if (title and _UNDERLINE.match(lines[i + 1]) and len(lines[i + 1].strip()) >= len(title)
                and title.lower() not in known):
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            lines[i], lines[i + 1] = f"{indent}.. rubric:: {title}", ""


def _no_annotations(app: Sphinx, what: str, name: str, obj: Any, options: Any, signature: str | None,
                    return_annotation: str | None) -> tuple[str, None] | None:
    """A class's signature without annotations: ``autodoc_typehints = "none"`` misses those of a
    dataclass's generated ``__init__``."""
    if what not in {"class", "exception"} or not signature or ":" not in signature:
        return None
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    empty = inspect.Parameter.empty
    bare = sig.replace(parameters=[p.replace(annotation=empty) for p in sig.parameters.values()],
                       return_annotation=inspect.Signature.empty)
    return str(bare), None


# --- pages that other work may add ---------------------------------------------------------------------

OPTIONAL_PAGES = ["reliability"]
"""Pages listed in the main table of contents, after the last entry, only once their file exists."""


def _optional_pages(app: Sphinx, docname: str, source: list[str]) -> None:
    if docname != root_doc:
        return
    here = app.srcdir
    extra = "".join(f"   {page}\n" for page in OPTIONAL_PAGES
                    if any((here / f"{page}{suffix}").exists() for suffix in source_suffix))
    source[0] = source[0].replace("   troubleshooting\n", "   troubleshooting\n" + extra, 1)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("synk-package", SynkPackage)
    app.connect("missing-reference", _resolve)
    app.connect("autodoc-process-docstring", _before_napoleon, priority=400)  # napoleon's runs at 500
    app.connect("autodoc-process-signature", _no_annotations)
    app.connect("source-read", _optional_pages)
    return {"parallel_read_safe": True}
