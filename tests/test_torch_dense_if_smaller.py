"""``jacobian(..., dense_if_smaller=True)``: a linear layer or ungrouped convolution whose
per-sample gradient is no larger than its Kronecker factors comes as that DenseBlock, reduced
pass by pass (``ntkcore.jacobian.dense_is_smaller``, ``LayerRule.gradient_sums``), and
``ntkcore.ntk`` asks for it.  References: ``torch.func`` Jacobians in float64."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import ntkcore  # noqa: E402
from ntkcore import DenseBlock, KroneckerBlock  # noqa: E402
from ntkcore.backends import torch_jacobian  # noqa: E402
from ntkcore.backends.torch_jacobian import from_block_order, jacobian, to_block_order  # noqa: E402
from ntkcore.jacobian import dense_is_smaller  # noqa: E402
from tests.test_torch_provider import dense_reference, reference, rel  # noqa: E402
from tests.tolerances import kernel_tol  # noqa: E402

nn = torch.nn
DT = torch.float64


class Tokens(nn.Module):
    """A linear layer over 64 positions, O = 1: its dense gradient (3 x 5) is smaller than
    its factors (64 x (5 + 3))."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)).mean(1))


class Tied(nn.Module):
    """One convolution called twice (its calls' positions add up)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y = self.conv(torch.tanh(self.conv(x)))
        return self.head(y.mean((2, 3)))


def _stem() -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(4, 4, 3, stride=2), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * 7 * 7, 3))


MODELS = {
    # (model, per-sample input shape, blocks expected dense); S > O C_out: the per-pass
    # grouped convolution (torch_layers._grouped_weight_gradient)
    "stem": (_stem, (4, 16, 16), {"0", "2"}),
    "reflect_dilated": (lambda: nn.Sequential(
        nn.Conv2d(4, 3, 3, padding=2, dilation=2, padding_mode="reflect", bias=False),
        nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2)), (4, 12, 12), {"0"}),
    "conv1d_same": (lambda: nn.Sequential(
        nn.Conv1d(8, 3, 4, padding="same"), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 20, 2)),
        (8, 20), {"0"}),
    "conv3d": (lambda: nn.Sequential(
        nn.Conv3d(4, 2, 2, stride=(1, 2, 2)), nn.Tanh(), nn.Flatten(),
        nn.Linear(2 * 5 * 3 * 3, 2)), (4, 6, 6, 6), {"0"}),
    # S > O C_out and C_in prod(k) = 27 < GROUPED_WEIGHT_MIN_WIDTH: declined, factors kept
    "declined": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(),
                                       nn.Linear(4 * 6 * 6, 2)), (3, 8, 8), set()),
    # S <= O C_out: the patches formed once (F.unfold; conv_patches for circular padding)
    "patches": (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(),
                                      nn.Linear(8, 3)), (1, 4, 4), {"0"}),
    "patches_circular": (lambda: nn.Sequential(
        nn.Conv1d(1, 2, 3, padding=1, padding_mode="circular"), nn.Tanh(), nn.Flatten(),
        nn.Linear(8, 3)), (1, 4), {"0"}),
    "pointwise": (lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.Tanh(), nn.Flatten(),
                                        nn.Linear(3 * 8 * 8, 2)), (2, 8, 8), {"0"}),
    "tokens": (Tokens, (64, 4), {"lin", "head"}),  # head: O d_out d_in = 4 <= 1 (4 + 1)
    "tied": (Tied, (4, 8, 8), {"conv"}),
}


def _widths(mod: nn.Module, weight: bool, bias: bool) -> tuple[int, int]:
    """(d_in with the ones column, d_out), written out here for the two layer types."""
    if isinstance(mod, nn.Linear):
        d_in, d_out = mod.in_features, mod.out_features
    else:
        d_in, d_out = mod.in_channels * math.prod(mod.kernel_size), mod.out_channels
    return (d_in + int(bias) if weight else 1), d_out


def _built(name: str, n: int = 3) -> tuple[nn.Module, torch.Tensor]:
    make, shape, _ = MODELS[name]
    torch.manual_seed(0)
    return make().to(DT).eval(), torch.randn(n, *shape, dtype=DT)


@pytest.mark.filterwarnings("ignore:Using padding=.same.:UserWarning")
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("backward", ["loop", "batched"])
def test_dense_blocks_equal_torch_func(name, backward):
    model, x = _built(name)
    j = jacobian(model, x, dense_if_smaller=True, backward=backward)
    kinds = {b.name: type(b) for b in j.blocks}
    assert {k for k, t in kinds.items() if t is DenseBlock} == MODELS[name][2]
    assert jacobian(model, x).nbytes >= j.nbytes  # the dense blocks are the smaller form
    ref = reference(model, x)
    tol = kernel_tol(DT, j.num_params, computations=2)
    # the Jacobian in block order ([weight.flatten(), bias] for a DenseBlock) and back
    assert rel(j.to_dense(), to_block_order(model, j, ref)) < tol
    back = from_block_order(model, j, to_block_order(model, j, ref))
    for key in ref:
        assert torch.equal(back[key], ref[key])
    # the kernels, against the reference and the factor form
    rd = dense_reference(ref)
    k_ref = torch.einsum("nok,mpk->nmop", rd, rd)
    assert rel(ntkcore.gram(j, mode="full"), k_ref) < tol


def test_the_rule_is_the_size_comparison():
    """Dense exactly when O d_out d_in <= S (d_in + O d_out), equality included; every
    structured layer of the models above checked against that, with its real S (the
    factor form's positions, over all calls of the tied convolution)."""
    assert dense_is_smaller(4, 2, 4, 1)  # 8 <= 4 * 6
    assert dense_is_smaller(4, 2, 2, 2)  # 16 == 2 * (4 + 4)
    assert not dense_is_smaller(5, 2, 2, 2)  # 20 > 2 * (5 + 4)
    for name in MODELS:
        model, x = _built(name)
        j = jacobian(model, x, dense_if_smaller=True)
        for b in j.blocks:
            mod = model.get_submodule(b.name)
            if not isinstance(mod, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d):
                continue
            d_in, d_out = _widths(mod, True, mod.bias is not None)
            k = jacobian(model, x).blocks[[c.name for c in j.blocks].index(b.name)]
            assert isinstance(k, KroneckerBlock)
            dense = dense_is_smaller(d_in, d_out, k.num_positions, j.num_outputs) and \
                name != "declined"
            assert isinstance(b, DenseBlock) == dense, (name, b.name)


@pytest.mark.parametrize("params", [["0.weight"], ["0.bias"], ["0.weight", "2.bias"]])
def test_selected_parameters(params):
    """Weight only, bias only (d_in = 1: always dense), and a mix."""
    model, x = _built("stem")
    j = jacobian(model, x, params=params, dense_if_smaller=True)
    assert isinstance(j.blocks[0], DenseBlock)
    ref = reference(model, x, [p for p, _ in model.named_parameters() if p in params])
    assert rel(j.to_dense(), to_block_order(model, j, ref, params)) < \
        kernel_tol(DT, j.num_params, computations=2)


def test_outputs_and_pseudo():
    """An output chunk decides with its own O'; the pseudo-NTK Jacobian with O = 1."""
    model, x = _built("stem")
    ref = reference(model, x)
    j = jacobian(model, x, outputs=(1, 3), dense_if_smaller=True)
    assert isinstance(j.blocks[0], DenseBlock)
    full = to_block_order(model, j, ref)
    assert rel(j.to_dense(), full[:, 1:3]) < kernel_tol(DT, j.num_params, computations=2)
    jp = jacobian(model, x, pseudo=True, dense_if_smaller=True)
    refp = to_block_order(model, jp, reference(model, x, pseudo=True))
    assert rel(jp.to_dense(), refp) < kernel_tol(DT, jp.num_params, computations=2)


def test_differentiable_in_x():
    """With x requiring grad, the dense blocks stay on the graph: the gradient of the
    kernel's sum with respect to x equals the factor form's."""
    model, x = _built("stem")
    grads = []
    for dense in (True, False):
        xg = x.clone().requires_grad_(True)
        j = jacobian(model, xg, dense_if_smaller=dense)
        assert isinstance(j.blocks[0], DenseBlock) == dense
        ntkcore.gram(j, mode="trace").sum().backward()
        grads.append(xg.grad)
    # each entry of d(sum K)/dx sums at most P terms per input entry of a sample and per
    # sample pair (the double backward through the blocks): gamma of that length, twice
    terms = sum(p.numel() for p in model.parameters()) * x[0].numel() * x.shape[0]
    assert rel(grads[0], grads[1]) < kernel_tol(DT, terms, computations=2)


def test_ntk_asks_for_it_and_a_cross_kernel_of_another_shape_does_not(monkeypatch):
    """ntk passes ``dense_if_smaller=True`` when both sides have one sample shape (the same
    blocks are dense on both), and not otherwise; the kernels equal the reference."""
    seen = []
    real = torch_jacobian.jacobian

    def spy(*args, **kwargs):
        seen.append(kwargs.get("dense_if_smaller", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_jacobian, "jacobian", spy)
    model, x = _built("reflect_dilated", 4)  # global pooling: any spatial size
    x2 = torch.randn(3, 4, 10, 10, dtype=DT)
    for other, expect in ((None, True), (x[:2].clone(), True), (x2, False)):
        seen.clear()
        k = ntkcore.ntk(model, x, other, mode="trace")
        assert seen and all(s == expect for s in seen)
        ra = dense_reference(reference(model, x))
        rb = ra if other is None else dense_reference(reference(model, other))
        kr = torch.einsum("nok,mok->nm", ra, rb)
        p = sum(q.numel() for q in model.parameters())  # each entry sums O P products
        assert rel(k, kr) < kernel_tol(DT, ra.shape[1] * p, computations=2)


def test_bad_flag():
    model, x = _built("stem")
    with pytest.raises(TypeError, match="dense_if_smaller"):
        jacobian(model, x, dense_if_smaller=1)


@pytest.mark.parametrize(("name", "patches"), [("stem", False), ("tied", False),
                                               ("patches", True), ("patches_circular", True),
                                               ("pointwise", False)])
def test_patches_are_kept_only_where_no_larger_than_the_block(monkeypatch, name, patches):
    """Patches (N, S, K) held across the passes are memory the Jacobian does not show: they
    are formed only where S <= O C_out (a 1 x 1 convolution of stride 1 reads its input as
    they are); elsewhere each pass is a grouped convolution's weight gradient."""
    from ntkcore.backends import torch_layers

    formed = []
    real_unfold, real_patches = torch.nn.functional.unfold, torch_layers.conv_patches
    monkeypatch.setattr(torch.nn.functional, "unfold",
                        lambda *a, **k: formed.append("unfold") or real_unfold(*a, **k))
    monkeypatch.setattr(torch_layers, "conv_patches",
                        lambda *a, **k: formed.append("patches") or real_patches(*a, **k))
    model, x = _built(name)
    j = jacobian(model, x, dense_if_smaller=True)
    assert bool(formed) == patches
    ref = to_block_order(model, j, reference(model, x))
    assert rel(j.to_dense(), ref) < kernel_tol(DT, j.num_params, computations=2)


@pytest.mark.parametrize("name", ["patches", "patches_circular", "stem"])
def test_passes_written_into_their_slots(monkeypatch, name):
    """O = 3 loop passes: from the second pass on, the GEMM of the patches (or the grouped
    convolution's result) is written into the pass's slot of the (N, O, P_b) array, and the
    Jacobian still equals torch.func's."""
    from ntkcore.backends import torch_layers

    slots = []
    original = torch_layers.weight_sums

    def spy(*args, **kwargs):
        out = args[5] if len(args) > 5 else kwargs.get("out")
        slots.append(out is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch_layers, "weight_sums", spy)
    copies = []
    into = torch_layers.into
    monkeypatch.setattr(torch_layers, "into",
                        lambda r, out: copies.append(out is not None) or into(r, out))
    model, x = _built(name)
    j = jacobian(model, x, dense_if_smaller=True, backward="loop")
    ref = reference(model, x)
    assert rel(j.to_dense(), to_block_order(model, j, ref)) < \
        kernel_tol(DT, j.num_params, computations=2)
    written = slots if name != "stem" else copies  # stem: the grouped convolution, copied
    assert written.count(True) >= 2 and written.count(False) >= 1  # passes 2, 3 and pass 1
