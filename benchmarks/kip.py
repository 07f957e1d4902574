r"""KIP loss :math:`\mathrm{mean}((K_{ts}(K_{ss} + \lambda I)^{-1} Y_s - Y_t)^2)` (trace eNTK,
:math:`\lambda` = 1e-6 mean diag :math:`K_{ss}`) + gradient wrt the support images: ``kip_loss``
fused, checkpointed ``ntkcore.ntk`` + ``kernel_regression``, and the plain autograd graph."""

import os
from typing import Any

import ntkcore
from benchmarks.common import in_turns, require, working_memory

REG = 1e-6
IMPLS = ("fused", "checkpointed", "plain")
# case -> (model, support M, targets N); the seed ones are opt-in
CASES = {"tiny M=8 N=64": ("tiny", 8, 64), "seed M=100 N=500": ("seed", 100, 500),
         "seed M=100 N=60000": ("seed", 100, 60_000)}


def build(model: str, n_support: int, n_target: int, dtype: str = "float32",
          device: str = "cpu") -> dict[str, Any]:
    """Model (eval, seed 0), support images (requires grad), targets, one-hot labels; ``"seed"``:
    two 3x3 convs (64 channels) + Linear on 1x28x28 (a user's OOM report), ``"tiny"``: 4 channels,
    8x8, ``"mlp"``: 32-128-128-10 tanh."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    if model in ("seed", "tiny"):
        c, hw = (64, 28) if model == "seed" else (4, 8)
        net = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
                            nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
                            nn.Flatten(), nn.Linear(c * hw * hw, 10))
        shape: tuple[int, ...] = (1, hw, hw)
    else:
        net = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                            nn.Linear(128, 10))
        shape = (32,)
    tdtype, gen = getattr(torch, dtype), torch.Generator().manual_seed(1)
    net = net.to(device=device, dtype=tdtype).eval()

    p = {}
    for n, x, y in ((n_support, "xs", "ys"), (n_target, "xt", "yt")):
        p[x] = torch.randn((n, *shape), generator=gen, dtype=torch.float64).to(device, tdtype)
        p[y] = nn.functional.one_hot(torch.randint(0, 10, (n,), generator=gen), 10).to(p[x])
    return {**p, "model": net, "xs": p["xs"].requires_grad_(True)}


def case(impl: str, model: str, n_support: int, n_target: int, dtype: str = "float32",
         device: str = "cpu", max_memory: Any = "2GB", batch_size: int | None = None) -> Any:
    """A call of the KIP loss of ``impl`` + its gradient wrt the support images (returned)."""
    import torch

    from ntkcore.backends.torch_kip import kip_loss
    p = build(model, n_support, n_target, dtype, device)
    net, xs, ys, xt, yt = p["model"], p["xs"], p["ys"], p["xt"], p["yt"]

    def loss() -> Any:
        if impl in ("fused", "checkpointed"):
            return kip_loss(net, xs, ys, xt, yt, reg=REG, max_memory=max_memory,
                            batch_size=batch_size, fused=impl == "fused")
        k_ss = ntkcore.ntk(net, xs, mode="trace", checkpoint=False)
        k_ts = ntkcore.ntk(net, xt, xs, mode="trace", checkpoint=False, max_memory=max_memory)
        eye = torch.eye(k_ss.shape[0], dtype=k_ss.dtype, device=k_ss.device)
        pred = ntkcore.kernel_regression(k_ss + REG * k_ss.diagonal().mean() * eye, ys, k_ts)
        return torch.mean((pred - yt) ** 2)

    return lambda: torch.autograd.grad(loss(), xs)[0]


memory = working_memory  # the name tests/test_kip.py imports


class Loss:
    """KIP loss + support gradient per implementation; error: max-abs deviation from the
    float64 plain gradient over its max-abs.

    Seed cases (M = 100): ``NTKCORE_BENCH_LARGE=1`` (N = 60,000: most of an hour; plain skipped)."""
    params = (["torch", "torch-cuda"], list(IMPLS), list(CASES))
    param_names = ("backend", "impl", "case")
    timeout, number, repeat, warmup_time, rounds = 6 * 3600, 1, 2, 0, 1

    def setup(self, backend: str, impl: str, name: str) -> None:
        require(backend)
        self.spec = CASES[name]
        if self.spec[0] == "seed" and os.environ.get("NTKCORE_BENCH_LARGE") != "1":
            raise NotImplementedError("seed cases need NTKCORE_BENCH_LARGE=1")
        if impl == "plain" and self.spec[2] > 10_000:
            raise NotImplementedError("the plain graph keeps every target's factors")
        self.device = "cuda" if backend == "torch-cuda" else "cpu"
        self.call = case(impl, *self.spec, device=self.device)

    def time_loss_and_grad(self, *_: Any) -> None:
        self.call()

    def track_speedup(self, *_: Any) -> float:
        t = in_turns({"impl": self.call, "plain": case("plain", *self.spec, device=self.device)},
                     rounds=2)
        return t["plain"] / t["impl"]

    def track_error(self, *_: Any) -> float:
        ref = case("plain", *self.spec, "float64", self.device)().cpu()
        return float((self.call().double().cpu() - ref).abs().max() / ref.abs().max())

    def track_working_memory(self, *_: Any) -> float:
        return memory(self.call)

    track_speedup.unit, track_error.unit = "x", "relative"  # type: ignore[attr-defined]
    track_working_memory.unit = "bytes"  # type: ignore[attr-defined]
