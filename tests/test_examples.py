"""Every script in examples/ runs in its quick mode (``--quick``) in a fresh process.

Each runs with a temporary directory as working directory and as ``TMPDIR``, so default plot
paths and any scratch files land there, never in the repository.  The names the scripts once
wrote to in the temporary directory hold symbolic links to a victim file or folder during
each run: the victims must come out untouched (CWE-377), the outputs land in fresh private
directories whose paths the scripts print.  For the two eNTK regression
examples the printed numbers are checked too, and for trak_digits.py the measurements it
writes (check_trak_quick); test_trak_scores_primal_equals_kernel_form checks its formulas.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
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


#: The fixed names in the temporary directory the scripts wrote to before issue 29.
OLD_NAMES = {"ntk_regression_digits.py": "ntk_regression_digits.png",
             "same_result_backends.py": "same_result_backends.png",
             "trak_digits.py": "trak_digits"}
VICTIM = b"not yours to overwrite\n"


def plant_links(tmp_path: Path) -> dict[Path, Path]:
    """A symbolic link at each old fixed name in ``tmp_path`` (the run's TMPDIR), to a victim
    file (a folder holding one, for the folder name); ``{link: victim file}``."""
    victims = tmp_path / "victims"
    victims.mkdir()
    links = {}
    for name in OLD_NAMES.values():
        target = victims / name
        if target.suffix:
            target.write_bytes(VICTIM)
            victim = target
        else:  # a folder: the script would write trak_digits.json / .png into it
            target.mkdir()
            victim = target / "trak_digits.json"
            victim.write_bytes(VICTIM)
        (tmp_path / name).symlink_to(target)
        links[tmp_path / name] = victim
    return links


def check_victims(links: dict[Path, Path]) -> None:
    """The links are still links, the victims hold what they held, and nothing was added
    beside them (a script that followed the folder link would have left its plot there)."""
    for link, victim in links.items():
        assert link.is_symlink(), link
        assert victim.read_bytes() == VICTIM, victim
        assert sorted(p.name for p in victim.parent.iterdir()) == (
            sorted(OLD_NAMES.values()) if victim.parent.name == "victims"
            else [victim.name]), victim.parent


def printed_output(stdout: str, label: str, tmp_path: Path) -> Path:
    """The path a script printed after ``label:``, checked to be a fresh private directory
    (mode 0700) of the run's TMPDIR."""
    found = re.findall(rf"^{label}: (\S+)", stdout, re.M)
    assert found, stdout[-2000:]
    path = Path(found[-1])
    fresh = path.parent
    assert fresh.parent == tmp_path and fresh.name.startswith("ntkcore-"), path
    assert fresh.stat().st_mode & 0o777 == 0o700, oct(fresh.stat().st_mode)
    assert path.is_file() and not path.is_symlink(), path
    return path


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"ntk_regression_digits.py", "same_result_backends.py"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_quick(path, tmp_path):
    for mod in ("torch", "sklearn", *NEEDS.get(path.name, ())):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{path.name} needs {mod}")
    links = plant_links(tmp_path)
    r = run_example(path, tmp_path)
    assert r.returncode == 0, f"{path.name} --quick failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    check_victims(links)

    if path.name == "ntk_regression_digits.py":
        accs = [float(a) for a in re.findall(r"test accuracy\s+([\d.]+)%", r.stdout)]
        assert len(accs) == 6, r.stdout  # 3 classifiers x 2 models
        assert min(accs) > 85.0, r.stdout  # chance is 10%; the eNTK alone is far above it
        png = printed_output(r.stdout, "plot", tmp_path)
        assert png.name == "ntk_regression_digits.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if path.name == "trak_digits.py":
        check_trak_quick(printed_output(r.stdout, "results", tmp_path).parent)
    if path.name == "same_result_backends.py":
        # the script itself exits 1 unless every implementation matches NumPy to 1e-9
        assert "within the tolerance" in r.stdout, r.stdout
        assert re.search(r"torch nn\.Module\s+torch\.Tensor", r.stdout), r.stdout
        png = printed_output(r.stdout, "plot", tmp_path)
        assert png.name == "same_result_backends.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_trak_quick(out: Path) -> None:
    """trak_digits.py --quick: it writes only into its output folder ``out``, the rank
    correlation of projected with exact scores grows with dim, and top proponents share the
    test label more often than chance.

    Rank correlations (Spearman, per test image) are paired by seed and test image across
    consecutive dims.  Every seed's mean must grow, and the pooled paired differences must
    have a t statistic above 4 (images of one seed share a projection, so the pooled t
    overstates the evidence somewhat; the per-seed condition does not depend on it).  The
    label check is against the binomial null: under random labels the share of the top-k of m
    test images that carry the test label has mean ``chance`` and standard error
    ``sqrt(chance (1 - chance) / (k m))``; the share must exceed it by 4 of those."""
    assert sorted(p.name for p in out.iterdir()) == ["trak_digits.json", "trak_digits.png"]
    res = json.loads((out / "trak_digits.json").read_text(encoding="utf-8"))
    rows = [r for r in res["rows"] if r["seed"] != "ensemble"]
    dims = sorted({r["dim"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    assert len(dims) >= 2 and len(seeds) >= 2, res["args"]
    rho = np.array([[next(r["spearman"] for r in rows if r["dim"] == d and r["seed"] == s)
                     for s in seeds] for d in dims])  # (dims, seeds, test images)
    assert rho.shape[2] == res["m_exact"]
    for lo, hi in itertools.pairwise(rho):
        diff = hi - lo
        assert np.all(diff.mean(axis=1) > 0), (dims, rho.mean(axis=2))
        t = diff.mean() / (diff.std(ddof=1) / np.sqrt(diff.size))
        assert t > 4, (dims, rho.mean(axis=2), t)
    share, k = res["label_share"], res["args"]["top_k"]
    se = np.sqrt(share["chance"] * (1 - share["chance"]) / (k * res["m_exact"]))
    assert share["exact_top"] > share["chance"] + 4 * se, share


def test_trak_scores_primal_equals_kernel_form():
    """The example's two score formulas agree when the projection is exact (Phi = J):
    ``trak_scores`` on the dense per-sample margin gradients J (torch.func, float64; more
    samples than parameters, so feature_regression solves the primal P x P system) and
    ``kernel_scores`` on ntkcore's eNTK of the ``Margin`` model (the dual N x N system, by the
    push-through identity) both equal ``J_*(J^T J + lam I)^{-1} J^T diag(q)`` from a direct
    NumPy solve, within the first-order bound for a solve of condition ``cond(K + lam I)``
    plus the kernel's rounding amplified by it (tests/tolerances.py).  ``Margin`` is checked
    against ``log(p / (1 - p))``."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sklearn") is None:
        pytest.skip("needs torch and scikit-learn")
    import torch

    import ntkcore
    from tests.tolerances import kernel_tol, solve_tol

    spec = importlib.util.spec_from_file_location("trak_digits", ROOT / "examples" /
                                                  "trak_digits.py")
    trak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trak)
    x_tr, x_te, y_tr, y_te = ntkcore.cli.demo.demo_data(400, n_test=30)
    net = ntkcore.cli.demo.demo_model("mlp", width=3).double()
    x_tr, x_te = torch.as_tensor(x_tr), torch.as_tensor(x_te)
    margin = trak.Margin(net, x_tr.shape[1])
    z_tr, z_te = trak.with_labels(x_tr, y_tr), trak.with_labels(x_te, y_te)
    q = trak.loss_weights(net, x_tr, y_tr)

    with torch.no_grad():
        p = net(x_te).softmax(1)[torch.arange(len(y_te)), torch.as_tensor(y_te)]
        np.testing.assert_allclose(margin(z_te)[:, 0], torch.log(p / (1 - p)), rtol=1e-12)
    params = {name: v.detach() for name, v in margin.named_parameters()}

    def f(w, z):
        return torch.func.functional_call(margin, w, (z[None],))[0, 0]

    def jac(z):
        g = torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(params, z)
        return torch.cat([v.reshape(len(z), -1) for v in g.values()], dim=1)

    j_tr, j_te = jac(z_tr), jac(z_te)
    n, num_params = j_tr.shape
    assert num_params < n  # the primal side of feature_regression
    k = j_tr @ j_tr.T
    lam = 1e-3 * float(torch.mean(torch.diagonal(k)))
    a = j_tr.numpy()
    ref = j_te.numpy() @ np.linalg.solve(a.T @ a + lam * np.eye(num_params), a.T * q.numpy())

    primal = trak.trak_scores(j_tr, q, j_te, lam)
    kernel = trak.kernel_scores(ntkcore.ntk(margin, z_tr, mode="trace"), q,
                                ntkcore.ntk(margin, z_te, z_tr, mode="trace"), lam)
    w = np.linalg.eigvalsh(k.numpy())
    cond = (w.max() + lam) / (max(w.min(), 0.0) + lam)
    tol = solve_tol(torch.float64, cond, computations=2) + cond * kernel_tol(
        torch.float64, num_params, computations=2)
    for got in (primal, kernel):
        assert got.shape == (len(y_te), n) and got.dtype == torch.float64
        err = np.linalg.norm(got.numpy() - ref) / np.linalg.norm(ref)
        assert err <= tol, (err, tol, cond)


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
    # the scripts' --help runs side by side: each is mostly the interpreter importing torch
    procs = {path: subprocess.Popen([sys.executable, str(path), "--help"], cwd=tmp_path,
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for path in EXAMPLES}
    for path, proc in procs.items():
        flags = documented[path.name]
        if "savefig" in path.read_text(encoding="utf-8"):
            assert "--out" in flags, path.name
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err[-2000:]
        missing = [f for f in flags if f not in out]
        assert not missing, f"{path.name} --help lacks {missing}"


def test_symlink_at_out_is_refused_before_any_work(tmp_path):
    """An existing symbolic link given as ``--out`` is a usage error (exit 2, the message
    says so) before the script computes anything; the link's target is untouched."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sklearn") is None:
        pytest.skip("needs torch and scikit-learn")
    links = plant_links(tmp_path)
    env = dict(os.environ, MPLBACKEND="Agg", TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    procs = {name: subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / name), "--quick", "--out",
         str(tmp_path / old)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for name, old in OLD_NAMES.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 2, (name, out[-2000:], err[-2000:])
        assert "is a symbolic link" in err and "does not write through a link" in err, err
        assert "digits:" not in out, out  # refused before loading anything
    check_victims(links)
