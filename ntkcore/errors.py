"""Exceptions and warnings raised by ntkcore."""

from __future__ import annotations


class NotPositiveDefiniteError(ValueError):
    """A matrix that must be symmetric positive definite is not, even after the allowed jitter."""


class JitterWarning(RuntimeWarning):
    """A Cholesky factorisation needed diagonal jitter to succeed; the message states how much."""


class BudgetTooSmallError(ValueError):
    """``max_memory`` cannot hold the smallest useful tile of a kernel (``min(N, 8)`` samples a
    side, ``MIN_TILE_SAMPLES`` in ``ntkcore/gram.py``); the message quotes the budget given and
    the smallest one that works.

    ``given`` is the budget in bytes the planner got, ``needed`` the smallest that works."""

    def __init__(self, message: str, given: int, needed: int) -> None:
        super().__init__(message)
        self.given = given
        self.needed = needed
