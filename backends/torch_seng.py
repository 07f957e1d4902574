r"""SENG, the sketchy empirical natural gradient optimizer for PyTorch (:class:`SENG`), with
its per-sample factors from the one backward of the batch loss: the layer rules of
``torch_layers`` where they allow a Kronecker update, ``torch.func`` for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from ntkcore._validation import check_scalar, first_nonfinite
from ntkcore.backend import seed_from
from ntkcore.jacobian import DenseBlock, Jacobian, KroneckerBlock
from ntkcore.linop import LinearOperator
from ntkcore.lowrank import low_rank as _low_rank
from ntkcore.sketch import KINDS, SketchSpec, spawn_seed
from ntkcore.solve import SMWSolver
from ntkcore.support import capabilities

from .torch_jacobian import (
    ProbeFailed,
    check_sample_coupling,
    graph_uses,
    in_provider_pass,
    probe_sample_axes,
    probe_size,
    provider_pass,
)
from .torch_layers import cat, rule_for

__all__ = ["SENG"]


@dataclass(eq=False)
class _Owner:
    """Parameters updated as one block.  With ``module``: a Linear / groups=1 Conv layer, its
    weight (d_out, ...) [+ bias] in the [W | b] row-major layout of its KroneckerBlock
    (``torch_layers``, bias as the last column); without: the other trainable parameters of
    one module, concatenated (key ``"dense:" + name``)."""

    name: str
    params: list[nn.Parameter]
    module: nn.Module | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.name if self.module is not None else "dense:" + self.name

    def flat(self, ts: list[torch.Tensor], lead: tuple[int, ...] = ()) -> torch.Tensor:
        """Tensors shaped as ``params`` (after the axes ``lead``) in the block's layout: a
        (rows, P_b / rows) matrix, row-major (rows = d_out with a module, else 1)."""
        rows = 1 if self.module is None else self.params[0].shape[0]
        return cat([t.reshape(*lead, rows, -1) for t in ts], -1).reshape(*lead, -1)

    def split(self, d: torch.Tensor) -> list[torch.Tensor]:
        rows = 1 if self.module is None else self.params[0].shape[0]
        parts = d.reshape(rows, -1).split([p.numel() // rows for p in self.params], dim=1)
        return [q.reshape(p.shape) for q, p in zip(parts, self.params, strict=True)]


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry is finite, with one device sync: a finite sum proves its tensor
    finite; only a non-finite sum (NaN/Inf, or an overflow of finite entries) is looked at
    entry by entry."""
    total = sum(t.sum(dtype=torch.float32) for t in tensors)  # NaN/Inf in a sum stays
    if math.isfinite(float(total)):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _grad(p: torch.Tensor, wd: float = 0.0, inv: float = 1.0) -> torch.Tensor:
    """``inv`` times ``p``'s gradient (zero if None) plus ``wd * p``."""
    g = torch.zeros_like(p) if p.grad is None else p.grad.detach()
    g = g if inv == 1.0 else g * inv
    return g + wd * p.detach() if wd else g


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / DataParallel / ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod  # torch.compile(model)
        else:
            return model


def _eager(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, run eagerly when ``torch.compile`` traces the model (a graph
    break there), so that a hook sees real tensors and can register tensor hooks on them."""
    if torch.compiler.is_compiling():
        return torch._dynamo.disable(fn)(*args, **kwargs)
    return fn(*args, **kwargs)


class _Thin(LinearOperator):
    r"""U = J_b^\top (P_b, N) of a one-block Jacobian with O = 1 (per-sample loss gradients)
    as a linear operator, :math:`U c` (``matvec``) and :math:`U^\top v` (``rmatvec``):

    * Kronecker block, a (N, S, d_in), g (N, S, 1, d_out), :math:`V` = v as (d_out, d_in):
      :math:`(U^\top v)_n = \sum_s g_{n,s}^\top V a_{n,s}` and
      :math:`U c = \operatorname{vec}\bigl(\sum_{n,s} c_n\, g_{n,s} a_{n,s}^\top\bigr)`
      (the same products as ``KroneckerBlock.jvp`` / ``vjp``, without their checks);
    * dense block (N, 1, P_b): :math:`U^\top v = J v`, :math:`U c = J^\top c`.
    """

    def __init__(self, jac: Jacobian) -> None:
        (block,) = jac.blocks
        self.n = jac.num_samples
        self.shape, self.dtype, self.device = (jac.num_params, self.n), jac.dtype, jac.device
        self.kron = isinstance(block, KroneckerBlock)
        if self.kron:
            self.s = s = block.num_positions
            self.w_shape = (block.d_out, block.d_in)
            self.a = block.explicit_a().reshape(self.n * s, block.d_in)
            self.g = block.g.reshape(self.n * s, block.d_out)
            self.gt = self.g.t().contiguous()  # (d_out, N S) for the row-major product U c
        else:
            self.jac = block.to_dense().reshape(self.n, block.num_params)

    def rmatvec(self, v: torch.Tensor) -> torch.Tensor:  # (P_b,) -> (N,)
        if not self.kron:
            return self.jac @ v
        y = torch.mm(self.a, v.reshape(self.w_shape).t())  # rows a_{n,s}^T V^T, (N S, d_out)
        r = torch.linalg.vecdot(y, self.g)  # g_{n,s} . V a_{n,s}
        return r if self.s == 1 else r.reshape(self.n, self.s).sum(1)

    def matvec(self, c: torch.Tensor) -> torch.Tensor:  # (N,) -> (P_b,)
        if not self.kron:
            return c @ self.jac
        cs = c if self.s == 1 else c.repeat_interleave(self.s)
        return torch.mm(self.gt * cs, self.a).reshape(-1)


@capabilities(name="backends.torch.SENG", fast={
    "torch": "hooks (Linear/Conv) + torch.func for the rest; torch.distributed"},
    note={"torch": "CPU and CUDA"}, missing=("numpy", "cupy", "jax", "array_api_strict"))
class SENG(torch.optim.Optimizer):
    r"""Sketchy empirical natural gradient (layer-wise SMW with Cholesky), one backward per step.

    Parameters
    ----------
    params_or_model : nn.Module or iterable of parameters / parameter groups
        A module (its trainable parameters are optimised), or parameters together with
        ``model=``.  Hooks are installed on the model's layers.
    lr : float
        Step size :math:`\alpha`: :math:`\theta \leftarrow \theta - \alpha\, m`.
    damping : float
        :math:`\lambda > 0` (per parameter group; see also ``damping_schedule``).
    model : nn.Module, optional
        Required when ``params_or_model`` is not a module.  May be wrapped in
        ``DistributedDataParallel``.
    sketch : {"uniform", "leverage", "gaussian", "sparse_sign"} or None
        Sketch the parameter rows of layers with more than ``sketch_size`` parameters.
    sketch_size : int
        Rows q per sketched layer (split q_A x q_G over the Kronecker factors).
    update_freq : int
        Refresh the curvature (per-sample factors and Cholesky factor) every this many steps.
    momentum : float
        Heavy-ball momentum on the direction: :math:`m \leftarrow \mu m + d`.
    weight_decay : float
        Added to the gradient before preconditioning (:math:`g + w\theta`).
    damping_schedule : callable, optional
        ``damping_schedule(step) -> float`` overrides ``damping`` (the small system is
        refactored, not recomputed, when the value changes).
    loss_reduction : {"mean", "sum"}
        How the loss reduces over the batch; per-sample gradients are ``N * dL/dy`` for
        "mean" and ``dL/dy`` for "sum".
    low_rank : int, optional
        Compress Kronecker layers with more than this many positions (convolutions) to rank
        ``low_rank`` per-sample gradients (SENG's implicit mode, ``ntkcore.lowrank.low_rank``).
    distributed : {"auto", True, False}
        Average directions over ``torch.distributed`` workers (auto: when initialised with
        more than one worker).
    seed : int, numpy.random.Generator, torch.Generator or JAX key, optional
        Seed of the sketches (the k-th refresh uses a seed derived from it and k); a generator
        is drawn from once, at construction.
    grad_scaler : torch.amp.GradScaler, optional
        The scaler of the loss, whose ``get_scale()`` unscales the captured output gradients;
        needed for :meth:`precondition` and after ``scaler.unscale_(opt)``.

    Notes
    -----
    For every layer (block) :math:`b` SENG moves along the damped empirical natural gradient

    .. math::

        (\lambda I + \tfrac{1}{N} U_b U_b^\top)\, d_b = g_b ,\qquad
        d_b = \frac{1}{\lambda}\bigl(g_b - U_b c_b\bigr),\qquad
        (\lambda I + \tfrac{1}{N} U_b^\top U_b)\, c_b = \tfrac{1}{N} U_b^\top g_b ,

    where the columns of :math:`U_b` (P_b x N) are the per-sample loss gradients of the batch
    and :math:`g_b` the (mean) gradient plus weight decay.  The N x N system is assembled in
    float64 and factored by Cholesky (``ntkcore.solve.SMWSolver``); with ``sketch`` its Gram
    and right-hand side use a row sketch of the P_b dimension (:math:`\Omega_A \otimes
    \Omega_G` for Kronecker layers, ``ntkcore.sketch.sketch_jacobian``).  The curvature is
    refreshed every ``update_freq`` steps from the batch of that step; in between, only
    :math:`U_b^\top g_b` and :math:`U_b c_b` are recomputed.  Distributed
    (``torch.distributed``, e.g. DDP): every worker solves with its own samples and the
    directions are averaged with one ``all_reduce`` (the block-diagonal-over-workers variant
    of the SENG paper).

    Per-sample gradients: a layer whose rule allows it
    (``torch_layers.LayerRule.kronecker_update``: ``nn.Linear``, ``nn.Conv1d/2d/3d`` with
    groups = 1, torch's own ``forward``) is a KroneckerBlock from hooks, ``a`` its inputs
    (plus a ones column for the bias) and ``g = N * dL/dy`` (:math:`\partial \ell_n /
    \partial y_n` for a mean-reduced loss), never materialised; where its weight is used
    only by its hooked calls (counted in the autograd graph) and each call's input and output
    carry the sample axis (the provider's probe, ``torch_jacobian.probe_sample_axes``, run on
    the first refresh of each shape signature, at most 64 cached; another axis than the
    first is moved to the front).  Every other trainable parameter, and such a layer with a
    shared input (positional table, buffer) or a weight used outside its ``forward``, gets
    exact dense per-sample gradients from ``torch.func``: :math:`\partial \ell_n / \partial
    f(x_n)`, captured at the model output, pulled back per sample with ``vmap(vjp)``.  Every
    tensor argument of the model that carries the samples must lead with the sample axis N.

    Usage is that of any optimizer: ``opt.zero_grad(); loss = crit(model(x), y);
    loss.backward(); opt.step()``, also with ``scaler.step(opt)`` of a ``GradScaler``, under
    ``torch.autocast`` (the factors are cast to the parameters' dtype), after
    ``add_param_group`` and with ``torch.compile`` before or after (the hooks run eagerly);
    :meth:`precondition` is the preconditioner form.  On refresh steps the forward and
    backward must run after the previous ``step()``; the last forward before ``step()`` is
    used.  ``state_dict()`` stores the step counter, momentum buffers and curvature factors:
    a loaded optimizer continues bit for bit on the same machine and thread count.

    ``step()`` raises ``ValueError`` before any parameter, momentum buffer or step counter
    changes when a gradient (plus weight decay) is not finite (naming the parameter) or the
    direction is not; on a refresh, when the captured forward coupled the samples (a
    BatchNorm with batch statistics), had a Dropout in training mode while some layer needs
    the ``torch.func`` pass (which cannot replay its mask), or, on a new shape signature,
    when the model cannot run on p != N samples (the probe).

    Threads: ntkcore's own passes over the model (``ntk``, ``gram``, KIP, ...), at any point
    of a step, run with ``torch_jacobian.in_provider_pass()`` true and are invisible to the
    hooks.  The ``torch.func`` pass of a refresh holds ``torch_jacobian.model_lock(model)``;
    hold it yourself around the training forward and backward when ntkcore calls on the
    model may run in other threads (their ``torch.func`` pass swaps parameters in place).
    The hooks capture any forward with autograd enabled, from any thread: run evaluation
    forwards in other threads under ``torch.no_grad()``.
    """

    def __init__(self, params_or_model: Any, lr: float = 0.05, damping: float = 1.0, *,
                 model: nn.Module | None = None, sketch: str | None = None,
                 sketch_size: int = 256, update_freq: int = 1, momentum: float = 0.0,
                 weight_decay: float = 0.0,
                 damping_schedule: Callable[[int], float] | None = None,
                 loss_reduction: str = "mean", low_rank: int | None = None,
                 distributed: str | bool = "auto", seed: int | None = 0,
                 grad_scaler: Any = None) -> None:
        params: Any = params_or_model
        if isinstance(params_or_model, nn.Module):
            if model is not None and model is not params_or_model:
                raise ValueError("pass the model either as the first argument or as model=")
            model = params_or_model
            params = [p for p in model.parameters() if p.requires_grad]
        elif model is None:
            raise TypeError("SENG needs the model (to capture per-sample gradients): "
                            "SENG(model, ...) or SENG(params, ..., model=model)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        lr = check_scalar(lr, "lr", positive=True)
        damping = check_scalar(damping, "damping", positive=True)
        weight_decay = check_scalar(weight_decay, "weight_decay", nonnegative=True)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1); got {momentum}")
        if int(update_freq) != update_freq or update_freq < 1:
            raise ValueError(f"update_freq must be a positive integer; got {update_freq}")
        if sketch is not None and sketch not in KINDS:
            raise ValueError(f"sketch must be None or one of {KINDS}; got {sketch!r}")
        if int(sketch_size) != sketch_size or sketch_size < 1:
            raise ValueError(f"sketch_size must be a positive integer; got {sketch_size}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum'; got {loss_reduction!r}")
        if low_rank is not None and (int(low_rank) != low_rank or low_rank < 1):
            raise ValueError(f"low_rank must be None or a positive integer; got {low_rank}")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError("grad_scaler must be a torch.amp.GradScaler (or have get_scale()); "
                            f"got {type(grad_scaler).__name__}")
        defaults = dict(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.model = model
        self.sketch = sketch
        self.sketch_size = int(sketch_size)
        self.update_freq = int(update_freq)
        self.damping_schedule = damping_schedule
        self.loss_reduction = loss_reduction
        self.low_rank = None if low_rank is None else int(low_rank)
        self.distributed = distributed
        self.seed = seed_from(seed)  # a generator is drawn from once, here
        self.grad_scaler = grad_scaler
        self._step = 0
        self._refreshes = 0
        self._solvers: dict[str, SMWSolver] = {}
        self._directions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._curvature: dict[str, Jacobian] = {}
        self._sketch_seeds: dict[str, int | None] = {}
        self._root_calls: list[dict[str, Any]] = []
        self._coupling: str | None = None  # why the captured forward has no per-sample grads
        self._random: str | None = None  # a Dropout in training mode (dense layers fail on it)
        # per shape signature: unit name -> sample axes of its used calls, or why it has none
        self._axes_cache: dict[Any, dict[str, list[int] | str]] = {}
        self._probes = 0  # probe forwards run (one per new shape signature)
        self._suspended = False
        self._handles: list[Any] = []
        self._hooks_wanted = True
        self._build_units()
        self._sync_hooks()

    # GradScaler.step(self) then sets self.grad_scale / self.found_inf and calls step()
    _step_supports_amp_scaling = True

    # -- structure ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``; the layers are re-planned and the next
        step refreshes the curvature of every block (the hooks are attached for it)."""
        super().add_param_group(param_group)
        if hasattr(self, "units"):  # not from Optimizer.__init__
            try:
                self._build_units()
            except ValueError:  # parameters outside the model: refused, nothing changed
                self.param_groups.pop()
                self._build_units()
                raise
            self._solvers, self._directions, self._curvature = {}, {}, {}
            self._drop_hooks()
            self._sync_hooks()

    def _group_of(self) -> dict[int, dict[str, Any]]:
        return {id(p): g for g in self.param_groups for p in g["params"]}

    def _build_units(self) -> None:
        inner = _unwrap(self.model)
        owned = self._group_of()
        self.units: list[_Owner] = []
        covered: set[int] = set()
        for name, mod in inner.named_modules():
            # the layers whose rule allows a Kronecker update (Linear, groups=1 Conv)
            rule = rule_for(mod)
            if rule is None or not rule.kronecker_update(mod):
                continue
            params = [mod.weight] if mod.bias is None else [mod.weight, mod.bias]
            # (a weight shared with an earlier layer: updated once, there)
            if all(id(q) in owned and id(q) not in covered for q in params):
                self.units.append(_Owner(name or "<root>", params, mod))
                covered.update(id(q) for q in params)
        by_module: dict[str, _Owner] = {}
        for pname, p in inner.named_parameters():
            if id(p) in owned and id(p) not in covered:
                mname = pname.rpartition(".")[0] or "<root>"
                by_module.setdefault(mname, _Owner(mname, [])).params.append(p)
                covered.add(id(p))
        self.dense = list(by_module.values())
        self._names = {id(p): n for n, p in inner.named_parameters()}
        missing = [p for g in self.param_groups for p in g["params"] if id(p) not in covered]
        if missing:
            raise ValueError(f"{len(missing)} optimised parameter(s) do not belong to the model")

    def _drop_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _sync_hooks(self) -> None:
        """Hooks are attached only while the next step refreshes the curvature (between
        refreshes the model runs without Python hook calls, PyTorch's fast module-call path)."""
        if not self._hooks_wanted:
            return
        due = self._refresh_due()
        if due and not self._handles:
            inner = _unwrap(self.model)
            self._handles = [
                inner.register_forward_pre_hook(partial(_eager, self._root_pre_hook),
                                                with_kwargs=True),
                inner.register_forward_hook(partial(_eager, self._root_hook)),
                *(unit.module.register_forward_hook(partial(_eager, self._unit_hook, unit),
                                                    with_kwargs=True) for unit in self.units)]
        elif not due and self._handles:
            self._drop_hooks()

    def remove_hooks(self) -> None:
        """Detach the optimizer's hooks from the model (for good: refreshes then fail)."""
        self._hooks_wanted = False
        self._drop_hooks()

    def _refresh_due(self) -> bool:
        return self._step % self.update_freq == 0 or not self._solvers

    def _capturing(self, x: Any = None) -> bool:
        # not in ntkcore's own passes over the model (ntk() between backward and step); (a deep
        # copy of a hooked model carries hooks bound to a stripped optimizer copy)
        if getattr(self, "_suspended", True) or not torch.is_grad_enabled() or in_provider_pass():
            return False
        wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
        if isinstance(x, torch.Tensor) and wrapped is not None and wrapped(x):
            return False  # forwards inside torch.func transforms (vmap, grad) are not batches
        return self._refresh_due()

    def _root_pre_hook(self, module: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> None:
        first = args[0] if args else next(iter(kwargs.values()), None)
        if self._capturing(first):
            for unit in self.units:
                unit.calls = []
            self._root_calls = [{
                "args": tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                "kwargs": {k: v.detach() if isinstance(v, torch.Tensor) else v
                           for k, v in kwargs.items()},
                "outs": [], "gy": None}]
            # Per-sample gradients need independent samples (no batch statistics) and, for
            # the torch.func pass of the dense layers, a deterministic forward (no Dropout):
            # recorded for this forward, raised by the refresh before anything changes.
            self._coupling = self._random = None
            for dropout, attr in ((False, "_coupling"), (True, "_random")):
                try:
                    check_sample_coupling(module, dropout=dropout)
                except ValueError as exc:
                    setattr(self, attr, str(exc))
                    break

    def _root_hook(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if not self._root_calls or not self._capturing(out):
            return
        rec = self._root_calls[0]
        # the output tensors (their graph tells which weights are used outside a hooked call)
        rec["outs"] = [t for t in torch.utils._pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: rec.__setitem__("gy", grad.detach()))

    def _unit_hook(self, unit: _Owner, module: nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any], out: torch.Tensor) -> None:
        x = args[0] if args else kwargs.get("input")
        if isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and out.requires_grad \
                and self._capturing(out):
            call: dict[str, Any] = {"x": x.detach(), "gy": None}
            unit.calls.append(call)
            out.register_hook(lambda grad: call.__setitem__("gy", grad.detach()))

    # -- the sample axis of each hooked call ------------------------------------------------
    def _unit_plan(self, rec: dict[str, Any]) -> dict[str, list[int] | str]:
        """For every unit: the sample axis of each of its used calls (Kronecker), or why it
        has none (``torch.func``; :class:`SENG`'s notes).  Cached per shape signature."""
        def sig(a: Any) -> Any:
            return (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a)

        used = {u.name: [i for i, c in enumerate(u.calls) if c["gy"] is not None]
                for u in self.units}
        # (input shape, output shape) of every call; a call without a gradient has no recorded
        # output shape: it is not used, and its entry only keeps the call order
        shapes = {u.name: tuple((tuple(c["x"].shape), () if c["gy"] is None
                                 else tuple(c["gy"].shape)) for c in u.calls) for u in self.units}
        key = (tuple(sig(a) for a in rec["args"]),
               tuple((k, sig(v)) for k, v in rec["kwargs"].items()),
               tuple((k, v, tuple(used[k])) for k, v in shapes.items()))
        plan = self._axes_cache.get(key)
        if plan is not None:
            return plan
        plan = {}
        uses = graph_uses(rec["outs"])[1] if rec["outs"] else {}
        need: dict[str, list[int]] = {}
        for u in self.units:
            idx = used[u.name]
            if not idx:
                plan[u.name] = "no call of the module reaches the loss"
            elif any(uses.get(id(q), 0) != len(idx) for q in u.params):
                plan[u.name] = ("its weight is used outside the module's own forward (e.g. "
                                "nn.MultiheadAttention.out_proj, or tied to another module)")
            else:
                need[u.name] = idx
        if need:
            plan.update(self._probe(rec, need, shapes))
        if len(self._axes_cache) >= 64:  # bounded: drop the oldest signature
            self._axes_cache.pop(next(iter(self._axes_cache)))
        self._axes_cache[key] = plan
        return plan

    def _probe(self, rec: dict[str, Any], need: dict[str, list[int]],
               shapes: dict[str, Any]) -> dict[str, list[int] | str]:
        """The sample axes of the ``need``-ed units' calls from a forward on p != N samples
        (N: the leading length of the model's first tensor argument)."""
        n = next((int(a.shape[0]) for a in (*rec["args"], *rec["kwargs"].values())
                  if isinstance(a, torch.Tensor) and a.ndim >= 1), None)
        if n is None:
            raise ValueError("SENG needs the model's first tensor argument to lead with the "
                             "sample axis (N, ...); the last forward had no tensor argument")
        p = probe_size(n)

        def cut(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and a.ndim >= 1 and a.shape[0] == n:
                return torch.cat([a[:1]] * p) if p > 1 else a[:1]
            return a

        args = tuple(cut(a) for a in rec["args"])
        kwargs = {k: cut(v) for k, v in rec["kwargs"].items()}
        inner = _unwrap(self.model)
        modules = {u.name: u.module for u in self.units}
        cuda = sorted({a.device.index or 0 for a in (*args, *kwargs.values())
                       if isinstance(a, torch.Tensor) and a.is_cuda})
        self._probes += 1
        try:
            # ntkcore's own pass (SENG's hooks ignore it; the model's lock is held), on a
            # forked RNG so that the user's random stream (Dropout masks) is unchanged
            with provider_pass(inner), torch.random.fork_rng(devices=cuda):
                axes = probe_sample_axes(lambda: inner(*args, **kwargs), modules, shapes, need,
                                          n, p)
        except ProbeFailed as exc:
            raise ValueError(
                f"SENG cannot determine the sample axis of the layers it factors: the model "
                f"raised when run on {p} sample(s) (the first sample of each argument that "
                f"leads with N={n}): {exc}. SENG needs a model that runs on any number of "
                "samples, with every tensor argument that has the sample axis leading with it; "
                "no parameter was changed") from exc.__cause__
        return {k: axes.get(k, "its input has no sample axis (it is shared by all samples, "
                               "e.g. a positional table or a buffer, or the sample axis is "
                               "merged with another)") for k in need}

    # -- per-sample factors ---------------------------------------------------------------
    def _unit_block(self, unit: _Owner, axes: list[int]) -> KroneckerBlock:
        calls = [c for c in unit.calls if c["gy"] is not None]
        n = int(calls[0]["x"].shape[axes[0]])
        # torch_layers' factors, the sample axis in front (a sequence-first (T, N, d) call),
        # in the weight's dtype (under torch.autocast the calls run in a lower precision)
        dt, scale = unit.params[0].dtype, self._sample_scale(n)
        xs = [c["x"].to(dt).movedim(ax, 0) for c, ax in zip(calls, axes, strict=True)]
        mod, rule = unit.module, rule_for(unit.module) if unit.module is not None else None
        assert mod is not None and rule is not None  # a Kronecker unit (_build_units)
        gs = [rule.output_factor(mod, c["gy"].to(dt)[None] * scale, n, 1, ax)
              for c, ax in zip(calls, axes, strict=True)]
        block = rule.block(mod, xs, gs, n, unit.name, True, len(unit.params) == 2)
        assert isinstance(block, KroneckerBlock)  # Linear / groups=1 Conv
        return block

    def _dense_blocks(self, owners: list[_Owner]) -> list[DenseBlock]:
        """The DenseBlocks of ``owners`` (dense groups and Linear/Conv layers without a
        sample axis), each in the layout of its ``flat_grad``, from ``torch.func``."""
        if not owners:
            return []
        rec = self._root_calls[0]  # (_refresh checked that there is one)
        if rec["gy"] is None:
            what = [o.name for o in owners]
            raise RuntimeError("SENG has no captured model-output gradient for the layers "
                               f"without Kronecker structure ({what}); run the forward and "
                               "backward before step() (the model must return one tensor "
                               "(N, ...))")
        from torch.func import functional_call, vjp, vmap

        inner = _unwrap(self.model)
        base = {k: v.detach() for k, v in (*inner.named_parameters(), *inner.named_buffers())}
        fb = {self._names[id(q)]: base[self._names[id(q)]] for o in owners for q in o.params}
        args = rec["args"]
        batched = tuple(0 if isinstance(a, torch.Tensor) else None for a in args)

        def one(e_n: torch.Tensor, *args_n: Any) -> dict[str, torch.Tensor]:
            def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
                full = {**base, **p}
                xs = tuple(a[None] if isinstance(a, torch.Tensor) else a for a in args_n)
                return functional_call(inner, full, xs)[0]

            _, pull = vjp(f, fb)
            return pull(e_n)[0]

        # functional_call swaps the module's parameters in place: hold the model's lock so that
        # no ntkcore call on this model (another thread) runs meanwhile
        with provider_pass(inner):
            gy = rec["gy"].to(next(iter(fb.values())).dtype)  # (autocast: as _unit_block)
            per_sample = vmap(one, in_dims=(0, *batched))(gy, *args)
        n = rec["gy"].shape[0]
        scale = self._sample_scale(n)
        return [DenseBlock((o.flat([per_sample[self._names[id(q)]] for q in o.params], (n,))
                            * scale)[:, None, :], o.name) for o in owners]

    def _sample_scale(self, n: int) -> float:
        """Per-sample gradients from captured output gradients: ``N * dL/dy`` for a mean
        loss, ``dL/dy`` for a sum, divided by the GradScaler's loss scale (the factor the loss
        was multiplied by in the captured backward)."""
        scale = (self.grad_scaler.get_scale() if self.grad_scaler is not None
                 else getattr(self, "grad_scale", None))  # set by GradScaler.step (READY)
        if scale is None and getattr(self, "found_inf", None) is not None:
            raise ValueError("SENG: scaler.unscale_(optimizer) ran before scaler.step(optimizer),"
                             " so the scale of the captured output gradients is unknown; pass "
                             "grad_scaler=scaler to SENG; no parameter was changed")
        return (n if self.loss_reduction == "mean" else 1.0) / (1.0 if scale is None
                                                                else float(scale))

    def _damping(self, group: dict[str, Any]) -> float:
        if self.damping_schedule is not None:
            return check_scalar(self.damping_schedule(self._step),
                                f"damping_schedule({self._step})", positive=True)
        return float(group["damping"])

    def _build_solver(self, name: str, block: Any, damping: float) -> None:
        """Factor block ``name``'s system; its direction: ``SMWSolver.solve_with``, ``_Thin``."""
        jac = Jacobian([block])
        spec = (SketchSpec(self.sketch, self.sketch_size, self._sketch_seeds.get(name))
                if self.sketch is not None and jac.num_params > self.sketch_size else None)
        solver = SMWSolver(jac, damping, sketch=spec, scale=1.0 / jac.num_samples,
                           gram_dtype="wide")
        full = _Thin(jac)
        xi = _Thin(solver.sketched_factor) if solver.sketched_factor is not jac else full
        self._solvers[name] = solver
        # unchecked: _natural_directions tests every block's direction with one sync
        self._directions[name] = lambda g: solver.solve_with(g, xi.rmatvec, full.matvec, False)

    def _refresh(self) -> None:
        if self._coupling is not None:
            raise ValueError("SENG cannot form per-sample gradients from the last forward: "
                             f"{self._coupling}; no parameter was changed")
        rec = self._root_calls[0] if self._root_calls else None
        if rec is None or (rec["gy"] is None and not any(c["gy"] is not None
                                                         for u in self.units for c in u.calls)):
            raise RuntimeError(
                "SENG has no captured gradients for the model: on a curvature refresh step run "
                "the forward and backward (with autograd enabled) after the previous step() and "
                "before this one")
        # everything that can fail before any state changes: the sample axes (a probe
        # forward on a new shape signature) and the torch.func pass
        plan = self._unit_plan(rec) if self.units else {}
        demoted = [u for u in self.units if isinstance(plan[u.name], str)]
        if self._random is not None and (self.dense or demoted):
            why = "".join(f"; layer {u.name!r} needs it because {plan[u.name]}"
                          for u in demoted[:1])
            raise ValueError("SENG cannot form per-sample gradients from the last forward: "
                             f"{self._random} (the torch.func pass of the layers without "
                             f"Kronecker structure cannot replay its mask{why}); no parameter "
                             "was changed")
        kron: dict[str, Any] = {u.name: self._unit_block(u, plan[u.name]) for u in self.units
                                if u not in demoted}
        if self.low_rank is not None:
            kron = {k: _low_rank(b, self.low_rank)[0] for k, b in kron.items()}
        self._suspended = True  # the torch.func forwards below must not be captured
        try:
            kron.update(zip([o.key for o in demoted + self.dense],
                            self._dense_blocks(demoted + self.dense), strict=True))
        finally:
            self._suspended = False
        groups = self._group_of()
        self._refreshes += 1
        self._curvature, self._solvers, self._directions = {}, {}, {}
        for i, o in enumerate(self.units + self.dense):  # the units, then the dense groups
            self._curvature[o.key] = kron[o.key]
            self._sketch_seeds[o.key] = spawn_seed(self.seed, self._refreshes, i)
            self._build_solver(o.key, kron[o.key], self._damping(groups[id(o.params[0])]))
        for unit in self.units:
            unit.calls = []
        self._root_calls = []

    def _world(self) -> int:
        dist = torch.distributed
        if self.distributed is False or not (dist.is_available() and dist.is_initialized()):
            if self.distributed is True:
                raise RuntimeError("distributed=True but torch.distributed is not initialised")
            return 1
        return dist.get_world_size()

    # -- the step --------------------------------------------------------------------------
    def _natural_directions(self, skip_nonfinite: bool) -> list[tuple[Any, torch.Tensor]] | None:
        """(parameter, its direction) for every parameter, refreshing the curvature first when
        due; None when ``skip_nonfinite`` and a gradient is not finite."""
        groups = self._group_of()
        owners = self.units + self.dense
        scale = getattr(self, "grad_scale", None)  # GradScaler.step: the grads are still scaled
        inv = 1.0 if scale is None else 1.0 / float(scale)
        grads = [o.flat([_grad(p, groups[id(o.params[0])]["weight_decay"], inv)
                         for p in o.params]) for o in owners]
        # one device synchronisation; before the refresh and before any write
        if not _all_finite(grads):
            if skip_nonfinite:
                return None
            named = []  # name the first culprit
            for p in [p for o in owners for p in o.params]:
                name = self._names.get(id(p), "?")
                named.append((f"the gradient of parameter {name!r}", _grad(p)))
                if groups[id(p)]["weight_decay"]:
                    named.append((f"parameter {name!r} (weight decay adds it to the gradient)", p))
            raise ValueError(f"SENG.step: {first_nonfinite(named) or 'a gradient'} contains NaN or "
                             "Inf; no parameter was changed (check the loss, the data and the "
                             "learning rate)")
        if self._refresh_due():
            self._refresh()
        directions: list[torch.Tensor] = []
        for o, g in zip(owners, grads, strict=True):
            self._solvers[o.key].set_damping(self._damping(groups[id(o.params[0])]))
            directions.append(self._directions[o.key](g))
        world = self._world()
        if world > 1:
            flat = torch.cat(directions)
            torch.distributed.all_reduce(flat)
            flat /= world
            directions = list(torch.split(flat, [d.numel() for d in directions]))
        if not _all_finite(directions):
            bad = [o.key for o, d in zip(owners, directions, strict=True)
                   if not bool(torch.isfinite(d).all())]
            raise ValueError(f"SENG.step: the direction of block {bad[0]!r} contains NaN or Inf "
                             "(finite gradient; overflow in the curvature?); no parameter was "
                             "changed")
        return [(p, dp) for o, d in zip(owners, directions, strict=True)
                for p, dp in zip(o.params, o.split(d), strict=True)]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One SENG step (refreshing the curvature first when due); returns closure's loss.
        From ``GradScaler.step``: skipped when the scaler found Inf/NaN, else unscaled here."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step
        if found_inf is not None and bool(found_inf):
            return loss
        pairs = self._natural_directions(skip_nonfinite=False)
        assert pairs is not None
        # theta <- theta - lr * m, m <- mu m + d (m = d without momentum), batched per
        # (lr, momentum) with the foreach kernels of torch.optim
        groups = self._group_of()
        batches: dict[tuple[float, float], list[tuple[Any, torch.Tensor]]] = {}
        for p, dp in pairs:
            batches.setdefault((groups[id(p)]["lr"], groups[id(p)]["momentum"]), []).append((p, dp))
        for (lr, mu), batch in batches.items():
            params = [p for p, _ in batch]
            ds = [dp.to(p.dtype) for p, dp in batch]
            if mu:
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                bufs = [self.state[p]["momentum_buffer"] for p in params]
                torch._foreach_mul_(bufs, mu)
                torch._foreach_add_(bufs, ds)
                ds = bufs
            torch._foreach_add_(params, ds, alpha=-lr)
        self._step += 1
        self._sync_hooks()
        return loss

    @torch.no_grad()
    def precondition(self) -> None:
        r"""Replace every optimised parameter's ``.grad`` by its SENG direction :math:`d`.

        For any ``torch.optim`` optimizer to follow (``loss.backward(); seng.precondition();
        opt.step()``): direction, refreshes and checks as in :meth:`step`; ``lr`` and
        ``momentum`` unused.  With a ``GradScaler``, pass ``grad_scaler=`` and call
        ``scaler.unscale_(opt)`` first: a non-finite gradient then leaves ``.grad`` for
        ``scaler.step(opt)`` to skip (without a scaler it raises ``ValueError``).
        """
        pairs = self._natural_directions(skip_nonfinite=self.grad_scaler is not None)
        if pairs is None:
            return
        for p, dp in pairs:
            p.grad = dp.to(p.dtype, copy=True) if p.grad is None else p.grad.copy_(dp)
        self._step += 1
        self._sync_hooks()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        curvature = {name: {k: v.detach().clone() for k, v in (
            {"a": b.explicit_a(), "g": b.g} if isinstance(b, KroneckerBlock)
            else {"jac": b.to_dense()}).items()} for name, b in self._curvature.items()}
        sd["seng"] = {"step": self._step, "refreshes": self._refreshes,
                      "curvature": curvature, "sketch_seeds": dict(self._sketch_seeds)}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("seng", None)
        super().load_state_dict(state_dict)
        if extra is None:
            return
        self._step = int(extra["step"])
        self._refreshes = int(extra["refreshes"])
        self._sketch_seeds = dict(extra["sketch_seeds"])
        groups = self._group_of()
        dev_of = {o.key: o.params[0] for o in self.units + self.dense}
        self._curvature, self._solvers, self._directions = {}, {}, {}
        for name, arrays in extra["curvature"].items():
            like = dev_of[name]
            arrays = {k: v.to(like.device) for k, v in arrays.items()}
            block: Any = (DenseBlock(arrays["jac"], name.split(":", 1)[-1]) if "jac" in arrays
                          else KroneckerBlock(arrays["a"], arrays["g"], name))
            self._curvature[name] = block
            self._build_solver(name, block, self._damping(groups[id(like)]))
        self._sync_hooks()
