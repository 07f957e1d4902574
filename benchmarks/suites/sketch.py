r"""Sketched against exact: ``gram(sketch_jacobian(J, q))`` vs ``gram(J)``, and sketched SMW.

Cases
-----
``gram dense N=<n> P=<p>``
    One DenseBlock (N, 1, P).  Baseline: the exact ``ntkcore.gram(J)``.  Each impl
    ``<method> q=P/<k>`` times ``sketch_jacobian`` + ``gram`` together; ``error`` is the relative
    Frobenius error of the sketched Gram.  Target for q <= P/20: speedup >= 3.
``gram kronecker N=<n> S=<s> d=<d>``
    One KroneckerBlock with d_in = d_out = d at S positions (S = 1: a dense layer, S > 1: a
    convolution); the sketch is :math:`\Omega_A\otimes\Omega_G` and the result stays a
    Kronecker block.
``smw sketched P=<p> rho=<r>``
    ``smw_solve(U, g, damping, sketch=(method, q))`` against the exact smw_solve (baseline);
    ``error`` = relative error of the direction, against q.

Where the 3x target cannot be met, and why
------------------------------------------
* ``gram kronecker S=1`` at q = P/20.  The exact Gram of a one-position Kronecker block is
  itself cheap: :math:`(GG^\top)\odot(AA^\top)` costs :math:`N^2(d_A+d_G)/2` multiply-adds
  (two SYRKs; 268 M for N=512, d=1024).  The sketch keeps :math:`q_A=q_G=\sqrt{P/20}=229`
  columns of each factor, so the products shrink by :math:`(d_A+d_G)/(q_A+q_G)=4.5` at most,
  while the rest of ``gram`` (the N x N Hadamard product and output, planning) does not
  shrink at all: ``gram`` of the same N = 512 block with d = 8 takes 1.75 ms.  Measured
  single-threaded (CPU time, minimum of 60) on the loaded development machine: exact gram
  12-16 ms; ``sketch_jacobian`` 0.5-1.0 ms (uniform); gram of the sketched block 4.8 ms, of
  which the two products are 2.4 ms -> 2.3-2.7x.  At q = P/100 (q_A = q_G = 102, 10x fewer
  flops): 0.7 + 3.5 ms -> about 3.5x.  Leverage adds one pass over each factor (column
  norms, 2 MiB each here).
* ``gram dense`` leverage at q = P/20.  The probabilities need one pass over the block (column
  norms, 32 MiB: a few ms, memory bound) and the gather of q random columns touches about
  :math:`1-(1-1/20)^{16}=56\%` of the block's cache lines, so the sketch costs about one
  and a half reads of the block, against an exact Gram of :math:`N^2 P/2` multiply-adds
  (~30 ms on two cores): about 3x, not more.  Uniform sampling skips the norm pass.
* ``smw sketched`` leverage.  The probabilities need one pass over U (row norms, P x rho),
  and the direction :math:`d = (g - Ub)/\lambda` needs another whatever the sketch; the exact
  solve makes these two passes plus the SYRK :math:`P\rho^2/2`.  The speed-up of leverage is
  therefore bounded by about (2 passes + SYRK) / (2 passes), and drawing q of P = 200,000
  rows by probability (host copy and CDF of p) adds a few ms: measured 1.1-1.7x at
  q = P/200, rho = 64 (one thread; it was 0.6x before the one-pass norms); uniform
  sampling saves the norm pass and reaches 3-4x.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks._harness import Config, asarray, row, to_numpy

SUITE = "sketch"
METHODS = ("uniform", "leverage")


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _gram_rows(cfg: Config, backend: str, case_name: str, jac: Any, params: dict[str, Any],
               fractions: tuple[int, ...]) -> list[dict[str, Any]]:
    import ntkcore
    from ntkcore.sketch import sketch_jacobian

    rows = []
    exact = to_numpy(ntkcore.gram(jac)).astype(np.float64)
    p = jac.num_params
    rows.append(row(SUITE, case_name, "exact gram", backend=backend, device=cfg.device,
                    dtype=cfg.dtype, timing=cfg.time(lambda: ntkcore.gram(jac), backend),
                    params={**params, "P": p}, error=0.0))
    for method in METHODS:
        for k in fractions:
            q = max(1, p // k)

            def fn(method: str = method, q: int = q) -> Any:
                return ntkcore.gram(sketch_jacobian(jac, q, method=method, seed=0))

            err = _rel(to_numpy(fn()).astype(np.float64), exact)
            rows.append(row(
                SUITE, case_name, f"{method} q=P/{k}", backend=backend, device=cfg.device,
                dtype=cfg.dtype, timing=cfg.time(fn, backend),
                params={**params, "P": p, "q": q}, baseline="exact gram", error=err,
                target="speedup >= 3" if k >= 20 else None,
                note="sketch_jacobian + gram; error = relative Frobenius error of one draw",
            ))
    return rows


def run(cfg: Config) -> list[dict[str, Any]]:
    from ntkcore import DenseBlock, Jacobian, KroneckerBlock

    rows: list[dict[str, Any]] = []
    backends = [b for b in cfg.backends if b in ("numpy", "torch")]
    rng = np.random.default_rng(0)
    fractions = cfg.pick((20,), (100, 50, 20, 10))
    n, p = cfg.pick((32, 2048), (256, 32768))
    dense_np = rng.standard_normal((n, 1, p))
    dense_np[:, :, : p // 50] *= 10.0  # a few heavy parameters (where leverage helps)
    n_k, d = cfg.pick((32, 256), (512, 1024))
    kron_cases = [(n_k, 1, d), (cfg.pick(16, 128), cfg.pick(4, 16), d)]
    kron_np = [(rng.standard_normal((nn, s, d)), rng.standard_normal((nn, s, 1, d)))
               for nn, s, _ in kron_cases]
    for backend in backends:
        jac = Jacobian([DenseBlock(asarray(dense_np, backend, cfg.device, cfg.dtype))])
        rows += _gram_rows(cfg, backend, f"gram dense N={n} P={p}", jac, {"N": n}, fractions)
        for (nn, s, dd), (a, g) in zip(kron_cases, kron_np, strict=True):
            jac = Jacobian([KroneckerBlock(asarray(a, backend, cfg.device, cfg.dtype),
                                           asarray(g, backend, cfg.device, cfg.dtype))])
            rows += _gram_rows(cfg, backend, f"gram kronecker N={nn} S={s} d={dd}", jac,
                               {"N": nn, "S": s, "d": dd}, fractions)
        rows += _smw_rows(cfg, backend, rng)
    return rows


def _smw_rows(cfg: Config, backend: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    import ntkcore

    p, rho = cfg.pick((4000, 16), (200_000, 64))
    u_np = rng.standard_normal((p, rho)) * np.linspace(0.1, 3.0, p)[:, None] / np.sqrt(p)
    g_np = u_np @ rng.standard_normal(rho) + 0.01 * rng.standard_normal(p)
    u = asarray(u_np, backend, cfg.device, cfg.dtype)
    g = asarray(g_np, backend, cfg.device, cfg.dtype)
    lam = 1e-3
    case = f"smw sketched P={p} rho={rho}"
    exact = to_numpy(ntkcore.smw_solve(u, g, lam)).astype(np.float64)
    rows = [row(SUITE, case, "exact", backend=backend, device=cfg.device, dtype=cfg.dtype,
                timing=cfg.time(lambda: ntkcore.smw_solve(u, g, lam), backend),
                params={"N": p, "P": p, "rho": rho, "damping": lam}, error=0.0)]
    for method in METHODS:
        for k in cfg.pick((20,), (200, 50, 20, 5)):
            q = max(rho, p // k)

            def fn(method: str = method, q: int = q) -> Any:
                return ntkcore.smw_solve(u, g, lam, sketch=(method, q, 0))

            rows.append(row(
                SUITE, case, f"{method} q=P/{k}", backend=backend, device=cfg.device,
                dtype=cfg.dtype, timing=cfg.time(fn, backend),
                params={"N": p, "P": p, "rho": rho, "q": q, "damping": lam}, baseline="exact",
                error=_rel(to_numpy(fn()).astype(np.float64), exact),
                note="error of the sketched SENG direction against the exact SMW solve",
            ))
    return rows
