"""Regression on features (ntkcore.feature_regression): each function equals its kernel-space
counterpart on K = Phi Phi^T.

References: ntkcore's kernel path on the kernels of the same features (``gram`` of the features
as one dense Jacobian block, and the (N O, N O) matrix view of a full kernel; itself tested
against scikit-learn and SciPy in test_regression.py), independent float64 NumPy / SciPy
formulas (``solve``, ``lstsq``, ``expm``, ``multivariate_normal``), scikit-learn's
``Ridge(fit_intercept=False)``, and autograd through the kernel path or dense LU solves for the
gradients.  Tolerances: first-order bounds from the condition number of the solved system and
the length of the inner products that form the Gram matrices (tests/tolerances.py).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import array_api_compat
import numpy as np
import pytest
import scipy.linalg
import scipy.stats
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import Ridge
from sklearn.metrics import r2_score
from sklearn.model_selection import GridSearchCV, KFold, cross_val_score
from sklearn.utils.estimator_checks import parametrize_with_checks

import ntkcore
from ntkcore.modes import FULL
from tests.tolerances import kernel_tol, solve_tol

pytestmark = [pytest.mark.supports(
    "feature_regression", "feature_gd_mse_predict", "feature_gp_inference", "FeatureRidge",
    "kernel_regression", "gd_mse_predict", "gp_inference", "gram"),
    # many small eager JAX operations of changing shapes: compile them without XLA's passes
    pytest.mark.usefixtures("jax_quick_compile")]

#: (N, O or None, D): the primal side (D < rows) and the dual side (D >= rows), trace/full mode
CASES = [(30, None, 8), (6, None, 15), (7, 3, 12), (5, 3, 40)]
IDS = ["primal", "dual", "full-primal", "full-dual"]
norm = np.linalg.norm


def _problem(rng, n, o, d, k=None, m=4):
    lead = (n,) if o is None else (n, o)
    phi = rng.normal(size=(*lead, d)) / np.sqrt(d)
    phi_s = rng.normal(size=(m, *lead[1:], d)) / np.sqrt(d)
    y = rng.normal(size=(*lead, *(() if k is None else (k,))))
    return phi, y, phi_s


def _flat(phi, y, phi_s):
    """Rows (R, D) of the features, columns (R, K) of the targets, test rows (M O, D)."""
    d = phi.shape[-1]
    p = phi.reshape(-1, d)
    return p, y.reshape(len(p), -1), phi_s.reshape(-1, d)


def _kernel_path(backend, phi, y, phi_s):
    """K, y, K_*, K_** on the backend by ntkcore's kernel path: ``gram`` of the features as
    one dense Jacobian block (N, O, D), in full mode the (N O, N O) matrix view."""
    full = phi.ndim == 3
    a, b = (ntkcore.DenseBlock(backend.asarray(p if full else p[:, None, :]))
            for p in (phi, phi_s))
    ks = [ntkcore.gram(a, mode="full" if full else "trace"),
          ntkcore.gram(b, a, mode="full" if full else "trace"),
          ntkcore.gram(b, mode="full" if full else "trace")]
    if full:
        ks = [FULL.matrix(array_api_compat.array_namespace(k), k) for k in ks]
        y = y.reshape(-1, *y.shape[2:])
    return ks[0], backend.asarray(y), ks[1], ks[2]


def _tol(c, n, dtype=np.float64):
    """First-order relative error of two computations that solve a system of condition number
    ``c`` whose matrix is a Gram matrix of inner products of length ``n``: rounding the Gram
    matrix (gamma_n, relative to its norm) and the solve (eps), each amplified by ``c``."""
    return solve_tol(dtype, c, computations=2) + c * kernel_tol(dtype, n, computations=2)


def _pred_scale(p, ps, alpha):
    """||K_*|| ||alpha|| >= ||K_* alpha||: the scale of a prediction's forward error."""
    return norm(ps, 2) * norm(p, 2) * norm(alpha)


# -- kernel ridge ----------------------------------------------------------------------------
@pytest.mark.parametrize("k", [None, 2])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_ridge_equals_kernel_regression(backend, rng, case, k):
    phi, y, phi_s = _problem(rng, *case, k=k)
    p, yy, ps = _flat(phi, y, phi_s)
    reg = 0.3
    kk = p @ p.T + reg * np.eye(len(p))
    alpha = np.linalg.solve(kk, yy)
    ref = (ps @ p.T @ alpha).reshape(phi_s.shape[0], *y.shape[1:])
    out = ntkcore.feature_regression(backend.asarray(phi), backend.asarray(y),
                                     backend.asarray(phi_s), reg=reg)
    assert backend.is_native(out) and tuple(out.shape) == ref.shape
    est = ntkcore.FeatureRidge(alpha=reg).fit(backend.asarray(phi), backend.asarray(y))
    k_tr, y_k, k_te, _ = _kernel_path(backend, phi, y, phi_s)
    kernel = ntkcore.kernel_regression(k_tr, y_k, k_te, reg=reg)
    tol = _tol(np.linalg.cond(kk), max(p.shape)) * _pred_scale(p, ps, alpha)
    for got in (out, est.predict(backend.asarray(phi_s)), kernel):
        assert norm(backend.to_numpy(got).reshape(ref.shape) - ref) <= tol


def test_float32_stays_float32(backend, rng):
    phi, y, phi_s = _problem(rng, 30, None, 8)
    out = ntkcore.feature_regression(backend.asarray(phi, "float32"), backend.asarray(y, "float32"),
                                     backend.asarray(phi_s, "float32"), reg=0.1)
    assert str(out.dtype).endswith("float32")
    g = phi.T @ phi + 0.1 * np.eye(8)
    beta = np.linalg.solve(g, phi.T @ y)
    # rounding the inputs to float32, forming G (30 terms) and the solve, amplified by cond(G)
    tol = _tol(np.linalg.cond(g), 32, np.float32) * norm(phi_s, 2) * norm(beta)
    assert norm(backend.to_numpy(out) - phi_s @ beta) <= tol


def test_reg_zero_primal_is_least_squares(backend, rng):
    """More rows than features and reg = 0: least squares, without jitter (the kernel path
    needs jitter there: K has rank D < N); the gradient-flow limit t = inf is the same."""
    phi, y, phi_s = _problem(rng, 30, None, 8, k=2)
    beta = np.linalg.lstsq(phi, y, rcond=None)[0]
    ref = phi_s @ beta
    args = [backend.asarray(a) for a in (phi, y, phi_s)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ntkcore.JitterWarning)
        outs = [ntkcore.feature_regression(*args),
                ntkcore.feature_gd_mse_predict(*args, float("inf"))]
    tol = _tol(np.linalg.cond(phi.T @ phi), 30) * norm(phi_s, 2) * norm(beta)
    for out in outs:
        assert norm(backend.to_numpy(out) - ref) <= tol
    with pytest.raises(ntkcore.NotPositiveDefiniteError, match="reg > 0"):
        ntkcore.feature_gp_inference(*args)


def test_reg_zero_dual_interpolates(backend, rng):
    """Fewer rows than features and reg = 0: the N x N kernel is factorised (never the
    singular D x D Gram matrix), no jitter, training targets interpolated, zero variance."""
    phi, y, _ = _problem(rng, 6, None, 15)
    k = phi @ phi.T
    args = [backend.asarray(a) for a in (phi, y, phi)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ntkcore.JitterWarning)
        out = ntkcore.feature_regression(*args)
        post = ntkcore.feature_gp_inference(*args)
    tol = _tol(np.linalg.cond(k), 15)
    scale = norm(k, 2) * norm(np.linalg.solve(k, y))
    assert norm(backend.to_numpy(out) - y) <= tol * scale
    assert norm(backend.to_numpy(post.mean) - y) <= tol * scale
    assert np.max(np.abs(backend.to_numpy(post.variance))) <= tol * norm(k, 2)
    assert post.jitter == 0.0


def test_rank_deficient_features_get_the_jitter_policy(backend, rng):
    phi, y, phi_s = _problem(rng, 20, None, 6)
    phi[:, 2] = 0.0  # Phi^T Phi has a zero row and column: not positive definite
    args = [backend.asarray(a) for a in (phi, y, phi_s)]
    with pytest.warns(ntkcore.JitterWarning, match=r"phi_train\^T phi_train"):
        est = ntkcore.FeatureRidge(alpha=0.0).fit(*args[:2])
    assert est.jitter_ > 0
    g = phi.T @ phi + est.jitter_ * np.eye(6)
    beta = np.linalg.solve(g, phi.T @ y)
    tol = _tol(np.linalg.cond(g), 20) * norm(phi_s, 2) * norm(beta)
    assert norm(backend.to_numpy(est.predict(args[2])) - phi_s @ beta) <= tol
    with pytest.raises(ntkcore.NotPositiveDefiniteError, match=r"phi_train\^T phi_train"):
        ntkcore.feature_regression(*args, jitter=None)


# -- gradient flow ---------------------------------------------------------------------------
def _gd_reference(p, yy, ps, t, lr, reg):
    kk = p @ p.T + reg * np.eye(len(p))
    flow = np.eye(len(p)) if np.isinf(t) else np.eye(len(p)) - scipy.linalg.expm(-lr * kk * t)
    return ps @ p.T @ np.linalg.solve(kk, flow @ yy)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gd_equals_kernel_gd(backend, rng, case):
    phi, y, phi_s = _problem(rng, *case, k=2)
    p, yy, ps = _flat(phi, y, phi_s)
    ts, lr, reg = [0.0, 0.5, 3.0, float("inf")], 0.7, 0.3
    shape = (phi_s.shape[0], *y.shape[1:])
    out = ntkcore.feature_gd_mse_predict(backend.asarray(phi), backend.asarray(y),
                                         backend.asarray(phi_s), backend.asarray(np.array(ts)),
                                         learning_rate=lr, reg=reg)
    assert backend.is_native(out) and tuple(out.shape) == (len(ts), *shape)
    k_tr, y_k, k_te, _ = _kernel_path(backend, phi, y, phi_s)
    kernel = ntkcore.gd_mse_predict(k_tr, y_k, k_te, backend.asarray(np.array(ts)),
                                    learning_rate=lr, reg=reg)
    kk = p @ p.T + reg * np.eye(len(p))
    tol = _tol(np.linalg.cond(kk), max(p.shape)) * _pred_scale(p, ps, np.linalg.solve(kk, yy))
    for i, t in enumerate(ts):
        ref = _gd_reference(p, yy, ps, t, lr, reg).reshape(shape)
        for got in (out, kernel):
            assert norm(backend.to_numpy(got)[i].reshape(shape) - ref) <= tol, t
    single = ntkcore.feature_gd_mse_predict(backend.asarray(phi), backend.asarray(y),
                                            backend.asarray(phi_s), 0.5, learning_rate=lr,
                                            reg=reg)
    np.testing.assert_array_equal(backend.to_numpy(single).shape, shape)
    assert norm(backend.to_numpy(single) - backend.to_numpy(out)[1]) <= tol


# -- GP inference ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gp_equals_gp_inference(backend, rng, case):
    phi, y, phi_s = _problem(rng, *case, k=2)
    p, yy, ps = _flat(phi, y, phi_s)
    reg = 0.3
    kk = p @ p.T + reg * np.eye(len(p))
    ks, kss = ps @ p.T, ps @ ps.T
    alpha = np.linalg.solve(kk, yy)
    mean = (ks @ alpha).reshape(phi_s.shape[0], *y.shape[1:])
    cov = kss - ks @ np.linalg.solve(kk, ks.T)
    lml = sum(scipy.stats.multivariate_normal(np.zeros(len(p)), kk).logpdf(c) for c in yy.T)
    post = ntkcore.feature_gp_inference(backend.asarray(phi), backend.asarray(y),
                                        backend.asarray(phi_s), reg=reg, covariance=True)
    k_tr, y_k, k_te, k_tt = _kernel_path(backend, phi, y, phi_s)
    kpost = ntkcore.gp_inference(k_tr, y_k, k_te, k_tt, reg=reg)
    c = np.linalg.cond(kk)
    tol = _tol(c, max(p.shape))
    cov_scale = norm(ks, 2) ** 2 / reg + norm(kss, 2)  # ||K_* (K + reg I)^{-1} K_*^T|| + ||K_**||
    assert post.jitter == 0.0 and tuple(post.variance.shape) == phi_s.shape[:-1]
    assert tuple(post.covariance.shape) == cov.shape
    for got in (post, kpost):
        assert norm(backend.to_numpy(got.mean).reshape(mean.shape) - mean) <= tol * _pred_scale(
            p, ps, alpha)
        assert norm(backend.to_numpy(got.covariance) - cov) <= tol * cov_scale
        var = backend.to_numpy(got.variance).reshape(-1)
        assert norm(var - np.diag(cov)) <= tol * cov_scale
        # |d log p| <= |d y^T alpha| / 2 + cols |d log det| / 2, with |d log det| <= R c rel.err
        assert abs(float(backend.to_numpy(got.log_marginal_likelihood)) - lml) <= tol * (
            abs(float(np.sum(yy * alpha))) + len(p) * yy.shape[1])
    assert ntkcore.gp_inference(k_tr, y_k, k_te, reg=reg).variance is None
    assert ntkcore.feature_gp_inference(backend.asarray(phi), backend.asarray(y),
                                        backend.asarray(phi_s), reg=reg).covariance is None


# -- gradients -------------------------------------------------------------------------------
def _grads(framework, f, *arrays):
    """Gradients of the scalar ``f`` with respect to every argument, as float64 NumPy."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
        args = [torch.tensor(a, requires_grad=True) for a in arrays]
        f(*args).backward()
        return [a.grad.numpy() for a in args]
    jax = pytest.importorskip("jax")
    grad = jax.grad(f, argnums=tuple(range(len(arrays))))
    return [np.asarray(g) for g in grad(*(jax.numpy.asarray(a) for a in arrays))]


def _expm(a):
    if array_api_compat.is_torch_array(a):
        import torch

        return torch.linalg.matrix_exp(a)
    import jax

    return jax.scipy.linalg.expm(a)


def _flat_xp(phi, y, phi_s):
    xp = array_api_compat.array_namespace(phi)
    d = phi.shape[-1]
    p = xp.reshape(phi, (-1, d))
    return xp, p, xp.reshape(y, (p.shape[0], -1)), xp.reshape(phi_s, (-1, d))


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_equal_kernel_path_gradients(rng, framework, case):
    """Gradients with respect to phi_train, y_train and phi_test of a loss of the ridge
    predictions, the gradient-flow predictions and the GP posterior equal those of the kernel
    path on K = Phi Phi^T built in the graph (gradient flow: the dense formula with a matrix
    exponential and an LU solve, as the kernel path's eigh has no gradient at the repeated
    eigenvalues of a rank-deficient K)."""
    phi, y, phi_s = _problem(rng, *case, k=2)
    p = phi.reshape(-1, phi.shape[-1])
    reg, lr, t = 0.3, 0.7, 0.5
    w = [rng.normal(size=s) for s in ((phi_s.shape[0], *y.shape[1:]), phi_s.shape[:-1])]

    def feature_loss(a, b, c):
        xp = array_api_compat.array_namespace(a)
        post = ntkcore.feature_gp_inference(a, b, c, reg=reg)
        return (xp.sum(xp.asarray(w[0]) * ntkcore.feature_regression(a, b, c, reg=reg))
                + xp.sum(xp.asarray(w[0]) * ntkcore.feature_gd_mse_predict(
                    a, b, c, t, learning_rate=lr, reg=reg))
                + xp.sum(xp.asarray(w[0]) * post.mean) + xp.sum(xp.asarray(w[1]) * post.variance)
                + post.log_marginal_likelihood)

    def kernel_loss(a, b, c):
        xp, pa, yb, pc = _flat_xp(a, b, c)
        k, ks = pa @ pa.T, pc @ pa.T
        kk = k + reg * xp.eye(k.shape[0], dtype=k.dtype)
        post = ntkcore.gp_inference(k, yb, ks, pc @ pc.T, reg=reg)
        flow = ks @ xp.linalg.solve(kk, yb - _expm(-lr * t * kk) @ yb)
        w0 = xp.reshape(xp.asarray(w[0]), (ks.shape[0], -1))
        return (xp.sum(w0 * ntkcore.kernel_regression(k, yb, ks, reg=reg)) + xp.sum(w0 * flow)
                + xp.sum(w0 * post.mean) + xp.sum(xp.reshape(xp.asarray(w[1]), (-1,))
                                                  * post.variance)
                + post.log_marginal_likelihood)

    got = _grads(framework, feature_loss, phi, y, phi_s)
    ref = _grads(framework, kernel_loss, phi, y, phi_s)
    kk = p @ p.T + reg * np.eye(len(p))
    # two solves per gradient (the adjoint and the primal), and exp(-lr t (K + reg I))
    tol = 2 * _tol(np.linalg.cond(kk), max(p.shape)) * (1 + lr * t * norm(kk, 2))
    for g, r in zip(got, ref, strict=True):
        assert g.shape == r.shape
        assert norm(g - r) <= tol * norm(r), (norm(g - r) / norm(r), tol)


# -- jax.jit ---------------------------------------------------------------------------------
def _outputs(phi, y, phi_s, ts, reg):
    post = ntkcore.feature_gp_inference(phi, y, phi_s, reg=max(reg, 0.1), covariance=True)
    return (ntkcore.feature_regression(phi, y, phi_s, reg=reg),
            ntkcore.feature_gd_mse_predict(phi, y, phi_s, ts, reg=reg),
            ntkcore.FeatureRidge(alpha=reg).fit(phi, y).predict(phi_s),
            post.mean, post.variance, post.covariance, post.log_marginal_likelihood)


@pytest.mark.parametrize("case", [*CASES[:3], "jitter"], ids=[*IDS[:3], "jitter"])
def test_jit_matches_eager(rng, case):
    """Under jax.jit every function equals its eager float64 result, jitter included (a
    bounded lax loop there), and so does the gradient."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    phi, y, phi_s = _problem(rng, *(CASES[0] if case == "jitter" else case), k=2)
    reg = 0.0 if case == "jitter" else 0.3
    if case == "jitter":
        phi[..., 2] = 0.0
    args = [jnp.asarray(a) for a in (phi, y, phi_s, np.array([0.5, 3.0, np.inf]))]
    with pytest.warns(ntkcore.JitterWarning) if case == "jitter" else warnings.catch_warnings():
        eager = _outputs(*args, reg)
    jitted = jax.jit(_outputs, static_argnums=4)(*args, reg)
    p = phi.reshape(-1, phi.shape[-1])
    g = p.T @ p + max(reg, 1e-10 * np.mean(np.sum(p * p, 0))) * np.eye(p.shape[1])
    tol = _tol(np.linalg.cond(g), max(p.shape))
    for got, ref in zip(jitted, eager, strict=True):
        ref = np.asarray(ref)
        assert norm(np.asarray(got) - ref) <= tol * max(norm(ref), 1e-300)

    def loss(a):
        return jnp.sum(ntkcore.feature_regression(a, args[1], args[2], reg=reg) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ntkcore.JitterWarning)
        g_eager = np.asarray(jax.grad(loss)(args[0]))
    g_jit = np.asarray(jax.jit(jax.grad(loss))(args[0]))
    assert norm(g_jit - g_eager) <= 2 * tol * norm(g_eager)


# -- the estimator ---------------------------------------------------------------------------
EXPECTED_FAILED = {
    "check_complex_data": "complex input raises TypeError (ntkcore's dtype convention)",
    "check_dtype_object": "object arrays raise TypeError: features are numeric arrays",
    "check_estimators_empty_data_messages": "the message names phi_train and its shape",
    "check_fit2d_predict1d": "the message says 'must have shape (N, D) or (N, O, D)'",
}


@parametrize_with_checks([ntkcore.FeatureRidge(alpha=1.0)],
                         expected_failed_checks=lambda est: EXPECTED_FAILED)
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)


@pytest.mark.parametrize("shape", [(40, 6), (6, 15)], ids=["primal", "dual"])
@pytest.mark.parametrize("k", [None, 2])
def test_feature_ridge_matches_sklearn_ridge(backend, rng, shape, k):
    phi = rng.normal(size=shape)
    y = rng.normal(size=(shape[0],) if k is None else (shape[0], k))
    phi_s = rng.normal(size=(5, shape[1]))
    ref = Ridge(alpha=0.5, fit_intercept=False).fit(phi, y)
    est = ntkcore.FeatureRidge(alpha=0.5).fit(backend.asarray(phi), backend.asarray(y))
    assert backend.is_native(est.coef_) and tuple(est.coef_.shape) == ref.coef_.shape
    assert est.n_features_in_ == shape[1]
    g = phi.T @ phi + 0.5 * np.eye(shape[1])
    tol = _tol(np.linalg.cond(g), max(shape))
    assert norm(backend.to_numpy(est.coef_) - ref.coef_) <= tol * norm(ref.coef_)
    pred = est.predict(backend.asarray(phi_s))
    assert backend.is_native(pred)
    assert norm(backend.to_numpy(pred) - ref.predict(phi_s)) <= tol * norm(phi_s, 2) * norm(
        ref.coef_)
    y_s = rng.normal(size=ref.predict(phi_s).shape)
    assert abs(est.score(backend.asarray(phi_s), backend.asarray(y_s))
               - r2_score(y_s, backend.to_numpy(pred))) <= 1e3 * np.finfo(float).eps


def _r2_tol(phi, y, folds, alphas):
    """Bound on the difference of two computations of a fold's test R^2: with the prediction
    error delta <= t ||Phi_test|| ||beta|| (t from the fold's conditioning),
    |d SS_res| <= (2 ||y - pred|| + delta) delta, divided by SS_tot; the worst fold and alpha."""
    worst = 0.0
    for a in alphas:
        for tr, te in folds:
            beta = Ridge(alpha=a, fit_intercept=False).fit(phi[tr], y[tr]).coef_
            pred = phi[te] @ beta
            g = phi[tr].T @ phi[tr] + a * np.eye(phi.shape[1])
            delta = _tol(np.linalg.cond(g), len(tr)) * norm(phi[te], 2) * norm(beta)
            ss_tot = np.sum((y[te] - y[te].mean()) ** 2)
            worst = max(worst, (2 * norm(y[te] - pred) + delta) * delta / ss_tot)
    return worst


def test_grid_search_clone_and_cross_validation_match_sklearn(rng):
    phi = rng.normal(size=(60, 8))
    y = phi @ rng.normal(size=8) + 0.3 * rng.normal(size=60)
    grid = {"alpha": [1e-2, 1e-1, 1.0, 10.0]}
    cv = KFold(4, shuffle=True, random_state=0)
    folds = list(cv.split(phi))
    ours = GridSearchCV(ntkcore.FeatureRidge(), grid, cv=cv).fit(phi, y)
    ref = GridSearchCV(Ridge(fit_intercept=False), grid, cv=cv).fit(phi, y)
    assert ours.best_params_ == ref.best_params_
    np.testing.assert_allclose(ours.cv_results_["mean_test_score"],
                               ref.cv_results_["mean_test_score"], rtol=0,
                               atol=_r2_tol(phi, y, folds, grid["alpha"]))
    np.testing.assert_allclose(cross_val_score(ntkcore.FeatureRidge(alpha=0.1), phi, y, cv=cv),
                               cross_val_score(Ridge(0.1, fit_intercept=False), phi, y, cv=cv),
                               rtol=0, atol=_r2_tol(phi, y, folds, [0.1]))
    est = ntkcore.FeatureRidge(alpha=0.5, jitter=None)
    assert est.get_params() == {"alpha": 0.5, "jitter": None}
    assert repr(est) == "FeatureRidge(alpha=0.5, jitter=None)"
    assert repr(ntkcore.FeatureRidge()) == "FeatureRidge()"
    twin = clone(est)
    assert twin is not est and twin.get_params() == est.get_params()
    with pytest.raises(ValueError, match="Invalid parameter 'reg'"):
        est.set_params(reg=1.0)
    assert not est.__sklearn_tags__().input_tags.pairwise
    assert ntkcore.KernelRidge().__sklearn_tags__().input_tags.pairwise


def test_feature_ridge_full_mode(rng):
    phi, y, phi_s = _problem(rng, 7, 3, 12, k=2)
    est = ntkcore.FeatureRidge(alpha=0.3).fit(phi, y)
    assert est.coef_.shape == (2, 12)
    ref = ntkcore.feature_regression(phi, y, phi_s, reg=0.3)
    np.testing.assert_array_equal(est.predict(phi_s).shape, ref.shape)
    p = phi.reshape(-1, 12)
    tol = _tol(np.linalg.cond(p.T @ p + 0.3 * np.eye(12)), 21)
    pred = est.predict(phi_s)
    assert norm(pred - ref) <= tol * norm(ref)
    assert abs(est.score(phi_s, ref) - r2_score(ref.reshape(4, -1), pred.reshape(4, -1))
               ) <= 1e3 * np.finfo(float).eps  # the same formula, summed in another order
    with pytest.raises(ValueError, match=r"phi_test must have shape \(M, 3, 12\)"):
        est.predict(phi_s[:, :2])


def test_feature_ridge_protocol_errors(rng, monkeypatch):
    phi, y, _ = _problem(rng, 10, None, 4)
    with pytest.raises(NotFittedError, match="not fitted"):
        ntkcore.FeatureRidge().predict(phi)
    with pytest.raises(ValueError, match="alpha"):
        ntkcore.FeatureRidge(alpha=-1.0).fit(phi, y)
    with pytest.raises(ValueError, match="jitter must be"):
        ntkcore.FeatureRidge(jitter="always").fit(phi, y)
    with pytest.raises(ValueError, match="requires y"):
        ntkcore.FeatureRidge().fit(phi, None)
    est = ntkcore.FeatureRidge(alpha=0.1).fit(phi, y)
    with pytest.raises(ValueError, match="X has 3 features, but FeatureRidge is expecting 4"):
        est.predict(phi[:, :3])
    yi = (y > 0).astype(np.int64)
    ref = ntkcore.FeatureRidge(alpha=0.1).fit(phi, yi.astype(np.float64)).predict(phi)
    got = ntkcore.FeatureRidge(alpha=0.1).fit(phi.tolist(), yi.tolist()).predict(phi.tolist())
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    np.testing.assert_array_equal(got, ref)
    monkeypatch.setitem(sys.modules, "sklearn.exceptions", None)  # scikit-learn absent
    with pytest.raises(ntkcore.kernel_ridge.NotFittedError):
        ntkcore.FeatureRidge().predict(phi)


def test_sklearn_is_not_imported():
    """The functional feature regressions never import scikit-learn; ``ntkcore.FeatureRidge``
    is built on first access, with scikit-learn's bases (tests/test_kernel_ridge.py)."""
    code = ("import sys, numpy as np, ntkcore\n"
            "x = np.arange(12.0).reshape(4, 3) ** 0.5\n"
            "ntkcore.feature_regression(x, np.ones(4), x, reg=1.0)\n"
            "ntkcore.feature_gp_inference(x, np.ones(4), x, reg=1.0)\n"
            "assert 'sklearn' not in sys.modules, 'sklearn imported'\n"
            "ntkcore.FeatureRidge(alpha=1.0).fit(x, np.ones(4)).predict(x)\n"
            "assert 'sklearn.base' in sys.modules, 'built without scikit-learn'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# -- bad input -------------------------------------------------------------------------------
FUNCTIONS = {
    "feature_regression": lambda a, b, c, **kw: ntkcore.feature_regression(a, b, c, **kw),
    "feature_gd_mse_predict": lambda a, b, c, **kw: ntkcore.feature_gd_mse_predict(
        a, b, c, 1.0, **kw),
    "feature_gp_inference": lambda a, b, c, reg=0.1, **kw: ntkcore.feature_gp_inference(
        a, b, c, reg=reg, **kw),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_bad_input_names_the_argument(backend, name):
    f = FUNCTIONS[name]
    phi, y, phi_s = (backend.asarray(np.ones(s)) for s in ((5, 3), (5,), (2, 3)))
    with pytest.raises(ValueError, match=r"phi_train must have shape \(N, D\) or \(N, O, D\)"):
        f(backend.asarray(np.ones(5)), y, phi_s)
    with pytest.raises(ValueError, match=r"phi_test must have shape \(M, 3\)"):
        f(phi, y, backend.asarray(np.ones((2, 4))))
    with pytest.raises(ValueError, match=r"phi_test must have shape \(M, 2, 3\)"):
        f(backend.asarray(np.ones((5, 2, 3))), backend.asarray(np.ones((5, 2))), phi_s)
    with pytest.raises(ValueError, match=r"y_train must have shape \(N,\) or \(N, K\)"):
        f(phi, backend.asarray(np.ones(4)), phi_s)
    with pytest.raises(ValueError, match=r"y_train must have shape \(N, O\) or \(N, O, K\)"):
        f(backend.asarray(np.ones((5, 2, 3))), backend.asarray(np.ones((5, 3))),
          backend.asarray(np.ones((2, 2, 3))))
    with pytest.raises(ValueError, match="phi_train must have at least one row"):
        f(backend.asarray(np.ones((0, 3))), backend.asarray(np.ones(0)), phi_s)
    bad = np.ones((5, 3))
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="phi_train contains NaN or Inf"):
        f(backend.asarray(bad), y, phi_s)
    with pytest.raises(ValueError, match="y_train contains NaN or Inf"):
        f(phi, backend.asarray(np.array([1, np.inf, 0, 0, 0])), phi_s)
    with pytest.raises(ValueError, match="phi_test contains NaN or Inf"):
        f(phi, y, backend.asarray(bad[:2]))
    with pytest.raises(TypeError, match="phi_train must have a real floating dtype"):
        f(backend.asarray(np.ones((5, 3)), "int64"), y, phi_s)
    with pytest.raises(ValueError, match="reg must be non-negative"):
        f(phi, y, phi_s, reg=-1.0)
    if name == "feature_gd_mse_predict":
        with pytest.raises(ValueError, match="non-negative times"):
            ntkcore.feature_gd_mse_predict(phi, y, phi_s, -1.0)
        with pytest.raises(ValueError, match="learning_rate must be positive"):
            ntkcore.feature_gd_mse_predict(phi, y, phi_s, 1.0, learning_rate=0.0)
    else:
        with pytest.raises(ValueError, match="jitter must be"):
            f(phi, y, phi_s, jitter="always")


def test_mixed_namespaces_and_inputs_not_mutated(rng):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="y_train is a torch array but phi_train is a numpy"):
        ntkcore.feature_regression(np.ones((3, 2)), torch.ones(3, dtype=torch.float64),
                                   np.ones((3, 2)))
    phi, y, phi_s = _problem(rng, 7, 3, 12, k=2)
    copies = [a.copy() for a in (phi, y, phi_s)]
    ntkcore.feature_regression(phi, y, phi_s, reg=0.1)
    ntkcore.feature_gd_mse_predict(phi, y, phi_s, [0.0, 1.0], reg=0.1)
    ntkcore.feature_gp_inference(phi, y, phi_s, reg=0.1, covariance=True)
    ntkcore.FeatureRidge(alpha=0.1).fit(phi, y).predict(phi_s)
    for a, c in zip((phi, y, phi_s), copies, strict=True):
        np.testing.assert_array_equal(a, c)


# -- streamed primal ridge from a model (FeatureRidge.fit_model) ----------------------------
def _stream_case(backend, rng, mode, n=40):
    from ntkcore.models import MLP

    net = MLP.random((3, 6, 2), xp=backend.xp, seed=0, dtype=backend.xp.float64,
                     device=backend.device, activation="tanh")
    x, x_s = rng.normal(size=(n, 3)), rng.normal(size=(5, 3))
    y = rng.normal(size=(n,) if mode == "trace" else (n, 2))
    return net, x, y, x_s


@pytest.mark.parametrize("mode", ["trace", "full"])
def test_fit_model_streams_and_equals_fit_on_features(backend, rng, mode):
    """fit_model accumulates Phi^T Phi and Phi^T y over sample batches (here the smallest
    budget: one sample at a time, the first being the probe) and equals fit(features(...)) on
    the whole features; predict_model streams the test features of the same projection."""
    net, x, y, x_s = _stream_case(backend, rng, mode)
    kw = dict(dim=12, seed=4, mode=mode)
    bx, by, bxs = backend.asarray(x), backend.asarray(y), backend.asarray(x_s)
    phi = ntkcore.features(net, bx, **kw)
    ref = ntkcore.FeatureRidge(alpha=0.1).fit(phi, by)
    with pytest.raises(ntkcore.BudgetTooSmallError, match="dim x dim matrices") as info:
        ntkcore.FeatureRidge(alpha=0.1).fit_model(net, bx, by, max_memory=1, **kw)
    calls = []
    est = ntkcore.FeatureRidge(alpha=0.1).fit_model(
        net, bx, by, max_memory=info.value.needed, progress=lambda d, t: calls.append(d), **kw)
    assert calls == list(range(1, 41))  # 8 + 32 samples, one at a time: 40 batches
    assert backend.is_native(est.coef_) and est.n_features_in_ == 12
    p = backend.to_numpy(phi).reshape(-1, 12)
    tol = _tol(np.linalg.cond(p.T @ p + 0.1 * np.eye(12)), len(p))
    want = backend.to_numpy(ref.coef_)
    assert norm(backend.to_numpy(est.coef_) - want) <= tol * norm(want)
    pred = est.predict_model(net, bxs, max_memory=info.value.needed)
    ref_pred = backend.to_numpy(ref.predict(ntkcore.features(net, bxs, **kw)))
    assert backend.is_native(pred) and tuple(pred.shape) == ref_pred.shape
    assert norm(backend.to_numpy(pred) - ref_pred) <= tol * norm(ref_pred)


def test_fit_model_stays_within_max_memory(rng, small_ufunc_buffers):
    """NumPy allocations (tracemalloc) of a streamed fit stay below max_memory, which is
    below the bytes of the (N, dim) features it never holds."""
    import tracemalloc

    from ntkcore.models import MLP

    net = MLP.random((5, 32, 32, 3), xp=np, seed=0, activation="tanh")
    x, y = rng.normal(size=(3000, 5)), rng.normal(size=(3000, 3))
    budget = 1_000_000
    assert 3000 * 96 * 8 > 2 * budget  # the whole features would not fit
    tracemalloc.start()
    try:
        est = ntkcore.FeatureRidge(alpha=1e-2).fit_model(net, x, y, dim=96, seed=2,
                                                         max_memory=budget)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= budget
    phi = ntkcore.features(net, x, dim=96, seed=2)
    ref = ntkcore.FeatureRidge(alpha=1e-2).fit(phi, y)
    tol = _tol(np.linalg.cond(phi.T @ phi + 1e-2 * np.eye(96)), 3000)
    assert norm(est.coef_ - ref.coef_) <= tol * norm(ref.coef_)


def test_fit_model_errors(rng):
    from tests.conftest import make_case

    net, x, y, _ = _stream_case(make_case("numpy"), rng, "trace")
    with pytest.raises(ValueError, match="y must have one row per sample of x"):
        ntkcore.FeatureRidge().fit_model(net, x, y[:-1], dim=8)
    with pytest.raises(NotFittedError, match=r"fit_model\(model, x, y"):
        ntkcore.FeatureRidge().predict_model(net, x)
    est = ntkcore.FeatureRidge(alpha=0.1).fit_model(net, x, y, dim=8)
    jac = ntkcore.FeatureRidge(alpha=0.1).fit_model(net.jacobian(x), None, y, dim=8)
    np.testing.assert_array_equal(jac.coef_, est.coef_)  # a Jacobian as the model: the same
    est.fit(ntkcore.features(net, x, dim=8), y)  # plain fit: no model arguments remembered
    with pytest.raises(NotFittedError):
        est.predict_model(net, x)
