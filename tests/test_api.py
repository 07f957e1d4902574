"""ntk() / pseudo_ntk() on torch models against float64 torch.func reference kernels."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, jacrev, vmap

import ntkcore
from ntkcore._cache import LRUCache
from tests.conftest import spy_output_ranges
from tests.tolerances import kernel_tol

DT = torch.float64


def ref_jac(model, x):
    """Dense (N, O, P) by torch.func, all parameters requiring grad."""
    pd = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def f(pd, xn):
        return functional_call(model, pd, (xn[None],)).reshape(-1)

    jac = vmap(jacrev(f), in_dims=(None, 0))(pd, x)
    return torch.cat([v.reshape(v.shape[0], v.shape[1], -1) for v in jac.values()], dim=2)


def ref_kernel(model, x1, x2, mode):
    j1 = ref_jac(model, x1)
    j2 = j1 if x2 is None else ref_jac(model, x2)
    full = torch.einsum("nok,mpk->nmop", j1, j2)
    if mode == "full":
        return full
    if mode == "trace":
        return torch.einsum("nmoo->nm", full)
    return torch.einsum("nmoo->nmo", full)


def rel(a, b):
    return (a - b).abs().max().item() / b.abs().max().item()


class Net(nn.Module):
    """Linear + LayerNorm (dense block) + conv-free; 3 outputs."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 6)
        self.ln = nn.LayerNorm(6)
        self.l2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.ln(torch.tanh(self.l1(x)))))


# small inputs streamed in blocks by tiny budgets: the smallest-useful-tile rule is lifted
# (test_budget_below_a_useful_tile restores it)
pytestmark = pytest.mark.usefixtures("tiny_tiles")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
@pytest.mark.parametrize("max_memory", [None, 12_000, 40_000])
def test_ntk_modes_symmetric_and_cross(mode, max_memory):
    """Small budgets force the streamed (row, column) sample-block path."""
    m = Net().to(DT).eval()
    x1 = torch.randn(11, 4, dtype=DT)
    x2 = torch.randn(7, 4, dtype=DT)
    k = ntkcore.ntk(m, x1, x2, mode=mode, max_memory=max_memory)
    assert isinstance(k, torch.Tensor) and k.dtype == DT
    assert rel(k, ref_kernel(m, x1, x2, mode)) < 1e-12
    ks = ntkcore.ntk(m, x1, mode=mode, max_memory=max_memory)
    assert rel(ks, ref_kernel(m, x1, None, mode)) < 1e-12
    swap = {"full": (1, 0, 3, 2), "trace": (1, 0), "diagonal": (1, 0, 2)}[mode]
    assert torch.equal(ks, ks.permute(swap))  # exactly symmetric, as the docstring says


@pytest.mark.parametrize("max_memory", [None, 8000])
def test_layerwise_sums_to_total(max_memory):
    m = Net().to(DT).eval()
    x1 = torch.randn(9, 4, dtype=DT)
    x2 = torch.randn(5, 4, dtype=DT)
    lw = ntkcore.ntk(m, x1, x2, layerwise=True, max_memory=max_memory)
    assert lw.shape == (3, 9, 5, 3, 3)  # blocks l1, ln, l2
    tot = ref_kernel(m, x1, x2, "full")
    assert rel(lw.sum(0), tot) < 1e-12
    # each block is its own parameter subset's kernel
    params = [["l1.weight", "l1.bias"], ["ln.weight", "ln.bias"], ["l2.weight", "l2.bias"]]
    for b, names in enumerate(params):
        kb = ntkcore.ntk(m, x1, x2, params=names)
        assert rel(lw[b], kb) < 1e-12


@pytest.mark.parametrize("max_memory", [None, 3000])
def test_pseudo_ntk_is_mean_over_output_pairs(max_memory):
    m = Net().to(DT).eval()
    x1 = torch.randn(8, 4, dtype=DT)
    x2 = torch.randn(6, 4, dtype=DT)
    p = ntkcore.pseudo_ntk(m, x1, x2, max_memory=max_memory)
    full = ref_kernel(m, x1, x2, "full")
    assert p.shape == (8, 6)
    assert rel(p, full.sum((2, 3)) / 3) < 1e-12
    ps = ntkcore.pseudo_ntk(m, x1)
    assert rel(ps, ref_kernel(m, x1, None, "full").sum((2, 3)) / 3) < 1e-12
    lw = ntkcore.pseudo_ntk(m, x1, x2, layerwise=True)
    assert lw.shape == (3, 8, 6) and rel(lw.sum(0), p) < 1e-12


def test_cnn_ntk_and_float32():
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Conv2d(4, 5, 3, stride=2),
                        nn.Tanh(), nn.Flatten(), nn.Linear(5 * 2 * 2, 2)).to(DT).eval()
    x = torch.randn(6, 3, 8, 8, dtype=DT)
    k64 = ntkcore.ntk(cnn, x)
    ref = ref_kernel(cnn, x, None, "full")
    assert rel(k64, ref) < 1e-12
    k32 = ntkcore.ntk(cnn.float(), x.float())
    assert k32.dtype == torch.float32
    # first order (tests/tolerances.py): each Jacobian entry sums the fan-ins (27, 36, 20) and
    # the positions (36, 4, 1) of the layers in float32, each kernel entry P products
    n = sum(p.numel() for p in cnn.parameters()) + (27 + 36 + 20) + (36 + 4 + 1)
    assert rel(k32.double(), ref) <= kernel_tol(torch.float32, n)


def test_params_subset_and_embedding_inputs():
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(5, 3)
            self.l = nn.Linear(3, 2)

        def forward(self, i):
            return self.l(torch.tanh(self.e(i))).mean(1)

    m = Emb().to(DT)
    idx = torch.randint(0, 5, (6, 4))
    k = ntkcore.ntk(m, idx, mode="trace", max_memory=4000)  # streamed, 1-sample blocks
    assert rel(k, ref_kernel(m, idx, None, "trace")) < 1e-12
    ke = ntkcore.ntk(m, idx, params=["e.weight"], mode="trace")
    m.l.weight.requires_grad_(False)
    m.l.bias.requires_grad_(False)
    assert rel(ke, ref_kernel(m, idx, None, "trace")) < 1e-12


@settings(max_examples=8, deadline=None)
@given(n1=st.integers(1, 9), n2=st.integers(1, 9), budget=st.sampled_from([None, 1500, 9000]),
       batch=st.sampled_from([None, 1, 4]))
def test_ntk_sizes_budgets_batches(n1, n2, budget, batch):
    torch.manual_seed(n1 * 10 + n2)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    x1 = torch.randn(n1, 3, dtype=DT)
    x2 = torch.randn(n2, 3, dtype=DT)
    k = ntkcore.ntk(m, x1, x2, mode="diagonal", max_memory=budget, batch_size=batch)
    assert k.shape == (n1, n2, 2)
    assert rel(k, ref_kernel(m, x1, x2, "diagonal")) < 1e-12


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("mode", ["trace", "full"])
def test_budget_below_a_useful_tile(monkeypatch, mode, cross):
    """``python -m ntkcore demo --max-memory 1kB`` planned 790,653 one-sample tiles.  A budget
    that cannot hold a min(N, 8)-sample tile now raises before any factor beyond the probe
    is computed, quoting the user's value and the smallest budget; that budget works."""
    import sys

    api = sys.modules["ntkcore._api"]
    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 8)
    computed = []  # samples of every provider call
    real_call = api.provider_call

    def counting_call(provider, model, name, x_full, x1, options, x):
        computed.append(int(x.shape[0]))
        return real_call(provider, model, name, x_full, x1, options, x)

    monkeypatch.setattr(api, "provider_call", counting_call)
    m = Net().to(DT).eval()
    x1 = torch.randn(60, 4, dtype=DT)
    x2 = torch.randn(23, 4, dtype=DT) if cross else None
    needs = []
    for probes in ([api.PROBE_SAMPLES], []):  # probe-cache miss, then hit: the same number
        computed.clear()
        with pytest.raises(ValueError, match=r"max_memory='1kB' \(1000 bytes\)") as info:
            ntkcore.ntk(m, x1, x2, mode=mode, max_memory="1kB")
        assert computed == probes  # no factor beyond the probe, no tile
        needs.append(int(re.search(r"max_memory >= (\d+) bytes", str(info.value)).group(1)))
    need = needs[0]
    assert needs[1] == need
    assert need > 1000 and info.value.needed == need
    with pytest.raises(ValueError, match=f"max_memory >= {need} bytes"):
        ntkcore.ntk(m, x1, x2, mode=mode, max_memory=need - 1)
    k = ntkcore.ntk(m, x1, x2, mode=mode, max_memory=need)
    assert rel(k, ref_kernel(m, x1, x2, mode)) < 1e-12
    for more in (2 * need, 8 * need):  # larger budgets: fewer tiles, same kernel
        assert rel(ntkcore.ntk(m, x1, x2, mode=mode, max_memory=more), k) < 1e-12


def test_progress_callback():
    m = Net().to(DT)
    x = torch.randn(10, 4, dtype=DT)
    calls = []
    ntkcore.ntk(m, x, mode="trace", max_memory=3000, progress=lambda d, t: calls.append((d, t)))
    assert calls and calls[-1][0] == calls[-1][1]
    calls.clear()
    ntkcore.ntk(m, x, mode="trace", progress=lambda d, t: calls.append((d, t)))
    assert calls and calls[-1][0] == calls[-1][1]


def test_default_budget_shares_the_plan_when_free_memory_moves(monkeypatch):
    """ntk resolves the default budget once and hands gram its share still marked as the
    default, so gram plans it with its leading bits only: two calls whose free memory differs
    by 4 MiB (a default budget of 6 GiB + 64 MiB, mid-way between two rounding steps of
    2^27 bytes) make one plan, and the kernels are identical."""
    import sys

    from ntkcore.backends.torch import TorchBackend

    gram_module = sys.modules["ntkcore.gram"]
    m = Net().to(DT)
    x = torch.randn(5, 4, dtype=DT)
    free = [24 * 2**30 + 2**28]
    monkeypatch.setattr(TorchBackend, "free_memory", lambda self, device: free[0])
    monkeypatch.setattr(gram_module, "_PLAN_CACHE", LRUCache(4))
    calls = []
    real = gram_module._make_plan
    monkeypatch.setattr(gram_module, "_make_plan", lambda *a: calls.append(a) or real(*a))
    k1 = ntkcore.ntk(m, x)
    free[0] += 2**22
    k2 = ntkcore.ntk(m, x)
    assert len(calls) == 1
    assert torch.equal(k1, k2)


def test_errors():
    m = Net().to(DT)
    x = torch.randn(4, 4, dtype=DT)
    with pytest.raises(ValueError, match="mode"):
        ntkcore.ntk(m, x, mode="sum")
    with pytest.raises(TypeError, match="layerwise"):
        ntkcore.ntk(m, x, layerwise=1)
    with pytest.raises(TypeError, match="no Jacobian provider"):
        ntkcore.ntk(object(), x)
    with pytest.raises(TypeError, match="x2"):
        ntkcore.ntk(m, x, np.zeros((3, 4)))
    with pytest.raises(ValueError, match="x1 has no samples"):
        ntkcore.ntk(m, x[:0])
    with pytest.raises(ValueError, match="batch_size"):
        ntkcore.ntk(m, x, batch_size=0)
    with pytest.raises(ValueError, match="max_memory"):
        ntkcore.ntk(m, x, max_memory=-1)


def test_pseudo_scale():
    # a single-output model: pseudo_ntk == trace ntk
    m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).to(DT)
    x = torch.randn(5, 3, dtype=DT)
    assert rel(ntkcore.pseudo_ntk(m, x), ntkcore.ntk(m, x, mode="trace")) < 1e-14
    assert math.isclose(float(ntkcore.ntk(m, x, mode="full")[0, 0, 0, 0]),
                        float(ntkcore.pseudo_ntk(m, x)[0, 0]), rel_tol=1e-12)


def test_ntk_differentiable_in_inputs():
    """A KIP-style loss on ntk(model, x_support) back-propagates into the support set."""
    m = Net().to(DT)
    xs = torch.randn(5, 4, dtype=DT, requires_grad=True)
    xt = torch.randn(3, 4, dtype=DT)
    loss = ntkcore.ntk(m, xt, xs, mode="trace").pow(2).sum()
    (grad,) = torch.autograd.grad(loss, xs)
    x0 = xs.detach().requires_grad_(True)
    # Reference Jacobians by plain autograd per sample and output (create_graph): torch.func's
    # vmap under an outer autograd graph gives wrong input gradients through LayerNorm
    # (torch 2.13), so ref_kernel cannot serve as the gradient reference here.
    ps = list(m.parameters())

    def jac(x):
        rows = []
        for i in range(x.shape[0]):
            out = m(x[i:i + 1]).reshape(-1)
            rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                out[k], ps, create_graph=True, retain_graph=True)]) for k in range(3)]))
        return torch.stack(rows)

    ref = torch.einsum("nok,mok->nm", jac(xt), jac(x0)).pow(2).sum()
    (grad_ref,) = torch.autograd.grad(ref, x0)
    assert rel(grad, grad_ref) < 1e-10


def test_probe_is_cached_per_model_and_input_signature(monkeypatch):
    """The measuring call on the first samples runs once per model and input signature; the
    kernel is unchanged by the cache."""
    from ntkcore import providers

    calls = []

    class Counted:
        def __init__(self, mlp):
            self.mlp = mlp

        def parameters(self):
            return self.mlp.parameters()

    def jac(model, x, **kw):
        calls.append(int(x.shape[0]))
        return model.mlp.jacobian(x, **kw)

    monkeypatch.setattr(providers, "_REGISTRY", list(providers._REGISTRY))
    providers.register_provider("counted", lambda m: isinstance(m, Counted), lambda: jac,
                                first=True)
    mlp = ntkcore.models.MLP.random((3, 5, 2), seed=0, xp=np, dtype=np.float64)
    model = Counted(mlp)
    x = np.random.default_rng(0).standard_normal((20, 3))
    jd = mlp.jacobian(x).to_dense()  # (N, O, P), checked against autograd in test_models
    ref_k = np.einsum("nok,mok->nm", jd, jd)  # independent of ntkcore.gram
    k1 = ntkcore.ntk(model, x, mode="trace")
    assert calls == [1, 20]  # probe (one sample: PROBE_SAMPLES), then all samples at once
    k2 = ntkcore.ntk(model, x, mode="trace")
    assert calls == [1, 20, 20]  # probe skipped
    np.testing.assert_allclose(k1, ref_k, rtol=1e-12)
    np.testing.assert_array_equal(k2, k1)  # the cache changes nothing but the call count
    ntkcore.ntk(model, x[:, :3].astype(np.float32), mode="trace")  # new dtype: probes again
    assert calls[3:] == [1, 20]
    # another model object of the same architecture has its own entry
    ntkcore.ntk(Counted(mlp), x, mode="trace")
    assert calls[5:] == [1, 20]


@pytest.mark.parametrize("path", ["held", "streamed", "groups", "chunks"])
def test_probe_factors_are_released_before_the_contraction(monkeypatch, path):
    """The probe's Jacobian (the first provider call, which measures the factor bytes per
    sample) is not kept alive, uncharged to the budget, while ``gram`` contracts: on the held
    path it is gone once the factors are stacked, on the streamed path after the first row
    block (issue 18's memory budgets); groups of blocks and output chunks, which do not
    reuse it, free it before their first contraction."""
    import weakref

    import ntkcore._api as api
    from ntkcore.backends.torch_jacobian import jacobian

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).to(DT)
    x = torch.randn(24, 4, dtype=DT)
    per_sample = jacobian(m, x[:1]).nbytes
    budget = None if path == "held" else 40 * per_sample  # streamed: 24 b > M / 2
    probe: list = []
    alive: list[bool] = []
    real_gram = api.gram

    real_probe = api._probe

    def spy_probe(*args, **kwargs):
        facts, first = real_probe(*args, **kwargs)
        if first is not None and not probe:
            probe.append(weakref.ref(first.blocks[0].arrays()[0]))
        return facts, first

    def spy_gram(*args, **kwargs):
        alive.append(bool(probe) and probe[0]() is not None)
        return real_gram(*args, **kwargs)

    monkeypatch.setattr(api, "_probe", spy_probe)
    monkeypatch.setattr(api, "gram", spy_gram)
    if path != "chunks":
        monkeypatch.setattr(api, "_output_chunk", lambda *a: None)  # not outputs
    else:
        monkeypatch.setattr(api, "_output_chunk", lambda *a: 1)
    if path == "groups":
        monkeypatch.setattr(api, "_groups_cost", lambda *a: 0.0)
    else:
        monkeypatch.setattr(api, "_param_groups", lambda *a: None)
    api._PER_SAMPLE.clear()  # the probe runs in this call
    k = ntkcore.ntk(m, x, mode="trace", max_memory=budget)
    assert probe and alive
    assert (len(alive) == 1) == (path == "held")
    if path in ("groups", "chunks"):
        assert not any(alive)
    assert not alive[-1]  # the last contraction (the only one when held) runs without it
    ref = ref_kernel(m, x, None, "trace")
    assert (k - ref).abs().max() <= kernel_tol(DT, ref_jac(m, x[:1]).numel()) * ref.abs().max()


def test_factors_held_beyond_half_the_budget(monkeypatch, small_ufunc_buffers):
    """Factors of all samples that take more than half the budget are held where the
    contraction's plan and one provider call fit beside them (``_holds``): each sample's
    Jacobian is computed once, NumPy's allocations (tracemalloc) stay within the budget and
    the kernel is the dense float64 reference's; at the next smaller budget that does not
    hold them, the samples are streamed in blocks (computed more than once)."""
    import sys
    import tracemalloc

    from ntkcore.modes import check_mode

    api = sys.modules["ntkcore._api"]
    mlp = ntkcore.models.MLP.random((6, 48, 48, 1), seed=0, xp=np, dtype=np.float64)
    x = np.random.default_rng(1).standard_normal((96, 6))
    provider, trace = api.find_provider(mlp), check_mode("trace")
    facts, _ = api._probe(provider, mlp, lambda xx: mlp.jacobian(xx), x, False, None)
    factors = 96 * facts.per_sample
    budgets = [int(f * factors) for f in np.linspace(1.02, 2.0, 50)]
    held = [b for b in budgets if api._holds(facts, api.Budget(b), 96, 96, False, trace,
                                             False, None, np) is not None]
    assert held and held[0] > budgets[0]
    budget = held[0]
    assert factors > budget / 2  # the half rule would stream them
    jd = mlp.jacobian(x).to_dense()
    ref = np.einsum("nok,mok->nm", jd, jd)
    sizes: list[int] = []
    real = api.provider_call

    def counting(provider_, model, name, x_full, x1_, options, xx):
        sizes.append(int(xx.shape[0]))
        return real(provider_, model, name, x_full, x1_, options, xx)

    rests: list[int] = []
    real_gram = api.gram

    def spy_gram(*args, **kwargs):
        rests.append(int(kwargs["max_memory"]))
        return real_gram(*args, **kwargs)

    monkeypatch.setattr(api, "provider_call", counting)
    monkeypatch.setattr(api, "gram", spy_gram)
    api._PER_SAMPLE.clear()  # the probe runs in the traced call
    tracemalloc.start()
    try:
        k = ntkcore.ntk(mlp, x, mode="trace", max_memory=budget)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(sizes[1:]) + sizes[0] == 96  # the probe's sample is reused
    # the contraction gets the share its plan was checked in: at most 10% more flops than
    # within half the budget, in tiles as large (below 64 samples)
    hold = api._holds(facts, api.Budget(budget), 96, 96, False, trace, False, None, np)
    assert len(rests) == 1 and rests[0] >= hold
    plan = ntkcore.plan_gram(mlp.jacobian(x), mode="trace", max_memory=rests[0])
    half = ntkcore.plan_gram(mlp.jacobian(x), mode="trace", max_memory=budget // 2)
    assert plan.flops <= 1.1 * half.flops
    assert plan.tile_rows >= min(64, half.tile_rows)
    assert peak <= budget + k.nbytes
    assert np.abs(k - ref).max() <= kernel_tol(np.float64, jd.shape[-1]) * np.abs(ref).max()
    sizes.clear()
    below = budgets[budgets.index(budget) - 1]
    k2 = ntkcore.ntk(mlp, x, mode="trace", max_memory=below)
    assert sum(sizes) > 96  # streamed: column blocks computed once per row block
    assert np.abs(k2 - ref).max() <= kernel_tol(np.float64, jd.shape[-1]) * np.abs(ref).max()


class _ConvNet(nn.Module):
    """Convolutions and a Linear head (Kronecker blocks) and a LayerNorm (a dense block):
    10 outputs, whose output-gradient factors dominate the factor bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Conv2d(8, 8, 3, stride=2),
                                  nn.Tanh(), nn.Flatten(), nn.LayerNorm(8 * 6 * 6),
                                  nn.Linear(8 * 6 * 6, 10))

    def forward(self, x):
        return self.body(x)


def test_torch_jacobian_of_an_output_range():
    """``outputs=(start, stop)`` gives the Jacobian of those flattened outputs only: the rows
    of the whole Jacobian, whose products equal the dense autograd Jacobian's, with the input
    factors whole and the rest cut."""
    from ntkcore.backends.torch_jacobian import jacobian

    torch.manual_seed(0)
    m = _ConvNet().to(DT)
    x = torch.randn(3, 3, 16, 16, dtype=DT)
    ref = ref_jac(m, x)  # (N, O, P)
    whole = jacobian(m, x)
    for start, stop in [(0, 10), (2, 5), (9, 10)]:
        j = jacobian(m, x, outputs=(start, stop))
        assert j.num_outputs == stop - start
        jd = j.to_dense()  # (N, O', P) in the block layout (bias columns interleaved)
        # entries are sums over a convolution's positions (at most 14 x 14 x 3 x 3 x 8 terms),
        # computed in other batch shapes than the whole Jacobian's: rounding, not equality
        terms = 14 * 14 * 3 * 3 * 8
        assert rel(jd, whole.to_dense()[:, start:stop]) <= kernel_tol(DT, terms, 2)
        gram_ref = torch.einsum("nok,mpk->nomp", ref[:, start:stop], ref[:, start:stop])
        assert rel(torch.einsum("nok,mpk->nomp", jd, jd), gram_ref) <= \
            kernel_tol(DT, jd.shape[-1] + terms, 2)
        assert j.shared_nbytes == whole.shared_nbytes > 0
        assert j.nbytes - j.shared_nbytes < whole.nbytes - whole.shared_nbytes or stop == 10
    for bad, match in [((3, 3), "0 <= start < stop"), ((0, 11), "beyond the model's 10"),
                       ([0, 2], "pair of ints"), ((0.0, 2), "pair of ints")]:
        with pytest.raises(ValueError, match=match):
            jacobian(m, x, outputs=bad)
    with pytest.raises(ValueError, match="pseudo"):
        jacobian(m, x, outputs=(0, 2), pseudo=True)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("mode", ["trace", "diagonal"])
def test_output_chunks_when_the_factors_of_all_outputs_do_not_fit(monkeypatch, mode, cross):
    """A budget too small for the factors of all 10 outputs (refused before) computes the
    trace / diagonal kernel from Jacobians of a few outputs at a time, as the float64
    reference gives it; the smallest such budget is the one quoted by the error below it;
    full mode, which pairs all outputs, is still refused."""
    import sys

    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 4)
    torch.manual_seed(1)
    m = _ConvNet().to(DT)
    x1 = torch.randn(12, 3, 16, 16, dtype=DT)
    x2 = torch.randn(5, 3, 16, 16, dtype=DT) if cross else None
    ref = ref_kernel(m, x1, x2, mode)
    tol = kernel_tol(DT, ref_jac(m, x1[:1]).shape[-1]) * ref.abs().max()
    with pytest.raises(ntkcore.BudgetTooSmallError) as full:
        ntkcore.ntk(m, x1, x2, mode="full", max_memory=1000)
    with pytest.raises(ntkcore.BudgetTooSmallError) as info:
        ntkcore.ntk(m, x1, x2, mode=mode, max_memory=1000)
    least = info.value.needed
    assert least < full.value.needed
    with pytest.raises(ntkcore.BudgetTooSmallError, match=f"max_memory >= {least} bytes"):
        ntkcore.ntk(m, x1, x2, mode=mode, max_memory=least - 1)
    with pytest.raises(ntkcore.BudgetTooSmallError):
        ntkcore.ntk(m, x1, x2, mode="full", max_memory=least)
    seen = spy_output_ranges(monkeypatch)
    for budget in (least, 2 * least):
        seen.clear()
        k = ntkcore.ntk(m, x1, x2, mode=mode, max_memory=budget)
        assert k.shape == ref.shape
        assert (k - ref).abs().max() <= tol
        chunks = sorted({c for c in seen if c is not None})
        assert len(chunks) > 1 and chunks[0][0] == 0 and chunks[-1][1] == 10
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))  # a partition of 0:10
    # a budget that holds the factors of all outputs: no chunks
    seen.clear()
    ntkcore.ntk(m, x1, x2, mode=mode, max_memory=10**9)
    assert set(seen) == {None}


def test_output_chunks_when_cheaper_than_sample_blocks(monkeypatch):
    """A budget that admits all outputs in sample blocks (streamed) but holds one output's
    factors of every sample: the chunks (fewer sample passes, _samples_computed) are taken,
    and the kernel is the same."""
    import sys

    from ntkcore.modes import check_mode

    api = sys.modules["ntkcore._api"]
    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 4)
    torch.manual_seed(2)
    m = _ConvNet().to(DT)
    x = torch.randn(24, 3, 16, 16, dtype=DT)
    ref = ref_kernel(m, x, None, "trace")
    tol = kernel_tol(DT, ref_jac(m, x[:1]).shape[-1]) * ref.abs().max()
    facts, _ = api._probe(  # the facts as ntk's probe takes them
        api.find_provider(m), m,
        lambda xx: api.find_provider(m).jacobian(m, xx, dense_if_smaller=True,
                                                  measure_work=True), x, False,
        None, True)
    o, trace = facts.outputs, check_mode("trace")
    one = api._chunk_facts(facts, 1).per_sample
    budget = api.Budget(int(2.2 * 24 * one))  # one output's factors held, all outputs' not
    assert api._holds(facts, budget, 24, 24, False, trace, False, None, torch) is None
    assert api._holds(api._chunk_facts(facts, 1), budget, 24, 24, False, trace, False, None,
                      torch) is not None
    k = api._output_chunk(budget, facts, 24, 24, False, trace, False, None, torch)
    assert k is not None and k < o
    monkeypatch.setattr(api, "_grouped", lambda *a: None)  # chunks against sample blocks only
    seen = spy_output_ranges(monkeypatch)
    got = ntkcore.ntk(m, x, mode="trace", max_memory=int(budget))
    assert None not in seen and len(set(seen)) == -(-o // k)
    assert (got - ref).abs().max() <= tol


def test_full_mode_is_not_joined_from_output_chunks():
    from ntkcore.modes import check_mode

    assert not check_mode("full").output_chunks
    with pytest.raises(ValueError, match="pairs every output"):
        check_mode("full").join_output_chunks(np, [np.zeros((2, 2, 3, 3))])
    parts = [np.ones((2, 3, 1)), 2 * np.ones((2, 3, 2))]
    assert check_mode("diagonal").join_output_chunks(np, parts).shape == (2, 3, 3)
    assert np.all(check_mode("trace").join_output_chunks(np, [np.ones(2), np.ones(2)]) == 2)


@pytest.mark.parametrize("mode", ["trace", "diagonal"])
def test_layerwise_kernels_from_output_chunks(monkeypatch, mode):
    """Per-layer kernels (leading block axis) joined from output chunks equal those of one
    call with all outputs (the chunks sum, or concatenate along the last axis)."""
    import sys

    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 4)
    torch.manual_seed(3)
    m = _ConvNet().to(DT)
    x = torch.randn(12, 3, 16, 16, dtype=DT)
    ref = ntkcore.ntk(m, x, mode=mode, layerwise=True, max_memory=10**9)
    with pytest.raises(ntkcore.BudgetTooSmallError) as info:
        ntkcore.ntk(m, x, mode=mode, layerwise=True, max_memory=1000)
    seen = spy_output_ranges(monkeypatch)
    got = ntkcore.ntk(m, x, mode=mode, layerwise=True, max_memory=info.value.needed)
    assert len({c for c in seen if c is not None}) > 1
    assert got.shape == ref.shape
    tol = kernel_tol(DT, ref_jac(m, x[:1]).shape[-1])
    assert (got - ref).abs().max() <= tol * ref.abs().max()
    # and independently: the layers' kernels add up to the dense float64 reference
    dense = ref_kernel(m, x, None, mode)
    assert (got.sum(0) - dense).abs().max() <= tol * dense.abs().max()


class _WideActivations(nn.Module):
    """Few parameters, a large parameter-free activation saved for backward: the provider's
    working memory per sample (40,000 numbers of tanh output) far above its factors."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 2)
        self.out = nn.Linear(2, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x).repeat(1, 20000)).reshape(x.shape[0], 20000, 2)
        return self.out(h.mean(1))


def test_torch_work_nbytes_counts_saved_tensors_and_one_pass():
    """``Jacobian.work_nbytes`` of an MLP: the tanh output Linear 2 saves (N H) and the
    output gradients of the two Linear layers' outputs, one pass of O = 1 (N (H + 1)),
    written out by hand; parameters and x are not counted."""
    from ntkcore.backends.torch_jacobian import jacobian

    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)).to(DT)
    x = torch.randn(3, 5, dtype=DT)
    assert jacobian(m, x, measure_work=True).work_nbytes == 8 * (3 * 7 + 3 * (7 + 1))
    assert jacobian(m, x).work_nbytes == 0  # not measured unless asked (a hook a tensor)


def test_provider_calls_are_charged_the_providers_working_memory(monkeypatch):
    """A budget holding every sample's factors: each provider call takes at most
    ``budget / 2 / (3 b + w)`` samples, ``w`` the probe's working bytes per sample, where
    ``3 b`` alone would have taken all 64 in one call; the kernel is unchanged."""
    import sys

    api = sys.modules["ntkcore._api"]
    torch.manual_seed(0)
    m = _WideActivations().to(DT)
    x = torch.randn(64, 8, dtype=DT)
    ref = ntkcore.ntk(m, x, mode="trace")
    facts, _ = api._probe(api.find_provider(m), m,
                          lambda xx: api.find_provider(m).jacobian(m, xx, dense_if_smaller=True,
                                                                    measure_work=True),
                          x, False, None, True)
    b, w = facts[0], facts[5]
    assert w > 100 * b
    budget = 4 * 64 * 3 * b + 8 * w  # factors held; 3 b k alone admits all 64 samples a call
    assert 3 * b * 64 <= budget / 2
    sizes: list = []
    real = api.provider_call

    def counting(provider, model, name, x_full, x1_, options, xx):
        sizes.append(int(xx.shape[0]))
        return real(provider, model, name, x_full, x1_, options, xx)

    monkeypatch.setattr(api, "provider_call", counting)
    got = ntkcore.ntk(m, x, mode="trace", max_memory=int(budget))
    assert max(sizes) <= max(1, int(budget / 2 // (3 * b + w))) < 64
    assert (got - ref).abs().max() <= kernel_tol(DT, 64) * ref.abs().max()


# -- groups of parameter blocks: a kernel whose factors exceed the budget (_param_groups) ------


class _Deep(nn.Module):
    """Six tanh layers of equal width, a LayerNorm (a dense block) and a head of ``o``
    outputs: blocks of similar factor bytes, so that a budget holds a few of them."""

    def __init__(self, o: int = 3, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(5, width), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        self.body = nn.Sequential(*layers, nn.LayerNorm(width), nn.Linear(width, o))

    def forward(self, x):
        return self.body(x)


def _facts(api, m, x):
    """The probe's facts as ``ntk`` takes them (and caches them for ``m``)."""
    provider = api.find_provider(m)
    facts, _ = api._probe(provider, m, lambda xx: provider.jacobian(
        m, xx, dense_if_smaller=True, measure_work=True), x, False, None, True)
    return facts


def _group_budget(api, facts, n1, n2, mode, layerwise=False):
    """The largest budget (of 60 on a log scale below twice all factors) at which the blocks
    fall into groups whose factors of all samples are held, and which ``ntk`` accepts."""
    from ntkcore.modes import check_mode

    m, cross = check_mode(mode), n2 is not None
    total = facts[0] * (n1 + (n2 or 0))
    for f in np.geomspace(1.9, 0.05, 60):
        budget = api.Budget(int(f * total))
        groups = api._param_groups(budget, facts, n1, n2 or n1, cross, m, layerwise, None, torch)
        need = api._budget_need(facts, n1, n2 or n1, cross, m, layerwise, None, torch)[0]
        if groups and need <= budget:
            return budget, groups
    raise AssertionError("no budget holds the blocks in groups")


def _spy_groups(monkeypatch):
    """The groups of every ``_by_param_groups`` call, and the ``params`` option of every
    provider call, from now on."""
    import sys

    api = sys.modules["ntkcore._api"]
    groups: list = []
    selections: list = []
    real_groups, real_call = api._by_param_groups, api.provider_call

    def by_groups(g, *args, **kwargs):
        groups.append(list(g))
        return real_groups(g, *args, **kwargs)

    def call(provider, model, name, x_full, x1_, options, x):
        p = options.get("params")
        selections.append(None if p is None else tuple(p))
        return real_call(provider, model, name, x_full, x1_, options, x)

    monkeypatch.setattr(api, "_by_param_groups", by_groups)
    monkeypatch.setattr(api, "provider_call", call)
    return groups, selections


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_kernel_as_a_sum_over_groups_of_blocks(monkeypatch, mode, cross):
    """A budget that holds the factors of all samples for a few blocks at a time, not for all:
    the kernel summed over groups of consecutive blocks, each group's Jacobian from the
    provider's ``params=`` selection of its blocks, equals the float64 torch.func kernel in
    every mode (the groups taken here whatever their cost); a self-kernel stays exactly
    symmetric (each group's is, and the groups are added in one order)."""
    import sys

    api = sys.modules["ntkcore._api"]
    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 4)
    monkeypatch.setattr(api, "_groups_cost", lambda *a: 0.0)  # take groups where they exist
    torch.manual_seed(4)
    m = _Deep().to(DT)
    x1 = torch.randn(24, 5, dtype=DT)
    x2 = torch.randn(9, 5, dtype=DT) if cross else None
    facts = _facts(api, m, x1)
    budget, expected = _group_budget(api, facts, 24, 9 if cross else None, mode)
    groups, selections = _spy_groups(monkeypatch)
    k = ntkcore.ntk(m, x1, x2, mode=mode, max_memory=int(budget))
    assert groups == [expected]
    blocks = len(facts[6])
    assert len(expected) > 1 and expected[0][0] == 0 and expected[-1][1] == blocks
    assert all(a[1] == b[0] for a, b in itertools.pairwise(expected))  # a partition
    assert None not in selections and len(set(selections)) == len(expected)
    ref = ref_kernel(m, x1, x2, mode)
    assert k.shape == ref.shape
    assert (k - ref).abs().max() <= kernel_tol(DT, ref_jac(m, x1[:1]).shape[-1]) * \
        ref.abs().max()
    if not cross:
        mirror = {"full": (1, 0, 3, 2), "trace": (1, 0), "diagonal": (1, 0, 2)}[mode]
        assert torch.equal(k, k.permute(*mirror))


def test_layerwise_kernels_from_groups_of_blocks(monkeypatch):
    """Per-block kernels from groups of blocks: the groups' kernels concatenated in block
    order equal one call's with all factors held, and sum to the float64 reference."""
    import sys

    api = sys.modules["ntkcore._api"]
    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 4)
    monkeypatch.setattr(api, "_groups_cost", lambda *a: 0.0)
    torch.manual_seed(5)
    m = _Deep().to(DT)
    x = torch.randn(20, 5, dtype=DT)
    whole = ntkcore.ntk(m, x, mode="trace", layerwise=True, max_memory=10**9)
    budget, _ = _group_budget(api, _facts(api, m, x), 20, None, "trace", layerwise=True)
    groups, _ = _spy_groups(monkeypatch)
    got = ntkcore.ntk(m, x, mode="trace", layerwise=True, max_memory=int(budget))
    assert len(groups) == 1 and len(groups[0]) > 1
    assert got.shape == whole.shape
    tol = kernel_tol(DT, ref_jac(m, x[:1]).shape[-1])
    assert (got - whole).abs().max() <= tol * whole.abs().max()
    dense = ref_kernel(m, x, None, "trace")
    assert (got.sum(0) - dense).abs().max() <= tol * dense.abs().max()


def _greedy_groups(api, budget, facts, n1, n2, cross, mode, layerwise):
    """``_param_groups`` written out: each group grown one block at a time while held."""
    def held(a, b):
        return api._holds(api._group_facts(facts, a, b), budget, n1, n2, cross, mode,
                          layerwise, None, torch) is not None

    groups, start, blocks = [], 0, len(facts.block_bytes)
    while start < blocks:
        if not held(start, start + 1):
            return None
        stop = start + 1
        while stop < blocks and held(start, stop + 1):
            stop += 1
        groups.append((start, stop))
        start = stop
    return groups if len(groups) > 1 else None


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("mode", ["trace", "diagonal"])
def test_groups_of_blocks_in_output_chunks(monkeypatch, mode, cross, layerwise):
    """A budget in which no block's factors of all outputs and all samples are held, but one
    output's are, a few blocks at a time: the groups, each computed one output at a time
    (provider calls with both ``params=`` and ``outputs=``), give the float64 torch.func
    kernel (per block when ``layerwise``), exactly symmetric for a self-kernel; the groups
    are those of a one-block-at-a-time greedy scan."""
    import sys

    from ntkcore.modes import check_mode

    api = sys.modules["ntkcore._api"]
    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 4)
    monkeypatch.setattr(api, "_chunks_cost", lambda *a: math.inf)  # groups whatever the cost
    torch.manual_seed(8)
    m = _Deep(o=3).to(DT)
    n2 = 9 if cross else None
    x1 = torch.randn(24, 5, dtype=DT)
    x2 = torch.randn(9, 5, dtype=DT) if cross else None
    facts, md = _facts(api, m, x1), check_mode(mode)
    one = api._chunk_facts(facts, 1)
    total = one.per_sample * (24 + (n2 or 0))
    for f in np.geomspace(1.5, 0.05, 80):
        budget = api.Budget(int(f * total))
        grouped = api._grouped(budget, facts, 24, n2 or 24, cross, md, layerwise, None, torch,
                               None, True)
        if grouped is not None and grouped[1] == 1 and \
                api._param_groups(budget, facts, 24, n2 or 24, cross, md, layerwise, None,
                                  torch) is None:
            break
    else:
        raise AssertionError("no budget holds one output's blocks in groups only")
    expected = grouped[2]
    assert expected == _greedy_groups(api, budget, one, 24, n2 or 24, cross, md, layerwise)
    groups, selections = _spy_groups(monkeypatch)
    seen = spy_output_ranges(monkeypatch)
    got = ntkcore.ntk(m, x1, x2, mode=mode, layerwise=layerwise, max_memory=int(budget))
    assert groups == [expected] and None not in selections
    assert set(seen) == {(0, 1), (1, 2), (2, 3)}
    ref = ref_kernel(m, x1, x2, mode)
    tol = kernel_tol(DT, ref_jac(m, x1[:1]).shape[-1]) * ref.abs().max()
    whole = got.sum(0) if layerwise else got
    assert whole.shape == ref.shape and (whole - ref).abs().max() <= tol
    if layerwise:
        assert got.shape[0] == len(facts.block_bytes)
    if not cross:
        mirror = {"trace": (1, 0), "diagonal": (1, 0, 2)}[mode]
        lw = (0,) if layerwise else ()
        assert torch.equal(got, got.permute(*lw, *(d + len(lw) for d in mirror)))


def test_groups_of_blocks_when_cheaper_than_sample_blocks(monkeypatch):
    """One output (no output chunks) and a budget that holds the factors of all 48 samples
    for half the blocks: two groups (two forward passes, the second group's output-gradient
    passes stopping half way) cost fewer flops than sample blocks of a sixth of the samples
    (each column block recomputed for every row block above it), and are taken by the cost
    model alone; with all factors held, no groups."""
    import sys

    from ntkcore.modes import check_mode

    api = sys.modules["ntkcore._api"]
    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 4)
    torch.manual_seed(6)
    m = _Deep(o=1).to(DT)
    x = torch.randn(48, 5, dtype=DT)
    facts, full = _facts(api, m, x), check_mode("full")
    for f in np.geomspace(1.2, 0.3, 40):  # the largest budget that holds half the blocks
        budget = api.Budget(int(f * 48 * facts.per_sample))
        groups = api._param_groups(budget, facts, 48, 48, False, full, False, None, torch)
        if groups is not None and len(groups) == 2:
            break
    assert groups is not None and len(groups) == 2
    assert api._holds(facts, budget, 48, 48, False, full, False, None, torch) is None
    sampled = api._samples_computed(False, facts.per_sample, budget, 48, 48, False)
    assert sampled > 2 * 48  # sample blocks compute every sample more than twice
    seen, _ = _spy_groups(monkeypatch)
    k = ntkcore.ntk(m, x, mode="full", max_memory=int(budget))
    assert seen == [groups]
    ref = ref_kernel(m, x, None, "full")
    assert (k - ref).abs().max() <= kernel_tol(DT, ref_jac(m, x[:1]).shape[-1]) * \
        ref.abs().max()
    seen.clear()
    ntkcore.ntk(m, x, mode="full", max_memory=10**9)
    assert seen == []
    # taken only below GROUPS_MARGIN of the other plan's estimate
    real_grouped = api._grouped
    monkeypatch.setattr(api, "_chunks_cost", lambda *a: 100.0)
    for share, taken in ((api.GROUPS_MARGIN * 1.05, False), (api.GROUPS_MARGIN * 0.95, True)):
        monkeypatch.setattr(api, "_grouped", lambda *a, s=share: (
            100.0 * s, *real_grouped(*a)[1:]))
        seen.clear()
        ntkcore.ntk(m, x, mode="full", max_memory=int(budget))
        assert seen == ([groups] if taken else [])


def test_no_groups_without_the_capability_or_when_a_block_is_not_held():
    """``_param_groups`` is None where the provider cannot select blocks (no block
    selections in the facts), where one block's factors alone are not held, and where one
    group would hold every block."""
    import sys

    from ntkcore.modes import check_mode

    api = sys.modules["ntkcore._api"]
    torch.manual_seed(7)
    m = _Deep().to(DT)
    x = torch.randn(16, 5, dtype=DT)
    facts = _facts(api, m, x)
    trace = check_mode("trace")
    assert facts.block_params is not None
    assert len(facts.block_params) == len(facts.block_bytes) == len(facts.shapes)
    budget, _ = _group_budget(api, facts, 16, None, "trace")
    assert api._param_groups(budget, facts._replace(block_params=None), 16, 16, False, trace,
                             False, None, torch) is None
    # a block alone is not held: its stacking alone (a copy of it) takes twice its factors
    biggest = max(facts.block_bytes) * 16
    assert api._param_groups(api.Budget(int(1.9 * biggest)), facts, 16, 16, False, trace, False,
                             None, torch) is None
    assert api._param_groups(api.Budget(10**9), facts, 16, 16, False, trace, False, None,
                             torch) is None
    mlp = ntkcore.models.MLP.random((5, 8, 8, 2), xp=np, seed=0, activation="tanh")
    xs = np.random.default_rng(0).standard_normal((4, 5))
    provider = api.find_provider(mlp)
    mfacts, _ = api._probe(provider, mlp, lambda xx: provider.jacobian(mlp, xx), xs, False,
                           None)
    assert mfacts[7] is None  # the MLP provider has no block selection


def test_block_params_select_exactly_those_blocks():
    """The torch provider's ``block_params``: the Jacobian of consecutive blocks' selections
    has exactly those blocks (names, and the same factors as the whole Jacobian's, to
    rounding), for Linear, LayerNorm, Embedding, GRU and convolution blocks."""
    from ntkcore.backends.torch_jacobian import block_params, jacobian

    class _Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = nn.Embedding(7, 4)
            self.gru = nn.GRU(4, 5, batch_first=True)
            self.norm = nn.LayerNorm(5)
            self.conv = nn.Conv1d(5, 3, 2)
            self.head = nn.Linear(3 * 3, 2)

        def forward(self, t):
            h, _ = self.gru(self.e(t))
            h = self.conv(self.norm(h).transpose(1, 2))
            return self.head(torch.tanh(h).flatten(1))

    torch.manual_seed(8)
    m = _Mixed().to(DT)
    t = torch.randint(0, 7, (6, 4))
    whole = jacobian(m, t, dense_if_smaller=True)
    names = block_params(m, whole)
    assert len(names) == len(whole.blocks) >= 5
    dense = whole.to_dense()
    for start, stop in [(0, 2), (1, 4), (2, len(names))]:
        part = jacobian(m, t, params=[n for ns in names[start:stop] for n in ns],
                        dense_if_smaller=True)
        assert part.names == whole.names[start:stop]
        first = sum(b.num_params for b in whole.blocks[:start])
        cols = dense[..., first:first + part.num_params]
        # the same entries from other calls: each a sum of fewer than 64 products (4 steps
        # of a 5-unit GRU, 2 convolution taps over 5 channels), rounded independently
        assert rel(part.to_dense(), cols) <= kernel_tol(DT, 64)
