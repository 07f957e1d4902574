"""KernelRidge as a scikit-learn estimator on precomputed kernels.

References: scikit-learn's own ``KernelRidge(kernel="precomputed")`` (LAPACK ``solve`` with
``assume_a="pos"``) under the same ``GridSearchCV`` / ``cross_val_score`` machinery, scipy's
Cholesky solve and ``sklearn.metrics.r2_score``, all in float64 NumPy.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import scipy.linalg
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.kernel_ridge import KernelRidge as SkKernelRidge
from sklearn.metrics import r2_score
from sklearn.model_selection import GridSearchCV, KFold, cross_val_score
from sklearn.pipeline import Pipeline
from sklearn.utils.estimator_checks import parametrize_with_checks

import ntkcore
from ntkcore.kernel_ridge import NotFittedError as OwnNotFittedError
from tests.strategies import cond
from tests.tolerances import solve_tol

#: check_estimator checks that do not apply (the reasons are on docs/scikit-learn.md)
EXPECTED_FAILED = {
    "check_positive_only_tag_during_fit": "X - mean(X) of a kernel is not positive definite",
    "check_estimators_dtypes": "a float kernel truncated to integers is not positive definite",
    "check_complex_data": "complex input raises TypeError (ntkcore's dtype convention)",
    "check_dtype_object": "object arrays raise TypeError: kernels are numeric arrays",
    "check_estimators_empty_data_messages": "the message says 'k_train must be square'",
    "check_fit2d_predict1d": "the message says 'must have shape (M, N)'",
}


@parametrize_with_checks([ntkcore.KernelRidge(alpha=1.0)],
                         expected_failed_checks=lambda est: EXPECTED_FAILED)
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)


def _problem(rng, n=40, m=7, k=None):
    x = rng.normal(size=(n + m, 3))
    full = np.exp(-0.5 * ((x[:, None] - x[None]) ** 2).sum(-1))
    y = np.sin(x[:, 0]) + 0.1 * rng.normal(size=n + m)
    y = y if k is None else np.stack([y * (j + 1) for j in range(k)], 1)
    return full[:n, :n], y[:n], full[n:, :n], y[n:]


def _pred_tol(k, alpha):
    # both solvers backward stable: eps * cond each, to first order (normwise, relative)
    return solve_tol(np.float64, cond(k + alpha * np.eye(len(k))), computations=2)


def _r2_tol(y, pred, t):
    """Bound on |R^2 - R^2'| when ||pred - pred'|| <= t ||pred||:
    |d SS_res| <= (2 ||y - pred|| + t ||pred||) t ||pred||, divided by SS_tot."""
    p = np.linalg.norm(pred)
    return (2 * np.linalg.norm(y - pred) + t * p) * t * p / np.sum((y - y.mean(0)) ** 2)


def test_kernel_ridge_reuses_factor_for_many_predictions(backend, rng):
    k_tr, y, k_te, _ = _problem(rng, n=9, m=4, k=2)
    c, low = scipy.linalg.cho_factor(k_tr + 0.1 * np.eye(len(k_tr)), lower=True)
    alpha = scipy.linalg.cho_solve((c, low), y)
    model = ntkcore.KernelRidge(alpha=0.1).fit(backend.asarray(k_tr), backend.asarray(y))
    np.testing.assert_allclose(backend.to_numpy(model.dual_coef_), alpha, rtol=1e-9)
    np.testing.assert_allclose(backend.to_numpy(model.chol_), np.tril(c), rtol=1e-12)
    assert model.n_features_in_ == 9
    for rows in (slice(0, 2), slice(1, 4)):
        pred = model.predict(backend.asarray(k_te[rows]))
        np.testing.assert_allclose(backend.to_numpy(pred), k_te[rows] @ alpha, rtol=1e-9)


def test_params_clone_repr_and_pipeline(rng):
    est = ntkcore.KernelRidge(alpha=0.5, jitter=None)
    assert est.get_params() == {"alpha": 0.5, "jitter": None}
    assert repr(est) == "KernelRidge(alpha=0.5, jitter=None)"
    assert repr(ntkcore.KernelRidge()) == "KernelRidge()"
    twin = clone(est)
    assert twin is not est and twin.get_params() == est.get_params()
    assert est.set_params(alpha=2.0) is est and est.alpha == 2.0
    with pytest.raises(ValueError, match="Invalid parameter 'reg'"):
        est.set_params(reg=1.0)
    k_tr, y, k_te, _ = _problem(rng)
    pipe = Pipeline([("ridge", ntkcore.KernelRidge())]).set_params(ridge__alpha=0.3)
    ref = SkKernelRidge(alpha=0.3, kernel="precomputed").fit(k_tr, y).predict(k_te)
    got = pipe.fit(k_tr, y).predict(k_te)
    assert np.linalg.norm(got - ref) <= _pred_tol(k_tr, 0.3) * np.linalg.norm(ref)


def test_grid_search_matches_sklearn_precomputed(rng):
    k_tr, y, k_te, _ = _problem(rng)
    grid = {"alpha": [1e-3, 1e-2, 1e-1, 1.0]}
    cv = KFold(4, shuffle=True, random_state=0)
    ours = GridSearchCV(ntkcore.KernelRidge(), grid, cv=cv).fit(k_tr, y)
    ref = GridSearchCV(SkKernelRidge(kernel="precomputed"), grid, cv=cv).fit(k_tr, y)
    t = _pred_tol(k_tr, min(grid["alpha"]))  # a principal submatrix is no worse conditioned
    pred = ref.predict(k_te)
    assert ours.best_params_ == ref.best_params_
    assert np.linalg.norm(ours.predict(k_te) - pred) <= t * np.linalg.norm(pred)
    # per-fold R^2 within the bound implied by the prediction bound (pred ~ y on each fold)
    tol = max(_r2_tol(y, SkKernelRidge(alpha=a, kernel="precomputed").fit(k_tr, y).predict(k_tr),
                      t) for a in grid["alpha"])
    np.testing.assert_allclose(ours.cv_results_["mean_test_score"],
                               ref.cv_results_["mean_test_score"], rtol=0, atol=10 * tol + 1e-15)


def test_cross_val_score_and_score_match_sklearn(rng):
    k_tr, y, k_te, y_te = _problem(rng, k=2)
    w = rng.uniform(0.5, 2.0, size=len(y_te))
    est = ntkcore.KernelRidge(alpha=0.1)
    got = cross_val_score(est, k_tr, y, cv=5)
    ref = cross_val_score(SkKernelRidge(alpha=0.1, kernel="precomputed"), k_tr, y, cv=5)
    t = _pred_tol(k_tr, 0.1)
    np.testing.assert_allclose(got, ref, rtol=0, atol=10 * _r2_tol(y, y, t) + 1e-15)
    est.fit(k_tr, y)
    pred = est.predict(k_te)
    for weights in (None, w):
        assert abs(est.score(k_te, y_te, weights) - r2_score(y_te, pred, sample_weight=weights)
                   ) <= 1e3 * np.finfo(float).eps  # the same formula, summed in another order
    # constant column predicted exactly: 1.0 (sklearn's force_finite)
    assert est.score(k_tr[:3], est.predict(k_tr[:3])) == 1.0


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    k_tr, y, k_te, y_te = _problem(rng)
    est = ntkcore.KernelRidge(alpha=0.1).fit(torch.from_numpy(k_tr), torch.from_numpy(y))
    pred = est.predict(torch.from_numpy(k_te))
    assert isinstance(pred, torch.Tensor) and pred.dtype == torch.float64
    assert isinstance(est.dual_coef_, torch.Tensor)
    ref = SkKernelRidge(alpha=0.1, kernel="precomputed").fit(k_tr, y).predict(k_te)
    assert np.linalg.norm(pred.numpy() - ref) <= _pred_tol(k_tr, 0.1) * np.linalg.norm(ref)
    assert isinstance(est.score(torch.from_numpy(k_te), torch.from_numpy(y_te)), float)
    # integer targets become the kernel's floating dtype, in torch
    k32 = torch.from_numpy(k_tr).float()
    e32 = ntkcore.KernelRidge(alpha=0.1).fit(k32, torch.from_numpy((y > 0).astype(np.int64)))
    assert e32.dual_coef_.dtype == torch.float32


def test_fit_predict_under_jax_jit():
    """The estimator's fit and predict trace under ``jax.jit`` (the jitter search runs as a
    bounded lax loop there) and agree with scikit-learn's float64 solve."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not jax.config.jax_enable_x64:
        pytest.skip("needs jax_enable_x64 for a float64 comparison")
    rng = np.random.default_rng(2)
    k_tr, y, k_te, _ = _problem(rng)

    @jax.jit
    def fit_predict(k, yy, kt):
        return ntkcore.KernelRidge(alpha=0.1).fit(k, yy).predict(kt)

    pred = np.asarray(fit_predict(jnp.asarray(k_tr), jnp.asarray(y), jnp.asarray(k_te)))
    ref = SkKernelRidge(alpha=0.1, kernel="precomputed").fit(k_tr, y).predict(k_te)
    assert np.linalg.norm(pred - ref) <= _pred_tol(k_tr, 0.1) * np.linalg.norm(ref)


def test_lists_and_integer_targets(rng):
    k_tr, y, k_te, _ = _problem(rng, n=12)
    yi = (y > 0).astype(np.int64)
    ref = ntkcore.KernelRidge(alpha=0.1).fit(k_tr, yi.astype(np.float64)).predict(k_te)
    got = ntkcore.KernelRidge(alpha=0.1).fit(k_tr.tolist(), yi.tolist()).predict(k_te.tolist())
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    np.testing.assert_array_equal(got, ref)


def test_validation_in_fit_not_init(rng):
    k_tr, y, _, _ = _problem(rng, n=6)
    bad = ntkcore.KernelRidge(alpha=-1.0)  # sklearn: __init__ only stores
    with pytest.raises(ValueError, match="alpha"):
        bad.fit(k_tr, y)
    with pytest.raises(ValueError, match="jitter must be"):
        ntkcore.KernelRidge(jitter="always").fit(k_tr, y)
    with pytest.raises(ValueError, match="requires y"):
        ntkcore.KernelRidge().fit(k_tr, None)
    with pytest.raises(ValueError, match="reg"):  # kernel_regression keeps its argument name
        ntkcore.kernel_regression(k_tr, y, k_tr, reg=-1.0)


def test_not_fitted_error(monkeypatch):
    est = ntkcore.KernelRidge()
    with pytest.raises(NotFittedError, match="not fitted"):
        est.predict(np.eye(2))
    monkeypatch.setitem(sys.modules, "sklearn.exceptions", None)  # scikit-learn absent
    with pytest.raises(OwnNotFittedError) as info:
        est.predict(np.eye(2))
    assert isinstance(info.value, ValueError) and isinstance(info.value, AttributeError)


def _python(code: str) -> None:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr


def test_import_ntkcore_does_not_import_sklearn():
    """`import ntkcore` and the functional API leave scikit-learn alone; the estimator classes
    are built on first access, as real BaseEstimator / RegressorMixin subclasses, one class
    per process whichever module they are reached through."""
    _python("import sys, numpy as np, ntkcore\n"
            "assert 'sklearn' not in sys.modules, 'import ntkcore imported sklearn'\n"
            "ntkcore.kernel_regression(2 * np.eye(3), np.ones(3), np.eye(3), reg=0.1)\n"
            "ntkcore.feature_regression(np.eye(3), np.ones(3), np.eye(3), reg=0.1)\n"
            "assert {'KernelRidge', 'FeatureRidge'} <= set(dir(ntkcore))\n"
            "assert 'sklearn' not in sys.modules, 'the functional API imported sklearn'\n"
            "from sklearn.base import BaseEstimator, RegressorMixin\n"
            "from ntkcore.kernel_ridge import KernelRidge\n"
            "from ntkcore.feature_regression import FeatureRidge\n"
            "assert ntkcore.KernelRidge is KernelRidge and ntkcore.FeatureRidge is FeatureRidge\n"
            "for cls in (KernelRidge, FeatureRidge):\n"
            "    assert issubclass(cls, BaseEstimator) and issubclass(cls, RegressorMixin)\n"
            "    assert cls.__module__.startswith('ntkcore.') and cls.__qualname__ == "
            "cls.__name__\n")


def test_without_sklearn_the_estimators_work_as_before():
    """With scikit-learn absent the classes implement the protocol themselves: fit, predict,
    score, get_params / set_params, repr and the own NotFittedError, checked against NumPy."""
    _python("import sys\n"
            "sys.modules['sklearn'] = None  # the import fails as if not installed\n"
            "import numpy as np, ntkcore\n"
            "from ntkcore.kernel_ridge import NotFittedError\n"
            "rng = np.random.default_rng(0)\n"
            "x = rng.normal(size=(9, 3)); k = x @ x.T + np.eye(9); y = rng.normal(size=9)\n"
            "est = ntkcore.KernelRidge()\n"
            "assert est.get_params() == {'alpha': 1.0, 'jitter': 'auto'}\n"
            "assert repr(est) == 'KernelRidge()'\n"
            "assert repr(est.set_params(alpha=0.5)) == 'KernelRidge(alpha=0.5)'\n"
            "try:\n"
            "    est.predict(k)\n"
            "except NotFittedError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('no NotFittedError')\n"
            "pred = est.fit(k, y).predict(k[:4])\n"
            "ref = k[:4] @ np.linalg.solve(k + 0.5 * np.eye(9), y)\n"
            "assert np.allclose(pred, ref, rtol=1e-10, atol=1e-12), (pred, ref)\n"
            "p = est.predict(k)\n"
            "r2 = 1 - np.sum((y - p) ** 2) / np.sum((y - y.mean()) ** 2)\n"
            "assert abs(est.score(k, y) - r2) < 1e-12\n"
            "f = ntkcore.FeatureRidge().fit(x, y)\n"
            "assert np.allclose(f.coef_, np.linalg.solve(x.T @ x + np.eye(3), x.T @ y))\n"
            "for cls in (ntkcore.KernelRidge, ntkcore.FeatureRidge):\n"
            "    assert not any(c.__module__.startswith('sklearn') for c in cls.__mro__)\n")


@pytest.mark.parametrize("name", ["KernelRidge", "FeatureRidge"])
def test_check_estimator_has_no_inheritance_warning(name):
    """scikit-learn's check_estimator no longer warns that the class does not inherit from
    BaseEstimator, and the default (alpha=1.0, scikit-learn's) fails only the documented
    checks."""
    import warnings

    from sklearn.base import BaseEstimator, RegressorMixin
    from sklearn.utils.estimator_checks import check_estimator

    est = getattr(ntkcore, name)()
    assert isinstance(est, BaseEstimator) and isinstance(est, RegressorMixin)
    assert est.alpha == 1.0 == SkKernelRidge().alpha
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = check_estimator(est, on_fail=None)
    assert not [w for w in caught if "does not inherit" in str(w.message)]
    failed = {r["check_name"] for r in results if r["status"] == "failed"}
    expected = set(EXPECTED_FAILED) if name == "KernelRidge" else {
        "check_complex_data", "check_dtype_object", "check_estimators_empty_data_messages",
        "check_fit2d_predict1d"}
    assert failed == expected
