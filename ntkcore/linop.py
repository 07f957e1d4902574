r"""One linear-operator interface: products, adjoint and composition, for any array API.

A :class:`LinearOperator` A of ``shape`` (M, N) knows :meth:`~LinearOperator.matmat`
:math:`A V` ((N, k) -> (M, k)) or :meth:`~LinearOperator.matvec`, and where it has one its
adjoint :meth:`~LinearOperator.rmatmat` :math:`A^\top W` ((M, k) -> (N, k)) or ``rmatvec``;
``dtype`` and ``device`` describe its products.  Operators compose lazily, as in SciPy and
curvlinops: ``A + B`` (same shape), ``c * A`` (real scalar c), ``A @ B`` (:math:`A B`),
``A.T`` (:math:`A^\top`) and :class:`IdentityOperator`; ``A @ x`` with an array ``x`` is
the product.  ``diagonal``, ``columns`` and ``sketch`` serve the preconditioners of
:func:`ntkcore.cg_solve`; :meth:`~LinearOperator.split_identity` splits a ridge
:math:`A = K + s I` off for them.  Instances: arrays (:class:`ArrayOperator`), a Jacobian
(``Jacobian.as_operator()``, (N O, P)), :class:`ntkcore.KernelOperator`, the factor of
:class:`ntkcore.solve.SMWSolver` and the dask/Zarr kernels.  SciPy's
``scipy.sparse.linalg.LinearOperator`` of a NumPy operator: ``ntkcore.backends.numpy.to_scipy``.
"""

from __future__ import annotations

import numbers
from typing import Any

import array_api_compat

from ._typing import Array
from ._validation import promote

__all__ = ["AdjointOperator", "ArrayOperator", "IdentityOperator", "LinearOperator"]


class LinearOperator:
    """Base class (and duck-type description) of an (M, N) linear operator.

    Subclasses set ``shape`` and ``dtype`` (``device`` optionally) and implement
    :meth:`matmat` or :meth:`matvec`, and for an adjoint :meth:`rmatmat` or :meth:`rmatvec`
    (a ``symmetric`` operator is its own adjoint).  :meth:`diagonal` and :meth:`columns` have
    generic (slow: one product per column) fallbacks.
    """

    shape: tuple[int, int]
    dtype: Any = None
    device: Any = None
    symmetric: bool = False
    __array_ufunc__ = None  # NumPy scalars defer to __rmul__ instead of broadcasting

    def matmat(self, v: Array) -> Array:
        """:math:`A V` for ``v`` (N, k) -> (M, k)."""
        xp = array_api_compat.array_namespace(v)
        return xp.stack([self.matvec(v[:, j]) for j in range(v.shape[1])], axis=1)

    def matvec(self, v: Array) -> Array:
        """:math:`A v` for ``v`` (N,) -> (M,)."""
        return self.matmat(v[:, None])[:, 0]

    def rmatmat(self, w: Array) -> Array:
        r""":math:`A^\top W` for ``w`` (M, k) -> (N, k)."""
        if self.symmetric:
            return self.matmat(w)
        if type(self).rmatvec is LinearOperator.rmatvec:
            raise NotImplementedError(f"{type(self).__name__} has no adjoint (rmatmat/rmatvec)")
        xp = array_api_compat.array_namespace(w)
        return xp.stack([self.rmatvec(w[:, j]) for j in range(w.shape[1])], axis=1)

    def rmatvec(self, w: Array) -> Array:
        r""":math:`A^\top w` for ``w`` (M,) -> (N,)."""
        return self.rmatmat(w[:, None])[:, 0]

    @property
    def T(self) -> LinearOperator:
        r"""The adjoint :math:`A^\top` (lazy)."""
        return AdjointOperator(self)

    def __matmul__(self, other: Any) -> Any:
        if isinstance(other, LinearOperator):
            return _Product(self, other)
        return self.matvec(other) if other.ndim == 1 else self.matmat(other)

    def __add__(self, other: Any) -> LinearOperator:
        if not isinstance(other, LinearOperator):
            return NotImplemented
        return _Combination([(1.0, self), (1.0, other)])

    def __sub__(self, other: Any) -> LinearOperator:
        if not isinstance(other, LinearOperator):
            return NotImplemented
        return _Combination([(1.0, self), (-1.0, other)])

    def __mul__(self, c: Any) -> LinearOperator:
        if isinstance(c, bool) or not isinstance(c, numbers.Real):
            return NotImplemented
        return _Combination([(float(c), self)])

    __rmul__ = __mul__

    def __neg__(self) -> LinearOperator:
        return -1.0 * self

    def split_identity(self) -> tuple[LinearOperator | None, float]:
        """``(K, s)`` with this operator equal to :math:`K + s I` (``K`` None: zero); the
        preconditioners of :func:`ntkcore.cg_solve` approximate ``K`` and shift by ``s``."""
        return self, 0.0

    def sketch(self, v: Array) -> Array:
        """:math:`A V` for building a preconditioner (N, r) -> (N, r).

        A preconditioner only has to be approximate, so an operator may compute this product
        faster and less precisely than :meth:`matmat` (for example in the dtype of a float32
        stored kernel); the default is :meth:`matmat`.
        """
        return self.matmat(v)

    def columns(self, idx: list[int], like: Array) -> Array:
        """Columns ``A[:, idx]`` (M, len(idx)) in the namespace/device/dtype of ``like``."""
        xp = array_api_compat.array_namespace(like)
        dev = array_api_compat.device(like)
        rows = xp.asarray(idx, dtype=xp.int64, device=dev)
        grid = xp.arange(self.shape[1], dtype=xp.int64, device=dev)
        # one-hot (N, len(idx)) built by comparison: no in-place writes (jax, array_api_strict)
        e = xp.astype(grid[:, None] == rows[None, :], like.dtype)
        return self.matmat(e)

    def diagonal(self, like: Array) -> Array:
        """The diagonal of a square A (N,); the generic fallback costs N products (avoid it)."""
        xp = array_api_compat.array_namespace(like)
        n, step = self.shape[0], 256  # columns s:e hold the diagonal block s:e
        blocks = [(s, min(n, s + step)) for s in range(0, n, step)]
        return xp.concat([xp.linalg.diagonal(self.columns(list(range(s, e)), like)[s:e, :])
                          for s, e in blocks])


class ArrayOperator(LinearOperator):
    """An in-memory (M, N) array ``a`` of any array-API namespace (kept as ``array``).

    Products with an operand of another float dtype run in the dtype the two promote to
    (:func:`~ntkcore._validation.promote`, as NumPy's ``matmul`` does; torch's refuses mixed
    dtypes); ``a`` is then cast for each product, so callers that multiply often promote
    once up front (:func:`~ntkcore.cg_solve` does).
    """

    def __init__(self, a: Array) -> None:
        self.array = a
        self.xp = array_api_compat.array_namespace(a)
        self.shape = (int(a.shape[0]), int(a.shape[1]))
        self.dtype = a.dtype
        self.device = array_api_compat.device(a)

    def matmat(self, v: Array) -> Array:
        a, v = promote(self.xp, self.array, v)
        return a @ v

    def rmatmat(self, w: Array) -> Array:
        a, w = promote(self.xp, self.array, w)
        return self.xp.matrix_transpose(a) @ w

    def columns(self, idx: list[int], like: Array) -> Array:
        ind = self.xp.asarray(idx, dtype=self.xp.int64, device=self.device)
        return self.xp.take(self.array, ind, axis=1)

    def diagonal(self, like: Array) -> Array:
        return self.xp.linalg.diagonal(self.array)


class IdentityOperator(LinearOperator):
    """The (N, N) identity :math:`I V = V`."""

    symmetric = True

    def __init__(self, n: int, *, dtype: Any = None, device: Any = None) -> None:
        self.shape = (int(n), int(n))
        self.dtype, self.device = dtype, device

    def matmat(self, v: Array) -> Array:
        return v

    def split_identity(self) -> tuple[LinearOperator | None, float]:
        return None, 1.0

    def diagonal(self, like: Array) -> Array:
        xp = array_api_compat.array_namespace(like)
        return xp.ones(self.shape[0], dtype=like.dtype, device=array_api_compat.device(like))


class AdjointOperator(LinearOperator):
    r""":math:`A^\top` of an operator A (its products are A's adjoint products)."""

    def __init__(self, op: LinearOperator) -> None:
        self.op = op
        self.shape = (op.shape[1], op.shape[0])
        self.dtype, self.device, self.symmetric = op.dtype, op.device, op.symmetric

    def matmat(self, v: Array) -> Array:
        return self.op.rmatmat(v)

    def rmatmat(self, w: Array) -> Array:
        return self.op.matmat(w)

    @property
    def T(self) -> LinearOperator:
        return self.op


class _Combination(LinearOperator):
    r""":math:`\sum_i c_i A_i` for real :math:`c_i` and operators of one shape: ``A + B``,
    ``c * A``."""

    def __init__(self, terms: list[tuple[float, LinearOperator]]) -> None:
        shapes = [tuple(a.shape) for _, a in terms]
        if len(set(shapes)) != 1:
            raise ValueError(f"cannot add operators of shapes {' and '.join(map(str, shapes))}")
        self.terms, self.shape = terms, shapes[0]  # type: ignore[assignment]
        self.dtype = next((a.dtype for _, a in terms if a.dtype is not None), None)
        self.device = next((a.device for _, a in terms if a.device is not None), None)
        self.symmetric = all(a.symmetric for _, a in terms)

    def _sum(self, method: str, *args: Any) -> Array:
        out = None
        for c, a in self.terms:
            part = getattr(a, method)(*args)
            part = part if c == 1.0 else c * part
            out = part if out is None else out + part
        return out

    def matmat(self, v: Array) -> Array:
        return self._sum("matmat", v)

    def rmatmat(self, w: Array) -> Array:
        return self._sum("rmatmat", w)

    def sketch(self, v: Array) -> Array:
        return self._sum("sketch", v)

    def columns(self, idx: list[int], like: Array) -> Array:
        return self._sum("columns", idx, like)

    def diagonal(self, like: Array) -> Array:
        return self._sum("diagonal", like)

    def split_identity(self) -> tuple[LinearOperator | None, float]:
        splits = [(c, a.split_identity()) for c, a in self.terms]
        ks = [(c, k) for c, (k, _) in splits if k is not None]
        if len(ks) == 1 and ks[0][0] == 1.0:
            return ks[0][1], sum(c * s for c, (_, s) in splits)
        return (_Combination(ks) if ks else None), sum(c * s for c, (_, s) in splits)


class _Product(LinearOperator):
    r""":math:`A B` ((M, K) times (K, N)); :math:`(A B)^\top = B^\top A^\top`."""

    def __init__(self, a: LinearOperator, b: LinearOperator) -> None:
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"cannot compose operators of shapes {tuple(a.shape)} and "
                             f"{tuple(b.shape)}")
        self.a, self.b, self.shape = a, b, (a.shape[0], b.shape[1])
        self.dtype = a.dtype if a.dtype is not None else b.dtype
        self.device = a.device if a.device is not None else b.device

    def matmat(self, v: Array) -> Array:
        return self.a.matmat(self.b.matmat(v))

    def rmatmat(self, w: Array) -> Array:
        return self.b.rmatmat(self.a.rmatmat(w))

