"""NumPy backend: SciPy's LAPACK wrappers, NumPy's PCG64 generator and SciPy operators."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg
import scipy.special

from ntkcore.backend import Array, Device
from ntkcore.linop import LinearOperator

from .generic import GenericBackend, HostGenerator


class NumpyBackend(GenericBackend):
    """Backend for ``numpy`` arrays (host memory)."""

    name = "numpy"

    def cholesky(self, a: Array, *, shift: float = 0.0) -> Array | None:
        # One C-ordered copy, factorised in place by LAPACK potrf as the upper factor of its
        # (Fortran-ordered) transpose, which is how scipy.linalg.cho_factor treats C arrays;
        # np.linalg.cholesky was several times slower on the development machine.
        work = np.array(a, order="C", copy=True)
        n = work.shape[0]
        if shift:
            work.flat[:: n + 1] += shift
        try:
            u = scipy.linalg.cholesky(work.T, lower=False, overwrite_a=True, check_finite=False)
        except np.linalg.LinAlgError:
            return None
        l = u.T  # C-ordered lower factor (the same memory as `work` when LAPACK wrote in place)
        for i in range(n - 1):  # zero the strict upper triangle row by row, in place
            l[i, i + 1:] = 0
        return l

    def solve_triangular(
        self, a: Array, b: Array, *, lower: bool = True, transpose: bool = False
    ) -> Array:
        return scipy.linalg.solve_triangular(
            a, b, lower=lower, trans="T" if transpose else "N", check_finite=False
        )

    def cho_solve(self, l: Array, b: Array) -> Array:
        return scipy.linalg.cho_solve((l, True), b, check_finite=False)

    def erf(self, x: Array) -> Array:
        return scipy.special.erf(x)

    fast_scatter_add = True

    def scatter_add(self, idx: Array, x: Array, size: int) -> Array:
        # one bincount over (row, column) cells: faster than np.add.at; it sums in float64
        k = x.shape[1]
        keep = idx >= 0
        if not keep.all():
            idx, x = idx[keep], x[keep]
        cells = (idx[:, None] * k + np.arange(k)).ravel()
        out = np.bincount(cells, weights=x.ravel(), minlength=size * k)
        return out.reshape(size, k).astype(x.dtype, copy=False)

    def generator(self, seed: int | None, device: Device) -> HostGenerator:
        return HostGenerator(self.xp, np.random.default_rng(seed), None)


def to_scipy(op: LinearOperator) -> Any:
    """``op`` (M, N) acting on NumPy arrays as a ``scipy.sparse.linalg.LinearOperator``.

    Its ``matvec`` / ``matmat`` / ``rmatvec`` / ``rmatmat`` call ``op``'s (vectors flattened
    to (N,) first: SciPy may pass (N, 1)); the adjoint ones raise where ``op`` has no adjoint.
    """
    if not isinstance(op, LinearOperator):
        raise TypeError(f"op must be an ntkcore.linop.LinearOperator; got {type(op).__name__}")
    import scipy.sparse.linalg  # lazily: importing it costs more than the rest of the backend

    return scipy.sparse.linalg.LinearOperator(
        tuple(op.shape), dtype=None if op.dtype is None else np.dtype(op.dtype),
        matvec=lambda v: op.matvec(np.reshape(v, (-1,))),
        rmatvec=lambda w: op.rmatvec(np.reshape(w, (-1,))),
        matmat=op.matmat, rmatmat=op.rmatmat)
