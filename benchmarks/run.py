"""Benchmark runner: ``python -m benchmarks`` (or ``python benchmarks/run.py``).

Named suites are the modules ``benchmarks/suites/<name>.py`` (each defines
``run(cfg) -> list[dict]``) plus ``peers`` (neural-tangents, ``benchmarks/peers/suite.py``).
A suite that fails to import, raises or runs past ``--suite-timeout`` is reported in the JSON
(``suites[<name>]["status"]``) and skipped; the rows it produced before failing are kept.
Every row is written to the result file as soon as the suite builds it (the running suite has
status ``"running"`` there), so a run killed from outside keeps its finished cases; SIGTERM
and Ctrl-C stop the current suite with status ``"killed"`` / ``"interrupted"`` and still write
the file.  A stopped suite lists its planned cases that produced no row
(``suites[<name>]["cases_not_run"]``, for suites that iterate over ``cfg.select(CASES)``).

``--case SUBSTRING`` (repeatable) runs only the matching cases of the selected suites
(``--set cases=A,B`` is the same); suites document their own ``--set`` options (e.g. the
``ntk`` suite's baseline switches).

Timing runs re-execute the runner once in a subprocess whose environment lacks
``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` (set on some machines to protect old OpenBLAS
builds; they slow a current one down).  Only this command does that; ``--quick`` runs and the
test suite keep the environment as it is (``--blas-env keep|clean`` overrides).

Output: one JSON file (default ``benchmarks/results/<machine>-<device>-<date>.json``) with
``machine`` facts, the ``config``, the measured ``gemm`` throughput, per-suite status and the
result ``rows``; ``--render`` then writes ``docs/benchmarks.md`` and ``docs/img/*.png``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import math
import os
import pkgutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python benchmarks/run.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _harness
from benchmarks._harness import BACKENDS, Config
from benchmarks.machine import BLAS_ENV

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1
# suites that live outside benchmarks/suites/
EXTRA_SUITES = {"peers": "benchmarks.peers.suite"}
# listing order: the order first, then anything else alphabetically
PREFERRED_ORDER = ("gram", "ntk", "providers", "regression", "smw", "sketch", "seng", "peers")
ROW_KEYS = ("suite", "case", "impl", "backend", "device", "dtype", "params", "note")


class SuiteTimeout(BaseException):
    """Raised inside a suite when it runs past ``--suite-timeout`` (a BaseException, so that
    a suite's own ``except Exception`` cannot swallow it)."""


class RunKilled(BaseException):
    """Raised inside a suite when the runner receives SIGTERM."""


def discover() -> dict[str, str]:
    """Suite name -> module name, without importing anything."""
    from benchmarks import suites

    found = {
        m.name: f"benchmarks.suites.{m.name}"
        for m in pkgutil.iter_modules(suites.__path__)
        if not m.name.startswith("_")
    }
    found.update(EXTRA_SUITES)
    order = {n: i for i, n in enumerate(PREFERRED_ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def _split(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out.extend(s.strip() for s in v.split(",") if s.strip())
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        # `ntkcore bench` sets NTKCORE_BENCH_PROG so that usage and errors name that command
        prog=os.environ.get("NTKCORE_BENCH_PROG") or "python -m benchmarks",
        description="Run ntkcore's benchmark suites and write a JSON result file.",
    )
    p.add_argument("--suite", action="append", metavar="NAME",
                   help="suite(s) to run, repeatable or comma-separated (default: all)")
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="numpy|torch|jax|cupy|all, repeatable or comma-separated "
                        "(default: all available on the device)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--quick", action="store_true",
                   help="seconds-long smoke run: tiny sizes, one repetition")
    p.add_argument("--out", type=Path, help="result JSON (default: benchmarks/results/"
                                            "<machine>-<device>-<date>.json)")
    p.add_argument("--render", action="store_true",
                   help="render docs/benchmarks.md and docs/img/ afterwards")
    p.add_argument("--docs", type=Path, default=ROOT / "docs",
                   help="where --render writes (default: docs/)")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per case (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per case (default 1)")
    p.add_argument("--budget", type=float, default=20.0,
                   help="stop repeating a case after this many timed seconds (default 20)")
    p.add_argument("--no-memory", action="store_true", help="skip peak-memory measurements")
    p.add_argument("--suite-timeout", type=float, default=420.0,
                   help="seconds before a suite is abandoned (default 420; 0: none)")
    p.add_argument("--total-budget", type=float, default=1500.0,
                   help="seconds for all suites together (default 1500 = 25 min; 0: none): "
                        "each suite's timeout is cut so that every suite still to run keeps "
                        "at least 60 s")
    p.add_argument("--blas-env", choices=("auto", "clean", "keep"), default="auto",
                   help="unset OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE for this run "
                        "(auto: clean unless --quick)")
    p.add_argument("--tf32", choices=("default", "on", "off"), default="default",
                   help="TF32 for float32 GEMMs on the GPU (default: the libraries' defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra option passed to suites in cfg.extra")
    p.add_argument("--case", action="append", metavar="SUBSTRING",
                   help="run only the cases whose name contains SUBSTRING (case-insensitive; "
                        "repeatable or comma-separated; same as --set cases=...)")
    p.add_argument("--long-call", type=float, default=10.0, metavar="SECONDS",
                   help="a case whose checked first call took this long is timed by that "
                        "call alone where the suite supports it (default 10)")
    p.add_argument("--machine-name", help="machine part of the default output name")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--print-env", action="store_true",
                   help="print the BLAS environment the timing process sees and exit")
    p.add_argument("--strict", action="store_true",
                   help="exit with status 1 if any suite failed")
    return p.parse_args(argv)


def _maybe_reexec(args: argparse.Namespace, argv: list[str]) -> int | None:
    """Re-run this command without the OpenBLAS guard variables; None if not needed."""
    mode = args.blas_env
    if mode == "auto":
        mode = "keep" if args.quick else "clean"
    if mode != "clean" or os.environ.get("NTKCORE_BENCH_REEXEC") == "1":
        return None
    present = {k: os.environ[k] for k in BLAS_ENV if k in os.environ}
    if not present:
        return None
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in BLAS_ENV}
    env["NTKCORE_BENCH_REEXEC"] = "1"
    env["NTKCORE_BENCH_ORIG_ENV"] = json.dumps(present)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    print(f"[benchmarks] re-running without {', '.join(present)} for timing",
          file=sys.stderr)
    return subprocess.call([sys.executable, "-m", "benchmarks", *argv], env=env)


def _apply_tf32(mode: str, device: str) -> None:
    if device != "cuda" or mode == "default":
        return
    on = mode == "on"
    os.environ["CUPY_TF32"] = "1" if on else "0"
    try:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
    except ImportError:
        pass


def _backends(args: argparse.Namespace) -> tuple[str, ...]:
    wanted = _split(args.backend) or ["all"]
    if "all" in wanted:
        return _harness.available_backends(args.device)
    for b in wanted:
        if b not in BACKENDS:
            raise SystemExit(f"--backend: unknown backend {b!r}; choose from {BACKENDS} or all")
    available = _harness.available_backends(args.device, wanted)
    missing = [b for b in wanted if b not in available]
    if missing:
        print(f"[benchmarks] not available on {args.device}: {', '.join(missing)} (skipped)",
              file=sys.stderr)
    return tuple(b for b in wanted if b in available)


def measure_gemm(cfg: Config) -> list[dict[str, Any]]:
    """GEMM throughput of each selected backend on the device (float32 and float64 for numpy
    and torch, the run's dtype for the others)."""
    n = cfg.pick(256, 2048 if cfg.device == "cpu" else 8192)
    out = []
    for b in cfg.backends:
        dtypes = ("float32", "float64") if b in ("numpy", "torch") else (cfg.dtype,)
        for dt in dtypes:
            try:
                out.append(_harness.gemm_throughput(b, cfg.device, dt, n,
                                                    repeat=cfg.pick(1, 3)))
            except Exception as exc:
                out.append({"backend": b, "device": cfg.device, "dtype": dt, "n": n,
                            "error": repr(exc)})
    return out


def _suite_timeout(args: argparse.Namespace, elapsed: float, left: int) -> float | None:
    """Timeout of the next suite: ``--suite-timeout``, cut so that the ``left - 1`` suites
    after it keep 60 s each within ``--total-budget``; None in quick runs or with both off."""
    if args.quick:
        return None
    limits = []
    if args.suite_timeout > 0:
        limits.append(args.suite_timeout)
    if args.total_budget > 0:
        limits.append(max(60.0, args.total_budget - elapsed - 60.0 * (left - 1)))
    return min(limits) if limits else None


def run_suite(name: str, module: str, cfg: Config, timeout: float | None) -> dict[str, Any]:
    """Import and run one suite; never raises (failures are reported in the result).

    Statuses: ``ok``, ``import-error``, ``error``, ``timeout``, ``killed`` (SIGTERM),
    ``interrupted`` (Ctrl-C).  ``cases_not_run``: cases the suite planned
    (``cfg.select``) that have no row, when it did not finish.
    """
    _harness._EMITTED.clear()
    _harness._PLANNED.clear()
    t0 = time.perf_counter()
    info: dict[str, Any] = {"module": module}
    try:
        mod = importlib.import_module(module)
        fn = getattr(mod, "run", None)
        if not callable(fn):
            raise AttributeError(f"{module} defines no run(cfg)")
    except Exception:
        info.update(status="import-error", error=traceback.format_exc(limit=6), rows=[])
        info["wall_s"] = time.perf_counter() - t0
        return info

    def _alarm(signum: int, frame: Any) -> None:
        raise SuiteTimeout(f"suite {name!r} ran past {timeout:.0f} s")

    def _term(signum: int, frame: Any) -> None:
        raise RunKilled(f"suite {name!r} stopped by SIGTERM")

    use_alarm = bool(timeout) and hasattr(signal, "SIGALRM")
    old = signal.signal(signal.SIGALRM, _alarm) if use_alarm else None
    old_term = None
    try:
        old_term = signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread
        pass
    if use_alarm:
        signal.setitimer(signal.ITIMER_REAL, float(timeout))  # type: ignore[arg-type]
    try:
        rows = fn(cfg)
        if rows is None:
            rows = list(_harness._EMITTED)
        info.update(status="ok", rows=list(rows))
    except SuiteTimeout as exc:
        info.update(status="timeout", error=str(exc), rows=list(_harness._EMITTED))
    except RunKilled as exc:
        info.update(status="killed", error=str(exc), rows=list(_harness._EMITTED))
    except KeyboardInterrupt:
        info.update(status="interrupted", error=f"suite {name!r} interrupted (Ctrl-C)",
                    rows=list(_harness._EMITTED))
    except Exception:
        info.update(status="error", error=traceback.format_exc(limit=8),
                    rows=list(_harness._EMITTED))
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            signal.signal(signal.SIGALRM, old)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    info["timeout_s"] = timeout
    if _harness._PLANNED:
        info["cases_planned"] = list(_harness._PLANNED)
        if info["status"] != "ok":
            done = {r.get("case") for r in info["rows"] if isinstance(r, dict)}
            info["cases_not_run"] = [c for c in _harness._PLANNED if c not in done]
            if info["rows"] and isinstance(info["rows"][-1], dict):
                # the case of the last row may have been cut short
                info["last_case"] = info["rows"][-1].get("case")
    bad = [r for r in info["rows"] if not isinstance(r, dict) or any(k not in r for k in ROW_KEYS)]
    if bad:
        info["rows"] = [r for r in info["rows"] if r not in bad]
        info["dropped_rows"] = len(bad)
    info["wall_s"] = time.perf_counter() - t0
    return info


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def _clean_floats(x: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean_floats(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean_floats(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    known = discover()
    if args.list:
        for name, mod in known.items():
            print(f"{name:12s} {mod}")
        return 0
    rc = _maybe_reexec(args, argv)
    if rc is not None:
        return rc
    if args.print_env:
        orig = os.environ.get("NTKCORE_BENCH_ORIG_ENV")
        print(json.dumps({"env": {k: os.environ.get(k) for k in BLAS_ENV},
                          "env_before_reexec": json.loads(orig) if orig else None}))
        return 0

    names = _split(args.suite) or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--suite: unknown suite(s) {unknown}; known: {list(known)}")
    _apply_tf32(args.tf32, args.device)
    extra: dict[str, Any] = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        extra[k] = v
    case_filter = tuple(_split(args.case) + _split([extra["cases"]] if "cases" in extra else []))
    cfg = Config(
        quick=args.quick,
        backends=_backends(args),
        device=args.device,
        dtype=args.dtype,
        repeat=args.repeat,
        warmup=args.warmup,
        extra=extra,
        budget_s=args.budget if args.budget > 0 else None,
        memory=not args.no_memory,
        cases=case_filter,
        long_call_s=args.long_call,
    )
    if not cfg.backends:
        raise SystemExit(f"no selected backend is available on {args.device}")

    from benchmarks import machine

    started = _dt.datetime.now().astimezone()
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    t_start = time.perf_counter()
    gemm = measure_gemm(cfg)

    from tqdm.auto import tqdm

    results: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    facts = machine.collect(cfg.device)
    mslug = args.machine_name or machine.slug(facts, cfg.device)
    out_path = args.out or RESULTS / (
        f"{mslug}-{cfg.device}{'-quick' if cfg.quick else ''}-{started:%Y-%m-%d}.json"
    )
    config = {
        "quick": cfg.quick,
        "backends": list(cfg.backends),
        "device": cfg.device,
        "dtype": cfg.dtype,
        "repeat": cfg.repeat,
        "warmup": cfg.warmup,
        "budget_s": cfg.budget_s,
        "memory": cfg.memory,
        "tf32": args.tf32,
        "suites": names,
        "extra": extra,
        "cases": list(case_filter),
        "long_call_s": cfg.long_call_s,
    }

    def write(complete: bool, running: tuple[str, float] | None = None) -> None:
        """Write the result file; also after each row and suite, so a killed run keeps its
        rows (``running``: the suite in progress and when it started, its rows so far)."""
        suites, all_rows = results, rows
        if running is not None:
            rname, rstart = running
            cur = list(_harness._EMITTED)
            suites = {**results, rname: {
                "module": known[rname], "status": "running", "n_rows": len(cur),
                "wall_s": time.perf_counter() - rstart,
                "error": "still running when this file was written (if the run is over, it "
                         "was killed)",
                "cases_planned": list(_harness._PLANNED),
                "cases_not_run": [c for c in _harness._PLANNED
                                  if c not in {r.get("case") for r in cur}],
                "last_case": cur[-1].get("case") if cur else None}}
            all_rows = rows + cur
        doc = {
            "schema_version": SCHEMA_VERSION,
            "created": started.isoformat(timespec="seconds"),
            "complete": complete,
            "wall_s": time.perf_counter() - t_start,
            "load_average_start": load_start,
            "command": ["python", "-m", "benchmarks", *argv],
            "machine_slug": mslug,
            "machine": facts,
            "config": config,
            "gemm": gemm,
            "suites": suites,
            "rows": all_rows,
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(out_path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(_clean_floats(json.loads(json.dumps(doc, default=_jsonable))), f,
                      indent=1)
            f.write("\n")
        os.replace(tmp, out_path)

    bar = tqdm(total=len(names), desc="suites", unit="suite", file=sys.stderr, leave=True)
    counter = {"n": 0}

    def tick() -> None:
        counter["n"] += 1
        bar.set_postfix_str(f"{counter['n']} cases", refresh=True)

    _harness._ON_MEASURE = tick
    current: dict[str, Any] = {}

    def on_row(r: dict[str, Any]) -> None:
        try:
            write(complete=False, running=(current["name"], current["t0"]))
        except Exception as exc:  # never let saving break the suite
            print(f"[benchmarks] could not save partial results: {exc!r}", file=sys.stderr)

    _harness._ON_ROW = on_row
    try:
        for i, name in enumerate(names):
            bar.set_description(name)
            counter["n"] = 0
            timeout = _suite_timeout(args, time.perf_counter() - t_start, len(names) - i)
            current.update(name=name, t0=time.perf_counter())
            info = run_suite(name, known[name], cfg, timeout)
            suite_rows = info.pop("rows")
            rows.extend(suite_rows)
            info["n_rows"] = len(suite_rows)
            results[name] = info
            msg = f"[benchmarks] {name}: {info['status']}, {len(suite_rows)} rows, " \
                  f"{info['wall_s']:.1f} s"
            if info["status"] != "ok":
                last = (info.get("error") or "").strip().splitlines()[-1:] or [""]
                msg += f" ({last[0]})"
            if info.get("cases_not_run"):
                msg += f"; cases not run: {', '.join(info['cases_not_run'])}"
            bar.write(msg, file=sys.stderr)
            bar.update(1)
            write(complete=False)
            if info["status"] in ("killed", "interrupted"):
                for later in names[i + 1:]:
                    results[later] = {"module": known[later], "status": "not-run",
                                      "n_rows": 0, "wall_s": 0.0,
                                      "error": f"not run: the run was {info['status']}"}
                break
    finally:
        _harness._ON_MEASURE = None
        _harness._ON_ROW = None
        bar.close()

    # the libraries the suites imported are now loaded: record their BLAS/threads too
    facts = machine.collect(cfg.device)
    write(complete=True)
    print(f"[benchmarks] wrote {out_path} ({len(rows)} rows, "
          f"{time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    if args.render:
        from benchmarks import render

        render.render(None if out_path.parent.resolve() == RESULTS.resolve() else [out_path],
                      docs=args.docs)
    failed = [n for n, i in results.items() if i["status"] != "ok"]
    if failed:
        print(f"[benchmarks] suites not ok: {', '.join(failed)}", file=sys.stderr)
    return 1 if (failed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
