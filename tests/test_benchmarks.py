"""The benchmark runner: a ``--quick`` run on numpy and torch CPU, its JSON schema, the
renderer, failure isolation of suites, the peak-memory helper and the BLAS-environment rule.

No timing is asserted anywhere (the machine is shared); numbers that are checked are exact
facts (schema, statuses, byte counts of a known allocation, relative errors).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import _harness, render  # noqa: E402
from benchmarks import run as runner  # noqa: E402
from tests.tolerances import solve_tol  # noqa: E402

ROW_TYPES = {
    "suite": str,
    "case": str,
    "impl": str,
    "backend": str,
    "device": str,
    "dtype": str,
    "params": dict,
    "note": str,
}
OPTIONAL_NUMBERS = ("median_s", "min_s", "max_s", "peak_mem_bytes", "flops", "roofline_flops",
                    "error")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--backend", "numpy",
         "--backend", "torch", "--device", "cpu", "--blas-env", "keep", "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    doc["_path"] = str(out)
    return doc


def test_quick_run_top_level_schema(quick_results: dict) -> None:
    doc = quick_results
    for key in ("schema_version", "created", "command", "machine", "config", "gemm", "suites",
                "rows", "machine_slug"):
        assert key in doc, key
    assert doc["config"]["quick"] is True
    assert doc["config"]["backends"] == ["numpy", "torch"]
    m = doc["machine"]
    assert m["cpu_logical"] >= 1 and isinstance(m["versions"], dict)
    assert "numpy" in m["versions"] and "torch" in m["versions"]
    assert isinstance(m["blas"], list)
    # the quick run keeps the caller's environment: nothing was re-executed
    assert m["env_before_reexec"] is None
    got = {(g["backend"], g["dtype"]) for g in doc["gemm"]}
    assert got == {("numpy", "float32"), ("numpy", "float64"), ("torch", "float32"),
                   ("torch", "float64")}
    for g in doc["gemm"]:
        assert g["gflops"] > 0 and g["min_s"] <= g["median_s"] <= g["max_s"]


def test_every_suite_ran(quick_results: dict) -> None:
    suites = quick_results["suites"]
    assert "regression" in suites
    problems = {n: (i["status"], i.get("error", "")[-600:]) for n, i in suites.items()
                if i["status"] != "ok"}
    assert not problems, problems
    counted = sum(i["n_rows"] for i in suites.values())
    assert counted == len(quick_results["rows"])


def test_rows_schema(quick_results: dict) -> None:
    rows = quick_results["rows"]
    assert rows
    for r in rows:
        for key, typ in ROW_TYPES.items():
            assert isinstance(r[key], typ), (key, r)
        assert r["backend"] in ("numpy", "torch", "jax", "cupy"), r
        for key in OPTIONAL_NUMBERS:
            if key in r and r[key] is not None:
                assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r)
        if "median_s" in r:
            assert 0 <= r["min_s"] <= r["median_s"] <= r["max_s"]
            assert r["repeats"] >= 1
        if r.get("baseline"):
            same_case = {x["impl"] for x in rows
                         if (x["suite"], x["case"], x["device"]) == (r["suite"], r["case"],
                                                                     r["device"])}
            assert r["baseline"] in same_case, r


def test_regression_rows_are_accurate(quick_results: dict) -> None:
    rows = [r for r in quick_results["rows"] if r["suite"] == "regression"]
    impls = {(r["case"].split()[0], r["impl"], r["backend"]) for r in rows}
    for expected in [("fit+predict", "ntkcore", "numpy"), ("fit+predict", "scipy.cho_factor",
                     "numpy"), ("fit+predict", "numpy.linalg.solve", "numpy"),
                     ("fit+predict", "ntkcore", "torch"), ("backward", "ntkcore", "torch"),
                     ("backward", "torch.linalg.solve", "torch")]:
        assert expected in impls
    from benchmarks.suites import regression

    for r in rows:
        # float32 against a float64 reference, to first order (tests/tolerances.py): rounding
        # the kernels and the solve give eps * cond(K + reg I) each; the gradient
        # -A^{-1} K_*^T R alpha^T has two solves and R = 2 (K_* alpha - Y_*), whose relative
        # error is that of alpha times |K_* alpha| / |K_* alpha - Y_*|
        n, m, k = r["params"]["N"], r["params"]["M"], r["params"]["K"]
        backward = r["case"].startswith("backward")
        p = regression._problem(n, m, k, seed=1 if backward else 0)
        a = p["k_train"] + regression.REG * np.eye(n)
        c = np.linalg.cond(a)
        if backward:
            pred = p["k_test"] @ np.linalg.solve(a, p["y"])
            amp = np.linalg.norm(pred) / np.linalg.norm(pred - p["y_test"])
            assert r["error"] <= solve_tol(np.float32, c, computations=2) * (2 + amp), r
        else:
            assert r["error"] <= solve_tol(np.float32, c, computations=2), r
        assert r["dtype"] == "float32" and r["device"] == "cpu"
        assert "peak_mem_bytes" in r


def test_render_writes_tables_and_plots(quick_results: dict, tmp_path: Path) -> None:
    out = render.render([Path(quick_results["_path"])], docs=tmp_path)
    text = out.read_text()
    assert "median (min–max)" in text and "peak memory" in text and "GEMM %" in text
    assert "### regression" in text and "No GPU results yet" in text
    pngs = list((tmp_path / "img").glob("*.png"))
    assert pngs
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def _doc(rows: list[dict]) -> dict:
    return {"gemm": [{"backend": "numpy", "device": "cpu", "dtype": "float32",
                      "gflops": 100.0}], "rows": rows}


def _r(impl: str, t: float, **kw) -> dict:
    base = {"suite": "s", "case": "c N=10", "impl": impl, "backend": "numpy", "device": "cpu",
            "dtype": "float32", "params": {"N": 10}, "note": "", "median_s": t, "min_s": t,
            "max_s": t}
    base.update(kw)
    return base


def test_render_derived_columns() -> None:
    rows = render.derive(_doc([
        _r("base", 2.0, peak_mem_bytes=400),
        _r("ours", 0.5, baseline="base", flops=25e9, peak_mem_bytes=100,
           target="speedup >= 3"),
        _r("slow", 4.0, baseline="base", target="mem_ratio < 1"),
    ]))
    ours = rows[1]
    assert ours["_speedup"] == pytest.approx(4.0)
    assert ours["_gemm_fraction"] == pytest.approx(0.5)  # 50 GFLOP/s of 100
    assert ours["_mem_ratio"] == pytest.approx(0.25)
    assert ours["_target_ok"] is True
    assert rows[2]["_speedup"] == pytest.approx(0.5)
    assert rows[2]["_target_ok"] is None  # no memory measured: cannot be judged
    assert render.family(ours) == "c"


def test_failing_suites_are_reported_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _harness.Config(quick=True)

    def boom(cfg: _harness.Config) -> list:
        _harness.row("boom", "c", "i", backend="numpy", device="cpu", dtype="float32")
        raise RuntimeError("suite exploded")

    def slow(cfg: _harness.Config) -> list:
        _harness.row("slow", "c", "i", backend="numpy", device="cpu", dtype="float32")
        time.sleep(5)
        return []

    monkeypatch.setitem(sys.modules, "fake_boom", types.SimpleNamespace(run=boom))
    monkeypatch.setitem(sys.modules, "fake_slow", types.SimpleNamespace(run=slow))
    info = runner.run_suite("boom", "fake_boom", cfg, None)
    assert info["status"] == "error" and "suite exploded" in info["error"]
    assert len(info["rows"]) == 1  # rows emitted before the failure are kept
    info = runner.run_suite("missing", "benchmarks.suites.no_such_suite_xyz", cfg, None)
    assert info["status"] == "import-error" and info["rows"] == []
    info = runner.run_suite("slow", "fake_slow", cfg, 0.3)
    assert info["status"] == "timeout" and len(info["rows"]) == 1
    assert info["wall_s"] < 4


def test_discover_lists_suites() -> None:
    found = runner.discover()
    assert found["regression"] == "benchmarks.suites.regression"
    assert "peers" in found


@pytest.mark.parametrize("fresh", [True, False])
def test_peak_memory_measures_a_known_allocation(fresh: bool) -> None:
    nbytes = 96 * 2**20
    got = _harness.peak_memory("benchmarks._harness:alloc_case", {"nbytes": nbytes},
                               fresh=fresh)
    assert got is not None
    assert 0.9 * nbytes <= got <= 1.25 * nbytes + 8 * 2**20


def test_peak_memory_reports_failure_as_none() -> None:
    assert _harness.peak_memory("benchmarks._harness:no_such_case", {}, fresh=True) is None


def test_blas_guards_removed_only_in_timing_runs() -> None:
    env = _env(OPENBLAS_CORETYPE="Haswell", OPENBLAS_L2_SIZE="1048576")
    cmd = [sys.executable, "-m", "benchmarks", "--print-env"]
    timing = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    got = json.loads(timing.stdout.strip().splitlines()[-1])
    assert got["env"] == {"OPENBLAS_CORETYPE": None, "OPENBLAS_L2_SIZE": None}
    assert got["env_before_reexec"] == {"OPENBLAS_CORETYPE": "Haswell",
                                        "OPENBLAS_L2_SIZE": "1048576"}
    quick = subprocess.run([*cmd, "--quick"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    got = json.loads(quick.stdout.strip().splitlines()[-1])
    assert got["env"] == {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576"}
    assert got["env_before_reexec"] is None


def test_neural_tangents_peer_matches_reference() -> None:
    from benchmarks.peers import nt, suite

    ok, why = nt.status()
    if not ok:
        pytest.skip(why)
    p = suite.problem("MLP tiny tanh")
    results, kernels, versions = nt.run(
        p["weights"], p["biases"], p["x"], scales=p["scales"], beta=p["beta"],
        impls=(1, 2, 3), dtype="float64", repeat=1, warmup=0, memory=False, separate=False)
    assert versions["neural_tangents"].startswith("0.6")
    ref = suite.reference_ntk(p)
    assert [r["impl"] for r in results] == [1, 2, 3]
    for r in results:
        assert "error" not in r, r
        assert suite._rel(kernels[f"impl{r['impl']}"], ref) < 1e-10


def test_peers_reference_matches_autodiff() -> None:
    """The independent float64 reference of the peers suite against torch.func."""
    torch = pytest.importorskip("torch")
    from benchmarks.peers import suite

    p = suite.problem("MLP tiny tanh")
    params = [torch.tensor(a) for pair in zip(p["weights"], p["biases"], strict=True)
              for a in pair]
    x = torch.tensor(p["x"])

    def f(*flat: torch.Tensor) -> torch.Tensor:
        z = x
        for l in range(len(flat) // 2):
            w, b = flat[2 * l], flat[2 * l + 1]
            y = p["scales"][l] * z @ w.T + p["beta"] * b
            z = torch.tanh(y) if l < len(flat) // 2 - 1 else y
        return z[:, 0]

    jac = torch.autograd.functional.jacobian(f, tuple(params))
    j = torch.cat([t.reshape(x.shape[0], -1) for t in jac], dim=1).numpy()
    ref = suite.reference_ntk(p)
    assert suite._rel(j @ j.T, ref) < 1e-12


def test_suite_timeouts_respect_the_total_budget() -> None:
    args = runner.parse_args(["--suite-timeout", "420", "--total-budget", "1500"])
    assert runner._suite_timeout(args, 0.0, 8) == 420  # plenty left
    assert runner._suite_timeout(args, 1000.0, 3) == pytest.approx(380.0)  # 1500-1000-2*60
    assert runner._suite_timeout(args, 1490.0, 2) == 60.0  # every suite keeps a minute
    quick = runner.parse_args(["--quick"])
    assert runner._suite_timeout(quick, 0.0, 8) is None
    off = runner.parse_args(["--suite-timeout", "0", "--total-budget", "0"])
    assert runner._suite_timeout(off, 0.0, 8) is None


# --------------------------------------------------------------------------------------------
# results survive a stopped suite; case selection; long calls


def _fake_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run_fn, *extra: str) -> dict:
    """Run ``runner.main`` on one in-memory suite ``fake`` (no GEMM measurement)."""
    monkeypatch.setitem(sys.modules, "fake_suite_mod", types.SimpleNamespace(run=run_fn))
    monkeypatch.setattr(runner, "discover", lambda: {"fake": "fake_suite_mod"})
    monkeypatch.setattr(runner, "measure_gemm", lambda cfg: [])
    out = tmp_path / "fake.json"
    rc = runner.main(["--suite", "fake", "--backend", "numpy", "--blas-env", "keep",
                      "--no-memory", "--out", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def _fake_row(case: str) -> dict:
    return _harness.row("fake", case, "impl", backend="numpy", device="cpu", dtype="float32",
                        timing={"median_s": 1.0, "min_s": 1.0, "max_s": 1.0, "repeats": 1})


def test_rows_reach_the_file_as_soon_as_built(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    seen: dict = {}

    def suite(cfg: _harness.Config) -> list:
        rows = []
        for name in cfg.select({"case a": 1, "case b": 2, "case c": 3}):
            rows.append(_fake_row(name))
            if name == "case a":
                # what a run killed right now (SIGKILL) would leave behind
                seen.update(json.loads((tmp_path / "fake.json").read_text()))
        return rows

    doc = _fake_main(monkeypatch, tmp_path, suite)
    assert [r["case"] for r in seen["rows"]] == ["case a"]
    assert seen["complete"] is False
    info = seen["suites"]["fake"]
    assert info["status"] == "running" and info["cases_not_run"] == ["case b", "case c"]
    # the finished run: all rows, status ok, nothing listed as not run
    assert [r["case"] for r in doc["rows"]] == ["case a", "case b", "case c"]
    assert doc["suites"]["fake"]["status"] == "ok" and doc["complete"] is True
    assert "cases_not_run" not in doc["suites"]["fake"]


def test_timed_out_suite_keeps_finished_cases_and_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def suite(cfg: _harness.Config) -> list:
        for name in cfg.select({"fast": 1, "slow": 2, "never": 3}):
            if name == "slow":
                time.sleep(30)
            _fake_row(name)
        return []

    doc = _fake_main(monkeypatch, tmp_path, suite, "--suite-timeout", "0.5")
    info = doc["suites"]["fake"]
    assert info["status"] == "timeout" and info["cases_not_run"] == ["slow", "never"]
    assert [r["case"] for r in doc["rows"]] == ["fast"]
    text = render.render_doc(doc, tmp_path / "img", "img")
    assert "TIMED OUT (1/3 cases)" in text
    assert "ran past its time limit" in text and "Cases not run: `slow`, `never`" in text
    assert info["last_case"] == "fast"


def test_case_selection(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def suite(cfg: _harness.Config) -> list:
        return [_fake_row(n) for n in cfg.select({"MLP 6x512": 1, "CNN N=128": 2,
                                                  "MLP 784 full": 3})]

    doc = _fake_main(monkeypatch, tmp_path, suite, "--quick", "--case", "mlp")
    assert [r["case"] for r in doc["rows"]] == ["MLP 6x512", "MLP 784 full"]
    doc = _fake_main(monkeypatch, tmp_path, suite, "--quick", "--set", "cases=784,cnn")
    assert [r["case"] for r in doc["rows"]] == ["CNN N=128", "MLP 784 full"]
    assert doc["config"]["cases"] == ["784", "cnn"]


def test_config_flag() -> None:
    cfg = _harness.Config(extra={"a": "0", "b": "yes"})
    assert cfg.flag("a", True) is False and cfg.flag("b", False) is True
    assert cfg.flag("missing", True) is True
    with pytest.raises(ValueError, match="--set a="):
        _harness.Config(extra={"a": "maybe"}).flag("a", True)


class _Clock:
    """A fake ``time`` module: each call of the measured function takes ``step`` seconds."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.calls = 0.0, step, 0

    def perf_counter(self) -> float:
        return self.now

    def fn(self) -> None:
        self.calls += 1
        self.now += self.step


def test_no_repetition_overruns_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock(6.0)
    monkeypatch.setattr(_harness, "time", clock)
    t = _harness.measure(clock.fn, repeat=5, warmup=1, budget_s=20.0)
    # warm-up + 6 s, 12 s, 18 s timed; a 4th would end at 24 s > 20 s
    assert t["repeats"] == 3 and clock.calls == 4
    clock = _Clock(60.0)
    monkeypatch.setattr(_harness, "time", clock)
    t = _harness.measure(clock.fn, repeat=5, warmup=1, budget_s=20.0)
    assert t["repeats"] == 1 and clock.calls == 2


def test_a_long_first_call_is_its_own_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _harness.Config(quick=False, budget_s=20.0, long_call_s=10.0)
    clock = _Clock(60.0)
    monkeypatch.setattr(_harness, "time", clock)
    t = cfg.time(clock.fn, None, first_s=61.0)
    assert clock.calls == 0 and t["median_s"] == 61.0 and t["repeats"] == 1
    assert t["timed_calls"] == "first"
    # a short first call only replaces the warm-up
    clock = _Clock(2.0)
    monkeypatch.setattr(_harness, "time", clock)
    t = cfg.time(clock.fn, None, first_s=2.5)
    assert clock.calls == 5 and t["repeats"] == 5 and "timed_calls" not in t


@pytest.mark.parametrize("fresh", [True, False])
def test_peak_memory_without_warmup(fresh: bool) -> None:
    nbytes = 64 * 2**20
    got = _harness.peak_memory("benchmarks._harness:alloc_case", {"nbytes": nbytes},
                               fresh=fresh, warmup=False)
    assert got is not None
    assert 0.9 * nbytes <= got <= 1.25 * nbytes + 16 * 2**20


def test_peers_full_mode_reference_matches_autodiff() -> None:
    """The full-mode (N, N, O, O) relu reference of the peers suite against torch autograd."""
    torch = pytest.importorskip("torch")
    from benchmarks.peers import suite

    p = suite.problem("MLP tiny relu full")
    assert p["mode"] == "full" and p["activation"] == "relu"
    params = [torch.tensor(a) for pair in zip(p["weights"], p["biases"], strict=True)
              for a in pair]
    x = torch.tensor(p["x"])
    n_layers = len(params) // 2

    def f(*flat: torch.Tensor) -> torch.Tensor:
        z = x
        for l in range(n_layers):
            y = p["scales"][l] * z @ flat[2 * l].T + p["beta"] * flat[2 * l + 1]
            z = torch.relu(y) if l < n_layers - 1 else y
        return z

    jac = torch.autograd.functional.jacobian(f, tuple(params))
    n, o = x.shape[0], p["widths"][-1]
    j = torch.cat([t.reshape(n, o, -1) for t in jac], dim=2).numpy()
    expected = np.einsum("nop,mqp->nmoq", j, j)
    ref = suite.reference_ntk(p)
    assert ref.shape == (n, n, o, o)
    assert suite._rel(ref, expected) < 1e-12
    # the crop used for large N keeps the leading block
    big = dict(p, n=100)
    assert suite._crop(np.zeros((100, 100, o, o)), big).shape == (suite.N_REF, suite.N_REF, o, o)


def test_ab_compares_two_trees(tmp_path: Path) -> None:
    """``python -m benchmarks.ab`` times each case in both trees, every round, and records
    every timed call (here the same tree twice, on the seconds-long smoke case)."""
    from benchmarks.ab.__main__ import main

    out = tmp_path / "ab.json"
    root = str(Path(__file__).resolve().parents[1])
    assert main(["--before", root, "--after", root, "--rounds", "2", "--out", str(out),
                 "smoke=3"]) == 0
    data = json.loads(out.read_text())
    assert data["rounds"] == 2
    for side in ("before", "after"):
        times = data["timings_s"]["smoke"][side]
        assert len(times) == 2 * 3 and all(t > 0 for t in times)


@pytest.mark.parametrize("widths, mode", [((5, 7, 6, 1), "full"), ((4, 6, 3), "full"),
                                          ((4, 6, 3), "trace")])
def test_mlp_roofline_flops_match_a_flop_counter(widths: tuple[int, ...], mode: str) -> None:
    """The roofline count of the ``ntk``/``peers`` suites: forward plus output-gradient pass
    as torch's flop counter sees them, the Grams as half of the counted full GEMMs."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.suites.ntk import mlp_roofline_flops

    n, o = 9, widths[-1]
    layers = [torch.nn.Linear(a, b, dtype=torch.float64) for a, b in
              itertools.pairwise(widths)]
    x = torch.randn(n, widths[0], dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:  # forward + the O output-gradient passes
        ys, z = [], x
        for i, lin in enumerate(layers):
            ys.append(lin(z))
            z = torch.tanh(ys[-1]) if i < len(layers) - 1 else ys[-1]
        for k in range(o):
            torch.autograd.grad(z[:, k].sum(), ys, retain_graph=True)
    passes = counter.get_total_flops()
    # the Kronecker Grams as full GEMMs, A A^T (K = d_in + 1) and G G^T ((N O) or N rows);
    # a symmetric product of an (r, k) factor costs r (r + 1) k of the GEMM's 2 r^2 k
    m, k_scale = (n * o, 1) if mode == "full" else (n, o)
    sym = 0.0
    for d_in, d_out in itertools.pairwise(widths):
        for rows, cols in ((n, d_in + 1), (m, k_scale * d_out)):
            f = torch.randn(rows, cols, dtype=torch.float64)
            with FlopCounterMode(display=False) as counter:
                f @ f.T
            sym += counter.get_total_flops() * (rows + 1) / (2 * rows)
    assert mlp_roofline_flops(widths, n, mode) == pytest.approx(passes + sym)


def test_render_roofline_share() -> None:
    rows = render.derive(_doc([_r("ours", 0.5, roofline_flops=40e9,
                                  target="roofline_share >= 0.8")]))
    assert rows[0]["_roofline_share"] == pytest.approx(0.8)  # 80 GFLOP/s of 100
    assert rows[0]["_target_ok"] is True
    doc = _doc([_r("ours", 0.5, roofline_flops=40e9)])
    doc["gemm"][0].update(n=64, gflops_max=100.0)
    text = render.render_doc(doc, Path("/nonexistent"), "img")
    assert "roofline %" in text and "| 80% |" in text


def test_roofline_share_uses_the_gemm_rate_of_the_rows_own_rounds() -> None:
    """A row timed in the same rounds as a GEMM (``gemm_gflops``) is divided by that rate,
    not by the run's separate measurement (100 GFLOP/s in ``_doc``)."""
    rows = render.derive(_doc([_r("ours", 0.5, roofline_flops=40e9, gemm_gflops=160.0,
                                  target="roofline_share >= 0.8")]))
    assert rows[0]["_roofline_share"] == pytest.approx(0.5)  # 80 GFLOP/s of 160
    assert rows[0]["_target_ok"] is False


def test_paired_gemm_rate_is_timed_with_the_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """The roofline cases alternate the case's calls with a GEMM, one each per round, and
    report the GEMM's rate from those rounds."""
    pytest.importorskip("torch")
    from benchmarks._harness import Config
    order: list[str] = []
    real = _harness.gemm_call

    def recorded(*args):
        gemm = real(*args)
        return lambda: (order.append("gemm"), gemm())[1]

    monkeypatch.setattr(_harness, "gemm_call", recorded)
    cfg = Config(quick=True, repeat=3)
    timing, gflops = _harness.paired_with_gemm(cfg, lambda: order.append("case"), 0.001,
                                               "torch")
    rounds = timing["repeats"]
    assert rounds >= 1 and order == ["gemm"] + ["case", "gemm"] * rounds  # warm-up first
    assert math.isfinite(gflops) and gflops > 0


def test_render_takes_each_case_from_its_newest_run():
    """A later run of one case replaces that case only; the suite's other cases stay."""
    from benchmarks import render

    def doc(created, cases):
        return {"created": created, "machine_slug": "m", "config": {"device": "cpu"},
                "rows": [{"suite": "ntk", "case": c, "impl": i} for c in cases
                         for i in ("ntkcore", "torch.func")]}

    old, new = doc("2026-01-01", ["A", "B"]), doc("2026-02-01", ["B"])
    keep = render._newest_per_case([("old.json", old), ("new.json", new)])
    assert keep == {"old.json": {("ntk", "A")}, "new.json": {("ntk", "B")}}
    rows = render._only_cases(old, keep["old.json"])["rows"]
    assert {(r["case"], r["impl"]) for r in rows} == {("A", "ntkcore"), ("A", "torch.func")}


# -- suite ``features`` (benchmarks/suites/features.py) -------------------------------------

def test_features_suite_rows(quick_results: dict) -> None:
    """The quick run's ``features`` rows: error rows for every model, layout, split and dim
    with the measured and predicted errors; throughput rows of every implementation with
    samples per second; no scale case in a quick run."""
    pytest.importorskip("torch")
    from benchmarks.suites import features as fs

    rows = [r for r in quick_results["rows"] if r["suite"] == "features"]
    err = [r for r in rows if r["params"]["kind"] == "error"]
    tp = [r for r in rows if r["params"]["kind"] == "throughput"]
    assert len(err) + len(tp) == len(rows)
    assert not any("scale" in r["case"] for r in rows)
    cfg = _harness.Config(quick=True)
    dims = fs._ints(fs._opt(cfg, "features_dims"))
    splits = fs._opt(cfg, "features_splits").split(",")
    seeds = fs._opt(cfg, "features_seeds")
    points = {(r["params"]["model"], r["params"]["kronecker"], r["params"]["split"],
               r["params"]["dim"]) for r in err}
    assert points == {(m, lay, s, d) for m in fs.QUICK_MODELS for lay in fs.layouts()
                      for s in splits for d in dims}
    for r in err:
        p = r["params"]
        assert len(p["errors"]) == len(p["errors_subset"]) == p["seeds"] == seeds
        assert r["error"] == pytest.approx(float(np.median(p["errors"])))
        assert p["error_min"] <= r["error"] <= p["error_max"]
        assert p["error_rms"] == pytest.approx(math.sqrt(np.mean(np.square(p["errors"]))))
        assert p["error_pred"] > 0 and p["error_subset_rms"] > 0
    for model, kind in fs.QUICK_MODELS.items():
        got = {r["impl"]: r for r in tp if r["params"]["model"] == model}
        want = {"ntkcore.features trace", "ntkcore.ntk trace", fs.BASELINE}
        if fs.OUTPUTS[kind] > 1:
            want.add("ntkcore.features pseudo")
        assert set(got) == want
        for r in got.values():
            assert r["params"]["samples_per_s"] == pytest.approx(
                r["params"]["N"] / r["median_s"])


def test_features_rendering(quick_results: dict, tmp_path: Path) -> None:
    """The renderer's features section: its tables, and the error-against-dim plot under the
    machine's name and under the name docs/features.md embeds."""
    out = render.render([Path(quick_results["_path"])], docs=tmp_path)
    text = out.read_text()
    section = text[text.index("### features"):]
    for title in ("#### Kernel error against dim", "#### Throughput"):
        assert title in section
    slug = f"{quick_results['machine_slug']}-{quick_results['config']['device']}"
    assert f"img/{slug}-features-error-vs-dim.png" in section
    for name in (f"{slug}-features-error-vs-dim.png", render.FEATURES_PAGE_IMAGE):
        assert (tmp_path / "img" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"img/{render.FEATURES_PAGE_IMAGE}" in (ROOT / "docs" / "features.md").read_text()
    rows = [r for r in quick_results["rows"] if r["suite"] == "features"]
    n_tp = sum(r["params"]["kind"] == "throughput" for r in rows)
    n_err = sum(r["params"]["kind"] == "error" for r in rows)
    assert section.count("| throughput ") == n_tp
    assert n_err == sum(section.count(f"| {m} |") for m in {r["params"]["model"] for r in rows})


def test_features_predicted_error_equals_feature_error() -> None:
    """The suite's one-pass prediction equals ``ntkcore.feature_error`` point by point."""
    pytest.importorskip("torch")
    import ntkcore
    from benchmarks.suites import features as fs

    for kind in ("mlp_tiny", "cnn_tiny"):
        model, x = fs.build(kind, 6, "float64", "cpu")
        points = [(lay, split, d) for lay in fs.layouts() for split in ("default", "probe")
                  for d in (16, 40)]
        got = fs.predicted(model, x, points, x[:3])
        for lay, split, d in points:
            want = ntkcore.feature_error(model, x, dim=d, **fs._kw(lay),
                                         probe=x[:3] if split == "probe" else None)
            assert got[(lay, split, d)] == pytest.approx(want, rel=1e-12)


def test_features_baseline_gradients_and_projection() -> None:
    """The baseline's per-sample gradients give the pseudo-NTK (float64, against
    ``ntkcore.pseudo_ntk``); every batch sees the same projection whether the Gaussian is
    regenerated or kept, and the Frobenius error of its kernel is within 5x its predicted
    root mean square (by Markov's inequality a random seed fails with probability <= 1/25;
    the seed is fixed; a mis-scaled projection fails by far)."""
    torch = pytest.importorskip("torch")
    import ntkcore
    from benchmarks.baselines import torch_func
    from benchmarks.suites import features as fs
    from tests.tolerances import kernel_tol

    model, x = fs.build("cnn_tiny", 7, "float64", "cpu")
    g = torch_func.per_sample_gradients(model, x)
    k = g @ g.T
    ref = ntkcore.pseudo_ntk(model, x)
    p = g.shape[1]
    assert float((k - ref).abs().max()) <= kernel_tol(torch.float64, p, 2) * float(
        ref.abs().max())
    dim = 4096
    # regenerated for each batch of 2 (store_bytes=0) or kept: the same projection
    phi = torch_func.gradient_projection(model, x, dim=dim, seed=3, batch=2,
                                         chunk_bytes=1 << 16)
    phi2 = torch_func.gradient_projection(model, x, dim=dim, seed=3, batch=2,
                                          chunk_bytes=1 << 16, store_bytes=0)
    assert torch.equal(phi, phi2)
    # Var[(Phi Phi^T)_nm] = (K_nm^2 + K_nn K_mm) / dim for a Gaussian projection
    var = (k * k + torch.outer(torch.diag(k), torch.diag(k))) / dim
    assert float(torch.linalg.vector_norm(phi @ phi.T - k)) <= 5 * float(var.sum().sqrt())


def test_features_scale_case_small(tmp_path: Path) -> None:
    """The scale case end to end at a tiny size (fresh processes): both rows, their
    accuracies and peak memory, and the augmented digits keep the originals first."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    from benchmarks.suites import features as fs

    x, y, x_test, labels = fs.digits_data(1500)
    assert tuple(x.shape) == (1500, 1, 8, 8) and tuple(y.shape) == (1500, 10)
    assert tuple(x_test.shape) == (360, 1, 8, 8) and tuple(labels.shape) == (360,)
    assert bool((y.sum(1) == 1).all())
    digits, target = load_digits(return_X_y=True)
    train = np.random.default_rng(0).permutation(len(target))[360:]
    z = (digits[train] / 16.0 - (digits[train] / 16.0).mean()) / (digits[train] / 16.0).std()
    np.testing.assert_allclose(x[:1437, 0].reshape(1437, 64).numpy(), z, rtol=1e-6, atol=1e-6)
    assert (y[:1437].argmax(1).numpy() == target[train]).all()
    assert (y[1437:].argmax(1).numpy() == target[train][:63]).all()
    cfg = _harness.Config(quick=False, extra={"scale_n": "300", "scale_dim": "64",
                                              "scale_exact_n": "200", "scale_budget": "64MB"})
    rows = fs._scale_rows(cfg, "scale test")
    assert [r["params"]["N"] for r in rows] == [300, 200]
    for r in rows:
        assert 0.0 <= r["params"]["accuracy"] <= 1.0
        assert r["peak_mem_bytes"] >= r["params"]["rss_start_bytes"] > 0
        assert r["median_s"] == pytest.approx(r["params"]["seconds_kernel"]
                                              + r["params"]["seconds_solve"])


def test_render_quotes_the_widest_run_for_all_suites():
    """The "all suites took ..." estimate comes from the CPU run with the most suites and no
    case filter, not from whichever run came last (a one-case rerun took 3 of 6 minutes)."""
    from benchmarks import render

    def doc(suites, wall, cases=()):
        return {"config": {"device": "cpu", "suites": suites, "cases": list(cases)},
                "wall_s": wall}
    docs = [doc(["gram", "smw", "ntk"], 360.0), doc(["smw"], 160.0, ["large"]),
            doc(["ntk"], 60.0)]
    assert render._expected_minutes(docs) == "took 6 min on the machine below"
