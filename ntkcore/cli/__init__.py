"""The ``ntkcore`` command line (``python -m ntkcore`` or the ``ntkcore`` console script):
``info``, ``demo`` (:mod:`ntkcore.cli.demo`), ``bench`` (source checkout only) and ``support``.
Application layer: may import NumPy, PyTorch, scikit-learn and matplotlib, lazily.  Exit codes:
0 success, 1 failure while running, 2 bad arguments."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from ntkcore.support import support_markdown

from .demo import (
    DEFAULT_PLOT,
    PLOT_NAME,
    CLIError,
    DemoResult,
    demo_data,
    demo_model,
    fmt_bytes,
    run_demo,
)
from .output import OutputError

__all__ = ["DEFAULT_PLOT", "DemoResult", "demo_data", "demo_model", "main", "run_demo",
           "support_markdown"]

PROG = "ntkcore"
# backend name (ntkcore.backend.BACKEND_NAMES) -> the module whose namespace it serves, where
# they differ; "generic" stands for any other array-API namespace (array_api_strict is shown)
_NAMESPACES = {"jax": "jax.numpy", "generic": "array_api_strict"}


def _version(dist: str) -> str | None:
    """Installed version of a distribution, without importing it (``None``: not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# -- commands --------------------------------------------------------------------------------
def _devices(name: str, module: Any) -> list[tuple[str, Any]]:
    """``(label, device)`` of each device the framework ``module`` sees."""
    if name == "torch":
        cuda = module.cuda
        return [("cpu", module.device("cpu"))] + [
            (f"cuda:{i} {cuda.get_device_name(i)}", module.device("cuda", i))
            for i in range(cuda.device_count() if cuda.is_available() else 0)]
    if name == "cupy":
        return [(f"cuda:{i}", module.cuda.Device(i))
                for i in range(module.cuda.runtime.getDeviceCount())]
    if name == "jax":
        return [(f"{d.platform}:{d.id} {d.device_kind}", d) for d in module.devices()]
    return [("cpu", "cpu")]


def _backend_facts() -> list[dict[str, Any]]:
    """Per backend: version and, per device, free memory as the backend reports it
    (:meth:`~ntkcore.backend.Backend.free_memory`, what default budgets are a share of)."""
    from ntkcore.backend import BACKEND_NAMES, get_backend

    facts: list[dict[str, Any]] = []
    for name in BACKEND_NAMES:
        top = _NAMESPACES.get(name, name).split(".")[0]
        entry: dict[str, Any] = {"backend": name, "version": None, "devices": []}
        facts.append(entry)
        if importlib.util.find_spec(top) is None:
            continue
        try:  # a broken install is a fact worth reporting, not a crash
            module = importlib.import_module(top)
            entry["version"] = str(getattr(module, "__version__", "unknown"))
            backend = get_backend(importlib.import_module(_NAMESPACES.get(name, name)))
            entry["devices"] = [{"name": label, "gpu": backend.is_gpu(dev),
                                 "free": backend.free_memory(dev)}
                                for label, dev in _devices(name, module)]
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
    return facts


def _blas_facts() -> list[dict[str, Any]] | str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "threadpoolctl not installed (pip install threadpoolctl)"
    return [{"library": p.get("internal_api"), "version": p.get("version"),
             "threads": p.get("num_threads"), "path": p.get("filepath")}
            for p in threadpool_info()]  # after _backend_facts: the frameworks' BLAS are loaded


def collect_info() -> dict[str, Any]:
    """Everything ``ntkcore info`` prints, as a JSON-serialisable dict."""
    import ntkcore

    backends = _backend_facts()
    return {
        "ntkcore": {"version": ntkcore.__version__,
                    "path": str(Path(ntkcore.__file__).resolve().parent)},
        "python": {"version": platform.python_version(),
                   "implementation": platform.python_implementation(),
                   "platform": platform.platform()},
        "cpu_count": os.cpu_count(),
        "packages": {name: _version(name) for name in (
            "numpy", "scipy", "array-api-compat", "array-api-strict", "torch", "jax", "jaxlib",
            "cupy", "dask", "distributed", "zarr", "scikit-learn", "matplotlib", "tqdm",
            "threadpoolctl", "psutil", "sphinx", "myst-parser")},
        "backends": backends,
        "blas": _blas_facts(),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                           "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
                if k in os.environ},
    }


def _blas_lines(pools: list[dict[str, Any]]) -> list[str]:
    """One line per BLAS / OpenMP pool: library, version, threads, path, in columns as wide as
    their widest entry (a long version never runs into the thread count)."""
    rows = [(p["library"] or "?", p["version"] or "-",
             f"{p['threads']} thread{'' if p['threads'] == 1 else 's'}", p["path"] or "")
            for p in pools]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True))
            + f"  {r[3]}".rstrip() for r in rows]


def _cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    nk, py = info["ntkcore"], info["python"]
    print(f"ntkcore {nk['version']}  ({nk['path']})\npython  {py['version']} "
          f"({py['implementation']}, {py['platform']}), {info['cpu_count']} logical CPUs\n"
          "\npackages")
    for name, v in info["packages"].items():
        print(f"  {name:<17} {v or '-'}")
    print("\nbackends and devices (free memory)")
    for b in info["backends"]:
        print(f"  {b['backend']:<8} {b['version'] or 'not installed'}"
              + ("  (any other array-API namespace)" if b["backend"] == "generic" else ""))
        if b.get("error"):
            print(f"           error: {b['error']}")
        for d in b["devices"]:
            print(f"           {d['name']}: {fmt_bytes(d['free'])} free")
    print("\nBLAS thread pools (threadpoolctl)")
    blas = info["blas"]  # the pools, or why they are unknown
    if isinstance(blas, str) or not blas:
        print(f"  {blas or 'none found'}")
    else:
        print("\n".join(_blas_lines(blas)))
    if info["env"]:
        print("\nenvironment\n" + "\n".join(f"  {k}={v}" for k, v in info["env"].items()))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.n_train is not None and args.n_train < 10:
        raise CLIError(f"--n-train must be at least 10 (one image per class); got {args.n_train}")
    res = run_demo(model=args.model, n_train=args.n_train, n_test=args.n_test, width=args.width,
                   ridge=args.ridge, dtype=args.dtype, device=args.device,
                   max_memory=args.max_memory, seed=args.seed,
                   out=None if args.no_plot else DEFAULT_PLOT if args.out is None else args.out,
                   progress=not (args.json or args.no_progress), verbose=not args.json)
    if args.json:
        print(json.dumps(res.__dict__, indent=2))
    return 0


def source_root() -> Path | None:
    """The source checkout holding ``benchmarks/`` and ``asv.conf.json`` next to the
    ``ntkcore`` package, if any."""
    import ntkcore

    root = Path(ntkcore.__file__).resolve().parent.parent
    if (root / "asv.conf.json").is_file() and (root / "benchmarks").is_dir():
        return root
    return None


def _cmd_bench(argv: list[str]) -> int:
    """``asv ARGV`` in the source checkout; without arguments a quick run of every benchmark
    in this Python environment (``asv run --python=same --quick``)."""
    root = source_root()
    if root is None:
        raise CLIError("the benchmarks (asv) live in the source checkout (benchmarks/ and "
                       "asv.conf.json next to ntkcore/), which this installation does not have; "
                       "clone the repository, `pip install -e \".[bench]\"` and run "
                       "`ntkcore bench` there")
    try:
        return subprocess.call([sys.executable, "-m", "asv",
                                *(argv or ["run", "--python=same", "--quick"])], cwd=root)
    except KeyboardInterrupt:
        return 130


def _cmd_support(args: argparse.Namespace) -> int:
    text = support_markdown()
    if args.check is not None:
        if not args.check.is_file():
            raise CLIError(f"--check: {args.check} does not exist")
        if args.check.read_text(encoding="utf-8") != text:
            print(f"{args.check} differs from the support table; regenerate it with "
                  f"`python -m ntkcore support --out {args.check}`", file=sys.stderr)
            return 1
        print(f"{args.check} is up to date")
    elif args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


# -- entry point -----------------------------------------------------------------------------
def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Any:
    """An argparse ``type``: ``convert(text)``, a usage error (exit 2) unless ``ok`` holds."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
            valid = ok(value)
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    from ntkcore._memory import parse_memory

    positive = _checked(int, lambda v: v >= 1, "a positive integer")
    p = argparse.ArgumentParser(
        prog=PROG, description="ntkcore: empirical neural tangent kernels on any array library.",
        epilog="`ntkcore <command> --help` describes each command.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="command")
    q = sub.add_parser("info", help="versions, backends, devices, free memory, BLAS threads")
    q.add_argument("--json", action="store_true", help="print JSON instead of text")

    d = sub.add_parser("demo", help="eNTK kernel regression on scikit-learn's digits, end to end",
                       description="The empirical NTK of an untrained torch network on "
                                   "scikit-learn's digits, Cholesky kernel regression, accuracy, "
                                   "kernel size, time, memory and a plot.")
    d.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                   help="network whose eNTK is used (default: mlp)")
    d.add_argument("--n-train", type=positive, metavar="N",
                   help="training images to use (default: all 1257)")
    d.add_argument("--n-test", type=positive, metavar="M",
                   help="test images to use (default: all 540)")
    d.add_argument("--width", type=positive, default=256,
                   help="hidden width of the MLP (default: 256)")
    d.add_argument("--ridge", type=_checked(float, lambda v: 0 <= v < math.inf,
                                            "a non-negative finite number"),
                   default=1e-3, help="ridge relative to mean(diag K) (default: 1e-3)")
    d.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="dtype of the network and kernel (default: float32)")
    d.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="torch device (default: cuda if available, else cpu)")
    d.add_argument("--max-memory", type=_checked(str, parse_memory, "a size such as 200MB"),
                   metavar="SIZE", help="working-memory budget of the kernel computation, "
                                        "e.g. 200MB (default: a quarter of the free memory)")
    d.add_argument("--seed", type=int, default=0, help="split and initialisation seed")
    d.add_argument("--out", type=Path, metavar="PNG",
                   help=f"plot file; an existing symbolic link there is refused (default: "
                        f"{PLOT_NAME} in a fresh private directory under the temporary "
                        f"directory, printed at the end)")
    d.add_argument("--no-plot", action="store_true", help="do not write a plot")
    d.add_argument("--no-progress", action="store_true", help="no progress display")
    d.add_argument("--json", action="store_true",
                   help="print the measurements as JSON (implies --no-progress)")

    sub.add_parser("bench", add_help=False,
                   help="asv in the source checkout (default: run --python=same --quick)")
    s = sub.add_parser("support", help="the backend support table as Markdown")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--out", type=Path, metavar="PATH", help="write it to PATH")
    g.add_argument("--check", type=Path, metavar="PATH",
                   help="exit 1 if PATH differs from the generated table")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from ntkcore.errors import BudgetTooSmallError

    try:
        if argv and argv[0] == "bench":  # forwarded verbatim, --help included
            return _cmd_bench(argv[1:])
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse: 0 for --help, 2 for bad arguments
            return int(exc.code) if isinstance(exc.code, int) else 2
        if args.version:
            import ntkcore

            print(f"ntkcore {ntkcore.__version__}")
            return 0
        if args.command is None:
            parser.print_help(sys.stderr)
            print(f"\n{PROG}: error: a command is required (info, demo, bench, support)",
                  file=sys.stderr)
            return 2
        return {"info": _cmd_info, "demo": _cmd_demo, "support": _cmd_support}[args.command](args)
    # the budget error states the budget that works; OutputError an --out it will not write to
    except (CLIError, OutputError, BudgetTooSmallError) as exc:
        print(f"{PROG} {argv[0] if argv else ''}: error: {exc}".replace("  ", " "),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
