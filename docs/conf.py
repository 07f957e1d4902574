"""Sphinx configuration: Markdown pages (MyST), API reference from numpy-style docstrings."""

from __future__ import annotations

import atexit
import os
import tempfile
import zlib
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
    "sphinx.ext.intersphinx",
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
# "Attributes" sections as fields of their class, not as targets: otherwise the word "shape" in
# every "array, shape (N, N)" type resolves to some class's ``shape`` attribute (ambiguous
# since several classes have one).
napoleon_use_ivar = True
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autosummary_generate = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
suppress_warnings = ["myst.header"]
nitpicky = False


# Links to the libraries ntkcore works with.  Each project's own inventory is tried first; an
# empty local one stands behind it, so that a build without network access (CI, the tests)
# gets plain text instead of links rather than a warning that `-W` turns into a failure.
# The file is new on every build (mkstemp: O_CREAT | O_EXCL, an unpredictable name), never a
# fixed name in the shared temporary directory that another user's link could redirect.
def _empty_inventory() -> str:
    fd, path = tempfile.mkstemp(prefix="ntkcore-docs-empty-", suffix=".inv")
    with os.fdopen(fd, "wb") as f:
        f.write(b"# Sphinx inventory version 2\n# Project: none\n# Version: 0\n"
                b"# The remainder of this file is compressed using zlib.\n"
                + zlib.compress(b""))
    atexit.register(lambda: Path(path).unlink(missing_ok=True))
    return path


_EMPTY = _empty_inventory()
intersphinx_mapping = {
    name: (url, (None, _EMPTY)) for name, url in (
        ("python", "https://docs.python.org/3/"),
        ("numpy", "https://numpy.org/doc/stable/"),
        ("scipy", "https://docs.scipy.org/doc/scipy/"),
        ("torch", "https://docs.pytorch.org/docs/stable/"),
        ("jax", "https://docs.jax.dev/en/latest/"),
        ("dask", "https://docs.dask.org/en/stable/"),
        ("distributed", "https://distributed.dask.org/en/stable/"),
        ("zarr", "https://zarr.readthedocs.io/en/stable/"),
    )
}
intersphinx_timeout = 10


# Pages written by other tools that may be absent from a checkout: docs/benchmarks.md
# (rendered by `python -m benchmarks.render` from asv's results) and docs/distributed.md.  Their
# toctree entries are dropped when the file is missing, so that `sphinx-build -W` does not
# fail on a fresh clone.
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
