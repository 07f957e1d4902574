"""Normalisation layers with an elementwise affine, assembled from the provider's hooks.

BatchNorm1d/2d/3d (eval), GroupNorm, InstanceNorm1d/2d/3d (affine; input statistics and running
statistics), LayerNorm and RMSNorm over several axes (also sequence-first), in small models
(conv + norm + linear, MLP + BatchNorm1d, a transformer-ish token model).  Each is compared with
a dense float64 ``torch.func`` Jacobian (``vmap(jacrev)`` of ``functional_call``: independent
of the hooks and of the recomputed normalisation): the Jacobian in block order, the kernels in
trace / full / pseudo mode, symmetric and cross.  The spy on ``_dense_blocks`` checks that no
``torch.func`` pass ran for these layers (before issue 18 they all went through it, except
LayerNorm over the last axis).  SENG (which keeps its exact ``torch.func`` path for them),
sketches and the SMW solve are checked on the same models.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, jacrev, vmap  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import ntkcore  # noqa: E402
from ntkcore import DenseBlock, KroneckerBlock  # noqa: E402
from ntkcore.backends.torch_jacobian import jacobian, to_block_order  # noqa: E402
from ntkcore.sketch import sketch_jacobian  # noqa: E402
from tests.tolerances import kernel_tol, solve_tol  # noqa: E402

DT = torch.float64
NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
         nn.LayerNorm, nn.RMSNorm)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _randomise(model: nn.Module) -> nn.Module:
    """Non-trivial affine parameters and running statistics (defaults are ones / zeros)."""
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "running_mean", None) is not None:
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
            if isinstance(m, NORMS):
                if getattr(m, "weight", None) is not None:
                    m.weight.normal_(1.0, 0.3)
                if getattr(m, "bias", None) is not None:
                    m.bias.normal_(0.0, 0.3)
    return model.to(DT).eval()


class ConvNorm(nn.Module):
    """ConvNd -> norm -> tanh -> flatten -> Linear (3 outputs), input (N, 2, L, ...)."""

    def __init__(self, dim: int, norm: nn.Module, length: int):
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dim - 1]
        self.conv = conv(2, 4, 3, padding=1)
        self.norm = norm
        self.fc = nn.Linear(4 * length**dim, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.norm(self.conv(x))).flatten(1))


class Tokens(nn.Module):
    """x (N, T, 3, 4): Linear -> norm over (3, 4) (called twice: tied) -> LayerNorm(4) ->
    Linear, mean over tokens and rows: (N, 2).  ``seq_first`` runs the layers on (T, N, 3, 4)."""

    def __init__(self, norm: nn.Module, seq_first: bool = False):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.norm = norm
        self.ln_last = nn.LayerNorm(4)
        self.out = nn.Linear(4, 2)
        self.seq_first = seq_first

    def forward(self, x):
        if self.seq_first:
            x = x.transpose(0, 1)
        h = self.norm(torch.tanh(self.inp(x)))
        h = self.norm(h * 1.5 + 0.1)
        h = self.out(self.ln_last(h))
        if self.seq_first:
            h = h.transpose(0, 1)
        return h.mean(dim=(1, 2))


def _conv(dim, norm, length=4):
    def make():
        shape = (2, *([length] * dim))
        return (_randomise(ConvNorm(dim, norm(), length)), torch.randn(5, *shape, dtype=DT),
                torch.randn(3, *shape, dtype=DT), ["norm"])
    return make


def _tokens(norm, seq_first=False):
    def make():
        return (_randomise(Tokens(norm(), seq_first)), torch.randn(4, 3, 3, 4, dtype=DT),
                torch.randn(3, 3, 3, 4, dtype=DT), ["norm", "ln_last"])
    return make


def _mlp_bn():
    model = _randomise(nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(),
                                     nn.Linear(6, 3)))
    return model, torch.randn(5, 5, dtype=DT), torch.randn(4, 5, dtype=DT), ["1"]


MODELS = {
    "batchnorm1d-conv": _conv(1, lambda: nn.BatchNorm1d(4)),
    "batchnorm1d-mlp": _mlp_bn,
    "batchnorm2d": _conv(2, lambda: nn.BatchNorm2d(4)),
    "batchnorm3d": _conv(3, lambda: nn.BatchNorm3d(4), length=3),
    "groupnorm": _conv(2, lambda: nn.GroupNorm(2, 4)),
    "groupnorm1d": _conv(1, lambda: nn.GroupNorm(2, 4)),
    "instancenorm1d": _conv(1, lambda: nn.InstanceNorm1d(4, affine=True)),
    "instancenorm2d": _conv(2, lambda: nn.InstanceNorm2d(4, affine=True)),
    "instancenorm2d-running": _conv(2, lambda: nn.InstanceNorm2d(4, affine=True,
                                                                  track_running_stats=True)),
    "instancenorm3d": _conv(3, lambda: nn.InstanceNorm3d(4, affine=True), length=3),
    "layernorm-chw": _conv(2, lambda: nn.LayerNorm([4, 4, 4])),
    "rmsnorm-hw": _conv(2, lambda: nn.RMSNorm([4, 4])),
    "tokens-layernorm2axes": _tokens(lambda: nn.LayerNorm((3, 4))),
    "tokens-layernorm2axes-nobias": _tokens(lambda: nn.LayerNorm((3, 4), bias=False)),
    "tokens-layernorm2axes-seqfirst": _tokens(lambda: nn.LayerNorm((3, 4)), seq_first=True),
    "tokens-rmsnorm2axes": _tokens(lambda: nn.RMSNorm((3, 4))),
}


def reference(model, x, names=None):
    """``{name: (N, O, *shape)}`` by torch.func (float64)."""
    named = dict(model.named_parameters())
    pd = {n: named[n].detach() for n in (names or named)}

    def f(pd, xn):
        return functional_call(model, pd, (xn[None],)).reshape(-1)

    return vmap(jacrev(f), in_dims=(None, 0))(pd, x)


def dense(ref):
    return torch.cat([v.reshape(v.shape[0], v.shape[1], -1) for v in ref.values()], dim=2)


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-300)


def tol_for(p, o):
    """A kernel entry sums p * o products (trace) in two independent computations (the
    provider and the reference)."""
    return kernel_tol(DT, p * o, computations=2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_norm_block_equals_dense_reference(name, dense_calls):
    model, x1, x2, norms = MODELS[name]()
    j = jacobian(model, x1)
    assert dense_calls == []  # no torch.func pass: every block comes from the hooks
    kinds = {b.name: type(b) for b in j.blocks}
    assert all(kinds[p] is DenseBlock for p in norms)
    assert all(t is KroneckerBlock for p, t in kinds.items() if p not in norms)
    ref1 = reference(model, x1)
    r1, r2 = dense(ref1), dense(reference(model, x2))
    o = r1.shape[1]
    tol = tol_for(j.num_params, o)
    # the Jacobian itself, in block order ([weight, bias] for a norm block)
    assert rel(j.to_dense(), to_block_order(model, j, ref1)) < tol
    full11 = torch.einsum("nok,mpk->nmop", r1, r1)
    full12 = torch.einsum("nok,mpk->nmop", r1, r2)
    for mode, expect11, expect12 in (
            ("full", full11, full12),
            ("trace", full11.diagonal(dim1=2, dim2=3).sum(-1),
             full12.diagonal(dim1=2, dim2=3).sum(-1))):
        assert rel(ntkcore.ntk(model, x1, mode=mode), expect11) < tol
        assert rel(ntkcore.ntk(model, x1, x2, mode=mode), expect12) < tol
    p1, p2 = r1.sum(1) / math.sqrt(o), r2.sum(1) / math.sqrt(o)
    assert rel(ntkcore.pseudo_ntk(model, x1, x2), p1 @ p2.T) < tol
    assert dense_calls == []


@pytest.mark.parametrize("params", [None, ["norm.bias"], ["norm.weight"]])
@pytest.mark.parametrize("name, fused", [("batchnorm2d", True), ("groupnorm", True),
                                         ("instancenorm3d", True), ("batchnorm1d-conv", False)])
def test_fused_channel_sums(name, fused, params, monkeypatch):
    """A channels-first norm layer with at least ``FUSED_SUMS_MIN_POSITIONS`` positions (4 x 4,
    3 x 3 x 3) takes its sums from ``native_batch_norm_backward`` a pass, fewer (a length-4
    signal) from multiply-and-sum; both equal the float64 reference, weight and bias alone
    too."""
    from ntkcore.backends import torch_layers

    calls = []
    original = torch_layers._channel_sums

    def spy(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(torch_layers, "_channel_sums", spy)
    model, x, _, _ = MODELS[name]()
    j = jacobian(model, x, params=params, backward="loop")
    ref = reference(model, x, params)
    assert rel(j.to_dense(), to_block_order(model, j, ref, params)) < tol_for(j.num_params, 3)
    assert bool(calls) is fused
    assert all(shape[1] == 1 and shape[-1] >= torch_layers.FUSED_SUMS_MIN_POSITIONS
               for shape in calls)


@pytest.mark.parametrize("params", [["norm.weight"], ["norm.bias"], ["conv.bias", "norm.bias"]])
def test_parameter_subsets(params, dense_calls):
    model, x, _, _ = MODELS["groupnorm"]()
    j = jacobian(model, x, params=params)
    ref = reference(model, x, params)
    assert rel(j.to_dense(), to_block_order(model, j, ref, params)) < tol_for(j.num_params, 3)
    assert dense_calls == []


@pytest.mark.parametrize("name", ["groupnorm", "batchnorm1d-mlp", "tokens-layernorm2axes"])
def test_backward_strategies_agree(name):
    model, x, _, _ = MODELS[name]()
    rd = dense(reference(model, x))
    for how in ("batched", "loop"):
        j = jacobian(model, x, backward=how)
        assert rel(j.to_dense(), to_block_order(model, j, reference(model, x))) < \
            tol_for(rd.shape[2], rd.shape[1])


def test_subclass_with_its_own_forward(dense_calls):
    """Not a hooked layer (its forward may compute anything), but its F.group_norm call is
    found by torch_functional's mode (issue 18); an unrecognised use stays torch.func."""
    class Scaled(nn.GroupNorm):
        def forward(self, x):
            return super().forward(x) * 2.0

    class Odd(nn.GroupNorm):
        def forward(self, x):
            return F.group_norm(x, self.num_groups, self.weight * 2.0, self.bias, self.eps)

    x = torch.randn(3, 2, 4, 4, dtype=DT)
    for norm, expect in ((Scaled(2, 4), []), (Odd(2, 4), ["norm"])):
        dense_calls.clear()
        model = _randomise(ConvNorm(2, norm, 4))
        j = jacobian(model, x)
        assert dense_calls == expect
        assert rel(j.to_dense(), to_block_order(model, j, reference(model, x))) < \
            tol_for(j.num_params, 3)


@pytest.mark.parametrize("name", ["batchnorm2d", "groupnorm", "tokens-layernorm2axes"])
def test_norm_block_differentiable_in_x(name):
    model, x, _, norms = MODELS[name]()
    x = x[:2].clone().requires_grad_(True)
    idx = [b.name for b in jacobian(model, x.detach()).blocks].index(norms[0])

    def kernel_of(xx):
        jd = jacobian(model, xx).blocks[idx].to_dense()
        return (jd * jd).sum()

    assert torch.autograd.gradcheck(kernel_of, (x,))


class PassSums(nn.Module):
    """conv -> BatchNorm2d (a hooked module) -> a GroupNorm subclass with its own forward (a
    functional call) -> layer-scale ``gamma`` (a product in the graph) -> tanh -> Linear (O)."""

    def __init__(self, o: int):
        super().__init__()

        class Half(nn.GroupNorm):
            def forward(self, x):
                return super().forward(x) * 0.5

        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn = Half(2, 4)
        self.gamma = nn.Parameter(torch.randn(4, 1, 1))
        self.fc = nn.Linear(4 * 9, o)

    def forward(self, x):
        return self.fc(torch.tanh(self.gn(self.bn(self.conv(x))) * self.gamma).flatten(1))


@pytest.mark.parametrize("o", [1, 2, 5])
@pytest.mark.parametrize("how", ["batched", "loop"])
def test_norm_gradients_reduced_pass_by_pass(o, how, monkeypatch, dense_calls):
    """The output gradients of the norm layers and of the dense-rule functional calls reach
    the block builders already summed (``Summed`` (N, O, W)), for one pass (O = 1), the
    concatenated passes (O = 2), the per-pass buffer (O = 5) and the batched pass; the
    Jacobian equals the dense float64 reference in every case."""
    from ntkcore.backends import torch_jacobian as tj
    from ntkcore.backends.torch_layers import Summed

    model = _randomise(PassSums(o))
    x = torch.randn(4, 2, 3, 3, dtype=DT)
    seen = []
    original = tj._output_grads

    def spy(*args, **kwargs):
        gs = original(*args, **kwargs)
        seen.extend(gs)
        return gs

    monkeypatch.setattr(tj, "_output_grads", spy)
    j = jacobian(model, x, backward=how)
    summed = [g for g in seen if isinstance(g, Summed)]
    # bn, the functional group norm (weight, bias) and gamma: one reduced entry each
    assert len(summed) == 3
    assert all(g.sums.shape[:2] == (4, o) for g in summed)
    assert sorted(g.sums.shape[2] for g in summed) == [4, 8, 8]
    assert rel(j.to_dense(), to_block_order(model, j, reference(model, x))) < \
        tol_for(j.num_params, o)
    assert dense_calls == []


@pytest.mark.parametrize("o", [2, 5])
def test_reduced_norm_gradients_differentiable_in_x(o):
    """The pass-by-pass sums stay on the autograd graph (x requiring grad): the kernel of the
    reduced blocks passes ``gradcheck`` for the concatenated (O = 2) and buffered (O = 5)
    passes."""
    model = _randomise(PassSums(o))
    x = torch.randn(2, 2, 3, 3, dtype=DT, requires_grad=True)
    names = [b.name for b in jacobian(model, x.detach()).blocks]
    keep = [names.index(k) for k in ("bn", "gn", "gamma")]

    def kernel_of(xx):
        blocks = jacobian(model, xx).blocks
        return sum((blocks[i].to_dense() ** 2).sum() for i in keep)

    assert torch.autograd.gradcheck(kernel_of, (x,))


@pytest.mark.parametrize("method", ["gaussian", "uniform"])
def test_sketches_of_norm_blocks(method):
    """The sketched Jacobian is exactly J Omega^T with Omega the returned sketch (Omega from
    ``apply`` on the identity), J the torch.func reference in block order."""
    model, x, _, norms = MODELS["batchnorm2d"]()
    j = jacobian(model, x)
    jref = to_block_order(model, j, reference(model, x))
    js, sk = sketch_jacobian(j, j.num_params // 3, method=method, seed=1, return_sketch=True)
    omega = sk.apply(torch.eye(j.num_params, dtype=DT))  # (Q, P)
    assert rel(js.to_dense(), jref @ omega.T) < tol_for(j.num_params, 3)
    assert isinstance(js.blocks[j.names.index(norms[0])], DenseBlock)


def test_smw_solve_with_norm_blocks():
    model, x, _, _ = MODELS["groupnorm"]()
    j = jacobian(model, x)
    jref = to_block_order(model, j, reference(model, x)).reshape(-1, j.num_params)  # (N O, P)
    g = torch.randn(j.num_params, dtype=DT)
    lam = 0.3
    a = lam * torch.eye(j.num_params, dtype=DT) + jref.T @ jref
    d = ntkcore.smw_solve(j, g, lam)
    expect = torch.linalg.solve(a, g)
    cond = torch.linalg.cond(a).item()
    assert rel(d, expect) < solve_tol(DT, cond, computations=2 * j.num_params)


class SengNet(nn.Module):
    """Conv -> GroupNorm -> tanh -> InstanceNorm2d (affine) -> BatchNorm2d (eval) -> Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(64, 5)

    def forward(self, x):
        return self.fc(self.bn(self.inorm(torch.tanh(self.gn(self.conv(x))))).flatten(1))


SENG_BLOCKS = [("conv", True), ("gn", False), ("inorm", False), ("bn", False), ("fc", True)]


def _flat(t, mod, kron, lead=()):
    """SENG's block layout: [W | b] row-major for Kronecker blocks, else [weight, bias]."""
    w, b = t[f"{mod}.weight"], t[f"{mod}.bias"]
    if kron:
        d_out = b.shape[-1]
        return torch.cat([w.reshape(*lead, d_out, -1), b[..., None]], -1).reshape(*lead, -1)
    return torch.cat([w.reshape(*lead, -1), b.reshape(*lead, -1)], -1)


def _seng_data(n):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(n, 1, 4, 4, generator=gen, dtype=DT),
            torch.randint(0, 5, (n,), generator=gen))


def test_seng_step_with_norm_layers():
    """One SENG step equals the damped natural-gradient step built block by block from
    torch.func per-sample gradients."""
    from ntkcore.backends.torch import SENG

    lam, lr, n = 0.5, 0.3, 8
    model = _randomise(SengNet())
    x, y = _seng_data(n)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss1(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss1), in_dims=(None, 0, 0))(params, x, y)
    opt = SENG(model, lr=lr, damping=lam)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    now = {k: v.detach() for k, v in model.named_parameters()}
    eps = torch.finfo(DT).eps
    for mod, kron in SENG_BLOCKS:
        u = _flat(per, mod, kron, lead=(n,))
        a = lam * torch.eye(u.shape[1], dtype=DT) + u.T @ u / n
        d_ref = torch.linalg.solve(a, u.mean(0))
        theta = _flat(params, mod, kron)
        d_got = (theta - _flat(now, mod, kron)) / lr
        # the solve's forward error, plus the rounding of theta - lr d and of undoing it
        err = (solve_tol(DT, torch.linalg.cond(a).item(), computations=2 * u.shape[1])
               * d_ref.abs().max().item() + 4 * eps * theta.abs().max().item() / lr)
        assert (d_got - d_ref).abs().max().item() <= err, mod


def test_seng_sketched_with_norm_layers():
    """With sketches smaller than the norm blocks (8 parameters) the step is seeded and
    finite, and differs from the exact one."""
    from ntkcore.backends.torch import SENG

    x, y = _seng_data(8)
    outs = []
    for sketch, seed in (("gaussian", 3), ("gaussian", 3), (None, 0)):
        torch.manual_seed(0)
        model = _randomise(SengNet())
        opt = SENG(model, lr=0.3, damping=0.5, sketch=sketch, sketch_size=6, seed=seed)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        outs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])
