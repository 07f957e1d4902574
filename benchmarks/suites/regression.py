r"""Kernel regression: Cholesky fit + predict, and the backward pass through it.

Cases
-----
``fit+predict N=<n>`` (N = 1000, 2000, 4000)
    :math:`\hat Y = K_* (K + \lambda I)^{-1} Y` for an RBF kernel on 16-dimensional Gaussian
    inputs, :math:`K` (N, N), :math:`K_*` (M, N) with M = N/4, Y (N, 10), :math:`\lambda = 0.1`.
    ntkcore.kernel_regression against scipy ``cho_factor``/``cho_solve`` (the baseline on
    numpy, target: ntkcore within 1.1x of its time), a dense LU solve (``numpy.linalg.solve``)
    and each framework's own solvers.  ``error`` is the relative Frobenius error of the
    predictions against a float64 scipy reference.  Flops: :math:`N^3/3` (Cholesky) or
    :math:`2N^3/3` (LU), plus :math:`2N^2K` (two triangular solves) and :math:`2MNK`.
``backward N=<n>`` (N = 500, 1000, 2000)
    Forward and backward pass of :math:`\ell = \|K_*(K + \lambda I)^{-1}Y - Y_*\|_F^2` with
    respect to the kernels :math:`K`, :math:`K_*` (leaves requiring gradients, as in a KIP
    loop after the kernel computation): ntkcore.kernel_regression (Cholesky + triangular
    solves) against autograd through ``torch.linalg.solve`` (the baseline; target: less peak
    memory), and through ``jnp.linalg.solve`` under JAX.  ``error`` compares the symmetric
    part of :math:`\partial\ell/\partial K` with a float64 closed-form gradient
    :math:`-A^{-\top} K_*^\top R\, \alpha^\top` (:math:`A = K + \lambda I`,
    :math:`R = 2(K_*\alpha - Y_*)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks._harness import Config, asarray, row, to_numpy

SUITE = "regression"
REG = 0.1
D_IN = 16
K_OUT = 10
HERE = "benchmarks.suites.regression"

# impl names per backend for the forward case; the first entry after "ntkcore" is the baseline
FORWARD = {
    "numpy": ("ntkcore", "scipy.cho_factor", "numpy.linalg.solve"),
    "torch": ("ntkcore", "torch.linalg.solve", "torch.cholesky_solve"),
    "jax": ("ntkcore", "jnp.linalg.solve", "jax.scipy.cho_factor"),
    "cupy": ("ntkcore", "cupy.linalg.solve"),
}
BACKWARD = {
    "torch": ("ntkcore", "torch.linalg.solve"),
    "jax": ("ntkcore", "jnp.linalg.solve"),
}


def _problem(n: int, m: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float64 RBF kernels: k_train (n, n), k_test (m, n), targets y (n, k), y_test (m, k)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n + m, D_IN))
    sq = np.sum(x * x, axis=1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (x @ x.T), 0.0)
    kern = np.exp(-d2 / (2.0 * D_IN))
    w = rng.standard_normal((D_IN, k))
    y_all = np.tanh(x @ w) + 0.1 * rng.standard_normal((n + m, k))
    return {
        "k_train": np.ascontiguousarray(kern[:n, :n]),
        "k_test": np.ascontiguousarray(kern[n:, :n]),
        "y": y_all[:n],
        "y_test": y_all[n:],
    }


def _reference(p: dict[str, np.ndarray]) -> np.ndarray:
    import scipy.linalg

    n = p["k_train"].shape[0]
    c = scipy.linalg.cho_factor(p["k_train"] + REG * np.eye(n), lower=True)
    return p["k_test"] @ scipy.linalg.cho_solve(c, p["y"])


def _flops(impl: str, n: int, m: int, k: int) -> float:
    factor = n**3 / 3.0 if ("cho" in impl or impl == "ntkcore") else 2.0 * n**3 / 3.0
    return factor + 2.0 * n * n * k + 2.0 * m * n * k


def forward_case(
    impl: str, backend: str, device: str, dtype: str, n: int, m: int, k: int
) -> Callable[[], Any]:
    """Build inputs of ``backend`` and return the fit+predict call of ``impl``."""
    p = _problem(n, m, k)
    kt, ks, y = (asarray(p[key], backend, device, dtype) for key in ("k_train", "k_test", "y"))
    if impl == "ntkcore":
        import ntkcore

        return lambda: ntkcore.kernel_regression(kt, y, ks, reg=REG)
    if impl == "scipy.cho_factor":
        import scipy.linalg

        eye = np.eye(n, dtype=dtype)

        def scipy_cho() -> Any:
            c = scipy.linalg.cho_factor(kt + REG * eye, lower=True, check_finite=False)
            return ks @ scipy.linalg.cho_solve(c, y, check_finite=False)

        return scipy_cho
    if impl == "numpy.linalg.solve":
        eye = np.eye(n, dtype=dtype)
        return lambda: ks @ np.linalg.solve(kt + REG * eye, y)
    if impl == "torch.linalg.solve":
        import torch

        eye = torch.eye(n, dtype=kt.dtype, device=kt.device)
        return lambda: ks @ torch.linalg.solve(kt + REG * eye, y)
    if impl == "torch.cholesky_solve":
        import torch

        eye = torch.eye(n, dtype=kt.dtype, device=kt.device)

        def torch_cho() -> Any:
            l = torch.linalg.cholesky(kt + REG * eye)
            return ks @ torch.cholesky_solve(y, l)

        return torch_cho
    if impl == "jnp.linalg.solve":
        import jax.numpy as jnp

        eye = jnp.eye(n, dtype=kt.dtype)
        return lambda: ks @ jnp.linalg.solve(kt + REG * eye, y)
    if impl == "jax.scipy.cho_factor":
        import jax.numpy as jnp
        import jax.scipy.linalg as jsl

        eye = jnp.eye(n, dtype=kt.dtype)
        return lambda: ks @ jsl.cho_solve(jsl.cho_factor(kt + REG * eye, lower=True), y)
    if impl == "cupy.linalg.solve":
        import cupy

        eye = cupy.eye(n, dtype=kt.dtype)
        return lambda: ks @ cupy.linalg.solve(kt + REG * eye, y)
    raise ValueError(f"unknown forward impl {impl!r}")


def backward_case(
    impl: str, backend: str, device: str, dtype: str, n: int, m: int, k: int
) -> Callable[[], Any]:
    """Return a call that runs loss + backward and gives (dK, dK_*) of ``impl``."""
    p = _problem(n, m, k, seed=1)
    if backend == "torch":
        import torch

        import ntkcore

        kt = asarray(p["k_train"], backend, device, dtype).requires_grad_(True)
        ks = asarray(p["k_test"], backend, device, dtype).requires_grad_(True)
        y, yt = (asarray(p[key], backend, device, dtype) for key in ("y", "y_test"))
        eye = torch.eye(n, dtype=kt.dtype, device=kt.device)

        def torch_step() -> Any:
            kt.grad = None
            ks.grad = None
            if impl == "ntkcore":
                pred = ntkcore.kernel_regression(kt, y, ks, reg=REG)
            elif impl == "torch.linalg.solve":
                pred = ks @ torch.linalg.solve(kt + REG * eye, y)
            else:
                raise ValueError(f"unknown backward impl {impl!r}")
            loss = torch.sum((pred - yt) ** 2)
            loss.backward()
            return kt.grad, ks.grad

        return torch_step
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        import ntkcore

        kt, ks, y, yt = (
            asarray(p[key], backend, device, dtype) for key in ("k_train", "k_test", "y", "y_test")
        )
        eye = jnp.eye(n, dtype=kt.dtype)

        def loss(a: Any, b: Any) -> Any:
            if impl == "ntkcore":
                pred = ntkcore.kernel_regression(a, y, b, reg=REG)
            elif impl == "jnp.linalg.solve":
                pred = b @ jnp.linalg.solve(a + REG * eye, y)
            else:
                raise ValueError(f"unknown backward impl {impl!r}")
            return jnp.sum((pred - yt) ** 2)

        grad = jax.grad(loss, argnums=(0, 1))
        return lambda: grad(kt, ks)
    raise ValueError(f"no backward case for backend {backend!r}")


def _reference_grad(n: int, m: int, k: int) -> np.ndarray:
    """float64 dloss/dK from the closed form (dense solves in NumPy)."""
    p = _problem(n, m, k, seed=1)
    a = p["k_train"] + REG * np.eye(n)
    alpha = np.linalg.solve(a, p["y"])
    r = 2.0 * (p["k_test"] @ alpha - p["y_test"])  # dloss/dpred (m, k)
    # pred = Ks A^{-1} Y  =>  dloss/dA = -A^{-T} Ks^T r alpha^T
    return -np.linalg.solve(a.T, p["k_test"].T @ r) @ alpha.T


def _sym(g: np.ndarray) -> np.ndarray:
    """Symmetric part: the gradient wrt a symmetric K is defined up to its skew part
    (a Cholesky reads one triangle, a dense solve both), so only this part is compared."""
    return 0.5 * (g + g.T)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def run(cfg: Config) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    sizes = cfg.pick([48], [1000, 2000, 4000])
    for n in sizes:
        m, k = max(n // 4, 8), cfg.pick(2, K_OUT)
        ref = _reference(_problem(n, m, k))
        for backend in cfg.backends:
            impls = FORWARD.get(backend, ())
            for impl in impls:
                fn = forward_case(impl, backend, cfg.device, cfg.dtype, n, m, k)
                pred = to_numpy(fn())
                timing = cfg.time(fn, backend, warm=True)  # the call above warmed it up
                mem = cfg.peak_memory(f"{HERE}:forward_case", impl=impl, backend=backend,
                                      device=cfg.device, dtype=cfg.dtype, n=n, m=m, k=k)
                baseline = impls[1] if impl != impls[1] else None
                rows.append(row(
                    SUITE, f"fit+predict N={n}", impl, backend=backend, device=cfg.device,
                    dtype=cfg.dtype, timing=timing, params={"N": n, "M": m, "K": k, "reg": REG},
                    peak_mem_bytes=mem, mem_method=cfg.mem_method,
                    flops=_flops(impl, n, m, k), baseline=baseline, error=_rel(pred, ref),
                    target="speedup >= 0.909" if (impl, backend) == ("ntkcore", "numpy")
                    else None,
                ))
    bsizes = cfg.pick([32], [500, 1000, 2000])
    for n in bsizes:
        m, k = max(n // 4, 8), cfg.pick(2, K_OUT)
        gref = _reference_grad(n, m, k)
        for backend in cfg.backends:
            impls = BACKWARD.get(backend, ())
            for impl in impls:
                fn = backward_case(impl, backend, cfg.device, cfg.dtype, n, m, k)
                dk = _sym(to_numpy(fn()[0]))
                timing = cfg.time(fn, backend, warm=True)  # the call above warmed it up
                mem = cfg.peak_memory(f"{HERE}:backward_case", impl=impl, backend=backend,
                                      device=cfg.device, dtype=cfg.dtype, n=n, m=m, k=k)
                is_base = impl == impls[1]
                rows.append(row(
                    SUITE, f"backward N={n}", impl, backend=backend, device=cfg.device,
                    dtype=cfg.dtype, timing=timing, params={"N": n, "M": m, "K": k, "reg": REG},
                    peak_mem_bytes=mem, mem_method=cfg.mem_method,
                    baseline=None if is_base else impls[1], error=_rel(dk, _sym(gref)),
                    target="mem_ratio < 1" if impl == "ntkcore" and mem is not None else None,
                    note="loss + grad wrt K and K_*" + (" (eager JAX)" if backend == "jax"
                                                         else ""),
                ))
    return rows
