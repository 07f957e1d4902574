r"""SMW solves: ``ntkcore.smw_solve`` against dense P x P solves, and at sizes where dense is
impossible.

Cases
-----
``vs dense P=<p> rho=<r>``
    :math:`(\lambda I + U U^\top) d = g` with U (P, rho), g (P,), :math:`\lambda = 0.1`:
    ntkcore.smw_solve (a rho x rho Cholesky) against a Cholesky of the P x P matrix (the
    baseline: scipy ``cho_factor`` on numpy, ``torch.linalg.cholesky`` on torch).  ``error`` is
    the relative error of d against a float64 dense solve.
``large P=<p> rho=<r>``
    Only smw_solve (a dense P x P matrix would need P^2 floats).  Flops are those of the work
    done with the Gram's symmetry used, :math:`P\rho(\rho+1) + 4P\rho` (syrk + U^T g + U b),
    so the renderer's GEMM fraction is the fraction of measured GEMM throughput reached.
    ``error`` is the relative residual :math:`\|(\lambda I + UU^\top)d - g\| / \|g\|`.
    Target at P = 4e6, rho = 256, float32: at least 70% of the roofline (issue 18).

Every row gets a roofline share (the renderer's "roofline %"): the least GEMM work of the
solve, the symmetric product plus the two products with U (:func:`_roofline_flops`), over the
time and the GEMM rate measured in the same run; the dense baselines' rows share their
case's figure.  The ``large`` rows on the CPU are timed in the same rounds as a 2048 x 2048
GEMM of their backend (:func:`benchmarks._harness.paired_with_gemm`, ``gemm_gflops`` in the
row), whose rate their share divides by.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks._harness import Config, paired_with_gemm, row

SUITE = "smw"
LAM = 0.1
DENSE_BASELINE = {"numpy": "scipy.cho_factor (P x P)", "torch": "torch.linalg.cholesky (P x P)"}


def _inputs(backend: str, device: str, dtype: str, p: int, rho: int, seed: int = 0) -> Any:
    """U (P, rho) scaled to unit-order Gram entries, g (P,): made directly in ``dtype``."""
    scale = 1.0 / np.sqrt(p)
    if backend == "torch":
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        dt = getattr(torch, dtype)
        u = torch.randn(p, rho, generator=gen, device=device, dtype=dt) * scale
        g = torch.randn(p, generator=gen, device=device, dtype=dt)
        return u, g
    if backend == "numpy":
        rng = np.random.default_rng(seed)
        u = rng.standard_normal((p, rho), dtype=np.float32 if dtype == "float32" else np.float64)
        u *= scale
        g = rng.standard_normal(p).astype(dtype)
        return u, g
    raise ValueError(f"smw suite has no inputs for backend {backend!r}")


def _to64(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def case(impl: str, backend: str, device: str, dtype: str, p: int, rho: int
         ) -> tuple[Callable[[], Any], Any, Any]:
    u, g = _inputs(backend, device, dtype, p, rho)
    if impl == "ntkcore":
        import ntkcore

        return (lambda: ntkcore.smw_solve(u, g, LAM)), u, g
    if impl.startswith("scipy"):
        import scipy.linalg

        eye = np.eye(p, dtype=u.dtype)

        def dense_np() -> Any:
            c = scipy.linalg.cho_factor(LAM * eye + u @ u.T, lower=True, check_finite=False)
            return scipy.linalg.cho_solve(c, g, check_finite=False)

        return dense_np, u, g
    if impl.startswith("torch"):
        import torch

        eye = torch.eye(p, dtype=u.dtype, device=u.device)

        def dense_torch() -> Any:
            l = torch.linalg.cholesky(LAM * eye + u @ u.T)
            return torch.cholesky_solve(g[:, None], l)[:, 0]

        return dense_torch, u, g
    raise ValueError(f"unknown impl {impl!r}")


def _flops(impl: str, p: int, rho: int) -> float:
    if impl == "ntkcore":
        return p * rho * (rho + 1.0) + 4.0 * p * rho + rho**3 / 3.0
    return 2.0 * p * p * rho + p**3 / 3.0 + 2.0 * p * p


def _roofline_flops(p: int, rho: int) -> float:
    r"""The least GEMM work of an SMW solve: the symmetric product :math:`U^\top U` at half a
    GEMM's cost (:math:`P\rho(\rho+1)`, ``syrk``) plus :math:`U^\top g` and :math:`U b`
    (:math:`2P\rho` each); the rho x rho Cholesky (:math:`\rho^3/3`) is negligible."""
    return p * rho * (rho + 1.0) + 4.0 * p * rho


def _residual(d: Any, u: Any, g: Any) -> float:
    """Relative residual in float64, computed in column chunks to bound memory."""
    d64, g64 = _to64(d), _to64(g)
    utd = np.zeros(u.shape[1])
    step = 1 << 18
    for s in range(0, u.shape[0], step):
        utd += _to64(u[s:s + step]).T @ d64[s:s + step]
    res2 = 0.0
    for s in range(0, u.shape[0], step):
        r = LAM * d64[s:s + step] + _to64(u[s:s + step]) @ utd - g64[s:s + step]
        res2 += float(r @ r)
    return float(np.sqrt(res2) / np.linalg.norm(g64))


def run(cfg: Config) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    backends = [b for b in cfg.backends if b in ("numpy", "torch")]
    rho_dense = cfg.pick(16, 64)
    dense = cfg.select({f"vs dense P={p} rho={rho_dense}": p
                        for p in cfg.pick([300], [1000, 4000, 8000])})
    for p in dense.values():
        rho = rho_dense
        for backend in backends:
            ref = None
            for impl in ("ntkcore", DENSE_BASELINE[backend]):
                fn, u, g = case(impl, backend, cfg.device, cfg.dtype, p, rho)
                if ref is None:
                    u64, g64 = _to64(u), _to64(g)
                    ref = np.linalg.solve(LAM * np.eye(p) + u64 @ u64.T, g64)
                d = _to64(fn())
                rows.append(row(
                    SUITE, f"vs dense P={p} rho={rho}", impl, backend=backend,
                    device=cfg.device, dtype=cfg.dtype, timing=cfg.time(fn, backend),
                    params={"N": p, "P": p, "rho": rho, "damping": LAM},
                    flops=_flops(impl, p, rho), roofline_flops=_roofline_flops(p, rho),
                    baseline=None if impl != "ntkcore" else DENSE_BASELINE[backend],
                    error=float(np.linalg.norm(d - ref) / np.linalg.norm(ref)),
                ))
                del fn, u, g
    sizes = cfg.pick([(20_000, 32)], [(1_000_000, 64), (1_000_000, 256), (1_000_000, 512),
                                      (4_000_000, 64), (4_000_000, 256)])
    for p, rho in cfg.select({f"large P={p} rho={rho}": (p, rho) for p, rho in sizes}).values():
        for backend in backends:
            fn, u, g = case("ntkcore", backend, cfg.device, cfg.dtype, p, rho)
            t0 = time.perf_counter()
            d = fn()
            first_s = time.perf_counter() - t0
            gemm_gflops = None
            if cfg.device == "cpu":
                timing, gemm_gflops = paired_with_gemm(cfg, fn, first_s, backend)
            else:
                timing = cfg.time(fn, backend, first_s=first_s)
            big = (p, rho) == (4_000_000, 256) and cfg.dtype == "float32"
            # one target per row: the time of the issue-16 note, or the roofline share of
            # issue 18 (the time target assumed the developers' machine's GEMM rate)
            target = "roofline_share >= 0.7" if big else None
            rows.append(row(
                SUITE, f"large P={p} rho={rho}", "ntkcore", backend=backend, device=cfg.device,
                dtype=cfg.dtype, timing=timing,
                params={"N": p, "P": p, "rho": rho, "damping": LAM},
                flops=_flops("ntkcore", p, rho), roofline_flops=_roofline_flops(p, rho),
                error=_residual(d, u, g), target=target, gemm_gflops=gemm_gflops,
                note="dense P x P infeasible; error = relative residual",
            ))
            del fn, u, g, d
    return rows
