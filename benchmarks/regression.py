r"""Kernel regression :math:`\hat Y = K_*(K + \lambda I)^{-1} Y`: ``ntkcore.kernel_regression``
(Cholesky) against each library's Cholesky and LU solves, forward and backward."""

from typing import Any

import numpy as np

import ntkcore
from benchmarks.common import BACKENDS, asarray, in_turns, relerr, require, to64
from benchmarks.common import working_memory as memory

REG, D_IN, K_OUT = 0.1, 16, 10


def _problem(n: int, m: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    r"""float64 RBF kernels :math:`\exp(-\|x-x'\|^2 / 2d)` of 16-dimensional Gaussian inputs:
    ``k_train`` (n, n), ``k_test`` (m, n), targets ``y`` (n, k) and ``y_test`` (m, k)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n + m, D_IN))
    sq = np.sum(x * x, axis=1)
    kern = np.exp(-np.maximum(sq[:, None] + sq[None, :] - 2.0 * (x @ x.T), 0.0) / (2.0 * D_IN))
    y = np.tanh(x @ rng.standard_normal((D_IN, k))) + 0.1 * rng.standard_normal((n + m, k))
    return {"k_train": kern[:n, :n].copy(), "k_test": kern[n:, :n].copy(), "y": y[:n],
            "y_test": y[n:]}


def _solvers(backend: str, kt: Any, ks: Any, y: Any) -> dict[str, Any]:
    """Fit + predict through the library's Cholesky and through its LU solve."""
    xp = require(backend)
    if backend == "jax":
        import jax.numpy as xp
        import jax.scipy.linalg as sl
    elif backend == "numpy":
        import scipy.linalg as sl
    elif backend == "cupy":
        import cupyx.scipy.linalg as sl
    dev = {"device": kt.device} if backend.startswith("torch") else {}
    eye = xp.eye(kt.shape[0], dtype=kt.dtype, **dev)

    def cholesky() -> Any:
        if backend.startswith("torch"):
            return ks @ xp.cholesky_solve(y, xp.linalg.cholesky(kt + REG * eye))
        if backend != "cupy":
            return ks @ sl.cho_solve(sl.cho_factor(kt + REG * eye, lower=True), y)
        l = xp.linalg.cholesky(kt + REG * eye)
        return ks @ sl.solve_triangular(l.T, sl.solve_triangular(l, y, lower=True))

    return {"cholesky": cholesky, "solve": lambda: ks @ xp.linalg.solve(kt + REG * eye, y)}


class FitPredict:
    """Fit + predict, RBF kernel, M = N/4 test points, 10 outputs, lambda = 0.1; speed-up over
    scipy ``cho_factor`` on NumPy (target >= 0.91), over ``linalg.solve`` elsewhere."""

    params, param_names = (list(BACKENDS), [1000, 2000]), ("backend", "N")
    timeout, repeat, warmup_time = 180, (1, 5, 10.0), 0.2

    def setup(self, backend: str, n: int) -> None:
        require(backend)
        self.p = _problem(n, max(n // 4, 8), K_OUT)
        kt, ks, y = (asarray(self.p[key], backend) for key in ("k_train", "k_test", "y"))
        self.calls = {"ntkcore": lambda: ntkcore.kernel_regression(kt, y, ks, reg=REG),
                      **_solvers(backend, kt, ks, y)}

    def track_speedup(self, backend: str, n: int) -> float:
        base = "cholesky" if backend == "numpy" else "solve"
        t = in_turns({"ntkcore": self.calls["ntkcore"], base: self.calls[base]})
        return t[base] / t["ntkcore"]

    def track_error(self, *_: Any) -> float:
        """Relative error of the predictions against a float64 LU solve."""
        a, p = self.p["k_train"] + REG * np.eye(len(self.p["y"])), self.p
        return relerr(self.calls["ntkcore"](), p["k_test"] @ np.linalg.solve(a, p["y"]))

    track_speedup.unit, track_error.unit = "x", "relative"  # type: ignore[attr-defined]


def reference_grad(p: dict[str, np.ndarray]) -> np.ndarray:
    r"""float64 :math:`\partial\ell/\partial K` of :math:`\ell = \|K_*A^{-1}Y - Y_*\|_F^2`,
    :math:`A = K + \lambda I`: :math:`-A^{-\top}K_*^\top R\,\alpha^\top` with
    :math:`\alpha = A^{-1}Y`, :math:`R = 2(K_*\alpha - Y_*)`."""
    a = p["k_train"] + REG * np.eye(len(p["y"]))
    alpha = np.linalg.solve(a, p["y"])
    return -np.linalg.solve(a.T, p["k_test"].T @ (2.0 * (p["k_test"] @ alpha - p["y_test"]))
                            ) @ alpha.T


def backward_case(impl: str, backend: str, p: dict[str, np.ndarray]) -> Any:
    """Loss + gradient wrt K and K_* through ``impl`` ("ntkcore" or "solve"; eager JAX)."""
    kt, ks, y, yt = (asarray(p[key], backend) for key in ("k_train", "k_test", "y", "y_test"))
    xp = require(backend)
    if backend == "jax":
        import jax
        import jax.numpy as xp
    eye = xp.eye(kt.shape[0], dtype=kt.dtype, **({} if backend == "jax" else {"device": kt.device}))

    def loss(a: Any, b: Any) -> Any:
        pred = (ntkcore.kernel_regression(a, y, b, reg=REG) if impl == "ntkcore"
                else b @ xp.linalg.solve(a + REG * eye, y))
        return ((pred - yt) ** 2).sum()

    if backend == "jax":
        grad = jax.grad(loss, argnums=(0, 1))
        return lambda: grad(kt, ks)
    kt.requires_grad_(True), ks.requires_grad_(True)
    return lambda: xp.autograd.grad(loss(kt, ks), (kt, ks))


class Backward:
    r"""Loss :math:`\|K_*(K+\lambda I)^{-1}Y - Y_*\|_F^2` + gradient wrt K, K_*: ntkcore
    against autograd through ``linalg.solve``; error: symmetric part of dK against
    :func:`reference_grad`."""
    params, param_names = (["torch", "jax", "torch-cuda"], [1000, 2000]), ("backend", "N")
    timeout, repeat, warmup_time = 180, (1, 5, 10.0), 0.2

    def setup(self, backend: str, n: int) -> None:
        require(backend)
        self.p = _problem(n, max(n // 4, 8), K_OUT, seed=1)
        self.calls = {i: backward_case(i, backend, self.p) for i in ("ntkcore", "solve")}

    def track_speedup(self, *_: Any) -> float:
        t = in_turns(self.calls)
        return t["solve"] / t["ntkcore"]

    def track_error(self, *_: Any) -> float:
        g, ref = to64(self.calls["ntkcore"]()[0]), reference_grad(self.p)
        return relerr(g + g.T, ref + ref.T)

    def track_working_memory(self, *_: Any) -> float:
        return memory(self.calls["ntkcore"])

    def track_memory_ratio(self, *_: Any) -> float:
        return memory(self.calls["ntkcore"]) / max(memory(self.calls["solve"]), 1.0)

    track_speedup.unit, track_error.unit = "x", "relative"  # type: ignore[attr-defined]
    track_working_memory.unit, track_memory_ratio.unit = "bytes", "x"  # type: ignore


for _cls, _names in ((FitPredict, ("ntkcore", "cholesky", "solve")),
                     (Backward, ("ntkcore", "solve"))):
    for _n in _names:  # time_ntkcore, time_cholesky, time_solve: one call each
        setattr(_cls, f"time_{_n}", lambda self, *_, n=_n: self.calls[n]())
