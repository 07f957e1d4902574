"""Kernels in Zarr: chunked storage with per-tile completion markers, and resume.

Layout of a kernel store (a Zarr v3 group at a path)::

    <store>/kernel   the kernel, chunks = the dask tiles (no compression by default:
                     kernel values compress poorly and compression costs CPU per tile)
    <store>/done     uint8 (tile rows, tile columns[, 1, 1]); 1 once a tile is fully written
    attrs            {"ntkcore": {"shape", "chunks", "dtype", "complete", "key"}}

Each tile task writes its tile (exactly one Zarr chunk, so writers never share a chunk) and
then its marker (its own chunk of ``done``).  A run that dies leaves finished tiles marked;
writing again with ``resume=True`` computes only the unmarked ones.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import dask
import dask.array as da
import numpy as np
import zarr

from ._cluster import get_client, wait_with_progress

_ATTR = "ntkcore"


@dataclass(frozen=True)
class ZarrStatus:
    """Completion state of a kernel store.

    Attributes
    ----------
    shape, chunks : tuple of int
        Kernel shape and tile shape.
    tiles_done, tiles_total : int
    complete : bool
    key : str or None
        The user's label of what the kernel is (checked on resume).
    """

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    tiles_done: int
    tiles_total: int
    complete: bool
    key: str | None


def _path(store: Any) -> str:
    if not isinstance(store, str | os.PathLike):
        raise TypeError(f"store must be a filesystem path (str or PathLike); got "
                        f"{type(store).__name__}")
    return os.fspath(store)


def _regular_chunks(k: da.Array) -> tuple[int, ...]:
    out = []
    for axis, c in enumerate(k.chunks):
        if len(c) > 1 and (len(set(c[:-1])) > 1 or c[-1] > c[0]):
            raise ValueError(f"kernel chunks along axis {axis} are irregular ({c}); rechunk "
                             "to a regular grid before writing to Zarr")
        out.append(int(c[0]))
    return tuple(out)


def _write_tile(tile: np.ndarray, path: str, index: tuple[int, ...],
                region: tuple[slice, ...]) -> int:
    arr = zarr.open_array(store=path, path="kernel", mode="r+")
    arr[region] = tile
    done = zarr.open_array(store=path, path="done", mode="r+")
    done[tuple(slice(i, i + 1) for i in index)] = 1
    return 1


def zarr_status(store: Any) -> ZarrStatus:
    """How much of the kernel at ``store`` is written (:class:`ZarrStatus`)."""
    path = _path(store)
    try:
        group = zarr.open_group(store=path, mode="r")
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise FileNotFoundError(f"no ntkcore kernel store at {path!r}") from exc
    meta = dict(group.attrs.asdict().get(_ATTR, {}))
    if not meta:
        raise ValueError(f"{path!r} is a Zarr group but not an ntkcore kernel store")
    done = np.asarray(group["done"][...])
    return ZarrStatus(
        shape=tuple(meta["shape"]),
        chunks=tuple(meta["chunks"]),
        tiles_done=int(done.sum()),
        tiles_total=int(done.size),
        complete=bool(done.all()),
        key=meta.get("key"),
    )


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
) -> ZarrStatus:
    """Write a dask kernel to a Zarr store tile by tile, skipping tiles already written.

    Parameters
    ----------
    kernel : dask.array.Array
        E.g. from :func:`ntk_dask`; its chunks become the Zarr chunks (regular grid).
    store : str or PathLike
        Directory of the store.
    resume : bool, default True
        If the store exists with the same shape, chunks, dtype and ``key``, compute only the
        tiles not marked done.  ``False`` with an existing store raises unless ``overwrite``.
    overwrite : bool, default False
        Delete an existing store first.
    key : str, optional
        A label of the kernel's content (model, data, mode); a resume with a different key
        is refused, so tiles of two different kernels never mix.
    client, progress
        See :func:`get_client`; ``progress`` is ``True`` (Dask's bar) or ``progress(done,
        total)`` over the tiles computed in this call.
    compressors
        Zarr compressors (default ``None``: uncompressed).  Keep the default for kernels that
        CG will multiply many times: :class:`ZarrMatrixOperator` then reads every tile as one
        plain file read (from the OS page cache when the kernel fits the machine's RAM), while
        a compressed store is decoded tile by tile on every product (several times slower).
    symmetric : bool, default False
        Record that the kernel is symmetric (square tiles, ``K = K^T``), so that
        products with the stored kernel read only tiles on and above the diagonal.
        :func:`ntk_to_zarr` sets it for ``x2=None`` in ``"trace"`` mode.

    Returns
    -------
    ZarrStatus
    """
    if not isinstance(kernel, da.Array):
        raise TypeError(f"kernel must be a dask array; got {type(kernel).__name__}")
    path = _path(store)
    chunks = _regular_chunks(kernel)
    shape = tuple(int(s) for s in kernel.shape)
    grid = tuple(len(c) for c in kernel.chunks)
    meta = {"shape": list(shape), "chunks": list(chunks), "dtype": str(kernel.dtype),
            "key": key, "complete": False, "symmetric": bool(symmetric)}
    exists = os.path.exists(path) and os.listdir(path)
    if exists and not overwrite:
        status = zarr_status(path)
        group = zarr.open_group(store=path, mode="r+")
        old = group.attrs.asdict()[_ATTR]
        same = (old["shape"] == meta["shape"] and old["chunks"] == meta["chunks"]
                and old["dtype"] == meta["dtype"] and old.get("key") == key)
        if not same:
            raise ValueError(
                f"the store at {path!r} holds a different kernel (shape {old['shape']}, chunks "
                f"{old['chunks']}, dtype {old['dtype']}, key {old.get('key')!r}); pass "
                "overwrite=True or another path"
            )
        if not resume and not status.complete:
            raise ValueError(f"the store at {path!r} exists ({status.tiles_done}/"
                             f"{status.tiles_total} tiles); pass resume=True or overwrite=True")
        done = np.asarray(group["done"][...]).astype(bool)
    else:
        group = zarr.open_group(store=path, mode="w")
        group.create_array(name="kernel", shape=shape, chunks=chunks, dtype=kernel.dtype,
                           compressors=compressors, fill_value=0)
        group.create_array(name="done", shape=grid, chunks=(1,) * len(grid), dtype="uint8",
                           fill_value=0)
        group.attrs.update({_ATTR: meta})
        done = np.zeros(grid, dtype=bool)

    todo = [idx for idx in itertools.product(*(range(g) for g in grid)) if not done[idx]]
    if todo:
        client = get_client(client)
        blocks = kernel.to_delayed(optimize_graph=False)
        offsets = [np.concatenate([[0], np.cumsum(c)]) for c in kernel.chunks]
        write = dask.delayed(_write_tile, pure=False)
        tasks = []
        for idx in todo:
            region = tuple(slice(int(offsets[a][i]), int(offsets[a][i + 1]))
                           for a, i in enumerate(idx))
            tasks.append(write(blocks[idx], path, idx, region))
        futures = client.compute(tasks)
        wait_with_progress(client, futures, progress)
    status = zarr_status(path)
    if status.complete:
        meta_now = dict(zarr.open_group(store=path, mode="r").attrs.asdict()[_ATTR])
        meta_now["complete"] = True
        zarr.open_group(store=path, mode="r+").attrs.update({_ATTR: meta_now})
    return status


def ntk_to_zarr(
    model: Any,
    x1: Any,
    x2: Any = None,
    *,
    store: Any,
    mode: str = "trace",
    chunk: int = 2048,
    client: Any = None,
    params: Any = None,
    resume: bool = True,
    overwrite: bool = False,
    key: str | None = None,
    progress: Any = None,
    **ntk_options: Any,
) -> ZarrStatus:
    """:func:`ntk_dask` followed by :func:`to_zarr` (one call; resumable).

    Only the tiles missing from ``store`` are computed (and only the Jacobian chunks they
    need).  The store is uncompressed; a symmetric trace kernel (``x2=None``) is recorded as
    symmetric (see :func:`to_zarr`).
    """
    from ._ntk import ntk_dask

    kernel = ntk_dask(model, x1, x2, mode=mode, chunk=chunk, client=client, params=params,
                      **ntk_options)
    return to_zarr(kernel, store, resume=resume, overwrite=overwrite, key=key, client=client,
                   progress=progress, symmetric=x2 is None and mode == "trace")


def read_zarr(store: Any, *, require_complete: bool = True) -> da.Array:
    """The kernel in ``store`` as a dask array (chunks = the stored tiles).

    The returned array remembers its store: :func:`ntkcore.cg_solve` and
    ``kernel_regression(..., solver="cg")`` given it directly (not a slice or other
    expression of it) multiply through :class:`ZarrMatrixOperator`, which reads each tile
    once per product on the workers.

    Raises
    ------
    ValueError
        With ``require_complete`` (default) when some tiles are missing; the message says
        how many and how to resume.
    """
    path = _path(store)
    status = zarr_status(path)
    if require_complete and not status.complete:
        raise ValueError(
            f"the kernel at {path!r} is incomplete ({status.tiles_done}/{status.tiles_total} "
            "tiles written); finish it with ntk_to_zarr(..., resume=True) or pass "
            "require_complete=False (missing tiles read as 0)"
        )
    k = da.from_zarr(path, component="kernel")
    k._ntkcore_zarr_store = path  # picked up by DaskMatrixOperator (fast product path)
    return k
