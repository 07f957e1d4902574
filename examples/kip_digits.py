r"""Dataset distillation with the empirical NTK (KIP): scikit-learn digits -> 10 images per class.

The network is fixed (a small conv net at its random initialisation); the *data* are trained.
A support set of 10 images per class (100 images of 8x8) is optimised so that kernel regression
with the trace-mode eNTK of the network, fitted on the support set alone,

.. math::  \hat Y_t = K_{ts} (K_{ss} + \lambda I)^{-1} Y_s ,

predicts the labels of the training images.  The loss and its gradient with respect to the
support images come from :func:`ntkcore.backends.torch_kip.kip_loss`, which visits the target
images in chunks and never keeps their Jacobian factors, so the same script scales to large
target sets (see the case ``seed M=100 N=60000`` of ``benchmarks/kip.py``).

Test accuracy of kernel regression on the support set is reported before (10 random training
images per class) and after distillation, next to kernel regression on all training images.

Run::

    python examples/kip_digits.py            # 300 steps (a few minutes on 2 cores)
    python examples/kip_digits.py --quick    # 20 steps, under a minute
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import ntkcore
from ntkcore.backends.torch_kip import kip_loss

CLASSES = 10


def make_model() -> nn.Module:
    """Conv(1->16, 3x3) - ReLU - Conv(16->16, 3x3) - ReLU - Linear(16*8*8 -> 10), fixed."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 8 * 8, CLASSES),
    ).eval()


def load(seed: int) -> tuple[torch.Tensor, ...]:
    """Standardised digits (N, 1, 8, 8), centred one-hot labels, a stratified 2:1 split."""
    digits = load_digits()
    x = digits.images.astype(np.float32)[:, None] / 16.0
    y = digits.target
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=1 / 3, random_state=seed,
                                              stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    return (torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_te),
            torch.from_numpy(y_te))


def targets(labels: torch.Tensor) -> torch.Tensor:
    """Centred one-hot regression targets: 1 - 1/C for the class, -1/C elsewhere."""
    return nn.functional.one_hot(labels, CLASSES).float() - 1.0 / CLASSES


def accuracy(model: nn.Module, x_s: torch.Tensor, y_s: torch.Tensor, x_te: torch.Tensor,
             labels_te: torch.Tensor, reg: float) -> float:
    """Test accuracy of eNTK kernel regression fitted on (x_s, y_s)."""
    x_s = x_s.detach()
    k_ss = ntkcore.ntk(model, x_s, mode="trace")
    k_ts = ntkcore.ntk(model, x_te, x_s, mode="trace")
    lam = reg * float(torch.diagonal(k_ss).mean())
    pred = ntkcore.kernel_regression(k_ss, y_s.detach(), k_ts, reg=lam)
    return float((pred.argmax(1) == labels_te).float().mean())


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="20 steps of 300 targets (under a minute)")
    p.add_argument("--steps", type=int, default=None, help="optimisation steps (default 300)")
    p.add_argument("--per-class", type=int, default=10, help="support images per class")
    p.add_argument("--batch", type=int, default=400, help="target images per step")
    p.add_argument("--lr", type=float, default=0.02, help="Adam learning rate")
    p.add_argument("--reg", type=float, default=1e-3,
                   help="ridge relative to mean(diag K_ss)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else (20 if args.quick else 300)
    if args.quick:
        args.batch = min(args.batch, 300)
    gen = torch.Generator().manual_seed(args.seed)

    model = make_model()
    x_tr, l_tr, x_te, l_te = load(args.seed)
    y_tr = targets(l_tr)
    # initial support: per_class random training images of each class
    idx = torch.cat([torch.nonzero(l_tr == c).flatten()[
        torch.randperm(int((l_tr == c).sum()), generator=gen)[:args.per_class]]
        for c in range(CLASSES)])
    x_s = x_tr[idx].clone().requires_grad_(True)
    y_s = y_tr[idx].clone()

    t0 = time.perf_counter()
    acc_before = accuracy(model, x_s, y_s, x_te, l_te, args.reg)
    print(f"train {len(x_tr)} / test {len(x_te)} images; support {len(x_s)} images "
          f"({args.per_class} per class)")
    print(f"test accuracy, random support set: {acc_before:.3f}")
    if not args.quick:
        acc_all = accuracy(model, x_tr, y_tr, x_te, l_te, args.reg)
        print(f"test accuracy, all {len(x_tr)} training images: {acc_all:.3f}")

    opt = torch.optim.Adam([x_s], lr=args.lr)
    for step in range(1, steps + 1):
        batch = torch.randperm(len(x_tr), generator=gen)[:args.batch]
        loss = kip_loss(model, x_s, y_s, x_tr[batch], y_tr[batch], reg=args.reg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 or step % max(1, steps // 10) == 0:
            print(f"step {step:4d}  KIP loss {float(loss.detach()):.4f}  "
                  f"({time.perf_counter() - t0:.0f} s)")

    acc_after = accuracy(model, x_s, y_s, x_te, l_te, args.reg)
    print(f"test accuracy, distilled support set: {acc_after:.3f}  "
          f"(before: {acc_before:.3f}; {time.perf_counter() - t0:.0f} s in all)")
    return {"before": acc_before, "after": acc_after}


if __name__ == "__main__":
    main()
