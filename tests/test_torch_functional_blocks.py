"""Parameters applied by functional calls (``backends/torch_functional.py``, issue 18).

Per kind of use a small float64 model: layer-scale ``h * gamma`` (also ConvNeXt's
``gamma.reshape(1, -1, 1, 1)``), a bias added by hand, ``cls_token.expand`` + ``torch.cat`` and
``+ pos_embed``, norm subclasses with their own ``forward`` calling ``F.layer_norm`` (timm's
``LayerNorm2d``) / ``F.batch_norm`` with an in-place activation after it (``BatchNormAct2d``) /
``F.group_norm`` / ``F.instance_norm`` / ``F.rms_norm``, and ``nn.MultiheadAttention``
(``in_proj`` packed and split, ``out_proj``; batch-first and sequence-first; with and without
``need_weights``).  Each is compared with a dense float64 ``torch.func`` Jacobian (``vmap(jacrev)``
of ``functional_call``, independent of the mode, the hooks and the output gradients): the
Jacobian in block order and the full / trace kernels, symmetric and cross.  The spy on
``_dense_blocks`` checks that no ``torch.func`` pass ran for these parameters (before issue 18
each of them went through it), and the block kinds that they are Dense / Kronecker blocks.

Guards: a parameter used in a way the mode does not recognise (an extra ``gamma.sum()``, an
in-place ``mul_``, ``addcmul``, a scaled copy, a transposed Linear weight: caught in the
forward pass), inside an ``autograd.Function`` next to a recognised use (caught by the count of
graph edges), a use without a sample axis or with a merged (N*2, C) axis (caught by the probe)
keeps the ``torch.func`` path, with the same exact numbers; a parameter used twice in
recognised ways is the sum of both.  timm's own ``LayerNorm2d``, ``BatchNormAct2d``,
``ConvNeXtBlock`` and a one-block ``VisionTransformer`` at tiny sizes (skipped without timm),
and a plain MLP that never enters the mode.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import ntkcore  # noqa: E402
import ntkcore.backends.torch_functional as tf  # noqa: E402
from ntkcore import DenseBlock, KroneckerBlock  # noqa: E402
from ntkcore.backends.torch_jacobian import jacobian, to_block_order  # noqa: E402
from tests.test_torch_norm_blocks import _randomise, dense, reference, rel, tol_for  # noqa: E402

DT = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --------------------------------------------------------------------------------------------
# small models, one per kind of use
# --------------------------------------------------------------------------------------------
class LayerScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.gamma, self.b = nn.Linear(4, 5), nn.Parameter(torch.randn(5)), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x) * self.gamma))


class ConvScale(nn.Module):
    """ConvNeXt's ``x.mul(gamma.reshape(1, -1, 1, 1))``."""

    def __init__(self):
        super().__init__()
        self.c, self.gamma = nn.Conv2d(2, 4, 3, padding=1), nn.Parameter(torch.randn(4))
        self.fc = nn.Linear(64, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.c(x).mul(self.gamma.reshape(1, -1, 1, 1))).flatten(1))


class Tokens(nn.Module):
    """timm ViT's ``_pos_embed``: cat with ``cls_token.expand(N, -1, -1)``, then + pos_embed."""

    def __init__(self):
        super().__init__()
        self.e = nn.Linear(3, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 4))
        self.pos_embed = nn.Parameter(torch.randn(1, 6, 4))
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        t = self.e(x)
        t = torch.cat([self.cls_token.expand(t.shape[0], -1, -1), t], dim=1) + self.pos_embed
        return self.out(torch.tanh(t)).mean(1)


class HandBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.b = nn.Linear(4, 5, bias=False), nn.Parameter(torch.randn(5))
        self.o = nn.Linear(5, 2)

    def forward(self, x):
        return self.o(torch.tanh(self.b + self.l(x)))


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: F.layer_norm over C of a permuted (N, H, W, C) view."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight,
                            self.bias, self.eps).permute(0, 3, 1, 2)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d in eval mode: F.batch_norm, then an in-place activation."""

    def __init__(self, c):
        super().__init__(c)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        return self.act(F.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                     self.bias, False, 0.1, self.eps))


class GroupNormF(nn.GroupNorm):
    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class InstanceNormF(nn.InstanceNorm2d):
    def forward(self, x):
        return F.instance_norm(x, None, None, self.weight, self.bias, True, 0.1, self.eps)


class RMSNormF(nn.RMSNorm):
    def forward(self, x):
        return F.rms_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight,
                          self.eps).permute(0, 3, 1, 2)


class ConvNorm(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.c, self.norm, self.fc = nn.Conv2d(2, 4, 3, padding=1), norm, nn.Linear(64, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.norm(self.c(x))).flatten(1))


class Attention(nn.Module):
    def __init__(self, batch_first=True, need_weights=False, cross=False):
        super().__init__()
        self.e = nn.Linear(3, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.o = nn.Linear(8, 2)
        self.batch_first, self.need_weights, self.cross = batch_first, need_weights, cross

    def forward(self, x):
        t = torch.tanh(self.e(x))
        if not self.batch_first:
            t = t.transpose(0, 1)
        k = t * 0.5 if self.cross else t  # cross: in_proj_weight.split into q and kv rows
        y = self.att(t, k, k, need_weights=self.need_weights)[0]
        if not self.batch_first:
            y = y.transpose(0, 1)
        return self.o(y).mean(1)


img = (5, 2, 4, 4)
# name -> (model factory, input shape, {block name: kind} of the functional parameters)
MODELS = {
    "layer-scale": (LayerScale, (5, 4), {"gamma": DenseBlock}),
    "conv-scale": (ConvScale, img, {"gamma": DenseBlock}),
    "cls-pos": (Tokens, (5, 5, 3), {"cls_token": DenseBlock, "pos_embed": DenseBlock}),
    "hand-bias": (HandBias, (5, 4), {"b": DenseBlock}),
    "layernorm2d": (lambda: ConvNorm(LayerNorm2d(4)), img, {"norm": DenseBlock}),
    "batchnormact2d": (lambda: ConvNorm(BatchNormAct2d(4)), img, {"norm": DenseBlock}),
    "groupnorm-f": (lambda: ConvNorm(GroupNormF(2, 4)), img, {"norm": DenseBlock}),
    "instancenorm-f": (lambda: ConvNorm(InstanceNormF(4, affine=True)), img,
                       {"norm": DenseBlock}),
    "rmsnorm-f": (lambda: ConvNorm(RMSNormF(4)), img, {"norm": DenseBlock}),
    "mha": (Attention, (4, 3, 3), {"att": KroneckerBlock, "att.out_proj": KroneckerBlock}),
    "mha-weights": (lambda: Attention(need_weights=True), (4, 3, 3),
                    {"att": KroneckerBlock, "att.out_proj": KroneckerBlock}),
    "mha-seq-first": (lambda: Attention(batch_first=False), (4, 3, 3),
                      {"att": KroneckerBlock, "att.out_proj": KroneckerBlock}),
    "mha-cross": (lambda: Attention(cross=True), (4, 3, 3),
                  {"att": KroneckerBlock, "att.out_proj": KroneckerBlock}),
}


def _make(name):
    make, shape, kinds = MODELS[name]
    model = _randomise(make())
    return model, torch.randn(*shape, dtype=DT), torch.randn(3, *shape[1:], dtype=DT), kinds


def _check(model, x1, x2, tol_scale=1):
    """The Jacobian in block order, and the full / trace kernels (symmetric and cross)."""
    j = jacobian(model, x1)
    ref1 = reference(model, x1)
    r1, r2 = dense(ref1), dense(reference(model, x2))
    tol = tol_scale * tol_for(j.num_params, r1.shape[1])
    assert rel(j.to_dense(), to_block_order(model, j, ref1)) < tol
    full11 = torch.einsum("nok,mpk->nmop", r1, r1)
    full12 = torch.einsum("nok,mpk->nmop", r1, r2)
    assert rel(ntkcore.ntk(model, x1, mode="full"), full11) < tol
    assert rel(ntkcore.ntk(model, x1, x2, mode="full"), full12) < tol
    assert rel(ntkcore.ntk(model, x1, mode="trace"), full11.diagonal(dim1=2, dim2=3).sum(-1)) < tol
    assert rel(ntkcore.ntk(model, x1, x2, mode="trace"),
               full12.diagonal(dim1=2, dim2=3).sum(-1)) < tol
    return j


@pytest.mark.parametrize("name", sorted(MODELS))
def test_functional_block_equals_dense_reference(name, dense_calls):
    model, x1, x2, kinds = _make(name)
    j = _check(model, x1, x2)
    assert dense_calls == []  # no torch.func pass at all
    got = {b.name: type(b) for b in j.blocks}
    assert {k: got[k] for k in kinds} == kinds


@pytest.mark.parametrize("name", ["layer-scale", "cls-pos", "batchnormact2d", "mha-cross"])
@pytest.mark.parametrize("backward", ["batched", "loop"])
def test_backward_strategies_and_pseudo(name, backward, dense_calls):
    model, x, _, _ = _make(name)
    ref = reference(model, x)
    j = jacobian(model, x, backward=backward)
    assert rel(j.to_dense(), to_block_order(model, j, ref)) < tol_for(j.num_params, 3)
    jp = jacobian(model, x, pseudo=True)
    rp = dense(ref).sum(1, keepdim=True) / dense(ref).shape[1] ** 0.5
    assert rel(jp.to_dense(), to_block_order(model, jp, {k: v.sum(1, keepdim=True)
                                                         / dense(ref).shape[1] ** 0.5
                                                         for k, v in ref.items()})) < \
        tol_for(j.num_params, 3)
    assert rel(jp.to_dense().sum(-1), rp.sum(-1)) < tol_for(j.num_params, 3)
    assert dense_calls == []


@pytest.mark.parametrize("params", [["gamma"], ["a.weight", "gamma"]])
def test_parameter_subsets(params, dense_calls):
    model, x, _, _ = _make("layer-scale")
    j = jacobian(model, x, params=params)
    ref = reference(model, x, params)
    assert rel(j.to_dense(), to_block_order(model, j, ref, params)) < tol_for(j.num_params, 3)
    assert dense_calls == []


@pytest.mark.parametrize("params", [["att.in_proj_weight"], ["att.in_proj_bias"],
                                    ["att.out_proj.weight"]])
def test_attention_weight_or_bias_only(params, dense_calls):
    model, x, _, _ = _make("mha-cross")
    j = jacobian(model, x, params=params)
    ref = reference(model, x, params)
    assert isinstance(j.blocks[0], KroneckerBlock)
    assert rel(j.to_dense(), to_block_order(model, j, ref, params)) < tol_for(j.num_params, 3)
    assert dense_calls == []


@pytest.mark.parametrize("name", ["cls-pos", "mha-seq-first", "conv-scale"])
@pytest.mark.parametrize("n", [1, 6])  # N = 1 (the probe takes 2 samples); N = T + 1 for cls-pos
def test_batch_sizes(name, n, dense_calls):
    model, _, _, _ = _make(name)
    x = torch.randn(n, *MODELS[name][1][1:], dtype=DT)
    j = jacobian(model, x)
    assert rel(j.to_dense(), to_block_order(model, j, reference(model, x))) < \
        tol_for(j.num_params, 3)
    assert dense_calls == []


def test_attention_emits_no_warning():
    """No torch.func pass, so no batching-rule warning of scaled_dot_product_attention."""
    import warnings

    model, x, _, _ = _make("mha")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ntkcore.ntk(model, x, mode="full")
    assert [str(w.message) for w in caught] == []


def test_differentiable_in_x():
    """create_graph: the functional factors keep the graph to x (KIP's path)."""
    model, x, _, _ = _make("cls-pos")
    x = x[:2].clone().requires_grad_(True)
    j = jacobian(model, x)
    assert rel(j.to_dense().detach(), to_block_order(model, j, reference(model, x.detach()))) \
        < tol_for(j.num_params, 2)
    k = ntkcore.ntk(model, x, mode="trace")
    (gx,) = torch.autograd.grad(k.sum(), x)

    def kernel_of(xx):
        r = dense(reference(model, xx))
        return torch.einsum("nok,mok->nm", r, r).sum()

    gref = torch.func.grad(kernel_of)(x.detach())
    assert rel(gx, gref) < 1e-10


# --------------------------------------------------------------------------------------------
# guards: unrecognised uses keep torch.func
# --------------------------------------------------------------------------------------------
class _Product(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(h, w):
        return h * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        return g * w, (g * h).sum(0)


class Guarded(nn.Module):
    """``how`` names an unrecognised use of ``gamma`` (5,) next to a Linear (4 -> 5)."""

    def __init__(self, how):
        super().__init__()
        self.a, self.gamma, self.b = nn.Linear(4, 5), nn.Parameter(torch.randn(5)), nn.Linear(5, 3)
        self.how = how

    def forward(self, x):
        h, g = self.a(x), self.gamma
        if self.how == "extra-sum":
            y = h * g + g.sum()
        elif self.how == "in-place":
            y = h.mul_(g)
        elif self.how == "addcmul":
            y = torch.addcmul(h, h, g)
        elif self.how == "scaled-copy":
            y = h * (2.0 * g)
        elif self.how == "transposed-linear":
            y = F.linear(h, g[:, None].expand(5, 5).t())
        elif self.how == "function":  # a recognised use and one the mode cannot see
            y = h * g + _Product.apply(torch.tanh(h), g)
        elif self.how == "no-sample-axis":  # gamma * a fixed table, then added to every sample
            table = torch.linspace(0.5, 1.5, 15, dtype=h.dtype).reshape(3, 5)
            y = (h[:, None] + g * table).sum(1)
        elif self.how == "merged-axis":  # (N*2, 5): no axis of length N
            y = (torch.stack([h, 2 * h], 1).reshape(-1, 5) * g).reshape(-1, 2, 5).sum(1)
        elif self.how == "twice":  # two recognised uses: structured, their sum
            y = h * g + torch.tanh(h) * g
        else:
            raise AssertionError(self.how)
        return self.b(torch.tanh(y))


GUARDS = ["extra-sum", "in-place", "addcmul", "scaled-copy", "transposed-linear", "function",
          "no-sample-axis", "merged-axis"]


@pytest.mark.parametrize("how", [*GUARDS, "twice"])
def test_unrecognised_use_keeps_torch_func(how, dense_calls):
    model = _randomise(Guarded(how))
    x1, x2 = torch.randn(5, 4, dtype=DT), torch.randn(3, 4, dtype=DT)
    j = _check(model, x1, x2)
    kinds = {b.name: type(b) for b in j.blocks}
    assert kinds == {"a": KroneckerBlock, "gamma": DenseBlock, "b": KroneckerBlock}
    assert set(dense_calls) == (set() if how == "twice" else {"gamma"})


def test_norm_with_an_unrecognised_weight_falls_back_whole(dense_calls):
    """Both parameters of a module block are structured, or neither."""

    class Odd(nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight.exp(), self.bias, self.eps)

    model = _randomise(nn.Sequential(nn.Linear(3, 4), Odd(4), nn.Linear(4, 2)))
    x1, x2 = torch.randn(5, 3, dtype=DT), torch.randn(3, 3, dtype=DT)
    _check(model, x1, x2)
    assert set(dense_calls) == {"1"}


def test_mlp_never_enters_the_mode(monkeypatch):
    """No candidate parameter: no TorchFunctionMode, so no per-op cost."""
    entered = []
    real = tf.ParamUses.__torch_function__
    monkeypatch.setattr(tf.ParamUses, "__torch_function__",
                        lambda *a, **k: entered.append(1) or real(*a, **k))
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(DT)
    ntkcore.ntk(model, torch.randn(4, 3, dtype=DT))
    assert entered == []
    ntkcore.ntk(_make("layer-scale")[0], torch.randn(4, 4, dtype=DT))
    assert entered


# --------------------------------------------------------------------------------------------
# timm's own layers (tiny sizes)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def timm():
    try:
        import timm
    except Exception:
        # the CUDA torchvision wheel next to the CPU torch needs its op schemas (issue 18)
        try:
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except Exception:
            pass
        timm = pytest.importorskip("timm")
    return timm


def _timm_case(timm, name):
    from timm.layers import BatchNormAct2d as TBNA
    from timm.layers import LayerNorm2d as TLN2d
    from timm.models.convnext import ConvNeXtBlock
    from timm.models.vision_transformer import VisionTransformer

    if name == "LayerNorm2d":
        return ConvNorm(TLN2d(4)), img, ["norm"]
    if name == "BatchNormAct2d":
        return ConvNorm(TBNA(4, act_layer=nn.SiLU)), img, ["norm"]
    if name.startswith("ConvNeXtBlock"):
        block = ConvNeXtBlock(4, kernel_size=3, ls_init_value=0.5,
                              conv_mlp=name.endswith("conv_mlp"))
        head = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
        return nn.Sequential(nn.Conv2d(2, 4, 1), block, head), img, ["1", "1.norm"]
    vit = VisionTransformer(img_size=8, patch_size=4, in_chans=2, num_classes=3, embed_dim=8,
                            depth=1, num_heads=2, init_values=0.5)
    return vit, (3, 2, 8, 8), ["cls_token", "pos_embed", "blocks.0.ls1", "blocks.0.ls2",
                               "blocks.0.norm1", "norm"]


@pytest.mark.parametrize("name", ["LayerNorm2d", "BatchNormAct2d", "ConvNeXtBlock",
                                  "ConvNeXtBlock-conv_mlp", "VisionTransformer"])
def test_timm_layers(timm, name, dense_calls):
    model, shape, structured = _timm_case(timm, name)
    model = _randomise(model)
    with torch.no_grad():  # non-trivial layer scales
        for n, p in model.named_parameters():
            if n.endswith("gamma") or n in ("cls_token", "pos_embed"):
                p.normal_(0.0, 1.0)
    x1, x2 = torch.randn(*shape, dtype=DT), torch.randn(2, *shape[1:], dtype=DT)
    j = _check(model, x1, x2)
    names = set(j.names)
    assert set(structured) <= names
    assert not set(dense_calls) & set(structured)
    # the depthwise conv and the attention's internals are the only torch.func-free leftovers
    assert dense_calls == []
