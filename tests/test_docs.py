"""The docs: generated pages are current, code on the pages runs, the site builds with -W."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ntkcore import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_backends_page_is_generated_from_support_table():
    page = DOCS / "backends.md"
    assert page.read_text(encoding="utf-8") == cli.support_markdown(), (
        "docs/backends.md is stale: run `python -m ntkcore support --out docs/backends.md`")


def test_support_declared_at_definitions():
    """Each row of the table is declared by ``@capabilities`` on the object it describes; the
    framework modules' declarations are read from their source without importing torch/JAX/Dask,
    and equal what the decorator registers when the module is imported."""
    code = (
        "import sys\n"
        "for m in ('torch', 'jax', 'dask', 'distributed', 'zarr', 'cupy'): sys.modules[m] = None\n"
        "from ntkcore import support\n"
        "sys.stdout.write(support.support_markdown())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (DOCS / "backends.md").read_text(encoding="utf-8")

    import ntkcore
    from ntkcore import support
    from ntkcore.regression import kernel_regression

    assert list(support.SUPPORT) == list(support.ROWS)
    assert support._REGISTRY["kernel_regression"][0] == "ntkcore.regression.kernel_regression"
    assert support._REGISTRY["analysis.kernel_alignment"][0] == (
        "ntkcore.analysis.kernel_alignment")
    assert support.capabilities(name="kernel_regression")(kernel_regression) is kernel_regression
    with pytest.raises(ValueError, match="declared twice"):
        support.capabilities(name="kernel_regression")(ntkcore.gram)
    with pytest.raises(ValueError, match="unknown backend"):
        support.capabilities(missing=("numpyy",))
    pytest.importorskip("torch")
    import ntkcore.backends.torch_seng  # registers backends.torch.SENG

    from_source = dict(support._declared_in_source("ntkcore.backends.torch_seng"))
    assert support._REGISTRY["backends.torch.SENG"][1] == from_source["backends.torch.SENG"]
    assert support.supports("backends.torch.SENG", "torch")
    assert not support.supports("backends.torch.SENG", "numpy")


def test_every_page_is_in_a_toctree():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^([a-z][\w-]*)$", index, re.M))
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    assert pages <= listed, f"pages missing from the toctree: {sorted(pages - listed)}"


#: ``ntkcore.a.b`` in a role ({func}`...`), an autodoc directive or inline code
DOTTED = re.compile(r"(\{(?:func|class|meth|attr|data|exc)\}`~?|\.\. auto\w+:: +|`)"
                    r"(ntkcore(?:\.\w+)+)")


def _resolve(name: str):
    """``name`` as a user's ``import``, then attribute access, reaches it: import the longest
    importable module prefix (``import ntkcore.gram``), then ``getattr`` from ``ntkcore``."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    obj = importlib.import_module("ntkcore")
    for attr in parts[1:]:
        obj = getattr(obj, attr)
    return obj


def test_documented_names_resolve():
    """Every dotted ``ntkcore.…`` name the pages write works as written (``ntkcore.gram`` is
    the function, which shadows the module: ``ntkcore.gram.plan_gram`` does not exist)."""
    names = {(m.group(2), p.name) for p in DOCS.glob("*.md")
             for m in DOTTED.finditer(p.read_text(encoding="utf-8"))}
    bad = []
    for name, page in sorted(names):
        if name.startswith("ntkcore.backends.") and \
                importlib.util.find_spec(name.split(".")[2]) is None:
            continue  # a framework that is not installed
        try:
            _resolve(name)
        except Exception as e:
            bad.append(f"{page}: {name}: {e!r}")
    assert not bad, bad
    assert ("ntkcore.plan_gram", "api.md") in names


def test_plan_gram_spellings():
    """The spellings docs/api.md gives for the planner name the same objects."""
    import ntkcore
    from ntkcore.gram import GramPlan, plan_gram

    assert ntkcore.plan_gram is plan_gram and ntkcore.GramPlan is GramPlan
    j = ntkcore.DenseBlock(__import__("numpy").ones((3, 2, 4)))
    assert isinstance(ntkcore.plan_gram(j, mode="trace"), ntkcore.GramPlan)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_getting_started_code_runs():
    """The python blocks of getting-started.md, run in order as one script (they assert)."""
    text = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    assert "assert" in code
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_sphinx_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = tmp_path / "html"
    r = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    for page in ("index", "getting-started", "concepts", "math", "backends", "architecture",
                 "api", "examples", "changelog"):
        assert (out / f"{page}.html").is_file(), page
    api = (out / "api.html").read_text(encoding="utf-8")
    for name in ("ntkcore.ntk", "ntkcore.kernel_regression", "ntkcore.smw_solve",
                 "ntkcore.Jacobian", "ntkcore.gram", "ntkcore.trace_share", "SENG",
                 "ntkcore.distributed.ntk_dask"):
        assert name in api, name
    assert 'class="math' in (out / "math.html").read_text(encoding="utf-8")


def test_intersphinx_links_the_ecosystem():
    import runpy

    conf = runpy.run_path(str(DOCS / "conf.py"))
    assert "sphinx.ext.intersphinx" in conf["extensions"]
    mapping = conf["intersphinx_mapping"]
    assert {"numpy", "scipy", "torch", "jax", "dask"} <= set(mapping)
    for url, _inventories in mapping.values():
        assert url.startswith("https://")


def test_api_page_documents_distributed():
    """Every public name of ntkcore.distributed has an autodoc entry on the API page."""
    pytest.importorskip("dask")
    pytest.importorskip("zarr")
    import ntkcore.distributed as nd

    page = (DOCS / "api.md").read_text(encoding="utf-8")
    assert ".. automodule:: ntkcore.distributed" in page
    missing = [n for n in nd.__all__
               if not re.search(rf"\.\. auto\w+:: ntkcore\.distributed\.{n}$", page, re.M)]
    assert not missing, missing
