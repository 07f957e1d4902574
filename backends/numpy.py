"""NumPy backend: SciPy's LAPACK wrappers and NumPy's PCG64 generator."""

from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.special

from ntkcore.backend import Array, Device

from ._host import host_free_memory
from .generic import GenericBackend, _HostGenerator


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

    def generator(self, seed: int | None, device: Device) -> _HostGenerator:
        return _HostGenerator(self.xp, np.random.default_rng(seed), None)

    def free_memory(self, device: Device) -> int | None:
        return host_free_memory()
