r"""``ntk_dask``: the empirical NTK as a lazy dask array of tiles.

Task graph for inputs split into chunks :math:`x_1 = [x^{(1)}, \dots, x^{(B_1)}]` (and
:math:`x_2` likewise):

* one Jacobian task per chunk, :math:`J^{(i)} = \mathrm{provider}(f, x^{(i)})` -- structured
  factors, far smaller than the dense (n, O, P) Jacobian;
* one tile task per pair, :math:`\Theta^{(ij)} = \mathrm{gram}(J^{(i)}, J^{(j)})`; for a
  symmetric kernel (``x2=None``) only :math:`j \ge i`, and block :math:`(j, i)` is the
  transpose of :math:`\Theta^{(ij)}` (a cheap task: memory traffic, no arithmetic).

The model enters the graph as a single key (pickled bytes, unpickled once per worker
process), so each worker receives it once.  Tiles are NumPy
arrays (host memory, float32/float64 as the model computes), whatever framework the model uses.
"""

from __future__ import annotations

import math
from typing import Any

import cloudpickle
import dask
import dask.array as da
import numpy as np

from ..providers import find_provider
from ..support import capabilities
from ._cluster import get_client, worker_memory_limits

_MODES = ("trace", "full", "diagonal")


def _to_numpy(x: Any) -> np.ndarray:
    """A host NumPy copy of an array of any framework (detached from autograd)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    try:
        return np.asarray(x)
    except Exception:
        return np.from_dlpack(x)


_LOADED: dict[str, Any] = {}  # per worker process: token -> unpickled object


def _identity(blob: bytes) -> bytes:
    return blob


def _load(token: str, blob: bytes) -> Any:
    obj = _LOADED.get(token)
    if obj is None:
        if len(_LOADED) > 8:
            _LOADED.clear()
        obj = _LOADED[token] = cloudpickle.loads(blob)
    return obj


def _jacobian_task(jacfn: Any, model: Any, x: Any, params: Any) -> Any:
    kwargs = {} if params is None else {"params": params}
    return jacfn(model, x, **kwargs)


def _remote_jacobian_task(fn_blob: tuple[str, bytes], model_blob: tuple[str, bytes], x: Any,
                          params: Any) -> Any:
    return _jacobian_task(_load(*fn_blob), _load(*model_blob), x, params)


def _tile_task(j1: Any, j2: Any, mode: str, max_memory: Any, dtype: Any) -> np.ndarray:
    from ..gram import gram

    t = gram(j1, j2, mode=mode, max_memory=max_memory, dtype=dtype)
    return np.ascontiguousarray(_to_numpy(t))


def _transpose_task(t: np.ndarray, mode: str) -> np.ndarray:
    axes = {"trace": (1, 0), "diagonal": (1, 0, 2), "full": (1, 0, 3, 2)}[mode]
    return np.ascontiguousarray(np.transpose(t, axes))


def _bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(n, s + chunk)) for s in range(0, n, chunk)]


def _factor_bytes_per_sample(jac: Any) -> int:
    total = 0
    for b in jac.blocks:
        for arr in b.arrays():
            per = math.prod(int(s) for s in arr.shape[1:])
            total += per * _to_numpy(arr[:1, ...]).dtype.itemsize
    return total


def _slice(x: Any, s: int, e: int) -> Any:
    return x[s:e, ...]


@capabilities(name="distributed.ntk_dask", note={
    "numpy": "models.MLP", "torch": "torch.nn.Module (tiles copied to host)",
    "jax": "(apply_fn, params)", "cupy": "tiles copied to host"},
    missing=("array_api_strict",))
def ntk_dask(
    model: Any,
    x1: Any,
    x2: Any = None,
    *,
    mode: str = "trace",
    chunk: int = 2048,
    client: Any = None,
    params: Any = None,
    dtype: Any = None,
    max_memory: Any = None,
    check_memory: bool = True,
) -> da.Array:
    r"""The eNTK of ``model`` as a lazy dask array computed tile by tile on Dask workers.

    Parameters
    ----------
    model
        Anything with a registered Jacobian provider (a ``torch.nn.Module``, an
        :class:`ntkcore.models.MLP`, a JAX ``(apply_fn, params)`` pair, ...); it must pickle.
    x1 : array, shape (N1, ...)
        Inputs, leading with the sample axis, in the model's framework.
    x2 : array, shape (N2, ...), optional
        Second inputs; ``None`` computes the symmetric kernel of ``x1`` (each off-diagonal
        tile once).
    mode : {"trace", "full", "diagonal"}, default "trace"
        As in :func:`ntkcore.gram`: (N1, N2), (N1, N2, O, O) or (N1, N2, O).
    chunk : int, default 2048
        Samples per tile side; a tile holds chunk^2 (x O^2 for "full") values.
    client : distributed.Client, scheduler address or None
        See :func:`ntkcore.distributed.get_client`; ``None`` uses the default client or starts
        a LocalCluster.
    params
        Passed to the provider (a parameter subset).
    dtype : dtype, optional
        Accumulation/result dtype of the tiles (default: the Jacobians').
    max_memory : optional
        Working-memory budget of :func:`ntkcore.gram` inside each tile task (default: an
        eighth of the smallest worker memory limit, or 256 MiB without limits).
    check_memory : bool, default True
        Raise if one tile task would not fit a worker's memory limit.

    Returns
    -------
    dask.array.Array
        Lazy kernel with chunks (chunk, chunk[, O, O]); compute it, ``persist`` it, or write
        it with :func:`ntkcore.distributed.to_zarr` (one tile in memory per task).

    Raises
    ------
    ValueError
        Bad ``mode``/``chunk``, inputs with different trailing shapes, or a chunk that would
        not fit a worker (the message suggests a chunk that fits).
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}; got {mode!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer; got {chunk!r}")
    for name, x in (("x1", x1), ("x2", x2)):
        if x is not None and (not hasattr(x, "shape") or len(x.shape) < 1):
            raise ValueError(f"{name} must be an array whose first axis indexes samples")
    if x2 is not None and tuple(x2.shape[1:]) != tuple(x1.shape[1:]):
        raise ValueError(f"x1 samples have shape {tuple(x1.shape[1:])} but x2 samples have "
                         f"{tuple(x2.shape[1:])}")
    n1 = int(x1.shape[0])
    n2 = n1 if x2 is None else int(x2.shape[0])
    if n1 == 0 or n2 == 0:
        raise ValueError("x1 and x2 need at least one sample")
    client = get_client(client)
    provider = find_provider(model)
    jacfn = provider.load()

    # probe one sample on the client: output count, dtype and factor sizes
    probe = _jacobian_task(jacfn, model, _slice(x1, 0, 1), params)
    o = int(probe.num_outputs)
    probe_tile = _tile_task(probe, None, mode, None, dtype)
    out_dtype = probe_tile.dtype
    tail = {"trace": (), "diagonal": (o,), "full": (o, o)}[mode]
    limits = [m for m in worker_memory_limits(client) if m > 0]
    if max_memory is None:
        max_memory = max(32 * 2**20, min(limits) // 8) if limits else 256 * 2**20
    if check_memory and limits:
        q = math.prod(tail) if tail else 1
        c = min(chunk, max(n1, n2))
        tile_bytes = c * c * q * out_dtype.itemsize
        factors = 2 * c * _factor_bytes_per_sample(probe)
        need = 2 * tile_bytes + factors + int(max_memory)
        cap = int(0.6 * min(limits))
        if need > cap:
            # largest chunk whose tile + factors fit (solve a c^2 + b c <= cap - max_memory)
            a_, b_ = 2 * q * out_dtype.itemsize, 2 * _factor_bytes_per_sample(probe)
            room = max(cap - int(max_memory), 1)
            fit = int((-b_ + math.sqrt(b_ * b_ + 4 * a_ * room)) / (2 * a_))
            raise ValueError(
                f"chunk={chunk} needs about {need / 2**30:.2f} GiB per tile task (two "
                f"{c}x{c}{'x' + 'x'.join(map(str, tail)) if tail else ''} tiles of "
                f"{out_dtype}, Jacobian factors and a {int(max_memory) / 2**30:.2f} GiB "
                f"working budget) but workers have {min(limits) / 2**30:.2f} GiB (60% "
                f"usable); use chunk <= {max(fit, 1)} or workers with more memory"
            )

    # The model and provider travel as pickled bytes: one graph key each (so each worker
    # receives them once) and unpickled once per worker process.  Moving the live model
    # between workers instead would go through distributed's torch.nn.Module serializer,
    # which does not round-trip modules faithfully (their hook dicts lose their type).
    def blob(obj: Any) -> Any:
        data = cloudpickle.dumps(obj)
        token = dask.base.tokenize(data)
        return dask.delayed(_identity, pure=True)((token, data))

    model_d, fn_d = blob(model), blob(jacfn)
    b1 = _bounds(n1, chunk)
    b2 = b1 if x2 is None else _bounds(n2, chunk)
    jac_task = dask.delayed(_remote_jacobian_task, pure=True)
    tile_task = dask.delayed(_tile_task, pure=True)
    t_task = dask.delayed(_transpose_task, pure=True)
    j1 = [jac_task(fn_d, model_d, _slice(x1, s, e), params) for s, e in b1]
    j2 = j1 if x2 is None else [jac_task(fn_d, model_d, _slice(x2, s, e), params)
                                for s, e in b2]
    meta = np.empty((0,) * (2 + len(tail)), dtype=out_dtype)
    tiles: dict[tuple[int, int], Any] = {}
    for i in range(len(b1)):
        for j in range(len(b2)):
            if x2 is None and j < i:
                continue
            same = x2 is None and i == j
            tiles[i, j] = tile_task(j1[i], None if same else j2[j], mode, max_memory, dtype)
    rows = []
    for i, (s1, e1) in enumerate(b1):
        row = []
        for j, (s2, e2) in enumerate(b2):
            t = tiles[j, i] if (x2 is None and j < i) else tiles[i, j]
            if x2 is None and j < i:
                t = t_task(t, mode)
            shape = (e1 - s1, e2 - s2, *tail)
            row.append(da.from_delayed(t, shape=shape, dtype=out_dtype, meta=meta))
        rows.append(row)
    return da.concatenate([da.concatenate(row, axis=1) for row in rows], axis=0)
