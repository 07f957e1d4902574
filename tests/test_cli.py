"""The ``ntkcore`` command line: exit codes, info, support table, demo against a dense reference."""

from __future__ import annotations

import json
import os
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


def test_bench_forwards_to_runner(capsys):
    if cli.source_root() is None:
        pytest.skip("not a source checkout")
    assert cli.main(["bench", "--list"]) == 0


def test_bench_help_names_the_command(tmp_path):
    """``ntkcore bench --help`` prints ``usage: ntkcore bench``, ``python -m benchmarks
    --help`` its own name (both in a fresh process: the runner is a subprocess)."""
    if cli.source_root() is None:
        pytest.skip("not a source checkout")
    root = cli.source_root()
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("NTKCORE_BENCH_PROG", None)
    for cmd, usage in ((["-m", "ntkcore", "bench", "--help"], "usage: ntkcore bench"),
                       (["-m", "benchmarks", "--help"], "usage: python -m benchmarks")):
        r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env,
                           cwd=root, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(usage), r.stdout[:200]


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


def test_demo_budget_too_small_is_a_clear_error(capsys):
    """`demo --max-memory 1kB` planned 790,653 one-sample tiles; now: exit 1 at once, the
    message quoting the value and the smallest budget that works."""
    import time

    t0 = time.perf_counter()
    code = cli.main(["demo", "--n-train", "200", "--n-test", "30", "--width", "16",
                     "--no-progress", "--no-plot", "--max-memory", "1kB"])
    assert code == 1 and time.perf_counter() - t0 < 30
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


def test_default_plot_is_outside_the_repo():
    root = Path(__file__).resolve().parent.parent
    assert root not in cli.DEFAULT_PLOT.resolve().parents


@pytest.mark.parametrize("module, extra", [("sklearn.datasets", "bench"), ("torch", "torch")])
def test_missing_package_names_the_extra_for_a_wheel_install(module, extra, monkeypatch,
                                                             capsys):
    """After `pip install ntkcore` there is no source tree: the message names the extra as a
    wheel user installs it, not `pip install -e ".[bench]"`."""
    monkeypatch.setitem(sys.modules, module, None)  # the import fails as if not installed
    assert cli.main(["demo", "--no-plot", "--no-progress", "--n-train", "20"]) == 1
    err = capsys.readouterr().err
    assert f'pip install "ntkcore[{extra}]"' in err and "-e" not in err.split("needs", 1)[1]


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
