"""Hypothesis strategies shared by the tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


@st.composite
def spd_matrices(draw: st.DrawFn, max_n: int = 12, max_cond: float = 1e6) -> np.ndarray:
    """Symmetric positive definite (n, n) float64 matrices with condition number <= max_cond."""
    n = draw(st.integers(1, max_n))
    seed = draw(st.integers(0, 2**32 - 1))
    log_cond = draw(st.floats(0.0, np.log10(max_cond)))
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    eig = np.logspace(0, -log_cond, n) * draw(st.floats(0.1, 10.0))
    k = (q * eig) @ q.T
    return (k + k.T) / 2


def cond(k: np.ndarray) -> float:
    return float(np.linalg.cond(k))
