"""Sphinx configuration: Markdown pages (MyST), API reference from numpy-style docstrings."""

from __future__ import annotations

from pathlib import Path

import ntkcore

project = "ntkcore"
author = "the ntkcore developers"
release = ntkcore.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autosummary_generate = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
suppress_warnings = ["myst.header"]
nitpicky = False


# Pages written by other tools that may be absent from a checkout: docs/benchmarks.md (rendered
# by `python -m benchmarks --render`) and docs/distributed.md.  Their toctree entries are
# dropped when the file is missing, so that `sphinx-build -W` does not fail on a fresh clone.
OPTIONAL_PAGES = ("benchmarks", "distributed")
_HERE = Path(__file__).resolve().parent


def _drop_missing_pages(app, docname, source):
    if docname != "index":
        return
    missing = {p for p in OPTIONAL_PAGES if not (_HERE / f"{p}.md").is_file()}
    if missing:
        lines = source[0].splitlines()
        source[0] = "\n".join(ln for ln in lines if ln.strip() not in missing) + "\n"


def setup(app):
    app.connect("source-read", _drop_missing_pages)
    return {"parallel_read_safe": True}
