"""Render benchmark JSON into ``docs/benchmarks.md`` and plots in ``docs/img/``.

``python -m benchmarks.render [RESULTS.json ...] [--docs DIR]``; without files, the newest
full (non ``--quick``) result of each machine and device in ``benchmarks/results/`` is used.

Derived columns, all from rows of the *same* result file:

- speed-up = median time of the ``baseline`` row (same suite, case, device and dtype; the same
  backend when there is one, else any backend) / this row's median time;
- GEMM % = (``flops`` / median time) / measured GEMM throughput of the row's backend, device
  and dtype (numpy's on CPU or torch's on CUDA when the backend's own was not measured);
- roofline share = (``roofline_flops`` / median time) / the same measured GEMM throughput:
  the fraction of the GEMM-bound floor reached, where ``roofline_flops`` is the least GEMM
  work of the *problem* (the same for every implementation of a case);
- memory ratio = peak memory / the baseline row's peak memory (used by ``target``).
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import re
import shutil
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
METRICS = ("speedup", "time_s", "gemm_fraction", "roofline_share", "mem_ratio",
           "peak_mem_bytes", "error")


# --------------------------------------------------------------------------------------------
# formatting


def fmt_time(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.3g} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{int(b)} B"


def _esc(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "x"


# --------------------------------------------------------------------------------------------
# derived quantities


def family(r: dict[str, Any]) -> str:
    """The series a row belongs to when plotting against ``params["N"]``."""
    p = r.get("params") or {}
    if p.get("family"):
        return str(p["family"])
    case = str(r["case"])
    n = p.get("N")
    if n is not None:
        # "N=<n>" goes; another key swept with N keeps its name ("P=<n>" -> "P=N"); a bare
        # number goes
        stripped = re.sub(rf"\b[Nn]\s*=\s*{n}\b", "", case)
        if stripped == case:
            stripped = re.sub(rf"\b(\w+)\s*=\s*{n}\b", r"\1=N", case)
        if stripped == case:
            stripped = re.sub(rf"\b{n}\b", "", case)
        case = re.sub(r"\s+", " ", stripped).strip(" ,;-_") or case
    return case


def _gemm_table(doc: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    return {
        (g["backend"], g["device"], g["dtype"]): g["gflops"]
        for g in doc.get("gemm", [])
        if g.get("gflops")
    }


def gemm_ref(doc: dict[str, Any], r: dict[str, Any]) -> float | None:
    table = _gemm_table(doc)
    key = (r["backend"], r["device"], r["dtype"])
    if key in table:
        return table[key]
    fallback = "numpy" if r["device"] == "cpu" else "torch"
    return table.get((fallback, r["device"], r["dtype"]))


def derive(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows with ``_speedup``, ``_gemm_fraction``, ``_roofline_share``, ``_mem_ratio``,
    ``_target_ok`` added."""
    rows = [dict(r) for r in doc.get("rows", [])]
    index: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        index[(r["suite"], r["case"], r["device"], r["dtype"], r["impl"])].append(r)
    for r in rows:
        base = None
        if r.get("baseline"):
            cands = index.get((r["suite"], r["case"], r["device"], r["dtype"], r["baseline"]), [])
            same = [c for c in cands if c["backend"] == r["backend"]]
            base = (same or cands or [None])[0]
        t = r.get("median_s")
        if base is not None and base.get("median_s") and t:
            r["_speedup"] = base["median_s"] / t
            r["_baseline_backend"] = base["backend"]
        if base is not None and base.get("peak_mem_bytes") and r.get("peak_mem_bytes") is not None:
            r["_mem_ratio"] = r["peak_mem_bytes"] / base["peak_mem_bytes"]
        g = r.get("gemm_gflops") or gemm_ref(doc, r)  # measured in the row's own rounds
        if r.get("flops") and t and g:
            r["_gflops"] = r["flops"] / t / 1e9
            r["_gemm_fraction"] = r["_gflops"] / g
        if r.get("roofline_flops") and t and g:
            r["_roofline_share"] = r["roofline_flops"] / t / 1e9 / g
        if r.get("target"):
            r["_target_ok"] = check_target(r)
    return rows


def metric(r: dict[str, Any], name: str) -> float | None:
    return {
        "speedup": r.get("_speedup"),
        "time_s": r.get("median_s"),
        "gemm_fraction": r.get("_gemm_fraction"),
        "roofline_share": r.get("_roofline_share"),
        "mem_ratio": r.get("_mem_ratio"),
        "peak_mem_bytes": r.get("peak_mem_bytes"),
        "error": r.get("error"),
    }.get(name)


def check_target(r: dict[str, Any]) -> bool | None:
    """True/False when the row's ``target`` can be evaluated, None when it cannot."""
    m = re.fullmatch(r"\s*(\w+)\s*(>=|<=|>|<)\s*([-+0-9.eE]+)\s*", str(r.get("target", "")))
    if not m or m.group(1) not in METRICS:
        return None
    value = metric(r, m.group(1))
    if value is None:
        return None
    return bool(OPS[m.group(2)](value, float(m.group(3))))


# --------------------------------------------------------------------------------------------
# plots


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrap(text: str, width: int = 60) -> str:
    """``text`` broken into lines of at most ``width`` characters (labels, titles)."""
    return textwrap.fill(text, width, break_on_hyphens=False)


def _save(plt: Any, fig: Any, path: Path) -> None:
    """Lay out and write ``fig``; the saved box grows to hold every label (nothing cut)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_scaling(rows: list[dict[str, Any]], title: str, path: Path) -> bool:
    """Median time (and peak memory, where measured) against N, one line per implementation."""
    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("median_s") is not None:
            series[f"{r['impl']} ({r['backend']})"].append(r)
    if not series or len({r["params"]["N"] for r in rows}) < 2:
        return False
    has_mem = any(r.get("peak_mem_bytes") for r in rows)
    plt = _plt()
    fig, axes = plt.subplots(1, 2 if has_mem else 1, figsize=(11 if has_mem else 6, 4),
                             squeeze=False)
    for label, rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["params"]["N"])
        ns = [r["params"]["N"] for r in rs]
        med = [r["median_s"] for r in rs]
        lo = [r["median_s"] - r.get("min_s", r["median_s"]) for r in rs]
        hi = [r.get("max_s", r["median_s"]) - r["median_s"] for r in rs]
        axes[0][0].errorbar(ns, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
        if has_mem:
            mem = [(r["params"]["N"], r["peak_mem_bytes"] / 2**20) for r in rs
                   if r.get("peak_mem_bytes")]
            if mem:
                axes[0][1].plot(*zip(*mem, strict=True), marker="o", label=label)
    axes[0][0].set(xscale="log", yscale="log", xlabel="N", ylabel="median time [s]",
                   title=_wrap(f"{title}: time", 45 if has_mem else 50))
    axes[0][0].grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if has_mem:
        axes[0][1].set(xscale="log", yscale="log", xlabel="N", ylabel="peak memory [MiB]",
                       title=_wrap(f"{title}: peak memory", 45))
        axes[0][1].grid(True, which="both", alpha=0.3)
        axes[0][1].legend(fontsize=7)
    _save(plt, fig, path)
    return True


def plot_speedups(rows: list[dict[str, Any]], title: str, path: Path) -> bool:
    """Horizontal bars of speed-up over the baseline (log scale, 1x marked)."""
    rs = [r for r in rows if r.get("_speedup")]
    if not rs:
        return False
    plt = _plt()
    labels = [_wrap(f"{r['case']} · {r['impl']} ({r['backend']}) vs {r['baseline']}", 55)
              for r in rs]
    vals = [r["_speedup"] for r in rs]
    lines = sum(label.count("\n") + 1 for label in labels)
    fig, ax = plt.subplots(figsize=(9, 0.16 * lines + 0.16 * len(rs) + 1.2))
    colors = ["tab:green" if v >= 1 else "tab:red" for v in vals]
    ax.barh(range(len(rs)), vals, color=colors)
    ax.set_yticks(range(len(rs)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="speed-up over baseline (x)", title=_wrap(f"{title}: speed-up"))
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.3g}x", va="center", fontsize=7)
    _save(plt, fig, path)
    return True


# --------------------------------------------------------------------------------------------
# suite ``features``: error against dim, throughput, scale (benchmarks/suites/features.py)


#: the error-against-dim plot under the name docs/features.md embeds (of the last CPU result)
FEATURES_PAGE_IMAGE = "features-error-vs-dim.png"


def _fkind(r: dict[str, Any]) -> str | None:
    return (r.get("params") or {}).get("kind")


def _fnum(v: Any, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def _fseries(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Error rows by model, then by layout and split (``"grid, params"``), sorted by dim."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        p = r["params"]
        out[p["model"]][f"{p.get('kronecker') or 'default'}, dim split by {p['split']}"].append(r)
    for series in out.values():
        for rs in series.values():
            rs.sort(key=lambda r: r["params"]["dim"])
    return out


def plot_feature_errors(rows: list[dict[str, Any]], path: Path) -> bool:
    """Kernel relative error against dim, one panel per model (log-log): the median over
    seeds with its min-max band (N inputs), and the error model's prediction (dashed) next to
    the root mean square measured on the same inputs (crosses); one colour per layout and
    split of ``dim``."""
    models = _fseries([r for r in rows if r.get("error") is not None])
    if not models:
        return False
    plt = _plt()
    from matplotlib.lines import Line2D

    labels = sorted({label for series in models.values() for label in series})
    color = {label: f"C{i}" for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4.2), squeeze=False)
    n_pred, n_all = set(), set()
    for ax, (model, series) in zip(axes[0], models.items(), strict=True):
        dims_all: list[int] = []
        for label, rs in sorted(series.items()):
            rs = [r for r in rs if r.get("error") is not None]
            c = color[label]
            dims = [r["params"]["dim"] for r in rs]
            dims_all += dims
            n_pred.add(rs[0]["params"]["n_pred"])
            n_all.add(rs[0]["params"]["N"])
            ax.plot(dims, [r["error"] for r in rs], "o-", color=c)
            ax.fill_between(dims, [r["params"]["error_min"] for r in rs],
                            [r["params"]["error_max"] for r in rs], color=c, alpha=0.15)
            ax.plot(dims, [r["params"]["error_pred"] for r in rs], "--", color=c)
            ax.plot(dims, [r["params"]["error_subset_rms"] for r in rs], "x", color=c, ms=7)
        if dims_all:  # the 1/sqrt(dim) of a dense Gaussian projection, for the eye
            d0, d1 = min(dims_all), max(dims_all)
            ax.plot([d0, d1], [1.0, math.sqrt(d0 / d1)], ":", color="0.5", lw=1)
        ax.set(xscale="log", yscale="log", xlabel="dim",
               ylabel="||Phi Phi^T - K||_F / ||K||_F", title=_wrap(model, 40))
        ax.grid(True, which="both", alpha=0.3)
    npred = "/".join(map(str, sorted(n_pred)))
    nall = "/".join(map(str, sorted(n_all)))
    handles = [Line2D([], [], color=color[label], lw=4, label=label) for label in labels] + [
        Line2D([], [], color="k", marker="o", label=f"median over seeds, N={nall} "
                                                      "(band: min-max)"),
        Line2D([], [], color="k", ls="--", label=f"predicted (feature_error), first {npred}"),
        Line2D([], [], color="k", marker="x", ls="", label=f"measured RMS, first {npred}"),
        Line2D([], [], color="0.5", ls=":", label="slope dim^-1/2")]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2,
               fontsize=8)
    _save(plt, fig, path)
    return True


def _features_error_table(rows: list[dict[str, Any]]) -> str:
    table = []
    for model, series in _fseries(rows).items():
        for label, rs in sorted(series.items()):
            for r in rs:
                p = r["params"]
                med = "-" if r.get("error") is None else (
                    f"{r['error']:.3g} ({p['error_min']:.3g}–{p['error_max']:.3g})")
                table.append([model, label, p["dim"], med, _fnum(p.get("error_rms")),
                              _fnum(p.get("error_subset_rms")), _fnum(p.get("error_pred")),
                              p.get("seeds", "-"),
                              r["note"] if r.get("error") is None else ""])
    return _table(["model", "layout, dim split", "dim", "median error (min–max), N inputs",
                   "RMS, N inputs", "RMS, first n", "predicted, first n", "seeds", "note"],
                  table)


def _features_throughput_table(rows: list[dict[str, Any]]) -> str:
    table = []
    by_case: dict[str, list[dict[str, Any]]] = defaultdict(list)
    base_rate: dict[Any, float] = {}  # the baseline's samples/s, by model (from any case)
    for r in rows:
        by_case[r["case"]].append(r)
        if r["impl"].startswith("torch.func"):
            base_rate[r["params"].get("model")] = r["params"].get("samples_per_s")
    for case, rs in by_case.items():
        rate = {r["impl"]: r["params"].get("samples_per_s") for r in rs}
        ntk = next((v for k, v in rate.items() if "ntk" in k and "features" not in k), None)
        base = base_rate.get(rs[0]["params"].get("model"))
        for r in rs:
            sps = rate[r["impl"]]
            t = r.get("median_s")
            table.append([
                case, r["impl"], r["params"]["N"],
                "-" if t is None else
                f"{fmt_time(t)} ({fmt_time(r.get('min_s'))}–{fmt_time(r.get('max_s'))})",
                _fnum(sps, ".4g"),
                "-" if not (sps and base) else f"{sps / base:.3g}x",
                "-" if not (sps and ntk) else f"{sps / ntk:.3g}x",
                fmt_bytes(r.get("peak_mem_bytes")), r.get("note", "")])
    return _table(["case", "impl", "N", "median per call (min–max)", "samples/s",
                   "vs torch.func baseline", "vs ntkcore.ntk", "peak memory", "note"], table)


def _features_scale_table(rows: list[dict[str, Any]]) -> str:
    table = []
    for r in rows:
        p = r["params"]
        table.append([r["case"], r["impl"], p["N"], p.get("dim") or "-",
                      fmt_time(r.get("median_s")), fmt_time(p.get("seconds_kernel")),
                      fmt_time(p.get("seconds_solve")), fmt_bytes(r.get("peak_mem_bytes")),
                      fmt_bytes(p.get("rss_start_bytes")), p.get("max_memory") or "-",
                      _fnum(p.get("accuracy"), ".4f"), r.get("note", "")])
    return _table(["case", "impl", "N", "dim", "wall time", "features / kernels", "solve",
                   "peak RSS", "RSS before", "max_memory", "test accuracy", "note"], table)


def features_section(rows: list[dict[str, Any]], img_dir: Path, img_rel: str,
                     slug: str, page_copy: bool = False) -> str:
    """The ``features`` suite: its error rows as a table and an error-against-dim plot
    (``<slug>-features-error-vs-dim.png``; with ``page_copy`` also copied to
    ``features-error-vs-dim.png``, the name docs/features.md embeds, whatever the machine),
    its throughput rows with samples per second and the ratios, its scale rows."""
    out = []
    err = [r for r in rows if _fkind(r) == "error"]
    tp = [r for r in rows if _fkind(r) == "throughput"]
    sc = [r for r in rows if _fkind(r) == "scale"]
    if err:
        out.append("#### Kernel error against dim\n")
        out.append("Trace-mode features against the exact trace eNTK: relative Frobenius "
                   "error over seeds (median, min–max, root mean square) on N inputs, and on "
                   "the first n of them the measured root mean square next to the error "
                   "model's prediction (`ntkcore.feature_error`).\n")
        out.append(_features_error_table(err))
        name = f"{slug}-features-error-vs-dim.png"
        if plot_feature_errors(err, img_dir / name):
            if page_copy:
                shutil.copyfile(img_dir / name, img_dir / FEATURES_PAGE_IMAGE)
            out.append(f"\n![features: kernel error against dim]({img_rel}/{name})\n")
    if tp:
        out.append("\n#### Throughput\n")
        out.append("Timed interleaved in one run; ratios are of samples per second (the "
                   "torch.func baseline runs on fewer inputs: its cost is linear in N).\n")
        out.append(_features_throughput_table(tp))
    if sc:
        out.append("\n#### Scale\n")
        out.append(_features_scale_table(sc))
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# document


def _sort_key(r: dict[str, Any]) -> tuple:
    return (family(r), (r.get("params") or {}).get("N") or 0, r["case"], r["backend"],
            r["impl"] != r.get("baseline", "") and r.get("baseline") is not None, r["impl"])


def _machine_section(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    torch = m.get("torch") or {}
    cuda = torch.get("cuda") or {}
    v = m.get("versions", {})
    facts = [
        ["CPU", f"{m.get('cpu_model')} ({m.get('cpu_physical_cores')} physical cores, "
                f"{m.get('cpu_logical')} logical, {m.get('cpu_affinity')} usable)"],
        ["memory", fmt_bytes(m.get("memory_bytes"))],
        ["load average (1/5/15 min), start → end",
         " / ".join(f"{v:.1f}" for v in doc.get("load_average_start") or []) + " → "
         + " / ".join(f"{v:.1f}" for v in m.get("load_average") or [])],
        ["BLAS (threadpoolctl)", m.get("blas_kernel") or "-"],
        ["torch threads / BLAS", f"{torch.get('num_threads', '-')} / {torch.get('blas', '-')}"
                                 if torch else "-"],
        ["OpenBLAS guards in the timing run",
         ", ".join(f"{k}={val}" for k, val in (m.get("env") or {}).items()
                   if k.startswith("OPENBLAS_") and val is not None) or "unset"],
        ["malloc settings", ", ".join(f"{k}={val}" for k, val in (m.get("env") or {}).items()
                                      if k.startswith(("MALLOC_", "LD_PRELOAD"))
                                      and val is not None) or "glibc defaults"],
        ["removed by the runner", ", ".join(f"{k}={val}" for k, val in
                                            (m.get("env_before_reexec") or {}).items()) or "-"],
        ["Python", m.get("python")],
        ["versions", ", ".join(f"{k} {val}" for k, val in v.items() if val)],
        ["git", f"{(m.get('git') or {}).get('commit', '')[:12]}"
                f"{' (dirty)' if (m.get('git') or {}).get('dirty') else ''}"],
    ]
    if m.get("gpu") or cuda:
        gpu = m.get("gpu") or {}
        facts.insert(1, ["GPU", f"{gpu.get('name') or cuda.get('device_name')} "
                                f"(driver {gpu.get('driver', '-')}, CUDA "
                                f"{cuda.get('cuda_runtime', '-')})"])
        tf = m.get("tf32") or {}
        facts.insert(2, ["TF32 during timings",
                         f"{'on' if tf.get('effective') else 'off'} "
                         f"(torch matmul {tf.get('torch_matmul')}, cuDNN {tf.get('torch_cudnn')},"
                         f" CuPy {tf.get('cupy')}, NVIDIA_TF32_OVERRIDE "
                         f"{tf.get('NVIDIA_TF32_OVERRIDE')})"])
    return _table(["fact", "value"], facts)


_STATUS_TEXT = {
    "timeout": "TIMED OUT",
    "running": "STOPPED (run killed)",
    "killed": "STOPPED (SIGTERM)",
    "interrupted": "STOPPED (Ctrl-C)",
}


def _status_text(info: dict[str, Any]) -> str:
    st = str(info.get("status"))
    text = _STATUS_TEXT.get(st, st)
    if st != "ok" and info.get("cases_planned"):
        done = len(info["cases_planned"]) - len(info.get("cases_not_run") or [])
        text += f" ({done}/{len(info['cases_planned'])} cases)"
    return text


def _stopped_note(info: dict[str, Any] | None) -> str:
    """A warning line above a suite's table when the suite did not finish."""
    if not info or info.get("status") == "ok":
        return ""
    st = str(info.get("status"))
    why = {"timeout": f"ran past its time limit ({info.get('timeout_s') or 0:.0f} s)",
           "running": "was still running when the run was killed",
           "killed": "was stopped by SIGTERM", "interrupted": "was interrupted (Ctrl-C)",
           "error": "raised an error"}.get(st, f"ended with status {st}")
    note = f"**This suite {why} after {info.get('wall_s', 0):.0f} s; the rows below are " \
           "the cases it finished.**"
    missing = info.get("cases_not_run")
    if info.get("last_case"):
        note += f" The last case, `{info['last_case']}`, may lack some implementations."
    if missing:
        note += " Cases not run: " + ", ".join(f"`{c}`" for c in missing) + "."
    return note


def render_doc(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    """Markdown section for one result file; writes its plots into ``img_dir``."""
    cfg = doc.get("config", {})
    slug = f"{doc.get('machine_slug', 'machine')}-{cfg.get('device', 'cpu')}"
    out = [f"## {doc.get('machine_slug')} · {cfg.get('device')} · {cfg.get('dtype')} · "
           f"{doc.get('created', '')[:10]}\n"]
    backends = ", ".join(cfg.get("backends", []))
    out.append(f"Command: `{' '.join(doc.get('command', []))}` (total "
               f"{doc.get('wall_s', 0) / 60:.1f} min; backends {backends}; "
               f"{cfg.get('repeat')} timed calls after {cfg.get('warmup')} warm-up, at most "
               f"{cfg.get('budget_s')} s of timed calls per case"
               f"{'; QUICK smoke run, sizes are tiny' if cfg.get('quick') else ''}"
               f"{'; INCOMPLETE: the run was stopped' if doc.get('complete') is False else ''}"
               ").\n")
    out.append("### Machine\n")
    out.append(_machine_section(doc))
    out.append("\n### Measured GEMM throughput\n")
    out.append(_table(
        ["backend", "device", "dtype", "n", "GFLOP/s (median)", "GFLOP/s (best)"],
        [[g["backend"], g["device"], g["dtype"], g["n"],
          f"{g['gflops']:.1f}" if g.get("gflops") else g.get("error", "-"),
          f"{g['gflops_max']:.1f}" if g.get("gflops_max") else "-"] for g in doc.get("gemm", [])],
    ))
    out.append("\n### Suites\n")
    srows = []
    for name, info in doc.get("suites", {}).items():
        err = (info.get("error") or "").strip().splitlines()
        srows.append([name, _status_text(info), info.get("n_rows", 0),
                      f"{info.get('wall_s', 0):.1f} s", err[-1][:160] if err else ""])
    out.append(_table(["suite", "status", "rows", "wall time", "problem"], srows))

    rows = derive(doc)
    targets = [r for r in rows if r.get("target")]
    if targets:
        out.append("\n### Targets\n")
        trs = []
        for r in targets:
            ok = r.get("_target_ok")
            m = re.match(r"\s*(\w+)", r["target"])
            val = metric(r, m.group(1)) if m else None
            shown = "-" if val is None else (
                fmt_bytes(val) if m and m.group(1) == "peak_mem_bytes" else f"{val:.3g}")
            trs.append([r["suite"], r["case"], f"{r['impl']} ({r['backend']})", r["target"],
                        shown, {True: "met", False: "NOT met", None: "n/a"}[ok]])
        out.append(_table(["suite", "case", "impl", "target", "measured", "status"], trs))

    by_suite: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_suite[r["suite"]].append(r)
    suites_info = doc.get("suites", {})
    for suite, rs in by_suite.items():
        out.append(f"\n### {suite}\n")
        stopped = _stopped_note(suites_info.get(suite))
        if stopped:
            out.append(stopped + "\n")
        if suite == "features":
            out.append(features_section(rs, img_dir, img_rel, slug,
                                        page_copy=cfg.get("device", "cpu") == "cpu"))
            continue
        rs.sort(key=_sort_key)
        table = []
        for r in rs:
            t = r.get("median_s")
            timing = "-" if t is None else (
                f"{fmt_time(t)} ({fmt_time(r.get('min_s'))}–{fmt_time(r.get('max_s'))})")
            sp = r.get("_speedup")
            sp_s = "-" if sp is None else f"{sp:.3g}x vs {r['baseline']}" + (
                f" ({r['_baseline_backend']})" if r.get("_baseline_backend") != r["backend"]
                else "")
            gf = r.get("_gemm_fraction")
            roof = r.get("_roofline_share")
            err = r.get("error")
            table.append([
                r["case"], r["impl"], r["backend"], r["device"], r["dtype"], timing,
                fmt_bytes(r.get("peak_mem_bytes")), sp_s,
                "-" if gf is None else f"{100 * gf:.0f}%",
                "-" if roof is None else f"{100 * roof:.0f}%",
                "-" if err is None else f"{err:.1e}", r.get("note", ""),
            ])
        out.append(_table(["case", "impl", "backend", "device", "dtype", "median (min–max)",
                           "peak memory", "speed-up", "GEMM %", "roofline %", "rel. error",
                           "note"], table))
        if suite == "real_models":
            out.append(real_models_section(rs))
        fams: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rs:
            if isinstance((r.get("params") or {}).get("N"), (int, float)):
                fams[family(r)].append(r)
        for fam, frs in fams.items():
            name = f"{slug}-{_slug(suite)}-{_slug(fam)}.png"
            if plot_scaling(frs, f"{suite} · {fam}", img_dir / name):
                out.append(f"\n![{suite} {fam}: time and memory against N]({img_rel}/{name})\n")
        name = f"{slug}-{_slug(suite)}-speedup.png"
        if plot_speedups(rs, suite, img_dir / name):
            out.append(f"\n![{suite}: speed-up over the baseline]({img_rel}/{name})\n")
    return "\n".join(out)


def _blocks_text(blocks: dict[str, int] | None) -> str:
    """``Kronecker / dense / torch.func`` counts (the last are DenseBlocks too), then any
    other block kind by name."""
    if not blocks:
        return "-"
    text = (f"{blocks.get('KroneckerBlock', 0)} / {blocks.get('DenseBlock', 0)} / "
            f"{blocks.get('torch.func', 0)}")
    others = [f"{v} {k}" for k, v in sorted(blocks.items())
              if k not in ("KroneckerBlock", "DenseBlock", "torch.func")]
    return text + ("; " + ", ".join(others) if others else "")


def _func_over_floor(p: dict[str, Any]) -> str:
    """torch.func time / floor (``bound`` in results written before issue 32)."""
    v = p.get("func_over_floor", p.get("bound") if "bound_s" not in p else None)
    return "-" if v is None else f"{v:.3g}x"


def real_models_section(rows: list[dict[str, Any]]) -> str:
    """The ``real_models`` suite per model and N: ntkcore and torch.func times, the ratio,
    the blocks, the parameter shares in dense / torch.func blocks, and (budget cases) peak
    working memory over ``max_memory``."""
    base = {(r["case"], r["dtype"]): r for r in rows if r["impl"] == "torch.func jacobian"}
    table = []
    for r in rows:
        if r["impl"] != "ntkcore":
            continue
        p = r.get("params") or {}
        if "N" not in p:  # a model that was not run
            table.append([p.get("model", r["case"]), *["-"] * 13, r.get("note", "")])
            continue
        b = base.get((r["case"], r["dtype"]))
        sp = r.get("_speedup")
        over = p.get("mem_over_budget")
        table.append([
            p.get("model", r["case"]), p["N"], fmt_time(r.get("median_s")),
            fmt_time(b.get("median_s")) if b else "-",
            "-" if sp is None else f"{sp:.3g}x",
            fmt_time(p["floor_s"]) if p.get("floor_s") is not None else "-",
            _func_over_floor(p),
            "-" if p.get("gram_flops") is None else f"{p['gram_flops'] / 1e9:.3g}",
            fmt_time(p["bound_s"]) if p.get("bound_s") is not None else "-",
            f"{100 * p['share']:.0f}%" if p.get("share") is not None else "-",
            _blocks_text(p.get("blocks")),
            "-" if p.get("dense_share") is None else f"{100 * p['dense_share']:.1f}%",
            "-" if p.get("func_share") is None else f"{100 * p['func_share']:.1f}%",
            "-" if over is None else f"{fmt_bytes(r.get('peak_mem_bytes'))} / "
                                     f"{p.get('max_memory')} = {over:.2f}x",
            ", ".join(p.get("torch_func_blocks") or [])[:200],
        ])
    return ("\nPer model (trace mode; ratio = torch.func time / ntkcore time, timed "
            "interleaved in one run; floor = the forward pass and the activation-gradient "
            "backward passes, which both need (the faster of one pass per output and one "
            "batched pass), timed in the same rounds; max ratio = "
            "torch.func time / floor, the most a method built on those passes can gain; "
            "Gram = the planned Gram's GFLOP; bound = floor + the Gram's flops at the GEMM "
            "rate measured in the same rounds; share = bound / ntkcore; "
            "blocks = Kronecker / dense / of which built by the "
            "torch.func pass; shares = parameters in dense / in torch.func blocks; memory = "
            "peak working memory over `max_memory` in the budget cases):\n\n"
            + _table(["model", "N", "ntkcore", "torch.func", "ratio", "floor", "max ratio",
                      "Gram GFLOP", "bound", "share",
                      "blocks (K / dense / torch.func)", "dense params",
                      "torch.func params", "peak / max_memory", "torch.func blocks"], table))


INTRO = """# Benchmarks

*Generated by `python -m benchmarks.render` from the JSON files in `benchmarks/results/`;
edit the renderer, not this file.*

## Reproducing

```bash
python -m benchmarks --render                      # all suites, all CPU backends ({minutes})
python -m benchmarks --suite regression,peers --backend numpy,torch
python -m benchmarks --quick --out /tmp/smoke.json # seconds-long smoke run (used by the tests)
bash benchmarks/peers/make_venv.sh                 # once: neural-tangents in .venv-nt/
bash benchmarks/gpu.sh OUTDIR                      # on a machine with one NVIDIA GPU
```

## How the numbers are taken

- **Time**: each case runs once untimed (warm-up: JIT compilation, lazy initialisation), then
  up to 5 timed calls (fewer once a case has used 20 s); the tables give the median and the
  min–max range. On a GPU every call is followed by a device synchronisation (and JAX results
  by `block_until_ready`), so asynchronous launches are not mistaken for finished work.
- **Peak memory** (CPU): every case runs again in a fresh Python process; after a warm-up call
  the kernel's resident-set high-water mark is reset and the reported figure is its growth
  during one call (working memory including the output, excluding the inputs). On a GPU:
  `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, or the bytes in use in
  CuPy's memory pool, minus what was allocated before the call.
- **GEMM throughput** of each backend is measured in the same run (square products, float32
  and float64); "GEMM %" is a row's flop count divided by its median time, as a fraction of
  that throughput.  "roofline %" is the least GEMM work the problem needs (for dense-layer
  MLPs: forward pass, output-gradient pass and the symmetric Kronecker Grams,
  `benchmarks/suites/ntk.py:mlp_roofline_flops`; for SMW: the symmetric product
  U^T U and the two products with U), divided by the time and the same throughput: the
  share of the GEMM-bound floor an implementation reaches.  The `ntk` suite's MLP rows on
  the CPU, and ntkcore's rows of the `peers` suite, divide instead by the rate of a
  2048 x 2048 GEMM timed in the same rounds as the row's calls (`gemm_gflops`), so that a
  slow phase of a shared machine slows both sides of the share.
- **Speed-up** compares a row with the baseline named in the row (same case, device and dtype,
  same run); "rel. error" is the relative error against a float64 reference computed in the
  same run.
- **BLAS environment**: some machines set `OPENBLAS_CORETYPE` and `OPENBLAS_L2_SIZE` to protect
  old OpenBLAS builds; they slow a current one down. Timing runs of `python -m benchmarks`
  re-execute themselves without both variables (only that command; tests and CI keep them)
  and record the BLAS kernel threadpoolctl reports.
- **malloc**: glibc returns freed buffers of a few MB and more to the operating system, so
  each call of a kernel page-faults its working memory in again (on the 8 x 1000 MLP,
  N = 512: 3,000-16,000 minor faults per call, 0.002-0.5 s of system time depending on the
  host).  Large `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` (or jemalloc/tcmalloc
  through `LD_PRELOAD`) keep those buffers in the process.  The runner never sets them; each
  run's machine table lists the settings it ran with ("malloc settings").
- The machine that produced the CPU tables is shared: treat differences under ~20% as noise,
  and check the load average recorded with each run.

## Peers and baselines

- **neural-tangents** (suite `peers`): version 0.6.5 needs jax 0.4.23–0.4.25 and numpy < 2,
  so it lives in its own virtual environment, `.venv-nt/`, made by
  `bash benchmarks/peers/make_venv.sh` (pins in `benchmarks/peers/requirements-nt.lock`:
  jax/jaxlib 0.4.25, numpy 1.26.4; pip also pulls in TensorFlow through tf2jax). The suite
  writes the MLP's weights and inputs to an `.npz` file and runs
  `benchmarks/peers/nt_runner.py` in that venv, one process per implementation (1: Jacobian
  contraction, 2: NTK-vector products, 3: structured derivatives). The model is written with
  `lax.dot_general(x, W)` and the kernel function is built with `vmap_axes=0`, so that the
  structured rules apply; the first (compiling) call is excluded from the timing. The runner
  replaces `neural_tangents.experimental` (the TensorFlow bridge, unused here) by an empty
  module so that TensorFlow is not imported (it costs ~15 s per process). Implementation 3
  (the baseline) is timed *interleaved* with ntkcore: its runner stays up with the compiled
  kernel function and answers "time k" requests, and each round gives every ntkcore backend
  and the peer one turn of the same number of calls (0.3 s idle before each turn, so that
  spinning BLAS threads of the previous turn do not take a core), for about a minute per
  case; medians are over all rounds. Timing one library after the other let the machine's
  slow and fast phases decide the ratio. Without the venv the suite still runs ntkcore and
  says in its notes why neural-tangents was not run.
- **PyTorch** (suite `ntk`): `torch.func` Jacobian contraction (`vmap(jacrev)` + one GEMM)
  and NTK-vector products, on the same `torch.nn` models.
- **Regression** (suite `regression`): scipy `cho_factor`/`cho_solve`, a dense LU solve, and
  autograd through `torch.linalg.solve` for the backward pass.
"""


GPU_NONE = """## GPU

No GPU results yet. `benchmarks/gpu.sh OUTDIR` is ready for a machine with one NVIDIA GPU and
no network (it installs the wheels carried in `./.whl`, which `bash benchmarks/gpu.sh
--fetch-wheels` downloads on a machine with network, since array-api-compat is not on such
machines; it then runs `pytest -m gpu` for the torch-CUDA
and CuPy backends with TF32 disabled, then the GPU benchmark selection with
`--device cuda`, recording whether TF32 was on, and writes JSON and logs to OUTDIR), but it
has not been run: the task that built this benchmark had no GPU machine. Copy the JSON it
writes into `benchmarks/results/` and re-run `python -m benchmarks.render` to add the GPU
tables here.
"""


def _suites_with_rows(doc: dict[str, Any]) -> set[str]:
    return {r.get("suite") for r in doc.get("rows", [])} - {None}


def default_files() -> list[Path]:
    """Non-quick results in benchmarks/results/ that hold the newest rows of some case on
    their (machine, device): e.g. a main run plus later runs of single suites or cases."""
    docs = []
    for p in sorted(RESULTS.glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("config", {}).get("quick"):
            continue
        docs.append((p, doc))
    keep = _newest_per_case(docs)
    return [p for p, _ in docs if keep.get(str(p))]


def _newest_per_case(docs: list[tuple[Path, dict[str, Any]]]) -> dict[str, set[tuple[str, str]]]:
    """File -> the (suite, case) pairs whose rows it should contribute: for each (machine,
    device, suite, case), the newest file (by ``created``) with rows of that case.  All rows
    of one case (every implementation of a ratio) come from one run."""
    best: dict[tuple[str, str, str, str], tuple[str, str]] = {}
    for p, doc in docs:
        key0 = (doc.get("machine_slug", Path(p).stem), doc.get("config", {}).get("device", "cpu"))
        created = doc.get("created", "")
        for pair in {(r.get("suite"), r.get("case")) for r in doc.get("rows", [])
                     if r.get("suite") is not None}:
            key = (*key0, *pair)
            if key not in best or created >= best[key][0]:
                best[key] = (created, str(p))
    out: dict[str, set[tuple[str, str]]] = {}
    for (_, _, suite, case), (_, p) in best.items():
        out.setdefault(p, set()).add((suite, case))
    return out


def _only_cases(doc: dict[str, Any], cases: set[tuple[str, str]]) -> dict[str, Any]:
    """``doc`` restricted to the (suite, case) pairs ``cases`` (rows and suite statuses)."""
    out = dict(doc)
    out["rows"] = [r for r in doc.get("rows", []) if (r.get("suite"), r.get("case")) in cases]
    suites = {suite for suite, _ in cases}
    out["suites"] = {k: v for k, v in doc.get("suites", {}).items() if k in suites}
    return out


def _expected_minutes(docs: list[dict[str, Any]]) -> str:
    """The wall time of the CPU run that covered the most suites, without a case filter (the
    newest of those): a run of one suite or one case says nothing about running them all."""
    cpu = [d for d in docs if d.get("config", {}).get("device") == "cpu"
           and not d.get("config", {}).get("quick") and not d.get("config", {}).get("cases")]
    if cpu:
        widest = max(range(len(cpu)),
                     key=lambda i: (len(cpu[i].get("config", {}).get("suites") or ()), i))
        return f"took {cpu[widest].get('wall_s', 0) / 60:.0f} min on the machine below"
    return "capped at 25 min by --total-budget"


def render(files: list[Path] | None = None, docs: Path = ROOT / "docs") -> Path:
    """Write ``docs/benchmarks.md`` (and ``docs/img/*.png``) from result files."""
    auto = files is None
    files = default_files() if files is None else [Path(f) for f in files]
    loaded = [json.loads(Path(f).read_text()) for f in files]
    if auto:  # each case once per machine and device: from the newest file that ran it
        keep = _newest_per_case(list(zip(files, loaded, strict=True)))
        loaded = [_only_cases(d, keep.get(str(f), set()))
                  for f, d in zip(files, loaded, strict=True)]
    img_dir = docs / "img"
    parts = [INTRO.replace("{minutes}", _expected_minutes(loaded))]
    if not any(d.get("config", {}).get("device") == "cuda" for d in loaded):
        parts.append(GPU_NONE)
    if not loaded:
        parts.append("\n## CPU results\n\nNo full run has been recorded yet. The CPU tables are "
                     "produced on a quiet machine by `python -m benchmarks --render`, which writes "
                     "`benchmarks/results/<machine>-cpu-<date>.json` and regenerates this page.\n")
    for f, d in zip(files, loaded, strict=True):
        parts.append(f"\n<!-- from {Path(f).name} -->\n")
        parts.append(render_doc(d, img_dir, "img"))
    docs.mkdir(parents=True, exist_ok=True)
    out = docs / "benchmarks.md"
    out.write_text("\n".join(parts).rstrip() + "\n")
    print(f"[benchmarks] rendered {out} from {len(files)} result file(s)", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.render", description=__doc__)
    p.add_argument("files", nargs="*", type=Path, help="result JSON files (default: newest "
                                                       "full run per machine and device)")
    p.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = p.parse_args(argv)
    render(args.files or None, docs=args.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
