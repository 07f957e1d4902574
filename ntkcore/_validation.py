"""Input checks shared by the public functions.

Every public function resolves its namespace once, through :func:`namespace_of`, and checks
each array argument by name, so that errors say which argument is wrong and why.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import array_api_compat

from ._typing import Array
from .backend import Backend, get_backend


def promote(xp: Any, *arrays: Any) -> tuple[Any, ...]:
    """``arrays`` (None passes through) cast to the floating dtype they promote to under the
    array API's rules (float32 with float64: float64), so that products between them run in
    one dtype, as NumPy's ``matmul`` does; torch's ``matmul`` refuses mixed dtypes."""
    present = [a for a in arrays if a is not None]
    if len(present) < 2 or all(a.dtype == present[0].dtype for a in present):
        return arrays  # the common case, kept cheap: ArrayOperator calls this per product
    common = xp.result_type(*(a.dtype for a in present))  # dtypes: never converts an array
    return tuple(a if a is None or a.dtype == common else xp.astype(a, common) for a in arrays)


def namespace_of(**arrays: Array | None) -> tuple[Any, Backend]:
    """``(xp, backend)`` shared by the named arrays; ``None`` values are skipped.

    Raises
    ------
    TypeError
        If an argument is not an array, or the arrays come from different libraries.
    ValueError
        If the arrays live on different devices.
    """
    named = {k: v for k, v in arrays.items() if v is not None}
    namespaces = {}
    for name, arr in named.items():
        try:
            namespaces[name] = array_api_compat.array_namespace(arr)
        except TypeError:
            raise TypeError(
                f"{name} must be an array of an array-API library (numpy, torch, cupy, jax, "
                f"...); got {type(arr).__name__}"
            ) from None
    if not namespaces:
        raise TypeError("no array arguments were given")
    first_name, xp = next(iter(namespaces.items()))
    for name, other in namespaces.items():
        if other is not xp:
            raise TypeError(
                f"{name} is a {type(named[name]).__module__} array but {first_name} is a "
                f"{type(named[first_name]).__module__} array; pass arrays of one library"
            )
    devices = {name: array_api_compat.device(arr) for name, arr in named.items()}
    first_dev = devices[first_name]
    for name, dev in devices.items():
        # Traced arrays (jax.grad / jit) report no device; they cannot be compared.
        if dev is not None and first_dev is not None and dev != first_dev:
            raise ValueError(
                f"{name} is on device {dev} but {first_name} is on {first_dev}; "
                "move them to one device"
            )
    return xp, get_backend(xp)


def check_floating(xp: Any, x: Array, name: str) -> None:
    """Raise TypeError unless ``x`` has a real floating dtype."""
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype (float32 or float64); "
                        f"got {x.dtype}")


def _unreadable(exc: Exception) -> bool:
    """Whether ``exc`` says an array's values cannot be read (a tracer under ``jax.jit``)."""
    return "Concretization" in type(exc).__name__ or "Tracer" in type(exc).__name__


def concrete(value: Any) -> float | None:
    """``float(value)`` for a 0-d array, or ``None`` when its value is unknown (traced)."""
    try:
        return float(value)
    except Exception as exc:
        if _unreadable(exc):
            return None
        raise


def all_finite(xp: Any, x: Array) -> bool:
    """Whether ``x`` holds no NaN or Inf (integer and boolean arrays always do; a traced
    array under ``jax.jit`` counts as finite because its values are unknown)."""
    if not xp.isdtype(x.dtype, ("real floating", "complex floating")):
        return True
    try:
        # a finite sum proves every entry finite (one reduction, no boolean temporary); only a
        # non-finite sum (NaN/Inf, or an overflow of finite entries) is looked at entry by entry
        return bool(xp.isfinite(xp.sum(x))) or bool(xp.all(xp.isfinite(x)))
    except Exception as exc:
        if _unreadable(exc):
            return True
        raise


class FiniteFlags:
    """Finiteness checks deferred to one host synchronisation: :meth:`add` keeps a 0-d
    device boolean per array (no sync), :meth:`first_bad` reads them all at once."""

    def __init__(self, xp: Any) -> None:
        self.xp, self.flags = xp, []

    def add(self, x: Array) -> None:
        """Record whether ``x`` holds no NaN or Inf (exact, evaluated on the device)."""
        xp = self.xp
        if xp.isdtype(x.dtype, ("real floating", "complex floating")):
            self.flags.append((len(self.flags), xp.all(xp.isfinite(x))))
        else:
            self.flags.append((len(self.flags), None))

    def first_bad(self) -> int | None:
        """The index (order of :meth:`add`) of the first array with NaN or Inf, else None (also
        when the values are unknown: traced under ``jax.jit``).  One host sync for all."""
        xp = self.xp
        known = [(i, f) for i, f in self.flags if f is not None]
        if not known:
            return None
        try:
            if bool(xp.all(xp.stack([f for _, f in known]))):
                return None
        except Exception as exc:
            if _unreadable(exc):
                return None
            raise
        return next(i for i, f in known if not bool(f))  # the error path: one read each


def check_finite(xp: Any, x: Array, name: str) -> None:
    """Raise ValueError if ``x`` holds NaN or Inf."""
    if not all_finite(xp, x):
        raise ValueError(f"{name} contains NaN or Inf")


#: Relative tolerance of the symmetry check of a kernel, in units of its dtype's epsilon:
#: ``max|K - K^T| <= SYMMETRY_RTOL_EPS * eps * max_i |K_ii|``.  Rounding in a product
#: ``J J^T`` whose two triangles are summed in different orders stays far below it (ntkcore's
#: own kernels are mirrored, or asymmetric by a few eps); an asymmetry above it is not
#: rounding.
SYMMETRY_RTOL_EPS = 1000

_SYMMETRY_BLOCK = 256  # square blocks of the symmetry check (cache-sized transposes)


def max_asymmetry(xp: Any, k: Array) -> Array:
    """``max|K - K^T|`` of a square ``k`` (N, N) as a 0-d array, over block pairs on and above
    the diagonal (each block compared with the transpose of its mirror: cache-sized
    transposes, about 3x faster than ``k - k.T`` on a 3000 x 3000 float64 kernel)."""
    n = int(k.shape[0])
    b = _SYMMETRY_BLOCK
    worst = None
    for i in range(0, n, b):
        for j in range(i, n, b):
            u = k[i:min(n, i + b), j:min(n, j + b)]
            low = k[j:min(n, j + b), i:min(n, i + b)]
            d = xp.max(xp.abs(u - xp.matrix_transpose(low)))
            worst = d if worst is None else xp.maximum(worst, d)
    return worst


def check_symmetric(xp: Any, k: Array, name: str, backend: Any = None) -> Array:
    r"""``k`` (N, N) if exactly symmetric, ``(K + K^T) / 2`` if symmetric to rounding.

    The test is :math:`\max|K - K^\top| \le \tau \max_i |K_{ii}|` with
    :math:`\tau` = :data:`SYMMETRY_RTOL_EPS` :math:`\cdot\,\varepsilon` (``k``'s dtype;
    for a positive semi-definite ``K``, :math:`\max_i |K_{ii}| = \max|K|`): one O(N^2) read of
    ``k`` in cache-sized blocks.  An exactly symmetric ``k`` (ntkcore's own kernels) is
    returned as is; within the tolerance the symmetric part is returned, so that every solver
    (reading one triangle, the other or both) sees the same matrix (under autograd, in the
    graph).  A traced array (``jax.jit``) is symmetrised without the test.

    Raises
    ------
    ValueError
        If the asymmetry exceeds the tolerance (the message names ``name`` and both numbers).
    """
    if not k.shape[0]:
        return k
    k0 = backend.stop_gradient(k) if backend is not None else k
    diff = concrete(max_asymmetry(xp, k0))
    if diff == 0.0:
        return k
    if diff is not None:
        scale = concrete(xp.max(xp.abs(xp.linalg.diagonal(k0)))) or 0.0
        eps = float(xp.finfo(k.dtype).eps)
        tol = SYMMETRY_RTOL_EPS * eps * scale
        if not diff <= tol:
            raise ValueError(
                f"{name} is not symmetric: max|K - K^T| = {diff:.3g} exceeds "
                f"{SYMMETRY_RTOL_EPS} eps max|diag K| = {tol:.3g}; pass a symmetric kernel "
                "(e.g. (K + K^T)/2 if the asymmetry is expected)")
    return (k + xp.matrix_transpose(k)) / 2


def check_ndim(x: Array, name: str, ndims: tuple[int, ...], what: str) -> None:
    """Raise ValueError unless ``x.ndim`` is one of ``ndims``; ``what`` names the shape."""
    if x.ndim not in ndims:
        raise ValueError(f"{name} must have shape {what}; got shape {tuple(x.shape)}")


def check_array(
    xp: Any, x: Array, name: str, ndims: tuple[int, ...], what: str, *, finite: bool = True
) -> None:
    """Rank, real floating dtype and (optionally) finiteness of one argument."""
    check_ndim(x, name, ndims, what)
    check_floating(xp, x, name)
    if finite:
        check_finite(xp, x, name)


def kernel_layout_hint(x: Array, name: str) -> str:
    """What to do with a kernel ``x`` of another layout than the (N, M) matrix a solver needs
    (empty for a 2-d ``x``): a full-mode kernel (N, M, O, O) wants ``mode="trace"`` or its
    (N O, M O) matrix view; an (L, N, M) layerwise or (N, M, O) diagonal-mode kernel wants
    its layers summed or ``mode="trace"``."""
    shape = tuple(x.shape)
    if len(shape) == 4:
        n, m, o, p = shape
        return (f"; {name} looks like a full-mode kernel (N, M, O, O): compute it with "
                f'mode="trace" (one (N, M) kernel shared by the outputs), or use its '
                f"(N O, M O) matrix, xp.reshape(xp.permute_dims({name}, (0, 2, 1, 3)), "
                f"({n * o}, {m * p})), with the targets (N, O) reshaped to (N O,)")
    if len(shape) == 3:
        return (f"; {name} looks like a layerwise kernel (L, N, M), whose sum over the "
                f'first axis is the kernel, or a mode="diagonal" kernel (N, M, O): compute '
                f'it with mode="trace"')
    return ""


def check_kernel(xp: Any, x: Array, name: str, what: str, *, finite: bool = True) -> None:
    """:func:`check_array` for a kernel matrix ``x`` (2-d; ``what`` names its shape, e.g.
    ``"(N, N)"``), whose error says what to do with another kernel layout
    (:func:`kernel_layout_hint`)."""
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape {what}; got shape {tuple(x.shape)}"
                         + kernel_layout_hint(x, name))
    check_array(xp, x, name, (2,), what, finite=finite)


def check_size(value: Any, name: str) -> int:
    """A positive Python int from ``value`` (an integer, not a bool)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive integer; got {value!r}")
    try:
        ivalue = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive integer; got {value!r}") from None
    if ivalue < 1:
        raise ValueError(f"{name} must be a positive integer; got {ivalue}")
    return int(ivalue)


def check_scalar(
    value: Any, name: str, *, positive: bool = False, nonnegative: bool = False
) -> float:
    """A finite Python float from ``value`` with the stated sign constraint."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number; got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite; got {v}")
    if positive and v <= 0:
        raise ValueError(f"{name} must be positive; got {v}")
    if nonnegative and v < 0:
        raise ValueError(f"{name} must be non-negative; got {v}")
    return v


def first_nonfinite(named: list[tuple[str, Array]]) -> str | None:
    """The name of the first array in ``named`` holding NaN or Inf, or ``None``.

    One sum per array and one device sync per namespace, device and dtype: a finite sum proves
    every entry finite; only a non-finite sum (NaN/Inf, or an overflow) is checked entry by
    entry.  Integer and boolean arrays are skipped; traced arrays (``jax.jit``) count as finite.
    """
    groups: dict[tuple[int, str, str], tuple[Any, list[tuple[str, Array]]]] = {}
    # an array's namespace depends on its type alone, whether it is inexact on its dtype
    spaces: dict[Any, Any] = {}
    for name, arr in named:
        xp = spaces.get(type(arr))
        if xp is None:
            xp = spaces[type(arr)] = array_api_compat.array_namespace(arr)
        kind = (type(arr), arr.dtype)
        inexact = spaces.get(kind)
        if inexact is None:
            inexact = spaces[kind] = xp.isdtype(arr.dtype, ("real floating", "complex floating"))
        if inexact:
            key = (id(xp), str(array_api_compat.device(arr)), str(arr.dtype))
            groups.setdefault(key, (xp, []))[1].append((name, arr))
    for xp, items in groups.values():
        sums = xp.stack([xp.sum(a) for _, a in items])
        try:
            ok = bool(xp.all(xp.isfinite(sums)))
        except Exception as exc:
            if _unreadable(exc):
                continue
            raise
        if not ok:
            for name, arr in items:
                if not bool(xp.all(xp.isfinite(arr))):
                    return name
    return None


def check_outputs(outputs: Any, pseudo: bool) -> None:
    """A provider's ``outputs=(start, stop)`` option (None: all outputs): two ints with
    ``0 <= start < stop`` (``stop`` is checked against O once O is known), not with
    ``pseudo`` (one output)."""
    if outputs is None:
        return
    if pseudo:
        raise ValueError("outputs cannot be combined with pseudo=True (one output)")
    if (not isinstance(outputs, tuple) or len(outputs) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in outputs)
            or not 0 <= outputs[0] < outputs[1]):
        raise ValueError(f"outputs must be a pair of ints (start, stop) with "
                         f"0 <= start < stop; got {outputs!r}")
