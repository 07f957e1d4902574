r"""``ntk_dask``: the empirical NTK as a lazy dask array of host NumPy tiles.  One Jacobian task
per input chunk, :math:`J^{(i)} = \mathrm{provider}(f, x^{(i)})` (structured factors), and one
tile task per pair, :math:`\Theta^{(ij)} = \mathrm{gram}(J^{(i)}, J^{(j)})`; for ``x2=None``
only :math:`j \ge i`, block :math:`(j, i)` being the transpose."""

from __future__ import annotations

import math
import warnings
from typing import Any

import array_api_compat
import cloudpickle
import dask
import dask.array as da
import distributed
import numpy as np

from .._cache import LRUCache
from .._memory import parse_memory
from .._validation import check_size
from ..modes import Mode, check_mode
from ..providers import find_provider
from ..support import capabilities
from ..tiling import TileGrid


def to_numpy(x: Any) -> np.ndarray:
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


def back_to_namespace(host: np.ndarray, like: Any) -> Any:
    """``host`` in the namespace, device and dtype of ``like``."""
    if isinstance(like, np.ndarray):
        return host.astype(like.dtype, copy=False)
    xp = array_api_compat.array_namespace(like)
    return xp.asarray(np.ascontiguousarray(host), dtype=like.dtype,
                      device=array_api_compat.device(like))


def _np_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype of a dtype of any framework (``torch.float32`` -> float32)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype(str(dtype).rsplit(".", 1)[-1])


_LOADED: LRUCache[Any] = LRUCache(9)  # per worker process: token -> unpickled object


def _identity(blob: bytes) -> bytes:
    return blob




def _load(token: str, blob: bytes) -> Any:
    return _LOADED.get(token, lambda: cloudpickle.loads(blob))


def _worker_limit() -> int:
    """The memory limit of the Dask worker running this task (0: none, or no worker)."""
    try:
        return int(distributed.get_worker().memory_manager.memory_limit or 0)
    except (ValueError, AttributeError):
        return 0


def _budget(max_memory: Any) -> Any:
    if max_memory is not None:
        return parse_memory(max_memory)  # "200MB" as well as bytes
    limit = _worker_limit()
    return max(32 * 2**20, limit // 8) if limit else 256 * 2**20


def _check_fits(jac: Any, c: int, mode: Mode, dtype: np.dtype, max_memory: Any) -> None:
    """Raise if a tile task (two c x c tiles, the factors of two chunks, the gram budget)
    would not fit 60% of this worker's memory limit."""
    limit = _worker_limit()
    if not limit:
        return
    tail = mode.tail(int(jac.num_outputs))
    a_ = 2 * math.prod(tail) * dtype.itemsize
    b_ = 2 * sum(math.prod(int(s) for s in arr.shape[1:]) * to_numpy(arr[:1, ...]).itemsize
                 for blk in jac.blocks for arr in blk.arrays())
    budget = int(_budget(max_memory))
    need, cap = a_ * c * c + b_ * c + budget, int(0.6 * limit)
    if need > cap:
        # largest chunk whose tile + factors fit (solve a c^2 + b c <= cap - budget)
        room = max(cap - budget, 1)
        fit = int((-b_ + math.sqrt(b_ * b_ + 4 * a_ * room)) / (2 * a_))
        raise ValueError(
            f"chunks={c} needs about {need / 2**30:.2f} GiB per tile task (two "
            f"{c}x{c}{'x' + 'x'.join(map(str, tail)) if tail else ''} tiles of {dtype}, "
            f"Jacobian factors and a {budget / 2**30:.2f} GiB working budget) but the worker "
            f"has {limit / 2**30:.2f} GiB (60% usable); use chunks <= {max(fit, 1)} or "
            "workers with more memory")


def _jacobian_task(jacfn: Any, model: Any, x: Any, params: Any, check: Any) -> Any:
    jac = jacfn(model, x, **({} if params is None else {"params": params}))
    if check is not None:
        _check_fits(jac, *check)
    return jac


def _remote_jacobian_task(fn_blob: tuple[str, bytes], model_blob: tuple[str, bytes], x: Any,
                          params: Any, check: Any) -> Any:
    return _jacobian_task(_load(*fn_blob), _load(*model_blob), x, params, check)


def _tile_task(j1: Any, j2: Any, mode: str, max_memory: Any, dtype: Any, expect: Any
               ) -> np.ndarray:
    from ..gram import gram

    t = gram(j1, j2, mode=mode, max_memory=_budget(max_memory), dtype=dtype)
    t = np.ascontiguousarray(to_numpy(t))
    if expect is not None and (t.shape[2:], t.dtype) != expect:
        raise ValueError(f"a tile has trailing shape {t.shape[2:]} and dtype {t.dtype}, but "
                         f"the dask array was built for {expect[0]} and {expect[1]}; pass "
                         "dtype= to ntk_dask")
    return t


def _read_meta(provider: str, model: Any, x: Any, mode: Mode, dtype: Any
               ) -> tuple[int | None, np.dtype | None]:
    """(output count, tile dtype) read off the model without calling it; None where unknown
    (the output count matters only for "full" and "diagonal")."""
    o = 1 if not mode.tail_axes else model.widths[-1] if provider == "mlp" else None
    if dtype is not None:
        return o, _np_dtype(dtype)
    try:
        if provider == "jax":  # as the provider promotes (with JAX's lattice and x64 flag)
            import jax
            import jax.numpy as jnp

            found = [leaf.dtype for leaf in jax.tree_util.tree_leaves(model[1])
                     if jnp.issubdtype(leaf.dtype, jnp.inexact)]
            return o, np.dtype(jnp.result_type(*found, _np_dtype(x.dtype)))
        if provider not in ("mlp", "torch"):
            return o, None
        found = [model.dtype] if provider == "mlp" else [p.dtype for p in model.parameters()]
        found = [d for d in map(_np_dtype, [*found, x.dtype]) if np.issubdtype(d, np.floating)]
        return o, np.result_type(*found) if found else None
    except TypeError:  # a dtype NumPy does not know (bfloat16)
        return o, None


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
    chunks: int | None = None,
    params: Any = None,
    dtype: Any = None,
    max_memory: Any = None,
    check_memory: bool = True,
    chunk: int | None = None,
    client: Any = None,
) -> da.Array:
    r"""The eNTK of ``model`` as a lazy dask array, one task per tile.

    Building the array is cheap: it starts no cluster and does not call the model when its
    output count and dtype can be read off it (see ``dtype``).  The tiles are computed by
    whatever computes the array: a ``distributed.Client`` you created (the default client),
    ``client.compute(k)``, or dask's default scheduler.

    Parameters
    ----------
    model
        Anything with a registered Jacobian provider (a ``torch.nn.Module``, an
        :class:`ntkcore.models.MLP`, a JAX ``(apply_fn, params)`` pair, ...); it must pickle.
    x1 : array or dask.array.Array, shape (N1, ...)
        Inputs, leading with the sample axis, in the model's framework (a dask array is
        computed chunk by chunk inside the Jacobian tasks).
    x2 : array or dask.array.Array, shape (N2, ...), optional
        Second inputs; ``None`` computes the symmetric kernel of ``x1`` (each off-diagonal
        tile once).
    mode : {"trace", "full", "diagonal"}, default "trace"
        As in :func:`ntkcore.gram`: (N1, N2), (N1, N2, O, O) or (N1, N2, O).
    chunks : int, optional
        Samples per tile side; a tile holds chunks^2 (x O^2 for "full") values.  Default: the
        first chunk of a dask ``x1`` along its sample axis, otherwise 2048.
    params
        Passed to the provider (a parameter subset).
    dtype : dtype, optional
        Accumulation/result dtype of the tiles (default: the Jacobians', read off the model's
        parameters and the inputs; a model ntkcore cannot read, or ``mode="full"`` /
        ``"diagonal"`` for a model other than an MLP, is evaluated on one sample here to learn
        its output count and dtype).
    max_memory : optional
        Working-memory budget of :func:`ntkcore.gram` inside each tile task (default: an
        eighth of the worker's memory limit, or 256 MiB without a limit).
    check_memory : bool, default True
        Each Jacobian task raises if one tile task would not fit its worker's memory limit.
    chunk : int, optional
        Deprecated alias of ``chunks``.
    client
        Deprecated and ignored: the array computes wherever you compute it.

    Returns
    -------
    dask.array.Array
        Lazy kernel with chunks (chunks, chunks[, O, O]); compute it, ``persist`` it, or
        write it with :func:`ntkcore.distributed.to_zarr` (one tile in memory per task).

    Raises
    ------
    ValueError
        Bad ``mode``/``chunks`` or inputs with different trailing shapes; at compute time, a
        chunk that would not fit a worker (the message suggests a chunk that fits).
    """
    mode = check_mode(mode)
    if chunk is not None:
        if chunks is not None:
            raise TypeError("pass chunks=, not both chunks= and its deprecated alias chunk=")
        warnings.warn("ntk_dask(chunk=) is deprecated; use chunks= (Dask's name)",
                      FutureWarning, stacklevel=2)
        chunks = chunk
    if client is not None:
        warnings.warn("ntk_dask(client=) is deprecated and ignored: the array computes on the "
                      "client or scheduler that computes it", FutureWarning, stacklevel=2)
    for name, x in (("x1", x1), ("x2", x2)):
        if x is not None and (not hasattr(x, "shape") or len(x.shape) < 1):
            raise ValueError(f"{name} must be an array whose first axis indexes samples")
        if x is not None and math.isnan(x.shape[0]):
            raise ValueError(f"{name} has unknown chunk sizes; call {name}.compute_chunk_sizes()")
    if chunks is None:
        chunks = int(x1.chunks[0][0]) if isinstance(x1, da.Array) else 2048
    chunks = check_size(chunks, "chunks")
    if x2 is not None and tuple(x2.shape[1:]) != tuple(x1.shape[1:]):
        raise ValueError(f"x1 samples have shape {tuple(x1.shape[1:])} but x2 samples have "
                         f"{tuple(x2.shape[1:])}")
    n1 = int(x1.shape[0])
    n2 = n1 if x2 is None else int(x2.shape[0])
    if n1 == 0 or n2 == 0:
        raise ValueError("x1 and x2 need at least one sample")
    provider = find_provider(model)
    jacfn = provider.load()
    o, out_dtype = _read_meta(provider.name, model, x1, mode, dtype)
    if out_dtype is None or o is None:  # learn them from one sample, here
        x0 = x1[:1].compute() if isinstance(x1, da.Array) else x1[:1]
        probe = _jacobian_task(jacfn, model, x0, params, None)
        o = int(probe.num_outputs)
        out_dtype = _tile_task(probe, None, mode, None, dtype, None).dtype
    tail = mode.tail(o)
    check = (min(chunks, max(n1, n2)), mode, out_dtype, max_memory) if check_memory else None

    # The model and provider travel as pickled bytes: one graph key each (so each worker
    # receives them once) and unpickled once per worker process.  Moving the live model
    # between workers instead would go through distributed's torch.nn.Module serializer,
    # which does not round-trip modules faithfully (their hook dicts lose their type).
    def blob(obj: Any) -> Any:
        data = cloudpickle.dumps(obj)
        return dask.delayed(_identity, pure=True)((dask.base.tokenize(data), data))

    model_d, fn_d = blob(model), blob(jacfn)
    grid = TileGrid(n1, n2, chunks, symmetric=x2 is None)
    jac_task = dask.delayed(_remote_jacobian_task, pure=True)
    tile_task = dask.delayed(_tile_task, pure=True)
    j1 = [jac_task(fn_d, model_d, x1[s:e], params, check) for s, e in grid.rows]
    j2 = j1 if x2 is None else [jac_task(fn_d, model_d, x2[s:e], params, check)
                                for s, e in grid.cols]
    meta = np.empty((0,) * (2 + len(tail)), dtype=out_dtype)

    def tile(i: int, j: int) -> da.Array:
        (s1, e1), (s2, e2) = grid.rows[i], grid.cols[j]
        t = tile_task(j1[i], None if x2 is None and i == j else j2[j], mode, max_memory, dtype,
                      (tail, out_dtype))
        return da.from_delayed(t, shape=(e1 - s1, e2 - s2, *tail), dtype=out_dtype, meta=meta)

    tiles = {(i, j): tile(i, j) for i, j in grid.schedule()}
    return grid.assemble(array_api_compat.array_namespace(tiles[0, 0]), tiles, mode)
