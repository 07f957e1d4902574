"""Train-free eNTK kernel regression on digits, against the trained network.

For an MLP and a small CNN on scikit-learn's 8x8 digits this script compares three
classifiers built from the same architecture and the same initial parameters:

1. **eNTK at initialisation**: the trace eNTK of the untrained network
   (``ntkcore.ntk(net, x, mode="trace")``, computed from the Kronecker factors of its
   ``nn.Linear`` / ``nn.Conv2d`` layers) and Cholesky kernel regression on one-hot targets:
   no training at all;
2. **the trained network**: the same network trained with Adam on the cross-entropy;
3. **eNTK after training**: kernel regression with the eNTK of the trained network.

It prints the test accuracies, the kernel sizes and times, and the share of each layer in the
trace of the training kernel (``layerwise=True``; the per-layer kernels sum to the total),
before and after training, and plots the layer shares and the accuracies.

    python examples/ntk_regression_digits.py            # all 1257 training images
    python examples/ntk_regression_digits.py --quick    # 500 images, narrower nets, fewer epochs
    python examples/ntk_regression_digits.py --out /tmp/ntk_digits.png
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from ntkcore.backends.torch import jacobian
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import ntkcore


def load(n_train: int | None) -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.3, random_state=0,
                                              stratify=y)
    x_tr, y_tr = x_tr[:n_train], y_tr[:n_train]
    f = torch.float32
    return (torch.as_tensor(x_tr, dtype=f), torch.as_tensor(x_te, dtype=f),
            torch.as_tensor(y_tr), torch.as_tensor(y_te))


def make_model(kind: str, width: int) -> nn.Module:
    if kind == "MLP":
        return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 10))
    c = max(4, width // 16)
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                         nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(2 * c * 16, 10))


def layer_labels(net: nn.Module, names: tuple[str, ...]) -> list[str]:
    modules = dict(net.named_modules())
    return [f"{n}:{type(modules[n]).__name__}" if n in modules else n for n in names]


def ntk_regression(net: nn.Module, x_tr, y_tr, x_te, ridge: float) -> dict:
    """Trace eNTK (layerwise on the training set), kernel regression, accuracy, layer shares."""
    t = time.perf_counter()
    k_layers = ntkcore.ntk(net, x_tr, mode="trace", layerwise=True)   # (B, N, N)
    k_test = ntkcore.ntk(net, x_te, x_tr, mode="trace")               # (M, N)
    seconds = time.perf_counter() - t
    k = k_layers.sum(0).double()
    y = nn.functional.one_hot(y_tr, 10).double()
    reg = ridge * float(k.diagonal().mean())
    pred = ntkcore.kernel_regression(k, y, k_test.double(), reg=reg)
    traces = k_layers.diagonal(dim1=1, dim2=2).sum(1).double()
    return {"pred": pred.argmax(1), "seconds": seconds,
            "shares": (traces / traces.sum()).numpy(),
            "bytes": k_layers.numel() * k_layers.element_size()
            + k_test.numel() * k_test.element_size()}


def train(net: nn.Module, x, y, epochs: int, lr: float, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    t = time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    return time.perf_counter() - t


def run_model(kind: str, data, args) -> dict:
    x_tr, x_te, y_tr, y_te = data
    torch.manual_seed(args.seed)
    net = make_model(kind, args.width)
    init = copy.deepcopy(net)
    blocks = jacobian(init, x_tr[:2])
    n_params = sum(p.numel() for p in net.parameters())
    kron = sum(type(b).__name__ == "KroneckerBlock" for b in blocks.blocks)
    print(f"\n{kind}: {n_params:,} parameters, {len(blocks.blocks)} blocks ({kron} Kronecker)")

    at_init = ntk_regression(init, x_tr, y_tr, x_te, args.ridge)
    train_s = train(net, x_tr, y_tr, args.epochs, args.lr, args.seed)
    net.eval()
    with torch.no_grad():
        net_pred = net(x_te).argmax(1)
    trained = ntk_regression(net, x_tr, y_tr, x_te, args.ridge)

    def acc(p):
        return float((p == y_te).double().mean())

    res = {"kind": kind, "labels": layer_labels(init, blocks.names),
           "acc": {"eNTK at init": acc(at_init["pred"]), "trained network": acc(net_pred),
                   "eNTK after training": acc(trained["pred"])},
           "shares_init": at_init["shares"], "shares_trained": trained["shares"]}
    n, m = len(y_tr), len(y_te)
    print(f"  kernels: {n} x {n} per layer + {m} x {n}, {at_init['bytes'] / 2**20:.1f} MiB, "
          f"{at_init['seconds']:.2f} s (init), {trained['seconds']:.2f} s (trained)")
    print(f"  training: Adam, {args.epochs} epochs, {train_s:.2f} s")
    for name, a in res["acc"].items():
        print(f"  {name:<22} test accuracy {100 * a:6.2f}%")
    print("  share of trace(K) per layer (init -> trained): " + ", ".join(
        f"{lab} {100 * a:.0f}% -> {100 * b:.0f}%" for lab, a, b in
        zip(res["labels"], res["shares_init"], res["shares_trained"], strict=True)))
    return res


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(results) + 1, figsize=(5 * (len(results) + 1), 4.2))
    for ax, r in zip(axes, results, strict=False):
        pos = np.arange(len(r["labels"]))
        ax.bar(pos - 0.2, 100 * r["shares_init"], 0.4, label="at initialisation")
        ax.bar(pos + 0.2, 100 * r["shares_trained"], 0.4, label="after training")
        ax.set_xticks(pos)
        ax.set_xticklabels(r["labels"], rotation=20, ha="right")
        ax.set_ylabel("% of trace of the train eNTK")
        ax.set_title(f"{r['kind']}: layerwise kernel contributions")
        ax.legend()
    ax = axes[-1]
    kinds = list(results[0]["acc"])
    pos = np.arange(len(results))
    for i, k in enumerate(kinds):
        vals = [100 * r["acc"][k] for r in results]
        ax.bar(pos + (i - 1) * 0.27, vals, 0.27, label=k)
    ax.set_xticks(pos)
    ax.set_xticklabels([r["kind"] for r in results])
    lo = min(100 * a for r in results for a in r["acc"].values())
    ax.set_ylim(max(0.0, lo - 5), 100)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("digits: eNTK regression vs trained network")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"\nplot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="500 training images, width 128, 20 epochs")
    p.add_argument("--out", type=Path,
                   default=Path(tempfile.gettempdir()) / "ntk_regression_digits.png",
                   help="plot file (default: in the temporary directory)")
    p.add_argument("--models", default="MLP,CNN", help="comma-separated: MLP, CNN")
    p.add_argument("--width", type=int, default=None, help="MLP width (CNN: width/16 channels)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ridge", type=float, default=1e-3, help="relative to mean(diag K)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    kinds = [k.strip().upper() for k in args.models.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("MLP", "CNN")]
    if bad or not kinds:
        p.error(f"--models takes MLP and/or CNN; got {args.models!r}")
    args.width = args.width or (128 if args.quick else 256)
    args.epochs = args.epochs or (20 if args.quick else 40)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))

    data = load(500 if args.quick else None)
    print(f"digits: {len(data[2])} train / {len(data[3])} test images, "
          f"ntkcore {ntkcore.__version__}, torch {torch.__version__}")
    results = [run_model(k, data, args) for k in kinds]
    plot(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
