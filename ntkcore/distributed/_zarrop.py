"""Products with a kernel stored in Zarr (:class:`ZarrMatrixOperator`), computed on the Dask
workers straight from the store."""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import threading
from typing import Any

import numpy as np
import zarr

from .._cache import LRUCache
from .._validation import check_size
from ..cg import LinearOperator
from ..tiling import TileGrid, bounds
from ._cluster import get_client
from ._ntk import back_to_namespace, to_numpy

_ROWS = 64  # rows per upcast block: 64 x 4000 float64 = 2 MB, stays in cache
_local = threading.local()  # per worker thread: open Zarr arrays


def _plan(loc: Any, arr: Any) -> dict[str, Any]:
    """What a worker needs to read tiles: chunk grid, dtype and, for an uncompressed store in
    a local directory, the chunk files' layout (``raw``)."""
    key = arr.metadata.encode_chunk_key((0, 0))
    raw = (isinstance(loc, str) and key in ("c/0/0", "c.0.0") and not tuple(arr.filters)
           and not tuple(arr.compressors) and type(arr.serializer).__name__ == "BytesCodec")
    endian = getattr(getattr(arr.serializer, "endian", None), "value", "little") if raw else ""
    dtype = np.dtype(arr.dtype)
    (n1, n2), (c1, c2) = arr.shape, arr.chunks
    return {
        "path": loc,
        "rows": bounds(int(n1), int(c1)),  # (start, stop) of the tile rows and columns
        "cols": bounds(int(n2), int(c2)),
        "chunks": (int(c1), int(c2)),
        "dtype": dtype.str,
        "disk_dtype": dtype.newbyteorder(">" if endian == "big" else "<").str,
        "fill": float(arr.fill_value or 0),
        "raw": raw,
        "sep": key[1],
    }


def _zarr_array(loc: Any) -> Any:
    arrays = _local.__dict__.setdefault("arrays", LRUCache(9))
    return arrays.get(loc if isinstance(loc, str) else id(loc),
                      lambda: zarr.open_array(store=loc, path="kernel", mode="r"))


def _read_tile(plan: dict[str, Any], i: int, j: int) -> np.ndarray:
    """Tile (i, j) of the stored kernel; of a raw store, a read-only memory map of its chunk
    file (unmapped when the array is garbage collected)."""
    (r0, r1), (c0, c1) = plan["rows"][i], plan["cols"][j]
    if not plan["raw"]:
        return np.asarray(_zarr_array(plan["path"])[r0:r1, c0:c1])
    ch0, ch1 = plan["chunks"]
    disk = np.dtype(plan["disk_dtype"])
    nbytes = ch0 * ch1 * disk.itemsize  # Zarr stores edge chunks at full size
    sep = plan["sep"]
    name = os.path.join(plan["path"], "kernel", *f"c{sep}{i}{sep}{j}".split("/"))
    try:
        fd = os.open(name, os.O_RDONLY)
    except FileNotFoundError:  # Zarr leaves chunks equal to the fill value unwritten
        return np.full((r1 - r0, c1 - c0), plan["fill"], dtype=np.dtype(plan["dtype"]))
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise OSError(f"chunk file {name} has {size} bytes, expected {nbytes} (an "
                          f"uncompressed {ch0}x{ch1} {disk} chunk)")
        mapped = mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    tile = np.frombuffer(mapped, dtype=disk).reshape(ch0, ch1)[: r1 - r0, : c1 - c0]
    return tile if disk.isnative else tile.astype(np.dtype(plan["dtype"]))


def accumulate(t: np.ndarray, v: np.ndarray, out: np.ndarray, rows: tuple[int, int],
                cols: tuple[int, int], mirror: bool, dtype: np.dtype) -> None:
    r"""out[rows] += t @ v[cols]; with ``mirror`` also out[cols] += t^T @ v[rows].

    Computed in ``dtype``: if it is wider than the tile's, the tile is upcast in blocks of
    ``_ROWS`` rows (each block is used for both products while it is in cache).  The loop
    reuses preallocated buffers: Dask workers set a small ``MALLOC_TRIM_THRESHOLD_``, which
    makes every large temporary a fresh, page-faulting ``mmap``.
    """
    r0, r1 = rows
    c0, c1 = cols
    vc = v[c0:c1]
    k = v.shape[1]
    if t.dtype == dtype:
        out[r0:r1] += t @ vc
        if mirror:
            out[c0:c1] += t.T @ v[r0:r1]
        return
    blk = np.empty((_ROWS, c1 - c0), dtype=dtype)
    tmp = np.empty((_ROWS, k), dtype=dtype)
    acc = np.zeros((c1 - c0, k), dtype=dtype) if mirror else None
    tmp2 = np.empty((c1 - c0, k), dtype=dtype) if mirror else None
    for s in range(0, r1 - r0, _ROWS):
        e = min(r1 - r0, s + _ROWS)
        b = blk[: e - s]
        b[...] = t[s:e]  # upcast copy, in cache
        np.matmul(b, vc, out=tmp[: e - s])
        out[r0 + s:r0 + e] += tmp[: e - s]
        if acc is not None:
            np.matmul(b.T, v[r0 + s:r0 + e], out=tmp2)
            acc += tmp2
    if acc is not None:
        out[c0:c1] += acc


def _product_task(plan: dict[str, Any], tiles: list[tuple[int, int]], v: np.ndarray,
                  dtype: str, symmetric: bool) -> np.ndarray:
    """Partial K V over ``tiles`` (on a worker): (N, k) in ``dtype``."""
    out = np.zeros((plan["rows"][-1][1], v.shape[1]), dtype=dtype)
    vv = v.astype(out.dtype, copy=False)
    for i, j in tiles:
        accumulate(_read_tile(plan, i, j), vv, out, plan["rows"][i], plan["cols"][j],
                    symmetric and j != i, out.dtype)
    return out


def _diagonal_task(plan: dict[str, Any], i: int) -> np.ndarray:
    return np.array(np.diagonal(_read_tile(plan, i, i)))


def _rows_task(plan: dict[str, Any], rows: list[int]) -> np.ndarray:
    """Whole rows K[rows, :] (len(rows), N); raw tiles are memory-mapped, so only the pages
    of those rows are read."""
    ch0, nb = plan["chunks"][0], len(plan["cols"])
    out = np.empty((len(rows), plan["cols"][-1][1]), dtype=np.dtype(plan["dtype"]))
    for a, r in enumerate(rows):
        out[a] = np.concatenate([_read_tile(plan, r // ch0, j)[r % ch0] for j in range(nb)])
    return out


def _cols_task(plan: dict[str, Any], j: int, local: list[int]) -> np.ndarray:
    """Columns ``j * chunk + local`` of the kernel (N, len(local)), reading tile column j."""
    return np.concatenate([_read_tile(plan, i, j)[:, local] for i in range(len(plan["rows"]))],
                          axis=0)


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    parts = max(1, min(parts, len(items)))
    edges = [len(items) * p // parts for p in range(parts + 1)]
    return [items[a:b] for a, b in itertools.pairwise(edges)]


class ZarrMatrixOperator(LinearOperator):
    r"""A square kernel stored in Zarr, as a linear operator whose products run on the workers.

    With tiles :math:`K_{ij}`, :math:`U = K V` is :math:`U_i = \sum_j K_{ij} V_j`; a symmetric
    kernel reads only the B(B+1)/2 tiles :math:`j \ge i` of the B x B grid:
    :math:`U_i \mathrel{+}= K_{ij} V_j`, :math:`U_j \mathrel{+}= K_{ij}^\top V_i` (:math:`j > i`).
    A product is about ``tasks_per_worker`` tasks per worker thread, each reading a run of
    tiles one at a time (uncompressed local stores memory-mapped, through the OS page cache)
    and summing its share of U; the client adds the partial results.  The kernel is never
    gathered.  ``ntkcore.cg_solve(read_zarr(store), ...)`` uses this operator automatically.

    Parameters
    ----------
    store : str, PathLike, fsspec URL or zarr store
        A store written by :func:`to_zarr` / :func:`ntk_to_zarr` (complete, 2-D, square).
        A local directory is memory-mapped; other stores are read through Zarr (workers in
        other processes read a copy of a ``MemoryStore``).
    client : distributed.Client, scheduler address or None
        Where the products run (see :func:`get_client`; ``None``: the default client).
    symmetric : bool, optional
        Read only tiles on and above the diagonal.  Default: what the store records
        (``ntk_to_zarr`` with ``x2=None`` and ``mode="trace"`` records ``True``).  Requires
        square tiles.
    product_dtype : dtype, optional
        Dtype of :meth:`matmat` products.  Default: the wider of the kernel's and the vectors'
        (float32 tiles times float64 vectors are upcast blockwise: exact float64 products of
        the stored values).  Pass ``"float32"`` for faster, float32-accurate products.
    tasks_per_worker : int, default 2
        Tasks per worker thread and product (load balance vs per-task overhead).

    Attributes
    ----------
    shape : (N, N)
    dtype : dtype
        The stored kernel's dtype.
    chunks : (int, int)
        Tile shape of the store.
    raw : bool
        Whether tiles are read as plain files (uncompressed stores).
    products : int
        Products computed so far (each reads the kernel once).
    """

    def __init__(self, store: Any, *, client: Any = None, symmetric: bool | None = None,
                 product_dtype: Any = None, tasks_per_worker: int = 2) -> None:
        from ._zarr import check_complete, open_meta, store_location, zarr_status

        path = store_location(store)
        check_complete(path, zarr_status(path))
        group, meta = open_meta(path)
        arr = group["kernel"]
        if len(arr.shape) != 2 or arr.shape[0] != arr.shape[1]:
            raise ValueError(f"the kernel at {path!r} must be square (N, N) for products; got "
                             f"shape {tuple(arr.shape)}")
        if symmetric is None:
            symmetric = bool(meta.get("symmetric", False))
        if symmetric and arr.chunks[0] != arr.chunks[1]:
            raise ValueError(f"symmetric=True needs square tiles; the store has tiles "
                             f"{tuple(arr.chunks)}")
        self.path = path
        self.client = client
        self.symmetric = bool(symmetric)
        self.product_dtype = None if product_dtype is None else np.dtype(product_dtype)
        self.tasks_per_worker = check_size(tasks_per_worker, "tasks_per_worker")
        self.dtype = np.dtype(arr.dtype)
        self.shape = (int(arr.shape[0]), int(arr.shape[1]))
        self.chunks = (int(arr.chunks[0]), int(arr.chunks[1]))
        self._plan = _plan(path, arr)
        self.raw = bool(self._plan["raw"])
        self.products = 0
        self._tiles = TileGrid(*self.shape, *self.chunks, symmetric=self.symmetric).schedule()

    def __repr__(self) -> str:
        return (f"ZarrMatrixOperator({self.path!r}, shape={self.shape}, chunks={self.chunks}, "
                f"dtype={self.dtype}, symmetric={self.symmetric}, raw={self.raw})")

    def _product(self, v: Any, dtype: np.dtype) -> Any:
        host = np.asarray(to_numpy(v))
        vector = host.ndim == 1
        mat = host[:, None] if vector else host
        if mat.ndim != 2 or mat.shape[0] != self.shape[1]:
            raise ValueError(f"v must have shape ({self.shape[1]},) or ({self.shape[1]}, k); "
                             f"got {tuple(host.shape)}")
        client = get_client(self.client)
        threads = max(1, sum(client.nthreads().values()))
        groups = _split(self._tiles, self.tasks_per_worker * threads)
        vf = client.scatter(np.ascontiguousarray(mat.astype(dtype, copy=False)), hash=False)
        futures = [client.submit(_product_task, self._plan, g, vf, dtype.str, self.symmetric,
                                 pure=False) for g in groups]
        out = functools.reduce(np.add, client.gather(futures))
        del vf, futures
        self.products += 1
        return back_to_namespace(out[:, 0] if vector else out, v)

    def matmat(self, v: Any) -> Any:
        """:math:`K V` (N, k) -> (N, k), in the namespace, device and dtype of ``v``."""
        host_dtype = np.dtype(to_numpy(v[:1]).dtype)
        return self._product(v, self.product_dtype or np.promote_types(self.dtype, host_dtype))

    def sketch(self, v: Any) -> Any:
        """:math:`K V` in the kernel's dtype (for preconditioners: fast, less precise)."""
        return self._product(v, self.dtype)

    def diagonal(self, like: Any) -> Any:
        """The diagonal of K (N,), reading the diagonal tiles."""
        client = get_client(self.client)
        nd = min(len(self._plan["rows"]), len(self._plan["cols"]))
        futures = [client.submit(_diagonal_task, self._plan, i, pure=False) for i in range(nd)]
        return back_to_namespace(np.concatenate(client.gather(futures)), like)

    def columns(self, idx: list[int], like: Any) -> Any:
        """Columns ``K[:, idx]`` (N, len(idx)); a symmetric kernel reads rows instead."""
        idx = [int(i) for i in idx]
        n = self.shape[1]
        if any(i < 0 or i >= n for i in idx):
            raise IndexError(f"column indices must lie in [0, {n}); got {idx}")
        client = get_client(self.client)
        if self.symmetric:
            groups = _split(idx, max(1, min(len(idx) // 16, sum(client.nthreads().values()))))
            futures = [client.submit(_rows_task, self._plan, g, pure=False) for g in groups]
            out = np.concatenate(client.gather(futures), axis=0).T
        else:
            # one task per strip of tile columns; columns come back ordered by strip
            c = self.chunks[1]
            futures = [client.submit(_cols_task, self._plan, j, [i % c for i in idx if i // c == j],
                                     pure=False) for j in sorted({i // c for i in idx})]
            got = np.concatenate(client.gather(futures), axis=1)
            out = np.empty_like(got)
            out[:, sorted(range(len(idx)), key=lambda p: idx[p] // c)] = got
        return back_to_namespace(out, like)
