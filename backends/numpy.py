"""NumPy backend: SciPy's LAPACK wrappers and NumPy's PCG64 generator."""

from __future__ import annotations

import numpy as np
import scipy.linalg

from ._host import host_free_memory
from ._protocol import Array, Device
from .generic import GenericBackend, _HostGenerator


class NumpyBackend(GenericBackend):
    """Backend for ``numpy`` arrays (host memory)."""

    name = "numpy"

    def cholesky(self, a: Array) -> Array | None:
        try:
            return np.linalg.cholesky(a)
        except np.linalg.LinAlgError:
            return None

    def solve_triangular(
        self, a: Array, b: Array, *, lower: bool = True, transpose: bool = False
    ) -> Array:
        return scipy.linalg.solve_triangular(
            a, b, lower=lower, trans="T" if transpose else "N", check_finite=False
        )

    def cho_solve(self, l: Array, b: Array) -> Array:
        return scipy.linalg.cho_solve((l, True), b, check_finite=False)

    def generator(self, seed: int | None, device: Device) -> _HostGenerator:
        return _HostGenerator(self.xp, np.random.default_rng(seed), None)

    def free_memory(self, device: Device) -> int | None:
        return host_free_memory()
