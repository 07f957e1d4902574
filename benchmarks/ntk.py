r"""``ntkcore.ntk`` on PyTorch models (seeded, float32) against the ``torch.func`` baselines of
``benchmarks/baselines/torch_func.py``; roofline share of the 8 x 1000 MLP; memory in a budget."""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

from benchmarks.common import in_turns, relerr, require, roofline_share, to64, working_memory

TORCH = ["torch", "torch-cuda"]
N_REF = 32  # errors are taken on the kernel of the leading N_REF samples

MLP_WIDTHS: dict[str, tuple[int, ...]] = {  # the dense MLP kinds (biases everywhere)
    "mlp6x512": (256, *[512] * 6, 1),
    "mlp8x1000": (256, *[1000] * 8, 1),
    "mlp784": (784, 512, 512, 10),
    "mlp_tiny": (8, 16, 16, 1),
}


def _transformer(torch: Any, d: int, hidden: int, out: int) -> Any:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
            self.head = nn.Linear(d, out)

        def forward(self, x: Any) -> Any:
            att = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(d), dim=-1)
            h = self.ln1(x + self.o(att @ self.v(x)))
            h = self.ln2(h + self.fc2(torch.tanh(self.fc1(h))))
            return self.head(h.mean(1))

    return Block()


def build(kind: str, n: int, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """Model (eval) and inputs (N, ...) of a kind: the tanh MLPs of ``MLP_WIDTHS`` (relu:
    mlp784), ``cnn`` (two 3x3 convs, 32 x 32 inputs), ``transformer`` (T = 16, d = 64, O = 10)."""
    import torch

    nn = torch.nn
    torch.manual_seed(0)
    if kind in MLP_WIDTHS:
        widths, act = MLP_WIDTHS[kind], (nn.ReLU if kind == "mlp784" else nn.Tanh)
        layers: list[Any] = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            layers += [nn.Linear(a, b)] + ([act()] if i < len(widths) - 2 else [])
        model, shape = nn.Sequential(*layers), (widths[0],)
    elif kind in ("cnn", "cnn_tiny"):
        c1, c2, hw = (32, 64, 32) if kind == "cnn" else (4, 6, 8)
        model = nn.Sequential(nn.Conv2d(3, c1, 3, padding=1), nn.Tanh(),
                              nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.Tanh(),
                              nn.Flatten(), nn.Linear(c2 * (hw // 2) ** 2, 10))
        shape = (3, hw, hw)
    elif kind == "transformer":
        model, shape = _transformer(torch, 64, 128, 10), (16, 64)
    elif kind == "transformer_tiny":
        model, shape = _transformer(torch, 8, 16, 3), (4, 8)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    tdtype = getattr(torch, dtype)
    model = model.to(device=device, dtype=tdtype).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((n, *shape), generator=gen, dtype=torch.float64)
    return model, x.to(device=device, dtype=tdtype)


def mlp_roofline_flops(widths: tuple[int, ...] | list[int], n: int, mode: str) -> float:
    r"""GEMM flops (2 per multiply-add) of the least work of a dense MLP's self-kernel eNTK,
    widths :math:`d_0..d_L`, :math:`O = d_L`:

    .. math::

        F = 2N \sum_{l=1}^{L} d_{l-1} d_l,\quad B = 2NO \sum_{l=2}^{L} d_l d_{l-1},\quad
        G = \sum_{l} \bigl[N(N+1)(d_{l-1} + 1) + M(M+1)\,K_l\bigr]

    (forward, output gradients, ``syrk`` Grams of :math:`[z_{l-1}, 1]` and :math:`G_l`); full mode
    :math:`M = NO, K_l = d_l`, trace mode :math:`M = N, K_l = O d_l`."""
    if mode not in ("full", "trace"):
        raise ValueError(f"mode must be 'full' or 'trace'; got {mode!r}")
    d, full = [int(w) for w in widths], mode == "full"
    o, m = d[-1], n * d[-1] if full else n
    return mlp_pass_flops(d, n) + sum(
        n * (n + 1.0) * (d[l - 1] + 1) + m * (m + 1.0) * d[l] * (1 if full else o)
        for l in range(1, len(d)))


def mlp_pass_flops(widths: tuple[int, ...] | list[int], n: int) -> float:
    """:math:`F + B` of :func:`mlp_roofline_flops`: the GEMM flops of the forward pass and of
    the O output-gradient passes (input gradients only), the floor's share of the roofline."""
    d = [int(w) for w in widths]
    inner = sum(a * b for a, b in itertools.pairwise(d[1:]))
    return 2.0 * n * (d[0] * d[1] + (1 + d[-1]) * inner)


class _Model:
    """``self.ntkcore``: the eNTK of ``case`` = "kind N mode" (models: :func:`build`)."""

    timeout = 300
    number, repeat, warmup_time, rounds = 1, 3, 0, 1

    def build(self, backend: str, case: str, max_memory: Any = None) -> None:
        import ntkcore

        require(backend)
        self.device = "cuda" if backend == "torch-cuda" else "cpu"
        self.kind, n, self.mode = case.split()
        self.model, self.x = build(self.kind, int(n), "float32", self.device)
        self.ntkcore = lambda: ntkcore.ntk(self.model, self.x, mode=self.mode,
                                           max_memory=max_memory)

    def time_ntkcore(self, *_: Any) -> None:
        self.ntkcore()


class VsTorchFunc(_Model):
    """ntkcore against torch.func's per-sample Jacobian contraction (cases ``kind N mode``)."""

    params = (TORCH, ["mlp6x512 128 trace", "mlp784 16 full", "cnn 16 full",
                      "transformer 32 trace"])
    param_names = ("backend", "case")

    def setup(self, backend: str, case: str) -> None:
        from benchmarks.baselines import torch_func

        self.build(backend, case)
        self.jacobian = lambda: torch_func.jacobian_contraction(self.model, self.x,
                                                                mode=self.mode)

    def time_jacobian(self, *_: Any) -> None:
        self.jacobian()

    def track_speedup(self, *_: Any) -> float:
        """torch.func time over ntkcore's, timed in turn."""
        t = in_turns({"ntkcore": self.ntkcore, "jacobian": self.jacobian}, rounds=3)
        return t["jacobian"] / t["ntkcore"]
    track_speedup.unit = "x"  # type: ignore[attr-defined]

    def track_error(self, *_: Any) -> float:
        """Relative error of the leading 32 x 32 block against float64 torch.func."""
        from benchmarks.baselines import torch_func

        model, x = build(self.kind, N_REF, "float64", self.device)
        ref = torch_func.jacobian_contraction(model, x, mode=self.mode)
        m = min(N_REF, self.x.shape[0])
        return relerr(self.ntkcore()[:m, :m], ref[:m, :m])
    track_error.unit = "relative"  # type: ignore[attr-defined]


class VsVectorProducts(_Model):
    """ntkcore against torch.func NTK-vector products (cost N^2 O: small N)."""

    params = (TORCH, ["mlp6x512 16 trace", "transformer 8 trace"])
    param_names = ("backend", "case")

    def setup(self, backend: str, case: str) -> None:
        from benchmarks.baselines import torch_func

        self.build(backend, case)
        self.vp = lambda: torch_func.ntk_vector_products(self.model, self.x, mode=self.mode)

    def time_ntk_vp(self, *_: Any) -> None:
        self.vp()

    def track_speedup(self, *_: Any) -> float:
        """NTK-vector-product time over ntkcore's, timed in turn."""
        t = in_turns({"ntkcore": self.ntkcore, "vp": self.vp}, rounds=3)
        return t["vp"] / t["ntkcore"]
    track_speedup.unit = "x"  # type: ignore[attr-defined]


class Roofline(_Model):
    """The 8 x 1000 tanh MLP, N = 512, trace: share of the roofline on 1 and 2 threads.

    Roofline time: :func:`mlp_roofline_flops` at the rate of a 2048^2 GEMM timed in turns."""

    params = ([1, 2],)
    param_names = ("threads",)

    def setup(self, threads: int) -> None:
        import torch
        from threadpoolctl import threadpool_limits

        torch.set_num_threads(threads)
        self._limits = threadpool_limits(threads)
        self.build("torch", "mlp8x1000 512 trace")

    def track_roofline_share(self, threads: int) -> float:
        flops = mlp_roofline_flops(MLP_WIDTHS["mlp8x1000"], 512, "trace")
        return roofline_share(self.ntkcore, flops, "torch")
    track_roofline_share.unit = "share"  # type: ignore[attr-defined]

    def track_ceiling(self, threads: int) -> float:
        r"""The share of the roofline that an exact method running the model's own passes
        reaches at best: roofline time over :math:`t_{floor} + G / r_{GEMM}`, the floor
        (``backward_floor``: the forward pass and the output-gradient pass, their tanh,
        tanh' and bias copies included, which the roofline does not count) and a Gram at the
        GEMM rate, timed in turns with the GEMM."""
        from benchmarks.common import gemm
        from benchmarks.real_models_bench import backward_floor

        total = mlp_roofline_flops(MLP_WIDTHS["mlp8x1000"], 512, "trace")
        passes = mlp_pass_flops(MLP_WIDTHS["mlp8x1000"], 512)
        g, g_flops = gemm("torch")
        t = in_turns({"floor": backward_floor(self.model, self.x), "gemm": g}, rounds=5)
        rate = g_flops / t["gemm"]
        return total / rate / (t["floor"] + (total - passes) / rate)
    track_ceiling.unit = "share"  # type: ignore[attr-defined]

    def track_error(self, threads: int) -> float:
        """Leading 32 x 32 block against :func:`benchmarks.peer.reference_ntk` (float64)."""
        from benchmarks.peer import reference_ntk

        lin = [m for m in self.model if hasattr(m, "weight")]
        ws, bs = ([to64(getattr(m, k).detach()) for m in lin] for k in ("weight", "bias"))
        p = {"weights": ws, "biases": bs, "x": to64(self.x[:N_REF]), "scales": [1.0] * len(lin),
             "beta": 1.0}
        return relerr(self.ntkcore()[:N_REF, :N_REF], reference_ntk(p))
    track_error.unit = "relative"  # type: ignore[attr-defined]


class Budget(_Model):
    """The 6 x 512 MLP, trace: N = 1024 in ``max_memory="128MB"``; N = 4096 in "1GB" is
    opt-in (``NTKCORE_BENCH_LARGE=1``)."""

    params = (TORCH, [1024, 4096])
    param_names = ("backend", "N")

    def setup(self, backend: str, n: int) -> None:
        if n > 1024 and os.environ.get("NTKCORE_BENCH_LARGE") != "1":
            raise NotImplementedError("large case: set NTKCORE_BENCH_LARGE=1")
        self.build(backend, f"mlp6x512 {n} trace", max_memory="128MB" if n <= 1024 else "1GB")

    def track_working_memory(self, *_: Any) -> float:
        return working_memory(self.ntkcore)
    track_working_memory.unit = "bytes"  # type: ignore[attr-defined]
