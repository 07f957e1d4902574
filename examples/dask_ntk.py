"""Scale-out eNTK demo: kernel tiles on a Dask LocalCluster, stored in Zarr, solved with CG.

    python examples/dask_ntk.py                       # N = 4,000 (about a minute on 2 cores)
    python examples/dask_ntk.py --n 40000 --chunk 4000 --store big.zarr   # the 6.4 GB kernel
    python examples/dask_ntk.py --quick               # N = 600, seconds (used by the tests)

Interrupt it during the kernel step and run it again: finished tiles are not recomputed.
For a multi-node cluster, pass its scheduler address: see docs/distributed.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import numpy as np
from distributed import Client, LocalCluster

import ntkcore
import ntkcore.distributed as nd
from ntkcore.models import MLP


def main(n: int = 4000, chunk: int = 1000, store: str = "ntk_demo.zarr") -> None:
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, memory_limit="3GiB",
                           silence_logs=logging.ERROR)
    client = Client(cluster)
    print("dashboard:", client.dashboard_link)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n + 500, 64)).astype(np.float32)
    y = np.tanh(x[:, :4].sum(axis=1)).astype(np.float64)
    x_train, x_test, y_train, y_test = x[:n], x[n:], y[:n], y[n:]
    net = MLP.random((64, 512, 512, 1), xp=np, seed=0, activation="tanh", dtype=np.float32)

    t0 = time.perf_counter()
    status = nd.ntk_to_zarr(net, x_train, store=store, chunks=chunk, client=client,
                            key=f"mlp-64-512-512-1 seed0 N={n}", progress=True)
    print(f"\nkernel: {status.tiles_done}/{status.tiles_total} tiles in "
          f"{time.perf_counter() - t0:.1f}s -> {store}")

    k_train = nd.read_zarr(store)                                    # lazy, chunked
    k_test = nd.ntk_dask(net, x_test, x_train, chunks=chunk)  # computed on the client above
    reg = 1e-2 * float(nd.DaskMatrixOperator(k_train).diagonal(y_train).mean())
    t0 = time.perf_counter()
    alpha, report = ntkcore.cg_solve(k_train, y_train, reg=reg, tol=1e-4, rank=200)
    print(report)
    pred = np.asarray((k_test @ alpha).compute())
    print(f"CG + predict {time.perf_counter() - t0:.1f}s; test RMSE "
          f"{np.sqrt(np.mean((pred - y_test) ** 2)):.3f} (targets have std "
          f"{y_test.std():.3f})")
    client.close()
    cluster.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000, help="number of training inputs")
    parser.add_argument("--chunk", type=int, default=1000, help="samples per kernel tile side")
    parser.add_argument("--store", default=None,
                        help="Zarr store path (default: a fresh temporary directory)")
    parser.add_argument("--quick", action="store_true", help="N = 600, chunk 300")
    args = parser.parse_args()
    if args.quick:
        args.n, args.chunk = 600, 300
    with tempfile.TemporaryDirectory() as tmp:
        main(args.n, args.chunk, args.store or os.path.join(tmp, "ntk_demo.zarr"))
