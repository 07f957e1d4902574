"""SENG on layers whose input has no sample axis, or has it elsewhere than axis 0 (issue 15,
item 1, for the optimizer).

SENG's hooks see each Linear call's input; a length equal to N proves nothing about the sample
axis: a positional table ``proj(pos(arange(T)))`` or a fixed buffer (T, d) fed to a Linear has
first length N whenever T == N, and a sequence-first (T, N, d) tensor
(``nn.TransformerEncoderLayer`` with ``batch_first=False``) leads with T.  Each step is compared
with a dense float64 damped natural-gradient step whose per-sample loss gradients come from
``torch.func`` (``vmap(grad)``, independent of hooks and factors), for T == N and T != N.

Tolerance: as ``tests/test_seng.py`` (rtol 1e-9 on parameters of order one: the damped
systems here have condition numbers below 1e3 and a few hundred unknowns, so float64 solves
agree to far better than that; a wrong sample axis gives errors of order 1e-2 and more).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402

from ntkcore.backends.torch import SENG  # noqa: E402
from tests.sample_axis_models import Buffer, BufferConv, SeqFirst  # noqa: E402

DT = torch.float64
LAM = 0.5
LR = 0.3


class PosProj(nn.Module):
    """Token embedding (dense) + a Linear on the positional table ``pos(arange(T))``, which has
    no sample axis, + a Linear head on (N, T, d) (sample axis 0)."""

    def __init__(self, t: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 4)
        self.pos = nn.Embedding(t, 4)
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, i):
        h = self.tok(i) + self.proj(self.pos(torch.arange(i.shape[1])))
        return self.out(torch.tanh(h)).mean(1)






class SeqFirstMLP(nn.Module):
    """Only Linears, all on a sequence-first (T, N, d) tensor: Kronecker on the moved axis."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):  # x (N, T, d)
        return self.b(torch.tanh(self.a(x.transpose(0, 1)))).mean(0)




class TiedHead(nn.Module):
    """A Linear head whose weight is the Embedding table (tied): the Linear's hooked call is
    only one of the weight's two uses; and two Linears sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(3, 4)
        self.h = nn.Linear(4, 3)
        self.h.weight = self.e.weight
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, i):  # i (N, T)
        return self.h(torch.tanh(self.b(torch.tanh(self.a(self.e(i))))).mean(1))


# (model factory, input factory (n, t) -> x, T)
CASES = {
    "positional_table": (PosProj, lambda n, t: torch.randint(0, 11, (n, t)), 6),
    "buffer": (Buffer, lambda n, t: torch.randn(n, t, dtype=DT), 5),
    "seq_first_transformer": (SeqFirst, lambda n, t: torch.randn(n, t, 4, dtype=DT), 5),
    "seq_first_linears": (SeqFirstMLP, lambda n, t: torch.randn(n, t, 4, dtype=DT), 5),
    "buffer_conv": (BufferConv, lambda n, t: torch.randn(n, 6, dtype=DT), 5),
    "tied_head": (TiedHead, lambda n, t: torch.randint(0, 3, (n, t)), 4),
}


def _make(case, seed=0):
    make, inp, t = CASES[case]
    torch.manual_seed(seed)
    return make().to(DT).eval(), inp, t


def _module_groups(model):
    """SENG's blocks: weight and bias of each Linear / Conv (a tied weight goes with the
    Linear), then the parameters registered directly on each other module."""
    name_of = {id(p): k for k, p in model.named_parameters()}
    groups: dict[str, list[str]] = {}
    taken: set[str] = set()
    for path, mod in model.named_modules():
        if isinstance(mod, nn.Linear | nn.Conv1d):
            names = [name_of[id(q)] for q in (mod.weight, mod.bias)]
            if not taken.intersection(names):
                groups[path] = names
                taken.update(names)
    for name in name_of.values():
        if name not in taken:
            groups.setdefault("dense:" + name.rpartition(".")[0], []).append(name)
    return groups


def reference_step(model, x, y, lam=LAM, lr=LR):
    """theta - lr * d per block, (lam I + U^T U / N) d = mean of the per-sample gradients, with
    U (N, P_b) the per-sample loss gradients from vmap(grad) in float64."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss1(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    ps = vmap(grad(loss1), in_dims=(None, 0, 0))(params, x, y)
    n = x.shape[0]
    out = {}
    for names in _module_groups(model).values():
        u = torch.cat([ps[k].reshape(n, -1) for k in names], dim=1)
        g = u.mean(0)
        d = torch.linalg.solve(lam * torch.eye(u.shape[1], dtype=DT) + u.T @ u / n, g)
        start = 0
        for k in names:
            size = params[k].numel()
            out[k] = params[k] - lr * d[start:start + size].reshape(params[k].shape)
            start += size
    return out


def _seng_step(model, x, y, **kw):
    opt = SENG(model, lr=LR, damping=LAM, **kw)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return opt


def _assert_step(model, expected):
    for k, v in model.named_parameters():
        torch.testing.assert_close(v.detach(), expected[k], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("same", [True, False], ids=["N==T", "N!=T"])
def test_step_equals_dense_reference(case, same):
    """T == N (a shared input's length looks like a sample axis) and T != N (before the fix:
    wrong updates, or shape errors deep in the Kronecker products)."""
    model, inp, t = _make(case)
    n = t if same else t + 3
    x = inp(n, t)
    y = torch.randint(0, 3, (n,))
    expected = reference_step(model, x, y)
    _seng_step(model, x, y)
    _assert_step(model, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_one_sample_step(case):
    """N == 1 (the probe then runs on 2 samples)."""
    model, inp, t = _make(case)
    x = inp(1, t)
    y = torch.randint(0, 3, (1,))
    expected = reference_step(model, x, y)
    _seng_step(model, x, y)
    _assert_step(model, expected)


def test_blocks_kronecker_where_the_sample_axis_exists():
    """The moved axis keeps the Kronecker structure (positions = tokens); the shared input and
    the weight used outside its Linear's forward go through torch.func (dense)."""
    from ntkcore import DenseBlock, KroneckerBlock

    model, inp, t = _make("seq_first_transformer")
    x, y = inp(t, t), torch.randint(0, 3, (t,))
    opt = _seng_step(model, x, y)
    kinds = {k: type(b) for k, b in opt._curvature.items()}
    assert kinds["enc.linear1"] is KroneckerBlock and kinds["enc.linear2"] is KroneckerBlock
    assert opt._curvature["enc.linear1"].explicit_a().shape == (t, t, 5)  # (N, T, d_in + 1)
    assert kinds["o"] is KroneckerBlock
    assert kinds["enc.self_attn.out_proj"] is DenseBlock
    model, inp, t = _make("positional_table")
    opt = _seng_step(model, inp(t, t), torch.randint(0, 3, (t,)))
    assert isinstance(opt._curvature["proj"], DenseBlock)
    assert isinstance(opt._curvature["out"], KroneckerBlock)


def test_several_steps_with_update_freq_and_new_shapes():
    """Refreshes and cached steps over batches of different N and T, each compared with the
    dense reference on a refresh step."""
    model, inp, _ = _make("positional_table", seed=3)
    opt = SENG(model, lr=LR, damping=LAM, update_freq=2)
    for n, t in ((6, 6), (6, 6), (4, 6), (4, 6), (5, 3), (5, 3), (6, 6)):
        x, y = inp(n, t), torch.randint(0, 3, (n,))
        refresh = opt._step % 2 == 0
        expected = reference_step(model, x, y) if refresh else None
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if refresh:
            _assert_step(model, expected)


def test_probe_runs_once_per_shape_signature():
    """The probe (a forward on p != N samples) runs on the first refresh of each input shape
    signature only; its answer is cached."""
    # only Linears on a moved sample axis: no torch.func pass, so every forward after the
    # user's own is a probe
    model, inp, _ = _make("seq_first_linears")
    sizes: list[int] = []
    model.register_forward_pre_hook(lambda m, args: sizes.append(int(args[0].shape[0])))
    opt = SENG(model, lr=LR, damping=LAM)
    batches = [(6, 6), (6, 6), (6, 6), (4, 6), (4, 6), (6, 3), (6, 3), (6, 6), (1, 3), (1, 3)]
    probes = []
    for n, t in batches:
        x, y = inp(n, t), torch.randint(0, 3, (n,))
        opt.zero_grad()
        sizes.clear()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        probes.append([s for s in sizes[1:]])  # forwards after the user's own
    # new signatures: (6, 6), (4, 6), (6, 3), (1, 3); a probe runs on 1 sample (2 when N = 1)
    assert probes == [[1], [], [], [1], [], [1], [], [], [2], []], probes
    assert opt._probes == 4


def test_probe_failure_is_loud():
    """A model that cannot run on fewer samples (a hard-coded batch size) cannot have its
    sample axes determined: a clear ValueError, parameters unchanged."""

    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 4)
            self.b = nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)).reshape(6, 4))

    torch.manual_seed(0)
    model = Fixed().to(DT)
    opt = SENG(model, lr=LR, damping=LAM)
    x = torch.randn(6, 3, dtype=DT)
    nn.functional.cross_entropy(model(x), torch.randint(0, 2, (6,))).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="sample ax"):
        opt.step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before,
                                                          strict=True))


def test_attention_only_and_unused_linear():
    """The only Linears are ``nn.MultiheadAttention.out_proj`` (weight used outside its
    forward: never hooked) and one that is never called: both go through torch.func (before:
    "no captured gradients for layer 'att.out_proj'")."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(4, 2)
            self.ln = nn.LayerNorm(4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):  # x (N, T, 4), attention over T in sequence-first layout
            h = x.transpose(0, 1)
            return self.ln(self.att(h, h, h, need_weights=False)[0]).mean(0)[:, :3]

    torch.manual_seed(0)
    model = M().to(DT)
    x, y = torch.randn(5, 5, 4, dtype=DT), torch.randint(0, 3, (5,))
    expected = reference_step(model, x, y)
    _seng_step(model, x, y)
    _assert_step(model, expected)


class BufferDropout(Buffer):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.b(self.drop(x @ torch.tanh(self.a(self.z))))


def test_dropout_with_a_shared_input_layer_is_loud():
    """A Linear without a sample axis needs the torch.func pass, which cannot replay a
    Dropout mask: a ValueError naming both, parameters unchanged."""
    torch.manual_seed(0)
    model = BufferDropout().to(DT).train()
    opt = SENG(model, lr=LR, damping=LAM)
    x = torch.randn(5, 5, dtype=DT)
    nn.functional.cross_entropy(model(x), torch.randint(0, 3, (5,))).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'drop' is a Dropout.*layer 'a'.*no sample axis"):
        opt.step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before,
                                                          strict=True))


def test_probe_leaves_the_random_stream_unchanged():
    """The probe forward runs Dropout too, on a forked RNG: the user's random stream after
    step() is the one without SENG's probe."""
    torch.manual_seed(0)
    model = nn.Sequential(SeqFirstMLP(), nn.Dropout(0.3)).to(DT).train()
    opt = SENG(model, lr=LR, damping=LAM)
    x = torch.randn(5, 5, 4, dtype=DT)
    nn.functional.cross_entropy(model(x), torch.randint(0, 3, (5,))).backward()
    state = torch.get_rng_state()
    opt.step()
    assert opt._probes == 1
    assert torch.equal(torch.get_rng_state(), state)
