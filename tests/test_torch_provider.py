"""The PyTorch Jacobian provider against dense torch.func references (float64).

The reference is ``vmap(jacrev(f))`` over samples with ``functional_call``: independent of the
hooks, Kronecker factors and unfolding of the provider.  Kernels J J'^T are invariant to the
order of parameters, so the kernel checks need no layout knowledge at all; the Jacobian itself
is compared after :func:`to_block_order`, whose layout is also checked by hand on a Linear.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from ntkcore import DenseBlock, Jacobian, KroneckerBlock
from ntkcore.backends.torch_jacobian import from_block_order, jacobian, to_block_order
from tests.references import autograd_jacobian_graph
from tests.tolerances import kernel_tol

DT = torch.float64


def reference(model, x, names=None, pseudo=False):
    """``{name: (N, O, *shape)}`` by torch.func, for the selected parameter names."""
    named = dict(model.named_parameters())
    if names is None:
        names = [n for n, p in named.items() if p.requires_grad]
    pd = {n: named[n].detach() for n in names}

    def f(pd, xn):
        out = functional_call(model, pd, (xn[None],)).reshape(-1)
        return (out.sum() / math.sqrt(out.numel())).reshape(1) if pseudo else out

    return vmap(jacrev(f), in_dims=(None, 0))(pd, x)


def dense_reference(ref):
    """(N, O, P) in any parameter order (kernels do not depend on it)."""
    return torch.cat([v.reshape(v.shape[0], v.shape[1], -1) for v in ref.values()], dim=2)


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-300)


def check_model(model, x, params=None, pseudo=False, tol=1e-12, kinds=None):
    model = model.to(DT).eval()
    j = jacobian(model, x, params=params, pseudo=pseudo)
    names = None
    if params is not None:
        chosen = set(params)
        names = [n for n, _ in model.named_parameters() if n in chosen]
    ref = reference(model, x, names, pseudo)
    # 1. the kernel, layout-free
    jd = j.to_dense()
    rd = dense_reference(ref)
    assert jd.shape == rd.shape
    k = torch.einsum("nok,mpk->nmop", jd, jd)
    kr = torch.einsum("nok,mpk->nmop", rd, rd)
    assert rel(k, kr) < tol
    # 2. the Jacobian itself, in block order
    assert rel(jd, to_block_order(model, j, ref, params)) < tol
    back = from_block_order(model, j, to_block_order(model, j, ref, params), params)
    assert set(back) == set(ref)
    for key in ref:
        assert torch.equal(back[key], ref[key])
    if kinds is not None:
        assert "".join("K" if isinstance(b, KroneckerBlock) else "D" for b in j.blocks) == kinds
    return j


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def test_mlp_structured_and_exact():
    j = check_model(mlp(), torch.randn(4, 5, dtype=DT), kinds="KKK")
    assert j.names == ("0", "2", "4")
    assert [b.d_in for b in j.blocks] == [6, 8, 7]  # ones column for the bias
    assert j.num_outputs == 3


@pytest.mark.parametrize("made_inside", [False, True])
def test_inference_mode_gives_the_same_jacobian(made_inside):
    """Under a caller's ``torch.inference_mode()`` (and with inputs made in it) the provider
    and ``ntk`` compute what they compute outside it (they leave inference mode for their own
    passes): the float64 torch.func reference, and ``ntk`` equal to the kernel outside."""
    import ntkcore

    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6, 3),
                          nn.LayerNorm(3)).to(DT).eval()
    x = torch.randn(5, 2, 8, dtype=DT)
    outside = ntkcore.ntk(model, x, mode="full")
    with torch.inference_mode():
        xi = x.clone() if made_inside else x
        j = jacobian(model, xi)
        k = ntkcore.ntk(model, xi, mode="full")
    rd = dense_reference(reference(model, x))
    jd = j.to_dense()
    tol = kernel_tol("float64", rd.shape[2], computations=4)
    assert rel(torch.einsum("nok,mpk->nmop", jd, jd),
               torch.einsum("nok,mpk->nmop", rd, rd)) < tol
    assert rel(k, outside) < tol


def test_linear_layout_by_hand():
    lin = nn.Linear(3, 2).to(DT)
    x = torch.randn(4, 3, dtype=DT)
    j = jacobian(lin, x)
    jd = j.to_dense()  # (N, O, 2*(3+1)), row o of W_aug = [W[o], b[o]]
    expect = torch.zeros(4, 2, 2, 4, dtype=DT)
    for o in range(2):
        expect[:, o, o, :3] = x
        expect[:, o, o, 3] = 1.0
    assert torch.equal(jd, expect.reshape(4, 2, 8))


def test_pseudo_is_one_output():
    m = mlp().to(DT)
    x = torch.randn(4, 5, dtype=DT)
    j = check_model(m, x, pseudo=True)
    assert j.num_outputs == 1
    full = jacobian(m, x).to_dense()
    # J_pseudo = sum_o J_o / sqrt(O)
    assert rel(j.to_dense()[:, 0], full.sum(1) / math.sqrt(3)) < 1e-12


@pytest.mark.parametrize("params", [
    ["0.weight"],  # weight only: no ones column
    ["2.bias"],  # bias only: a = 1
    ["0.bias", "4.weight", "4.bias"],
])
def test_param_subsets(params):
    j = check_model(mlp(), torch.randn(3, 5, dtype=DT), params=params)
    assert j.num_params == sum(p.numel() for n, p in mlp().named_parameters() if n in params)


def test_params_as_tensors_and_errors():
    m = mlp().to(DT)
    x = torch.randn(3, 5, dtype=DT)
    j1 = jacobian(m, x, params=[m[2].weight])
    j2 = jacobian(m, x, params=["2.weight"])
    assert torch.equal(j1.to_dense(), j2.to_dense())
    with pytest.raises(ValueError, match="not a parameter name"):
        jacobian(m, x, params=["nope"])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        jacobian(m, x, params=[torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match="params is empty"):
        jacobian(m, x, params=[])
    m[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="do not require grad"):
        jacobian(m, x, params=["0.weight"])
    # params=None skips frozen parameters
    assert jacobian(m, x).num_params == sum(p.numel() for p in m.parameters()) - 35
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        jacobian(lambda z: z, x)
    with pytest.raises(TypeError, match=r"x is a NumPy array but the model's parameters are "
                                        r"torch tensors; convert it first: x = "
                                        r"torch\.as_tensor\(x\)$"):
        jacobian(m, np.zeros((3, 5)))


def test_cnn_stride_padding_dilation_groups():
    cnn = nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.Tanh(),
        nn.Conv2d(4, 6, 3, dilation=2, padding="same", padding_mode="reflect"), nn.Tanh(),
        nn.Conv2d(6, 6, 3, groups=3, padding=1, padding_mode="circular"), nn.Tanh(),
        nn.Conv2d(6, 6, (1, 3), groups=6, bias=False), nn.Tanh(),
        nn.Conv2d(6, 4, (2, 1), stride=(1, 2), padding=(1, 0), padding_mode="replicate"),
        nn.Flatten(), nn.Linear(4 * 5 * 1, 3))
    check_model(cnn, torch.randn(3, 2, 8, 8, dtype=DT))


def test_grouped_conv_kronecker_branch():
    # few positions and several outputs: the groups-as-positions Kronecker block is smaller
    m = nn.Sequential(nn.Conv2d(4, 4, 1, groups=2), nn.Tanh(), nn.Conv2d(4, 4, 1, groups=2),
                      nn.Flatten())
    check_model(m, torch.randn(3, 4, 1, 1, dtype=DT), kinds="KK")
    check_model(m, torch.randn(3, 4, 1, 1, dtype=DT), params=["0.bias", "2.weight"], kinds="KK")


def test_conv1d_and_conv3d():
    c1 = nn.Sequential(nn.Conv1d(4, 6, 3, stride=2, groups=2, padding=2,
                                 padding_mode="replicate"), nn.Tanh(),
                       nn.Conv1d(6, 2, 2, dilation=3), nn.Flatten(), nn.Linear(6, 2))
    check_model(c1, torch.randn(3, 4, 9, dtype=DT))
    c3 = nn.Sequential(nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding="valid"), nn.Tanh(),
                       nn.Conv3d(3, 2, (1, 2, 2), padding=(0, 1, 0), dilation=(1, 1, 2)),
                       nn.Flatten(), nn.Linear(2 * 2 * 3 * 1, 2))
    check_model(c3, torch.randn(2, 2, 3, 4, 4, dtype=DT), kinds="KKK")


class TiedLN(nn.Module):
    """A Linear applied twice (tied), a LayerNorm and a bare parameter (dense blocks)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.ln(torch.tanh(self.lin(x)))
        return self.out(torch.tanh(self.lin(h)) * self.scale)


def test_layernorm_tied_weights_bare_parameter():
    j = check_model(TiedLN(), torch.randn(3, 4, dtype=DT), kinds="DKDK")
    assert j.names == ("scale", "lin", "ln", "out")
    assert j.blocks[1].num_positions == 2  # the two calls, concatenated along S


def test_transformer_style_linear_on_sequences():
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 2))
    j = check_model(m, torch.randn(3, 6, 4, dtype=DT), kinds="KDK")
    assert j.blocks[0].num_positions == 6
    assert j.num_outputs == 12  # (T, 2) flattened


class Attention(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        att = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 2.0, dim=-1)
        h = self.ln(x + self.o(att @ self.v(x)))
        return h.mean(1)


def test_attention_block():
    check_model(Attention(), torch.randn(3, 5, 4, dtype=DT), kinds="KKKKD")


class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(6, 3, padding_idx=0)
        self.l = nn.Linear(3, 2)

    def forward(self, i):
        return self.l(torch.tanh(self.e(i))).mean(1)


def test_embedding():
    idx = torch.tensor([[0, 1, 2, 2], [3, 0, 5, 1], [4, 4, 4, 0]])
    j = check_model(Emb(), idx, kinds="KK")
    assert j.blocks[0].d_in == 6 and j.blocks[0].d_out == 3


class FunctionalReuse(nn.Module):
    """``a.weight`` is also used outside ``a.forward``: the hooks would miss that use."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + nn.functional.linear(h, self.a.weight)[:, :2]


class SharedParam(nn.Module):
    """One Parameter registered in two modules (tied input/output tables)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 3)
        self.out = nn.Linear(3, 3)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def test_weight_used_outside_its_module_falls_back_to_dense():
    check_model(FunctionalReuse(), torch.randn(3, 3, dtype=DT), kinds="DK")
    # the shared weight is dense (under its first name); out.bias alone is a bias-only block
    j = check_model(SharedParam(), torch.randn(3, 3, dtype=DT), kinds="DK")
    assert j.names == ("inp", "out")
    assert j.blocks[1].d_in == 1


class MHA(nn.Module):
    """nn.MultiheadAttention calls F.multi_head_attention_forward with out_proj's weight, so
    out_proj's forward (and hook) never runs: it must come out dense, not be skipped."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.l = nn.Linear(4, 2)

    def forward(self, x):
        return self.l(self.att(x, x, x, need_weights=False)[0]).mean(1)


def test_multihead_attention_is_kronecker():
    # in_proj (F.linear inside F.multi_head_attention_forward) and out_proj (applied by its
    # parent, never called as a module) are found by torch_functional's mode (issue 18)
    j = check_model(MHA(), torch.randn(2, 3, 4, dtype=DT), kinds="KKK")
    assert j.names == ("att", "att.out_proj", "l")


def test_inplace_activation_after_linear():
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    check_model(m, torch.randn(5, 3, dtype=DT), kinds="KK")


def test_inplace_model_records_copies_from_its_second_call():
    """A forward that modified a recorded tensor in place is repeated with copies; a model
    that did so once records copies at once on its next calls (one forward, not two), with
    the same exact Jacobian."""
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).to(DT)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(DT)
    x = torch.randn(5, 3, dtype=DT)
    counts = []
    for model in (m, plain):
        seen = []
        model.register_forward_hook(lambda mod, i, o, seen=seen: seen.append(i[0].shape[0]))
        check_model(model, x, kinds="KK")  # (a probe forward runs on other batch sizes)
        first = seen.count(5)
        seen.clear()
        check_model(model, x, kinds="KK")
        counts.append((first, seen.count(5)))
    assert counts == [(2, 1), (1, 1)]


def test_batchnorm():
    m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(),
                      nn.Linear(12, 2)).to(DT)
    x = torch.randn(3, 2, 4, 4, dtype=DT)
    m.train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        jacobian(m, x)
    m(x)  # running statistics
    check_model(m, x, kinds="KDK")
    m2 = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 1)).to(DT).train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        jacobian(m2, torch.randn(2, 3, dtype=DT))


def test_float32_matches_float64():
    m = mlp().to(DT).eval()
    x = torch.randn(6, 5, dtype=DT)
    j64 = jacobian(m, x).to_dense()
    j32 = jacobian(m.float(), x.float())
    assert j32.dtype == torch.float32
    k64 = torch.einsum("nok,mpk->nmop", j64, j64)
    d32 = j32.to_dense().double()
    k32 = torch.einsum("nok,mpk->nmop", d32, d32)
    # first order (tests/tolerances.py): a float32 Jacobian entry sums the fan-ins (5, 7, 6)
    # forward and the fan-outs (3, 6, 7) backward; twice that in a product of two entries
    n = 2 * ((5 + 7 + 6) + (3 + 6 + 7))
    assert rel(k32, k64) <= kernel_tol(torch.float32, n)


def test_differentiable_in_x():
    """With x.requires_grad the factors keep the graph to x (for KIP)."""
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 2)).to(DT)
    x = torch.randn(3, 3, dtype=DT, requires_grad=True)
    jd = jacobian(m, x).to_dense()
    grad = torch.autograd.grad((jd @ jd.transpose(1, 2)).pow(2).sum(), x)[0]
    x0 = x.detach().requires_grad_(True)
    rd = dense_reference_graph(m, x0)
    grad_ref = torch.autograd.grad((rd @ rd.transpose(1, 2)).pow(2).sum(), x0)[0]
    assert rel(grad, grad_ref) < 1e-10
    # without requires_grad nothing carries a graph
    j = jacobian(m, x.detach())
    assert all(not arr.requires_grad for b in j.blocks for arr in b.arrays())


dense_reference_graph = autograd_jacobian_graph


def test_chunked_dense_blocks_and_output_shapes():
    m = TiedLN().to(DT)
    x = torch.randn(5, 4, dtype=DT)
    a = jacobian(m, x, chunk_size=2).to_dense()
    b = jacobian(m, x).to_dense()
    assert rel(a, b) < 1e-14
    with pytest.raises(ValueError, match="chunk_size"):
        jacobian(m, x, chunk_size=0)
    # an (N,) output is O = 1
    sq = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0)).to(DT)
    j = jacobian(sq, x)
    assert j.num_outputs == 1
    assert isinstance(j.blocks[0], KroneckerBlock)


def test_blocks_cover_parameters_once():
    m = TiedLN().to(DT)
    j = jacobian(m, torch.randn(2, 4, dtype=DT))
    assert isinstance(j, Jacobian)
    assert j.num_params == sum(p.numel() for p in m.parameters())
    assert any(isinstance(b, DenseBlock) for b in j.blocks)


def test_registry_finds_torch_provider():
    from ntkcore.backends.torch import jacobian as reexported
    from ntkcore.providers import find_provider

    assert reexported is jacobian
    assert find_provider(mlp()).name == "torch"


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_backward_strategies_agree(model):
    if model == "mlp":
        m, x = mlp().to(DT), torch.randn(4, 5, dtype=DT)
    else:
        m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)).to(DT)
        x = torch.randn(4, 2, 4, 4, dtype=DT)
    ref = dense_reference(reference(m, x))
    kr = torch.einsum("nok,mpk->nmop", ref, ref)
    for how in ("auto", "batched", "loop"):
        jd = jacobian(m, x, backward=how).to_dense()
        assert rel(torch.einsum("nok,mpk->nmop", jd, jd), kr) < 1e-12
    with pytest.raises(ValueError, match="backward"):
        jacobian(m, x, backward="fast")


class TwoLN(nn.Module):
    """One LayerNorm applied twice (tied), one without bias, one over two axes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.ln_nobias = nn.LayerNorm(4, bias=False)
        self.ln2d = nn.LayerNorm((3, 4))
        self.out = nn.Linear(4, 2)

    def forward(self, x):  # x (N, 3, 4)
        h = self.ln(torch.tanh(self.lin(x)))
        h = self.ln(torch.tanh(self.lin(h)) * 1.5)
        h = self.ln2d(self.ln_nobias(h))
        return self.out(h).mean(1)


def test_layernorm_blocks_come_from_the_hooks(dense_calls):
    """LayerNorm over the last axis is assembled from the hooked inputs and output gradients
    (torch.func is not called for it), tied calls summed; over two axes too (issue 18; the
    other normalisation layers: test_torch_norm_blocks.py)."""
    seen = dense_calls
    x = torch.randn(5, 3, 4, dtype=DT)
    j = check_model(TwoLN(), x, kinds="KDDDK")
    assert seen == []
    # parameter subsets: weight only / bias only of the tied LayerNorm
    seen.clear()
    check_model(TwoLN(), x, params=["ln.weight", "out.bias"], kinds="DK")
    check_model(TwoLN(), x, params=["ln.bias"], kinds="D")
    assert seen == []
    assert j.names == ("lin", "ln", "ln_nobias", "ln2d", "out")


def test_layernorm_block_differentiable_in_x():
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 2)).to(DT)
    x = torch.randn(3, 2, 3, dtype=DT, requires_grad=True)

    def kernel_of(xx):
        jd = jacobian(m, xx).blocks[2].to_dense()  # the LayerNorm block (N, O, 8)
        return (jd * jd).sum()

    assert torch.autograd.gradcheck(kernel_of, (x,))
