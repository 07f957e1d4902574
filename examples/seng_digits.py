"""SENG against tuned SGD and Adam on scikit-learn's digits (an MLP and a small CNN).

For every optimizer a small learning-rate grid is tried and the best setting is reported: the
number of epochs until the full training loss first drops below a target, and the time per
epoch.  SENG uses ``ntkcore.backends.torch.SENG`` (layer-wise SMW natural gradient with
per-sample gradients captured from the normal backward pass).

    python examples/seng_digits.py            # both models, full grids
    python examples/seng_digits.py --quick    # MLP only, small grids, a few seconds
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from ntkcore.backends.torch import SENG


def load_data(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardised 8x8 digit images (1797, 1, 8, 8) and labels (1797,)."""
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6)
    return (torch.as_tensor(x, dtype=dtype).reshape(-1, 1, 8, 8),
            torch.as_tensor(y, dtype=torch.int64))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 4 * 4, 10))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "cnn": cnn}


def make_optimizer(name: str, model: nn.Module, setting: tuple[float, ...]
                   ) -> torch.optim.Optimizer:
    """``setting`` is (lr,) for SGD/Adam and (lr, damping) for SENG."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=setting[0], momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=setting[0])
    if name == "seng":
        lr, damping = setting
        return SENG(model, lr=lr, damping=damping, momentum=0.9, update_freq=1)
    raise ValueError(name)


def epochs_to_loss(model_name: str, opt_name: str, setting: tuple[float, ...], *,
                   target: float,
                   max_epochs: int, batch_size: int = 128, seed: int = 0
                   ) -> tuple[int | None, float, float]:
    """(first epoch whose full training loss is <= target or None, final loss, s/epoch)."""
    x, y = load_data()
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    opt = make_optimizer(opt_name, model, setting)
    crit = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    loss_value = float("nan")
    t0 = time.perf_counter()
    for epoch in range(1, max_epochs + 1):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            idx = perm[start:start + batch_size]
            opt.zero_grad()
            crit(model(x[idx]), y[idx]).backward()
            opt.step()
        with torch.no_grad():
            loss_value = float(crit(model(x), y))
        if not np.isfinite(loss_value):
            return None, loss_value, (time.perf_counter() - t0) / epoch
        if loss_value <= target:
            return epoch, loss_value, (time.perf_counter() - t0) / epoch
    return None, loss_value, (time.perf_counter() - t0) / max_epochs


# SGD/Adam: learning rates; SENG: (lr, damping).  Steps along directions outside the span of
# the per-sample gradients are lr/damping times the gradient, so a larger damping goes with a
# larger lr (the CNN needs more damping than the MLP).
GRIDS: dict[str, tuple[tuple[float, ...], ...]] = {
    "sgd": ((0.1,), (0.3,), (0.5,)),
    "adam": ((0.01,), (0.03,), (0.05,), (0.1,)),
    "seng": ((0.5, 0.1), (0.5, 0.3), (1.0, 3.0)),
}
QUICK_GRIDS: dict[str, tuple[tuple[float, ...], ...]] = {
    "sgd": ((0.3,), (0.5,)),
    "adam": ((0.03,), (0.05,), (0.1,)),
    "seng": ((0.5, 0.1),),
}


def best_of_grid(model_name: str, opt_name: str, grid: tuple[tuple[float, ...], ...], *,
                 target: float, max_epochs: int
                 ) -> tuple[tuple[float, ...], int | None, float, float]:
    """The setting reaching the target in the fewest epochs (ties: lower final loss)."""
    best = None
    for setting in grid:
        ep, final, per_epoch = epochs_to_loss(model_name, opt_name, setting, target=target,
                                              max_epochs=max_epochs)
        key = (ep if ep is not None else max_epochs + 1, final)
        if best is None or key < best[0]:
            best = (key, setting, ep, final, per_epoch)
    assert best is not None
    return best[1], best[2], best[3], best[4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="MLP only, small grids")
    parser.add_argument("--target", type=float, default=3e-4, help="training loss to reach")
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (one is fastest for these tiny models)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = ("mlp",) if args.quick else ("mlp", "cnn")
    max_epochs = 10 if args.quick else args.max_epochs
    grids = QUICK_GRIDS if args.quick else GRIDS
    print(f"target training loss {args.target}, at most {max_epochs} epochs, batch 128")
    for model_name in models:
        for opt_name in ("sgd", "adam", "seng"):
            setting, ep, final, per_epoch = best_of_grid(
                model_name, opt_name, grids[opt_name], target=args.target,
                max_epochs=max_epochs)
            reached = f"{ep:3d} epochs" if ep is not None else "not reached"
            label = ("lr, damping " if opt_name == "seng" else "lr ") + ", ".join(
                f"{v:g}" for v in setting)
            print(f"{model_name:4s} {opt_name:5s} best {label:<20s} {reached:>12s}  "
                  f"final loss {final:.2e}  {per_epoch * 1e3:7.1f} ms/epoch")


if __name__ == "__main__":
    main()
