r"""SMW solves :math:`(\lambda I + U U^\top) d = g`, U (P, rho): ``ntkcore.smw_solve`` (a rho x
rho Cholesky) against a dense P x P Cholesky, and at sizes where the dense matrix cannot exist.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.common import (
    CPU_BACKENDS,
    asarray,
    relerr,
    require,
    roofline_share,
    to64,
    working_memory,
)

LAM = 0.1


def inputs(backend: str, p: int, rho: int, dtype: str = "float32") -> tuple[Any, Any]:
    """U (P, rho) scaled to unit-order Gram entries and g (P,), seeded."""
    rng = np.random.default_rng(0)
    u = rng.standard_normal((p, rho), dtype=np.float32)
    u *= np.float32(1 / np.sqrt(p))
    return asarray(u, backend, dtype), asarray(rng.standard_normal(p), backend, dtype)


def least_flops(p: int, rho: int) -> float:
    r"""The least GEMM work of a solve: :math:`U^\top U` at half a GEMM (``syrk``,
    :math:`P\rho(\rho+1)`) plus :math:`U^\top g` and :math:`U b` (:math:`2P\rho` each); the
    rho x rho Cholesky (:math:`\rho^3/3`) is negligible."""
    return p * rho * (rho + 1.0) + 4.0 * p * rho


class VsDense:
    """ntkcore against the dense solve a user would write, P where P x P still fits."""

    params = ([*CPU_BACKENDS, "torch-cuda", "cupy"], [1000, 4000], [64])
    param_names = ("backend", "P", "rho")
    timeout = 120

    def setup(self, backend: str, p: int, rho: int) -> None:
        import ntkcore

        xp = require(backend)
        self.u, self.g = inputs(backend, p, rho)
        self.ntkcore = lambda: ntkcore.smw_solve(self.u, self.g, LAM)
        if backend == "numpy":
            import scipy.linalg as sl

            eye = np.eye(p, dtype=np.float32)

            def dense() -> Any:
                c = sl.cho_factor(LAM * eye + self.u @ self.u.T, lower=True, check_finite=False)
                return sl.cho_solve(c, self.g, check_finite=False)
        else:
            eye = xp.eye(p, dtype=self.u.dtype, **({"device": self.u.device}
                                                    if backend.startswith("torch") else {}))
            chol = xp.linalg.cholesky

            def dense() -> Any:
                l = chol(LAM * eye + self.u @ self.u.T)
                if backend.startswith("torch"):
                    return xp.cholesky_solve(self.g[:, None], l)[:, 0]
                return xp.linalg.solve(l.T, xp.linalg.solve(l, self.g))
        self.dense = dense

    def time_ntkcore(self, *_: Any) -> None:
        self.ntkcore()

    def time_dense(self, *_: Any) -> None:
        self.dense()

    def track_speedup(self, *_: Any) -> float:
        """Dense time over ntkcore's, the two timed in turn."""
        from benchmarks.common import in_turns

        t = in_turns({"ntkcore": self.ntkcore, "dense": self.dense})
        return t["dense"] / t["ntkcore"]
    track_speedup.unit = "x"  # type: ignore[attr-defined]

    def track_error(self, backend: str, p: int, rho: int) -> float:
        """Relative error of d against a float64 dense solve."""
        u, g = to64(self.u), to64(self.g)
        return relerr(self.ntkcore(), np.linalg.solve(LAM * np.eye(p) + u @ u.T, g))
    track_error.unit = "relative"  # type: ignore[attr-defined]


class Large:
    """Sizes where a P x P matrix is impossible: the roofline share is the target (>= 0.7 at
    P = 4e6, rho = 256, float32)."""

    params = ([*CPU_BACKENDS, "torch-cuda", "cupy"], ["1e6 x 64", "1e6 x 256", "4e6 x 256"])
    param_names = ("backend", "P x rho")
    timeout = 300
    number, repeat, warmup_time, rounds = 1, 3, 0, 1

    def setup(self, backend: str, size: str) -> None:
        import ntkcore

        require(backend)
        self.p, self.rho = (int(float(v)) for v in size.split(" x "))
        self.u, self.g = inputs(backend, self.p, self.rho)
        self.solve = lambda: ntkcore.smw_solve(self.u, self.g, LAM)

    def time_ntkcore(self, *_: Any) -> None:
        self.solve()

    def track_roofline_share(self, backend: str, size: str) -> float:
        return roofline_share(self.solve, least_flops(self.p, self.rho), backend, rounds=3)
    track_roofline_share.unit = "share"  # type: ignore[attr-defined]

    def track_residual(self, *_: Any) -> float:
        r"""Relative residual :math:`\|(\lambda I + UU^\top)d - g\| / \|g\|` in float64."""
        d, g, utd, res2 = to64(self.solve()), to64(self.g), np.zeros(self.rho), 0.0
        step = 1 << 18  # float64 copies of U in row chunks
        for s in range(0, self.p, step):
            utd += to64(self.u[s:s + step]).T @ d[s:s + step]
        for s in range(0, self.p, step):
            r = LAM * d[s:s + step] + to64(self.u[s:s + step]) @ utd - g[s:s + step]
            res2 += float(r @ r)
        return float(np.sqrt(res2) / np.linalg.norm(g))
    track_residual.unit = "relative"  # type: ignore[attr-defined]

    def track_working_memory(self, *_: Any) -> float:
        return working_memory(self.solve)
    track_working_memory.unit = "bytes"  # type: ignore[attr-defined]
