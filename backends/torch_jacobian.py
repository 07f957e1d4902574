r"""The PyTorch Jacobian provider: a ``torch.nn.Module`` and inputs -> :class:`ntkcore.Jacobian`.

:func:`jacobian` records one hooked forward, probes the sample axis of every call, takes the
output gradients in backward passes over all samples at once and lets each layer's rule
(``torch_layers``; ``torch_functional`` for functional calls) assemble its block; the rest
are DenseBlocks from ``torch.func``.  Also the model's lock (:func:`model_lock`), the probe
shared with ``SENG`` and the block-order conversions.  Design: docs/architecture.md, "The
torch provider".
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ntkcore._api import ModelInputError, explain_failure, input_problem
from ntkcore._validation import check_outputs
from ntkcore.jacobian import DenseBlock, Jacobian, KroneckerBlock, dense_is_smaller
from ntkcore.support import capabilities

from .torch_functional import (
    CALLED_BY_PARENT,
    ParamUses,
    functional_blocks,
    structured_groups,
    term_sums,
)
from .torch_functional import sample_axes as functional_sample_axes
from .torch_layers import (
    PLAIN,
    RULES,
    LayerRule,
    RecurrentPass,
    RecurrentRule,
    Reducer,
    Summed,
    cat,
    drop_zero_positions_all,
    recurrent_rule,
    rule_for,
)
from .torch_recycle import empty as recycled

__all__ = ["block_params", "from_block_order", "in_provider_pass", "jacobian", "model_lock",
           "to_block_order"]


# -- parameter selection ---------------------------------------------------------------------
def select_params(model: nn.Module, params: Any,
                   named: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Names of the selected parameters in ``named_parameters`` order (``named``: that dict,
    when the caller has it)."""
    if named is None:
        named = dict(model.named_parameters())
    if params is None:
        chosen = [n for n, p in named.items() if p.requires_grad]
        if not chosen:
            raise ValueError("model has no parameter that requires grad; pass params= or set "
                             "requires_grad on the parameters of interest")
        return chosen
    if isinstance(params, str | torch.Tensor):
        params = [params]
    try:
        items = list(params)
    except TypeError:
        raise TypeError("params must be None, or an iterable of parameter names or tensors; "
                        f"got {type(params).__name__}") from None
    if not items:
        raise ValueError("params is empty: select at least one parameter")
    by_id = {id(p): n for n, p in named.items()}
    all_named = dict(model.named_parameters(remove_duplicate=False))
    wanted: set[str] = set()
    for item in items:
        if isinstance(item, str):
            if item not in all_named:
                raise ValueError(f"params: {item!r} is not a parameter name of the model")
            item = all_named[item]
        elif not isinstance(item, torch.Tensor):
            raise TypeError(f"params entries must be names or tensors; got {type(item).__name__}")
        if id(item) not in by_id:
            raise ValueError("params: a tensor passed is not a parameter of the model")
        wanted.add(by_id[id(item)])
    chosen = [n for n in named if n in wanted]
    frozen = [n for n in chosen if not named[n].requires_grad]
    if frozen:
        raise ValueError(f"params: {frozen} do not require grad; set requires_grad=True on them")
    return chosen


@dataclass
class _Walk:
    """One walk over a model's modules: ``modules`` (path -> module, ``named_modules()``),
    ``named`` (``dict(named_parameters())``), ``owners`` (deduplicated parameter name ->
    (module path, local name)) and ``registrations`` (parameter id -> how many modules
    register it)."""

    modules: dict[str, nn.Module]
    named: dict[str, torch.Tensor]
    owners: dict[str, tuple[str, str]]
    registrations: dict[int, int]


def _walk(model: nn.Module) -> _Walk:
    """The :class:`_Walk` of ``model``, in one ``named_modules()`` pass."""
    modules: dict[str, nn.Module] = {}
    named: dict[str, torch.Tensor] = {}
    owners: dict[str, tuple[str, str]] = {}
    registrations: dict[int, int] = {}
    # named_modules() dedups shared modules and visits in the order named_parameters() uses,
    # which keeps the first name of a parameter registered twice
    for mpath, mod in model.named_modules():
        modules[mpath] = mod
        for local, p in mod._parameters.items():
            if p is None:
                continue
            registrations[id(p)] = registrations.get(id(p), 0) + 1
            if registrations[id(p)] == 1:
                name = f"{mpath}.{local}" if mpath else local
                owners[name] = (mpath, local)
                named[name] = p
    return _Walk(modules, named, owners, registrations)


# -- hooks -----------------------------------------------------------------------------------
@dataclass
class _Call:
    a: torch.Tensor  # module input (N, ...)
    y: torch.Tensor  # module output (N, ...)
    a_version: int
    y_version: int


@dataclass
class _Unit:
    module: nn.Module
    rule: LayerRule
    names: list[str]  # selected params of this module, in order (weight before bias)
    has_weight: bool
    has_bias: bool
    calls: list[_Call] = field(default_factory=list)


def _structured_units(walk: _Walk, selected: list[str]) -> dict[str, _Unit]:
    named, owners, registrations = walk.named, walk.owners, walk.registrations
    by_module: dict[str, list[str]] = {}
    for n in selected:
        by_module.setdefault(owners[n][0], []).append(n)
    units: dict[str, _Unit] = {}
    for mpath, names in by_module.items():
        mod = walk.modules[mpath]  # the owners' paths are named_modules() paths
        rule = rule_for(mod)
        if rule is None or isinstance(rule, RecurrentRule) or isinstance(mod, CALLED_BY_PARENT):
            continue
        if any(registrations[id(named[n])] > 1 for n in names):
            continue
        locals_ = {owners[n][1] for n in names}
        if not locals_ <= {"weight", "bias"}:
            continue
        units[mpath] = _Unit(mod, rule, names, "weight" in locals_, "bias" in locals_)
    return units


def check_sample_coupling(model: nn.Module, dropout: bool = True,
                           modules: dict[str, nn.Module] | None = None) -> None:
    """Raise ValueError naming the first module whose samples interact (BatchNorm with batch
    statistics) or that is random (Dropout in training mode, unless ``dropout`` is False);
    ``modules``: ``dict(model.named_modules())``, when the caller has it."""
    for path, mod in (model.named_modules() if modules is None else modules.items()):
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            if mod.training or not mod.track_running_stats:
                raise ValueError(
                    f"module {path or type(mod).__name__!r} is a BatchNorm that normalises with "
                    "batch statistics, which couples the samples (the per-sample Jacobian is "
                    "then undefined); call model.eval() first"
                    + ("" if mod.track_running_stats else
                       " (and it needs track_running_stats=True to have running statistics)"))
        if (dropout and isinstance(mod, nn.RNNBase) and mod.training and mod.dropout > 0
                and mod.num_layers > 1):
            raise ValueError(f"module {path!r} is a recurrent layer with dropout={mod.dropout} "
                             "between its layers in training mode (a random model has no fixed "
                             "Jacobian); call model.eval() first")
        if (dropout and isinstance(mod, nn.modules.dropout._DropoutNd) and mod.training
                and mod.p > 0):
            raise ValueError(f"module {path!r} is a Dropout in training mode (a random model "
                             "has no fixed Jacobian); call model.eval() first")


# -- thread safety ---------------------------------------------------------------------------
# model_lock's locks, keyed by id (a module may be unhashable), dropped with the model; and
# in_provider_pass's flag.
_LOCKS: dict[int, threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()
_PROVIDER_PASS: contextvars.ContextVar[bool] = contextvars.ContextVar("ntkcore_provider_pass",
                                                                      default=False)


def model_lock(model: nn.Module) -> threading.RLock:
    """The re-entrant lock that serialises ntkcore's passes over ``model`` (one per object).

    :func:`jacobian` (hence ``ntk``, ``pseudo_ntk``, ``gram`` and KIP) and SENG's
    ``torch.func`` pass hold it while they run the model, so concurrent ntkcore calls on one
    model from several threads give the results of sequential ones (to rounding: the BLAS
    may split its sums across threads otherwise) and leave the model unchanged (parameter
    objects, ``requires_grad``, hooks, buffers, ``training``), also when a call raises or is
    interrupted.  Hold it yourself around your own forward, backward and optimizer step of
    the same model when ntkcore calls may run in other threads meanwhile: their
    ``torch.func`` pass swaps the parameters of non-Kronecker modules in place.  Do not hold
    it around a backward that runs ntkcore passes itself (KIP's checkpointed kernel): on a
    GPU that backward runs in another thread, which would wait for the lock forever.
    """
    with _LOCKS_GUARD:
        lock = _LOCKS.get(id(model))
        if lock is None:
            lock = _LOCKS[id(model)] = threading.RLock()
            weakref.finalize(model, _LOCKS.pop, id(model), None)
        return lock


def in_provider_pass() -> bool:
    """Whether the current thread (context) is inside a pass that ntkcore runs over a model.

    For forward hooks and tensor hooks of your own that should ignore ntkcore's passes, as
    :class:`~ntkcore.backends.torch_seng.SENG`'s do.
    """
    return _PROVIDER_PASS.get()


@contextlib.contextmanager
def provider_pass(model: nn.Module) -> Iterator[None]:
    """Hold ``model``'s lock and mark this thread's passes as ntkcore's own."""
    with model_lock(model):
        token = _PROVIDER_PASS.set(True)
        try:
            yield
        finally:
            _PROVIDER_PASS.reset(token)


@contextlib.contextmanager
def _hooked(modules: dict[str, nn.Module], record: Any) -> Iterator[None]:
    """Forward hooks calling ``record(key, input, output)`` for each call of ``modules[key]``
    with tensor input and output made by this thread (another thread's forward of the same
    module is not our pass); its return value replaces the output.  Runs with autograd on."""
    def hook_of(key: str) -> Any:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            a = args[0] if args else kwargs.get("input")
            if isinstance(out, torch.Tensor) and isinstance(a, torch.Tensor):
                return record(key, a, out)
            return None
        return hook

    with _forward_hooks([(m, hook_of(k)) for k, m in modules.items()]), torch.enable_grad():
        yield


@contextlib.contextmanager
def _forward_hooks(pairs: list[tuple[nn.Module, Any]]) -> Iterator[None]:
    """Each (module, hook) registered as a forward hook (with kwargs) while in the block,
    called for the calls made by this thread only."""
    me = threading.get_ident()

    def mine(h: Any) -> Any:
        return lambda *call: h(*call) if threading.get_ident() == me else None

    handles = [m.register_forward_hook(mine(h), with_kwargs=True) for m, h in pairs]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _run_forward(model: nn.Module, x: torch.Tensor, units: dict[str, _Unit],
                 clone: bool, uses: ParamUses | None, rec: dict[str, _RecUnit]) -> torch.Tensor:
    for unit in units.values():
        unit.calls = []
    for runit in rec.values():
        runit.calls, runit.shapes, runit.ok = [], [], True

    def record(path: str, a: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        if clone:  # keep the recorded tensors out of reach of later in-place ops
            a, out = a.clone(), y.clone()
        units[path].calls.append(_Call(a, y, a._version, y._version))
        return out if clone else None

    with (_hooked({path: u.module for path, u in units.items()}, record),
          uses if uses is not None else contextlib.nullcontext(),
          _hooked_recurrent(rec)):
        try:
            out = model(x)
        except Exception as exc:  # a NumPy-typed dtype, complex x, ...: say so, naming x
            explain_failure(exc, model, "x", x)
            raise
        return _check_output(out)


def graph_uses(out: torch.Tensor | list[torch.Tensor]) -> tuple[set[Any], dict[int, int]]:
    """Nodes reachable from ``out`` (a tensor or a list of tensors) and, per leaf tensor id,
    the number of graph edges into its gradient accumulator (= the number of times the forward
    used it)."""
    seen: set[Any] = set()
    uses: dict[int, int] = {}
    stack = [t.grad_fn for t in (out if isinstance(out, list) else [out])]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                uses[id(var)] = uses.get(id(var), 0) + 1
            stack.append(nxt)
    return seen, uses


# -- recurrent layers (nn.RNN / nn.GRU / nn.LSTM), unrolled over time (torch_layers) ---------
@dataclass
class _RecUnit:
    module: nn.Module
    rule: RecurrentRule
    names: list[str]  # its selected parameters, in order
    calls: list[list[RecurrentPass]] = field(default_factory=list)  # per call, per layer/dir
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    ok: bool = True  # False once a call could not be unrolled (e.g. a PackedSequence)


#: The names torch's own recurrent modules give their parameters (``RecurrentRule.pairs``): only
#: their owners are looked up (``get_submodule`` walks the path, per parameter and call).
_RNN_PARAM = re.compile(r"(weight|bias)_(ih|hh)_l\d+(_reverse)?")


def _recurrent_units(walk: _Walk, selected: list[str]) -> dict[str, _RecUnit]:
    """The recurrent modules (``torch_layers.recurrent_rule``) owning selected parameters that
    no other module registers."""
    named, owners, registrations = walk.named, walk.owners, walk.registrations
    units: dict[str, _RecUnit] = {}
    for nm in selected:
        mpath = owners[nm][0]
        if mpath in units:
            units[mpath].names.append(nm)
        elif (mpath and _RNN_PARAM.fullmatch(owners[nm][1])
              and (rule := recurrent_rule(walk.modules[mpath])) is not None):
            units[mpath] = _RecUnit(walk.modules[mpath], rule, [nm])
    return {p: u for p, u in units.items()
            if all(registrations[id(named[nm])] == 1 for nm in u.names)}


def _rnn_call(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(input, hx) of a call ``forward(input, hx=None)``."""
    inp = args[0] if args else kwargs.get("input")
    return inp, args[1] if len(args) > 1 else kwargs.get("hx")


@contextlib.contextmanager
def _hooked_recurrent(rec: dict[str, _RecUnit]) -> Iterator[None]:
    """Forward hooks that replace the output of each call of a ``rec`` module made by this
    thread with its step-by-step recomputation (``RecurrentRule.forward``) and record
    the passes; a call on anything but a 3-D tensor is left alone and marks the unit not ok.
    The fused forward has run (and validated ``hx``) before the hook."""
    def hook_of(unit: _RecUnit) -> Any:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            inp, hx = _rnn_call(args, kwargs)
            if not isinstance(inp, torch.Tensor) or inp.ndim != 3:
                unit.ok = False
                return None
            new, passes = unit.rule.forward(mod, inp, hx)
            unit.calls.append(passes)
            unit.shapes.append((tuple(inp.shape), tuple(new[0].shape)))
            return new
        return hook

    with _forward_hooks([(u.module, hook_of(u)) for u in rec.values()]):
        yield


@contextlib.contextmanager
def _recurrent_shapes(rec: dict[str, _RecUnit],
                      seen: dict[str, list[Any]]) -> Iterator[None]:
    """Forward hooks appending (input shape, output shape) of each call of a ``rec`` module
    made by this thread to ``seen[path]`` (None for a call on a non-tensor), for the probe."""
    def hook_of(path: str) -> Any:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            inp, _ = _rnn_call(args, kwargs)
            ok = isinstance(inp, torch.Tensor) and isinstance(out[0], torch.Tensor)
            seen[path].append((tuple(inp.shape), tuple(out[0].shape)) if ok else None)
        return hook

    with _forward_hooks([(u.module, hook_of(p)) for p, u in rec.items()]):
        yield


def _recurrent_axes(rec: dict[str, _RecUnit], seen: dict[str, list[Any]], n: int,
                    p: int) -> dict[str, list[int]]:
    """``{path: [0, ...]}`` for the modules whose every call's batch axis (0 if
    ``batch_first``, else 1) is the sample axis of its input and output in the probe (as
    :func:`_tracking_axis` finds it); its passes are batch-first, hence the 0s."""
    axes: dict[str, list[int]] = {}
    for path, unit in rec.items():
        batch = 0 if unit.module.batch_first else 1
        if len(seen[path]) == len(unit.shapes) and all(
                q is not None and _tracking_axis(r[0], q[0], n, p) == batch
                and _tracking_axis(r[1], q[1], n, p) == batch
                for r, q in zip(unit.shapes, seen[path], strict=True)):
            axes[path] = [0] * len(unit.calls)
    return axes


def _recurrent_used(rec: dict[str, _RecUnit], reachable: set[Any], uses: dict[int, int],
                    named: dict[str, torch.Tensor]) -> list[str]:
    """The ``rec`` modules whose calls could all be unrolled and whose selected parameters are
    used in the graph only by those calls: each call uses a parameter through one alias
    (``torch_layers._direction``), so its number of uses must be the number of calls whose alias
    reaches the output (and one at least must)."""
    out = []
    for path, unit in rec.items():
        if not unit.ok or not unit.calls:
            continue
        counts = []
        for nm in unit.names:
            local = nm[len(path) + 1:]
            counts.append(sum(1 for passes in unit.calls for r in passes
                              if local in r.views and r.views[local].grad_fn in reachable))
            if uses.get(id(named[nm]), 0) != counts[-1]:
                break
        else:
            if any(counts):
                out.append(path)
    return out


def _recurrent_block_names(rkron: dict[str, _RecUnit]) -> dict[str, str]:
    """Parameter name -> block name for the recurrent modules ``rkron``: the blocks of
    ``RecurrentRule.blocks``, named after the first selected parameter of each
    (weight, bias) pair."""
    names: dict[str, str] = {}
    for path, unit in rkron.items():
        sel = set(unit.names)
        for _, w, b in unit.rule.pairs(unit.module):
            pair = [f"{path}.{w}", f"{path}.{b}"]
            chosen = [q for q in pair if q in sel]
            names.update(dict.fromkeys(chosen, chosen[0]) if chosen else {})
    return names


# -- the sample axis of each hooked call -----------------------------------------------------
def _tracking_axis(real: tuple[int, ...], probe: tuple[int, ...], n: int, p: int) -> int | None:
    """The axis of a tensor that has length ``n`` in the real pass (N samples) and ``p`` in the
    probe (p != N samples), every other axis having the same length in both; else None."""
    if len(real) != len(probe):
        return None
    diff = [k for k, (r, q) in enumerate(zip(real, probe, strict=True)) if r != q]
    if len(diff) != 1 or real[diff[0]] != n or probe[diff[0]] != p:
        return None
    return diff[0]


def _sample_axes(model: nn.Module, x: torch.Tensor, units: dict[str, _Unit],
                 used: dict[str, list[int]], uses: ParamUses | None,
                 rec: dict[str, _RecUnit]) -> dict[str, list[int]]:
    r"""``{path: [sample axis of each call in used[path]]}`` (:func:`probe_sample_axes`) from
    a probe forward on the first sample repeated p != N times; ``{}`` when the probe fails.

    Exact because, with samples independent, slice n of the layer output along that axis
    influences only f(x_n): :math:`\partial f(x_n)/\partial W = \sum_s g[n, s] a[n, s]^\top`,
    both factors with the sample axis in front (coupled samples are refused by
    :func:`check_sample_coupling`; that slice n feeds only output n is not checked).
    ``uses``: a fresh ``ParamUses`` recording the probe's functional calls (``uses.done``
    when it ran to the end).
    """
    n = int(x.shape[0])
    p = probe_size(n)
    first = x.detach()[:1]
    xp = torch.cat([first] * p) if p > 1 else first.clone()
    real = {path: [(tuple(c.a.shape), tuple(c.y.shape)) for c in units[path].calls]
            for path in used}
    modules = {path: units[path].module for path in used}
    rseen: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]] | None]] = {k: [] for k in rec}

    def run() -> torch.Tensor:
        with uses if uses is not None else contextlib.nullcontext(), \
                _recurrent_shapes(rec, rseen):
            out = _check_output(model(xp))
        if uses is not None:
            uses.done = True
        return out

    try:
        axes = probe_sample_axes(run, modules, real, used, n, p)
        axes.update(_recurrent_axes(rec, rseen, n, p))
        return axes
    except ProbeFailed:
        # A model that cannot run on p samples: no axis is proven, every unit goes dense; the
        # dense path runs the model sample by sample and raises the model's own error if any.
        return {}


#: The probe's answers per model (weakly) and real pass (:func:`_remembered_probe`), so that
#: repeated calls on one model and batch shape run the probe forward once.
_AXES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], Any]] = \
    weakref.WeakKeyDictionary()
_AXES_PER_MODEL = 16


def _real_pass_key(x: torch.Tensor, units: dict[str, _Unit], used: dict[str, list[int]],
                   reachable: set[Any]) -> tuple[Any, ...]:
    """What the probe's answer depends on, as the real pass shows it: x's shape, dtype and
    device; each hooked module, its calls' shapes and which reach the output; the count of
    autograd nodes per type (a forward that routes the samples differently differs there)."""
    calls = tuple((path, id(units[path].module), tuple(idx),
                   tuple((tuple(c.a.shape), tuple(c.y.shape)) for c in units[path].calls))
                  for path, idx in used.items())
    ops: dict[str, int] = {}
    for node in reachable:
        name = type(node).__name__
        ops[name] = ops.get(name, 0) + 1
    return tuple(x.shape), x.dtype, x.device, calls, tuple(sorted(ops.items()))


def _remembered(model: nn.Module, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    """``compute()``, run once per model and ``key`` (:data:`_AXES`)."""
    try:
        memo = _AXES.setdefault(model, {})
    except TypeError:  # not weakly referenceable / hashable: probe every time
        return compute()
    hit = memo.get(key)
    if hit is None:
        if len(memo) >= _AXES_PER_MODEL:
            memo.clear()
        hit = memo[key] = compute()
    return hit


#: Models whose forward modified a recorded tensor in place (timm's ``BatchNormAct2d``: an
#: in-place activation after the norm): their next passes record copies from the start.
_IN_PLACE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _modifies_in_place(model: nn.Module, seen: bool = False) -> bool:
    """Whether a forward of ``model`` modified a recorded tensor in place before (``seen``:
    remember that it did now)."""
    try:
        if seen:
            _IN_PLACE.add(model)
        return model in _IN_PLACE
    except TypeError:  # not weakly referenceable: find out every time
        return False


@dataclass(frozen=True)
class _ProbeCall:
    """A functional call of the probe as ``torch_functional.sample_axes`` reads it: the shapes
    of its result and sample operands, kept as meta tensors (no data, no graph)."""

    y: torch.Tensor
    samples: list[torch.Tensor]


def _remembered_probe(model: nn.Module, x: torch.Tensor, units: dict[str, _Unit],
                      used: dict[str, list[int]], reachable: set[Any], uses: ParamUses | None,
                      cands: list[torch.Tensor], tabs: list[torch.Tensor],
                      rec: dict[str, _RecUnit]) -> tuple[dict[str, list[int]], list[Any]]:
    """``(axes, probe calls)``: :func:`_sample_axes` with the functional calls ``uses`` (over
    the parameters ``cands`` and tables ``tabs``; None: none) and recurrent modules ``rec``,
    and the probe's functional calls (:class:`_ProbeCall`; empty unless the probe ran to the
    end), once per model and real pass: :func:`_real_pass_key` plus the parameters followed
    and the shapes of the real pass's functional and recurrent calls."""
    key = (_real_pass_key(x, units, used, reachable), tuple(id(p) for p in cands),
           tuple(id(p) for p in tabs),
           () if uses is None else tuple((type(c), tuple(c.y.shape),
                                          tuple(tuple(s.shape) for s in c.samples))
                                         for c in uses.calls),
           tuple((path, tuple(u.shapes)) for path, u in rec.items()))

    def compute() -> tuple[dict[str, list[int]], list[_ProbeCall]]:
        probe = None if uses is None else ParamUses(cands, tables=tabs)
        axes = _sample_axes(model, x, units, used, probe, rec)
        return axes, [] if probe is None or not probe.done else [
            _ProbeCall(torch.empty(c.y.shape, device="meta"),
                       [torch.empty(s.shape, device="meta") for s in c.samples])
            for c in probe.calls]

    hit = _remembered(model, key, compute)
    return {path: list(ax) for path, ax in hit[0].items()}, hit[1]


def probe_size(n: int) -> int:
    return 2 if n == 1 else 1


class ProbeFailed(Exception):
    """The probe forward raised (the original exception is the ``__cause__``)."""


def _check_output(out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model must return a tensor (N, ...); got {type(out).__name__}")
    return out


def check_inputs(model: Any, **inputs: Any) -> None:
    """TypeError / ValueError unless ``model`` is an ``nn.Module`` and each input a tensor
    with a non-empty leading sample axis (messages name the argument)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    for name, x in inputs.items():
        if not isinstance(x, torch.Tensor):
            problem = input_problem(model, name, x)  # an array of another library
            if problem is not None:
                raise ModelInputError(problem[0])
            hint = (f"; convert it first: {name} = torch.as_tensor({name})"
                    if hasattr(x, "__array__") or hasattr(x, "__dlpack__") else "")
            raise TypeError(f"{name} must be a torch.Tensor of shape (N, ...); got "
                            f"{type(x).__name__}{hint}")
        if x.ndim < 1 or x.shape[0] < 1:
            raise ValueError(f"{name} must lead with a non-empty sample axis N; got shape "
                             f"{tuple(x.shape)}")


def probe_sample_axes(run: Any, modules: dict[str, nn.Module],
                       real: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]],
                       used: dict[str, list[int]], n: int, p: int) -> dict[str, list[int]]:
    """The sample axes of the ``used[path]`` calls of ``modules[path]`` (shared with ``SENG``).

    ``run()`` is a forward on p != n samples; ``real[path]`` the (input shape, output shape)
    of every tensor call of that module in the pass on n samples.  A call's sample axis is the
    one axis of its input *and* output with length n there and p in the probe, every other
    axis unchanged (:func:`_tracking_axis`), that the module's ``LayerRule.sample_axis_ok`` allows.
    Returns ``{path: [axis per used call]}`` where every used call has one and the probe called
    the module as often; raises :class:`ProbeFailed` from the model's error.  Autograd stays
    on in the probe so that it takes the training code path (PyTorch's fused inference paths,
    e.g. ``nn.TransformerEncoderLayer``'s, skip the submodule calls).
    """
    seen: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {k: [] for k in used}
    try:
        with _hooked({path: modules[path] for path in used},
                     lambda path, a, y: seen[path].append((tuple(a.shape), tuple(y.shape)))):
            run()
    except Exception as exc:
        raise ProbeFailed(str(exc)) from exc
    axes: dict[str, list[int]] = {}
    for path, idx in used.items():
        mod, calls, probes = modules[path], real[path], seen[path]
        rule = rule_for(mod)
        if len(calls) != len(probes):
            continue
        found: list[int] = []
        for i in idx:
            a_ax = _tracking_axis(calls[i][0], probes[i][0], n, p)
            y_ax = _tracking_axis(calls[i][1], probes[i][1], n, p)
            if (a_ax is None or a_ax != y_ax or rule is None
                    or not rule.sample_axis_ok(mod, a_ax, len(calls[i][0]))):
                break
            found.append(a_ax)
        else:
            axes[path] = found
    return axes


@dataclass
class _Target:
    """A tensor ``y`` whose output gradients the backward passes take: shaped by
    ``rule.output_factor`` (samples on ``axis`` of y, ``mod`` its module or None), and reduced
    pass by pass by ``reduce`` (``LayerRule.reducer``, ``torch_functional.term_sums``) when
    that is not None; ``functional``: a functional call's, stored (N, O, S, d)."""

    y: torch.Tensor
    axis: int = 0
    mod: nn.Module | None = None
    rule: LayerRule = PLAIN
    reduce: Reducer | None = None
    functional: bool = False

    def shape(self, gr: torch.Tensor, n: int, lead: int) -> torch.Tensor:
        return self.rule.output_factor(self.mod, gr, n, lead, self.axis)

    def done(self, g: torch.Tensor) -> Any:
        """All O outputs' g, reduced if it has a map."""
        return g if self.reduce is None else Summed(self.reduce(g))

    @property
    def storage(self) -> tuple[int, ...]:
        """The permutation of g (N, S, O, d) into the storage of all O passes: (N, O, C, S)
        channels-first, (N, O, S, d) functional, else (N, S, O, d)."""
        return (0, 2, 3, 1) if self.rule.channels_first else (0, 2, 1, 3) if self.functional \
            else (0, 1, 2, 3)

    def buffer(self, g1: torch.Tensor, n: int, o: int) -> torch.Tensor:
        """The array the O passes' g1 (one pass's factor or sums) are copied into, host
        memory recycled from an earlier call where free (``torch_recycle``)."""
        if self.reduce is not None:
            return recycled((n, o, g1.shape[-1]), g1.dtype, g1.device)
        perm, shape = self.storage, (n, g1.shape[1], o, g1.shape[-1])
        return recycled([shape[i] for i in perm], g1.dtype, g1.device).permute(*_inverse(perm))

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The O <= 2 passes' g1 concatenated in the storage of :meth:`buffer`."""
        if self.reduce is not None:  # (N, 1, W) each
            return torch.cat(parts, 1)
        perm = self.storage
        return torch.cat([g.permute(*perm) for g in parts],
                         perm.index(2)).permute(*_inverse(perm))


def _inverse(perm: tuple[int, ...]) -> list[int]:
    return [perm.index(i) for i in range(len(perm))]


def _output_grads(out2: torch.Tensor, targets: list[_Target], pseudo: bool,
                  create_graph: bool, batched: bool) -> list[Any]:
    """Gradients of every output column of ``out2`` (N, O) with respect to each target's y,
    as g (N, S, O, d_out) (:meth:`_Target.shape`; O = 1 for the pseudo-NTK), or, where the
    target reduces, a ``torch_layers.Summed`` (N, O, W) applied pass by pass (g never stored).

    All N samples go through each backward pass together (samples are independent, so the
    gradient of output o summed over samples, taken at y[n], is d f_o(x_n) / d y[n]).  The O
    passes are one ``is_grads_batched`` pass, or (``batched`` False, or an op without a
    batching rule) a loop: into preallocated arrays, or for O <= 2 concatenated at the end.
    """
    n, o = out2.shape
    ys = [t.y for t in targets]
    if pseudo or o == 1:
        cot = torch.full_like(out2, 1.0 / math.sqrt(o) if pseudo else 1.0)
        grads = torch.autograd.grad(out2, ys, cot, create_graph=create_graph,
                                    allow_unused=True, materialize_grads=True)
        return [t.done(t.shape(gr[None], n, 1)) for gr, t in zip(grads, targets, strict=True)]
    eye = torch.eye(o, dtype=out2.dtype, device=out2.device)
    cot = eye[:, None, :].expand(o, n, o)
    if batched:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                grads = torch.autograd.grad(out2, ys, cot, create_graph=create_graph,
                                            retain_graph=True, allow_unused=True,
                                            materialize_grads=True, is_grads_batched=True)
            return [t.done(t.shape(gr, n, o)) for gr, t in zip(grads, targets, strict=True)]
        except RuntimeError:  # an op without a batching rule: one backward per output
            pass
    gs: list[Any] = []
    kept: list[list[torch.Tensor]] = []  # o <= 2: each pass's g, concatenated at the end
    for k in range(o):
        grads = torch.autograd.grad(out2, ys, cot[k], create_graph=create_graph,
                                    retain_graph=create_graph or k < o - 1, allow_unused=True,
                                    materialize_grads=True)
        # from the second of many passes on, a reducer writes into its slot of the buffer
        slots = [None if k == 0 or o <= 2 or create_graph or not _writes_into(t.reduce)
                 else gs[i][:, k:k + 1] for i, t in enumerate(targets)]
        g1s = [t.shape(gr[None], n, 1) if t.reduce is None  # (N, S, 1, d) views
               else t.reduce(t.shape(gr[None], n, 1)) if slot is None  # (N, 1, W)
               else t.reduce(t.shape(gr[None], n, 1), out=slot)
               for gr, t, slot in zip(grads, targets, slots, strict=True)]
        del grads
        if o <= 2:  # one concatenation a block costs less than O copies into a buffer (BERT)
            kept.append(g1s)
            continue
        for i, (g1, t) in enumerate(zip(g1s, targets, strict=True)):
            if k == 0:  # many outputs: each pass copied into its slot while it is in cache
                gs.append(t.buffer(g1, n, o))
            if slots[i] is None:
                (gs[i][:, k:k + 1] if t.reduce is not None else gs[i][:, :, k:k + 1]).copy_(g1)
        del g1s, slots
    for i, t in enumerate(targets if kept else ()):
        gs.append(t.join([p[i] for p in kept]))
        for p in kept:
            p[i] = None  # each pass's gradient goes once its block is assembled
    return [g if t.reduce is None else Summed(g) for g, t in zip(gs, targets, strict=True)]


def _writes_into(reduce: Reducer | None) -> bool:
    """Whether a reducer takes the ``out`` slot (:data:`torch_layers.Reducer`; a rule's own
    ``lambda g: ...`` does not, and gets its result copied)."""
    code = getattr(reduce, "__code__", None)
    return code is not None and _takes_out(code)


@functools.lru_cache(maxsize=256)
def _takes_out(code: Any) -> bool:
    return "out" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]


def _front(a: torch.Tensor, ax: int, create_graph: bool) -> torch.Tensor:
    """A recorded call input with its sample axis ``ax`` in front, detached unless the
    Jacobian is to be differentiable."""
    a = a if ax == 0 else a.movedim(ax, 0)
    return a if create_graph else a.detach()


def _output_columns(outputs: tuple[int, int] | None, o: int) -> slice:
    """The flattened output columns ``outputs`` selects (all when None), checked against O."""
    if outputs is None:
        return slice(0, o)
    if outputs[1] > o:
        raise ValueError(f"outputs={outputs!r} is beyond the model's {o} outputs")
    return slice(*outputs)


def _dense_blocks(model: nn.Module, x: torch.Tensor, groups: list[tuple[str, list[str]]],
                  o: int, pseudo: bool, chunk_size: int | None,
                  create_graph: bool, cols: slice | None = None) -> dict[str, DenseBlock]:
    """DenseBlocks of ``groups`` (block name, parameter names): ``vmap`` over chunks of samples
    of ``jacrev`` w.r.t. those parameters, or plain autograd (:func:`_dense_blocks_graph`)
    with ``create_graph`` or where ``torch.func`` raises a RuntimeError (a recurrent layer
    not unrolled, ``nn.PReLU`` in torch 2.13, data-dependent control flow), which then
    raises the model's own error if any; out-of-memory errors are not retried."""
    from torch.func import functional_call, jacrev, vmap

    cols = slice(0, o) if cols is None else cols
    if create_graph:
        return _dense_blocks_graph(model, x, groups, o, pseudo, cols=cols)
    named = dict(model.named_parameters())
    names = [n for _, ns in groups for n in ns]
    pdict = {k: named[k].detach() for k in names}
    scale = 1.0 / math.sqrt(o)
    whole = cols == slice(0, o)  # no slicing op in the graph for all outputs

    def f(pd: dict[str, torch.Tensor], xn: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, pd, (xn.unsqueeze(0),), strict=False).reshape(-1)
        return (out.sum() * scale).reshape(1) if pseudo else out if whole else out[cols]

    jf = vmap(jacrev(f), in_dims=(None, 0))
    n = x.shape[0]
    p_total = sum(named[k].numel() for k in names)
    if chunk_size is None:  # keep each chunk's Jacobian around 64 MB
        width = 1 if pseudo else len(range(o)[cols])
        chunk_size = max(1, min(n, (2**26) // max(1, width * p_total * x.element_size())))
    pieces: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    try:
        with torch.no_grad(), _quiet_sdpa_batching():
            for start in range(0, n, chunk_size):
                res = jf(pdict, x[start:start + chunk_size])
                for k in names:
                    pieces[k].append(res[k].reshape(res[k].shape[0], res[k].shape[1], -1))
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError:  # no batching rule, or data-dependent control flow
        return _dense_blocks_graph(model, x, groups, o, pseudo, create_graph=False, cols=cols)
    return _grouped(groups, {k: cat(v, 0) for k, v in pieces.items()})


# torch's vmap fallback warns for every scaled_dot_product_attention (forward and backward) in
# the torch.func pass: a performance note about torch itself, hundreds per call on ViT / BERT.
_SDPA_BATCHING = (r"There is a performance drop because we have not yet implemented the "
                  r"batching rule for aten::_scaled_dot_product")
_QUIET_LOCK = threading.Lock()
_QUIET: list[Any] = []  # [the filter entry] while a torch.func pass runs, in any thread


@contextlib.contextmanager
def _quiet_sdpa_batching() -> Iterator[None]:
    """Ignore torch's SDPA batching-rule warning (:data:`_SDPA_BATCHING` only, in every
    thread) while ntkcore's ``torch.func`` passes run.  Thread-safe, unlike
    ``warnings.catch_warnings``: the first pass to start puts one ``ignore`` entry at the
    front of ``warnings.filters`` (winning over "always" / "error"), the last one to end
    removes that entry alone."""
    with _QUIET_LOCK:
        if not _QUIET:
            had = list(warnings.filters)
            warnings.filterwarnings("ignore", message=_SDPA_BATCHING, category=UserWarning)
            # the user's own identical entry (moved to the front) is kept after the pass
            _QUIET.append(None if warnings.filters[0] in had else warnings.filters[0])
        _QUIET.append(None)
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _QUIET.pop()
            if len(_QUIET) == 1 and _QUIET[0] is None:
                _QUIET.pop()
            elif len(_QUIET) == 1:
                with contextlib.suppress(ValueError):  # removed meanwhile by someone else
                    warnings.filters.remove(_QUIET.pop())
                getattr(warnings, "_filters_mutated", lambda: None)()


def _grouped(groups: list[tuple[str, list[str]]],
             cols: dict[str, torch.Tensor]) -> dict[str, DenseBlock]:
    """One DenseBlock per group from per-parameter Jacobians (N, O, P_k), concatenated."""
    return {b: DenseBlock(cat([cols[k] for k in ns], 2), b) for b, ns in groups}


def _dense_blocks_graph(model: nn.Module, x: torch.Tensor, groups: list[tuple[str, list[str]]],
                        o: int, pseudo: bool, create_graph: bool = True,
                        cols: slice | None = None) -> dict[str, DenseBlock]:
    """DenseBlocks by plain autograd, one backward per sample and output (differentiable in
    ``x`` when ``create_graph``: ``vmap`` under an outer graph gives wrong gradients with
    respect to ``x`` for some ops, LayerNorm in torch 2.13; meant for small support sets)."""
    named = dict(model.named_parameters())
    names = [n for _, ns in groups for n in ns]
    ps = [named[k] for k in names]
    scale = 1.0 / math.sqrt(o)
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    with torch.enable_grad():
        for i in range(x.shape[0]):
            out = model(x[i:i + 1]).reshape(-1)
            if pseudo:
                out = (out.sum() * scale).reshape(1)
            elif cols is not None:
                out = out[cols]
            last = out.shape[0] - 1
            if out.requires_grad:
                per_o = [torch.autograd.grad(out[k], ps, create_graph=create_graph,
                                             retain_graph=create_graph or k < last,
                                             allow_unused=True, materialize_grads=True)
                         for k in range(out.shape[0])]
            else:  # no parameter reaches the output: a zero Jacobian
                per_o = [tuple(torch.zeros_like(q) for q in ps)] * out.shape[0]
            for j, k in enumerate(names):
                rows[k].append(torch.stack([g[j].reshape(-1) for g in per_o]))
    return _grouped(groups, {k: torch.stack(v) for k, v in rows.items()})


# -- the provider ----------------------------------------------------------------------------
@capabilities(name="backends.torch.jacobian", fast={
    "torch": "Kronecker for Linear/Conv1-3d/Embedding/RNN/GRU/LSTM/F.linear, hooks for norm "
             "layers and elementwise parameters, torch.func for the rest"},
    note={"torch": "CPU and CUDA; differentiable in x when x.requires_grad"},
    missing=("numpy", "cupy", "jax", "array_api_strict"))
def jacobian(
    model: nn.Module,
    x: torch.Tensor,
    *,
    params: Iterable[str | torch.Tensor] | None = None,
    pseudo: bool = False,
    chunk_size: int | None = None,
    create_graph: bool | None = None,
    backward: str = "auto",
    outputs: tuple[int, int] | None = None,
    dense_if_smaller: bool = False,
    measure_work: bool = False,
) -> Jacobian:
    r"""The per-sample Jacobian of a torch model, with Kronecker structure where it exists.

    Parameters
    ----------
    model : torch.nn.Module
        Maps ``x`` (N, ...) to outputs (N, ...); the trailing output axes are flattened to
        O = prod(shape[1:]) (an output (N,) is O = 1).  Samples must be independent: BatchNorm
        using batch statistics (training mode) or Dropout in training mode raise ValueError.
    x : torch.Tensor, shape (N, ...)
        Inputs, on the model's device.  If ``x.requires_grad`` the result is differentiable
        with respect to ``x``.
    params : iterable of str or torch.Tensor, optional
        The parameters to differentiate (names as in ``model.named_parameters()`` or the
        tensors themselves).  Default: every parameter with ``requires_grad``.
    pseudo : bool
        Return the Jacobian of :math:`\sum_o f_o / \sqrt{O}` (O = 1), the pseudo-NTK
        Jacobian, from a single backward pass.
    chunk_size : int, optional
        Samples per ``torch.func`` call for the DenseBlocks (default: about 64 MB of Jacobian
        per chunk).
    create_graph : bool, optional
        Keep the autograd graph to ``x`` (default: ``x.requires_grad``).
    backward : {"auto", "batched", "loop"}
        How the O output-gradient passes run: one ``is_grads_batched`` pass or a loop of O
        passes over all samples ("auto": the loop when the model has convolutions, whose
        vmapped backward is slow, or O <= 2; batched otherwise).  Same flops either way.
    outputs : (int, int), optional
        ``(start, stop)``: the Jacobian of the outputs ``start:stop`` of the flattened O only
        (O' = stop - start outputs, O' backward passes; the factors' output-gradient part
        shrinks by O' / O).  How :func:`ntkcore.ntk` computes a trace or diagonal kernel in
        output chunks when the factors of all O outputs do not fit its budget.  Not with
        ``pseudo``.
    dense_if_smaller : bool
        Give a linear layer or an ungrouped convolution whose per-sample gradient (N, O, P_b)
        is no larger than its Kronecker factors (``ntkcore.jacobian.dense_is_smaller``: shapes
        only, e.g. a stem convolution over many positions) as that DenseBlock, in the
        DenseBlock layout ``[weight.flatten(), bias]``, reduced from each backward pass's
        output gradients while they are in cache (g (N, S, O, d_out) is never stored).  Its
        Gram then costs no more than the factors' cheapest route; :func:`ntkcore.ntk` asks
        for this (provider capability ``"dense_if_smaller"``).  Default False: every such
        layer a KroneckerBlock, as ``SENG`` and the block-structure tests expect.
    measure_work : bool
        Set :attr:`ntkcore.Jacobian.work_nbytes`: the bytes of the tensors the forward saved
        for backward (the model's parameters, buffers and ``x`` aside) and of the output
        gradients alive at once (one pass's, or all O batched).  A hook on every saved
        tensor: ``ntk`` asks for it in its one-sample probe only (capability
        ``"work_nbytes"``).  Default: 0.

    Returns
    -------
    Jacobian
        N samples, O outputs, blocks independent of N: per module with a layer rule
        (``torch_layers.RULES``) whose calls all have a sample axis, the rule's block (a
        KroneckerBlock a (N, S, d_in), g (N, S, O, d_out), or a DenseBlock); the blocks of
        unrolled recurrent layers and of functional parameter uses (``torch_functional``);
        a DenseBlock (N, O, P_b) for everything else.

    Notes
    -----
    Block order and parameter layout.  With ``names`` the selected parameters in
    ``model.named_parameters()`` order, the blocks cover each exactly once, in the order of
    their first parameter:

    * a module with a rule, at path ``m``: ``m.weight`` and ``m.bias`` (those selected), as
      the matrix ``[weight.reshape(d_out, -1), bias[:, None]]`` flattened row-major (the
      bias *interleaved* as the last column; weight only: no column; bias only: d_in = 1);
      an Embedding's ``m.weight.T``; a norm's DenseBlock ``[weight, bias]``;
    * a recurrent module at ``m``: one block per (weight, bias) pair, named after its first
      selected parameter (``m.weight_ih_l0``), laid out as a Linear's;
    * a DenseBlock named ``m``: the selected parameters registered directly on module ``m``,
      each flattened, in ``named_parameters`` order; a root parameter alone, named by it.

    A module called several times (tied weights) gets one block, its calls concatenated
    along the positions; a module whose weight is also used outside its own calls, or is
    registered in several modules, or one of whose calls has no sample axis, gets a
    DenseBlock.  :func:`to_block_order` and :func:`from_block_order` convert between
    per-parameter tensors and this order.  Where ``torch.func`` cannot run the model, the
    DenseBlocks come from plain autograd, one sample and output at a time.  Concurrent calls
    on one model are safe (:func:`model_lock`); so are calls under ``torch.no_grad()`` or
    ``torch.inference_mode()`` (the passes run outside them; inputs made in inference mode
    are copied into ordinary tensors first).
    """
    check_inputs(model, x=x)
    check_outputs(outputs, pseudo)
    if backward not in ("auto", "batched", "loop"):
        raise ValueError(f"backward must be 'auto', 'batched' or 'loop'; got {backward!r}")
    for flag, value in (("dense_if_smaller", dense_if_smaller), ("measure_work", measure_work)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be True or False; got {value!r}")
    if chunk_size is not None and (int(chunk_size) != chunk_size or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    with provider_pass(model), torch.inference_mode(False):
        # a caller's inference mode would make every activation an inference tensor, which
        # autograd cannot use; inputs made in it are copied into ordinary tensors
        x = x.clone() if x.is_inference() else x
        walk = _walk(model)  # under the lock: no other ntkcore pass changes the model now
        check_sample_coupling(model, modules=walk.modules)
        jac = _jacobian_locked(model, x, params, pseudo, chunk_size, create_graph, backward,
                               walk, outputs=outputs, dense=dense_if_smaller,
                               measure=measure_work)
        if not isinstance(jac, Jacobian):  # positional tables found: once more, with them
            jac = _jacobian_locked(model, x, params, pseudo, chunk_size, create_graph,
                                   backward, walk, tables=jac, outputs=outputs,
                                   dense=dense_if_smaller, measure=measure_work)
        return jac


#: Per model (weakly), the paths of its positional tables (:func:`_shared_tables`): (those the
#: functional mode follows from the first pass on, all found so far).
_TABLES: weakref.WeakKeyDictionary[nn.Module, tuple[frozenset[str], frozenset[str]]] = \
    weakref.WeakKeyDictionary()


def _remembered_tables(model: nn.Module) -> tuple[frozenset[str], frozenset[str]]:
    try:
        return _TABLES.get(model, (frozenset(), frozenset()))
    except TypeError:  # not weakly referenceable: nothing remembered
        return frozenset(), frozenset()


def _remember_tables(model: nn.Module, follow: frozenset[str], seen: frozenset[str]) -> None:
    with contextlib.suppress(TypeError):
        _TABLES[model] = (follow, seen)


def _shared_tables(model: nn.Module, units: dict[str, _Unit], used: dict[str, list[int]],
                   axes: dict[str, list[int]]) -> frozenset[str] | None:
    """The tables to follow, when the ``nn.Embedding`` units whose used calls have no sample
    axis (e.g. ``pos(torch.arange(T))``) include one not seen before on ``model``; else None.

    Such a lookup :math:`P[i]` is the same for all samples, but where the functional mode
    sees it added to (or multiplying) a sample operand, ``torch_functional`` builds its
    block from that call's output gradients: the forward runs once more with the tables
    followed.  A table found used otherwise is followed no more (:func:`_probe`)."""
    follow, seen = _remembered_tables(model)
    new = {p for p in used if p not in axes and isinstance(units[p].module, nn.Embedding)}
    if new <= seen:
        return None
    _remember_tables(model, follow | new, seen | new)
    return follow | new


@dataclass
class _Found:
    """What may be structured, before the forward: the hooked modules ``units``, the
    recurrent modules ``rec``, and the functional calls' recorder ``uses`` (a ``ParamUses``
    over the parameters ``cands`` no module structures and the positional tables ``tabs`` of
    the followed ``tables``; None when there are none)."""

    units: dict[str, _Unit]
    rec: dict[str, _RecUnit]
    cands: list[torch.Tensor]
    tables: frozenset[str]
    tabs: list[torch.Tensor]
    uses: ParamUses | None = None

    def recorder(self, clone: bool) -> ParamUses | None:
        """A fresh ``uses`` (recording copies with ``clone``)."""
        self.uses = (ParamUses(self.cands, clone=clone, tables=self.tabs)
                     if self.cands or self.tabs else None)
        return self.uses


@dataclass
class _Plan:
    """What the probe proved structured: per module path its used calls with their sample
    axes (``kron``), the unrolled recurrent modules (``rkron``), the functional calls with
    theirs (``fcalls``) and the block groups they structure (``fgroups``)."""

    kron: dict[str, list[tuple[_Call, int]]] = field(default_factory=dict)
    rkron: dict[str, _RecUnit] = field(default_factory=dict)
    fcalls: list[tuple[Any, int]] = field(default_factory=list)
    fgroups: dict[str, list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class _Gradients:
    """The output gradients of a :class:`_Plan`, by owner: per module path one per call
    (``modules``), per recurrent path one :math:`g_{ih}` per pass (``recurrent``), one per
    functional call (``functional``)."""

    modules: dict[str, list[Any]]
    recurrent: dict[str, list[torch.Tensor]]
    functional: list[Any]
    pass_nbytes: int = 0  # the output gradients alive at once (one pass, or all O batched)


def _find_units(model: nn.Module, walk: _Walk, selected: list[str],
                tables: frozenset[str]) -> _Found:
    """Step 1: the structured candidates among the ``selected`` parameters' owners."""
    named, owners, registrations = walk.named, walk.owners, walk.registrations
    units = _structured_units(walk, selected)
    rec = _recurrent_units(walk, selected)
    # parameters no structured module owns: their functional calls (torch_functional)
    cands = [named[nm] for nm in selected
             if owners[nm][0] not in units and owners[nm][0] not in rec
             and registrations[id(named[nm])] == 1]
    tabs = [named[nm] for p in tables if p in units for nm in units[p].names]
    return _Found(units, rec, cands, tables, tabs)


@contextlib.contextmanager
def _saved_bytes(model: nn.Module, x: torch.Tensor, measure: bool) -> Iterator[list[int]]:
    """Counts, into the one-element list it yields, the bytes of the distinct storages that
    the forward saves for backward, the model's parameters and buffers and ``x`` aside (they
    exist anyway): the forward's working memory while the backward passes run.  Nothing
    (0) unless ``measure``: the hook costs about 0.1 ms a call on a small MLP."""
    if not measure:
        yield [0]
        return
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    total = [0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
    # after the forward: a lazy module's parameters have storage only from its first call
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), x)
           if t.layout == torch.strided
           and not isinstance(t, nn.parameter.UninitializedTensorMixin)}
    total[0] = sum(v for k, v in seen.items() if k not in own)


def _record_forward(model: nn.Module, x: torch.Tensor, found: _Found,
                    measure: bool = False) -> tuple[torch.Tensor, int]:
    """Step 2: the hooked forward, recording the calls of ``found``; again with copies when
    the model modified a recorded tensor in place (and from the start once it did).  Also
    the bytes it saved for backward (:func:`_saved_bytes`; 0 unless ``measure``)."""
    cloned = _modifies_in_place(model)
    with _saved_bytes(model, x, measure) as saved:
        out = _run_forward(model, x, found.units, clone=cloned, uses=found.recorder(cloned),
                           rec=found.rec)
    uses = found.uses
    if not cloned and (any(c.a._version != c.a_version or c.y._version != c.y_version
                           for u in found.units.values() for c in u.calls)
                       or (uses is not None and any(c.modified() for c in uses.calls))):
        _modifies_in_place(model, True)
        with _saved_bytes(model, x, measure) as saved:
            out = _run_forward(model, x, found.units, clone=True, uses=found.recorder(True),
                               rec=found.rec)
    n = int(x.shape[0])
    if out.ndim < 1 or out.shape[0] != n:
        raise ValueError(f"the model output must lead with the sample axis N={n}; got shape "
                         f"{tuple(out.shape)}: the first axis of x (shape {tuple(x.shape)}) "
                         "is the sample axis; for a single sample add it: x.unsqueeze(0) "
                         "(or x[None])")
    return out, saved[0]


def _probe(model: nn.Module, x: torch.Tensor, walk: _Walk, selected: list[str],
           found: _Found, out: torch.Tensor, first: bool) -> _Plan | frozenset[str]:
    """Step 3: which candidates really are structured: every use of the weight is a
    recorded call, and every such call has a sample axis in its input and output, found by
    a probe at another batch size (:func:`_sample_axes`).  On the ``first`` pass it may
    return the positional tables to follow instead (:func:`_shared_tables`)."""
    units, rec, uses, tables = found.units, found.rec, found.uses, found.tables
    named, owners = walk.named, walk.owners
    plan = _Plan()
    if not (units or rec or uses is not None) or out.grad_fn is None:
        return plan
    reachable, n_uses = graph_uses(out)
    used: dict[str, list[int]] = {}  # indices of the calls that reach the output
    for path, unit in units.items():
        idx = [i for i, c in enumerate(unit.calls)
               if c.y.grad_fn is not None and c.y.grad_fn in reachable]
        if not idx:
            continue  # falls back to dense (torch.func finds the true, possibly zero, use)
        if any(n_uses.get(id(named[nm]), 0) != len(idx) for nm in unit.names):
            continue
        used[path] = idx
    rused = {p: rec[p] for p in _recurrent_used(rec, reachable, n_uses, named)}
    axes, probe_calls = ({}, []) if uses is None and not rused and not used else \
        _remembered_probe(model, x, units, used, reachable, uses, found.cands, found.tabs, rused)
    plan.kron = {path: [(units[path].calls[i], ax) for i, ax in zip(idx, axes[path],
                                                                   strict=True)]
                 for path, idx in used.items() if path in axes}
    plan.rkron = {p: u for p, u in rused.items() if p in axes}
    if first and (more := _shared_tables(model, units, used, axes)) is not None:
        return more
    if uses is not None:
        uses.bad.update(id(named[nm]) for p in tables if p in plan.kron
                        for nm in units[p].names)
        plan.fcalls, plan.fgroups = _functional_plan(uses, probe_calls, reachable, n_uses,
                                                     selected, owners, named, int(x.shape[0]))
        failed = (tables & used.keys()) - plan.kron.keys() - plan.fgroups.keys()
        if failed:  # used otherwise: follow them no more
            follow, seen = _remembered_tables(model)
            _remember_tables(model, follow - failed, seen)
    return plan


def _gradients(model: nn.Module, out2: torch.Tensor, plan: _Plan, units: dict[str, _Unit],
               pseudo: bool, create_graph: bool, backward: str, dense: bool,
               measure: bool = False) -> _Gradients:
    """Step 4: the output gradients of every structured call (:func:`_output_grads`): the
    module calls', the recurrent gate pre-activations' (:math:`u = W_{ih} x + b_{ih}` of
    every layer, direction and call) and the functional calls'.  ``dense``: a module whose
    per-sample gradient is no larger than its factors (``ntkcore.jacobian.dense_is_smaller``)
    has each pass's g reduced to it (:meth:`LayerRule.gradient_sums`).  ``measure``: also
    the bytes of the output gradients alive at once (``pass_nbytes``; else 0)."""
    n, o = out2.shape
    if backward == "auto":  # vmap's per-op batching costs more than a second pass at O = 2
        slow = tuple(t for r in RULES.values() for t in r.unbatched)
        batched = o > 2 and not any(isinstance(mod, slow) for mod in model.modules())
    else:
        batched = backward == "batched"
    targets = []
    for p, calls in plan.kron.items():
        u = units[p]
        widths = u.rule.factor_widths(u.module, u.has_weight, u.has_bias) if dense else None
        o_g = 1 if pseudo else o
        reducers: list[Any] = [None]
        if widths is not None and dense_is_smaller(
                *widths, sum(c.y.numel() // (n * widths[1]) for c, _ in calls), o_g):
            reducers = [u.rule.gradient_sums(u.module, _front(c.a, ax, create_graph), n, o_g,
                                             u.has_weight, u.has_bias) for c, ax in calls]
        if widths is None or None in reducers:  # the rule declined: g kept (or its reducer)
            reducers = [u.rule.reducer(u.module, _front(c.a, ax, create_graph), n,
                                       u.has_weight, u.has_bias) for c, ax in calls]
        targets += [_Target(c.y, ax, u.module, u.rule, r)
                    for (c, ax), r in zip(calls, reducers, strict=True)]
    targets += [_Target(r.u, 0, ru.module) for ru in plan.rkron.values()
                for passes in ru.calls for r in passes]
    targets += [_Target(c.y, ax, reduce=term_sums(c, ax, create_graph), functional=True)
                for c, ax in plan.fcalls]
    gs = iter(_output_grads(out2, targets, pseudo, create_graph, batched))
    alive = 1 if pseudo or not batched else o  # one pass's gradients alive, or all O
    return _Gradients(
        {p: [next(gs) for _ in calls] for p, calls in plan.kron.items()},
        {p: [next(gs) for passes in ru.calls for _ in passes] for p, ru in plan.rkron.items()},
        list(gs),
        alive * sum(t.y.numel() * t.y.element_size() for t in targets) if measure else 0)


def _assemble(plan: _Plan, units: dict[str, _Unit], grads: _Gradients,
              owners: dict[str, tuple[str, str]], n: int,
              create_graph: bool) -> dict[str, DenseBlock | KroneckerBlock]:
    """Step 5: the structured blocks from the calls' inputs (sample axis in front, as the
    gradients are) and their gradients, by the modules' rules."""
    blocks: dict[str, DenseBlock | KroneckerBlock] = {}
    if plan.fcalls:
        blocks.update(functional_blocks(plan.fgroups, plan.fcalls, grads.functional, n,
                                        create_graph))
    for p, calls in plan.kron.items():
        u = units[p]
        blocks[p] = u.rule.block(u.module, [_front(c.a, ax, create_graph) for c, ax in calls],
                                 grads.modules[p], n, p, u.has_weight, u.has_bias)
    for p, ru in plan.rkron.items():
        blocks.update(ru.rule.blocks(ru.module, p, ru.calls, grads.recurrent[p],
                                       [owners[nm][1] for nm in ru.names], n,
                                       detach=not create_graph))
    return blocks


def _block_order(selected: list[str], owners: dict[str, tuple[str, str]],
                 plan: _Plan) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
    """The block names in parameter order (a structured module, a recurrent pair, or the
    parameters registered directly on one module; a root parameter alone), the dense groups
    (block name -> parameter names) and the recurrent blocks' names by parameter."""
    order: dict[str, None] = {}
    dense: dict[str, list[str]] = {}
    rnames = _recurrent_block_names(plan.rkron)  # parameter name -> its recurrent block
    for nm in selected:
        mpath = owners[nm][0]
        bname = rnames.get(nm) or (mpath if mpath in plan.kron or mpath else nm)
        order[bname] = None
        if mpath not in plan.kron and nm not in rnames and bname not in plan.fgroups:
            dense.setdefault(bname, []).append(nm)
    return list(order), dense, rnames


def _jacobian_locked(model: nn.Module, x: torch.Tensor, params: Any, pseudo: bool,
                     chunk_size: int | None, create_graph: bool | None,
                     backward: str, walk: _Walk, tables: frozenset[str] | None = None,
                     outputs: tuple[int, int] | None = None, dense: bool = False,
                     measure: bool = False) -> Jacobian | frozenset[str]:
    """:func:`jacobian` under the model's lock (``walk`` taken under it): find units, record,
    probe, gradients, assemble, then the dense blocks.  With ``tables`` None (the first pass)
    it may return the positional tables (:func:`_shared_tables`) to run it again with."""
    selected = select_params(model, params, walk.named)
    if create_graph is None:
        create_graph = bool(x.requires_grad)
    first = tables is None
    found = _find_units(model, walk, selected,
                        _remembered_tables(model)[0] if tables is None else tables)
    out, saved = _record_forward(model, x, found, measure)
    work = saved
    n, o = int(x.shape[0]), int(math.prod(out.shape[1:]))
    cols = _output_columns(outputs, o)
    plan = _probe(model, x, walk, selected, found, out, first)
    if isinstance(plan, frozenset):
        return plan
    order, dense_groups, rnames = _block_order(selected, walk.owners, plan)
    blocks: dict[str, DenseBlock | KroneckerBlock] = {}
    if plan.kron or plan.rkron or plan.fcalls:
        out2 = out.reshape(n, o) if outputs is None else out.reshape(n, o)[:, cols]
        grads = _gradients(model, out2, plan, found.units, pseudo, create_graph, backward,
                           dense, measure)
        del out2
        blocks = _assemble(plan, found.units, grads, walk.owners, n, create_graph)
        work += grads.pass_nbytes
        del grads
    del out, found, plan  # the recorded calls go before the dense pass
    if dense_groups:
        blocks.update(_dense_blocks(model, x, list(dense_groups.items()), o, pseudo, chunk_size,
                                    create_graph, cols))
    if not create_graph:  # exact: positions with g == 0 add nothing (see drop_zero_positions);
        # a recurrent block's positions are its time steps, kept whole; one host sync for all
        recurrent = set(rnames.values())
        names = [k for k in blocks if k not in recurrent]
        blocks.update(zip(names, drop_zero_positions_all([blocks[k] for k in names]),
                          strict=True))
    return Jacobian([blocks[name] for name in order], work_nbytes=work)


def _functional_plan(uses: ParamUses, probe: list[Any], reachable: set[Any],
                     n_uses: dict[int, int], selected: list[str],
                     owners: dict[str, tuple[str, str]], named: dict[str, torch.Tensor],
                     n: int) -> tuple[list, dict[str, list[torch.Tensor]]]:
    """The functional calls (with sample axes) and the block groups they structure
    (``torch_functional``): the candidate parameters with no unrecognised use, as many graph
    edges as recorded direct uses, and calls whose results reach the output."""
    bad = set(uses.bad)
    for pid, ys in uses.direct.items():
        if n_uses.get(pid, 0) != sum(y.grad_fn in reachable for y in ys):
            bad.add(pid)  # a use the mode did not see (or counted differently)
    for c in uses.calls:
        if c.modified():  # changed in place even in the cloned pass
            bad.update(id(t.param) for t in c.terms)
    bad |= _unseen_lookup_uses(uses, reachable)
    calls = uses.calls
    axes = functional_sample_axes(calls, probe, _tracking_axis, n, probe_size(n))
    live = [(c, ax) for c, ax in zip(calls, axes, strict=True) if c.y.grad_fn in reachable]
    found = {id(t.param) for c in calls for t in c.terms} - bad
    groups: dict[str, list[torch.Tensor]] = {}
    for nm in selected:  # block name -> its parameters, as in _jacobian_locked's order
        groups.setdefault(owners[nm][0] or nm, []).append(named[nm])
    root = {nm for nm in selected if not owners[nm][0]}
    # a group is structured only if all of its selected parameters are
    groups = {b: ps for b, ps in groups.items() if all(id(p) in found for p in ps)}
    ok = structured_groups(groups, [c for c, _ in live], [ax for _, ax in live], root)
    ids = {id(p) for ps in ok.values() for p in ps}
    return [(c, ax) for c, ax in live if any(id(t.param) in ids for t in c.terms)], ok


def _unseen_lookup_uses(uses: ParamUses, reachable: set[Any]) -> set[int]:
    """The tables (ids) with a lookup result y used in a way the mode did not see: the graph
    has more edges from reachable nodes into y's node than recognised calls on y that reach
    the output (the check of the direct uses of a parameter, for ``F.embedding`` results)."""
    nodes = {tab.y.grad_fn: tab for tab in uses.gathers.values() if tab.y.grad_fn in reachable}
    if not nodes:
        return set()
    edges = dict.fromkeys(nodes, 0)
    for node in reachable:
        for nxt, _ in node.next_functions:
            if nxt in edges:
                edges[nxt] += 1
    for c in uses.calls:
        if c.y.grad_fn in reachable:
            for t in c.terms:
                if t.operand is not None and t.operand.grad_fn in edges:
                    edges[t.operand.grad_fn] -= 1
    return {id(nodes[node].param) for node, k in edges.items() if k}


# -- layout helpers --------------------------------------------------------------------------
def _block_layout(model: nn.Module, jac: Jacobian,
                  params: Any) -> list[tuple[Any, list[str], int, bool]]:
    """Per block: (block, parameter names, rows, transposed).  The block's parameter vector
    is a (rows, P_b / rows) matrix, row-major: each parameter ``t`` fills the next
    ``t.numel() / rows`` columns as ``t.reshape(rows, -1)`` (rows = 1 for a DenseBlock, d_out
    for a KroneckerBlock), or is the whole matrix transposed (``transposed``: an Embedding)."""
    selected = select_params(model, params)
    walk = _walk(model)
    owners = walk.owners
    recurrent = _recurrent_block_names(_recurrent_units(walk, selected))
    out = []
    covered: list[str] = []
    for b in jac.blocks:
        rnames = [nm for nm in selected if recurrent.get(nm) == b.name]
        if rnames:
            names = rnames
        elif b.name in selected and owners[b.name][0] == "":
            names = [b.name]
        else:
            names = [nm for nm in selected if owners[nm][0] == b.name]
        if not names:
            raise ValueError(f"block {b.name!r} matches no selected parameter of the model")
        kron = isinstance(b, KroneckerBlock)
        rule = rule_for(model.get_submodule(b.name), False) if kron and not rnames else None
        out.append((b, names, b.d_out if kron else 1, rule is not None and rule.transposed))
        covered += names
    if sorted(covered) != sorted(selected):
        raise ValueError("the Jacobian's blocks do not match the selected parameters")
    return out


def block_params(model: nn.Module, jac: Jacobian, params: Any = None) -> list[list[str]]:
    """Per block of ``jac`` (a Jacobian of ``model`` by :func:`jacobian` with the same
    ``params``), in block order: the names of its parameters.  :func:`jacobian` called with
    ``params=`` the names of consecutive blocks gives exactly those blocks (the provider's
    ``"block_params"`` capability: :func:`ntkcore.ntk` computes a kernel whose factors do not
    fit its budget as a sum over groups of blocks)."""
    return [names for _, names, _, _ in _block_layout(model, jac, params)]


def to_block_order(model: nn.Module, jac: Jacobian, per_param: dict[str, torch.Tensor],
                   params: Any = None) -> torch.Tensor:
    """Assemble per-parameter tensors into the Jacobian's flat block order.

    Parameters
    ----------
    model, jac, params
        The model, a Jacobian returned by :func:`jacobian` for it and the same ``params``.
    per_param : dict of str -> tensor (..., *param.shape)
        E.g. ``torch.func.jacrev`` output (N, O, *shape) or a parameter update (*shape); the
        leading axes must agree.

    Returns
    -------
    tensor (..., P)
        In block order, with the layouts of :func:`jacobian` (bias interleaved as the last
        column of a Kronecker block's matrix, Embedding tables transposed).
    """
    named = dict(model.named_parameters())
    cols = []
    for _b, names, rows, transposed in _block_layout(model, jac, params):
        mats = []
        for nm in names:
            t = per_param[nm]
            lead = t.shape[:t.ndim - named[nm].ndim]
            mats.append(t.transpose(-1, -2) if transposed else t.reshape(*lead, rows, -1))
        mat = cat(mats, -1)
        cols.append(mat.reshape(*mat.shape[:-2], -1))
    return torch.cat(cols, dim=-1)


def from_block_order(model: nn.Module, jac: Jacobian, v: torch.Tensor,
                     params: Any = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_block_order`: ``v`` (..., P) -> ``{name: (..., *shape)}``.

    Use it to turn a flat vector in block order (e.g. ``jac.vjp(c)`` or a natural-gradient
    step) into parameter-shaped tensors.
    """
    if v.shape[-1] != jac.num_params:
        raise ValueError(f"v must have a last axis of size P={jac.num_params}; got shape "
                         f"{tuple(v.shape)}")
    named = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    lead = v.shape[:-1]
    start = 0
    for b, names, rows, transposed in _block_layout(model, jac, params):
        mat = v[..., start:start + b.num_params].reshape(*lead, rows, -1)
        start += b.num_params
        col = 0
        for nm in names:
            w = named[nm]
            width = w.numel() // rows
            part = mat[..., col:col + width]
            out[nm] = (part.transpose(-1, -2) if transposed else part).reshape(*lead, *w.shape)
            col += width
    return out
