r"""Sketched against exact: ``gram(sketch_jacobian(J, q))`` against ``gram(J)`` and
``smw_solve(..., sketch=(method, q))`` against the exact SMW solve.  Limits: a Kronecker block's
sketch shrinks its SYRKs by :math:`(d_A+d_G)/(q_A+q_G)` <= 4.5 but not the N x N Hadamard product;
leverage needs a pass for its norms; SENG's :math:`(g - Ub)/\lambda` a pass over U."""

from typing import Any

import numpy as np

import ntkcore
from benchmarks.common import CPU_BACKENDS, asarray, in_turns, relerr, require, to64

METHODS = ["uniform", "leverage"]
LAM = 1e-3


class _Sketched:
    """Shared methods: ``self.exact`` and ``self.sketched`` calls, ``self.reference()``."""

    timeout, repeat, warmup_time = 180, (1, 3, 3.0), 0.1

    def time_exact(self, *_: Any) -> None:
        self.exact()

    def time_sketched(self, *_: Any) -> None:
        self.sketched()

    def track_speedup(self, *_: Any) -> float:
        t = in_turns({"exact": self.exact, "sketched": self.sketched})
        return t["exact"] / t["sketched"]

    def track_error(self, *_: Any) -> float:
        """Relative Frobenius error of one sketched draw (seed 0) against the exact result
        computed in float64."""
        return relerr(self.sketched(), self.reference())

    track_speedup.unit, track_error.unit = "x", "relative"  # type: ignore[attr-defined]


class Gram(_Sketched):
    r"""Sketched Gram of one block, q = P/k: dense (N = 256, P = 32768, 2% heavy columns) or
    Kronecker, d_in = d_out = 1024 at S positions (S = 1: N = 512; S = 16: N = 64), sketch
    :math:`\Omega_A\otimes\Omega_G`."""

    params = ([*CPU_BACKENDS, "torch-cuda"], ["dense", "kron S=1", "kron S=16"], METHODS,
              [20])
    param_names = ("backend", "block", "method", "k")

    def setup(self, backend: str, kind: str, method: str, k: int) -> None:
        from ntkcore import DenseBlock, Jacobian, KroneckerBlock
        from ntkcore.sketch import sketch_jacobian
        require(backend)
        rng = np.random.default_rng(0)
        if kind == "dense":
            blocks, block = [rng.standard_normal((256, 1, 32768), dtype=np.float32)], DenseBlock
            blocks[0][:, :, :655] *= 10.0  # a few heavy parameters (where leverage helps)
        else:
            (n, s), block = ((512, 1) if kind == "kron S=1" else (64, 16)), KroneckerBlock
            blocks = [rng.standard_normal(sh, dtype=np.float32) for sh in ((n, s, 1024),
                                                                          (n, s, 1, 1024))]
        jac = Jacobian([block(*(asarray(b, backend) for b in blocks))])
        q = max(1, jac.num_params // k)
        self.exact = lambda: ntkcore.gram(jac)
        self.sketched = lambda: ntkcore.gram(sketch_jacobian(jac, q, method=method, seed=0))
        self.reference = lambda: ntkcore.gram(Jacobian([block(*(b.astype(float)
                                                                for b in blocks))]))


class SMW(_Sketched):
    r"""Sketched SENG direction: ``smw_solve(U, g, 1e-3, sketch=(method, q))``, U (P, rho) with
    row scales 0.1..3 and g near its range, P = 200,000, rho = 64, q = P/k."""
    params = ([*CPU_BACKENDS, "torch-cuda"], METHODS, [200, 20])
    param_names = ("backend", "method", "k")

    def setup(self, backend: str, method: str, k: int) -> None:
        require(backend)
        p, rho = 200_000, 64
        rng = np.random.default_rng(0)
        u = rng.standard_normal((p, rho)) * np.linspace(0.1, 3.0, p)[:, None] / np.sqrt(p)
        g = u @ rng.standard_normal(rho) + 0.01 * rng.standard_normal(p)
        u32, g32, q = asarray(u, backend), asarray(g, backend), max(rho, p // k)
        self.exact = lambda: ntkcore.smw_solve(u32, g32, LAM)
        self.sketched = lambda: ntkcore.smw_solve(u32, g32, LAM, sketch=(method, q, 0))
        self.reference = lambda: to64(ntkcore.smw_solve(u, g, LAM))
