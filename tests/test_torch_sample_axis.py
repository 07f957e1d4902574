"""Which axis of a hooked layer's input is the sample axis, and the dense fallback of the torch
provider, against dense float64 references (issue 15, items 1 and 2).

A hooked Linear / Embedding / LayerNorm call is a Kronecker factor only when its input and
output carry the sample axis.  A length that merely equals N (a positional table
``pos(arange(T))`` with T == N, a fixed buffer (T, d) fed to a Linear, a sequence-first (T, N, d)
tensor) must not pass for it: these tests put T == N on purpose and compare with
``vmap(jacrev)`` (independent of hooks and factors).  Modules that ``torch.func`` cannot run
(a GRU on a PackedSequence and an LSTM with projections, which the provider does not unroll
into Kronecker blocks as it does other recurrent layers (``tests/test_torch_rnn_blocks.py``);
PReLU; data-dependent control flow) are compared with plain per-sample autograd
(:func:`tests.references.autograd_jacobian_graph`).

Tolerance: 1e-12 relative (about 4500 float64 epsilons) on kernels and Jacobians of a few
hundred parameters with entries of order one, as in ``test_torch_provider``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

import ntkcore
from ntkcore import KroneckerBlock
from ntkcore.backends.torch_jacobian import jacobian, to_block_order
from tests.references import autograd_jacobian_graph
from tests.sample_axis_models import Buffer, BufferConv, SeqFirst
from tests.test_torch_provider import check_model, dense_reference, reference, rel

DT = torch.float64
TOL = 1e-12


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def kinds(j):
    return "".join("K" if isinstance(b, KroneckerBlock) else "D" for b in j.blocks)


def ref_dense(model, x):
    """(N, O, P) by torch.func (vmap of jacrev over samples)."""
    return dense_reference(reference(model, x))


def ref_full_kernel(model, x1, x2=None):
    j1 = ref_dense(model, x1)
    j2 = j1 if x2 is None else ref_dense(model, x2)
    return torch.einsum("nok,mpk->nmop", j1, j2)


# --------------------------------------------------------------------------------------------
# item 1: the sample axis
# --------------------------------------------------------------------------------------------
class GPT(nn.Module):
    """Token + positional embeddings: ``pos`` is fed ``arange(T)``, which has no sample axis."""

    def __init__(self, t=6):
        super().__init__()
        self.tok = nn.Embedding(11, 4)
        self.pos = nn.Embedding(t, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, i):
        return self.out(torch.tanh(self.tok(i) + self.pos(torch.arange(i.shape[1])))).mean(1)






class Flattened(nn.Module):
    """A Linear on (N*T, d): an axis that grows with N but is not the sample axis."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):  # x (N, T, 3)
        n, t, d = x.shape
        return self.b(torch.tanh(self.a(x.reshape(n * t, d))).reshape(n, t, 4).sum(1))


class TiedMixed(nn.Module):
    """One Embedding called on per-sample tokens and on ``arange(T)``: one call has a sample
    axis, the other has none, so the module as a whole must be dense."""

    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(7, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, i):
        return self.out(torch.tanh(self.e(i) + self.e(torch.arange(i.shape[1])))).mean(1)


class SeqFirstEmbedding(nn.Module):
    """An Embedding and a Linear on sequence-first (T, N) indices / (T, N, d) vectors."""

    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(9, 3)
        self.l = nn.Linear(3, 2)

    def forward(self, i):  # i (N, T)
        return self.l(torch.tanh(self.e(i.T))).sum(0)




def tokens(n, t=6):
    return torch.randint(0, 11, (n, t))


# (model factory, input factory N -> x, T, block kinds whatever N is)
CASES = {
    "gpt": (GPT, lambda n: tokens(n), 6, "KKK"),  # pos: a positional table (issue 18)
    "buffer": (partial(Buffer, out=2), lambda n: torch.randn(n, 5, dtype=DT), 5, "DK"),
    "seq_first_transformer": (partial(SeqFirst, out=2), lambda n: torch.randn(n, 5, 4, dtype=DT),
                              5, "KKKKDDK"),  # MHA: torch_functional (issue 18)
    "flattened": (Flattened, lambda n: torch.randn(n, 3, 3, dtype=DT), 3, "DK"),
    "tied_mixed": (TiedMixed, lambda n: torch.randint(0, 7, (n, 4)), 4, "DK"),
    "seq_first_embedding": (SeqFirstEmbedding, lambda n: torch.randint(0, 9, (n, 4)), 4, "KK"),
    "buffer_conv": (partial(BufferConv, out=2), lambda n: torch.randn(n, 6, dtype=DT), 5, "DK"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("same", [True, False], ids=["N==T", "N!=T"])
def test_sample_axis_not_fooled_by_lengths(case, same):
    """N == T gives the exact Jacobian (it was 4.6e-2 to 0.74 off), and the same blocks as
    N != T (the Kronecker structure is kept where the sample axis really exists)."""
    make, inp, t, expected = CASES[case]
    model = make().to(DT).eval()
    x = inp(t if same else t + 3)
    check_model(model, x, kinds=expected, tol=TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_one_sample_has_the_same_blocks(case):
    """N == 1 (probed at 2 samples) gives the same block kinds, so batches concatenate."""
    make, inp, _t, expected = CASES[case]
    check_model(make().to(DT).eval(), inp(1), kinds=expected, tol=TOL)


def test_seq_first_linears_are_kronecker_over_tokens():
    model = SeqFirst(out=2).to(DT).eval()
    j = check_model(model, torch.randn(5, 5, 4, dtype=DT), tol=TOL)
    by_name = dict(zip(j.names, j.blocks, strict=True))
    assert by_name["enc.linear1"].num_positions == 5  # the T tokens of each sample
    assert by_name["enc.linear1"].explicit_a().shape == (5, 5, 5)  # (N, T, d + 1)


@pytest.mark.parametrize("backward", ["batched", "loop"])
@pytest.mark.parametrize("pseudo", [False, True], ids=["ntk", "pseudo"])
def test_seq_first_every_backward_path(backward, pseudo):
    """The moved sample axis in each way of taking the output gradients."""
    model = SeqFirst(out=2).to(DT).eval()
    x = torch.randn(5, 5, 4, dtype=DT)
    j = jacobian(model, x, backward=backward, pseudo=pseudo)
    assert kinds(j) == "KKKKDDK"
    ref = reference(model, x, pseudo=pseudo)
    assert rel(j.to_dense(), to_block_order(model, j, ref)) < TOL


def test_gpt_trace_kernel_n_equals_t():
    """The issue's reproducer: ``ntk(..., mode="trace")`` with N == T == 6."""
    model = GPT().to(DT)
    idx = tokens(6)
    k = ntkcore.ntk(model, idx, mode="trace")
    kr = torch.einsum("nmoo->nm", ref_full_kernel(model, idx))
    assert rel(k, kr) < TOL


@pytest.mark.parametrize("case", ["gpt", "seq_first_transformer", "buffer"])
def test_cross_kernel_n1_equals_t(case):
    """J1 at N1 == T and J2 at N2 != T have the same blocks (it raised "KroneckerBlock in J1
    but a DenseBlock in J2")."""
    make, inp, t, _ = CASES[case]
    model = make().to(DT).eval()
    x1, x2 = inp(t), inp(t + 2)
    k = ntkcore.ntk(model, x1, x2, mode="full")
    assert rel(k, ref_full_kernel(model, x1, x2)) < TOL


@pytest.mark.parametrize("case", ["gpt", "seq_first_transformer", "buffer"])
def test_batch_size_equal_to_t(case):
    """Batches of T samples and a last batch of another size concatenate (it raised "Jacobians
    to concatenate must have the same blocks")."""
    make, inp, t, _ = CASES[case]
    model = make().to(DT).eval()
    # ntk's first (measuring) call takes 8 samples, then batches of T: 8, T, 1 (or T, T, 9 - T
    # when the measurement is cached); either way batches of T meet batches of another size.
    x = inp(t + 9)
    k = ntkcore.ntk(model, x, mode="full", batch_size=t)
    assert rel(k, ref_full_kernel(model, x)) < TOL


def test_multihead_attention_seq_first():
    """``nn.MultiheadAttention`` (batch_first=False) followed by a Linear on (T, N, d)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(4, 2)
            self.l = nn.Linear(4, 2)

        def forward(self, x):
            h = x.transpose(0, 1)
            return self.l(self.att(h, h, h, need_weights=False)[0]).mean(0)

    j = check_model(M(), torch.randn(3, 3, 4, dtype=DT), tol=TOL)
    assert kinds(j) == "KKK"  # in_proj and out_proj: torch_functional (issue 18)


def test_differentiable_in_x_with_seq_first_axis():
    """The moved sample axis keeps the graph to x (create_graph)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)

    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):  # (N, T, 3) -> seq-first inside
            return self.m(x.transpose(0, 1)).sum(0)

    m = T()
    x = torch.randn(3, 3, 3, dtype=DT, requires_grad=True)
    j = jacobian(m, x)
    assert kinds(j) == "KK"
    jr = autograd_jacobian_graph(m, x)
    kk, kr = (torch.einsum("nok,mpk->nmop", a, a) for a in (j.to_dense(), jr))
    assert rel(kk.detach(), kr.detach()) < TOL
    w = torch.randn(kk.shape, dtype=DT)  # a scalar that sees every entry of the kernel
    (g,) = torch.autograd.grad((kk * w).sum(), x)
    (gr,) = torch.autograd.grad((kr * w).sum(), x)
    assert rel(g, gr) < TOL


# --------------------------------------------------------------------------------------------
# item 2: the dense fallback when torch.func cannot run a module
# --------------------------------------------------------------------------------------------
class Recurrent(nn.Module):
    def __init__(self, rnn, hidden_out):
        super().__init__()
        self.rnn = rnn
        self.l = nn.Linear(hidden_out, 2)

    def forward(self, x):  # (N, T, d_in), default hx
        return self.l(self.rnn(x)[0].mean(1))


class PackedRecurrent(Recurrent):
    """The same on a PackedSequence (not unrolled by the provider; torch.func cannot run it)."""

    def forward(self, x):
        pk = nn.utils.rnn.pack_padded_sequence(x, [x.shape[1]] * x.shape[0], batch_first=True)
        return self.l(nn.utils.rnn.pad_packed_sequence(self.rnn(pk)[0], batch_first=True)[0]
                      .mean(1))


class PReLUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.act = nn.PReLU(4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


class Guarded(nn.Module):
    """Input validation in ``forward`` is data-dependent Python control flow, which ``vmap``
    refuses."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.s = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        if not torch.isfinite(x).all():
            raise ValueError("non-finite input")
        return self.a(x) * self.s


FALLBACK = {
    # (recurrent layers on plain 3-D tensors are Kronecker blocks: test_torch_rnn_blocks.py)
    "gru": (lambda: PackedRecurrent(nn.GRU(3, 4, num_layers=2, bidirectional=True,
                                           batch_first=True), 8),
            lambda: torch.randn(3, 5, 3, dtype=DT), "DK"),
    "lstm": (lambda: Recurrent(nn.LSTM(3, 4, num_layers=2, bidirectional=True,
                                       batch_first=True, proj_size=2), 4),
             lambda: torch.randn(3, 5, 3, dtype=DT), "DK"),
    "prelu": (PReLUNet, lambda: torch.randn(4, 3, dtype=DT), "KDK"),
    "guarded": (Guarded, lambda: torch.randn(4, 3, dtype=DT), "DK"),
}


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # pack_padded_sequence
@pytest.mark.parametrize("pseudo", [False, True], ids=["ntk", "pseudo"])
@pytest.mark.parametrize("case", list(FALLBACK))
def test_dense_fallback_when_torch_func_fails(case, pseudo):
    make, inp, expected = FALLBACK[case]
    model = make().to(DT).eval()
    x = inp()
    before = [(p, p.requires_grad) for p in model.parameters()]
    j = jacobian(model, x, pseudo=pseudo)
    assert kinds(j) == expected
    # the failed torch.func pass left the model as it was (same parameter objects)
    after = list(model.parameters())
    assert len(after) == len(before)
    assert all(q is p and q.requires_grad == r for (p, r), q in zip(before, after, strict=True))
    # reference: plain autograd, one sample and output at a time (model.parameters() order)
    jr = autograd_jacobian_graph(model, x).detach()
    if pseudo:
        jr = jr.sum(1, keepdim=True) / jr.shape[1] ** 0.5
    jd = j.to_dense()
    assert not jd.requires_grad
    assert rel(torch.einsum("nok,mpk->nmop", jd, jd),
               torch.einsum("nok,mpk->nmop", jr, jr)) < TOL
    # the Jacobian itself, in block order
    per_param, start = {}, 0
    for name, p in model.named_parameters():
        per_param[name] = jr[..., start:start + p.numel()].reshape(*jr.shape[:2], *p.shape)
        start += p.numel()
    assert rel(jd, to_block_order(model, j, per_param)) < TOL


def test_dense_fallback_in_ntk():
    make, inp, _ = FALLBACK["lstm"]
    model = make().to(DT).eval()
    x = inp()
    jr = autograd_jacobian_graph(model, x).detach()
    k = ntkcore.ntk(model, x, mode="trace")
    assert rel(k, torch.einsum("nok,mok->nm", jr, jr)) < TOL


def test_model_error_still_surfaces():
    """A model that fails on one sample (here: a hard-coded batch size) still raises its own
    error: the per-sample fallback runs it too and does not hide the failure."""

    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(3, dtype=DT))

        def forward(self, x):
            return (x * self.s).reshape(2, 3)

    with pytest.raises(RuntimeError, match="invalid for input of size 3"):
        jacobian(Bad(), torch.randn(2, 3, dtype=DT))


class _Flip(nn.Module):
    """A Linear over (N, T, d), or, with ``seq_first``, over the same tensor transposed to
    (T, N, d): with T == N both calls have the same shapes, only the graph differs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.seq_first = False

    def forward(self, x):
        if self.seq_first:
            return torch.tanh(self.lin(x.transpose(0, 1))).transpose(0, 1).sum(1)
        return torch.tanh(self.lin(x)).sum(1)


def test_probe_runs_once_per_model_and_batch_shape():
    """Repeated calls on one model and input shape run the probe forward once."""
    model = _Flip().to(DT).eval()
    model.seq_first = True
    x = torch.randn(5, 5, 3, dtype=DT)
    forwards = []
    model.register_forward_pre_hook(lambda mod, args: forwards.append(args[0].shape[0]))
    first = jacobian(model, x).to_dense()
    assert forwards == [5, 1]  # the real pass and the probe on one sample
    again = jacobian(model, x).to_dense()
    assert forwards == [5, 1, 5]
    assert torch.equal(first, again)
    assert kinds(jacobian(model, x)) == "K"
    jacobian(model, x[:3])  # another batch shape: probed
    assert forwards == [5, 1, 5, 5, 3, 1]


def test_remembered_probe_follows_a_changed_forward():
    """A flag that moves the samples to another axis (same call shapes, T == N) is seen in
    the graph and probed again: the kernel stays exact."""
    model = _Flip().to(DT).eval()
    x = torch.randn(4, 4, 3, dtype=DT)
    for flag in (False, True, False):
        model.seq_first = flag
        j = jacobian(model, x)
        ref = reference(model, x)
        assert rel(j.to_dense(), to_block_order(model, j, ref)) < TOL


class _Weight(nn.Module):
    """A bare weight that its parent applies with ``F.linear`` (a functional call)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 3))


class _FlipFunctional(nn.Module):
    """:class:`_Flip` with the weight applied functionally (``torch_functional``)."""

    def __init__(self):
        super().__init__()
        self.proj = _Weight()
        self.seq_first = False

    def forward(self, x):
        w = self.proj.weight
        if self.seq_first:
            return torch.tanh(nn.functional.linear(x.transpose(0, 1), w)).transpose(0, 1).sum(1)
        return torch.tanh(nn.functional.linear(x, w)).sum(1)


def test_functional_probe_runs_once_per_model_and_batch_shape():
    """With functional calls too, repeated calls on one model and input shape run the probe
    forward once (its axes and call shapes are remembered); a changed forward (samples on
    another axis, same shapes, T == N) is probed again and stays exact."""
    model = _FlipFunctional().to(DT).eval()
    x = torch.randn(5, 5, 3, dtype=DT)
    forwards = []
    model.register_forward_pre_hook(lambda mod, args: forwards.append(args[0].shape[0]))
    first = jacobian(model, x)
    assert kinds(first) == "K"
    assert forwards == [5, 1]  # the real pass and the probe on one sample
    again = jacobian(model, x)
    assert forwards == [5, 1, 5]
    assert torch.equal(first.to_dense(), again.to_dense())
    jacobian(model, x[:3])  # another batch shape: probed
    assert forwards == [5, 1, 5, 3, 1]
    for flag in (True, False, True):
        model.seq_first = flag
        j = jacobian(model, x)
        assert kinds(j) == "K"
        assert rel(j.to_dense(), to_block_order(model, j, reference(model, x))) < TOL
