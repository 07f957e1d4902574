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
    python examples/ntk_regression_digits.py --out ntk_digits.png

The plot goes to ``--out``, by default to ``ntk_regression_digits.png`` in a fresh private
directory (printed at the end; never a fixed name in the shared temporary directory).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import ntkcore
from ntkcore.cli.demo import demo_data, demo_model, describe, entk_regression, plot_shares
from ntkcore.cli.output import OutputError, check_not_symlink, fresh_directory, write_new

# The data, the networks, the layer labels, the eNTK regression and the share bars are those of
# `python -m ntkcore demo` (ntkcore/cli/demo.py); this script adds training and the comparison.


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
    net = demo_model(kind.lower(), width=args.width, seed=args.seed,
                     channels=max(4, args.width // 16))
    init = copy.deepcopy(net)
    labels, kinds = describe(init, x_tr[:2])
    n_params = sum(p.numel() for p in net.parameters())
    kron = kinds.count("KroneckerBlock")
    print(f"\n{kind}: {n_params:,} parameters, {len(kinds)} blocks ({kron} Kronecker)")

    at_init = entk_regression(init, x_tr, y_tr, x_te, ridge=args.ridge)
    train_s = train(net, x_tr, torch.as_tensor(y_tr), args.epochs, args.lr, args.seed)
    net.eval()
    with torch.no_grad():
        net_pred = net(x_te).argmax(1).numpy()
    trained = entk_regression(net, x_tr, y_tr, x_te, ridge=args.ridge)

    res = {"kind": kind, "labels": labels,
           "acc": {"eNTK at init": float(np.mean(at_init.pred == y_te)),
                   "trained network": float(np.mean(net_pred == y_te)),
                   "eNTK after training": float(np.mean(trained.pred == y_te))},
           "shares_init": np.array(at_init.shares), "shares_trained": np.array(trained.shares)}
    n, m = len(y_tr), len(y_te)
    mib = sum(k.numel() * k.element_size() for k in (at_init.k_layers, at_init.k_test)) / 2**20

    def seconds(fit) -> float:
        return fit.times["train kernel"] + fit.times["test kernel"]

    print(f"  kernels: {n} x {n} per layer + {m} x {n}, {mib:.1f} MiB, "
          f"{seconds(at_init):.2f} s (init), {seconds(trained):.2f} s (trained)")
    print(f"  training: Adam, {args.epochs} epochs, {train_s:.2f} s")
    for name, a in res["acc"].items():
        print(f"  {name:<22} test accuracy {100 * a:6.2f}%")
    print("  share of trace(K) per layer (init -> trained): " + ", ".join(
        f"{lab} {100 * a:.0f}% -> {100 * b:.0f}%" for lab, a, b in
        zip(res["labels"], res["shares_init"], res["shares_trained"], strict=True)))
    return res


def plot(results: list[dict], path: Path | None) -> None:
    """The layer shares and accuracies, to ``path`` (``None``: a fresh private directory)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(results) + 1, figsize=(5 * (len(results) + 1), 4.2))
    for ax, r in zip(axes, results, strict=False):
        plot_shares(ax, r["labels"], {"at initialisation": r["shares_init"],
                                      "after training": r["shares_trained"]})
        ax.set_title(f"{r['kind']}: layerwise kernel contributions")
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
    if path is None:
        path = fresh_directory("ntkcore-ntk-regression-digits-") / "ntk_regression_digits.png"
    write_new(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    print(f"\nplot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="500 training images, width 128, 20 epochs")
    p.add_argument("--out", type=Path,
                   help="plot file; an existing symbolic link there is refused (default: "
                        "ntk_regression_digits.png in a fresh private directory, printed)")
    p.add_argument("--models", default="MLP,CNN", help="comma-separated: MLP, CNN")
    p.add_argument("--width", type=int, default=None, help="MLP width (CNN: width/16 channels)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ridge", type=float, default=1e-3, help="relative to mean(diag K)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.out is not None:
        try:
            args.out = check_not_symlink(args.out)
        except OutputError as exc:
            p.error(str(exc))
    kinds = [k.strip().upper() for k in args.models.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("MLP", "CNN")]
    if bad or not kinds:
        p.error(f"--models takes MLP and/or CNN; got {args.models!r}")
    args.width = args.width or (128 if args.quick else 256)
    args.epochs = args.epochs or (20 if args.quick else 40)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))

    x_tr, x_te, y_tr, y_te = demo_data(500 if args.quick else None)
    data = (torch.as_tensor(x_tr, dtype=torch.float32), torch.as_tensor(x_te, dtype=torch.float32),
            y_tr, y_te)
    print(f"digits: {len(data[2])} train / {len(data[3])} test images, "
          f"ntkcore {ntkcore.__version__}, torch {torch.__version__}")
    results = [run_model(k, data, args) for k in kinds]
    plot(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
