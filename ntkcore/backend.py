"""The backend protocol (:class:`Backend`) and its registry (:func:`register_backend`,
:func:`get_backend`): what ntkcore needs from an array library beyond the array API standard
(triangular solves, random numbers, device facts) and which module supplies it.  A backend's
module is imported only when an array of its framework is seen; an unknown namespace gets
``ntkcore.backends.generic`` (standard only).  ``ntkcore/`` never imports a framework."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import array_api_compat as _compat

from ._typing import Array

__all__ = ["BACKEND_NAMES", "Backend", "Generator", "get_backend", "namespace_and_backend",
           "on_gpu", "register_backend", "seed_from"]

Namespace = Any
Device = Any

#: Elements of the one-hot chunk that the standard-only :meth:`Backend.scatter_add` forms at
#: a time.
ONE_HOT_CHUNK = 1 << 22
#: :meth:`Backend.transient_bytes` of host memory: well below glibc's largest mmap
#: threshold (32 MB).  Measured once, ResNet-18 of ``benchmarks/real_models.py`` at N = 32 on
#: one thread (page faults counted by ``getrusage``, docs/real-models.md "Fresh pages"): 8 MB
#: slabs took its ``ntk`` from about 60,000 faults a call to 7,000; 16 MB slabs left a third
#: to a half of them.
HOST_TRANSIENT_BYTES = 8 << 20


@runtime_checkable
class Generator(Protocol):
    """A seeded random generator that creates arrays on one device of one namespace.

    All methods return arrays of the backend's namespace on the generator's device.
    """

    def integers(self, low: int, high: int, shape: tuple[int, ...]) -> Array:
        """Uniform integers in ``[low, high)`` of the default integer dtype (int64)."""
        ...

    def choice(
        self, n: int, size: int, *, p: Array | None = None, replace: bool = True
    ) -> Array:
        """``size`` indices from ``range(n)``, with probabilities ``p`` of shape (n,).

        Without replacement and with ``p`` this is successive sampling (draw one index with
        probability proportional to ``p`` among those not drawn yet), as numpy,
        torch.multinomial and jax.random.choice all implement it.
        """
        ...

    def normal(self, shape: tuple[int, ...], dtype: Any) -> Array:
        """Standard normal samples of a real floating ``dtype``."""
        ...

    def uniform(self, shape: tuple[int, ...], dtype: Any) -> Array:
        """Uniform samples on ``[0, 1)`` of a real floating ``dtype``."""
        ...


class Backend:
    """Primitives one array namespace offers beyond the array API standard.

    Attributes
    ----------
    name : str
        Short name (``"numpy"``, ``"torch"``, ``"cupy"``, ``"jax"``, ``"generic"``).
    xp : namespace
        The (array-api-compat wrapped, where needed) namespace the backend serves.
    """

    name: str = "abstract"

    def __init__(self, xp: Namespace) -> None:
        self.xp = xp

    # -- linear algebra -------------------------------------------------------------------
    def cholesky(self, a: Array, *, shift: float = 0.0) -> Array | None:
        """Lower Cholesky factor ``L`` of ``a + shift * I`` for symmetric ``a`` (n, n), or ``None``.

        ``None`` means the factorisation failed (not numerically positive definite).  Only the
        lower triangle of ``a`` is read and ``a`` is never modified; backends add ``shift`` to
        the diagonal of the one copy they factorise in place, where the framework allows it.
        The factor must stay differentiable under the framework's autograd.
        """
        raise NotImplementedError

    def solve_triangular(
        self, a: Array, b: Array, *, lower: bool = True, transpose: bool = False
    ) -> Array:
        """Solve ``op(a) x = b`` for triangular ``a`` (n, n) and ``b`` (n,) or (n, k).

        ``op(a) = a.T`` when ``transpose`` else ``a``; ``lower`` states which triangle of ``a``
        holds the matrix.
        """
        raise NotImplementedError

    def cho_solve(self, l: Array, b: Array) -> Array:
        """Solve ``(l l^T) x = b`` for the lower Cholesky factor ``l`` (n, n); b (n,) or (n, k)."""
        y = self.solve_triangular(l, b, lower=True, transpose=False)
        return self.solve_triangular(l, y, lower=True, transpose=True)

    def stop_gradient(self, x: Array) -> Array:
        """``x`` cut from the autograd graph (identity for libraries without autograd)."""
        return x

    def tracks_gradient(self, *xs: Array) -> bool:
        """Whether any of ``xs`` is being differentiated (an autograd graph or a tracer)."""
        return False

    def scalar(self, x: Array) -> float:
        """A 0-d array as a Python float (outside any autograd graph; syncs the device)."""
        return float(x)

    def is_traced(self, *xs: Array) -> bool:
        """Whether the values of any of ``xs`` are unknown (abstract tracers under ``jax.jit``):
        data-dependent Python decisions on them are impossible, array-valued ones remain."""
        return False

    def first_cholesky(self, a: Array, shifts: Any) -> tuple[Array | None, Any]:
        """``(L, i)``: the factor of ``a + shifts[i] I`` for the first ``i`` that succeeds
        (``(None, len(shifts))`` if none does).  For traced ``a`` or ``shifts`` a backend runs
        this as a bounded loop in its own control flow; ``i`` is then an array and ``L`` holds
        NaN when no shift succeeds."""
        for i, shift in enumerate(shifts):
            l = self.cholesky(a, shift=shift)
            if l is not None:
                return l, i
        return None, len(shifts)

    def implicit_solve(self, x: Array, residual: Array, solve: Callable[[Array], Array]) -> Array:
        r"""``x``, solving :math:`A x = b` outside autograd, with the derivative of the exact
        :math:`A^{-1} b`: :math:`x + A^{-1} r` evaluated as ``x``, for ``residual``
        :math:`r = b - A x` formed by the caller inside autograd; the backward pass applies
        ``solve`` (:math:`A^{-\top}`) once to the cotangent.  Without autograd: ``x``."""
        return x

    #: Whether a Python loop of many small array calls is cheap (eager dispatch of a few
    #: microseconds per call).  False where every call is staged or costly to dispatch (JAX);
    #: loops over row chunks (:func:`ntkcore.solve.gram_and_product`) run only where it holds.
    eager_loops: bool = True

    # -- scatter-add ------------------------------------------------------------------------
    #: Whether :meth:`scatter_add` costs O(R k) (a native scatter) rather than the standard
    #: fallback's O(R size k) one-hot products; :mod:`ntkcore.gram` offers its "pairs" route
    #: only then.
    fast_scatter_add: bool = False

    def scatter_add(self, idx: Array, x: Array, size: int) -> Array:
        r"""``out[i] = sum of x[r] over the r with idx[r] == i``, shape (size, k): the sum
        :math:`\sum_r e_{idx_r} x_r^\top` for indices ``idx`` (R,) in ``[-1, size)`` and ``x``
        (R, k); rows with ``idx == -1`` are dropped.  In ``x``'s dtype and device, and
        differentiable in ``x`` under the framework's autograd.

        The array API standard has no scatter-add: this fallback forms one-hot (chunk, size)
        matrices over row chunks, O(R size k) flops and at most ``ONE_HOT_CHUNK`` extra
        elements; backends override it with their native scatter (``fast_scatter_add``).
        """
        xp = self.xp
        r = idx.shape[0]
        step = max(1, ONE_HOT_CHUNK // size)
        cols = xp.arange(size, dtype=idx.dtype, device=_compat.device(idx))
        out = None
        for lo in range(0, r, step):
            hi = min(r, lo + step)
            part = xp.astype(idx[lo:hi, None] == cols, x.dtype).T @ x[lo:hi, ...]
            out = part if out is None else out + part
        if out is None:
            out = xp.zeros((size, x.shape[1]), dtype=x.dtype, device=_compat.device(x))
        return out

    # Optional: ``erf(x)``, the error function elementwise.  The standard has none; backends
    # that define it give ntkcore.models an exact, fast erf/gelu (the fallback is a pure
    # array-API series accurate to float64 rounding).

    # -- random numbers -------------------------------------------------------------------
    def generator(self, seed: int | None, device: Device) -> Generator:
        """A :class:`Generator` seeded with ``seed`` (``None``: fresh entropy) on ``device``."""
        raise NotImplementedError

    @staticmethod
    def seed_from(seed: Any) -> int:
        """An integer seed in ``[0, 2**63)`` drawn from ``seed``, a random generator or key of
        this backend's framework (one draw: equal generator states give equal seeds).

        Raises ``TypeError`` for any other object; see :func:`seed_from`.
        """
        raise TypeError("seed must be None, a non-negative integer, a numpy.random.Generator, "
                        f"a torch.Generator or a JAX PRNG key; got {type(seed).__name__}")

    def transient_product(self, a: Array, b: Array) -> Array:
        """``a @ b`` for a transient the caller drops before it returns (the Gram's slabs of
        per-sample weights): where the library can, written into memory recycled from
        earlier calls rather than fresh pages (the torch backend on the host,
        ``ntkcore.backends.torch_recycle``).  Here: ``a @ b``."""
        return a @ b

    # -- device facts -----------------------------------------------------------------------
    def free_memory(self, device: Device) -> int | None:
        """Bytes that can still be allocated on ``device``; ``None`` when unknown."""
        return None

    def transient_bytes(self, device: Device) -> int | None:
        """The largest transient array the engines form at once on ``device`` (the Gram's
        per-sample weights are formed in slabs of at most this); None: no limit.

        Host memory: :data:`HOST_TRANSIENT_BYTES`.  glibc's malloc maps an array above its
        mmap threshold (at most 32 MB) anew on every call and returns freed memory at the
        top of the heap to the system, so a large transient costs a page fault every 4 KiB
        it touches (about 1.7 us each on the 2-core Xeon of ``docs/real-models.md``), while
        slabs below the threshold are recycled.  A GPU's caching allocator keeps its
        blocks: no limit there."""
        return None if self.is_gpu(device) else HOST_TRANSIENT_BYTES

    def synchronize(self, device: Device) -> None:
        """Wait until all work queued on ``device`` has finished (for honest timings)."""
        return None

    def is_gpu(self, device: Device) -> bool:
        """Whether ``device`` is an accelerator."""
        return False

    def __repr__(self) -> str:
        return f"<ntkcore backend {self.name!r}>"


# -- registry -------------------------------------------------------------------------------
# name -> (namespace test, "module:Class"); order matters: first match wins.
_REGISTRY: dict[str, tuple[Callable[[Namespace], bool], str]] = {}
_GENERIC = "ntkcore.backends.generic:GenericBackend"
_cache: dict[int, Backend] = {}


def register_backend(name: str, matches: Callable[[Namespace], bool], target: str) -> None:
    """Serve the namespaces that ``matches`` accepts with the class ``target`` (``"module:Class"``).

    ``matches(xp)`` must not import a framework; the module of ``target`` is imported on the
    first :func:`get_backend` call for a matching namespace.  Registering ``name`` again
    replaces its entry in place; a new name goes after the existing ones (first match wins).
    """
    _REGISTRY[name] = (matches, target)
    _cache.clear()


def get_backend(xp: Any) -> Backend:
    """The :class:`Backend` serving the array namespace ``xp`` (cached per namespace)."""
    key = id(xp)
    backend = _cache.get(key)
    if backend is None:
        target = next((t for matches, t in tuple(_REGISTRY.values()) if matches(xp)),
                      _GENERIC)
        backend = _backend_class(target)(xp)
        _cache[key] = backend
    return backend


def on_gpu(xp: Any, device: Any) -> bool:
    """Whether ``device`` (of namespace ``xp``) is a GPU; False where it cannot be told (a
    traced JAX array has no device)."""
    try:
        return bool(get_backend(xp).is_gpu(device))
    except Exception:
        return False


def _backend_class(target: str) -> type[Backend]:
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def seed_from(seed: Any, spawn_key: tuple[int, ...] | None = None) -> Any:
    """The integer seed that ``seed`` stands for, or its child at ``spawn_key``.

    ``None`` (fresh entropy) and integers are returned as they are.  Any other object goes to
    the backend of its framework (:meth:`Backend.seed_from`: the array namespace's backend for
    an array such as a JAX key, else the backend registered under the name of the object's
    top-level module, e.g. ``numpy`` for a ``numpy.random.Generator``), which draws an integer
    seed from it.  With a ``spawn_key`` the result is the child seed by NumPy's
    ``SeedSequence`` convention (:func:`ntkcore.sketch.spawn_seed`).
    """
    if seed is not None and not isinstance(seed, int):
        if _compat.is_array_api_obj(seed):
            seed = get_backend(_compat.array_namespace(seed)).seed_from(seed)
        else:
            entry = _REGISTRY.get(type(seed).__module__.partition(".")[0])
            seed = _backend_class(_GENERIC if entry is None else entry[1]).seed_from(seed)
    if seed is None or spawn_key is None:
        return seed
    return _backend_class(_GENERIC).spawn_seed(seed, spawn_key)


def host_array(x: Any) -> Array:
    """A list, tuple or scalar as an array of the host library (NumPy), which is what
    scikit-learn makes of non-array input; NumPy is reached through the generic backend."""
    return _backend_class(_GENERIC).host_array(x)


def namespace_and_backend(*arrays: Any) -> tuple[Any, Backend]:
    """``(xp, backend)`` for arrays that must share one namespace (``None`` entries ignored)."""
    xp = _compat.array_namespace(*[a for a in arrays if a is not None])
    return xp, get_backend(xp)


register_backend("numpy", _compat.is_numpy_namespace, "ntkcore.backends.numpy:NumpyBackend")
register_backend("torch", _compat.is_torch_namespace, "ntkcore.backends.torch:TorchBackend")
register_backend("cupy", _compat.is_cupy_namespace, "ntkcore.backends.cupy:CupyBackend")
register_backend("jax", _compat.is_jax_namespace, "ntkcore.backends.jax:JaxBackend")
BACKEND_NAMES = (*_REGISTRY, "generic")  # the built-in backends
