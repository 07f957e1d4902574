"""TRAK's training features in Zarr (:class:`ntkcore.attribution.TRAK` with ``store=``): one
store per ensemble member holding ``[Phi | Q]`` (N, width + 1), written in row chunks with the
per-chunk completion markers, fingerprint and writer lock of :func:`to_zarr`, so that a killed
fit resumes where it stopped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dask
import dask.array as da
import numpy as np

from . import _fingerprint as fp
from ._ntk import to_numpy
from ._zarr import read_zarr, to_zarr

__all__ = ["member_fingerprint", "store_features"]


def member_fingerprint(model: Any, x: Any, y: Any, params: Any, options: dict[str, Any]
                       ) -> dict[str, str | None]:
    """The fingerprint of one member's features: the model (architecture and parameters),
    the inputs ``x`` (as ``x1``), the targets ``y`` (as ``x2``) and the options that fix the
    projection and the output function."""
    probe = options.get("probe")
    if isinstance(probe, tuple):  # a probe pair fixes the dim split: its arrays, not "given"
        options = dict(options, probe=[None if a is None else fp._safe_digest(a)
                                       for a in probe])
    return fp.kernel_fingerprint(model, x, y, mode="attribution", params=params,
                                 options=options)


def store_features(block: Callable[[int, int], tuple[Any, Any]], n: int, width: int,
                   dtype: Any, store: Any, *, fingerprint: dict[str, str | None],
                   key: str | None, chunk: int, progress: Any = None) -> da.Array:
    """Write ``[phi | q]`` of samples ``0:n`` to ``store``, ``chunk`` rows per Zarr chunk,
    skipping the chunks a previous call completed, and return the stored array (lazy).

    ``block(start, stop)`` returns the features (stop - start, width) and the loss weights
    (stop - start,) of those samples (in any namespace).  Chunks are computed one at a time in
    this process (dask's synchronous scheduler): the working memory is that of one chunk.
    """
    def compute(start: int, stop: int) -> np.ndarray:
        phi, q = block(start, stop)
        return np.concatenate([to_numpy(phi), to_numpy(q)[:, None]], axis=1).astype(
            dtype, copy=False)

    parts = [da.from_delayed(dask.delayed(compute, pure=False)(s, min(s + chunk, n)),
                             shape=(min(s + chunk, n) - s, width + 1), dtype=dtype)
             for s in range(0, n, chunk)]
    arr = parts[0] if len(parts) == 1 else da.concatenate(parts, axis=0)
    with dask.config.set(scheduler="synchronous"):
        to_zarr(arr, store, key=key, progress=progress, _fingerprint=fingerprint)
    return read_zarr(store)
