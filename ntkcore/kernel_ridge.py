r"""Kernel ridge regression on precomputed kernels, as a scikit-learn estimator.

:class:`KernelRidge` follows scikit-learn's estimator protocol (``get_params`` /
``set_params``, ``score``, ``__sklearn_tags__`` with ``input_tags.pairwise``, fitted
attributes ending in ``_``, ``NotFittedError``), so ``clone``, pipelines, ``GridSearchCV`` and
``cross_val_score`` accept it, without importing scikit-learn: the protocol is implemented
here, and scikit-learn is imported only by scikit-learn's own calls (``__sklearn_tags__``) and
to raise its ``NotFittedError``.  The arrays stay in the caller's namespace: NumPy in, NumPy
out; torch in, torch out.  Lists and other non-array inputs become NumPy arrays, and integer
or boolean arrays the floating dtype of the other argument (``float64`` if neither floats),
in their own namespace (a lazy NumPy import, for lists only).
"""

from __future__ import annotations

import inspect
from typing import Any

import array_api_compat

from ._typing import Array
from ._validation import check_array, check_scalar, namespace_of
from .backend import host_array
from .regression import _check_regression_inputs, _jitter_cap, _ridge_solve
from .support import DIFFERENTIABLE, TRIANGULAR_SOLVE, capabilities

__all__ = ["KernelRidge", "NotFittedError"]


class NotFittedError(ValueError, AttributeError):
    """:class:`KernelRidge` used before ``fit`` (raised as scikit-learn's own
    ``NotFittedError``, also a ``ValueError`` and ``AttributeError``, when it is installed)."""


def _floating(**arrays: Any) -> list[Any]:
    """The arguments as real floating arrays of one namespace (see the module docstring)."""
    out = {}
    for name, x in arrays.items():
        if x is not None and not array_api_compat.is_array_api_obj(x):
            kind = type(x).__name__
            x = host_array(x)
            if x.dtype == object:  # also scipy.sparse matrices (not supported)
                raise TypeError(f"{name} must be a dense array of numbers; got {kind} (sparse "
                                "input is not supported: densify it with .toarray())")
        out[name] = x
    xp, _ = namespace_of(**out)
    given = [x for x in out.values() if x is not None]
    floats = [x.dtype for x in given if xp.isdtype(x.dtype, "real floating")]
    target = xp.result_type(*floats) if floats else xp.float64
    return [xp.astype(x, target) if x is not None and xp.isdtype(x.dtype, ("integral", "bool"))
            else x for x in out.values()]


@capabilities(fast=TRIANGULAR_SOLVE, note=DIFFERENTIABLE)
class KernelRidge:
    r"""Kernel ridge regression on precomputed kernels, one Cholesky factor for many predictions.

    A scikit-learn regressor whose ``X`` is a kernel (``kernel="precomputed"`` in
    :class:`sklearn.kernel_ridge.KernelRidge`): ``fit(k_train, y)`` with
    ``k_train`` (N, N), ``predict(k_test_train)`` with ``k_test_train`` (M, N).

    Parameters
    ----------
    alpha : float, default 0.0
        Ridge :math:`\lambda \ge 0` added to the diagonal of the training kernel
        (scikit-learn's default is 1.0).
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

    def __init__(self, alpha: float = 0.0, *, jitter: str | float | None = "auto") -> None:
        self.alpha = alpha
        self.jitter = jitter

    # -- scikit-learn's estimator protocol ----------------------------------------------------
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor arguments, by name (scikit-learn's ``get_params``)."""
        return {p: getattr(self, p) for p in inspect.signature(type(self)).parameters}

    def set_params(self, **params: Any) -> KernelRidge:
        """Set constructor arguments by name; checked at the next :meth:`fit`."""
        valid = self.get_params()
        for key, value in params.items():
            if key not in valid:
                raise ValueError(f"Invalid parameter {key!r} for estimator {self}. Valid "
                                 f"parameters are: {sorted(valid)!r}.")
            setattr(self, key, value)
        return self

    def __repr__(self) -> str:
        defaults = {p: v.default for p, v in inspect.signature(type(self)).parameters.items()}
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items() if v != defaults[k])
        return f"{type(self).__name__}({args})"

    _estimator_type = "regressor"  # scikit-learn < 1.6

    def _more_tags(self) -> dict[str, bool]:  # scikit-learn < 1.6
        return {"pairwise": True, "multioutput": True}

    def __sklearn_tags__(self) -> Any:
        """scikit-learn's tags: a regressor whose ``X`` is a pairwise (kernel) matrix."""
        from sklearn.utils import InputTags, RegressorTags, Tags, TargetTags

        return Tags(estimator_type="regressor", regressor_tags=RegressorTags(),
                    target_tags=TargetTags(required=True, multi_output=True),
                    input_tags=InputTags(pairwise=True))

    # -- fit / predict ----------------------------------------------------------------------
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
        return self._fit(*_floating(k_train=k_train, y_train=y))

    def _fit(self, k_train: Array, y_train: Array) -> KernelRidge:
        """:meth:`fit` for floating arrays (:func:`ntkcore.kernel_regression` calls it)."""
        alpha = check_scalar(self.alpha, "alpha", nonnegative=True)
        _jitter_cap(self.jitter)
        xp, backend = namespace_of(k_train=k_train, y_train=y_train)
        k_train = _check_regression_inputs(xp, k_train, y_train, None, backend)
        l, dual, eps = _ridge_solve(xp, backend, k_train, y_train, alpha, self.jitter)
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
        if not hasattr(self, "dual_coef_"):
            try:
                from sklearn.exceptions import NotFittedError as error
            except ImportError:
                error = NotFittedError
            raise error(f"This {type(self).__name__} instance is not fitted yet; call "
                        "fit(k_train, y) before using this estimator")
        return self._predict(*_floating(k_test_train=k_test_train))

    def _predict(self, k_test_train: Array) -> Array:
        xp, _ = namespace_of(k_test_train=k_test_train, dual_coef_=self.dual_coef_)
        check_array(xp, k_test_train, "k_test_train", (2,), "(M, N)")
        n = self.n_features_in_
        if k_test_train.shape[1] != n:
            raise ValueError(
                f"k_test_train must have N={n} columns (X has {k_test_train.shape[1]} features, "
                f"but KernelRidge is expecting {n} features as input); got shape "
                f"{tuple(k_test_train.shape)}"
            )
        return k_test_train @ self.dual_coef_

    def score(self, k_test_train: Array, y: Array, sample_weight: Array | None = None) -> float:
        r"""Coefficient of determination :math:`R^2` of :meth:`predict` (scikit-learn's
        ``r2_score``: per output column :math:`1 - \sum w (y - \hat y)^2 /
        \sum w (y - \bar y_w)^2`, 1.0 for a constant column predicted exactly, else 0.0 for
        it; averaged over the columns)."""
        pred = self.predict(k_test_train)
        y, pred, w = _floating(y=y, pred=pred, sample_weight=sample_weight)
        xp, _ = namespace_of(y=y, pred=pred)
        if tuple(y.shape) != tuple(pred.shape):
            raise ValueError(f"y must have shape {tuple(pred.shape)}; got {tuple(y.shape)}")
        y2 = xp.reshape(y, (y.shape[0], -1))
        res = xp.reshape(y - pred, y2.shape)
        w = xp.ones_like(y2[:, :1]) if w is None else xp.reshape(w, (-1, 1))
        mean = xp.sum(w * y2, axis=0) / xp.sum(w)
        num = xp.sum(w * res**2, axis=0)
        den = xp.sum(w * (y2 - mean) ** 2, axis=0)
        safe = xp.where(den == 0, xp.ones_like(den), den)
        r2 = xp.where(den == 0, xp.astype(num == 0, den.dtype), 1 - num / safe)
        return float(xp.mean(r2))
