"""Recurrent layers (``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM``) as Kronecker blocks over time steps
(issue 18, item 1).

The provider replaces each recurrent call's output by a step-by-step recomputation with the
module's own parameters (``torch_layers.recurrent_forward``) and builds, per layer and
direction, a block for ``[W_ih | b_ih]`` (a = [x_t, 1]) and one for ``[W_hh | b_hh]``
(a = [h_{t-1}, 1]) from the gradient with respect to the gate pre-activations.  Every case is
compared with a dense float64 ``torch.func`` Jacobian of the *unmodified* model (``jacrev`` of
``functional_call``, one sample at a time: ``vmap`` over samples has no batching rule for the
fused recurrent ops), independent of hooks, factors and the unrolled cells: the Jacobian in
block order, the kernels in full / trace / pseudo mode, symmetric and cross.  Configurations
that cannot be unrolled (PackedSequence input, projections, unbatched input, a batch axis that
is not the sample axis, a weight also used outside the module) keep the exact per-sample path;
inter-layer dropout in training mode raises.

Tolerance (``tests/tolerances.py``): a kernel entry sums P * O products, and each Jacobian entry
is itself computed through T steps of each of the L layers, each an inner product of
I + H + 1 terms (the fan-ins), in two independent computations.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, jacrev  # noqa: E402

import ntkcore  # noqa: E402
from ntkcore import DenseBlock, KroneckerBlock  # noqa: E402
from ntkcore.backends.torch_jacobian import from_block_order, jacobian, to_block_order  # noqa: E402
from ntkcore.backends.torch_layers import recurrent_forward  # noqa: E402
from tests.references import autograd_jacobian_graph  # noqa: E402
from tests.tolerances import gamma, kernel_tol  # noqa: E402

DT = torch.float64
CELLS = {"rnn_tanh": (nn.RNN, {}), "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}),
         "gru": (nn.GRU, {}), "lstm": (nn.LSTM, {})}
# (num_layers, bidirectional, batch_first, bias, explicit h0)
CONFIGS = {
    "1-layer": (1, False, True, True, False),
    "2-layer-bidir": (2, True, True, True, False),
    "seq-first-h0": (2, False, False, True, True),
    "bidir-nobias-h0": (1, True, True, False, True),
    "2-layer-bidir-seqfirst": (2, True, False, True, False),
}
IN, HID, T = 3, 4, 5


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class Rec(nn.Module):
    """x (N, T, IN) -> recurrent layer (seq-first inside when not batch_first; explicit h0
    computed from the input, or the default hx) -> mean over time -> Linear (N, 2)."""

    def __init__(self, rnn: nn.Module, h0: bool):
        super().__init__()
        self.rnn = rnn
        self.h0 = h0
        width = getattr(rnn, "proj_size", 0) or rnn.hidden_size
        self.out = nn.Linear(width * (2 if rnn.bidirectional else 1), 2)

    def forward(self, x):
        inp = x if self.rnn.batch_first else x.transpose(0, 1)
        if self.h0:
            layers = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            h = torch.tanh(x[:, :1, :1]).permute(1, 0, 2).expand(layers, -1, self.rnn.hidden_size)
            hx = (h, 0.5 * h) if isinstance(self.rnn, nn.LSTM) else h
            y = self.rnn(inp, hx)[0]
        else:
            y = self.rnn(inp)[0]
        return self.out(y.mean(1 if self.rnn.batch_first else 0))


def make(cell: str, config: str) -> tuple[nn.Module, int]:
    cls, kw = CELLS[cell]
    layers, bidir, bf, bias, h0 = CONFIGS[config]
    rnn = cls(IN, HID, num_layers=layers, bidirectional=bidir, batch_first=bf, bias=bias, **kw)
    return Rec(rnn, h0).to(DT).eval(), layers


def reference(model, x, names=None):
    """``{name: (N, O, *shape)}``: ``torch.func.jacrev`` of ``functional_call``, per sample."""
    named = dict(model.named_parameters())
    names = names or [k for k, p in named.items() if p.requires_grad]
    pd = {k: named[k].detach() for k in names}

    def f(pd, xn):
        return functional_call(model, pd, (xn,), strict=False).reshape(-1)

    rows = [jacrev(f)(pd, x[i:i + 1]) for i in range(x.shape[0])]
    return {k: torch.stack([r[k] for r in rows]) for k in names}


def autograd_reference(model, x):
    """``{name: (N, O, *shape)}`` by plain autograd, one sample and output at a time."""
    jr = autograd_jacobian_graph(model, x).detach()
    out, start = {}, 0
    for name, p in model.named_parameters():
        out[name] = jr[..., start:start + p.numel()].reshape(*jr.shape[:2], *p.shape)
        start += p.numel()
    return out


def dense(ref):
    return torch.cat([v.reshape(v.shape[0], v.shape[1], -1) for v in ref.values()], dim=2)


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-300)


def tol_for(p, o, layers, t=T, fan_in=IN + HID + 1):
    return kernel_tol(DT, p * o + 2 * layers * t * fan_in, computations=2)


def kinds(j):
    return "".join("K" if isinstance(b, KroneckerBlock) else "D" for b in j.blocks)


def check_against_reference(model, x1, x2, layers, params=None, t=T, fan_in=IN + HID + 1):
    j = jacobian(model, x1, params=params)
    names = None
    if params is not None:
        names = [k for k, _ in model.named_parameters() if k in set(params)]
    ref1 = reference(model, x1, names)
    r1, r2 = dense(ref1), dense(reference(model, x2, names))
    o = r1.shape[1]
    tol = tol_for(j.num_params, o, layers, t, fan_in)
    assert rel(j.to_dense(), to_block_order(model, j, ref1, params)) < tol
    back = from_block_order(model, j, to_block_order(model, j, ref1, params), params)
    assert all(torch.equal(back[k], ref1[k]) for k in ref1)
    full11 = torch.einsum("nok,mpk->nmop", r1, r1)
    full12 = torch.einsum("nok,mpk->nmop", r1, r2)
    sel = {"params": params} if params is not None else {}
    assert rel(ntkcore.ntk(model, x1, mode="full", **sel), full11) < tol
    assert rel(ntkcore.ntk(model, x1, x2, mode="trace", **sel),
               full12.diagonal(dim1=2, dim2=3).sum(-1)) < tol
    p1, p2 = r1.sum(1) / math.sqrt(o), r2.sum(1) / math.sqrt(o)
    assert rel(ntkcore.pseudo_ntk(model, x1, x2, **sel), p1 @ p2.T) < tol
    return j


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("cell", list(CELLS))
def test_recurrent_blocks_equal_dense_reference(cell, config, dense_calls):
    model, layers = make(cell, config)
    x1, x2 = torch.randn(3, T, IN, dtype=DT), torch.randn(2, T, IN, dtype=DT)
    j = check_against_reference(model, x1, x2, layers)
    assert dense_calls == []  # no torch.func / per-sample pass: every block from the hooks
    rnn = model.rnn
    pairs = layers * (2 if rnn.bidirectional else 1) * 2  # ih and hh per layer and direction
    assert kinds(j) == "K" * (pairs + 1)
    assert all(b.num_positions == T for b in j.blocks[:-1])
    assert not rnn._forward_hooks and not rnn._forward_pre_hooks  # the model is left as found


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_unrolled_output_equals_fused(cell, config):
    """The recomputation equals torch's fused op to float64 rounding (output and h_n / c_n)."""
    model, layers = make(cell, config)
    rnn = model.rnn
    x = torch.randn(3, T, IN, dtype=DT)
    inp = x if rnn.batch_first else x.transpose(0, 1)
    nd = 2 if rnn.bidirectional else 1
    h = torch.randn(layers * nd, 3, HID, dtype=DT)
    for hx in (None, (h, torch.randn_like(h)) if isinstance(rnn, nn.LSTM) else h):
        with torch.no_grad():
            fused = rnn(inp, hx)
            mine, passes = recurrent_forward(rnn, inp, hx)
        assert len(passes) == layers * nd
        # each entry: T steps through L layers of inner products of I + H + 1 terms
        tol = gamma(DT, 2 * layers * T * (IN + nd * HID + 1))
        flat = (lambda o: [o[0], *o[1]]) if isinstance(rnn, nn.LSTM) else list
        for a, b in zip(flat(mine), flat(fused), strict=True):
            assert a.shape == b.shape
            assert rel(a, b) < tol


class EmbGRU(nn.Module):
    """The issue's model: Embedding -> GRU -> Linear classifier on the last hidden state."""

    def __init__(self, vocab=20, emb=6, hidden=5, classes=3, h0=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.gru = nn.GRU(emb, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, classes)
        self.h0 = h0

    def forward(self, tokens):
        e = self.emb(tokens)
        if self.h0:
            h = e.new_zeros((1, e.shape[0], self.gru.hidden_size))
            _, h_n = self.gru(e, h)
        else:
            _, h_n = self.gru(e)
        return self.fc(h_n[-1])


@pytest.mark.parametrize("h0", [False, True], ids=["default-hx", "explicit-h0"])
def test_embedding_gru_classifier(h0, dense_calls):
    model = EmbGRU(h0=h0).to(DT).eval()
    t = 7
    x1, x2 = torch.randint(0, 20, (4, t)), torch.randint(0, 20, (3, t))
    j = check_against_reference(model, x1, x2, 1, t=t, fan_in=6 + 5 + 1)
    assert dense_calls == []
    assert kinds(j) == "KKKK"
    assert j.names == ("emb", "gru.weight_ih_l0", "gru.weight_hh_l0", "fc")


def test_parameter_subsets_and_layout():
    """Weight only, bias only, and pairs split across blocks: names, a factor widths, layout."""
    model, _ = make("gru", "2-layer-bidir")
    params = ["rnn.weight_hh_l0", "rnn.bias_ih_l0", "rnn.weight_ih_l1_reverse",
              "rnn.bias_ih_l1_reverse", "out.weight"]
    x1, x2 = torch.randn(3, T, IN, dtype=DT), torch.randn(2, T, IN, dtype=DT)
    j = check_against_reference(model, x1, x2, 2, params=params)
    assert j.names == ("rnn.weight_hh_l0", "rnn.bias_ih_l0", "rnn.weight_ih_l1_reverse", "out")
    assert [b.d_in for b in j.blocks] == [HID, 1, 2 * HID + 1, 2 * HID]


class TwoCalls(nn.Module):
    """One LSTM applied to two halves of the input (tied weights): 2 T positions per block."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(IN, HID, batch_first=True)
        self.out = nn.Linear(HID, 2)

    def forward(self, x):
        a, (h, _) = self.rnn(x[:, :T])
        b, _ = self.rnn(x[:, T:], hx=(h, torch.zeros_like(h)))  # hx as a keyword
        return self.out(a.mean(1) * b.mean(1))


def test_tied_calls(dense_calls):
    model = TwoCalls().to(DT)
    x1, x2 = torch.randn(3, 2 * T, IN, dtype=DT), torch.randn(2, 2 * T, IN, dtype=DT)
    j = check_against_reference(model, x1, x2, 2)
    assert kinds(j) == "KKK" and dense_calls == []
    assert j.blocks[0].num_positions == 2 * T


def test_create_graph_gradient_wrt_input():
    """x.requires_grad (KIP): the kernel is differentiable in x through the unrolled cells."""
    model, _ = make("gru", "2-layer-bidir")
    x = torch.randn(3, T, IN, dtype=DT, requires_grad=True)
    j = jacobian(model, x)
    assert kinds(j) == "KKKKKKKKK"
    named = dict(model.named_parameters())
    ps = [named[k] for k in named]
    rows = []
    for i in range(3):
        out = model(x[i:i + 1]).reshape(-1)
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            out[k], ps, create_graph=True)]) for k in range(out.shape[0])]))
    jr = torch.stack(rows)
    kk = torch.einsum("nok,mpk->nmop", j.to_dense(), j.to_dense())
    kr = torch.einsum("nok,mpk->nmop", jr, jr)
    tol = tol_for(j.num_params, 2, 2)
    assert rel(kk.detach(), kr.detach()) < tol
    w = torch.randn(kk.shape, dtype=DT)
    (g,) = torch.autograd.grad((kk * w).sum(), x)
    (gr,) = torch.autograd.grad((kr * w).sum(), x)
    assert rel(g, gr) < 10 * tol  # second derivatives: one more pass through the layers


# --------------------------------------------------------------------------------------------
# what is not unrolled: the exact per-sample path, or a clear error
# --------------------------------------------------------------------------------------------
class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(IN, HID, num_layers=2, bidirectional=True, batch_first=True)
        self.out = nn.Linear(2 * HID, 2)

    def forward(self, x):
        pk = nn.utils.rnn.pack_padded_sequence(x, [x.shape[1]] * x.shape[0], batch_first=True)
        y, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(pk)[0], batch_first=True)
        return self.out(y.mean(1))


class Unbatched(nn.Module):
    """Calls the GRU on each sample's (T, IN) slice: a 2-D, unbatched input."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(IN, HID)
        self.out = nn.Linear(HID, 2)

    def forward(self, x):
        return self.out(torch.stack([self.rnn(xi)[0].mean(0) for xi in x]))


class TimeAsBatch(nn.Module):
    """A sequence-first GRU fed (N, T, IN): its batch axis is T, not the sample axis."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(IN, HID)
        self.out = nn.Linear(HID, 2)

    def forward(self, x):
        return self.out(self.rnn(x)[0].mean(1))


class OutsideUse(nn.Module):
    """The GRU's hidden weight also scales the output outside the GRU's forward."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(IN, HID, batch_first=True)
        self.out = nn.Linear(HID, 2)

    def forward(self, x):
        return self.out(self.rnn(x)[0].mean(1)) * self.rnn.weight_hh_l0.sum()


class GRUSub(nn.GRU):
    def forward(self, x, hx=None):
        y, h = super().forward(x, hx)
        return 2 * y, h


NOT_UNROLLED = {
    "packed": (Packed, "DK"),
    "lstm-proj": (lambda: Rec(nn.LSTM(IN, HID, num_layers=2, bidirectional=True,
                                      batch_first=True, proj_size=2), False), "DK"),
    "unbatched": (Unbatched, "DK"),
    "time-as-batch": (TimeAsBatch, "DK"),
    "outside-use": (OutsideUse, "DK"),
    "subclass": (lambda: Rec(GRUSub(IN, HID, batch_first=True), False), "DK"),
}


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # pack_padded_sequence
@pytest.mark.parametrize("case", list(NOT_UNROLLED))
def test_not_unrolled_stays_exact(case, dense_calls):
    make_model, expected = NOT_UNROLLED[case]
    model = make_model().to(DT).eval()
    x1 = torch.randn(3, T, IN, dtype=DT)
    j = jacobian(model, x1)
    assert kinds(j) == expected
    assert dense_calls == ["rnn"]
    if case == "time-as-batch":  # couples the samples: no per-sample reference to compare
        return
    # torch.func cannot run a PackedSequence: plain per-sample autograd for that one
    ref = reference(model, x1) if case != "packed" else autograd_reference(model, x1)
    tol = tol_for(j.num_params, 2, 2)
    assert rel(j.to_dense(), to_block_order(model, j, ref)) < tol
    assert rel(ntkcore.ntk(model, x1, mode="trace"),
               torch.einsum("nok,mok->nm", dense(ref), dense(ref))) < tol


def test_dropout_in_training_mode_raises():
    model = Rec(nn.GRU(IN, HID, num_layers=2, dropout=0.5, batch_first=True), False).to(DT)
    x = torch.randn(3, T, IN, dtype=DT)
    with pytest.raises(ValueError, match=r"'rnn'.*dropout=0.5.*model.eval\(\)"):
        jacobian(model.train(), x)
    with pytest.raises(ValueError, match="dropout"):
        ntkcore.ntk(model, x)
    model.eval()  # no dropout in eval mode: unrolled and exact
    j = check_against_reference(model, x, torch.randn(2, T, IN, dtype=DT), 2)
    assert kinds(j) == "KKKKK"


def test_float32_kernel(dense_calls):
    """float32 against the float64 reference of the same weights."""
    model = EmbGRU(vocab=30, emb=8, hidden=6, classes=4)
    x = torch.randint(0, 30, (5, 9))
    k32 = ntkcore.ntk(model.float(), x, mode="trace")
    assert k32.dtype == torch.float32 and dense_calls == []
    r = dense(reference(model.to(DT), x))
    kr = torch.einsum("nok,mok->nm", r, r)
    p = sum(q.numel() for q in model.parameters())
    assert rel(k32.double(), kr) < kernel_tol(torch.float32, p * 4 + 2 * 9 * (8 + 6 + 1),
                                              computations=2)
    assert isinstance(jacobian(model.float(), x).blocks[1], KroneckerBlock)
    assert not isinstance(jacobian(model.float(), x).blocks[1], DenseBlock)


def test_frozen_input_weights(dense_calls):
    """W_ih and b_ih frozen (requires_grad False) on a plain input: u = W_ih x + b_ih is then
    off the graph, yet g_hh (derived from the gradient w.r.t. u) must not be zero."""
    for cell in ("gru", "lstm"):
        model, layers = make(cell, "1-layer")
        for name in ("weight_ih_l0", "bias_ih_l0"):
            getattr(model.rnn, name).requires_grad_(False)
        x1, x2 = torch.randn(3, T, IN, dtype=DT), torch.randn(2, T, IN, dtype=DT)
        j = check_against_reference(model, x1, x2, layers)
        assert kinds(j) == "KK" and j.names == ("rnn.weight_hh_l0", "out")
    assert dense_calls == []


def test_single_output_and_backward_loop(dense_calls):
    """O = 1 (one backward pass) and the loop of O passes give the same blocks as the
    reference / the batched pass."""
    model = EmbGRU(classes=1).to(DT).eval()
    x1, x2 = torch.randint(0, 20, (4, 6)), torch.randint(0, 20, (3, 6))
    check_against_reference(model, x1, x2, 1, t=6, fan_in=6 + 5 + 1)
    model, layers = make("lstm", "2-layer-bidir")
    x = torch.randn(3, T, IN, dtype=DT)
    jb, jl = jacobian(model, x, backward="batched"), jacobian(model, x, backward="loop")
    tol = tol_for(jb.num_params, 2, layers)
    assert kinds(jl) == kinds(jb) == "K" * 9
    assert rel(jl.to_dense(), jb.to_dense()) < tol
    assert dense_calls == []


class GRUAttention(nn.Module):
    """A GRU next to parameters found as functional calls (MultiheadAttention's in_proj /
    out_proj): both mechanisms in one forward."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(IN, HID, batch_first=True, bidirectional=True)
        self.attn = nn.MultiheadAttention(2 * HID, 2, batch_first=True)
        self.out = nn.Linear(2 * HID, 2)

    def forward(self, x):
        h = self.gru(x)[0]
        return self.out(self.attn(h, h, h, need_weights=False)[0].mean(1))


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # the reference's jacrev
def test_with_functional_calls(dense_calls):
    model = GRUAttention().to(DT).eval()
    x1, x2 = torch.randn(3, T, IN, dtype=DT), torch.randn(2, T, IN, dtype=DT)
    j = check_against_reference(model, x1, x2, 2, fan_in=IN + 3 * 2 * HID + 1)
    assert dense_calls == []
    assert j.names[:4] == ("gru.weight_ih_l0", "gru.weight_hh_l0", "gru.weight_ih_l0_reverse",
                           "gru.weight_hh_l0_reverse")
