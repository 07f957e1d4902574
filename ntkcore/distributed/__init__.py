"""Scale-out eNTK: kernel tiles as Dask tasks, kernels stored in Zarr, solvers for kernels that
do not fit one machine.

This is the application layer of ntkcore (it imports dask, distributed and zarr; install them
with ``pip install ntkcore[dask]``).  The in-memory engine does the arithmetic: each Dask task
computes the structured Jacobian of one chunk of samples with the model's provider, and each
kernel tile contracts two such chunks with :func:`ntkcore.gram`.

* :func:`ntk_dask` -- a lazy ``dask.array`` of the kernel (tiles computed once; a symmetric
  kernel computes each off-diagonal tile once and mirrors it).
* :func:`to_zarr` / :func:`ntk_to_zarr` / :func:`read_zarr` / :func:`zarr_status` -- chunked
  storage with per-tile completion markers, so an interrupted run resumes without recomputing
  finished tiles; a store records a fingerprint of its computation (a resume with another
  model, inputs or options is refused), a size and CRC-32 per tile (a torn tile is reported
  and recomputed), and ntkcore never writes into or deletes a directory that is not its store.
* :func:`cholesky_regression` -- blocked Cholesky (``dask.array.linalg``) on a dask kernel.
* :class:`DaskMatrixOperator` -- lets :func:`ntkcore.cg_solve` and
  ``kernel_regression(..., solver="cg")`` use a dask kernel through products only.
* :class:`ZarrMatrixOperator` -- products with a kernel stored in Zarr, a few tasks per
  worker reading each tile once (the upper triangle of a symmetric kernel); used
  automatically for an array from :func:`read_zarr`.
* :func:`get_client` -- the client used when none is given (a ``LocalCluster`` is started on
  first use).

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
from ._zarr import ZarrStatus, ntk_to_zarr, read_zarr, to_zarr, zarr_status
from ._zarrop import ZarrMatrixOperator

__all__ = [
    "DaskMatrixOperator",
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
