r"""Memory-bounded Gram contractions of structured Jacobians: the empirical NTK.

For Jacobians :math:`J` (N1, O, P) and :math:`J'` (N2, O, P) split into the same parameter
blocks ``b``, :math:`\Theta = \sum_b \Theta_b` with
:math:`\Theta_b[n, m, o, p] = \sum_k J_b[n, o, k]\, J'_b[m, p, k]`, laid out by the
:mod:`~ntkcore.modes` mode.  The kernel is computed in tiles (:mod:`ntkcore.tiling`), block
after block, each block on one :class:`Route` (the registry :data:`ROUTES`: how its tile is
contracted and what that costs); the planner picks per block the route with the fewest flops
at the largest tile that fits ``max_memory`` (:func:`plan_gram`).  A self-kernel computes the
tiles on and above the diagonal, diagonal tiles in up to ``SYMMETRIC_MAX_PANELS`` row panels,
and mirrors one triangle of each diagonal tile (:meth:`~ntkcore.modes.Mode.mirror_tile`): it
is exactly symmetric, bit for bit.  Design notes and timings: docs/architecture.md.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple

import array_api_compat

from ._cache import LRUCache
from ._memory import Budget, itemsize, resolve_budget
from ._typing import Array
from ._validation import all_finite, first_nonfinite, namespace_of
from .backend import get_backend, on_gpu
from .errors import BudgetTooSmallError
from .jacobian import (
    DenseBlock,
    Jacobian,
    KroneckerBlock,
    as_jacobian,
    factor_gram,
    flat_weights,
    one_hot_rows,
    with_ones,
)
from .modes import Mode, check_mode
from .support import capabilities
from .tiling import TileGrid, panel_share, progress_steps, sizes

__all__ = ["ROUTES", "GramPlan", "Route", "gram", "plan_gram", "register_route"]

#: Flop-equivalents of one element of a memory-bound pass (a gather, a scatter, index
#: arithmetic): such passes run at memory speed, tens of times fewer elements per second than
#: a GEMM does flops on a CPU core.  Charged to the index routes only (:class:`PairsRoute`,
#: :class:`TokensRoute`).
ELEMENT_FLOPS = 16

#: Matching pairs the "pairs" route gathers at a time: at least ``PAIRS_MIN_CHUNK`` (the
#: working set the cost model charges when it picks a tile), at most ``PAIRS_MAX_CHUNK`` (the
#: plan takes the largest chunk between the two that its budget holds).
PAIRS_MIN_CHUNK = 256
PAIRS_MAX_CHUNK = 1 << 16

#: Flop-equivalents of the "tokens" route's fixed work per tile (:class:`TokensRoute`): its
#: sorts, the host reads of its groups' shapes and about a hundred small array calls, 1-2 ms
#: in torch on a CPU (the bench GRU's and BERT's embeddings at N = 32: 3.3 and 2.3 ms against
#: "pairs"' 1.6 and 1.0 ms); without it the route won those blocks and BERT's at N = 256.
TOKENS_TILE_FLOPS = 10 ** 8

#: Splitting a symmetric kernel into k x k tiles and computing only the upper triangle does
#: (k+1)/(2k) of the work but mirrors the lower tiles (a transposed copy, memory bound).  The
#: split is made only when the budget forces tiles anyway or when the contraction costs at
#: least this many flops per kernel entry, and then with tiles no smaller than
#: ``SYMMETRIC_MIN_TILE`` (CPU / GPU).
SYMMETRIC_SPLIT_FLOPS_PER_ENTRY = 2048
SYMMETRIC_MIN_TILE = {"cpu": 1024, "gpu": 4096}

#: Row panels of a tile on the diagonal of a symmetric kernel (:meth:`TileGrid.pieces`): used
#: when the contraction costs at least ``SYMMETRIC_SPLIT_FLOPS_PER_ENTRY`` flops per kernel
#: entry and only where arrays support slice assignment; panels have at least
#: ``SYMMETRIC_PANEL_ROWS`` GEMM rows (CPU / GPU), a tile at most ``SYMMETRIC_MAX_PANELS``.
#: A panel of k samples is a GEMM of k rows, k S on the "positions" route
#: (:meth:`Route.gemm_rows_per_sample`; the block with the most flops decides).
SYMMETRIC_PANEL_ROWS = {"cpu": 128, "gpu": 2048}
SYMMETRIC_MAX_PANELS = 4

#: Least GEMM rows of a sample's product forming a slab of per-sample weights
#: (:meth:`MaterialiseRoute.tile`: ``|slab| O`` rows of ``S`` x ``d_in``), above the transient
#: limit where that allows fewer.  Eight rows (the 8 MB limit at BERT-base's 3072-wide layer,
#: N = 128, two outputs, 72-sample tiles) read the whole ``a`` slice for each of 192 slabs
#: at 47 GFLOP/s; 64 rows took that Gram from 22 s to 12 s (docs/real-models.md).
MIN_SLAB_GEMM_ROWS = 64
#: GEMM rows a slab is given where that keeps it within :data:`SLAB_CAP_FACTOR` times the
#: transient limit: the forming products ``(|slab| O, S) @ (S, d_in)`` of ViT-S/16 at
#: N = 32 (two outputs; the 8 MB limit: 170 rows) ran at 117 GFLOP/s against the run's
#: 172; with 256 rows its Gram took 0.87-0.97 of the time (four runs), BERT-base's at
#: N = 32 0.81-0.90 (one output), at N = 8 (341 rows already) unchanged; 1024 rows (50 MB
#: slabs, beyond the last-level cache the slab's W W^T reads it from) were slower than 170
#: (AMD EPYC, 32 MB L3, 1 and 2 threads, in turns; one block alone:
#: ``benchmarks.gram.SlabRows``).
PREFERRED_SLAB_GEMM_ROWS = 256
SLAB_CAP_FACTOR = 4

#: Samples a side of the blocks in which a diagonal tile of a self-kernel is mirrored
#: (:meth:`~ntkcore.modes.Mode.mirror_tile`): transposed copies of this size stay in cache.
#: Full mode takes ``MIRROR_BLOCK // O`` samples (blocks of about this many matrix rows).
MIRROR_BLOCK = 256

#: The smallest useful tile holds ``min(N, MIN_TILE_SAMPLES)`` samples a side (rows of J1,
#: columns of J2).  A budget that cannot hold it raises ``ValueError`` stating the budget that
#: does (:func:`min_budget`), instead of computing the kernel in up to N^2 / 2 tiny tiles:
#: one-sample tiles cost a Python round trip per kernel entry (hours for N = 1000).
MIN_TILE_SAMPLES = 8


@dataclass(frozen=True)
class _Pair:
    """Block ``name`` of J1 and its counterpart in J2 (or their :class:`_BlockShape`)."""

    name: str
    b1: Any
    b2: Any
    kronecker: bool
    #: Index blocks whose "pairs" route is on offer: matching positions per sample pair,
    #: :math:`M / (N_1 N_2)` (:func:`_pairs_density`); None for every other block.
    density: float | None = None
    #: Index blocks whose "tokens" route is on offer: its padded products per sample pair
    #: and its dense indices, ``(beta, V_d)`` (:func:`_tokens_density`); None for every other
    #: block.
    grouped: tuple[float, int] | None = None

    @property
    def one_position(self) -> bool:
        """A Kronecker block with S = T = 1 (a dense layer)."""
        return self.b1.num_positions == 1 and self.b2.num_positions == 1

    def routes(self, forced: str | None) -> tuple[str, ...]:
        """The names of the routes on offer for this block, in :data:`ROUTES` order."""
        return tuple(name for name, route in ROUTES.items() if route.offers(self, forced))


class _Context(NamedTuple):
    """What a tile needs besides the factors: the backend (its scatter-add), the plan's
    chunk of matching pairs and the largest transient array in elements of the compute dtype
    (:meth:`~ntkcore.backend.Backend.transient_bytes`; None: no limit)."""

    backend: Any
    pair_chunk: int
    transient: int | None = None


# ---------------------------------------------------------------------------------------------
# Routes: how one block's tile is contracted, and what that costs
# ---------------------------------------------------------------------------------------------
class Route:
    """One way to contract a block on an ``r`` x ``c`` tile (samples of J1 x samples of J2).

    Subclasses set ``name``, say which blocks they take (:meth:`offers`) and implement
    :meth:`cost` and :meth:`tile`; :func:`register_route` adds them to :data:`ROUTES`.
    Tiles come in the mode's GEMM layout (:class:`~ntkcore.modes.Mode`), summed over blocks
    in that layout; factor slices are taken in the compute dtype (:func:`_take`).
    """

    name: ClassVar[str]
    #: Whether ``plan_gram(strategy=name)`` may force it on every block it applies to.
    forceable: ClassVar[bool] = True
    #: Whether it gathers matching pairs in chunks (:attr:`GramPlan.pair_chunk`).
    uses_pair_chunk: ClassVar[bool] = False

    def offers(self, pair: _Pair, forced: str | None) -> bool:
        """Whether this route may contract ``pair`` when ``forced`` (a route name or None)."""
        raise NotImplementedError

    def cost(self, pair: _Pair, mode: Mode, o: int, r: int, c: int,
             chunk: int | None = None) -> tuple[int, int]:
        """``(working elements, flops)`` of one block on one ``r`` x ``c`` tile, besides the
        tile accumulator."""
        raise NotImplementedError

    def working(self, pair: _Pair, mode: Mode, o: int, r: int, c: int, chunk: int | None,
                transient: int | None) -> int:
        """Working elements of one block on one ``r`` x ``c`` tile when transients are formed
        in pieces of at most ``transient`` elements (None: whole): :meth:`cost`'s unless the
        route forms them in pieces."""
        return self.cost(pair, mode, o, r, c, chunk)[0]

    def tile(self, xp: Any, pair: _Pair, rows: slice, cols: slice, same: bool, dtype: Any,
             mode: Mode, ctx: _Context) -> Array:
        """The block's contribution to the tile (rows, cols); ``same``: a diagonal tile of a
        self-kernel (the two sides are one array)."""
        raise NotImplementedError

    def panel_tiles(self, xp: Any, pair: _Pair, rows: slice,
                    pieces: list[tuple[slice, slice, int]], same: bool, dtype: Any, mode: Mode,
                    ctx: _Context) -> Iterator[Array]:
        """The block's tiles for the pieces (rows, cols, mirror) of the tile ``rows`` (one
        piece, or the row panels of a diagonal tile, through :meth:`shared_panels` where the
        route shares work between them), in order."""
        if len(pieces) > 1:
            shared = self.shared_panels(xp, pair, rows, pieces, dtype, mode, ctx)
            if shared is not None:
                yield from shared
                return
        for prs, pcs, _ in pieces:
            yield self.tile(xp, pair, prs, pcs, same, dtype, mode, ctx)

    def shared_panels(self, xp: Any, pair: _Pair, rows: slice,
                      pieces: list[tuple[slice, slice, int]], dtype: Any, mode: Mode,
                      ctx: _Context) -> Iterator[Array] | None:
        """The row panels of the diagonal tile ``rows`` computed with work shared between them
        (both sides of every panel lie within ``rows``); None: each panel on its own."""
        return None

    def gemm_rows_per_sample(self, pair: _Pair) -> int:
        """GEMM rows a sample makes in this route's products (row panels are that wide)."""
        return 1

    def diagonal_flops(self, pair: _Pair, mode: Mode, o: int, r: int, panels: int) -> float:
        """Flops of an ``r`` x ``r`` diagonal tile of a self-kernel in ``panels`` row panels."""
        return self.cost(pair, mode, o, r, r)[1] * panel_share(r, panels)


#: The routes by name, in the order the planner offers them (the first wins a tie).
ROUTES: dict[str, Route] = {}


def register_route(cls: type[Route]) -> type[Route]:
    """Class decorator: offer ``cls()`` to the planner under ``cls.name``."""
    ROUTES[cls.name] = cls()
    return cls


def _free(pair: _Pair, forced: str | None) -> bool:
    """No route is forced on this block (an index route forces only index blocks)."""
    return forced is None or (forced in INDEX_ROUTES and pair.density is None)


#: The routes offered to index factors only (their matches counted when a call plans).
INDEX_ROUTES = ("pairs", "tokens")


def _take(xp: Any, x: Array, sl: slice, dtype: Any) -> Array:
    """Samples ``sl`` of a factor, in the compute dtype (an index factor stays integer)."""
    x = x[sl, ...]
    return x if x.dtype == dtype or x.ndim == 2 else xp.astype(x, dtype)


def _take_inputs(xp: Any, block: KroneckerBlock, sl: slice, dtype: Any, ones: bool) -> Array:
    """:func:`_take` of the factor a, its implicit ones column (``block.ones``) kept implicit
    only where the product passes ``ones`` on (both sides have it), else appended."""
    a = _take(xp, block.a, sl, dtype)
    return with_ones(xp, a) if block.ones and not ones else a


def _factors(xp: Any, pair: _Pair, rows: slice, cols: slice, same: bool, dtype: Any,
             ones: bool) -> tuple[Array, Array, Array, Array]:
    """``(a1, g1, a2, g2)`` of a Kronecker block on a tile (one pair of arrays if ``same``)."""
    a1, g1 = _take_inputs(xp, pair.b1, rows, dtype, ones), _take(xp, pair.b1.g, rows, dtype)
    if same:
        return a1, g1, a1, g1
    return a1, g1, _take_inputs(xp, pair.b2, cols, dtype, ones), _take(xp, pair.b2.g, cols, dtype)


def _kron_sizes(pair: _Pair, o: int, r: int, c: int) -> tuple[int, int, int, int, int]:
    """``(S, T, a_width, d_out, factor-slice elements)`` of a Kronecker block on a tile."""
    b1, b2 = pair.b1, pair.b2
    s, t, dout = b1.num_positions, b2.num_positions, b1.d_out
    a_width = b1.a_width  # d_in, or 1 for an index factor (its products are comparisons)
    return s, t, a_width, dout, (r * s + c * t) * (a_width + o * dout)


# Tile products are ``x @ y.T``; a self-product ``x @ x.T`` is left as it is: NumPy detects it
# and calls SYRK (half the flops), and GEMM on a contiguous copy of ``x.T`` was not faster
# (``benchmarks/gram.py``, ``SelfProduct``).
@register_route
class DenseRoute(Route):
    r""":class:`~ntkcore.DenseBlock` (N, O, P_b): one GEMM, :meth:`Mode.dense` (trace:
    ``(r, O P_b) @ (O P_b, c)``; full: ``(r O, P_b) @ (P_b, c O)``; diagonal: O batched
    ``(r, P_b) @ (P_b, c)``).  Flops :math:`2 r c O^k P_b` (``k = 2`` for full, else 1);
    memory the two slices :math:`(r + c) O P_b`, twice for diagonal (its permuted copies)."""

    name = "dense"
    forceable = False

    def offers(self, pair: _Pair, forced: str | None) -> bool:
        return not pair.kronecker

    def cost(self, pair: _Pair, mode: Mode, o: int, r: int, c: int,
             chunk: int | None = None) -> tuple[int, int]:
        p = pair.b1.num_stored  # the columns a DenseBlock stores (its zeros are not read)
        return (r + c) * o * p * mode.input_copies, 2 * r * c * mode.gemm_outputs(o) * p

    def tile(self, xp: Any, pair: _Pair, rows: slice, cols: slice, same: bool, dtype: Any,
             mode: Mode, ctx: _Context) -> Array:
        j1 = _take(xp, pair.b1.jac, rows, dtype)
        return mode.dense(xp, j1, j1 if same else _take(xp, pair.b2.jac, cols, dtype), same)


@register_route
class Kron1Route(Route):
    r""":class:`~ntkcore.KroneckerBlock` with ``S = T = 1`` (a dense layer), factors ``a``
    (N, 1, d_in), ``g`` (N, 1, O, d_out): :math:`\Theta_b = (G G'^\top) \odot (A A'^\top)`,
    two GEMMs (``G``: :meth:`Mode.dense` of ``g``) and an in-place Hadamard product.
    Flops :math:`2 r c (d_{in} + O^k d_{out}) + r c q` (``q`` numbers per kernel entry)
    instead of :math:`2 r c O^k d_{out} d_{in}` for the materialised Jacobian; memory the
    slices :math:`(r + c)(d_{in} + O d_{out})` (twice for diagonal) and :math:`r c (1 + q)`.
    An index factor ``a`` counts ``d_in`` as 1 (:attr:`~ntkcore.KroneckerBlock.a_width`)."""

    name = "kron1"
    forceable = False

    def offers(self, pair: _Pair, forced: str | None) -> bool:
        return pair.kronecker and pair.one_position and (
            _free(pair, forced) or forced == "positions")

    def cost(self, pair: _Pair, mode: Mode, o: int, r: int, c: int,
             chunk: int | None = None) -> tuple[int, int]:
        _, _, a_width, dout, inputs = _kron_sizes(pair, o, r, c)
        q = mode.entries(o)
        mem = inputs * mode.input_copies + r * c * (1 + q)
        return mem, 2 * r * c * (a_width + mode.gemm_outputs(o) * dout) + r * c * q

    def tile(self, xp: Any, pair: _Pair, rows: slice, cols: slice, same: bool, dtype: Any,
             mode: Mode, ctx: _Context) -> Array:
        ones = pair.b1.ones and pair.b2.ones  # implicit ones columns stay implicit
        a1, g1, a2, g2 = _factors(xp, pair, rows, cols, same, dtype, ones)
        r, c = a1.shape[0], a2.shape[0]
        o, dout = g1.shape[2], g1.shape[3]
        x1 = xp.reshape(a1, (r, *a1.shape[2:]))
        aa = factor_gram(xp, x1, x1 if same else xp.reshape(a2, (c, *a2.shape[2:])), g1.dtype,
                         ones)
        gg = mode.dense(xp, xp.reshape(g1, (r, o, dout)), xp.reshape(g2, (c, o, dout)), same)
        # in place: the GEMM result is this function's (JAX rebinds the name instead)
        gg *= mode.broadcast(aa)
        return gg


@register_route
class PositionsRoute(Route):
    r"""A Kronecker block with ``S`` positions (``T`` on the column side): contract the
    weight-sharing axis, :math:`\Theta_b[n,m,o,p] = \sum_{s,t} \langle g[n,s,o],
    g'[m,t,p]\rangle \langle a[n,s], a'[m,t]\rangle` with :math:`A = a a'^\top` over
    (n s, m t) (:func:`~ntkcore.jacobian.factor_gram`; an index factor: the equality
    :math:`[i_{ns} = i'_{mt} \ne -1]`, ``d_in`` counted as 1), then :meth:`Mode.positions`.

    Trace mode (outputs summed): :math:`G = g g'^\top` over (n s, m t) with ``K = O d_out``,
    then :math:`\sum_{s,t} A \odot G`: :math:`2rcST(d_{in} + O d_{out} + 1)` flops,
    :math:`3rcST` elements (``A``, ``G``, their product).  Otherwise
    :math:`Y[n,m,t,o,:] = \sum_s A[n,s,m,t]\, g[n,s,o,:]`, then
    :math:`\sum_{t,k} Y[n,m,t,o,k]\, g'[m,t,p,k]`: :math:`2rcST(d_{in} + O d_{out}) +
    2rcTO^k d_{out}` flops, :math:`2rcST + 2rcTOd_{out}` elements (``A`` and ``Y``, each
    possibly copied once).  Besides the factor slices :math:`(rS + cT)(d_{in} + O d_{out})`.
    """

    name = "positions"

    def offers(self, pair: _Pair, forced: str | None) -> bool:
        return pair.kronecker and not pair.one_position and (
            _free(pair, forced) or forced == "positions")

    def cost(self, pair: _Pair, mode: Mode, o: int, r: int, c: int,
             chunk: int | None = None) -> tuple[int, int]:
        s, t, a_width, dout, inputs = _kron_sizes(pair, o, r, c)
        rcst = r * c * s * t
        if mode.sums_outputs:
            return inputs + 3 * rcst, 2 * rcst * (a_width + o * dout + 1)
        y = r * c * t * o * dout
        mem = inputs + 2 * rcst + 2 * y + c * t * o * dout
        return mem, 2 * rcst * (a_width + o * dout) + 2 * y * mode.partners(o)

    def tile(self, xp: Any, pair: _Pair, rows: slice, cols: slice, same: bool, dtype: Any,
             mode: Mode, ctx: _Context) -> Array:
        ones = pair.b1.ones and pair.b2.ones
        a1, g1, a2, g2 = _factors(xp, pair, rows, cols, same, dtype, ones)
        r, s = a1.shape[0], a1.shape[1]
        c, t = a2.shape[0], a2.shape[1]
        x1 = xp.reshape(a1, (r * s, *a1.shape[2:]))
        aa = factor_gram(xp, x1, x1 if same else xp.reshape(a2, (c * t, *a2.shape[2:])),
                         g1.dtype, ones)  # A[(n,s), (m,t)]
        return mode.positions(xp, aa, g1, g2, same)

    def gemm_rows_per_sample(self, pair: _Pair) -> int:
        return pair.b1.num_positions


@register_route
class MaterialiseRoute(Route):
    r"""A Kronecker block through per-sample weights
    :math:`W[n,o] = \sum_s g[n,s,o]\, a[n,s]^\top` (N, O, d_out d_in)
    (:func:`~ntkcore.jacobian.flat_weights`), one batched GEMM per tile side, then
    :class:`DenseRoute`'s product.  With :math:`P_b = d_{out} d_{in}`:
    :math:`2(rS + cT) O P_b + 2rcO^k P_b` flops, :math:`(r + c) O P_b` elements (twice for
    diagonal) besides the factor slices and an index factor's one-hot rows
    :math:`(rS + cT) d_{in}` (formed only here), an upper bound: where the backend limits
    transients the weights are formed a slab of d_out rows at a time (:meth:`tile`; in trace
    mode as many flat rows of :math:`(o, d)`, views of g: :meth:`_formers`).  Row
    panels of a diagonal tile share the tile's weights, formed once (the products through
    ``Backend.transient_product``: recycled memory where the backend has some)."""

    name = "materialise"

    def offers(self, pair: _Pair, forced: str | None) -> bool:
        return pair.kronecker and (_free(pair, forced) or forced == "materialise")

    def cost(self, pair: _Pair, mode: Mode, o: int, r: int, c: int,
             chunk: int | None = None) -> tuple[int, int]:
        s, t, a_width, _, inputs = _kron_sizes(pair, o, r, c)
        din = pair.b1.d_in
        p = din * pair.b1.d_out
        w = (r + c) * o * p
        one_hot = (r * s + c * t) * din if a_width != din else 0  # an index factor's one-hot rows
        mem = inputs + one_hot + w * mode.input_copies
        return mem, 2 * (r * s + c * t) * o * p + 2 * r * c * mode.gemm_outputs(o) * p

    def working(self, pair: _Pair, mode: Mode, o: int, r: int, c: int, chunk: int | None,
                transient: int | None) -> int:
        """:meth:`cost`'s memory with the weights of one slab a side (:meth:`slabs`, the
        first and widest) in place of all :math:`(r + c) O P_b`: what :meth:`tile` and
        :meth:`shared_panels` hold at once (a diagonal tile's one side counted twice)."""
        mem = self.cost(pair, mode, o, r, c, chunk)[0]
        if transient is None:
            return mem
        din, dout = pair.b1.d_in, pair.b1.d_out
        width = max(r, c) * o * din
        first = self.slabs(dout, width, transient, self.least_rows(o, width, transient))[0]
        whole = (r + c) * o * din * dout
        slab = (r + c) * o * din * (first.stop - first.start)
        return mem - (whole - slab) * mode.input_copies

    @staticmethod
    def least_rows(o: int, width: int = 0, limit: int | None = None) -> int:
        """Rows of d_out a slab has at least: :data:`MIN_SLAB_GEMM_ROWS` GEMM rows in each
        sample's forming product (``|slab| O``), and up to :data:`PREFERRED_SLAB_GEMM_ROWS`
        where that many rows of ``width`` elements take at most :data:`SLAB_CAP_FACTOR`
        times the transient ``limit`` (elements; None: no slabs)."""
        o = max(1, o)
        least = -(-MIN_SLAB_GEMM_ROWS // o)
        if limit is None or width <= 0:
            return least
        return max(least, min(-(-PREFERRED_SLAB_GEMM_ROWS // o),
                              SLAB_CAP_FACTOR * limit // width))

    @staticmethod
    def slabs(d_out: int, width: int, limit: int | None, least: int = 1) -> list[slice]:
        """Slices of the ``d_out`` rows whose weights take at most ``limit`` elements, a row
        of the slab being ``width`` elements on the widest side (:math:`r O d_{in}`); at
        least ``least`` rows (and one), all rows where ``limit`` is None.  The fewest slabs
        of at most that many rows, their sizes within one of each other, widest first (no
        small remainder: 64 rows in slabs of at most 26 are 22, 21, 21, not 26, 26, 12)."""
        k = d_out if limit is None else min(d_out, max(1, least, limit // max(width, 1)))
        m = -(-d_out // k)
        size, wider = divmod(d_out, m)
        bounds = [0]
        for i in range(m):
            bounds.append(bounds[-1] + size + (i < wider))
        return [slice(lo, hi) for lo, hi in itertools.pairwise(bounds)]

    @staticmethod
    def _inputs(xp: Any, block: KroneckerBlock, rows: slice, dtype: Any) -> tuple[Array, Array]:
        """``(a, g)`` of the tile's samples: ``a`` explicit (ones column appended, index
        factors as one-hot rows), formed once for all slabs."""
        a = _take_inputs(xp, block, rows, dtype, False)
        g = _take(xp, block.g, rows, dtype)
        if block.one_hot is not None:
            a = one_hot_rows(xp, a, block.one_hot, g.dtype)
        return a, g

    @staticmethod
    def _weights(xp: Any, ag: tuple[Array, Array], slab: slice, backend: Any,
                 mode: Mode) -> Array:
        """Per-sample weights of the rows ``slab`` of d_out: (r, O, |slab| d_in), the product of
        :func:`~ntkcore.jacobian.flat_weights` through ``backend.transient_product``; for a
        mode whose products run over ``O P`` at once, in any order of the columns
        (``Mode.flat_rows``) and where ``O |slab| >= d_in``, their transpose,
        (r, 1, d_in O |slab|), the product ``(r, d_in, S) @ (r, S, O |slab|)``: the same
        flops, its wider side last, which MKL forms in 0.4-0.9 of the time of
        (r, O |slab|, S) @ (r, S, d_in) on the real models' shapes (the bench GRU's
        ``weight_hh``: 17 against 21 ms at N = 256; :mod:`benchmarks.gram` ``Forming``); with
        ``O |slab| < d_in`` (resnet18's 3 x 3 convolutions in slabs of 11 rows) it was
        slower."""
        a, g = ag
        g = g if slab.stop - slab.start == g.shape[3] else g[..., slab]
        if not mode.flat_rows or g.shape[2] * g.shape[3] < a.shape[2]:
            return flat_weights(xp, a, g, product=backend.transient_product)
        n, s = a.shape[0], a.shape[1]
        w = backend.transient_product(xp.permute_dims(a, (0, 2, 1)),
                                      xp.reshape(g, (n, s, g.shape[2] * g.shape[3])))
        return xp.reshape(w, (n, 1, w.shape[1] * w.shape[2]))

    @staticmethod
    def _flat_inputs(xp: Any, ag: tuple[Array, Array]) -> tuple[Array, Array] | None:
        """``(a, g)`` with g (r, S, O, d_out) as (r, S, O d_out) where that is a view of it
        (its O and d_out axes merge: a contiguous or channels-first g), else None."""
        a, g = ag
        r, s, o, dout = g.shape
        try:
            gf = xp.reshape(g, (r, s, o * dout), copy=False)
        except Exception:  # a copy would be needed (torch: ValueError; others differ)
            return None
        return a, gf

    @staticmethod
    def _flat_weights(xp: Any, af: tuple[Array, Array], rows: slice, backend: Any) -> Array:
        r"""Per-sample weights of the flat rows ``rows`` of :math:`(o, d)` (o-major) for a
        mode whose products run over :math:`O P` at once in any order (``Mode.flat_rows``):
        (r, 1, k d_in) for k rows, from ``af`` = (a, g (r, S, O d_out)) of
        :meth:`_flat_inputs`.  A slab of g's flat rows is a view of g; a slab of d_out rows
        of every output is not (its (O, |slab|) axes do not merge), and :meth:`_weights`
        copies it before the product (resnet18 at N = 16: 5.6 of the Gram's 87 ms went to
        such copies).  The product runs wide side last, as :meth:`_weights`'."""
        a, gf = af
        g = gf if rows.stop - rows.start == gf.shape[2] else gf[:, :, rows]
        n, k, din = a.shape[0], g.shape[2], a.shape[2]
        if k >= din:
            w = backend.transient_product(xp.permute_dims(a, (0, 2, 1)), g)  # (r, d_in, k)
        else:
            w = backend.transient_product(xp.permute_dims(g, (0, 2, 1)), a)  # (r, k, d_in)
        return xp.reshape(w, (n, 1, k * din))

    def _formers(self, xp: Any, pair: _Pair, ag1: tuple[Array, Array],
                 ag2: tuple[Array, Array], same: bool, widest: int, mode: Mode,
                 ctx: _Context) -> list[tuple[Callable[[slice], Array],
                                               Callable[[slice], Array], slice]]:
        """``(form1, form2, slab)`` per slab (:meth:`_slabs_of`): the two sides' weights of
        the slab by ``form(slab)``.  In a ``flat_rows`` mode, with more than one slab and g
        flattening to a view on both sides, the slab of d_out rows [d0, d1) becomes the flat
        rows [d0 O, d1 O) of (o, d) (:meth:`_flat_weights`): as many rows, the same memory,
        no copy of g; else :meth:`_weights` of the d_out rows."""
        slabs = self._slabs_of(pair, widest, ctx)
        backend = ctx.backend
        if mode.flat_rows and len(slabs) > 1:
            f1 = self._flat_inputs(xp, ag1)
            f2 = f1 if same else self._flat_inputs(xp, ag2)
            if f1 is not None and f2 is not None:
                o = pair.b1.num_outputs
                flat1 = functools.partial(self._flat_weights, xp, f1, backend=backend)
                flat2 = functools.partial(self._flat_weights, xp, f2, backend=backend)
                return [(flat1, flat2, slice(sl.start * o, sl.stop * o)) for sl in slabs]
        rows1 = functools.partial(self._weights, xp, ag1, backend=backend, mode=mode)
        rows2 = functools.partial(self._weights, xp, ag2, backend=backend, mode=mode)
        return [(rows1, rows2, sl) for sl in slabs]

    def _slabs_of(self, pair: _Pair, r: int, ctx: _Context) -> list[slice]:
        """Slabs within the backend's transient limit, of :meth:`least_rows` at least."""
        b = pair.b1
        width = r * b.num_outputs * b.d_in
        return self.slabs(b.d_out, width, ctx.transient,
                          self.least_rows(b.num_outputs, width, ctx.transient))

    def tile(self, xp: Any, pair: _Pair, rows: slice, cols: slice, same: bool, dtype: Any,
             mode: Mode, ctx: _Context) -> Array:
        r"""The Gram is a sum over the rows of d_out (trace and full: over the GEMM's inner
        dimension; diagonal: within each output's product), so the weights are formed a
        slab of rows at a time (:meth:`slabs`): a transient the allocator recycles, not
        fresh pages a tile (glibc maps arrays above 32 MB anew on every call, and the page
        faults cost ResNet-18's Gram a quarter of its time), with the flops unchanged."""
        ag1 = self._inputs(xp, pair.b1, rows, dtype)
        ag2 = ag1 if same else self._inputs(xp, pair.b2, cols, dtype)
        widest = max(rows.stop - rows.start, cols.stop - cols.start)
        k = None
        for form1, form2, slab in self._formers(xp, pair, ag1, ag2, same, widest, mode, ctx):
            w1 = form1(slab)
            w2 = w1 if same else form2(slab)
            t = mode.dense(xp, w1, w2, same)
            del w1, w2  # each slab's weights free before the next one's (recycled memory)
            if k is None:
                k = t
            else:
                k += t  # on the first slab's fresh product (a rebinding in JAX)
        return k

    def shared_panels(self, xp: Any, pair: _Pair, rows: slice,
                      pieces: list[tuple[slice, slice, int]], dtype: Any, mode: Mode,
                      ctx: _Context) -> Iterator[Array]:
        """The per-sample weights formed once for the whole tile (a slab at a time), sliced
        for each panel."""
        ag, r0 = self._inputs(xp, pair.b1, rows, dtype), rows.start
        parts: list[Array | None] = [None] * len(pieces)
        for form, _, slab in self._formers(xp, pair, ag, ag, True, rows.stop - rows.start,
                                           mode, ctx):
            w = form(slab)
            for i, (prs, pcs, _) in enumerate(pieces):
                t = mode.dense(xp, w[prs.start - r0:prs.stop - r0, ...],
                               w[pcs.start - r0:pcs.stop - r0, ...], False)
                if parts[i] is None:
                    parts[i] = t
                else:
                    parts[i] += t
        yield from parts

    def diagonal_flops(self, pair: _Pair, mode: Mode, o: int, r: int, panels: int) -> float:
        form = 2 * r * pair.b1.num_positions * o * pair.b1.num_params  # weights formed once
        return form + (self.cost(pair, mode, o, r, r)[1] - 2 * form) * panel_share(r, panels)


@register_route
class PairsRoute(Route):
    r"""An index factor (``one_hot``, an embedding) from its matching pairs only: as
    :math:`\langle e_i, e_j\rangle = [i = j \ne -1]`,
    :math:`\Theta_b[n,m,o,p] = \sum_{(s,t):\ i_{ns} = i'_{mt} \ne -1}
    \langle g[n,s,o], g'[m,t,p]\rangle`, a sum over the M matching (sample, position) pairs,
    about :math:`(N S)^2 / V` of the :math:`(N S)^2` for tokens spread over a vocabulary of
    V (but :math:`(N S)^2` for a padding token everywhere).

    Sorting the column indices and two binary searches per row index give each flat row
    position ``u = (n, s)`` its matches in the sorted order, ``lo[u] .. lo[u] + cnt[u]``;
    pair ``k`` belongs to row ``u`` with :math:`e_{u-1} \le k < e_u` for ``e = cumsum(cnt)``.
    Pairs are taken ``chunk`` at a time: gather the two g rows, contract them
    (:meth:`Mode.pair_products`) and scatter-add into cell ``(n, m)``
    (:meth:`ntkcore.backend.Backend.scatter_add`).  A self-tile takes each unordered pair
    once and adds it to both cells (n, m) and (m, n): half the gathers.  Offered only where
    the backend has a native scatter-add (``fast_scatter_add``) and the indices can be read
    (not under ``jax.jit``); :func:`gram` counts M when it plans.

    Cost, with :math:`m = \rho r c` pairs in the tile (:math:`\rho = M / (N_1 N_2)` measured
    on the whole kernel; a self-tile's halving is not credited) and ``q`` numbers per kernel
    entry: :math:`2 m O^k d_{out}` flops of products plus :data:`ELEMENT_FLOPS` per element
    of its memory-bound passes, :math:`m(2 O d_{out} + q + 8)` (gathers, scatter, index
    arithmetic), :math:`(rS + cT)(4 + \log_2(cT + 2))` (sort, searches) and :math:`rcq`
    (cells); memory :math:`8(rS + cT) + 2rcq` elements plus the chunk,
    :math:`2 O d_{out} + 2q + 8` a pair.  The tile is chosen with a chunk of
    ``min(m, PAIRS_MIN_CHUNK)`` pairs; the plan then takes the largest chunk up to
    ``PAIRS_MAX_CHUNK`` the budget holds.  Only the index routes' passes are weighted by
    ``ELEMENT_FLOPS`` (why: docs/architecture.md, "The Gram engine").
    """

    name = "pairs"
    uses_pair_chunk = True

    def offers(self, pair: _Pair, forced: str | None) -> bool:
        return pair.kronecker and pair.density is not None and forced in (None, "pairs")

    def cost(self, pair: _Pair, mode: Mode, o: int, r: int, c: int,
             chunk: int | None = None) -> tuple[int, int]:
        s, t, _, dout, inputs = _kron_sizes(pair, o, r, c)
        q = mode.entries(o)
        m = (pair.density or 0.0) * r * c  # offered only where density is known
        if chunk is None:
            chunk = min(math.ceil(m), PAIRS_MIN_CHUNK)
        index = r * s + c * t
        # the sort and searches (int64: two elements each), the cell sums and their sum
        mem = inputs + 8 * index + 2 * r * c * q + chunk * self.per_pair(mode, o, dout)
        gemm = 2 * m * o * dout * mode.partners(o)
        passes = m * (2 * o * dout + q + 8) + index * (4 + math.log2(c * t + 2)) + r * c * q
        return int(mem), int(gemm + ELEMENT_FLOPS * passes)

    def chunk_density(self, pair: _Pair) -> float:
        """What the chunk counts, per sample pair (here matching pairs, :math:`\rho`)."""
        return pair.density or 0.0

    @staticmethod
    def per_pair(mode: Mode, o: int, dout: int) -> int:
        """Working elements per pair of a chunk: two gathered g rows, the products, four
        int64 indices (two elements each) and the scattered copy."""
        return 2 * o * dout + 2 * mode.entries(o) + 8

    def tile(self, xp: Any, pair: _Pair, rows: slice, cols: slice, same: bool, dtype: Any,
             mode: Mode, ctx: _Context) -> Array:
        a1, g1, a2, g2 = _factors(xp, pair, rows, cols, same, dtype,
                                  pair.b1.ones and pair.b2.ones)
        (r, s), (c, t) = a1.shape, a2.shape
        o, dout = g1.shape[2], g1.shape[3]
        order, lo, cnt = _index_matches(xp, xp.reshape(a1, (r * s,)), xp.reshape(a2, (c * t,)))
        if same:  # each unordered pair once: the matches at or after u's own sorted place
            rank = xp.argsort(order)
            cnt = xp.where(cnt > 0, lo + cnt - rank, cnt)
            lo = rank
        end = xp.cumulative_sum(cnt)
        total = int(end[-1]) if r * s else 0
        base = lo - (end - cnt)  # sorted position of pair k of row u: k + base[u]
        y1, y2 = xp.reshape(g1, (r * s, o * dout)), xp.reshape(g2, (c * t, o * dout))
        out = None
        for p0 in range(0, total, ctx.pair_chunk):
            k = xp.arange(p0, min(total, p0 + ctx.pair_chunk), dtype=end.dtype,
                          device=array_api_compat.device(end))
            row = xp.searchsorted(end, k, side="right")
            col = xp.take(order, k + xp.take(base, row))
            # 2-D gathers: the fast ones in torch
            v = mode.pair_products(xp, xp.take(y1, row, axis=0), xp.take(y2, col, axis=0), o)
            cell = (row // s) * c + col // t
            if same:  # and the mirror (m, n) of every pair of two positions
                mirror = xp.where(row == col, -1, (col // s) * c + row // t)
                cell = xp.concat((cell, mirror))
                v = xp.concat((v, mode.transpose_outputs(xp, v, o)))
            part = ctx.backend.scatter_add(cell, v, r * c)
            out = part if out is None else out + part
        if out is None:
            out = xp.zeros((r * c, mode.entries(o)), dtype=g1.dtype,
                           device=array_api_compat.device(g1))
        return mode.cells_to_tile(xp, out, r, c, o)

    def shared_panels(self, xp: Any, pair: _Pair, rows: slice,
                      pieces: list[tuple[slice, slice, int]], dtype: Any, mode: Mode,
                      ctx: _Context) -> Iterator[Array]:
        """The whole diagonal tile as one self-tile (half its pairs), sliced per panel."""
        t, r0 = self.tile(xp, pair, rows, rows, True, dtype, mode, ctx), rows.start  # half
        for prs, pcs, _ in pieces:
            yield mode.tile_part(t, slice(prs.start - r0, prs.stop - r0),
                                 slice(pcs.start - r0, pcs.stop - r0))


@register_route
class TokensRoute(PairsRoute):
    r"""An index factor grouped by index value: GEMMs per index in place of a gather per pair.

    Positions of one sample with the same index are summed first,
    :math:`H[n,v] = \sum_{s:\ i_{ns} = v} g[n,s]` (O, d_out), a scatter-add over the
    (sample, index) keys sorted by (index, sample); then
    :math:`\Theta_b[n,m] = \sum_v \langle H[n,v], H'[m,v]\rangle` (the mode's contraction of
    the outputs), for one index v a product of its :math:`c_v` rows of H with its
    :math:`c'_v` rows of H'.  Indices of equal row counts rounded up to powers of two,
    :math:`B_v \times B'_v`, are stacked into one batched product
    (:meth:`~ntkcore.modes.Mode.block_products`; zero rows pad them) whose products are
    scatter-added into their cells ``(n, m)``, at most :attr:`GramPlan.pair_chunk` padded
    products at a time.  An index held by most samples (a position id, a padding token) is
    cheaper dense: its rows are written into per-sample arrays :math:`D[n, v]` (zero where
    sample n lacks v) and all such indices contracted by one GEMM, :meth:`Mode.dense` of
    (r, O, V_d d_out) (:func:`_dense_tokens` decides per index by the costs below).  The
    kernel is :class:`PairsRoute`'s; each (sample, index) row is read once per group instead
    of once per matching pair (the bench GRU's embedding at N = 256, 67,000 matching pairs
    over 8,192 positions: 53 ms by pairs, 16 ms so).  Offered where the backend has a native
    scatter-add and cheap eager loops (``Backend.eager_loops``: not JAX, whose every new
    shape compiles), unless forced.

    Cost, with :math:`m_B = \beta r c` padded products and :math:`V_d` dense indices
    (:func:`_tokens_density`, counted on the whole kernel) and :math:`w = O d_{out}`:
    :math:`2 (m_B + r c V_d) O^{k-1} w` flops of products, plus
    :data:`ELEMENT_FLOPS` per element of the memory-bound passes: the sums and gathers of
    :math:`3(rS + cT) w`, the scatter of the products and their cell indices
    :math:`m_B (q + 8)`, the dense rows :math:`(r + c) V_d w`, the sorts
    :math:`(rS + cT)(6 + \log_2(rS + cT + 2))`, and :math:`rcq` (cells), plus
    :data:`TOKENS_TILE_FLOPS` a tile; memory that of
    :class:`PairsRoute` plus the summed rows :math:`(rS + cT) w` and twice the dense rows.
    """

    name = "tokens"

    def offers(self, pair: _Pair, forced: str | None) -> bool:
        return pair.kronecker and pair.grouped is not None and forced in (None, "tokens")

    def chunk_density(self, pair: _Pair) -> float:
        return pair.grouped[0] if pair.grouped else 0.0

    def cost(self, pair: _Pair, mode: Mode, o: int, r: int, c: int,
             chunk: int | None = None) -> tuple[int, int]:
        s, t, _, dout, inputs = _kron_sizes(pair, o, r, c)
        q, w = mode.entries(o), o * dout
        beta, dense = pair.grouped or (0.0, 0)  # offered only where they are counted
        m = beta * r * c
        if chunk is None:
            chunk = min(math.ceil(m), PAIRS_MIN_CHUNK)
        index = r * s + c * t
        mem = inputs + index * (w + 8) + 2 * (r + c) * dense * w + 2 * r * c * q \
            + chunk * self.per_pair(mode, o, dout)
        gemm = 2 * (m + r * c * dense) * w * mode.partners(o)
        passes = 3 * index * w + m * (q + 8) + (r + c) * dense * w \
            + index * (6 + math.log2(index + 2)) + r * c * q
        return int(mem), int(gemm + ELEMENT_FLOPS * passes + TOKENS_TILE_FLOPS)

    def tile(self, xp: Any, pair: _Pair, rows: slice, cols: slice, same: bool, dtype: Any,
             mode: Mode, ctx: _Context) -> Array:
        a1, g1, a2, g2 = _factors(xp, pair, rows, cols, same, dtype, False)
        (r, _), c = a1.shape, a2.shape[0]
        o, dout = g1.shape[2], g1.shape[3]
        side1 = _TokenRows.of(xp, ctx.backend, a1, g1)
        side2 = side1 if same else _TokenRows.of(xp, ctx.backend, a2, g2)
        start1, count1, start2, count2 = _common_tokens(xp, side1, side2)
        e1, e2 = _pow2_exponent(xp, count1), _pow2_exponent(xp, count2)
        dense = _dense_tokens(xp, e1, e2, r, c, mode, o, dout)
        out = None
        # the sparse indices, by padded size: their products scattered into the cells
        bucket = xp.where(dense, -1, e1 * 64 + e2)
        for key in sorted(int(v) for v in xp.unique_values(bucket)):  # host: group shapes
            if key < 0:
                continue
            sel = xp.nonzero(bucket == key)[0]
            b1, b2 = 1 << (key // 64), 1 << (key % 64)
            st1, n1 = xp.take(start1, sel), xp.take(count1, sel)
            st2, n2 = xp.take(start2, sel), xp.take(count2, sel)
            step = max(1, ctx.pair_chunk // (b1 * b2))  # indices at a time
            slab = b1 if b1 * b2 <= ctx.pair_chunk else max(1, ctx.pair_chunk // b2)
            for k0 in range(0, sel.shape[0], step):
                ks = slice(k0, min(sel.shape[0], k0 + step))
                x2, m2, smp2 = side2.rows(xp, st2[ks], n2[ks], 0, b2)
                for r0 in range(0, b1, slab):
                    x1, m1, smp1 = side1.rows(xp, st1[ks], n1[ks], r0, min(b1, r0 + slab))
                    v = mode.block_products(xp, x1, x2, o)
                    cell = xp.where(m1[:, :, None] & m2[:, None, :],
                                    smp1[:, :, None] * c + smp2[:, None, :], -1)
                    part = ctx.backend.scatter_add(xp.reshape(cell, (-1,)),
                                                   xp.reshape(v, (-1, v.shape[-1])), r * c)
                    out = part if out is None else out + part
        if out is None:
            out = xp.zeros((r * c, mode.entries(o)), dtype=g1.dtype,
                           device=array_api_compat.device(g1))
        tile = mode.cells_to_tile(xp, out, r, c, o)
        sel = xp.nonzero(dense)[0]  # the dense indices: one GEMM
        if sel.shape[0]:
            d1 = side1.dense_rows(xp, ctx.backend, xp.take(start1, sel), xp.take(count1, sel),
                                  r, o)
            d2 = d1 if same else side2.dense_rows(xp, ctx.backend, xp.take(start2, sel),
                                                  xp.take(count2, sel), c, o)
            tile = tile + mode.dense(xp, d1, d2, same)
        return tile


def _dense_tokens(xp: Any, e1: Array, e2: Array, r: int, c: int, mode: Mode, o: int,
                  dout: int) -> Array:
    """Which indices of an r x c tile the "tokens" route contracts dense: those whose
    padded block of :math:`2^{e_1} \\times 2^{e_2}` products, each :math:`2 O^{k-1} w` flops
    and a scatter of ``q + 8`` elements, costs more than their share of a dense GEMM,
    :math:`2 r c O^{k-1} w` flops and :math:`(r + c) w` elements written."""
    w, pp = o * dout, mode.partners(o)
    per = 2 * w * pp + ELEMENT_FLOPS * (mode.entries(o) + 8)
    whole = 2 * r * c * w * pp + ELEMENT_FLOPS * (r + c) * w
    # 2^(e1+e2) per > whole, in exponents (no overflow): e1 + e2 > log2(whole / per)
    return (e1 + e2) > math.floor(math.log2(whole / per))


class _TokenRows(NamedTuple):
    """One side of the "tokens" route: the rows ``h`` (U + 1, O d_out) summed per (sample,
    index) key, sorted by (index, sample), the last a zero row for padding; each row's
    ``sample`` (U + 1,); the distinct indices ``token`` (V,) with the first row ``start`` and
    the row ``count`` of each."""

    h: Array
    sample: Array
    token: Array
    start: Array
    count: Array

    @classmethod
    def of(cls, xp: Any, backend: Any, a: Array, g: Array) -> _TokenRows:
        r, s = a.shape
        order, srt, runs, distinct = _sorted_keys(xp, a)
        row = xp.cumulative_sum(xp.astype(runs, xp.int64)) - 1  # each sorted key's row
        row = xp.where(srt >= 0, row, -1)  # "no index" dropped
        y = xp.reshape(g, (r * s, g.shape[2] * g.shape[3]))
        h = backend.scatter_add(xp.take(row, xp.argsort(order)), y, distinct.shape[0])
        token, start, count = _token_runs(xp, distinct, r)
        dev = array_api_compat.device(h)
        return cls(xp.concat((h, xp.zeros((1, y.shape[1]), dtype=h.dtype, device=dev))),
                   xp.concat((distinct % r, xp.zeros((1,), dtype=row.dtype, device=dev))),
                   token, start, count)

    def dense_rows(self, xp: Any, backend: Any, start: Array, count: Array, r: int,
                   o: int) -> Array:
        """The rows of k indices (``start``, ``count``) as dense rows (r, O, k d_out) of the r
        samples, zero where a sample lacks the index."""
        k = start.shape[0]
        x, valid, smp = self.rows(xp, start, count, 0, r)  # (k, r, O d_out)
        slot = xp.arange(k, dtype=smp.dtype, device=array_api_compat.device(smp))
        cell = xp.where(valid, smp * k + slot[:, None], -1)
        d = backend.scatter_add(xp.reshape(cell, (-1,)), xp.reshape(x, (k * r, -1)), r * k)
        d = xp.permute_dims(xp.reshape(d, (r, k, o, -1)), (0, 2, 1, 3))
        return xp.reshape(d, (r, o, -1))

    def rows(self, xp: Any, start: Array, count: Array, lo: int,
             hi: int) -> tuple[Array, Array, Array]:
        """Rows ``lo .. hi`` of each of k indices (``start``, ``count``): ``(x`` (k, hi - lo,
        O d_out), ``valid`` (k, hi - lo), ``sample`` (k, hi - lo)``), padding rows zero."""
        j = xp.arange(lo, hi, dtype=start.dtype, device=array_api_compat.device(start))
        valid = j[None, :] < count[:, None]
        idx = xp.where(valid, start[:, None] + j[None, :], self.h.shape[0] - 1)
        flat = xp.reshape(idx, (-1,))
        x = xp.reshape(xp.take(self.h, flat, axis=0), (*idx.shape, self.h.shape[1]))
        return x, valid, xp.reshape(xp.take(self.sample, flat), idx.shape)


def _sorted_keys(xp: Any, a: Array) -> tuple[Array, Array, Array, Array]:
    """``(order, sorted, runs, distinct)`` of an index factor ``a`` (r, S): the order that
    sorts the keys ``i r + n`` of its positions (-1 for "no index"), the sorted keys, where a
    run of equal sorted keys starts, and the distinct keys."""
    r, s = a.shape
    flat = xp.astype(xp.reshape(a, (r * s,)), xp.int64)
    n = xp.arange(r * s, dtype=xp.int64, device=array_api_compat.device(flat)) // s
    keys = xp.where(flat >= 0, flat * r + n, -1)
    order = xp.argsort(keys)
    srt = xp.take(keys, order)
    runs = _runs(xp, srt)
    return order, srt, runs, xp.take(srt, xp.nonzero(runs)[0])


def _runs(xp: Any, v: Array) -> Array:
    """Where a run of equal values of the sorted ``v`` starts (boolean)."""
    head = xp.ones((min(1, v.shape[0]),), dtype=xp.bool, device=array_api_compat.device(v))
    return xp.concat((head, v[1:] != v[:-1]))


def _token_runs(xp: Any, distinct: Array, r: int) -> tuple[Array, Array, Array]:
    """``(token, start, count)``: the indices of the sorted distinct keys ``i r + n``
    (:func:`_sorted_keys`), each with its first key and number of keys (samples)."""
    tok = distinct // r  # -1 ("no index") stays -1 and is left out
    start = xp.nonzero(_runs(xp, tok) & (tok >= 0))[0]
    end = xp.concat((start[1:], xp.asarray([distinct.shape[0]], dtype=start.dtype,
                                           device=array_api_compat.device(start))))
    return xp.take(tok, start), start, end - start


def _common_tokens(xp: Any, side1: Any, side2: Any) -> tuple[Array, Array, Array, Array]:
    """``(start1, count1, start2, count2)`` of the indices both sides hold (each side with
    the ``token``, ``start`` and ``count`` of :class:`_TokenRows`)."""
    t1, t2 = side1.token, side2.token
    if t1.shape[0] == 0 or t2.shape[0] == 0:
        return side1.start[:0], side1.start[:0], side1.start[:0], side1.start[:0]
    pos = xp.searchsorted(t2, t1)
    at = xp.minimum(pos, t2.shape[0] - 1)
    both = xp.nonzero((pos < t2.shape[0]) & (xp.take(t2, at) == t1))[0]
    at = xp.take(at, both)
    return (xp.take(side1.start, both), xp.take(side1.count, both), xp.take(side2.start, at),
            xp.take(side2.count, at))


def _pow2_exponent(xp: Any, count: Array) -> Array:
    """The least e with 2**e >= count (count >= 1), elementwise, in integers."""
    e = xp.zeros_like(count)
    top = int(xp.max(count)) if count.shape[0] else 1  # host: the loop's length
    for k in range(max(1, top - 1).bit_length()):
        e = e + xp.astype(count - 1 >= (1 << k), count.dtype)
    return e


class _TokenCounts(NamedTuple):
    """The ``token``, ``start`` and ``count`` of :class:`_TokenRows`, without the rows (the
    planner's count)."""

    token: Array
    start: Array
    count: Array


def _tokens_density(xp: Any, a1: Array, a2: Array, mode: Mode, o: int,
                    dout: int) -> tuple[float, int]:
    r"""``(beta, dense)`` of the "tokens" route on the whole kernel of index factors ``a1``
    (N1, S), ``a2`` (N2, T): the indices it contracts dense (:func:`_dense_tokens`) and, for
    the others, the padded products per sample pair,
    :math:`\beta = \sum_v 2^{\lceil \log_2 c_v \rceil} 2^{\lceil \log_2 c'_v \rceil} / (N_1 N_2)`
    for the :math:`c_v` samples of ``a1`` and :math:`c'_v` of ``a2`` that hold index v."""
    n1, n2 = a1.shape[0], a2.shape[0]
    sides = [_TokenCounts(*_token_runs(xp, _sorted_keys(xp, a)[3], a.shape[0]))
             for a in ((a1,) if a2 is a1 else (a1, a2))]
    _, c1, _, c2 = _common_tokens(xp, sides[0], sides[-1])
    if c1.shape[0] == 0:
        return 0.0, 0
    e1, e2 = _pow2_exponent(xp, c1), _pow2_exponent(xp, c2)
    dense = _dense_tokens(xp, e1, e2, n1, n2, mode, o, dout)
    sparse = xp.bitwise_left_shift(xp.where(dense, 0, xp.ones_like(e1)), e1 + e2)
    return float(xp.sum(sparse)) / (n1 * n2), int(xp.sum(xp.astype(dense, xp.int64)))


def _index_matches(xp: Any, i1: Array, i2: Array) -> tuple[Array, Array, Array]:
    """``(order, lo, cnt)`` for index vectors ``i1`` (R,) and ``i2`` (C,): the order that sorts
    ``i2``, and for each ``i1[u]`` where its matches start in the sorted ``i2`` and how many
    there are (0 for ``-1``, "no index"): ``i2[order[lo[u] + k]] == i1[u]`` for ``k < cnt[u]``."""
    if i1.dtype != i2.dtype:
        i1 = xp.astype(i1, xp.result_type(i1, i2))
        i2 = xp.astype(i2, i1.dtype)
    order = xp.argsort(i2)
    srt = xp.take(i2, order)
    lo = xp.searchsorted(srt, i1, side="left")
    cnt = xp.searchsorted(srt, i1, side="right") - lo
    return order, lo, xp.where(i1 >= 0, cnt, xp.zeros_like(cnt))


def _pairs_density(xp: Any, a1: Array, a2: Array) -> float:
    r"""Matching positions per sample pair of index factors ``a1`` (N1, S), ``a2`` (N2, T):
    :math:`M / (N_1 N_2)` with :math:`M = \#\{(n,s,m,t) : i_{ns} = i'_{mt} \ne -1\}`."""
    n1, n2 = a1.shape[0], a2.shape[0]
    _, _, cnt = _index_matches(xp, xp.reshape(a1, (-1,)), xp.reshape(a2, (-1,)))
    return int(xp.sum(cnt)) / (n1 * n2)


# ---------------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------------
class _BlockShape(NamedTuple):
    """What the cost model reads of a block, without its arrays (for :func:`min_budget`)."""

    kron: bool
    num_params: int
    num_positions: int = 1
    d_in: int = 0
    d_out: int = 0
    a_width: int = 0  # KroneckerBlock.a_width

    @property
    def num_stored(self) -> int:
        """A dense block's stored columns (:attr:`DenseBlock.num_stored`): ``num_params``
        holds them here."""
        return self.num_params


def block_shapes(j: Any) -> tuple[_BlockShape, ...]:
    """The block shapes of a Jacobian as the cost model sees them (no arrays are kept)."""
    return tuple(_BlockShape(True, b.num_params, b.num_positions, b.d_in, b.d_out, b.a_width)
                 if isinstance(b, KroneckerBlock) else _BlockShape(False, b.num_stored)
                 for b in as_jacobian(j, "J").blocks)


def cheapest_flops(shape: _BlockShape, n: int, num_outputs: int, mode: str = "trace") -> int:
    """Flops of the cheapest route offered to a block of ``shape`` (:func:`block_shapes`) on
    one ``n`` x ``n`` tile in ``mode``, as the planner counts them (an index block's "pairs"
    route, which needs the indices, is left out): the price of a change to a block's shape
    (``torch_layers.drop_zero_positions``)."""
    pair, m = _Pair("", shape, shape, shape.kron), check_mode(mode)
    return min(ROUTES[s].cost(pair, m, num_outputs, n, n)[1] for s in pair.routes(None))


def useful_tile(n: int) -> int:
    """Samples a side of the smallest useful tile for ``n`` samples (:data:`MIN_TILE_SAMPLES`)."""
    return min(n, MIN_TILE_SAMPLES)


def _min_elements(pairs: list[_Pair], mode: Mode, o: int, n1: int, n2: int, layerwise: bool,
                  forced: str | None) -> int:
    """Working elements of the smallest useful tile, ``min(n1, MIN_TILE_SAMPLES)`` x
    ``min(n2, MIN_TILE_SAMPLES)``, with each block's leanest route."""
    r, c = useful_tile(n1), useful_tile(n2)
    acc = _tiles_held(layerwise, len(pairs))
    mem = max(min(ROUTES[s].cost(p, mode, o, r, c)[0] for s in p.routes(forced)) for p in pairs)
    return mem + r * c * mode.entries(o) * acc


def min_budget(shapes: tuple[_BlockShape, ...], *, num_outputs: int, n1: int, n2: int,
               mode: str = "full", layerwise: bool = False, itemsize: int = 8,
               shapes2: tuple[_BlockShape, ...] | None = None) -> int:
    """Smallest ``max_memory`` (bytes) for which :func:`gram` plans a useful tile.

    ``shapes`` (and ``shapes2`` for J2, default the same) from :func:`block_shapes`;
    ``itemsize`` of the compute dtype.  Used by :func:`ntkcore.ntk` to check a budget before
    any factor is computed.
    """
    pairs = [_Pair(str(i), a, b, a.kron) for i, (a, b) in enumerate(
        zip(shapes, shapes if shapes2 is None else shapes2, strict=True))]
    return _min_elements(pairs, check_mode(mode), num_outputs, n1, n2, layerwise,
                         None) * itemsize


def plan_shapes(shapes: tuple[_BlockShape, ...], *, num_outputs: int, n1: int, n2: int,
                symmetric: bool, mode: str, layerwise: bool, itemsize: int, budget: Budget,
                xp: Any, device: Any) -> GramPlan:
    """The :class:`GramPlan` :func:`gram` makes within ``budget`` for Jacobians of block
    shapes ``shapes`` (:func:`block_shapes`, the same on both sides) on ``device`` of ``xp``,
    before any factor is computed (an index block's "pairs" route, which needs the indices,
    is left out); ``budget`` must hold a useful tile (:func:`min_budget`).  Used by
    :func:`ntkcore.ntk` to size the contraction's share of its budget."""
    pairs = tuple(_Pair(str(i), a, a, a.kron) for i, a in enumerate(shapes))
    limit = get_backend(xp).transient_bytes(device)
    problem = _Problem(pairs, check_mode(mode), num_outputs, n1, n2, symmetric, layerwise,
                       int(budget), itemsize, None, on_gpu(xp, device),
                       _writable(xp, None, device), None if limit is None else limit // itemsize)
    return _cached_plan(problem, budget)


def _tiles_held(layerwise: bool, nblocks: int) -> int:
    """Tiles held by the accumulator: running sum, new block tile and their sum (one block or
    layerwise: just the block's tile)."""
    return 1 if layerwise or nblocks == 1 else 3


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest ``x`` in ``[lo, hi]`` with ``fits(x)`` (monotone), or ``lo - 1`` if none."""
    if not fits(lo):
        return lo - 1
    if fits(hi):  # the common case: everything fits in one tile
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class GramPlan:
    """How :func:`gram` will compute a kernel (see :func:`plan_gram`).

    Attributes
    ----------
    tile_rows, tile_cols : int
        Tile size (rows of J1, columns of J2).
    strategies : tuple of str
        Per block, the name of its :class:`Route`: ``"dense"``, ``"kron1"`` (Kronecker,
        S = T = 1), ``"positions"``, ``"materialise"``, ``"pairs"`` or ``"tokens"``.
    num_tiles : int
        Tiles computed (upper triangle only when symmetric).
    symmetric : bool
        Whether J2 is J1 (only upper-triangle tiles are computed).
    working_bytes : int
        Predicted peak working memory beyond the output.
    budget_bytes : int
        The memory budget.
    flops : float
        Floating-point operations of the tiles actually computed.
    flops_all_tiles : float
        Operations if every tile were computed (the nominal count, for throughput figures).
    panels : int
        Row panels per tile on the diagonal of a symmetric kernel (1: the tile is one
        product; see ``SYMMETRIC_PANEL_ROWS``).
    pair_chunk : int
        Matching pairs the "pairs" route gathers, or padded products the "tokens" route
        forms, at a time (0: no block takes either route).
    """

    tile_rows: int
    tile_cols: int
    strategies: tuple[str, ...]
    num_tiles: int
    symmetric: bool
    working_bytes: int
    budget_bytes: int
    flops: float
    flops_all_tiles: float
    panels: int = 1
    pair_chunk: int = 0


Routes = tuple[str, ...] | list[str]


@dataclass(frozen=True)
class _Problem:
    """What the planner reads of one kernel: its blocks, layout, sizes, budget and device."""

    pairs: tuple[_Pair, ...]
    mode: Mode
    o: int
    n1: int
    n2: int
    symmetric: bool
    layerwise: bool
    budget: int
    itemsize: int
    forced: str | None
    gpu: bool
    writable: bool
    #: The backend's largest transient in elements (``Backend.transient_bytes``; None: none).
    transient: int | None = None

    @property
    def elements(self) -> float:
        """The budget in elements of the compute dtype."""
        return self.budget / self.itemsize

    @property
    def device_kind(self) -> str:
        return "gpu" if self.gpu else "cpu"

    def working(self, routes: Routes, r: int, c: int, chunk: int | None = None,
                pairs: tuple[_Pair, ...] | None = None) -> int:
        """Working elements of an ``r`` x ``c`` tile: the largest block's working set plus
        the accumulator."""
        pairs = self.pairs if pairs is None else pairs
        return max(ROUTES[s].working(p, self.mode, self.o, r, c, chunk, self.transient)
                   for s, p in zip(routes, pairs, strict=True)) \
            + r * c * self.mode.entries(self.o) * _tiles_held(self.layerwise, len(self.pairs))

    def flops(self, routes: Routes, rows: list[tuple[int, int]], cols: list[tuple[int, int]],
              pairs: tuple[_Pair, ...] | None = None) -> float:
        """Flops of the blocks over ``(size, count)`` row and column blocks (:func:`sizes`)."""
        pairs = self.pairs if pairs is None else pairs
        return float(sum(nr * nc * ROUTES[s].cost(p, self.mode, self.o, r, c)[1]
                         for s, p in zip(routes, pairs, strict=True)
                         for r, nr in rows for c, nc in cols))

    def symmetric_flops(self, route: str, pair: _Pair, r: int, panels: int) -> float:
        """Flops of one block over the upper-triangle tiles of the n1 x n1 kernel in r x r
        tiles, diagonal tiles in ``panels`` row panels."""
        grid = sizes(self.n1, r)
        diag = sum(k * ROUTES[route].cost(pair, self.mode, self.o, rr, rr)[1] for rr, k in grid)
        rest = self.flops([route], grid, grid, (pair,)) - diag
        return sum(k * ROUTES[route].diagonal_flops(pair, self.mode, self.o, rr, panels)
                   for rr, k in grid) + rest / 2


def _panel_count(r: int, span: int, rows: int) -> int:
    """Row panels of an ``r``-sample diagonal tile whose dominant GEMMs have ``span`` rows per
    sample: panels of at least ``rows`` GEMM rows, at most ``SYMMETRIC_MAX_PANELS``."""
    return max(1, min(SYMMETRIC_MAX_PANELS, r * span // rows, r))


def _panel_span(pb: _Problem, chosen: Routes, r: int) -> int:
    """GEMM rows per sample of the block with the most flops on an ``r`` x ``r`` tile."""
    _, route, pair = max(((ROUTES[s].cost(p, pb.mode, pb.o, r, r)[1], s, p)
                          for s, p in zip(chosen, pb.pairs, strict=True)), key=lambda x: x[0])
    return ROUTES[route].gemm_rows_per_sample(pair)


def _route_key(pb: _Problem, route: str, pair: _Pair, panel_rows: int) -> tuple[tuple, int]:
    """``(key, tile)``: the route's largest tile that fits, and its rank (lower is better):
    ``(0, flops)`` at a useful tile (symmetric with ``panel_rows``: diagonal tiles in row
    panels), else ``(1, -tile)`` or, when nothing fits, ``(2, working elements)``."""
    n1, n2 = pb.n1, pb.n2

    def fits(tile: int) -> bool:
        return pb.working([route], min(tile, n1), min(tile, n2), None, (pair,)) <= pb.elements

    tile = _largest(fits, 1, max(n1, n2))
    if tile >= useful_tile(max(n1, n2)):
        if panel_rows:
            r = min(tile, n1)
            span = ROUTES[route].gemm_rows_per_sample(pair)
            f = pb.symmetric_flops(route, pair, r, _panel_count(r, span, panel_rows))
        else:
            f = pb.flops([route], sizes(n1, min(tile, n1)), sizes(n2, min(tile, n2)), (pair,))
        return (0, f), tile
    if tile >= 1:  # below a useful tile (plan_gram only): the largest tile
        return (1, float(-tile)), tile
    return (2, float(pb.working([route], 1, 1, None, (pair,)))), tile


def _choose(pb: _Problem, panel_rows: int) -> tuple[list[str], list[int]]:
    """Per block the route with the fewest flops at the largest tile that fits, and that
    tile.  ``panel_rows`` > 0: a symmetric kernel whose diagonal tiles are split into the row
    panels of at least ``panel_rows`` GEMM rows that the route would get alone; 0: every
    tile counted in full."""
    chosen: list[str] = []
    tiles: list[int] = []
    for pair in pb.pairs:
        options = [(*_route_key(pb, s, pair, panel_rows), s) for s in pair.routes(pb.forced)]
        _, tile, route = min(options, key=lambda x: x[0])
        chosen.append(route)
        tiles.append(tile)
    return chosen, tiles


def _make_plan(pb: _Problem) -> GramPlan:
    """Routes and tile size from the cost model.

    A symmetric kernel is planned twice: routes chosen with every tile counted in full, and
    chosen with the diagonal tiles split into the row panels each route would allow alone (a
    "positions" block's panels are S times taller GEMMs); each plan gets the panels its
    dominant block allows (:func:`_panel_span`), and the one with fewer flops is kept.
    """
    plan = _plan_of(pb, *_choose(pb, 0))
    if pb.symmetric and pb.writable and pb.forced is None and SYMMETRIC_MAX_PANELS > 1:
        paneled = _plan_of(pb, *_choose(pb, SYMMETRIC_PANEL_ROWS[pb.device_kind]))
        if paneled.flops < plan.flops:
            return paneled
    return plan


def _symmetric_tile(pb: _Problem, chosen: list[str], tile: int) -> tuple[int, int]:
    """``(rows, panels)`` of a symmetric kernel's square tiles (see
    ``SYMMETRIC_SPLIT_FLOPS_PER_ENTRY``)."""
    r, panels = min(tile, pb.n1), 1
    per_entry = pb.flops(chosen, [(r, 1)], [(r, 1)]) / (r * r * pb.mode.entries(pb.o))
    if per_entry >= SYMMETRIC_SPLIT_FLOPS_PER_ENTRY:
        r = min(r, max(SYMMETRIC_MIN_TILE[pb.device_kind], math.ceil(pb.n1 / 4)))
        if pb.writable:
            panels = _panel_count(r, _panel_span(pb, chosen, r),
                                  SYMMETRIC_PANEL_ROWS[pb.device_kind])
    return r, panels


def _widened_tile(pb: _Problem, chosen: list[str], tile: int) -> tuple[int, int]:
    """``(rows, cols)`` of a cross kernel's tiles: with few rows (or columns), widened."""
    r, c = min(tile, pb.n1), min(tile, pb.n2)
    if pb.working(chosen, r, c) <= pb.elements:
        if r == pb.n1 and c < pb.n2:
            c = _largest(lambda x: pb.working(chosen, r, x) <= pb.elements, c, pb.n2)
        elif c == pb.n2 and r < pb.n1:
            r = _largest(lambda x: pb.working(chosen, x, c) <= pb.elements, r, pb.n1)
    return r, c


def _plan_of(pb: _Problem, chosen: list[str], tiles: list[int]) -> GramPlan:
    """The plan of the chosen routes: one tile grid for all blocks, panels, flops."""
    tile = max(1, min(tiles))  # _setup has checked that a useful tile fits
    if pb.symmetric:
        r, panels = _symmetric_tile(pb, chosen, tile)
        c = r
    else:
        (r, c), panels = _widened_tile(pb, chosen, tile), 1
    nr, nc = math.ceil(pb.n1 / r), math.ceil(pb.n2 / c)
    flops_all = pb.flops(chosen, sizes(pb.n1, r), sizes(pb.n2, c))
    if pb.symmetric:  # upper triangle: diagonal tiles plus half of the rest
        flops = sum(pb.symmetric_flops(s, p, r, panels)
                    for s, p in zip(chosen, pb.pairs, strict=True))
    else:
        flops = flops_all
    chunk = _pair_chunk(pb, chosen, r, c)
    return GramPlan(tile_rows=r, tile_cols=c, strategies=tuple(chosen),
                    num_tiles=nr * (nr + 1) // 2 if pb.symmetric else nr * nc,
                    symmetric=pb.symmetric,
                    working_bytes=int(pb.working(chosen, r, c, chunk) * pb.itemsize),
                    budget_bytes=int(pb.budget), flops=float(flops),
                    flops_all_tiles=float(flops_all), panels=panels, pair_chunk=chunk)


def _pair_chunk(pb: _Problem, chosen: list[str], r: int, c: int) -> int:
    """The largest chunk of matching pairs, up to ``PAIRS_MAX_CHUNK`` (and no more than a
    tile has), that every chunked block fits in the budget with (0: no such block)."""
    sel = [ROUTES[s].chunk_density(p) for s, p in zip(chosen, pb.pairs, strict=True)
           if ROUTES[s].uses_pair_chunk]
    if not sel:
        return 0
    need = max(1, math.ceil(max(sel) * r * c))  # pairs in a tile
    least = min(PAIRS_MIN_CHUNK, need)  # what the tile was chosen to fit with
    most = max(least, min(PAIRS_MAX_CHUNK, need))
    return max(least, _largest(lambda k: pb.working(chosen, r, c, k) <= pb.elements,
                               least, most))


#: Plans by problem shape: repeated calls on same-shaped Jacobians (SENG refreshes, KIP
#: steps, kernel tiles) skip the cost model's Python evaluation (a few hundred us).
_PLAN_CACHE: LRUCache[GramPlan] = LRUCache(256)
_BUDGET_BITS = 6


def _pair_key(pair: _Pair) -> tuple[Any, ...]:
    """What the cost model reads of a block pair."""
    b1, b2 = pair.b1, pair.b2
    if not pair.kronecker:
        return ("dense", b1.num_stored)
    density = None if pair.density is None else float(f"{pair.density:.2g}")
    grouped = None if pair.grouped is None else (float(f"{pair.grouped[0]:.2g}"),
                                                 pair.grouped[1])
    return ("kron", b1.num_positions, b2.num_positions, b1.d_in, b1.d_out, b1.a_width, density,
            grouped)


def _round_budget(budget: int) -> int:
    """``budget`` rounded down to ``_BUDGET_BITS`` significant bits (at most 3% less)."""
    drop = max(0, int(budget).bit_length() - _BUDGET_BITS)
    return (int(budget) >> drop) << drop


def _cached_plan(pb: _Problem, budget: Budget) -> GramPlan:
    """:func:`_make_plan` of ``pb`` (planned with ``budget``), memoised on its shape.

    A default budget (a share of the free memory, which changes from call to call) is
    rounded down to ``_BUDGET_BITS`` significant bits for planning, so that calls in the same
    memory situation share a plan; an explicit ``max_memory`` is used as given.  The module
    constants that steer the plan (and the routes on offer) are part of the key.
    """
    plan_budget = _round_budget(budget) if budget.default else int(budget)
    key = (tuple(_pair_key(p) for p in pb.pairs), pb.mode, pb.o, pb.n1, pb.n2, pb.symmetric,
           pb.layerwise, plan_budget, pb.itemsize, pb.forced, pb.gpu, pb.writable,
           pb.transient, MIN_SLAB_GEMM_ROWS, PREFERRED_SLAB_GEMM_ROWS, SLAB_CAP_FACTOR,
           SYMMETRIC_SPLIT_FLOPS_PER_ENTRY,
           tuple(SYMMETRIC_MIN_TILE.items()), tuple(SYMMETRIC_PANEL_ROWS.items()),
           SYMMETRIC_MAX_PANELS, ELEMENT_FLOPS, TOKENS_TILE_FLOPS,
           PAIRS_MIN_CHUNK, PAIRS_MAX_CHUNK, tuple(ROUTES.values()))
    plan = _PLAN_CACHE.get(key, lambda: _make_plan(replace(pb, budget=plan_budget)))
    return plan if plan.budget_bytes == budget else replace(plan, budget_bytes=int(budget))




# ---------------------------------------------------------------------------------------------
# The public function
# ---------------------------------------------------------------------------------------------


def _pairs(j1: Jacobian, j2: Jacobian | None) -> list[_Pair]:
    if j2 is None:
        return [_Pair(str(b.name), b, b, isinstance(b, KroneckerBlock)) for b in j1.blocks]
    if len(j1.blocks) != len(j2.blocks):
        raise ValueError(f"J1 has {len(j1.blocks)} blocks {j1.names} but J2 has "
                         f"{len(j2.blocks)} blocks {j2.names}; a cross kernel needs the same "
                         "block structure")
    if j1.num_outputs != j2.num_outputs:
        raise ValueError(f"J1 has O={j1.num_outputs} outputs but J2 has O={j2.num_outputs}")
    pairs = []
    for i, (b1, b2) in enumerate(zip(j1.blocks, j2.blocks, strict=True)):
        label = f"block {i} ({b1.name!r})"
        if b1.name != b2.name:
            raise ValueError(f"{label}: J1 names it {b1.name!r} but J2 names it {b2.name!r}")
        if type(b1) is not type(b2):
            raise ValueError(f"{label} is a {type(b1).__name__} in J1 but a "
                             f"{type(b2).__name__} in J2")
        if isinstance(b1, KroneckerBlock) and isinstance(b2, KroneckerBlock):
            if (b1.d_in, b1.d_out) != (b2.d_in, b2.d_out):
                raise ValueError(f"{label} has (d_in, d_out) = ({b1.d_in}, {b1.d_out}) in J1 "
                                 f"but ({b2.d_in}, {b2.d_out}) in J2")
            if (b1.one_hot is None) != (b2.one_hot is None):
                raise ValueError(f"{label} has an index factor a (one_hot) in only one of J1 "
                                 "and J2; use the same provider for both")
        elif b1.num_params != b2.num_params:
            raise ValueError(f"{label} has P_b={b1.num_params} parameters in J1 but "
                             f"P_b={b2.num_params} in J2")
        if isinstance(b1, DenseBlock) and isinstance(b2, DenseBlock) and \
                not b1.same_columns(b2):  # stored columns differ: the tiles need them aligned
            b1, b2 = b1.expanded(), b2.expanded()
        pairs.append(_Pair(str(b1.name), b1, b2, isinstance(b1, KroneckerBlock)))
    return pairs


def _with_density(xp: Any, backend: Any, pairs: list[_Pair], mode: Mode, o: int,
                  tokens: str | None) -> list[_Pair]:
    """``pairs`` with the "pairs" route offered to the index-factor blocks (their matching
    positions counted: a sort and searches over the indices), and the "tokens" route
    (:func:`_tokens_density`, more sorts) where ``tokens`` is "forced", or "offered" and the
    pairs' passes over the whole kernel cost more than its fixed work per tile (else it
    cannot win, and counting would cost small calls 0.3 ms a block); factors traced by
    ``jax.jit`` (values unknown) and empty ones are left as they are."""
    out = []
    for p in pairs:
        b1, b2 = p.b1, p.b2
        if (p.kronecker and b1.one_hot is not None and b1.num_samples and b2.num_samples
                and not backend.is_traced(b1.a, b2.a)):
            m = _pairs_density(xp, b1.a, b2.a)
            passes = ELEMENT_FLOPS * m * b1.num_samples * b2.num_samples \
                * (2 * o * b1.d_out + mode.entries(o) + 8)
            count = tokens == "forced" or (tokens == "offered" and passes > TOKENS_TILE_FLOPS)
            p = replace(p, density=m, grouped=_tokens_density(xp, b1.a, b2.a, mode, o, b1.d_out)
                        if count else None)
        out.append(p)
    return out


def resolve_dtype(xp: Any, dtype: Any, default: Any) -> Any:
    if dtype is None:
        return default
    if isinstance(dtype, str):
        resolved = getattr(xp, dtype, None)
        if resolved is None:
            raise ValueError(f"dtype {dtype!r} is not a dtype of this array library")
        dtype = resolved
    try:
        ok = xp.isdtype(dtype, "real floating")
    except Exception:
        ok = False
    if not ok:
        raise TypeError(f"dtype must be a real floating dtype of the arrays' library (e.g. "
                        f"float64); got {dtype!r}")
    return dtype


_WRITABLE: dict[int, bool] = {}


def _writable(xp: Any, dtype: Any, device: Any) -> bool:
    """Whether arrays of ``xp`` support slice assignment (not JAX)."""
    if array_api_compat.is_jax_namespace(xp):
        return False
    key = id(xp)
    if key not in _WRITABLE:
        try:
            z = xp.zeros((2,), dtype=dtype, device=device)
            z[0:1] = z[1:2]
            _WRITABLE[key] = True
        except Exception:
            _WRITABLE[key] = False
    return _WRITABLE[key]


@dataclass
class _Setup:
    """One validated :func:`gram` call: the arrays' namespace, the block pairs and the plan."""

    xp: Any
    backend: Any
    pairs: list[_Pair]
    mode: Mode
    n1: int
    n2: int
    o: int
    dtype: Any
    device: Any
    plan: GramPlan


def _forceable() -> tuple[str, ...]:
    return tuple(name for name, route in ROUTES.items() if route.forceable)


def _setup(J1: Any, J2: Any, mode: Any, layerwise: Any, max_memory: Any, dtype: Any,
           strategy: str | None) -> _Setup:
    mode = check_mode(mode)
    if not isinstance(layerwise, bool):
        raise TypeError(f"layerwise must be True or False; got {layerwise!r}")
    if strategy is not None and strategy not in _forceable():
        raise ValueError(f"strategy must be None or one of {_forceable()}; got {strategy!r}")
    j1 = as_jacobian(J1, "J1")
    j2 = None if J2 is None else as_jacobian(J2, "J2")
    xp, backend = namespace_of(J1=j1.blocks[0].arrays()[0],
                               J2=None if j2 is None else j2.blocks[0].arrays()[0])
    pairs = _pairs(j1, j2)
    if backend.fast_scatter_add or strategy in INDEX_ROUTES:
        # "tokens" loops over groups of data-dependent shapes: only where such loops are cheap
        pairs = _with_density(xp, backend, pairs, mode, j1.num_outputs,
                              "forced" if strategy == "tokens" else
                              "offered" if backend.eager_loops else None)
    default = j1.dtype if j2 is None else xp.result_type(j1.dtype, j2.dtype)
    out_dtype = resolve_dtype(xp, dtype, default)
    device = j1.device
    budget = resolve_budget(max_memory, backend, device)
    n1 = j1.num_samples
    n2 = n1 if j2 is None else j2.num_samples
    o = j1.num_outputs
    item = max(itemsize(xp, out_dtype), itemsize(xp, default))
    if n1 == 0 or n2 == 0:
        plan = GramPlan(max(n1, 1), max(n2, 1), tuple("dense" if not p.kronecker else "kron1"
                                                      for p in pairs), 0, j2 is None, 0,
                        budget, 0.0, 0.0)
    else:
        need = _min_elements(pairs, mode, o, n1, n2, layerwise, strategy) * item
        if budget < need:
            raise BudgetTooSmallError(
                f"{budget.given} ({budget} bytes) is too small for the smallest useful tile of "
                f"this kernel ({useful_tile(n1)} x {useful_tile(n2)} samples, "
                f"mode {mode!r}{', layerwise' if layerwise else ''}, {item}-byte "
                f"numbers): pass max_memory >= {need} bytes", budget, need)
        limit = backend.transient_bytes(device)
        problem = _Problem(tuple(pairs), mode, o, n1, n2, j2 is None, layerwise, int(budget),
                           item, strategy, on_gpu(xp, device),
                           _writable(xp, out_dtype, device),
                           None if limit is None else limit // itemsize(xp, out_dtype))
        plan = _cached_plan(problem, budget)
    return _Setup(xp, backend, pairs, mode, n1, n2, o, out_dtype, device, plan)
def plan_gram(J1: Any, J2: Any = None, *, mode: str = "full", layerwise: bool = False,
              max_memory: Any = None, dtype: Any = None,
              strategy: str | None = None) -> GramPlan:
    """The :class:`GramPlan` :func:`gram` follows for these arguments (nothing is computed).

    ``strategy`` forces a :class:`Route` (``"positions"``, ``"materialise"``, ``"pairs"``,
    ``"tokens"``)
    on every block it applies to (``None``: chosen by the cost model).  Other arguments as
    for :func:`gram`.
    """
    return _setup(J1, J2, mode, layerwise, max_memory, dtype, strategy).plan


@capabilities(note={"torch": "differentiable (autograd)",
                    "jax": "tiles assembled by concatenation (no in-place writes)"})
def gram(J1: Any, J2: Any = None, *, mode: str = "full", layerwise: bool = False,
         max_memory: Any = None, dtype: Any = None, progress: Any = None,
         check_finite: bool = True) -> Array:
    r"""Empirical NTK :math:`\Theta = J_1 J_2^\top` of structured Jacobians, in tiles.

    Parameters
    ----------
    J1 : Jacobian (or a single DenseBlock / KroneckerBlock)
        N1 samples, O outputs.
    J2 : Jacobian, optional
        N2 samples with the same block structure as ``J1`` (names, kinds, parameter shapes;
        Kronecker blocks may have a different number of positions).  ``None``: ``J1`` against
        itself; only tiles on and above the diagonal are computed, the rest is mirrored, and
        the result is exactly symmetric (``K[n, m, o, p] == K[m, n, p, o]`` bit for bit, on
        any machine: one triangle of each diagonal tile is mirrored, whatever the BLAS).
    mode : {"full", "trace", "diagonal"}
        ``full``: :math:`\Theta[n,m,o,p] = \sum_k J_1[n,o,k] J_2[m,p,k]`, shape (N1, N2, O, O).
        ``trace``: :math:`\sum_o \Theta[n,m,o,o]` (a sum over outputs), shape (N1, N2).
        ``diagonal``: :math:`\Theta[n,m,o,o]`, shape (N1, N2, O).
    layerwise : bool
        Return one kernel per block on a leading axis, shape (B, N1, N2, ...); the sum over
        that axis is the total kernel.
    max_memory : int, float or str, optional
        Budget in bytes (or ``"2GB"``, ``"512MiB"``) for the working memory beyond the
        output.  Default: a quarter of the free memory of the arrays' device
        (see :mod:`ntkcore._memory`).  It must hold a tile of ``min(N, 8)`` samples a side
        (:data:`MIN_TILE_SAMPLES`); :func:`min_budget` gives the smallest that does.  A
        :class:`ntkcore._memory.Budget` (a caller's resolved budget or a share) is used as is.
    dtype : dtype or str, optional
        Accumulation and result dtype (e.g. ``float64`` for float32 factors; factors are cast
        tile by tile).  Default: the Jacobians' dtype.
    progress : None, callable, True or "tqdm"
        ``progress(done, total)`` is called after each tile; ``True`` / ``"tqdm"`` shows a
        tqdm bar.
    check_finite : bool, default True
        Raise rather than return a kernel computed from a NaN/Inf factor (a dense block's
        ``jac``, a Kronecker block's ``a`` or ``g``) or one whose entries overflow ``dtype``.
        The check reads the smaller side: the factors before contracting (one reduction per
        array), or, when the kernel has fewer entries (convolutions: many positions per
        sample), the kernel afterwards, where any NaN/Inf factor shows (IEEE products and
        sums propagate NaN/Inf, and a factor enters its own sample's diagonal entry); the
        factors are then read only to name the culprit.  Values of arrays traced by
        ``jax.jit`` are unknown and not checked.  ``False`` skips it (a NaN/Inf then
        propagates into the kernel).

    Returns
    -------
    array
        The kernel in the Jacobians' namespace and device: (N1, N2, O, O), (N1, N2) or
        (N1, N2, O), with a leading (B,) axis when ``layerwise``.

    Raises
    ------
    TypeError
        ``J1``/``J2`` are not Jacobians, arrays of different libraries, a bad ``dtype``,
        ``layerwise``, ``progress`` or ``check_finite``.
    ValueError
        Unknown ``mode``, a bad ``max_memory``, ``J1`` and ``J2`` with different block
        structure or output counts (the message names the block), or NaN/Inf in a factor
        (``check_finite``; the message names the Jacobian and the block).
    BudgetTooSmallError
        (a ``ValueError``) ``max_memory`` cannot hold a useful tile; the message states the
        smallest budget that can.

    Notes
    -----
    Kronecker blocks use :math:`(G G'^\top)\odot(A A'^\top)` for a dense layer and, with
    weight sharing, either contract the positions or materialise per-sample weights (index
    factors: or sum over matching pairs), chosen per block by the cost model of the
    :class:`Route` classes; :func:`plan_gram` shows the choice and tile size.
    """
    st = _setup(J1, J2, mode, layerwise, max_memory, dtype, None)
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be True or False; got {check_finite!r}")
    if not check_finite:
        return _execute(st, layerwise, progress)
    blocks = {id(b): b for p in st.pairs for b in (p.b1, p.b2)}.values()
    factors = sum(math.prod(a.shape) for b in blocks for a in b.arrays())
    entries = st.n1 * st.n2 * math.prod(st.mode.tail(st.o)) * (len(st.pairs) if layerwise else 1)
    if factors <= entries:  # read the smaller side (see check_finite above)
        _check_factors_finite(st.pairs, J2 is None)
        return _execute(st, layerwise, progress)
    out = _execute(st, layerwise, progress)
    if not all_finite(st.xp, out):
        _check_factors_finite(st.pairs, J2 is None)
        raise ValueError(f"the kernel holds Inf or NaN although every factor is finite: its "
                         f"entries overflow {st.dtype} (pass dtype= a wider floating type)")
    return out


def _check_factors_finite(pairs: list[_Pair], symmetric: bool) -> None:
    """ValueError naming the Jacobian and block when a factor array holds NaN or Inf."""
    named = []
    for pair in pairs:
        sides = (("J1", pair.b1),) if symmetric else (("J1", pair.b1), ("J2", pair.b2))
        for side, block in sides:
            fields = ("jac",) if len(block.arrays()) == 1 else ("a", "g")
            for field_name, arr in zip(fields, block.arrays(), strict=True):
                named.append((f"{side} block {pair.name!r} (factor {field_name})", arr))
    bad = first_nonfinite(named)
    if bad is not None:
        raise ValueError(f"{bad} contains NaN or Inf; from ntk()/pseudo_ntk() this means "
                         "the model's outputs or their gradients are not finite on these "
                         "inputs (pass check_finite=False to skip this check)")


def _gram(J1: Any, J2: Any = None, *, mode: str = "full", layerwise: bool = False,
          max_memory: Any = None, dtype: Any = None, progress: Any = None,
          strategy: str | None = None) -> Array:
    """:func:`gram` with the Kronecker strategy forced (for tests and benchmarks)."""
    st = _setup(J1, J2, mode, layerwise, max_memory, dtype, strategy)
    return _execute(st, layerwise, progress)



class _Output:
    """Where the finished tiles of :func:`_execute` go.

    Where arrays have item assignment, into one kernel allocated by the first tile (every
    entry is written, so ``empty``), the mirror image of an off-diagonal piece below the
    diagonal; a single tile already in the kernel's layout (:attr:`Mode.tile_is_kernel`) is
    returned as computed.  Otherwise (JAX) tiles are kept and concatenated at the end, which
    transiently needs a second output-sized buffer.
    """

    def __init__(self, st: _Setup, grid: TileGrid, shape: tuple[int, ...], layerwise: bool):
        self.st, self.grid, self.shape, self.layerwise = st, grid, shape, layerwise
        self.writable = _writable(st.xp, st.dtype, st.device)
        self.panels = st.plan.panels if self.writable else 1
        self.whole = self.writable and st.mode.tile_is_kernel and grid.schedule() == [
            (0, 0)] and len(grid.pieces(0, 0, st.plan.panels)) == 1
        self.kernel: Array | None = None
        self.tiles: dict[tuple[int, int], Array] = {}
        self.parts: list[Array] = []

    def put(self, t: Array, piece: tuple[slice, slice, int], block: int | None,
            same: bool) -> None:
        """Write piece ``(rows, cols, mirror)``'s tile ``t`` (GEMM layout) of ``block`` (None:
        the sum of all blocks); ``same``: the piece lies on the diagonal of a self-kernel,
        and its square ``[rows, rows]`` (the first ``mirror`` columns) is made exactly
        symmetric first (:meth:`Mode.mirror_tile`)."""
        xp, mode = self.st.xp, self.st.mode
        rows, cols, mirror = piece
        if same and self.writable:
            mode.mirror_tile(xp, t, mirror, MIRROR_BLOCK)
        t = mode.kernel_layout(xp, t)
        if not self.writable:  # a diagonal tile is one piece here
            self.parts.append(mode.mirror(xp, t) if same else t)
            return
        if self.whole and block is None:  # the tile is the kernel, in its layout: no copy
            self.kernel = t
            return
        if self.kernel is None:
            self.kernel = xp.empty(self.shape, dtype=self.st.dtype, device=self.st.device)
        lead: tuple[int, ...] = () if block is None else (block,)
        self.kernel[(*lead, rows, cols, ...)] = t  # type: ignore[index]
        if mirror < cols.stop - cols.start:
            below = (*lead, slice(cols.start + mirror, cols.stop), rows, ...)
            self.kernel[below] = mode.transpose(xp, t[:, mirror:, ...])  # type: ignore[index]

    def close_tile(self, i: int, j: int) -> None:
        """Tile (i, j) is complete."""
        if not self.writable:
            parts, self.parts = self.parts, []
            self.tiles[(i, j)] = self.st.xp.stack(parts, axis=0) if self.layerwise else parts[0]

    def result(self) -> Array:
        if self.writable:
            return self.kernel
        return self.grid.assemble(self.st.xp, self.tiles, self.st.mode, 1 if self.layerwise else 0)


def _compute_tile(st: _Setup, grid: TileGrid, i: int, j: int, output: _Output,
                  layerwise: bool, ctx: _Context) -> None:
    """Tile (i, j): blocks outside, pieces (row panels) inside, so that a block's per-tile
    work is done once; blocks summed per piece in GEMM layout (or written one by one)."""
    same = st.plan.symmetric and i == j
    pieces = grid.pieces(i, j, output.panels)
    rows = slice(*grid.rows[i])
    sums: list[Array | None] = [None] * len(pieces)
    for b, (name, pair) in enumerate(zip(st.plan.strategies, st.pairs, strict=True)):
        for k, t in enumerate(ROUTES[name].panel_tiles(st.xp, pair, rows, pieces,
                                                       same and len(pieces) == 1, st.dtype,
                                                       st.mode, ctx)):
            if layerwise:
                output.put(t, pieces[k], b, same)
            elif sums[k] is None:
                sums[k] = t
            else:
                sums[k] += t  # this loop's own array (a block tile computed above)
            del t  # free the block tile before the next one is allocated
    if not layerwise:
        for k, piece in enumerate(pieces):
            t, sums[k] = sums[k], None
            output.put(t, piece, None, same)
    output.close_tile(i, j)


def _execute(st: _Setup, layerwise: bool, progress: Any) -> Array:
    """The kernel of ``st``, tile by tile in the plan's upper-triangle-first schedule."""
    shape = (*((len(st.pairs),) if layerwise else ()), st.n1, st.n2, *st.mode.tail(st.o))
    if st.n1 == 0 or st.n2 == 0:
        return st.xp.zeros(shape, dtype=st.dtype, device=st.device)
    plan = st.plan
    grid = TileGrid(st.n1, st.n2, plan.tile_rows, plan.tile_cols, symmetric=plan.symmetric)
    output = _Output(st, grid, shape, layerwise)
    limit = st.backend.transient_bytes(st.device)
    ctx = _Context(st.backend, plan.pair_chunk,
                   None if limit is None else limit // itemsize(st.xp, st.dtype))
    todo = grid.schedule()
    with progress_steps(progress, len(todo), "gram") as step:
        for i, j in todo:
            _compute_tile(st, grid, i, j, output, layerwise, ctx)
            step()
    return output.result()
