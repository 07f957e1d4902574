"""Packaging: an SPDX license with its file, the PEP 561 marker in the wheel and
classifiers (pyproject.toml), checked in the file and in a wheel built from it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_is_an_spdx_expression_with_its_file(pyproject):
    project = pyproject["project"]
    assert project["license"] == "BSD-3-Clause"  # a string, not the deprecated {text = ...}
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("BSD 3-Clause License") and "Neither the name" in text
    # setuptools refuses a License :: classifier beside an SPDX expression
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    assert any(r.startswith("setuptools>=77") for r in pyproject["build-system"]["requires"])


def test_typed_marker_is_package_data(pyproject):
    assert (ROOT / "ntkcore" / "py.typed").is_file()
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["ntkcore"]
    assert "Typing :: Typed" in pyproject["project"]["classifiers"]


def test_classifiers_and_no_guessed_urls(pyproject):
    project = pyproject["project"]
    # no public address yet: any URL here would be a guess (see the comment in pyproject.toml)
    assert "urls" not in project
    classifiers = project["classifiers"]
    assert "Programming Language :: Python :: 3.10" in classifiers  # requires-python >= 3.10
    assert any(c.startswith("Topic :: Scientific/Engineering") for c in classifiers)
    assert any(c.startswith("Development Status ::") for c in classifiers)


@pytest.mark.slow
def test_wheel_ships_marker_and_license(tmp_path):
    """A wheel built from a copy of the sources holds ntkcore/py.typed, the license file and
    ``License-Expression`` metadata."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77 or importlib.util.find_spec("wheel") is None:
        pytest.skip("needs setuptools >= 77 and wheel (the build-system requirements)")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "backends")
    shutil.copytree(ROOT / "ntkcore", src / "ntkcore", ignore=ignore)
    shutil.copytree(ROOT / "backends", src / "backends", ignore=ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("ntkcore-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "ntkcore/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: BSD-3-Clause" in meta
    assert "Classifier: Typing :: Typed" in meta
