r"""SENG training-step time against an SGD step on the same model (scikit-learn digits).

Cases
-----
``step <model> batch=<b>``
    Time of 10 training steps (zero_grad, forward, cross-entropy, backward, optimizer step) on
    fixed mini-batches of the standardised digits, reported per step.  Baseline: SGD with
    momentum.  Impls: Adam, SENG with the curvature refreshed every step (``update_freq=1``)
    and every 10 steps (``update_freq=10``, target: within 3x of the SGD step on the MLP, i.e.
    speedup >= 1/3), and SENG with a leverage sketch.  Models: the MLP 64-64-10 (tanh) and a
    small CNN (two 3x3 convolutions, 8 and 16 channels) of ``examples/seng_digits.py``.
    ``error`` is unused (no reference); ``params`` record the model's parameter count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks._harness import Config, row

SUITE = "seng"
STEPS = 10


def _models() -> dict[str, Callable[[], Any]]:
    from torch import nn

    return {
        "mlp": lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh(),
                                     nn.Linear(64, 10)),
        "cnn": lambda: nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3),
                                     nn.ReLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, 10)),
    }


def _optimizer(impl: str, model: Any) -> Any:
    import torch

    from ntkcore.backends.torch import SENG

    if impl == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if impl == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if impl == "seng update_freq=1":
        return SENG(model, lr=0.3, damping=1.0, momentum=0.9, update_freq=1)
    if impl == "seng update_freq=10":
        return SENG(model, lr=0.3, damping=1.0, momentum=0.9, update_freq=10)
    if impl == "seng update_freq=10 leverage q=256":
        return SENG(model, lr=0.3, damping=1.0, momentum=0.9, update_freq=10,
                    sketch="leverage", sketch_size=256)
    raise ValueError(f"unknown impl {impl!r}")


IMPLS = ("sgd", "adam", "seng update_freq=1", "seng update_freq=10",
         "seng update_freq=10 leverage q=256")


def step_case(model_name: str, impl: str, device: str, dtype: str, batch: int
              ) -> Callable[[], Any]:
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    dt = getattr(torch, dtype)
    xs = torch.as_tensor(x, dtype=dt, device=device).reshape(-1, 1, 8, 8)
    ys = torch.as_tensor(y, device=device)
    torch.manual_seed(0)
    model = _models()[model_name]().to(device=device, dtype=dt)
    opt = _optimizer(impl, model)
    crit = nn.CrossEntropyLoss()
    batches = [(xs[s:s + batch], ys[s:s + batch]) for s in range(0, STEPS * batch, batch)]

    def steps() -> Any:
        for xb, yb in batches:
            opt.zero_grad()
            crit(model(xb), yb).backward()
            opt.step()
        return model

    return steps


def run(cfg: Config) -> list[dict[str, Any]]:
    if not cfg.has("torch"):
        return []
    rows: list[dict[str, Any]] = []
    batch = 128
    for model_name in cfg.pick(("mlp",), ("mlp", "cnn")):
        n_params = sum(p.numel() for p in _models()[model_name]().parameters())
        for impl in cfg.pick(("sgd", "seng update_freq=10"), IMPLS):
            fn = step_case(model_name, impl, cfg.device, cfg.dtype, batch)
            timing = cfg.time(fn, "torch")
            per_step = {k: (v / STEPS if k.endswith("_s") else v) for k, v in timing.items()}
            target = ("speedup >= 0.333" if (model_name, impl) == ("mlp", "seng update_freq=10")
                      else None)
            rows.append(row(
                SUITE, f"step {model_name} batch={batch}", impl, backend="torch",
                device=cfg.device, dtype=cfg.dtype, timing=per_step,
                params={"N": batch, "P": n_params, "steps": STEPS},
                baseline=None if impl == "sgd" else "sgd", target=target,
                note="per training step (forward + backward + update), mean over 10 steps",
            ))
    return rows
