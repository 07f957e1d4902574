"""Scale-out eNTK: kernel tiles as Dask tasks, kernels stored in Zarr, solvers for kernels that
do not fit one machine.

This is the application layer of ntkcore (it imports dask, distributed and zarr; install them
with ``pip install ntkcore[dask]``).  The in-memory engine does the arithmetic: each Dask task
computes the structured Jacobian of one chunk of samples with the model's provider, and each
kernel tile contracts two such chunks with :func:`ntkcore.gram`.

* :func:`ntk_dask` -- a lazy ``dask.array`` of the kernel (building it starts no cluster
  and does not call the model; a symmetric kernel computes each off-diagonal tile once).
* :func:`to_zarr` / :func:`ntk_to_zarr` / :func:`read_zarr` / :func:`zarr_status` --
  resumable storage in a directory or any Zarr store, with the guarantees of :func:`to_zarr`.
* :func:`cholesky_regression` -- blocked Cholesky (``dask.array.linalg``), lazy by default.
* :class:`DaskMatrixOperator` / :class:`ZarrMatrixOperator` -- products with a dask kernel or
  a stored one for :func:`ntkcore.cg_solve` (the latter used for an array from
  :func:`read_zarr`: a few tasks per worker read each tile once).
* :func:`get_client` -- a client (a ``LocalCluster`` started on first use).  Work runs on the
  ``client=`` you pass, otherwise where dask computes: the last ``Client`` you created, or
  dask's default scheduler.

See ``docs/distributed.md`` for a multi-node cluster.
"""

from __future__ import annotations

try:
    import dask
    import dask.array  # noqa: F401
    import distributed  # noqa: F401
    import zarr  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is installed in CI
    raise ImportError(
        "ntkcore.distributed needs dask[array], distributed and zarr; install them with "
        f"`pip install ntkcore[dask]` ({exc})"
    ) from exc

from ._cluster import get_client
from ._ntk import ntk_dask
from ._solve import DaskMatrixOperator, cholesky_regression, to_local
from ._zarr import StoreLockedError as StoreLockedError  # public; see to_zarr
from ._zarr import ZarrStatus, ntk_to_zarr, read_zarr, to_zarr, zarr_status
from ._zarrop import ZarrMatrixOperator

__all__ = [
    "DaskMatrixOperator",
    "StoreLockedError",
    "ZarrMatrixOperator",
    "ZarrStatus",
    "cholesky_regression",
    "get_client",
    "ntk_dask",
    "ntk_to_zarr",
    "read_zarr",
    "to_local",
    "to_zarr",
    "zarr_status",
]
