r"""Projected eNTK features (``ntkcore.features``): their kernel's error against the exact trace
eNTK (``ntkcore.ntk``) and its prediction (``ntkcore.feature_error``), their speed against the
exact kernel and against per-sample gradients projected by a dense Gaussian (``torch.func``,
TRAK's recipe), and a 100,000-sample ridge regression on augmented digits (opt-in).
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import numpy as np
from asv_runner.benchmarks.mark import skip_benchmark_if

from benchmarks.common import in_turns, relerr, require, working_memory

MODELS = ("mlp", "cnn", "transformer")
LAYOUTS = ("pairs", "grid")
N_ERR, N_PRED, N_PROBE, SEEDS, DIM = 256, 64, 32, 3, 1024
LARGE = os.environ.get("NTKCORE_BENCH_LARGE") == "1"


def unit(name: str) -> Any:
    """Decorator: asv's ``unit`` of a ``track_*`` method."""
    return lambda f: setattr(f, "unit", name) or f


def build(kind: str, n: int, dtype: str = "float32") -> tuple[Any, Any]:
    """The model (eval mode, seed 0) and N seeded Gaussian inputs of ``kind``: "mlp"
    (256-512-512-1, tanh), "cnn" (3 x 16 x 16; Conv 3->16 3x3, tanh, Conv 16->32 3x3 stride
    2, tanh, Linear -> 10) or "transformer" (one block: T = 16 tokens, d = 64, single-head
    attention, tanh MLP of 128, LayerNorms, mean over tokens, Linear -> 10)."""
    torch = require("torch")
    nn = torch.nn
    torch.manual_seed(0)
    if kind == "mlp":
        model, shape = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512),
                                     nn.Tanh(), nn.Linear(512, 1)), (256,)
    elif kind == "cnn":
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Tanh(),
                              nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.Tanh(),
                              nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
        shape = (3, 16, 16)
    elif kind == "transformer":
        d = 64

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
                self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
                self.fc1, self.fc2, self.head = nn.Linear(d, 128), nn.Linear(128, d), \
                    nn.Linear(d, 10)

            def forward(self, x: Any) -> Any:
                a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(d), -1)
                h = self.ln1(x + self.o(a @ self.v(x)))
                return self.head(self.ln2(h + self.fc2(torch.tanh(self.fc1(h)))).mean(1))

        model, shape = Block(), (16, d)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((n, *shape), generator=gen, dtype=torch.float64)
    return model.to(getattr(torch, dtype)).eval(), x.to(getattr(torch, dtype))


def errors(model: Any, x: Any, k: np.ndarray, seeds: int, **kw: Any) -> list[float]:
    r"""Per seed, :math:`\|\Phi\Phi^\top - \Theta\|_F / \|\Theta\|_F` of trace features
    :math:`\Phi` (``ntkcore.features(model, x, **kw)``) against the float64 kernel ``k``."""
    import ntkcore

    out = []
    for seed in range(seeds):
        phi = ntkcore.features(model, x, seed=seed, **kw).double()
        out.append(relerr(phi @ phi.T, k))
    return out


class Error:
    """Relative Frobenius error of trace features' kernel against the exact trace eNTK, N = 256.

    ``split`` divides ``dim`` over the Jacobian's blocks by equal weights ("default") or by each
    block's share of the kernel trace on ``probe=`` the first 32 inputs ("probe").  The error
    is heavy-tailed over seeds: the median over 3 seeds.
    """

    params = (list(MODELS), list(LAYOUTS), ["default", "probe"], [256, 4096])
    param_names = ("model", "kronecker", "split", "dim")
    timeout = 300

    def setup_cache(self) -> dict[str, np.ndarray]:
        import ntkcore

        return {k: ntkcore.ntk(*build(k, N_ERR), mode="trace").double().numpy() for k in MODELS}

    def setup(self, exact: dict, kind: str, layout: str, split: str, dim: int) -> None:
        self.model, self.x = build(kind, N_ERR)
        self.k = exact[kind]
        self.kw = {"dim": dim, "kronecker": layout,
                   "probe": self.x[:N_PROBE] if split == "probe" else None}

    @unit("relative")
    def track_error(self, *_: Any) -> float:
        return statistics.median(errors(self.model, self.x, self.k, SEEDS, **self.kw))


class Prediction:
    """``ntkcore.feature_error`` over the measured error (root mean square over 5 seeds) of
    trace features of 64 inputs, dim = 1024: the error model's accuracy (1 = exact)."""

    params = (list(MODELS), list(LAYOUTS))
    param_names = ("model", "kronecker")
    timeout = 300

    @unit("ratio")
    def track_predicted_over_measured(self, kind: str, layout: str) -> float:
        import ntkcore

        (model, x), kw = build(kind, N_PRED), {"dim": DIM, "kronecker": layout}
        k = ntkcore.ntk(*build(kind, N_PRED, "float64"), mode="trace").numpy()
        rms = math.sqrt(statistics.fmean(e * e for e in errors(model, x, k, 5, **kw)))
        return ntkcore.feature_error(model, x, **kw) / rms


class Throughput:
    """Seconds per call of trace features (dim = 1024) of N inputs, and their speed-up over the
    exact trace eNTK of the same inputs (whose cost grows like N^2, that of features like N)."""

    params = (list(MODELS), [512], list(LAYOUTS))
    param_names = ("model", "N", "kronecker")
    number, repeat, warmup_time, rounds, timeout = 1, 3, 0, 1, 300

    def setup(self, kind: str, n: int, layout: str) -> None:
        import ntkcore

        model, x = build(kind, n)
        self.trace = lambda: ntkcore.features(model, x, dim=DIM, kronecker=layout)
        self.exact = lambda: ntkcore.ntk(model, x, mode="trace")

    def time_trace(self, *_: Any) -> None:
        self.trace()

    @unit("x")
    def track_speedup_vs_exact(self, *_: Any) -> float:
        """Exact kernel time over trace features' time, timed in turns."""
        t = in_turns({"features": self.trace, "exact": self.exact}, rounds=2)
        return t["exact"] / t["features"]


class VsGradients:
    """Pseudo-NTK features (dim = 1024) of 64 inputs against per-sample gradients projected by
    a dense Gaussian (``torch.func`` vmap(grad), then a P x dim projection regenerated per batch
    when over 512 MB, as TRAK does; ``benchmarks/baselines/torch_func.py``): both give the
    pseudo-NTK's features, the gradients of :math:`\\sum_o f_o/\\sqrt{O}`."""

    params = (list(MODELS),)
    param_names = ("model",)
    number, repeat, warmup_time, rounds, timeout = 1, 1, 0, 1, 300

    def setup(self, kind: str) -> None:
        import ntkcore
        from benchmarks.baselines.torch_func import gradient_projection

        self.model, self.x = build(kind, 64)
        self.ntkcore = lambda: ntkcore.features(self.model, self.x, dim=DIM, mode="pseudo")
        self.baseline = lambda: gradient_projection(self.model, self.x, dim=DIM)

    def time_ntkcore(self, *_: Any) -> None:
        self.ntkcore()

    def time_baseline(self, *_: Any) -> None:
        self.baseline()

    @unit("x")
    def track_speedup(self, *_: Any) -> float:
        """Baseline time over ntkcore's, timed in turns."""
        t = in_turns({"ntkcore": self.ntkcore, "baseline": self.baseline}, rounds=1)
        return t["baseline"] / t["ntkcore"]


# -- scale: augmented digits ---------------------------------------------------------------------
def digits_data(n_train: int, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """``(x_train (n, 1, 8, 8), y_train one-hot (n, 10), x_test, labels_test)`` as float32
    torch tensors (labels int64): the 1437 training digits of a seeded split, augmented to
    ``n_train`` (the first 1437 unchanged, then shifts by -1..1 pixel in each direction,
    intensity x U(0.8, 1.2), Gaussian noise of 0.05); the 360 test digits as they are; all
    standardised with the training digits' mean and standard deviation."""
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y))
    test, train = perm[:360], perm[360:]
    x = x.reshape(-1, 8, 8) / 16.0
    base, yb = x[train], y[train]
    idx = np.arange(n_train) % len(train)
    xs = base[idx].copy()
    aug = np.arange(n_train) >= len(train)
    m, pad = int(aug.sum()), np.pad(base[idx[aug]], ((0, 0), (1, 1), (1, 1)))
    rows = rng.integers(0, 3, m)[:, None] + np.arange(8)[None, :]
    cols = rng.integers(0, 3, m)[:, None] + np.arange(8)[None, :]
    shifted = pad[np.arange(m)[:, None, None], rows[:, :, None], cols[:, None, :]]
    xs[aug] = shifted * rng.uniform(0.8, 1.2, (m, 1, 1)) + 0.05 * rng.standard_normal((m, 8, 8))
    mu, sd = base.mean(), base.std()

    def t(a: Any) -> Any:
        return torch.as_tensor(((a - mu) / sd)[:, None], dtype=torch.float32)

    onehot = np.eye(10, dtype=np.float32)[yb[idx]]
    return t(xs), torch.as_tensor(onehot), t(x[test]), torch.as_tensor(y[test])


def digits_fit_predict(path: str, x: Any, y: Any, x_test: Any, dim: int = 4096,
                       budget: str = "2GB", reg: float = 1e-3) -> Any:
    r"""Test predictions of a small CNN's eNTK regression (Conv 1->16 3x3, tanh, Conv 16->32 3x3
    stride 2, tanh, Linear 512->10; PyTorch default initialisation, seed 0): ``path``
    "features" (trace features of ``dim`` within ``budget``, then ``ntkcore.FeatureRidge``) or
    "exact" (``ntkcore.ntk`` + ``ntkcore.kernel_regression``); ridge
    :math:`\lambda = \mathrm{reg}\cdot\mathrm{tr}(K)/N` (:math:`\mathrm{tr}(\Phi\Phi^\top)` for
    features)."""
    import ntkcore

    torch = require("torch")
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(),
                          nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.Tanh(),
                          nn.Flatten(), nn.Linear(32 * 4 * 4, 10)).eval()
    n = x.shape[0]
    if path == "features":
        phi = ntkcore.features(model, x, dim=dim, max_memory=budget)
        phi_test = ntkcore.features(model, x_test, dim=dim, max_memory=budget)
        lam = reg * float(torch.linalg.vector_norm(phi)) ** 2 / n
        return ntkcore.FeatureRidge(alpha=lam).fit(phi, y).predict(phi_test)
    k = ntkcore.ntk(model, x, mode="trace", max_memory=budget)
    k_test = ntkcore.ntk(model, x_test, x, mode="trace", max_memory=budget)
    return ntkcore.kernel_regression(k, y, k_test, reg=reg * float(torch.trace(k)) / n)


class Scale:
    """Ridge regression on N augmented digits: trace features (dim = 4096, 2 GB) with
    ``FeatureRidge`` against the exact eNTK with ``kernel_regression`` (N <= 16,000: 1 GB).

    Opt-in (minutes, about 4 GB): set ``NTKCORE_BENCH_LARGE=1``.  Timed: features (or kernels),
    solve and predictions of the 360 test digits; ``track_accuracy`` is their test accuracy."""

    params = (["features", "exact"], [16_000, 100_000])
    param_names = ("path", "N")
    number, repeat, warmup_time, rounds, timeout = 1, 1, 0, 1, 3600

    def setup(self, path: str, n: int) -> None:
        if not LARGE:
            raise NotImplementedError("opt-in: NTKCORE_BENCH_LARGE=1")
        if path == "exact" and n > 16_000:
            raise NotImplementedError("the exact N x N kernel would not fit")
        x, y, x_test, self.labels = digits_data(n)
        self.run = lambda: digits_fit_predict(path, x, y, x_test)

    @skip_benchmark_if(not LARGE)
    def time_fit_predict(self, *_: Any) -> None:
        self.run()

    @skip_benchmark_if(not LARGE)
    @unit("share")
    def track_accuracy(self, *_: Any) -> float:
        return float((self.run().argmax(1) == self.labels).double().mean())

    @skip_benchmark_if(not LARGE)
    @unit("bytes")
    def track_working_memory(self, *_: Any) -> float:
        return working_memory(self.run)
