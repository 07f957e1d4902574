r"""Cholesky kernel regression, NTK gradient-flow predictions and GP inference on any array-API
namespace.  Only Cholesky factors and triangular solves (no LU, no explicit inverse), so all of
it is differentiable under torch/jax autograd; what ``jax.jit`` checks: docs/math.md."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from array_api_compat import device

from ._typing import Array
from ._validation import (
    check_array,
    check_kernel,
    check_scalar,
    check_symmetric,
    namespace_of,
    promote,
)
from .backend import Backend
from .errors import JitterWarning, NotPositiveDefiniteError
from .support import DIFFERENTIABLE, GENERATOR, TRIANGULAR_SOLVE, capabilities

__all__ = [
    "GPPosterior",
    "cholesky_with_jitter",
    "gd_mse_predict",
    "gp_inference",
    "kernel_regression",
]

_JITTER_CAP = 1e-2
_LOG_2PI = math.log(2 * math.pi)


def jitter_cap(jitter: str | float | None) -> float | None:
    """Relative jitter cap from the user's ``jitter`` argument (``None``: never add jitter)."""
    if jitter is None or jitter is False:
        return None
    if isinstance(jitter, str):
        if jitter != "auto":
            raise ValueError(f"jitter must be 'auto', None or a positive float; got {jitter!r}")
        return _JITTER_CAP
    cap = check_scalar(jitter, "jitter", nonnegative=True)
    return cap if cap > 0 else None


def cholesky_with_jitter(
    xp: Any,
    backend: Backend,
    k: Array,
    *,
    reg: float = 0.0,
    jitter: str | float | None = "auto",
    name: str = "k_train",
) -> tuple[Array, Any]:
    r"""Lower Cholesky factor of ``k + (reg + eps) I`` and the absolute jitter ``eps`` used.

    If the factorisation fails, :math:`\epsilon` grows by 10x from ``1e-10 * mean(diag K)`` to
    ``cap * mean(diag K)``, warning :class:`~ntkcore.JitterWarning`; past the cap it raises
    :class:`~ntkcore.NotPositiveDefiniteError`.

    Parameters
    ----------
    xp, backend
        The namespace and backend of ``k`` (resolved once by the public caller).
    k : array, shape (N, N)
        Symmetric positive (semi-)definite matrix; only its lower triangle is read.
    reg : float
        Ridge added to the diagonal before factorising (not counted as jitter).
    jitter : "auto", float or None
        Relative jitter cap (``"auto"``: 1e-2); ``None`` disables retries.
    name : str
        Argument name used in messages.

    Returns
    -------
    l : array, shape (N, N)
        Lower-triangular factor in ``k``'s namespace, device and dtype.
    eps : float
        Absolute jitter added beyond ``reg`` (0.0 when none was needed).  Under ``jax.jit``
        (values unknown) a 0-d array, and the factor holds NaN where eager code would raise.
    """
    traced = backend.is_traced(k)
    if not traced:
        l = backend.cholesky(k, shift=reg)
        if l is not None:
            return l, 0.0
    cap = jitter_cap(jitter)
    # relative jitters 1e-10, 1e-9, ... up to the cap (and none first when traced)
    top = -11 if cap is None else math.floor(math.log10(cap) + 1e-12)
    rels = [0.0] * traced + [10.0 ** e for e in range(-10, top + 1)]
    scale = backend.stop_gradient(xp.mean(xp.abs(xp.linalg.diagonal(k)))) if k.shape[0] else 1.0
    if traced:
        rel_arr = xp.asarray(rels, dtype=k.dtype, device=device(k))
        scale = xp.where(scale > 0, scale, 1.0)
        l, i = backend.first_cholesky(k, reg + rel_arr * scale)
        return l, rel_arr[xp.minimum(i, len(rels) - 1)] * scale
    scale = backend.scalar(scale) or 1.0
    l, i = backend.first_cholesky(k, [reg + rel * scale for rel in rels])
    if l is not None:
        warnings.warn(f"{name} was not numerically positive definite; added jitter "
                      f"{rels[i] * scale:.3g} ({rels[i]:.0e} x mean(diag)) to its diagonal",
                      JitterWarning, stacklevel=3)
        return l, rels[i] * scale
    limit = "" if cap is None else f" even with jitter up to {cap:g} x mean(diag) = {cap*scale:.3g}"
    raise NotPositiveDefiniteError(
        f"{name} (+ reg={reg:g} I) is not positive definite{limit}; increase reg or check the "
        "kernel"
    )


def ridge_solve(xp: Any, backend: Backend, k: Array, y: Array, reg: float,
                jitter: str | float | None, name: str = "k_train") -> tuple[Array, Array, Any]:
    """``(L, alpha, eps)``: the factor, ``(K + (reg + eps) I)^{-1} y`` and the jitter."""
    differentiate = backend.tracks_gradient(k, y)
    k0 = backend.stop_gradient(k) if differentiate else k
    l, eps = cholesky_with_jitter(xp, backend, k0, reg=reg, jitter=jitter, name=name)
    alpha = backend.cho_solve(l, backend.stop_gradient(y) if differentiate else y)
    if differentiate:
        # One step of iterative refinement, alpha <- alpha - A^{-1}(A alpha - y) with
        # A = K + (reg + eps) I, differentiated through the residual only (the factor is a
        # constant): its value is the solve (refined), and its first derivative is the exact
        # adjoint  d alpha = A^{-1}(dy - dA alpha),  i.e.  grad_y = A^{-1} g,
        # grad_K = -(A^{-1} g) alpha^T, at O(N^2) per backward instead of the O(N^3)
        # backward of a differentiated Cholesky factor.
        alpha = alpha - backend.cho_solve(l, k @ alpha + (reg + eps) * alpha - y)
    return l, alpha, eps


def check_regression_inputs(
    xp: Any, k_train: Array, y_train: Array | None, k_test_train: Array | None,
    backend: Any = None,
) -> tuple[Array, Any, Any]:
    """Check the arrays (rank, dtype, finiteness, shapes; names in messages) and return them
    in the dtype they promote to (:func:`~ntkcore._validation.promote`), ``k_train``
    symmetrised within ``SYMMETRY_RTOL_EPS`` eps (ValueError beyond)."""
    check_kernel(xp, k_train, "k_train", "(N, N)")
    n = k_train.shape[0]
    if k_train.shape[1] != n:
        raise ValueError(f"k_train must be square (N, N); got shape {tuple(k_train.shape)}")
    if y_train is not None:
        check_array(xp, y_train, "y_train", (1, 2), "(N,) or (N, K)")
        if y_train.shape[0] != n:
            raise ValueError(f"y_train has {y_train.shape[0]} rows but k_train is {n} x {n}")
    if k_test_train is not None:
        check_kernel(xp, k_test_train, "k_test_train", "(M, N)")
        if k_test_train.shape[1] != n:
            raise ValueError(
                f"k_test_train must have N={n} columns (one per training point); got shape "
                f"{tuple(k_test_train.shape)}"
            )
    return promote(xp, check_symmetric(xp, k_train, "k_train", backend), y_train,  # type: ignore[return-value]
                   k_test_train)


@capabilities(fast=TRIANGULAR_SOLVE, note=DIFFERENTIABLE)
@capabilities(name="kernel_regression(solver='cg')", fast=GENERATOR)
def kernel_regression(
    k_train: Array,
    y_train: Array,
    k_test_train: Array,
    *,
    reg: float = 0.0,
    jitter: str | float | None = "auto",
    solver: str = "cholesky",
    **cg_options: Any,
) -> Array:
    r"""Kernel (ridge) regression predictions :math:`K_* (K + \lambda I)^{-1} y`.

    Parameters
    ----------
    k_train : array, shape (N, N)
        Kernel between training points (symmetric positive semi-definite).
    y_train : array, shape (N,) or (N, K)
        Training targets.
    k_test_train : array, shape (M, N)
        Kernel between test and training points.
    reg : float, default 0.0
        Ridge :math:`\lambda \ge 0`.
    jitter : "auto", float or None
        Jitter policy when the Cholesky factorisation fails (:func:`cholesky_with_jitter`).
    solver : {"cholesky", "cg"}, default "cholesky"
        ``"cg"``: preconditioned conjugate gradients (:func:`ntkcore.cg_solve`), which needs
        only products with ``k_train``: it may then also be a dask array or a linear operator
        (e.g. :class:`ntkcore.KernelOperator`), and ``k_test_train`` a dask array or an
        operator.  Warns :class:`ntkcore.ConvergenceWarning` if the tolerance is not reached.
    **cg_options
        For ``solver="cg"`` only: ``tol``, ``maxiter``, ``preconditioner`` ("nystrom",
        "pivoted_cholesky", None), ``rank``, ``seed``, ``x0``, ``callback``.

    Returns
    -------
    array, shape (M,) or (M, K)
        Predictions in the inputs' namespace, device and dtype; differentiable with respect
        to all three arrays under torch/jax autograd (Cholesky solver).

    Notes
    -----
    Under autograd the factor is computed outside the graph and the solve is differentiated
    through one refinement step (see :meth:`KernelRidge.fit`): first derivatives are exact and
    cost :math:`O(N^2)` per backward pass (no differentiated Cholesky, no LU); second
    derivatives treat the factor as a constant and are not exact.

    Raises
    ------
    TypeError
        Arrays of different libraries, a non-floating dtype, or CG options with
        ``solver="cholesky"``.
    ValueError
        Wrong shapes, NaN/Inf in any array, or ``k_train`` asymmetric beyond
        ``1000 eps max|diag K|`` (checked for in-memory arrays with both solvers; within the
        tolerance both use :math:`(K + K^\top)/2`).  With ``solver="cg"`` and an operator
        ``k_train`` whose entries cannot be checked up front, a non-finite product during the
        iteration raises too (:func:`ntkcore.cg_solve`).
    NotPositiveDefiniteError
        Cholesky solver: ``k_train + reg I`` not positive definite even with the jitter.
    """
    if solver == "cg":
        from .cg import cg_kernel_regression

        return cg_kernel_regression(k_train, y_train, k_test_train, reg=reg, **cg_options)
    if solver != "cholesky":
        raise ValueError(f"solver must be 'cholesky' or 'cg'; got {solver!r}")
    if cg_options:
        raise TypeError(f"options {sorted(cg_options)} apply only to solver='cg'")
    reg = check_scalar(reg, "reg", nonnegative=True)
    jitter_cap(jitter)
    xp, backend = namespace_of(k_train=k_train, y_train=y_train, k_test_train=k_test_train)
    k_train, y_train, k_test_train = check_regression_inputs(xp, k_train, y_train,
                                                             k_test_train, backend)
    return k_test_train @ ridge_solve(xp, backend, k_train, y_train, reg, jitter)[1]


def check_times(xp: Any, backend: Backend, t: float | Array, like: Array) -> tuple[Array, Array]:
    """``(t_arr, ts)``: ``t`` in ``like``'s dtype and device, and as a 1-D array (T,)."""
    t_arr = xp.asarray(t, dtype=like.dtype, device=device(like))
    if t_arr.ndim > 1:
        raise ValueError(f"t must be a scalar or 1-D array of times; got shape {t_arr.shape}")
    ts = xp.reshape(t_arr, (-1,))
    if backend.is_traced(ts):  # under jax.jit: a NaN or negative time gives NaN predictions
        ts = xp.where(ts >= 0, ts, float("nan"))
    elif not bool(xp.all(ts >= 0)):
        raise ValueError("t must hold non-negative times (inf allowed)")
    return t_arr, ts


def flow_factor(xp: Any, w: Array, ts: Array, lr: float, tiny: Any) -> Array:
    """``f[t, i] = (1 - exp(-lr w_i t)) / w_i`` (T, n) for eigenvalues ``w >= 0``, with the
    limits ``lr t`` for ``w_i <= tiny`` and, at ``t = inf``, ``1 / w_i`` (0 for
    ``w_i <= tiny``: the pseudo-inverse)."""
    infinite = xp.isinf(ts)
    small = xp.abs(w) <= tiny
    w_safe = xp.where(small, xp.ones_like(w), w)
    ts_finite = xp.where(infinite, xp.zeros_like(ts), ts)
    lwt = lr * w_safe[None, :] * ts_finite[:, None]
    f = -xp.expm1(-lwt) / w_safe[None, :]
    f = xp.where(small[None, :], lr * ts_finite[:, None] * xp.ones_like(w)[None, :], f)
    limit = xp.where(small, xp.zeros_like(w), 1.0 / w_safe)
    return xp.where(infinite[:, None], limit[None, :] * xp.ones_like(f), f)


@capabilities(note=DIFFERENTIABLE)
def gd_mse_predict(
    k_train: Array,
    y_train: Array,
    k_test_train: Array,
    t: float | Array,
    *,
    learning_rate: float = 1.0,
    reg: float = 0.0,
) -> Array:
    r"""Predictions after time ``t`` of gradient flow on the MSE loss (linearised NTK dynamics).

    For the loss :math:`\tfrac12 \|f - y\|^2`, zero initial outputs and kernel
    :math:`K + \lambda I = V \operatorname{diag}(w) V^\top`,

    .. math::

        f_t(X_*) = K_* V \operatorname{diag}\!\Big(\frac{1 - e^{-\eta w t}}{w}\Big) V^\top y ,

    which is :math:`K_* K^{-1} (I - e^{-\eta K t}) y`; the factor is evaluated with ``expm1``
    and tends to :math:`\eta t` as :math:`w \to 0`, and to :math:`1/w` (kernel regression) as
    :math:`t \to \infty`.

    Parameters
    ----------
    k_train : array, shape (N, N)
    y_train : array, shape (N,) or (N, K)
    k_test_train : array, shape (M, N)
    t : float or array, shape () or (T,)
        Training time(s) ``>= 0``; ``inf`` gives the kernel-regression limit.
    learning_rate : float, default 1.0
        :math:`\eta > 0`.
    reg : float, default 0.0
        :math:`\lambda \ge 0` added to the kernel.

    Returns
    -------
    array, shape (M,) / (M, K) for scalar ``t``, (T, M) / (T, M, K) for 1-D ``t``

    Raises
    ------
    TypeError
        Arrays of different libraries or a non-floating dtype (the argument is named).
    ValueError
        Wrong shapes, NaN/Inf in an array, negative or NaN ``t``, or ``k_train`` asymmetric
        beyond ``1000 eps max|diag K|`` (within it :math:`(K + K^\top)/2` is used).
    NotPositiveDefiniteError
        An eigenvalue :math:`w` of :math:`K + \lambda I` at or below ``-1e-2 * mean(diag K)``
        (the jitter cap at which :func:`kernel_regression` raises too: gradient flow would
        diverge, and overflow), or ``t = inf`` with a singular kernel.

    Warns
    -----
    JitterWarning
        Negative eigenvalues between that cap and rounding
        (:math:`|w| \le 1000\,\varepsilon \max|w|`) are treated as zero (gradient flow
        does not move along them: the factor is :math:`\eta t`), as the Cholesky path
        adds jitter for them.
    """
    xp, backend = namespace_of(k_train=k_train, y_train=y_train, k_test_train=k_test_train)
    k_train, y_train, k_test_train = check_regression_inputs(xp, k_train, y_train,
                                                             k_test_train, backend)
    lr = check_scalar(learning_rate, "learning_rate", positive=True)
    reg = check_scalar(reg, "reg", nonnegative=True)
    t_arr, ts = check_times(xp, backend, t, k_train)
    nan = float("nan")
    n = k_train.shape[0]
    kk = k_train + reg * xp.eye(n, dtype=k_train.dtype, device=device(k_train)) if reg else k_train
    w, v = xp.linalg.eigh(kk)
    tiny = 1e3 * float(xp.finfo(k_train.dtype).eps) * (xp.max(xp.abs(w)) if n else 1.0)
    if n:
        # Same policy as the Cholesky path: negative eigenvalues that a jitter up to the cap
        # would repair are treated as zero (with a warning); at or beyond the cap, raise
        # (under jax.jit: NaN predictions).
        w_min = xp.min(w)
        scale = xp.mean(xp.abs(xp.linalg.diagonal(k_train)))
        cap = _JITTER_CAP * xp.where(scale > 0, scale, 1.0)
        if backend.is_traced(w):
            w = xp.where(w_min > -cap, w, nan)
        else:
            w_min, cap, tiny_v = (backend.scalar(a) for a in (w_min, cap, tiny))
            if w_min <= -cap:
                raise NotPositiveDefiniteError(
                    f"k_train (+ reg={reg:g} I) is not positive semi-definite: smallest "
                    f"eigenvalue {w_min:.3g} is at or below -{_JITTER_CAP:g} x mean(diag) = "
                    f"{-cap:.3g} (gradient flow diverges); check the kernel")
            if w_min < -tiny_v:
                warnings.warn(
                    f"k_train (+ reg={reg:g} I) has negative eigenvalues down to {w_min:.3g} "
                    f"(beyond rounding, {tiny_v:.3g}); they are treated as 0",
                    JitterWarning, stacklevel=2)
        w = xp.where(w < 0, xp.zeros_like(w), w)  # those within rounding are as good as 0
    singular = xp.min(w) <= tiny if n else False
    if backend.is_traced(w, ts):  # t = inf with a singular kernel: NaN predictions
        ts = xp.where(xp.isinf(ts) & singular, nan, ts)
    elif bool(xp.any(xp.isinf(ts))) and bool(singular):
        raise NotPositiveDefiniteError(
            "k_train (+ reg I) is singular, so t=inf (kernel regression) is undefined; use reg>0"
        )
    phi = flow_factor(xp, w, ts, lr, tiny)
    vty = v.T @ y_train  # (N,) or (N, K)
    ksv = k_test_train @ v  # (M, N)
    if y_train.ndim == 1:
        out = (phi * vty[None, :]) @ ksv.T  # (T, M)
    else:
        out = xp.stack([ksv @ (phi[i, :, None] * vty) for i in range(phi.shape[0])])
    return out[0, ...] if t_arr.ndim == 0 else out


@dataclass(frozen=True)
class GPPosterior:
    """Gaussian-process posterior with a precomputed kernel.

    Attributes
    ----------
    mean : array, shape (M,) or (M, K)
        Posterior mean :math:`K_* (K + \\lambda I)^{-1} y`.
    covariance : array, shape (M, M), or None
        :math:`K_{**} - K_* (K + \\lambda I)^{-1} K_*^\\top` (``None`` without ``k_test_test``);
        shared by all K output columns.
    log_marginal_likelihood : array, shape ()
        :math:`\\log p(y)` summed over the K independent output columns.
    jitter : float
        Absolute jitter the factorisation needed (a 0-d array under ``jax.jit``).
    variance : array, shape (M,), or None
        The posterior variances, the diagonal of the covariance (``None`` where
        :func:`gp_inference` has no ``k_test_test``; :func:`ntkcore.feature_gp_inference`
        always gives them).
    """

    mean: Array
    covariance: Array | None
    log_marginal_likelihood: Array
    jitter: float
    variance: Array | None = None


@capabilities(fast=TRIANGULAR_SOLVE, note=DIFFERENTIABLE)
def gp_inference(
    k_train: Array,
    y_train: Array,
    k_test_train: Array,
    k_test_test: Array | None = None,
    *,
    reg: float = 0.0,
    jitter: str | float | None = "auto",
) -> GPPosterior:
    r"""GP posterior mean, covariance and log marginal likelihood from one Cholesky factor.

    With :math:`L L^\top = K + \lambda I`, :math:`\alpha = L^{-\top}L^{-1}y` and
    :math:`W = L^{-1} K_*^\top`:

    .. math::

        \mu = K_* \alpha, \quad \Sigma = K_{**} - W^\top W, \quad
        \log p(y) = -\tfrac12 y^\top \alpha - \sum_i \log L_{ii} - \tfrac N2 \log 2\pi

    (per output column; columns are independent and their log-likelihoods add).

    Parameters
    ----------
    k_train : array, shape (N, N)
    y_train : array, shape (N,) or (N, K)
    k_test_train : array, shape (M, N)
    k_test_test : array, shape (M, M), optional
        Prior covariance of the test points; without it ``covariance`` is ``None``.
    reg : float
        Observation-noise variance :math:`\lambda \ge 0`.
    jitter : "auto", float or None

    Returns
    -------
    GPPosterior

    Raises
    ------
    TypeError
        Arrays of different libraries or a non-floating dtype (the argument is named).
    ValueError
        Wrong shapes, NaN/Inf in an array, or ``k_train`` asymmetric beyond
        ``1000 eps max|diag K|`` (within it :math:`(K + K^\top)/2` is used).
    NotPositiveDefiniteError
        ``k_train + reg I`` not positive definite even with the allowed jitter.
    """
    xp, backend = namespace_of(
        k_train=k_train, y_train=y_train, k_test_train=k_test_train, k_test_test=k_test_test
    )
    k_train, y_train, k_test_train = check_regression_inputs(xp, k_train, y_train,
                                                             k_test_train, backend)
    reg = check_scalar(reg, "reg", nonnegative=True)
    m = k_test_train.shape[0]
    if k_test_test is not None:
        check_kernel(xp, k_test_test, "k_test_test", "(M, M)")
        if tuple(k_test_test.shape) != (m, m):
            raise ValueError(
                f"k_test_test must have shape ({m}, {m}); got {tuple(k_test_test.shape)}"
            )
        k_train, y_train, k_test_train, k_test_test = promote(xp, k_train, y_train,
                                                              k_test_train, k_test_test)
    l, eps = cholesky_with_jitter(xp, backend, k_train, reg=reg, jitter=jitter)
    alpha = backend.cho_solve(l, y_train)
    mean = k_test_train @ alpha
    cov = var = None
    if k_test_test is not None:
        w = backend.solve_triangular(l, k_test_train.T, lower=True)
        cov = k_test_test - w.T @ w
        var = xp.linalg.diagonal(cov)
    n = k_train.shape[0]
    cols = 1 if y_train.ndim == 1 else y_train.shape[1]
    logdet_half = xp.sum(xp.log(xp.linalg.diagonal(l)))
    lml = -0.5 * xp.sum(y_train * alpha) - cols * logdet_half - 0.5 * n * cols * _LOG_2PI
    return GPPosterior(mean=mean, covariance=cov, log_marginal_likelihood=lml, jitter=eps,
                       variance=var)
