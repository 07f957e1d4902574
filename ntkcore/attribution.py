r"""Training-data attribution in the TRAK form from projected eNTK features.

:class:`TRAK` scores training samples against test samples,
:math:`T = \Phi_*(\Phi^\top\Phi + \lambda I)^{-1}\Phi^\top Q`, with :math:`\Phi` the
projected gradients of an output function (:data:`OUTPUTS`) from :func:`ntkcore.features`.
A model kind with an adapter (:data:`ADAPTERS`: torch, JAX) is wrapped into a one-output model
of ``(x, y)`` in ``ntkcore.backends``; any other model goes through the chain rule on its
full-mode features.  Math, conventions and choices: docs/attribution.md.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import array_api_compat

from ._typing import Array
from ._validation import all_finite, check_scalar, check_size, namespace_of
from .feature_regression import PRIMAL_COPIES
from .features import feature_batches
from .providers import find_provider
from .regression import cholesky_with_jitter
from .sketch import spawn_seed
from .support import TRIANGULAR_SOLVE, capabilities

__all__ = [
    "ADAPTERS",
    "OUTPUTS",
    "TRAK",
    "Custom",
    "Margin",
    "ModelAdapter",
    "Output",
    "OutputFunction",
    "register_output",
]


# -- output functions ---------------------------------------------------------------------
class OutputFunction:
    r"""The function :math:`f(z) = f(\mathrm{outputs}(x), y)` whose gradients TRAK projects,
    and its loss weights :math:`Q` (TRAK's ``out_to_loss``).

    A variant implements :meth:`value` (differentiable array-API code: the model adapters
    differentiate through it with the framework's autograd), :meth:`loss_weights` and, for
    models without an adapter, :meth:`output_grad`.  ``outputs`` is (N, O), ``targets`` the
    user's ``y`` rows (or None)."""

    name: ClassVar[str] = ""
    #: Whether ``fit``/``score`` need ``y``.
    needs_targets: ClassVar[bool] = True

    def check(self, xp: Any, targets: Array | None, num_outputs: int, name: str) -> None:
        """Raise a clear error for targets this function cannot use."""

    def value(self, outputs: Array, targets: Array | None) -> Array:
        """:math:`f`, shape (N,)."""
        raise NotImplementedError

    def output_grad(self, outputs: Array, targets: Array | None) -> Array:
        r""":math:`\partial f / \partial \mathrm{outputs}`, shape (N, O)."""
        raise NotImplementedError(
            f"output function {self!r} has no output_grad: it needs a model with an adapter "
            f"({', '.join(ADAPTERS)}), or an output_grad")

    def loss_weights(self, outputs: Array, targets: Array | None) -> Array:
        """:math:`Q`, shape (N,)."""
        xp = array_api_compat.array_namespace(outputs)
        return xp.ones((outputs.shape[0],), dtype=outputs.dtype,
                       device=array_api_compat.device(outputs))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


#: Output functions by name (one line per variant: :func:`register_output`).
OUTPUTS: dict[str, type[OutputFunction]] = {}


def register_output(cls: type[OutputFunction]) -> type[OutputFunction]:
    """Class decorator: register an :class:`OutputFunction` under its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name to be registered")
    OUTPUTS[cls.name] = cls
    return cls


def _onehot(xp: Any, labels: Array, num: int, like: Array) -> Array:
    classes = xp.arange(num, device=array_api_compat.device(like))
    return xp.astype(labels, classes.dtype)[:, None] == classes[None, :]


@register_output
class Margin(OutputFunction):
    r"""TRAK's default for classification: the correct-class margin of the logits
    :math:`\ell` (N, O) and integer labels :math:`y` (N,),

    .. math:: f = \ell_y - \log\sum_{j\ne y} e^{\ell_j} = \log\frac{p_y}{1 - p_y},
              \qquad Q = 1 - p_y = -\partial L/\partial f,

    with :math:`p = \mathrm{softmax}(\ell)` and :math:`L = -\log p_y` the cross-entropy;
    :math:`\partial f/\partial\ell_j = [j = y] - [j \ne y]\, e^{\ell_j}/\sum_{k\ne y}
    e^{\ell_k}`."""

    name = "margin"

    def check(self, xp: Any, targets: Array | None, num_outputs: int, name: str) -> None:
        if targets is None:
            raise ValueError(f"{name} is required: the margin needs the class labels")
        if not xp.isdtype(targets.dtype, "integral"):
            raise TypeError(f"{name} must hold integer class labels for the margin; got "
                            f"dtype {targets.dtype}")
        if targets.ndim != 1:
            raise ValueError(f"{name} must be the class labels, shape (N,); got shape "
                             f"{tuple(targets.shape)}")
        if num_outputs < 2:
            raise ValueError(f"the margin needs at least two classes (outputs); the model has "
                             f"{num_outputs}")
        lo, hi = int(xp.min(targets)), int(xp.max(targets))
        if lo < 0 or hi >= num_outputs:
            raise ValueError(f"{name} holds labels in [{lo}, {hi}] but the model has "
                             f"{num_outputs} outputs (classes 0..{num_outputs - 1})")

    def _parts(self, outputs: Array, targets: Array) -> tuple[Any, Array, Array, Array]:
        xp = array_api_compat.array_namespace(outputs)
        hot = _onehot(xp, targets, outputs.shape[1], outputs)
        correct = xp.sum(xp.where(hot, outputs, xp.zeros_like(outputs)), axis=1)
        others = xp.where(hot, xp.full_like(outputs, -math.inf), outputs)
        top = xp.max(others, axis=1, keepdims=True)
        return xp, hot, correct, (others, top)

    def value(self, outputs: Array, targets: Array | None) -> Array:
        xp, _, correct, (others, top) = self._parts(outputs, targets)
        lse = top[:, 0] + xp.log(xp.sum(xp.exp(others - top), axis=1))
        return correct - lse

    def output_grad(self, outputs: Array, targets: Array | None) -> Array:
        xp, hot, _, (others, top) = self._parts(outputs, targets)
        e = xp.exp(others - top)
        soft = e / xp.sum(e, axis=1, keepdims=True)
        return xp.astype(hot, outputs.dtype) - soft

    def loss_weights(self, outputs: Array, targets: Array | None) -> Array:
        xp, hot, _, _ = self._parts(outputs, targets)
        top = xp.max(outputs, axis=1, keepdims=True)
        e = xp.exp(outputs - top)
        # sum of the other classes' probabilities: 1 - p_y without its cancellation at p_y ~ 1
        return xp.sum(xp.where(hot, xp.zeros_like(e), e), axis=1) / xp.sum(e, axis=1)


@register_output
class Output(OutputFunction):
    r"""Regression: the model's single output itself, :math:`f = \mathrm{outputs}[:, 0]`,
    with :math:`Q = I`.  Then :math:`T_{*i}` is the weight of the training target
    :math:`y_i` in the (projected) eNTK kernel-ridge prediction at the test sample,
    :math:`\hat f(x_*) = \sum_i T_{*i}\, y_i`.  (TRAK's Newton-step derivation for the
    squared loss would weight by the residuals :math:`y_i - f(x_i)`, which vanish at an
    interpolating model; pass them as a :class:`Custom` ``weights`` if wanted.)"""

    name = "output"
    needs_targets = False

    def check(self, xp: Any, targets: Array | None, num_outputs: int, name: str) -> None:
        if num_outputs != 1:
            raise ValueError(f"output='output' takes a model with one output; this one has "
                             f"{num_outputs} (use a Custom output function to choose one)")

    def value(self, outputs: Array, targets: Array | None) -> Array:
        return outputs[:, 0]

    def output_grad(self, outputs: Array, targets: Array | None) -> Array:
        xp = array_api_compat.array_namespace(outputs)
        return xp.ones_like(outputs)


@register_output
class Custom(OutputFunction):
    r"""A user-supplied :math:`f(\mathrm{outputs}, y)` (N,), written with the operations of
    the model's framework (it is differentiated through by its autograd), with optional
    ``weights(outputs, y)`` (:math:`Q`, (N,); default 1) and ``grad(outputs, y)``
    (:math:`\partial f/\partial \mathrm{outputs}`, (N, O); needed only for models without
    an adapter, e.g. :class:`ntkcore.models.MLP`)."""

    name = "custom"
    needs_targets = False  # fn gets None without y

    def __init__(self, fn: Callable[[Array, Any], Array],
                 weights: Callable[[Array, Any], Array] | None = None,
                 grad: Callable[[Array, Any], Array] | None = None) -> None:
        for arg, v in (("fn", fn), ("weights", weights), ("grad", grad)):
            if v is not None and not callable(v):
                raise TypeError(f"Custom {arg} must be callable; got {type(v).__name__}")
        if fn is None:
            raise TypeError("Custom needs fn(outputs, targets) -> (N,)")
        self.fn, self.weights, self.grad = fn, weights, grad

    def value(self, outputs: Array, targets: Array | None) -> Array:
        return self.fn(outputs, targets)

    def output_grad(self, outputs: Array, targets: Array | None) -> Array:
        if self.grad is None:
            return super().output_grad(outputs, targets)
        return self.grad(outputs, targets)

    def loss_weights(self, outputs: Array, targets: Array | None) -> Array:
        if self.weights is None:
            return super().loss_weights(outputs, targets)
        return self.weights(outputs, targets)

    def __repr__(self) -> str:
        return f"Custom({getattr(self.fn, '__name__', self.fn)!r})"


def output_function(output: Any) -> OutputFunction:
    """An :class:`OutputFunction` from a name of :data:`OUTPUTS`, an instance or a callable
    (wrapped in :class:`Custom`)."""
    if isinstance(output, OutputFunction):
        return output
    if isinstance(output, str):
        cls = OUTPUTS.get(output)
        if cls is None or cls is Custom:
            names = tuple(k for k, c in OUTPUTS.items() if c is not Custom)
            raise ValueError(f"output must be one of {names}, an OutputFunction or a callable "
                             f"f(outputs, targets); got {output!r}")
        return cls()
    if callable(output):
        return Custom(output)
    raise TypeError(f"output must be a name, an OutputFunction or a callable; got "
                    f"{type(output).__name__}")


# -- model adapters ---------------------------------------------------------------------
class ModelAdapter:
    r"""How one kind of model gives its outputs and a one-output model of ``(x, y)``.

    The generic adapter (any provider, pure array API) calls ``model(x)`` for the outputs and
    has no one-output model: :class:`TRAK` then contracts the full-mode features with
    :meth:`OutputFunction.output_grad` (chain rule, exact: one projection for all outputs).
    Framework adapters (``ntkcore.backends.torch_attribution``,
    ``ntkcore.backends.jax_attribution``) wrap the model so that its Jacobian has one output
    (cheaper by O)."""

    def outputs(self, model: Any, x: Array) -> Array:
        """The model's outputs on ``x``, (N, O), without tracking gradients."""
        out = model(x)
        return out if out.ndim == 2 else array_api_compat.array_namespace(out).reshape(
            out, (out.shape[0], -1))

    def loss_weights(self, fn: OutputFunction, outputs: Array, targets: Array | None) -> Array:
        """``fn.loss_weights(outputs, targets)`` (a framework may compile it)."""
        return fn.loss_weights(outputs, targets)

    def one_output(self, model: Any, fn: OutputFunction, x: Array, targets: Array | None
                   ) -> tuple[Any, Array] | None:
        """``(model1, z)``: a one-output model and its inputs (one row per sample) with
        :math:`\\mathrm{model1}(z) = f(\\mathrm{model}(x), y)[:, None]`, or None."""
        return None


#: Adapters by provider name: ``(module, attribute)`` loaded on first use; any other
#: provider gets the generic :class:`ModelAdapter`.
ADAPTERS: dict[str, tuple[str, str]] = {
    "torch": ("ntkcore.backends.torch_attribution", "ADAPTER"),
    "jax": ("ntkcore.backends.jax_attribution", "ADAPTER"),
}


def adapter_for(model: Any) -> ModelAdapter:
    entry = ADAPTERS.get(find_provider(model).name)
    if entry is None:
        return ModelAdapter()
    return getattr(importlib.import_module(entry[0]), entry[1])


# -- TRAK ---------------------------------------------------------------------------------
def _seeds(seed: Any) -> tuple[int, ...]:
    items = seed if isinstance(seed, Sequence) and not isinstance(seed, str) else (seed,)
    out = []
    for s in items:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise TypeError(f"seed must be a non-negative integer or a sequence of them (one "
                            f"projection per seed, reused for the test samples); got {s!r}")
        out.append(int(s))
    if not out:
        raise ValueError("seed is an empty sequence: give at least one projection seed")
    return tuple(out)


def _checkpoints(model: Any) -> tuple[Any, ...]:
    if isinstance(model, list):
        if not model:
            raise ValueError("model is an empty list: give at least one checkpoint")
        models = tuple(model)
    else:
        models = (model,)
    for i, m in enumerate(models):
        find_provider(m)  # TypeError naming the model kind when no provider knows it
        if isinstance(m, list):
            raise TypeError(f"model[{i}] is a list; pass one flat list of checkpoints")
    return models


#: Rows per Zarr chunk of a stored member (``TRAK(store=...)``): a resume recomputes at most
#: this many samples.
STORE_CHUNK_ROWS = 4096


class _Member:
    """One (checkpoint, seed) of the ensemble: its training features (in memory, or a stored
    ``[Phi | Q]`` read by row chunks), loss weights and the Cholesky factor of its system
    (primal dim x dim or dual N x N)."""

    def __init__(self, model: Any, seed: int) -> None:
        self.model, self.seed = model, seed
        self.phi: Array | None = None
        self.stored: Any = None  # a lazy (N, width + 1) array of the store
        self.like: Array | None = None  # namespace, device and dtype of the features
        self.q: Array | None = None
        self.factor: Array | None = None
        self.primal = True
        self.jitter: Any = 0.0

    def blocks(self) -> Iterator[Array]:
        """The training features by row blocks, in the features' namespace and device."""
        if self.stored is None:
            yield self.phi
            return
        xp = array_api_compat.array_namespace(self.like)
        for b in range(self.stored.numblocks[0]):
            host = self.stored.blocks[b, :].compute()[:, :-1]
            yield xp.asarray(host, dtype=self.like.dtype,
                             device=array_api_compat.device(self.like))


@capabilities(name="attribution.TRAK", fast=TRIANGULAR_SOLVE, note={
    "numpy": "models.MLP (chain rule on full-mode features)",
    "torch": "torch.nn.Module, CPU and CUDA (one-output wrapper), or models.MLP",
    "cupy": "models.MLP (chain rule on full-mode features)",
    "jax": "(apply_fn, params) (composition) or models.MLP",
    "array_api_strict": "models.MLP (chain rule on full-mode features)"})
class TRAK:
    r"""TRAK attribution scores (Park et al., 2023) from ntkcore's projected features.

    .. math:: T = \frac{1}{CS}\sum_{c,s} \Phi_{*cs}\,(\Phi_{cs}^\top\Phi_{cs} + \lambda I)^{-1}
              \Phi_{cs}^\top \;\cdot\; \mathrm{diag}\Big(\frac1C\sum_c Q_c\Big)
              \qquad (M, N)

    over checkpoints :math:`c` and projection seeds :math:`s`, with
    :math:`\Phi_{cs}` (N, dim) the features of the output function's gradients
    (:func:`ntkcore.features`; :math:`\mathbb{E}[\Phi\Phi^\top]` is its eNTK) and
    :math:`Q_c` its loss weights (:class:`Margin`: :math:`1 - p_y`).  The ensemble average
    is traker's (per-member scores averaged, then multiplied by the averaged Q), without its
    per-member rescaling by the mean of :math:`|(\Phi^\top\Phi)^{-1}|`.  Each member is
    solved on the smaller side: the primal dim x dim system while dim < N, else the dual
    :math:`\Phi_*\Phi^\top(\Phi\Phi^\top + \lambda I)^{-1}` (equal by the push-through
    identity; at :math:`\lambda = 0` the limit :math:`\lambda \to 0^+`, the pseudo-inverse),
    with ntkcore's Cholesky and its jitter policy.

    Parameters
    ----------
    model : model or list of models
        A ``torch.nn.Module``, a JAX ``(apply_fn, params)`` pair, an
        :class:`ntkcore.models.MLP` or any model with a Jacobian provider; a list is an
        ensemble of checkpoints (several trained models or several states of one).
    dim : int or None
        Feature columns per member (:func:`ntkcore.features`).  ``None``: exact TRAK, the
        kernel form :math:`K_*(K + \lambda I)^{-1} Q` from the unprojected eNTK of the output
        function (:func:`ntkcore.ntk`; N x N memory, one member per checkpoint, ``seed``,
        ``store`` and the projection options unused).
    seed : int or sequence of int
        Projection seed(s); each is one member per checkpoint.  Checkpoint 0 projects with the
        seed itself (``features(..., seed=seed)``), checkpoint c > 0 with its child
        ``ntkcore.sketch.spawn_seed(seed, c)``, so that every member has its own projection.
        The test features of a member use its projection.
    output : str, OutputFunction or callable
        ``"margin"`` (default, classification), ``"output"`` (one-output regression), an
        :class:`OutputFunction` or ``f(outputs, targets)`` (:class:`Custom`, Q = 1).
    reg : float
        :math:`\lambda \ge 0`; TRAK's default 0.
    max_memory : int, float or str, optional
        Working memory of the feature batches and the dim x dim matrices of the solve (the
        results, N dim per member and the M N scores, are not counted; nor is the (batch, N)
        block of scores of a test batch).
    kronecker : {"pairs", "grid"}
        Layout of the Kronecker projections; "pairs" (default) has TRAK's 1/dim variance.
    method, params, check_finite
        As for :func:`ntkcore.features`.
    probe : int or (x_probe, y_probe), optional
        Split ``dim`` over the layers by their shares of the kernel trace on these samples
        (the first ``probe`` training samples, or the given inputs and targets), as
        ``ntkcore.features(probe=...)``; default: equal shares.
    jitter : "auto", float or None
        Jitter policy of the Cholesky (:func:`ntkcore.kernel_regression`).

    store : str or PathLike, optional
        A directory for the training features: member ``i`` (checkpoint-major) keeps
        ``[Phi | Q]`` in the Zarr store ``<store>/member-<i>``, written in chunks of
        :data:`STORE_CHUNK_ROWS` samples by :func:`ntkcore.distributed.to_zarr` (completion
        markers, fingerprint of model, inputs, targets and options, writer lock): a fit that
        was killed resumes with the chunks it had finished; a store of another computation is
        refused.  Needs ``ntkcore[dask]``.  Default: features in memory.
    key : str, optional
        Your label of the stored computation (:func:`ntkcore.distributed.to_zarr`).

    Attributes
    ----------
    features_ : tuple of arrays
        The training features (N, width) of each member (checkpoint-major), width = dim or
        less (:func:`ntkcore.features`); with ``store``, lazy dask arrays of the stores.
    weights_ : array
        (N,): the loss weights averaged over the checkpoints.
    jitter_ : tuple of float
        The jitter each member's Cholesky needed (0.0: none).
    """

    def __init__(self, model: Any, *, dim: int | None, seed: Any = 0, output: Any = "margin",
                 reg: float = 0.0, max_memory: Any = None, kronecker: str = "pairs",
                 method: str = "auto", params: Any = None, probe: Any = None,
                 jitter: str | float | None = "auto", check_finite: bool = True,
                 store: Any = None, key: str | None = None) -> None:
        self.models = _checkpoints(model)
        self.dim = None if dim is None else check_size(dim, "dim")
        self.seeds = _seeds(seed) if dim is not None else (0,)
        self.output = output_function(output)
        self.reg = check_scalar(reg, "reg", nonnegative=True)
        self.max_memory = max_memory
        self.options = {"method": method, "params": params, "probe": probe,
                        "kronecker": kronecker, "check_finite": check_finite}
        self.jitter = jitter
        if store is not None and not isinstance(store, str) and not hasattr(store, "__fspath__"):
            raise TypeError(f"store must be a directory path; got {type(store).__name__}")
        if key is not None and not isinstance(key, str):
            raise TypeError(f"key must be a string or None; got {type(key).__name__}")
        self.store, self.key = store, key
        self._members: list[_Member] = []
        self._n: int | None = None

    # -- inputs ---------------------------------------------------------------------------
    def _inputs(self, x: Array, y: Array | None, which: str) -> tuple[Any, Any]:
        xn, yn = f"x_{which}", f"y_{which}"
        xp, backend = namespace_of(**{xn: x, yn: y})
        if x.ndim < 1 or x.shape[0] == 0:
            raise ValueError(f"{xn} must lead with a non-empty sample axis; got shape "
                             f"{tuple(x.shape)}")
        if y is None and self.output.needs_targets:
            raise ValueError(f"{yn} is required by output {self.output!r}")
        if y is not None:
            if y.ndim < 1 or y.shape[0] != x.shape[0]:
                raise ValueError(f"{yn} must have one row per sample of {xn} "
                                 f"({x.shape[0]}); got shape {tuple(y.shape)}")
            if not all_finite(xp, y):
                raise ValueError(f"{yn} contains NaN or Inf")
        if self.options["check_finite"] and not all_finite(xp, x):
            raise ValueError(f"{xn} contains NaN or Inf")
        return xp, backend

    def _stream(self, member: _Member, x: Array, y: Array | None, which: str,
                reserve: Callable[[int, int], float] | None, weights: bool = True
                ) -> Iterator[tuple[int, int, Array, Array | None]]:
        """``(start, stop, phi, q)`` by sample batches of ``x``: the member's features of the
        output function (stop - start, dim) and its loss weights (None unless ``weights``;
        a model with an adapter then needs no forward pass beyond the provider's)."""
        model, fn = member.model, self.output
        adapter = adapter_for(model)
        first = adapter.outputs(model, x[0:1, ...])
        fn.check(array_api_compat.array_namespace(first), y, int(first.shape[1]), f"y_{which}")
        composed = adapter.one_output(model, fn, x, y)
        src, z, mode = (model, x, "full") if composed is None else (*composed, "trace")
        options = dict(self.options, probe=self._probe(adapter, model, composed))
        for _, start, stop, phi in feature_batches(
                src, z, dim=self.dim, seed=member.seed, mode=mode, max_memory=self.max_memory,
                reserve=reserve, **options):
            xp = array_api_compat.array_namespace(phi)
            if composed is not None and not weights:
                yield start, stop, phi, None
                continue
            out = adapter.outputs(model, x[start:stop, ...])
            t = None if y is None else y[start:stop, ...]
            if composed is None:  # chain rule on the full-mode features (N, O, dim)
                w = xp.astype(fn.output_grad(out, t), phi.dtype)
                phi = xp.sum(w[:, :, None] * phi, axis=1)
            if not weights:
                yield start, stop, phi, None
                continue
            q = xp.astype(adapter.loss_weights(fn, out, t), phi.dtype)
            if not all_finite(xp, q):
                raise ValueError(f"the loss weights Q of samples {start}:{stop} of x_{which} "
                                 "contain NaN or Inf (non-finite model outputs)")
            yield start, stop, phi, q

    def _probe(self, adapter: ModelAdapter, model: Any, composed: Any) -> Any:
        """The ``probe`` of :func:`ntkcore.features` for a member: None, or the fitted probe
        samples ``(x, y)`` as the member's model takes them (composed like the training
        samples), the same in ``fit`` and ``score``."""
        if self.probe_ is None:
            return None
        x, y = self.probe_
        return x if composed is None else adapter.one_output(model, self.output, x, y)[1]

    # -- fit and score --------------------------------------------------------------------
    def fit(self, x_train: Array, y_train: Array | None = None) -> TRAK:
        """Featurize the training set for every member, factor its system.

        Parameters
        ----------
        x_train : array, shape (N, ...)
            The model's inputs.
        y_train : array, shape (N,) or (N, ...), optional
            Targets of the output function (class labels for the margin).

        Returns
        -------
        self
        """
        self._inputs(x_train, y_train, "train")
        probe = self.options["probe"]
        if isinstance(probe, int) and not isinstance(probe, bool):  # fixed here, for score too
            k = max(1, probe)
            probe = (x_train[0:k, ...], None if y_train is None else y_train[0:k, ...])
        elif probe is not None and not (isinstance(probe, tuple) and len(probe) == 2):
            raise TypeError("probe must be None, a number of training samples, or a pair "
                            f"(x_probe, y_probe); got {type(probe).__name__}")
        self.probe_ = probe
        # checkpoint c > 0 projects with a child of each seed, so that no two members share
        # a projection (traker: one projection per model id); checkpoint 0 uses the seed itself
        members = [_Member(m, s if c == 0 else spawn_seed(s, c))
                   for c, m in enumerate(self.models) for s in self.seeds]
        if self.dim is None:
            return self._fit_exact(members, x_train, y_train)

        chunk = 0 if self.store is None else min(int(x_train.shape[0]), STORE_CHUNK_ROWS)

        def reserve(dim: int, item: int) -> float:  # the solve's matrices; a stored chunk
            return item * (PRIMAL_COPIES * dim * dim + 2 * chunk * (dim + 1))  # (and its copy)

        q_sum = None
        n = int(x_train.shape[0])
        for i, mem in enumerate(members):
            if self.store is None:
                mem.phi, mem.q = self._featurize(mem, x_train, y_train, 0, n, reserve)
                mem.like = mem.phi
            else:
                self._write_store(i, mem, x_train, y_train, reserve)
            xp, backend = namespace_of(features=mem.like)
            mem.primal = int(mem.like.shape[1]) < n
            if mem.stored is not None and not mem.primal:  # dual: N <= width, in memory
                mem.phi = xp.concat(list(mem.blocks()), axis=0)
                mem.stored = None
            a = None
            for blk in mem.blocks():
                part = blk.T @ blk if mem.primal else blk @ blk.T
                a = part if a is None else a + part
            q = mem.q
            name = "Phi^T Phi" if mem.primal else "Phi Phi^T"
            mem.factor, mem.jitter = cholesky_with_jitter(
                xp, backend, (a + a.T) / 2, reg=self.reg, jitter=self.jitter,
                name=f"{name} of member {i} (checkpoint {i // len(self.seeds)}, seed "
                     f"{mem.seed})")
            if i % len(self.seeds) == 0:
                q_sum = q if q_sum is None else q_sum + q
        self._members = members
        self._n = n
        self.features_ = tuple(m.phi if m.stored is None else m.stored[:, :-1]
                               for m in members)
        self.weights_ = q_sum / len(self.models)
        self.jitter_ = tuple(m.jitter for m in members)
        return self

    def _kernel(self, mem: _Member, x1: Array, y1: Array | None, x2: Array | None = None,
                y2: Array | None = None, which: str = "train") -> Array:
        """The exact eNTK of the output function, (N1, N2): of the one-output model, or the
        full-mode kernel contracted with the output gradients (chain rule)."""
        from ._api import ntk

        model, fn = mem.model, self.output
        adapter = adapter_for(model)
        first = adapter.outputs(model, x1[0:1, ...])
        fn.check(array_api_compat.array_namespace(first), y1, int(first.shape[1]), f"y_{which}")
        kw = {"params": self.options["params"], "max_memory": self.max_memory,
              "check_finite": self.options["check_finite"]}
        c1 = adapter.one_output(model, fn, x1, y1)
        if c1 is not None:
            z2 = None if x2 is None else adapter.one_output(model, fn, x2, y2)[1]
            return ntk(c1[0], c1[1], z2, mode="trace", **kw)
        k = ntk(model, x1, x2, mode="full", **kw)  # (N1, N2, O, O)
        xp = array_api_compat.array_namespace(k)
        w1 = xp.astype(fn.output_grad(adapter.outputs(model, x1), y1), k.dtype)
        w2 = w1 if x2 is None else xp.astype(fn.output_grad(adapter.outputs(model, x2), y2),
                                             k.dtype)
        return xp.sum(w1[:, None, :, None] * k * w2[None, :, None, :], axis=(2, 3))

    def _fit_exact(self, members: list[_Member], x: Array, y: Array | None) -> TRAK:
        """``dim=None``: per checkpoint the kernel K, its factor (dual) and Q."""
        q_sum = None
        for i, mem in enumerate(members):
            k = self._kernel(mem, x, y)
            xp, backend = namespace_of(kernel=k)
            mem.primal, mem.like = False, k
            mem.factor, mem.jitter = cholesky_with_jitter(
                xp, backend, (k + k.T) / 2, reg=self.reg, jitter=self.jitter,
                name=f"the eNTK K of checkpoint {i}")
            adapter = adapter_for(mem.model)
            out = adapter.outputs(mem.model, x)
            mem.q = xp.astype(adapter.loss_weights(self.output, out, y), k.dtype)
            if not all_finite(xp, mem.q):
                raise ValueError("the loss weights Q of x_train contain NaN or Inf "
                                 "(non-finite model outputs)")
            q_sum = mem.q if q_sum is None else q_sum + mem.q
        self._members, self._n = members, int(x.shape[0])
        self._x_train, self._y_train = x, y
        self.features_ = ()
        self.weights_ = q_sum / len(self.models)
        self.jitter_ = tuple(m.jitter for m in members)
        return self

    def _featurize(self, mem: _Member, x: Array, y: Array | None, start: int, stop: int,
                   reserve: Callable[[int, int], float] | None) -> tuple[Array, Array]:
        """The member's features (stop - start, width) and loss weights of those samples."""
        xs = x[start:stop, ...]
        ys = None if y is None else y[start:stop, ...]
        parts, qs = [], []
        for _, _, phi, q in self._stream(mem, xs, ys, "train", reserve):
            parts.append(phi)
            qs.append(q)
        xp = array_api_compat.array_namespace(parts[0])
        return (parts[0] if len(parts) == 1 else xp.concat(parts, axis=0),
                qs[0] if len(qs) == 1 else xp.concat(qs, axis=0))

    def _write_store(self, i: int, mem: _Member, x: Array, y: Array | None,
                     reserve: Callable[[int, int], float]) -> None:
        """Write (or resume) member ``i``'s ``[Phi | Q]`` to ``<store>/member-<i>`` and keep
        the stored array and Q (application layer: ntkcore.distributed, dask and zarr)."""
        import os

        from .distributed._attribution import member_fingerprint, store_features

        probe, _ = self._featurize(mem, x, y, 0, 1, reserve)
        xp = array_api_compat.array_namespace(probe)
        dtype = str(probe.dtype).rsplit(".", 1)[-1]
        options = {"dim": self.dim, "seed": mem.seed, "output": repr(self.output),
                   "output_code": type(self.output).__qualname__,
                   **{k: v for k, v in self.options.items() if k not in ("params", "probe")},
                   "probe": self.probe_ if isinstance(self.options["probe"], tuple)
                   else self.options["probe"]}
        fingerprint = member_fingerprint(mem.model, x, y, self.options["params"], options)
        n = int(x.shape[0])
        mem.stored = store_features(
            lambda a, b: self._featurize(mem, x, y, a, b, reserve), n, int(probe.shape[1]),
            dtype, os.path.join(os.fspath(self.store), f"member-{i}"),
            fingerprint=fingerprint, key=self.key, chunk=min(n, STORE_CHUNK_ROWS))
        mem.like = probe
        mem.q = xp.asarray(mem.stored[:, -1].compute(), dtype=probe.dtype,
                           device=array_api_compat.device(probe))

    def _check_fitted(self) -> None:
        if not self._members:
            raise RuntimeError("this TRAK instance is not fitted yet; call fit(x_train, "
                               "y_train) before score")

    def score(self, x_test: Array, y_test: Array | None = None) -> Array:
        """Scores of every training sample for every test sample.

        Parameters
        ----------
        x_test : array, shape (M, ...)
        y_test : array, shape (M,) or (M, ...), optional
            As ``y_train`` in :meth:`fit`.

        Returns
        -------
        array, shape (M, N)
            ``T[m, i]``: the support of training sample i for the output on test sample m,
            in the namespace, device and dtype of the features.
        """
        self._check_fitted()
        self._inputs(x_test, y_test, "test")
        n = self._n
        k = len(self._members)

        stored = any(m.stored is not None for m in self._members)

        def reserve(dim: int, item: int) -> float:  # the factor, a solve's copy, a read chunk
            return item * (2 * dim * dim + (min(n, STORE_CHUNK_ROWS) * (dim + 1) if stored
                                            else 0))

        total = None
        if self.dim is None:  # exact: K_* (K + lam I)^{-1} per checkpoint
            for mem in self._members:
                ks = self._kernel(mem, x_test, y_test, self._x_train, self._y_train, "test")
                _, backend = namespace_of(kernel=ks)
                s = backend.cho_solve(mem.factor, ks.T).T
                total = s if total is None else total + s
            return (total / k) * self.weights_[None, :]
        for mem in self._members:
            xp, backend = namespace_of(features=mem.like)
            rows = []
            for _, _, phi_s, _ in self._stream(mem, x_test, y_test, "test", reserve,
                                               weights=False):
                if mem.primal:  # Phi_* (Phi^T Phi + lam I)^{-1} Phi^T, by training blocks
                    left = backend.cho_solve(mem.factor, phi_s.T).T
                    cols = [left @ blk.T for blk in mem.blocks()]
                    rows.append(cols[0] if len(cols) == 1 else xp.concat(cols, axis=1))
                else:  # Phi_* Phi^T (Phi Phi^T + lam I)^{-1}
                    rows.append(backend.cho_solve(mem.factor, mem.phi @ phi_s.T).T)
            s = rows[0] if len(rows) == 1 else xp.concat(rows, axis=0)
            total = s if total is None else total + s
        return (total / k) * self.weights_[None, :]

    def __repr__(self) -> str:
        return (f"TRAK(checkpoints={len(self.models)}, dim={self.dim}, seeds={self.seeds}, "
                f"output={self.output!r}, reg={self.reg:g})")
