r"""Tile grids over the sample pairs (N1, N2) of a kernel, in one place.

A kernel :math:`\Theta` (N1, N2, ...) is computed in tiles :math:`\Theta_{ij}` of row block
:math:`i` (``rows[i] = (start, stop)``) and column block :math:`j`.  For a symmetric kernel
(:math:`J_2 = J_1`, so N2 = N1 and the column blocks are the row blocks) only the tiles on and
above the diagonal (:math:`j \ge i`) are computed; a tile below it is the transpose of its
mirror, :math:`\Theta_{ij} = \Theta_{ji}^\top` in the sense of
:meth:`ntkcore.modes.Mode.transpose` (:math:`\Theta[n,m,o,p] = \Theta[m,n,p,o]`).

Clients: :func:`ntkcore.gram` (its tiles; the row panels of its diagonal tiles stay its own),
the streaming path of :func:`ntkcore.ntk`, :class:`ntkcore.KernelOperator` (which mirrors
products, :math:`\Theta_{ij}^\top V_i`, instead of tiles) and ``ntkcore.distributed.ntk_dask``.
"""

from __future__ import annotations

from typing import Any

from ._typing import Array
from .modes import Mode

__all__ = ["TileGrid", "bounds"]


def bounds(n: int, size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of ``size`` covering ``range(n)`` (the last may
    be shorter)."""
    return [(s, min(n, s + size)) for s in range(0, n, size)]


class TileGrid:
    """The tiles of an (N1, N2) kernel and which of them to compute.

    Parameters
    ----------
    n1, n2 : int
        Samples of the row and column sides (``n2`` is ignored when ``symmetric``).
    rows : int
        Samples per row block.
    cols : int, optional
        Samples per column block (default ``rows``; ignored when ``symmetric``, whose column
        blocks are its row blocks).
    symmetric : bool
        Only tiles with ``j >= i`` are computed; the others are mirrored.

    Attributes
    ----------
    rows, cols : list of (start, stop)
    symmetric : bool
    """

    __slots__ = ("cols", "rows", "symmetric")

    def __init__(self, n1: int, n2: int, rows: int, cols: int | None = None, *,
                 symmetric: bool = False) -> None:
        self.rows = bounds(n1, rows)
        self.cols = self.rows if symmetric else bounds(n2, rows if cols is None else cols)
        self.symmetric = symmetric

    def row_tiles(self, i: int) -> range:
        """Column blocks ``j`` computed in row block ``i`` (``j >= i`` when symmetric)."""
        return range(i if self.symmetric else 0, len(self.cols))

    def schedule(self) -> list[tuple[int, int]]:
        """The tiles ``(i, j)`` to compute, row by row (the upper triangle when symmetric)."""
        return [(i, j) for i in range(len(self.rows)) for j in self.row_tiles(i)]

    def mirrored(self, i: int, j: int) -> bool:
        """Whether tile ``(i, j)`` is the transpose of the computed tile ``(j, i)``."""
        return self.symmetric and j < i

    def assemble(self, xp: Any, tiles: dict[tuple[int, int], Array], mode: Mode,
                 lead: int = 0) -> Array:
        """The kernel from the computed ``tiles`` ((lead..., r, c, tail) each), mirroring those
        below the diagonal, by concatenation (for namespaces without item
        assignment, or tiles that arrive whole)."""
        out_rows = []
        for i in range(len(self.rows)):
            row = [mode.transpose(xp, tiles[(j, i)], lead) if self.mirrored(i, j)
                   else tiles[(i, j)] for j in range(len(self.cols))]
            out_rows.append(row[0] if len(row) == 1 else xp.concat(row, axis=lead + 1))
        return out_rows[0] if len(out_rows) == 1 else xp.concat(out_rows, axis=lead)
