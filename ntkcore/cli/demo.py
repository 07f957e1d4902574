"""The digits demo behind ``ntkcore demo`` and ``examples/ntk_regression_digits.py``: data,
network, eNTK kernel regression, report and plot.  Application layer: imports PyTorch, NumPy,
scikit-learn and matplotlib lazily, inside the functions."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .output import check_not_symlink, fresh_directory, write_new

__all__ = ["DEFAULT_PLOT", "PLOT_NAME", "CLIError", "DemoResult", "EntkFit", "demo_data",
           "demo_model", "describe", "entk_regression", "install_hint", "plot_shares",
           "run_demo"]

#: ``out`` of :func:`run_demo` (and what ``ntkcore demo`` does without ``--out``): write the
#: plot as :data:`PLOT_NAME` into a fresh private directory (``tempfile.mkdtemp``), never to a
#: fixed name in the shared temporary directory (see :mod:`ntkcore.cli.output`).
DEFAULT_PLOT = "auto"
PLOT_NAME = "ntkcore-demo.png"


class CLIError(Exception):
    """A failure the command line reports as ``ntkcore <cmd>: error: ...`` with exit code 1."""


#: Distribution names of the modules the demo imports, where they differ.
_DISTRIBUTIONS = {"sklearn": "scikit-learn"}


def install_hint() -> str:
    """One command that installs everything the demo needs: the ``bench`` extra, and torch
    only when it is missing (following the hint never replaces an installed torch build)."""
    torch = "" if importlib.util.find_spec("torch") is not None else "torch "
    return f'pip install {torch}"ntkcore[bench]"'


def _require(module: str, purpose: str) -> Any:
    """Import ``module`` or raise a :class:`CLIError` naming what is missing and the one
    command that installs all the demo needs (:func:`install_hint`)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise CLIError(f"{purpose} needs {_DISTRIBUTIONS.get(top, top)} ({exc}); install "
                       f"everything the demo needs with: {install_hint()}") from None


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _peak_rss() -> int | None:
    """Peak resident memory of this process in bytes (``None`` where ``resource`` is absent)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


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
    datasets = _require("sklearn.datasets", "the digits demo")
    model_selection = _require("sklearn.model_selection", "the digits demo")
    x, y = datasets.load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x / 16.0, y, test_size=0.3, random_state=seed, stratify=y)
    return x_train[:n_train], x_test[:n_test], y_train[:n_train], y_test[:n_test]


def demo_model(kind: str = "mlp", *, width: int = 256, seed: int = 0, channels: int = 8) -> Any:
    """The demo network (float32, CPU; move it with ``.to``), initialised from ``seed``.

    ``mlp``: 64 -> width -> width -> 10 with ReLU (three ``nn.Linear``: three Kronecker
    blocks).  ``cnn``: the image as 1x8x8, Conv(1->c, 3x3, pad 1) - ReLU - Conv(c->2c, 3x3,
    stride 2, pad 1) - ReLU - Linear(2c*4*4 -> 10) with c = ``channels`` (Kronecker blocks
    with S = 64 and S = 16 weight-sharing positions for the convolutions).
    """
    torch = _require("torch", "the demo")
    nn = torch.nn
    if kind not in ("mlp", "cnn"):
        raise ValueError(f"model must be 'mlp' or 'cnn'; got {kind!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "mlp":
            return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width),
                                 nn.ReLU(), nn.Linear(width, 10))
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, channels, 3, padding=1),
                             nn.ReLU(), nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1),
                             nn.ReLU(), nn.Flatten(), nn.Linear(2 * channels * 4 * 4, 10))


def describe(net: Any, x: Any) -> tuple[list[str], list[str]]:
    """Labels (``"2:Linear(256,256)"``) and kinds (``"KroneckerBlock"``, ...) of the Jacobian
    blocks of ``net`` at a few inputs ``x`` (B, 64), in block order."""
    from ntkcore.backends.torch import jacobian

    jac = jacobian(net, x)
    modules = dict(net.named_modules())
    labels = []
    for name in jac.names:
        m = modules.get(name)
        dims = [str(getattr(m, a)) for a in ("in_features", "out_features", "in_channels",
                                             "out_channels") if hasattr(m, a)]
        labels.append(name if m is None else
                      f"{name}:{type(m).__name__}" + (f"({','.join(dims)})" if dims else ""))
    return labels, [type(b).__name__ for b in jac.blocks]


@dataclass
class EntkFit:
    """What :func:`entk_regression` computed.

    Attributes
    ----------
    k_layers : Tensor, shape (B, N, N)
        Per-block trace eNTK of the training images (network's dtype and device).
    k_train : Tensor, shape (N, N)
        ``k_layers.sum(0)``.
    k_test : Tensor, shape (M, N)
        Test-train trace eNTK.
    reg : float
        The absolute ridge, ``ridge * mean(diag k_train)``.
    pred, pred_train : ndarray of int, shape (M,) and (N,)
        Predicted test / training labels.
    shares : list of float, length B
        Share of each block in ``trace(k_train)`` (:func:`ntkcore.trace_share`; they sum to 1).
    times : dict
        Seconds of ``"train kernel"``, ``"test kernel"`` and ``"regression"``.
    """

    k_layers: Any
    k_train: Any
    k_test: Any
    reg: float
    pred: Any
    pred_train: Any
    shares: list[float]
    times: dict[str, float]


def entk_regression(net: Any, x_train: Any, y_train: Any, x_test: Any, *, ridge: float = 1e-3,
                    max_memory: str | None = None, progress: bool = False) -> EntkFit:
    r"""Trace-eNTK kernel regression of the class labels by the network ``net``.

    1. the layerwise trace eNTK of the training images,
       :math:`K_b = \sum_o J_b[:, o] J_b[:, o]^\top`, and :math:`K = \sum_b K_b`;
    2. the test-train kernel :math:`K_*` (same network, same parameters);
    3. :math:`\hat Y = K_* (K + \lambda I)^{-1} Y` with one-hot targets ``Y`` (10 classes) and
       :math:`\lambda` = ``ridge`` * mean(diag K), solved by a Cholesky factorisation in
       float64; the predicted class is the argmax.

    Parameters
    ----------
    net : torch.nn.Module
    x_train, x_test : Tensor, shape (N, 64) and (M, 64)
        Images on the network's device, in its dtype.
    y_train : array of int, shape (N,)
    ridge : float
        Ridge relative to the mean diagonal of the training kernel.
    max_memory : str, optional
        Working-memory budget passed to :func:`ntkcore.ntk`.
    progress : bool
        Name each stage on stderr, and show :func:`ntkcore.ntk`'s tile bar when tqdm is
        installed.

    Returns
    -------
    EntkFit
    """
    import torch

    import ntkcore

    bar = progress and importlib.util.find_spec("tqdm") is not None
    times: dict[str, float] = {}

    def timed(stage: str, compute: Any) -> Any:
        if progress:
            print(f"  ... {stage}", file=sys.stderr, flush=True)
        t = time.perf_counter()
        out = compute()
        if x_train.is_cuda:
            torch.cuda.synchronize()
        times[stage] = time.perf_counter() - t
        return out

    k_layers = timed("train kernel", lambda: ntkcore.ntk(
        net, x_train, mode="trace", layerwise=True, max_memory=max_memory, progress=bar))
    k_test = timed("test kernel", lambda: ntkcore.ntk(
        net, x_test, x_train, mode="trace", max_memory=max_memory, progress=bar))
    k_train = k_layers.sum(dim=0)
    k64 = k_train.double()
    reg = ridge * float(torch.diagonal(k64).mean())

    def regression() -> list[Any]:
        y = torch.nn.functional.one_hot(torch.as_tensor(y_train, device=k64.device), 10)
        fit = ntkcore.KernelRidge(alpha=reg).fit(k64, y.double())
        return [fit.predict(k).argmax(dim=1).cpu().numpy() for k in (k_test.double(), k64)]

    pred, pred_train = timed("regression", regression)
    shares = [float(s) for s in ntkcore.trace_share(k_layers.double())]
    return EntkFit(k_layers, k_train, k_test, reg, pred, pred_train, shares, times)


def run_demo(*, model: str = "mlp", n_train: int | None = None, n_test: int | None = None,
             width: int = 256, ridge: float = 1e-3, dtype: str = "float32",
             device: str = "auto", max_memory: str | None = None, seed: int = 0,
             out: str | Path | None = DEFAULT_PLOT, progress: bool = True,
             verbose: bool = True) -> DemoResult:
    """eNTK kernel regression of a small torch network on scikit-learn's digits.

    :func:`demo_data`, :func:`demo_model` (untrained) and :func:`entk_regression`, with
    timings, peak memory, a report and a plot.

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
    out : path, "auto" or None
        Where to write the PNG: a path (not a symbolic link; written beside it and renamed
        into place), ``"auto"`` (:data:`DEFAULT_PLOT`: ``ntkcore-demo.png`` in a fresh private
        ``tempfile.mkdtemp`` directory, printed in the report) or ``None`` (no plot).
    progress, verbose : bool
        Progress on stderr; report on stdout.

    Returns
    -------
    DemoResult
    """
    t_start = time.perf_counter()
    if out is not None and out != DEFAULT_PLOT:
        if Path(out).suffix.lower() != ".png":
            raise CLIError(f"--out must name a .png file; got {str(out)!r}")
        out = check_not_symlink(out)  # before the work: refused at once
    torch = _require("torch", "the demo")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise CLIError("--device cuda: torch sees no CUDA device (see `ntkcore info`)")
        torch.cuda.reset_peak_memory_stats()
    tdtype = getattr(torch, dtype)

    t = time.perf_counter()
    x_train, x_test, y_train, y_test = demo_data(n_train, seed, n_test)
    times = {"data": time.perf_counter() - t}
    net = demo_model(model, width=width, seed=seed).to(device=device, dtype=tdtype)
    xtr, xte = (torch.as_tensor(x, dtype=tdtype, device=device) for x in (x_train, x_test))
    names, kinds = describe(net, xtr[:2])
    fit = entk_regression(net, xtr, y_train, xte, ridge=ridge, max_memory=max_memory,
                          progress=progress)
    times.update(fit.times, kernel=fit.times["train kernel"] + fit.times["test kernel"])
    r = DemoResult(
        model=model, num_params=sum(p.numel() for p in net.parameters()), n_train=len(y_train),
        n_test=len(y_test), accuracy=float((fit.pred == y_test).mean()),
        train_accuracy=float((fit.pred_train == y_train).mean()),
        kernel_bytes=sum(k.numel() * k.element_size() for k in (fit.k_train, fit.k_test)),
        layer_names=names, layer_shares=fit.shares, times=times,
        predictions=[int(p) for p in fit.pred])
    t = time.perf_counter()
    if out is not None:
        r.plot = _demo_plot(out, fit, y_train, y_test, r)
    times["plot"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - t_start
    r.peak_rss = _peak_rss()
    if device == "cuda":
        r.peak_device = int(torch.cuda.max_memory_allocated())
    if verbose:
        _print_demo(r, kinds, dtype, device, width, fit.reg)
    return r


def _print_demo(r: DemoResult, kinds: list[str], dtype: str, device: str, width: int,
                reg: float) -> None:
    import ntkcore

    arch = (f"MLP 64-{width}-{width}-10 (ReLU)" if r.model == "mlp"
            else "CNN conv(8)-conv/2(16)-linear(10)")
    t = r.times
    shares = ", ".join(f"{n} {100 * s:.0f}%" for n, s in zip(r.layer_names, r.layer_shares,
                                                                strict=True))
    mem = f"peak RSS {fmt_bytes(r.peak_rss)}"
    if r.peak_device is not None:
        mem += f", peak CUDA {fmt_bytes(r.peak_device)}"
    print(f"ntkcore {ntkcore.__version__} demo: empirical NTK kernel regression on digits\n"
          f"  data        {r.n_train} train / {r.n_test} test images (8x8), 10 classes\n"
          f"  network     torch {arch}, {r.num_params:,} parameters, untrained, "
          f"{dtype} on {device}\n"
          f"  Jacobian    {len(kinds)} blocks, {kinds.count('KroneckerBlock')} "
          "Kronecker-factored (layer inputs x output gradients)\n"
          f"  kernel      trace eNTK {r.n_train} x {r.n_train} + {r.n_test} x {r.n_train}, "
          f"{fmt_bytes(r.kernel_bytes)}, {t['kernel']:.2f} s\n"
          f"  layers      share of trace(K): {shares}\n"
          f"  regression  Cholesky, ridge {reg:.3g}, float64, {t['regression']:.2f} s\n"
          f"  accuracy    test {100 * r.accuracy:.2f}%  (train {100 * r.train_accuracy:.1f}%)\n"
          f"  memory      {mem}")
    if r.plot:
        print(f"  plot        {r.plot}")
    print(f"  time        {t['total']:.2f} s in total")


def plot_shares(ax: Any, labels: list[str], series: dict[str, list[float]]) -> None:
    """Bars of each block's share of trace(K) on the matplotlib axes ``ax``: one group per
    block (``labels``), one bar per entry of ``series`` (name -> shares; legend when > 1)."""
    import numpy as np

    pos, w = np.arange(len(labels)), 0.8 / len(series)
    for i, shares in enumerate(series.values()):
        ax.bar(pos + (i - (len(series) - 1) / 2) * w, 100 * np.asarray(shares), w)
    ax.set_xticks(pos, labels, rotation=25, ha="right")
    ax.set_ylabel("% of trace(K)")
    if len(series) > 1:
        ax.legend(list(series))


def _demo_plot(out: str | Path, fit: EntkFit, y_train: Any, y_test: Any,
               r: DemoResult) -> str | None:
    """Write the plot to ``out`` (a path, or :data:`DEFAULT_PLOT`); its path, or ``None``
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"  (matplotlib not installed: no plot; {install_hint()} installs it)",
              file=sys.stderr)
        return None
    import numpy as np
    from sklearn.metrics import ConfusionMatrixDisplay

    order = np.argsort(y_train, kind="stable")
    k = fit.k_train.double().cpu().numpy()[np.ix_(order, order)]
    d = np.sqrt(np.diag(k))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    im = axes[0].imshow(k / np.outer(d, d), cmap="viridis", interpolation="nearest")
    axes[0].set(title="normalised train eNTK, sorted by class", xlabel="train image",
                ylabel="train image")
    fig.colorbar(im, ax=axes[0], fraction=0.046)
    plot_shares(axes[1], r.layer_names, {"": fit.shares})
    axes[1].set_title("layerwise kernel contributions")
    ConfusionMatrixDisplay.from_predictions(y_test, fit.pred, labels=list(range(10)),
                                            ax=axes[2], cmap="Blues", colorbar=False)
    axes[2].set_title(f"test confusion, accuracy {100 * r.accuracy:.1f}%")
    fig.suptitle(f"ntkcore demo: eNTK kernel regression of an untrained {r.model.upper()} "
                 f"({r.num_params:,} parameters) on digits")
    fig.tight_layout()
    if out == DEFAULT_PLOT:
        out = fresh_directory("ntkcore-demo-") / PLOT_NAME
    path = write_new(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return str(path)
