"""The asv benchmarks' shared measurements (benchmarks/common.py), the renderer of their
results (benchmarks/render.py) and the discovery of every benchmark module by asv.

No timing is asserted (the machine is shared): what is checked are exact facts (byte counts
of a known allocation, the structure of tables, ratios of known work, asv's exit status).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import common, render  # noqa: E402


def test_require_skips_missing_and_unselected_backends(monkeypatch):
    assert common.require("numpy") is np
    with pytest.raises(NotImplementedError, match="not installed"):
        common.require("no_such_library_here")
    monkeypatch.setenv("NTKCORE_BENCH_BACKENDS", "torch-cuda,cupy")
    with pytest.raises(NotImplementedError, match="NTKCORE_BENCH_BACKENDS"):
        common.require("numpy")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_asarray_and_relerr_round_trip(backend):
    pytest.importorskip(backend)
    common.require(backend)
    x = np.arange(6.0).reshape(2, 3)
    a = common.asarray(x, backend, "float32")
    assert str(a.dtype).endswith("float32")
    np.testing.assert_array_equal(common.to64(a), x)
    assert common.relerr(a, x) == 0.0
    assert common.relerr(common.asarray(2 * x, backend), x) == pytest.approx(1.0)


def test_in_turns_medians_order_known_work():
    """Sleeping 50 ms and 1 ms in turns: each median is at least its sleep (sleep never
    returns early) and they keep their order (a median of 5 rounds: one late wake-up of the
    short call does not reorder them)."""
    t = common.in_turns({"long": lambda: time.sleep(0.05), "short": lambda: time.sleep(0.001)},
                        rounds=5)
    assert t["long"] >= 0.05 and t["short"] >= 0.001
    assert t["short"] < t["long"]


def test_in_turns_stops_at_the_budget():
    calls = []
    common.in_turns({"f": lambda: (calls.append(1), time.sleep(0.05))}, rounds=100,
                    budget_s=0.2)
    assert 2 <= len(calls) <= 6  # warm-up + rounds that fit the budget, not 101


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_working_memory_sees_a_known_allocation():
    """64 MiB written inside the call: the growth is at least that, and a call that
    allocates nothing grows by far less (page-granular noise)."""
    n = 64 * 2**20

    def alloc():
        a = np.ones(n, dtype=np.uint8)
        return int(a[-1])

    grew = common.working_memory(alloc)
    assert 0.99 * n <= grew < n + 16 * 2**20  # VmRSS before may hold a few freed pages
    assert common.working_memory(lambda: 0) < 8 * 2**20


def test_roofline_share_of_a_gemm_is_about_one():
    """A GEMM measured against itself: the share is ~1 (two timings of the same work in the
    same rounds; 0.5-2 allows for a shared machine)."""
    fn, flops = common.gemm("numpy", n=256)
    assert 0.5 < common.roofline_share(fn, flops, "numpy", rounds=5, n=256) < 2.0


# -- the renderer ---------------------------------------------------------------------------

def _results(tmp: Path) -> Path:
    """An asv results folder with one machine and two result files (two commits)."""
    (tmp / "m1").mkdir(parents=True)
    (tmp / "m1" / "machine.json").write_text(json.dumps(
        {"machine": "m1", "cpu": "Test CPU", "num_cpu": "2", "os": "Linux", "version": 1}))
    meta = {"smw.VsDense.time_ntkcore": {"param_names": ["backend", "P"], "unit": "seconds"},
            "smw.VsDense.track_speedup": {"param_names": ["backend", "P"], "unit": "x"},
            "smw.Large.track_working_memory": {"param_names": [], "unit": "bytes"},
            "version": 2}
    (tmp / "benchmarks.json").write_text(json.dumps(meta))
    cols = ["result", "params", "version"]
    params = [["'numpy'", "'cupy'"], ["1000", "4000"]]
    for commit, date, t in (("a" * 40, 1, 9.0), ("b" * 40, 2, 0.5)):
        doc = {"commit_hash": commit, "date": date, "env_name": "existing", "python": "3.11",
               "result_columns": cols, "version": 2, "results": {
                   "smw.VsDense.time_ntkcore": [[t * 1e-3, 2e-3, None, None], params, "v"],
                   "smw.VsDense.track_speedup": [[3.0, 30.0, float("nan"), None], params, "v"],
                   "smw.Large.track_working_memory": [[3 * 2**30 if date == 1 else None],
                                                      [], "v"]}}
        (tmp / "m1" / f"{commit[:8]}-existing.json").write_text(json.dumps(doc))
    return tmp


def test_render_takes_each_table_from_one_result_file(tmp_path):
    """The newest file that measured a class gives the whole table and names its commit;
    a class measured only in an older file comes from that file; skipped rows are dropped."""
    machine, docs, meta = render.load(results=_results(tmp_path))
    page = render.render(machine, docs, meta)
    assert "#### VsDense · commit bbbbbbbb" in page
    assert "| numpy | 1000 | 500 µs | 3x |" in page
    assert "| numpy | 4000 | 2 ms | 30x |" in page
    assert "cupy" not in page  # skipped everywhere: no row
    assert "#### Large · commit aaaaaaaa" in page and "3 GiB" in page
    _, old, _ = render.load(results=tmp_path, commit="aaaa")
    page = render.render(machine, old, meta)
    assert "| numpy | 1000 | 9 ms | 3x |" in page and "bbbbbbbb" not in page


@pytest.mark.parametrize("value, unit, text", [
    (1.5, "seconds", "1.5 s"), (0.0123, "seconds", "12.3 ms"), (2e-5, "seconds", "20 µs"),
    (5 * 2**20, "bytes", "5 MiB"), (0.734, "share", "73%"), (None, "x", "n/a"),
    (float("nan"), "relative", "n/a"), (1.23e-7, "relative", "1.23e-07")])
def test_cells(value, unit, text):
    assert render.fmt(value, unit) == text


def test_chart_over_n_is_drawn_and_not_cut_off(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    t = {"names": ["backend", "N"],
         "combos": [("'numpy'", n) for n in (10, 20, 40)] + [("'a long backend name'", 10)],
         "methods": {"time_ntkcore": ("seconds", [1e-3, 2e-3, 4e-3, 1.0])}}
    assert render.chart(t, "module.Class " + "long title " * 8, tmp_path / "c.png")
    assert (tmp_path / "c.png").is_file()
    (fig,) = figs
    fig.canvas.draw()
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    w, h = fig.get_size_inches()
    assert max(0.0, -box.x0, -box.y0, box.x1 - w, box.y1 - h) < 0.01
    assert not render.chart({"names": ["backend"], "combos": [], "methods": {}}, "x",
                            tmp_path / "d.png")


def test_asv_discovers_every_benchmark_module():
    """``asv check`` imports every module of benchmarks/ and checks each benchmark's
    signature: an import error or a malformed benchmark fails it."""
    pytest.importorskip("asv")
    r = subprocess.run([sys.executable, "-m", "asv", "check", "--python=same"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
