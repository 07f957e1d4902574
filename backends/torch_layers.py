r"""The torch layer types with structured per-sample gradients: one home per layer type.

For ``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding`` and ``nn.LayerNorm`` (last axis):
which classes qualify (:data:`FORWARD`), which axis may carry the samples, how a call's input
unfolds into a (N, S, d_in [+ 1]), how its output gradients shape into g (N, S, O, d_out) and
how the two form the layer's block, in the layouts of the provider's module docstring (bias
as the last column of [W | b], patches in the weight's (C_in, k_1, ...) order, Embedding as
:math:`W^\top`).  Clients: the provider (``torch_jacobian``) and ``SENG`` (``torch_seng``),
which only find the calls and their gradients; KIP gets its blocks from the provider.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ntkcore.jacobian import DenseBlock, KroneckerBlock

__all__ = ["CONV", "FORWARD", "cat", "input_factor", "layer_block", "layer_type",
           "output_factor", "sample_axis_ok"]

CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Structured only when the class keeps torch's own forward (a subclass may compute anything).
FORWARD = {nn.Linear: nn.Linear.forward, nn.Conv1d: nn.Conv1d.forward,
           nn.Conv2d: nn.Conv2d.forward, nn.Conv3d: nn.Conv3d.forward,
           nn.Embedding: nn.Embedding.forward, nn.LayerNorm: nn.LayerNorm.forward}


def layer_type(mod: nn.Module) -> type | None:
    """The supported class ``mod`` is an instance of (a key of :data:`FORWARD`), or None: not
    one of them, a subclass overriding ``forward``, or a LayerNorm over several axes."""
    base = next((c for c in FORWARD if isinstance(mod, c)), None)
    if base is None or type(mod).forward is not FORWARD[base]:
        return None
    if base is nn.LayerNorm and len(mod.normalized_shape) != 1:
        return None  # normalised over several axes: torch.func (dense) instead
    return base


def sample_axis_ok(mod: nn.Module, axis: int, ndim: int) -> bool:
    """Whether ``axis`` of a call's ``ndim``-axis input may be its sample axis: not the
    feature axis of a Linear / LayerNorm, and 0 for a convolution ((N, C, *L) is its only
    batched layout)."""
    if isinstance(mod, CONV):
        return axis == 0
    return not (isinstance(mod, nn.Linear | nn.LayerNorm) and axis == ndim - 1)


def conv_patches(mod: nn.Module, a: torch.Tensor, ones: bool) -> torch.Tensor:
    """Unfolded input patches (N, L, C_in * prod(k) [+ 1]) in the weight's (C_in, k1, k2, ...)
    order, with a trailing ones column if ``ones``; written with a single copy, so that
    ``y[n, :, l] = [W.reshape(C_out, -1), b] @ a[n, l]``."""
    nd = len(mod.kernel_size)
    flat: list[int] = []  # (lo, hi) per axis, the last axis first as F.pad wants
    for i in reversed(range(nd)):
        if mod.padding == "same":  # torch pads the extra element on the right
            total = mod.dilation[i] * (mod.kernel_size[i] - 1)
            flat += [total // 2, total - total // 2]
        else:
            flat += [0, 0] if mod.padding == "valid" else [mod.padding[i]] * 2
    if any(flat):
        mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
        a = F.pad(a, flat, mode=mode)
    for i in range(nd):
        k, d, s = mod.kernel_size[i], mod.dilation[i], mod.stride[i]
        span = d * (k - 1) + 1
        a = a.unfold(2 + i, span, s)  # appends a window axis
        if d > 1:
            a = a[..., ::d]
    n, c = a.shape[0], a.shape[1]
    lens = tuple(a.shape[2:2 + nd])
    # (N, C, L1..Lnd, k1..knd) -> (N, L1..Lnd, C, k1..knd), a strided view
    view = a.permute([0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)])
    dk = c * math.prod(mod.kernel_size)
    out = a.new_empty((n, math.prod(lens), dk + int(ones)))
    if ones:
        out[..., dk] = 1
    out[..., :dk].unflatten(2, (c, *mod.kernel_size)).unflatten(1, lens).copy_(view)
    return out


def cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)``, or the one part itself (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _with_ones(a: torch.Tensor) -> torch.Tensor:
    return torch.cat([a, a.new_ones((*a.shape[:-1], 1))], dim=-1)


def input_factor(mod: nn.Module, a: torch.Tensor, n: int, ones: bool,
                 dtype: torch.dtype) -> torch.Tensor:
    """The factor a (N, S, d_in [+ 1]) of one call of a Linear / Conv / Embedding ``mod``.

    ``a`` is the call's input with the sample axis in front: (N, *mid, d_in) for a Linear
    (S = prod(mid)), (N, C_in, *L) for a convolution (unfolded patches, S = L positions),
    indices (N, *mid) for an Embedding (one-hot rows in ``dtype``, zero at ``padding_idx``).
    ``ones`` appends the bias's ones column (Linear / Conv).
    """
    if isinstance(mod, nn.Linear):
        a_c = a.reshape(n, -1, mod.in_features)
        return _with_ones(a_c) if ones else a_c
    if isinstance(mod, nn.Embedding):
        a_c = F.one_hot(a.reshape(n, -1), mod.num_embeddings).to(dtype)
        if mod.padding_idx is not None:
            a_c[..., mod.padding_idx] = 0
        return a_c
    return conv_patches(mod, a, ones)


def output_factor(mod: nn.Module, gr: torch.Tensor, n: int, lead: int,
                  axis: int = 0) -> torch.Tensor:
    """The factor g (N, S, lead, d_out) from output gradients ``gr`` (lead, *y.shape).

    ``y`` is (N, *mid, d_out) for a Linear / Embedding / LayerNorm, with the samples on
    ``axis`` (moved to the front here), and (N, C_out, *L) for a convolution, whose g is a
    view of an (N, lead, C_out, S) array (the layout in which the per-sample weight gradient
    ``g^T a`` is a plain batched GEMM).  At most one copy (none when ``lead == 1`` and the
    sample axis leads).
    """
    if isinstance(mod, CONV):
        g4 = gr.reshape(lead, n, gr.shape[2], -1).transpose(0, 1)  # (N, lead, C, S)
        return (g4 if lead == 1 else g4.contiguous()).permute(0, 3, 1, 2)
    if axis:
        gr = gr.movedim(1 + axis, 1)
    g4 = gr.reshape(lead, n, -1, gr.shape[-1]).permute(1, 2, 0, 3)  # (N, S, lead, d)
    return g4 if lead == 1 else g4.contiguous()


def layer_block(mod: nn.Module, inputs: list[torch.Tensor], gs: list[torch.Tensor], n: int,
                name: str, *, weight: bool = True,
                bias: bool = True) -> DenseBlock | KroneckerBlock:
    r"""The block of one layer from its calls: ``inputs[i]`` the input of call i with the
    sample axis in front, ``gs[i]`` its g (N, S_i, O, d_out) (:func:`output_factor`).

    ``weight`` / ``bias``: which of the layer's parameters the block covers.  Several calls
    (tied weights) are concatenated along S:
    :math:`\partial f/\partial W = \sum_{calls}\sum_s g a^\top`.  A Linear / Conv / Embedding
    gives a KroneckerBlock (a contiguous, g as given; a grouped convolution may give a
    DenseBlock, see :func:`_grouped_conv_block`), a LayerNorm a DenseBlock.
    """
    if isinstance(mod, nn.LayerNorm):
        return _layer_norm_block(mod, inputs, gs, n, name, weight, bias)
    groups = getattr(mod, "groups", 1)
    ones = bias and weight and groups == 1
    if weight:
        a_parts = [input_factor(mod, a_c, n, ones, g_c.dtype)
                   for a_c, g_c in zip(inputs, gs, strict=True)]
    else:  # bias only: the ones column is the whole input
        a_parts = [g_c.new_ones((n, g_c.shape[1], 1)) for g_c in gs]
    a, g = cat(a_parts, 1), cat(gs, 1)
    if groups > 1:
        return _grouped_conv_block(a, g, groups, name, weight, bias)
    return KroneckerBlock(a.contiguous(), g, name)


def _layer_norm_block(mod: nn.Module, inputs: list[torch.Tensor], gs: list[torch.Tensor],
                      n: int, name: str, weight: bool, bias: bool) -> DenseBlock:
    r"""The DenseBlock (N, O, 2 d) of a LayerNorm over the last axis, from its calls.

    The module computes :math:`y = \hat x \odot \gamma + \beta` with
    :math:`\hat x = (x - \mu) / \sqrt{\sigma^2 + \epsilon}` per position, so with the output
    gradients g (N, S, O, d) taken at y,

    .. math:: J_\gamma[n, o, :] = \sum_s g[n, s, o, :] \odot \hat x[n, s, :], \qquad
              J_\beta[n, o, :] = \sum_s g[n, s, o, :],

    summed over every call (tied modules).  :math:`\hat x` is recomputed from the recorded
    input (differentiably when the input is on a graph).  Cost O(N S O d): no torch.func pass.
    """
    d = int(mod.normalized_shape[0])
    pieces = []  # DenseBlock layout: [weight, bias]
    if weight:
        pieces.append(functools.reduce(torch.add, (
            torch.einsum("nsod,nsd->nod", g_c, F.layer_norm(a_in, (d,), None, None, mod.eps)
                         .reshape(n, -1, d).to(g_c.dtype))
            for a_in, g_c in zip(inputs, gs, strict=True))))
    if bias:
        pieces.append(functools.reduce(torch.add, (g_c.sum(dim=1) for g_c in gs)))
    return DenseBlock(cat(pieces, -1), name)


def _grouped_conv_block(a: torch.Tensor, g: torch.Tensor, groups: int, name: str,
                        weight: bool, bias: bool) -> DenseBlock | KroneckerBlock:
    r"""A grouped convolution: a (N, L, C_in*k), g (N, L, O, C_out).

    Output channel c belongs to group c // (C_out/G) and sees only that group's input channels
    (contiguous in the patch vector).  With the G groups as extra positions,
    a'[n, (G,L), C_in/G*k] and g'[n, (G,L), o, c] = g[n, L, o, c] if c is in group G else 0,
    :math:`\sum_{(G,L)} g' a'^\top` is the (C_out, C_in/G*k) weight gradient exactly.  When
    that is larger than the per-sample gradient itself (many groups, e.g. depthwise), a
    DenseBlock is built from the same factors instead.
    """
    n, s, o, cout = g.shape
    if not weight:  # bias only: the groups do not matter
        return KroneckerBlock(a, g, name)
    cg_in = a.shape[2] // groups
    cg_out = cout // groups
    a4 = a.reshape(n, s, groups, cg_in)
    kron_size = n * groups * s * (o * cout + cg_in + 1)
    dense_size = n * o * cout * (cg_in + 1)
    if kron_size <= dense_size:
        ap = a4.permute(0, 2, 1, 3).reshape(n, groups * s, cg_in)
        # g6[n, G, l, o, G', c] = g[n, l, o, G' cg_out + c] where G == G', else 0
        g6 = g.new_zeros((n, groups, s, o, groups, cg_out))
        g6.diagonal(dim1=1, dim2=4).copy_(g.unflatten(-1, (groups, cg_out)).movedim(3, -1))
        gp = g6.reshape(n, groups * s, o, cout)
        if bias:
            ap = _with_ones(ap)
        return KroneckerBlock(ap.contiguous(), gp, name)
    # Dense per-sample gradient: dW[n, o, c, :] = sum_s g[n, s, o, c] a[n, s, group(c), :].
    gg = g.reshape(n, s, o, groups, cg_out)
    dw = torch.einsum("nsogc,nsgk->nogck", gg, a4).reshape(n, o, cout, cg_in)
    # DenseBlock layout: [weight.flatten(), bias]
    return DenseBlock(cat([dw.reshape(n, o, -1), *([g.sum(dim=1)] if bias else [])], -1), name)
