r"""Kernel ridge regression on precomputed kernels, as a scikit-learn estimator.

:class:`KernelRidge` is a scikit-learn regressor (``RegressorMixin``, ``BaseEstimator`` when
scikit-learn is installed; ``get_params`` / ``set_params``, ``score``, ``__sklearn_tags__``
with ``input_tags.pairwise``, fitted attributes ending in ``_``, ``NotFittedError``), so
``clone``, pipelines, ``GridSearchCV`` and ``cross_val_score`` accept it.  The class is built
on first access of ``KernelRidge`` (this module's ``__getattr__``), so that ``import
ntkcore`` does not import scikit-learn; without scikit-learn it implements the protocol
itself.  How, and how lists and integer arrays are converted: :mod:`ntkcore._estimator`
(shared with :class:`ntkcore.FeatureRidge`).  The arrays stay in the caller's namespace:
NumPy in, NumPy out; torch in, torch out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._estimator import NotFittedError, Regressor, as_floating_arrays, lazy_module_attributes
from ._typing import Array
from ._validation import check_kernel, check_scalar, namespace_of, promote
from .regression import check_regression_inputs, jitter_cap, ridge_solve
from .support import DIFFERENTIABLE, TRIANGULAR_SOLVE, capabilities

__all__ = ["KernelRidge", "NotFittedError"]


@capabilities(name="KernelRidge", fast=TRIANGULAR_SOLVE, note=DIFFERENTIABLE)
class KernelRidgeCore(Regressor):
    r"""Kernel ridge regression on precomputed kernels, one Cholesky factor for many predictions.

    A scikit-learn regressor whose ``X`` is a kernel (``kernel="precomputed"`` in
    :class:`sklearn.kernel_ridge.KernelRidge`): ``fit(k_train, y)`` with
    ``k_train`` (N, N), ``predict(k_test_train)`` with ``k_test_train`` (M, N).

    Parameters
    ----------
    alpha : float, default 1.0
        Ridge :math:`\lambda \ge 0` added to the diagonal of the training kernel (an
        absolute value, as in scikit-learn, whose default it shares; an eNTK's diagonal can
        be large or small, so choose it relative to ``mean(diag k_train)`` or by
        ``GridSearchCV``).  ``0.0`` interpolates (with the jitter policy when ``k_train`` is
        singular).
    jitter : "auto", float or None, default "auto"
        Jitter policy when the factorisation fails (see :mod:`ntkcore.regression`).

    Attributes
    ----------
    chol_ : array, shape (N, N)
        Lower Cholesky factor of ``k_train + (alpha + jitter_) I``.
    dual_coef_ : array, shape (N,) or (N, K)
        Dual coefficients :math:`(K + \lambda I)^{-1} y`.
    jitter_ : float
        Absolute jitter that was needed (0.0 normally).
    n_features_in_ : int
        N, the number of training points (columns of ``k_test_train``).

    Examples
    --------
    >>> import numpy as np, ntkcore
    >>> k = np.array([[2.0, 1.0], [1.0, 2.0]]); y = np.array([1.0, -1.0])
    >>> ntkcore.KernelRidge(alpha=0.0).fit(k, y).predict(k)
    array([ 1., -1.])
    """

    _pairwise = True

    def __init__(self, alpha: float = 1.0, *, jitter: str | float | None = "auto") -> None:
        self.alpha = alpha
        self.jitter = jitter

    def fit(self, k_train: Array, y: Array) -> KernelRidge:
        r"""Factorise ``k_train`` (N, N) and solve for the targets ``y`` (N,) or (N, K).

        Errors about ``y`` name it ``y_train``, as :func:`ntkcore.kernel_regression` does.

        Raises
        ------
        TypeError
            Arrays of different libraries, a complex dtype, an object array or a sparse
            matrix (the argument is named).
        ValueError
            ``y`` is None, ``alpha < 0``, an unknown ``jitter``, wrong shapes, NaN/Inf in
            ``k_train`` or ``y``, or ``k_train`` asymmetric beyond ``1000 eps max|diag K|``
            (see :mod:`ntkcore.regression`; within it :math:`(K + K^\top)/2` is used).
        NotPositiveDefiniteError
            ``k_train + alpha I`` is not positive definite even with the allowed jitter.
        """
        if y is None:
            raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y "
                             "is None")
        return self._fit(*as_floating_arrays(k_train=k_train, y_train=y))

    def _fit(self, k_train: Array, y_train: Array) -> KernelRidge:
        """:meth:`fit` for floating arrays (:func:`ntkcore.kernel_regression` calls it)."""
        alpha = check_scalar(self.alpha, "alpha", nonnegative=True)
        jitter_cap(self.jitter)
        xp, backend = namespace_of(k_train=k_train, y_train=y_train)
        k_train, y_train, _ = check_regression_inputs(xp, k_train, y_train, None, backend)
        l, dual, eps = ridge_solve(xp, backend, k_train, y_train, alpha, self.jitter)
        self.chol_ = l
        self.dual_coef_ = dual
        self.jitter_ = eps
        self.n_features_in_ = int(k_train.shape[0])
        return self

    def predict(self, k_test_train: Array) -> Array:
        """Predictions ``k_test_train @ dual_coef_``: (M, N) -> (M,) or (M, K).

        Raises
        ------
        NotFittedError
            Before :meth:`fit` (scikit-learn's when it is installed).
        ValueError
            Wrong shape or NaN/Inf in ``k_test_train``.
        """
        self._check_fitted("dual_coef_", "fit(k_train, y)")
        return self._predict(*as_floating_arrays(k_test_train=k_test_train))

    def _predict(self, k_test_train: Array) -> Array:
        xp, _ = namespace_of(k_test_train=k_test_train, dual_coef_=self.dual_coef_)
        check_kernel(xp, k_test_train, "k_test_train", "(M, N)")
        n = self.n_features_in_
        if k_test_train.shape[1] != n:
            raise ValueError(
                f"k_test_train must have N={n} columns (X has {k_test_train.shape[1]} features, "
                f"but KernelRidge is expecting {n} features as input); got shape "
                f"{tuple(k_test_train.shape)}"
            )
        k_test_train, dual = promote(xp, k_test_train, self.dual_coef_)
        return k_test_train @ dual


if TYPE_CHECKING:
    KernelRidge = KernelRidgeCore
else:  # ``KernelRidge``, built on first access
    __getattr__, __dir__ = lazy_module_attributes(KernelRidgeCore, "KernelRidge", globals())
