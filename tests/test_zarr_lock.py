"""One writer per Zarr kernel store (issue 29, section 4, "Two writers, one store").

A second writer of a store -- another process, or another thread of this one -- is refused at
once with ``StoreLockedError``; the lock is released on success, error and interruption, and a
killed writer's lock by the operating system.  The cross-process tests run the first writer
in a real subprocess that stops inside its write (in its progress callback, after three
tiles) until the test lets it go, so nothing depends on timing.  Kernels are compared with a
dense float64 reference (``MLP``) or with the array that was written.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

pytest.importorskip("dask")
pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")

import dask  # noqa: E402
import dask.array as da  # noqa: E402

import ntkcore.distributed as nd  # noqa: E402
from ntkcore.distributed import _zarr  # noqa: E402
from ntkcore.models import MLP  # noqa: E402

LOCK = ".ntkcore.lock"
X = np.random.default_rng(0).standard_normal((20, 3))  # 4 x 4 tiles of 5 samples


def dense_trace(net, x):
    """Independent float64 reference: dense Jacobians, K = sum_o J[:, o] J[:, o]^T."""
    d = net.jacobian(x).to_dense()
    return np.einsum("nop,mop->nm", d, d)


def net(seed=0):
    return MLP.random((3, 8, 2), xp=np, seed=seed, activation="tanh")


@pytest.fixture
def synchronous():
    with dask.config.set(scheduler="synchronous"):
        yield


# ---------------------------------------------------------------------------------------------
# two processes
# ---------------------------------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import os, sys, time
    import dask, numpy as np
    import ntkcore.distributed as nd
    from ntkcore.models import MLP

    store, ready, go = sys.argv[1:4]
    net = MLP.random((3, 8, 2), xp=np, seed=0, activation="tanh")
    x = np.random.default_rng(0).standard_normal((20, 3))

    def progress(done, total):
        if done == 3:  # three tiles written and marked; hold the store until told to go on
            open(ready, "w").close()
            deadline = time.monotonic() + 30  # a test that never says go fails, not hangs
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.01)

    with dask.config.set(scheduler="synchronous"):
        nd.ntk_to_zarr(net, x, store=store, chunks=5, progress=progress)
""")


def start_writer(tmp_path):
    """A subprocess writing ``tmp_path/k.zarr``, stopped inside its write after 3 tiles."""
    store, ready, go = tmp_path / "k.zarr", tmp_path / "ready", tmp_path / "go"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store), str(ready), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _out, err = proc.communicate()
            pytest.fail(f"the writer did not reach its third tile (rc {proc.returncode}):\n"
                        f"{err.decode(errors='replace')}")
        time.sleep(0.01)
    return proc, store, go


def test_second_process_is_refused_at_once_until_the_first_finishes(tmp_path, synchronous):
    proc, store, go = start_writer(tmp_path)
    try:
        assert (store / LOCK).exists()
        # reading is not locked: the store shows the writer's three tiles
        assert nd.zarr_status(store).tiles_done == 3
        assert nd.read_zarr(store, require_complete=False).shape == (20, 20)
        with warnings.catch_warnings():  # Zarr warns that the lock file is not an array
            warnings.simplefilter("ignore")
            assert sorted(zarr.open_group(str(store), mode="r").array_keys()) == [
                "done", "kernel", "tiles"]
        # a second writer fails at once, whatever it asks for, and changes nothing
        with pytest.raises(nd.StoreLockedError) as info:
            nd.ntk_to_zarr(net(), X, store=store, chunks=5)
        text = str(info.value)
        assert repr(str(store)) in text and "another process" in text
        assert f"pid {proc.pid} " in text and info.value.holder.startswith(f"pid {proc.pid} ")
        assert isinstance(info.value, RuntimeError) and info.value.store == str(store)
        with pytest.raises(nd.StoreLockedError, match="another process"):
            nd.ntk_to_zarr(net(1), X, store=store, chunks=5, overwrite=True)
        with pytest.raises(nd.StoreLockedError, match="another process"):
            nd.to_zarr(da.from_array(np.eye(20), chunks=5), f"file://{store}", overwrite=True)
        assert nd.zarr_status(store).tiles_done == 3
        assert proc.poll() is None  # the first writer is still inside its write
    finally:
        go.touch()
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode(errors="replace")
    assert not (store / LOCK).exists()  # removed when the writer finished
    # now the store can be resumed (it is complete: nothing is computed) and overwritten
    seen = []
    status = nd.ntk_to_zarr(net(), X, store=store, chunks=5, progress=lambda *a: seen.append(a))
    assert status.complete and seen == []
    np.testing.assert_allclose(nd.read_zarr(store).compute(), dense_trace(net(), X),
                               rtol=1e-12, atol=1e-12)
    assert nd.ntk_to_zarr(net(1), X, store=store, chunks=5, overwrite=True).complete
    np.testing.assert_allclose(nd.read_zarr(store).compute(), dense_trace(net(1), X),
                               rtol=1e-12, atol=1e-12)
    assert not (store / LOCK).exists()


def test_killed_writer_leaves_no_stale_lock(tmp_path, synchronous):
    proc, store, _go = start_writer(tmp_path)
    proc.kill()  # SIGKILL: no cleanup runs in the writer
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert (store / LOCK).exists()  # left behind, but the kernel released its lock
    seen = []
    status = nd.ntk_to_zarr(net(), X, store=store, chunks=5, progress=lambda *a: seen.append(a))
    assert status.complete and seen[-1] == (13, 13)  # resumed: the 3 tiles written are kept
    np.testing.assert_allclose(nd.read_zarr(store).compute(), dense_trace(net(), X),
                               rtol=1e-12, atol=1e-12)
    assert not (store / LOCK).exists()


# ---------------------------------------------------------------------------------------------
# two threads of one process; any store
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["directory", "MemoryStore", "memory:// URL"])
def test_second_thread_is_refused_and_the_process_can_write_again(tmp_path, kind):
    store = {"directory": str(tmp_path / "k.zarr"), "MemoryStore": zarr.storage.MemoryStore(),
             "memory:// URL": f"memory://{tmp_path.name}-{os.getpid()}/k.zarr"}[kind]
    a = np.random.default_rng(1).standard_normal((12, 12))
    inside, go, failure = threading.Event(), threading.Event(), []

    def progress(done, total):
        if done == 0:
            inside.set()
            go.wait(30)

    def first():
        try:
            nd.to_zarr(da.from_array(a, chunks=4), store, progress=progress)
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)

    with dask.config.set(scheduler="threads"):
        thread = threading.Thread(target=first)
        thread.start()
        try:
            assert inside.wait(30), failure
            with pytest.raises(nd.StoreLockedError, match="another thread of this process"):
                nd.to_zarr(da.from_array(a + 1, chunks=4), store, overwrite=True)
            # a URL naming the same fsspec store is the same store
            if kind == "memory:// URL":
                with pytest.raises(nd.StoreLockedError):
                    nd.to_zarr(da.from_array(a, chunks=4), zarr.storage.FsspecStore.from_url(
                        store))
        finally:
            go.set()
            thread.join(30)
        assert not failure and not thread.is_alive()
        np.testing.assert_array_equal(nd.read_zarr(store).compute(), a)
        # the same process writes the store again once the first write is over
        assert nd.to_zarr(da.from_array(a + 1, chunks=4), store, overwrite=True).complete
    np.testing.assert_array_equal(nd.read_zarr(store).compute(), a + 1)
    assert not _zarr._held


class FakeMsvcrt:
    """Windows' ``msvcrt.locking`` semantics (a non-blocking exclusive lock that fails with
    EACCES while another open file holds it), built on flock: runs ntkcore's Windows branch
    (unlock, close, then remove) on POSIX."""

    LK_UNLCK, LK_NBLCK = 0, 2

    @staticmethod
    def locking(fd, mode, nbytes):
        import fcntl

        if mode == FakeMsvcrt.LK_UNLCK:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EACCES, "Permission denied") from None


@pytest.mark.parametrize("api", ["fcntl", "msvcrt"])
def test_os_lock_conflicts_between_two_opens_and_is_released(tmp_path, monkeypatch, api):
    if api == "fcntl" and _zarr.fcntl is None:
        pytest.skip("no fcntl on this platform")
    if api == "msvcrt" and _zarr.msvcrt is None:
        if _zarr.fcntl is None:
            pytest.skip("neither fcntl nor msvcrt")
        monkeypatch.setattr(_zarr, "fcntl", None)
        monkeypatch.setattr(_zarr, "msvcrt", FakeMsvcrt)
    d = str(tmp_path / "k.zarr")
    fd = _zarr._lock_directory(d)
    assert fd is not None
    try:
        with pytest.raises(nd.StoreLockedError, match=f"another process \\(pid {os.getpid()} "):
            _zarr._lock_directory(d)  # a second open file, in this very process
    finally:
        _zarr._unlock_directory(d, fd)
    assert os.listdir(d) == []
    fd = _zarr._lock_directory(d)  # free again
    _zarr._unlock_directory(d, fd)
    assert os.listdir(d) == []


def test_lock_file_unlinked_between_open_and_lock_is_not_trusted(tmp_path, monkeypatch):
    """A writer that opened the lock file just before its holder removed it (and released
    it) must not take the lock of that removed file: a third writer could create and lock a
    new file at the same path at the same time."""
    if _zarr.fcntl is None:
        pytest.skip("no fcntl on this platform")
    d = tmp_path / "k.zarr"
    real, calls = _zarr._os_lock, []

    def os_lock(fd):
        calls.append(fd)
        if len(calls) == 1:  # the holder removes the file between our open and our lock
            os.remove(d / LOCK)
        return real(fd)

    monkeypatch.setattr(_zarr, "_os_lock", os_lock)
    fd = _zarr._lock_directory(str(d))
    try:
        assert len(calls) == 2 and _zarr._same_file(fd, str(d / LOCK))
    finally:
        _zarr._unlock_directory(str(d), fd)
    assert not (d / LOCK).exists()


# ---------------------------------------------------------------------------------------------
# release on error and interruption
# ---------------------------------------------------------------------------------------------
GATE = threading.Event()  # module globals: the in-process worker runs this module's objects
STARTED, FINISHED = [], []


def gated_write(*args, **kwargs):
    """The tile writer, held at the third tile until GATE is set."""
    STARTED.append(1)
    if len(STARTED) >= 3:
        GATE.wait(30)
    try:
        return REAL_WRITE(*args, **kwargs)
    finally:
        FINISHED.append(1)


REAL_WRITE = _zarr._write_tile


def test_interrupted_write_releases_the_lock_and_cancels_its_tiles(client, tmp_path,
                                                                   monkeypatch):
    """KeyboardInterrupt while tiles are computed on a cluster: the lock is released, and the
    tiles not yet started are cancelled (a second writer must not meet them afterwards)."""
    store = tmp_path / "k.zarr"
    GATE.clear()
    STARTED.clear()
    FINISHED.clear()

    def progress(done, total):
        if done == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(_zarr, "_write_tile", gated_write)
        with pytest.raises(KeyboardInterrupt):
            nd.ntk_to_zarr(net(), X, store=store, chunks=5, client=client, progress=progress)
        assert not (store / LOCK).exists() and not _zarr._held
        GATE.set()  # a third tile, if it was running when the call was interrupted, finishes
        deadline = time.monotonic() + 30
        while (any(client.processing().values()) or len(STARTED) != len(FINISHED)) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
    # two tiles done, and the third if it had started (one worker thread); none after it
    written = nd.zarr_status(store).tiles_done
    assert len(STARTED) in (2, 3) and written == len(STARTED)
    seen = []
    status = nd.ntk_to_zarr(net(), X, store=store, chunks=5, client=client,
                            progress=lambda *a: seen.append(a))
    assert status.complete and seen[-1] == (16 - written, 16 - written)
    np.testing.assert_allclose(nd.read_zarr(store).compute(), dense_trace(net(), X),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("store_kind", ["directory", "MemoryStore"])
def test_failed_write_releases_the_lock(tmp_path, monkeypatch, synchronous, store_kind):
    store = tmp_path / "k.zarr" if store_kind == "directory" else zarr.storage.MemoryStore()
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) > 5:
            raise RuntimeError("simulated failure")
        return REAL_WRITE(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(_zarr, "_write_tile", write)
        with pytest.raises(RuntimeError, match="simulated failure"):
            nd.ntk_to_zarr(net(), X, store=store, chunks=5)
    assert not _zarr._held
    if store_kind == "directory":
        assert not (store / LOCK).exists()
    assert nd.ntk_to_zarr(net(), X, store=store, chunks=5).complete
    np.testing.assert_allclose(nd.read_zarr(store).compute(), dense_trace(net(), X),
                               rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# the lock file and the store's guarantees
# ---------------------------------------------------------------------------------------------
def test_foreign_directory_gets_no_lock_file_and_a_stale_one_is_ignored(tmp_path,
                                                                          synchronous):
    k = da.from_array(np.arange(36.0).reshape(6, 6), chunks=3)
    d = tmp_path / "results"
    d.mkdir()
    (d / "paper.tex").write_text("precious")
    with pytest.raises(ValueError, match=r"not an ntkcore kernel store: it holds paper\.tex\. "):
        nd.to_zarr(k, d, overwrite=True)
    assert os.listdir(d) == ["paper.tex"]
    # a directory holding only a lock file left by a killed writer is a new store
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / LOCK).write_text("pid 1 on elsewhere")
    assert nd.to_zarr(k, tmp_path / "new").complete
    np.testing.assert_array_equal(nd.read_zarr(tmp_path / "new").compute(), k.compute())
    assert sorted(os.listdir(tmp_path / "new")) == ["done", "kernel", "tiles", "zarr.json"]


def test_store_being_created_by_another_writer_is_reported_as_locked(tmp_path, synchronous):
    """While another writer creates a store it can look like a foreign Zarr group (its group
    exists, its attributes not yet): the second writer hears that the store is locked."""
    if _zarr.fcntl is None and _zarr.msvcrt is None:
        pytest.skip("no OS lock on this platform")
    d = tmp_path / "k.zarr"
    k = da.from_array(np.eye(6), chunks=3)
    fd = _zarr._lock_directory(str(d))  # the other writer (another open file)
    try:
        zarr.open_group(store=str(d), mode="a")  # its group, without ntkcore's record yet
        with pytest.raises(nd.StoreLockedError, match="another process"):
            nd.to_zarr(k, d)
    finally:
        _zarr._unlock_directory(str(d), fd)
    with pytest.raises(ValueError, match="not an ntkcore kernel store"):
        nd.to_zarr(k, d, overwrite=True)  # left like this, it is not ntkcore's


class NoLocks:
    """An fcntl whose flock fails as on a file system without lock support."""

    LOCK_EX, LOCK_NB, LOCK_UN = 2, 4, 8

    @staticmethod
    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")


@pytest.mark.parametrize("platform", ["file system without locks", "no lock API"])
def test_unlockable_store_warns_and_is_written(tmp_path, monkeypatch, synchronous, platform):
    if platform == "no lock API":
        monkeypatch.setattr(_zarr, "fcntl", None)
        monkeypatch.setattr(_zarr, "msvcrt", None)
        why = "neither fcntl nor msvcrt"
    else:
        monkeypatch.setattr(_zarr, "fcntl", NoLocks)
        monkeypatch.setattr(_zarr, "msvcrt", None)
        why = "refused a lock .No locks available"
    store = tmp_path / "k.zarr"
    with pytest.warns(UserWarning, match=f"cannot lock the store at .*k\\.zarr.*{why}"):
        status = nd.ntk_to_zarr(net(), X, store=store, chunks=5)
    assert status.complete and not (store / LOCK).exists() and not _zarr._held
    np.testing.assert_allclose(nd.read_zarr(store).compute(), dense_trace(net(), X),
                               rtol=1e-12, atol=1e-12)
