"""SENG training steps against SGD (the baseline) and Adam on the same model, scikit-learn digits
(``examples/seng_digits.py``'s MLP and CNN)."""

from typing import Any

from benchmarks.common import in_turns, require

STEPS, BATCH = 10, 128
# optimizer -> SENG options (seng: curvature refreshed every step, seng_freq10: every 10 steps)
SENG = {"seng": {"update_freq": 1}, "seng_freq10": {"update_freq": 10},
        "seng_leverage": {"update_freq": 10, "sketch": "leverage", "sketch_size": 256}}


def steps_case(model_name: str, optimizer: str, device: str = "cpu") -> Any:
    """A call of 10 training steps on fixed batches of 128 standardised digits (float32, seed 0):
    the MLP 64-64-10 (tanh) or the CNN (3x3 convolutions, 8 and 16 channels)."""
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    from ntkcore.backends.torch import SENG as Seng
    x, y = load_digits(return_X_y=True)
    xs = torch.as_tensor((x - x.mean(0)) / (x.std(0) + 1e-6), dtype=torch.float32,
                         device=device).reshape(-1, 1, 8, 8)
    ys = torch.as_tensor(y, device=device)
    torch.manual_seed(0)
    model = (nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
             if model_name == "mlp" else
             nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
                           nn.Flatten(), nn.Linear(16 * 4 * 4, 10))).to(device)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd" else
           torch.optim.Adam(model.parameters(), lr=0.01) if optimizer == "adam" else
           Seng(model, lr=0.3, damping=1.0, momentum=0.9, **SENG[optimizer]))
    crit = nn.CrossEntropyLoss()
    batches = [(xs[s:s + BATCH], ys[s:s + BATCH]) for s in range(0, STEPS * BATCH, BATCH)]

    def steps() -> Any:
        for xb, yb in batches:
            opt.zero_grad()
            (loss := crit(model(xb), yb)).backward()
            opt.step()
        return loss

    return steps


class Steps:
    """Ten training steps, batch 128, per optimizer; target: ``seng_freq10`` within 3x of SGD on
    the MLP (``track_speedup`` >= 0.333, SGD time over SENG's, timed in turns)."""
    params, param_names = (["torch", "torch-cuda"], ["mlp", "cnn"]), ("backend", "model")
    timeout, repeat, warmup_time = 120, (1, 5, 4.0), 0.1

    def setup(self, backend: str, model: str) -> None:
        require(backend)
        device = "cuda" if backend == "torch-cuda" else "cpu"
        self.calls = {o: steps_case(model, o, device) for o in ("sgd", "adam", *SENG)}

    def track_speedup(self, *_: Any) -> float:
        t = in_turns({"sgd": self.calls["sgd"], "seng": self.calls["seng_freq10"]})
        return t["sgd"] / t["seng"]
    track_speedup.unit = "x"  # type: ignore[attr-defined]


for _o in ("sgd", "adam", *SENG):  # time_sgd, time_adam, time_seng, ...: ten steps each
    setattr(Steps, f"time_{_o}", lambda self, *_, o=_o: self.calls[o]())
