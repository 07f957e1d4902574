"""The ``ntkcore`` command line: exit codes, info, support table, demo against a dense reference."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ntkcore import cli
from ntkcore.support import BACKENDS, SUPPORT

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["demo", "--model", "rnn"],
    ["demo", "--n-train", "0"],
    ["demo", "--n-train", "many"],
    ["demo", "--ridge", "-1"],
    ["demo", "--max-memory", "lots"],
    ["demo", "--dtype", "float16"],
    ["support", "--out", "a.md", "--check", "b.md"],
    ["info", "--bogus"],
])
def test_bad_arguments_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["demo", "--n-train", "5", "--no-plot"], "--n-train must be at least 10"),
    (["demo", "--out", "plot.txt"], "--out must name a .png"),
    (["support", "--check", "/nonexistent/backends.md"], "does not exist"),
])
def test_runtime_errors_exit_1(argv, needle, capsys):
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert needle in err and err.startswith("ntkcore ")


def test_help_and_version(capsys):
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    import ntkcore

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ntkcore {ntkcore.__version__}"


def test_python_m_ntkcore_runs():
    r = subprocess.run([sys.executable, "-m", "ntkcore", "nope"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ntkcore", "support"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == cli.support_markdown()


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["packages"]["numpy"] == np.__version__
    backends = {b["backend"]: b for b in info["backends"]}
    assert set(backends) == {"numpy", "torch", "cupy", "jax", "generic"}
    assert backends["torch"]["version"] == torch.__version__
    names = [d["name"] for d in backends["torch"]["devices"]]
    assert names[0] == "cpu"
    assert sum(n.startswith("cuda") for n in names) == (
        torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert info["cpu_count"] >= 1


def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("ntkcore", "backends and devices", "BLAS", "numpy", "torch"):
        assert word in out


def test_support_table_matches_declaration():
    md = cli.support_markdown()
    # parse the summary matrix back and compare with SUPPORT cell by cell
    lines = md.splitlines()
    head = lines.index("| function | " + " | ".join(BACKENDS) + " |")
    rows = {}
    for line in lines[head + 2:]:
        if not line.startswith("| `"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    assert set(rows) == set(SUPPORT)
    for fn, cells in rows.items():
        assert cells == ["yes" if SUPPORT[fn][b].ok else "no" for b in BACKENDS], fn
    for fn, entries in SUPPORT.items():
        for entry in entries.values():
            if entry.ok and entry.fast_path:
                assert f"`{entry.fast_path}`" in md, (fn, entry.fast_path)


def test_support_out_and_check(tmp_path, capsys):
    path = tmp_path / "backends.md"
    assert cli.main(["support", "--out", str(path)]) == 0
    assert path.read_text() == cli.support_markdown()
    assert cli.main(["support", "--check", str(path)]) == 0
    path.write_text(path.read_text() + "edited\n")
    assert cli.main(["support", "--check", str(path)]) == 1
    assert "differs" in capsys.readouterr().err


def test_bench_passes_its_arguments_to_asv(capfd):
    """``ntkcore bench ARGS`` is ``asv ARGS`` in the checkout (asv's own version line)."""
    if cli.source_root() is None:
        pytest.skip("not a source checkout")
    pytest.importorskip("asv")
    assert cli.main(["bench", "--version"]) == 0
    assert "asv" in capfd.readouterr().out


def test_bench_without_checkout(monkeypatch, capsys):
    monkeypatch.setattr(cli, "source_root", lambda: None)
    assert cli.main(["bench", "--quick"]) == 1
    assert "source checkout" in capsys.readouterr().err


def _dense_reference(net, x):
    """(N, O, P) Jacobian by torch.func, parameters in named_parameters order, and the
    number of parameters of each module (for the layer shares)."""
    from torch.func import functional_call, jacrev, vmap

    params = {k: v.detach() for k, v in net.named_parameters()}

    def f(p, xn):
        return functional_call(net, p, (xn[None],))[0]

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    parts = [jac[k].reshape(x.shape[0], 10, -1) for k in params]
    owners = [k.rsplit(".", 1)[0] for k in params]
    return torch.cat(parts, dim=2), [p.shape[2] for p in parts], owners


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_demo_matches_dense_reference(model, tmp_path):
    n, m = 50, 40
    out = tmp_path / "sub" / "demo.png"
    res = cli.run_demo(model=model, n_train=n, n_test=m, width=24, ridge=1e-3, dtype="float64",
                       device="cpu", seed=3, out=out, progress=False, verbose=False)

    x_tr, x_te, y_tr, y_te = cli.demo_data(n, seed=3, n_test=m)
    net = cli.demo_model(model, width=24, seed=3).double()
    jtr, sizes, owners = _dense_reference(net, torch.as_tensor(x_tr))
    jte, _, _ = _dense_reference(net, torch.as_tensor(x_te))
    jtr, jte = jtr.numpy(), jte.numpy()
    k = np.einsum("nop,mop->nm", jtr, jtr)
    ks = np.einsum("nop,mop->nm", jte, jtr)
    reg = 1e-3 * np.mean(np.diag(k))
    y = np.eye(10)[y_tr]
    pred = (ks @ np.linalg.solve(k + reg * np.eye(n), y)).argmax(1)

    assert res.n_train == n and res.n_test == m == len(y_te)
    assert res.num_params == jtr.shape[2]
    assert res.predictions == pred.tolist()
    assert res.accuracy == pytest.approx(np.mean(pred == y_te))
    assert res.accuracy > 0.7  # an eNTK on 60 digits is far better than chance (0.1)

    # layer shares: per-module share of trace(K) from the dense Jacobian
    per_param = np.split(jtr, np.cumsum(sizes)[:-1], axis=2)
    share: dict[str, float] = {}
    for owner, jb in zip(owners, per_param, strict=True):
        share[owner] = share.get(owner, 0.0) + float(np.sum(jb * jb))
    ref = np.array(list(share.values())) / sum(share.values())
    np.testing.assert_allclose(res.layer_shares, ref, rtol=1e-10)
    assert [name.split(":")[0] for name in res.layer_names] == list(share)

    assert res.kernel_bytes == (n * n + len(y_te) * n) * 8
    assert res.plot == str(out) and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res.times["total"] >= res.times["kernel"] > 0


def test_demo_cli_prints_report(tmp_path, capsys):
    out = tmp_path / "d.png"
    code = cli.main(["demo", "--n-train", "40", "--n-test", "30", "--width", "16", "--no-progress",
                     "--out", str(out), "--max-memory", "50MB"])
    assert code == 0
    text = capsys.readouterr().out
    for word in ("accuracy", "kernel", "memory", "time", str(out)):
        assert word in text
    assert out.is_file()


def test_demo_budget_too_small_is_a_clear_error(capsys, monkeypatch):
    """`demo --max-memory 1kB` planned 790,653 one-sample tiles; now: exit 1 at once, the
    message quoting the value and the smallest budget that works."""
    import sys

    tiles = []  # no route contracts a tile: the budget is refused first
    for route in sys.modules["ntkcore.gram"].ROUTES.values():
        monkeypatch.setattr(route, "tile", lambda *a, _t=route.tile, **k:
                            tiles.append(1) or _t(*a, **k))
    code = cli.main(["demo", "--n-train", "200", "--n-test", "30", "--width", "16",
                     "--no-progress", "--no-plot", "--max-memory", "1kB"])
    assert code == 1 and not tiles
    err = capsys.readouterr().err
    assert "max_memory='1kB' (1000 bytes) is too small" in err and "max_memory >= " in err


def test_demo_json(capsys):
    assert cli.main(["demo", "--n-train", "30", "--n-test", "20", "--width", "8", "--no-plot",
                     "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n_train"] == 30 and res["plot"] is None
    assert abs(sum(res["layer_shares"]) - 1) < 1e-9


def test_demo_cuda_unavailable(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert cli.main(["demo", "--device", "cuda", "--no-plot", "--no-progress"]) == 1
    assert "CUDA" in capsys.readouterr().err


VICTIM = b"not yours to overwrite\n"
TINY_DEMO = ["demo", "--n-train", "20", "--n-test", "10", "--width", "8", "--no-progress"]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """``tmp_path`` as the temporary directory of this process (``tempfile.gettempdir()``),
    holding a symbolic link at the demo's old fixed plot name to a victim file."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "victim.png").write_bytes(VICTIM)
    (tmp_path / "ntkcore-demo.png").symlink_to(tmp_path / "victim.png")
    return tmp_path


def test_demo_default_plot_is_a_fresh_private_directory(private_tmp, capsys):
    """Without --out the plot goes to ntkcore-demo.png in a new mode-0700 directory of the
    temporary directory, printed in the report, a different one on each run; the link
    planted at the old fixed name $TMPDIR/ntkcore-demo.png is not followed (CWE-377)."""
    plots = []
    for _ in range(2):
        assert cli.main(TINY_DEMO) == 0
        printed = [line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines()
                   if line.strip().startswith("plot ")]
        assert len(printed) == 1
        plots.append(Path(printed[0]))
    for plot in plots:
        assert plot.name == "ntkcore-demo.png" and plot.parent.parent == private_tmp
        assert plot.parent.name.startswith("ntkcore-demo-")
        assert plot.parent.stat().st_mode & 0o777 == 0o700
        assert not plot.is_symlink() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert sorted(p.name for p in plot.parent.iterdir()) == ["ntkcore-demo.png"]
    assert plots[0] != plots[1]  # two runs never share a file
    root = Path(__file__).resolve().parent.parent
    assert root not in plots[0].resolve().parents
    assert (private_tmp / "ntkcore-demo.png").is_symlink()
    assert (private_tmp / "victim.png").read_bytes() == VICTIM


def test_demo_out_symlink_is_refused(private_tmp, capsys):
    """An --out that is a symbolic link is refused at once (exit 1, before any work); its
    target is untouched."""
    link = private_tmp / "ntkcore-demo.png"
    assert cli.main([*TINY_DEMO, "--out", str(link)]) == 1
    captured = capsys.readouterr()
    assert "is a symbolic link" in captured.err and str(link) in captured.err
    assert "accuracy" not in captured.out
    assert (private_tmp / "victim.png").read_bytes() == VICTIM
    with pytest.raises(OSError, match="is a symbolic link"):
        cli.run_demo(n_train=20, n_test=10, width=8, out=link, progress=False, verbose=False)


def test_write_new_never_follows_a_link_planted_during_the_write(tmp_path):
    """The file is written beside the target and renamed over it: a link planted at the
    target after the check is replaced, not followed; a failed write leaves nothing."""

    from ntkcore.cli.output import write_new, write_text

    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    target = tmp_path / "sub" / "out.txt"

    def race(tmp):
        Path(tmp).write_text("mine", encoding="utf-8")
        target.symlink_to(victim)  # another user's link, planted mid-write

    assert write_new(target, race) == target
    assert not target.is_symlink() and target.read_text(encoding="utf-8") == "mine"
    assert victim.read_bytes() == VICTIM
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # as open(path, "w") would give
    write_text(target, "again")
    assert target.read_text(encoding="utf-8") == "again"

    def fail(tmp):
        Path(tmp).write_text("half", encoding="utf-8")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_new(target, fail)
    assert target.read_text(encoding="utf-8") == "again"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.txt"]  # no leftovers
    with pytest.raises(OSError, match="is a directory"):
        write_new(tmp_path / "sub", lambda tmp: None)
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(OSError, match=r"is a symbolic link \(to .*victim\)"):
        write_text(tmp_path / "link", "x")
    assert victim.read_bytes() == VICTIM


@pytest.mark.parametrize("missing, hint", [
    ("sklearn.datasets", 'pip install "ntkcore[bench]"'),
    ("torch", 'pip install torch "ntkcore[bench]"'),
])
def test_missing_package_hint_installs_everything_the_demo_needs(missing, hint, monkeypatch,
                                                                 capsys):
    """After `pip install ntkcore` there is no source tree: the message names one command, as
    a wheel user types it (not `pip install -e ".[bench]"`), that installs all the demo
    imports: the bench extra (scikit-learn, matplotlib, tqdm, ...) and torch when torch is
    missing (not otherwise: the hint must not replace an installed torch build)."""
    monkeypatch.setitem(sys.modules, missing, None)  # the import fails as if not installed
    assert cli.main(["demo", "--no-plot", "--no-progress", "--n-train", "20"]) == 1
    err = capsys.readouterr().err
    package = {"sklearn.datasets": "scikit-learn", "torch": "torch"}[missing]
    assert f"needs {package} (" in err
    assert err.rstrip().endswith(f"install everything the demo needs with: {hint}"), err
    assert "-e" not in err.split("needs", 1)[1]


def test_bench_extra_holds_what_the_demo_imports():
    """The hint's extra really holds the demo's imports (all but torch), per pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~ \[]", req, maxsplit=1)[0] for req in extras["bench"]}
    assert {"scikit-learn", "matplotlib", "tqdm"} <= names
    assert "torch" not in names  # hence "torch" in the hint when it is missing


def test_matplotlib_missing_prints_the_hint(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main([*TINY_DEMO, "--out", str(tmp_path / "p.png")]) == 0
    err = capsys.readouterr().err
    assert 'matplotlib not installed: no plot; pip install "ntkcore[bench]" installs it' in err
    assert not (tmp_path / "p.png").exists()


def test_info_blas_columns_stay_apart(monkeypatch, capsys):
    """A long version (threadpoolctl reports scipy-openblas as 0.3.31.188.0) no longer runs
    into the thread count: library, version, threads and path are columns two spaces apart
    at least, aligned across the pools."""
    pools = [{"library": "openblas", "version": "0.3.31.188.0", "threads": 2,
              "path": "/lib/libscipy_openblas64_.so"},
             {"library": "openmp", "version": None, "threads": 1, "path": "/lib/libgomp.so.1"},
             {"library": "mkl", "version": "2024.2", "threads": 16, "path": "/lib/libmkl.so"}]
    monkeypatch.setattr(cli, "_blas_facts", lambda: pools)
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.split("BLAS thread pools (threadpoolctl)\n", 1)[1]
    lines = lines.splitlines()[:3]
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines]
    assert cells == [["openblas", "0.3.31.188.0", "2 threads", "/lib/libscipy_openblas64_.so"],
                     ["openmp", "-", "1 thread", "/lib/libgomp.so.1"],
                     ["mkl", "2024.2", "16 threads", "/lib/libmkl.so"]]
    for i in (1, 2, 3):  # aligned: each column starts at one offset on every line
        assert len({line.index(c[i]) for line, c in zip(lines, cells, strict=True)}) == 1, lines


def test_info_free_memory_is_the_backends_figure(monkeypatch, capsys):
    """info reports what Backend.free_memory says (the figure default budgets are a share of)."""
    from ntkcore.backend import get_backend

    backend = get_backend(torch)
    monkeypatch.setattr(type(backend), "free_memory", lambda self, device: 12345 * 2**20)
    assert cli.main(["info", "--json"]) == 0
    facts = {b["backend"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    assert [d["free"] for d in facts["torch"]["devices"]] == [12345 * 2**20] * len(
        facts["torch"]["devices"])
    assert all(d["gpu"] == d["name"].startswith("cuda") for d in facts["torch"]["devices"])
