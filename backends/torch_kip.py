r"""Differentiable eNTK for dataset distillation (KIP) whose backward pass needs memory
independent of the number of targets: :func:`checkpointed_ntk` (target Jacobian factors
recomputed chunk by chunk in the backward pass) and :func:`kip_loss` (the KIP loss in one pass
over the target chunks).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import array_api_compat.torch as _xp
import torch
from torch import nn

from ntkcore._memory import PROBE_SAMPLES, Budget, batch_samples, resolve_budget
from ntkcore.backend import get_backend
from ntkcore.gram import gram
from ntkcore.jacobian import DenseBlock, Jacobian, KroneckerBlock
from ntkcore.kernel_ridge import KernelRidgeCore
from ntkcore.modes import Mode, check_mode
from ntkcore.support import capabilities
from ntkcore.tiling import bounds

from .torch_jacobian import check_inputs, jacobian

__all__ = ["checkpointed_ntk", "kip_loss"]

# -- block layout of the support side --------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """How each block is represented on both sides: ``kinds[i]`` is ``"dense"`` (one array),
    ``"kron"`` (arrays ``a``, ``g``; ``"kron+1"`` with ``ones=True``) or ``"mat"`` (a
    KroneckerBlock materialised into a DenseBlock of per-sample weights, one array)."""

    names: tuple[str, ...]
    kinds: tuple[str, ...]

    def support_arrays(self, j: Jacobian) -> list[torch.Tensor]:
        return [arr for b, kind in zip(j.blocks, self.kinds, strict=True)
                # (a DenseBlock with stored columns goes in whole: from_arrays makes plain ones)
                for arr in ((b.to_dense(),) if kind == "mat" or isinstance(b, DenseBlock)
                            else b.arrays())]

    def from_arrays(self, arrays: Sequence[torch.Tensor]) -> Jacobian:
        it = iter(arrays)
        return Jacobian([KroneckerBlock(next(it), next(it), name, ones=kind == "kron+1")
                         if kind.startswith("kron") else DenseBlock(next(it), name)
                         for name, kind in zip(self.names, self.kinds, strict=True)])

    def convert(self, j: Jacobian) -> Jacobian:
        """Materialise the ``"mat"`` blocks of a (target) Jacobian."""
        return Jacobian([DenseBlock(b.to_dense(), b.name) if kind == "mat" else b
                         for b, kind in zip(j.blocks, self.kinds, strict=True)])


def _target_jacobian(model: nn.Module, x: torch.Tensor, params: Any,
                     pseudo: bool) -> Jacobian:
    """Detached factors of ``x`` (which does not require grad).  The provider needs grad mode
    for its own forward/backward pass, and autograd Functions run without it."""
    with torch.enable_grad():
        return jacobian(model, x, params=params, pseudo=pseudo, create_graph=False)


def _choose_layout(jt: Jacobian, js: Jacobian, mode: str, budget: int,
                   itemsize: int) -> _Layout:
    r"""Which Kronecker blocks to materialise into per-sample weights
    :math:`W[m, o] = \sum_t g[m, t, o]\, a[m, t]^\top`, on both sides.

    A block with S > 1 target positions is materialised when, per target sample against M
    support samples (T positions), :math:`2 S O P_b + 2 M O^k P_b < 2 M S T (d_{in} + O
    d_{out})` (k = 2 for ``full``, else 1) and the support's weights (M O P_b elements) fit in
    ``budget / 4``.  Only the target side counts: the support's weights are formed once.
    """
    if jt.names != js.names or [type(b) for b in jt] != [type(b) for b in js]:
        raise ValueError(f"the provider returned different blocks for the two inputs "
                         f"({jt.names} vs {js.names}); they must have the same structure")
    m = js.num_samples
    kinds = []
    spent = 0
    for bt, bs in zip(jt.blocks, js.blocks, strict=True):
        if isinstance(bs, DenseBlock):
            kinds.append("dense")
            continue
        s, t = bt.num_positions, bs.num_positions
        if s == 1 and t == 1:
            kinds.append("kron+1" if bs.ones else "kron")
            continue
        o, pb = bs.num_outputs, bs.num_params
        ok = mode.gemm_outputs(o)
        materialise = 2 * s * o * pb + 2 * m * ok * pb
        positions = 2 * m * s * t * (bs.d_in + o * bs.d_out)
        w_bytes = m * o * pb * itemsize
        if materialise < positions and spent + w_bytes <= budget // 4:
            kinds.append("mat")
            spent += w_bytes
        else:
            kinds.append("kron+1" if bs.ones else "kron")
    return _Layout(tuple(jt.names), tuple(kinds))


# -- shared set-up ---------------------------------------------------------------------------
def _timed(timings: dict[str, float] | None, phase: str, t0: float) -> float:
    """Add the seconds since ``t0`` to ``timings[phase]`` (if ``timings``); the time now."""
    now = time.perf_counter()
    if timings is not None:
        timings[phase] = timings.get(phase, 0.0) + (now - t0)
    return now


@dataclass
class _Spec:
    """Everything the Functions need besides the support arrays."""

    model: nn.Module
    x_target: torch.Tensor  # detached
    chunks: list[tuple[int, int]]
    layout: _Layout
    mode: Mode
    layerwise: bool
    pseudo: bool
    params: Any
    dtype: Any
    gram_budget: Budget
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    timings: dict[str, float] | None

    def target(self, start: int, stop: int) -> Jacobian:
        """Factors of target samples ``start:stop``, no graph, ``"mat"`` blocks materialised."""
        t0 = time.perf_counter()
        j = _target_jacobian(self.model, self.x_target[start:stop], self.params, self.pseudo)
        with torch.no_grad():
            j = self.layout.convert(j)
        _timed(self.timings, "target_factors_s", t0)
        return j

    def contract(self, jt: Jacobian, js: Jacobian) -> torch.Tensor:
        t0 = time.perf_counter()
        k = gram(jt, js, mode=self.mode, layerwise=self.layerwise, max_memory=self.gram_budget,
                 dtype=self.dtype)
        _timed(self.timings, "contract_s", t0)
        return k

    def rows(self, start: int, stop: int) -> tuple[slice, ...]:
        """Index of target rows ``start:stop`` in the output (after a layerwise axis)."""
        lead = (slice(None),) if self.layerwise else ()
        return (*lead, slice(start, stop))

    def sweep(self, support: Sequence[torch.Tensor], need: Sequence[bool],
              visit: Any) -> list[torch.Tensor | None]:
        r"""One pass over the target chunks: ``visit(start, stop, k)`` gets each chunk's
        detached kernel ``k`` and returns :math:`\bar K_c`; the result is the gradient of
        :math:`\sum_c \langle \bar K_c, K_c\rangle` with respect to the support arrays
        where ``need`` (zeros if unused), None elsewhere."""
        leaves = [s.detach().requires_grad_(bool(q)) for s, q in zip(support, need, strict=True)]
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        js = self.layout.from_arrays(leaves)
        acc: list[torch.Tensor | None] = [None] * len(wanted)
        for start, stop in self.chunks:
            jt = self.target(start, stop)
            with torch.enable_grad():
                k = self.contract(jt, js)
                t0 = time.perf_counter()
                gk = visit(start, stop, k.detach())
                grads = torch.autograd.grad(k, wanted, gk, allow_unused=True) if wanted else ()
            for i, g in enumerate(grads):
                if g is not None:
                    acc[i] = g if acc[i] is None else acc[i] + g
            _timed(self.timings, "support_grad_s", t0)
            del jt, k, gk, grads
        it = iter(acc)
        out = [next(it) if q else None for q in need]
        return [torch.zeros_like(leaf) if q and g is None else g
                for leaf, q, g in zip(leaves, need, out, strict=True)]


def _check(model: Any, inputs: dict[str, Any], mode: Any, layerwise: Any, pseudo: bool,
           batch_size: Any) -> Mode:
    """Validate the arguments of the public functions; the mode as a :class:`Mode`."""
    check_inputs(model, **inputs)
    mode = check_mode(mode)
    if pseudo and not mode.sums_outputs:
        raise ValueError(f"pseudo=True gives a single-output kernel: mode must be 'trace'; "
                         f"got {mode!r}")
    if not isinstance(layerwise, bool):
        raise TypeError(f"layerwise must be True or False; got {layerwise!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be None or a positive integer; got {batch_size!r}")
    return mode


def _prepare(model: nn.Module, xs: torch.Tensor, xt: torch.Tensor, *, mode: Mode,
             layerwise: bool, pseudo: bool, params: Any, max_memory: Any, dtype: Any,
             batch_size: int | None,
             timings: dict[str, float] | None) -> tuple[_Spec, list[torch.Tensor]]:
    r"""Support arrays (with their graph) and the chunk plan for targets ``xt``.

    With the budget B and a probe of a few targets giving the factor bytes per sample f and
    the materialised-weight bytes per sample w, the chunk has
    :math:`C = \lfloor (B/2) / (3 f + 2 w) \rfloor \ge 1` targets (3 f: factors,
    activations and output gradients of a provider call) unless ``batch_size`` says; each
    chunk's :func:`ntkcore.gram` gets B/4.
    """
    t0 = time.perf_counter()
    xt = xt.detach()
    n, m = int(xt.shape[0]), int(xs.shape[0])
    budget = resolve_budget(max_memory, get_backend(_xp), xt.device)
    probe = _target_jacobian(model, xt[:min(n, PROBE_SAMPLES)], params, pseudo)
    js = jacobian(model, xs, params=params, pseudo=pseudo)
    out_dtype = dtype if dtype is not None else torch.promote_types(probe.dtype, js.dtype)
    itemsize = torch.empty((), dtype=out_dtype).element_size()
    layout = _choose_layout(probe, js, mode, budget, itemsize)
    per_sample = probe.nbytes / probe.num_samples
    mat_bytes = sum(b.num_outputs * b.num_params * itemsize
                    for b, kind in zip(probe.blocks, layout.kinds, strict=True) if kind == "mat")
    o = probe.num_outputs
    del probe
    chunk = min(batch_size or batch_samples(per_sample, budget / 2, 2 * mat_bytes), n)
    support = layout.support_arrays(js)
    del js
    lead = (len(layout.names),) if layerwise else ()
    spec = _Spec(model=model, x_target=xt, chunks=bounds(n, chunk), layout=layout, mode=mode,
                 layerwise=layerwise, pseudo=pseudo, params=params, dtype=dtype,
                 gram_budget=budget.share(4), out_shape=(*lead, n, m, *mode.tail(o)),
                 out_dtype=out_dtype, timings=timings)
    _timed(timings, "support_s", t0)
    if timings is not None:
        timings["chunk_size"] = float(chunk)
        timings["num_chunks"] = float(len(spec.chunks))
    return spec, support


def _first_order_only() -> None:
    """The backward passes here are first-order only.  Autograd runs a backward with grad mode
    on exactly when a graph of the gradient is requested (``create_graph=True``); refuse it
    rather than return a gradient whose own graph would silently miss this Function."""
    if torch.is_grad_enabled():
        raise RuntimeError("the checkpointed eNTK / fused KIP loss supports first-order "
                           "gradients only (create_graph=True was requested); build the "
                           "kernels with ntkcore.ntk(..., checkpoint=False) for higher "
                           "derivatives")


# -- the checkpointed kernel -----------------------------------------------------------------
class _CheckpointedKernel(torch.autograd.Function):
    r"""``K[n, m, ...] = gram(J_t, J_s)``, the target factors recomputed in the backward pass.

    Inputs: the support arrays (dense blocks, Kronecker factors, materialised weights), built
    once with their graph to :math:`X_s`.  Forward: per chunk of targets, factors without a
    graph, contracted with the detached support arrays, then dropped.  Backward: per chunk
    the factors are recomputed and autograd through that chunk's ``gram`` alone accumulates
    :math:`\partial L/\partial F_s \mathrel{+}= (\partial K_c/\partial F_s)^\top \bar K_c`
    (trace mode, dense layer: :math:`\bar A_s = (\bar K_c \odot G_c G_s^\top)^\top A_c`,
    :math:`\bar G_s = (\bar K_c \odot A_c A_s^\top)^\top G_c`; materialised:
    :math:`\bar W_s = \bar K_c^\top W_c`); autograd then goes once through the support
    graph.  Peak memory: the support graph plus one chunk's factors.
    """

    @staticmethod
    def forward(ctx: Any, spec: _Spec, *support: torch.Tensor) -> torch.Tensor:
        js = spec.layout.from_arrays([s.detach() for s in support])
        out = torch.empty(spec.out_shape, dtype=spec.out_dtype, device=support[0].device)
        for start, stop in spec.chunks:
            out[spec.rows(start, stop)] = spec.contract(spec.target(start, stop), js)
        ctx.spec = spec
        ctx.save_for_backward(*support)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        _first_order_only()
        spec: _Spec = ctx.spec
        return (None, *spec.sweep(ctx.saved_tensors, ctx.needs_input_grad[1:],
                                  lambda start, stop, k: grad_out[spec.rows(start, stop)]))


@capabilities(name="backends.torch.checkpointed_ntk", fast={
    "torch": "custom autograd Function, target chunks recomputed in backward"},
    note={"torch": "CPU and CUDA; first-order gradients w.r.t. the support input"},
    missing=("numpy", "cupy", "jax", "array_api_strict"))
def checkpointed_ntk(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, *,
                     mode: str = "trace", layerwise: bool = False, pseudo: bool = False,
                     params: Any = None, max_memory: Any = None, dtype: Any = None,
                     batch_size: int | None = None,
                     timings: dict[str, float] | None = None) -> torch.Tensor:
    r"""The eNTK between a support set that requires grad and a large target set, with a
    backward pass whose memory does not grow with the number of targets.

    Exactly one of ``x1``, ``x2`` is the *support* set (``requires_grad=True``); the other is
    the *target* set, processed in chunks whose Jacobian factors are recomputed in the
    backward pass instead of being kept (:class:`_CheckpointedKernel`; plain autograd keeps
    them for every target).  The value and the gradient are those of
    ``ntkcore.ntk(model, x1, x2, ...)`` up to rounding.  Gradients also reach
    ``param.grad`` through the support side; they are not the loss's parameter gradients
    (the targets are not tracked).

    :func:`ntkcore.ntk` and :func:`ntkcore.pseudo_ntk` call this function themselves when one
    input requires grad and the other is large (``checkpoint="auto"``), or always with
    ``checkpoint=True``.  For the KIP loss itself, :func:`kip_loss` avoids the second pass
    over the targets altogether.

    Parameters
    ----------
    model : torch.nn.Module
        The network (eval mode if it has BatchNorm or Dropout), parameters fixed.
    x1 : torch.Tensor, shape (N1, ...)
    x2 : torch.Tensor, shape (N2, ...)
        Inputs; one of them requires grad.  If neither does, the kernel is computed in the
        same chunks without a graph.
    mode : {"full", "trace", "diagonal"}
        As for :func:`ntkcore.ntk` (default ``"trace"``, the usual KIP kernel).
    layerwise : bool
        One kernel per parameter block on a leading axis.
    pseudo : bool
        The pseudo-NTK (Jacobian of :math:`\sum_o f_o/\sqrt{O}`); ``mode`` must be "trace".
    params : optional
        Parameter subset (names or tensors), as for the torch provider.
    max_memory : int, float or str, optional
        Working-memory budget ``B`` for the target chunks (default: a quarter of the free
        memory of the device); the support side's graph is not counted.
    dtype : torch.dtype, optional
        Accumulation and result dtype (default: the factors').
    batch_size : int, optional
        Target samples per chunk (default: from ``B``, :func:`_prepare`).
    timings : dict, optional
        If given, wall-clock seconds are added per phase: ``support_s`` (support factors with
        their graph, probe, plan), ``target_factors_s`` (target factors, forward and
        backward), ``contract_s`` (contractions), ``support_grad_s`` (gradient GEMMs), and
        ``chunk_size``, ``num_chunks``.

    Returns
    -------
    torch.Tensor
        (N1, N2), (N1, N2, O) or (N1, N2, O, O) by ``mode``, with a leading (B,) axis when
        ``layerwise``; differentiable with respect to the support input (once).

    Raises
    ------
    TypeError
        ``model`` is not a ``torch.nn.Module`` or an input is not a tensor.
    ValueError
        Both inputs require grad, an unknown ``mode``, ``pseudo`` with a mode other than
        trace, empty inputs or a bad ``batch_size``.
    """
    mode = _check(model, {"x1": x1, "x2": x2}, mode, layerwise, pseudo, batch_size)
    if x1.requires_grad and x2.requires_grad:
        raise ValueError("checkpointed_ntk bounds the backward when exactly one of x1, x2 "
                         "requires grad (the support set); both do. Use ntkcore.ntk(..., "
                         "checkpoint=False) to differentiate with respect to both")
    support_first = bool(x1.requires_grad)
    xs, xt = (x1, x2) if support_first else (x2, x1)
    spec, support = _prepare(model, xs, xt, mode=mode, layerwise=layerwise, pseudo=pseudo,
                             params=params, max_memory=max_memory, dtype=dtype,
                             batch_size=batch_size, timings=timings)
    k = _CheckpointedKernel.apply(spec, *support)
    if support_first:
        k = k.permute(mode.swap(1 if layerwise else 0))
    return k


# -- the fused KIP loss ----------------------------------------------------------------------
class _FusedKipLoss(torch.autograd.Function):
    r""":math:`L = \frac1{R}\sum (K_{ts}\alpha - Y_t)^2` in one pass over the target chunks.

    Inputs: ``alpha`` (M', C') and the support arrays; ``spec.y_target`` (rows, C') is a
    constant.  Per chunk: :math:`r = K_c \alpha - Y_c`, :math:`\bar K_c = (2/R)\, r
    \alpha^\top`, :math:`\bar\alpha \mathrel{+}= K_c^\top (2/R)\, r` and the support gradient
    of :math:`\langle \bar K_c, K_c\rangle`; all are kept for the backward pass, which only
    scales them by the incoming gradient.
    """

    @staticmethod
    def forward(ctx: Any, spec: _Spec, y_target: torch.Tensor, alpha: torch.Tensor,
                *support: torch.Tensor) -> torch.Tensor:
        grad_alpha = bool(ctx.needs_input_grad[2])
        mode, o = spec.mode, spec.mode.matrix_rows(spec.out_shape[-1])
        a = alpha.detach()
        rows_total = y_target.numel()
        g_alpha = torch.zeros_like(a)
        sq = torch.zeros((), dtype=spec.out_dtype, device=a.device)

        def visit(start: int, stop: int, k: torch.Tensor) -> torch.Tensor:
            nonlocal g_alpha, sq
            kf = mode.matrix(_xp, k)
            res = kf @ a - y_target[start * o:stop * o]  # (rows, C') residual of the chunk
            sq = sq + torch.sum(res * res)
            if grad_alpha:
                g_alpha = g_alpha + (2.0 / rows_total) * (kf.T @ res)
            return mode.unmatrix(_xp, (2.0 / rows_total) * (res @ a.T), o)

        g_support = spec.sweep(support, ctx.needs_input_grad[3:], visit)
        ctx.grads = (g_alpha if grad_alpha else None, g_support)
        return sq / rows_total

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        _first_order_only()
        g_alpha, g_support = ctx.grads
        ga = None if g_alpha is None else g_alpha * grad_loss
        return (None, None, ga, *[None if g is None else g * grad_loss for g in g_support])


@capabilities(name="backends.torch.kip_loss",
              fast={"torch": "one pass over target chunks, Cholesky regression"},
              note={"torch": "CPU and CUDA; first-order gradients w.r.t. support inputs/labels"},
              missing=("numpy", "cupy", "jax", "array_api_strict"))
def kip_loss(model: nn.Module, x_support: torch.Tensor, y_support: torch.Tensor,
             x_target: torch.Tensor, y_target: torch.Tensor, *, reg: float = 1e-6,
             mode: str = "trace", pseudo: bool = False, params: Any = None,
             max_memory: Any = None, batch_size: int | None = None, fused: bool = True,
             timings: dict[str, float] | None = None) -> torch.Tensor:
    r"""The KIP loss: kernel regression from the support set, mean squared error on targets.

    .. math::

        \hat Y_t = K_{ts} (K_{ss} + \lambda I)^{-1} Y_s, \qquad
        L = \frac{1}{N C} \sum_{n, c} (\hat Y_t - Y_t)_{nc}^2,
        \qquad \lambda = \texttt{reg} \cdot \operatorname{mean}(\operatorname{diag} K_{ss}),

    with :math:`K` the eNTK of ``model``: ``mode="trace"`` (or ``pseudo=True``) is one scalar
    kernel shared by the C label columns; ``mode="full"`` uses the (N O, M O) kernel with
    labels (N, O).  :math:`K_{ss}` (M x M, with its autograd graph) is factorised by Cholesky
    (:class:`ntkcore.KernelRidge`, no LU); :math:`\lambda` is part of the graph (the gradient
    includes its dependence on the support set).  Gradients flow to ``x_support`` and
    ``y_support`` when they require grad.

    ``fused=True`` (default) makes **one** pass over the target chunks
    (:class:`_FusedKipLoss`): :math:`\alpha = (K_{ss} + \lambda I)^{-1} Y_s` is known before
    the targets are visited, so each chunk's share of the loss, of :math:`\partial
    L/\partial\alpha` and of the support gradient is formed at once and the targets' factors
    are computed once, with the memory bound of :func:`checkpointed_ntk`.  ``fused=False``
    computes the same loss from :func:`ntkcore.ntk` (``checkpoint=True``) and
    :func:`ntkcore.kernel_regression`: the reference the fused path is tested against.

    Parameters
    ----------
    model : torch.nn.Module
    x_support : torch.Tensor, shape (M, ...)
        The support inputs (usually ``requires_grad=True``).
    y_support : torch.Tensor, shape (M, C)
        Support labels (may require grad too: "label learning").
    x_target : torch.Tensor, shape (N, ...)
        Target inputs (no gradient is taken with respect to them).
    y_target : torch.Tensor, shape (N, C)
        Target labels (constants).
    reg : float
        Relative ridge (see above), ``>= 0``.
    mode : {"trace", "full"}
    pseudo : bool
        Use the pseudo-NTK (mode "trace").
    params, max_memory, batch_size
        As for :func:`checkpointed_ntk` (``batch_size``: target chunk size).
    fused : bool
        One pass over the targets (default) or the unfused reference.
    timings : dict, optional
        Filled with seconds per phase as for :func:`checkpointed_ntk`, plus ``solve_s``.

    Returns
    -------
    torch.Tensor, shape ()
        Differentiable (once) with respect to ``x_support`` and ``y_support``.
    """
    import ntkcore

    mode = _check(model, {"x_support": x_support, "x_target": x_target},
                  check_mode(mode, ("trace", "full")), False, pseudo, batch_size)
    reg = float(reg)
    if not math.isfinite(reg) or reg < 0:
        raise ValueError(f"reg must be a finite non-negative number; got {reg!r}")
    for name, y, x in (("y_support", y_support, x_support), ("y_target", y_target, x_target)):
        if not isinstance(y, torch.Tensor) or y.ndim != 2 or y.shape[0] != x.shape[0]:
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"{name} must be a tensor (N, C) with one row per input sample "
                             f"({x.shape[0]}); got {shape}")
    if y_support.shape[1] != y_target.shape[1]:
        raise ValueError(f"y_support has {y_support.shape[1]} columns but y_target has "
                         f"{y_target.shape[1]}")
    if x_target.requires_grad:
        raise ValueError("x_target requires grad: kip_loss differentiates with respect to the "
                         "support set only; pass x_target.detach()")
    kernel = functools.partial(ntkcore.pseudo_ntk if pseudo else ntkcore.ntk, model,
                               params=params, max_memory=max_memory, batch_size=batch_size,
                               **({} if pseudo else {"mode": mode}))
    if fused:  # the support side once: its arrays give K_ss and enter the target pass
        spec, support = _prepare(model, x_support, x_target, mode=mode, layerwise=False,
                                 pseudo=pseudo, params=params, max_memory=max_memory,
                                 dtype=None, batch_size=batch_size, timings=timings)
        t0 = time.perf_counter()
        k_ss = gram(spec.layout.from_arrays(support), None, mode=mode,
                    max_memory=spec.gram_budget)
    else:
        t0 = time.perf_counter()
        k_ss = kernel(x_support, checkpoint=False)
    ys, yt = y_support, y_target.detach()
    if not mode.sums_outputs:  # full: the matrix view, rows (n, o)
        o = int(k_ss.shape[2])
        if ys.shape[1] != o:
            raise ValueError(f"mode='full' needs labels with O={o} columns; got {ys.shape[1]}")
        k_ss = mode.matrix(_xp, k_ss)
        ys, yt = ys.reshape(-1, 1), yt.reshape(-1, 1)
    # lambda = reg * mean(diag K_ss) stays on the graph: the loss is a function of x_support
    # through the ridge too, and its gradient is exact.
    k_reg = k_ss + (reg * torch.diagonal(k_ss).mean()) * torch.eye(
        k_ss.shape[0], dtype=k_ss.dtype, device=k_ss.device)
    t0 = _timed(timings, "support_kernel_s", t0)
    if not fused:
        k_ts = kernel(x_target, x_support, checkpoint=True)
        t0 = _timed(timings, "target_kernel_s", t0)
        k_ts = mode.matrix(_xp, k_ts)
        pred = ntkcore.kernel_regression(k_reg, ys, k_ts)
        _timed(timings, "solve_s", t0)
        return torch.mean((pred - yt) ** 2)
    # the ridge is in k_reg already: alpha=0.0; the plain class (ntkcore.KernelRidge's code
    # without scikit-learn's bases), so that a KIP step never imports scikit-learn
    alpha = KernelRidgeCore(alpha=0.0).fit(k_reg, ys).dual_coef_
    _timed(timings, "solve_s", t0)
    yt = yt.to(spec.out_dtype)
    return _FusedKipLoss.apply(spec, yt, alpha, *support)
