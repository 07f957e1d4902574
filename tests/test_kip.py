"""Differentiable eNTK for KIP: gradients with respect to the inputs, the checkpointed
(memory-bounded) kernel and the fused KIP loss (float64).

References are independent of the library's Jacobian machinery: dense per-sample Jacobians
from ``torch.func`` (``vmap(jacrev)`` with respect to the parameters, differentiable in ``x``
under ordinary autograd), contracted with ``einsum``, and ``torch.linalg.solve`` for the
regression.  Peak memory is measured in fresh subprocesses by ``benchmarks.kip.memory``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.autograd import gradcheck

import ntkcore
from ntkcore.backends import torch_kip
from ntkcore.backends.torch_kip import checkpointed_ntk, kip_loss
from ntkcore.modes import check_mode
from tests.references import autograd_jacobian_graph

DT = torch.float64
ROOT = Path(__file__).resolve().parent.parent


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 2)).to(DT)


def cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 2, 2), nn.Tanh(), nn.Conv2d(2, 2, 2, padding=1),
                         nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 2)).to(DT)


SHAPES = {"mlp": (3,), "cnn": (1, 3, 3)}
MODELS = {"mlp": mlp, "cnn": cnn}


def inputs(kind: str, n: int, seed: int, grad: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *SHAPES[kind], generator=gen, dtype=DT).requires_grad_(grad)


ref_jac = autograd_jacobian_graph


def test_reference_matches_finite_differences():
    """The reference's input gradient against central differences (LayerNorm model)."""
    model = mlp()
    x = inputs("mlp", 2, 20, True)
    x2 = inputs("mlp", 2, 21)

    def f(a):
        return (ref_kernel(model, a, x2, "full") ** 2).sum()

    g = torch.autograd.grad(f(x), x)[0]
    num = torch.zeros_like(g)
    eps = 1e-6
    xd = x.detach()
    for idx in np.ndindex(*x.shape):
        e = torch.zeros_like(xd)
        e[idx] = eps
        num[idx] = (f(xd + e) - f(xd - e)).detach() / (2 * eps)
    assert rel(g, num) < 1e-6


def ref_kernel(model, x1, x2, mode, pseudo=False):
    j1, j2 = ref_jac(model, x1), ref_jac(model, x2)
    if pseudo:
        o = j1.shape[1]
        j1, j2 = j1.sum(1, keepdim=True) / o**0.5, j2.sum(1, keepdim=True) / o**0.5
    full = torch.einsum("nok,mpk->nmop", j1, j2)
    return {"full": full, "trace": torch.einsum("nmoo->nm", full),
            "diagonal": torch.einsum("nmoo->nmo", full)}["trace" if pseudo else mode]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-300)


# --------------------------------------------------------------------------------------------
# 1. ntk() / pseudo_ntk() are differentiable in x1, x2, both (plain autograd path)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,mode", [("mlp", "trace"), ("cnn", "full")])
@pytest.mark.parametrize("side", ["x1", "x2", "both"])
def test_gradcheck_ntk(kind, mode, side):
    model = MODELS[kind]()
    x1 = inputs(kind, 2, 0, side in ("x1", "both"))
    x2 = inputs(kind, 3, 1, side in ("x2", "both"))
    args = tuple(x for x in (x1, x2) if x.requires_grad)

    def f(*xs):
        it = iter(xs)
        a = next(it) if x1.requires_grad else x1
        b = next(it) if x2.requires_grad else x2
        return ntkcore.ntk(model, a, b, mode=mode, checkpoint=False)

    assert gradcheck(f, args, fast_mode=True)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_gradcheck_symmetric_and_pseudo(kind):
    model = MODELS[kind]()
    x1 = inputs(kind, 3, 2, True)
    assert gradcheck(lambda a: ntkcore.ntk(model, a, mode="diagonal"), (x1,), fast_mode=True)
    x2 = inputs(kind, 2, 3, True)
    assert gradcheck(lambda a, b: ntkcore.pseudo_ntk(model, a, b, checkpoint=False), (x1, x2),
                     fast_mode=True)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_input_gradient_matches_torch_func_reference(kind):
    """Value and gradient of a scalar of the kernel against the torch.func reference."""
    model = MODELS[kind]()
    x1, x2 = inputs(kind, 3, 4, True), inputs(kind, 4, 5, True)
    w = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(9), dtype=DT)
    k = ntkcore.ntk(model, x1, x2, mode="full")
    g = torch.autograd.grad((k * w).sum(), (x1, x2))
    kr = ref_kernel(model, x1, x2, "full")
    gr = torch.autograd.grad((kr * w).sum(), (x1, x2))
    assert rel(k, kr) < 1e-12
    for a, b in zip(g, gr, strict=True):
        assert rel(a, b) < 1e-10


# --------------------------------------------------------------------------------------------
# 2. the checkpointed kernel
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("support_first", [False, True])
def test_gradcheck_checkpointed(kind, support_first):
    model = MODELS[kind]()
    xs, xt = inputs(kind, 2, 6, True), inputs(kind, 5, 7)

    def f(a):
        args = (a, xt) if support_first else (xt, a)
        return ntkcore.ntk(model, *args, mode="trace", checkpoint=True, batch_size=2)

    assert gradcheck(f, (xs,), fast_mode=True)


def _forced(kinds):
    real = torch_kip._choose_layout

    def choose(jt, js, mode, budget, itemsize):
        layout = real(jt, js, mode, budget, itemsize)
        return torch_kip._Layout(layout.names, tuple(
            k if k == "dense" or (b.num_positions == 1) else kinds
            for k, b in zip(layout.kinds, js.blocks, strict=True)))

    return choose


@pytest.mark.parametrize("mode", ["trace", "full", "diagonal"])
@pytest.mark.parametrize("layout", ["kron", "mat"])
def test_checkpointed_equals_untiled(monkeypatch, mode, layout):
    """Values and gradients of the chunked/recomputing path equal the plain autograd graph
    (and the torch.func reference), for both Kronecker strategies and every chunk size."""
    monkeypatch.setattr(torch_kip, "_choose_layout", _forced(layout))
    model = cnn()
    xs, xt = inputs("cnn", 3, 8, True), inputs("cnn", 7, 9)
    k0 = ntkcore.ntk(model, xt, xs, mode=mode, checkpoint=False)
    w = torch.randn(k0.shape, generator=torch.Generator().manual_seed(3), dtype=DT)
    g0 = torch.autograd.grad((k0 * w).sum(), xs)[0]
    kr = ref_kernel(model, xt, xs, mode)
    gr = torch.autograd.grad((kr * w).sum(), xs)[0]
    assert rel(k0, kr) < 1e-12 and rel(g0, gr) < 1e-10
    for chunk in (1, 3, 7):
        k = checkpointed_ntk(model, xt, xs, mode=mode, batch_size=chunk)
        assert k.grad_fn is not None
        g = torch.autograd.grad((k * w).sum(), xs)[0]
        assert rel(k, k0) < 1e-13 and rel(g, g0) < 1e-12, chunk
    # support as x1: the transposed kernel
    wt = w.permute(check_mode(mode).swap(0))
    k = checkpointed_ntk(model, xs, xt, mode=mode, batch_size=2)
    g = torch.autograd.grad((k * wt).sum(), xs)[0]
    assert rel(k, k0.permute(check_mode(mode).swap(0))) < 1e-13 and rel(g, g0) < 1e-12


def test_checkpointed_with_stored_column_blocks():
    """A depthwise convolution on 1 x 1 maps stores one live tap of 25 (``DenseBlock.columns``)
    on the target side; the support side is rebuilt from whole arrays.  Value and input
    gradient of the checkpointed kernel against the torch.func reference."""
    from tests.test_torch_grouped_conv_embedding import _SmallMapDepthwise
    from tests.tolerances import kernel_tol

    torch.manual_seed(4)
    model = _SmallMapDepthwise(kernel=5).to(DT)
    model(torch.randn(1, 2, 1, 1, dtype=DT))
    model = model.eval()
    xt = torch.randn(5, 2, 1, 1, dtype=DT)
    xs = torch.randn(3, 2, 1, 1, dtype=DT, requires_grad=True)
    blocks = ntkcore.backends.torch_jacobian.jacobian(model, xt).blocks
    assert blocks[1].columns is not None and blocks[1].num_stored == 20 + 20
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(2), dtype=DT)
    k = checkpointed_ntk(model, xt, xs, mode="trace")
    (g,) = torch.autograd.grad((k * w).sum(), (xs,))
    kr = ref_kernel(model, xt, xs, "trace")
    (gr,) = torch.autograd.grad((kr * w).sum(), (xs,))
    p = sum(q.numel() for q in model.parameters())
    assert rel(k, kr) < kernel_tol(DT, p, computations=2)
    assert rel(g, gr) < kernel_tol(DT, p, computations=8)


def test_checkpointed_layerwise_pseudo_and_dense_blocks():
    model = mlp()  # LayerNorm: a DenseBlock
    xs, xt = inputs("mlp", 3, 10, True), inputs("mlp", 6, 11)
    k0 = ntkcore.ntk(model, xt, xs, mode="trace", layerwise=True, checkpoint=False)
    k = checkpointed_ntk(model, xt, xs, mode="trace", layerwise=True, batch_size=4)
    assert k.shape == k0.shape == (3, 6, 3)  # Linear, LayerNorm (dense), Linear
    w = torch.randn(k0.shape, generator=torch.Generator().manual_seed(4), dtype=DT)
    g0 = torch.autograd.grad((k0 * w).sum(), xs)[0]
    g = torch.autograd.grad((k * w).sum(), xs)[0]
    assert rel(k, k0) < 1e-13 and rel(g, g0) < 1e-12
    kp = ntkcore.pseudo_ntk(model, xt, xs, checkpoint=True, batch_size=4)
    kr = ref_kernel(model, xt, xs, "trace", pseudo=True)
    gp = torch.autograd.grad(kp.sum(), xs)[0]
    gr = torch.autograd.grad(kr.sum(), xs)[0]
    assert rel(kp, kr) < 1e-12 and rel(gp, gr) < 1e-10


def test_checkpointed_without_grad_and_single_backward_only():
    model = mlp()
    xs, xt = inputs("mlp", 2, 12), inputs("mlp", 5, 13)
    k = checkpointed_ntk(model, xt, xs, batch_size=2)
    assert not k.requires_grad
    assert rel(k, ref_kernel(model, xt, xs, "trace")) < 1e-12
    xs.requires_grad_(True)
    k = checkpointed_ntk(model, xt, xs, batch_size=2)
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(k.sum(), xs, create_graph=True)
    ys = torch.zeros(2, 2, dtype=DT)
    loss = kip_loss(model, xs, ys, xt, torch.ones(5, 2, dtype=DT), reg=1e-2)
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(loss, xs, create_graph=True)


def test_auto_routing(monkeypatch):
    model = cnn()
    xs, xt = inputs("cnn", 2, 14, True), inputs("cnn", 40, 15)
    calls = []
    real = torch_kip.checkpointed_ntk

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_kip, "checkpointed_ntk", spy)
    k_small = ntkcore.ntk(model, xt, xs, mode="trace", max_memory="60kB")  # targets too big
    assert len(calls) == 1 and calls[0]["max_memory"] == 60000
    k_big = ntkcore.ntk(model, xt, xs, mode="trace", max_memory="1GB")
    assert len(calls) == 1  # fits: plain graph
    ntkcore.ntk(model, xs, xt, mode="trace", max_memory="1GB", checkpoint=True)
    assert len(calls) == 2
    ntkcore.ntk(model, xt, xs.detach(), mode="trace", max_memory="60kB")  # no grad anywhere
    ntkcore.ntk(model, xt, xs, mode="trace", max_memory="60kB", checkpoint=False)
    assert len(calls) == 2
    assert rel(k_small, k_big) < 1e-13


def test_checkpoint_routes_by_provider_capability(monkeypatch):
    """``checkpoint=True`` goes to the provider's declared ``checkpointed_ntk`` capability,
    whatever the provider is called (here a provider other than "torch" for wrapped modules)."""
    from ntkcore import providers
    from ntkcore.backends.torch_jacobian import jacobian

    class Wrapped:  # a model kind only the provider below knows
        def __init__(self, module: nn.Module) -> None:
            self.module = module

    calls = []

    def checkpointed(model, x1, x2, **kwargs):
        calls.append(kwargs)
        return checkpointed_ntk(model.module, x1, x2, **kwargs)

    monkeypatch.setattr(providers, "_REGISTRY", list(providers._REGISTRY))
    providers.register_provider(
        "wrapped", lambda m: isinstance(m, Wrapped),
        lambda: lambda model, x, **kw: jacobian(model.module, x, **kw), first=True,
        capabilities={"checkpointed_ntk": lambda: checkpointed})
    model = mlp()
    xs, xt = inputs("mlp", 2, 0, True), inputs("mlp", 3, 1)
    k = ntkcore.ntk(Wrapped(model), xs, xt, mode="trace", checkpoint=True)
    assert len(calls) == 1
    assert rel(k, ntkcore.ntk(model, xs, xt, mode="trace", checkpoint=False)) < 1e-13


def test_errors():
    model = mlp()
    a, b = inputs("mlp", 2, 0, True), inputs("mlp", 3, 1, True)
    with pytest.raises(ValueError, match="exactly one of x1, x2"):
        ntkcore.ntk(model, a, b, checkpoint=True)
    with pytest.raises(ValueError, match="exactly one of x1, x2"):
        checkpointed_ntk(model, a, b)
    with pytest.raises(ValueError, match="checkpoint must be"):
        ntkcore.ntk(model, a, b.detach(), checkpoint="yes")
    with pytest.raises(ValueError, match="mode must be"):
        checkpointed_ntk(model, a, b.detach(), mode="sum")
    with pytest.raises(ValueError, match="pseudo=True"):
        checkpointed_ntk(model, a, b.detach(), mode="full", pseudo=True)
    with pytest.raises(ValueError, match="batch_size"):
        checkpointed_ntk(model, a, b.detach(), batch_size=0)
    with pytest.raises(TypeError, match="model must be"):
        checkpointed_ntk(lambda x: x, a, b.detach())
    with pytest.raises(ValueError, match="non-empty sample axis"):
        checkpointed_ntk(model, a, b.detach()[:0])
    net = ntkcore.models.MLP.random((3, 4, 2), xp=torch, seed=0)
    with pytest.raises(ValueError, match=r"torch\.nn\.Module"):
        ntkcore.ntk(net, torch.ones(2, 3, dtype=torch.float32, requires_grad=True),
                    torch.ones(3, 3, dtype=torch.float32), checkpoint=True)
    ys, yt = torch.zeros(2, 2, dtype=DT), torch.zeros(3, 2, dtype=DT)
    with pytest.raises(ValueError, match="y_target must be"):
        kip_loss(model, a, ys, b.detach(), yt[:2])
    with pytest.raises(ValueError, match="columns"):
        kip_loss(model, a, ys, b.detach(), torch.zeros(3, 1, dtype=DT))
    with pytest.raises(ValueError, match="x_target requires grad"):
        kip_loss(model, a, ys, b, yt)
    with pytest.raises(ValueError, match="reg"):
        kip_loss(model, a, ys, b.detach(), yt, reg=-1.0)
    with pytest.raises(ValueError, match="mode must be"):
        kip_loss(model, a, ys, b.detach(), yt, mode="diagonal")


# --------------------------------------------------------------------------------------------
# 3. the KIP loss
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,pseudo", [("trace", False), ("trace", True), ("full", False)])
def test_kip_loss_fused_unfused_reference(mode, pseudo):
    model = cnn()
    xs, xt = inputs("cnn", 3, 16, True), inputs("cnn", 8, 17)
    gen = torch.Generator().manual_seed(5)
    ys = torch.randn(3, 2, generator=gen, dtype=DT, requires_grad=True)
    yt = torch.randn(8, 2, generator=gen, dtype=DT)
    reg = 1e-2
    k_ss = ref_kernel(model, xs, xs, mode, pseudo)
    k_ts = ref_kernel(model, xt, xs, mode, pseudo)
    y1, y2 = ys, yt
    if mode == "full":
        k_ss = k_ss.permute(0, 2, 1, 3).reshape(6, 6)
        k_ts = k_ts.permute(0, 2, 1, 3).reshape(16, 6)
        y1, y2 = ys.reshape(-1, 1), yt.reshape(-1, 1)
    lam = reg * torch.diagonal(k_ss).mean()
    pred = k_ts @ torch.linalg.solve(k_ss + lam * torch.eye(k_ss.shape[0], dtype=DT), y1)
    loss_ref = ((pred - y2) ** 2).mean()
    g_ref = torch.autograd.grad(loss_ref, (xs, ys))
    for fused in (True, False):
        timings: dict[str, float] = {}
        loss = kip_loss(model, xs, ys, xt, yt, reg=reg, mode=mode, pseudo=pseudo,
                        batch_size=3, fused=fused, timings=timings)
        g = torch.autograd.grad(loss, (xs, ys))
        assert rel(loss, loss_ref) < 1e-12, fused
        for a, b in zip(g, g_ref, strict=True):
            assert rel(a, b) < 1e-9, fused
        assert timings["solve_s"] >= 0.0
        if fused:
            assert timings["num_chunks"] == 3.0 and timings["target_factors_s"] > 0


def test_kip_loss_gradcheck_and_no_grad():
    model = mlp()
    xs, xt = inputs("mlp", 3, 18, True), inputs("mlp", 5, 19)
    gen = torch.Generator().manual_seed(6)
    ys = torch.randn(3, 2, generator=gen, dtype=DT, requires_grad=True)
    yt = torch.randn(5, 2, generator=gen, dtype=DT)
    assert gradcheck(lambda a, b: kip_loss(model, a, b, xt, yt, reg=1e-2, batch_size=2),
                     (xs, ys), fast_mode=True)
    loss = kip_loss(model, xs.detach(), ys.detach(), xt, yt, reg=1e-2, batch_size=2)
    assert not loss.requires_grad
    assert rel(loss, kip_loss(model, xs, ys, xt, yt, reg=1e-2, fused=False)) < 1e-12


# --------------------------------------------------------------------------------------------
# 4. peak memory of the backward does not grow with the number of targets
# --------------------------------------------------------------------------------------------
def test_backward_memory_does_not_grow_with_targets():
    """Forward + backward of the KIP loss, each in a fresh process: ``benchmarks.kip.memory``
    (``benchmarks.common.working_memory``: a warm-up call, then the growth of the resident set
    while the measured call runs).  From 100 to 1600 targets the checkpointed path does not
    grow and the fused one stays at the same level, while the plain autograd graph, which keeps
    every target's factors, does grow: the measurement is sensitive enough to see it."""
    code = ("import sys; from benchmarks.kip import case, memory; "
            "print(memory(case(sys.argv[1], 'mlp', 20, int(sys.argv[2]), 'float64', 'cpu', "
            "'1GB', 100)))")

    def peak(impl: str, n: int) -> float:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
            "PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", code, impl, str(n)], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return float(proc.stdout.split()[-1]) / 1e6

    jobs = [("checkpointed", 100), ("checkpointed", 1600), ("fused", 1600), ("plain", 1600)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        mb = dict(zip(jobs, pool.map(lambda j: peak(*j), jobs), strict=True))
    assert mb[("checkpointed", 1600)] - mb[("checkpointed", 100)] < 12, mb
    assert mb[("fused", 1600)] - mb[("checkpointed", 100)] < 12, mb
    assert mb[("plain", 1600)] - mb[("checkpointed", 1600)] > 40, mb
