"""Every script in examples/ runs in its quick mode (``--quick``) in a fresh process.

Each runs with a temporary directory as working directory and as ``TMPDIR``, so default plot
paths and any scratch files land there, never in the repository.  For the two eNTK regression
examples the printed numbers are checked too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT = 300  # seconds per script; --quick promises well under a minute on 2 idle cores

# modules an example needs beyond the test extra (skip, not fail, when absent)
NEEDS = {
    "dask_ntk.py": ("dask", "distributed", "zarr"),
}


def run_example(path: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPLBACKEND="Agg", TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(path), "--quick", *extra], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"ntk_regression_digits.py", "same_result_backends.py"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_quick(path, tmp_path):
    for mod in ("torch", "sklearn", *NEEDS.get(path.name, ())):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{path.name} needs {mod}")
    r = run_example(path, tmp_path)
    assert r.returncode == 0, f"{path.name} --quick failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"

    if path.name == "ntk_regression_digits.py":
        accs = [float(a) for a in re.findall(r"test accuracy\s+([\d.]+)%", r.stdout)]
        assert len(accs) == 6, r.stdout  # 3 classifiers x 2 models
        assert min(accs) > 85.0, r.stdout  # chance is 10%; the eNTK alone is far above it
        assert (tmp_path / "ntk_regression_digits.png").is_file()
    if path.name == "same_result_backends.py":
        # the script itself exits 1 unless every implementation matches NumPy to 1e-9
        assert "within the tolerance" in r.stdout, r.stdout
        assert re.search(r"torch nn\.Module\s+torch\.Tensor", r.stdout), r.stdout
        assert (tmp_path / "same_result_backends.png").is_file()


def test_bad_arguments_are_usage_errors(tmp_path):
    """A bad --models value is an argparse usage error: exit 2, message on stderr."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sklearn") is None:
        pytest.skip("needs torch and scikit-learn")
    path = ROOT / "examples" / "ntk_regression_digits.py"
    r = run_example(path, tmp_path, "--models", "RNN")
    assert r.returncode == 2 and "--models" in r.stderr


def _documented_flags() -> dict[str, list[str]]:
    """script -> flags docs/examples.md promises: --quick and --help for every script, plus
    the flags in its table row's "writes" column."""
    text = (ROOT / "docs" / "examples.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+\.py)` \| ([^|]*) \|", text, re.M)
    return {name: ["--quick", "--help", *re.findall(r"`(--[\w-]+)`", writes)]
            for name, writes in rows}


def test_examples_accept_documented_flags(tmp_path):
    """Every example is in docs/examples.md's table, accepts the flags documented there
    (its ``--help`` lists them), and a script that saves a plot documents ``--out``."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sklearn") is None:
        pytest.skip("needs torch and scikit-learn")
    documented = _documented_flags()
    assert set(documented) == {p.name for p in EXAMPLES}
    env = dict(os.environ, MPLBACKEND="Agg", TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    for path in EXAMPLES:
        flags = documented[path.name]
        if "savefig" in path.read_text(encoding="utf-8"):
            assert "--out" in flags, path.name
        r = subprocess.run([sys.executable, str(path), "--help"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr[-2000:]
        missing = [f for f in flags if f not in r.stdout]
        assert not missing, f"{path.name} --help lacks {missing}"
