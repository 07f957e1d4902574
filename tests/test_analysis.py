"""Tests of ntkcore.analysis against direct float64 NumPy formulas (explicit centering matrices,
numpy.linalg.eigvalsh, einsum traces of dense Jacobians)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ntkcore
from ntkcore import analysis

pytestmark = pytest.mark.supports(
    "analysis.kernel_alignment", "analysis.relative_kernel_distance", "analysis.kernel_spectrum",
    "analysis.effective_rank", "analysis.trace_share",
)


def fixture_settings(max_examples: int) -> settings:
    return settings(max_examples=min(max_examples, settings.default.max_examples),
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow], deadline=None)


def ref_alignment(k1, k2, centered):
    if centered:
        h1 = np.eye(k1.shape[0]) - 1.0 / k1.shape[0]
        h2 = np.eye(k1.shape[1]) - 1.0 / k1.shape[1]
        k1, k2 = h1 @ k1 @ h2, h1 @ k2 @ h2
    return np.sum(k1 * k2) / np.sqrt(np.sum(k1 * k1) * np.sum(k2 * k2))


def psd(rng, n, rank=None):
    x = rng.standard_normal((n, rank or n))
    return x @ x.T


def as_matrix(k4):
    n1, n2, o, _ = k4.shape
    return k4.transpose(0, 2, 1, 3).reshape(n1 * o, n2 * o)


@fixture_settings(10)
@given(n1=st.integers(2, 8), n2=st.integers(2, 8), centered=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_alignment_matches_formula(backend, n1, n2, centered, seed):
    if backend.name == "jax":
        pytest.skip("jax compiles every new shape; covered by test_fixed_shapes")
    rng = np.random.default_rng(seed)
    k1, k2 = rng.standard_normal((n1, n2)), rng.standard_normal((n1, n2))
    got = analysis.kernel_alignment(backend.asarray(k1), backend.asarray(k2), centered=centered)
    assert backend.is_native(got) and got.ndim == 0
    np.testing.assert_allclose(float(backend.to_numpy(got)), ref_alignment(k1, k2, centered),
                               rtol=1e-10)


def test_fixed_shapes(backend, rng):
    n, o = 5, 2
    x = rng.standard_normal((n * o, 4))
    k = (x @ x.T).reshape(n, o, n, o).transpose(0, 2, 1, 3)  # (N, N, O, O) PSD
    y = rng.standard_normal((n * o, 3))
    k2 = (y @ y.T).reshape(n, o, n, o).transpose(0, 2, 1, 3)
    kb, k2b = backend.asarray(k), backend.asarray(k2)
    m, m2 = as_matrix(k), as_matrix(k2)
    cka = analysis.centered_kernel_alignment(kb, k2b)
    np.testing.assert_allclose(float(backend.to_numpy(cka)), ref_alignment(m, m2, True),
                               rtol=1e-10)
    assert 0.0 <= float(backend.to_numpy(cka)) <= 1.0  # PSD kernels
    dist = analysis.relative_kernel_distance(kb, k2b)
    np.testing.assert_allclose(float(backend.to_numpy(dist)),
                               np.linalg.norm(m - m2) / np.linalg.norm(m2), rtol=1e-10)
    ev = backend.to_numpy(analysis.kernel_spectrum(kb))
    np.testing.assert_allclose(ev, np.linalg.eigvalsh(m)[::-1], rtol=1e-9, atol=1e-9)
    er = float(backend.to_numpy(analysis.effective_rank(kb)))
    lam = np.clip(np.linalg.eigvalsh(m), 0, None)
    p = lam / lam.sum()
    p = p[p > 0]
    np.testing.assert_allclose(er, np.exp(-np.sum(p * np.log(p))), rtol=1e-8)
    assert 1.0 <= er <= 4.0 + 1e-9  # rank 4


def test_alignment_invariances(rng):
    k1, k2 = psd(rng, 6), psd(rng, 6)
    a = float(analysis.kernel_alignment(k1, k2))
    assert float(analysis.kernel_alignment(3.0 * k1, k2)) == pytest.approx(a, rel=1e-12)
    # centering removes constant offsets (H 1 = 0)
    assert float(analysis.kernel_alignment(k1 + 5.0, k2)) == pytest.approx(a, rel=1e-10)
    assert float(analysis.kernel_alignment(k1, k1)) == pytest.approx(1.0, rel=1e-12)
    assert float(analysis.kernel_alignment(k1, k1, centered=False)) == pytest.approx(1.0)
    assert float(analysis.relative_kernel_distance(k1, k1)) == 0.0
    assert float(analysis.relative_kernel_distance(2 * k1, k1)) == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["entropy", "participation"])
def test_effective_rank_known_spectra(method):
    # r equal eigenvalues: both definitions give exactly r
    for r in (1, 3, 7):
        lam = np.zeros(10)
        lam[:r] = 2.5
        assert float(analysis.effective_rank(lam, method=method)) == pytest.approx(r, rel=1e-12)
    lam = np.array([4.0, 1.0, 0.0, -1e-14])  # rounding negatives are clipped
    if method == "participation":
        assert float(analysis.effective_rank(lam, method=method)) == pytest.approx(25.0 / 17.0)
    else:
        p = np.array([0.8, 0.2])
        assert float(analysis.effective_rank(lam, method=method)) == pytest.approx(
            np.exp(-np.sum(p * np.log(p))))


def test_effective_rank_of_low_rank_kernel(backend, rng):
    if backend.name == "jax":
        pytest.skip("covered by test_fixed_shapes")
    k = psd(rng, 8, rank=3)
    for method in ("entropy", "participation"):
        er = float(backend.to_numpy(analysis.effective_rank(backend.asarray(k), method=method)))
        assert 1.0 <= er <= 3.0 + 1e-6


@pytest.mark.parametrize("mode", ["trace", "diagonal", "full"])
def test_trace_share_of_layerwise_kernel(backend, rng, mode):
    if backend.name == "jax" and mode != "trace":
        pytest.skip("covered by the trace variant")
    a, g = rng.standard_normal((5, 2, 3)), rng.standard_normal((5, 2, 2, 4))
    d = rng.standard_normal((5, 2, 6))
    j = ntkcore.Jacobian([ntkcore.KroneckerBlock(backend.asarray(a), backend.asarray(g),
                                                 name="conv"),
                          ntkcore.DenseBlock(backend.asarray(d), name="fc")])
    dense = [np.einsum("nsoi,nsj->noij", g, a).reshape(5, 2, -1), d]
    traces = np.array([np.sum(x * x) for x in dense])  # tr Theta_b = sum ||J_b[n, o]||^2
    lw = ntkcore.gram(j, mode=mode, layerwise=True)
    share = backend.to_numpy(analysis.trace_share(lw))
    np.testing.assert_allclose(share, traces / traces.sum(), rtol=1e-10)
    named = analysis.trace_share(lw, names=["conv", "fc"])
    assert set(named) == {"conv", "fc"}
    assert named["conv"] == pytest.approx(traces[0] / traces.sum(), rel=1e-10)
    # directly from the Jacobian, without a kernel
    np.testing.assert_allclose(backend.to_numpy(analysis.layer_traces(j)), traces, rtol=1e-10)
    from_j = analysis.trace_share(j)
    assert list(from_j) == ["conv", "fc"]
    assert from_j["fc"] == pytest.approx(traces[1] / traces.sum(), rel=1e-10)


def test_validation(rng):
    k = psd(rng, 4)
    with pytest.raises(ValueError, match="same shape"):
        analysis.kernel_alignment(k, psd(rng, 5))
    with pytest.raises(ValueError, match=r"k1 must have shape \(N1, N2\) or \(N1, N2, O, O\)"):
        analysis.kernel_alignment(np.ones((3, 3, 2)), np.ones((3, 3, 2)))
    with pytest.raises(ValueError, match="square"):
        analysis.kernel_spectrum(np.ones((3, 4)))
    with pytest.raises(ValueError, match="method"):
        analysis.effective_rank(k, method="nuclear")
    with pytest.raises(ValueError, match="same shape"):
        analysis.relative_kernel_distance(k, np.ones((4, 5)))
    with pytest.raises(ValueError, match="square layerwise"):
        analysis.trace_share(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match=r"k must have shape \(B, N, N\)"):
        analysis.trace_share(np.ones((3, 3)))
    with pytest.raises(ValueError, match="names has 1 entries"):
        analysis.trace_share(np.ones((2, 3, 3)), names=["a"])
    with pytest.raises(TypeError, match="real floating"):
        analysis.kernel_spectrum(np.ones((3, 3), dtype=np.int64))
    with pytest.raises(TypeError, match="Jacobian"):
        analysis.layer_traces(k)
    with pytest.raises(ValueError, match="NaN or Inf"):
        analysis.kernel_spectrum(np.full((2, 2), np.nan))


def test_top_level_exports():
    for name in ("gram", "kernel_alignment", "centered_kernel_alignment",
                 "relative_kernel_distance", "kernel_spectrum", "effective_rank",
                 "trace_share"):
        assert name in ntkcore.__all__ and callable(getattr(ntkcore, name))
    assert ntkcore.analysis is analysis
