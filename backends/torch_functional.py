r"""Parameters applied by functional calls, which no module with a layer rule owns: the
``TorchFunctionMode`` that finds their uses (:class:`ParamUses`: what it recognises, and when
a parameter is structured) and their blocks (:func:`functional_blocks`; the dense rule in
:func:`term_sums`).
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ntkcore.jacobian import DenseBlock, KroneckerBlock

from .torch_layers import NORMALISE, Reducer, Summed, cat, embedding_index, into, with_ones

__all__ = ["CALLED_BY_PARENT", "Call", "ParamUses", "Term", "functional_blocks", "sample_axes",
           "structured_groups"]

# Structured module classes whose parameters the parent applies functionally (never a module
# call): left to the mode instead of the hooks.
CALLED_BY_PARENT = (nn.modules.linear.NonDynamicallyQuantizableLinear,)

_MUL = frozenset({torch.mul, torch.Tensor.mul, torch.multiply, torch.Tensor.multiply})
_ADD = frozenset({torch.add, torch.Tensor.add})
_CAT = frozenset({torch.cat, torch.concat, torch.concatenate})


# norm function -> (parameter names with defaults, xhat builder, channels-first).  The weight
# and bias are broadcast like the trailing normalized_shape (LayerNorm / RMSNorm) or along
# axis 1 (channel norms on (N, C, *L)).
_NORMS: dict[Any, tuple[tuple[tuple[str, Any], ...], Callable, bool]] = {
    F.layer_norm: ((("input", None), ("normalized_shape", None), ("weight", None),
                    ("bias", None), ("eps", 1e-5)), NORMALISE[F.layer_norm], False),
    F.rms_norm: ((("input", None), ("normalized_shape", None), ("weight", None),
                  ("eps", None)), NORMALISE[F.rms_norm], False),
    F.batch_norm: ((("input", None), ("running_mean", None), ("running_var", None),
                    ("weight", None), ("bias", None), ("training", False), ("momentum", 0.1),
                    ("eps", 1e-5)), NORMALISE[F.batch_norm], True),
    F.group_norm: ((("input", None), ("num_groups", None), ("weight", None), ("bias", None),
                    ("eps", 1e-5)), NORMALISE[F.group_norm], True),
    F.instance_norm: ((("input", None), ("running_mean", None), ("running_var", None),
                       ("weight", None), ("bias", None), ("use_input_stats", True),
                       ("momentum", 0.1), ("eps", 1e-5)), NORMALISE[F.instance_norm], True),
}
_LINEAR = (("input", None), ("weight", None), ("bias", None))
_EMBEDDING = (("input", None), ("weight", None), ("padding_idx", None), ("max_norm", None),
              ("norm_type", 2.0), ("scale_grad_by_freq", False), ("sparse", False))


def _bind(spec: tuple[tuple[str, Any], ...], args: tuple, kwargs: dict) -> dict | None:
    """``{name: value}`` of a call by the names and defaults of ``spec``; None if it does not
    fit (unknown keyword, too many arguments)."""
    if len(args) > len(spec) or any(k not in dict(spec) for k in kwargs):
        return None
    out = dict(spec)
    out.update(zip((k for k, _ in spec), args, strict=False))
    out.update(kwargs)
    return out


def _flat(obj: Any) -> Iterator[Any]:
    if isinstance(obj, list | tuple):
        for o in obj:
            yield from _flat(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _flat(o)
    else:
        yield obj


# --------------------------------------------------------------------------------------------
# how a view lays out its parameter
# --------------------------------------------------------------------------------------------
def _core(d: torch.Tensor, p: torch.Tensor) -> tuple[tuple[int, ...], int] | None:
    r"""``(core shape, offset)`` of a view ``d`` of ``p``: d's shape with its broadcast axes
    (stride 0) set to 1, and the flat offset in ``p`` of d's first entry, when d's remaining
    entries are ``p.flatten()[offset : offset + prod(core)]`` in row-major order; else None.
    """
    if not p.is_contiguous():
        return None
    core = tuple(1 if st == 0 else sz for sz, st in zip(d.shape, d.stride(), strict=True))
    expect = 1
    for sz, st in reversed(list(zip(core, d.stride(), strict=True))):
        if sz > 1:
            if st != expect:
                return None
            expect *= sz
    off = d.storage_offset() - p.storage_offset()
    if off < 0 or off + math.prod(core) > p.numel():
        return None
    return core, off


def _rows(d: torch.Tensor, p: torch.Tensor, ndim: int) -> tuple[int, int] | None:
    """The row range ``(r0, r1)`` of ``p`` that a Linear weight (``ndim`` 2) or bias (1) view
    ``d`` is, when d is ``p[r0:r1]`` with p of the same number of axes; else None."""
    if d.ndim != ndim or p.ndim != ndim or d.shape[1:] != p.shape[1:]:
        return None
    found = _core(d, p)
    if found is None or found[0] != tuple(d.shape):
        return None
    width = math.prod(p.shape[1:])
    if found[1] % width:
        return None
    r0 = found[1] // width
    return r0, r0 + d.shape[0]


# --------------------------------------------------------------------------------------------
# the recorded calls
# --------------------------------------------------------------------------------------------
@dataclass
class Term:
    """One parameter operand of a call: ``role`` is "weight" / "bias" (Linear: rows
    ``(lo, hi)``), "scale" (times ``Call.h``), "shift", "piece" (a slice of y along
    ``dim`` from ``lo`` to ``hi``) or "rows" (the rows ``P[index]`` of a table, added to or
    times ``Call.h``: :class:`Table`); ``core`` and ``offset``: the operand's layout of P
    (:func:`_core`), ``place``: its shape in y's axes (ones where broadcast)."""

    param: torch.Tensor
    role: str
    offset: int = 0
    core: tuple[int, ...] = ()
    place: tuple[int, ...] = ()
    lo: int = 0
    hi: int = 0
    dim: int = 0
    operand: Any = None
    index: torch.Tensor | None = None  # "rows": the index factor (-1 at padding_idx)


@dataclass
class Table:
    """A lookup ``y = F.embedding(idx, P)`` of a table parameter P (:class:`ParamUses`'s
    ``tables``): ``index`` is idx as an index factor (``torch_layers.embedding_index``)."""

    y: torch.Tensor
    param: torch.Tensor
    index: torch.Tensor


@dataclass
class Call:
    """A recognised call: its result ``y``, its sample operands ``samples`` (they and y must
    carry the sample axis), ``h``: the Linear input / the other factor of a product / the
    norm input (with ``xhat``), ``terms``.  Its subclass says which rule its block follows."""

    y: torch.Tensor
    samples: list[torch.Tensor]
    terms: list[Term]
    h: torch.Tensor | None = None
    xhat: Callable[[torch.Tensor], torch.Tensor] | None = None
    channels_first: bool = False
    trailing: int = 0  # normalised axes of a LayerNorm / RMSNorm (never the sample axis)
    versions: list[int] = field(default_factory=list)

    def modified(self) -> bool:
        return [t._version for t in (self.y, *self.samples)] != self.versions

    def allows_axis(self, ax: int, ndim: int) -> bool:
        """Whether axis ``ax`` of y (``ndim`` axes) may be the sample axis."""
        raise NotImplementedError

    @staticmethod
    def block(params: list[torch.Tensor], mine: list, n: int, name: str,
              create_graph: bool) -> DenseBlock | KroneckerBlock:
        """The block of the group ``params`` from its calls ``mine`` (call, axis, g)."""
        raise NotImplementedError


class LinearCall(Call):
    """``F.linear``: its weight / bias rows make a KroneckerBlock (:func:`_linear_block`)."""

    def allows_axis(self, ax: int, ndim: int) -> bool:
        return ax < ndim - 1  # never the feature axis

    @staticmethod
    def block(params: list[torch.Tensor], mine: list, n: int, name: str,
              create_graph: bool) -> DenseBlock | KroneckerBlock:
        return _linear_block(params, mine, n, name, create_graph)


class DenseCall(Call):
    """A norm, product, sum or ``cat`` with parameter terms: the dense rule
    (:func:`term_sums`), or a table lookup's index-factor block (:func:`_table_block`)."""

    def allows_axis(self, ax: int, ndim: int) -> bool:
        if (self.channels_first and ax != 0) or ax >= ndim - self.trailing:
            return False
        return all(t.place[ax] == 1 and not (t.role == "piece" and t.dim == ax)
                   for t in self.terms)

    @staticmethod
    def block(params: list[torch.Tensor], mine: list, n: int, name: str,
              create_graph: bool) -> DenseBlock | KroneckerBlock:
        if any(t.role == "rows" for c, _, _ in mine for t in c.terms):
            return _table_block(params[0], mine, n, name, create_graph)
        return _dense_block(params, mine, name, create_graph)


def _place(core: tuple[int, ...], ndim: int) -> tuple[int, ...] | None:
    """``core`` right-aligned in ``ndim`` axes (numpy broadcasting); None if longer."""
    if len(core) > ndim:
        if any(c != 1 for c in core[:len(core) - ndim]):
            return None
        core = core[len(core) - ndim:]
    return (1,) * (ndim - len(core)) + core


class ParamUses(TorchFunctionMode):
    r"""Records, during a forward pass, the calls that use the candidate parameters ``params``
    (below); ``bad`` collects the ids of parameters used otherwise,
    ``direct[id(P)]`` the outputs of the ops that took P itself (for the graph check).
    ``clone``: hand the model a clone of each recognised result (a rerun after an in-place
    change).  ``probe``: a pass on other samples that only needs the calls' shapes.
    ``tables``: embedding tables whose lookups ``F.embedding(idx, P)`` are followed
    (``gathers[id(y)]``: the result y then counts as P's operand, see :func:`_table_term`).

    A parameter that no structured module owns (``torch_layers.rule_for``) is still structured when
    every use of it in the forward pass is one of the calls below, found by a
    ``torch.overrides.TorchFunctionMode`` (:class:`ParamUses`) that is active during the
    provider's hooked forward and its probe, and only when the model has such candidate
    parameters (a model made of structured modules runs without it: no per-call cost).
    An operand "is" a parameter P when it is P or a view of P (``t._base is P``: ``reshape``,
    ``expand``, ``unsqueeze``, ``split``, ...), whose entries are a contiguous run of P's, possibly
    broadcast (stride 0).  g denotes the output gradients of the call's result y, taken with the
    same backward passes as the Kronecker blocks' (``torch_jacobian._output_grads``).

    ==========================================  ================================================
    call (P = a parameter or a view of one)     block
    ==========================================  ================================================
    ``F.linear(x, W, b)``                       :class:`~ntkcore.KroneckerBlock` [W | b] with
                                                a = [x, 1] and g, positions = the non-sample
                                                axes of x; W, b may be the same row range of
                                                larger parameters (``nn.MultiheadAttention``'s
                                                ``in_proj_weight.split``): g is zero outside it.
    ``F.layer_norm``, ``F.rms_norm``,           :math:`J_w = \sum_s g\,\hat x`,
    ``F.batch_norm`` (eval, running stats),     :math:`J_b = \sum_s g` (DenseBlock), with
    ``F.group_norm``, ``F.instance_norm``       :math:`\hat x` the call without weight and bias
                                                (timm's ``LayerNorm2d``, ``BatchNormAct2d``).
    ``h * P``, ``torch.mul``                    :math:`J_P = \sum_{\text{broadcast}} g \odot h`
                                                (layer-scale ``gamma``)
    ``h + P``, ``torch.add`` (alpha 1)          :math:`J_P = \sum_{\text{broadcast}} g`
                                                (``pos_embed``, a bias added by hand)
    ``torch.cat([..., P, ...])``                the slice of g at P's positions, summed over
                                                P's broadcast axes (``cls_token.expand(N, ...)``)
    ``h + R``, ``h * R``, R = ``F.embedding(i,  KroneckerBlock with index factor a[n, t] = i_t
    E)`` of a table E in ``tables``             (``one_hot`` = V), g summed over R's broadcast
                                                axes (BERT's ``position_embeddings``;
                                                :func:`_table_block`)
    ==========================================  ================================================

    Safety.  A parameter is structured only when (1) each of its operands in the forward pass is
    a recognised call's operand or the input of a view op whose result is again a view of it (an
    op whose outputs need no gradient, such as ``p.shape`` or ``p.detach()``, is not a use), (2)
    the number of autograd edges into its gradient accumulator reachable from the output equals
    the number of ops that took the parameter itself (a use the mode did not see, e.g. inside an
    ``autograd.Function``, makes them differ), (3) every call's result and sample operands have
    the sample axis the provider's probe finds (:func:`sample_axes`), (4) the result and
    operands were not modified in place afterwards (else the pass reruns with clones), and (5)
    all selected parameters registered on its module are structured the same way (one
    Kronecker matrix [W | b], weight registered first, or all dense).  Otherwise the parameter
    keeps the exact ``torch.func`` path.

    Tables.  The provider passes as ``tables`` the ``nn.Embedding`` weights whose lookups its probe
    found without a sample axis (``pos(torch.arange(T))``); the mode then takes the result R of
    ``F.embedding(i, E)`` (E itself, no ``max_norm`` or ``scale_grad_by_freq``) as E's operand,
    laid out as the rows :math:`E[i_t]`, and recognises R in ``h + R`` and ``h * R`` only (any
    other op on R, views included, is a use it does not recognise); the graph check (2) counts
    the edges into R's node against the recognised calls on R.  A table also used in any other
    recognised call (``F.linear(h, E)``, ``h + E``) keeps ``torch.func``.

    Not covered (they keep ``torch.func``): other ops (``-``, ``/``, ``addcmul``, ``matmul``,
    ``F.embedding`` of a non-table parameter, in-place ops), a result with fewer than two axes
    (an (N,) output plus a bias), a Linear weight registered on the root module,
    ``nn.MultiheadAttention`` with separate q/k/v weights or ``bias_k`` / ``bias_v``.  ``SENG``
    does not use this module (its non-Linear / Conv layers keep its own ``torch.func`` path).

    ``nn.MultiheadAttention``.  ``F.multi_head_attention_forward`` is a Python function that
    dispatches to the mode as a whole; the mode runs a copy of its body with its
    ``has_torch_function`` check off and the mode active, so that its ``F.linear`` calls are seen.
    Its ``out_proj`` (``NonDynamicallyQuantizableLinear``, never called as a module:
    :data:`CALLED_BY_PARENT`) is applied to a (T*B, E) reshape of the attention output whose row
    t*B + b the body views back as (t, b); the copy applies that ``F.linear`` to the (T, B, E)
    view instead (the same rows) and checks that the body's result is that view, so that its
    sample axis B is found like any other.
    """

    def __init__(self, params: list[torch.Tensor], clone: bool = False,
                 tables: list[torch.Tensor] = ()):
        super().__init__()
        self.params = {id(p): p for p in (*params, *tables)}
        self.tables = {id(p) for p in tables}
        self.gathers: dict[int, Table] = {}
        self.clone = clone
        self.calls: list[Call] = []
        self.bad: set[int] = set()
        self.direct: dict[int, list[torch.Tensor]] = {}
        self.done = False  # set by the caller when the forward pass ran to the end

    def owner(self, t: Any) -> torch.Tensor | None:
        """The candidate parameter that ``t`` is or views, or None."""
        if not isinstance(t, torch.Tensor):
            return None
        p = self.params.get(id(t))
        if p is t:
            return p
        tab = self.gathers.get(id(t))
        if tab is not None and tab.y is t:
            return tab.param
        b = t._base
        if b is not None:
            p = self.params.get(id(b))
            if p is b:
                return p
        return None

    def _owned(self, items: Any, found: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``found`` extended by ``(t, owner(t))`` for the tensors t in the nested ``items``
        (lists, tuples, dict values) that are or view a candidate, in :func:`_flat` order: a
        loop, not a generator, for it runs on every torch call of the forward pass."""
        for t in items:
            if isinstance(t, torch.Tensor):
                if (p := self.owner(t)) is not None:
                    found.append((t, p))
            elif isinstance(t, list | tuple):
                self._owned(t, found)
            elif isinstance(t, dict):
                self._owned(t.values(), found)
        return found

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        owned = self._owned(args, [])
        if kwargs:
            self._owned(kwargs.values(), owned)
        if not owned:
            return func(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            return self._attention(args, kwargs, owned)
        out = func(*args, **kwargs)
        outs = [o for o in _flat(out) if isinstance(o, torch.Tensor)]
        if not any(o.requires_grad for o in outs):
            return out  # no gradient reaches P through this op (shape queries, detach, ...)
        params = {id(p): p for _, p in owned}
        if len(params) == 1 and all(self.owner(o) is owned[0][1] for o in outs):
            self._direct(owned, outs[0])  # a view of P (or P itself)
            return out
        if func is F.embedding and (tab := _lookup(self, args, kwargs, out)) is not None:
            self._direct(owned, out)
            self.gathers[id(out)] = tab
            return out
        call = _recognise(self, func, args, kwargs, owned, out)
        if call is None:
            self.bad.update(params)
            return out
        self._direct(owned, call.y)
        if self.clone:  # keep the recorded tensors out of reach of later in-place ops
            old, call.samples = call.samples, [s.clone() for s in call.samples]
            if call.h is not None:
                same = [c for s, c in zip(old, call.samples, strict=True) if s is call.h]
                call.h = same[0] if same else call.h.clone()
        call.versions = [t._version for t in (call.y, *call.samples)]
        self.calls.append(call)
        return out.clone() if self.clone else out

    def _direct(self, owned: list[tuple[torch.Tensor, torch.Tensor]], y: torch.Tensor) -> None:
        for t, p in owned:
            if t is p and y is not p:
                self.direct.setdefault(id(p), []).append(y)

    def _attention(self, args: tuple, kwargs: dict,
                   owned: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """``F.multi_head_attention_forward`` with its body visible (:class:`ParamUses`)."""
        query = args[0] if args else kwargs["query"]
        made: list[torch.Tensor] = []
        if query.dim() == 3:
            t_len, bsz = int(query.shape[0]), int(query.shape[1])

            def linear(inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                       ) -> torch.Tensor:
                if inp.dim() == 2 and inp.shape[0] == t_len * bsz:
                    y = F.linear(inp.reshape(t_len, bsz, inp.shape[1]), w, b)
                    made.append(y)
                    return y.reshape(t_len * bsz, y.shape[-1])
                return F.linear(inp, w, b)
        else:
            linear = F.linear
        n_calls = len(self.calls)
        with self:
            res = _unchecked(F.multi_head_attention_forward, linear)(*args, **kwargs)
        if made:  # the body must hand back the (T, B, E) view of the last out_proj result
            y, r = made[-1], res[0]
            if not (r.shape == y.shape and r.stride() == y.stride()
                    and r.data_ptr() == y.data_ptr()):
                for c in self.calls[n_calls:]:
                    if any(c.y is m for m in made):
                        self.bad.update(id(t.param) for t in c.terms)
        return res


@functools.cache
def _unchecked_code(func: Any) -> tuple[Any, dict]:
    g = dict(func.__globals__)
    g["has_torch_function"] = lambda *a: False
    return func.__code__, g


def _unchecked(func: Any, linear: Callable) -> Callable:
    """A copy of the Python function ``func`` whose ``has_torch_function`` check is off (so
    that an active mode sees the calls in its body), with ``linear`` in place of ``F.linear``
    for the calls made from the body itself."""
    code, g = _unchecked_code(func)
    g = {**g, "linear": linear}
    body = types.FunctionType(code, g, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


def _lookup(mode: ParamUses, args: tuple, kwargs: dict, out: Any) -> Table | None:
    """The :class:`Table` of ``F.embedding(idx, P, padding_idx)`` with P one of ``mode``'s
    tables itself (not a view), else None (``max_norm`` renormalises P in place,
    ``scale_grad_by_freq`` rescales its gradient: neither is a lookup)."""
    a = _bind(_EMBEDDING, args, kwargs)
    if a is None or not isinstance(out, torch.Tensor) or not isinstance(a["input"], torch.Tensor):
        return None
    p = a["weight"]
    if (id(p) not in mode.tables or mode.params.get(id(p)) is not p or p.ndim != 2
            or a["max_norm"] is not None or a["scale_grad_by_freq"]):
        return None
    return Table(out, p, embedding_index(a["input"], a["padding_idx"], int(p.shape[0])))


def _recognise(mode: ParamUses, func: Any, args: tuple, kwargs: dict,
               owned: list[tuple[torch.Tensor, torch.Tensor]], out: Any) -> Call | None:
    """The :class:`Call` of ``func(*args, **kwargs) -> out`` if it is one of the recognised
    uses of its parameter operands ``owned`` (every one of them a term), else None."""
    if not isinstance(out, torch.Tensor) or out.ndim < 2:
        return None
    if func is F.linear:
        call = _linear_call(mode, args, kwargs, out)
    elif func in _NORMS:
        call = _norm_call(mode, func, args, kwargs, out)
    elif func in _MUL or func in _ADD:
        call = _elementwise_call(mode, func in _MUL, args, kwargs, out)
    elif func in _CAT:
        call = _cat_call(mode, args, kwargs, out)
    else:
        return None
    if call is None or {id(t) for t, _ in owned} - {id(t.operand) for t in call.terms}:
        return None
    return call


def _term(mode: ParamUses, d: Any, role: str, ndim: int, **kw: Any) -> Term | None:
    """The term of operand ``d`` (a candidate's view) placed in ``ndim`` axes, or None."""
    p = mode.owner(d)
    if p is None or id(d) in mode.gathers:  # a table lookup is no view of P
        return None
    found = _core(d, p)
    if found is None:
        return None
    place = _place(found[0], ndim)
    if place is None:
        return None
    return Term(p, role, offset=found[1], core=found[0], place=place, operand=d, **kw)


def _linear_call(mode: ParamUses, args: tuple, kwargs: dict, out: torch.Tensor) -> Call | None:
    a = _bind(_LINEAR, args, kwargs)
    if a is None or mode.owner(a["input"]) is not None or a["input"].ndim < 2:
        return None
    terms = []
    rows = None
    for role, dim in (("weight", 2), ("bias", 1)):
        d = a[role]
        p = mode.owner(d)
        if p is None:
            continue
        r = None if id(d) in mode.gathers else _rows(d, p, dim)
        if r is None or (rows is not None and r != rows):
            return None
        rows = r
        terms.append(Term(p, role, lo=r[0], hi=r[1], operand=d))
    if not terms:
        return None
    return LinearCall(out, [a["input"]], terms, h=a["input"])


def _norm_call(mode: ParamUses, func: Any, args: tuple, kwargs: dict,
               out: torch.Tensor) -> Call | None:
    spec, xhat_of, chan = _NORMS[func]
    a = _bind(spec, args, kwargs)
    if a is None or mode.owner(a["input"]) is not None:
        return None
    if any(mode.owner(a[k]) is not None for k in a if k not in ("weight", "bias", "input")):
        return None
    xhat = xhat_of(a)
    if xhat is None:
        return None
    trailing = 0 if chan else len(tuple(a["normalized_shape"]))
    terms = []
    for role, name in (("scale", "weight"), ("shift", "bias")):
        d = a.get(name)
        if mode.owner(d) is None:
            if d is not None and not isinstance(d, torch.Tensor):
                return None
            continue
        t = _term(mode, d, role, out.ndim)
        if t is not None and chan:  # (C,) along axis 1 of (N, C, *L)
            t.place = (1, *t.core, *([1] * (out.ndim - 2))) if d.ndim == 1 else ()
            if len(t.place) != out.ndim:
                return None
        if t is None:
            return None
        terms.append(t)
    if not terms:
        return None
    return DenseCall(out, [a["input"]], terms, h=a["input"], xhat=xhat,
                channels_first=chan, trailing=trailing)


def _elementwise_call(mode: ParamUses, mul: bool, args: tuple, kwargs: dict,
                      out: torch.Tensor) -> Call | None:
    if len(args) != 2 or any(k != "alpha" for k in kwargs) or kwargs.get("alpha", 1) != 1:
        return None
    a, b = args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    d, h = (a, b) if mode.owner(a) is not None else (b, a)
    if mode.owner(h) is not None:
        return None  # both operands parameters: no sample axis
    if id(d) in mode.gathers:
        t = _table_term(mode.gathers[id(d)], out.ndim)
    else:
        t = _term(mode, d, "scale" if mul else "shift", out.ndim)
    if t is None:
        return None
    return DenseCall(out, [h], [t], h=h if mul else None)


def _table_term(tab: Table, ndim: int) -> Term | None:
    """The "rows" term of a lookup ``tab.y = P[idx]`` (idx.shape + (D,)) that is added to
    (or multiplies) an ``ndim``-axis operand: placed like a view of P of that shape."""
    place = _place(tuple(tab.y.shape), ndim)
    if place is None or tab.y.shape[:-1] != tab.index.shape:
        return None
    return Term(tab.param, "rows", core=tuple(tab.y.shape), place=place, operand=tab.y,
                index=tab.index)


def _cat_call(mode: ParamUses, args: tuple, kwargs: dict, out: torch.Tensor) -> Call | None:
    a = _bind((("tensors", None), ("dim", 0)), args, kwargs)
    if a is None or not isinstance(a["tensors"], list | tuple):
        return None
    dim = a["dim"] % out.ndim
    terms, samples, start = [], [], 0
    for piece in a["tensors"]:
        if not isinstance(piece, torch.Tensor) or piece.ndim != out.ndim:
            return None
        length = int(piece.shape[dim])
        if mode.owner(piece) is not None:
            t = _term(mode, piece, "piece", out.ndim, lo=start, hi=start + length, dim=dim)
            if t is None:
                return None
            terms.append(t)
        else:
            samples.append(piece)
        start += length
    if not terms or not samples:
        return None
    return DenseCall(out, samples, terms)


# --------------------------------------------------------------------------------------------
# sample axes (from the provider's probe)
# --------------------------------------------------------------------------------------------
def _shapes(call: Call) -> tuple[tuple[int, ...], ...]:
    return (tuple(call.y.shape), *(tuple(s.shape) for s in call.samples))


def sample_axes(real: list[Call], probe: list[Call], tracking: Callable[..., int | None],
                n: int, p: int) -> list[int | None]:
    """The sample axis of each real call's result (None: it has none that the rules allow):
    the axis ``tracking(real shape, probe shape, n, p)`` of y, the same (right-aligned) axis of
    every sample operand, never a Linear's feature axis, a normalised axis or a ``cat``
    axis, axis 0 for a channel norm; and every parameter term broadcast along it."""
    if len(real) != len(probe):
        return [None] * len(real)
    axes: list[int | None] = []
    for c, q in zip(real, probe, strict=True):
        ax = _call_axis(c, _shapes(c), _shapes(q), tracking, n, p)
        axes.append(ax)
    return axes


def _call_axis(c: Call, rs: tuple, ps: tuple, tracking: Callable[..., int | None], n: int,
               p: int) -> int | None:
    if len(rs) != len(ps):
        return None
    ax = tracking(rs[0], ps[0], n, p)
    if ax is None:
        return None
    ndim = len(rs[0])
    for r, q in zip(rs[1:], ps[1:], strict=True):
        if tracking(r, q, n, p) != ax - (ndim - len(r)):
            return None
    return ax if c.allows_axis(ax, ndim) else None


# --------------------------------------------------------------------------------------------
# blocks
# --------------------------------------------------------------------------------------------
def structured_groups(groups: dict[str, list[torch.Tensor]], calls: list[Call],
                      axes: list[int | None], root: set[str]) -> dict[str, list[torch.Tensor]]:
    """The groups (block name -> its selected parameters in block order) that the ``calls``
    (reachable from the output, with their sample ``axes``) structure: every parameter has a
    call, every call of it a sample axis, and either all its terms are dense ones, or the
    group is Linear [W] / [W, b] / [b] (W registered first, not a ``root`` block), with each
    of its calls using all of the group's parameters."""
    by_param: dict[int, list[int]] = {}
    no_axis: set[int] = set()
    for i, c in enumerate(calls):
        for t in c.terms:
            by_param.setdefault(id(t.param), []).append(i)
            if axes[i] is None:
                no_axis.add(id(t.param))
    ok: dict[str, list[torch.Tensor]] = {}
    for name, ps in groups.items():
        ids = [id(p) for p in ps]
        if any(i in no_axis or i not in by_param for i in ids):
            continue
        roles = [{t.role for j in by_param[i] for t in calls[j].terms if id(t.param) == i}
                 for i in ids]
        if any("rows" in r for r in roles):  # a table: looked up only, never used directly
            if all(r == {"rows"} for r in roles):
                ok[name] = ps
            continue
        if all(r.isdisjoint(("weight", "bias")) for r in roles):
            ok[name] = ps
            continue
        kinds = [next(iter(r)) for r in roles if len(r) == 1]
        if (name in root or len(kinds) != len(ids) or kinds not in (["weight"], ["bias"],
                                                                   ["weight", "bias"])):
            continue
        touched = {j for i in ids for j in by_param[i]}
        if all({id(t.param) for t in calls[j].terms} >= set(ids) for j in touched):
            ok[name] = ps
    return ok


def _grads_view(g: torch.Tensor, y: torch.Tensor, ax: int) -> torch.Tensor:
    """g (N, S, O, d) of ``LayerRule.output_factor`` (no module: Linear layout, sample axis
    ``ax`` of y moved to the front) as a view (N, O, *rest), rest = y's other axes in order."""
    rest = [s for i, s in enumerate(y.shape) if i != ax]
    return g.unflatten(1, rest[:-1]).movedim(-2, 1) if len(rest) > 1 else g[:, 0]


def term_sums(c: Call, ax: int,
              create_graph: bool) -> Reducer | None:
    r"""For a call every term of which follows the dense rule (no Linear, no table rows): the
    map from its output gradients g (N, S, L, d) (Linear layout, any number L of outputs) to
    its terms' :func:`_dense_term` sums concatenated along the last axis, in ``c.terms``
    order, (N, L, W).  The factor h (:math:`\hat x` for a norm) is formed once, here.  The
    provider applies it pass by pass and keeps only the sums (``torch_layers.Summed``);
    None for any other call (its g is kept).

    Dense rule.  Let y (the call's output, samples on axis k) depend on P only through
    :math:`y = h \odot D` (or :math:`h + D`, or D a slice of y) where :math:`D[i] = P[\pi(i)]` is
    P's entries laid out over y's axes, broadcast over the axes B where D has length 1 or stride
    0 (k must be one of them: a parameter is the same for all samples).  Then, per sample n and
    output o,

    .. math:: \frac{\partial f_o(x_n)}{\partial P_c} = \sum_{i \notin B} [\pi(i) = c]
              \sum_{j \in B \setminus k} g[n, o, i, j]\; (h[n, i, j]),

    i.e. multiply (for a product), sum over the broadcast axes other than the sample axis, and
    flatten: P's entries in row-major order.  The norm layers are this rule with
    :math:`h = \hat x` for the weight and :math:`h = 1` for the bias.  Several calls (a parameter
    used twice) add up; the sum over positions is exact and minimal (``AffineRule``).
    """
    if not isinstance(c, DenseCall) or any(t.role == "rows" for t in c.terms):
        return None
    h = c.h if c.h is None or create_graph else c.h.detach()
    scaled = None  # the factor of every "scale" term, broadcast to y, samples in front
    if h is not None and any(t.role == "scale" for t in c.terms):
        hh = c.xhat(h) if c.xhat is not None else h
        scaled = hh.broadcast_to(c.y.shape).movedim(ax, 0).unsqueeze(1)

    def reduce(g: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        gv = _grads_view(g, c.y, ax)
        return into(cat([_dense_term(t, gv, scaled if t.role == "scale" else None, c.y, ax,
                                     ready=True) for t in c.terms], -1), out)

    return reduce


def _dense_term(t: Term, gv: torch.Tensor, h: torch.Tensor | None, y: torch.Tensor,
                ax: int, ready: bool = False) -> torch.Tensor:
    r"""(N, O, prod(t.core)): the term's :math:`\sum_{\text{broadcast}} g\,(h)` of the module
    docstring, from gv (N, O, *rest) and h (broadcastable to y, or None; with ``ready``
    already broadcast to y with the samples in front and an output axis, (N, 1, *rest))."""
    place = [s for i, s in enumerate(t.place) if i != ax]
    rest = [s for i, s in enumerate(y.shape) if i != ax]
    if t.role == "piece":  # no h
        d = t.dim - (t.dim > ax)
        gv = gv.narrow(2 + d, t.lo, t.hi - t.lo)
        rest[d] = t.hi - t.lo
    elif h is not None:  # ready: h is already (N, 1, *rest)
        gv = gv * (h if ready else h.broadcast_to(y.shape).movedim(ax, 0).unsqueeze(1)).to(
            gv.dtype)
    dims = [2 + i for i, (pl, r) in enumerate(zip(place, rest, strict=True)) if pl == 1 and r > 1]
    red = gv.sum(dims) if dims else gv
    return red.reshape(red.shape[0], red.shape[1], -1)


def functional_blocks(groups: dict[str, list[torch.Tensor]], calls: list[tuple[Call, int]],
                      gs: list[torch.Tensor], n: int,
                      create_graph: bool) -> dict[str, DenseBlock | KroneckerBlock]:
    """The blocks of ``groups`` (block name -> its parameters, in block order) from the
    recognised ``calls`` (with their sample axes) and their output gradients ``gs`` (Linear
    layout, one per call).  A group whose parameters appear only as Linear terms is a
    KroneckerBlock [W | b]; otherwise a DenseBlock (the dense rule of :func:`term_sums`)."""
    out: dict[str, DenseBlock | KroneckerBlock] = {}
    for name, params in groups.items():
        ids = {id(p) for p in params}
        mine = [(c, ax, g) for (c, ax), g in zip(calls, gs, strict=True)
                if any(id(t.param) in ids for t in c.terms)]
        out[name] = mine[0][0].block(params, mine, n, name, create_graph)
    return out


def _linear_block(params: list[torch.Tensor], mine: list, n: int, name: str,
                  create_graph: bool) -> KroneckerBlock:
    r""":math:`\partial f/\partial [W|b] = \sum_{calls}\sum_s g_s [a_s, 1]^\top`: positions of
    all calls concatenated, each call's g zero outside its rows."""
    ids = {id(p) for p in params}
    roles = {t.role for c, _, _ in mine for t in c.terms if id(t.param) in ids}
    weight, bias = "weight" in roles, "bias" in roles
    rows = params[0].shape[0]
    a_parts, g_parts = [], []
    for c, ax, g in mine:
        lo, hi = next((t.lo, t.hi) for t in c.terms if id(t.param) in ids)
        if hi - lo != rows:
            full = g.new_zeros((*g.shape[:3], rows))
            full[..., lo:hi] = g
            g = full
        x = c.h if create_graph else c.h.detach()
        x = (x if ax == 0 else x.movedim(ax, 0)).reshape(n, -1, x.shape[-1])
        if not weight:
            x = g.new_ones((n, g.shape[1], 1))
        elif bias:
            x = with_ones(x)
        a_parts.append(x.to(g.dtype))
        g_parts.append(g.contiguous())  # (the provider's loop stores g output-major)
    return KroneckerBlock(cat(a_parts, 1).contiguous(), cat(g_parts, 1), name)


def _table_block(p: torch.Tensor, mine: list, n: int, name: str,
                 create_graph: bool) -> KroneckerBlock:
    r"""The index-factor KroneckerBlock of a table P (V, D) looked up without a sample axis,
    :math:`D_t = P[i_t]` (t over idx's entries), and added to (multiplying) the sample operand
    h of y: by the dense rule with :math:`\pi(t, d) = (i_t, d)`,

    .. math:: \frac{\partial f_o(x_n)}{\partial P_{vd}} = \sum_{t:\, i_t = v}
              \sum_{j \in B \setminus k} g[n, o, t, j, d]\; (h[n, t, j, d]),

    i.e. a Kronecker block of :math:`W = P^\top` (D, V) with one-hot inputs :math:`e_{i_t}`
    (the same for every sample) at the positions t, and g the dense rule's sum over the
    broadcast axes (:func:`_dense_term`) before the scatter by :math:`i_t`; every lookup and
    call concatenated along the positions."""
    a_parts, g_parts = [], []
    d = int(p.shape[1])
    for c, ax, g in mine:
        gv = _grads_view(g, c.y, ax)
        h = c.h if c.h is None or create_graph else c.h.detach()
        for t in c.terms:
            if t.param is not p:
                continue
            s = t.index.numel()
            part = _dense_term(t, gv, h, c.y, ax)  # (N, O, S * D), rows in idx order
            g_parts.append(part.reshape(n, part.shape[1], s, d).transpose(1, 2))
            a_parts.append(t.index.reshape(1, s).expand(n, s))
    return KroneckerBlock(cat(a_parts, 1).contiguous(), cat(g_parts, 1), name,
                          one_hot=int(p.shape[0]))


def _term_width(t: Term, y: torch.Tensor, ax: int) -> int:
    """The last-axis length of :func:`_dense_term`'s result for term ``t`` of a call with
    result ``y`` (sample axis ``ax``): the kept (not summed) axes of y, a piece's narrowed."""
    rest = [s for i, s in enumerate(y.shape) if i != ax]
    place = [s for i, s in enumerate(t.place) if i != ax]
    if t.role == "piece":
        rest[t.dim - (t.dim > ax)] = t.hi - t.lo
    return math.prod(r for pl, r in zip(place, rest, strict=True) if not (pl == 1 and r > 1))


def _dense_block(params: list[torch.Tensor], mine: list, name: str,
                 create_graph: bool) -> DenseBlock:
    """Per parameter, the sum over its terms of :func:`_dense_term`, placed at the term's
    offset; concatenated in block order.  Each call's sums come from :func:`term_sums`: as
    the provider's ``Summed``, or applied here to a stored g."""
    cols: dict[int, torch.Tensor] = {}
    for c, ax, g in mine:
        if not isinstance(g, Summed):  # a stored g: reduced here as the provider does per pass
            reduce = term_sums(c, ax, create_graph)
            if reduce is None:
                raise RuntimeError(f"block {name!r}: a {type(c).__name__} in a dense group")
            g = Summed(reduce(g))
        # term_sums' output: the terms' sums side by side
        widths = [_term_width(t, c.y, ax) for t in c.terms]
        if sum(widths) != g.sums.shape[-1]:
            raise RuntimeError(f"block {name!r}: the reduced output gradients have "
                               f"{g.sums.shape[-1]} columns, the call's terms {widths}")
        parts = torch.split(g.sums, widths, dim=-1)
        for t, part in zip(c.terms, parts, strict=True):
            if id(t.param) not in {id(p) for p in params}:
                continue
            numel = t.param.numel()
            if part.shape[2] == numel:
                cols[id(t.param)] = part if id(t.param) not in cols else cols[id(t.param)] + part
            else:
                col = cols.get(id(t.param))
                if col is None:
                    col = cols[id(t.param)] = part.new_zeros((*part.shape[:2], numel))
                col = col.clone() if create_graph else col
                col[..., t.offset:t.offset + part.shape[2]] += part
                cols[id(t.param)] = col
    return DenseBlock(cat([cols[id(p)] for p in params], 2), name)
