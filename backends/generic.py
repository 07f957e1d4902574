"""Fallback backend for any array-API namespace (e.g. ``array_api_strict``).

Only the standard is used for linear algebra: a triangular solve becomes ``xp.linalg.solve``
(an LU solve: correct, if slower than a true triangular solve), and a failed Cholesky is
recognised by an exception or by non-finite entries.  Random numbers are drawn on the host
with NumPy and handed to the namespace with ``xp.asarray``; this is acceptable because every
namespace without a backend of its own that we know of lives in host memory.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

from ntkcore.backend import Array, Backend, Device

from ._host import host_free_memory


class GenericBackend(Backend):
    """Backend built from the array API standard alone (plus host RNG).

    Its :meth:`cholesky` serves the CuPy and JAX backends too, which override only how the
    shift is added (:meth:`_shifted`) or which factors can be checked (:meth:`_finite`).
    """

    name = "generic"

    def cholesky(self, a: Array, *, shift: float = 0.0) -> Array | None:
        if shift:
            a = self._shifted(a, shift)
        try:
            l = self.xp.linalg.cholesky(a)
        except Exception as exc:  # each library raises its own LinAlgError
            if "LinAlgError" in type(exc).__name__ or "positive" in str(exc).lower():
                return None
            raise
        # Libraries that do not raise report a failed factorisation with non-finite entries.
        return l if self._finite(l) else None

    def _shifted(self, a: Array, shift: float) -> Array:
        xp = self.xp
        return a + shift * xp.eye(a.shape[0], dtype=a.dtype, device=array_api_compat.device(a))

    def _finite(self, l: Array) -> bool:
        return bool(self.xp.all(self.xp.isfinite(l)))

    def solve_triangular(
        self, a: Array, b: Array, *, lower: bool = True, transpose: bool = False
    ) -> Array:
        xp = self.xp
        a = xp.tril(a) if lower else xp.triu(a)
        if transpose:
            a = a.T
        if b.ndim == 1:
            return xp.linalg.solve(a, b[:, None])[:, 0]
        return xp.linalg.solve(a, b)

    def generator(self, seed: int | None, device: Device) -> HostGenerator:
        return HostGenerator(self.xp, np.random.default_rng(seed), device)

    @staticmethod
    def seed_from(seed: Any) -> int:
        if isinstance(seed, np.random.Generator):
            return int(seed.integers(2**63))
        return Backend.seed_from(seed)

    @staticmethod
    def host_array(x: Any) -> np.ndarray:
        return np.asarray(x)

    @staticmethod
    def spawn_seed(seed: int, spawn_key: tuple[int, ...]) -> int:
        """``SeedSequence(seed, spawn_key=spawn_key)``'s first 64-bit word, low 63 bits."""
        state = np.random.SeedSequence(seed, spawn_key=spawn_key).generate_state(1, np.uint64)
        return int(state[0]) & (2**63 - 1)

    def free_memory(self, device: Device) -> int | None:
        return host_free_memory()


class HostGenerator:
    """NumPy's PCG64 on the host, results converted with ``xp.asarray``."""

    def __init__(self, xp: Any, rng: np.random.Generator, device: Device) -> None:
        self.xp = xp
        self.rng = rng
        self.device = device

    def _wrap(self, arr: np.ndarray, dtype: Any = None) -> Array:
        kwargs = {} if self.device is None else {"device": self.device}
        return self.xp.asarray(arr, dtype=dtype, **kwargs)

    def integers(self, low: int, high: int, shape: tuple[int, ...]) -> Array:
        return self._wrap(self.rng.integers(low, high, size=shape, dtype=np.int64), self.xp.int64)

    def choice(
        self, n: int, size: int, *, p: Array | None = None, replace: bool = True
    ) -> Array:
        p_host = None if p is None else _probabilities_to_host(p)
        idx = self.rng.choice(n, size=size, replace=replace, p=p_host)
        return self._wrap(np.asarray(idx, dtype=np.int64), self.xp.int64)

    def normal(self, shape: tuple[int, ...], dtype: Any) -> Array:
        return self._wrap(self.rng.standard_normal(size=shape), dtype)

    def uniform(self, shape: tuple[int, ...], dtype: Any) -> Array:
        return self._wrap(self.rng.random(size=shape), dtype)


def _probabilities_to_host(p: Array) -> np.ndarray:
    """Probabilities as a float64 host vector summing to one (required by numpy's choice)."""
    try:
        host = np.asarray(p, dtype=np.float64)
    except Exception:  # namespaces that refuse __array__ still speak DLPack
        host = np.from_dlpack(p).astype(np.float64)
    host = np.clip(host, 0.0, None)
    return host / host.sum()
