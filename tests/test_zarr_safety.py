"""Zarr kernel stores: never mix two kernels, never delete what is not ntkcore's, never call a
torn store complete (issue 15, item 6).

Interruptions are simulated by making the tile writer raise after k tiles, on an in-process
cluster (one worker thread, so tiles are written one after another and the patched writer is
the one the worker runs).  Every kernel is compared with a dense float64 reference.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

pytest.importorskip("dask")
pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")


import ntkcore  # noqa: E402
import ntkcore.distributed as nd  # noqa: E402
from ntkcore.distributed import _zarr  # noqa: E402
from ntkcore.models import MLP  # noqa: E402


def dense_trace(net, x1, x2=None):
    """Independent float64 reference: dense Jacobians, K = sum_o J1[:, o] J2[:, o]^T."""
    d1 = net.jacobian(x1).to_dense()
    d2 = d1 if x2 is None else net.jacobian(x2).to_dense()
    return np.einsum("nop,mop->nm", d1, d2)


def interrupt_after(monkeypatch, k):
    """Make the tile writer raise after k tiles (a run that dies part way)."""
    real = _zarr._write_tile
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) > k:
            raise RuntimeError("simulated interruption")
        return real(*args, **kwargs)

    monkeypatch.setattr(_zarr, "_write_tile", write)
    return calls


def run_interrupted(monkeypatch, k, *args, **kwargs):
    with monkeypatch.context() as m:
        interrupt_after(m, k)
        with pytest.raises(BaseException, match="simulated interruption"):
            nd.ntk_to_zarr(*args, **kwargs)


X = np.random.default_rng(0).standard_normal((20, 3))


# ---------------------------------------------------------------------------------------------
# 1. a store belongs to one computation
# ---------------------------------------------------------------------------------------------
def test_resume_with_another_model_is_refused(client, tmp_path, monkeypatch):
    net_a = MLP.random((3, 8, 2), xp=np, seed=0, activation="tanh")
    net_b = MLP.random((3, 8, 2), xp=np, seed=1, activation="tanh")
    store = tmp_path / "k.zarr"
    run_interrupted(monkeypatch, 4, net_a, X, store=store, chunks=5, client=client)
    assert nd.zarr_status(store).tiles_done == 4
    with pytest.raises(ValueError, match=r"(?s)k\.zarr.*parameters.*overwrite=True"):
        nd.ntk_to_zarr(net_b, X, store=store, chunks=5, client=client)
    assert nd.zarr_status(store).tiles_done == 4  # refused before writing anything
    # the same computation resumes (a new MLP object with the same values)
    net_a2 = MLP.random((3, 8, 2), xp=np, seed=0, activation="tanh")
    seen = []
    status = nd.ntk_to_zarr(net_a2, X, store=store, chunks=5, client=client,
                            progress=lambda d, t, seen=seen: seen.append((d, t)))
    assert status.complete and seen[-1] == (12, 12)  # 16 tiles, 4 kept
    np.testing.assert_allclose(nd.read_zarr(store).compute(), dense_trace(net_a, X),
                               rtol=1e-12, atol=1e-12)
    # a complete store of model a is not returned for model b either
    with pytest.raises(ValueError, match="parameters"):
        nd.ntk_to_zarr(net_b, X, store=store, chunks=5, client=client)
    status = nd.ntk_to_zarr(net_b, X, store=store, chunks=5, client=client, overwrite=True)
    assert status.complete
    np.testing.assert_allclose(nd.read_zarr(store).compute(), dense_trace(net_b, X),
                               rtol=1e-12, atol=1e-12)


def test_resume_refuses_other_inputs_selection_or_activation(client, tmp_path, monkeypatch):
    net = MLP.random((3, 8, 8, 2), xp=np, seed=0, activation="tanh")
    store = tmp_path / "k.zarr"
    run_interrupted(monkeypatch, 3, net, X, store=store, chunks=5, client=client)
    x_other = X.copy()
    x_other[7, 1] = np.nextafter(x_other[7, 1], np.inf)  # one ulp in one input
    with pytest.raises(ValueError, match="x1"):
        nd.ntk_to_zarr(net, x_other, store=store, chunks=5, client=client)
    with pytest.raises(ValueError, match="params"):
        nd.ntk_to_zarr(net, X, store=store, chunks=5, client=client, params=["layer2"])
    relu = MLP(net.weights, net.biases, activation="relu")  # same parameter values
    with pytest.raises(ValueError, match=r"model \(architecture"):
        nd.ntk_to_zarr(relu, X, store=store, chunks=5, client=client)
    with pytest.raises(ValueError, match="x2"):  # same numbers, but a cross kernel
        nd.ntk_to_zarr(net, X, X, store=store, chunks=5, client=client)
    assert nd.zarr_status(store).tiles_done == 3


def test_torch_fingerprint_sees_one_ulp_and_flags(client, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model = model.double()
    x = torch.tensor(X)
    store = tmp_path / "k.zarr"
    run_interrupted(monkeypatch, 2, model, x, store=store, chunks=5, client=client)
    with torch.no_grad():
        w = model[2].weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(np.inf, dtype=torch.float64))
    with pytest.raises(ValueError, match="parameters"):
        nd.ntk_to_zarr(model, x, store=store, chunks=5, client=client)
    with torch.no_grad():
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(-np.inf, dtype=torch.float64))
    model[0].bias.requires_grad_(False)  # changes which parameters the kernel sums over
    with pytest.raises(ValueError, match="params"):
        nd.ntk_to_zarr(model, x, store=store, chunks=5, client=client)
    model[0].bias.requires_grad_(True)
    status = nd.ntk_to_zarr(model, x, store=store, chunks=5, client=client)
    assert status.complete
    # independent reference: per-output autograd rows
    params = list(model.parameters())
    rows = []
    for n in range(len(x)):
        for o in range(2):
            grads = torch.autograd.grad(model(x[n:n + 1])[0, o], params)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    jd = torch.stack(rows).reshape(len(x), 2, -1).numpy()
    np.testing.assert_allclose(nd.read_zarr(store).compute(),
                               np.einsum("nop,mop->nm", jd, jd), rtol=1e-12, atol=1e-12)


def test_explicit_key_is_trusted_but_a_changed_model_warns(client, tmp_path, monkeypatch):
    net_a = MLP.random((3, 8, 2), xp=np, seed=0, activation="tanh")
    net_b = MLP.random((3, 8, 2), xp=np, seed=1, activation="tanh")
    store = tmp_path / "k.zarr"
    run_interrupted(monkeypatch, 4, net_a, X, store=store, chunks=5, client=client, key="run1")
    with pytest.raises(ValueError, match="key"):
        nd.ntk_to_zarr(net_a, X, store=store, chunks=5, client=client, key="run2")
    with pytest.raises(ValueError, match="key"):  # the key is part of the identity
        nd.ntk_to_zarr(net_a, X, store=store, chunks=5, client=client)
    status = nd.ntk_to_zarr(net_a, X, store=store, chunks=5, client=client, key="run1")
    assert status.complete and status.key == "run1"
    with pytest.warns(UserWarning, match="parameters"):
        nd.ntk_to_zarr(net_b, X, store=store, chunks=5, client=client, key="run1")


def test_to_zarr_without_key_refuses_another_dask_array(client, tmp_path, monkeypatch):
    import dask.array as da

    a = np.arange(100.0).reshape(10, 10)
    store = tmp_path / "k.zarr"
    with monkeypatch.context() as m:
        interrupt_after(m, 2)
        with pytest.raises(BaseException, match="simulated"):
            nd.to_zarr(da.from_array(a, chunks=5), store, client=client)
    with pytest.raises(ValueError, match="overwrite=True"):
        nd.to_zarr(da.from_array(a + 1, chunks=5), store, client=client)
    nd.to_zarr(da.from_array(a, chunks=5), store, client=client)
    np.testing.assert_array_equal(nd.read_zarr(store).compute(), a)


# ---------------------------------------------------------------------------------------------
# 2. never delete what is not ntkcore's
# ---------------------------------------------------------------------------------------------
def test_overwrite_refuses_a_directory_of_other_files(client, tmp_path):
    import dask.array as da

    d = tmp_path / "results"
    (d / "sub").mkdir(parents=True)
    (d / "paper.tex").write_text("precious")
    (d / "sub" / "data.npy").write_bytes(b"\x00" * 10)
    k = da.from_array(np.eye(6), chunks=3)
    for overwrite in (True, False):
        with pytest.raises(ValueError, match=r"(?s)results.*not an ntkcore kernel store"):
            nd.to_zarr(k, d, client=client, overwrite=overwrite)
    assert (d / "paper.tex").read_text() == "precious"
    assert (d / "sub" / "data.npy").read_bytes() == b"\x00" * 10
    # another program's Zarr group is not ours either
    other = tmp_path / "other.zarr"
    zarr.open_group(store=str(other), mode="w").create_array("x", shape=(3,), dtype="f8")
    with pytest.raises(ValueError, match="not an ntkcore kernel store"):
        nd.to_zarr(k, other, client=client, overwrite=True)
    assert zarr.open_group(store=str(other), mode="r")["x"].shape == (3,)
    # a plain file is refused; an empty directory is used
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        nd.to_zarr(k, tmp_path / "f", client=client, overwrite=True)
    (tmp_path / "empty").mkdir()
    assert nd.to_zarr(k, tmp_path / "empty", client=client).complete


def test_overwrite_of_own_store_keeps_foreign_files(client, tmp_path):
    import dask.array as da

    store = tmp_path / "k.zarr"
    nd.to_zarr(da.from_array(np.eye(6), chunks=3), store, client=client)
    (store / "NOTES.txt").write_text("mine")
    nd.to_zarr(da.from_array(2 * np.eye(6), chunks=2), store, client=client, overwrite=True)
    np.testing.assert_array_equal(nd.read_zarr(store).compute(), 2 * np.eye(6))
    assert (store / "NOTES.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# 3. never call a torn store complete
# ---------------------------------------------------------------------------------------------
def chunk_file(store, i, j):
    return os.path.join(store, "kernel", "c", str(i), str(j))


@pytest.mark.parametrize("mode", ["trace", "full"])
def test_truncated_tile_is_detected_and_recomputed(client, tmp_path, mode):
    net = MLP.random((3, 8, 2), xp=np, seed=0, activation="tanh")
    store = tmp_path / "k.zarr"
    nd.ntk_to_zarr(net, X, store=store, chunks=5, client=client, mode=mode)
    d = net.jacobian(X).to_dense()
    ref = np.einsum("nop,mqp->nmoq", d, d)  # dense float64 reference
    ref = np.einsum("nmoo->nm", ref) if mode == "trace" else ref
    tile = (1, 2) if mode == "trace" else (1, 2, 0, 0)
    name = os.path.join(store, "kernel", "c", *map(str, tile))
    with open(name, "r+b") as f:
        f.truncate(os.path.getsize(name) // 2)
    status = nd.zarr_status(store)
    assert not status.complete and status.torn == (tile,)
    assert status.tiles_done == 15
    text = re.escape(f"tile {tile}")
    with pytest.raises(ValueError, match=text):
        nd.read_zarr(store)
    if mode == "trace":
        with pytest.raises(ValueError, match=text):
            nd.ZarrMatrixOperator(store, client=client)
    seen = []
    status = nd.ntk_to_zarr(net, X, store=store, chunks=5, client=client, mode=mode,
                            progress=lambda d, t, seen=seen: seen.append((d, t)))
    assert status.complete and status.torn == () and seen[-1] == (1, 1)
    np.testing.assert_allclose(nd.read_zarr(store).compute(), ref, rtol=1e-12, atol=1e-12)


def test_corrupted_tile_found_by_checksum(client, tmp_path):
    net = MLP.random((3, 8, 2), xp=np, seed=0, activation="tanh")
    store = tmp_path / "k.zarr"
    nd.ntk_to_zarr(net, X, store=store, chunks=5, client=client)
    ref = dense_trace(net, X)
    name = chunk_file(store, 0, 3)
    with open(name, "r+b") as f:  # same size, one byte changed
        f.seek(17)
        b = f.read(1)
        f.seek(17)
        f.write(bytes([b[0] ^ 0xFF]))
    assert nd.zarr_status(store).complete  # sizes only: cheap, does not read the tiles
    status = nd.zarr_status(store, checksums=True)
    assert status.torn == ((0, 3),) and not status.complete
    with pytest.raises(ValueError, match=r"tile \(0, 3\)"):
        nd.read_zarr(store, checksums=True)
    status = nd.ntk_to_zarr(net, X, store=store, chunks=5, client=client, checksums=True)
    assert nd.zarr_status(store, checksums=True).complete
    np.testing.assert_allclose(nd.read_zarr(store).compute(), ref, rtol=1e-12, atol=1e-12)


def test_interrupt_between_data_and_marker_leaves_tile_not_done(client, tmp_path,
                                                                monkeypatch):
    net = MLP.random((3, 8, 2), xp=np, seed=0, activation="tanh")
    store = tmp_path / "k.zarr"
    calls = []

    def mark(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("simulated interruption")
        return real(*args, **kwargs)

    real = _zarr._mark_done
    with monkeypatch.context() as m:
        m.setattr(_zarr, "_mark_done", mark)
        with pytest.raises(BaseException, match="simulated"):
            nd.ntk_to_zarr(net, X, store=store, chunks=5, client=client)
    assert nd.zarr_status(store).tiles_done == 3
    status = nd.ntk_to_zarr(net, X, store=store, chunks=5, client=client)
    assert status.complete
    np.testing.assert_allclose(nd.read_zarr(store).compute(), dense_trace(net, X),
                               rtol=1e-12, atol=1e-12)


def test_all_zero_tile_without_chunk_file_is_complete(client, tmp_path):
    import dask.array as da

    k = np.ones((6, 6))
    k[:3, 3:] = 0.0  # Zarr writes no file for a tile equal to the fill value
    store = tmp_path / "k.zarr"
    nd.to_zarr(da.from_array(k, chunks=3), store, client=client)
    assert not os.path.exists(chunk_file(store, 0, 1))
    assert nd.zarr_status(store, checksums=True).complete
    np.testing.assert_array_equal(nd.read_zarr(store).compute(), k)


def make_format_1(store):
    """Turn a store into what ntkcore wrote before fingerprints and per-tile records."""
    import shutil

    group = zarr.open_group(store=str(store), mode="r+")
    meta = dict(group.attrs.asdict()["ntkcore"])
    for name in ("format", "fingerprint", "version"):
        meta.pop(name)
    group.attrs.update({"ntkcore": meta})
    shutil.rmtree(store / "tiles")


def test_store_of_an_older_ntkcore(client, tmp_path, monkeypatch):
    net = MLP.random((3, 8, 2), xp=np, seed=0, activation="tanh")
    ref = dense_trace(net, X)
    for key in (None, "run1"):
        store = tmp_path / f"k-{key}.zarr"
        run_interrupted(monkeypatch, 5, net, X, store=store, chunks=5, client=client, key=key)
        make_format_1(store)
        name = chunk_file(store, *next((i, j) for i in range(4) for j in range(4)
                                   if os.path.exists(chunk_file(store, i, j))))
        with open(name, "r+b") as f:  # torn: an uncompressed tile has a known size
            f.truncate(7)
        status = nd.zarr_status(store)
        assert len(status.torn) == 1 and status.tiles_done == 4
        if key is None:  # nothing proves what the tiles are
            with pytest.raises(ValueError, match="older ntkcore"):
                nd.ntk_to_zarr(net, X, store=store, chunks=5, client=client)
            continue
        seen = []
        status = nd.ntk_to_zarr(net, X, store=store, chunks=5, client=client, key=key,
                                progress=lambda d, t, seen=seen: seen.append((d, t)))
        assert status.complete and seen[-1] == (12, 12)
        np.testing.assert_allclose(nd.read_zarr(store).compute(), ref, rtol=1e-12, atol=1e-12)
        # upgraded: records and a fingerprint, so key=None is refused only for the key
        assert nd.zarr_status(store, checksums=True).complete


# ---------------------------------------------------------------------------------------------
# 4. any Zarr store: a MemoryStore, an fsspec URL (issue 17); the same guarantees
# ---------------------------------------------------------------------------------------------
def test_memory_store_write_resume_and_operator(client, monkeypatch):
    net_a = MLP.random((3, 8, 2), xp=np, seed=0, activation="tanh")
    net_b = MLP.random((3, 8, 2), xp=np, seed=1, activation="tanh")
    store = zarr.storage.MemoryStore()
    run_interrupted(monkeypatch, 5, net_a, X, store=store, chunks=5, client=client)
    assert nd.zarr_status(store).tiles_done == 5
    # the fingerprint lives in the store's Zarr attributes: another model is refused
    with pytest.raises(ValueError, match="parameters"):
        nd.ntk_to_zarr(net_b, X, store=store, chunks=5, client=client)
    seen = []
    status = nd.ntk_to_zarr(net_a, X, store=store, chunks=5, client=client,
                            progress=lambda d, t, seen=seen: seen.append((d, t)))
    assert status.complete and seen[-1] == (11, 11)  # 16 tiles, 5 kept
    ref = dense_trace(net_a, X)
    np.testing.assert_allclose(nd.read_zarr(store).compute(), ref, rtol=1e-12, atol=1e-12)
    # a damaged chunk is found through the store API and recomputed
    key = "kernel/c/1/2"
    good = store._store_dict[key]
    store._store_dict[key] = type(good).from_bytes(good.to_bytes()[:-8])
    assert nd.zarr_status(store).torn == ((1, 2),)
    assert nd.ntk_to_zarr(net_a, X, store=store, chunks=5, client=client).complete
    op = nd.ZarrMatrixOperator(store, client=client)
    assert op.symmetric and not op.raw
    v = np.random.default_rng(1).standard_normal((20, 2))
    np.testing.assert_allclose(op.matmat(v), ref @ v, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(op.diagonal(v[:, 0]), np.diag(nd.read_zarr(store).compute()))
    np.testing.assert_allclose(ntkcore.cg_solve(nd.read_zarr(store), v, reg=0.1, tol=1e-12)[0],
                               np.linalg.solve(ref + 0.1 * np.eye(20), v), rtol=1e-8,
                               atol=1e-10)


def test_memory_store_on_dask_scheduler_and_fsspec_url(tmp_path):
    import dask
    import dask.array as da

    a = np.random.default_rng(2).standard_normal((9, 9))
    with dask.config.set(scheduler="synchronous"):  # no distributed client at all
        store = zarr.storage.MemoryStore()
        assert nd.to_zarr(da.from_array(a, chunks=4), store).complete
        np.testing.assert_array_equal(nd.read_zarr(store).compute(), a)
        with pytest.raises(ValueError, match="overwrite=True"):
            nd.to_zarr(da.from_array(a + 1, chunks=4), store)  # another dask graph
        foreign = zarr.storage.MemoryStore()
        zarr.open_group(store=foreign, mode="w").create_array("x", shape=(3,), dtype="f8")
        with pytest.raises(ValueError, match="not an ntkcore kernel store"):
            nd.to_zarr(da.from_array(a, chunks=4), foreign, overwrite=True)
        assert "x" in zarr.open_group(store=foreign, mode="r")
        url = f"memory://{tmp_path.name}/k.zarr"
        assert nd.to_zarr(da.from_array(a, chunks=3), url, key="a").complete
        np.testing.assert_array_equal(nd.read_zarr(url).compute(), a)
        assert nd.zarr_status(url, checksums=True).complete
