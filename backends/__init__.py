"""Backends: the only part of ntkcore that knows array frameworks.

:func:`get_backend` maps an array namespace to a :class:`Backend` (linear-algebra extras,
random numbers, device facts).  The framework module is imported only when an array of that
framework is actually seen, so ``import ntkcore`` never pulls in torch, cupy or jax.

=========  ==============================  =============================================
backend    namespace test                  module
=========  ==============================  =============================================
numpy      ``is_numpy_namespace``          ``ntkcore.backends.numpy`` (SciPy LAPACK)
torch      ``is_torch_namespace``          ``ntkcore.backends.torch`` (torch.linalg)
cupy       ``is_cupy_namespace``           ``ntkcore.backends.cupy`` (cupyx.scipy.linalg)
jax        ``is_jax_namespace``            ``ntkcore.backends.jax`` (jax.scipy.linalg)
generic    anything else                   ``ntkcore.backends.generic`` (standard only)
=========  ==============================  =============================================
"""

from __future__ import annotations

import importlib
from typing import Any

import array_api_compat as _compat

from ._protocol import Backend, Generator

__all__ = ["BACKEND_NAMES", "Backend", "Generator", "get_backend", "namespace_and_backend"]

# name -> (namespace predicate, module, class); order matters: first match wins.
_TABLE: tuple[tuple[str, Any, str, str], ...] = (
    ("numpy", _compat.is_numpy_namespace, "numpy", "NumpyBackend"),
    ("torch", _compat.is_torch_namespace, "torch", "TorchBackend"),
    ("cupy", _compat.is_cupy_namespace, "cupy", "CupyBackend"),
    ("jax", _compat.is_jax_namespace, "jax", "JaxBackend"),
)
BACKEND_NAMES = (*tuple(row[0] for row in _TABLE), "generic")

_cache: dict[int, Backend] = {}


def get_backend(xp: Any) -> Backend:
    """The :class:`Backend` serving the array namespace ``xp`` (cached per namespace)."""
    key = id(xp)
    backend = _cache.get(key)
    if backend is None:
        for _name, predicate, module, cls in _TABLE:
            if predicate(xp):
                mod = importlib.import_module(f"{__name__}.{module}")
                backend = getattr(mod, cls)(xp)
                break
        else:
            from .generic import GenericBackend

            backend = GenericBackend(xp)
        _cache[key] = backend
    return backend


def namespace_and_backend(*arrays: Any) -> tuple[Any, Backend]:
    """``(xp, backend)`` for arrays that must share one namespace (``None`` entries ignored)."""
    xp = _compat.array_namespace(*[a for a in arrays if a is not None])
    return xp, get_backend(xp)
