r"""Regression on features: kernel ridge, NTK gradient flow and GP inference for the kernel
:math:`K = \Phi\Phi^\top`, each equal to its counterpart of :mod:`ntkcore.regression` on
:math:`K` and :math:`K_* = \Phi_*\Phi^\top`.  Full-mode features (N, O, D) are the rows
``phi.reshape(N * O, D)`` of the (N O, N O) matrix view (:meth:`ntkcore.modes.Mode.matrix`),
with targets ``y.reshape(N * O, ...)``.

Each function solves on the smaller side (:func:`_gram`): the primal D x D system
:math:`(\Phi^\top\Phi + \lambda I)\beta = \Phi^\top y` when D < R rows, else the dual R x R
one of the kernel path, at O(R D min(R, D)).  Math, ``reg = 0``, costs and differentiability:
docs/features.md, "Regression on features".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import array_api_compat
from array_api_compat import device

from ._estimator import Regressor, as_floating_arrays, lazy_module_attributes
from ._typing import Array
from ._validation import check_array, check_finite, check_scalar, namespace_of, promote
from .backend import Backend
from .errors import NotPositiveDefiniteError
from .regression import (
    GPPosterior,
    check_times,
    cholesky_with_jitter,
    flow_factor,
    jitter_cap,
    ridge_solve,
)
from .support import DIFFERENTIABLE, TRIANGULAR_SOLVE, capabilities

__all__ = ["PRIMAL_COPIES", "FeatureRidge", "feature_gd_mse_predict", "feature_gp_inference",
           "feature_regression"]

_GRAM_NAMES = ("phi_train phi_train^T", "phi_train^T phi_train")  # dual, primal


def _rows(xp: Any, phi: Array, name: str, tail: tuple[int, ...] | None = None) -> Array:
    """``phi`` (N, D) or (N, O, D) checked, as rows (N O, D); ``tail``: the training
    features' ``shape[1:]``, which ``phi`` must share (``None``: ``phi`` is the training set,
    which must not be empty)."""
    check_array(xp, phi, name, (2, 3), "(N, D) or (N, O, D)")
    shape = tuple(phi.shape)
    if tail is None and 0 in shape:
        raise ValueError(f"{name} must have at least one row and one feature; got shape {shape}")
    if tail is not None and shape[1:] != tuple(tail):
        want = ", ".join(map(str, ("M", *tail)))
        raise ValueError(f"{name} must have shape ({want}) like the training features; got "
                         f"shape {shape}")
    return xp.reshape(phi, (math.prod(shape[:-1]), shape[-1]))


def _targets(xp: Any, y: Array, phi: Array, finite: bool = True) -> Array:
    """``y_train`` checked against ``phi_train`` (N, D) / (N, O, D), as columns (N O, K)
    (``finite``: also for NaN/Inf)."""
    lead = tuple(phi.shape[:-1])
    what = "(N, O) or (N, O, K)" if len(lead) == 2 else "(N,) or (N, K)"
    check_array(xp, y, "y_train", (len(lead), len(lead) + 1), what, finite=finite)
    if tuple(y.shape[:len(lead)]) != lead:
        raise ValueError(f"y_train must have shape {what} with {lead} from phi_train of shape "
                         f"{tuple(phi.shape)}; got shape {tuple(y.shape)}")
    return xp.reshape(y, (math.prod(lead), math.prod(y.shape[len(lead):])))


def _inputs(phi_train: Array, y_train: Array, phi_test: Array
            ) -> tuple[Any, Backend, Array, Array, Array, tuple[int, ...]]:
    """``(xp, backend, phi, y, phi_s, shape)``: the checked arrays as rows and columns, and the
    shape of the predictions, (M, *y_train's trailing shape)."""
    xp, backend = namespace_of(phi_train=phi_train, y_train=y_train, phi_test=phi_test)
    phi = _rows(xp, phi_train, "phi_train")
    y = _targets(xp, y_train, phi_train)
    phi_s = _rows(xp, phi_test, "phi_test", tuple(phi_train.shape[1:]))
    phi, y, phi_s = promote(xp, phi, y, phi_s)
    return xp, backend, phi, y, phi_s, (phi_test.shape[0], *y_train.shape[1:])


def _gram(xp: Any, phi: Array) -> tuple[bool, Array]:
    """``(primal, A)``: ``A = Phi^T Phi`` (D, D) if D < R rows, else ``Phi Phi^T`` (R, R),
    symmetrised (a matrix product need not be exactly symmetric)."""
    primal = phi.shape[1] < phi.shape[0]
    a = phi.T @ phi if primal else phi @ phi.T
    return primal, (a + a.T) / 2


def _ridge_weights(xp: Any, backend: Backend, phi: Array, y: Array, reg: float,
                   jitter: str | float | None) -> tuple[Array, Any]:
    """``(beta, eps)``: ``(Phi^T Phi + (reg + eps) I)^{-1} Phi^T y`` (D, K), solved on the
    smaller side (differentiable through the refinement step of ``ridge_solve``), and the
    jitter ``eps``."""
    primal, a = _gram(xp, phi)
    _, sol, eps = ridge_solve(xp, backend, a, phi.T @ y if primal else y, reg, jitter,
                              _GRAM_NAMES[primal])
    return (sol if primal else phi.T @ sol), eps


#: dim x dim matrices the streamed primal ridge (:meth:`FeatureRidge.fit_model`) charges to
#: ``max_memory``: the accumulated Gram matrix, one batch's product and their sum while
#: streaming; the Gram matrix, its symmetrised and shifted copies and the Cholesky factor
#: while solving (at most five at a time).
PRIMAL_COPIES = 5


def _stream_moments(model: Any, x: Array | None, y: Array, spec: Any, max_memory: Any,
                    progress: Any) -> tuple[Any, Backend, Array, Array, tuple[int, ...]]:
    r"""``(xp, backend, G, c, tail)``: :math:`G = \sum_b \Phi_b^\top\Phi_b` (dim, dim) and
    :math:`c = \sum_b \Phi_b^\top y_b` (dim, K) over the sample batches ``b`` of
    :func:`ntkcore.features.feature_batches` (its budget less the dim x dim matrices of
    :data:`PRIMAL_COPIES` and two (dim, K) ones), and the features' ``shape[1:]``; the (N, dim)
    features are never held together."""
    from .features import batches  # features imports this package's modules

    n = int(x.shape[0]) if getattr(x, "ndim", 0) >= 1 else \
        getattr(model, "num_samples", 0) if x is None else 0  # model: a Jacobian
    if getattr(y, "ndim", 0) < 1 or int(y.shape[0]) != n:
        raise ValueError(f"y must have one row per sample of x ({n}); got shape "
                         f"{tuple(getattr(y, 'shape', ()))}")
    cols = math.prod(y.shape[1 + (not spec.mode.sums_outputs):])

    def reserve(dim: int, item: int) -> float:
        return item * (PRIMAL_COPIES * dim * dim + 2 * dim * cols)

    # y is checked for NaN/Inf once here, not per batch (one host sync per call)
    check_finite(array_api_compat.array_namespace(y), y, "y_train")
    g = c = None
    for _, start, stop, phi in batches(spec, model, x, max_memory, progress, reserve,
                                       defer_check=True):
        xp, backend = namespace_of(features=phi, y_train=y)
        rows, yb = promote(xp, _rows(xp, phi, "features"),
                           _targets(xp, y[start:stop, ...], phi, finite=False))
        gb, cb = rows.T @ rows, rows.T @ yb
        g, c = (gb, cb) if g is None else (g + gb, c + cb)
        tail = tuple(phi.shape[1:])
    return xp, backend, (g + g.T) / 2, c, tail


@capabilities(fast=TRIANGULAR_SOLVE, note=DIFFERENTIABLE)
def feature_regression(
    phi_train: Array,
    y_train: Array,
    phi_test: Array,
    *,
    reg: float = 0.0,
    jitter: str | float | None = "auto",
) -> Array:
    r"""Kernel ridge predictions for :math:`K = \Phi\Phi^\top`, in primal form:
    :math:`\Phi_*(\Phi^\top\Phi + \lambda I)^{-1}\Phi^\top y`.

    Equal to ``kernel_regression(phi_train @ phi_train.T, y_train, phi_test @ phi_train.T,
    reg=reg)`` by the push-through identity :math:`\Phi^\top(\Phi\Phi^\top + \lambda I_R)^{-1}
    = (\Phi^\top\Phi + \lambda I_D)^{-1}\Phi^\top`, at O(R D min(R, D)) instead of
    O(R^2 D + R^3), R the number of feature rows.

    Parameters
    ----------
    phi_train : array, shape (N, D) or (N, O, D)
        Training features (full mode: one row per sample and output).
    y_train : array, shape (N,) or (N, K); (N, O) or (N, O, K) in full mode
    phi_test : array, shape (M, D) or (M, O, D)
        Test features, in the same space (``shape[1:]`` as ``phi_train``).
    reg : float, default 0.0
        Ridge :math:`\lambda \ge 0`.
    jitter : "auto", float or None
        Jitter policy of :mod:`ntkcore.regression` when the factorisation fails.

    Returns
    -------
    array, shape (M,) or (M, K); (M, O) or (M, O, K) in full mode
        In the inputs' namespace, device and dtype.

    Raises
    ------
    TypeError
        Arrays of different libraries or a non-floating dtype (the argument is named).
    ValueError
        Wrong shapes, an empty ``phi_train``, NaN/Inf in an array, ``reg < 0`` or an unknown
        ``jitter``.
    NotPositiveDefiniteError
        The side's Gram matrix (+ reg I) not positive definite even with the jitter.
    """
    reg = check_scalar(reg, "reg", nonnegative=True)
    jitter_cap(jitter)
    xp, backend, phi, y, phi_s, shape = _inputs(phi_train, y_train, phi_test)
    beta, _ = _ridge_weights(xp, backend, phi, y, reg, jitter)
    return xp.reshape(phi_s @ beta, shape)


@capabilities(note=DIFFERENTIABLE)
def feature_gd_mse_predict(
    phi_train: Array,
    y_train: Array,
    phi_test: Array,
    t: float | Array,
    *,
    learning_rate: float = 1.0,
    reg: float = 0.0,
) -> Array:
    r"""Gradient-flow (linearised NTK) predictions of :func:`ntkcore.gd_mse_predict` for
    :math:`K = \Phi\Phi^\top`, from the eigendecomposition of the smaller Gram matrix.

    With :math:`G = \Phi^\top\Phi = V\operatorname{diag}(w)V^\top` and
    :math:`\varphi_t(w) = (1 - e^{-\eta w t})/w`,

    .. math::

        f_t(X_*) = \Phi_* V \operatorname{diag}\big(\varphi_t(w + \lambda)\big) V^\top
        \Phi^\top y ,

    since :math:`\Phi^\top u_i = \sqrt{w_i}\, v_i` for the eigenvectors :math:`u_i` of
    :math:`K` with :math:`w_i > 0`, and :math:`K_*` annihilates the others (for D >= R rows the
    same formula on :math:`K = U\operatorname{diag}(w)U^\top`:
    :math:`\Phi_*\Phi^\top U\operatorname{diag}(\varphi_t(w + \lambda))U^\top y`).  Cost
    O(R D min(R, D) + min(R, D)^3).

    The Gram matrices are positive semi-definite by construction: negative eigenvalues are
    rounding and count as 0 (no :class:`JitterWarning`, no :class:`NotPositiveDefiniteError`).
    At ``t = inf`` eigenvalues :math:`w + \lambda \le 1000\,\varepsilon\max(w + \lambda)` get
    :math:`\varphi = 0`: the limit of gradient flow, :math:`\Phi_*(G + \lambda I)^{+}\Phi^\top
    y` (least squares for a singular :math:`K`, where :func:`ntkcore.gd_mse_predict` raises,
    since a general :math:`K_*` need not annihilate the null space of :math:`K`).

    Parameters
    ----------
    phi_train : array, shape (N, D) or (N, O, D)
    y_train : array, shape (N,) or (N, K); (N, O) or (N, O, K) in full mode
    phi_test : array, shape (M, D) or (M, O, D)
    t : float or array, shape () or (T,)
        Training time(s) ``>= 0``; ``inf`` gives the kernel-regression limit.
    learning_rate : float, default 1.0
        :math:`\eta > 0`.
    reg : float, default 0.0
        :math:`\lambda \ge 0` added to the kernel.

    Returns
    -------
    array
        The shape of :func:`feature_regression`'s result, with a leading (T,) for 1-D ``t``.

    Raises
    ------
    TypeError, ValueError
        As :func:`feature_regression`; also a negative or NaN ``t`` or ``learning_rate <= 0``.
    """
    xp, backend, phi, y, phi_s, shape = _inputs(phi_train, y_train, phi_test)
    lr = check_scalar(learning_rate, "learning_rate", positive=True)
    reg = check_scalar(reg, "reg", nonnegative=True)
    t_arr, ts = check_times(xp, backend, t, phi)
    primal, a = _gram(xp, phi)
    w, v = xp.linalg.eigh(a)
    w = xp.where(w < 0, xp.zeros_like(w), w) + reg  # a Gram matrix: w < 0 is rounding
    tiny = 1e3 * float(xp.finfo(phi.dtype).eps) * xp.max(w)
    fac = flow_factor(xp, w, ts, lr, tiny)  # (T, n)
    c = v @ (fac[:, :, None] * (v.T @ (phi.T @ y if primal else y))[None, ...])  # (T, n, K)
    out = xp.reshape(phi_s @ (c if primal else phi.T @ c), (ts.shape[0], *shape))
    return out[0, ...] if t_arr.ndim == 0 else out


@capabilities(fast=TRIANGULAR_SOLVE, note=DIFFERENTIABLE)
def feature_gp_inference(
    phi_train: Array,
    y_train: Array,
    phi_test: Array,
    *,
    reg: float = 0.0,
    jitter: str | float | None = "auto",
    covariance: bool = False,
) -> GPPosterior:
    r"""GP posterior of :func:`ntkcore.gp_inference` for :math:`K = \Phi\Phi^\top` and noise
    variance :math:`\sigma^2` = ``reg`` (+ jitter), as Bayesian linear regression on features.

    The prior :math:`f = \Phi w`, :math:`w \sim N(0, I_D)`, has covariance :math:`K`; with
    :math:`L L^\top = G + \sigma^2 I`, :math:`G = \Phi^\top\Phi` (when D < R rows),
    :math:`\beta = (G + \sigma^2 I)^{-1}\Phi^\top y`, :math:`r = y - \Phi\beta` and
    :math:`W = L^{-1}\Phi_*^\top`:

    .. math::

        \mu = \Phi_*\beta, \quad
        \Sigma = \sigma^2 W^\top W \;(= K_{**} - K_*(K + \sigma^2 I)^{-1}K_*^\top,
        \text{ Woodbury}),

        y^\top (K + \sigma^2 I)^{-1} y = \|r\|^2/\sigma^2 + \|\beta\|^2, \quad
        \log\det(K + \sigma^2 I) = 2\textstyle\sum_i \log L_{ii} + (R - D)\log\sigma^2

    (Sylvester's determinant identity), hence :math:`\log p(y)` per output column as in
    :func:`ntkcore.gp_inference`; the variances :math:`\sigma^2 \sum_j W_{ji}^2` are computed
    without cancellation.  With D >= R the formulas of :func:`ntkcore.gp_inference` on
    :math:`K = \Phi\Phi^\top`, :math:`K_* = \Phi_*\Phi^\top`, :math:`K_{**} =
    \Phi_*\Phi_*^\top` apply.  Cost O(R D min(R, D) + M D min(R, D)) for the mean and
    variances, plus O(M^2 min(R, D)) for the covariance.

    Parameters
    ----------
    phi_train : array, shape (N, D) or (N, O, D)
    y_train : array, shape (N,) or (N, K); (N, O) or (N, O, K) in full mode
    phi_test : array, shape (M, D) or (M, O, D)
    reg : float, default 0.0
        Observation-noise variance :math:`\sigma^2 \ge 0`; must be positive when D < R (K is
        then singular: the likelihood is degenerate).
    jitter : "auto", float or None
    covariance : bool, default False
        Also return the (M, M) posterior covariance (M O, M O in full mode, rows
        ``m * O + o``), O(M^2) memory; the variances are always returned.

    Returns
    -------
    GPPosterior
        ``mean`` shaped as :func:`feature_regression`'s result, ``variance`` (M,) or (M, O)
        (shared by the K columns), ``covariance`` or ``None``, ``log_marginal_likelihood``
        summed over the K columns (and, in full mode, taken jointly over the N O rows), and
        ``jitter``.

    Raises
    ------
    TypeError, ValueError
        As :func:`feature_regression`.
    NotPositiveDefiniteError
        ``reg = 0`` with fewer features than rows (D < R), or the side's Gram matrix
        (+ reg I) not positive definite even with the jitter.
    """
    reg = check_scalar(reg, "reg", nonnegative=True)
    jitter_cap(jitter)
    xp, backend, phi, y, phi_s, shape = _inputs(phi_train, y_train, phi_test)
    (rows, cols), d = y.shape, phi.shape[1]
    primal, a = _gram(xp, phi)
    if primal and reg == 0:
        raise NotPositiveDefiniteError(
            f"phi_train phi_train^T is singular ({rows} rows, {d} features) and reg = 0, so the "
            "GP likelihood is degenerate; pass the noise variance reg > 0")
    l, eps = cholesky_with_jitter(xp, backend, a, reg=reg, jitter=jitter,
                                  name=_GRAM_NAMES[primal])
    logdet_half = xp.sum(xp.log(xp.linalg.diagonal(l)))
    if primal:
        noise = xp.asarray(reg + eps, dtype=phi.dtype, device=device(phi))
        beta = backend.cho_solve(l, phi.T @ y)
        r = y - phi @ beta
        quad = xp.sum(r * r) / noise + xp.sum(beta * beta)
        logdet_half = logdet_half + 0.5 * (rows - d) * xp.log(noise)
        w = backend.solve_triangular(l, phi_s.T, lower=True)  # (D, M)
        var = noise * xp.sum(w * w, axis=0)
        cov = noise * (w.T @ w) if covariance else None
    else:
        alpha = backend.cho_solve(l, y)
        beta = phi.T @ alpha
        quad = xp.sum(y * alpha)
        w = backend.solve_triangular(l, phi @ phi_s.T, lower=True)  # (R, M)
        var = xp.sum(phi_s * phi_s, axis=1) - xp.sum(w * w, axis=0)
        cov = phi_s @ phi_s.T - w.T @ w if covariance else None
    lml = -0.5 * quad - cols * logdet_half - 0.5 * rows * cols * math.log(2 * math.pi)
    return GPPosterior(mean=xp.reshape(phi_s @ beta, shape), covariance=cov,
                       log_marginal_likelihood=lml, jitter=eps,
                       variance=xp.reshape(var, tuple(phi_test.shape[:-1])))


@capabilities(name="FeatureRidge", fast=TRIANGULAR_SOLVE, note=DIFFERENTIABLE)
class _FeatureRidge(Regressor):
    r"""Ridge regression on features as a scikit-learn estimator: kernel ridge for
    :math:`K = \Phi\Phi^\top` in primal form (:func:`feature_regression`).

    ``fit(phi_train, y)`` with features (N, D) (or full-mode (N, O, D) with ``y`` (N, O)),
    ``predict(phi_test)`` with (M, D) (or (M, O, D)).  On (N, D) features it equals
    ``sklearn.linear_model.Ridge(alpha, fit_intercept=False)``, default ``alpha=1.0`` as
    there (whose ``alpha = 0`` is an error or a warning; here least squares / the
    minimum-norm interpolant), solved by the
    jitter policy of :mod:`ntkcore.regression` on the smaller of the two Gram matrices, in the
    input's namespace (differentiable under torch / JAX autograd).  The estimator protocol
    (``get_params``, ``set_params``, ``score``, ``clone``, ``GridSearchCV``; a
    ``RegressorMixin``/``BaseEstimator`` subclass when scikit-learn is installed, built on
    first access) is that of :class:`KernelRidge`, with ``X`` the features (not pairwise).

    Parameters
    ----------
    alpha : float, default 1.0
        Ridge :math:`\lambda \ge 0` (scikit-learn's default; ``0.0``: least squares, or the
        minimum-norm interpolant when D > N).
    jitter : "auto", float or None, default "auto"

    Attributes
    ----------
    coef_ : array, shape (D,) or (K, D)
        The weights :math:`\beta^\top` in scikit-learn's layout (predictions
        ``phi @ coef_.T``).
    jitter_ : float
        Absolute jitter that was needed (0.0 normally).
    n_features_in_ : int
        D, the number of features.

    Examples
    --------
    >>> import numpy as np, ntkcore
    >>> phi = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]]); y = np.array([1.0, 4.0, 5.0])
    >>> ntkcore.FeatureRidge(alpha=0.0).fit(phi, y).coef_  # least squares
    array([1., 2.])
    """

    def __init__(self, alpha: float = 1.0, *, jitter: str | float | None = "auto") -> None:
        self.alpha = alpha
        self.jitter = jitter

    def fit(self, phi_train: Array, y: Array) -> FeatureRidge:
        """Solve for the weights from features (N, D) or (N, O, D) and targets ``y``.

        Errors about ``y`` name it ``y_train``, as :func:`feature_regression` does.

        Raises
        ------
        TypeError, ValueError, NotPositiveDefiniteError
            As :func:`feature_regression`; also ``y`` None, ``alpha < 0``, object or sparse
            input.
        """
        if y is None:
            raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y "
                             "is None")
        phi, y = as_floating_arrays(phi_train=phi_train, y_train=y)
        alpha = check_scalar(self.alpha, "alpha", nonnegative=True)
        jitter_cap(self.jitter)
        xp, backend = namespace_of(phi_train=phi, y_train=y)
        rows, targets = promote(xp, _rows(xp, phi, "phi_train"), _targets(xp, y, phi))
        beta, eps = _ridge_weights(xp, backend, rows, targets, alpha, self.jitter)
        self.coef_ = xp.matrix_transpose(beta) if y.ndim == phi.ndim else beta[:, 0]
        self.jitter_ = eps
        self.n_features_in_ = int(phi.shape[-1])
        self._shapes = (tuple(phi.shape[1:]), tuple(y.shape[1:]))
        self.__dict__.pop("_features_spec", None)  # no model arguments: fit_model's are void
        return self

    def fit_model(self, model: Any, x: Array | None, y: Array, *, dim: int, seed: Any = 0,
                  mode: str = "trace", max_memory: Any = None, **features_kw: Any
                  ) -> FeatureRidge:
        r"""Fit on ``ntkcore.features(model, x, dim=dim, seed=seed, mode=mode, ...)`` streamed
        over sample batches: :math:`G = \sum_b \Phi_b^\top\Phi_b`,
        :math:`c = \sum_b \Phi_b^\top y_b`, then :math:`\beta = (G + \alpha I)^{-1} c`
        (the primal system, always; the jitter policy on :math:`G`, named ``phi_train^T
        phi_train``), so the (N, dim) features are never held: memory O(dim^2) plus one
        batch within ``max_memory``, which is charged :data:`PRIMAL_COPIES` dim x dim
        matrices besides the features' batches.  Equal to ``fit(features(model, x, ...),
        y)`` up to rounding when dim < N (with dim >= N that solves the dual system, the same
        predictions for ``alpha > 0``).  Not for gradients (use :meth:`fit` on features).

        Parameters
        ----------
        model, x, dim, seed, mode, max_memory, **features_kw
            As for :func:`ntkcore.features` (``method``, ``params``, ``probe``, ``kronecker``,
            ``progress``, ``check_finite``; ``model`` may be a Jacobian with ``x`` None);
            remembered for :meth:`predict_model`.
        y : array, shape (N,) or (N, K); (N, O) or (N, O, K) in full mode
            Targets, in the namespace of the features.

        Raises
        ------
        BudgetTooSmallError
            ``max_memory`` below the dim x dim matrices and one sample (the message states a
            budget that works).
        TypeError, ValueError, NotPositiveDefiniteError
            As :func:`ntkcore.features` and :meth:`fit`.
        """
        alpha = check_scalar(self.alpha, "alpha", nonnegative=True)
        jitter_cap(self.jitter)
        from .features import FeatureSpec

        progress = features_kw.pop("progress", None)
        spec = FeatureSpec(dim=dim, seed=seed, mode=mode, **features_kw)
        xp, backend, g, c, tail = _stream_moments(model, x, y, spec, max_memory, progress)
        _, beta, eps = ridge_solve(xp, backend, g, c, alpha, self.jitter, _GRAM_NAMES[1])
        self.coef_ = xp.matrix_transpose(beta) if y.ndim == len(tail) + 1 else beta[:, 0]
        self.jitter_ = eps
        self.n_features_in_ = int(tail[-1])
        self._shapes = (tail, tuple(y.shape[1:]))
        self._features_spec = (spec, progress)
        return self

    def predict_model(self, model: Any, x: Array | None, *, max_memory: Any = None) -> Array:
        """Predictions on ``features(model, x, ...)`` with the arguments of
        :meth:`fit_model` (the same projection), streamed over sample batches within
        ``max_memory`` (the (M, dim) features are never held together)."""
        self._check_fitted("_features_spec", "fit_model(model, x, y, dim=...)")
        from .features import batches

        spec, progress = self._features_spec
        parts = [self.predict(phi) for _, _, _, phi in batches(spec, model, x, max_memory,
                                                               progress, defer_check=True)]
        xp = array_api_compat.array_namespace(parts[0])
        return parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)

    def predict(self, phi_test: Array) -> Array:
        """Predictions ``phi_test @ coef_.T``: (M, D) -> (M,) or (M, K); (M, O, D) -> (M, O)
        or (M, O, K).

        Raises
        ------
        NotFittedError
            Before :meth:`fit` (scikit-learn's when it is installed).
        ValueError
            Wrong shape or NaN/Inf in ``phi_test``.
        """
        self._check_fitted("coef_", "fit(phi_train, y)")
        (phi,) = as_floating_arrays(phi_test=phi_test)
        xp, _ = namespace_of(phi_test=phi, coef_=self.coef_)
        tail, y_tail = self._shapes
        d = self.n_features_in_
        if phi.ndim == 2 and len(tail) == 1 and phi.shape[1] != d:
            raise ValueError(f"phi_test must have D={d} columns (X has {phi.shape[1]} features, "
                             f"but {type(self).__name__} is expecting {d} features as input); "
                             f"got shape {tuple(phi.shape)}")
        rows, coef = promote(xp, _rows(xp, phi, "phi_test", tail), self.coef_)
        beta = xp.reshape(coef, (-1, d))  # (K, D)
        return xp.reshape(rows @ xp.matrix_transpose(beta), (phi.shape[0], *y_tail))


if TYPE_CHECKING:
    FeatureRidge = _FeatureRidge
else:  # ``FeatureRidge``, built on first access
    __getattr__, __dir__ = lazy_module_attributes(_FeatureRidge, "FeatureRidge", globals())
