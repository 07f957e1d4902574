r"""High-level entry points: the empirical NTK of a model, ``ntk()`` and ``pseudo_ntk()``.

.. math::

    \Theta(x, x')[o, p] = \sum_b J_b(x)[o, :]\, J_b(x')[p, :]^\top ,
    \qquad J_b(x) = \partial f(\theta, x) / \partial \theta_b .

The model is turned into a structured :class:`~ntkcore.Jacobian` by the provider registered for
its type (:mod:`ntkcore.providers`: ``torch.nn.Module``, JAX ``(apply_fn, params)``,
:class:`ntkcore.models.MLP`, ...), and the kernel is contracted by :func:`ntkcore.gram`.

Pure array API: nothing here imports a framework.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import array_api_compat

from ._memory import (
    CALL_OVERHEAD,
    PROBE_SAMPLES,
    Budget,
    batch_samples,
    itemsize,
    resolve_budget,
)
from ._typing import Array
from ._validation import FiniteFlags, first_nonfinite, namespace_of
from ._validation import check_finite as _check_finite_array
from .errors import BudgetTooSmallError
from .gram import block_shapes, cheapest_flops, gram, min_budget, plan_shapes, useful_tile
from .jacobian import Jacobian, KroneckerBlock, SampleStack
from .modes import Mode, check_mode
from .providers import find_provider
from .support import capabilities
from .tiling import TileGrid, progress_steps

__all__ = ["ntk", "pseudo_ntk"]


def _check_inputs(x1: Any, x2: Any) -> tuple[Any, Any]:
    """``(xp, backend)`` of ``x1`` and ``x2``: arrays of one library and device, leading with
    a non-empty sample axis.  (Finite entries: ``check_finite``; an input the model cannot
    take is explained after its failure: :func:`input_problem`.)"""
    xp, backend = namespace_of(x1=x1, x2=x2)
    for name, x in (("x1", x1), ("x2", x2)):
        if x is not None and (x.ndim < 1 or x.shape[0] is None):
            raise ValueError(f"{name} must lead with the sample axis N; got shape "
                             f"{tuple(x.shape)} (for a single sample add the sample axis: "
                             f"{name}[None])")
        if x is not None and x.shape[0] == 0:
            raise ValueError(f"{name} has no samples (N{name[1]} = 0)")
    return xp, backend


def _named_parameters(model: Any) -> list[tuple[str, Any]]:
    """The model's parameters (and torch buffers) as ``(name, array)``, found by duck typing,
    without a framework import: ``named_parameters()`` / ``named_buffers()``
    (``torch.nn.Module``), the ``weights`` / ``biases`` of an :class:`ntkcore.models.MLP`,
    the array leaves of a JAX ``(apply_fn, params)`` pair; empty when the model exposes
    none."""
    out: list[tuple[str, Any]] = []
    for method in ("named_parameters", "named_buffers"):  # torch.nn.Module
        fn = getattr(model, method, None)
        if callable(fn):
            try:
                out.extend((str(n), p) for n, p in fn())
            except Exception:
                pass
    if out:  # lazy modules' parameters before their first call hold no values yet
        arrays: dict[type, bool] = {}  # _is_array per type (its namespace test is per type)
        for _, p in out:
            if type(p) not in arrays:
                arrays[type(p)] = (not type(p).__name__.startswith("Uninitialized")
                                   and _is_array(p))
        return [(n, p) for n, p in out if arrays[type(p)] and hasattr(p, "dtype")
                and hasattr(p, "shape")]
    from .models import MLP  # pure array API

    if isinstance(model, MLP):
        out = [(f"weights[{i}]", w) for i, w in enumerate(model.weights)]
        out += [(f"biases[{i}]", b) for i, b in enumerate(model.biases or ())]
        return out
    if isinstance(model, tuple) and len(model) == 2 and callable(model[0]):  # JAX pair
        _leaves(model[1], "params", out)
    return out


def _leaves(tree: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            _leaves(v, f"{path}[{k!r}]", out)
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            _leaves(v, f"{path}[{i}]", out)
    elif _is_array(tree):
        out.append((path, tree))


def _is_array(x: Any) -> bool:
    try:
        array_api_compat.array_namespace(x)
    except TypeError:
        return False
    return hasattr(x, "dtype") and hasattr(x, "shape")


def check_model_finite(model: Any) -> None:
    bad = first_nonfinite(_named_parameters(model))
    if bad is not None:
        raise ValueError(f"the model's parameter or buffer {bad!r} contains NaN or Inf "
                         "(pass check_finite=False to skip this check)")


#: Array libraries by the ``array_api_compat`` predicate that recognises their arrays (by
#: module name: nothing is imported): the library's name, what one and several of its arrays
#: are called in messages, and how to convert another library's array ``{}`` into one.
_LIBRARIES = (
    ("is_numpy_array", "NumPy", "a NumPy array", "NumPy arrays", "numpy.asarray({})"),
    ("is_torch_array", "torch", "a torch tensor", "torch tensors", "torch.as_tensor({})"),
    ("is_jax_array", "JAX", "a JAX array", "JAX arrays", "jax.numpy.asarray({})"),
    ("is_cupy_array", "CuPy", "a CuPy array", "CuPy arrays", "cupy.asarray({})"),
    ("is_dask_array", "Dask", "a Dask array", "Dask arrays", "dask.array.asarray({})"),
)

#: Libraries whose functions convert other libraries' arrays themselves (``jax.numpy`` takes
#: NumPy arrays and CPU tensors), so that a model of theirs given a foreign array is not
#: failing for that reason.
_CONVERTING = frozenset({"JAX"})


def _library(x: Any) -> tuple[str, str, str, str] | None:
    """``(name, one, several, conversion)`` of ``x``'s array library (:data:`_LIBRARIES`),
    or ``None`` for another library or a non-array."""
    for test, *library in _LIBRARIES:
        fn = getattr(array_api_compat, test, None)
        if fn is not None and fn(x):
            return library[0], library[1], library[2], library[3]
    return None


def _about_types(exc: BaseException | None) -> bool:
    """Whether the model's error ``exc`` speaks of types (torch's "must have the same dtype",
    "expected scalar type Float", "Input type (double) and bias type (float)"; JAX's "requires
    arguments to have the same dtypes"): a dtype difference is then named as its cause, not
    after a shape error."""
    return exc is None or "type" in str(exc).lower()


def _dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``torch.float32``, ``numpy.float32``, ... (libraries compared)."""
    return str(dtype).rsplit(".", 1)[-1]


def _is_dtype(x: Any, kind: str) -> bool:
    try:
        return bool(array_api_compat.array_namespace(x).isdtype(x.dtype, kind))
    except Exception:
        return False


def _floating(x: Any) -> bool:
    return _is_dtype(x, "real floating")


def input_problem(model: Any, name: str, x: Any,
                  exc: BaseException | None = None) -> tuple[str, bool] | None:
    """What visibly keeps ``model`` from taking the input ``x`` (called ``name``), or ``None``.

    Returns ``(message, with_cause)``: ``with_cause`` says whether the model's own error is
    worth quoting after the message.  Checked, in this order, against the model's parameters
    (:func:`_named_parameters`; nothing is known without them):

    * ``x`` is an array of another library than every parameter's (a NumPy array for a torch
      model): the message names both libraries and the conversion, e.g.
      ``torch.as_tensor(x1)`` (with the parameters' dtype and, off the CPU, device).  Not for
      JAX models, whose functions convert foreign arrays themselves.
    * ``x`` is complex and no parameter is: complex inputs need a model that maps them to
      real values itself.
    * ``x`` is real floating, its dtype is no floating parameter's dtype, and the model's
      error ``exc`` (when given) speaks of types.
    """
    params = [p for _, p in _named_parameters(model)]
    if not params:
        return None
    mine = _library(x)
    theirs = {_library(p) for p in params}
    lib = next(iter(theirs)) if len(theirs) == 1 else None
    if lib is not None and lib != mine and lib[0] not in _CONVERTING and _is_array(x):
        what = mine[1] if mine is not None else \
            f"an array of {type(x).__module__.split('.')[0]}"
        extra = []
        floats = {str(p.dtype) for p in params if _floating(p)}
        if len(floats) == 1 and _floating(x):
            (dtype,) = floats
            if _dtype_name(dtype) != _dtype_name(x.dtype):
                extra.append(f"dtype={dtype}" if lib[0] == "torch" else f"dtype={dtype!r}")
        devices = {str(array_api_compat.device(p)) for p in params}
        if lib[0] == "torch" and len(devices) == 1 and devices != {"cpu"}:
            extra.append(f"device={next(iter(devices))!r}")
        convert = lib[3].format(", ".join([name, *extra]))
        return (f"{name} is {what} but the model's parameters are {lib[2]}; convert it "
                f"first: {name} = {convert}", False)
    if _is_dtype(x, "complex floating") and not any(
            _is_dtype(p, "complex floating") for p in params):
        have = ", ".join(sorted({str(p.dtype) for p in params}))
        return (f"{name} has complex dtype {x.dtype} but the model's parameters are real "
                f"({have}): complex inputs are not supported unless the model maps them to "
                f"real values itself; pass a real floating {name} (for example its real and "
                "imaginary parts as separate features)", True)
    if _floating(x) and _about_types(exc):
        dtypes = {str(p.dtype) for p in params if _floating(p)}
        if dtypes and _dtype_name(x.dtype) not in {_dtype_name(d) for d in dtypes}:
            have = ", ".join(sorted(dtypes))
            if len(dtypes) > 1:
                fix = "to one of them"
            elif mine is not None and mine[0] == "torch":
                fix = f"to the model's dtype: {name} = {name}.to({have})"
            elif mine is not None and mine[0] in ("NumPy", "JAX", "CuPy"):
                fix = f"to the model's dtype: {name} = {name}.astype({_dtype_name(have)!r})"
            else:
                fix = "to the model's dtype"
            return (f"{name} has dtype {x.dtype} but the model's parameters have dtype "
                    f"{have}; convert {name} {fix}", True)
    return None


class ModelInputError(TypeError):
    """A provider's failure on its input, explained by :func:`input_problem` (the model's
    own exception is the ``__cause__``); :func:`explain_failure` explains it anew under the
    caller's argument name instead of quoting it."""


def explain_failure(exc: BaseException, model: Any, name: str, x: Any,
                    x1: Any = None) -> None:
    """Raise a clear error from a provider failure ``exc`` on input ``name`` when its cause is
    visible (:func:`input_problem`; with ``x1`` given, an ``x`` shaped unlike ``x1``);
    return otherwise (the caller re-raises ``exc``)."""
    if isinstance(exc, ModelInputError) and exc.__cause__ is not None:
        exc = exc.__cause__  # the model's own error, explained again under this name
    cause = f"{type(exc).__name__}: {exc}"
    problem = input_problem(model, name, x, exc)
    if problem is not None:
        message, with_cause = problem
        if with_cause:
            message += f" (the model raised {cause})"
        raise ModelInputError(message) from exc
    if x1 is not None and x is not x1 and tuple(x.shape[1:]) != tuple(x1.shape[1:]):
        raise ValueError(f"{name} has per-sample shape {tuple(x.shape[1:])} but x1 has "
                         f"{tuple(x1.shape[1:])}, and the model failed on {name} (it raised "
                         f"{cause}); pass inputs of one per-sample shape") from exc


#: The probe's findings (factor bytes per sample, block shapes, O, item size, the bytes per
#: sample without an output axis) per model
#: (weakly: entries die with it) and input signature (:func:`_probe_key`).  For a model called
#: repeatedly (a training or distillation loop, a benchmark) the probe's fixed cost (a forward
#: and a backward pass with hooks, several milliseconds for a small MLP) is paid once.  The
#: values only size batches: a stale one (a module changed in place without changing any
#: parameter shape) can misjudge memory, never the kernel.
_PER_SAMPLE: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], _Facts]] = \
    weakref.WeakKeyDictionary()


class _Facts(NamedTuple):
    """What the probe measured of the Jacobian of one sample (bytes are per sample)."""

    per_sample: float  #: factor bytes ``b``
    shapes: tuple[Any, ...]  #: the blocks' shapes (:func:`ntkcore.gram.block_shapes`)
    outputs: int  #: O
    itemsize: int  #: of the factors' dtype
    shared: float  #: bytes without an output axis (the Kronecker blocks' ``a``)
    work: float  #: the provider's working bytes ``w`` (:attr:`Jacobian.work_nbytes`)
    block_bytes: tuple[float, ...]  #: each block's factor bytes
    block_params: tuple[tuple[Any, ...], ...] | None  #: each block's ``params`` selection
    block_shared: tuple[float, ...]  #: each block's bytes without an output axis


def _shape_signature(model: Any) -> Any:
    """Parameter sizes of ``model`` when it tells them cheaply (duck-typed: a
    ``block_sizes`` attribute, as :class:`ntkcore.models.MLP` has, or the shapes of
    ``parameters()``, as a ``torch.nn.Module`` lists them without copying)."""
    sizes = getattr(model, "block_sizes", None)
    if sizes is not None:
        try:
            return tuple(sizes)
        except TypeError:
            return None
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return None
    try:
        return tuple(tuple(getattr(p, "shape", ())) for p in parameters())
    except Exception:
        return None


def _probe_key(provider: str, model: Any, x: Any, pseudo: bool, params: Any,
               dense: bool = False) -> tuple[Any, tuple[Any, ...]] | None:
    """``(model, signature)``: where :data:`_PER_SAMPLE` keeps this call's probe, or ``None``
    when it cannot (a model not weakly referenceable or not hashable)."""
    if params is None:
        pkey: Any = None
    elif isinstance(params, str):
        pkey = params
    else:
        try:
            pkey = tuple(p if isinstance(p, str | int) else id(p) for p in params)
        except TypeError:
            return None
    signature = (provider, tuple(x.shape[1:]), str(x.dtype), str(array_api_compat.device(x)),
                 pseudo, pkey, _shape_signature(model), dense)
    try:
        weakref.ref(model)
        hash((model, signature))
    except TypeError:
        return None
    return model, signature


def _jacobians(call: Callable[[Any], Jacobian], x: Any, start: int, stop: int,
               batch: int, first: Jacobian | None = None) -> Jacobian:
    """The Jacobian of samples ``start:stop`` from provider calls of ``batch`` samples.

    The batches are written into arrays for all samples as they come (:class:`SampleStack`:
    the factors and one batch at the peak, where stacking them at the end held them twice in
    a process whose allocator kept the freed batches resident: ResNet-50 at 224 px, N = 32,
    ten chunks of one output held under 1.6 GB, reached 2.48 GB, now 1.55 GB).  ``first``
    (the probe's Jacobian of the leading samples) is reused only when more than one call is
    needed anyway: a single call keeps the provider's own factor layouts (e.g. a
    convolution's g as a view of an (N, O, C, S) array), which stacking would not.
    """
    if first is not None and stop - start <= batch and first.num_samples < stop - start:
        first = None
    if first is None and stop - start <= batch:
        return call(x[start:stop, ...])
    # each batch written into arrays for all samples and dropped (peak: factors + a batch)
    stack = SampleStack(stop - start)
    pos = start
    if first is not None:
        stack.add(first)
        pos, first = start + first.num_samples, None
    while pos < stop:
        end = min(stop, pos + batch)
        stack.add(call(x[pos:end, ...]))
        pos = end
    return stack.result()


def _requires_grad(x: Any) -> bool:
    """Whether ``x`` asks for gradients (torch's ``requires_grad``; duck-typed, no import)."""
    return bool(getattr(x, "requires_grad", False))


def _check_options(mode: Any, layerwise: Any, batch_size: Any, checkpoint: Any,
                   check_finite: Any) -> Mode:
    """Validate the options of :func:`ntk` / :func:`pseudo_ntk`; the mode as a :class:`Mode`."""
    mode = check_mode(mode)
    if checkpoint not in (True, False, "auto"):
        raise ValueError(f"checkpoint must be True, False or 'auto'; got {checkpoint!r}")
    if not isinstance(layerwise, bool):
        raise TypeError(f"layerwise must be True or False; got {layerwise!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be None or a positive integer; got {batch_size!r}")
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be True or False; got {check_finite!r}")
    return mode


def provider_call(provider: Any, model: Any, name: str, x_full: Any, x1: Any,
                   options: dict[str, Any], x: Any) -> Jacobian:
    """The provider's Jacobian of ``x``, samples of the input called ``name`` (``x_full``);
    a failure is explained by :func:`explain_failure`."""
    try:
        if "outputs" in options:  # an output chunk (_output_chunk): the capability's function
            j = provider.capabilities["outputs"]()(model, x, **options)
        elif "dense_if_smaller" in options:
            j = provider.capabilities["dense_if_smaller"]()(model, x, **options)
        elif "measure_work" in options:
            j = provider.capabilities["work_nbytes"]()(model, x, **options)
        else:
            j = provider.jacobian(model, x, **options)
    except Exception as exc:
        explain_failure(exc, model, name, x_full, x1)
        if getattr(x, "ndim", None) == 1 and int(x.shape[0]) < int(x_full.shape[0]):
            # Scalar samples (a 1-d input) that the model does not take, most likely one
            # unbatched sample: the provider's diagnosis of the whole input (one cheap
            # call on N scalars) names it, where the probe's slice of it would not.
            try:
                provider.jacobian(model, x_full, **options)
            except Exception as whole:
                raise whole from exc
        raise
    if not isinstance(j, Jacobian):
        raise TypeError(f"provider {provider.name!r} returned {type(j).__name__}, "
                        "not an ntkcore.Jacobian")
    return j


def _check_checkpoint(checkpoint: Any, x1: Any, x2: Any, provider: Any) -> bool:
    """Whether exactly one input requires grad (a support set: KIP); raise where
    ``checkpoint=True`` cannot be honoured.  Then ``"auto"`` hands the call to the provider's
    ``checkpointed_ntk`` (torch: ``ntkcore.backends.torch_kip``, loaded lazily) when the
    other side's factors exceed ``M / 4``."""
    one_grad = x2 is not None and _requires_grad(x1) != _requires_grad(x2)
    if checkpoint is True and x2 is not None and _requires_grad(x1) and _requires_grad(x2):
        raise ValueError("checkpoint=True needs exactly one of x1, x2 to require grad (the "
                         "support set); both do")
    if checkpoint is True and one_grad and "checkpointed_ntk" not in provider.capabilities:
        raise ValueError(f"checkpoint=True is implemented for torch.nn.Module models; this "
                         f"model uses the {provider.name!r} provider")
    return one_grad


def _probe(provider: Any, model: Any, call: Callable[[Any], Jacobian], x1: Any, pseudo: bool,
           params: Any, dense: bool = False) -> tuple[_Facts, Jacobian | None]:
    """``(facts, probe)``: the :class:`_Facts` of the model on ``x1``'s leading samples (each
    block's ``params`` selection from :func:`_block_params`; remembered per model and input
    signature, :data:`_PER_SAMPLE`), and the probe's Jacobian when it was computed now."""
    key = _probe_key(provider.name, model, x1, pseudo, params, dense)
    cached = None if key is None else _PER_SAMPLE.get(key[0], {}).get(key[1])
    if cached is not None:
        return cached, None
    probe = call(x1[0:min(int(x1.shape[0]), PROBE_SAMPLES), ...])
    n = probe.num_samples
    def nbytes(arrays: Any) -> float:
        return sum(math.prod(a.shape) * itemsize(probe.xp, a.dtype) for a in arrays) / n

    cached = _Facts(probe.nbytes / n, block_shapes(probe), probe.num_outputs,
                    itemsize(probe.xp, probe.dtype), probe.shared_nbytes / n,
                    probe.work_nbytes / n, tuple(nbytes(b.arrays()) for b in probe.blocks),
                    _block_params(provider, model, probe, params),
                    tuple(nbytes([b.a]) if isinstance(b, KroneckerBlock) else 0.0
                          for b in probe.blocks))
    if key is not None:
        _PER_SAMPLE.setdefault(key[0], {})[key[1]] = cached
    return cached, probe


def _block_params(provider: Any, model: Any, probe: Jacobian,
                  params: Any) -> tuple[tuple[Any, ...], ...] | None:
    """Each block's ``params`` selection (the provider's ``"block_params"`` capability), or
    None where the provider has none or cannot tell."""
    loader = provider.capabilities.get("block_params")
    if loader is None:
        return None
    try:
        return tuple(tuple(names) for names in loader()(model, probe, params))
    except ValueError:  # a layout the capability does not recognise: no groups
        return None


def _kernel(model: Any, x1: Any, x2: Any, *, mode: str, layerwise: bool, max_memory: Any,
            params: Any, progress: Any, dtype: Any, pseudo: bool, batch_size: Any,
            checkpoint: Any = "auto", check_finite: bool = True) -> Array:
    """:func:`ntk` within the budget ``M``.  A probe on the first sample measures the factor
    bytes per sample ``b`` and the provider's working bytes per sample ``w`` (its forward's
    saved tensors and a backward pass's gradients, :attr:`Jacobian.work_nbytes`; remembered
    per model and input signature, :data:`_PER_SAMPLE`); a provider call on ``k`` samples is
    taken to need ``k (3 b + w)``: ``w`` is alive beside the ``2 b`` of copies that assemble
    the result, so it is added to them (the larger of the two let ResNet-50 at 224 px, N =
    32, reach 1.03 times a 6 GB budget; the sum, 0.80).  If the factors of all samples
    fit in ``M / 2`` they are computed once, in batches, and :func:`gram` gets the rest;
    otherwise :func:`_streamed` computes the kernel in sample blocks of ``M / 4`` of
    factors, :func:`_by_output_chunks` a few outputs at a time (:func:`_output_chunk`), or
    :func:`_by_param_groups` as a sum over groups of blocks (:func:`_param_groups`), whichever
    is estimated to cost the fewest flops.
    Stacking drops each batch once stacked and the probe is released once copied, so
    nothing outside the charged figures stays alive (the kernel itself is not counted).
    A budget too small for a useful tile raises :class:`ntkcore.BudgetTooSmallError` right
    after the probe (:func:`_check_budget`)."""
    mode = _check_options(mode, layerwise, batch_size, checkpoint, check_finite)
    provider = find_provider(model)
    xp, backend = _check_inputs(x1, x2)
    if check_finite:
        _check_finite_array(xp, x1, "x1")
        if x2 is not None:
            _check_finite_array(xp, x2, "x2")
        check_model_finite(model)
    budget = resolve_budget(max_memory, backend, array_api_compat.device(x1))
    options: dict[str, Any] = {"params": params, **({"pseudo": True} if pseudo else {})}
    if "dense_if_smaller" in provider.capabilities and (
            x2 is None or tuple(x2.shape[1:]) == tuple(x1.shape[1:])):
        # the same sample shape on both sides: the same blocks dense (shapes decide), which a
        # cross kernel needs; the kernel is the same, cheaper and with fewer bytes
        options["dense_if_smaller"] = True
    call = functools.partial(provider_call, provider, model, "x1", x1, x1, options)
    call2 = call if x2 is None else functools.partial(provider_call, provider, model, "x2",
                                                      x2, x1, options)
    n1 = int(x1.shape[0])
    n2 = n1 if x2 is None else int(x2.shape[0])
    one_grad = _check_checkpoint(checkpoint, x1, x2, provider)
    probe_call = call if "work_nbytes" not in provider.capabilities else functools.partial(
        provider_call, provider, model, "x1", x1, x1, {**options, "measure_work": True})
    cached, probe = _probe(provider, model, probe_call, x1, pseudo, params,
                           bool(options.get("dense_if_smaller")))
    per_sample = cached.per_sample
    cross = x2 is not None
    device = array_api_compat.device(x1)
    need = _budget_need(cached, n1, n2, cross, mode, layerwise, dtype, xp)
    fits = need[0] <= budget
    hold = _holds(cached, budget, n1, n2, cross, mode, layerwise, dtype, xp, device, need)
    held = hold is not None
    chunkable = not held and not one_grad and "outputs" in provider.capabilities and \
        mode.output_chunks and cached.outputs > 1
    k = _output_chunk(budget, cached, n1, n2, cross, mode, layerwise, dtype, xp, device) \
        if chunkable else None
    if k is None and (chunkable or not fits):
        # raises, quoting the smallest budget (of one output at a time if any)
        _check_budget(budget, _chunk_facts(cached, 1) if chunkable else cached, n1, n2,
                      cross, mode, layerwise, dtype, xp)
    grouped = None if held or one_grad else _grouped(budget, cached, n1, n2, cross, mode,
                                                      layerwise, dtype, xp, device, chunkable)
    if grouped is not None:
        o, shapes = cached.outputs, cached.shapes
        # the plan otherwise taken: k outputs at a time (k = O: all, in sample blocks)
        kk = o if k is None else k
        facts = _chunk_facts(cached, kk)
        kept = _holds(facts, budget, n1, n2, cross, mode, layerwise, dtype, xp, device)
        samples = _samples_computed(kept is not None, facts.per_sample, budget, n1, n2, cross)
        if grouped[0] < GROUPS_MARGIN * _chunks_cost(shapes, kk, o, samples, n1, n2, mode):
            probe = None  # not reused (its blocks are all of them): freed, not held uncharged
            return _by_param_groups(grouped[2], cached, provider, model, x1, x2, options,
                                    budget, batch_size, mode, layerwise, pseudo, dtype,
                                    progress, xp, check_finite, device, k=grouped[1])
    if k is not None and k < cached.outputs:  # chunks cost fewer flops than sample blocks
        probe = None  # not reused (all outputs): freed, not held uncharged
        return _by_output_chunks(k, cached, provider, model, x1, x2, options, budget,
                                 batch_size, mode, layerwise, dtype, progress, xp, check_finite,
                                 device)
    # The budget suffices; from here on, a planner that finds its share too small raises.
    box, probe = [probe], None  # the only reference: freed once used (_held_or_streamed)
    return _held_or_streamed(call, call2, box, per_sample, budget, one_grad, provider, model,
                             x1, x2, mode, layerwise, pseudo, params, dtype, batch_size,
                             checkpoint, progress, xp, check_finite, work=cached.work, hold=hold)


def _held_or_streamed(call: Callable[[Any], Jacobian], call2: Callable[[Any], Jacobian],
                      box: list[Jacobian | None], per_sample: float, budget: Budget,
                      one_grad: bool, provider: Any, model: Any, x1: Any, x2: Any, mode: Mode,
                      layerwise: bool, pseudo: bool, params: Any, dtype: Any, batch_size: Any,
                      checkpoint: Any, progress: Any, xp: Any, check_finite: bool,
                      work: float = 0.0, hold: int | None = None) -> Array:
    """The kernel of a budget that suffices: the provider's checkpointed kernel (one side
    requiring grad), all factors held (``hold``: the contraction's least share, from
    :func:`_holds`), or else :func:`_streamed` (see :func:`_kernel`).  ``box`` holds the
    probe's Jacobian (or None), its only reference; ``work``: the provider's working bytes
    per sample (:attr:`Jacobian.work_nbytes`), charged to each call."""
    probe = box.pop()
    n1 = int(x1.shape[0])
    n2 = n1 if x2 is None else int(x2.shape[0])
    checkpointed = provider.capabilities.get("checkpointed_ntk")
    try:
        if one_grad and checkpointed is not None and (checkpoint is True or (
                checkpoint == "auto" and per_sample * (n2 if _requires_grad(x1) else n1)
                > budget / 4)):
            # One side requires grad and the other is large: the provider's checkpointed
            # target factors (torch: ntkcore.backends.torch_kip), loaded lazily.
            probe = None
            try:
                return checkpointed()(model, x1, x2, mode=mode, layerwise=layerwise,
                                      pseudo=pseudo, params=params, max_memory=budget,
                                      dtype=dtype, batch_size=batch_size)
            except Exception as exc:
                explain_failure(exc, model, "x2", x2, x1)
                raise
        if hold is None:
            box, probe = [probe], None  # _streamed drops the probe after its first row block
            return _streamed(call, call2, x1, x2, box, per_sample, budget, batch_size, mode,
                             layerwise, dtype, progress, xp, check_finite, work)
        # batches beside the factors computed before them (_holds)
        factors = per_sample * (n1 + (0 if x2 is None else n2))
        batch = batch_size or batch_samples(per_sample, min(budget / 2, budget - factors), work)
        j1 = _jacobians(call, x1, 0, n1, batch, probe)
        probe = None  # j1 holds its samples (a copy, when stacked): not charged twice
        j2 = None if x2 is None else _jacobians(call2, x2, 0, n2, batch)
        rest = budget.less(j1.nbytes + (0 if j2 is None else j2.nbytes), hold)
        return gram(j1, j2, mode=mode, layerwise=layerwise, max_memory=rest, dtype=dtype,
                    progress=progress, check_finite=check_finite)
    except BudgetTooSmallError as e:  # a planner got a share of the budget: scale back
        need = math.ceil(e.needed * budget / max(e.given, 1))
        raise BudgetTooSmallError(
            f"{budget.given} ({budget} bytes) is too small for the smallest useful tile "
            f"of this kernel: pass max_memory >= {need} bytes", budget, need) from None


def _check_budget(budget: Budget, cached: _Facts, n1: int, n2: int, cross: bool,
                  mode: str, layerwise: bool, dtype: Any, xp: Any) -> None:
    """Raise when ``budget`` cannot give :func:`gram` a useful tile (``min(N, 8)`` samples a
    side, ``MIN_TILE_SAMPLES`` in ``ntkcore/gram.py``), stating the smallest budget that
    does.

    The kernel is computed with all factors held (when they take at most ``M / 2``) and the
    contraction then gets at least ``M / 2``, or in sample blocks of ``M / 4`` bytes of factors
    with ``M / 2`` for the contraction (:func:`_kernel`).  So ``M`` works when
    ``M >= 2 g`` (``g``: the contraction's need for a useful tile, from the block shapes) and
    either ``M >= 2 F`` (``F``: all factors) or ``M >= 4 m b`` (blocks of ``m`` samples of
    ``b`` bytes each).
    """
    need, g, per_sample = _budget_need(cached, n1, n2, cross, mode, layerwise, dtype, xp)
    if budget < need:
        raise BudgetTooSmallError(
            f"{budget.given} ({budget} bytes) is too small for the smallest useful tile "
            f"of this kernel ({useful_tile(n1)} x {useful_tile(n2)} "
            f"samples: {per_sample:.0f} bytes of Jacobian factors per sample, {g} bytes to "
            f"contract the tile): pass max_memory >= {need} bytes", budget, need)


def _budget_need(cached: _Facts, n1: int, n2: int, cross: bool, mode: str,
                 layerwise: bool, dtype: Any, xp: Any) -> tuple[int, int, float]:
    """``(M, g, b)``: the smallest budget :func:`_check_budget` accepts for the probe's facts
    ``cached``, the contraction's need ``g`` and the factor bytes per sample ``b``."""
    per_sample, shapes, o = cached[:3]
    item = _compute_itemsize(cached, dtype, xp)
    g = min_budget(shapes, num_outputs=o, n1=n1, n2=n2, mode=mode, layerwise=layerwise,
                   itemsize=item)
    m = max(useful_tile(n1), useful_tile(n2))
    factors = per_sample * (n1 + (n2 if cross else 0))
    return max(2 * g, math.ceil(min(2 * factors, 4 * m * per_sample))), g, per_sample


#: Samples a side of the contraction's tiles below which held factors are not worth its
#: slowdown (:func:`_holds`): a trace tile of ``r x r`` samples reads ``2 r`` rows of the
#: factors for ``r^2`` products, so small tiles leave the GEMM bound by memory.
HELD_MIN_TILE = 64
#: How many more flops the contraction may plan beside held factors than within half the
#: budget (:func:`_holds`).
HELD_FLOPS_SLACK = 1.1
#: Groups of blocks are taken when their estimated flops are below this share of the plan
#: otherwise taken (:func:`_kernel`): each group runs the model's forward pass again with
#: its per-block framework operations, which the flop count leaves out.  ViT-S/16 at N = 32
#: under 6 GB: two groups of five outputs, estimated 0.5% cheaper than five held chunks of
#: two outputs, took 27% longer (47% of the bound against 60%).
GROUPS_MARGIN = 0.9


def _holds(facts: _Facts, budget: Budget, n1: int, n2: int, cross: bool, mode: Mode,
           layerwise: bool, dtype: Any, xp: Any, device: Any = None,
           need: tuple[int, int, float] | None = None) -> int | None:
    r"""The contraction's least share of ``budget`` (bytes) where the factors of all samples
    are held, or None where they are not (they are then computed in sample blocks);
    ``need``: :func:`_budget_need`'s result for these facts, where the caller has it.

    The factors ``F = b (n_1 + n_2)`` are held when the budget ``M`` has a useful tile
    (:func:`_check_budget`) and either ``F <= M / 2`` (the contraction gets the rest, at
    least ``M / 4`` should the factors come out larger than the probe said), or

    .. math:: M - F \ge \max(g,\ 3 b + w,\ n F_{max})

    (``g`` a useful tile's contraction, ``3 b + w`` a provider call on one sample beside
    the factors computed before it, the batches then taking ``M - F``, and ``n F_{max}``
    the largest block of all ``n`` samples, which stacking copies once) and the plan
    :func:`gram` makes within ``M - F`` costs at most :data:`HELD_FLOPS_SLACK` times the
    flops of the plan within ``M / 2`` in tiles of at least ``min(HELD_MIN_TILE, t)``
    samples a side (``t`` the tile within ``M / 2``); its working bytes are returned.  So
    the factors need not leave the contraction half the budget when it needs less:
    ResNet-50 at 224 px, N = 128, one output of its ten at a time under 6 GB holds 4.9 GB of
    factors beside a 0.66 GB contraction (ten chunks of one forward and one output-gradient
    pass a sample), where the half rule streamed two outputs at a time in blocks of 27
    samples (five chunks computing 384 sample Jacobians each)."""
    samples = n1 + (n2 if cross else 0)
    factors = facts.per_sample * samples
    least, g, _ = need or _budget_need(facts, n1, n2, cross, mode, layerwise, dtype, xp)
    if least > budget:
        return None
    if factors <= budget / 2:
        return budget // 4
    rest = budget - factors
    if rest < max(g, CALL_OVERHEAD * facts.per_sample + facts.work,
                  samples * max(facts.block_bytes, default=0.0)):
        return None
    item = _compute_itemsize(facts, dtype, xp)

    def plan(share: float) -> Any:
        return plan_shapes(facts.shapes, num_outputs=facts.outputs, n1=n1, n2=n2,
                           symmetric=not cross, mode=mode, layerwise=layerwise, itemsize=item,
                           budget=Budget(int(share), budget.default), xp=xp, device=device)

    half, here = plan(budget / 2), plan(rest)
    small = min(HELD_MIN_TILE, half.tile_rows), min(HELD_MIN_TILE, half.tile_cols)
    if here.flops > HELD_FLOPS_SLACK * half.flops or here.tile_rows < small[0] or \
            here.tile_cols < small[1]:
        return None
    return here.working_bytes


def _compute_itemsize(facts: _Facts, dtype: Any, xp: Any) -> int:
    """Bytes of a number in the contraction: the factors' or ``dtype``'s, the larger."""
    item = facts.itemsize
    if dtype is not None:
        try:
            resolved = getattr(xp, dtype) if isinstance(dtype, str) else dtype
            item = max(item, itemsize(xp, resolved))
        except Exception:  # gram() reports a bad dtype
            pass
    return item


def _chunk_facts(cached: _Facts, k: int) -> _Facts:
    """The probe's facts for a Jacobian of ``k`` of its O outputs: the factors without an
    output axis whole, the rest scaled by ``k / O`` (per block too); the provider's working
    bytes (its forward, one pass's gradients) whole."""
    o = cached.outputs

    def part(whole: float, shared: float) -> float:
        return shared + (whole - shared) * k / o

    return cached._replace(per_sample=part(cached.per_sample, cached.shared), outputs=k,
                           block_bytes=tuple(map(part, cached.block_bytes,
                                                 cached.block_shared)))


def _output_chunk(budget: Budget, cached: _Facts, n1: int, n2: int, cross: bool,
                  mode: Mode, layerwise: bool, dtype: Any, xp: Any,
                  device: Any = None) -> int | None:
    r"""Outputs per chunk (O: all at once) for a kernel whose factors of all O outputs are
    not held within ``budget`` (streamed in sample blocks, or refused), or None (not even
    one output fits, or ``mode`` is not a sum or a concatenation over outputs: full mode
    pairs every output with every other).

    The trace and diagonal kernels are made of the outputs one at a time,

    .. math:: \Theta_{trace} = \sum_{c} \sum_{o \in c} J_o J_o'^T, \qquad
              \Theta_{diag}[:, :, c] = (J_o J_o'^T)_{o \in c},

    and a Jacobian of the outputs of chunk ``c`` (``k`` backward passes) holds the
    Kronecker factors ``a`` whole and the output-gradient factors ``g`` and dense rows
    for ``k`` outputs only: ``b_k = b_a + (b - b_a) k / O`` bytes per sample.  Of the ``k``
    whose ``b_k`` passes :func:`_check_budget` (one per chunk count, ``k = ceil(O / c)``),
    the one of the fewest flops (:func:`_chunks_cost`; ties go to fewer chunks) is taken.
    Few chunks save forward passes and the repeated input-factor Grams ``a a'^T``; chunks
    small enough for all samples' factors to be held save the recomputation of sample
    blocks (:func:`_samples_computed`): BERT-base at N = 32 under 6 GB, streamed in blocks of
    12 samples (64 sample Jacobians of three passes), takes two chunks of one output held
    whole (2 x 32 Jacobians of two passes)."""
    o = cached.outputs
    if not mode.output_chunks or o < 2:
        return None
    best: tuple[float, int] | None = None
    for c in range(1, o + 1):  # chunk counts (1: all outputs); each k = ceil(O / c) once
        k = -(-o // c)
        if c > 1 and k == -(-o // (c - 1)):
            continue
        facts = _chunk_facts(cached, k)
        if _budget_need(facts, n1, n2, cross, mode, layerwise, dtype, xp)[0] > budget:
            continue
        held = _holds(facts, budget, n1, n2, cross, mode, layerwise, dtype, xp, device)
        samples = _samples_computed(held is not None, facts.per_sample, budget, n1, n2, cross)
        cost = _chunks_cost(cached.shapes, k, o, samples, n1, n2, mode)
        if best is None or cost < best[0]:
            best = (cost, k)
    return None if best is None else best[1]


def _chunks_cost(shapes: tuple[Any, ...], k: int, o: int, samples: float, n1: int, n2: int,
                 mode: Mode) -> float:
    r"""Flops of a kernel computed in ``ceil(O / k)`` chunks of ``k`` outputs, each computing
    ``samples`` sample Jacobians and the Gram of its outputs:

    .. math:: C_k = \lceil O / k \rceil \bigl[s_k F (1 + k) + \textstyle\sum_b G_b(k)\bigr]

    with ``F`` the forward flops of a sample through the parameterised layers (``2 S d_in
    d_out`` per Kronecker block, ``2 P`` per dense one; a pass of output gradients, which
    needs input gradients only, costs about as much) and ``G_b(k)`` the cheapest route's
    flops of block ``b`` on an ``n x n`` tile of ``k`` outputs
    (:func:`ntkcore.gram.cheapest_flops`, ``n`` the geometric mean of the two sides): the
    input-factor Grams of the "positions" route are paid once per chunk."""
    forward = sum(2.0 * sh.num_positions * sh.a_width * sh.d_out if sh.kron
                  else 2.0 * sh.num_params for sh in shapes)
    n = max(1, round(math.sqrt(n1 * n2)))
    gram_flops = sum(cheapest_flops(sh, n, k, mode) for sh in shapes)
    return -(-o // k) * (samples * forward * (1 + k) + gram_flops)


def _samples_computed(held: bool, per_sample: float, budget: Budget, n1: int, n2: int,
                      cross: bool) -> float:
    """Sample Jacobians a kernel computes: each sample once when all factors are ``held``
    (:func:`_holds`); else, in blocks of ``m = (M / 4) / b`` samples (:func:`_streamed`), the
    row blocks once and the column blocks once per row block (on and above the diagonal of
    a self-kernel)."""
    if held:
        return n1 + (n2 if cross else 0)
    m = max(1, int(budget / 4 // max(1.0, per_sample)))
    rows = -(-n1 // m)
    if cross:
        return n1 + rows * n2
    return n1 + (rows - 1) * n1 / 2


def _by_output_chunks(k: int, cached: _Facts, provider: Any, model: Any, x1: Any,
                      x2: Any, options: dict[str, Any], budget: Budget, batch_size: Any,
                      mode: Mode, layerwise: bool, dtype: Any, progress: Any, xp: Any,
                      check_finite: bool, device: Any = None) -> Array:
    """The kernel from the provider's Jacobians of ``k`` outputs at a time
    (:func:`_output_chunk`): each chunk's kernel as :func:`_kernel` computes a kernel whose
    factors fit (held or streamed), joined by ``mode.join_output_chunks`` (trace: summed;
    diagonal: concatenated along the output axis).  ``progress`` is reported per chunk."""
    o, parts = cached.outputs, []
    facts = _chunk_facts(cached, k)
    n1 = int(x1.shape[0])
    n2 = n1 if x2 is None else int(x2.shape[0])
    hold = _holds(facts, budget, n1, n2, x2 is not None, mode, layerwise, dtype, xp, device)
    for c0 in range(0, o, k):
        opts = {**options, "outputs": (c0, min(o, c0 + k))}
        call = functools.partial(provider_call, provider, model, "x1", x1, x1, opts)
        call2 = call if x2 is None else functools.partial(provider_call, provider, model, "x2",
                                                          x2, x1, opts)
        parts.append(_held_or_streamed(call, call2, [None], facts.per_sample, budget, False,
                                       provider, model, x1, x2, mode, layerwise, False, None,
                                       dtype, batch_size, False, progress, xp, check_finite,
                                       work=facts.work, hold=hold))
        if mode.sums_outputs and len(parts) == 2:  # a running sum: two kernels alive at most
            parts = [mode.join_output_chunks(xp, parts)]
    return mode.join_output_chunks(xp, parts)


def _group_facts(cached: _Facts, start: int, stop: int) -> _Facts:
    """The probe's facts for a Jacobian of blocks ``start:stop`` only: their factor bytes and
    shapes; the provider's working bytes (its whole forward) whole."""
    sel = slice(start, stop)
    params = cached.block_params
    return cached._replace(per_sample=sum(cached.block_bytes[sel]),
                           shared=sum(cached.block_shared[sel]), shapes=cached.shapes[sel],
                           block_bytes=cached.block_bytes[sel],
                           block_params=None if params is None else params[sel],
                           block_shared=cached.block_shared[sel])


def _param_groups(budget: Budget, cached: _Facts, n1: int, n2: int, cross: bool, mode: Mode,
                  layerwise: bool, dtype: Any, xp: Any,
                  device: Any = None) -> list[tuple[int, int]] | None:
    r"""Consecutive groups of blocks ``(start, stop)`` whose factors of all samples are each
    held within ``budget`` (:func:`_holds`), or None: the provider cannot select blocks (no
    ``"block_params"``), a block alone is not held, or one group would hold them all.

    The kernel is a sum over parameters, so over any partition of the blocks into groups
    :math:`g`, in every mode (and a concatenation of the groups' per-block kernels when
    ``layerwise``):

    .. math:: \Theta[n, m, o, p] = \sum_g \sum_{k \in g} J[n, o, k]\, J'[m, p, k] .

    Each group costs a forward pass and O output-gradient passes, which stop at the group's
    first block (:func:`_groups_cost`): the groups are packed greedily from the first block
    (the input side), so that the groups after it start as late as they can, and they are as
    few as they can be."""
    if cached.block_params is None or len(cached.block_bytes) < 2:
        return None

    def held(start: int, stop: int) -> bool:
        return _holds(_group_facts(cached, start, stop), budget, n1, n2, cross, mode,
                      layerwise, dtype, xp, device) is not None

    groups, start, blocks = [], 0, len(cached.block_bytes)
    samples = n1 + (n2 if cross else 0)
    while start < blocks:
        if not held(start, start + 1):
            return None
        stop = start + 1  # grown while its factors take at most M / 2 (held: no plan needed)
        while stop < blocks and samples * sum(cached.block_bytes[start:stop + 1]) <= \
                budget / 2 and held(start, stop + 1):
            stop += 1
        lo, hi = stop, blocks  # then bisected: more blocks hold no less
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if held(start, mid) else (lo, mid - 1)
        groups.append((start, lo))
        start = lo
    return groups if len(groups) > 1 else None


def _chunk_sizes(o: int) -> list[int]:
    """The outputs per chunk ``k = ceil(O / c)`` of ``c = 1 .. O`` chunks, each once, from
    ``O`` (one chunk) down."""
    sizes: list[int] = []
    for c in range(1, o + 1):
        k = -(-o // c)
        if not sizes or k != sizes[-1]:
            sizes.append(k)
    return sizes


def _grouped(budget: Budget, cached: _Facts, n1: int, n2: int, cross: bool, mode: Mode,
             layerwise: bool, dtype: Any, xp: Any, device: Any,
             chunkable: bool) -> tuple[float, int, list[tuple[int, int]]] | None:
    """``(cost, k, groups)``: the groups of blocks (:func:`_param_groups`) computed ``k``
    outputs at a time (``k = O`` unless the kernel is ``chunkable``, see
    :func:`_output_chunk`) of the fewest estimated flops (:func:`_groups_cost`), or None
    where no ``k`` gives groups.  A group's factors of ``k`` outputs are
    :func:`_chunk_facts`'s."""
    o, best = cached.outputs, None
    for k in _chunk_sizes(o) if chunkable else [o]:
        groups = _param_groups(budget, _chunk_facts(cached, k), n1, n2, cross, mode, layerwise,
                               dtype, xp, device)
        if groups is None:
            continue
        cost = _groups_cost(cached.shapes, groups, o, n1 + (n2 if cross else 0), n1, n2, mode,
                            k)
        if best is None or cost < best[0]:
            best = (cost, k, groups)
    return best


def _groups_cost(shapes: tuple[Any, ...], groups: list[tuple[int, int]], o: int,
                 samples: int, n1: int, n2: int, mode: Mode, k: int | None = None) -> float:
    r"""Flops of a kernel computed over the groups of blocks :math:`g` (:func:`_param_groups`),
    each group's factors of all ``samples`` held, ``k`` outputs at a time (default O):

    .. math:: C = \lceil O / k \rceil \Bigl[\sum_g s \bigl[F + k\, F_{\ge g}\bigr]
              + \textstyle\sum_b G_b(k)\Bigr]

    with ``F`` the forward flops of a sample through the parameterised layers and
    :math:`F_{\ge g}` those of the blocks from the group's first on (an output-gradient pass
    goes back to the group's first block and no further; per block as in
    :func:`_chunks_cost`), and ``G_b(k)`` the cheapest route's flops of block ``b`` on an
    ``n x n`` tile of ``k`` outputs, each block's once per chunk."""
    k = o if k is None else k
    per_block = [2.0 * sh.num_positions * sh.a_width * sh.d_out if sh.kron
                 else 2.0 * sh.num_params for sh in shapes]
    forward = sum(per_block)
    n = max(1, round(math.sqrt(n1 * n2)))
    gram_flops = sum(cheapest_flops(sh, n, k, mode) for sh in shapes)
    return -(-o // k) * (sum(samples * (forward + k * sum(per_block[start:]))
                             for start, _ in groups) + gram_flops)


def _by_param_groups(groups: list[tuple[int, int]], cached: _Facts, provider: Any,
                     model: Any, x1: Any, x2: Any, options: dict[str, Any], budget: Budget,
                     batch_size: Any, mode: Mode, layerwise: bool, pseudo: bool, dtype: Any,
                     progress: Any, xp: Any, check_finite: bool, device: Any = None,
                     k: int | None = None) -> Array:
    """The kernel as the sum of the kernels of the groups of blocks ``groups``
    (:func:`_param_groups`), each from the provider's Jacobian of that group's parameters
    (``params=`` its blocks' selections, :func:`_block_params`) with the factors of all
    samples held, ``k`` outputs at a time (default all; the chunks joined as in
    :func:`_by_output_chunks`); ``layerwise``: the groups' per-block kernels concatenated, in
    block order.  Running sums keep a few kernels alive at most.  ``progress`` is reported
    per group and chunk."""
    total, parts = None, []
    n1 = int(x1.shape[0])
    n2 = n1 if x2 is None else int(x2.shape[0])
    o = cached.outputs
    k = o if k is None else k
    chunked = _chunk_facts(cached, k)
    for start, stop in groups:
        selection = [name for names in (cached.block_params or ())[start:stop]
                     for name in names]
        facts = _group_facts(chunked, start, stop)
        hold = _holds(facts, budget, n1, n2, x2 is not None, mode, layerwise, dtype, xp,
                      device)
        chunks: list[Array] = []
        for c0 in range(0, o, k):
            opts = {**options, "params": selection,
                    **({"outputs": (c0, min(o, c0 + k))} if k < o else {})}
            call = functools.partial(provider_call, provider, model, "x1", x1, x1, opts)
            call2 = call if x2 is None else functools.partial(provider_call, provider, model,
                                                              "x2", x2, x1, opts)
            chunks.append(_held_or_streamed(call, call2, [None], facts.per_sample, budget,
                                            False, provider, model, x1, x2, mode, layerwise,
                                            pseudo, selection, dtype, batch_size, False,
                                            progress, xp, check_finite, work=facts.work,
                                            hold=hold))
            if mode.sums_outputs and len(chunks) == 2:
                chunks = [mode.join_output_chunks(xp, chunks)]
        part = chunks[0] if len(chunks) == 1 else mode.join_output_chunks(xp, chunks)
        del chunks
        if layerwise:
            parts.append(part)
        else:
            total = part if total is None else total + part
            del part
    return xp.concat(parts, axis=0) if layerwise else total


def _streamed(call: Callable[[Any], Jacobian], call2: Callable[[Any], Jacobian], x1: Any,
              x2: Any, box: list[Jacobian | None], per_sample: float, budget: Budget,
              batch_size: Any, mode: Mode, layerwise: bool, dtype: Any, progress: Any, xp: Any,
              check_finite: bool, work: float = 0.0) -> Array:
    """Kernel in (row, column) sample blocks: the row block's factors computed once, the
    column blocks' per row block (for ``x2=None`` only the blocks on and above the diagonal).

    ``box`` holds the probe's Jacobian (or None), the only reference to it, so that it is
    freed after the first row block instead of being held, uncharged, to the end."""
    probe = box.pop()
    block = max(1, int(budget / 4 // max(1.0, per_sample)))
    batch = batch_size or batch_samples(per_sample, budget / 4, work)
    symmetric = x2 is None
    xc = x1 if symmetric else x2
    grid = TileGrid(int(x1.shape[0]), int(xc.shape[0]), block, symmetric=symmetric)
    tiles: dict[tuple[int, int], Array] = {}
    rest = budget.share(2)
    # NaN/Inf: one flag per tile kept on the device and read once at the end (one host sync
    # per call, not per tile); a bad tile is recomputed with gram's own check for its message
    flags, order = FiniteFlags(xp), []

    def tile(i: int, j: int, ji: Jacobian, check: bool) -> Array:
        jj = None if symmetric and j == i else _jacobians(call2, xc, *grid.cols[j], batch)
        return gram(ji, jj, mode=mode, layerwise=layerwise, max_memory=rest, dtype=dtype,
                    check_finite=check)

    with progress_steps(progress, len(grid.schedule()), "ntk") as step:
        for i, (r0, r1) in enumerate(grid.rows):
            first = probe if probe is not None and r0 == 0 and \
                probe.num_samples <= r1 - r0 else None
            ji = _jacobians(call, x1, r0, r1, batch, first)
            probe = first = None
            for j in grid.row_tiles(i):  # on the diagonal of a symmetric kernel, ji with itself
                tiles[(i, j)] = tile(i, j, ji, False)
                if check_finite:
                    flags.add(tiles[(i, j)])
                    order.append((i, j))
                step()
            del ji
    bad = flags.first_bad() if order else None
    if bad is not None:
        i, j = order[bad]
        tiles.clear()
        tile(i, j, _jacobians(call, x1, *grid.rows[i], batch), True)  # raises gram's error
        raise ValueError(f"the kernel of samples {grid.rows[i]} x {grid.cols[j]} holds Inf "
                         "or NaN")
    return grid.assemble(xp, tiles, mode, 1 if layerwise else 0)


@capabilities(note={"torch": "torch.nn.Module (CPU and CUDA) or models.MLP",
                    "jax": "(apply_fn, params) or models.MLP"})
def ntk(model: Any, x1: Array, x2: Array | None = None, *, mode: str = "full",
        layerwise: bool = False, max_memory: Any = None, params: Any = None,
        progress: Any = None, dtype: Any = None, batch_size: int | None = None,
        checkpoint: bool | str = "auto", check_finite: bool = True) -> Array:
    r"""The empirical neural tangent kernel of a model.

    .. math:: \Theta[n, m, o, p] = \sum_k J[n, o, k]\, J'[m, p, k],
              \quad J = \partial f(\theta, x_1) / \partial\theta,\;
              J' = \partial f(\theta, x_2) / \partial\theta .

    Parameters
    ----------
    model : model object
        Anything a registered Jacobian provider knows (:func:`ntkcore.providers.find_provider`):
        a ``torch.nn.Module`` (Kronecker blocks for Linear / Conv / Embedding, see
        :mod:`ntkcore.backends.torch_jacobian`), an :class:`ntkcore.models.MLP`, a JAX
        ``(apply_fn, params)`` pair, ...
    x1 : array, shape (N1, ...)
        Inputs of the model's framework, leading with the sample axis.
    x2 : array, shape (N2, ...), optional
        Second inputs; ``None`` means ``x1`` against itself (symmetric: tiles on and above the
        diagonal only, the result is exactly symmetric: ``K[n, m, o, p] == K[m, n, p, o]``
        bit for bit on any machine, as one triangle of each diagonal tile is mirrored).
    mode : {"full", "trace", "diagonal"}
        ``full`` (N1, N2, O, O); ``trace`` (N1, N2), :math:`\sum_o \Theta[:, :, o, o]`;
        ``diagonal`` (N1, N2, O).
    layerwise : bool
        One kernel per parameter block on a leading axis (B, N1, N2, ...), in the Jacobian's
        block order; the blocks sum to the total kernel.
    max_memory : int, float or str, optional
        Working-memory budget in bytes (or ``"1GB"``) for Jacobian factors and contractions,
        the kernel itself aside (docs/reliability.md, "Memory budgets").  Default: a quarter of the
        device's free memory.  Where the factors of all samples do not fit, the kernel is
        computed in sample blocks or, in "trace" and "diagonal" mode for providers with the
        ``"outputs"`` capability (torch), a few outputs at a time, or, for providers with
        the ``"block_params"`` capability (torch), as a sum over groups of parameter blocks
        whose factors of all samples are held, whichever costs fewer flops.  Too small for
        a tile of ``min(N, 8)`` samples a side: a ``ValueError`` stating the smallest budget
        that works.  Providers with the ``"dense_if_smaller"``
        capability (torch) give a layer whose per-sample gradient is smaller than its
        factors as that gradient (when ``x2`` is None or has ``x1``'s sample shape).
    params : optional
        Provider-specific parameter subset (torch: parameter names or tensors).
    progress : None, callable, True or "tqdm"
        Progress report per tile (``progress(done, total)``) or a tqdm bar.
    dtype : dtype, optional
        Accumulation and result dtype (default: the Jacobian's).
    batch_size : int, optional
        Samples per provider call (default: from the memory budget).
    checkpoint : {"auto", True, False}
        Gradients with respect to the inputs (torch autograd): when ``x1`` or ``x2`` requires
        grad, the provider builds the factors with ``create_graph`` and the kernel carries a
        graph to them (exact for every block kind).  For KIP-style dataset distillation, where
        exactly one side requires grad (the support set) and the other is large (the
        targets), the plain graph would keep every target's factors until the backward pass.
        The checkpointed path (:func:`ntkcore.backends.torch_kip.checkpointed_ntk`) instead
        recomputes the targets' factors chunk by chunk in the backward pass, so its memory
        does not grow with the number of targets.  ``"auto"`` takes it for a
        ``torch.nn.Module`` when exactly one of ``x1``, ``x2`` requires grad and the other
        side's factors (estimated from the first samples of ``x1``) would take more than a
        quarter of ``max_memory``; ``True`` takes it whenever exactly one side requires grad;
        ``False`` never (needed for double backward: the checkpointed backward is
        once-differentiable).  ``batch_size`` is then the target chunk size.
    check_finite : bool, default True
        Check that the floating entries of ``x1`` and ``x2``, the model's parameters (and
        torch buffers) and the Jacobian factors are finite (one reduction per array; an
        integer input needs none).  ``False`` skips these checks (a NaN/Inf then gives a NaN
        kernel).

    Returns
    -------
    array
        In the inputs' namespace and device: (N1, N2, O, O), (N1, N2) or (N1, N2, O), with a
        leading (B,) axis when ``layerwise``.

    Raises
    ------
    TypeError
        No provider for ``model``; ``x1``/``x2`` not arrays or of different libraries; a bad
        ``layerwise``/``progress``/``check_finite``; an input whose floating dtype differs from
        every floating parameter's when the model fails on it (the input is named).
    ValueError
        A bad ``mode``, ``batch_size``, ``checkpoint`` or ``max_memory``; inputs without a
        sample axis or with no samples; NaN/Inf in ``x1``, ``x2``, a parameter or buffer
        (named) or a Jacobian factor (``check_finite``); ``x2`` with a per-sample shape unlike
        ``x1``'s when the model fails on it.
    """
    return _kernel(model, x1, x2, mode=mode, layerwise=layerwise, max_memory=max_memory,
                   params=params, progress=progress, dtype=dtype, pseudo=False,
                   batch_size=batch_size, checkpoint=checkpoint, check_finite=check_finite)


@capabilities(note={"torch": "torch.nn.Module (CPU and CUDA) or models.MLP",
                    "jax": "(apply_fn, params) or models.MLP"})
def pseudo_ntk(model: Any, x1: Array, x2: Array | None = None, *, layerwise: bool = False,
               max_memory: Any = None, params: Any = None, progress: Any = None,
               dtype: Any = None, batch_size: int | None = None,
               checkpoint: bool | str = "auto", check_finite: bool = True) -> Array:
    r"""The pseudo-NTK: the kernel of :math:`\bar f = \sum_o f_o / \sqrt{O}`.

    .. math:: \hat\Theta[n, m] = \langle \nabla_\theta \bar f(x_n), \nabla_\theta \bar f(x'_m)
              \rangle = \frac{1}{O} \sum_{o, p} \Theta[n, m, o, p] .

    The provider builds the Jacobian of :math:`\bar f` with one backward pass, so the cost is
    that of a single-output model (O times less than :func:`ntk` in ``full`` mode).

    Parameters
    ----------
    model, x1, x2, layerwise, max_memory, params, progress, dtype, batch_size, checkpoint
        As for :func:`ntk` (differentiable in the inputs, with the same checkpointed path).
    check_finite : bool, default True
        As for :func:`ntk`.

    Returns
    -------
    array
        (N1, N2), or (B, N1, N2) when ``layerwise``.

    Raises
    ------
    TypeError, ValueError
        As for :func:`ntk`.
    """
    return _kernel(model, x1, x2, mode="trace", layerwise=layerwise, max_memory=max_memory,
                   params=params, progress=progress, dtype=dtype, pseudo=True,
                   batch_size=batch_size, checkpoint=checkpoint, check_finite=check_finite)
