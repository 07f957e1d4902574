"""Memory budgets: parsing ``max_memory`` arguments and the default budget of a device.

A budget is resolved once, at the public call, into a :class:`Budget` whose shares
(:meth:`Budget.share`, :meth:`Budget.less`) are passed down; one batching policy
(:func:`batch_samples`) serves :func:`ntkcore.ntk` and the KIP path.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["CALL_OVERHEAD", "DEFAULT_FRACTION", "FALLBACK_BUDGET", "PROBE_SAMPLES", "Budget",
           "batch_samples", "default_budget", "itemsize", "parse_memory", "resolve_budget"]

#: Fraction of the free memory of a device used as the default working-memory budget.
DEFAULT_FRACTION = 0.25
#: Budget (bytes) used when the backend cannot report free memory: 1 GiB.
FALLBACK_BUDGET = 1 << 30
#: Smallest budget the default ever gives (64 MiB), so a nearly full device still makes progress.
MIN_DEFAULT_BUDGET = 64 << 20
#: Samples in the first (measuring) provider call of a batched computation: one, so that the
#: only allocation made before the budget is checked is one sample's factors (a call on
#: CALL_OVERHEAD x 534 MB for a ResNet-50 at 224 px with 10 outputs), whatever the model.
PROBE_SAMPLES = 1
#: Transient bytes of a provider call per byte of factors it returns.
CALL_OVERHEAD = 3

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_memory(value: Any, name: str = "max_memory") -> int:
    """Bytes from an ``int``, ``float`` or a string such as ``"2GB"`` or ``"512 MiB"``: decimal
    units ``kB``, ``MB``, ``GB``, ``TB`` (also ``K``, ``M``, ``G``, ``T``), binary ``KiB`` ...
    ``TiB``, or ``B``; case ignored, spaces allowed (``"1.5 gib"``, ``"1e9"``).

    Parameters
    ----------
    value : int, float or str
        The budget.  Must be positive.
    name : str
        Argument name used in error messages.

    Returns
    -------
    int
        The number of bytes (rounded down, at least 1).

    Raises
    ------
    TypeError
        If ``value`` is neither a number nor a string (``bool`` is rejected too).
    ValueError
        If the string cannot be parsed, the unit is unknown, or the value is not a positive
        finite number.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string like '2GB'; got {value!r}")
    if isinstance(value, str):
        m = _PATTERN.match(value.lower())
        if m is None:
            raise ValueError(f"{name} must look like '2GB', '512MiB' or '1e9'; got {value!r}")
        number, unit = m.groups()
        if unit not in _UNITS:
            raise ValueError(
                f"{name} has unknown unit {unit!r} in {value!r}; use B, kB, MB, GB, TB, "
                "KiB, MiB, GiB or TiB"
            )
        nbytes = float(number) * _UNITS[unit]
    else:
        try:
            nbytes = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"{name} must be a number of bytes or a string like '2GB'; got "
                f"{type(value).__name__}"
            ) from None
    if not math.isfinite(nbytes) or nbytes <= 0:
        raise ValueError(f"{name} must be a positive, finite number of bytes; got {value!r}")
    return max(1, int(nbytes))


def default_budget(backend: Any, device: Any, fraction: float = DEFAULT_FRACTION) -> int:
    """Bytes: ``fraction`` of the free memory of ``device`` as ``backend.free_memory`` reports
    it (host ``MemAvailable`` for CPU arrays), at least :data:`MIN_DEFAULT_BUDGET` (also when
    none is free); :data:`FALLBACK_BUDGET` when it is unknown (``None``).  A default budget
    stays marked (:class:`Budget`), so :func:`ntkcore.gram` plans it with its leading bits
    only: calls in the same memory situation share a plan."""
    try:
        free = backend.free_memory(device)
    except Exception:  # a failing probe must not break the computation
        free = None
    if free is None:
        return FALLBACK_BUDGET
    return max(MIN_DEFAULT_BUDGET, int(max(free, 0) * fraction))


class Budget(int):
    """A resolved budget: an ``int`` of bytes (at least 1), immutable, that knows whether it
    is the ``default`` (a share of the free memory) and how messages name it (``given``: "the
    default budget", the user's ``max_memory='2GB'``, or ``max_memory=<bytes>`` for a share).
    :func:`resolve_budget` returns a :class:`Budget` it is given as it is."""

    default: bool
    given: str

    def __new__(cls, nbytes: float, default: bool = False, given: str = "") -> Budget:
        self = super().__new__(cls, max(1, int(nbytes)))
        object.__setattr__(self, "default", bool(default))
        object.__setattr__(self, "given", given or f"max_memory={int(self)}")
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Budget is immutable")

    def share(self, k: int) -> Budget:
        """``self // k`` bytes (at least 1), default if this one is."""
        return Budget(self // k, self.default)

    def less(self, used: float, floor: int = 1) -> Budget:
        """``self - used`` bytes, at least ``floor`` (and 1), default if this one is."""
        return Budget(max(self - used, floor), self.default)


def resolve_budget(max_memory: Any, backend: Any, device: Any) -> Budget:
    """The :class:`Budget` of ``max_memory``: parsed, or :func:`default_budget` when ``None``;
    a :class:`Budget` is returned as it is."""
    if isinstance(max_memory, Budget):
        return max_memory
    if max_memory is None:
        return Budget(default_budget(backend, device), True, "the default budget")
    return Budget(parse_memory(max_memory, "max_memory"), False, f"max_memory={max_memory!r}")


def itemsize(xp: Any, dtype: Any) -> int:
    """Bytes per number of the real floating (or integer: an index factor) ``dtype`` of
    ``xp``."""
    if xp.isdtype(dtype, "integral"):
        return int(xp.iinfo(dtype).bits) // 8
    return int(xp.finfo(dtype).bits) // 8


def batch_samples(per_sample: float, budget: float, extra: float = 0.0) -> int:
    """Samples per provider call within ``budget`` bytes, at least 1: ``floor(budget / (3 b +
    extra))`` for ``b = per_sample`` factor bytes and ``extra`` further bytes per sample (e.g.
    materialised weights)."""
    return max(1, int(budget // max(1.0, CALL_OVERHEAD * per_sample + extra)))
