r"""Kernel modes: one class per layout of :math:`\Theta[n,m,o,p] = \sum_k J_1[n,o,k] J_2[m,p,k]`.

========== ===================== ==============================================
mode       shape                 entries
========== ===================== ==============================================
"full"     (N1, N2, O, O)        :math:`\Theta[n,m,o,p]`
"trace"    (N1, N2)              :math:`\sum_o \Theta[n,m,o,o]`
"diagonal" (N1, N2, O)           :math:`\Theta[n,m,o,o]`
"pseudo"   (N1, N2)              features only: the trace of :math:`\sum_o f_o/\sqrt{O}`
========== ===================== ==============================================

A :class:`Mode` is the validated mode string (it compares, hashes and prints as the string),
returned by :func:`check_mode` from the registry that :func:`register_mode` fills.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import array_api_compat

from ._typing import Array

__all__ = ["DIAGONAL", "FEATURE_MODES", "FULL", "MODES", "TRACE", "Mode", "check_mode",
           "register_mode"]

#: The built-in kernel modes, in the order error messages list them.
MODES = ("full", "trace", "diagonal")
#: The modes of :func:`ntkcore.features` (and the hint for the one it lacks).
FEATURE_MODES = ("full", "trace", "pseudo")
FEATURE_HINT = {"diagonal": " (the diagonal kernel is Phi[:, o] @ Phi[:, o].T of mode='full')"}

_REGISTRY: dict[str, Mode] = {}


class Mode(str):
    """A validated kernel mode: its layout, and the pieces of the contractions that produce it.

    A tile comes from the contractions in its *GEMM layout*, (r, c, tail) except where a mode
    says otherwise (full: (r, O, c, O)); :meth:`kernel_layout` turns it into the kernel's.
    Factor arguments: ``j`` (n, O, P) dense rows, ``g`` (n, S, O, d_out) Kronecker output
    factors, ``aa`` an (r, c) or (r S, c T) Gram of the input factors; ``same``: the two
    sides are one array (a self-product, which NumPy computes as SYRK).
    """

    __slots__ = ()
    name: ClassVar[str]  # the mode string, set by each subclass
    #: Positions of the trailing axes after a transpose (:meth:`swap`); their count is the
    #: number of output axes.
    tail_axes: ClassVar[tuple[int, ...]] = ()
    #: Whether the outputs are summed (:math:`o = p`): the contractions may then run over
    #: ``O d_out`` at once.
    sums_outputs: ClassVar[bool] = False
    #: Copies of a tile's factor slices the products make (batched GEMMs permute theirs).
    input_copies: ClassVar[int] = 1
    #: Whether a tile in GEMM layout is already a contiguous kernel (returned as computed).
    tile_is_kernel: ClassVar[bool] = False
    #: Whether the kernel functions take it (False: a mode of :func:`ntkcore.features` only).
    kernel: ClassVar[bool] = True
    #: Whether the model's outputs are contracted first (the pseudo-NTK).
    pseudo: ClassVar[bool] = False
    #: Whether the kernel is joined from kernels of chunks of the outputs
    #: (:meth:`join_output_chunks`): the factors of a few outputs at a time then suffice.
    output_chunks: ClassVar[bool] = False
    #: Whether :meth:`dense` contracts its rows' (O, P) axes as one (trace: one GEMM with
    #: K = O P), so that rows may come as (r, 1, O P) with the columns in any order (the
    #: "materialise" route then forms its weights in a faster layout).
    flat_rows: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that defines its own ``dense`` gets ``flat_rows`` False, and one that
        defines its own ``pair_products`` the generic :meth:`block_products`, unless it sets
        them too: an inherited fast form would bypass its own contraction."""
        super().__init_subclass__(**kwargs)
        if "dense" in cls.__dict__ and "flat_rows" not in cls.__dict__:
            cls.flat_rows = False
        if "pair_products" in cls.__dict__ and "block_products" not in cls.__dict__:
            cls.block_products = Mode.block_products  # type: ignore[method-assign]

    def join_output_chunks(self, xp: Any, parts: list[Array]) -> Array:
        """The kernel from the kernels of consecutive chunks of the outputs."""
        raise ValueError(f"mode {self!r} pairs every output with every other: its kernel is "
                         "not joined from chunks of the outputs")

    def feature_jacobian(self, j: Any) -> Any:
        """The Jacobian whose rows :func:`ntkcore.features` projects in this mode: ``j``
        itself (features (N, O, dim)) or ``j.merged_outputs()`` (features (N, dim))."""
        raise ValueError(f"mode {self!r} has no features")

    # -- layout --------------------------------------------------------------------------
    def tail(self, o: int) -> tuple[int, ...]:
        """Trailing shape of the kernel for ``o`` outputs."""
        return (o,) * len(self.tail_axes)

    def entries(self, o: int) -> int:
        """Numbers per kernel entry (n, m): 1, O or O^2."""
        return o ** len(self.tail_axes)

    def partners(self, o: int) -> int:
        """Outputs ``p`` that one output ``o`` meets in a GEMM: O in full mode, else 1."""
        return 1

    def gemm_outputs(self, o: int) -> int:
        """Output pairs the GEMMs produce per sample pair: O^2 in full mode, else O."""
        return o * self.partners(o)

    def swap(self, lead: int = 0) -> tuple[int, ...]:
        """Axes permutation taking a kernel (lead..., N2, N1, tail) to (lead..., N1, N2, tail):
        :math:`\\Theta_{12}[n,m,o,p] = \\Theta_{21}[m,n,p,o]`."""
        return tuple(range(lead)) + tuple(a + lead for a in (1, 0, *self.tail_axes))

    def transpose(self, xp: Any, k: Array, lead: int = 0) -> Array:
        """``k`` (lead..., N2, N1, tail) as (lead..., N1, N2, tail) (a view where ``xp`` has
        views)."""
        return xp.permute_dims(k, self.swap(lead))

    def mirror(self, xp: Any, k: Array, lead: int = 0) -> Array:
        r"""The square kernel ``k`` (lead..., N, N, tail) made exactly symmetric by
        construction: entries on and above the diagonal of the matrix view (row
        ``n * O + o``, column ``m * O + p``) are kept, those below are the transpose of their
        mirror image above, :math:`K[m,n,p,o] := K[n,m,o,p]` for :math:`(n,o) < (m,p)`.

        No BLAS promises that ``X @ X.T`` comes out symmetric (MKL, OpenBLAS and cuBLAS may
        round its two triangles differently), and a contraction over positions sums
        ``(n, m)`` and ``(m, n)`` in different orders.  One ``where``: :mod:`ntkcore.gram`
        applies it to cache-sized blocks (:meth:`mirror_tile`), and to whole tiles only where
        arrays have no item assignment (JAX).
        """
        n = k.shape[lead]
        keep = self._upper(xp, n, k.shape[lead + 2:], array_api_compat.device(k))
        return xp.where(keep, k, self.transpose(xp, k, lead))

    def _upper(self, xp: Any, n: int, tail: tuple[int, ...], device: Any) -> Array:
        """Where (n, m, tail) lies on or above the diagonal of the matrix view."""
        pos = xp.arange(n, device=device)
        keep = pos[:, None] <= pos[None, :]
        return keep[(...,) + (None,) * len(tail)]

    def mirror_tile(self, xp: Any, tile: Array, width: int, block: int) -> None:
        """Make the square ``tile[:, :width]`` (a diagonal tile of a self-kernel, GEMM layout)
        exactly symmetric in place, in strips of ``block`` rows (:func:`_mirror_strips`)."""
        _mirror_strips(xp, self, tile[:, :width, ...], block)

    def _no_matrix(self, *args: Any) -> Any:
        raise ValueError(f"a {self!r} kernel has no matrix view")

    #: The matrix view (N1 q, N2 q), rows ``n * q + o`` (``matrix(xp, k)``), its inverse
    #: (``unmatrix(xp, kf, o)``), ``q`` (``matrix_rows(o)``) and its diagonal
    #: (``matrix_diagonal(xp, k)``, from a self-kernel in :attr:`matrix_diagonal_mode`);
    #: ValueError for a mode without one.
    matrix = unmatrix = matrix_rows = matrix_diagonal = _no_matrix
    matrix_diagonal_mode: ClassVar[str] = ""

    def kernel_layout(self, xp: Any, t: Array) -> Array:
        """A tile in GEMM layout as (r, c, tail)."""
        return t

    def tile_part(self, t: Array, rows: slice, cols: slice) -> Array:
        """Samples ``rows`` x ``cols`` of a tile in GEMM layout."""
        return t[rows, cols, ...]

    def broadcast(self, aa: Array) -> Array:
        """An (r, c) array of sample pairs, broadcast against a tile in GEMM layout."""
        return aa[(...,) + (None,) * len(self.tail_axes)]

    # -- contraction pieces ----------------------------------------------------------------
    def dense(self, xp: Any, j1: Array, j2: Array, same: bool) -> Array:
        """Tile of dense rows ``j1`` (r, O, P), ``j2`` (c, O, P), in GEMM layout."""
        raise NotImplementedError

    def positions(self, xp: Any, aa: Array, g1: Array, g2: Array, same: bool) -> Array:
        r"""Tile of a Kronecker block over positions: :math:`\sum_{s,t} A[n,s,m,t]
        \langle g[n,s,o], g'[m,t,p]\rangle` for ``aa`` (r S, c T)."""
        raise NotImplementedError

    def pair_products(self, xp: Any, x1: Array, x2: Array, o: int) -> Array:
        """Per matching pair, its (M, entries) products of the gathered g rows (M, O d_out)."""
        raise NotImplementedError

    def block_products(self, xp: Any, x1: Array, x2: Array, o: int) -> Array:
        """Products (k, B1, B2, entries) of every row of ``x1`` (k, B1, O d_out) with every row
        of ``x2`` (k, B2, O d_out) in the same group (the "tokens" route): here
        :meth:`pair_products` of the broadcast pairs; a mode with a GEMM form overrides it."""
        k, b1, w = x1.shape
        b2 = x2.shape[1]
        e1 = xp.broadcast_to(x1[:, :, None, :], (k, b1, b2, w))
        e2 = xp.broadcast_to(x2[:, None, :, :], (k, b1, b2, w))
        v = self.pair_products(xp, xp.reshape(e1, (k * b1 * b2, w)),
                               xp.reshape(e2, (k * b1 * b2, w)), o)
        return xp.reshape(v, (k, b1, b2, self.entries(o)))

    def transpose_outputs(self, xp: Any, v: Array, o: int) -> Array:
        """Per-pair products (M, entries) with ``o`` and ``p`` swapped."""
        return v

    def cells_to_tile(self, xp: Any, cells: Array, r: int, c: int, o: int) -> Array:
        """Cell sums (r c, entries) as a tile in GEMM layout."""
        return xp.reshape(cells, (r, c, *self.tail(o)))


def _weighted_g(xp: Any, aa: Array, g1: Array, c: int, t: int) -> Array:
    """:math:`Y[n, (m,t), (o,k)] = \\sum_s A[n,s,m,t]\\, g[n,s,o,k]`: r batched
    (cT, S) @ (S, O d_out)."""
    r, s, o, dout = g1.shape
    at = xp.permute_dims(xp.reshape(aa, (r, s, c * t)), (0, 2, 1))
    return at @ xp.reshape(g1, (r, s, o * dout))


def _mirror_strips(xp: Any, mode: Mode, square: Array, b: int) -> None:
    """:meth:`Mode.mirror_tile` of a square in strips of ``b`` rows: the block on the
    diagonal through :meth:`Mode.mirror` (a small temporary), the strip right of it copied,
    transposed, into the strip below; nothing tile-sized is allocated."""
    r = square.shape[0]
    for i0 in range(0, r, b):
        i1 = min(r, i0 + b)
        square[i0:i1, i0:i1, ...] = mode.mirror(xp, square[i0:i1, i0:i1, ...])
        if i1 < r:
            square[i1:, i0:i1, ...] = mode.transpose(xp, square[i0:i1, i1:, ...])


def register_mode(cls: type[Mode]) -> type[Mode]:
    """Class decorator: make ``cls(cls.name)`` a mode :func:`check_mode` accepts."""
    _REGISTRY[cls.name] = cls(cls.name)
    return cls


@register_mode
class FullMode(Mode):
    """(N1, N2, O, O); GEMM layout (r, O, c, O), whose matrix view (r O, c O) is a reshape."""

    __slots__ = ()
    name = "full"
    tail_axes = (3, 2)
    matrix_diagonal_mode = "diagonal"

    def partners(self, o: int) -> int:
        return o

    def feature_jacobian(self, j: Any) -> Any:
        return j

    def _upper(self, xp: Any, n: int, tail: tuple[int, ...], device: Any) -> Array:
        o = tail[0]
        pos = xp.arange(n * o, device=device)  # entry (n, o) of the matrix view
        return xp.reshape(pos, (n, 1, o, 1)) <= xp.reshape(pos, (1, n, 1, o))

    def mirror_tile(self, xp: Any, tile: Array, width: int, block: int) -> None:
        r, o, c = tile.shape[0], tile.shape[1], tile.shape[2]
        try:  # the matrix view itself (no copy), where the tile's strides allow it
            matrix = xp.reshape(tile, (r * o, c * o), copy=False)
        except (ValueError, AttributeError, RuntimeError):  # a permuted tile: sample blocks
            _mirror_samples(xp, tile[:, :, :width, :], block)
            return
        _mirror_strips(xp, TRACE, matrix[:, :width * o], block)

    def matrix_rows(self, o: int) -> int:
        return o

    def matrix(self, xp: Any, k: Array) -> Array:
        n1, n2, o = k.shape[0], k.shape[1], k.shape[2]
        if o == 1:
            return xp.reshape(k, (n1, n2))
        return xp.reshape(xp.permute_dims(k, (0, 2, 1, 3)), (n1 * o, n2 * o))

    def unmatrix(self, xp: Any, kf: Array, o: int) -> Array:
        return xp.permute_dims(xp.reshape(kf, (kf.shape[0] // o, o, kf.shape[1] // o, o)),
                               (0, 2, 1, 3))

    def matrix_diagonal(self, xp: Any, k: Array) -> Array:
        d = xp.linalg.diagonal(xp.permute_dims(k, (2, 0, 1)))  # (O, b)
        return xp.reshape(d.T, (-1,))

    def kernel_layout(self, xp: Any, t: Array) -> Array:
        return xp.permute_dims(t, (0, 2, 1, 3))

    def tile_part(self, t: Array, rows: slice, cols: slice) -> Array:
        return t[rows, :, cols, :]

    def broadcast(self, aa: Array) -> Array:
        return aa[:, None, :, None]

    def dense(self, xp: Any, j1: Array, j2: Array, same: bool) -> Array:
        (r, o, p), c = j1.shape, j2.shape[0]  # (r O, P) @ (P, c O) -> (r, O, c, O)
        x1 = xp.reshape(j1, (r * o, p))
        k = x1 @ (x1 if same else xp.reshape(j2, (c * o, p))).T
        return xp.reshape(k, (r, o, c, o))

    def positions(self, xp: Any, aa: Array, g1: Array, g2: Array, same: bool) -> Array:
        r, o, dout = g1.shape[0], g1.shape[2], g1.shape[3]
        c, t = g2.shape[0], g2.shape[1]
        y = _weighted_g(xp, aa, g1, c, t)
        # Theta[n,m,o,p] = sum_{t,k} Y[n,m,t,o,k] g'[m,t,p,k]: c batched (r O, T d) @ (T d, O)
        yp = xp.permute_dims(xp.reshape(y, (r, c, t, o, dout)), (1, 0, 3, 2, 4))
        yp = xp.reshape(yp, (c, r * o, t * dout))
        g2p = xp.reshape(xp.permute_dims(g2, (0, 2, 1, 3)), (c, o, t * dout))
        k = yp @ xp.permute_dims(g2p, (0, 2, 1))  # (c, r O, O)
        return xp.permute_dims(xp.reshape(k, (c, r, o, o)), (1, 2, 0, 3))  # (r, O, c, O)

    def pair_products(self, xp: Any, x1: Array, x2: Array, o: int) -> Array:
        m = x1.shape[0]  # (M, O, d) @ (M, d, O)
        x1, x2 = xp.reshape(x1, (m, o, -1)), xp.reshape(x2, (m, o, -1))
        return xp.reshape(x1 @ xp.permute_dims(x2, (0, 2, 1)), (m, o * o))

    def block_products(self, xp: Any, x1: Array, x2: Array, o: int) -> Array:
        (k, b1, w), b2 = x1.shape, x2.shape[1]  # k batched (B1 O, d) @ (d, B2 O)
        y1, y2 = xp.reshape(x1, (k, b1 * o, w // o)), xp.reshape(x2, (k, b2 * o, w // o))
        v = xp.reshape(y1 @ xp.permute_dims(y2, (0, 2, 1)), (k, b1, o, b2, o))
        return xp.reshape(xp.permute_dims(v, (0, 1, 3, 2, 4)), (k, b1, b2, o * o))

    def transpose_outputs(self, xp: Any, v: Array, o: int) -> Array:
        return xp.reshape(xp.permute_dims(xp.reshape(v, (-1, o, o)), (0, 2, 1)), (-1, o * o))

    def cells_to_tile(self, xp: Any, cells: Array, r: int, c: int, o: int) -> Array:
        return xp.permute_dims(xp.reshape(cells, (r, c, o, o)), (0, 2, 1, 3))  # (r, O, c, O)


def _mirror_samples(xp: Any, square: Array, block: int) -> None:
    """:meth:`FullMode.mirror_tile` of a square (r, O, r, O) that is no reshape of its matrix
    view (a tile the "positions" or "pairs" route permuted): strips of ``block // O``
    samples."""
    r, o = square.shape[0], square.shape[1]
    b = max(1, block // o)
    for i0 in range(0, r, b):
        i1 = min(r, i0 + b)
        nb = i1 - i0
        sq = xp.reshape(square[i0:i1, :, i0:i1, :], (nb * o, nb * o))  # a copy
        square[i0:i1, :, i0:i1, :] = xp.reshape(TRACE.mirror(xp, sq), (nb, o, nb, o))
        if i1 < r:
            square[i1:, :, i0:i1, :] = xp.permute_dims(square[i0:i1, :, i1:, :], (2, 3, 0, 1))


@register_mode
class TraceMode(Mode):
    """(N1, N2): the outputs summed, the contractions run over ``O d_out`` at once."""

    __slots__ = ()
    name = "trace"
    sums_outputs = True
    flat_rows = True
    tile_is_kernel = True
    matrix_diagonal_mode = "trace"
    output_chunks = True

    def join_output_chunks(self, xp: Any, parts: list[Array]) -> Array:
        # sum_o over all outputs = sum over chunks of sum_o within the chunk
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def feature_jacobian(self, j: Any) -> Any:
        return j.merged_outputs()

    def matrix_rows(self, o: int) -> int:
        return 1

    def matrix(self, xp: Any, k: Array) -> Array:
        return k

    def unmatrix(self, xp: Any, kf: Array, o: int) -> Array:
        return kf

    def matrix_diagonal(self, xp: Any, k: Array) -> Array:
        return xp.linalg.diagonal(k)

    def dense(self, xp: Any, j1: Array, j2: Array, same: bool) -> Array:
        (r, o, p), c = j1.shape, j2.shape[0]  # one GEMM with K = O P
        x1 = xp.reshape(j1, (r, o * p))
        return x1 @ (x1 if same else xp.reshape(j2, (c, o * p))).T

    def positions(self, xp: Any, aa: Array, g1: Array, g2: Array, same: bool) -> Array:
        r, s, o, dout = g1.shape
        c, t = g2.shape[0], g2.shape[1]
        # G[(n,s),(m,t)] = sum_o <g[n,s,o], g'[m,t,o]>;  Theta[n,m] = sum_{s,t} A (.) G
        y1 = xp.reshape(g1, (r * s, o * dout))
        gg = y1 @ (y1 if same else xp.reshape(g2, (c * t, o * dout))).T
        return xp.sum(xp.reshape(aa * gg, (r, s, c, t)), axis=(1, 3))

    def pair_products(self, xp: Any, x1: Array, x2: Array, o: int) -> Array:
        return xp.vecdot(x1, x2, axis=-1)[:, None]

    def block_products(self, xp: Any, x1: Array, x2: Array, o: int) -> Array:
        return (x1 @ xp.permute_dims(x2, (0, 2, 1)))[..., None]  # k (B1, O d) @ (O d, B2)


@register_mode
class DiagonalMode(Mode):
    """(N1, N2, O): O batched products, one per output."""

    __slots__ = ()
    name = "diagonal"
    tail_axes = (2,)
    input_copies = 2
    output_chunks = True

    def join_output_chunks(self, xp: Any, parts: list[Array]) -> Array:
        # the output axis is last, with and without a leading layer axis
        return parts[0] if len(parts) == 1 else xp.concat(parts, axis=-1)

    def dense(self, xp: Any, j1: Array, j2: Array, same: bool) -> Array:
        # O batched GEMMs (O, r, P) @ (O, P, c) -> (O, r, c) -> (r, c, O)
        k = xp.permute_dims(j1, (1, 0, 2)) @ xp.permute_dims(j2, (1, 2, 0))
        return xp.permute_dims(k, (1, 2, 0))

    def positions(self, xp: Any, aa: Array, g1: Array, g2: Array, same: bool) -> Array:
        r, o, dout = g1.shape[0], g1.shape[2], g1.shape[3]
        c, t = g2.shape[0], g2.shape[1]
        # Theta[n,m,o] = sum_{t,k} Y[n,m,t,o,k] g'[m,t,o,k]
        y5 = xp.reshape(_weighted_g(xp, aa, g1, c, t), (r, c, t, o, dout))
        return xp.sum(xp.vecdot(y5, g2[None, ...], axis=-1), axis=2)

    def pair_products(self, xp: Any, x1: Array, x2: Array, o: int) -> Array:
        m = x1.shape[0]
        return xp.vecdot(xp.reshape(x1, (m, o, -1)), xp.reshape(x2, (m, o, -1)), axis=-1)

    def block_products(self, xp: Any, x1: Array, x2: Array, o: int) -> Array:
        (k, b1, w), b2 = x1.shape, x2.shape[1]  # k O batched (B1, d) @ (d, B2)
        y1 = xp.permute_dims(xp.reshape(x1, (k, b1, o, w // o)), (0, 2, 1, 3))
        y2 = xp.permute_dims(xp.reshape(x2, (k, b2, o, w // o)), (0, 2, 3, 1))
        return xp.permute_dims(y1 @ y2, (0, 2, 3, 1))


@register_mode
class PseudoMode(TraceMode):
    r"""The pseudo-NTK's features: those of trace mode for :math:`\sum_o f_o / \sqrt{O}`."""

    __slots__ = ()
    name = "pseudo"
    kernel = False
    pseudo = True

    def feature_jacobian(self, j: Any) -> Any:
        return (j.pseudo() if j.num_outputs > 1 else j).merged_outputs()


FULL, TRACE, DIAGONAL = _REGISTRY["full"], _REGISTRY["trace"], _REGISTRY["diagonal"]


def check_mode(mode: Any, allowed: Sequence[str] | None = None, context: str = "",
               hint: dict[str, str] | None = None) -> Mode:
    """``mode`` as a :class:`Mode`, or ValueError ``mode must be one of {allowed}{context};
    got {mode!r}{hint[mode]}`` when it is not a string in ``allowed`` (default: every
    registered kernel mode)."""
    names = tuple(k for k, m in _REGISTRY.items() if m.kernel) if allowed is None \
        else tuple(allowed)
    if not isinstance(mode, str) or mode not in names or mode not in _REGISTRY:
        extra = (hint or {}).get(mode, "") if isinstance(mode, str) else ""
        raise ValueError(f"mode must be one of {names}{context}; got {mode!r}{extra}")
    return _REGISTRY[str(mode)]
