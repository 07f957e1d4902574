"""Error bounds for the tests, derived from the dtype, the size of the computation and its
conditioning; never from what one machine printed.

``u = eps / 2`` is the unit roundoff of the dtype.  Standard results (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., sections 3.1, 3.5 and 7.1):

- A sum or inner product of n terms computed in floating point errs by at most
  ``gamma_n * sum |terms|``, ``gamma_n = n u / (1 - n u)``, **for every order of summation**:
  every BLAS blocking, SIMD width (AVX2, AVX-512) and thread count.  (FMA only lowers it.)
- A kernel entry ``K[n, m] = <j_n, j_m>`` is such a sum of P products, and by Cauchy-Schwarz
  ``sum |j_n| |j_m| <= |j_n| |j_m| <= max_i K[i, i] = max |K|`` (K is positive semi-definite),
  so ``max |fl(K) - K| <= gamma_P max |K|``: :func:`kernel_tol`.  Rounding the inputs to the
  dtype first adds two roundings per product (``gamma_{P+2}``); a structured computation
  (Kronecker factors, trace over O outputs, a sum over B blocks) sums fewer terms per step and
  at most P in all.  A Jacobian computed by a model in that dtype adds the fan-ins of its layers
  (each forward/backward matmul is an inner product of that length), to first order.
- A backward-stable linear solve (Cholesky, LU) of a system with condition number ``cond`` has
  relative forward error ``cond * eps`` to first order (the worst-case constant grows with the
  size, typical errors do not): :func:`solve_tol`.
- Comparing two computations that both round doubles the bound (``computations=2``).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def unit_roundoff(dtype: Any) -> float:
    """u = eps / 2 of a NumPy / torch / JAX floating dtype (or its name)."""
    if not isinstance(dtype, (str, np.dtype, type)):
        dtype = str(dtype).rsplit(".", 1)[-1]  # torch.float32 -> "float32"
    return float(np.finfo(np.dtype(dtype)).eps) / 2


def gamma(dtype: Any, n: int) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of a sum of n terms."""
    nu = n * unit_roundoff(dtype)
    if nu >= 0.5:
        raise ValueError(f"n = {n} is too long a sum for {dtype}: the bound is vacuous")
    return nu / (1 - nu)


def kernel_tol(dtype: Any, n: int, computations: int = 1) -> float:
    """Bound on ``max |K_computed - K| / max |K|`` for a Gram/kernel matrix whose entries
    sum n products (see the module docstring)."""
    return computations * gamma(dtype, n)


def solve_tol(dtype: Any, cond: float, computations: int = 1) -> float:
    """First-order bound on the relative (normwise) forward error of a backward-stable solve
    with condition number ``cond``."""
    return computations * float(cond) * 2 * unit_roundoff(dtype)
