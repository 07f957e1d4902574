"""CuPy backend: ``cupyx.scipy.linalg`` and CuPy's random generator on the current GPU.

Written against CuPy >= 13 and exercised only on machines with an NVIDIA GPU; importing this
module without CuPy raises ImportError, which :func:`ntkcore.backends.get_backend` never
triggers unless a CuPy array is actually passed in.
"""

from __future__ import annotations

from typing import Any

import cupy
import cupyx.scipy.linalg

from ntkcore.backend import Array, Device

from .generic import GenericBackend


class CupyBackend(GenericBackend):
    """Backend for ``cupy.ndarray`` (``cupy.linalg.cholesky`` reports failure as NaNs, or
    raises when debug checks are on: :meth:`GenericBackend.cholesky` handles both)."""

    name = "cupy"

    def _shifted(self, a: Array, shift: float) -> Array:
        a = a.copy()
        a[cupy.diag_indices(a.shape[0])] += shift
        return a

    def solve_triangular(
        self, a: Array, b: Array, *, lower: bool = True, transpose: bool = False
    ) -> Array:
        return cupyx.scipy.linalg.solve_triangular(
            a, b, lower=lower, trans="T" if transpose else "N", check_finite=False
        )

    def erf(self, x: Array) -> Array:
        import cupyx.scipy.special

        return cupyx.scipy.special.erf(x)

    fast_scatter_add = True

    def scatter_add(self, idx: Array, x: Array, size: int) -> Array:
        import cupyx

        idx = cupy.where(idx < 0, size, idx)  # -1 rows go to a spare last row
        out = cupy.zeros((size + 1, *x.shape[1:]), dtype=x.dtype)
        cupyx.scatter_add(out, idx, x)
        return out[:size]

    def generator(self, seed: int | None, device: Device) -> CupyGenerator:
        return CupyGenerator(seed, device)

    def free_memory(self, device: Device) -> int | None:
        dev = device if device is not None else cupy.cuda.Device()
        with cupy.cuda.Device(getattr(dev, "id", dev)):
            free, _total = cupy.cuda.runtime.memGetInfo()
            pool = cupy.get_default_memory_pool()
            return int(free + pool.free_bytes())

    def synchronize(self, device: Device) -> None:
        cupy.cuda.Device(getattr(device, "id", 0) if device is not None else 0).synchronize()

    def is_gpu(self, device: Device) -> bool:
        return True


class CupyGenerator:
    """``cupy.random.RandomState`` bound to one GPU (it offers ``choice`` with ``p``)."""

    def __init__(self, seed: int | None, device: Device) -> None:
        self.device_id = getattr(device, "id", 0) if device is not None else 0
        with cupy.cuda.Device(self.device_id):
            self.rs = cupy.random.RandomState(seed)

    def integers(self, low: int, high: int, shape: tuple[int, ...]) -> Array:
        with cupy.cuda.Device(self.device_id):
            return self.rs.randint(low, high, size=shape, dtype=cupy.int64)

    def choice(
        self, n: int, size: int, *, p: Array | None = None, replace: bool = True
    ) -> Array:
        with cupy.cuda.Device(self.device_id):
            if p is not None:
                p = cupy.clip(cupy.asarray(p, dtype=cupy.float64), 0, None)
                p = p / p.sum()
            return self.rs.choice(n, size=size, replace=replace, p=p).astype(cupy.int64)

    def normal(self, shape: tuple[int, ...], dtype: Any) -> Array:
        with cupy.cuda.Device(self.device_id):
            return self.rs.standard_normal(size=shape, dtype=dtype)

    def uniform(self, shape: tuple[int, ...], dtype: Any) -> Array:
        with cupy.cuda.Device(self.device_id):
            return self.rs.random_sample(size=shape, dtype=dtype)
