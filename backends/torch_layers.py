r"""The torch layer rules: one :class:`LayerRule` subclass per layer type, registered in
:data:`RULES`, and the factor and block helpers they share.

A rule says which axis of a call may carry the samples, how the call's input and output
gradients become the factors a (N, S, d_in [+ 1]) and g (N, S, O, d_out), how these form the
layer's block, and what the backward passes need.  The provider (``torch_jacobian``) and
``SENG`` (``torch_seng``) only look the rule up (:func:`rule_for`); KIP gets its blocks from
the provider.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ntkcore.jacobian import DenseBlock, KroneckerBlock, trusted_blocks

from .torch_recycle import empty as recycled

__all__ = ["NORMALISE", "PLAIN", "RULES", "AffineRule", "BatchNormRule", "ConvRule",
           "EmbeddingRule", "GRURule", "GroupNormRule", "InstanceNormRule", "LSTMRule",
           "LayerNormRule", "LayerRule", "LinearRule", "RMSNormRule", "RNNRule", "RecurrentPass",
           "RecurrentRule", "Summed", "affine_sums", "cat", "drop_zero_positions",
           "drop_zero_positions_all", "embedding_index", "recurrent_forward", "recurrent_rule",
           "rule_for", "with_ones"]


#: A reducer: ``reduce(g)`` maps one call's output gradients g (N, S, L, d_out) to (N, L, W).
#: One that also takes ``out`` (``reduce(g, out=None)``) gets, from the second of O > 2 loop
#: passes on, the (N, 1, W) slot of the O passes' array to write in place (the built-in
#: reducers: straight from the GEMM where they can, else copied) and returns it.
Reducer = Callable[..., torch.Tensor]


class LayerRule:
    r"""How calls of one torch layer type become its block (the base says what to implement).

    A subclass implements :meth:`block` and overrides what differs from these defaults; its
    instance goes into :data:`RULES` under the module classes it covers.  The provider hooks
    every call of such a module (input a, output y), finds its sample axis by a probe on
    another batch size (:meth:`sample_axis_ok` says which axes may be it), takes the output
    gradients :math:`g = \partial f_o(x_n) / \partial y_n` of every output o in O backward
    passes over all samples, shapes each pass's gradient with :meth:`output_factor` (or
    reduces it with :meth:`reducer`) and hands a call's inputs (samples in front) and gs to
    :meth:`block`.  Several calls (tied weights) are concatenated along the positions S:
    :math:`\partial f/\partial W = \sum_{calls}\sum_s g a^\top`.
    """

    #: the output is (N, C, *L): the samples only on axis 0, g stored as (N, O, C, S) (the
    #: layout in which the per-sample weight gradient :math:`g^\top a` is one batched GEMM)
    channels_first = False
    #: the block's (d_out, d_in) matrix is the weight transposed (an Embedding's table)
    transposed = False
    #: module classes whose presence anywhere in the model makes the automatic backward a
    #: loop of O passes (one batched pass is slower for them)
    unbatched: tuple[type, ...] = ()

    def sample_axis_ok(self, mod: nn.Module, axis: int, ndim: int) -> bool:
        """Whether ``axis`` of a call's ``ndim``-axis input may be its sample axis."""
        return axis == 0 or not self.channels_first

    def out_width(self, mod: nn.Module, gr: torch.Tensor) -> int:
        """d_out: the trailing entries of the output one position holds."""
        return int(gr.shape[-1])

    def output_factor(self, mod: nn.Module | None, gr: torch.Tensor, n: int, lead: int,
                      axis: int = 0) -> torch.Tensor:
        """The factor g (N, S, lead, d_out) from output gradients ``gr`` (lead, *y.shape), the
        samples on ``axis`` of y (moved to the front).  Channels-first: a view of an (N, lead,
        C, S) array.  At most one copy (none when ``lead == 1`` and the samples lead)."""
        if self.channels_first:
            g4 = gr.reshape(lead, n, gr.shape[2], -1).transpose(0, 1)  # (N, lead, C, S)
            return (g4 if lead == 1 else g4.contiguous()).permute(0, 3, 1, 2)
        if axis:
            gr = gr.movedim(1 + axis, 1)
        d = gr.shape[-1] if mod is None else self.out_width(mod, gr)
        g4 = gr.reshape(lead, n, -1, d).permute(1, 2, 0, 3)  # (N, S, lead, d)
        return g4 if lead == 1 else g4.contiguous()

    def reducer(self, mod: nn.Module, a: torch.Tensor, n: int, weight: bool,
                bias: bool) -> Reducer | None:
        """A map g (N, S, L, d_out) -> (N, L, W) that the provider applies to each backward
        pass's g while it is in cache (the block then gets :class:`Summed`), or None: g is
        kept.  ``a``: the call's input, samples in front.  See :data:`Reducer`."""
        return None

    def gradient_sums(self, mod: nn.Module, a: torch.Tensor, n: int, o: int, weight: bool,
                      bias: bool) -> Reducer | None:
        """A map g (N, S, L, d_out) -> (N, L, P_b): one call's contribution to the per-sample
        gradient of the selected parameters, in DenseBlock layout ``[weight.flatten(),
        bias]`` (``a``: the call's input, samples in front; O outputs in all), or None where
        the rule has none (or declines for this call).  Used by :func:`dense_is_smaller`
        blocks, applied pass by pass; what it keeps across the passes must be no larger than
        the block it forms (the budget of ``ntk`` charges the Jacobian's bytes and the
        forward's working memory, not this)."""
        return None

    def factor_widths(self, mod: nn.Module, weight: bool,
                      bias: bool) -> tuple[int, int] | None:
        """(d_in, d_out) of the rule's KroneckerBlock of ``mod``, the ones column counted,
        where :meth:`gradient_sums` forms the per-sample gradient instead; else None."""
        return None

    def kronecker_update(self, mod: nn.Module) -> bool:
        """Whether ``SENG`` may update this module as a KroneckerBlock of its weight and bias."""
        return False

    def block(self, mod: nn.Module, inputs: list[torch.Tensor], gs: list[Any], n: int,
              name: str, weight: bool, bias: bool) -> DenseBlock | KroneckerBlock:
        """The block of ``mod`` named ``name`` from its calls: ``inputs[i]`` call i's input
        with the samples in front, ``gs[i]`` its g (:meth:`output_factor`) or
        :class:`Summed` (:meth:`reducer`); ``weight`` / ``bias``: which of its parameters
        (``weight``, ``bias``) are selected.  Layout: ``[weight.reshape(d_out, -1),
        bias[:, None]]`` row-major for a KroneckerBlock, ``[weight.flatten(), bias]`` for a
        DenseBlock."""
        raise NotImplementedError


#: the rule of what has none (functional calls, recurrent gate gradients): trailing d_out
PLAIN = LayerRule()


class LinearRule(LayerRule):
    """``nn.Linear``: a KroneckerBlock; input (N, *mid, d_in) gives S = prod(mid) positions,
    the samples on any axis but the feature axis (a sequence-first (T, N, d) input gives
    S = T).  The bias's ones column stays implicit (``KroneckerBlock(ones=True)``)."""

    def sample_axis_ok(self, mod: nn.Module, axis: int, ndim: int) -> bool:
        return axis != ndim - 1

    def kronecker_update(self, mod: nn.Module) -> bool:
        return True

    def factor_widths(self, mod, weight, bias):
        return (mod.in_features + int(bias) if weight else 1), mod.out_features

    def gradient_sums(self, mod, a, n, o, weight, bias):
        a3 = a.reshape(n, -1, mod.in_features) if weight else None  # a view: no memory

        def sums(g: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            lead = g.shape[2]  # g (N, S, L, d_out)
            gt = g.reshape(n, g.shape[1], -1).transpose(1, 2)  # (N, L d_out, S), a view
            return weight_sums(gt, None if a3 is None else a3.to(g.dtype), n, lead, bias, out)

        return sums

    def block(self, mod, inputs, gs, n, name, weight, bias):
        if isinstance(gs[0], Summed):
            return DenseBlock(functools.reduce(torch.add, (g.sums for g in gs)), name)
        if not weight:  # bias only: the ones column is the whole input
            a_parts = [g_c.new_ones((n, g_c.shape[1], 1)) for g_c in gs]
        else:
            a_parts = [a_c.reshape(n, -1, mod.in_features) for a_c in inputs]
        return KroneckerBlock(cat(a_parts, 1).contiguous(), cat(gs, 1), name,
                              ones=bias and weight)


class ConvRule(LayerRule):
    r"""``nn.Conv1d/2d/3d``: a KroneckerBlock on unfolded patches a (N, L, C_in k [+ 1]) in the
    weight's (C_in, k_1, ...) order, L output positions; stride, dilation, padding (ints,
    ``'same'``, ``'valid'``) and every ``padding_mode``.

    ``groups > 1``: the G groups are put on the position axis (a (N, G L, C_in/G k), g zero
    outside each group's output channels), which represents the (C_out, C_in/G k) weight
    exactly; when that is larger than the per-sample gradient (many groups, e.g. depthwise),
    the DenseBlock of the per-sample gradient instead (:func:`_grouped_conv_weights`,
    :func:`_grouped_conv_dense`, :func:`_grouped_conv_block`; docs/concepts.md, "Grouped and
    depthwise convolutions").
    """

    channels_first = True
    unbatched = (nn.modules.conv._ConvNd,)

    def kronecker_update(self, mod: nn.Module) -> bool:
        return bool(mod.groups == 1)

    def factor_widths(self, mod, weight, bias):
        if mod.groups > 1:  # grouped: _grouped_conv_block's own dense form
            return None
        k = mod.in_channels * math.prod(mod.kernel_size)
        return (k + int(bias) if weight else 1), mod.out_channels

    def gradient_sums(self, mod, a, n, o, weight, bias):
        return conv_gradient_sums(mod, a, n, o, weight, bias)

    def block(self, mod, inputs, gs, n, name, weight, bias):
        if isinstance(gs[0], Summed):
            return DenseBlock(functools.reduce(torch.add, (g.sums for g in gs)), name)
        groups = mod.groups
        dense = groups > 1 and weight and _dense_grouped(mod, gs, n)
        # a grouped convolution's dense block stores the live taps only (_grouped_conv_block):
        # its patches are formed for those alone
        taps = live_tap_axes(mod, [tuple(a_c.shape[2:]) for a_c in inputs]) if dense else None
        if dense and taps is None and _convolves(inputs, gs):
            return _grouped_conv_weights(mod, inputs, gs, n, name, bias)
        if dense and _unfoldable(mod, gs):
            return _grouped_conv_dense(mod, inputs, gs, n, name, bias)
        ones = bias and weight and groups == 1
        if weight:
            a_parts = [conv_patches(mod, a_c, ones, taps) for a_c in inputs]
        else:  # bias only: the ones column is the whole input
            a_parts = [g_c.new_ones((n, g_c.shape[1], 1)) for g_c in gs]
        a, g = cat(a_parts, 1), cat(gs, 1)
        if groups > 1:
            return _grouped_conv_block(a, g, groups, name, weight, bias,
                                       None if taps is None else _flat_taps(taps))
        return KroneckerBlock(a.contiguous(), g, name)


class EmbeddingRule(LayerRule):
    r"""``nn.Embedding``: a KroneckerBlock with one-hot inputs and weight :math:`W^\top` (D, V)
    (its parameter is the *transposed* table), stored as the index factor (N, T) int64 of
    :class:`~ntkcore.KroneckerBlock` (``one_hot = V``; the one-hot rows are never formed),
    ``-1`` at ``padding_idx``, whose row gets no gradient in torch."""

    transposed = True

    def block(self, mod, inputs, gs, n, name, weight, bias):
        a = cat([embedding_index(a_c.reshape(n, -1), mod.padding_idx, mod.num_embeddings)
                 for a_c in inputs], 1)
        with trusted_blocks():  # indices the embedding took: no range check (a sync)
            return KroneckerBlock(a.contiguous(), cat(gs, 1), name, one_hot=mod.num_embeddings)


class AffineRule(LayerRule):
    r"""A normalisation layer with an elementwise affine, :math:`y[n,s,c] = \gamma[c]\,\hat
    x[n,s,c] + \beta[c]` (c the parameter's entries, s the positions it is broadcast over):

    .. math:: J_\gamma[n,o,c] = \sum_s g[n,s,o,c]\,\hat x[n,s,c], \qquad
              J_\beta[n,o,c] = \sum_s g[n,s,o,c].

    The positions can always be summed first, and the summed (N, O, C) array *is* the
    per-sample gradient: a :class:`DenseBlock` (N, O, C [+ C]), exact, S times smaller than
    any per-position form and the cheapest Gram (its rows are arbitrary C-vectors), built from
    the hooks in O(N S O C) work with no ``torch.func`` pass.  :math:`\hat x` is recomputed
    from the call's input by :meth:`xhat` (:func:`affine_sums`), and g is reduced pass by
    pass (:meth:`reducer`).  A subclass implements :meth:`xhat`."""

    def xhat(self, mod: nn.Module, a: torch.Tensor) -> torch.Tensor:
        """The normalised input :math:`\\hat x`: the module's normalisation without affine."""
        raise NotImplementedError

    def reducer(self, mod, a, n, weight, bias):
        return affine_sums(self, mod, a, n, weight, bias)

    def block(self, mod, inputs, gs, n, name, weight, bias):
        if isinstance(gs[0], Summed):
            return DenseBlock(functools.reduce(torch.add, (g.sums for g in gs)), name)
        return DenseBlock(functools.reduce(torch.add, (
            affine_sums(self, mod, a_c, n, weight, bias)(g_c)
            for a_c, g_c in zip(inputs, gs, strict=True))), name)


class _TrailingNormRule(AffineRule):
    """Normalises the trailing ``normalized_shape`` axes: the samples on none of them."""

    def sample_axis_ok(self, mod, axis, ndim):
        return axis < ndim - len(mod.normalized_shape)

    def out_width(self, mod, gr):
        return math.prod(mod.normalized_shape)


class LayerNormRule(_TrailingNormRule):
    """``nn.LayerNorm`` over any ``normalized_shape``."""

    def xhat(self, mod, a):
        return NORMALISE[F.layer_norm]({"normalized_shape": mod.normalized_shape,
                                        "eps": mod.eps})(a)


class RMSNormRule(_TrailingNormRule):
    """``nn.RMSNorm`` over any ``normalized_shape``."""

    def xhat(self, mod, a):
        return NORMALISE[F.rms_norm]({"normalized_shape": mod.normalized_shape,
                                      "eps": mod.eps})(a)


class BatchNormRule(AffineRule):
    """``nn.BatchNorm1d/2d/3d`` in eval mode (running statistics; batch statistics couple the
    samples and are refused by the provider)."""

    channels_first = True

    def xhat(self, mod, a):
        return NORMALISE[F.batch_norm]({"training": False, "running_mean": mod.running_mean,
                                        "running_var": mod.running_var, "eps": mod.eps})(a)


class GroupNormRule(AffineRule):
    """``nn.GroupNorm`` (per-sample statistics)."""

    channels_first = True

    def xhat(self, mod, a):
        return NORMALISE[F.group_norm]({"num_groups": mod.num_groups, "eps": mod.eps})(a)


class InstanceNormRule(AffineRule):
    """``nn.InstanceNorm1d/2d/3d`` with an affine: per-sample statistics, or the running ones
    in eval mode with ``track_running_stats`` (as torch's forward decides)."""

    channels_first = True

    def xhat(self, mod, a):
        stats = not mod.training and mod.track_running_stats
        return NORMALISE[F.instance_norm]({
            "running_mean": mod.running_mean if stats else None,
            "running_var": mod.running_var if stats else None,
            "use_input_stats": not stats, "eps": mod.eps})(a)


# --------------------------------------------------------------------------------------------
# recurrent layers: nn.RNN / nn.GRU / nn.LSTM unrolled over time (positions = time steps)
# --------------------------------------------------------------------------------------------
@dataclass
class RecurrentPass:
    """What one layer and direction of one call leaves for the blocks (batch-first tensors)."""

    key: str  # "l0", "l0_reverse", ...
    x: torch.Tensor  # (N, T, I): the layer's input
    u: torch.Tensor  # (N, T, G H): W_ih x_t + b_ih, the gradient target
    h_prev: list[torch.Tensor]  # T x (N, H): h_{t-1} in time order
    r: list[torch.Tensor] | None  # T x (N, H): GRU reset gates in time order
    views: dict[str, torch.Tensor]  # local parameter name -> the alias the pass used


class RecurrentRule(LayerRule):
    r"""A recurrent layer unrolled over time: the provider replaces the module's output by
    :meth:`forward` and gets one KroneckerBlock per layer, direction and matrix from
    :meth:`blocks`; a subclass implements :meth:`cell` (and :meth:`hh_grad` where
    :math:`v_t` does not enter the cell where :math:`u_t` does).

    Recurrent layers as time-unrolled Linear layers
    -----------------------------------------------
    Layer k, direction d of an ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` applies two weight matrices
    at every time step t (torch's gate order; G = 1, 3, 4 gates of H units):

    .. math:: u_t = W_{ih} x_t + b_{ih}, \qquad v_t = W_{hh} h_{t-1} + b_{hh}
              \qquad (u_t, v_t \in \mathbb R^{G H},\ h_{-1} = h_0),

    then the cell (:meth:`cell`): RNN :math:`h_t = \tanh(u_t + v_t)` (or ReLU); GRU
    :math:`r, z = \sigma(u_{r,z} + v_{r,z})`, :math:`n = \tanh(u_n + r \odot v_n)`,
    :math:`h_t = (1 - z) \odot n + z \odot h_{t-1}`; LSTM :math:`i, f, g, o = \sigma, \sigma,
    \tanh, \sigma\,(u + v)`, :math:`c_t = f \odot c_{t-1} + i \odot g`,
    :math:`h_t = o \odot \tanh(c_t)`.  With the positions s = t, :math:`[W_{ih} | b_{ih}]` is a
    Kronecker block with

    .. math:: a_{ih}[n, t] = [x_t, 1], \qquad g_{ih}[n, t, o] = \partial f_o(x_n) / \partial u_t,

    and :math:`[W_{hh} | b_{hh}]` one with :math:`a_{hh}[n, t] = [h_{t-1}, 1]` and
    :math:`g_{hh}[n, t, o] = \partial f_o / \partial v_t`.  The second needs no gradient pass of its
    own: :math:`v_t` enters the cell exactly where :math:`u_t` does, except GRU's candidate gate,
    which sees :math:`r_t \odot v_{n,t}` (:math:`b_{hn}` sits inside the product), so

    .. math:: g_{hh} = g_{ih} \ \text{(RNN, LSTM; all gates of the GRU but n)}, \qquad
              g_{hh, n} = r_t \odot g_{ih, n} \ \text{(GRU)}.

    ``torch``'s fused op hides :math:`x_t` (above layer 0), :math:`h_{t-1}` and the gate
    pre-activations from hooks, so the provider replaces the module's output in its hooked forward
    by :meth:`forward`, which recomputes it step by step with the module's own
    parameters (equal to the fused output up to rounding), computing all :math:`u_t` of a layer as
    one tensor: the gradient of every output with respect to it is :math:`g_{ih}` for all t at once
    (it is split by ``unbind``, whose backward stacks, so no per-step zero padding).
    Structured: any ``num_layers``, ``bidirectional``, ``bias``, ``batch_first``, explicit or
    default ``hx``, 3-D tensor input; not (a DenseBlock from the exact per-sample path):
    ``proj_size > 0``, unbatched 2-D input, ``PackedSequence`` input, subclasses with their own
    ``forward``.  Inter-layer dropout in training mode is random and refused by the provider.
    """

    #: torch's ``mode`` strings this cell computes
    modes: tuple[str, ...] = ()
    #: the cell carries a state c_t (LSTM)
    cell_state = False

    def accepts(self, mod: nn.Module) -> bool:
        """Whether ``mod`` can be unrolled: no projection, a known cell."""
        return bool(mod.proj_size == 0 and mod.mode in self.modes)

    def cell(self, mod: nn.Module, u: torch.Tensor, v: torch.Tensor, h: torch.Tensor,
             c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None,
                                              torch.Tensor | None]:
        """One time step in ATen's order of operations: (h_t, c_t or None, r_t or None) from
        u_t, v_t, h_{t-1}, c_{t-1}."""
        raise NotImplementedError

    def hh_grad(self, g: torch.Tensor, rec: RecurrentPass, detach: bool) -> torch.Tensor:
        r""":math:`g_{hh}` of one pass from its :math:`g_{ih}`."""
        return g

    def pairs(self, mod: nn.Module) -> list[tuple[str, str, str]]:
        """(suffix, weight name, bias name) per layer, direction and matrix (ih before hh), in
        torch's parameter order: ``("ih_l0", "weight_ih_l0", "bias_ih_l0")``, ..."""
        dirs = ("", "_reverse") if mod.bidirectional else ("",)
        return [(f"{kind}_l{k}{sfx}", f"weight_{kind}_l{k}{sfx}", f"bias_{kind}_l{k}{sfx}")
                for k in range(mod.num_layers) for sfx in dirs for kind in ("ih", "hh")]

    def _direction(self, mod: nn.Module, x: torch.Tensor, h: torch.Tensor,
                   c: torch.Tensor | None, key: str) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor | None,
                                                              RecurrentPass]:
        """One layer and direction over x (N, T, I) from h_0 (N, H) (and c_0): its outputs
        (N, T, H), h_T, c_T and the :class:`RecurrentPass`.  Each parameter enters through
        one alias (``p.view(p.shape)``), so the provider can count the uses of the parameter
        outside the module in the autograd graph (one edge per call)."""
        views = {}
        for kind in ("ih", "hh"):
            for w in ("weight", "bias"):
                p = getattr(mod, f"{w}_{kind}_{key}", None)
                if p is not None:
                    views[f"{w}_{kind}_{key}"] = p.view(p.shape)
        get = views.get
        u = F.linear(x, views[f"weight_ih_{key}"], get(f"bias_ih_{key}"))
        if not u.requires_grad and torch.is_grad_enabled():
            u.requires_grad_()  # (W_ih, b_ih frozen, x constant): g_hh still comes from g_ih
        steps = u.unbind(1)
        n_t = len(steps)
        hs: list[torch.Tensor] = [h] * n_t
        h_prev: list[torch.Tensor] = [h] * n_t
        rs: list[torch.Tensor] | None = None
        w_hh, b_hh = views[f"weight_hh_{key}"], get(f"bias_hh_{key}")
        for t in (reversed(range(n_t)) if key.endswith("_reverse") else range(n_t)):
            h_prev[t] = h
            h, c, r = self.cell(mod, steps[t], F.linear(h, w_hh, b_hh), h, c)
            hs[t] = h
            if r is not None:
                rs = rs or [h] * n_t
                rs[t] = r
        return torch.stack(hs, 1), h, c, RecurrentPass(key, x, u, h_prev, rs, views)

    def forward(self, mod: nn.Module, inp: torch.Tensor,
                hx: Any) -> tuple[tuple[torch.Tensor, Any], list[RecurrentPass]]:
        """``mod(inp, hx)`` unrolled step by step (3-D ``inp``), as ``(output, h_n)`` (LSTM:
        ``(output, (h_n, c_n))``), and the passes of every layer and direction.  The input
        and ``hx`` are cloned first, so that later in-place changes by the model cannot alter
        the recorded factors."""
        bf, lstm = mod.batch_first, self.cell_state
        x = (inp if bf else inp.transpose(0, 1)).clone()  # (N, T, I)
        n, nd = x.shape[0], 2 if mod.bidirectional else 1
        if hx is None:
            zeros = x.new_zeros((mod.num_layers * nd, n, mod.hidden_size))
            h0, c0 = zeros, (zeros if lstm else None)
        else:
            h0, c0 = (hx[0].clone(), hx[1].clone()) if lstm else (hx.clone(), None)
        finals_h, finals_c, passes = [], [], []
        for k in range(mod.num_layers):
            outs = []
            for d in range(nd):
                i = k * nd + d
                y, h_t, c_t, rec = self._direction(mod, x, h0[i], c0[i] if lstm else None,
                                                   f"l{k}" + ("_reverse" if d else ""))
                outs.append(y)
                finals_h.append(h_t)
                finals_c.append(c_t)
                passes.append(rec)
            x = cat(outs, -1)
        out = x if bf else x.transpose(0, 1)
        h_n = torch.stack(finals_h)
        return (out, (h_n, torch.stack(finals_c)) if lstm else h_n), passes

    def blocks(self, mod: nn.Module, path: str, calls: list[list[RecurrentPass]],
               gs: list[torch.Tensor], names: list[str], n: int,
               detach: bool) -> dict[str, KroneckerBlock]:
        r"""The KroneckerBlocks of ``mod``, ``{block name: block}`` in parameter order.

        ``calls[i]`` are the passes of call i (:meth:`forward`), ``gs`` the matching
        :math:`g_{ih}` (N, T, O, G H), one per pass in the same order, ``names`` the selected
        local parameter names.  One block per selected (weight, bias) pair, named
        ``path.<first selected of the pair>``, layout ``[W | b]`` (the bias as the last column,
        as a Linear's); the calls are concatenated along the positions.  ``detach`` drops the
        graph of the a factors and of :math:`r_t`.
        """
        sel = set(names)
        by_key: dict[str, list[tuple[RecurrentPass, torch.Tensor]]] = {}
        flat = [rec for passes in calls for rec in passes]
        for rec, g in zip(flat, gs, strict=True):
            by_key.setdefault(rec.key, []).append((rec, g))
        blocks: dict[str, KroneckerBlock] = {}
        for suffix, wname, bname in self.pairs(mod):
            weight, bias = wname in sel, bname in sel
            if not (weight or bias):
                continue
            kind, key = suffix[:2], suffix[3:]
            a_parts, g_parts = [], []
            for rec, g in by_key[key]:
                if kind == "hh":
                    g = self.hh_grad(g, rec, detach)
                a = rec.x if kind == "ih" else torch.stack(rec.h_prev, 1)
                a = a.detach() if detach else a
                if not weight:
                    a = a.new_ones((n, a.shape[1], 1))
                elif bias:
                    a = with_ones(a)
                a_parts.append(a)
                g_parts.append(g)
            name = f"{path}.{wname if weight else bname}"
            blocks[name] = KroneckerBlock(cat(a_parts, 1).contiguous(), cat(g_parts, 1), name)
        return blocks


class RNNRule(RecurrentRule):
    r"""``nn.RNN``: :math:`h_t = \tanh(u_t + v_t)` (or ReLU)."""

    modes = ("RNN_TANH", "RNN_RELU")

    def cell(self, mod, u, v, h, c):
        pre = u + v
        return (torch.tanh(pre) if mod.mode == "RNN_TANH" else torch.relu(pre)), None, None


class GRURule(RecurrentRule):
    r"""``nn.GRU``: its candidate gate sees :math:`r_t \odot v_{n,t}`, so
    :math:`g_{hh,n} = r_t \odot g_{ih,n}` (the other gates: :math:`g_{hh} = g_{ih}`)."""

    modes = ("GRU",)

    def cell(self, mod, u, v, h, c):
        u_r, u_z, u_n = u.chunk(3, 1)
        v_r, v_z, v_n = v.chunk(3, 1)
        r = torch.sigmoid(u_r + v_r)
        z = torch.sigmoid(u_z + v_z)
        n = torch.tanh(u_n + r * v_n)
        return (h - n) * z + n, None, r

    def hh_grad(self, g, rec, detach):
        r = torch.stack(rec.r, 1)
        hid = r.shape[-1]
        if not detach:  # differentiable: no out= (autograd does not record into it)
            return torch.cat([g[..., :2 * hid], g[..., 2 * hid:] * r[:, :, None, :]], -1)
        out = recycled(g.shape, g.dtype, g.device)  # (N, T, O, 3H): host pages reused
        out[..., :2 * hid] = g[..., :2 * hid]
        torch.mul(g[..., 2 * hid:], r.detach()[:, :, None, :], out=out[..., 2 * hid:])
        return out


class LSTMRule(RecurrentRule):
    """``nn.LSTM`` (no projection)."""

    modes = ("LSTM",)
    cell_state = True

    def cell(self, mod, u, v, h, c):
        i, f, g, o = (v + u).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c, None


_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_IN = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

#: module class -> its rule; a module is structured when it is an instance of a key and
#: keeps that class's ``forward`` (a subclass may compute anything).  Adding a layer type:
#: a rule class and one entry here.
RULES: dict[type[nn.Module], LayerRule] = {
    nn.Linear: LinearRule(),
    **dict.fromkeys(_CONV, ConvRule()),
    nn.Embedding: EmbeddingRule(),
    nn.LayerNorm: LayerNormRule(),
    nn.RMSNorm: RMSNormRule(),
    **dict.fromkeys(_BN, BatchNormRule()),
    nn.GroupNorm: GroupNormRule(),
    **dict.fromkeys(_IN, InstanceNormRule()),
    nn.RNN: RNNRule(),
    nn.GRU: GRURule(),
    nn.LSTM: LSTMRule(),
}


def rule_for(mod: nn.Module, own_forward: bool = True) -> LayerRule | None:
    """The rule of ``mod`` (:data:`RULES`), or None: no rule for its class, or (unless
    ``own_forward`` is False) a subclass overriding ``forward``."""
    base = next((c for c in RULES if isinstance(mod, c)), None)
    if base is None or (own_forward and type(mod).forward is not base.forward):
        return None
    return RULES[base]


def recurrent_rule(mod: nn.Module) -> RecurrentRule | None:
    """The rule of a recurrent ``mod`` that can be unrolled (:meth:`RecurrentRule.accepts`),
    or None."""
    rule = rule_for(mod)
    return rule if isinstance(rule, RecurrentRule) and rule.accepts(mod) else None


def recurrent_forward(mod: nn.Module, inp: torch.Tensor,
                      hx: Any) -> tuple[tuple[torch.Tensor, Any], list[RecurrentPass]]:
    """:meth:`RecurrentRule.forward` of ``mod``'s rule."""
    return RULES[type(mod)].forward(mod, inp, hx)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# normalisations without their affine: one home for the module rules and torch_functional
# --------------------------------------------------------------------------------------------
#: normalisation function -> builder of :math:`\hat x` from the call's arguments by name (the
#: call without weight and bias), or None where the call couples the samples (batch statistics)
NORMALISE: dict[Any, Callable[[dict], Callable[[torch.Tensor], torch.Tensor] | None]] = {
    F.layer_norm: lambda a: lambda x: F.layer_norm(x, a["normalized_shape"], None, None,
                                                   a["eps"]),
    F.rms_norm: lambda a: lambda x: F.rms_norm(x, a["normalized_shape"], None, a["eps"]),
    F.batch_norm: lambda a: (  # eval mode only: batch statistics couple the samples
        None if a["training"] or a["running_mean"] is None or a["running_var"] is None
        else lambda x: F.batch_norm(x, a["running_mean"], a["running_var"], None, None, False,
                                    0.0, a["eps"])),
    F.group_norm: lambda a: lambda x: F.group_norm(x, a["num_groups"], None, None, a["eps"]),
    F.instance_norm: lambda a: lambda x: F.instance_norm(
        x, a["running_mean"], a["running_var"], None, None, a["use_input_stats"], 0.0, a["eps"]),
}


# --------------------------------------------------------------------------------------------
# factors
# --------------------------------------------------------------------------------------------
def _conv_padding(mod: Any, i: int) -> tuple[int, int]:
    """The padding (before, after) of spatial axis ``i`` of a convolution's input."""
    if mod.padding == "same":  # torch pads the extra element on the right
        total = mod.dilation[i] * (mod.kernel_size[i] - 1)
        return total // 2, total - total // 2
    if mod.padding == "valid":
        return 0, 0
    return mod.padding[i], mod.padding[i]


def conv_patches(mod: nn.Module, a: torch.Tensor, ones: bool,
                 taps: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Unfolded input patches (N, L, C_in * prod(k) [+ 1]) in the weight's (C_in, k1, k2, ...)
    order, with a trailing ones column if ``ones``; written with a single copy, so that
    ``y[n, :, l] = [W.reshape(C_out, -1), b] @ a[n, l]``, into host memory recycled between
    calls (``torch_recycle``).  ``taps`` (per spatial axis, the bool masks of
    :func:`live_tap_axes`): only those taps, (N, L, C_in * prod(k_live))."""
    nd = len(mod.kernel_size)
    flat: list[int] = []  # (lo, hi) per axis, the last axis first as F.pad wants
    for i in reversed(range(nd)):
        flat += _conv_padding(mod, i)
    if any(flat):
        mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
        a = F.pad(a, flat, mode=mode)
    for i in range(nd):
        k, d, s = mod.kernel_size[i], mod.dilation[i], mod.stride[i]
        span = d * (k - 1) + 1
        a = a.unfold(2 + i, span, s)  # appends a window axis
        if d > 1:
            a = a[..., ::d]
    kernel = tuple(mod.kernel_size)
    if taps is not None:  # the window axes cut to the live taps (a slice when contiguous)
        for i, live in enumerate(taps):
            idx = live.nonzero().flatten()
            lo, m = int(idx[0]), int(idx.numel())
            a = (a.narrow(2 + nd + i, lo, m) if int(idx[-1]) - lo + 1 == m
                 else a.index_select(2 + nd + i, idx.to(a.device)))
        kernel = tuple(int(live.sum()) for live in taps)
    n, c = a.shape[0], a.shape[1]
    lens = tuple(a.shape[2:2 + nd])
    # (N, C, L1..Lnd, k1..knd) -> (N, L1..Lnd, C, k1..knd), a strided view
    view = a.permute([0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)])
    dk = c * math.prod(kernel)
    out = recycled((n, math.prod(lens), dk + int(ones)), a.dtype, a.device)
    if ones:
        out[..., dk] = 1
    out[..., :dk].unflatten(2, (c, *kernel)).unflatten(1, lens).copy_(view)
    return out


def cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)``, or the one part itself (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def with_ones(a: torch.Tensor) -> torch.Tensor:
    """``a`` with a trailing ones column (a bias's input)."""
    return torch.cat([a, a.new_ones((*a.shape[:-1], 1))], dim=-1)


def weight_sums(gt: torch.Tensor, a: torch.Tensor | None, n: int, lead: int,
                bias: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    r"""``[g^T a, g^T 1]`` per sample: gt (N, L d_out, S), a (N, S, d_in) or None (no weight)
    -> (N, L, d_out d_in [+ d_out]), :math:`W[n,l,c,k] = \sum_s g[n,s,l,c]\,a[n,s,k]` row-major
    (c, k) and the bias's :math:`\sum_s g[n,s,l,c]`: a linear layer's per-sample gradient, in
    DenseBlock layout.  One batched GEMM; a transposed ``gt`` is read as it is.  ``out``
    (N, L, W), a slot of the O passes' array: written in place (one pass, L = 1: the GEMM
    and the sum write into it; ResNet-50's 512-channel 3 x 3 layer, N = 8: 52 -> 24 ms a pass
    against a fresh 75 MB result copied in)."""
    if out is not None and lead == 1:
        dd = 0 if a is None else gt.shape[1] * a.shape[2]
        if a is not None:
            torch.bmm(gt, a, out=out[:, 0, :dd].view(n, gt.shape[1], a.shape[2]))
        if bias:
            torch.sum(gt, -1, out=out[:, 0, dd:])
        return out
    pieces = [] if a is None else [torch.bmm(gt, a).reshape(n, lead, -1)]
    if bias:
        pieces.append(gt.sum(-1).reshape(n, lead, -1))
    return into(cat(pieces, -1), out)


def into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A reducer's ``result`` copied into its slot ``out`` (returned), or itself (None)."""
    return result if out is None else out.copy_(result)


#: :func:`conv_gradient_sums` declines (the layer keeps its Kronecker factors) where the
#: patches are not kept and C_in prod(k) is below this: one grouped convolution's weight
#: gradient a pass was 3x slower than a GEMM with the patches at C_in prod(k) = 27 (a small
#: CNN's first layer, one thread), and the small CNN's whole ``ntk`` call 10% slower.
GROUPED_WEIGHT_MIN_WIDTH = 32


def conv_gradient_sums(mod: Any, a: torch.Tensor, n: int, o: int, weight: bool,
                       bias: bool) -> Reducer | None:
    r"""The map g (N, S, L, C_out) -> (N, L, C_out C_in prod(k) [+ C_out]) of one call of an
    ungrouped convolution ``mod`` with input ``a`` (N, C_in, *L_in), O outputs in all:

    .. math:: \partial f_l(x_n) / \partial W = \sum_s g[n, s, l, :]\,P[n, s, :]^\top,
              \qquad \partial f_l(x_n) / \partial b = \sum_s g[n, s, l, :]

    with P the unfolded patches (N, S, K), K = C_in prod(k), and g read in its (N, L, C_out,
    S) storage.  Where P is no larger than the block (S K <= O C_out K, or a view: a 1 x 1
    convolution of stride 1), P is formed once for all passes and each pass is one batched
    GEMM (:func:`weight_sums`); else each pass is the weight gradient of one convolution with
    N groups (:func:`_grouped_weight_gradient`), which never forms P: P held across the O
    passes would be memory the Jacobian does not show (ResNet-50's first stages: S K is
    5-20 times O C_out K), which the budget of ``ntk`` does not charge.  Measured on one
    thread: the GEMM is as fast or faster a pass (3x at C_in = 3), the grouped convolution
    equal within 10% on ResNet-50's layers, 1.4x slower on its stem; None (declined) below
    :data:`GROUPED_WEIGHT_MIN_WIDTH`."""
    p = None
    if weight:
        nd = len(mod.kernel_size)
        pads = [_conv_padding(mod, i) for i in range(nd)]
        one = math.prod(mod.kernel_size) == 1 and all(v == 1 for v in mod.stride) and \
            not any(lo or hi for lo, hi in pads)
        if one:  # the input itself, read transposed
            p = a.reshape(n, a.shape[1], -1).transpose(1, 2)
        elif math.prod(_out_lens(mod, a.shape[2:], pads)) <= o * mod.out_channels:
            p = (F.unfold(a, mod.kernel_size, dilation=mod.dilation, padding=mod.padding,
                          stride=mod.stride).transpose(1, 2) if _unfolds(mod)
                 else conv_patches(mod, a, False))
    if weight and p is None and mod.in_channels * math.prod(mod.kernel_size) < \
            GROUPED_WEIGHT_MIN_WIDTH:
        return None  # the grouped convolution is slow here, the patches too large: factors
    grouped = _grouped_weight_gradient(mod, a, n) if weight and p is None else None

    def sums(g: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        lead = g.shape[2]  # g (N, S, L, C) viewing (N, L, C, S)
        gv = g.permute(0, 2, 3, 1).reshape(n, -1, g.shape[1])  # (N, L C, S)
        if grouped is None:
            return weight_sums(gv, None if p is None else p.to(g.dtype), n, lead, bias, out)
        pieces = [grouped(gv, lead).reshape(n, lead, -1)]
        if bias:
            pieces.append(gv.sum(-1).reshape(n, lead, -1))
        return into(cat(pieces, -1), out)

    return sums


def _grouped_weight_gradient(mod: Any, a: torch.Tensor,
                             n: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    r"""gv (N, L C_out, S) -> (N, L, G, C_out/G C_in/G prod(k)): the per-sample weight gradients of
    a convolution with G groups (G = 1: ungrouped) as the weight gradient of one convolution
    with N G groups: input (1, N C_in, *L_in), output gradient (1, N G L C_out/G, *L_out),
    weight (N G L C_out/G, C_in/G, *k) (``convolution_backward``, weight only; the weight's
    values are not read):

    .. math:: \partial f_l(x_n) / \partial W[c, i, \kappa] = \sum_s g[n, l, c, s]\,
              x[n, \gamma(c) C_{in}/G + i, s \cdot \text{stride} + \kappa \cdot
              \text{dilation} - \text{pad}]

    with :math:`\gamma(c)` the group of output channel c: the convolution's own weight
    gradient, one group per sample and group.  With G > 1 and L > 1 the output channels are
    put group-major first ((N, G, L, C_out/G): a copy of g), and the result is returned as a
    view in (N, L, G, ...) order, which the caller's write into its block copies once.
    Padding other than zeros on both sides alike is applied to ``a`` first."""
    nd = len(mod.kernel_size)
    pads = [_conv_padding(mod, i) for i in range(nd)]
    numeric = mod.padding_mode == "zeros" and all(lo == hi for lo, hi in pads)
    x, padding = a, [lo for lo, _ in pads]
    if not numeric:
        mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
        x, padding = F.pad(a, [v for lo_hi in reversed(pads) for v in lo_hi], mode=mode), [0] * nd
    lens = _out_lens(mod, a.shape[2:], pads)
    x1 = x.reshape(1, -1, *x.shape[2:])  # (1, N C_in, *L_in)
    groups = mod.groups

    def grad(gv: torch.Tensor, lead: int) -> torch.Tensor:
        go = gv.reshape(n, lead, groups, -1).transpose(1, 2).reshape(1, -1, *lens)
        w = go.new_empty(1).expand(go.shape[1], a.shape[1] // groups, *mod.kernel_size)
        gw = torch.ops.aten.convolution_backward(
            go, x1.to(gv.dtype), w, None, list(mod.stride), padding, list(mod.dilation), False,
            [0] * nd, n * groups, [False, True, False])[1]
        return gw.reshape(n, groups, lead, -1).transpose(1, 2)  # (N, L, G, C_out/G C_in/G k)

    return grad


def _out_lens(mod: Any, lens: Any, pads: list[tuple[int, int]]) -> list[int]:
    """The output lengths of convolution ``mod`` on input lengths ``lens``, padded by
    ``pads`` (before, after) per axis."""
    return [(int(lens[i]) + lo + hi - mod.dilation[i] * (mod.kernel_size[i] - 1) - 1)
            // mod.stride[i] + 1 for i, (lo, hi) in enumerate(pads)]


def _unfolds(mod: Any) -> bool:
    """A 2-d convolution whose patches ``F.unfold`` forms (zero padding given as numbers)."""
    return isinstance(mod, nn.Conv2d) and mod.padding_mode == "zeros" and \
        not isinstance(mod.padding, str)


def embedding_index(idx: torch.Tensor, padding_idx: int | None, v: int) -> torch.Tensor:
    """The indices ``idx`` of a lookup in a (v, D) table as an index factor: int64, ``-1`` at
    ``padding_idx`` (whose row gets no gradient in torch; negative counts from the end)."""
    idx = idx.to(torch.int64)
    if padding_idx is None:
        return idx
    return torch.where(idx == padding_idx % v, -1, idx)


#: Flop-equivalents, at the GEMM rate, of one element that :func:`drop_zero_positions` copies
#: (a gather along the positions) and of one element its zero test reads (a max and a min
#: over a view).  Measured on the 2-core development machine (float32, under load, so as
#: ratios to a GEMM timed in the same process): ``index_select`` of a conv's g 210-410
#: (contiguous) to 550-1000 (channels-first, strided) flop-equivalents an element, the max
#: and the min 260-430; the lower ends are charged.
COPY_FLOPS = 256
SCAN_FLOPS = 256
#: Below this many elements of a and g (float32: 1 MiB, in cache) a block's zero positions
#: are dropped unpriced: the read and the copy take microseconds either way.
PRICED_ELEMENTS = 1 << 18


def drop_zero_positions(block: DenseBlock | KroneckerBlock,
                        priced: bool = True) -> DenseBlock | KroneckerBlock:
    r"""``block`` without the positions at which its output gradients vanish for every sample.

    A position s with :math:`g[n, s, o, :] = 0` for all n and o adds nothing to the weight
    gradient :math:`\sum_s g[n,s,o]\, a[n,s]^\top`, so dropping it from a and g is exact: a
    classifier reading one token (ViT's class token, BERT's pooler) leaves S - 1 of the S
    token positions of every Linear after the last attention at zero, and the Gram's
    positions route then costs :math:`N^2` instead of :math:`N^2 S^2` per unit of width.
    Cost: a read of sample 0's g (a position live there is live), and of the other samples
    over the range of positions from sample 0's first dead one to its last (a max and a min
    over a view, no copy), then a copy of the kept positions of a and g.

    With ``priced`` (the default; False: whatever the cost) that cost is weighed against the
    flops the Gram saves: ``cheapest_flops`` (ntkcore/gram.py) of the block on an N x N tile
    in trace mode (the mode that gains least) with S positions and with the kept ones.  The
    read is skipped unless sample 0's dead positions, were they dead everywhere, would repay
    it and the copy; the copy is skipped unless the positions dead everywhere repay it
    (:data:`COPY_FLOPS`, :data:`SCAN_FLOPS`; a block under :data:`PRICED_ELEMENTS` is not
    priced).  A convolution whose stride skips the last row and column of its input (59 of
    900 positions) keeps them: the materialise route would save 7% of forming the per-sample
    weights, less than a copy of g costs.  A DenseBlock, S = 1, or a g on an autograd graph
    (a zero value may have a non-zero derivative) is returned as it is; at least one position
    stays.
    """
    return drop_zero_positions_all([block], priced)[0]


def _candidate(block: DenseBlock | KroneckerBlock) -> bool:
    return isinstance(block, KroneckerBlock) and block.num_positions > 1 \
        and not block.g.requires_grad


def drop_zero_positions_all(blocks: list[DenseBlock | KroneckerBlock],
                            priced: bool = True) -> list[DenseBlock | KroneckerBlock]:
    """:func:`drop_zero_positions` of every block with at most two host synchronisations
    for all of them (not two or more per block): each block's count, first and last dead
    position of sample 0 are reduced on the device and read together (the only one when no
    block has one: a CNN's every position is usually live); then the blocks with dead
    positions worth a scan count, locate and gather their kept positions with one more read
    (a stable sort in place of ``nonzero``, which would sync per block)."""
    cands = [i for i, b in enumerate(blocks) if _candidate(b)]
    if not cands:
        return list(blocks)
    lives = {i: _live(blocks[i].g[0]) for i in cands}  # (S,) each
    read = _read_stats([~lives[i] for i in cands])  # sync 1: count, first, last dead
    out = list(blocks)
    scanned = {}  # i -> price function or None, for the blocks whose range is scanned
    for i, (count, lo, last) in zip(cands, read, strict=True):
        if not count:
            continue
        block, live = blocks[i], lives[i]
        g = block.g
        n, s, o, dout = g.shape
        width = math.prod(block.a.shape[2:]) + o * dout  # elements of a and g at one position
        price = _position_pricer(block) if priced and n * s * width > PRICED_ELEMENTS else None
        if price is not None:
            # at best sample 0's dead positions go, after a read of their range
            scan = SCAN_FLOPS * n * (last + 1 - lo) * o * dout
            if price(s) - price(s - count) <= scan + COPY_FLOPS * n * (s - count) * width:
                continue
        # zero everywhere <=> max = min = 0 (a NaN propagates: live); amax and amin over the
        # view read it without a copy, 3x faster than torch's any over several axes
        part = g[:, lo:last + 1]
        live[lo:last + 1] |= part.amax(dim=(0, 2, 3)).ne(0) | part.amin(dim=(0, 2, 3)).ne(0)
        scanned[i] = (price, width)
    if not scanned:
        return out
    keys = list(scanned)
    for i, (k, first, final) in zip(keys, _read_stats([lives[i] for i in keys]),
                                    strict=True):  # sync 2: count, first, last live
        block, live, (price, width) = blocks[i], lives[i], scanned[i]
        n, s = block.g.shape[:2]
        if k == s:
            continue
        if k == 0:  # at least one position stays
            k, first, final = 1, 0, 0
        if price is not None and price(s) - price(k) <= COPY_FLOPS * n * k * width:
            continue
        # the kept positions in order, without nonzero's sync: a stable sort puts them first
        keep = None if final - first + 1 == k else \
            torch.sort((~live).to(torch.int32), stable=True).indices[:k]
        out[i] = block.with_arrays(_take_positions(block.a, first, k, keep),
                                   _take_positions(block.g, first, k, keep))
    return out


def _live(g0: torch.Tensor) -> torch.Tensor:
    """(S,): whether sample 0's g (S, O, d_out) is nonzero anywhere at each position.  Zero
    everywhere <=> max = min = 0 (a NaN propagates: live); amax and amin read a strided
    view without a copy, where ``any`` over two axes took 2.4 ms for ResNet-50's (196, 10,
    1024) (1 % of its Jacobian)."""
    return g0.amax(dim=(1, 2)).ne(0) | g0.amin(dim=(1, 2)).ne(0)


def _read_stats(masks: list[torch.Tensor]) -> list[list[int]]:
    """``[count, first, last]`` of the True entries of each 1-d boolean mask (first and last
    meaningless where count is 0), read to the host together: one synchronisation.  Masks of
    one length and device are stacked and reduced by a handful of calls for all of them, not
    six calls each (BERT (small) at N = 16: :func:`drop_zero_positions_all` 1.09 -> 0.84 ms
    a call)."""
    groups: dict[tuple[int, Any], list[int]] = {}
    for i, m in enumerate(masks):
        groups.setdefault((m.shape[0], m.device), []).append(i)
    parts, order = [], []
    for (s, _), idx in groups.items():
        v = torch.stack([masks[i] for i in idx]).to(torch.int32)  # (B, S)
        # argmax gives the first maximum
        parts.append(torch.stack([v.sum(dim=1, dtype=torch.int64), v.argmax(dim=1),
                                  (s - 1) - v.flip(1).argmax(dim=1)], dim=1))
        order += idx
    dev = parts[0].device
    rows = torch.cat([p.to(dev) for p in parts]).tolist()
    out: list[list[int]] = [[]] * len(masks)
    for i, row in zip(order, rows, strict=True):
        out[i] = row
    return out


def _take_positions(x: torch.Tensor, first: int, k: int, keep: torch.Tensor | None
                    ) -> torch.Tensor:
    """Positions ``keep`` (axis 1; None: the range ``first:first + k``) of ``x`` in a new
    array with ``x``'s order of axes in memory (a channels-first g stays channels-first: the
    per-sample weights' batched GEMM reads it as it would the whole g); a range is sliced, not
    gathered."""
    order = sorted(range(x.ndim), key=lambda d: -x.stride(d))
    xs = x.permute(order)
    axis = order.index(1)
    if keep is None:
        part = xs.narrow(axis, first, k).contiguous()
    else:
        part = xs.index_select(axis, keep).contiguous()
    return part.permute([order.index(d) for d in range(x.ndim)])


def _position_pricer(block: KroneckerBlock) -> Callable[[int], int]:
    """S -> the Gram's flops for ``block`` with S positions (:func:`drop_zero_positions`)."""
    from ntkcore.gram import block_shapes, cheapest_flops

    (shape,) = block_shapes(block)
    n, o = block.g.shape[0], block.g.shape[2]
    return lambda s: cheapest_flops(shape._replace(num_positions=s), n, o)


@dataclass
class Summed:
    """Output gradients already reduced to what a DenseBlock needs: ``sums`` (N, O, W), the
    passes' results of a :func:`affine_sums` / ``torch_functional.term_sums`` map stacked
    along O.  The provider reduces a normalisation layer's (or a dense-rule functional
    call's) g pass by pass, while it is in cache, and never stores g (N, S, O, C): S times
    the memory, and a copy per pass (efficientnet_b0: 49 BatchNorm layers, O = 10)."""

    sums: torch.Tensor


#: :func:`affine_sums` of a channels-first layer, one output a pass, off the graph, uses the
#: fused channel sums of ``native_batch_norm_backward`` from this many positions on: 2-3x
#: faster than multiply-and-sum (whose temporary is as large as g) at 64-12544 positions;
#: 5x slower at 4 (its threads split channels, each summing 4 numbers).  One thread, N = 4-32.
FUSED_SUMS_MIN_POSITIONS = 16


def affine_sums(rule: AffineRule, mod: nn.Module, a_in: torch.Tensor, n: int, weight: bool,
                bias: bool) -> Reducer:
    r"""The map g (N, S, L, C) -> (N, L, C [+ C]) of one call of an elementwise-affine layer
    ``mod`` (:class:`AffineRule`) with input ``a_in`` (samples in front), for any number L of
    outputs (one pass, or all O):

    .. math:: J_\gamma[n, l, c] = \sum_s g[n, s, l, c]\,\hat x[n, s, c], \qquad
              J_\beta[n, l, c] = \sum_s g[n, s, l, c],

    in the layout [weight.flatten(), bias.flatten()].  :math:`\hat x` is computed once, here
    (differentiably when ``a_in`` is on a graph).  The products are taken in g's storage
    layout, (N, L, C, S) for a channels-first layer, (N, S, L, C) otherwise: a contiguous
    multiply-and-sum, 4x faster than an ``einsum`` that copies g.  A channels-first pass (L =
    1) off the graph with at least :data:`FUSED_SUMS_MIN_POSITIONS` positions takes both
    sums from one ``native_batch_norm_backward`` over the N C rows of (1, N C, S), input
    :math:`\hat x`, mean 0 and inverse deviation 1: its weight and bias gradients are
    exactly the two sums, with no temporary of g's size.
    """
    chan = rule.channels_first
    axis = -1 if chan else 1  # the positions
    x = rule.xhat(mod, a_in) if weight else None
    fused = chan and (x is None or not x.requires_grad)

    def reduce(g: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return into(sums(g), out)

    def sums(g: torch.Tensor) -> torch.Tensor:
        gv = g.permute(0, 2, 3, 1) if chan else g
        if fused and gv.shape[1] == 1 and gv.shape[-1] >= FUSED_SUMS_MIN_POSITIONS and \
                not g.requires_grad:
            return _channel_sums(gv, None if x is None else x.to(g.dtype), bias)
        pieces = []
        if x is not None:
            xx = x.to(g.dtype)
            pieces.append((gv * (xx.reshape(n, 1, xx.shape[1], -1) if chan else
                                 xx.reshape(n, -1, 1, gv.shape[-1]))).sum(axis))
        if bias:
            pieces.append(gv.sum(axis))
        return cat(pieces, -1)

    return reduce


def _channel_sums(gv: torch.Tensor, x: torch.Tensor | None, bias: bool) -> torch.Tensor:
    r""":func:`affine_sums` of one pass, gv (N, 1, C, S) and :math:`\hat x` (N, C, *L) or
    None, by ``native_batch_norm_backward`` on the rows (n, c)."""
    n, _, c, s = gv.shape
    rows = gv.reshape(1, n * c, s)
    inp = rows if x is None else x.reshape(1, n * c, s)  # the input is not read without x
    zero, one = rows.new_zeros(n * c), rows.new_ones(n * c)
    _, gw, gb = torch.ops.aten.native_batch_norm_backward(
        rows, inp, one, None, None, zero, one, True, 0.0, [False, x is not None, bias])
    return cat([t.reshape(n, 1, c) for t in (gw if x is not None else None,
                                             gb if bias else None) if t is not None], -1)


def _dense_is_smaller(n: int, groups: int, s: int, o: int, cout: int, cg_in: int) -> bool:
    """Whether a grouped convolution's per-sample gradient N O C_out (C_in/G k + 1) is
    smaller than its group-position Kronecker factors N G S (O C_out + C_in/G k + 1): the
    choice of :func:`_grouped_conv_block` (S positions over all calls, C_in/G k = ``cg_in``)."""
    return n * groups * s * (o * cout + cg_in + 1) > n * o * cout * (cg_in + 1)


def _dense_grouped(mod: nn.Module, gs: list[torch.Tensor], n: int) -> bool:
    """:func:`_dense_is_smaller` for the calls' output gradients ``gs`` of ``mod``, before any
    patch factor is formed."""
    return _dense_is_smaller(n, mod.groups, sum(int(g_c.shape[1]) for g_c in gs),
                             int(gs[0].shape[2]), int(gs[0].shape[3]),
                             mod.in_channels // mod.groups * math.prod(mod.kernel_size))


#: when :func:`_grouped_conv_dense` is used: at least this many output positions per call
#: (its batched GEMMs contract over the positions; with fewer they are outer products of
#: vectors) and at most this many kernel taps.  Measured on one thread, N = 32, O = 10,
#: against the ``einsum`` of the patch factor: efficientnet_b0's 3 x 3 depthwise layers
#: 1.5-2x faster at 4-256 positions; 2-8x slower at one position; 5 x 5 layers within 10%
#: either way; convnext_atto's 7 x 7 layers 15-40% slower at 64 positions.
GROUPED_GEMM_MIN_POSITIONS = 4
GROUPED_GEMM_MAX_TAPS = 9
#: :func:`_grouped_conv_block`'s dense form with at most this many positions is a sum of
#: outer products written in place, not an ``einsum`` (whose batched GEMMs over the positions
#: are tiny).
GROUPED_OUTER_MAX_POSITIONS = 4


def _unfoldable(mod: nn.Module, gs: list[torch.Tensor]) -> bool:
    """A 2-d convolution whose patches ``F.unfold`` forms (zero padding given as numbers) and
    whose per-group GEMMs pay (:data:`GROUPED_GEMM_MIN_POSITIONS`, ``..._MAX_TAPS``)."""
    return (_unfolds(mod) and math.prod(mod.kernel_size) <= GROUPED_GEMM_MAX_TAPS
            and min(int(g_c.shape[1]) for g_c in gs) >= GROUPED_GEMM_MIN_POSITIONS)


#: when :func:`_grouped_conv_weights` forms a grouped convolution's dense block: every tap
#: live and at least this many output positions per call.  Measured (N = 32, O = 10,
#: depthwise, float32, one and two threads; ``benchmarks.providers.GroupedConvBlock``, in
#: turns) against the routes it replaces: convnext_atto's 7 x 7 at 8 x 8 positions 0.49-0.52
#: of the time, efficientnet_b0's 3 x 3 at 16 x 16 and 8 x 8 0.68-0.84 and 0.74-0.77; at
#: 4 x 4 (16 positions) 0.98-1.30, no gain.  On 2 x 2 and 1 x 1 maps, whose dead taps keep
#: it out anyway, a script measured it 2.5-50x slower.
GROUPED_CONV_MIN_POSITIONS = 64


def _convolves(inputs: list[torch.Tensor], gs: list[torch.Tensor]) -> bool:
    """Whether a grouped convolution whose taps are all live forms its dense block by
    :func:`_grouped_conv_weights` (:data:`GROUPED_CONV_MIN_POSITIONS`): not where the block
    must be differentiable (its ``out=`` writes)."""
    return (min(int(g_c.shape[1]) for g_c in gs) >= GROUPED_CONV_MIN_POSITIONS
            and not any(t.requires_grad for t in (*inputs, *gs)))


def _grouped_conv_weights(mod: nn.Module, inputs: list[torch.Tensor],
                          gs: list[torch.Tensor], n: int, name: str,
                          bias: bool) -> DenseBlock:
    r"""The DenseBlock (N, O, C_out C_in/G k [+ C_out]) of a grouped convolution from its
    calls' inputs (N, C_in, *L_in) and output gradients g (N, S, O, C_out), viewing their
    (N, O, C_out, S) storage: per call the weight gradient of one convolution with N G groups
    (:func:`_grouped_weight_gradient`, which holds the math), written into the block's final
    array (later calls added), and the bias's :math:`\sum_s g[n, s, o, c]` beside it.  No
    patches are formed: the convolution reads the input itself."""
    o, cout = int(gs[0].shape[2]), int(gs[0].shape[3])
    width = cout * mod.in_channels // mod.groups * math.prod(mod.kernel_size)
    out = gs[0].new_empty((n, o, width + (cout if bias else 0)))
    w = out[..., :width].unflatten(-1, (mod.groups, -1))  # (N, O, G, C_out/G C_in/G k)
    for i, (a_c, g_c) in enumerate(zip(inputs, gs, strict=True)):
        part = _grouped_weight_gradient(mod, a_c, n)(
            g_c.permute(0, 2, 3, 1).reshape(n, o * cout, -1), o)
        w.copy_(part) if i == 0 else w.add_(part)
        if bias:
            b = out[..., width:]
            torch.sum(g_c, 1, out=b) if i == 0 else b.add_(g_c.sum(1))
    return DenseBlock(out, name)


def _grouped_conv_dense(mod: nn.Conv2d, inputs: list[torch.Tensor], gs: list[torch.Tensor],
                        n: int, name: str, bias: bool) -> DenseBlock:
    r"""The DenseBlock (N, O, C_out C_in/G k [+ C_out]) of a grouped 2-d convolution (G
    groups, C_in/G input and C_out/G output channels each, k taps), from its calls.

    .. math:: \partial f_o / \partial W[c, i, \kappa] = \sum_s g[n, s, o, c]\,
              P[n, \gamma(c) C_{in}/G + i, \kappa, s]

    with P the unfolded input (``F.unfold``: (N, C_in k, S), channel-major) and
    :math:`\gamma(c)` the group of output channel c.  Per sample and group that is one GEMM
    (O C_out/G, S) @ (S, C_in/G k), batched over N G: g is read in its (N, O, C_out, S)
    storage (:meth:`LayerRule.output_factor`) and permuted once to (N, G, O C_out/G, S); the patches
    are read as they come out of ``unfold``.  Used where it was measured faster than the
    ``einsum`` of the (N, S, C_in k) patch factor (:data:`GROUPED_GEMM_MIN_POSITIONS`).
    """
    groups, k = mod.groups, math.prod(mod.kernel_size)
    cg_in = mod.in_channels // groups * k
    dw = None
    for a_c, g_c in zip(inputs, gs, strict=True):
        o, cout = int(g_c.shape[2]), int(g_c.shape[3])
        cg_out = cout // groups
        patches = F.unfold(a_c.to(g_c.dtype), mod.kernel_size, dilation=mod.dilation,
                           padding=mod.padding, stride=mod.stride)  # (N, C_in k, S)
        s = patches.shape[-1]
        pt = patches.reshape(n * groups, cg_in, s).transpose(1, 2)  # (N G, S, C_in/G k)
        # g (N, S, O, C_out) -> (N, G, O, C_out/G, S): one copy
        gt = g_c.permute(0, 3, 2, 1).reshape(n, groups, cg_out, o, s).transpose(2, 3)
        part = torch.bmm(gt.reshape(n * groups, o * cg_out, s), pt)  # (N G, O C_out/G, ..)
        part = part.reshape(n, groups, o, cg_out * cg_in).transpose(1, 2)  # (N, O, G, ..)
        dw = part if dw is None else dw + part
    j = dw.reshape(n, dw.shape[1], -1)
    if bias:
        j = cat([j, functools.reduce(torch.add, (g_c.sum(dim=1) for g_c in gs))], -1)
    return DenseBlock(j.contiguous(), name)


def live_taps(mod: Any, sizes: list[tuple[int, ...]]) -> torch.Tensor | None:
    """:func:`live_tap_axes` as one bool mask (prod(kernel_size),) over the taps in
    row-major order, or None."""
    axes = live_tap_axes(mod, sizes)
    return None if axes is None else _flat_taps(axes)


def _flat_taps(axes: list[torch.Tensor]) -> torch.Tensor:
    """The row-major product of per-axis tap masks, (prod(k),)."""
    return functools.reduce(lambda m, v: (m[..., None] & v).flatten(), axes[1:], axes[0])


def live_tap_axes(mod: Any, sizes: list[tuple[int, ...]]) -> list[torch.Tensor] | None:
    r"""The kernel taps of a zero-padded convolution ``mod`` that read the input, not only
    padding, at some output position of some call (input spatial sizes ``sizes``): one bool
    mask (k_i,) per spatial axis (a tap is live iff it is live along every axis), or None
    when every tap is live (or the padding is not zeros).  For one call this is exactly its
    live set; for several, the per-axis unions over the calls that read the input at all,
    whose product may hold taps live in no single call (stored, they are zero columns).

    Along an axis of input length L, with stride s, dilation d, padding ``lo`` before, tap
    :math:`\kappa` reads input index :math:`l s + \kappa d - lo` at output position l, for
    :math:`0 \le l < L_{out}`.  A tap none of whose indices lies in [0, L) sees only the
    zeros of the padding, so its weight's per-sample gradient is exactly zero for every
    sample: a 5 x 5 kernel with padding 2 on a 1 x 1 map reads the input at its centre tap
    alone.  Depends on the shapes only, so every batch of one input size gets the same taps.
    """
    if mod.padding_mode != "zeros":
        return None
    geometry = list(zip(mod.kernel_size, mod.dilation, mod.stride, strict=True))
    live = [[False] * k for k, _, _ in geometry]
    for size in sizes:
        call = []  # this call's live taps per axis: their product is its live set
        for i, (k, d, st) in enumerate(geometry):
            lo, hi = _conv_padding(mod, i)
            n_in = size[i]
            n_out = (n_in + lo + hi - d * (k - 1) - 1) // st + 1
            call.append([max(0, -((kap * d - lo) // st)) < n_out  # first l: l s + kap d >= lo
                         and max(0, -((kap * d - lo) // st)) * st + kap * d - lo < n_in
                         for kap in range(k)])
        if all(any(axis) for axis in call):  # a call with a dead axis reads nothing
            live = [[u or v for u, v in zip(lv, cv, strict=True)]
                    for lv, cv in zip(live, call, strict=True)]
    masks = [torch.tensor(lv) for lv in live]
    return None if all(bool(m.all()) for m in masks) else masks


def _grouped_conv_block(a: torch.Tensor, g: torch.Tensor, groups: int, name: str,
                        weight: bool, bias: bool,
                        taps: torch.Tensor | None = None) -> DenseBlock | KroneckerBlock:
    r"""A grouped convolution: a (N, L, C_in*k), g (N, L, O, C_out).

    Output channel c belongs to group c // (C_out/G) and sees only that group's input channels
    (contiguous in the patch vector).  With the G groups as extra positions,
    a'[n, (G,L), C_in/G*k] and g'[n, (G,L), o, c] = g[n, L, o, c] if c is in group G else 0,
    :math:`\sum_{(G,L)} g' a'^\top` is the (C_out, C_in/G*k) weight gradient exactly.  When
    that is larger than the per-sample gradient itself (many groups, e.g. depthwise), a
    DenseBlock is built from the same factors instead, written once into its final array.
    ``taps`` (the mask of :func:`live_taps`, None: all): the dense block stores only the
    columns of these kernel taps (and the bias), the others being exactly zero
    (``DenseBlock.columns``); ``a`` then holds the patches of those taps alone
    (:func:`conv_patches`), and the Kronecker form is not taken.
    """
    n, s, o, cout = g.shape
    if not weight:  # bias only: the groups do not matter
        return KroneckerBlock(a, g, name)
    cg_in = a.shape[2] // groups
    cg_out = cout // groups
    a4 = a.reshape(n, s, groups, cg_in)
    if taps is None and not _dense_is_smaller(n, groups, s, o, cout, cg_in):
        ap = a4.permute(0, 2, 1, 3).reshape(n, groups * s, cg_in)
        # g6[n, G, l, o, G', c] = g[n, l, o, G' cg_out + c] where G == G', else 0
        g6 = g.new_zeros((n, groups, s, o, groups, cg_out))
        g6.diagonal(dim1=1, dim2=4).copy_(g.unflatten(-1, (groups, cg_out)).movedim(3, -1))
        gp = g6.reshape(n, groups * s, o, cout)
        if bias:
            ap = with_ones(ap)
        return KroneckerBlock(ap.contiguous(), gp, name)
    # Dense per-sample gradient: dW[n, o, c, :] = sum_s g[n, s, o, c] a[n, s, group(c), :].
    gg = g.reshape(n, s, o, groups, cg_out)
    columns = size = None
    if taps is not None:  # a's patch entries: (C_in/G, k_live) per group, row-major
        k, live = taps.numel(), taps.nonzero().flatten()
        width = cg_in // live.numel() * k  # a group's patch width with every tap
        kk = (torch.arange(cg_in // live.numel())[:, None] * k + live).flatten().to(a.device)
        size = cout * width + (cout if bias else 0)
        columns = (torch.arange(cout, device=a.device)[:, None] * width + kk).flatten()
        if bias:
            columns = torch.cat([columns, cout * width + torch.arange(cout, device=a.device)])
    if g.requires_grad or a.requires_grad:  # differentiable: no out= writes
        dw = torch.einsum("nsogc,nsgk->nogck", gg, a4).reshape(n, o, cout, cg_in)
        # DenseBlock layout: [weight.flatten(), bias]
        with trusted_blocks():  # columns built above: increasing, in range
            return DenseBlock(cat([dw.reshape(n, o, -1), *([g.sum(dim=1)] if bias else [])],
                                  -1), name, columns, size)
    # written once into the block (N, O, [weight.flatten(), bias]): the block is N O C_out
    # C_in/G k numbers, often tens of MB in fresh pages; the two extra passes over it (the
    # einsum's layout copy, the concatenation with the bias) made building these blocks
    # 22-26 % slower (docs/concepts.md)
    width = cout * cg_in
    out = g.new_empty((n, o, width + (cout if bias else 0)))
    w = out[..., :width].unflatten(-1, (groups, cg_out, cg_in))
    if s <= GROUPED_OUTER_MAX_POSITIONS:  # a sum of outer products per sample and group
        torch.mul(gg[:, 0, ..., None], a4[:, 0, :, None, :].unsqueeze(1), out=w)
        for j in range(1, s):
            w.addcmul_(gg[:, j, ..., None], a4[:, j, :, None, :].unsqueeze(1))
    else:
        w.copy_(torch.einsum("nsogc,nsgk->nogck", gg, a4))
    if bias:
        torch.sum(g, dim=1, out=out[..., width:])
    with trusted_blocks():  # columns built above: increasing, in range
        return DenseBlock(out, name, columns, size)
