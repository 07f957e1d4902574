"""The ``ntkcore`` command line (``python -m ntkcore`` or the ``ntkcore`` console script).

Subcommands
-----------
``info``
    Versions, the array backends and devices this machine offers, BLAS threads and free memory.
``demo``
    The README's main job, end to end: the empirical NTK of a small PyTorch network on
    scikit-learn's digits (computed by :func:`ntkcore.ntk` from the Kronecker structure of its
    layers), Cholesky kernel regression (:class:`ntkcore.KernelRidge`), test accuracy,
    kernel size, time and peak memory, per-layer kernel shares and a plot.  The pipeline is
    :mod:`ntkcore.cli.demo`, which ``examples/ntk_regression_digits.py`` reuses.
``bench``
    Forwards its arguments to the benchmark runner, ``python -m benchmarks`` (source checkout
    only: the benchmarks are not part of the installed package).
``support``
    The per-function / per-backend support table as Markdown
    (:func:`ntkcore.support.support_markdown`); ``docs/backends.md`` is this output.

This package is the application layer: unlike the rest of ``ntkcore/`` it may import NumPy,
PyTorch, scikit-learn and matplotlib (lazily, inside the subcommands).  Exit codes: 0 success,
1 failure while running (missing optional package, failed check), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ntkcore.support import support_markdown

__all__ = ["DemoResult", "demo_data", "demo_model", "main", "run_demo", "support_markdown"]

PROG = "ntkcore"
DEFAULT_PLOT = Path(tempfile.gettempdir()) / "ntkcore-demo.png"


class CLIError(Exception):
    """A failure the command line reports as ``ntkcore <cmd>: error: ...`` with exit code 1."""


# --------------------------------------------------------------------------------------------
# small helpers


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _version(dist: str) -> str | None:
    """Installed version of a distribution, without importing it (``None``: not installed)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _require(module: str, purpose: str, extra: str) -> Any:
    """Import ``module`` or raise a :class:`CLIError` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CLIError(
            f"{purpose} needs {module.split('.')[0]} ({exc}); install it, e.g. "
            f"pip install -e \".[{extra}]\""
        ) from None


def _host_total_memory() -> int | None:
    """Bytes of physical host memory (``None`` when the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except Exception:
            return None


# --------------------------------------------------------------------------------------------
# info


def _devices(name: str, module: Any, host_total: int | None) -> list[tuple[str, Any, Any]]:
    """``(label, device, total bytes)`` of each device the framework ``module`` sees.

    ``device`` is what the backend's ``free_memory`` takes; ``None`` where no free-memory
    figure exists (Apple MPS: unified memory).
    """
    if name == "numpy":
        return [("cpu", "cpu", host_total)]
    if name == "torch":
        cuda = module.cuda
        found = [("cpu", module.device("cpu"), host_total)] + [
            (f"cuda:{i} {cuda.get_device_name(i)}", module.device("cuda", i),
             int(cuda.get_device_properties(i).total_memory))
            for i in range(cuda.device_count() if cuda.is_available() else 0)]
        mps = getattr(module.backends, "mps", None)
        if mps is not None and mps.is_available():
            found.append(("mps", None, None))
        return found
    if name == "cupy":
        return [(f"cuda:{i}", module.cuda.Device(i), int(module.cuda.Device(i).mem_info[1]))
                for i in range(module.cuda.runtime.getDeviceCount())]
    return [(f"{d.platform}:{d.id} {d.device_kind}", d, host_total if d.platform == "cpu"
             else (d.memory_stats() or {}).get("bytes_limit")) for d in module.devices()]


def _backend_facts() -> list[dict[str, Any]]:
    """One entry per backend: installed version, devices and their free / total memory.

    Free memory is the backend's :meth:`ntkcore.backend.Backend.free_memory`, the figure that
    default memory budgets are a share of; totals come from the framework's device query.
    """
    from ntkcore.backend import get_backend
    from ntkcore.backends.generic import GenericBackend

    total = _host_total_memory()
    facts: list[dict[str, Any]] = []
    for name, dists, namespace in (
            ("numpy", ("numpy",), "numpy"), ("torch", ("torch",), "torch"),
            ("cupy", ("cupy", "cupy-cuda12x", "cupy-cuda11x"), "cupy"),
            ("jax", ("jax",), "jax.numpy")):
        version = next((v for v in map(_version, dists) if v is not None), None)
        entry: dict[str, Any] = {"backend": name, "version": version, "devices": []}
        facts.append(entry)
        if version is None:
            continue
        try:  # a broken install is a fact worth reporting, not a crash
            backend = get_backend(importlib.import_module(namespace))
            module = importlib.import_module(name)
            for label, dev, tot in _devices(name, module, total):
                free = None if dev is None else backend.free_memory(dev)
                entry["devices"].append({"name": label, "total": tot, "free": free})
            if name == "torch":
                entry["devices"][0]["threads"] = module.get_num_threads()
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
    cpu = {"name": "cpu", "total": total, "free": GenericBackend(None).free_memory(None)}
    facts.append({"backend": "generic", "version": _version("array-api-strict"),
                  "devices": [cpu], "note": "any other array-API namespace "
                  "(array_api_strict version shown)"})
    return facts


def _blas_facts() -> list[dict[str, Any]] | str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "threadpoolctl not installed (pip install threadpoolctl)"
    import numpy  # noqa: F401  (loads numpy's BLAS so that threadpoolctl sees it)

    if _version("torch") is not None:
        try:
            import torch  # noqa: F401
        except Exception:
            pass
    return [{"library": p.get("internal_api"), "version": p.get("version"),
             "threads": p.get("num_threads"), "path": p.get("filepath")}
            for p in threadpool_info()]


def collect_info() -> dict[str, Any]:
    """Everything ``ntkcore info`` prints, as a JSON-serialisable dict."""
    import ntkcore

    packages = {name: _version(name) for name in (
        "numpy", "scipy", "array-api-compat", "array-api-strict", "torch", "jax", "jaxlib",
        "cupy", "dask", "distributed", "zarr", "scikit-learn", "matplotlib", "tqdm",
        "threadpoolctl", "psutil", "sphinx", "myst-parser")}
    return {
        "ntkcore": {"version": ntkcore.__version__,
                    "path": str(Path(ntkcore.__file__).resolve().parent)},
        "python": {"version": platform.python_version(),
                   "implementation": platform.python_implementation(),
                   "platform": platform.platform()},
        "cpu_count": os.cpu_count(),
        "packages": packages,
        "backends": _backend_facts(),
        "blas": _blas_facts(),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                           "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
                if k in os.environ},
    }


def _print_info(info: dict[str, Any]) -> None:
    nk = info["ntkcore"]
    py = info["python"]
    print(f"ntkcore {nk['version']}  ({nk['path']})")
    print(f"python  {py['version']} ({py['implementation']}, {py['platform']}), "
          f"{info['cpu_count']} logical CPUs")
    print("\npackages")
    for name, v in info["packages"].items():
        print(f"  {name:<17} {v or '-'}")
    print("\nbackends and devices (free / total memory)")
    for b in info["backends"]:
        if b["version"] is None and b["backend"] != "generic":
            print(f"  {b['backend']:<8} not installed")
            continue
        head = f"  {b['backend']:<8} {b['version'] or ''}"
        if b.get("note"):
            head += f"  ({b['note']})"
        print(head)
        if b.get("error"):
            print(f"           error: {b['error']}")
        for d in b["devices"]:
            extra = f", {d['threads']} threads" if "threads" in d else ""
            print(f"           {d['name']}: {_fmt_bytes(d['free'])} free / "
                  f"{_fmt_bytes(d['total'])}{extra}")
    print("\nBLAS thread pools (threadpoolctl)")
    if isinstance(info["blas"], str):
        print(f"  {info['blas']}")
    elif not info["blas"]:
        print("  none found")
    else:
        for p in info["blas"]:
            print(f"  {p['library'] or '?':<9} {p['version'] or '':<10} {p['threads']} threads"
                  f"  {p['path']}")
    if info["env"]:
        print("\nenvironment")
        for k, v in info["env"].items():
            print(f"  {k}={v}")


def _cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


# --------------------------------------------------------------------------------------------
# demo: the options; the pipeline is ntkcore.cli.demo (imported at the end of this module)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a non-negative finite number, got {v}")
    return v


def _memory(text: str) -> str:
    from ntkcore._memory import parse_memory

    try:
        parse_memory(text, "--max-memory")
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.n_train is not None and args.n_train < 10:
        raise CLIError(f"--n-train must be at least 10 (one image per class); got {args.n_train}")
    res = run_demo(model=args.model, n_train=args.n_train, n_test=args.n_test, width=args.width,
                   ridge=args.ridge, dtype=args.dtype, device=args.device,
                   max_memory=args.max_memory, seed=args.seed,
                   out=None if args.no_plot else args.out,
                   progress=not (args.json or args.no_progress), verbose=not args.json)
    if args.json:
        print(json.dumps(res.__dict__, indent=2))
    return 0


# --------------------------------------------------------------------------------------------
# bench


def source_root() -> Path | None:
    """The source checkout holding ``benchmarks/`` next to the ``ntkcore`` package, if any."""
    import ntkcore

    root = Path(ntkcore.__file__).resolve().parent.parent
    if (root / "benchmarks" / "__main__.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def _cmd_bench(argv: list[str]) -> int:
    root = source_root()
    if root is None:
        import ntkcore

        raise CLIError(
            "the benchmark runner lives in the source checkout (benchmarks/ next to ntkcore/), "
            f"which this installation ({Path(ntkcore.__file__).resolve().parent}) does not "
            "have; clone the repository, `pip install -e \".[bench]\"` and run "
            "`python -m ntkcore bench` (or `python -m benchmarks`) there")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env["NTKCORE_BENCH_PROG"] = f"{PROG} bench"  # the runner's usage line names this command
    try:
        return subprocess.call([sys.executable, "-m", "benchmarks", *argv], env=env)
    except KeyboardInterrupt:
        return 130


# --------------------------------------------------------------------------------------------
# support


def _cmd_support(args: argparse.Namespace) -> int:
    text = support_markdown()
    if args.check is not None:
        path = Path(args.check)
        if not path.is_file():
            raise CLIError(f"--check: {path} does not exist")
        if path.read_text(encoding="utf-8") != text:
            print(f"{path} differs from the support table; regenerate it with "
                  f"`python -m ntkcore support --out {path}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    if args.out is not None:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    else:
        sys.stdout.write(text)
    return 0


# --------------------------------------------------------------------------------------------
# entry point


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="ntkcore: empirical neural tangent kernels on any array library.",
        epilog="`ntkcore <command> --help` describes each command.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="command")

    q = sub.add_parser("info", help="versions, backends, devices, BLAS threads, free memory",
                       description="Versions, available backends and devices, BLAS threads "
                                   "and free memory.")
    q.add_argument("--json", action="store_true", help="print JSON instead of text")

    d = sub.add_parser(
        "demo", help="eNTK kernel regression on scikit-learn's digits, end to end",
        description="The empirical NTK of an untrained torch network on scikit-learn's "
                    "digits, Cholesky kernel regression, accuracy, kernel size, time, memory "
                    "and a plot.")
    d.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                   help="network whose eNTK is used (default: mlp)")
    d.add_argument("--n-train", type=_positive_int, default=None, metavar="N",
                   help="training images to use (default: all 1257)")
    d.add_argument("--n-test", type=_positive_int, default=None, metavar="M",
                   help="test images to use (default: all 540)")
    d.add_argument("--width", type=_positive_int, default=256,
                   help="hidden width of the MLP (default: 256)")
    d.add_argument("--ridge", type=_nonneg_float, default=1e-3,
                   help="ridge relative to mean(diag K) (default: 1e-3)")
    d.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="dtype of the network and kernel (default: float32)")
    d.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="torch device (default: cuda if available, else cpu)")
    d.add_argument("--max-memory", type=_memory, default=None, metavar="SIZE",
                   help="working-memory budget of the kernel computation, e.g. 200MB "
                        "(default: a quarter of the free memory)")
    d.add_argument("--seed", type=int, default=0, help="split and initialisation seed")
    d.add_argument("--out", type=Path, default=DEFAULT_PLOT, metavar="PNG",
                   help=f"plot file (default: {DEFAULT_PLOT})")
    d.add_argument("--no-plot", action="store_true", help="do not write a plot")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.add_argument("--json", action="store_true",
                   help="print the measurements as JSON (implies --no-progress)")

    sub.add_parser("bench", help="run the benchmarks (python -m benchmarks; source checkout)",
                   description="Forward all arguments to `python -m benchmarks`; "
                               "`ntkcore bench --help` shows the runner's options.",
                   add_help=False)

    s = sub.add_parser("support", help="the backend support table as Markdown",
                       description="Print the per-function/backend support table "
                                   "(ntkcore/support.py) as Markdown.")
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
        handler = {"info": _cmd_info, "demo": _cmd_demo, "support": _cmd_support}
        return handler[args.command](args)
    except (CLIError, BudgetTooSmallError) as exc:  # the budget error states the one that works
        cmd = argv[0] if argv else ""
        print(f"{PROG} {cmd}: error: {exc}".replace("  ", " "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


# the demo pipeline, shared with examples/ntk_regression_digits.py; imported last because it
# uses CLIError and the helpers above
from .demo import DemoResult, demo_data, demo_model, run_demo  # noqa: E402
