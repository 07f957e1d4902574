"""Exceptions and warnings raised by ntkcore."""

from __future__ import annotations


class NotPositiveDefiniteError(ValueError):
    """A matrix that must be symmetric positive definite is not, even after the allowed jitter."""


class JitterWarning(RuntimeWarning):
    """A Cholesky factorisation needed diagonal jitter to succeed; the message states how much."""
