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


def test_every_page_is_in_a_toctree():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^([a-z][\w-]*)$", index, re.M))
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    assert pages <= listed, f"pages missing from the toctree: {sorted(pages - listed)}"


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
                 "ntkcore.Jacobian", "ntkcore.gram", "ntkcore.trace_share", "SENG"):
        assert name in api, name
    assert 'class="math' in (out / "math.html").read_text(encoding="utf-8")
