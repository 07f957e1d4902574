"""Input checks shared by the public functions.

Every public function resolves its namespace once, through :func:`namespace_of`, and checks
each array argument by name, so that errors say which argument is wrong and why.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from .backends import Backend, get_backend

Array = Any


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


def check_finite(xp: Any, x: Array, name: str) -> None:
    """Raise ValueError if ``x`` holds NaN or Inf."""
    if not bool(xp.all(xp.isfinite(x))):
        raise ValueError(f"{name} contains NaN or Inf")


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


def result_dtype(xp: Any, *arrays: Array) -> Any:
    """The floating dtype that ``arrays`` promote to."""
    return xp.result_type(*[a.dtype for a in arrays if a is not None])
