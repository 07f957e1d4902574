r"""Scale-out: the trace eNTK of an MLP on a LocalCluster, written to Zarr, then CG regression.

Cases (``n`` = N samples, ``w`` = workers; one LocalCluster of w processes, one thread and
``memory_limit`` each, per worker count)
------------------------------------------------------------------------------------------
``ntk_to_zarr N=<n> workers=<w>``
    :func:`ntkcore.distributed.ntk_to_zarr` of an :class:`ntkcore.models.MLP`
    (widths 64-512-512-1, tanh, float32, NTK parameterisation) on N Gaussian inputs, tiles of
    ``chunk`` samples, to an uncompressed Zarr store marked symmetric; time, peak RSS per
    worker (sampled every 0.2 s; the row's peak memory is the largest worker's), kernel size.
    Flops: :math:`N^2/2 \cdot \sum_l 2(d_{in,l} + 1 + d_{out,l})` (upper triangle).
``cg N=<n> workers=<w>``
    :func:`ntkcore.cg_solve` on :class:`ntkcore.distributed.ZarrMatrixOperator` (each
    product: a few tasks per worker memory-mapping the upper triangle of tiles from the
    store, float64 products of the float32 kernel), Nystrom preconditioner of rank ``rank``
    (its sketch in float32), ``reg = 1e-2 mean(diag K)``, tol 1e-4.  The note gives the CG
    iterations, products and the client's peak RSS (the kernel is never gathered anywhere);
    ``error`` is the final true relative residual.  The client's BLAS is limited to one
    thread (the workers own the cores; an oversubscribed OpenBLAS is several times slower).

Options (``--set key=value``): ``n``, ``chunk``, ``rank``, ``workers`` (e.g. ``1,2``),
``memory_limit`` (default ``3GiB``), ``tol``, ``dir`` (where the store goes; default a
temporary directory, which needs ~N^2 x 4 bytes free, 6.4 GB at N = 40,000).

``--quick``: N = 1,000, chunk 500, 2 workers only (tens of seconds, mostly cluster start-up).
Full run (the issue's target; run by the lead on a quiet 2-core machine): N = 40,000 (6.4 GB
kernel in float32), chunk 4,000, rank 500, 1 and 2 workers with 3 GiB memory limits::

    python -m benchmarks --suite distributed --suite-timeout 0 --total-budget 0 \
        --out benchmarks/results/cpu-distributed.json

Expected on 2 quiet cores (extrapolated from N = 10,000 and 20,000, see docs/distributed.md):
kernel about 1.5-2 min with 1 worker and 1 min with 2; CG (about 80 iterations, each
reading 3.5 GB of tiles from the page cache) about 3-4 min with 1 worker and 2 min with 2;
roughly 8-10 min in all, cluster start-up included (up to ~25 min on a machine as loaded
as the one the extrapolation came from).  Worker peak RSS about 0.6-0.7 GiB.  Give the
suite no timeout (``--suite-timeout 0 --total-budget 0``): the default 420 s would stop it.
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


def _client_peak() -> int:
    """Peak RSS of this (client) process so far, in bytes (Linux: ru_maxrss is in KiB)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def run(cfg: Config) -> list[dict[str, Any]]:
    from distributed import Client, LocalCluster
    from threadpoolctl import threadpool_limits

    import ntkcore
    import ntkcore.distributed as nd
    from ntkcore.models import MLP

    n = int(cfg.extra.get("n", 1000 if cfg.quick else 40000))
    chunk = int(cfg.extra.get("chunk", 500 if cfg.quick else 4000))
    workers_opt = str(cfg.extra.get("workers", "2" if cfg.quick else "1,2"))
    worker_counts = tuple(int(w) for w in workers_opt.split(",") if w.strip())
    mem = str(cfg.extra.get("memory_limit", "3GiB"))
    rank = int(cfg.extra.get("rank", 100 if cfg.quick else 500))
    tol = float(cfg.extra.get("tol", 1e-4))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, WIDTHS[0])).astype(np.float32)
    y = np.tanh(x[:, :4].sum(axis=1, keepdims=True)).astype(np.float64)
    net = MLP.random(WIDTHS, xp=np, seed=0, activation="tanh", dtype=np.float32)
    rows: list[dict[str, Any]] = []
    root = tempfile.mkdtemp(prefix="ntkcore-dist-", dir=cfg.extra.get("dir"))
    limit_bytes = _parse_bytes(mem)
    target = f"peak_mem_bytes < {limit_bytes}" if limit_bytes else None
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
                    status = nd.ntk_to_zarr(net, x, store=store, chunks=chunk, client=client)
                    t_kernel = time.perf_counter() - t0
                peak = max(sampler.peak.values()) if sampler.peak else None
                rows.append(row(SUITE, f"ntk_to_zarr N={n} workers={workers}", "ntkcore",
                                backend="numpy", device="cpu", dtype="float32",
                                timing={"median_s": t_kernel, "min_s": t_kernel,
                                        "max_s": t_kernel, "repeats": 1},
                                params={**params, "tiles": status.tiles_total,
                                        "kernel_bytes": n * n * 4,
                                        "worker_peaks": sorted(sampler.peak.values())},
                                peak_mem_bytes=peak, flops=_flops_kernel(n), target=target,
                                note=f"{workers} worker(s); {n * n * 4 / 1e9:.2g} GB kernel "
                                     f"in {status.tiles_total} tiles; peak memory = largest "
                                     "worker RSS"))
                op = nd.ZarrMatrixOperator(store, client=client)
                with threadpool_limits(1), _PeakSampler(client) as sampler:
                    client_before = _client_peak()
                    t0 = time.perf_counter()
                    diag = np.asarray(op.diagonal(np.zeros(1, np.float64)))
                    reg = 1e-2 * float(diag.mean())
                    _alpha, report = ntkcore.cg_solve(op, y, reg=reg, tol=tol, rank=rank,
                                                     maxiter=1000, warn=False)
                    t_cg = time.perf_counter() - t0
                    client_peak = max(client_before, _client_peak())
                peak = max(sampler.peak.values()) if sampler.peak else None
                state = "converged" if report.converged else "NOT converged"
                rows.append(row(SUITE, f"cg N={n} workers={workers}", "ntkcore",
                                backend="numpy", device="cpu", dtype="float32",
                                timing={"median_s": t_cg, "min_s": t_cg, "max_s": t_cg,
                                        "repeats": 1},
                                params={**params, "rank": rank, "reg": reg, "tol": tol,
                                        "iterations": report.iterations,
                                        "converged": report.converged,
                                        "products": op.products,
                                        "setup_s": report.setup_seconds,
                                        "solve_s": report.solve_seconds,
                                        "symmetric": op.symmetric, "raw": op.raw,
                                        "client_rss_bytes": client_peak,
                                        "worker_peaks": sorted(sampler.peak.values())},
                                peak_mem_bytes=peak, error=report.max_residual, target=target,
                                note=f"{workers} worker(s); CG {state} in "
                                     f"{report.iterations} iterations (Nystrom rank {rank}, "
                                     f"setup {report.setup_seconds:.0f} s); client RSS "
                                     f"{client_peak / 2**30:.2f} GiB; error = final "
                                     "relative residual"))
            finally:
                client.close()
                cluster.close()
                shutil.rmtree(store, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _parse_bytes(text: str) -> int | None:
    try:
        from dask.utils import parse_bytes

        return int(parse_bytes(text))
    except Exception:
        return None
