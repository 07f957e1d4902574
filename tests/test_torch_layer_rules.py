"""A layer rule added in the test itself (``torch_layers.RULES``, one entry): the provider,
the kernels, the features, the sketches and SENG use it with no other edit.

``MyLinear`` (a Kronecker rule) and ``Scale`` (a dense, reduced-pass rule) are custom
``nn.Module`` subclasses that no rule of ntkcore covers; the references are ``torch.func``
dense Jacobians in float64.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ntkcore  # noqa: E402
from ntkcore import DenseBlock, KroneckerBlock  # noqa: E402
from ntkcore.backends import torch_layers  # noqa: E402
from ntkcore.backends.torch_jacobian import jacobian, to_block_order  # noqa: E402
from ntkcore.backends.torch_layers import LayerRule, with_ones  # noqa: E402
from ntkcore.sketch import sketch_jacobian  # noqa: E402
from tests.test_torch_provider import dense_reference, reference, rel  # noqa: E402

nn = torch.nn
DT = torch.float64


class MyLinear(nn.Module):
    """y = x W^T + b, written by hand."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in, dtype=DT) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.randn(d_out, dtype=DT))

    def forward(self, x):
        return x @ self.weight.T + self.bias


class Scale(nn.Module):
    """y = x * w along the last axis."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + torch.randn(d, dtype=DT) / 4)

    def forward(self, x):
        return x * self.weight


class MyLinearRule(LayerRule):
    """A KroneckerBlock [W | b] with a = [x, 1] over the positions, as ``nn.Linear``."""

    def sample_axis_ok(self, mod, axis, ndim):
        return axis != ndim - 1

    def kronecker_update(self, mod):
        return True

    def block(self, mod, inputs, gs, n, name, weight, bias):
        a = torch.cat([x.reshape(n, -1, x.shape[-1]) for x in inputs], 1)
        if not weight:
            a = a.new_ones((*a.shape[:2], 1))
        elif bias:
            a = with_ones(a)
        return KroneckerBlock(a.contiguous(), torch.cat(gs, 1), name)


class ScaleRule(LayerRule):
    r"""A DenseBlock :math:`J[n, o, c] = \sum_s g[n, s, o, c]\, x[n, s, c]`, reduced pass by
    pass."""

    def sample_axis_ok(self, mod, axis, ndim):
        return axis != ndim - 1

    def reducer(self, mod, a, n, weight, bias):
        x = a.reshape(n, -1, a.shape[-1])
        return lambda g: torch.einsum("nsoc,nsc->noc", g, x)

    def block(self, mod, inputs, gs, n, name, weight, bias):
        return DenseBlock(sum(g.sums for g in gs), name)


class Net(nn.Module):
    def __init__(self, o: int) -> None:
        super().__init__()
        self.lin = MyLinear(4, 5)
        self.scale = Scale(5)
        self.head = nn.Linear(15, o).double()

    def forward(self, x):  # x (N, 3, 4): three positions per sample
        return self.head(self.scale(torch.tanh(self.lin(x))).flatten(1))


@pytest.fixture
def rules(monkeypatch):
    monkeypatch.setitem(torch_layers.RULES, MyLinear, MyLinearRule())
    monkeypatch.setitem(torch_layers.RULES, Scale, ScaleRule())


def _kernel(j):
    return torch.einsum("nok,mpk->nmop", j, j)


@pytest.mark.parametrize(("o", "backward"), [(1, "auto"), (2, "auto"), (4, "batched"),
                                             (4, "loop")])
def test_toy_rules_give_exact_blocks(rules, dense_calls, o, backward):
    torch.manual_seed(0)
    model, x = Net(o), torch.randn(6, 3, 4, dtype=DT)
    j = jacobian(model, x, backward=backward)
    assert [type(b).__name__[0] for b in j.blocks] == ["K", "D", "K"]
    assert dense_calls == []  # no torch.func pass
    ref = reference(model, x)
    assert rel(j.to_dense(), to_block_order(model, j, ref)) < 1e-12
    k_ref = _kernel(dense_reference(ref))
    assert rel(torch.as_tensor(ntkcore.ntk(model, x)), k_ref) < 1e-12
    assert rel(torch.as_tensor(ntkcore.gram(j)), k_ref) < 1e-12


def test_toy_rules_in_features_and_sketches(rules, dense_calls):
    torch.manual_seed(1)
    model, x = Net(2), torch.randn(5, 3, 4, dtype=DT)
    j = jacobian(model, x)
    k_ref = torch.einsum("nok,mok->nm", *[dense_reference(reference(model, x))] * 2)
    # features of the model are those of its Jacobian, and estimate the trace kernel
    phi = torch.as_tensor(ntkcore.features(model, x, dim=4000, seed=3))
    # (the model's in provider calls of 1 + 4 samples: the factors round as another batch's)
    assert rel(phi, torch.as_tensor(ntkcore.features(j, dim=4000, seed=3))) < 1e-12
    assert rel(phi @ phi.T, k_ref) < 0.2
    # a sketch keeping every parameter is exact; a smaller one estimates the kernel
    full = sketch_jacobian(j, j.num_params, method="uniform", replace=False, seed=0)
    assert rel(torch.as_tensor(ntkcore.gram(full, mode="trace")), k_ref) < 1e-12
    est = [torch.as_tensor(ntkcore.gram(sketch_jacobian(j, 40, seed=s), mode="trace"))
           for s in range(200)]
    assert rel(sum(est) / len(est), k_ref) < 0.2
    assert dense_calls == []


def test_seng_updates_a_toy_layer_as_a_linear(rules):
    from ntkcore.backends.torch_seng import SENG

    def run(model):
        opt = SENG(model, lr=0.1, damping=0.5)
        torch.manual_seed(2)
        x, y = torch.randn(8, 3, 4, dtype=DT), torch.randint(0, 2, (8,))
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return opt, [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    toy = Net(2)
    twin = Net(2)
    twin.load_state_dict(toy.state_dict())
    lin = nn.Linear(4, 5).double()
    lin.load_state_dict(toy.lin.state_dict())
    twin.lin = lin  # torch's Linear, same weights: a rule tested elsewhere
    opt, got = run(toy)
    assert "lin" in [u.name for u in opt.units]  # a Kronecker unit by its rule
    _, want = run(twin)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
