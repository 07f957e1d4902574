r"""Memory-bounded Gram contractions of structured Jacobians: the empirical NTK.

For Jacobians :math:`J \in \mathbb{R}^{N_1\times O\times P}` and
:math:`J' \in \mathbb{R}^{N_2\times O\times P}` split into the same parameter blocks ``b``,

.. math::

    \Theta[n, m, o, p] = \sum_b \Theta_b[n, m, o, p], \qquad
    \Theta_b[n, m, o, p] = \sum_{k} J_b[n, o, k]\, J'_b[m, p, k] .

Modes: ``full`` (N1, N2, O, O); ``trace`` (N1, N2) :math:`=\sum_o \Theta[:, :, o, o]` (a sum,
not a mean); ``diagonal`` (N1, N2, O) :math:`=\Theta[:, :, o, o]`.

Per block kind (``r`` rows and ``c`` columns of one tile):

* :class:`~ntkcore.DenseBlock` (N, O, P_b): one GEMM.  trace: ``(r, O P_b) @ (O P_b, c)``;
  full: ``(r O, P_b) @ (P_b, c O)``; diagonal: O batched ``(r, P_b) @ (P_b, c)``.
* :class:`~ntkcore.KroneckerBlock` with factors ``a`` (N, S, d_in), ``g`` (N, S, O, d_out)
  (and ``T`` positions on the column side):

  .. math::

      \Theta_b[n,m,o,p] = \sum_{s,t} \langle g[n,s,o], g'[m,t,p]\rangle\,
                                      \langle a[n,s], a'[m,t]\rangle .

  - ``S = T = 1`` (dense layer): :math:`\Theta_b = (G G'^\top) \odot (A A'^\top)`, two GEMMs
    and a Hadamard product; in trace mode ``G`` is ``g`` reshaped to (N, O d_out).
    Cost :math:`2 r c (d_{in} + O^k d_{out})` with ``k = 1`` (trace, diagonal) or 2 (full),
    instead of :math:`2 r c O^k d_{out} d_{in}` for the materialised Jacobian.
  - ``S > 1``, strategy ``"positions"`` (contract the weight-sharing axis):
    :math:`A = a a'^\top` over (n s, m t).  trace: also :math:`G = g g'^\top` over
    (n s, m t) with ``K = O d_out``, then :math:`\sum_{s,t} A \odot G`.  full / diagonal:
    :math:`Y[n,m,t,o,:] = \sum_s A[n,s,m,t]\, g[n,s,o,:]`, then
    :math:`\Theta_b[n,m,o,p] = \sum_{t,k} Y[n,m,t,o,k]\, g'[m,t,p,k]` (diagonal: ``p = o``).
  - an index factor a (N, S) (``one_hot``, an embedding): :math:`A` is the index equality
    :math:`[i_{ns} = i'_{mt} \ne -1]` (:func:`ntkcore.jacobian.factor_gram`), and the cost
    model below counts ``d_in`` as 1 in both positions routes (the one-hot rows are formed
    only by the materialise route, which is charged for them).
  - strategy ``"materialise"``: per-sample weights
    :math:`W[n,o] = \sum_s g[n,s,o]\, a[n,s]^\top` (N, O, d_out d_in), one batched GEMM per
    tile side, then the dense contraction.
  - strategy ``"pairs"`` (index factors only, :func:`_pairs_tile`): as
    :math:`\langle e_i, e_j\rangle = [i = j \ne -1]`,

    .. math::

        \Theta_b[n,m,o,p] = \sum_{(s,t):\ i_{ns} = i'_{mt} \ne -1}
                            \langle g[n,s,o], g'[m,t,p]\rangle ,

    a sum over the M matching (sample, position) pairs only, about :math:`(N S)^2 / V` of
    the :math:`(N S)^2` for tokens spread over a vocabulary of V (but :math:`(N S)^2` for a
    padding token everywhere).  The pairs are found by sorting the column indices and two
    binary searches per row index, taken in chunks, their g rows gathered and contracted,
    and the products scatter-added into their kernel cells
    (:meth:`ntkcore.backend.Backend.scatter_add`).  The route is offered only where the
    backend has a native scatter-add (``fast_scatter_add``: numpy, torch, jax, cupy; the
    standard's fallback is one-hot products) and the index values can be read (not under
    ``jax.jit``); :func:`gram` counts M when it plans (a sort and two searches of the
    N S indices).

Choosing the Kronecker strategy (flop and memory model)
--------------------------------------------------------
Per tile of ``r`` rows and ``c`` columns, with ``P_b = d_out d_in`` and ``k = 2`` for
``full`` (``k = 1`` otherwise); counts of floating-point operations (flops) and of
working-memory elements, besides the factor slices :math:`(rS + cT)(d_{in} + O d_{out})`:

* positions, trace: :math:`2rcST(d_{in} + O d_{out} + 1)` flops, :math:`3rcST` elements
  (``A``, ``G`` and their product).
* positions, full / diagonal: :math:`2rcST(d_{in} + O d_{out}) + 2rcTO^k d_{out}` flops,
  :math:`2rcST + 2rcTOd_{out}` elements (``A`` and ``Y``, each possibly copied once).
* materialise: :math:`2(rS + cT) O P_b + 2rcO^k P_b` flops, :math:`(r + c) O P_b` elements
  (twice that for diagonal).
* pairs: with :math:`m = \rho r c` matching pairs in the tile (:math:`\rho = M / (N_1 N_2)`
  measured on the whole kernel; a self-tile takes about half of them, not credited),
  :math:`2 m O^k d_{out}` flops of products plus ``ELEMENT_FLOPS`` per element of its
  memory-bound passes: :math:`m(2 O d_{out} + q + 8)` (the two gathers, the scatter, the
  index arithmetic), :math:`(rS + cT)(4 + \log_2(cT + 2))` (the sort and the searches) and
  :math:`rcq` (the cells); working memory :math:`8(rS + cT) + 2rcq` elements plus the chunk,
  :math:`(2 O d_{out} + 2q + 8)` elements a pair (``q`` outputs per cell: 1, O or
  :math:`O^2`).  The tile is chosen with a chunk of ``min(m, PAIRS_MIN_CHUNK)`` pairs; the
  plan then takes the largest chunk up to ``PAIRS_MAX_CHUNK`` that the budget holds
  (:attr:`GramPlan.pair_chunk`).  ``ELEMENT_FLOPS`` (16) is the flop-equivalent of one
  element of such a pass: gathers and scatters run at memory speed, far fewer elements per
  second than a GEMM does flops.  The weight is applied to this route only, whose work is
  all gathers and scatters: charging the positions route's Hadamard product and strided sum
  the same way turned convnext_atto's ``stages.1`` ``fc2`` blocks (N = 256, trace) to
  materialise, which took 0.65 s against the positions route's 0.43 s (one thread), so the
  other strategies keep their counts above.

A tile accumulator of :math:`3 r c O^k` elements comes on top (layerwise: one tile).
For each block and strategy the largest square tile that fits the budget is found, the total
flop count over all tiles is computed at that tile size (so the materialisation's
recomputation on small tiles is charged), and the strategy with fewer flops wins (the
"pairs" route's M makes this choice data dependent: a plan is remembered per density
:math:`\rho` rounded to two digits).  All blocks share one tile grid: its size is the
smallest of the blocks' chosen tile sizes.  A symmetric kernel is planned a second time with
the flops of its upper-triangle tiles (a diagonal tile: the materialised weights formed once,
the products times :func:`~ntkcore.tiling.panel_share` of the row panels each strategy would
get: a "positions" block's panels are GEMMs of ``S`` rows per sample, so a token layer gets
panels at N = 32 where a dense one needs ``SYMMETRIC_PANEL_ROWS`` samples); the plan with
fewer flops is kept (vit_tiny, N = 214: the "positions" route in 4 panels, 442 GFLOP,
instead of materialised weights, 549 GFLOP and 1.9x the time).

Tiling and memory
-----------------
The kernel is computed in tiles of (rows, columns) (:mod:`ntkcore.tiling`), block after block,
so that the working memory beyond the output (factor slices, intermediate Gram matrices,
per-sample weights, the tile accumulator) stays below ``max_memory``.  Tiles are written into a
preallocated output where the namespace supports item assignment; otherwise (JAX) tiles are
concatenated, which transiently needs a second output-sized buffer.  With ``J2=None`` only
tiles on and above the diagonal are computed and mirrored, and a tile on the diagonal is
computed as up to ``SYMMETRIC_MAX_PANELS`` row panels: a SYRK-like (p+1)/(2p) of the work with
GEMMs that stay wide (PyTorch has no SYRK; NumPy's, which it calls for ``x @ x.T``, was slower
than panels on large full-mode tiles).  The square of each piece on the diagonal keeps its
upper triangle and mirrors it below, in strips of ``MIRROR_BLOCK`` samples
(:func:`_mirror_in_place`; without item assignment :meth:`~ntkcore.modes.Mode.mirror`): no
BLAS promises a symmetric ``X X^T`` (MKL, OpenBLAS and cuBLAS may round its triangles
differently) and the "positions" and "pairs" routes sum ``(n, m)`` and
``(m, n)`` in different orders, so a self-kernel is exactly symmetric, bit for bit, by
construction, whichever machine computed it.

Everything is pure array API (matmul, reshape, permute_dims, vecdot, sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import array_api_compat

from ._memory import Budget, itemsize, resolve_budget
from ._typing import Array
from ._validation import all_finite, first_nonfinite, namespace_of
from .backend import on_gpu
from .errors import BudgetTooSmallError
from .jacobian import (
    DenseBlock,
    Jacobian,
    KroneckerBlock,
    as_jacobian,
    factor_gram,
    flat_weights,
    with_ones,
)
from .modes import Mode, check_mode
from .support import capabilities
from .tiling import TileGrid, panel_share, progress_steps, sizes

__all__ = ["GramPlan", "gram", "plan_gram"]

STRATEGIES = ("positions", "materialise", "pairs")

#: Flop-equivalents of one element of a memory-bound pass (a gather, a scatter, index
#: arithmetic): such passes run at memory speed, tens of times fewer elements per second than
#: a GEMM does flops on a CPU core.  The cost model charges the "pairs" route's passes this
#: many flops per element (see "Choosing the Kronecker strategy" above).
ELEMENT_FLOPS = 16

#: Matching pairs the "pairs" route gathers at a time: at least ``PAIRS_MIN_CHUNK`` (the
#: working set the cost model charges when it picks a tile), at most ``PAIRS_MAX_CHUNK`` (the
#: plan takes the largest chunk between the two that its budget holds).
PAIRS_MIN_CHUNK = 256
PAIRS_MAX_CHUNK = 1 << 16

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
#: A panel of k samples is a GEMM of k rows for a dense, kron1 or materialised block and of
#: k S rows for a block on the "positions" route (:func:`_panel_span`, the block with the
#: most flops decides): a token or convolution layer's panels stay wide at small N.
SYMMETRIC_PANEL_ROWS = {"cpu": 128, "gpu": 2048}
SYMMETRIC_MAX_PANELS = 4

#: Samples a side of the blocks in which a diagonal tile of a self-kernel is mirrored
#: (:func:`_mirror_in_place`): transposed copies of this size stay in cache.  Full mode takes
#: ``MIRROR_BLOCK // O`` samples (blocks of about this many rows of the matrix view).
MIRROR_BLOCK = 256

#: The smallest useful tile holds ``min(N, MIN_TILE_SAMPLES)`` samples a side (rows of J1,
#: columns of J2).  A budget that cannot hold it raises ``ValueError`` stating the budget that
#: does (:func:`min_budget`), instead of computing the kernel in up to N^2 / 2 tiny tiles:
#: one-sample tiles cost a Python round trip per kernel entry (hours for N = 1000).
MIN_TILE_SAMPLES = 8


# ---------------------------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------------------------
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

    def strategies(self, forced: str | None) -> tuple[str, ...]:
        if not self.kronecker:
            return ("dense",)
        if self.density is not None:
            if forced == "pairs":
                return ("pairs",)
            if forced is None:
                return (*_Pair(self.name, self.b1, self.b2, True).strategies(None), "pairs")
        if forced == "materialise":
            return ("materialise",)
        if self.b1.num_positions == 1 and self.b2.num_positions == 1:
            return ("kron1",) if forced == "positions" else ("kron1", "materialise")
        if forced == "positions":
            return ("positions",)
        return ("positions", "materialise")


def _q(mode: str, o: int) -> int:
    return {"trace": 1, "diagonal": o, "full": o * o}[mode]


def _cost(strategy: str, pair: _Pair, mode: str, o: int, r: int, c: int,
          chunk: int | None = None) -> tuple[int, int]:
    """``(working elements, flops)`` of one block on one ``r`` x ``c`` tile (see module doc);
    ``chunk``: pairs gathered at a time by the "pairs" route (default: the least it needs)."""
    q = _q(mode, o)
    qk = o * o if mode == "full" else o  # output pairs per sample pair the GEMMs produce
    if strategy == "dense":
        p = pair.b1.num_stored  # the columns a DenseBlock stores (its zeros are not read)
        inputs = (r + c) * o * p
        mem = inputs * (2 if mode == "diagonal" else 1)
        return mem, 2 * r * c * qk * p
    b1, b2 = pair.b1, pair.b2
    s, t, din, dout = b1.num_positions, b2.num_positions, b1.d_in, b1.d_out
    aw = b1.a_width  # d_in, or 1 for an index factor (its products are comparisons)
    inputs = (r * s + c * t) * (aw + o * dout)
    if strategy == "pairs":
        return _pairs_cost(pair.density, mode, o, dout, r, c, s, t, inputs, chunk)
    if strategy == "kron1":
        mem = inputs * (2 if mode == "diagonal" else 1) + r * c * (1 + q)
        if mode == "trace":
            return mem, 2 * r * c * (aw + o * dout) + r * c
        return mem, 2 * r * c * (aw + qk * dout) + r * c * q
    if strategy == "positions":
        rcst = r * c * s * t
        if mode == "trace":
            return inputs + 3 * rcst, 2 * rcst * (aw + o * dout + 1)
        y = r * c * t * o * dout
        mem = inputs + 2 * rcst + 2 * y + c * t * o * dout
        last = 2 * y * o if mode == "full" else 2 * y
        return mem, 2 * rcst * (aw + o * dout) + last
    if strategy == "materialise":
        p = din * dout
        w = (r + c) * o * p
        one_hot = (r * s + c * t) * din if aw != din else 0  # an index factor's one-hot rows
        mem = inputs + one_hot + w * (2 if mode == "diagonal" else 1)
        return mem, 2 * (r * s + c * t) * o * p + 2 * r * c * qk * p
    raise AssertionError(strategy)


def _pairs_cost(density: float, mode: str, o: int, dout: int, r: int, c: int, s: int, t: int,
                inputs: int, chunk: int | None) -> tuple[int, int]:
    """``(working elements, flops)`` of the "pairs" route on an ``r`` x ``c`` tile with
    ``density * r * c`` matching pairs (see the module docstring)."""
    q = _q(mode, o)
    m = density * r * c
    if chunk is None:
        chunk = min(math.ceil(m), PAIRS_MIN_CHUNK)
    index = r * s + c * t
    # the sort and searches (int64: two elements each), the cell sums and their sum
    mem = inputs + 8 * index + 2 * r * c * q + chunk * _pairs_per_pair(mode, o, dout)
    gemm = 2 * m * o * dout * (o if mode == "full" else 1)
    passes = m * (2 * o * dout + q + 8) + index * (4 + math.log2(c * t + 2)) + r * c * q
    return int(mem), int(gemm + ELEMENT_FLOPS * passes)


def _pairs_per_pair(mode: str, o: int, dout: int) -> int:
    """Working elements per pair of a "pairs" chunk: two gathered g rows, the products, four
    int64 indices (two elements each) and the scattered copy."""
    return 2 * o * dout + 2 * _q(mode, o) + 8


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


def useful_tile(n: int) -> int:
    """Samples a side of the smallest useful tile for ``n`` samples (:data:`MIN_TILE_SAMPLES`)."""
    return min(n, MIN_TILE_SAMPLES)


def _min_elements(pairs: list[_Pair], mode: str, o: int, n1: int, n2: int, layerwise: bool,
                  forced: str | None) -> int:
    """Working elements of the smallest useful tile, ``min(n1, MIN_TILE_SAMPLES)`` x
    ``min(n2, MIN_TILE_SAMPLES)``, with each block's leanest strategy."""
    r, c = useful_tile(n1), useful_tile(n2)
    acc = _acc_factor(layerwise, len(pairs))
    mem = max(min(_cost(s, p, mode, o, r, c)[0] for s in p.strategies(forced)) for p in pairs)
    return mem + r * c * _q(mode, o) * acc


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
    return _min_elements(pairs, mode, num_outputs, n1, n2, layerwise, None) * itemsize


def _acc_factor(layerwise: bool, nblocks: int) -> int:
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
        Per block: ``"dense"``, ``"kron1"`` (Kronecker, S = T = 1), ``"positions"`` or
        ``"materialise"``.
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
        Matching pairs the "pairs" route gathers at a time (0: no block takes that route).
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


def _work(strategies: tuple[str, ...] | list[str], pairs: list[_Pair], mode: str, o: int,
          r: int, c: int, acc: int, chunk: int | None = None) -> int:
    """Working elements of a tile: the largest block's working set plus the accumulator."""
    return max(_cost(s, p, mode, o, r, c, chunk)[0]
               for s, p in zip(strategies, pairs, strict=True)) \
        + r * c * _q(mode, o) * acc


def _flops(strategies: tuple[str, ...] | list[str], pairs: list[_Pair], mode: str, o: int,
           rows: list[tuple[int, int]], cols: list[tuple[int, int]]) -> float:
    """Flops of the blocks over ``(size, count)`` row and column blocks (:func:`sizes`)."""
    return float(sum(nr * nc * _cost(s, p, mode, o, r, c)[1]
                     for s, p in zip(strategies, pairs, strict=True)
                     for r, nr in rows for c, nc in cols))


def _panel_span(strategies: list[str], pairs: list[_Pair], mode: str, o: int, r: int) -> int:
    """GEMM rows per sample of the block with the most flops on an ``r`` x ``r`` tile: its
    positions S on the "positions" route (the Grams are (r S) x (r S)), else 1."""
    _, strat, pair = max(((_cost(s, p, mode, o, r, r)[1], s, p)
                              for s, p in zip(strategies, pairs, strict=True)),
                             key=lambda x: x[0])
    return pair.b1.num_positions if strat == "positions" else 1


def _diagonal_flops(strategy: str, pair: _Pair, mode: str, o: int, r: int, panels: int) -> float:
    """Flops of one block on an ``r`` x ``r`` tile on the diagonal of a symmetric kernel in
    ``panels`` row panels: :func:`panel_share` of the products, the materialised weights formed
    once (:math:`2 r S O P_b`, not for both sides)."""
    flops = _cost(strategy, pair, mode, o, r, r)[1]
    form = 0
    if strategy == "materialise":
        form = 2 * r * pair.b1.num_positions * o * pair.b1.num_params
        flops -= 2 * form
    return form + flops * panel_share(r, panels)


def _symmetric_flops(strategy: str, pair: _Pair, mode: str, o: int, n: int, r: int,
                     panels: int) -> float:
    """Flops of one block over the upper-triangle tiles of an n x n kernel in r x r tiles."""
    grid = sizes(n, r)
    diag = sum(k * _cost(strategy, pair, mode, o, rr, rr)[1] for rr, k in grid)
    rest = _flops([strategy], [pair], mode, o, grid, grid) - diag
    return sum(k * _diagonal_flops(strategy, pair, mode, o, rr, panels)
               for rr, k in grid) + rest / 2


def _choose(pairs: list[_Pair], mode: str, o: int, n1: int, n2: int, fits_elems: float,
            acc: int, forced: str | None, panel_rows: int) -> tuple[list[str], list[int]]:
    """Per block the strategy with the fewest flops at the largest tile that fits, and that
    tile.  ``panel_rows`` > 0: a symmetric kernel whose diagonal tiles are split into the row
    panels of at least ``panel_rows`` GEMM rows that the strategy would get alone
    (:func:`_panel_count`, :func:`_symmetric_flops`); 0: every tile counted in full."""
    nmax = max(n1, n2)
    useful = useful_tile(nmax)
    chosen: list[str] = []
    tiles: list[int] = []
    for pair in pairs:
        options = []
        for strat in pair.strategies(forced):
            def fits(tile: int, strat: str = strat, pair: _Pair = pair) -> bool:
                r, c = min(tile, n1), min(tile, n2)
                return _work([strat], [pair], mode, o, r, c, acc) <= fits_elems
            tile = _largest(fits, 1, nmax)
            if tile >= useful:
                if panel_rows:
                    r = min(tile, n1)
                    span = pair.b1.num_positions if strat == "positions" else 1
                    f = _symmetric_flops(strat, pair, mode, o, n1, r,
                                         _panel_count(r, span, panel_rows))
                else:
                    f = _flops([strat], [pair], mode, o, sizes(n1, min(tile, n1)),
                               sizes(n2, min(tile, n2)))
                key = (0, f)
            elif tile >= 1:  # below a useful tile (plan_gram only): the largest tile
                key = (1, float(-tile))
            else:  # nothing fits: prefer the smallest working set
                key = (2, float(_work([strat], [pair], mode, o, 1, 1, acc)))
            options.append((key, tile, strat))
        key, tile, strat = min(options, key=lambda x: x[0])
        chosen.append(strat)
        tiles.append(tile)
    return chosen, tiles


def _panel_count(r: int, span: int, rows: int) -> int:
    """Row panels of an ``r``-sample diagonal tile whose dominant GEMMs have ``span`` rows per
    sample: panels of at least ``rows`` GEMM rows, at most ``SYMMETRIC_MAX_PANELS``."""
    return max(1, min(SYMMETRIC_MAX_PANELS, r * span // rows, r))


def _make_plan(pairs: list[_Pair], mode: str, o: int, n1: int, n2: int, symmetric: bool,
               layerwise: bool, budget: int, itemsize: int, forced: str | None,
               gpu: bool, writable: bool = True) -> GramPlan:
    """Strategies and tile size from the cost model (see the module docstring).

    A symmetric kernel is planned twice: strategies chosen with every tile counted in full,
    and chosen with the diagonal tiles split into the row panels each strategy would allow
    alone (a "positions" block's panels are S times taller GEMMs); each plan gets the panels
    its dominant block allows (:func:`_panel_span`), and the one with fewer flops is kept.
    """
    acc = _acc_factor(layerwise, len(pairs))
    elems = budget / itemsize
    args = (pairs, mode, o, n1, n2, symmetric, layerwise, budget, itemsize, gpu, writable, acc)
    plan = _finish(*_choose(pairs, mode, o, n1, n2, elems, acc, forced, 0), *args)
    if symmetric and writable and forced is None and SYMMETRIC_MAX_PANELS > 1:
        rows = SYMMETRIC_PANEL_ROWS["gpu" if gpu else "cpu"]
        paneled = _finish(*_choose(pairs, mode, o, n1, n2, elems, acc, forced, rows), *args)
        if paneled.flops < plan.flops:
            return paneled
    return plan


def _finish(chosen: list[str], tiles: list[int], pairs: list[_Pair], mode: str, o: int,
            n1: int, n2: int, symmetric: bool, layerwise: bool, budget: int, itemsize: int,
            gpu: bool, writable: bool, acc: int) -> GramPlan:
    """The plan of the chosen strategies: one tile grid for all blocks, panels, flops."""
    elems = budget / itemsize
    panels = 1
    tile = max(1, min(tiles))  # _setup has checked that a useful tile fits
    if symmetric:
        r = min(tile, n1)
        per_entry = _flops(chosen, pairs, mode, o, [(r, 1)], [(r, 1)]) / (r * r * _q(mode, o))
        if per_entry >= SYMMETRIC_SPLIT_FLOPS_PER_ENTRY:
            floor = SYMMETRIC_MIN_TILE["gpu" if gpu else "cpu"]
            r = min(r, max(floor, math.ceil(n1 / 4)))
            if writable:
                rows = SYMMETRIC_PANEL_ROWS["gpu" if gpu else "cpu"]
                panels = _panel_count(r, _panel_span(chosen, pairs, mode, o, r), rows)
        c = r
    else:
        r, c = min(tile, n1), min(tile, n2)
        if _work(chosen, pairs, mode, o, r, c, acc) <= elems:
            if r == n1 and c < n2:  # few rows: widen the tiles
                c = _largest(lambda x: _work(chosen, pairs, mode, o, r, x, acc) <= elems,
                             c, n2)
            elif c == n2 and r < n1:
                r = _largest(lambda x: _work(chosen, pairs, mode, o, x, c, acc) <= elems,
                             r, n1)

    nr, nc = math.ceil(n1 / r), math.ceil(n2 / c)
    ntiles = nr * (nr + 1) // 2 if symmetric else nr * nc
    flops_all = _flops(chosen, pairs, mode, o, sizes(n1, r), sizes(n2, c))
    if symmetric:  # upper triangle: diagonal tiles plus half of the rest
        flops = sum(_symmetric_flops(s, p, mode, o, n1, r, panels)
                    for s, p in zip(chosen, pairs, strict=True))
    else:
        flops = flops_all
    chunk = _pair_chunk(chosen, pairs, mode, o, r, c, acc, elems)
    working = _work(chosen, pairs, mode, o, r, c, acc, chunk)
    return GramPlan(tile_rows=r, tile_cols=c, strategies=tuple(chosen), num_tiles=ntiles,
                    symmetric=symmetric, working_bytes=int(working * itemsize),
                    budget_bytes=int(budget), flops=float(flops),
                    flops_all_tiles=float(flops_all), panels=panels, pair_chunk=chunk)


def _pair_chunk(chosen: list[str], pairs: list[_Pair], mode: str, o: int, r: int, c: int,
                acc: int, elems: float) -> int:
    """The largest chunk of matching pairs, up to ``PAIRS_MAX_CHUNK`` (and no more than a
    tile has), that every "pairs" block fits in the budget with (0: no such block)."""
    sel = [p for s, p in zip(chosen, pairs, strict=True) if s == "pairs"]
    if not sel:
        return 0
    need = max(1, math.ceil(max(p.density for p in sel) * r * c))  # pairs in a tile
    least = min(PAIRS_MIN_CHUNK, need)  # what the tile was chosen to fit with
    most = max(least, min(PAIRS_MAX_CHUNK, need))
    return max(least, _largest(lambda k: _work(chosen, pairs, mode, o, r, c, acc, k) <= elems,
                               least, most))


#: Plans by problem shape: repeated calls on same-shaped Jacobians (SENG refreshes, KIP
#: steps, kernel tiles) skip the cost model's Python evaluation (a few hundred us).
_PLAN_CACHE: dict[tuple[Any, ...], GramPlan] = {}
_PLAN_CACHE_SIZE = 256
_BUDGET_BITS = 6


def _pair_key(pair: _Pair) -> tuple[Any, ...]:
    """What the cost model reads of a block pair."""
    b1, b2 = pair.b1, pair.b2
    if not pair.kronecker:
        return ("dense", b1.num_stored)
    density = None if pair.density is None else float(f"{pair.density:.2g}")
    return ("kron", b1.num_positions, b2.num_positions, b1.d_in, b1.d_out, b1.a_width, density)


def _round_budget(budget: int) -> int:
    """``budget`` rounded down to ``_BUDGET_BITS`` significant bits (at most 3% less)."""
    drop = max(0, int(budget).bit_length() - _BUDGET_BITS)
    return (int(budget) >> drop) << drop


def _cached_plan(pairs: list[_Pair], mode: str, o: int, n1: int, n2: int, symmetric: bool,
                 layerwise: bool, budget: Budget, itemsize: int, forced: str | None, gpu: bool,
                 writable: bool) -> GramPlan:
    """:func:`_make_plan`, memoised on the problem's shape.

    A default budget (a share of the free memory, which changes from call to call) is
    rounded down to ``_BUDGET_BITS`` significant bits for planning, so that calls in the same
    memory situation share a plan; an explicit ``max_memory`` is used as given.  The module
    constants that steer the plan are part of the key.
    """
    plan_budget = _round_budget(budget) if budget.default else int(budget)
    key = (tuple(_pair_key(p) for p in pairs), mode, o, n1, n2, symmetric, layerwise,
           plan_budget, itemsize, forced, gpu, writable, SYMMETRIC_SPLIT_FLOPS_PER_ENTRY,
           tuple(SYMMETRIC_MIN_TILE.items()), tuple(SYMMETRIC_PANEL_ROWS.items()),
           SYMMETRIC_MAX_PANELS, ELEMENT_FLOPS, PAIRS_MIN_CHUNK, PAIRS_MAX_CHUNK)
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        plan = _make_plan(pairs, mode, o, n1, n2, symmetric, layerwise, plan_budget, itemsize,
                          forced, gpu, writable)
        if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = plan
    return plan if plan.budget_bytes == budget else replace(plan, budget_bytes=int(budget))


# ---------------------------------------------------------------------------------------------
# Tile kernels.  Inputs are already sliced to the tile and cast to the compute dtype.
# ---------------------------------------------------------------------------------------------
# Tile products are ``x @ y.T``; a self-product ``x @ x.T`` is left as it is: NumPy detects it
# and calls SYRK (half the flops), and GEMM on a contiguous copy of ``x.T`` was not faster
# (``benchmarks/suites/gram.py``, "selfprod" rows).
def _dense_tile(xp: Any, j1: Array, j2: Array, mode: str) -> Array:
    """Theta for dense slices ``j1`` (r, O, P), ``j2`` (c, O, P)."""
    r, o, p = j1.shape
    c = j2.shape[0]
    same = j1 is j2
    if mode == "trace":  # sum_{o,k} J[n,o,k] J'[m,o,k]: one GEMM with K = O P
        x1 = xp.reshape(j1, (r, o * p))
        return x1 @ (x1 if same else xp.reshape(j2, (c, o * p))).T
    if mode == "full":  # (r O, P) @ (P, c O) -> (r, O, c, O), the GEMM layout
        x1 = xp.reshape(j1, (r * o, p))
        k = x1 @ (x1 if same else xp.reshape(j2, (c * o, p))).T
        return xp.reshape(k, (r, o, c, o))
    # diagonal: O batched GEMMs (O, r, P) @ (O, P, c) -> (O, r, c) -> (r, c, O)
    k = xp.permute_dims(j1, (1, 0, 2)) @ xp.permute_dims(j2, (1, 2, 0))
    return xp.permute_dims(k, (1, 2, 0))


def _kron1_tile(xp: Any, a1: Array, g1: Array, a2: Array, g2: Array, mode: str,
                ones: bool = False) -> Array:
    """Theta for S = T = 1: (G G'^T) (.) (A A'^T); a (r, 1, d_in), g (r, 1, O, d_out);
    ``ones``: the factors' implicit ones columns (:func:`factor_gram`)."""
    r, c = a1.shape[0], a2.shape[0]
    o, dout = g1.shape[2], g1.shape[3]
    same = a1 is a2 and g1 is g2
    x1 = xp.reshape(a1, (r, *a1.shape[2:]))
    aa = factor_gram(xp, x1, x1 if same else xp.reshape(a2, (c, *a2.shape[2:])), g1.dtype,
                     ones)
    # the Hadamard products are in place: the GEMM results are fresh arrays of this function
    # (namespaces without in-place operators, JAX, rebind the name instead)
    if mode == "trace":  # sum_o <g[n,o], g'[m,o]> = (r, O d_out) @ (O d_out, c)
        y1 = xp.reshape(g1, (r, o * dout))
        gg = y1 @ (y1 if same else xp.reshape(g2, (c, o * dout))).T
        gg *= aa
        return gg
    if mode == "full":  # (r O, d_out) @ (d_out, c O) -> (r, O, c, O), the GEMM layout
        y1 = xp.reshape(g1, (r * o, dout))
        gg = xp.reshape(y1 @ (y1 if same else xp.reshape(g2, (c * o, dout))).T, (r, o, c, o))
        gg *= aa[:, None, :, None]
        return gg
    # diagonal: (O, r, d_out) @ (O, d_out, c) -> (O, r, c) -> (r, c, O)
    gg = xp.permute_dims(xp.reshape(g1, (r, o, dout)), (1, 0, 2)) @ \
        xp.permute_dims(xp.reshape(g2, (c, o, dout)), (1, 2, 0))
    gg = xp.permute_dims(gg, (1, 2, 0))
    gg *= aa[:, :, None]
    return gg


def _positions_tile(xp: Any, a1: Array, g1: Array, a2: Array, g2: Array, mode: str,
                    ones: bool = False) -> Array:
    """Theta by contracting positions; a (r, S, d_in) (or index (r, S)), g (r, S, O, d_out);
    a2/g2 with T; ``ones`` as for :func:`_kron1_tile`."""
    r, s = a1.shape[0], a1.shape[1]
    c, t = a2.shape[0], a2.shape[1]
    o, dout = g1.shape[2], g1.shape[3]
    same = a1 is a2 and g1 is g2
    x1 = xp.reshape(a1, (r * s, *a1.shape[2:]))
    # A[(n,s), (m,t)]
    aa = factor_gram(xp, x1, x1 if same else xp.reshape(a2, (c * t, *a2.shape[2:])), g1.dtype,
                     ones)
    if mode == "trace":
        # G[(n,s),(m,t)] = sum_o <g[n,s,o], g'[m,t,o]>;  Theta[n,m] = sum_{s,t} A (.) G
        y1 = xp.reshape(g1, (r * s, o * dout))
        gg = y1 @ (y1 if same else xp.reshape(g2, (c * t, o * dout))).T
        return xp.sum(xp.reshape(aa * gg, (r, s, c, t)), axis=(1, 3))
    # Y[n, (m,t), (o,k)] = sum_s A[n,s,m,t] g[n,s,o,k]: r batched (cT, S) @ (S, O d_out)
    at = xp.permute_dims(xp.reshape(aa, (r, s, c * t)), (0, 2, 1))
    y = at @ xp.reshape(g1, (r, s, o * dout))
    if mode == "full":
        # Theta[n,m,o,p] = sum_{t,k} Y[n,m,t,o,k] g'[m,t,p,k]: c batched (r O, T d) @ (T d, O)
        yp = xp.permute_dims(xp.reshape(y, (r, c, t, o, dout)), (1, 0, 3, 2, 4))
        yp = xp.reshape(yp, (c, r * o, t * dout))
        g2p = xp.reshape(xp.permute_dims(g2, (0, 2, 1, 3)), (c, o, t * dout))
        k = yp @ xp.permute_dims(g2p, (0, 2, 1))  # (c, r O, O)
        return xp.permute_dims(xp.reshape(k, (c, r, o, o)), (1, 2, 0, 3))  # (r, O, c, O)
    # diagonal: Theta[n,m,o] = sum_{t,k} Y[n,m,t,o,k] g'[m,t,o,k]
    y5 = xp.reshape(y, (r, c, t, o, dout))
    return xp.sum(xp.vecdot(y5, g2[None, ...], axis=-1), axis=2)


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


def _pairs_tile(xp: Any, backend: Any, a1: Array, g1: Array, a2: Array, g2: Array,
                mode: str, chunk: int) -> Array:
    r"""Theta of an index block from its matching pairs only; a1 (r, S), a2 (c, T) indices,
    g (r, S, O, d_out), g2 with T.

    The one-hot inner product :math:`\langle e_i, e_j\rangle = [i = j \ne -1]` makes
    :math:`\Theta[n,m,o,p] = \sum_{(s,t):\, i_{ns} = i'_{mt} \ne -1}
    \langle g[n,s,o], g'[m,t,p]\rangle`.  Sorting the column indices and two binary searches
    per row index give each flat row position ``u = (n, s)`` its matches in the sorted
    order, ``lo[u] .. lo[u] + cnt[u]``; pair ``k`` (in ``0 .. M``, rows in order) belongs to
    row ``u`` with :math:`e_{u-1} \le k < e_u` for the running sums ``e = cumsum(cnt)`` and
    is its ``(k - e_{u-1})``-th match.  Pairs are taken ``chunk`` at a time: gather the two g
    rows, contract them (trace: over (o, k); diagonal: over k; full: a (O, d) @ (d, O)
    product) and scatter-add into cell ``(n, m)`` (:meth:`Backend.scatter_add`).  A self-tile
    (J' = J) takes each unordered pair once, the matches of u from u's own place in the
    sorted order on, and adds its value to both cells (n, m) and (m, n) (transposed over
    (o, p)): half the gathers.  Work :math:`O(M O d_{out})` plus a sort, instead of the
    positions route's :math:`O(r c S T)`.
    """
    r, s = a1.shape
    c, t = a2.shape
    o, dout = g1.shape[2], g1.shape[3]
    same = a1 is a2 and g1 is g2
    order, lo, cnt = _index_matches(xp, xp.reshape(a1, (r * s,)), xp.reshape(a2, (c * t,)))
    if same:  # each unordered pair once: the matches at or after u's own sorted place
        rank = xp.argsort(order)
        cnt = xp.where(cnt > 0, lo + cnt - rank, cnt)
        lo = rank
    end = xp.cumulative_sum(cnt)
    total = int(end[-1]) if r * s else 0
    base = lo - (end - cnt)  # sorted position of pair k of row u: k + base[u]
    y1, y2 = xp.reshape(g1, (r * s, o * dout)), xp.reshape(g2, (c * t, o * dout))
    kept = (o * dout,) if mode == "trace" else (o, dout)  # the gathered rows' layout
    q = _q(mode, o)
    out = None
    for p0 in range(0, total, chunk):
        k = xp.arange(p0, min(total, p0 + chunk), dtype=end.dtype,
                      device=array_api_compat.device(end))
        row = xp.searchsorted(end, k, side="right")
        col = xp.take(order, k + xp.take(base, row))
        x1 = xp.reshape(xp.take(y1, row, axis=0), (k.shape[0], *kept))  # 2-D gathers: the
        x2 = xp.reshape(xp.take(y2, col, axis=0), (k.shape[0], *kept))  # fast ones in torch
        if mode == "trace":
            v = xp.vecdot(x1, x2, axis=-1)[:, None]
        elif mode == "full":  # (M, O, d) @ (M, d, O)
            v = xp.reshape(x1 @ xp.permute_dims(x2, (0, 2, 1)), (k.shape[0], q))
        else:  # diagonal: (M, O)
            v = xp.vecdot(x1, x2, axis=-1)
        cell = (row // s) * c + col // t
        if same:  # and the mirror (m, n) of every pair of two positions (transposed O x O)
            mirror = xp.where(row == col, -1, (col // s) * c + row // t)
            cell = xp.concat((cell, mirror))
            v = xp.concat((v, v if mode != "full" else xp.reshape(xp.permute_dims(
                xp.reshape(v, (-1, o, o)), (0, 2, 1)), (-1, q))))
        part = backend.scatter_add(cell, v, r * c)
        out = part if out is None else out + part
    if out is None:
        out = xp.zeros((r * c, q), dtype=g1.dtype, device=array_api_compat.device(g1))
    if mode == "trace":
        return xp.reshape(out, (r, c))
    if mode == "diagonal":
        return xp.reshape(out, (r, c, o))
    return xp.permute_dims(xp.reshape(out, (r, c, o, o)), (0, 2, 1, 3))  # (r, O, c, O)


def _take(xp: Any, x: Array, sl: slice, dtype: Any) -> Array:
    """Samples ``sl`` of a factor, in the compute dtype (an index factor stays integer)."""
    x = x[sl, ...]
    return x if x.dtype == dtype or x.ndim == 2 else xp.astype(x, dtype)


def _take_a(xp: Any, block: KroneckerBlock, sl: slice, dtype: Any, ones: bool) -> Array:
    """:func:`_take` of the factor a, its implicit ones column (``block.ones``) kept implicit
    only where the product passes ``ones`` on (both sides have it), else appended."""
    a = _take(xp, block.a, sl, dtype)
    return with_ones(xp, a) if block.ones and not ones else a


def _piece_tiles(xp: Any, strategy: str, pair: _Pair, rows: slice,
                 pieces: list[tuple[slice, slice, int]], same: bool, dtype: Any,
                 mode: str, route: _Route) -> Iterator[Array]:
    """One block's tiles for the pieces (rows, cols, mirror) of the tile ``rows``, in order.

    ``same``: the single piece is a diagonal tile itself (self-products).  Several pieces are
    the row panels of a diagonal tile; materialised per-sample weights are then computed
    once for the whole tile and sliced for each panel (both sides of every panel lie within
    the tile's rows).  The "pairs" route computes the whole diagonal tile as a self-tile (half
    its pairs) and slices it for each panel.
    """
    r0 = rows.start
    if strategy == "pairs" and len(pieces) > 1:
        t = _block_tile(xp, strategy, pair, rows, rows, True, dtype, mode, route)
        for prs, pcs, _ in pieces:
            i, j = slice(prs.start - r0, prs.stop - r0), slice(pcs.start - r0, pcs.stop - r0)
            yield t[i, :, j, :] if mode == "full" else t[i, j, ...]  # full: (r, O, c, O)
        return
    if strategy != "materialise" or len(pieces) == 1:
        for prs, pcs, _ in pieces:
            yield _block_tile(xp, strategy, pair, prs, pcs, same, dtype, mode, route)
        return
    w = flat_weights(xp, _take_a(xp, pair.b1, rows, dtype, False),
                     _take(xp, pair.b1.g, rows, dtype), pair.b1.one_hot)
    for prs, pcs, _ in pieces:
        yield _dense_tile(xp, w[prs.start - r0:prs.stop - r0, ...],
                          w[pcs.start - r0:pcs.stop - r0, ...], mode)


class _Route(NamedTuple):
    """What the "pairs" route needs besides the factors: the backend (its scatter-add) and
    the plan's chunk of pairs."""

    backend: Any
    chunk: int


def _block_tile(xp: Any, strategy: str, pair: _Pair, rows: slice, cols: slice,
                same: bool, dtype: Any, mode: str, route: _Route) -> Array:
    """One block's contribution to the tile (rows, cols).

    In ``full`` mode the tile comes in the layout of the GEMMs that produce it, (r, O, c, O):
    blocks are summed in that layout and :func:`_execute` permutes the sum to (r, c, O, O)
    once per tile (one strided pass over the tile instead of one per block).
    """

    if strategy == "dense":
        j1 = _take(xp, pair.b1.jac, rows, dtype)
        return _dense_tile(xp, j1, j1 if same else _take(xp, pair.b2.jac, cols, dtype), mode)
    # implicit ones columns stay implicit in the factor products (not in materialise)
    ones = strategy != "materialise" and pair.b1.ones and pair.b2.ones
    a1, g1 = _take_a(xp, pair.b1, rows, dtype, ones), _take(xp, pair.b1.g, rows, dtype)
    a2, g2 = (a1, g1) if same else (_take_a(xp, pair.b2, cols, dtype, ones),
                                    _take(xp, pair.b2.g, cols, dtype))
    if strategy == "kron1":
        return _kron1_tile(xp, a1, g1, a2, g2, mode, ones)
    if strategy == "positions":
        return _positions_tile(xp, a1, g1, a2, g2, mode, ones)
    if strategy == "pairs":
        return _pairs_tile(xp, route.backend, a1, g1, a2, g2, mode, route.chunk)
    w1 = flat_weights(xp, a1, g1, pair.b1.one_hot)
    return _dense_tile(xp, w1, w1 if same else flat_weights(xp, a2, g2, pair.b2.one_hot), mode)


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


def _with_density(xp: Any, backend: Any, pairs: list[_Pair]) -> list[_Pair]:
    """``pairs`` with the "pairs" route offered to the index-factor blocks (their matching
    positions counted: a sort and two searches over the indices); factors traced by
    ``jax.jit`` (values unknown) and empty ones are left as they are."""
    out = []
    for p in pairs:
        b1, b2 = p.b1, p.b2
        if (p.kronecker and b1.one_hot is not None and b1.num_samples and b2.num_samples
                and not backend.is_traced(b1.a, b2.a)):
            p = replace(p, density=_pairs_density(xp, b1.a, b2.a))
        out.append(p)
    return out


def _resolve_dtype(xp: Any, dtype: Any, default: Any) -> Any:
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


def _setup(J1: Any, J2: Any, mode: Any, layerwise: Any, max_memory: Any, dtype: Any,
           strategy: str | None) -> _Setup:
    mode = check_mode(mode)
    if not isinstance(layerwise, bool):
        raise TypeError(f"layerwise must be True or False; got {layerwise!r}")
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy must be None or one of {STRATEGIES}; got {strategy!r}")
    j1 = as_jacobian(J1, "J1")
    j2 = None if J2 is None else as_jacobian(J2, "J2")
    xp, backend = namespace_of(J1=j1.blocks[0].arrays()[0],
                               J2=None if j2 is None else j2.blocks[0].arrays()[0])
    pairs = _pairs(j1, j2)
    if backend.fast_scatter_add or strategy == "pairs":
        pairs = _with_density(xp, backend, pairs)
    default = j1.dtype if j2 is None else xp.result_type(j1.dtype, j2.dtype)
    out_dtype = _resolve_dtype(xp, dtype, default)
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
        gpu = on_gpu(xp, device)
        plan = _cached_plan(pairs, mode, o, n1, n2, j2 is None, layerwise, budget, item,
                            strategy, gpu, _writable(xp, out_dtype, device))
    return _Setup(xp, backend, pairs, mode, n1, n2, o, out_dtype, device, plan)


def plan_gram(J1: Any, J2: Any = None, *, mode: str = "full", layerwise: bool = False,
              max_memory: Any = None, dtype: Any = None,
              strategy: str | None = None) -> GramPlan:
    """The :class:`GramPlan` :func:`gram` follows for these arguments (nothing is computed).

    ``strategy`` forces ``"positions"`` or ``"materialise"`` for every Kronecker block
    (``None``: chosen by the cost model).  Other arguments as for :func:`gram`.
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
    weight sharing, either contract the positions or materialise per-sample weights, chosen
    by the flop and memory model described in the module docstring; :func:`plan_gram` shows
    the choice and tile size.
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


def _mirror_in_place(xp: Any, mode: Mode, tile: Array, width: int) -> None:
    r"""Make the square ``tile[:, :width]`` (over samples) of a tile on the diagonal of a
    self-kernel exactly symmetric in place: its upper triangle in the matrix view (row
    ``n O + o``, column ``m O + p``; :meth:`Mode.mirror`) is kept and the lower one is
    overwritten with its transpose.

    ``tile`` comes in the layout of the products that made it: (r, c) in trace mode,
    (r, c, O) in diagonal mode, (r, O, c, O) in full mode, whose matrix view (r O, c O) is a
    reshape.  In strips of ``b`` = :data:`MIRROR_BLOCK` rows of that matrix (samples in
    diagonal mode): the block on the diagonal through :meth:`Mode.mirror` (a small
    temporary), the strip right of it copied, transposed, into the strip below.  Half the tile
    is written, in cache-sized transposes, and nothing tile-sized is allocated.  ``square``
    must be an array (or a view of one) that this module created: the tiles of
    :func:`_execute` are.
    """
    if mode == "full":
        r, o, c = tile.shape[0], tile.shape[1], tile.shape[2]
        try:  # the matrix view itself (no copy), where the tile's strides allow it
            matrix = xp.reshape(tile, (r * o, c * o), copy=False)
        except (ValueError, AttributeError, RuntimeError):  # a permuted tile: sample blocks
            _mirror_samples(xp, tile[:, :, :width, :])
            return
        square, mode = matrix[:, :width * o], check_mode("trace")
    else:
        square = tile[:, :width, ...]
    r, b = square.shape[0], MIRROR_BLOCK
    for i0 in range(0, r, b):
        i1 = min(r, i0 + b)
        square[i0:i1, i0:i1, ...] = mode.mirror(xp, square[i0:i1, i0:i1, ...])
        if i1 < r:
            square[i1:, i0:i1, ...] = mode.transpose(xp, square[i0:i1, i1:, ...])


def _mirror_samples(xp: Any, square: Array) -> None:
    """:func:`_mirror_in_place` of a full-mode square (r, O, r, O) that is no reshape of its
    matrix view (a tile the "positions" or "pairs" route permuted): strips of
    ``MIRROR_BLOCK // O`` samples."""
    r, o = square.shape[0], square.shape[1]
    b = max(1, MIRROR_BLOCK // o)
    trace = check_mode("trace")  # the mirror of a plain matrix
    for i0 in range(0, r, b):
        i1 = min(r, i0 + b)
        nb = i1 - i0
        block = xp.reshape(square[i0:i1, :, i0:i1, :], (nb * o, nb * o))  # a copy
        square[i0:i1, :, i0:i1, :] = xp.reshape(trace.mirror(xp, block), (nb, o, nb, o))
        if i1 < r:
            square[i1:, :, i0:i1, :] = xp.permute_dims(square[i0:i1, :, i1:, :], (2, 3, 0, 1))


def _execute(st: _Setup, layerwise: bool, progress: Any) -> Array:
    xp, plan, mode = st.xp, st.plan, st.mode
    out_shape = (*((len(st.pairs),) if layerwise else ()), st.n1, st.n2, *mode.tail(st.o))
    if st.n1 == 0 or st.n2 == 0:
        return xp.zeros(out_shape, dtype=st.dtype, device=st.device)
    grid = TileGrid(st.n1, st.n2, plan.tile_rows, plan.tile_cols, symmetric=plan.symmetric)
    writable = _writable(xp, st.dtype, st.device)
    out = None  # allocated by the first tile written (or that tile, ``whole``)
    # a single tile, of a trace kernel (its GEMM layout is the kernel's), is returned itself
    whole = writable and mode == "trace" and grid.schedule() == [(0, 0)] and len(
        grid.pieces(0, 0, plan.panels)) == 1
    tiles: dict[tuple[int, int], Array] = {}
    route = _Route(st.backend, plan.pair_chunk)

    def flush(accs: list[Array | None], k: int, piece: tuple[slice, slice, int],
              b: int | None, same: bool, parts: list[Array]) -> None:
        """Write piece ``k``'s tile (taken from ``accs``, GEMM layout) for block ``b`` (None:
        all blocks) and its mirror below the diagonal; ``same``: the piece lies on the
        diagonal of a self-kernel, and its square is written as :meth:`Mode.mirror` of the
        computed one (one triangle mirrored: exactly symmetric whatever the products'
        rounding).  Without item assignment (JAX) append the tile to ``parts`` instead."""
        t, accs[k] = accs[k], None
        rows, cols, mirror = piece
        if same and writable:  # the square [rows, rows]: the piece's first ``mirror`` columns
            _mirror_in_place(xp, mode, t, mirror)
        if mode == "full":  # (r, O, c, O) -> (r, c, O, O)
            t = xp.permute_dims(t, (0, 2, 1, 3))
        if not writable:  # a diagonal tile is one piece here
            parts.append(mode.mirror(xp, t) if same else t)
            return
        nonlocal out
        if whole and b is None:  # the tile is the kernel, in its layout: no copy
            out = t
            return
        if out is None:
            out = xp.empty(out_shape, dtype=st.dtype, device=st.device)  # every entry is written
        lead: tuple[int, ...] = () if b is None else (b,)
        out[(*lead, rows, cols, ...)] = t  # type: ignore[index]
        if mirror < cols.stop - cols.start:
            below = (*lead, slice(cols.start + mirror, cols.stop), rows, ...)
            out[below] = mode.transpose(xp, t[:, mirror:, ...])  # type: ignore[index]

    todo = grid.schedule()
    panels = plan.panels if writable else 1
    with progress_steps(progress, len(todo), "gram") as step:
        for i, j in todo:
            same = plan.symmetric and i == j
            pieces = grid.pieces(i, j, panels)
            rows = slice(*grid.rows[i])
            accs: list[Array | None] = [None] * len(pieces)
            parts: list[Array] = []
            # blocks outside, pieces inside: a block's per-tile work is done once
            for b, (strat, pair) in enumerate(zip(plan.strategies, st.pairs, strict=True)):
                for k, t in enumerate(_piece_tiles(xp, strat, pair, rows, pieces,
                                                   same and len(pieces) == 1, st.dtype, mode,
                                                   route)):
                    if layerwise or accs[k] is None:
                        accs[k] = t
                    else:
                        accs[k] += t  # this loop's own array (a block tile computed above)
                    del t  # free the block tile before the next one is allocated
                    if layerwise:
                        flush(accs, k, pieces[k], b, same, parts)
            if not layerwise:
                for k, piece in enumerate(pieces):
                    flush(accs, k, piece, None, same, parts)
            if not writable:
                tiles[(i, j)] = xp.stack(parts, axis=0) if layerwise else parts[0]
            step()
    if writable:
        return out
    return grid.assemble(xp, tiles, mode, 1 if layerwise else 0)
