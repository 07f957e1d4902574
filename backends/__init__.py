"""Backends: the only part of ntkcore that knows array frameworks.

Each module implements the :class:`~ntkcore.backend.Backend` protocol for one framework; the
protocol and the registry that maps an array namespace to its module live in the core,
:mod:`ntkcore.backend`, which imports a module here only when an array of that framework is
actually seen.  The names below are re-exported from there.
"""

from __future__ import annotations

from ntkcore.backend import (
    BACKEND_NAMES,
    Backend,
    Generator,
    get_backend,
    namespace_and_backend,
    register_backend,
)

__all__ = ["BACKEND_NAMES", "Backend", "Generator", "get_backend", "namespace_and_backend",
           "register_backend"]
