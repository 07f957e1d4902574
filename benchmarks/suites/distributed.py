r"""Scale-out: the trace eNTK of an MLP on a LocalCluster, written to Zarr, then CG regression.

Cases (``n`` = N samples, ``w`` = workers)
------------------------------------------
``ntk_to_zarr N=<n> workers=<w>``
    :func:`ntkcore.distributed.ntk_to_zarr` of an :class:`ntkcore.models.MLP`
    (widths 64-512-512-1, tanh, float32, NTK parameterisation) on N Gaussian inputs, tiles of
    ``chunk`` samples, to an uncompressed Zarr store; time, peak RSS per worker (sampled), and
    the kernel size.  Flops: :math:`N^2/2 \cdot \sum_l 2(d_{in,l} + d_{out,l})` (the two Gram
    matrices per dense layer, upper triangle).
``cg N=<n> workers=<w>``
    ``kernel_regression(..., solver="cg")`` reading the kernel from Zarr (one pass over the
    store per iteration), Nystrom preconditioner of rank 200, ``reg = 1e-2 mean(diag K)``,
    tol 1e-4; the CG iteration count and the relative residual are reported.

``--quick``: N = 1,000, chunk 500, 2 workers only (tens of seconds, mostly cluster start-up
and per-product Dask overhead).  Full run (the issue's target, run by the lead on a quiet
machine): N = 40,000 (6.4 GB kernel in float32), chunk 4,000,
1 and 2 workers with 3 GiB memory limits each (``-x n=40000 -x chunk=4000`` override).
Expected on 2 cores: about 1-3 min for the kernel per worker setting and 2-6 min of CG
(each iteration streams 6.4 GB from the page cache or disk), so roughly 10-20 min in all.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import numpy as np

from benchmarks._harness import Config, row

SUITE = "distributed"
WIDTHS = (64, 512, 512, 1)


def _flops_kernel(n: int) -> float:
    per_pair = sum(2 * (a + 1 + b) for a, b in itertools.pairwise(WIDTHS))
    return n * n / 2 * per_pair


class _PeakSampler:
    """Peak RSS of every worker process, sampled on the workers every 0.2 s."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import psutil

        def rss() -> int:
            return psutil.Process().memory_info().rss

        while not self._stop.is_set():
            try:
                for addr, v in self.client.run(rss).items():
                    self.peak[addr] = max(self.peak.get(addr, 0), int(v))
            except Exception:
                pass
            self._stop.wait(0.2)

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def run(cfg: Config) -> list[dict[str, Any]]:
    from distributed import Client, LocalCluster

    import ntkcore
    import ntkcore.distributed as nd
    from ntkcore.models import MLP

    n = int(cfg.extra.get("n", 1000 if cfg.quick else 40000))
    chunk = int(cfg.extra.get("chunk", 500 if cfg.quick else 4000))
    worker_counts = (2,) if cfg.quick else (1, 2)
    mem = str(cfg.extra.get("memory_limit", "3GiB"))
    rank = int(cfg.extra.get("rank", 100 if cfg.quick else 200))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, WIDTHS[0])).astype(np.float32)
    y = np.tanh(x[:, :4].sum(axis=1, keepdims=True)).astype(np.float32)
    net = MLP.random(WIDTHS, xp=np, seed=0, activation="tanh", dtype=np.float32)
    rows: list[dict[str, Any]] = []
    root = tempfile.mkdtemp(prefix="ntkcore-dist-")
    try:
        for workers in worker_counts:
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                   memory_limit=mem, dashboard_address=None,
                                   silence_logs=logging.ERROR,
                                   env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                        "OPENBLAS_NUM_THREADS": "1"})
            client = Client(cluster)
            store = os.path.join(root, f"k{workers}.zarr")
            params = {"n": n, "chunk": chunk, "workers": workers, "memory_limit": mem,
                      "widths": list(WIDTHS)}
            try:
                with _PeakSampler(client) as sampler:
                    t0 = time.perf_counter()
                    status = nd.ntk_to_zarr(net, x, store=store, chunk=chunk, client=client)
                    t_kernel = time.perf_counter() - t0
                peak = max(sampler.peak.values()) if sampler.peak else None
                rows.append(row(SUITE, f"ntk_to_zarr N={n} workers={workers}", "ntkcore",
                                backend="numpy", device="cpu", dtype="float32",
                                timing={"median_s": t_kernel, "min_s": t_kernel,
                                        "max_s": t_kernel, "repeats": 1},
                                params={**params, "tiles": status.tiles_total,
                                        "kernel_bytes": n * n * 4},
                                peak_mem_bytes=peak, flops=_flops_kernel(n),
                                note="peak_mem_bytes = largest worker RSS"))
                k = nd.read_zarr(store)
                diag = np.asarray(nd.DaskMatrixOperator(k).diagonal(np.zeros(1, np.float64)))
                reg = 1e-2 * float(diag.mean())
                with _PeakSampler(client) as sampler:
                    t0 = time.perf_counter()
                    _alpha, report = ntkcore.cg_solve(k, y.astype(np.float64), reg=reg,
                                                     tol=1e-4, rank=rank, maxiter=500,
                                                     warn=False)
                    t_cg = time.perf_counter() - t0
                peak = max(sampler.peak.values()) if sampler.peak else None
                rows.append(row(SUITE, f"cg N={n} workers={workers}", "ntkcore",
                                backend="numpy", device="cpu", dtype="float32",
                                timing={"median_s": t_cg, "min_s": t_cg, "max_s": t_cg,
                                        "repeats": 1},
                                params={**params, "rank": rank, "reg": reg,
                                        "iterations": report.iterations,
                                        "converged": report.converged,
                                        "setup_s": report.setup_seconds},
                                peak_mem_bytes=peak, error=report.max_residual,
                                note="error = final relative residual"))
            finally:
                client.close()
                cluster.close()
                shutil.rmtree(store, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows
