"""Embeddings (index factors) and grouped / depthwise convolutions, issue 18 item 1.

Every number is compared with a dense float64 reference: the ``torch.func`` Jacobian of the
model, its Gram (full and trace), J v, J^T c, the sketched dense Jacobian J Omega^T and a
direct solve of (lambda I + J^T J) d = g.  An ``nn.Embedding`` is a KroneckerBlock whose
factor a is the (N, T) index array (``one_hot = V``): no (N, T, V) one-hot array exists.
A positional table looked up without a sample axis (``pos(arange(T))``, Hugging Face BERT's
``position_embeddings``) and added to / multiplying the samples is such a block too (the
``dense_calls`` spy: no ``torch.func`` pass); its other uses keep ``torch.func``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ntkcore import DenseBlock, Jacobian, KroneckerBlock, gram, ntk, smw_solve
from ntkcore.analysis import layer_traces
from ntkcore.backends.torch_jacobian import jacobian, to_block_order
from ntkcore.features import feature_variance, features
from ntkcore.gram import _gram
from ntkcore.lowrank import low_rank
from ntkcore.sketch import sketch_jacobian
from tests.test_torch_provider import reference
from tests.tolerances import kernel_tol, solve_tol

DT = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- models -------------------------------------------------------------------------------
class Emb(nn.Module):
    """Embedding (padding_idx) -> tanh -> Linear, mean over tokens."""

    def __init__(self, v=7, d=3, padding_idx=0, out=3):
        super().__init__()
        self.e = nn.Embedding(v, d, padding_idx=padding_idx)
        self.l = nn.Linear(d, out)

    def forward(self, i):
        return self.l(torch.tanh(self.e(i))).mean(1)


class BertEmbeddings(nn.Module):
    """word + position + token type, LayerNorm, a Linear head on the mean token (as in BERT).

    ``shared_positions``: positions looked up as ``pos(arange(T))`` (one (T, D) table for all
    samples, no sample axis: its lookup is followed to the sum with the sample operand)
    instead of ``pos(arange(T).expand(N, T))``."""

    def __init__(self, v=50, t=6, d=4, out=2, shared_positions=False):
        super().__init__()
        self.word = nn.Embedding(v, d, padding_idx=1)
        self.pos = nn.Embedding(t, d)
        self.typ = nn.Embedding(2, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, out)
        self.shared = shared_positions

    def forward(self, ids):
        n, t = ids.shape
        pos = torch.arange(t, device=ids.device)
        p = self.pos(pos) if self.shared else self.pos(pos.expand(n, t))
        typ = self.typ((ids % 2 == 0).long())  # a per-sample token type
        h = self.norm(self.word(ids) + p + typ)
        return self.head(torch.tanh(h)).mean(1)


def _ids(n, t, v, pad=None, gen_seed=1):
    g = torch.Generator().manual_seed(gen_seed)
    ids = torch.randint(0, v, (n, t), generator=g)
    if pad is not None:
        ids[:, -1] = pad  # every sample has padding
        ids[0, 0] = pad
    return ids


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-300)


def _dense_checks(model, x, j, ref):
    """The Jacobian in block order, its Gram (full, trace, both Kronecker strategies), jvp and
    vjp against the dense float64 reference; returns the dense reference Jacobian."""
    jd_ref = to_block_order(model, j, ref)  # (N, O, P)
    n, o, p = jd_ref.shape
    tol = kernel_tol(DT, p + 2, computations=2)
    assert rel(j.to_dense(), jd_ref) < tol
    k_full = torch.einsum("nop,mqp->nmoq", jd_ref, jd_ref)
    k_trace = torch.einsum("nop,mop->nm", jd_ref, jd_ref)
    assert rel(gram(j, mode="full"), k_full) < tol
    assert rel(gram(j, mode="trace"), k_trace) < tol
    for strategy in ("positions", "materialise"):
        assert rel(_gram(j, mode="full", strategy=strategy), k_full) < tol
        assert rel(_gram(j, mode="diagonal", strategy=strategy),
                   torch.einsum("nop,mop->nmo", jd_ref, jd_ref)) < tol
    # a cross kernel (J1 != J2): rows 0..1 against all
    assert rel(gram(j[0:2], j, mode="trace"), k_trace[0:2]) < tol
    v = torch.randn(p, dtype=DT)
    c = torch.randn(n, o, dtype=DT)
    assert rel(j.jvp(v), jd_ref @ v) < tol
    assert rel(j.vjp(c), torch.einsum("no,nop->p", c, jd_ref)) < tol
    return jd_ref


# -- embeddings -----------------------------------------------------------------------------
def test_embedding_is_an_index_factor():
    model = Emb().to(DT).eval()
    ids = _ids(4, 5, 7, pad=0)
    j = jacobian(model, ids)
    e = j.blocks[0]
    assert isinstance(e, KroneckerBlock) and e.one_hot == 7
    assert tuple(e.a.shape) == (4, 5) and e.a.dtype == torch.int64  # no one-hot rows
    assert (e.a == -1).sum() == (ids == 0).sum()  # padding_idx: a zero row
    assert e.d_in == 7 and e.d_out == 3 and e.num_params == 21
    _dense_checks(model, ids, j, reference(model, ids))


@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_embedding_padding_idx(padding_idx):
    model = Emb(v=6, padding_idx=padding_idx).to(DT).eval()
    ids = _ids(3, 4, 6, pad=None if padding_idx is None else padding_idx % 6)
    j = jacobian(model, ids)
    _dense_checks(model, ids, j, reference(model, ids))


def test_large_vocabulary_never_forms_one_hot_rows(monkeypatch):
    """V = 30522 (BERT's vocabulary): the Gram, jvp, vjp and the sketch run on indices."""
    import ntkcore.jacobian as jac_mod

    v = 30522
    model = Emb(v=v, d=2, padding_idx=0, out=2).to(DT).eval()
    ids = _ids(3, 4, v, pad=0)
    j = jacobian(model, ids)
    ref = reference(model, ids)
    calls = []
    real = jac_mod.one_hot_rows

    def spy(xp, idx, d, dtype):
        calls.append(math.prod(idx.shape) * d)
        return real(xp, idx, d, dtype)

    monkeypatch.setattr(jac_mod, "one_hot_rows", spy)
    jd_ref = to_block_order(model, j, ref)
    tol = kernel_tol(DT, jd_ref.shape[2] + 2, computations=2)
    assert rel(gram(j, mode="full"), torch.einsum("nop,mqp->nmoq", jd_ref, jd_ref)) < tol
    vec = torch.randn(j.num_params, dtype=DT)
    assert rel(j.jvp(vec), jd_ref @ vec) < tol
    assert calls == []  # Gram and jvp: comparisons and gathers only
    c = torch.randn(3, 2, dtype=DT)
    assert rel(j.vjp(c), torch.einsum("no,nop->p", c, jd_ref)) < tol
    assert calls == []  # vjp: torch's native scatter-add (Backend.scatter_add), no one-hot rows


@pytest.mark.parametrize("shared_positions", [False, True])
def test_bert_like_embedding_sum(shared_positions, dense_calls):
    model = BertEmbeddings(shared_positions=shared_positions).to(DT).eval()
    ids = _ids(4, 6, 50, pad=1)
    j = jacobian(model, ids)
    kinds = {b.name: (type(b).__name__, getattr(b, "one_hot", None)) for b in j.blocks}
    assert kinds["word"] == ("KroneckerBlock", 50)
    assert kinds["typ"] == ("KroneckerBlock", 2)
    # pos(arange(T)), no sample axis, or expanded: an index factor either way
    assert kinds["pos"] == ("KroneckerBlock", 6)
    assert dense_calls == []  # no torch.func pass
    _dense_checks(model, ids, j, reference(model, ids))


class SharedTable(nn.Module):
    """A positional table looked up without a sample axis, used as ``how`` says: word
    embeddings (N, T, D) -> [+ pos] -> LayerNorm -> tanh -> Linear head on the mean token.

    Structured: "hf" (Hugging Face BERT: ``position_ids`` a (1, max) buffer sliced to (1, T),
    added to word + token type; T < max so some rows get no gradient), "mul" (the sample
    operand times the table), "twice" (one lookup added at two places), "two-calls" (the
    module called twice), "padding" (a ``padding_idx`` row looked up: zero gradient).
    Fallbacks (torch.func): "row0" (a view of the lookup, ``h + p[0]``), "matmul" (a
    non-broadcast product ``h @ p.T``), "extra-sum" (``h + p`` and ``p.sum()``), "function"
    (``h + p`` and a use inside an ``autograd.Function``), "tables" (two shared lookups
    added to each other first); and "sequence-first" ((T, N, D) plus a (T, 1, D) lookup:
    broadcast along the samples on axis 1, structured)."""

    def __init__(self, how, v=30, t=5, d=4, out=3, max_pos=8):
        super().__init__()
        self.how, self.t = how, t
        self.word = nn.Embedding(v, d)
        if how == "hf":
            self.typ = nn.Embedding(2, d)
        self.pos = nn.Embedding(max_pos, d, padding_idx=2 if how == "padding" else None)
        if how == "tables":
            self.other = nn.Embedding(max_pos, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, out)
        self.register_buffer("position_ids", torch.arange(max_pos).expand((1, -1)),
                             persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        h = self.word(ids)
        how = self.how
        if how == "hf":
            h = h + self.typ(torch.zeros_like(ids))
            y = h + self.pos(self.position_ids[:, :t])
        elif how == "sequence-first":
            y = (h.transpose(0, 1) + self.pos(torch.arange(t)[:, None])).transpose(0, 1)
        else:
            p = self.pos(torch.arange(t))
            if how == "mul":
                y = torch.tanh(h) * p
            elif how == "twice":
                y = torch.tanh(h + p) + p
            elif how == "two-calls":
                y = torch.tanh(h + p) + self.pos(torch.arange(t).flip(0))
            elif how == "padding":
                y = h + p
            elif how == "row0":
                y = h + p[0]
            elif how == "matmul":
                y = h @ p.T
            elif how == "extra-sum":
                y = h + p + p.sum()
            elif how == "function":
                y = h + p + _Product.apply(h, p)
            elif how == "tables":
                y = h + (p + self.other(torch.arange(t)))
            else:
                raise AssertionError(how)
        y = y if y.shape[-1] == self.norm.normalized_shape[0] else y[..., :4]
        return self.head(torch.tanh(self.norm(y))).mean(1)


class _Product(torch.autograd.Function):
    """h * p with a hand-written backward: a use of p that the functional mode cannot see."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h, p):
        return h * p

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        h, p = ctx.saved_tensors
        return g * p, g * h


SHARED = ["hf", "mul", "twice", "two-calls", "padding", "sequence-first"]
FALLBACK = ["row0", "matmul", "extra-sum", "function", "tables"]


@pytest.mark.parametrize("how", SHARED + FALLBACK)
def test_shared_positional_table(how, dense_calls):
    """A table looked up without a sample axis and broadcast-added to (or multiplying) the
    samples is an index-factor KroneckerBlock from the sum's output gradients, exactly; any
    other use of the lookup keeps the exact torch.func path."""
    model = SharedTable(how).to(DT).eval()
    with torch.no_grad():
        for q in model.parameters():
            q.normal_()
    ids = _ids(4, 5, 30)
    j = jacobian(model, ids)
    pos = next(b for b in j.blocks if b.name == "pos")
    if how in SHARED:
        assert isinstance(pos, KroneckerBlock) and pos.one_hot == 8
        assert dense_calls == []
        if how == "padding":
            assert (pos.a == -1).sum() == 4  # arange(5) hits padding_idx 2 once per sample
    else:
        assert isinstance(pos, DenseBlock)
        assert "pos" in dense_calls
    _dense_checks(model, ids, j, reference(model, ids))


def test_shared_table_is_remembered(dense_calls):
    """The first call finds the table (one more forward and probe); later calls follow its
    lookup from the start and reuse the remembered probe (one forward)."""
    model = SharedTable("hf").to(DT).eval()
    ids = _ids(3, 5, 30)
    passes = []
    model.register_forward_pre_hook(lambda m, a: passes.append(a[0].shape[0]))
    j1 = jacobian(model, ids)
    first = len(passes)
    j2 = jacobian(model, ids)
    assert first == 4 and len(passes) - first == 1
    assert rel(gram(j2, mode="full"), gram(j1, mode="full")) == 0
    assert dense_calls == []


def test_table_used_otherwise_is_followed_no_more(monkeypatch, dense_calls):
    """A table whose lookup is used in an unrecognised way: the second call runs without the
    functional mode (no per-op cost for nothing), with the same exact torch.func block."""
    import ntkcore.backends.torch_functional as tf

    entered = []
    real = tf.ParamUses.__torch_function__
    monkeypatch.setattr(tf.ParamUses, "__torch_function__",
                        lambda *a, **k: entered.append(1) or real(*a, **k))
    model = SharedTable("row0").to(DT).eval()
    ids = _ids(3, 5, 30)
    j1 = jacobian(model, ids)
    assert entered and dense_calls == ["pos"]
    entered.clear()
    j2 = jacobian(model, ids)
    assert entered == [] and dense_calls == ["pos", "pos"]
    assert rel(j2.to_dense(), j1.to_dense()) == 0


class FloatWithTable(nn.Module):
    """Linear on float inputs (N, T, 3) plus a positional table, tanh, head, sum over T."""

    def __init__(self):
        super().__init__()
        self.l, self.pos, self.head = nn.Linear(3, 4), nn.Embedding(7, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.l(x) + self.pos(torch.arange(x.shape[1])))).sum(1)


@pytest.mark.parametrize("kw", [{"params": ["pos.weight"]}, {"pseudo": True},
                                {"backward": "loop"}], ids=["pos-only", "pseudo", "loop"])
def test_shared_table_provider_paths(kw, dense_calls):
    model = FloatWithTable().to(DT)
    x = torch.randn(3, 5, 3, dtype=DT)
    j = jacobian(model, x, **kw)
    ref = reference(model, x, kw.get("params"), pseudo=kw.get("pseudo", False))
    assert all(isinstance(b, KroneckerBlock) for b in j.blocks) and dense_calls == []
    jd = to_block_order(model, j, ref, kw.get("params"))
    assert rel(j.to_dense(), jd) < kernel_tol(DT, jd.shape[2] + 2, computations=2)


def test_shared_table_differentiable_in_x(dense_calls):
    """x.requires_grad (KIP's path): the table's g keeps the graph to x."""
    model = FloatWithTable().to(DT)
    x = torch.randn(2, 5, 3, dtype=DT)
    xg = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(ntk(model, xg, mode="trace").sum(), xg)

    def kernel_of(xx):
        r = torch.cat([v.reshape(v.shape[0], v.shape[1], -1)
                       for v in reference(model, xx).values()], 2)
        return torch.einsum("nok,mok->nm", r, r).sum()

    assert rel(gx, torch.func.grad(kernel_of)(x)) < 1e-10
    assert dense_calls == []


@pytest.fixture(scope="module")
def hf_bert():
    from benchmarks import real_models as rm

    why = rm.available("bert")
    if why:
        pytest.skip(why)
    return rm


def test_hf_bert_position_embeddings(hf_bert, dense_calls):
    """Hugging Face BertForSequenceClassification (tiny): every block structured, the position
    table an index factor; Jacobian and full / trace kernels against dense float64."""
    rm = hf_bert
    model, ids = rm.build("bert", "tiny", n=3, dtype="float64")
    assert rm.block_report(model, ids).torch_func == []
    j = jacobian(model, ids)
    pos = next(b for b in j.blocks if b.name.endswith("position_embeddings"))
    assert isinstance(pos, KroneckerBlock) and pos.one_hot == 32
    assert dense_calls == []
    _dense_checks(model, ids, j, reference(model, ids))
    ids2 = _ids(2, 6, 50, gen_seed=3)
    r1 = to_block_order(model, j, reference(model, ids))
    j2 = jacobian(model, ids2)
    r2 = to_block_order(model, j2, reference(model, ids2))
    tol = kernel_tol(DT, r1.shape[2] * r1.shape[1], computations=2)
    assert rel(ntk(model, ids, ids2, mode="full"), torch.einsum("nop,mqp->nmoq", r1, r2)) < tol
    assert rel(ntk(model, ids, ids2, mode="trace"), torch.einsum("nop,mop->nm", r1, r2)) < tol


def test_ntk_batches_and_concatenates_index_blocks():
    """ntk() with a small budget: sample batches of the factors (select / concatenate)."""
    model = BertEmbeddings().to(DT).eval()
    ids = _ids(10, 6, 50, pad=1)
    jd_ref = to_block_order(model, jacobian(model, ids), reference(model, ids))
    k_ref = torch.einsum("nop,mop->nm", jd_ref, jd_ref)
    tol = kernel_tol(DT, jd_ref.shape[2] + 2, computations=2)
    assert rel(ntk(model, ids, mode="trace"), k_ref) < tol
    assert rel(ntk(model, ids, mode="trace", batch_size=3), k_ref) < tol
    ids2 = _ids(5, 6, 50, pad=1, gen_seed=2)
    jd2 = to_block_order(model, jacobian(model, ids2), reference(model, ids2))
    assert rel(ntk(model, ids, ids2, mode="trace", batch_size=4),
               torch.einsum("nop,mop->nm", jd_ref, jd2)) < tol
    j = jacobian(model, ids)
    joined = Jacobian.concatenate([j[0:4], j[4:10]])
    assert [getattr(b, "one_hot", None) for b in joined] == \
        [getattr(b, "one_hot", None) for b in j]
    assert rel(gram(joined, mode="trace"), k_ref) < tol


def _one_hot_twin(j):
    """The same Jacobian with every index factor materialised as dense one-hot rows."""
    return Jacobian([KroneckerBlock(b.dense_a(), b.g, b.name)
                     if isinstance(b, KroneckerBlock) and b.one_hot is not None else b
                     for b in j.blocks])


@pytest.mark.parametrize("method", ["uniform", "leverage", "gaussian", "sparse_sign"])
def test_sketch_of_index_factor(method):
    """sketch_jacobian on an index factor gathers Omega_A's columns: its blocks equal
    J_b Omega_b^T of the dense reference, and its Gram the dense sketched Gram."""
    model = Emb(v=40, d=3, padding_idx=0).to(DT).eval()
    ids = _ids(5, 4, 40, pad=0)
    j = jacobian(model, ids)
    jd_ref = to_block_order(model, j, reference(model, ids))
    js, jsk = sketch_jacobian(j, 60, method=method, seed=5, return_sketch=True)
    e, es = j.blocks[0], js.blocks[0]
    sk_a, sk_g = jsk.block_sketches[0]
    assert sk_a is not None
    om_a = sk_a.matrix(DT)
    om_g = torch.eye(e.d_out, dtype=DT) if sk_g is None else sk_g.matrix(DT)
    omega = torch.kron(om_g, om_a)  # parameter index i_out * d_in + i_in
    ref_b = torch.einsum("nop,qp->noq", jd_ref[:, :, :e.num_params], omega)
    tol = kernel_tol(DT, e.num_params + 2, computations=2)
    assert rel(es.to_dense(), ref_b) < tol
    # the whole sketched Jacobian against the dense one times the block-diagonal sketch
    omegas = [omega] + [sk.matrix(DT) if sk is not None else torch.eye(b.num_params, dtype=DT)
                        for b, sk in zip(j.blocks[1:], jsk.block_sketches[1:], strict=True)
                        if isinstance(b, DenseBlock)]
    if len(omegas) == len(j.blocks):
        full = torch.block_diag(*omegas)
        jd_sk = torch.einsum("nop,qp->noq", jd_ref, full)
        assert rel(gram(js, mode="full"), torch.einsum("nop,mqp->nmoq", jd_sk, jd_sk)) < tol
    # the same sketch on the one-hot twin: identical sketched factors
    js2 = sketch_jacobian(_one_hot_twin(j), 60, method=method, seed=5)
    assert rel(js2.blocks[0].a, es.a) < tol


def test_smw_solve_with_index_factor():
    model = BertEmbeddings(v=30, d=3).to(DT).eval()
    ids = _ids(4, 6, 30, pad=1)
    j = jacobian(model, ids)
    jd = to_block_order(model, j, reference(model, ids))
    n, o, p = jd.shape
    u = jd.reshape(n * o, p).T  # (P, rho)
    lam = 0.3
    g = torch.randn(p, dtype=DT)
    a = lam * torch.eye(p, dtype=DT) + u @ u.T
    d_ref = torch.linalg.solve(a, g)
    d = smw_solve(j, g, lam)
    cond = torch.linalg.cond(a).item()
    assert (d - d_ref).norm() / d_ref.norm() < solve_tol(DT, cond, computations=2) + \
        kernel_tol(DT, p, computations=2) * cond


def test_other_consumers_match_the_one_hot_twin():
    """features, feature_variance, layer_traces and low_rank: index factor == one-hot rows."""
    model = BertEmbeddings(v=30, d=3, out=1).to(DT).eval()
    ids = _ids(4, 6, 30, pad=1)
    j = jacobian(model, ids)
    twin = _one_hot_twin(j)
    tol = kernel_tol(DT, j.num_params + 2, computations=2)
    assert rel(features(j, dim=64, seed=3), features(twin, dim=64, seed=3)) < tol
    assert rel(layer_traces(j), layer_traces(twin)) < tol
    assert rel(feature_variance(j, dim=64), feature_variance(twin, dim=64)) < tol
    lr, err = low_rank(j, 2)
    lr2, err2 = low_rank(twin, 2)
    assert rel(err, err2) < 1e-8
    assert rel(gram(lr, mode="trace"), gram(lr2, mode="trace")) < 1e-8


def test_factored_feature_stats_of_index_factor():
    from ntkcore.features import _pair_stats

    model = Emb(v=9, d=2, padding_idx=0, out=1).to(DT).eval()
    j = jacobian(model, _ids(3, 4, 9, pad=0))
    e = j.blocks[0]
    twin = _one_hot_twin(j).blocks[0]
    for factored in (True, False):
        st, st2 = _pair_stats(e, factored), _pair_stats(twin, factored)
        for key in st2:
            assert rel(st[key], st2[key]) < 1e-12, key


def test_index_factor_validation():
    g = torch.zeros(2, 3, 1, 4, dtype=DT)
    with pytest.raises(ValueError, match=r"indices in \[0, 5\]; one_hot=5"):
        KroneckerBlock(torch.tensor([[0, 1, 5], [0, 0, 0]]), g, "e", one_hot=5)
    with pytest.raises(ValueError, match=r"\[-2, 1\]"):
        KroneckerBlock(torch.tensor([[0, 1, -2], [0, 0, 0]]), g, "e", one_hot=5)
    with pytest.raises(TypeError, match="integer dtype"):
        KroneckerBlock(torch.zeros(2, 3, dtype=DT), g, "e", one_hot=5)
    with pytest.raises(ValueError, match=r"shape \(N, S\)"):
        KroneckerBlock(torch.zeros(2, 3, 5, dtype=torch.int64), g, "e", one_hot=5)
    with pytest.raises(ValueError, match="positive int"):
        KroneckerBlock(torch.zeros(2, 3, dtype=torch.int64), g, "e", one_hot=0)
    ok = KroneckerBlock(torch.tensor([[0, 1, 4], [-1, 0, 0]]), g, "e", one_hot=5)
    dense = KroneckerBlock(ok.dense_a(), g, "e")
    with pytest.raises(ValueError, match="index factor"):
        gram(Jacobian([ok]), Jacobian([dense]))


# -- grouped and depthwise convolutions ------------------------------------------------------
def _conv_net(dim, groups, bias, stride, dilation, padding, c=4):
    conv = {1: nn.Conv1d, 2: nn.Conv2d}[dim]
    return nn.Sequential(conv(2, c, 1), nn.Tanh(),
                         conv(c, c, 3, groups=groups, bias=bias, stride=stride,
                              dilation=dilation, padding=padding), nn.Tanh(),
                         nn.Flatten(), nn.LazyLinear(3))


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("groups", [2, 4])  # grouped, depthwise (groups = channels)
@pytest.mark.parametrize("bias", [True, False])
# 7 positions per axis in; out: 7 (1d) / 49 (2d), 3 / 9, 7 / 49, and one position (stride 8)
@pytest.mark.parametrize("geometry", [(1, 1, 1), (2, 1, 0), (1, 2, "same"), (8, 1, 0)])
def test_grouped_and_depthwise_conv(dim, groups, bias, geometry):
    stride, dilation, padding = geometry
    model = _conv_net(dim, groups, bias, stride, dilation, padding)
    x = torch.randn(3, 2, *([7] * dim), dtype=DT)
    model(x.float())  # materialise the LazyLinear
    model = model.to(DT).eval()
    j = jacobian(model, x)
    jd = _dense_checks(model, x, j, reference(model, x))
    _sketch_and_smw_checks(j, jd)


def _sketch_and_smw_checks(j, jd):
    """A Gaussian sketch of the whole Jacobian (blocks J_b Omega_b^T: its Gram against the
    dense sketched Gram) and an SMW solve against a direct one, for the dense float64
    reference jd (N, O, P) in block order."""
    # sketch of the whole Jacobian: blocks J_b Omega_b^T, Gram vs the dense sketched Gram
    js, jsk = sketch_jacobian(j, 40, method="gaussian", seed=2, return_sketch=True)
    mats = []
    for b, sk in zip(j.blocks, jsk.block_sketches, strict=True):
        if sk is None:
            mats.append(torch.eye(b.num_params, dtype=DT))
        elif isinstance(b, KroneckerBlock):
            sk_a, sk_g = sk
            om_a = torch.eye(b.d_in, dtype=DT) if sk_a is None else sk_a.matrix(DT)
            om_g = torch.eye(b.d_out, dtype=DT) if sk_g is None else sk_g.matrix(DT)
            mats.append(torch.kron(om_g, om_a))
        else:
            mats.append(sk.matrix(DT))
    jd_sk = torch.einsum("nop,qp->noq", jd, torch.block_diag(*mats))
    tol = kernel_tol(DT, jd.shape[2] + 2, computations=2)
    assert rel(gram(js, mode="full"), torch.einsum("nop,mqp->nmoq", jd_sk, jd_sk)) < tol
    # SMW against a direct solve
    n, o, p = jd.shape
    u = jd.reshape(n * o, p).T
    g = torch.randn(p, dtype=DT)
    a = 0.5 * torch.eye(p, dtype=DT) + u @ u.T
    d_ref = torch.linalg.solve(a, g)
    cond = torch.linalg.cond(a).item()
    assert (smw_solve(j, g, 0.5) - d_ref).norm() / d_ref.norm() < \
        solve_tol(DT, cond, computations=2) + kernel_tol(DT, p, computations=2) * cond


class _TiedDepthwise(nn.Module):
    """One depthwise convolution applied twice (its calls' gradients add up), then a channel
    multiplier convolution (groups = C_in, C_out = 2 C_in)."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(4, 4, 3, groups=4, padding=1)
        self.mult = nn.Conv2d(4, 8, 3, groups=4, padding=(1, 0), stride=(2, 1), dilation=(1, 2))
        self.head = nn.LazyLinear(3)

    def forward(self, x):
        h = torch.tanh(self.dw(torch.tanh(self.dw(x))))
        return self.head(torch.tanh(self.mult(h)).flatten(1))


def test_tied_and_multiplier_depthwise_dense_blocks(dense_calls):
    """The unfolded-patch GEMM route of grouped 2-d convolutions: calls of a tied layer
    summed, output channels per group > 1, asymmetric stride / dilation / padding."""
    model = _TiedDepthwise()
    x = torch.randn(3, 4, 6, 7, dtype=DT)
    model(x.float())  # materialise the LazyLinear
    model = model.to(DT).eval()
    j = jacobian(model, x)
    assert [type(b).__name__ for b in j.blocks[:2]] == ["DenseBlock", "DenseBlock"]
    assert dense_calls == []
    _dense_checks(model, x, j, reference(model, x))


def test_grouped_conv_dense_block_differentiable_in_x():
    """The GEMM route's block is differentiable in the input (gradcheck of its squared sum:
    the patches and the output gradients both depend on x)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(2, 4, 1), nn.Tanh(), nn.Conv2d(4, 4, 3, groups=4, padding=1),
                          nn.Tanh(), nn.Flatten(), nn.Linear(4 * 16, 2)).to(DT).eval()
    x = torch.randn(2, 2, 4, 4, dtype=DT, requires_grad=True)
    assert isinstance(jacobian(model, x.detach()).blocks[1], DenseBlock)

    def kernel_of(xx):
        jd = jacobian(model, xx).blocks[1].to_dense()
        return (jd * jd).sum()

    assert torch.autograd.gradcheck(kernel_of, (x,))


def test_depthwise_conv_is_a_hook_built_dense_block(dense_calls):
    """A depthwise convolution's block is its (N, O, C k [+ C]) per-sample gradient built from
    the hooks (no torch.func pass): at every real size it is smaller, and its Gram cheaper,
    than any Kronecker form (docs/concepts.md, "Grouped convolutions")."""
    seen = dense_calls
    model = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8, padding=1), nn.Tanh(),
                          nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(8 * 36, 2)).to(DT).eval()
    x = torch.randn(2, 8, 6, 6, dtype=DT)
    j = jacobian(model, x)
    assert isinstance(j.blocks[0], DenseBlock) and j.blocks[0].num_params == 8 * 9 + 8
    assert seen == []
    _dense_checks(model, x, j, reference(model, x))


def test_float32_index_factor_kernel():
    """float32 factors against the float64 reference (tolerance from the fan-ins)."""
    model = BertEmbeddings().eval()
    ids = _ids(4, 6, 50, pad=1)
    j32 = jacobian(model, ids)
    model64 = BertEmbeddings().to(DT).eval()
    model64.load_state_dict({k: v.to(DT) for k, v in model.state_dict().items()})
    jd = to_block_order(model64, jacobian(model64, ids), reference(model64, ids))
    k_ref = torch.einsum("nop,mop->nm", jd, jd)
    k = gram(j32, mode="trace")
    assert k.dtype == torch.float32
    # first order (tests/tolerances.py): an entry of the float32 Jacobian sums the fan-ins
    # forward (3 embeddings, LayerNorm mean and variance over d = 4 plus its rsqrt and
    # division, the head's 4, the mean over T = 6) and the fan-outs backward (2 outputs, the
    # LayerNorm's 4 + 4, T = 6), twice in a product; the Gram sums P products on top
    n = 2 * ((3 + 4 + 4 + 2 + 4 + 6) + (2 + 4 + 4 + 6))
    tol = kernel_tol(torch.float32, n) + kernel_tol(torch.float32, jd.shape[2] + 2)
    assert rel(k.double(), k_ref) < tol
    np.testing.assert_array_equal(k.numpy(), k.numpy().T)


@pytest.mark.parametrize("stride", [8, 1])  # one position (outer products), 49 (einsum)
def test_patch_factor_dense_block_on_a_graph(stride):
    """With x on an autograd graph the patch-factor route builds its block by ``einsum``
    (no ``out=`` writes): its values equal the dense float64 reference, the same as the
    written-once block of a detached x, and it passes ``gradcheck`` in x."""
    torch.manual_seed(4)
    # 16 channels: the dense block is smaller than the group-position factors also at one
    # position (_dense_is_smaller)
    model = nn.Sequential(nn.Conv2d(2, 16, 1), nn.Tanh(),
                          nn.Conv2d(16, 16, 5, groups=16, padding=2, stride=stride), nn.Tanh(),
                          nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(2, 2, 7, 7, dtype=DT)
    model(x.float())  # materialise the LazyLinear
    model = model.to(DT).eval()
    j0 = jacobian(model, x)
    assert isinstance(j0.blocks[1], DenseBlock)
    xg = x.clone().requires_grad_(True)
    jg = jacobian(model, xg)
    assert jg.blocks[1].jac.requires_grad
    ref = to_block_order(model, jg, reference(model, x))
    tol = kernel_tol(DT, j0.num_params, computations=2)
    assert rel(jg.to_dense().detach(), ref) < tol
    assert rel(j0.to_dense(), ref) < tol

    def kernel_of(xx):
        jd = jacobian(model, xx).blocks[1].to_dense()
        return (jd * jd).sum()

    assert torch.autograd.gradcheck(kernel_of, (xg,))


class _WideKernelGrouped(nn.Module):
    """A grouped convolution of a kernel wider than 3 x 3 (the convolution route's domain),
    called once or twice (tied: its calls' gradients add up)."""

    def __init__(self, dim, c_in, c_out, groups, kernel, bias, tied, **geometry):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        self.inp = conv(2, c_in, 1)
        self.conv = conv(c_in, c_out, kernel, groups=groups, bias=bias, **geometry)
        self.back = conv(c_out, c_in, 1) if tied else None
        self.head = nn.LazyLinear(2)

    def forward(self, x):
        h = torch.tanh(self.conv(torch.tanh(self.inp(x))))
        if self.back is not None:
            h = torch.tanh(self.conv(torch.tanh(self.back(h))))
        return self.head(h.flatten(1))


# at least 64 output positions a call (GROUPED_CONV_MIN_POSITIONS), also in a tied second call
@pytest.mark.parametrize(("dim", "c_in", "c_out", "groups", "kernel", "size", "geometry"), [
    (2, 6, 6, 6, 5, 8, {"padding": 2}),  # depthwise 5 x 5, 64 positions
    (2, 4, 8, 4, 7, 8, {"padding": 3}),  # channel multiplier 2, 7 x 7
    (2, 4, 8, 2, (5, 3), 19, {"padding": (2, 1), "stride": (2, 1), "dilation": (1, 2)}),
    (2, 4, 4, 4, 4, 8, {"padding": "same"}),  # even kernel: padding 1 before, 2 after
    (2, 4, 4, 4, 3, 8, {"padding": 1, "padding_mode": "reflect"}),
    (1, 6, 6, 3, 11, 64, {"padding": 5, "dilation": 1}),
    (3, 3, 3, 3, (3, 3, 2), 4, {"padding": (1, 1, 2)}),  # 18 taps, 4 x 4 x 5 positions
])
@pytest.mark.parametrize(("bias", "tied"), [(True, False), (False, True)])
def test_grouped_conv_dense_block_by_convolution(dim, c_in, c_out, groups, kernel, size,
                                                 geometry, bias, tied, monkeypatch, dense_calls):
    """A grouped convolution's dense block formed as the weight gradient of one convolution
    with N G groups (``_grouped_conv_weights``; taken: spied) equals the dense float64
    torch.func reference, also through its Grams, J v, J^T c, a sketch and an SMW solve."""
    from ntkcore.backends import torch_layers

    taken = []
    real = torch_layers._grouped_conv_weights
    monkeypatch.setattr(torch_layers, "_grouped_conv_weights",
                        lambda *a, **k: taken.append(a[4]) or real(*a, **k))
    model = _WideKernelGrouped(dim, c_in, c_out, groups, kernel, bias, tied, **geometry)
    x = torch.randn(3, 2, *([size] * dim), dtype=DT)
    model(x.float())  # materialise the LazyLinear
    model = model.to(DT).eval()
    j = jacobian(model, x)
    assert taken == ["conv"] and dense_calls == []
    b = next(b for b in j.blocks if b.name == "conv")
    k = math.prod(kernel) if isinstance(kernel, tuple) else kernel ** dim
    assert isinstance(b, DenseBlock) and b.columns is None
    assert b.num_params == c_out * c_in // groups * k + c_out * bias
    jd = _dense_checks(model, x, j, reference(model, x))
    _sketch_and_smw_checks(j, jd)


def test_grouped_conv_by_convolution_float32():
    """The convolution route in float32 against the float64 reference: first-order error
    from the fan-ins (tests/tolerances.py)."""
    model = _WideKernelGrouped(2, 8, 8, 8, 7, True, False, padding=3)
    x = torch.randn(4, 2, 8, 8, dtype=DT)
    model(x.float())
    model64 = model.to(DT).eval()
    model32 = _WideKernelGrouped(2, 8, 8, 8, 7, True, False, padding=3)
    model32(x.float())
    model32.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    j32 = jacobian(model32.eval(), x.float())
    assert j32.blocks[1].jac.dtype == torch.float32
    jd = to_block_order(model64, jacobian(model64, x), reference(model64, x))
    # an entry sums 49 taps x 64 positions in the weight gradient, the 1 x 1 inputs' 2, the
    # head's 512 fan-in backward; the Gram sums P products on top
    tol = kernel_tol(torch.float32, 2 * (49 + 64 + 2 + 512)) + kernel_tol(torch.float32,
                                                                          jd.shape[2])
    assert rel(gram(j32, mode="trace").double(), torch.einsum("nop,mop->nm", jd, jd)) < tol


# -- kernel taps that read only zero padding -------------------------------------------------
def _tap_reads(conv, sizes):
    """Reference for ``live_taps``: torch's own convolution backward.  The weight gradient of
    sum(conv(ones)) counts, per tap, the input elements (not padding) it reads over all output
    positions and channels; a tap is live iff that count is positive for some call."""
    reads = 0
    for size in sizes:
        w = conv.weight.detach().clone().requires_grad_(True)
        x = torch.ones(1, conv.in_channels, *size, dtype=w.dtype)
        y = conv._conv_forward(x, w, None)
        (g,) = torch.autograd.grad(y.sum(), w)
        reads = reads + g.sum(dim=(0, 1))
    return (reads > 0).flatten()


def _stored_taps(conv, sizes):
    """What ``live_taps`` promises for several calls: the product over the axes of the union,
    over the calls, of each call's live taps projected on the axis (from :func:`_tap_reads`
    of that call alone; a call that reads nothing adds nothing)."""
    k = conv.kernel_size
    union = [torch.zeros(ki, dtype=torch.bool) for ki in k]
    for size in sizes:
        r = _tap_reads(conv, [size]).reshape(k)
        for i in range(len(k)):
            union[i] |= r.any(dim=tuple(a for a in range(len(k)) if a != i)) if len(k) > 1 \
                else r
    out = union[0]
    for u in union[1:]:
        out = (out[..., None] & u).flatten()
    return out


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(("dim", "kernel", "stride", "dilation", "padding", "sizes"), [
    (2, 5, 1, 1, 2, [(1, 1)]),  # a 5 x 5 kernel on a 1 x 1 map: the centre tap alone
    (2, 5, 1, 1, 2, [(2, 2)]),  # 3 x 3 of the 25 taps
    (2, 3, 1, 1, 1, [(1, 1)]),
    (2, 3, 2, 1, 1, [(2, 2)]),  # one output position, stride 2: 2 x 2 taps
    (2, (3, 5), (1, 2), (2, 1), (2, 2), [(1, 3)]),
    (2, 3, 1, 2, "same", [(1, 2)]),
    (2, 4, 1, 1, "same", [(1, 1)]),  # even kernel: the extra zero on the right
    (2, 5, 1, 1, 2, [(1, 1), (4, 4)]),  # two calls: the union (all live at 4 x 4)
    (2, 3, 1, 1, 0, [(3, 3)]),  # no padding: all live
    (2, 3, 1, 1, "valid", [(5, 5)]),
    (1, 7, 1, 1, 3, [(2,)]),
    (3, 3, 1, 1, 1, [(1, 2, 3)]),
    (2, 5, 2, 1, 4, [(1, 1)]),  # taps 0, 2, 4 per axis: live taps with gaps
    # two calls, one reading nothing along its second axis: it adds no taps (was taps 1-3)
    (2, (5, 1), (1, 2), 1, (2, 1), [(1, 2), (2, 1)]),
])
def test_live_taps_match_the_convolution_backward(dim, kernel, stride, dilation, padding, sizes):
    from ntkcore.backends.torch_layers import live_taps

    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim](
        3, 3, kernel, stride=stride, dilation=dilation, padding=padding, groups=3).to(DT)
    ref = _tap_reads(conv, sizes)
    got = live_taps(conv, sizes)
    if bool(ref.all()):
        assert got is None
    else:
        assert torch.equal(got, ref)


def test_live_taps_need_zero_padding():
    """Reflect / replicate / circular padding reads real values at every tap."""
    from ntkcore.backends.torch_layers import live_taps

    for mode in ("reflect", "replicate", "circular"):
        conv = nn.Conv2d(2, 2, 3, padding=1, groups=2, padding_mode=mode)
        assert live_taps(conv, [(1, 1)]) is None
    assert live_taps(nn.Conv2d(2, 2, 3, padding=1, groups=2), [(1, 1)]) is not None


class _SmallMapDepthwise(nn.Module):
    """Depthwise convolutions on maps smaller than their kernels' reach (CIFAR-sized inputs
    deep in an EfficientNet / MobileNet), called once or twice (tied)."""

    def __init__(self, c=20, kernel=5, bias=True, tied=False, stride=1, padding=None):
        super().__init__()
        self.inp = nn.Conv2d(2, c, 1)
        self.dw = nn.Conv2d(c, c, kernel, padding=kernel // 2 if padding is None else padding,
                            stride=stride, groups=c, bias=bias)
        self.head = nn.LazyLinear(2)
        self.tied = tied

    def forward(self, x):
        h = torch.tanh(self.dw(torch.tanh(self.inp(x))))
        if self.tied:
            h = torch.tanh(self.dw(h))
        return self.head(h.flatten(1))


@pytest.mark.parametrize(("kernel", "size", "live", "bias", "tied", "stride", "padding"), [
    (5, 1, 1, True, False, 1, None), (5, 1, 1, False, False, 1, None),
    (3, 1, 1, True, False, 1, None), (5, 2, 9, True, False, 1, None),
    (5, 2, 9, False, True, 1, None),
    (5, 1, 9, True, False, 2, 4),  # taps 0, 2, 4 per axis (gaps), 3 x 3 outputs
])
def test_depthwise_dense_block_stores_live_taps_only(kernel, size, live, bias, tied, stride,
                                                      padding, dense_calls):
    """The depthwise block stores the live taps' columns (and the bias) only, and the
    Jacobian, Grams (all routes, a cross kernel), J v, J^T c, a sketch and an SMW solve equal
    those of the dense float64 torch.func reference, whose other columns are zeros."""
    model = _SmallMapDepthwise(kernel=kernel, bias=bias, tied=tied, stride=stride,
                               padding=padding)
    x = torch.randn(3, 2, size, size, dtype=DT)
    model(x.float())  # materialise the LazyLinear
    model = model.to(DT).eval()
    j = jacobian(model, x)
    b = j.blocks[1]
    c = 20
    assert isinstance(b, DenseBlock) and b.columns is not None
    assert (b.num_params, b.num_stored) == (c * kernel**2 + c * bias, c * live + c * bias)
    assert dense_calls == []
    jd = _dense_checks(model, x, j, reference(model, x))
    p = jd.shape[2]
    # the columns not stored are zero in the reference
    mask = torch.ones(p, dtype=torch.bool)
    start = j.blocks[0].num_params
    mask[start + b.columns] = False
    mask[:start] = False
    mask[start + b.num_params:] = False
    assert jd[..., mask].abs().max().item() == 0.0
    _sketch_and_smw_checks(j, jd)


def test_live_tap_block_differentiable_in_x():
    """The stored-columns block on a graph (einsum route, then ``to_dense``'s scatter) is
    differentiable in the input: gradcheck of the squared sum."""
    torch.manual_seed(5)
    model = _SmallMapDepthwise(kernel=5).to(DT)
    model(torch.randn(1, 2, 1, 1, dtype=DT))
    model = model.eval()
    x = torch.randn(2, 2, 1, 1, dtype=DT, requires_grad=True)
    assert jacobian(model, x.detach()).blocks[1].columns is not None

    def kernel_of(xx):
        jd = jacobian(model, xx).blocks[1].to_dense()
        return (jd * jd).sum()

    assert torch.autograd.gradcheck(kernel_of, (x,))


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_live_taps_property(data):
    """Random 1-d / 2-d geometries (kernel, stride, dilation, padding or "same", input sizes,
    one or two calls): ``live_taps`` equals the convolution-backward reference."""
    from ntkcore.backends.torch_layers import live_taps

    dim = data.draw(st.sampled_from([1, 2]))
    kernel = tuple(data.draw(st.integers(1, 6)) for _ in range(dim))
    dilation = tuple(data.draw(st.integers(1, 3)) for _ in range(dim))
    same = data.draw(st.booleans())
    stride = (1,) * dim if same else tuple(data.draw(st.integers(1, 3)) for _ in range(dim))
    padding = "same" if same else tuple(data.draw(st.integers(0, 5)) for _ in range(dim))
    conv = {1: nn.Conv1d, 2: nn.Conv2d}[dim](2, 2, kernel, stride=stride, dilation=dilation,
                                             padding=padding, groups=2).to(DT)
    sizes = []
    for _ in range(data.draw(st.integers(1, 2))):
        size = []
        for i in range(dim):
            pad = 2 * (0 if same else padding[i])
            least = max(1, dilation[i] * (kernel[i] - 1) + 1 - pad)  # one output position
            size.append(data.draw(st.integers(least, least + 5)))
        sizes.append(tuple(size))
    reads = _tap_reads(conv, sizes)
    ref = _stored_taps(conv, sizes)
    got = live_taps(conv, sizes)
    assert (got is None) == bool(ref.all())
    got = torch.ones_like(ref) if got is None else got
    assert torch.equal(got, ref)
    assert bool((got | ~reads).all())  # no tap that reads the input is dropped
    if len(sizes) == 1:
        assert torch.equal(ref, reads)
