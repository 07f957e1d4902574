"""The trace eNTK of a tanh MLP: ``ntkcore.models.MLP`` on each array library, the torch
provider on the same ``nn.Sequential`` (baseline) and the JAX provider on an ``apply_fn``."""

import os
from itertools import pairwise
from typing import Any

import numpy as np

import ntkcore
from benchmarks.common import (
    BACKENDS,
    asarray,
    in_turns,
    ratio_in_turns,
    relerr,
    require,
    roofline_share,
)
from benchmarks.common import working_memory as memory
from benchmarks.panels import reference_ntk
from ntkcore.models import MLP

N_REF = 32
CASES = {"MLP 6x512 tanh N=384": ((256, *[512] * 6, 1), 384),
         "MLP 8x1000 tanh N=512": ((256, *[1000] * 8, 1), 512)}  # (widths, N); 2nd opt-in


def case(impl: str, backend: str, ws: list[Any], bs: list[Any], x_np: np.ndarray) -> Any:
    """The zero-argument kernel call of ``impl`` ("mlp" or "provider") on ``backend``."""
    x = asarray(x_np, backend)
    if impl == "mlp":
        net = MLP([asarray(w, backend) for w in ws], [asarray(b, backend) for b in bs],
                  activation="tanh", parameterization="standard")
        return lambda: ntkcore.ntk(net, x, mode="trace")
    if backend.startswith("torch"):
        import torch
        layers: list[Any] = []
        for w, b in zip(ws, bs, strict=True):
            layers += [lin := torch.nn.Linear(w.shape[1], w.shape[0]), torch.nn.Tanh()]
            lin.weight.data, lin.bias.data = asarray(w, backend), asarray(b, backend)
        model = torch.nn.Sequential(*layers[:-1]).eval()
        return lambda: ntkcore.ntk(model, x, mode="trace")
    import jax.numpy as jnp
    params = [(asarray(w, backend), asarray(b, backend)) for w, b in zip(ws, bs, strict=True)]

    def apply_fn(p: Any, z: Any) -> Any:
        for w, b in p[:-1]:
            z = jnp.tanh(z @ w.T + b)
        return z @ p[-1][0].T + p[-1][1]

    return lambda: ntkcore.ntk((apply_fn, params), x, mode="trace")


def flops(widths: tuple[int, ...], n: int) -> float:
    r"""Trace-mode flops (O = 1), each layer's (N, N) Grams of :math:`[a, 1]` and g as full
    GEMMs: :math:`2N^2\sum_l (d_{in}+1+d_{out})`."""
    return float(n) * n * sum(2 * (a + 1 + b) for a, b in pairwise(widths))


class TraceKernel:
    """Trace eNTK of a tanh MLP per implementation ("mlp" or "provider") and library.

    Speed-up: torch provider over this; error: leading 32 x 32 samples against
    :func:`benchmarks.panels.reference_ntk`.  8 x 1000: ``NTKCORE_BENCH_LARGE=1``."""
    params = (["mlp", "provider"], list(BACKENDS), list(CASES))
    param_names = ("impl", "backend", "case")
    timeout, number, repeat, warmup_time, rounds = 300, 1, 2, 0, 1

    def setup(self, impl: str, backend: str, name: str) -> None:
        require(backend)
        if impl == "provider" and backend in ("numpy", "cupy"):
            raise NotImplementedError("no autodiff provider for " + backend)
        if name != next(iter(CASES)) and os.environ.get("NTKCORE_BENCH_LARGE") != "1":
            raise NotImplementedError("needs NTKCORE_BENCH_LARGE=1")
        self.widths, n = CASES[name]
        net = MLP.random(self.widths, xp=np, seed=0, parameterization="standard", dtype=np.float64)
        self.ws, self.bs = list(net.weights), list(net.biases)  # type: ignore[arg-type]
        self.x = np.random.default_rng(1).standard_normal((n, self.widths[0]))
        self.call = case(impl, backend, self.ws, self.bs, self.x)
        self.device = "torch-cuda" if backend in ("torch-cuda", "cupy") else "torch"

    def time_ntk(self, *_: Any) -> None:
        self.call()

    def track_speedup(self, *_: Any) -> float:
        base = case("provider", self.device, self.ws, self.bs, self.x)
        t = in_turns({"impl": self.call, "base": base}, rounds=2)
        return t["base"] / t["impl"]

    def track_error(self, *_: Any) -> float:
        ref = reference_ntk(self.ws, self.bs, self.x[:N_REF], "tanh", "trace", [1.0] * 99)
        return relerr(self.call()[:N_REF, :N_REF], ref)

    def track_roofline_share(self, impl: str, backend: str, name: str) -> float:
        return roofline_share(self.call, flops(self.widths, self.x.shape[0]), backend, rounds=2)

    def track_working_memory(self, *_: Any) -> float:
        return memory(self.call)

    track_speedup.unit, track_error.unit = "x", "relative"  # type: ignore[attr-defined]
    track_roofline_share.unit, track_working_memory.unit = "share", "bytes"  # type: ignore


#: grouped-convolution layers (C channels, depthwise, H x H input, k x k kernel, "same"
#: padding; every tap live), N = 32, O = 10: convnext_atto's 7 x 7 at 8 x 8 and 4 x 4,
#: efficientnet_b0's 3 x 3 at 16 x 16, 8 x 8 and 4 x 4, and 5 x 5 at 4 x 4
GROUPED = {"convnext_7x7_8x8": (40, 8, 7), "convnext_7x7_4x4": (80, 4, 7),
           "effnet_3x3_16x16": (32, 16, 3), "effnet_3x3_8x8": (96, 8, 3),
           "effnet_3x3_4x4": (240, 4, 3), "effnet_5x5_4x4": (240, 4, 5)}


class GroupedConvBlock:
    """The torch provider's dense block of a depthwise convolution (``ConvRule.block`` from
    the layer's input and output gradients, float32, N = 32, O = 10) by one convolution
    (``torch_layers._grouped_conv_weights``, its position threshold set to 0) against the
    routes it replaces (threshold infinite), in turns: what sets
    ``GROUPED_CONV_MIN_POSITIONS`` (64: the 8 x 8 and larger maps below 1, the 4 x 4 ones
    not)."""

    params = (list(GROUPED), [1, 2])
    param_names = ("layer", "threads")
    number, repeat, warmup_time = 1, 1, 0
    timeout = 300

    def setup(self, layer: str, threads: int) -> None:
        torch = require("torch")
        from ntkcore.backends import torch_layers as tl

        torch.set_num_threads(threads)
        c, h, k = GROUPED[layer]
        n, o = 32, 10
        gen = torch.Generator().manual_seed(0)
        mod = torch.nn.Conv2d(c, c, k, padding=k // 2, groups=c)
        x = torch.randn(n, c, h, h, generator=gen)
        g = torch.randn(n, o, c, h * h, generator=gen).permute(0, 3, 1, 2)  # (N, S, O, C)
        rule, kept = tl.RULES[torch.nn.Conv2d], tl.GROUPED_CONV_MIN_POSITIONS

        def build(least: int) -> Any:
            tl.GROUPED_CONV_MIN_POSITIONS = least
            try:
                return rule.block(mod, [x], [g], n, "conv", True, True)
            finally:
                tl.GROUPED_CONV_MIN_POSITIONS = kept

        self.fns = {"convolution": lambda: build(0), "others": lambda: build(10**9)}

    def time_convolution(self, *_: Any) -> None:
        self.fns["convolution"]()

    def track_convolution_over_others(self, *_: Any) -> float:
        return ratio_in_turns(self.fns, "convolution", "others")

    track_convolution_over_others.unit = "ratio"  # type: ignore[attr-defined]
