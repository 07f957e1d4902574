"""The ``ntkcore`` command line (``python -m ntkcore`` or the ``ntkcore`` console script).

Subcommands
-----------
``info``
    Versions, the array backends and devices this machine offers, BLAS threads and free memory.
``demo``
    The README's main job, end to end: the empirical NTK of a small PyTorch network on
    scikit-learn's digits (computed by :func:`ntkcore.ntk` from the Kronecker structure of its
    layers), Cholesky kernel regression (:func:`ntkcore.kernel_regression`), test accuracy,
    kernel size, time and peak memory, per-layer kernel shares and a plot.
``bench``
    Forwards its arguments to the benchmark runner, ``python -m benchmarks`` (source checkout
    only: the benchmarks are not part of the installed package).
``support``
    The per-function / per-backend support table (:mod:`ntkcore.support`) as Markdown;
    ``docs/backends.md`` is this output.

This module is the application layer: unlike the rest of ``ntkcore/`` it may import NumPy,
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DemoResult", "main", "run_demo", "support_markdown"]

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


def _peak_rss() -> int | None:
    """Peak resident memory of this process in bytes (``None`` when the OS does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        resource = None  # type: ignore[assignment]
    if resource is not None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024
    try:
        import psutil

        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", info.rss))
    except Exception:
        return None


def _host_memory() -> tuple[int | None, int | None]:
    """(total, available) host memory in bytes."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception:
        pass
    try:
        from ntkcore.backends._host import host_free_memory

        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(total), host_free_memory()
    except Exception:
        return None, None


# --------------------------------------------------------------------------------------------
# info


def _backend_facts() -> list[dict[str, Any]]:
    """One entry per backend: installed version, devices and their free memory."""
    facts: list[dict[str, Any]] = []
    total, avail = _host_memory()
    cpu = {"name": "cpu", "total": total, "free": avail}

    facts.append({"backend": "numpy", "version": _version("numpy"), "devices": [cpu]})

    torch_v = _version("torch")
    entry: dict[str, Any] = {"backend": "torch", "version": torch_v, "devices": []}
    if torch_v is not None:
        try:
            import torch

            entry["devices"].append(dict(cpu, threads=torch.get_num_threads()))
            if torch.cuda.is_available():
                for i in range(torch.cuda.device_count()):
                    free, tot = torch.cuda.mem_get_info(i)
                    entry["devices"].append({"name": f"cuda:{i} {torch.cuda.get_device_name(i)}",
                                             "total": int(tot), "free": int(free)})
            mps = getattr(torch.backends, "mps", None)
            if mps is not None and mps.is_available():
                entry["devices"].append({"name": "mps", "total": None, "free": None})
        except Exception as exc:  # a broken install is a fact worth reporting, not a crash
            entry["error"] = f"{type(exc).__name__}: {exc}"
    facts.append(entry)

    cupy_v = _version("cupy") or _version("cupy-cuda12x") or _version("cupy-cuda11x")
    entry = {"backend": "cupy", "version": cupy_v, "devices": []}
    if cupy_v is not None:
        try:
            import cupy

            for i in range(cupy.cuda.runtime.getDeviceCount()):
                with cupy.cuda.Device(i):
                    free, tot = cupy.cuda.runtime.memGetInfo()
                entry["devices"].append({"name": f"cuda:{i}", "total": int(tot),
                                         "free": int(free)})
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
    facts.append(entry)

    jax_v = _version("jax")
    entry = {"backend": "jax", "version": jax_v, "devices": []}
    if jax_v is not None:
        try:
            import jax

            for d in jax.devices():
                stats = d.memory_stats() if d.platform != "cpu" else None
                tot = stats.get("bytes_limit") if stats else None
                used = stats.get("bytes_in_use") if stats else None
                free = tot - used if tot is not None and used is not None else None
                if d.platform == "cpu":
                    tot, free = total, avail
                entry["devices"].append({"name": f"{d.platform}:{d.id} {d.device_kind}",
                                         "total": tot, "free": free})
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
    facts.append(entry)

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
# demo


@dataclass
class DemoResult:
    """What ``ntkcore demo`` measured.

    Attributes
    ----------
    model : str
        ``"mlp"`` or ``"cnn"``.
    num_params : int
        Parameters of the network.
    n_train, n_test : int
        Training and test images.
    accuracy : float
        Test accuracy of the eNTK kernel regression (argmax of the predicted one-hot scores).
    train_accuracy : float
        Accuracy on the training images (1.0 unless the ridge is large).
    kernel_bytes : int
        Bytes of the two kernel matrices (train x train and test x train).
    layer_names : list of str
        Parameter blocks of the Jacobian, in block order.
    layer_shares : list of float
        Share of each block in the trace of the training kernel (they sum to 1).
    times : dict
        Seconds per stage (``"kernel"``, ``"regression"``, ``"total"``, ...).
    peak_rss : int or None
        Peak resident memory of the process in bytes.
    peak_device : int or None
        Peak CUDA memory allocated by torch (CUDA runs only).
    plot : str or None
        Path of the written PNG.
    predictions : list of int
        Predicted test labels.
    """

    model: str
    num_params: int
    n_train: int
    n_test: int
    accuracy: float
    train_accuracy: float
    kernel_bytes: int
    layer_names: list[str]
    layer_shares: list[float]
    times: dict[str, float] = field(default_factory=dict)
    peak_rss: int | None = None
    peak_device: int | None = None
    plot: str | None = None
    predictions: list[int] = field(default_factory=list)


def demo_data(n_train: int | None = None, seed: int = 0,
              n_test: int | None = None) -> tuple[Any, Any, Any, Any]:
    """scikit-learn's digits, pixels scaled to [0, 1], split 70/30 stratified.

    Returns
    -------
    x_train, x_test : ndarray, shape (N, 64) and (M, 64), float64
    y_train, y_test : ndarray of int, shape (N,) and (M,)
        ``n_train`` / ``n_test`` (if given) keep only the first training / test images.
    """
    datasets = _require("sklearn.datasets", "the digits demo", "bench")
    model_selection = _require("sklearn.model_selection", "the digits demo", "bench")
    x, y = datasets.load_digits(return_X_y=True)
    x = x / 16.0
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x, y, test_size=0.3, random_state=seed, stratify=y)
    if n_train is not None:
        x_train, y_train = x_train[:n_train], y_train[:n_train]
    if n_test is not None:
        x_test, y_test = x_test[:n_test], y_test[:n_test]
    return x_train, x_test, y_train, y_test


def demo_model(kind: str = "mlp", *, width: int = 256, seed: int = 0) -> Any:
    """The demo network (float32, CPU; move it with ``.to``), initialised from ``seed``.

    ``mlp``: 64 -> width -> width -> 10 with ReLU (three ``nn.Linear``: three Kronecker
    blocks).  ``cnn``: the image as 1x8x8, Conv(1->8, 3x3, pad 1) - ReLU - Conv(8->16, 3x3,
    stride 2, pad 1) - ReLU - Linear(16*4*4 -> 10) (Kronecker blocks with S = 64 and S = 16
    weight-sharing positions for the convolutions).
    """
    torch = _require("torch", "the demo", "torch")
    nn = torch.nn
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if kind == "mlp":
            net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width),
                                nn.ReLU(), nn.Linear(width, 10))
        elif kind == "cnn":
            net = nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                                nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                                nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                                nn.Flatten(), nn.Linear(16 * 4 * 4, 10))
        else:
            raise ValueError(f"model must be 'mlp' or 'cnn'; got {kind!r}")
    finally:
        torch.random.set_rng_state(gen_state)
    return net


class _Stages:
    """A tqdm bar over the demo's stages whose postfix shows the kernel tiles (or plain text)."""

    def __init__(self, names: list[str], enabled: bool) -> None:
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=len(names), desc="demo", unit="stage", file=sys.stderr,
                                bar_format="{desc:<34} {percentage:3.0f}%|{bar:20}| "
                                           "{n_fmt}/{total_fmt} [{elapsed}]")
            except ImportError:
                pass

    def start(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(f"demo: {name}")
        elif self.enabled:
            print(f"  ... {name}", file=sys.stderr, flush=True)

    def tiles(self, name: str) -> Any:
        def report(done: int, total: int) -> None:
            if self.bar is not None:
                self.bar.set_description_str(f"demo: {name} (tile {done}/{total})")

        return report

    def done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_demo(*, model: str = "mlp", n_train: int | None = None, n_test: int | None = None,
             width: int = 256,
             ridge: float = 1e-3, dtype: str = "float32", device: str = "auto",
             max_memory: str | None = None, seed: int = 0, out: str | Path | None = DEFAULT_PLOT,
             progress: bool = True, verbose: bool = True) -> DemoResult:
    r"""eNTK kernel regression of a small torch network on scikit-learn's digits.

    1. the layerwise trace eNTK of the training images,
       :math:`K_b = \sum_o J_b[:, o] J_b[:, o]^\top`, and :math:`K = \sum_b K_b`;
    2. the test-train kernel :math:`K_*` (same network, same parameters, no training);
    3. :math:`\hat Y = K_* (K + \lambda I)^{-1} Y` with one-hot targets ``Y`` and
       :math:`\lambda` = ``ridge`` * mean(diag K), solved by a Cholesky factorisation in
       float64; the predicted class is the argmax.

    Parameters
    ----------
    model : {"mlp", "cnn"}
        The network (see :func:`demo_model`).
    n_train, n_test : int, optional
        Use only this many training / test images (default: all, 1257 / 540).
    width : int
        Hidden width of the MLP.
    ridge : float
        Ridge relative to the mean diagonal of the training kernel.
    dtype : {"float32", "float64"}
        Dtype of the network and of the kernel computation.
    device : {"auto", "cpu", "cuda"}
        ``auto``: CUDA when torch sees a GPU.
    max_memory : str, optional
        Working-memory budget passed to :func:`ntkcore.ntk` (e.g. ``"200MB"``).
    seed : int
        Seed of the split and of the network's initialisation.
    out : path or None
        Where to write the PNG (``None``: no plot).
    progress, verbose : bool
        Progress bar on stderr; report on stdout.

    Returns
    -------
    DemoResult
    """
    t_start = time.perf_counter()
    torch = _require("torch", "the demo", "torch")
    import ntkcore
    import ntkcore.backends.torch as ntk_torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: torch sees no CUDA device (see `ntkcore info`)")
    tdtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    stages = _Stages(["data", "model", "train kernel", "test kernel", "regression", "plot"],
                     progress)
    times: dict[str, float] = {}

    def stage(name: str) -> float:
        stages.start(name)
        return time.perf_counter()

    try:
        t = stage("loading digits")
        x_train, x_test, y_train, y_test = demo_data(n_train, seed, n_test)
        times["data"] = time.perf_counter() - t
        stages.done()

        t = stage("building the network")
        net = demo_model(model, width=width, seed=seed).to(device=device, dtype=tdtype)
        xtr = torch.as_tensor(x_train, dtype=tdtype, device=device)
        xte = torch.as_tensor(x_test, dtype=tdtype, device=device)
        num_params = sum(p.numel() for p in net.parameters())
        jac = ntk_torch.jacobian(net, xtr[:2])
        modules = dict(net.named_modules())
        names = [_layer_label(n, modules.get(n)) for n in jac.names]
        kinds = [type(b).__name__ for b in jac.blocks]
        stages.done()

        t = stage("train kernel")
        k_layers = ntkcore.ntk(net, xtr, mode="trace", layerwise=True, max_memory=max_memory,
                               progress=stages.tiles("train kernel"))
        k_train = k_layers.sum(dim=0)
        if device == "cuda":
            torch.cuda.synchronize()
        times["train kernel"] = time.perf_counter() - t
        stages.done()

        t = stage("test kernel")
        k_test = ntkcore.ntk(net, xte, xtr, mode="trace", max_memory=max_memory,
                             progress=stages.tiles("test kernel"))
        if device == "cuda":
            torch.cuda.synchronize()
        times["test kernel"] = time.perf_counter() - t
        stages.done()

        t = stage("kernel regression")
        k64, ks64 = k_train.double(), k_test.double()
        y_onehot = torch.nn.functional.one_hot(
            torch.as_tensor(y_train, device=device), 10).double()
        reg = ridge * float(torch.diagonal(k64).mean())
        model_fit = ntkcore.KernelRidge(reg=reg).fit(k64, y_onehot)
        pred = model_fit.predict(ks64).argmax(dim=1).cpu().numpy()
        pred_train = model_fit.predict(k64).argmax(dim=1).cpu().numpy()
        times["regression"] = time.perf_counter() - t
        stages.done()

        traces = torch.diagonal(k_layers, dim1=1, dim2=2).sum(dim=1).double().cpu()
        shares = (traces / traces.sum()).tolist()
        result = DemoResult(
            model=model, num_params=int(num_params), n_train=len(y_train), n_test=len(y_test),
            accuracy=float((pred == y_test).mean()),
            train_accuracy=float((pred_train == y_train).mean()),
            kernel_bytes=int(k_train.numel() * k_train.element_size()
                             + k_test.numel() * k_test.element_size()),
            layer_names=names, layer_shares=[float(s) for s in shares],
            predictions=[int(p) for p in pred])

        t = stage("plot")
        if out is not None:
            result.plot = _demo_plot(Path(out), k_train, y_train, y_test, pred, names, shares,
                                     result)
        times["plot"] = time.perf_counter() - t
        stages.done()
    finally:
        stages.close()

    times["kernel"] = times["train kernel"] + times["test kernel"]
    times["total"] = time.perf_counter() - t_start
    result.times = times
    result.peak_rss = _peak_rss()
    if device == "cuda":
        result.peak_device = int(torch.cuda.max_memory_allocated())
    if verbose:
        _print_demo(result, kinds, dtype, device, width, reg)
    return result


def _layer_label(name: str, module: Any) -> str:
    """``"2:Linear(256,256)"`` for block ``"2"`` of a Sequential (the block name otherwise)."""
    if module is None:
        return name
    kind = type(module).__name__
    dims = ""
    if hasattr(module, "in_features"):
        dims = f"({module.in_features},{module.out_features})"
    elif hasattr(module, "in_channels"):
        dims = f"({module.in_channels},{module.out_channels})"
    return f"{name}:{kind}{dims}"


def _print_demo(r: DemoResult, kinds: list[str], dtype: str, device: str, width: int,
                reg: float) -> None:
    import ntkcore

    arch = (f"MLP 64-{width}-{width}-10 (ReLU)" if r.model == "mlp"
            else "CNN conv(8)-conv/2(16)-linear(10)")
    nk = sum(k == "KroneckerBlock" for k in kinds)
    t = r.times
    print(f"ntkcore {ntkcore.__version__} demo: empirical NTK kernel regression on digits")
    print(f"  data        {r.n_train} train / {r.n_test} test images (8x8), 10 classes")
    print(f"  network     torch {arch}, {r.num_params:,} parameters, untrained, "
          f"{dtype} on {device}")
    print(f"  Jacobian    {len(kinds)} blocks, {nk} Kronecker-factored (layer inputs x "
          "output gradients)")
    print(f"  kernel      trace eNTK {r.n_train} x {r.n_train} + {r.n_test} x {r.n_train}, "
          f"{_fmt_bytes(r.kernel_bytes)}, {t['kernel']:.2f} s")
    shares = ", ".join(f"{n} {100 * s:.0f}%" for n, s in zip(r.layer_names, r.layer_shares,
                                                                strict=True))
    print(f"  layers      share of trace(K): {shares}")
    print(f"  regression  Cholesky, ridge {reg:.3g}, float64, {t['regression']:.2f} s")
    print(f"  accuracy    test {100 * r.accuracy:.2f}%  (train {100 * r.train_accuracy:.1f}%)")
    mem = f"peak RSS {_fmt_bytes(r.peak_rss)}"
    if r.peak_device is not None:
        mem += f", peak CUDA {_fmt_bytes(r.peak_device)}"
    print(f"  memory      {mem}")
    if r.plot:
        print(f"  plot        {r.plot}")
    print(f"  time        {t['total']:.2f} s in total")


def _demo_plot(path: Path, k_train: Any, y_train: Any, y_test: Any, pred: Any,
               names: list[str], shares: list[float], r: DemoResult) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib not installed: no plot; pip install matplotlib)", file=sys.stderr)
        return ""
    import numpy as np

    path = path.expanduser()
    if path.suffix.lower() != ".png":
        raise CLIError(f"--out must name a .png file; got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    order = np.argsort(y_train, kind="stable")
    k = k_train.double().cpu().numpy()[np.ix_(order, order)]
    d = np.sqrt(np.diag(k))
    corr = k / np.outer(d, d)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    im = axes[0].imshow(corr, cmap="viridis", interpolation="nearest")
    axes[0].set_title("normalised train eNTK, sorted by class")
    axes[0].set_xlabel("train image")
    axes[0].set_ylabel("train image")
    fig.colorbar(im, ax=axes[0], fraction=0.046)

    axes[1].bar(range(len(names)), [100 * s for s in shares], color="tab:blue")
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels(names, rotation=30, ha="right")
    axes[1].set_ylabel("% of trace(K)")
    axes[1].set_title("layerwise kernel contributions")

    conf = np.zeros((10, 10), dtype=int)
    np.add.at(conf, (y_test, pred), 1)
    axes[2].imshow(conf, cmap="Blues")
    for i in range(10):
        for j in range(10):
            if conf[i, j]:
                axes[2].text(j, i, str(conf[i, j]), ha="center", va="center", fontsize=7,
                             color="white" if conf[i, j] > conf.max() / 2 else "black")
    axes[2].set_xticks(range(10))
    axes[2].set_yticks(range(10))
    axes[2].set_xlabel("predicted")
    axes[2].set_ylabel("true")
    axes[2].set_title(f"test confusion, accuracy {100 * r.accuracy:.1f}%")
    fig.suptitle(f"ntkcore demo: eNTK kernel regression of an untrained {r.model.upper()} "
                 f"({r.num_params:,} parameters) on digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


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
    out = None if args.no_plot else args.out
    if out is not None and Path(out).suffix.lower() != ".png":
        raise CLIError(f"--out must name a .png file; got {str(out)!r}")
    if args.json:
        res = run_demo(model=args.model, n_train=args.n_train, n_test=args.n_test, width=args.width,
                       ridge=args.ridge, dtype=args.dtype, device=args.device,
                       max_memory=args.max_memory, seed=args.seed, out=out,
                       progress=False, verbose=False)
        print(json.dumps(res.__dict__, indent=2))
    else:
        run_demo(model=args.model, n_train=args.n_train, n_test=args.n_test, width=args.width,
                 ridge=args.ridge,
                 dtype=args.dtype, device=args.device, max_memory=args.max_memory,
                 seed=args.seed, out=out, progress=not args.no_progress)
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


_SUPPORT_INTRO = """\
# Backends

<!-- Generated by `python -m ntkcore support --out docs/backends.md` from ntkcore/support.py.
     Do not edit by hand: tests/test_docs.py checks that this file equals the generated one. -->

Which public function runs on which array backend, as declared once in `ntkcore/support.py`
(the same table the test suite uses to decide what it skips, so this page and the tests cannot
disagree).

- **numpy**: NumPy arrays; SciPy's LAPACK for triangular and Cholesky solves.
- **torch**: `torch.Tensor` on CPU or CUDA; autograd flows through the linear algebra.
- **cupy**: CuPy arrays on CUDA; `cupyx.scipy.linalg`.
- **jax**: `jax.Array` on CPU or GPU; differentiable under `jax.grad`.
- **array_api_strict**: stands for any other array-API namespace, served by the generic backend
  (the standard alone: `xp.linalg.solve` in place of triangular solves, host random numbers).
"""


def support_markdown() -> str:
    """The support table of :mod:`ntkcore.support` as a Markdown page (``docs/backends.md``).

    A summary matrix (function x backend, "yes" / "no") followed by, for every function, the
    fast path and notes of each supported backend.
    """
    from ntkcore.support import BACKENDS, SUPPORT

    lines = [_SUPPORT_INTRO]
    lines.append("## Summary\n")
    lines.append("| function | " + " | ".join(BACKENDS) + " |")
    lines.append("|---|" + "---|" * len(BACKENDS))
    for fn in SUPPORT:
        cells = ["yes" if SUPPORT[fn][b].ok else "no" for b in BACKENDS]
        lines.append(f"| `{fn}` | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("## Details\n")
    for fn in SUPPORT:
        lines.append(f"### `{fn}`\n")
        lines.append("| backend | supported | fast path | note |")
        lines.append("|---|---|---|---|")
        for b in BACKENDS:
            s = SUPPORT[fn][b]
            fast = f"`{s.fast_path}`" if s.fast_path else "array API standard"
            if not s.ok:
                fast = "-"
            note = s.note.replace("|", "\\|")
            lines.append(f"| {b} | {'yes' if s.ok else 'no'} | {fast} | {note} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


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
    from .errors import BudgetTooSmallError

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
