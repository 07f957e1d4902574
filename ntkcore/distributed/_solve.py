r"""Solvers on dask kernels: blocked Cholesky, and a product-only operator for CG.

Blocked Cholesky (for kernels that fit the cluster's memory, not one machine's):

.. math:: L L^\top = K + \lambda I, \quad z = L^{-1} y, \quad \alpha = L^{-\top} z, \quad
          \hat f = K_* \alpha .

``dask.array.linalg.cholesky`` returns the *upper* factor unless ``lower=True`` is passed; we
ask for the lower one explicitly and solve with ``lower=True`` then with its transpose
(``lower=False``).  The factor is persisted on the workers so that the two solves do not
factorise twice.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import dask.array as da
import numpy as np

from .._validation import check_scalar
from ..cg import LinearOperator, register_operator_adapter
from ..errors import NotPositiveDefiniteError
from ..support import capabilities
from ._ntk import back_to_namespace, to_numpy
from ._zarrop import ZarrMatrixOperator, accumulate


def to_local(x: Any) -> np.ndarray:
    """Compute a (small) dask array into host memory."""
    return np.asarray(x.compute()) if hasattr(x, "compute") else to_numpy(x)


def _lazy(x: Any) -> da.Array:
    return x if isinstance(x, da.Array) else da.from_array(to_numpy(x))


def _tile_product(t: np.ndarray, v: np.ndarray, dtype: str) -> np.ndarray:
    """One tile's share ``t @ v`` (rows, 1, k) in ``dtype`` (tile upcast in row blocks)."""
    out = np.zeros((t.shape[0], v.shape[1]), dtype=dtype)
    accumulate(np.asarray(t), v.astype(out.dtype, copy=False), out, (0, t.shape[0]),
                (0, t.shape[1]), False, out.dtype)
    return out[:, None, :]


class DaskMatrixOperator(LinearOperator):
    """A square dask array as a linear operator for :func:`ntkcore.cg_solve`.

    Each product ``K @ V`` is one Dask computation (tiles recomputed from the graph, read
    from storage, or taken from worker memory after ``persist``); ``V`` and the result are
    small (N, k) host arrays converted to and from the namespace of ``V``.  A float32 kernel
    times float64 vectors is computed in float64 with each tile upcast in cache-sized row
    blocks (never as a mixed-dtype NumPy product, which does not use BLAS and is tens of
    times slower); :meth:`sketch` multiplies in the kernel's dtype.

    A dask array returned by :func:`read_zarr` (unmodified) is multiplied through
    :class:`ZarrMatrixOperator` instead: a few tasks per worker reading tiles straight from
    the store, the upper triangle only for a symmetric kernel.

    Parameters
    ----------
    k : dask.array.Array, shape (N, N)
    persist : bool, default False
        ``k.persist()`` first (keeps every tile in the workers' memory: only when it fits).
    """

    def __init__(self, k: da.Array, *, persist: bool = False) -> None:
        if k.ndim != 2:
            raise ValueError(f"k must have shape (N, N); got shape {tuple(k.shape)}")
        store = None if persist else getattr(k, "_ntkcore_zarr_store", None)
        self.zarr = None if store is None else ZarrMatrixOperator(store)
        if self.zarr is not None:  # read_zarr's array: every product straight from the store
            self.matmat, self.sketch = self.zarr.matmat, self.zarr.sketch
            self.columns, self.diagonal = self.zarr.columns, self.zarr.diagonal
        self.k = k.persist() if persist else k
        self.shape = (int(k.shape[0]), int(k.shape[1]))
        self.dtype = k.dtype

    def _product(self, v: Any, dtype: np.dtype) -> Any:
        host = to_numpy(v)
        vd = da.from_array(np.ascontiguousarray(host.astype(dtype, copy=False)),
                           chunks=(self.k.chunks[1], host.shape[1]))
        # partial products per tile (i, j): (rows_i, 1, k); summed over j
        parts = da.blockwise(_tile_product, "ijk", self.k, "ij", vd, "jk", dtype.str,
                             None, dtype=dtype, adjust_chunks={"j": 1}, concatenate=False,
                             meta=np.empty((0, 0, 0), dtype=dtype))
        return back_to_namespace(to_local(parts.sum(axis=1)), v)

    def matmat(self, v: Any) -> Any:
        return self._product(v, np.promote_types(self.dtype, to_numpy(v[:1]).dtype))

    def sketch(self, v: Any) -> Any:
        """:math:`K V` in the kernel's dtype (for building preconditioners)."""
        return self._product(v, np.dtype(self.dtype))

    def columns(self, idx: list[int], like: Any) -> Any:
        return back_to_namespace(to_local(self.k[:, list(idx)]), like)

    def diagonal(self, like: Any) -> Any:
        return back_to_namespace(to_local(da.diagonal(self.k)), like)


def _finite(block: np.ndarray, reg: float) -> np.ndarray:
    if not np.all(np.isfinite(block)):
        raise NotPositiveDefiniteError(
            f"k_train (+ reg={reg:g} I) is not numerically positive definite (the blocked "
            "Cholesky factor has non-finite entries); increase reg")
    return block


@capabilities(name="distributed.cholesky_regression",
              fast={"numpy": "dask.array.linalg.cholesky"},
              missing=("torch", "cupy", "jax", "array_api_strict"))
def cholesky_regression(
    k_train: Any,
    y_train: Any,
    k_test_train: Any = None,
    *,
    reg: float = 0.0,
    compute: bool = False,
) -> Any:
    r"""Kernel regression by blocked Cholesky on a dask kernel.

    Parameters
    ----------
    k_train : dask.array.Array (or array), shape (N, N)
        ``dask.array.linalg.cholesky`` needs equal square chunks: the kernel is rechunked to
        its first row chunk c on both axes and padded to a multiple of c with an identity
        block (which leaves the first N entries of the solution unchanged).
    y_train : array, shape (N,) or (N, k)
    k_test_train : dask.array.Array or array, shape (M, N), optional
        Without it the dual coefficients :math:`\alpha` are returned.
    reg : float
        Ridge :math:`\lambda \ge 0`.
    compute : bool, default False
        ``False``: a lazy dask array (as dask's own linear algebra; call ``.compute()``).
        ``True``: compute it and return a NumPy array.

    Returns
    -------
    dask.array.Array (or NumPy with ``compute=True``), shape (M,) / (M, k) predictions, or
    (N,) / (N, k) coefficients

    Raises
    ------
    NotPositiveDefiniteError
        ``K + reg I`` is not positive definite: the factor has non-finite values (at compute
        time), or, with ``compute=True``, a block factorisation failed (a lazy result raises
        dask's ``numpy.linalg.LinAlgError`` then).
    """
    k = _lazy(k_train)
    if k.ndim != 2 or k.shape[0] != k.shape[1]:
        raise ValueError(f"k_train must be square (N, N); got shape {tuple(k.shape)}")
    n = int(k.shape[0])
    reg = check_scalar(reg, "reg", nonnegative=True)
    y = _lazy(y_train)
    if y.shape[0] != n:
        raise ValueError(f"y_train has {y.shape[0]} rows but k_train is {n} x {n}")
    # dask's blocked Cholesky needs equal square chunks: pad K to a multiple of the chunk
    # with an identity block, [[K + reg I, 0], [0, I]], and y with zeros; alpha[:N] is exact
    c = int(k.chunks[0][0])
    pad = (-n) % c
    a = k + reg * da.eye(n, chunks=c, dtype=k.dtype) if reg else k
    yy = y
    if pad:
        zeros = da.zeros((n, pad), chunks=c, dtype=k.dtype)
        a = da.block([[a, zeros], [zeros.T, da.eye(pad, chunks=c, dtype=k.dtype)]])
        yy = da.concatenate([y, da.zeros((pad, *y.shape[1:]), dtype=y.dtype)], axis=0)
    lower = da.linalg.cholesky(a.rechunk((c, c)), lower=True)
    z = da.linalg.solve_triangular(lower, yy.rechunk((c, *yy.shape[1:])), lower=True)
    alpha = da.linalg.solve_triangular(lower.T, z, lower=False)[:n]
    out = alpha.map_blocks(_finite, reg, dtype=alpha.dtype)
    if k_test_train is not None:  # one graph: the factor is computed once
        out = _lazy(k_test_train) @ out
    if not compute:
        return out
    try:
        return np.asarray(out.compute())
    except np.linalg.LinAlgError as exc:  # a block factorisation failed on a worker
        raise NotPositiveDefiniteError(
            f"k_train (+ reg={reg:g} I) is not positive definite (blocked Cholesky: "
            f"{exc}); increase reg"
        ) from exc


# cg_solve and aslinearoperator take dask arrays through this adapter.
register_operator_adapter(array_api_compat.is_dask_array, DaskMatrixOperator, local=to_local)
