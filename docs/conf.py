"""Sphinx configuration: the jaxckpt documentation site (``make docs``; strict: any warning fails)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxckpt  # noqa: E402

project = "jaxckpt"
author = "the jaxckpt authors"
copyright = "2026, the jaxckpt authors"
release = jaxckpt.__version__
version = release

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # links to headings: [text](page.md#a-heading)

autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}

# Strict (-W -n): a reference to a jaxckpt name that does not resolve fails the build. References to
# other libraries' types (jax, numpy, the standard library) resolve through intersphinx, which needs the
# network; without it they are let through.
nitpick_ignore_regex = [(r"py:.*", r"(?!jaxckpt\b).*")]

html_theme = "furo"
html_title = f"jaxckpt {release}"
