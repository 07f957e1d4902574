"""The backend protocol: what ntkcore needs from an array library beyond the array API standard.

The array API standard has matrix products, ``cholesky`` and ``eigh``, but no triangular
solve, no random numbers and no facts about device memory.  A backend supplies exactly these,
for one array namespace.  ``ntkcore/`` talks to backends only through this protocol; it never
imports a framework itself.

Every backend subclasses :class:`Backend` (the generic implementation lives in
``backends/generic.py`` and is what an unknown namespace gets) and overrides the methods for
which its framework has a faster or more exact primitive.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

Array = Any
Namespace = Any
Device = Any


@runtime_checkable
class Generator(Protocol):
    """A seeded random generator that creates arrays on one device of one namespace.

    All methods return arrays of the backend's namespace on the generator's device.
    """

    def integers(self, low: int, high: int, shape: tuple[int, ...]) -> Array:
        """Uniform integers in ``[low, high)`` of the default integer dtype (int64)."""
        ...

    def choice(
        self, n: int, size: int, *, p: Array | None = None, replace: bool = True
    ) -> Array:
        """``size`` indices from ``range(n)``, with probabilities ``p`` of shape (n,).

        Without replacement and with ``p`` this is successive sampling (draw one index with
        probability proportional to ``p`` among those not drawn yet), as numpy,
        torch.multinomial and jax.random.choice all implement it.
        """
        ...

    def normal(self, shape: tuple[int, ...], dtype: Any) -> Array:
        """Standard normal samples of a real floating ``dtype``."""
        ...

    def uniform(self, shape: tuple[int, ...], dtype: Any) -> Array:
        """Uniform samples on ``[0, 1)`` of a real floating ``dtype``."""
        ...


class Backend:
    """Primitives one array namespace offers beyond the array API standard.

    Attributes
    ----------
    name : str
        Short name (``"numpy"``, ``"torch"``, ``"cupy"``, ``"jax"``, ``"generic"``).
    xp : namespace
        The (array-api-compat wrapped, where needed) namespace the backend serves.
    """

    name: str = "abstract"

    def __init__(self, xp: Namespace) -> None:
        self.xp = xp

    # -- linear algebra -------------------------------------------------------------------
    def cholesky(self, a: Array, *, shift: float = 0.0) -> Array | None:
        """Lower Cholesky factor ``L`` of ``a + shift * I`` for symmetric ``a`` (n, n), or ``None``.

        ``None`` means the factorisation failed (not numerically positive definite).  Only the
        lower triangle of ``a`` is read and ``a`` is never modified; backends add ``shift`` to
        the diagonal of the one copy they factorise in place, where the framework allows it.
        The factor must stay differentiable under the framework's autograd.
        """
        raise NotImplementedError

    def solve_triangular(
        self, a: Array, b: Array, *, lower: bool = True, transpose: bool = False
    ) -> Array:
        """Solve ``op(a) x = b`` for triangular ``a`` (n, n) and ``b`` (n,) or (n, k).

        ``op(a) = a.T`` when ``transpose`` else ``a``; ``lower`` states which triangle of ``a``
        holds the matrix.
        """
        raise NotImplementedError

    def cho_solve(self, l: Array, b: Array) -> Array:
        """Solve ``(l l^T) x = b`` for the lower Cholesky factor ``l`` (n, n); b (n,) or (n, k)."""
        y = self.solve_triangular(l, b, lower=True, transpose=False)
        return self.solve_triangular(l, y, lower=True, transpose=True)

    def stop_gradient(self, x: Array) -> Array:
        """``x`` cut from the autograd graph (identity for libraries without autograd)."""
        return x

    def tracks_gradient(self, *xs: Array) -> bool:
        """Whether any of ``xs`` is being differentiated (an autograd graph or a tracer)."""
        return False

    def scalar(self, x: Array) -> float:
        """A 0-d array as a Python float (outside any autograd graph; syncs the device)."""
        return float(x)

    # Optional: ``erf(x)``, the error function elementwise.  The standard has none; backends
    # that define it give ntkcore.models an exact, fast erf/gelu (the fallback is a pure
    # array-API series accurate to float64 rounding).

    # -- random numbers -------------------------------------------------------------------
    def generator(self, seed: int | None, device: Device) -> Generator:
        """A :class:`Generator` seeded with ``seed`` (``None``: fresh entropy) on ``device``."""
        raise NotImplementedError

    # -- device facts -----------------------------------------------------------------------
    def free_memory(self, device: Device) -> int | None:
        """Bytes that can still be allocated on ``device``; ``None`` when unknown."""
        return None

    def synchronize(self, device: Device) -> None:
        """Wait until all work queued on ``device`` has finished (for honest timings)."""
        return None

    def is_gpu(self, device: Device) -> bool:
        """Whether ``device`` is an accelerator."""
        return False

    def __repr__(self) -> str:
        return f"<ntkcore backend {self.name!r}>"
