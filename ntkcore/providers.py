"""The Jacobian-provider registry: how ``ntk()`` turns a model into a :class:`~ntkcore.Jacobian`.

A provider knows one kind of model (a ``torch.nn.Module``, a JAX ``(apply_fn, params)`` pair,
an :class:`ntkcore.models.MLP`, ...) and returns its per-sample Jacobian with as much Kronecker
structure as it can find.  Providers register a cheap *matcher* and a *loader*; the loader
imports the framework-specific module only when a matching model is actually seen, so ntkcore
itself never imports a framework.

Provider call signature::

    jacobian(model, x, *, params=None, pseudo=False, **options) -> Jacobian

``x`` leads with the sample axis N.  ``params`` restricts the Jacobian to a subset of the
parameters (provider-specific: names or tensors); ``pseudo=True`` asks for the Jacobian of
:math:`\\sum_o f_o / \\sqrt{O}` (O = 1), the pseudo-NTK, which providers compute with one
backward pass instead of O.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Provider", "find_provider", "register_provider", "registered_providers"]


@dataclass(frozen=True)
class Provider:
    """One registered provider.

    Attributes
    ----------
    name : str
        Short name (``"torch"``, ``"jax"``, ``"mlp"``).
    matches : callable
        ``matches(model) -> bool``; must not import a framework.
    load : callable
        ``load() -> jacobian_function`` (imports the framework module lazily).
    capabilities : mapping of str to callable
        What the provider offers beyond the Jacobian, each a loader like ``load``.  Known
        capability: ``"checkpointed_ntk"``, loading ``f(model, x1, x2, *, mode, layerwise,
        pseudo, params, max_memory, dtype, batch_size) -> kernel`` for one input requiring
        grad (used by :func:`ntkcore.ntk`'s ``checkpoint`` option); ``"outputs"``, loading
        ``jacobian(model, x, *, outputs=(start, stop), **options)``, the Jacobian of the
        flattened outputs ``start:stop`` only (used by :func:`ntkcore.ntk` to compute trace
        and diagonal kernels in output chunks when the factors of all outputs exceed the
        budget); ``"dense_if_smaller"``, loading ``jacobian(model, x, *,
        dense_if_smaller=True, **options)`` (with ``outputs=`` and ``measure_work=`` too
        where the provider has those capabilities), a Jacobian whose blocks may be the
        dense per-sample gradient where that is smaller than their factors, chosen from
        shapes alone, never from N (used by :func:`ntkcore.ntk`, whose kernels are the same
        either way); ``"work_nbytes"``,
        loading ``jacobian(model, x, *, measure_work=True, **options)`` (the other options
        as above), a Jacobian whose :attr:`~ntkcore.Jacobian.work_nbytes` is set (used by
        :func:`ntkcore.ntk`'s one-sample probe); ``"block_params"``, loading ``f(model, jac,
        params) -> list of list of str``, the ``params`` selection of each block of ``jac`` (a
        Jacobian of the provider with that ``params``), such that the provider called with
        the selections of consecutive blocks returns exactly those blocks (used by
        :func:`ntkcore.ntk` to compute a kernel whose factors exceed the budget as a sum over
        groups of blocks, :func:`ntkcore._api._param_groups`).
    """

    name: str
    matches: Callable[[Any], bool]
    load: Callable[[], Callable[..., Any]]
    capabilities: Mapping[str, Callable[[], Callable[..., Any]]] = field(
        default_factory=dict, compare=False)

    def jacobian(self, model: Any, x: Any, **kwargs: Any) -> Any:
        return self.load()(model, x, **kwargs)


_REGISTRY: list[Provider] = []


def register_provider(
    name: str,
    matches: Callable[[Any], bool],
    load: Callable[[], Callable[..., Any]],
    *,
    first: bool = False,
    capabilities: Mapping[str, Callable[[], Callable[..., Any]]] | None = None,
) -> None:
    """Register a provider (``first=True`` puts it before the existing ones).

    ``capabilities`` maps a capability name to a lazy loader (see :class:`Provider`).
    """
    global _REGISTRY
    _REGISTRY = [p for p in _REGISTRY if p.name != name]
    entry = Provider(name, matches, load, dict(capabilities or {}))
    if first:
        _REGISTRY.insert(0, entry)
    else:
        _REGISTRY.append(entry)


def registered_providers() -> tuple[Provider, ...]:
    return tuple(_REGISTRY)


def find_provider(model: Any) -> Provider:
    """The first registered provider whose matcher accepts ``model``.

    Raises
    ------
    TypeError
        If no provider knows this kind of model.
    """
    for p in _REGISTRY:
        if p.matches(model):
            return p
    names = ", ".join(p.name for p in _REGISTRY)
    raise TypeError(
        f"model of type {type(model).__module__}.{type(model).__qualname__} has no Jacobian "
        f"provider (registered: {names}); pass a torch.nn.Module, an ntkcore.models.MLP, a "
        "(apply_fn, params) pair for JAX, or register one with "
        "ntkcore.providers.register_provider"
    )


def _mro_names(obj: Any) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__}


def _loader(module: str, attr: str) -> Callable[[], Callable[..., Any]]:
    return lambda: getattr(importlib.import_module(module), attr)


def _is_torch_module(model: Any) -> bool:
    return "torch.nn.modules.module.Module" in _mro_names(model)


def _is_jax_pair(model: Any) -> bool:
    return (
        isinstance(model, tuple)
        and len(model) == 2
        and callable(model[0])
        and not _is_torch_module(model[0])
    )


def _is_mlp(model: Any) -> bool:
    from .models import MLP  # pure array API: no framework import

    return isinstance(model, MLP)


register_provider(
    "torch", _is_torch_module, _loader("ntkcore.backends.torch_jacobian", "jacobian"),
    capabilities={"checkpointed_ntk": _loader("ntkcore.backends.torch_kip", "checkpointed_ntk"),
                  "outputs": _loader("ntkcore.backends.torch_jacobian", "jacobian"),
                  "dense_if_smaller": _loader("ntkcore.backends.torch_jacobian", "jacobian"),
                  "work_nbytes": _loader("ntkcore.backends.torch_jacobian", "jacobian"),
                  "block_params": _loader("ntkcore.backends.torch_jacobian", "block_params")})
register_provider("mlp", _is_mlp, _loader("ntkcore.models", "_mlp_provider"), first=True)
# The JAX entry is an adapter taking the (apply_fn, params) pair as ``model``; the public
# ntkcore.backends.jax.jacobian(apply_fn, params, x) takes them separately.
register_provider("jax", _is_jax_pair, _loader("ntkcore.backends.jax_provider", "provider"),
                  capabilities={"outputs": _loader("ntkcore.backends.jax_provider", "provider"),
                                "dense_if_smaller": _loader("ntkcore.backends.jax_provider",
                                                            "provider")})
