r"""Preconditioned conjugate gradients for :math:`(K + \lambda I) X = Y` with K used only through
products (:func:`cg_solve`), its Nystrom and pivoted-Cholesky preconditioners, and the registry
of operator adapters (:func:`register_operator_adapter`)."""

from __future__ import annotations

import functools
import importlib
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import array_api_compat

from ._typing import Array
from ._validation import (
    FiniteFlags,
    all_finite,
    check_array,
    check_scalar,
    check_symmetric,
    kernel_layout_hint,
    namespace_of,
    promote,
)
from .backend import Backend, get_backend, seed_from
from .linop import ArrayOperator, IdentityOperator, LinearOperator
from .support import GENERATOR, capabilities

__all__ = [
    "CGReport",
    "ConvergenceWarning",
    "LinearOperator",
    "NystromPreconditioner",
    "PivotedCholeskyPreconditioner",
    "aslinearoperator",
    "cg_kernel_regression",
    "cg_solve",
    "nystrom_preconditioner",
    "pivoted_cholesky_preconditioner",
    "register_operator_adapter",
]


_is_array = array_api_compat.is_array_api_obj


class ConvergenceWarning(RuntimeWarning):
    """An iterative solver stopped at its iteration limit before reaching the tolerance."""


# -- Linear operators (the interface lives in ntkcore.linop) --------------------------------------
class _DuckOperator(LinearOperator):
    """A user object with ``shape``, ``matmat``/``matvec`` (and the optional methods)."""

    def __init__(self, op: Any) -> None:
        self.op = op
        self.shape = tuple(int(s) for s in op.shape)  # type: ignore[assignment]
        self.dtype = getattr(op, "dtype", None)
        for method in ("matmat", "matvec", "sketch", "columns", "diagonal"):
            if hasattr(op, method):
                setattr(self, method, getattr(op, method))


class _Detached(LinearOperator):
    """The products of an operator cut from autograd (what the iterations use)."""

    def __init__(self, op: LinearOperator, backend: Backend) -> None:
        self.op, self.cut = op, backend.stop_gradient
        self.shape, self.dtype, self.symmetric = op.shape, op.dtype, op.symmetric

    def matmat(self, v: Array) -> Array:
        return self.cut(self.op.matmat(v))

    def sketch(self, v: Array) -> Array:
        return self.cut(self.op.sketch(v))

    def columns(self, idx: list[int], like: Array) -> Array:
        return self.cut(self.op.columns(idx, like))

    def diagonal(self, like: Array) -> Array:
        return self.cut(self.op.diagonal(like))


class _Adapter(NamedTuple):
    matches: Callable[[Any], bool]
    adapt: Callable[[Any], LinearOperator]
    local: Callable[[Any], Array] | None


_ADAPTERS: list[_Adapter] = []
# Kinds of ``k`` whose adapter a module registers when imported, imported on first sight:
# (test, module, hint if the import fails).
_ADAPTER_MODULES = ((array_api_compat.is_dask_array, "ntkcore.distributed",
                     "a dask array was given; install the 'dask' extra (pip install "
                     "ntkcore[dask])"),)


def register_operator_adapter(matches: Callable[[Any], bool],
                              adapt: Callable[[Any], LinearOperator], *,
                              local: Callable[[Any], Array] | None = None) -> None:
    """Let :func:`aslinearoperator` wrap the objects ``matches`` accepts with ``adapt``.

    ``local(y)``, when given, turns a matching right-hand side ``y`` of :func:`cg_solve` into
    an array of this process.  :mod:`ntkcore.distributed` registers dask arrays this way.
    """
    global _ADAPTERS
    _ADAPTERS = [a for a in _ADAPTERS if a.matches is not matches]
    _ADAPTERS.append(_Adapter(matches, adapt, local))


def _adapter(x: Any) -> _Adapter | None:
    """The registered adapter for ``x`` (importing the module that registers it if needed)."""
    for matches, module, hint in _ADAPTER_MODULES:
        if matches(x):
            try:
                importlib.import_module(module)
            except ImportError as exc:  # pragma: no cover - dask is installed in CI
                raise ImportError(hint) from exc
    return next((a for a in _ADAPTERS if a.matches(x)), None)


def aslinearoperator(k: Any, *, name: str = "k") -> LinearOperator:
    """Wrap an array, a dask array or an operator-like object as a :class:`LinearOperator`.

    Raises
    ------
    TypeError
        If ``k`` is neither an array nor an object with ``shape`` and ``matmat``/``matvec``.
    ValueError
        If ``k`` is not square.
    """
    if isinstance(k, LinearOperator):
        op = k
    elif (adapter := _adapter(k)) is not None:
        op = adapter.adapt(k)
    elif not _is_array(k) and hasattr(k, "shape") and (hasattr(k, "matmat")
                                                        or hasattr(k, "matvec")):
        op = _DuckOperator(k)
    elif _is_array(k):
        if k.ndim != 2:
            raise ValueError(f"{name} must have shape (N, N); got shape {tuple(k.shape)}"
                             + kernel_layout_hint(k, name))
        op = ArrayOperator(k)
    else:
        raise TypeError(
            f"{name} must be an array, a dask array or a linear operator with shape, dtype and "
            f"matmat/matvec; got {type(k).__name__}"
        )
    if len(op.shape) != 2 or op.shape[0] != op.shape[1]:
        raise ValueError(f"{name} must be square (N, N); got shape {tuple(op.shape)}")
    return op


# -- Preconditioners ------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class NystromPreconditioner:
    r"""Randomized Nystrom preconditioner :math:`M^{-1}` for :math:`K + \mu I`.

    Attributes
    ----------
    u : array, shape (N, r)
        Orthonormal eigenvector estimates of K.
    eigenvalues : array, shape (r,)
        Eigenvalue estimates :math:`\hat\lambda_1 \ge \dots \ge \hat\lambda_r \ge 0`.
    mu : float
        The shift (the ridge of the system).
    """

    u: Array
    eigenvalues: Array
    mu: float
    name: str = "nystrom"

    @property
    def rank(self) -> int:
        return int(self.u.shape[1])

    def apply(self, r: Array) -> Array:
        r""":math:`M^{-1} R = R + U\,\big(\tfrac{\hat\lambda_r+\mu}{\hat\lambda+\mu} - 1\big)
        \odot (U^\top R)` for ``r`` (N, k) -> (N, k)."""
        lam_r = self.eigenvalues[-1]
        scale = (lam_r + self.mu) / (self.eigenvalues + self.mu) - 1.0  # (r,)
        return r + self.u @ (scale[:, None] * (self.u.T @ r))


@dataclass(frozen=True, eq=False)
class PivotedCholeskyPreconditioner:
    r"""Pivoted-Cholesky preconditioner :math:`M = L L^\top + s I`, applied by Woodbury.

    Attributes
    ----------
    l : array, shape (N, r)
        Low-rank factor, :math:`K \approx L L^\top`.
    chol : array, shape (r, r)
        Lower Cholesky factor of :math:`s I + L^\top L`.
    shift : float
        :math:`s > 0`.
    pivots : tuple of int
        The chosen pivot indices, in order.
    """

    l: Array
    chol: Array
    shift: float
    pivots: tuple[int, ...]
    backend: Backend = field(repr=False)
    name: str = "pivoted_cholesky"

    @property
    def rank(self) -> int:
        return int(self.l.shape[1])

    def apply(self, r: Array) -> Array:
        r""":math:`M^{-1} R = (R - L (sI + L^\top L)^{-1} L^\top R) / s`, (N, k) -> (N, k)."""
        if self.rank == 0:
            return r / self.shift
        w = self.backend.cho_solve(self.chol, self.l.T @ r)
        return (r - self.l @ w) / self.shift


def nystrom_preconditioner(
    k: Any, rank: int, *, reg: float = 0.0, seed: Any = 0, like: Array,
    name: str = "k",
) -> NystromPreconditioner:
    r"""Build a :class:`NystromPreconditioner` of ``rank`` for ``k + reg I``.

    Randomized Nystrom (Frangella, Tropp & Udell, 2023), one product with r columns: with an
    orthonormal Gaussian :math:`\Omega` (N, r), :math:`Y = K\Omega`, a stabilising shift
    :math:`\nu`, :math:`C C^\top = \Omega^\top (Y + \nu\Omega)`,
    :math:`B = (Y + \nu\Omega) C^{-\top} = U \Sigma V^\top` and
    :math:`\hat\Lambda = \max(\Sigma^2 - \nu, 0)`, :math:`K \approx U \hat\Lambda U^\top` and
    :math:`M^{-1} = (\hat\lambda_r + \mu) U (\hat\Lambda + \mu I)^{-1} U^\top + (I - U U^\top)`.

    Parameters
    ----------
    k : array, dask array or linear operator, shape (N, N)
    rank : int
        Sketch size r (``1 <= r <= N``).
    reg : float
        The ridge :math:`\mu` of the system being preconditioned.
    seed : int, None, numpy.random.Generator, torch.Generator or JAX PRNG key
        Seed of the Gaussian test matrix (a generator or key is drawn from once:
        :func:`ntkcore.backend.seed_from`).
    like : array
        Any array of the namespace/device/dtype the preconditioner should live in (the
        right-hand side).
    name : str
        Name of ``k`` in error messages.

    Returns
    -------
    NystromPreconditioner

    Raises
    ------
    ValueError
        The product of ``k`` with the Gaussian sketch holds NaN or Inf (so does ``k``).
    """
    op, xp, backend, n, r = _setup(k, rank, like)
    dtype, dev = like.dtype, array_api_compat.device(like)
    omega = backend.generator(seed_from(seed), dev).normal((n, r), dtype)
    omega, _ = xp.linalg.qr(omega)  # orthonormal columns, (N, r)
    y = xp.astype(op.sketch(omega), dtype)  # K Omega, (N, r) (may be lower precision)
    if not all_finite(xp, y):
        raise ValueError(f"{name} contains NaN or Inf (its product with the Nystrom sketch "
                         "does)")
    eps = float(xp.finfo(dtype).eps)
    nu = math.sqrt(n) * eps * float(xp.linalg.vector_norm(y))
    gram = omega.T @ y  # C C^T = Omega^T (Y + nu Omega) = Omega^T Y + nu I, nu grown 10x
    shifts = [(nu if nu > 0 else eps) * 10.0 ** j for j in range(40)]
    c, i = backend.first_cholesky(0.5 * (gram + gram.T), shifts)
    if c is None:
        raise ValueError(f"{name}: its Nystrom sketch could not be factorised")
    nu = shifts[i]
    y_nu = y + nu * omega
    b = backend.solve_triangular(c, y_nu.T, lower=True).T  # Y_nu C^{-T}, (N, r)
    u, s, _ = xp.linalg.svd(b, full_matrices=False)
    lam = xp.clip(s * s - nu, min=0.0)
    mu = float(reg)
    if mu <= 0:
        # no ridge: keep M^{-1} finite with a shift below every retained eigenvalue
        lam_pos = float(lam[-1])
        mu = lam_pos * 1e-3 if lam_pos > 0 else max(nu, eps)
    return NystromPreconditioner(u, lam, mu)


def pivoted_cholesky_preconditioner(
    k: Any, rank: int, *, reg: float = 0.0, like: Array, rel_tol: float = 0.0,
    name: str = "k",
) -> PivotedCholeskyPreconditioner:
    """Build a :class:`PivotedCholeskyPreconditioner` of at most ``rank`` for ``k + reg I``.

    Greedy partial Cholesky :math:`K \approx L L^\top` pivoting on the largest remaining
    diagonal entry; it reads ``diagonal()`` and r single columns of K.

    Parameters
    ----------
    k : array, dask array or linear operator, shape (N, N)
    rank : int
        Maximum number of pivots r.
    reg : float
        Ridge of the system; the shift ``s`` when positive (else the largest remaining
        diagonal entry).
    like : array
        Namespace/device/dtype of the result (the right-hand side).
    rel_tol : float
        Stop early once the largest remaining diagonal entry is below
        ``rel_tol * trace(K)``.
    name : str
        Name of ``k`` in error messages.

    Returns
    -------
    PivotedCholeskyPreconditioner

    Raises
    ------
    ValueError
        The diagonal or a pivot column of ``k`` holds NaN or Inf.
    """
    op, xp, backend, n, r = _setup(k, rank, like)
    d = xp.astype(op.diagonal(like), like.dtype)  # remaining diagonal of K - L L^T
    if not all_finite(xp, d):
        raise ValueError(f"{name} contains NaN or Inf (on its diagonal)")
    trace = float(xp.sum(d))
    cols: list[Array] = []
    pivots: list[int] = []
    flags = FiniteFlags(xp)  # the columns' NaN/Inf check: one read after the loop
    for _ in range(r):
        i_dev, di_dev = xp.argmax(d), xp.max(d)  # both queued, then read: the pivot's sync
        i = int(i_dev)
        di = float(di_dev)
        if di <= max(rel_tol * trace, 0.0) or di <= 0:
            break
        col = xp.astype(op.columns([i], like)[:, 0], like.dtype)  # K[:, i]
        flags.add(col)
        if cols:
            lmat = xp.stack(cols, axis=1)  # (N, m)
            col = col - lmat @ lmat[i, :]
        li = col / math.sqrt(di)
        cols.append(li)
        pivots.append(i)
        d = d - li * li
    bad = flags.first_bad()
    if bad is not None:  # (a NaN column made the later pivots meaningless, not an error)
        raise ValueError(f"{name} contains NaN or Inf (in column {pivots[bad]})")
    dev = array_api_compat.device(like)
    lmat = (xp.stack(cols, axis=1) if cols
            else xp.zeros((n, 0), dtype=like.dtype, device=dev))
    if reg > 0:
        shift = float(reg)
    else:
        rem = float(xp.max(d)) if n else 0.0
        shift = rem if rem > 0 else float(xp.finfo(like.dtype).eps) * max(trace / max(n, 1), 1.0)
    small = lmat.T @ lmat  # + s I: sI + L^T L
    chol = backend.cholesky(small, shift=shift) if lmat.shape[1] else small
    if chol is None:  # pragma: no cover - sI + L^T L is SPD for s > 0
        raise ValueError("pivoted-Cholesky preconditioner: inner factorisation failed")
    return PivotedCholeskyPreconditioner(lmat, chol, shift, tuple(pivots), backend)


def _setup(k: Any, rank: Any, like: Array) -> tuple[LinearOperator, Any, Backend, int, int]:
    """``(operator, xp, backend, N, rank capped at N)`` for building a preconditioner."""
    if isinstance(rank, bool) or not hasattr(rank, "__index__"):
        raise TypeError(f"rank must be an integer; got {rank!r}")
    if int(rank) < 1:
        raise ValueError(f"rank must be at least 1; got {int(rank)}")
    op, xp = aslinearoperator(k), array_api_compat.array_namespace(like)
    return op, xp, get_backend(xp), op.shape[0], min(int(rank), op.shape[0])


# -- Conjugate gradients --------------------------------------------------------------------------
@dataclass(frozen=True)
class CGReport:
    """What happened in one :func:`cg_solve` call.

    Attributes
    ----------
    converged : bool
        Every column reached ``tol``.
    iterations : int
        Iterations run (products with K, not counting preconditioner set-up and the final
        residual check).
    tol : float
        Requested relative residual.
    maxiter : int
        Iteration limit.
    residuals : tuple of float
        Final true relative residual :math:`\\|y - (K+\\lambda I)x\\| / \\|y\\|` per column.
    history : tuple of float
        Largest recursive relative residual over the columns after each iteration.
    preconditioner : str
        ``"none"``, ``"nystrom"``, ``"pivoted_cholesky"`` or the class name of a custom one.
    rank : int
        Rank of the preconditioner (0 without one).
    setup_seconds, solve_seconds : float
        Wall time building the preconditioner and iterating.
    """

    converged: bool
    iterations: int
    tol: float
    maxiter: int
    residuals: tuple[float, ...]
    history: tuple[float, ...]
    preconditioner: str
    rank: int
    setup_seconds: float
    solve_seconds: float

    @property
    def max_residual(self) -> float:
        return max(self.residuals) if self.residuals else 0.0

    def __str__(self) -> str:
        state = "converged" if self.converged else "NOT converged"
        return (
            f"CG {state} in {self.iterations} iterations (tol {self.tol:.1e}, max relative "
            f"residual {self.max_residual:.2e}); preconditioner {self.preconditioner} rank "
            f"{self.rank}; setup {self.setup_seconds:.3g}s, solve {self.solve_seconds:.3g}s"
        )


@capabilities(fast=GENERATOR, note={
    "numpy": "k may also be a dask array or a linear operator",
    "jax": "works; slow in eager mode (one dispatch per operation per iteration)"})
def cg_solve(
    k: Any,
    y: Array,
    *,
    reg: float = 0.0,
    tol: float | None = None,
    maxiter: int | None = None,
    preconditioner: str | Any | None = "nystrom",
    rank: int = 100,
    seed: Any = 0,
    x0: Array | None = None,
    callback: Callable[[int, float], None] | None = None,
    warn: bool = True,
    name: str = "k",
) -> tuple[Array, CGReport]:
    r"""Solve :math:`(K + \lambda I) X = Y` by preconditioned conjugate gradients.

    The iterates live in ``y``'s namespace, device and dtype; each column is an independent CG
    run sharing one product :math:`K P` per iteration.  Differentiable (torch autograd, eager
    ``jax.grad``) implicitly, as :math:`X = A^{-1} Y`: the backward pass is one more CG solve for
    the cotangent.  A host-driven loop: not under ``jax.jit``.

    Parameters
    ----------
    k : array (N, N), dask array (N, N) or linear operator
        Symmetric positive semi-definite kernel, used only through products: a
        :class:`ntkcore.linop.LinearOperator` or an object with ``shape`` (N, N), ``dtype`` and
        ``matmat(V)`` (N, k) -> (N, k) or ``matvec(v)``, e.g. :class:`ntkcore.KernelOperator`.
        Optional ``diagonal()`` (N,) and ``columns(idx)`` (N, len(idx)) make the
        pivoted-Cholesky preconditioner cheap.
    y : array, shape (N,) or (N, k)
        Right-hand side(s); the solution has the same shape, namespace, device and dtype.
    reg : float, default 0.0
        Ridge :math:`\lambda \ge 0`.
    tol : float, optional
        Relative residual :math:`\|y - (K+\lambda I)x\| \le \mathrm{tol}\,\|y\|` per column;
        default ``max(1e-6, 100 eps(dtype))``.
    maxiter : int, optional
        Iteration limit (default 10 N: rounding spoils the exact N-step termination).
    preconditioner : "nystrom", "pivoted_cholesky", None or object, default "nystrom"
        A ready preconditioner is any object with ``apply(R)`` (N, k) -> (N, k) approximating
        :math:`(K + \lambda I)^{-1} R`.
    rank : int, default 100
        Rank of a preconditioner built here (capped at N).
    seed : int, None, numpy.random.Generator, torch.Generator or JAX PRNG key
        Seed of the Nystrom sketch (as in :func:`nystrom_preconditioner`).
    x0 : array, optional
        Initial guess, same shape as ``y``.
    callback : callable, optional
        ``callback(iteration, max_relative_residual)`` after every iteration.
    warn : bool, default True
        Emit :class:`ConvergenceWarning` when the tolerance is not reached.
    name : str, default "k"
        Name of ``k`` in error messages (``kernel_regression`` passes ``"k_train"``).

    Returns
    -------
    x : array, shape of ``y``
    report : CGReport

    Raises
    ------
    TypeError
        ``k`` or ``y`` of the wrong kind, arrays of different libraries, a non-floating dtype.
    ValueError
        Wrong shapes; NaN/Inf in ``y``, ``x0`` or an array ``k``; an array ``k`` asymmetric
        beyond ``1000 eps max|diag K|`` (within it :math:`(K + K^\top)/2` is used); a NaN/Inf
        in a product with an operator or dask ``k`` (or from the preconditioner) during the
        set-up or the iteration.  Never a silently wrong ``x``: a run that stops without
        converging warns (``warn``) and its report says so.
    """
    op = aslinearoperator(k, name=name)
    adapter = _adapter(y)
    if adapter is not None and adapter.local is not None:
        y = adapter.local(y)
    dense = isinstance(op, ArrayOperator)
    xp, backend = namespace_of(**({name: op.array} if dense else {}), y=y)
    check_array(xp, backend.stop_gradient(y), "y", (1, 2), "(N,) or (N, k)")
    n = op.shape[0]
    if y.shape[0] != n:
        raise ValueError(f"y has {y.shape[0]} rows but k is {n} x {n}")
    if dense:
        check_array(xp, backend.stop_gradient(op.array), name, (2,), "(N, N)")
        k_sym, y = promote(xp, check_symmetric(xp, op.array, name, backend), y)
        op = ArrayOperator(k_sym)
    reg = check_scalar(reg, "reg", nonnegative=True)
    base, shift = op.split_identity()
    if base is not None and shift > 0:
        # an operator carrying its own ridge (K + s I, e.g. KernelOperator(reg=s)):
        # precondition K, shift by both
        op, reg = base, reg + shift
    tol_v = (max(1e-6, 100.0 * float(xp.finfo(y.dtype).eps)) if tol is None
             else check_scalar(tol, "tol", positive=True))
    if maxiter is not None and (isinstance(maxiter, bool) or int(maxiter) != maxiter
                                or maxiter < 0):
        raise ValueError(f"maxiter must be a non-negative integer; got {maxiter!r}")
    maxiter_v = max(10 * n, 1) if maxiter is None else int(maxiter)
    vector = y.ndim == 1
    ymat = y[:, None] if vector else y
    if x0 is not None:
        if not _is_array(x0) or tuple(x0.shape) != tuple(y.shape):
            raise ValueError(f"x0 must be an array of shape {tuple(y.shape)}")
        if not all_finite(xp, x0):
            raise ValueError("x0 contains NaN or Inf")
        x0 = backend.stop_gradient(xp.astype(x0[:, None] if vector else x0, y.dtype))
    # The iterations run outside autograd; the solution is differentiated implicitly.
    op_d = (ArrayOperator(backend.stop_gradient(op.array)) if isinstance(op, ArrayOperator)
            else _Detached(op, backend))
    a_d = op_d + reg * IdentityOperator(n) if reg else op_d  # A = K + reg I

    t0 = time.perf_counter()
    precond = _make_preconditioner(preconditioner, op_d, rank, reg, seed, ymat, name)
    setup = time.perf_counter() - t0
    pname = "none" if precond is None else getattr(precond, "name", type(precond).__name__)

    solve = functools.partial(_pcg, xp, a_d, precond, tol_v, maxiter_v, name, pname)

    def solve_adjoint(g: Array) -> Array:  # the backward pass: one more solve with A = A^T
        x, converged, history = solve(g)
        if warn and not converged:
            warnings.warn(f"conjugate gradients for the gradient did not converge in "
                          f"{len(history)} iterations; raise maxiter or rank, or add a larger "
                          "reg", ConvergenceWarning, stacklevel=2)
        return x

    t1 = time.perf_counter()
    xmat, converged, history = solve(backend.stop_gradient(ymat), x0, callback)
    # honest final residual (the recursive one drifts in low precision), inside autograd
    resid = ymat - (op + reg * IdentityOperator(n) if reg else op).matmat(xmat)
    ynorm = xp.linalg.vector_norm(backend.stop_gradient(ymat), axis=0)
    true_res = xp.linalg.vector_norm(backend.stop_gradient(resid), axis=0) / xp.where(
        ynorm > 0, ynorm, xp.ones_like(ynorm))
    residuals = tuple(float(true_res[i]) for i in range(true_res.shape[0]))
    if not all(math.isfinite(v) for v in residuals):
        raise ValueError(f"the final residual of conjugate gradients is NaN or Inf: {name} "
                         "gave a non-finite product; check it for NaN/Inf entries")
    report = CGReport(converged=converged, iterations=len(history), tol=tol_v,
                      maxiter=maxiter_v, residuals=residuals, history=tuple(history),
                      preconditioner=pname,
                      rank=0 if precond is None else int(getattr(precond, "rank", 0)),
                      setup_seconds=setup, solve_seconds=time.perf_counter() - t1)
    if warn and not converged:
        warnings.warn(f"conjugate gradients did not converge: {report}; raise maxiter or "
                      "rank, or add a larger reg", ConvergenceWarning, stacklevel=2)
    xmat = backend.implicit_solve(xmat, resid, solve_adjoint)
    return (xmat[:, 0] if vector else xmat), report


def _pcg(xp: Any, a: LinearOperator, precond: Any, tol: float, maxiter: int, name: str,
         pname: str, ymat: Array, xmat: Array | None = None, callback: Any = None,
         ) -> tuple[Array, bool, list[float]]:
    r"""Preconditioned CG from ``xmat`` (zero if None) for the columns of ``ymat``:
    ``(x, converged, largest recursive relative residual per iteration)``.

    Per column, with :math:`M^{-1} \approx A^{-1}`: :math:`r_0 = y - A x_0`, :math:`z_0 = p_0 =
    M^{-1} r_0`; :math:`\alpha_j = r_j^\top z_j / p_j^\top A p_j`, :math:`x_{j+1} = x_j +
    \alpha_j p_j`, :math:`r_{j+1} = r_j - \alpha_j A p_j`, :math:`z_{j+1} = M^{-1} r_{j+1}`,
    :math:`\beta_j = r_{j+1}^\top z_{j+1} / r_j^\top z_j`, :math:`p_{j+1} = z_{j+1} + \beta_j
    p_j`, until :math:`\|r_j\| \le \mathrm{tol}\,\|y\|` for every column."""
    ynorm = xp.linalg.vector_norm(ymat, axis=0)  # (k,)
    ynorm_safe = xp.where(ynorm > 0, ynorm, xp.ones_like(ynorm))
    r = ymat if xmat is None else ymat - a.matmat(xmat)
    xmat = xp.zeros_like(ymat) if xmat is None else xmat
    z = precond.apply(r) if precond is not None else r
    p = z
    rz = xp.sum(r * z, axis=0)
    res = xp.linalg.vector_norm(r, axis=0) / ynorm_safe
    history: list[float] = []
    done = bool(xp.all(res <= tol))
    while not done and len(history) < maxiter:
        active = res > tol
        ap = a.matmat(p)
        pap = xp.sum(p * ap, axis=0)
        ok = active & (pap > 0)
        step = xp.where(ok, rz / xp.where(ok, pap, xp.ones_like(pap)), xp.zeros_like(pap))
        xmat = xmat + step * p
        r = r - step * ap
        res = xp.where(active, xp.linalg.vector_norm(r, axis=0) / ynorm_safe, res)
        any_ok = xp.any(ok)  # queued before the read below: its own read then waits for nothing
        worst = float(xp.max(res))  # the iteration's host sync (convergence)
        history.append(worst)
        if not math.isfinite(worst):
            raise ValueError(
                f"conjugate gradients met NaN or Inf at iteration {len(history)}: {name} (or "
                f"the preconditioner {pname!r}) gave a non-finite product; check {name} for "
                "NaN/Inf entries")
        if callback is not None:
            callback(len(history), worst)
        if worst <= tol or not bool(any_ok):
            break
        z = precond.apply(r) if precond is not None else r
        rz_new = xp.sum(r * z, axis=0)
        still = ok & (rz > 0)
        beta = xp.where(still, rz_new / xp.where(still, rz, xp.ones_like(rz)),
                        xp.zeros_like(rz))
        p = z + beta * p
        rz = xp.where(ok, rz_new, rz)
    return xmat, bool(xp.all(res <= tol)), history


def _make_preconditioner(
    preconditioner: Any, op: LinearOperator, rank: int, reg: float, seed: int | None,
    like: Array, name: str = "k",
) -> Any:
    if preconditioner is None or preconditioner == "none":
        return None
    if preconditioner == "nystrom":
        return nystrom_preconditioner(op, rank, reg=reg, seed=seed, like=like, name=name)
    if preconditioner in ("pivoted_cholesky", "pivchol"):
        return pivoted_cholesky_preconditioner(op, rank, reg=reg, like=like, name=name)
    if isinstance(preconditioner, str) or not callable(getattr(preconditioner, "apply", None)):
        text = isinstance(preconditioner, str)
        raise (ValueError if text else TypeError)(
            "preconditioner must be 'nystrom', 'pivoted_cholesky', None or an object with "
            f"apply(R); got {repr(preconditioner) if text else type(preconditioner).__name__}")
    return preconditioner


def cg_kernel_regression(
    k_train: Any,
    y_train: Array,
    k_test_train: Any,
    *,
    reg: float = 0.0,
    **cg_options: Any,
) -> Array:
    r"""Kernel regression :math:`K_* (K + \lambda I)^{-1} y`, solved by :func:`cg_solve`.

    This is what ``kernel_regression(..., solver="cg")`` runs.

    Parameters
    ----------
    k_train : array (N, N), dask array or linear operator
    y_train : array, shape (N,) or (N, k)
    k_test_train : array (M, N), dask array (M, N), or an object with ``matmat``
        (e.g. a :class:`~ntkcore.KernelOperator` between test and training points).
    reg : float
    **cg_options
        ``tol``, ``maxiter``, ``preconditioner``, ``rank``, ``seed``, ``x0``, ``callback``,
        ``warn`` of :func:`cg_solve`.

    Returns
    -------
    array, shape (M,) or (M, k)
        In ``k_test_train``'s kind: a lazy dask array for a dask ``k_test_train``, otherwise
        the namespace of ``y_train``.

    Raises
    ------
    TypeError
        Unknown options, arrays of different libraries or a non-floating dtype.
    ValueError
        Wrong shapes; NaN/Inf in ``y_train`` or in an in-memory ``k_train`` or
        ``k_test_train``; an array ``k_train`` asymmetric beyond ``1000 eps max|diag K|``; a
        non-finite product of an operator ``k_train`` (see :func:`cg_solve`).  An operator or
        dask ``k_test_train`` is not checked: it is only read by the final product.
    """
    allowed = {"tol", "maxiter", "preconditioner", "rank", "seed", "x0", "callback", "warn"}
    if unknown := set(cg_options) - allowed:
        raise TypeError(f"unknown conjugate-gradient option(s) {sorted(unknown)}; allowed: "
                        f"{sorted(allowed)}")
    n = aslinearoperator(k_train, name="k_train").shape[0]
    if len(k_test_train.shape) != 2 or k_test_train.shape[1] != n:
        raise ValueError(
            f"k_test_train must have N={n} columns (one per training point); got shape "
            f"{tuple(k_test_train.shape)}" + kernel_layout_hint(k_test_train, "k_test_train")
        )
    if _is_array(k_test_train):
        check_array(array_api_compat.array_namespace(k_test_train), k_test_train,
                    "k_test_train", (2,), "(M, N)")
    alpha, _ = cg_solve(k_train, y_train, reg=reg, name="k_train", **cg_options)
    if _is_array(k_test_train):  # dask arrays too: a lazy product
        if k_test_train.dtype != alpha.dtype:  # one library here (a dask K_* meets NumPy)
            k_test_train, alpha = promote(array_api_compat.array_namespace(alpha),
                                          k_test_train, alpha)
        return k_test_train @ alpha
    return _DuckOperator(k_test_train) @ alpha
