r"""Kernel modes: what ``mode`` means for the layout of a kernel, in one place.

For Jacobians :math:`J_1` (N1, O, P) and :math:`J_2` (N2, O, P) the kernel
:math:`\Theta[n,m,o,p] = \sum_k J_1[n,o,k] J_2[m,p,k]` is returned in one of three modes:

========== ===================== ==============================================
mode       shape                 entries
========== ===================== ==============================================
"full"     (N1, N2, O, O)        :math:`\Theta[n,m,o,p]`
"trace"    (N1, N2)              :math:`\sum_o \Theta[n,m,o,o]`
"diagonal" (N1, N2, O)           :math:`\Theta[n,m,o,o]`
========== ===================== ==============================================

A :class:`Mode` is the validated mode string (it compares, hashes and prints as the string),
returned by :func:`check_mode` at each public entry; it knows its trailing shape, how to
transpose a kernel (:math:`\Theta_{21}[m,n,p,o] = \Theta_{12}[n,m,o,p]`), mirror one triangle
of a self-kernel's tile (:meth:`Mode.mirror`) and the matrix view
of a full kernel, (N1 O, N2 O) with row index ``n * O + o``.  To add a mode, add it here and
teach :mod:`ntkcore.gram`'s tiles to produce it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import array_api_compat

from ._typing import Array

__all__ = ["DIAGONAL", "FULL", "MODES", "TRACE", "Mode", "check_mode"]

#: Every kernel mode, in the order error messages list them.
MODES = ("full", "trace", "diagonal")

_TAIL_AXES = {"full": (3, 2), "trace": (), "diagonal": (2,)}


class Mode(str):
    """A validated kernel mode (a ``str``: ``"full"``, ``"trace"`` or ``"diagonal"``)."""

    __slots__ = ()

    def tail(self, o: int) -> tuple[int, ...]:
        """Trailing shape of the kernel for ``o`` outputs: (O, O), () or (O,)."""
        return (o, o) if self == "full" else (o,) if self == "diagonal" else ()

    def swap(self, lead: int = 0) -> tuple[int, ...]:
        """Axes permutation taking a kernel (lead..., N2, N1, tail) to (lead..., N1, N2, tail):
        :math:`\\Theta_{12}[n,m,o,p] = \\Theta_{21}[m,n,p,o]`."""
        return tuple(range(lead)) + tuple(a + lead for a in (1, 0, *_TAIL_AXES[self]))

    def transpose(self, xp: Any, k: Array, lead: int = 0) -> Array:
        """``k`` (lead..., N2, N1, tail) as (lead..., N1, N2, tail) (a view where ``xp`` has
        views)."""
        return xp.permute_dims(k, self.swap(lead))

    def mirror(self, xp: Any, k: Array, lead: int = 0) -> Array:
        r"""The square kernel ``k`` (lead..., N, N, tail) made exactly symmetric by
        construction: entries on and above the diagonal of the matrix view (row
        ``n * O + o``, column ``m * O + p``) are kept, those below are the transpose of their
        mirror image above, :math:`K[m,n,p,o] := K[n,m,o,p]` for :math:`(n,o) < (m,p)`.

        This is how a self-kernel is symmetric bit for bit on any machine: no BLAS promises
        that a product ``X @ X.T`` comes out symmetric (MKL, OpenBLAS and cuBLAS may round
        its two triangles differently), and a contraction over positions sums ``(n, m)`` and
        ``(m, n)`` in different orders.  One ``where``, which allocates the result and a
        boolean mask of ``k``'s size: :mod:`ntkcore.gram` applies it to cache-sized blocks on
        the diagonal of a writable output, and to whole tiles only where arrays have no item
        assignment (JAX).
        """
        n = k.shape[lead]
        o = k.shape[lead + 2] if self == "full" else 1
        # position of entry (n, o) in the matrix view, broadcast as rows and as columns
        pos = xp.arange(n * o, device=array_api_compat.device(k))
        if self == "full":
            keep = xp.reshape(pos, (n, 1, o, 1)) <= xp.reshape(pos, (1, n, 1, o))
        else:
            keep = pos[:, None] <= pos[None, :]
            if self == "diagonal":
                keep = keep[:, :, None]
        return xp.where(keep, k, self.transpose(xp, k, lead))

    def matrix(self, xp: Any, k: Array) -> Array:
        """The kernel as a matrix: trace mode as is (N1, N2); full mode
        (N1, N2, O, O) -> (N1, O, N2, O) -> (N1 O, N2 O), rows ``n * O + o``."""
        if self == "trace":
            return k
        if self != "full":
            raise ValueError(f"a {self!r} kernel has no matrix view")
        n1, n2, o = k.shape[0], k.shape[1], k.shape[2]
        if o == 1:
            return xp.reshape(k, (n1, n2))
        return xp.reshape(xp.permute_dims(k, (0, 2, 1, 3)), (n1 * o, n2 * o))

    def unmatrix(self, xp: Any, kf: Array, o: int) -> Array:
        """Inverse of :meth:`matrix`: (N1 O, N2 O) -> (N1, N2, O, O) in full mode."""
        if self == "trace":
            return kf
        if self != "full":
            raise ValueError(f"a {self!r} kernel has no matrix view")
        return xp.permute_dims(xp.reshape(kf, (kf.shape[0] // o, o, kf.shape[1] // o, o)),
                               (0, 2, 1, 3))


_BY_NAME = {m: Mode(m) for m in MODES}
FULL, TRACE, DIAGONAL = _BY_NAME["full"], _BY_NAME["trace"], _BY_NAME["diagonal"]


def check_mode(mode: Any, allowed: Sequence[str] = MODES, context: str = "") -> Mode:
    """``mode`` as a :class:`Mode`, or ValueError ``mode must be one of {allowed}{context};
    got {mode!r}`` when it is not a string in ``allowed``."""
    if not isinstance(mode, str) or mode not in allowed or mode not in _BY_NAME:
        raise ValueError(f"mode must be one of {tuple(allowed)}{context}; got {mode!r}")
    return _BY_NAME[str(mode)]
