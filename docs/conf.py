"""Sphinx configuration: the jaxckpt documentation site (``make docs``; strict: any warning fails)."""

import dataclasses
import inspect
import os
import sys
import typing

from docutils import nodes
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxckpt

logger = logging.getLogger(__name__)

project = "jaxckpt"
author = "the jaxckpt authors"
copyright = "2026, the jaxckpt authors"
release = jaxckpt.__version__
version = release

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # links to headings: [text](page.md#a-heading)

autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True}
# Defaults as written in the source (``like=NO_TEMPLATE``, ``clock=time.time``), not their reprs.
autodoc_preserve_defaults = True
# Docstrings use Google-style sections (Args:, Returns:, Attributes:); attributes as fields, not
# separate entries (a dataclass's fields are not class attributes autodoc could document).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# Strict (-W -n): a reference to a jaxckpt name that does not resolve fails the build. References to
# other libraries' types (jax, numpy, the standard library) resolve through intersphinx, which needs the
# network; without it they are let through.
nitpick_ignore_regex = [(r"py:.*", r"(?!jaxckpt\b).*")]
# The index records (dtype, shape, ...) that CheckpointView.leaves holds: the format page describes them.
nitpick_ignore = [("py:class", "jaxckpt.format.records.ArrayLeaf"), ("py:class", "jaxckpt.format.records.ValueLeaf")]

# Objects that jaxckpt returns rather than ones a user builds: their constructors take its internals
# (an opened index, a probe of the path), so the reference shows no constructor signature.
RETURNED_NOT_BUILT = {"jaxckpt.RestoreStatus", "jaxckpt.CheckpointView", "jaxckpt.ManagerView"}

html_theme = "furo"
html_title = f"jaxckpt {release}"


def _signature(app, what, name, obj, options, signature, return_annotation):
    """No constructor signature for a Protocol (it has none) or an object jaxckpt returns; defaults
    whose repr is not Python (a function, a dataclass field's factory) as the expression they stand for,
    so that the signature parses and its types link."""
    if what == "class" and (name in RETURNED_NOT_BUILT or typing.Protocol in getattr(obj, "__mro__", ())):
        return "", None
    if not signature or "<" not in signature:
        return None
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    for p in parameters:
        if callable(p.default) and hasattr(p.default, "__qualname__"):
            signature = signature.replace(repr(p.default), f"{p.default.__module__}.{p.default.__qualname__}")
    for field in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
        if field.default_factory is not dataclasses.MISSING:
            factory = getattr(field.default_factory, "__qualname__", "")
            signature = signature.replace("<factory>", f"{factory}()", 1)  # the fields in order
    return signature, return_annotation


def _internal(name: str) -> bool:
    """``name`` is in one of jaxckpt's internal modules (its layers' subpackages, ``jaxckpt._errors``...)."""
    return name.startswith("jaxckpt.") and name.split(".")[1] not in jaxckpt.__all__


def _unresolved(app, env, node, contnode):
    """References that have no page of their own: an internal module (named in a docstring for those who
    read the code: any but ``jaxckpt`` itself) shows as its name; a type variable shows as its name."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not _internal(target):
        return None
    if node["reftype"] == "mod":
        return nodes.literal(target, target)
    module, _, attr = target.rpartition(".")
    if node["reftype"] == "class" and isinstance(getattr(sys.modules.get(module), attr, None), typing.TypeVar):
        return contnode
    return None


def _docstring(app, what, name, obj, options, lines):
    """A constant that ``jaxckpt`` re-exports takes the ``#:`` comment where it is defined (without one,
    autodoc shows the docstring of its type: ``int``'s)."""
    if what != "data" or not name.startswith("jaxckpt."):
        return
    attr = name.rpartition(".")[2]
    for module in sorted(m for m in sys.modules if _internal(m)):
        try:
            comment = ModuleAnalyzer.for_module(module).find_attr_docs().get(("", attr))
        except PycodeError:  # a module without source
            continue
        if comment is not None and getattr(sys.modules[module], attr, None) is obj:
            lines[:] = list(comment)
            return


def public_members(cls: type) -> list[str]:
    """The public attributes of a public class that jaxckpt defines (not those of ``object``, ``Exception``
    or ``Protocol``): each must have an entry in the reference. A dataclass's fields are its
    signature's parameters, which its docstring describes."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return sorted(
        attr
        for attr in dir(cls)
        if not attr.startswith("_")
        and attr not in fields
        and any(attr in vars(k) and k.__module__.startswith("jaxckpt") for k in cls.__mro__)
    )


def _check_reference(app, env):
    """Every name of ``jaxckpt.__all__`` and every public member of its classes is documented."""
    documented = set(env.domains["py"].objects)
    for name in jaxckpt.__all__:
        if f"jaxckpt.{name}" not in documented:
            logger.warning("jaxckpt.%s is not in the API reference (docs/api.md)", name)
            continue
        obj = getattr(jaxckpt, name)
        if isinstance(obj, type):
            for attr in public_members(obj):
                if f"jaxckpt.{name}.{attr}" not in documented:
                    logger.warning("jaxckpt.%s.%s is not in the API reference (a docstring?)", name, attr)


def setup(app):
    app.connect("env-check-consistency", _check_reference)
    app.connect("autodoc-process-docstring", _docstring)
    app.connect("autodoc-process-signature", _signature)
    app.connect("missing-reference", _unresolved)
