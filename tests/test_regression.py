"""Cholesky kernel regression, gradient-flow predictions and GP inference.

References: scikit-learn's KernelRidge (precomputed kernel), scipy's cho_factor/cho_solve,
scipy.linalg.expm for the gradient-flow formula and scipy.stats for the GP likelihood, all in
float64 NumPy, independent of ntkcore's code path.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.kernel_ridge import KernelRidge as SkKernelRidge

import ntkcore
from tests.strategies import cond, spd_matrices
from tests.tolerances import solve_tol

pytestmark = pytest.mark.supports("kernel_regression", "gd_mse_predict", "gp_inference")


def _problem(rng, n=9, m=4, k=None):
    x = rng.normal(size=(n + m, 3))
    full = np.exp(-0.5 * ((x[:, None] - x[None]) ** 2).sum(-1)) + 0.1 * x @ x.T
    y = rng.normal(size=(n,) if k is None else (n, k))
    return full[:n, :n], y, full[n:, :n], full[n:, n:]


@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("reg", [0.0, 0.3])
def test_kernel_regression_matches_sklearn(backend, rng, k, reg):
    k_tr, y, k_te, _ = _problem(rng, k=k)
    ref = SkKernelRidge(alpha=reg if reg else 1e-300, kernel="precomputed").fit(k_tr, y)
    expected = ref.predict(k_te)
    out = ntkcore.kernel_regression(backend.asarray(k_tr), backend.asarray(y),
                                    backend.asarray(k_te), reg=reg)
    assert backend.is_native(out)
    assert out.shape == expected.shape
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=1e-8, atol=1e-10)


def test_float32_stays_float32(backend, rng):
    k_tr, y, k_te, _ = _problem(rng)
    out = ntkcore.kernel_regression(backend.asarray(k_tr, "float32"),
                                    backend.asarray(y, "float32"),
                                    backend.asarray(k_te, "float32"), reg=0.1)
    assert str(out.dtype).endswith("float32")
    ref = k_te @ np.linalg.solve(k_tr + 0.1 * np.eye(len(k_tr)), y)
    # rounding K to float32 and the float32 solve: eps * cond each, to first order (normwise)
    tol = solve_tol(np.float32, cond(k_tr + 0.1 * np.eye(len(k_tr))), computations=2)
    err = np.linalg.norm(backend.to_numpy(out) - ref) / np.linalg.norm(ref)
    assert err <= tol, (err, tol)


@settings(max_examples=20)
@given(k=spd_matrices(max_n=10, max_cond=1e6), seed=st.integers(0, 2**31))
def test_regression_property_against_scipy(k, seed):
    rng = np.random.default_rng(seed)
    n = k.shape[0]
    y = rng.normal(size=(n, 2))
    k_te = rng.normal(size=(3, n))
    ref = k_te @ scipy.linalg.cho_solve(scipy.linalg.cho_factor(k), y)
    out = ntkcore.kernel_regression(k, y, k_te)
    # forward error bound ~ cond(K) * eps, with margin
    tol = 100 * cond(k) * np.finfo(float).eps
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_training_points_are_interpolated_without_reg(backend, rng):
    k_tr, y, _, _ = _problem(rng)
    out = ntkcore.kernel_regression(backend.asarray(k_tr), backend.asarray(y),
                                    backend.asarray(k_tr))
    np.testing.assert_allclose(backend.to_numpy(out), y, rtol=1e-7, atol=1e-8)


# -- jitter ------------------------------------------------------------------------------
def test_jitter_rescues_singular_kernel_and_warns(backend, rng):
    x = rng.normal(size=(6, 2))
    k = x @ x.T  # rank 2: singular
    y = rng.normal(size=6)
    with pytest.warns(ntkcore.JitterWarning, match="jitter"):
        model = ntkcore.KernelRidge(alpha=0.0).fit(backend.asarray(k), backend.asarray(y))
    assert model.jitter_ > 0
    scale = np.mean(np.diag(k))
    # jitter is one of 1e-10, 1e-9, ... times mean(diag)
    rel = model.jitter_ / scale
    assert np.isclose(np.log10(rel), np.round(np.log10(rel)))
    ref = np.linalg.solve(k + model.jitter_ * np.eye(6), y)
    np.testing.assert_allclose(backend.to_numpy(model.dual_coef_), ref, rtol=1e-5)


def test_not_positive_definite_past_the_cap(backend):
    k = np.array([[1.0, 0.0], [0.0, -1.0]])
    y = np.ones(2)
    with pytest.raises(ntkcore.NotPositiveDefiniteError, match="not positive definite"):
        ntkcore.kernel_regression(backend.asarray(k), backend.asarray(y), backend.asarray(k))
    with pytest.raises(ntkcore.NotPositiveDefiniteError):
        ntkcore.kernel_regression(backend.asarray(k), backend.asarray(y), backend.asarray(k),
                                  jitter=None)
    assert issubclass(ntkcore.NotPositiveDefiniteError, ValueError)
    assert issubclass(ntkcore.JitterWarning, RuntimeWarning)


def test_jitter_cap_is_settable(rng):
    x = rng.normal(size=(5, 1))
    k = x @ x.T - 1e-4 * np.eye(5)  # needs jitter > 1e-4 * scale
    y = np.ones(5)
    with pytest.raises(ntkcore.NotPositiveDefiniteError):
        ntkcore.kernel_regression(k, y, k, jitter=1e-8)
    with pytest.warns(ntkcore.JitterWarning):
        ntkcore.kernel_regression(k, y, k, jitter=1.0)


# -- bad input ---------------------------------------------------------------------------
def test_bad_input_messages(backend):
    k = backend.asarray(np.eye(3))
    y = backend.asarray(np.ones(3))
    with pytest.raises(ValueError, match="k_train must be square"):
        ntkcore.kernel_regression(backend.asarray(np.ones((3, 2))), y, k)
    with pytest.raises(ValueError, match="y_train has 2 rows"):
        ntkcore.kernel_regression(k, backend.asarray(np.ones(2)), k)
    with pytest.raises(ValueError, match="k_test_train must have N=3"):
        ntkcore.kernel_regression(k, y, backend.asarray(np.ones((2, 2))))
    bad = np.eye(3)
    bad[0, 1] = np.nan
    with pytest.raises(ValueError, match="k_train contains NaN"):
        ntkcore.kernel_regression(backend.asarray(bad), y, k)
    with pytest.raises(ValueError, match="y_train contains NaN or Inf"):
        ntkcore.kernel_regression(k, backend.asarray(np.array([1, np.inf, 0])), k)
    with pytest.raises(ValueError, match="reg must be non-negative"):
        ntkcore.kernel_regression(k, y, k, reg=-1.0)
    with pytest.raises(TypeError, match="k_train must have a real floating dtype"):
        ntkcore.kernel_regression(backend.asarray(np.eye(3), "int64"), y, k)
    with pytest.raises(ValueError, match="y_train must have shape"):
        ntkcore.kernel_regression(k, backend.asarray(np.ones((3, 1, 1))), k)


def test_mixed_namespaces_rejected():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="y_train is a torch array but k_train is a numpy"):
        ntkcore.kernel_regression(np.eye(2), torch.ones(2, dtype=torch.float64), np.eye(2))
    with pytest.raises(TypeError, match="y_train must be an array"):
        ntkcore.kernel_regression(np.eye(2), [1.0, 2.0], np.eye(2))


def test_inputs_are_not_mutated(rng):
    k_tr, y, k_te, k_tt = _problem(rng)
    copies = [a.copy() for a in (k_tr, y, k_te, k_tt)]
    ntkcore.kernel_regression(k_tr, y, k_te, reg=0.1)
    ntkcore.gd_mse_predict(k_tr, y, k_te, [0.0, 1.0], reg=0.1)
    ntkcore.gp_inference(k_tr, y, k_te, k_tt, reg=0.1)
    for a, c in zip((k_tr, y, k_te, k_tt), copies, strict=True):
        np.testing.assert_array_equal(a, c)


# -- gradient flow -----------------------------------------------------------------------
def _gd_reference(k, y, ks, t, lr, reg):
    kk = k + reg * np.eye(len(k))
    return ks @ np.linalg.solve(kk, (np.eye(len(k)) - scipy.linalg.expm(-lr * kk * t)) @ y)


@pytest.mark.parametrize("k", [None, 2])
def test_gd_mse_predict_matches_matrix_exponential(backend, rng, k):
    k_tr, y, k_te, _ = _problem(rng, k=k)
    ts = [0.0, 0.5, 3.0]
    out = ntkcore.gd_mse_predict(backend.asarray(k_tr), backend.asarray(y),
                                 backend.asarray(k_te), backend.asarray(np.array(ts)),
                                 learning_rate=0.7, reg=0.05)
    assert backend.is_native(out)
    assert out.shape == (3, *(k_te.shape[:1]), *(() if k is None else (k,)))
    for i, t in enumerate(ts):
        np.testing.assert_allclose(backend.to_numpy(out)[i],
                                   _gd_reference(k_tr, y, k_te, t, 0.7, 0.05),
                                   rtol=1e-8, atol=1e-10)
    single = ntkcore.gd_mse_predict(backend.asarray(k_tr), backend.asarray(y),
                                    backend.asarray(k_te), 0.5, learning_rate=0.7, reg=0.05)
    np.testing.assert_allclose(backend.to_numpy(single), backend.to_numpy(out)[1], rtol=1e-12)


def test_gd_mse_predict_infinite_time_is_kernel_regression(backend, rng):
    k_tr, y, k_te, _ = _problem(rng)
    inf = ntkcore.gd_mse_predict(backend.asarray(k_tr), backend.asarray(y),
                                 backend.asarray(k_te), float("inf"))
    kr = ntkcore.kernel_regression(backend.asarray(k_tr), backend.asarray(y),
                                   backend.asarray(k_te))
    np.testing.assert_allclose(backend.to_numpy(inf), backend.to_numpy(kr), rtol=1e-7)


def test_gd_mse_predict_singular_kernel_finite_time(rng):
    x = rng.normal(size=(5, 2))
    k = x @ x.T
    y = rng.normal(size=5)
    out = ntkcore.gd_mse_predict(k, y, k, 2.0)
    np.testing.assert_allclose(out, _gd_reference(k, y, k, 2.0, 1.0, 0.0), atol=1e-8)
    with pytest.raises(ntkcore.NotPositiveDefiniteError):
        ntkcore.gd_mse_predict(k, y, k, float("inf"))
    with pytest.raises(ValueError, match="non-negative times"):
        ntkcore.gd_mse_predict(k, y, k, -1.0)
    with pytest.raises(ValueError, match="learning_rate must be positive"):
        ntkcore.gd_mse_predict(k, y, k, 1.0, learning_rate=0.0)


# -- GP inference ------------------------------------------------------------------------
@pytest.mark.parametrize("k", [None, 2])
def test_gp_inference_matches_dense_formulas(backend, rng, k):
    k_tr, y, k_te, k_tt = _problem(rng, k=k)
    reg = 0.2
    kk = k_tr + reg * np.eye(len(k_tr))
    mean = k_te @ np.linalg.solve(kk, y)
    cov = k_tt - k_te @ np.linalg.solve(kk, k_te.T)
    cols = y.reshape(len(y), -1).T
    lml = sum(scipy.stats.multivariate_normal(np.zeros(len(y)), kk).logpdf(c) for c in cols)
    post = ntkcore.gp_inference(backend.asarray(k_tr), backend.asarray(y),
                                backend.asarray(k_te), backend.asarray(k_tt), reg=reg)
    np.testing.assert_allclose(backend.to_numpy(post.mean), mean, rtol=1e-9)
    np.testing.assert_allclose(backend.to_numpy(post.covariance), cov, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(float(backend.to_numpy(post.log_marginal_likelihood)), lml,
                               rtol=1e-10)
    assert post.jitter == 0.0
    post2 = ntkcore.gp_inference(backend.asarray(k_tr), backend.asarray(y),
                                 backend.asarray(k_te), reg=reg)
    assert post2.covariance is None
    with pytest.raises(ValueError, match="k_test_test must have shape"):
        ntkcore.gp_inference(backend.asarray(k_tr), backend.asarray(y), backend.asarray(k_te),
                             backend.asarray(np.eye(2)))


# -- differentiability -------------------------------------------------------------------
def test_gradcheck_torch():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    xs = torch.randn(4, 3, generator=gen, dtype=torch.float64)

    def rbf(a, b):
        return torch.exp(-0.5 * torch.cdist(a, b) ** 2)

    y = torch.randn(6, 2, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(x_support, y_support):
        return ntkcore.kernel_regression(rbf(x_support, x_support), y_support,
                                         rbf(xs, x_support), reg=1e-2)

    x_req = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x_req, y))

    def g(x_support):
        post = ntkcore.gp_inference(rbf(x_support, x_support), y.detach(), rbf(xs, x_support),
                                    rbf(xs, xs), reg=1e-2)
        return post.mean, post.covariance, post.log_marginal_likelihood

    assert torch.autograd.gradcheck(g, (x_req,))

    def h(x_support):
        return ntkcore.gd_mse_predict(rbf(x_support, x_support), y.detach(),
                                      rbf(xs, x_support), [0.5, 2.0], reg=1e-1)

    assert torch.autograd.gradcheck(h, (x_req,))


def test_gradient_matches_dense_solve_gradient():
    """Gradient through Cholesky equals the gradient of the same loss through an LU solve."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    k0 = a @ a.T + 8 * torch.eye(8, dtype=torch.float64)
    y = torch.randn(8, generator=gen, dtype=torch.float64)
    ks = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    k1 = k0.clone().requires_grad_(True)
    (ntkcore.kernel_regression(k1, y, ks) ** 2).sum().backward()
    k2 = k0.clone().requires_grad_(True)
    sym = (k2 + k2.T) / 2  # cholesky reads one triangle: compare on the symmetric part
    (((ks @ torch.linalg.solve(sym, y)) ** 2).sum()).backward()
    g1, g2 = k1.grad, k2.grad
    np.testing.assert_allclose(((g1 + g1.T) / 2).numpy(), ((g2 + g2.T) / 2).numpy(), rtol=1e-8,
                               atol=1e-10)


def test_jax_grad():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    k_tr, y, k_te, _ = _problem(rng)

    def loss(kt):
        return jnp.sum(ntkcore.kernel_regression(jnp.asarray(k_tr), jnp.asarray(y), kt) ** 2)

    g = jax.grad(loss)(jnp.asarray(k_te))
    alpha = np.linalg.solve(k_tr, y)
    expected = 2 * np.outer(k_te @ alpha, alpha)
    np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-8)


# -- jax.jit ---------------------------------------------------------------------------------
def _jit_problem(rng, case):
    k_tr, y, k_te, k_tt = _problem(rng, k=2)
    if case == "jitter":  # indefinite by 3e-5 mean(diag): jitter 1e-4 mean(diag) repairs it
        x = rng.normal(size=(len(k_tr), 2))
        k_tr = x @ x.T - 3e-5 * np.mean(np.sum(x * x, axis=1)) * np.eye(len(k_tr))
    return k_tr, y, k_te, k_tt


def _regression_outputs(k_tr, y, k_te, k_tt, times):
    post = ntkcore.gp_inference(k_tr, y, k_te, k_tt, reg=0.0)
    return (ntkcore.kernel_regression(k_tr, y, k_te), ntkcore.gd_mse_predict(k_tr, y, k_te, times),
            post.mean, post.covariance, post.log_marginal_likelihood, post.jitter)


@pytest.mark.parametrize("case", ["definite", "jitter"])
def test_jit_matches_eager(rng, case):
    """kernel_regression, gd_mse_predict and gp_inference under jax.jit equal the un-jitted
    float64 results, jitter included (decided by a bounded lax loop under jit)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    k_tr, y, k_te, k_tt = (jnp.asarray(a) for a in _jit_problem(rng, case))
    times = jnp.asarray([0.5, 3.0] + ([float("inf")] if case == "definite" else []))
    with pytest.warns(ntkcore.JitterWarning) if case == "jitter" else warnings.catch_warnings():
        eager = _regression_outputs(k_tr, y, k_te, k_tt, times)
    jitted = jax.jit(_regression_outputs)(k_tr, y, k_te, k_tt, times)
    k = np.asarray(k_tr) + float(eager[-1]) * np.eye(len(k_tr))
    tol = solve_tol(np.float64, cond(k), computations=10)
    for got, ref in zip(jitted, eager, strict=True):
        ref = np.asarray(ref)
        assert np.linalg.norm(np.asarray(got) - ref) <= tol * max(np.linalg.norm(ref), 1e-300)
    # the gradient through the jittered factor, too (the lax loop runs outside autodiff)
    lml = lambda kk: ntkcore.gp_inference(kk, y, k_te, reg=0.0).log_marginal_likelihood  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ntkcore.JitterWarning)
        g_eager = np.asarray(jax.grad(lml)(k_tr))
    g_jit = np.asarray(jax.jit(jax.grad(lml))(k_tr))
    assert np.linalg.norm(g_jit - g_eager) <= tol * cond(k) * np.linalg.norm(g_eager)
    # kernel regression's gradient (refinement step) too; under jit k_train is always
    # symmetrised, so its gradient is the symmetric part of the eager one
    loss = lambda kk: jnp.sum(ntkcore.kernel_regression(kk, y, k_te) ** 2)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ntkcore.JitterWarning)
        g_eager = np.asarray(jax.grad(loss)(k_tr))
    g_jit, g_sym = np.asarray(jax.jit(jax.grad(loss))(k_tr)), (g_eager + g_eager.T) / 2
    assert np.linalg.norm(g_jit - g_sym) <= tol * cond(k) * np.linalg.norm(g_sym)


def test_jit_gives_nan_where_eager_raises():
    """Under jax.jit a value-dependent failure cannot raise: the result is NaN (documented)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    k = jnp.asarray([[1.0, 0.0], [0.0, -1.0]])  # indefinite beyond the jitter cap
    y = jnp.ones(2)
    with pytest.raises(ntkcore.NotPositiveDefiniteError):
        ntkcore.kernel_regression(k, y, k)
    assert np.all(np.isnan(jax.jit(ntkcore.kernel_regression)(k, y, k)))
    assert np.all(np.isnan(jax.jit(lambda a, b: ntkcore.gp_inference(a, b, a).mean)(k, y)))
    assert np.all(np.isnan(jax.jit(ntkcore.gd_mse_predict)(k, y, k, 1.0)))
    # a negative time and t = inf with a singular kernel: NaN for those times only
    ks = jnp.asarray([[1.0, 1.0], [1.0, 1.0]])
    out = np.asarray(jax.jit(ntkcore.gd_mse_predict)(ks, y, ks, jnp.asarray([1.0, -1.0, jnp.inf])))
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1:]))


@pytest.mark.parametrize("wide", ["k", "y"])
@pytest.mark.parametrize("fn", ["kernel_regression", "kernel_regression_cg", "gd_mse_predict",
                                "gp_inference", "KernelRidge", "cg_solve",
                                "feature_regression", "FeatureRidge"])
def test_mixed_float_dtypes_promote(backend, rng, fn, wide):
    """float32 and float64 inputs together are computed in float64 (the array API's
    promotion, as NumPy's matmul does; torch's matmul refuses mixed dtypes), on every entry
    point: the result is float64 and equals a float64 NumPy/SciPy solve of the inputs as
    the call received them (the float32 ones rounded)."""
    if backend.name == "jax":
        pytest.skip("eager backends: jax's promotion follows the same rule under its own x64")
    n, m, d, reg = 12, 4, 5, 0.1
    phi = rng.standard_normal((n, d))
    k = phi @ phi.T + np.eye(n)
    ks = rng.standard_normal((m, d)) @ phi.T
    phis = rng.standard_normal((m, d))
    y = rng.standard_normal(n)
    narrow = {"k": "float64", "y": "float32"} if wide == "k" else {"k": "float32",
                                                                     "y": "float64"}
    k_, ks_, phi_, phis_, y_ = (backend.asarray(x, narrow[w]) for x, w in
                                ((k, "k"), (ks, "k"), (phi, "k"), (phis, "k"), (y, "y")))
    # the float64 values the call received, and independent float64 references
    k64, ks64, phi64, phis64, y64 = (backend.to_numpy(x).astype(np.float64)
                                     for x in (k_, ks_, phi_, phis_, y_))
    kk = k64 + reg * np.eye(n)
    gram = phi64.T @ phi64 + reg * np.eye(d)
    if fn.startswith("feature") or fn == "FeatureRidge":
        ref, c = phis64 @ np.linalg.solve(gram, phi64.T @ y64), np.linalg.cond(gram)
    elif fn == "gd_mse_predict":
        ref, c = _gd_reference(k64, y64, ks64, 2.0, 1.0, reg), np.linalg.cond(kk)
    elif fn == "cg_solve":
        ref, c = np.linalg.solve(kk, y64), np.linalg.cond(kk)
    else:
        ref, c = ks64 @ np.linalg.solve(kk, y64), np.linalg.cond(kk)
    cg = dict(tol=1e-13, preconditioner=None, maxiter=200)
    if fn == "kernel_regression":
        got = ntkcore.kernel_regression(k_, y_, ks_, reg=reg)
    elif fn == "kernel_regression_cg":
        got = ntkcore.kernel_regression(k_, y_, ks_, reg=reg, solver="cg", **cg)
    elif fn == "gd_mse_predict":
        got = ntkcore.gd_mse_predict(k_, y_, ks_, 2.0, reg=reg)
    elif fn == "gp_inference":
        got = ntkcore.gp_inference(k_, y_, ks_, reg=reg).mean
    elif fn == "KernelRidge":
        got = ntkcore.KernelRidge(alpha=reg).fit(k_, y_).predict(ks_)
    elif fn == "cg_solve":
        got = ntkcore.cg_solve(k_, y_, reg=reg, **cg)[0]
    elif fn == "feature_regression":
        got = ntkcore.feature_regression(phi_, y_, phis_, reg=reg)
    else:
        got = ntkcore.FeatureRidge(alpha=reg).fit(phi_, y_).predict(phis_)
    assert got.dtype == backend.asarray(y, "float64").dtype
    err = np.linalg.norm(backend.to_numpy(got) - ref) / np.linalg.norm(ref)
    # float64 solves on both sides (the CG one stopped at 1e-13 relative residual)
    assert err <= solve_tol(np.float64, c, computations=4) + (c * 1e-13 if "cg" in fn else 0), err
