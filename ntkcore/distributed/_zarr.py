"""Kernels in Zarr: chunked storage with per-tile completion markers, resume, one writer.

A kernel store is a Zarr v3 group (a local directory, flushed and read by ntkcore itself, or
any Zarr store through the Zarr API)::

    kernel    the kernel, one chunk per dask tile (uncompressed by default)
    tiles     uint64 (tile rows, tile columns[, 1, 1], 2): per done tile, its chunk file's
              size in bytes (0: no file, an all-fill-value tile) and CRC-32
    done      uint8 (tile rows, tile columns[, 1, 1]): 1 once the tile is durable
    attrs     {"ntkcore": {"format", "shape", "chunks", "dtype", "complete", "key",
               "symmetric", "fingerprint", "version"}}
    .ntkcore.lock   a local store's writer lock file (see :func:`to_zarr`)
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import socket
import threading
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any

import dask
import dask.array as da
import numpy as np
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from .._version import __version__
from ..modes import check_mode
from ..support import capabilities
from . import _fingerprint as fp
from ._cluster import compute

try:  # POSIX: flock, one lock per open file description, released by the kernel on exit
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]
try:  # Windows: a byte-range lock on the lock file, released by the system on exit
    import msvcrt
except ImportError:
    msvcrt = None  # type: ignore[assignment]

_ATTR = "ntkcore"
_FORMAT = 2  # 1: no per-tile records and no fingerprint (ntkcore before issue 15)
_OURS = ("done", "tiles", "kernel", "zarr.json")  # removed in this order by overwrite=True
_LOCK_NAME = ".ntkcore.lock"  # a local store's writer lock (not one of _OURS: never cleared)


class StoreLockedError(RuntimeError):
    """Another process (local or shared-file-system stores) or thread (any store) is writing
    the kernel store; raised by :func:`to_zarr` before anything is read or written.
    ``store`` is its location, ``holder`` what the writer recorded (pid, host, start time) or
    ``None``."""

    def __init__(self, message: str, store: Any, holder: str | None = None) -> None:
        super().__init__(message)
        self.store = store
        self.holder = holder


@dataclass(frozen=True)
class ZarrStatus:
    """Completion state of a kernel store.

    Attributes
    ----------
    shape, chunks : tuple of int
        Kernel shape and tile shape.
    tiles_done : int
        Tiles marked done whose chunk file passed the check (size, or checksum).
    tiles_total : int
    complete : bool
        Every tile is done and passed the check.
    key : str or None
        The user's label of what the kernel is (checked on resume).
    torn : tuple of tile indices
        Tiles marked done whose chunk file does not match what was recorded when they were
        written (truncated, replaced or, with ``checksums=True``, altered); a resume
        recomputes them and :func:`read_zarr` refuses the store until then.
    """

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    tiles_done: int
    tiles_total: int
    complete: bool
    key: str | None
    torn: tuple[tuple[int, ...], ...] = ()
    problems: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def describe_torn(self, limit: int = 5) -> str:
        """The torn tiles and what is wrong with each (at most ``limit`` listed)."""
        more = len(self.problems) - limit
        text = "; ".join(self.problems[:limit])
        return text + (f"; and {more} more" if more > 0 else "")


_SHARED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _shared_memory_store(pid: int, key: int, data: Any) -> Any:
    store = _SHARED.get(key) if pid == os.getpid() else None
    return zarr.storage.MemoryStore(data) if store is None else store  # elsewhere: a copy


class _SharedMemoryStore(zarr.storage.MemoryStore):
    """A MemoryStore that Dask tasks in this process use in place (Dask pickles task
    arguments even for in-process workers, and writes to a copy would be lost); workers in
    other processes get a copy, whose writes :func:`to_zarr` reports."""

    def __reduce__(self) -> Any:
        _SHARED[id(self)] = self
        return _shared_memory_store, (os.getpid(), id(self), self._store_dict)


def store_location(store: Any) -> Any:
    """A local directory (str; ntkcore flushes and reads its chunk files itself) for a path,
    a ``file://`` URL or a LocalStore; otherwise a Zarr store (an fsspec URL opened with
    ``FsspecStore``)."""
    if isinstance(store, zarr.storage.LocalStore):
        return str(store.root)
    if isinstance(store, zarr.storage.MemoryStore) and not isinstance(store, _SharedMemoryStore):
        return _SharedMemoryStore(store._store_dict, read_only=store.read_only)
    if isinstance(store, zarr.abc.store.Store):
        return store
    if not isinstance(store, str | os.PathLike):
        raise TypeError(f"store must be a path, an fsspec URL or a zarr store; got "
                        f"{type(store).__name__}")
    path = os.fsdecode(os.fspath(store))
    if path.startswith("file://"):
        return path[len("file://"):]
    return zarr.storage.FsspecStore.from_url(path) if "://" in path else path


# -- one writer per store ---------------------------------------------------------------------
_held: set[tuple[Any, ...]] = set()  # stores written by this process now (any thread)
_held_guard = threading.Lock()
_MSVCRT_BYTE = 1 << 20  # Windows locks a byte far past the holder's note, which stays readable
_OPEN = os.O_RDWR | getattr(os, "O_BINARY", 0)


class _Busy(Exception):
    """The OS lock is held by another open file (another process, or another open here)."""


def _identity(loc: Any) -> tuple[Any, ...]:
    """What makes two locations the same store within this process."""
    if isinstance(loc, str):
        return ("path", os.path.realpath(loc))
    if isinstance(loc, zarr.storage.MemoryStore):
        return ("memory", id(loc._store_dict))
    if isinstance(loc, zarr.storage.FsspecStore):
        return ("fsspec", str(loc.fs.protocol), loc.path)
    return ("store", id(loc))


def _os_lock(fd: int) -> str | None:
    """Lock ``fd`` exclusively without waiting.  None once locked; raises :class:`_Busy` when
    another open file holds the lock; otherwise the reason no lock is possible here."""
    if fcntl is None and msvcrt is None:
        return "this platform has neither fcntl nor msvcrt"
    if fcntl is None:
        os.lseek(fd, _MSVCRT_BYTE, os.SEEK_SET)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError as exc:
        busy = ((errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) if fcntl is not None
                else (errno.EACCES, errno.EDEADLK))
        if exc.errno in busy:
            raise _Busy from exc
        return f"the file system refused a lock ({exc.strerror or exc})"
    return None


def _os_unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    elif msvcrt is not None:
        os.lseek(fd, _MSVCRT_BYTE, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def _holder(fd: int) -> str | None:
    """What the lock's holder wrote about itself (None: not yet written, or unreadable)."""
    with contextlib.suppress(OSError):
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 512).decode("utf-8", "replace").strip()
        return text or None
    return None


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _locked_error(loc: Any, holder: str | None, who: str) -> StoreLockedError:
    return StoreLockedError(
        f"the store at {loc!r} is being written by {who}"
        + (f" ({holder})" if holder else "")
        + ": two writers of one store would mix their tiles. Wait for it to finish (then "
        "call again: a resume keeps its tiles), or stop it, or write to another store",
        loc, holder)


def _lock_directory(loc: str) -> int | None:
    """Take the writer lock of the local store ``loc`` (creating the directory); the lock
    file's descriptor, or None (with a warning) where the file system cannot lock.

    A holder unlinks the file before it unlocks it, so a writer that opened the file just
    before and then locks it finds it unlinked (or replaced) and tries again.
    """
    os.makedirs(loc, exist_ok=True)
    path = os.path.join(loc, _LOCK_NAME)
    while True:
        fd = os.open(path, _OPEN | os.O_CREAT, 0o644)
        try:
            why = _os_lock(fd)
        except _Busy:
            holder = _holder(fd)
            os.close(fd)
            raise _locked_error(loc, holder, "another process") from None
        except BaseException:
            os.close(fd)
            raise
        if why is not None:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(path)
            warnings.warn(f"cannot lock the store at {loc!r} ({why}): a second process "
                          "writing it at the same time will not be detected", UserWarning,
                          stacklevel=5)
            return None
        if _same_file(fd, path):
            break
        _os_unlock(fd)  # unlinked by the writer that held it: lock the file at path now
        os.close(fd)
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {stamp}\n".encode())
    return fd


def _unlock_directory(loc: str, fd: int) -> None:
    """Remove the lock file and release the lock (POSIX: remove first, see
    :func:`_lock_directory`; Windows cannot remove an open file: release first, and the
    removal fails harmlessly while another writer has it open)."""
    path = os.path.join(loc, _LOCK_NAME)
    try:
        if fcntl is not None and _same_file(fd, path):
            os.remove(path)
        _os_unlock(fd)
    finally:
        os.close(fd)
    if fcntl is None:
        with contextlib.suppress(OSError):
            os.remove(path)


def _raise_if_locked(loc: Any) -> None:
    """Raise :class:`StoreLockedError` if another writer holds ``loc`` now; touches nothing
    (a store another writer is creating can look foreign for a moment)."""
    with _held_guard:
        if _identity(loc) in _held:
            raise _locked_error(loc, None, "another thread of this process")
    if not isinstance(loc, str) or (fcntl is None and msvcrt is None):
        return
    try:
        fd = os.open(os.path.join(loc, _LOCK_NAME), _OPEN)
    except OSError:  # no lock file (or no directory): nobody holds it
        return
    try:
        if _os_lock(fd) is None:
            _os_unlock(fd)
    except _Busy:
        raise _locked_error(loc, _holder(fd), "another process") from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def _writer_lock(loc: Any) -> Any:
    """Hold the store ``loc`` for one writer for the duration of the block: across threads of
    this process for every store, across processes (and machines sharing the file system)
    for a local directory.  Released on return, error and interruption; a killed process's
    lock is released by the operating system."""
    ident = _identity(loc)
    with _held_guard:
        if ident in _held:
            raise _locked_error(loc, None, "another thread of this process")
        _held.add(ident)
    try:
        fd = _lock_directory(loc) if isinstance(loc, str) else None
        try:
            yield
        finally:
            if fd is not None:
                _unlock_directory(loc, fd)
    finally:
        with _held_guard:
            _held.discard(ident)


def _key(arr: Any, index: tuple[int, ...]) -> str:
    """The store key of tile ``index`` of the ``kernel`` array ``arr``."""
    return "kernel/" + arr.metadata.encode_chunk_key(tuple(int(i) for i in index))


def _tile_record(loc: Any, key: str, *, checksum: bool = True, flush: bool = False
                 ) -> tuple[int, int]:
    """(size in bytes, CRC-32) of a stored chunk; (0, 0) if there is none.  ``flush``: fsync
    a local chunk file and its directory first."""
    if not isinstance(loc, str):
        try:
            if not checksum:
                return int(sync(loc.getsize(key))), 0
        except FileNotFoundError:
            return 0, 0
        buf = sync(loc.get(key, prototype=default_buffer_prototype()))
        data = b"" if buf is None else buf.to_bytes()
        return len(data), zlib.crc32(data) if data else 0
    name = os.path.join(loc, *key.split("/"))
    try:
        fd = os.open(name, os.O_RDONLY)
    except FileNotFoundError:
        return 0, 0
    try:
        if flush:
            os.fsync(fd)
            with contextlib.suppress(OSError):  # platforms without directory descriptors
                dir_fd = os.open(os.path.dirname(name), os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        size = os.fstat(fd).st_size
        crc = 0
        if checksum and size:
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as view:
                crc = zlib.crc32(view)
        return int(size), int(crc)
    finally:
        os.close(fd)


def _set_record(loc: Any, index: tuple[int, ...], size: int, crc: int, done: bool = True
                ) -> None:
    """Record a written tile's chunk, then (with ``done``) set its marker: in that order."""
    rec = zarr.open_array(store=loc, path="tiles", mode="r+")
    rec[(*(slice(i, i + 1) for i in index), slice(None))] = np.array(
        [size, crc], dtype=np.uint64).reshape((1,) * len(index) + (2,))
    if done:
        zarr.open_array(store=loc, path="done", mode="r+")[tuple(slice(i, i + 1)
                                                                for i in index)] = 1


_mark_done = _set_record  # tests interrupt a run here


def _write_tile(tile: np.ndarray, loc: Any, index: tuple[int, ...],
                region: tuple[slice, ...]) -> int:
    """Write one tile, flush it, then mark it done (a tile is marked only once its data is
    durable: an interruption before the marker leaves it not done)."""
    arr = zarr.open_array(store=loc, path="kernel", mode="r+")
    arr[region] = tile
    _mark_done(loc, index, *_tile_record(loc, _key(arr, index), flush=True))
    return 1


def open_meta(loc: Any) -> tuple[Any, dict[str, Any]]:
    try:
        group = zarr.open_group(store=loc, mode="r")
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError
            ) as exc:
        raise FileNotFoundError(f"no ntkcore kernel store at {loc!r}") from exc
    except zarr.errors.ContainsArrayError as exc:
        raise ValueError(f"{loc!r} is a Zarr array, not an ntkcore kernel store") from exc
    meta = group.attrs.asdict().get(_ATTR)
    if not isinstance(meta, dict) or "shape" not in meta:
        raise ValueError(f"{loc!r} is a Zarr group but not an ntkcore kernel store")
    return group, dict(meta)


def zarr_status(store: Any, *, checksums: bool = False) -> ZarrStatus:
    """How much of the kernel at ``store`` is written (:class:`ZarrStatus`).

    Every tile marked done is checked against the size of its chunk recorded when it was
    written (one ``stat`` per tile); ``checksums=True`` also reads every chunk and compares
    its CRC-32 (reads the whole kernel).  Tiles that fail are reported in ``torn`` and not
    counted as done.
    """
    loc = store_location(store)
    group, meta = open_meta(loc)
    if "done" not in group or "kernel" not in group:
        raise ValueError(f"the ntkcore kernel store at {loc!r} is damaged (its 'done' or "
                         "'kernel' array is missing); rewrite it with overwrite=True")
    done = np.asarray(group["done"][...]).astype(bool)
    # tiles marked done whose chunk does not match its record -> what is wrong
    kernel = group["kernel"]
    records = np.asarray(group["tiles"][...]) if "tiles" in group else None
    expected_raw = None
    if records is None and not tuple(kernel.compressors) and not tuple(kernel.filters):
        # a store of format 1: an uncompressed chunk file has a known size
        expected_raw = int(np.prod(meta["chunks"])) * np.dtype(meta["dtype"]).itemsize
    bad: dict[tuple[int, ...], str] = {}
    for index in zip(*np.nonzero(done), strict=True):
        idx = tuple(int(i) for i in index)
        where = _key(kernel, idx)
        head = f"tile {idx}: chunk file {where}"
        if records is not None:
            want_size, want_crc = (int(v) for v in records[idx])
            size, crc = _tile_record(loc, where, checksum=checksums and want_size > 0)
            if size != want_size:
                bad[idx] = (f"{head} has {size} bytes, {want_size} were written" if want_size
                            else f"{head} should not exist (the tile was written as all fill "
                            f"values) but has {size} bytes")
            elif checksums and crc != want_crc:
                bad[idx] = f"{head} has CRC-32 {crc:08x}, {want_crc:08x} was written"
        elif expected_raw is not None:
            size, _ = _tile_record(loc, where, checksum=False)
            if size not in (0, expected_raw):
                bad[idx] = f"{head} has {size} bytes, an uncompressed tile has {expected_raw}"
    torn = tuple(sorted(bad))
    n_done = int(done.sum()) - len(torn)
    return ZarrStatus(shape=tuple(meta["shape"]), chunks=tuple(meta["chunks"]),
                      tiles_done=n_done, tiles_total=int(done.size),
                      complete=n_done == done.size, key=meta.get("key"), torn=torn,
                      problems=tuple(bad[i] for i in torn))


def _existing_store(loc: Any) -> dict[str, Any] | None:
    """The ntkcore metadata of the store at ``loc``; None for a missing or empty one;
    ValueError for a file or a directory or store that is not an ntkcore kernel store."""
    if not isinstance(loc, str):
        async def names() -> list[str]:
            return sorted([k async for k in loc.list_dir("")])

        entries = sync(names())
    elif not os.path.isdir(loc):
        if os.path.lexists(loc):
            raise ValueError(f"store {loc!r} exists and is not a directory; ntkcore will not "
                             "replace it (even with overwrite=True): choose another path")
        return None
    else:
        entries = sorted(e for e in os.listdir(loc) if e != _LOCK_NAME)
    if not entries:
        return None
    try:
        meta = open_meta(loc)[1] if "zarr.json" in entries else None
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        meta = None
    if meta is None:
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)"
                                          if len(entries) > 5 else "")
        raise ValueError(
            f"store {loc!r} is not an ntkcore kernel store: it holds {shown}. ntkcore neither "
            "writes into nor deletes a directory or store it did not create, even with "
            "overwrite=True: pass a new or empty one"
        )
    return meta


def _clear_store(loc: Any) -> None:
    """Delete an ntkcore store's own entries (markers first); leave anything else there."""
    for name in _OURS:
        if not isinstance(loc, str):
            sync(loc.delete(name) if name == "zarr.json" else loc.delete_dir(name))
            continue
        full = os.path.join(loc, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        elif os.path.lexists(full):
            os.remove(full)


def _check_identity(loc: Any, old: dict[str, Any], meta: dict[str, Any],
                    key: str | None) -> None:
    """Refuse to resume a store that holds another computation (see :func:`to_zarr`)."""
    same = (old["shape"] == meta["shape"] and old["chunks"] == meta["chunks"]
            and old["dtype"] == meta["dtype"] and old.get("key") == key)
    if not same:
        raise ValueError(
            f"the store at {loc!r} holds a different kernel (shape {old['shape']}, chunks "
            f"{old['chunks']}, dtype {old['dtype']}, key {old.get('key')!r}; this call: shape "
            f"{meta['shape']}, chunks {meta['chunks']}, dtype {meta['dtype']}, key {key!r}); "
            "pass overwrite=True to replace it, or another store"
        )
    differ, unknown = fp.compare(old.get("fingerprint"), meta["fingerprint"])
    labels = [fp.LABELS.get(k, k) for k in differ]
    if key is not None:
        if differ:
            warnings.warn(
                f"resuming the store at {loc!r} because key={key!r} matches, but these "
                f"differ from the run that started it: {'; '.join(labels)}. The key is your "
                "promise that the kernel is the same; pass overwrite=True if it is not",
                UserWarning, stacklevel=5)
        return
    if differ:
        raise ValueError(
            f"the store at {loc!r} holds tiles of another computation: "
            f"{'; '.join(labels)} differ from the run that started it. Pass overwrite=True "
            "to replace it, or another store"
        )
    if unknown:
        what = ", ".join(fp.LABELS.get(k, k) for k in unknown)
        raise ValueError(
            f"cannot prove that the store at {loc!r} holds this computation ({what} could "
            "not be fingerprinted, or the store was written without one by an older ntkcore). "
            "Pass overwrite=True to replace it, another store, or the same key= on every call "
            "(your promise that the kernel is the same)"
        )


def _resume(loc: Any, old: dict[str, Any], meta: dict[str, Any], key: str | None,
            resume: bool, checksums: bool) -> np.ndarray:
    """Check that the store holds this computation and prepare it for a resume: unmark its
    torn tiles, give a store of format 1 (resumed with its key) the per-tile records of
    format 2.  Returns the done markers."""
    _check_identity(loc, old, meta, key)
    status = zarr_status(loc, checksums=checksums)
    if not resume and not status.complete:
        raise ValueError(f"the store at {loc!r} exists ({status.tiles_done}/"
                         f"{status.tiles_total} tiles); pass resume=True or overwrite=True")
    group = zarr.open_group(store=loc, mode="r+")
    done = np.asarray(group["done"][...]).astype(bool)
    if status.torn:
        # unmark first: a run interrupted while recomputing them leaves them not done
        for idx in status.torn:
            group["done"][tuple(slice(i, i + 1) for i in idx)] = 0
            done[idx] = False
        old["complete"] = False
    if "tiles" not in group:  # format 1: its done tiles passed the size check above
        grid = done.shape
        group.create_array(name="tiles", shape=(*grid, 2), chunks=(1,) * len(grid) + (2,),
                           dtype="uint64", fill_value=0)
        for index in zip(*np.nonzero(done), strict=True):
            _set_record(loc, index, *_tile_record(loc, _key(group["kernel"], index)), False)
        old.update(format=_FORMAT, fingerprint=old.get("fingerprint") or meta["fingerprint"])
    group.attrs.update({_ATTR: old})
    return done


def to_zarr(
    kernel: da.Array,
    store: Any,
    *,
    resume: bool = True,
    overwrite: bool = False,
    key: str | None = None,
    client: Any = None,
    progress: Any = None,
    compressors: Any = None,
    symmetric: bool = False,
    checksums: bool = False,
    _fingerprint: dict[str, str | None] | None = None,
) -> ZarrStatus:
    """Write a dask kernel to a Zarr store tile by tile, skipping tiles already written.

    Parameters
    ----------
    kernel : dask.array.Array
        E.g. from :func:`ntk_dask`; its chunks become the Zarr chunks (regular grid).
    store : str, PathLike, fsspec URL or zarr store
        A directory (new, empty, or an ntkcore kernel store), a ``LocalStore``, a
        ``MemoryStore`` or any other Zarr store, or an fsspec URL (``"memory://k.zarr"``,
        ``"s3://..."``).  A file, or a directory or store with other content, is refused
        (``ValueError``), even with ``overwrite``.  Stores other than local directories go
        through the Zarr API (a ``MemoryStore`` needs Dask workers in this process).
    resume : bool, default True
        If the store holds the same computation (same shape, chunks, dtype and ``key``, and
        with ``key=None`` the same fingerprint: dask's name for ``kernel``, or for
        :func:`ntk_to_zarr` a hash of parameters, inputs and options), compute only the tiles
        not marked done or failing their check; otherwise ``ValueError`` naming what differs.
        ``False`` with an existing incomplete store raises unless ``overwrite``.
    overwrite : bool, default False
        Replace an existing ntkcore store (only its own entries are deleted).
    key : str, optional
        Your label of the kernel's content (model, data, mode).  A resume needs the same key
        as the run that created the store; with a key, ntkcore trusts it and resumes even if
        the fingerprint differs (it warns, naming what differs).  Use it when the fingerprint
        cannot be derived (a model of a custom provider) or changes although the kernel does
        not.
    client, progress
        Where the tiles are computed: a ``distributed.Client`` or scheduler address, or
        ``None``: where dask computes (the default client, else dask's default scheduler).
        ``progress`` is ``True`` (Dask's bar) or ``progress(done, total)`` over the tiles
        computed in this call.
    compressors
        Zarr compressors (default ``None``: uncompressed, which :class:`ZarrMatrixOperator`
        reads as plain file reads; a compressed store is decoded on every CG product).
    symmetric : bool, default False
        Record that the kernel is symmetric (square tiles, ``K = K^T``), so that
        products with the stored kernel read only tiles on and above the diagonal.
        :func:`ntk_to_zarr` sets it for ``x2=None`` in ``"trace"`` mode.
    checksums : bool, default False
        On resume, also verify the CRC-32 of every tile marked done (reads the stored
        kernel once); by default only the chunks' sizes are checked.

    Returns
    -------
    ZarrStatus

    Raises
    ------
    StoreLockedError
        Another writer is writing ``store`` now (see Notes); raised at once, before the store
        is read for a resume or changed.  A subclass of ``RuntimeError``.
    ValueError
        ``store`` is not an ntkcore store; it holds another computation (the message names
        what differs); or it is incomplete and ``resume=False``.

    Notes
    -----
    One writer at a time (docs/distributed.md, "One writer at a time").  A local store is
    locked for the call by the calling process with an OS advisory lock (``flock``,
    ``msvcrt.locking``) on ``.ntkcore.lock``: a second writer on this machine, on one sharing
    the file system (where it supports locks) or in another thread gets
    :class:`StoreLockedError`.  The lock is released on return, error, interruption or
    process death; a file system that refuses locks gets a ``UserWarning``.  Other stores
    have no lock file: only a second writer in this process is refused.  Readers take no
    lock.  Each tile is written, flushed (``fsync``), recorded (size, CRC-32) and only then
    marked done.
    """
    if not isinstance(kernel, da.Array):
        raise TypeError(f"kernel must be a dask array; got {type(kernel).__name__}")
    loc = store_location(store)
    for axis, c in enumerate(kernel.chunks):
        if len(c) > 1 and (len(set(c[:-1])) > 1 or c[-1] > c[0]):
            raise ValueError(f"kernel chunks along axis {axis} are irregular ({c}); rechunk "
                             "to a regular grid before writing to Zarr")
    chunks = tuple(int(c[0]) for c in kernel.chunks)
    meta = {"format": _FORMAT, "shape": [int(s) for s in kernel.shape], "chunks": list(chunks),
            "dtype": str(kernel.dtype), "key": key, "complete": False,
            "symmetric": bool(symmetric), "version": __version__,
            "fingerprint": _fingerprint or {"dask graph": fp._text_digest(str(kernel.name))}}
    try:  # refuse a file or a foreign directory before creating anything in it
        _existing_store(loc)
    except ValueError:
        _raise_if_locked(loc)  # unless it is a store that another writer is creating now
        raise
    with _writer_lock(loc):  # one writer at a time; resume checks and writes all under it
        return _write(kernel, loc, meta, resume=resume, overwrite=overwrite, key=key,
                      client=client, progress=progress, compressors=compressors,
                      checksums=checksums)


def _write(kernel: da.Array, loc: Any, meta: dict[str, Any], *, resume: bool, overwrite: bool,
           key: str | None, client: Any, progress: Any, compressors: Any, checksums: bool
           ) -> ZarrStatus:
    """The body of :func:`to_zarr`, run while holding the store's writer lock."""
    chunks, grid = tuple(meta["chunks"]), tuple(len(c) for c in kernel.chunks)
    old = _existing_store(loc)
    if old is not None and not overwrite:
        done = _resume(loc, old, meta, key, resume, checksums)
    else:
        if old is not None:
            _clear_store(loc)
        if isinstance(loc, str):
            os.makedirs(loc, exist_ok=True)
        group = zarr.open_group(store=loc, mode="a")  # holds none of ours now
        group.create_array(name="kernel", shape=kernel.shape, chunks=chunks, dtype=kernel.dtype,
                           compressors=compressors, fill_value=0)
        group.create_array(name="tiles", shape=(*grid, 2), chunks=(1,) * len(grid) + (2,),
                           dtype="uint64", fill_value=0)
        group.create_array(name="done", shape=grid, chunks=(1,) * len(grid), dtype="uint8",
                           fill_value=0)
        group.attrs.update({_ATTR: meta})
        done = np.zeros(grid, dtype=bool)

    # tile index -> its region of the kernel, in the same (C) order
    todo = [(idx, region) for idx, region in zip(np.ndindex(grid),
                                                 da.core.slices_from_chunks(kernel.chunks),
                                                 strict=True) if not done[idx]]
    if todo:
        blocks = kernel.to_delayed(optimize_graph=False)
        write = dask.delayed(_write_tile, pure=False)
        compute([write(blocks[idx], loc, idx, region) for idx, region in todo], client, progress)
    status = zarr_status(loc)
    if not status.complete:
        raise RuntimeError(
            f"the store at {loc!r} holds {status.tiles_done}/{status.tiles_total} tiles after "
            "all of them were written: another process changed it, or the workers wrote to "
            "their own copy of a store in this process's memory (a MemoryStore needs workers "
            "in this process: dask's threaded scheduler or a Client(processes=False))")
    group = zarr.open_group(store=loc, mode="r+")
    group.attrs.update({_ATTR: {**group.attrs.asdict()[_ATTR], "complete": True}})
    return status


@capabilities(name="distributed.ntk_to_zarr", missing=("array_api_strict",))
def ntk_to_zarr(
    model: Any,
    x1: Any,
    x2: Any = None,
    *,
    store: Any,
    client: Any = None,
    resume: bool = True,
    overwrite: bool = False,
    key: str | None = None,
    progress: Any = None,
    checksums: bool = False,
    **ntk_options: Any,
) -> ZarrStatus:
    """:func:`ntk_dask` followed by :func:`to_zarr` (one call; resumable).

    ``ntk_options`` (``mode``, ``chunks``, ``params``, ``dtype``, ...) are those of
    :func:`ntk_dask`; the other arguments those of :func:`to_zarr`.  Only the tiles missing
    from ``store`` are computed (and only the Jacobian chunks they need).  The store is
    uncompressed; a symmetric trace kernel (``x2=None``) is recorded as symmetric.

    With ``key=None`` the store records a fingerprint (SHA-256 digests of the model's
    parameters and structure, the parameter selection, the inputs, ``mode``, ``dtype`` and
    ntkcore's version; docs/distributed.md) and a resume on a store whose fingerprint differs
    is refused, naming the differing parts; a model of an unknown provider has none and needs
    ``key``.  A second writer of the store gets :class:`StoreLockedError`, as in
    :func:`to_zarr`.
    """
    from ._ntk import ntk_dask

    kernel = ntk_dask(model, x1, x2, **ntk_options)
    options = dict(ntk_options)
    mode, params = options.pop("mode", "trace"), options.pop("params", None)
    matrix = not check_mode(mode).tail_axes  # a 2-D kernel: a symmetric matrix for x2=None
    fingerprint = fp.kernel_fingerprint(model, x1, x2, mode=mode, params=params,
                                        options=options)
    return to_zarr(kernel, store, resume=resume, overwrite=overwrite, key=key, client=client,
                   progress=progress, symmetric=x2 is None and matrix,
                   checksums=checksums, _fingerprint=fingerprint)


def read_zarr(store: Any, *, require_complete: bool = True, checksums: bool = False
              ) -> da.Array:
    """The kernel in ``store`` as a dask array (chunks = the stored tiles).

    The returned array remembers its store: :func:`ntkcore.cg_solve` and
    ``kernel_regression(..., solver="cg")`` given it directly (not a slice or other
    expression of it) multiply through :class:`ZarrMatrixOperator`, which reads each tile
    once per product on the workers.

    The store is checked as :func:`zarr_status` checks it (``checksums`` likewise).

    Raises
    ------
    ValueError
        With ``require_complete`` (default) when some tiles are missing or torn; the
        message says how many, which tiles are torn, and how to resume.
    """
    loc = store_location(store)
    status = zarr_status(loc, checksums=checksums)
    if require_complete:
        check_complete(loc, status, ", or pass require_complete=False (missing tiles read as 0)")
    k = da.from_zarr(loc, component="kernel")
    k._ntkcore_zarr_store = loc  # picked up by DaskMatrixOperator (fast product path)
    return k


def check_complete(loc: Any, status: ZarrStatus, more: str = "") -> None:
    if status.complete:
        return
    text = (f"the kernel at {loc!r} is incomplete ({status.tiles_done}/{status.tiles_total} "
            "tiles written")
    if status.torn:
        text += (f"; {len(status.torn)} marked done but damaged: {status.describe_torn()}")
    raise ValueError(text + "); finish it with ntk_to_zarr(..., resume=True) (or to_zarr)" + more)
