"""ntkcore.distributed on a 2-process LocalCluster: ntk_dask == ntk, Zarr round-trip and resume,
blocked Cholesky and CG on dask kernels, and a worker killed mid-run."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import numpy as np
import pytest

pytest.importorskip("dask")
pytest.importorskip("distributed")
pytest.importorskip("zarr")

import cloudpickle
import dask.array as da
from distributed import Client, LocalCluster, get_task_stream

import ntkcore
import ntkcore.distributed as nd
from ntkcore.models import MLP
from ntkcore.providers import register_provider
from tests.tolerances import gamma, kernel_tol

# test-only models and providers travel to the worker processes by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def client():
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           memory_limit="1GiB", dashboard_address=None,
                           silence_logs=logging.ERROR)
    c = Client(cluster)
    yield c
    c.close()
    cluster.close()


@pytest.fixture(scope="module")
def net():
    return MLP.random((3, 16, 16, 2), xp=np, seed=0, activation="tanh")


def kernel_bound(net, ref, computations=2):
    """How far two computations of an eNTK of ``net`` may differ, entry by entry
    (tests/tolerances.py): an entry sums at most O P products (trace mode; P in the others),
    bounded by ``max |K|`` (Cauchy-Schwarz), whatever the order of the sums; each Jacobian
    entry adds, to first order, the fan-ins (forward) and fan-outs (backward) of the layers.
    Tiles of one size against another, or against one product, are such two computations."""
    n = net.num_outputs * net.num_params + 2 * sum(net.widths)
    return kernel_tol(ref.dtype, n, computations) * np.max(np.abs(ref))


def torch_kernel_bound(model, ref):
    """:func:`kernel_bound` for a torch ``Sequential`` of ``Linear`` layers."""
    lin = [m for m in model if hasattr(m, "in_features")]
    n = lin[-1].out_features * sum(q.numel() for q in model.parameters()) + 2 * (
        sum(m.in_features for m in lin) + lin[-1].out_features)
    return kernel_tol(np.float64, n, computations=2) * np.max(np.abs(ref))


def assert_product_close(got, k, v):
    """``got`` is ``k @ v`` for float64 ``k`` and ``v``, summed in any order (tile by tile):
    two sums of n terms differ by at most ``2 gamma_n |k| |v|``, entry by entry."""
    bound = kernel_tol(np.float64, k.shape[1], computations=2) * (np.abs(k) @ np.abs(v))
    assert np.all(np.abs(np.asarray(got) - k @ v) <= bound)


def dense_reference(net, x1, x2, mode):
    """Independent float64 reference: dense Jacobians and einsum."""
    d1 = net.jacobian(x1).to_dense()
    d2 = d1 if x2 is None else net.jacobian(x2).to_dense()
    full = np.einsum("nop,mqp->nmoq", d1, d2)
    if mode == "full":
        return full
    if mode == "trace":
        return np.einsum("nmoo->nm", full)
    return np.einsum("nmoo->nmo", full)


@pytest.mark.parametrize("mode", ["trace", "full", "diagonal"])
@pytest.mark.parametrize("with_x2", [False, True])
def test_ntk_dask_matches_dense(client, net, mode, with_x2):
    rng = np.random.default_rng(1)
    x1 = rng.standard_normal((23, 3))
    x2 = rng.standard_normal((10, 3)) if with_x2 else None
    k = nd.ntk_dask(net, x1, x2, mode=mode, chunks=7)  # 7 does not divide 23
    assert isinstance(k, da.Array)
    assert k.chunks[0] == (7, 7, 7, 2)
    got = k.compute()
    ref = dense_reference(net, x1, x2, mode)
    assert got.shape == ref.shape
    # 7 x 7 tiles against one product: equal to rounding only (docs/reliability.md)
    np.testing.assert_allclose(got, ref, rtol=0, atol=kernel_bound(net, ref))
    np.testing.assert_allclose(got, np.asarray(ntkcore.ntk(net, x1, x2, mode=mode)),
                               rtol=0, atol=kernel_bound(net, ref))


def test_symmetric_kernel_computes_each_tile_once(client, net):
    x = np.random.default_rng(2).standard_normal((20, 3))
    k = nd.ntk_dask(net, x, chunks=5)
    names = [key[0] if isinstance(key, tuple) else key for key in dict(k.__dask_graph__())]
    n_tiles = sum(1 for name in names if str(name).startswith("_tile_task"))
    n_jac = sum(1 for name in names if str(name).startswith("_remote_jacobian_task"))
    assert n_tiles == 4 * 5 // 2  # upper triangle of a 4 x 4 tile grid
    assert n_jac == 4
    got = k.compute()
    np.testing.assert_array_equal(got, got.T)


@pytest.mark.slow
def test_torch_model(client):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = model.double()
    x = torch.randn(13, 3, dtype=torch.float64)
    k = nd.ntk_dask(model, x, chunks=6).compute()
    # independent reference: autograd Jacobian rows
    params = list(model.parameters())
    rows = []
    for n in range(13):
        for o in range(2):
            grads = torch.autograd.grad(model(x[n:n + 1])[0, o], params)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    jd = torch.stack(rows).reshape(13, 2, -1).numpy()
    ref = np.einsum("nop,mop->nm", jd, jd)
    np.testing.assert_allclose(k, ref, rtol=0, atol=torch_kernel_bound(model, ref))


def test_chunk_too_big_for_worker(client, net):
    x = np.zeros((100_000, 3))
    k = nd.ntk_dask(net, x, chunks=50_000)  # checked where the tiles run: on the workers
    with pytest.raises(ValueError, match=r"chunks=50000 needs about .* use chunks <="):
        k.compute()


def test_bad_arguments(client, net):
    x = np.zeros((5, 3))
    with pytest.raises(ValueError, match="mode"):
        nd.ntk_dask(net, x, mode="pseudo")
    with pytest.raises(ValueError, match="chunk"):
        nd.ntk_dask(net, x, chunks=0)
    with pytest.raises(ValueError, match="x2 samples have"):
        nd.ntk_dask(net, x, np.zeros((5, 4)))
    with pytest.raises(TypeError, match="client"):
        nd.get_client(3)
    with pytest.raises(TypeError, match="no Jacobian provider"):
        nd.ntk_dask(object(), x)


def test_zarr_round_trip_and_resume(client, net, tmp_path):
    x = np.random.default_rng(3).standard_normal((22, 3))
    store = tmp_path / "k.zarr"
    ref = dense_reference(net, x, None, "trace")
    k = nd.ntk_dask(net, x, chunks=6)  # 4 x 4 tiles, last ones partial
    seen = []
    status = nd.to_zarr(k, store, client=client, key="mlp-x3",
                        progress=lambda d, t: seen.append((d, t)))
    assert status.complete and status.tiles_total == 16
    assert seen[-1] == (16, 16)
    back = nd.read_zarr(store)
    assert back.chunks == k.chunks
    tol = kernel_bound(net, ref)
    first = back.compute()
    np.testing.assert_allclose(first, ref, rtol=0, atol=tol)

    # simulate an interrupted run: unmark 3 tiles and scribble over them
    import zarr

    done = zarr.open_array(store=str(store), path="done", mode="r+")
    kern = zarr.open_array(store=str(store), path="kernel", mode="r+")
    for i, j in [(0, 0), (1, 3), (3, 2)]:
        done[i, j] = 0
        kern[i * 6:(i + 1) * 6, j * 6:(j + 1) * 6] = -1.0
    status = nd.zarr_status(store)
    assert (status.tiles_done, status.complete) == (13, False)
    with pytest.raises(ValueError, match="incomplete"):
        nd.read_zarr(store)
    # a finished tile that is NOT marked missing must not be recomputed: poison one
    kern[6:12, 0:6] = 7.0
    seen.clear()
    status = nd.ntk_to_zarr(net, x, store=store, chunks=6, client=client, key="mlp-x3",
                            progress=lambda d, t: seen.append((d, t)))
    assert status.complete
    assert seen[-1] == (3, 3)  # only the three missing tiles were computed
    got = nd.read_zarr(store).compute()
    np.testing.assert_array_equal(got[6:12, 0:6], 7.0)  # untouched
    mask = np.ones_like(ref, dtype=bool)
    mask[6:12, 0:6] = False
    np.testing.assert_allclose(got[mask], ref[mask], rtol=0, atol=tol)
    # the recomputed tiles are the first run's, bit for bit (same tasks, same workers)
    assert got[mask].tobytes() == first[mask].tobytes()

    with pytest.raises(ValueError, match="different kernel"):
        nd.ntk_to_zarr(net, x, store=store, chunks=5, client=client, key="mlp-x3")
    with pytest.raises(ValueError, match="different kernel"):
        nd.ntk_to_zarr(net, x, store=store, chunks=6, client=client, key="other")
    status = nd.ntk_to_zarr(net, x, store=store, chunks=6, client=client, key="other",
                            overwrite=True)
    np.testing.assert_allclose(nd.read_zarr(store).compute(), ref, rtol=0, atol=tol)
    with pytest.raises(FileNotFoundError):
        nd.zarr_status(tmp_path / "missing.zarr")


# ---------------------------------------------------------------------------------------------
# what a resumed store promises (docs/reliability.md): the uninterrupted run's store bit for
# bit, by construction; against the in-memory ntk, equality to rounding only
# ---------------------------------------------------------------------------------------------
def _write_interrupted(monkeypatch, k, *args, **kwargs):
    """``ntk_to_zarr(*args, **kwargs)`` that dies after writing k tiles."""
    from ntkcore.distributed import _zarr

    real, calls = _zarr._write_tile, []

    def write(*a, **kw):
        calls.append(1)
        if len(calls) > k:
            raise RuntimeError("simulated interruption")
        return real(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(_zarr, "_write_tile", write)
        with pytest.raises(RuntimeError, match="simulated interruption"):
            nd.ntk_to_zarr(*args, **kwargs)


def _lose_markers(store, tiles):
    """Tiles whose data was written but whose marker was lost (a crash in between): unmarked,
    and their data scribbled over, so that a resume must recompute them."""
    import zarr

    done = zarr.open_array(store=str(store), path="done", mode="r+")
    kern = zarr.open_array(store=str(store), path="kernel", mode="r+")
    for tile in tiles:
        idx = tile + (0,) * (done.ndim - len(tile))
        assert done[idx] == 1
        done[idx] = 0
        kern[tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, kern.chunks, strict=True))] = -1


def _torch_net():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 2)).double()


@pytest.mark.exactness
@pytest.mark.parametrize(("model", "mode", "with_x2", "dtype"), [
    ("mlp", "trace", False, np.float64), ("mlp", "full", False, np.float64),
    ("mlp", "trace", True, np.float64), ("mlp", "diagonal", False, np.float32),
    ("torch", "trace", False, np.float64)])
def test_resumed_store_equals_uninterrupted_run_bit_for_bit(monkeypatch, tmp_path, model, mode,
                                                            with_x2, dtype):
    """A store finished by resumes holds the bits of an uninterrupted run's store: each tile
    is the same task on the same Jacobian chunks with the same budget in both runs, and tiles
    already written are kept as written.  Both runs compute here, one tile after another
    (dask's synchronous scheduler), so that a torch model's products are the perturbed ones
    of an exactness test (tests/perturbed_products.py) in both.  Against the in-memory
    ``ntk`` (one product, not 6 x 6 tiles) the store agrees to rounding only."""
    import dask

    rng = np.random.default_rng(21)
    x = rng.standard_normal((22, 3)).astype(dtype)
    x2 = rng.standard_normal((9, 3)).astype(dtype) if with_x2 else None
    if model == "torch":
        import torch

        net, x = _torch_net(), torch.from_numpy(x)
    else:
        net = MLP.random((3, 16, 16, 2), xp=np, seed=0, activation="tanh", dtype=dtype)
    options = {"mode": mode, "chunks": 6}
    whole, resumed = tmp_path / "whole.zarr", tmp_path / "resumed.zarr"
    with dask.config.set(scheduler="synchronous"):
        assert nd.ntk_to_zarr(net, x, x2, store=whole, **options).complete
        _write_interrupted(monkeypatch, 5, net, x, x2, store=resumed, **options)
        assert nd.zarr_status(resumed).tiles_done == 5
        assert nd.ntk_to_zarr(net, x, x2, store=resumed, **options).complete
        # a second crash: two more tiles lost, one on the diagonal, one whose mirror is kept
        _lose_markers(resumed, [(0, 0), (0, 1)])
        seen = []
        status = nd.ntk_to_zarr(net, x, x2, store=resumed, **options,
                                progress=lambda d, t: seen.append((d, t)))
        assert status.complete and seen[-1] == (2, 2)
    a, b = nd.read_zarr(whole).compute(), nd.read_zarr(resumed).compute()
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()

    ref = np.asarray(ntkcore.ntk(net, x, x2, mode=mode))
    bound = torch_kernel_bound(net, ref) if model == "torch" else kernel_bound(net, ref)
    np.testing.assert_allclose(b, ref, rtol=0, atol=bound)


def regression_problem(net, n=30, m=5, seed=4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n + m, 3))
    k_all = dense_reference(net, x, None, "trace")
    y = rng.standard_normal((n, 2))
    return x[:n], x[n:], k_all[:n, :n], k_all[n:, :n], y


def test_blocked_cholesky_regression(client, net):
    xtr, xte, k, ks, y = regression_problem(net)
    reg = 1e-3
    ref = ks @ np.linalg.solve(k + reg * np.eye(len(k)), y)
    kd = nd.ntk_dask(net, xtr, chunks=8)
    kt = nd.ntk_dask(net, xte, xtr, chunks=8)
    pred = nd.cholesky_regression(kd, y, kt, reg=reg, compute=True)
    np.testing.assert_allclose(pred, ref, rtol=1e-7, atol=1e-9)
    alpha = nd.cholesky_regression(kd, y[:, 0], reg=reg, compute=True)
    np.testing.assert_allclose(alpha, np.linalg.solve(k + reg * np.eye(len(k)), y[:, 0]),
                               rtol=1e-7, atol=1e-7)
    lazy = nd.cholesky_regression(kd, y, kt, reg=reg)  # lazy by default, as dask's linalg
    assert isinstance(lazy, da.Array)
    np.testing.assert_allclose(lazy.compute(), ref, rtol=1e-7, atol=1e-9)
    # indefinite matrix: clear error
    bad = da.from_array(-np.eye(12), chunks=4)
    with pytest.raises(ntkcore.NotPositiveDefiniteError):
        nd.cholesky_regression(bad, np.ones(12), compute=True)


def test_cg_on_dask_kernel(client, net, tmp_path):
    # every CG product is one Dask computation: keep the iteration count tiny
    xtr, xte, k, ks, y = regression_problem(net, n=16, m=3)
    reg = 0.1
    ref = ks @ np.linalg.solve(k + reg * np.eye(len(k)), y)
    nd.ntk_to_zarr(net, xtr, store=tmp_path / "k.zarr", chunks=8, client=client)
    kd = nd.read_zarr(tmp_path / "k.zarr")
    kt = nd.ntk_dask(net, xte, xtr, chunks=8)
    for pc, rank in (("nystrom", 16), ("pivoted_cholesky", 6)):
        pred = ntkcore.kernel_regression(kd, y, kt, reg=reg, solver="cg", tol=1e-10,
                                         rank=rank, preconditioner=pc)
        assert isinstance(pred, da.Array)  # a dask k_test_train gives a lazy result
        np.testing.assert_allclose(pred.compute(), ref, rtol=1e-6, atol=1e-8)
    torch = pytest.importorskip("torch")
    alpha_t, report = ntkcore.cg_solve(kd, da.from_array(torch.tensor(y).numpy(), chunks=8),
                                       reg=reg, tol=1e-10, rank=16)
    assert report.converged and isinstance(alpha_t, np.ndarray)
    alpha_t, _ = ntkcore.cg_solve(kd, torch.tensor(y), reg=reg, tol=1e-10, rank=16)
    assert isinstance(alpha_t, torch.Tensor)
    np.testing.assert_allclose(alpha_t.numpy(), np.linalg.solve(k + reg * np.eye(16), y),
                               rtol=1e-7, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# faults: a worker process killed while tiles are being computed
# ---------------------------------------------------------------------------------------------
class SlowModel:
    """An MLP whose Jacobian takes a while, so that a worker can be killed mid-task."""

    def __init__(self, net, delay):
        self.net = net
        self.delay = delay


def slow_jacobian(model, x, *, params=None, **_):
    time.sleep(model.delay)
    return model.net.jacobian(x)


register_provider("slow-test-model", lambda m: type(m).__name__ == "SlowModel",
                  lambda: slow_jacobian, first=True)


def test_worker_killed_mid_run(client, net):
    x = np.random.default_rng(5).standard_normal((24, 3))
    ref = dense_reference(net, x, None, "trace")
    k = nd.ntk_dask(SlowModel(net, 0.4), x, chunks=4)  # 6 Jacobian tasks
    pids = client.run(os.getpid)
    future = client.compute(k)
    # wait until the cluster is busy computing, then kill one worker process outright
    deadline = time.time() + 20
    while time.time() < deadline and not any(client.processing().values()):
        time.sleep(0.05)
    time.sleep(0.2)
    _addr, victim_pid = sorted(pids.items())[0]
    os.kill(victim_pid, signal.SIGKILL)
    got = future.result(timeout=60)
    np.testing.assert_allclose(got, ref, rtol=0, atol=kernel_bound(net, ref))
    assert not future.cancelled()
    # the killed process is gone (its nanny starts a fresh one)
    assert victim_pid not in client.run(os.getpid).values()


# ---------------------------------------------------------------------------------------------
# products with a stored kernel: ZarrMatrixOperator (memory-mapped tiles, upper triangle)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def net32():
    return MLP.random((3, 16, 16, 2), xp=np, seed=3, activation="tanh", dtype=np.float32)


def test_zarr_operator_products(client, net32, tmp_path):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((23, 3)).astype(np.float32)
    nd.ntk_to_zarr(net32, x, store=tmp_path / "k.zarr", chunks=7, client=client)  # ragged
    stored = np.asarray(nd.read_zarr(tmp_path / "k.zarr").compute())
    assert stored.dtype == np.float32
    # the stored kernel is the eNTK (float32 accuracy against a float64 dense reference)
    ref = dense_reference(net32, x.astype(np.float64), None, "trace")
    # first order (tests/tolerances.py): P = 370 products per entry, and each float32 Jacobian
    # entry sums the fan-ins (3, 16, 16) forward and the fan-outs (2, 16, 16) backward, twice
    n = 370 + 2 * ((3 + 16 + 16) + (2 + 16 + 16))
    assert np.max(np.abs(stored - ref)) <= kernel_tol(np.float32, n) * np.max(np.abs(ref))
    k64 = stored.astype(np.float64)
    v = rng.standard_normal((23, 3))
    sym = nd.ZarrMatrixOperator(tmp_path / "k.zarr", client=client)
    assert sym.symmetric and sym.raw  # recorded by ntk_to_zarr; uncompressed store
    full = nd.ZarrMatrixOperator(tmp_path / "k.zarr", client=client, symmetric=False)
    for op in (sym, full):
        # float64 vectors: exact float64 products of the stored float32 values
        assert_product_close(op.matmat(v), k64, v)
        assert_product_close(op.matvec(v[:, 0]), k64, v[:, 0])
        sk = op.sketch(v)
        assert sk.dtype == np.float64
        # float32 products: v rounded, then 23 terms summed per entry
        bound = gamma(np.float32, 23 + 2) * np.abs(k64) @ np.abs(v)
        assert np.all(np.abs(sk - k64 @ v) <= bound)
        np.testing.assert_array_equal(op.diagonal(v[:, 0]), np.diag(k64))
        np.testing.assert_array_equal(op.columns([0, 8, 22, 8], v), k64[:, [0, 8, 22, 8]])
    assert sym.products == 3 and full.products == 3
    torch = pytest.importorskip("torch")
    got = sym.matmat(torch.tensor(v))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
    assert_product_close(got.numpy(), k64, v)
    with pytest.raises(ValueError, match="shape"):
        sym.matmat(np.ones((5, 1)))
    with pytest.raises(IndexError):
        sym.columns([23], v)


def test_zarr_operator_compressed_store_and_missing_tiles(client, tmp_path):
    import zarr

    rng = np.random.default_rng(8)
    a = rng.standard_normal((10, 10))
    k = a @ a.T
    k[:5, 5:] = 0.0  # a whole tile equal to the fill value: Zarr writes no chunk file
    k[5:, :5] = 0.0
    kd = da.from_array(k, chunks=5)
    nd.to_zarr(kd, tmp_path / "raw.zarr", client=client, symmetric=True)
    assert not os.path.exists(tmp_path / "raw.zarr" / "kernel" / "c" / "0" / "1")
    nd.to_zarr(kd, tmp_path / "zstd.zarr", client=client,
               compressors=zarr.codecs.ZstdCodec(level=1))
    v = rng.standard_normal((10, 2))
    for name, raw, sym in (("raw.zarr", True, True), ("zstd.zarr", False, False)):
        op = nd.ZarrMatrixOperator(tmp_path / name, client=client)
        assert op.raw is raw and op.symmetric is sym
        assert_product_close(op.matmat(v), k, v)
        np.testing.assert_array_equal(op.columns([1, 7], v), k[:, [1, 7]])
        np.testing.assert_array_equal(op.diagonal(v[:, 0]), np.diag(k))
    with pytest.raises(ValueError, match="square tiles"):
        nd.to_zarr(da.from_array(k, chunks=(5, 10)), tmp_path / "rect.zarr", client=client)
        nd.ZarrMatrixOperator(tmp_path / "rect.zarr", client=client, symmetric=True)


def test_cg_on_read_zarr_uses_store_operator(client, net, tmp_path):
    xtr, _xte, k, _ks, y = regression_problem(net, n=20, m=3)
    nd.ntk_to_zarr(net, xtr, store=tmp_path / "k.zarr", chunks=6, client=client)
    kd = nd.read_zarr(tmp_path / "k.zarr")
    op = ntkcore.cg.aslinearoperator(kd)
    assert isinstance(op, nd.DaskMatrixOperator) and op.zarr is not None and op.zarr.symmetric
    assert ntkcore.cg.aslinearoperator(kd * 1.0).zarr is None  # an expression: generic path
    reg = 0.05
    alpha, report = ntkcore.cg_solve(kd, y, reg=reg, tol=1e-10, rank=8)
    assert report.converged
    np.testing.assert_allclose(alpha, np.linalg.solve(k + reg * np.eye(20), y), rtol=1e-7,
                               atol=1e-8)


def test_dask_operator_mixed_dtypes(client):
    rng = np.random.default_rng(9)
    a = rng.standard_normal((13, 13)).astype(np.float32)
    k32 = a @ a.T
    op = nd.DaskMatrixOperator(da.from_array(k32, chunks=5))
    assert op.zarr is None
    v = rng.standard_normal((13, 2))
    got = op.matmat(v)
    assert got.dtype == np.float64
    assert_product_close(got, k32.astype(np.float64), v)  # float32 values exact in float64
    k64 = k32.astype(np.float64)  # float32 products: v rounded, then 13 terms per entry
    bound = gamma(np.float32, 13 + 2) * np.abs(k64) @ np.abs(v)
    assert np.all(np.abs(op.sketch(v) - k64 @ v) <= bound)


# ---------------------------------------------------------------------------------------------
# native in Dask (issue 17): a cheap lazy graph, the caller's scheduler, chunks=, dask inputs
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_cluster_no_model_call(monkeypatch):
    """Count model evaluations (MLP.jacobian) and fail if a cluster or client is started."""
    calls = []
    real = MLP.jacobian

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster or client was started while building the graph")

    monkeypatch.setattr(MLP, "jacobian", counted)
    with monkeypatch.context() as m:
        m.setattr(nd._cluster, "get_client", no_cluster)
        m.setattr("distributed.LocalCluster", no_cluster)
        yield calls


@pytest.mark.parametrize("mode", ["trace", "full"])
def test_building_the_graph_calls_no_model_and_starts_no_cluster(net, mode,
                                                                no_cluster_no_model_call):
    calls = no_cluster_no_model_call
    x1 = np.random.default_rng(10).standard_normal((13, 3))
    x2 = np.random.default_rng(11).standard_normal((6, 3))
    ks = [nd.ntk_dask(net, x1, mode=mode, chunks=4), nd.ntk_dask(net, x1, x2, mode=mode)]
    assert calls == []
    import dask

    with dask.config.set(scheduler="synchronous"):
        got = [k.compute() for k in ks]
    assert len(calls) == 4 + 2  # one Jacobian per chunk of x1 (and x2), at compute time
    for k, g, b in zip(ks, got, (None, x2), strict=True):
        ref = dense_reference(net, x1, b, mode)  # float64 reference
        assert g.dtype == np.float64 and k.dtype == np.float64 and g.shape == k.shape
        np.testing.assert_allclose(g, ref, rtol=0, atol=kernel_bound(net, ref))


def test_graph_computes_on_the_callers_client(net, no_cluster_no_model_call):
    calls = no_cluster_no_model_call
    x = np.random.default_rng(12).standard_normal((11, 3))
    k = nd.ntk_dask(net, x, mode="diagonal", chunks=5)
    assert calls == []
    with Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0",
                silence_logs=logging.ERROR) as mine:
        with get_task_stream(client=mine) as stream:
            got = k.compute()  # the client the user made is dask's default
    # the upper triangle of 3 x 3 tiles ran there
    assert sum("_tile_task" in str(t["key"]) for t in stream.data) == 3
    ref = dense_reference(net, x, None, "diagonal")
    np.testing.assert_allclose(got, ref, rtol=0, atol=kernel_bound(net, ref))


def test_max_memory_string_on_a_worker_with_a_limit(net):
    """``max_memory="200kB"`` reaches the worker's fit check (which compares bytes with the
    worker's memory limit) as bytes, as ``ntk`` accepts it."""
    x = np.random.default_rng(13).standard_normal((10, 3))
    k = nd.ntk_dask(net, x, mode="trace", chunks=5, max_memory="200kB")
    with Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0",
                memory_limit="2GiB", silence_logs=logging.ERROR) as limited:
        # a result, or a failure: under coverage and a swapping machine this wait once
        # never returned (no timeout in Client.gather)
        got = limited.compute(k).result(timeout=120)
    ref = dense_reference(net, x, None, "trace")  # float64 einsum of dense Jacobians
    assert np.abs(got - ref).max() <= kernel_bound(net, ref)


@pytest.mark.slow
def test_torch_graph_build_calls_no_model():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model = model.double()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    x = torch.randn(9, 3, dtype=torch.float64)
    k = nd.ntk_dask(model, x, chunks=4)
    assert calls == [] and k.dtype == np.float64
    import dask

    with dask.config.set(scheduler="synchronous"):
        got = k.compute()
    params = list(model.parameters())
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(model(x[n:n + 1])[0, o],
                                                                  params)])
            for n in range(9) for o in range(2)]
    jd = torch.stack(rows).reshape(9, 2, -1).numpy()
    ref = np.einsum("nop,mop->nm", jd, jd)
    np.testing.assert_allclose(got, ref, rtol=0, atol=torch_kernel_bound(model, ref))


def test_chunks_argument_and_dask_inputs(net):
    import dask

    x = np.random.default_rng(13).standard_normal((17, 3))
    ref = dense_reference(net, x, x[:7], "full")
    with pytest.warns(FutureWarning, match="chunks="):
        old = nd.ntk_dask(net, x, x[:7], mode="full", chunk=5)
    assert old.chunks[:2] == ((5, 5, 5, 2), (5, 2))
    with pytest.raises(TypeError, match="both"):
        nd.ntk_dask(net, x, chunks=5, chunk=5)
    # a dask array's chunks along the sample axis are the tiles
    k = nd.ntk_dask(net, da.from_array(x, chunks=(6, 3)), da.from_array(x[:7], chunks=4),
                    mode="full")
    assert k.chunks[:2] == ((6, 6, 5), (6, 1))
    with dask.config.set(scheduler="synchronous"):
        for got in (old.compute(), k.compute()):
            np.testing.assert_allclose(got, ref, rtol=0, atol=kernel_bound(net, ref))
    unknown = da.from_array(x, chunks=6)[da.from_array(x[:, 0] > 0, chunks=6)]
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        nd.ntk_dask(net, unknown)


def test_cholesky_regression_is_lazy_on_dask_scheduler(net):
    import dask

    _xtr, _xte, k, ks, y = regression_problem(net, n=14, m=4)
    reg = 1e-3
    ref = ks @ np.linalg.solve(k + reg * np.eye(len(k)), y)  # direct float64 solve
    pred = nd.cholesky_regression(da.from_array(k, chunks=5), y, da.from_array(ks, chunks=5),
                                  reg=reg)
    assert isinstance(pred, da.Array)
    with dask.config.set(scheduler="synchronous"):
        np.testing.assert_allclose(pred.compute(), ref, rtol=1e-7, atol=1e-9)
        indefinite = nd.cholesky_regression(da.from_array(-np.eye(6), chunks=3), np.ones(6))
        with pytest.raises(np.linalg.LinAlgError):  # loud at compute time
            indefinite.compute()


def test_memory_store_with_process_workers_is_loud(client):
    import zarr

    k = da.from_array(np.eye(4), chunks=2)
    store = zarr.storage.MemoryStore()
    with pytest.raises(RuntimeError, match="own copy"):  # no silently lost writes
        nd.to_zarr(k, store, client=client)
    assert nd.zarr_status(store).tiles_done == 0


def test_jax_graph_build_calls_no_model():
    pytest.importorskip("jax")
    import dask
    import jax.numpy as jnp

    calls = []

    def apply(p, x):
        calls.append(1)
        return jnp.tanh(x @ p["w"]) @ p["v"]

    rng = np.random.default_rng(14)
    w, v = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    x = rng.standard_normal((7, 3)).astype(np.float32)
    params = {"w": jnp.asarray(w, dtype=jnp.float32), "v": jnp.asarray(v, dtype=jnp.float32)}
    k = nd.ntk_dask((apply, params), x, chunks=3)
    assert calls == [] and k.dtype == np.float32  # the dtype the JAX provider computes in
    with dask.config.set(scheduler="synchronous"):
        got = k.compute()
    assert got.dtype == np.float32
    # float64 reference from the closed-form Jacobian of tanh(x W) V (of the float32 values)
    xd, wd, vd = (np.asarray(a, dtype=np.float64) for a in (x, params["w"], params["v"]))
    h = np.tanh(xd @ wd)
    jw = np.einsum("ni,na,ao->noia", xd, 1 - h**2, vd).reshape(7, 2, -1)
    jv = np.einsum("na,ob->noab", h, np.eye(2)).reshape(7, 2, -1)
    jd = np.concatenate([jw, jv], axis=2)
    ref = np.einsum("nop,mop->nm", jd, jd)
    n = jd.shape[2] + 2 * (3 + 4 + 2)  # products per entry, and the fan-ins of each factor
    assert np.max(np.abs(got - ref)) <= kernel_tol(np.float32, n) * np.max(np.abs(ref))
