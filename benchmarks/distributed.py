r"""Scale-out (``ntkcore.distributed``): the trace eNTK of an MLP written to Zarr by a Dask
LocalCluster, then conjugate gradients on the stored kernel through ``ZarrMatrixOperator``.
Skipped where dask.distributed or zarr is missing.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

import numpy as np

WIDTHS = (64, 512, 512, 1)
CHUNK, RANK, TOL = 1000, 100, 1e-4


def problem(n: int) -> tuple[Any, np.ndarray, np.ndarray]:
    r"""The MLP (64-512-512-1, tanh, float32, seed 0), N Gaussian inputs and the targets
    :math:`y = \tanh(\sum_{i<4} x_i)` (float64)."""
    from ntkcore.models import MLP

    x = np.random.default_rng(0).standard_normal((n, WIDTHS[0])).astype(np.float32)
    y = np.tanh(x[:, :4].sum(axis=1, keepdims=True)).astype(np.float64)
    return MLP.random(WIDTHS, xp=np, seed=0, activation="tanh", dtype=np.float32), x, y


def start(workers: int) -> tuple[Any, Any]:
    """A LocalCluster of ``workers`` processes (one thread, 3 GiB, one-thread BLAS each) and its
    client; ``NotImplementedError`` where dask.distributed or zarr is missing."""
    try:
        import zarr  # noqa: F401
        from distributed import Client, LocalCluster
    except ImportError as exc:
        raise NotImplementedError(f"{exc.name} is not installed") from exc
    one = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                           memory_limit="3GiB", dashboard_address=None,
                           silence_logs=logging.ERROR, env=one)
    return cluster, Client(cluster)


class Distributed:
    """The trace eNTK of N inputs written to Zarr (tiles of 1,000), then CG on it, by a
    LocalCluster of 1 or 2 workers.

    CG: Nystrom preconditioner of rank 100, ``reg = 1e-2 mean(diag K)``, tol 1e-4, float64
    products of the float32 kernel (the client's BLAS on one thread; the kernel is never
    gathered).
    """

    params = ([4000], [1, 2])
    param_names = ("N", "workers")
    number, repeat, warmup_time, rounds, timeout = 1, 1, 0, 1, 600

    def setup_cache(self) -> dict[int, str]:  # one store per N, for the CG benchmarks
        import ntkcore.distributed as nd

        cluster, client = start(2)
        try:
            out = {}
            for n in self.params[0]:
                net, x, _ = problem(n)
                out[n] = os.path.abspath(f"k{n}.zarr")
                nd.ntk_to_zarr(net, x, store=out[n], chunks=CHUNK, client=client)
            return out
        finally:
            client.close()
            cluster.close()

    def setup(self, stores: dict, n: int, workers: int) -> None:
        self.net, self.x, self.y = problem(n)
        self.stored = stores[n]
        self.root = tempfile.mkdtemp(prefix="ntkcore-dist-")
        self.cluster, self.client = start(workers)
        self.writes = 0

    def teardown(self, *_: Any) -> None:
        self.client.close()
        self.cluster.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def write(self) -> Any:
        import ntkcore.distributed as nd

        self.writes += 1
        store = os.path.join(self.root, f"k{self.writes}.zarr")
        return nd.ntk_to_zarr(self.net, self.x, store=store, chunks=CHUNK, client=self.client)

    def solve(self) -> Any:
        """CG on the stored kernel; its report."""
        from threadpoolctl import threadpool_limits

        import ntkcore
        import ntkcore.distributed as nd

        op = nd.ZarrMatrixOperator(self.stored, client=self.client)
        with threadpool_limits(1):
            reg = 1e-2 * float(np.mean(op.diagonal(np.zeros(1, np.float64))))
            return ntkcore.cg_solve(op, self.y, reg=reg, tol=TOL, rank=RANK, maxiter=1000,
                                    warn=False)[1]

    def time_ntk_to_zarr(self, *_: Any) -> None:
        self.write()

    def track_worker_peak_memory(self, *_: Any) -> float:
        """The largest worker's peak resident set (``ru_maxrss``, Linux) after writing."""
        import resource

        self.write()
        peak = self.client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return 1024.0 * max(peak.values())

    track_worker_peak_memory.unit = "bytes"  # type: ignore[attr-defined]

    def time_cg(self, *_: Any) -> None:
        self.solve()

    def track_error(self, *_: Any) -> float:
        """CG's final true relative residual."""
        return float(self.solve().max_residual)

    track_error.unit = "relative"  # type: ignore[attr-defined]
