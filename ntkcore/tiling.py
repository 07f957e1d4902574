r"""Tile grids over the sample pairs (N1, N2) of a kernel, in one place.

A kernel :math:`\Theta` (N1, N2, ...) is computed in tiles :math:`\Theta_{ij}` (row block
:math:`i`, column block :math:`j`); a symmetric kernel only on and above the diagonal, a tile
below it being the transpose of its mirror (:meth:`ntkcore.modes.Mode.transpose`).
:func:`progress_steps` reports the tiles done to a user's ``progress`` argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ._typing import Array
from .modes import Mode

__all__ = ["TileGrid", "bounds", "panel_bounds", "panel_share", "progress_steps", "sizes",
           "square_tile"]


def bounds(n: int, size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of ``size`` covering ``range(n)`` (the last may
    be shorter)."""
    return [(s, min(n, s + size)) for s in range(0, n, size)]


def sizes(n: int, size: int) -> list[tuple[int, int]]:
    """``(block size, count)`` of the blocks of :func:`bounds` (``n`` samples, ``size`` each),
    without listing them."""
    return [(b, k) for b, k in ((size, n // size), (n % size, 1)) if b and k]


def square_tile(nbytes: float, pair_bytes: float) -> int:
    """Samples a side of the largest square tile of ``pair_bytes`` bytes per sample pair that
    fits ``nbytes`` (at least 1)."""
    return max(1, math.isqrt(int(nbytes // pair_bytes)))


def panel_bounds(start: int, stop: int, panels: int) -> list[int]:
    """Row boundaries of ``panels`` near-equal panels of the rows ``[start, stop)``."""
    n = stop - start
    return [start + (k * n) // panels for k in range(panels + 1)]


def panel_share(r: int, panels: int) -> float:
    """Share of a diagonal tile's (r x r) products that its row panels compute."""
    if panels <= 1 or r <= 0:
        return 1.0
    b = panel_bounds(0, r, panels)
    return sum((b[k + 1] - b[k]) * (r - b[k]) for k in range(panels)) / (r * r)


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

    def pieces(self, i: int, j: int, panels: int = 1) -> list[tuple[slice, slice, int]]:
        """The products ``(rows, cols, mirror)`` that compute tile ``(i, j)``: columns from
        offset ``mirror`` on of each product are also the transpose of their mirror below the
        diagonal (``mirror`` equal to the product's width: nothing is mirrored).  A tile off
        the diagonal of a symmetric grid is mirrored whole; one on it is ``panels`` row
        panels: panel ``k`` against the columns from its own first row to the tile's end, the
        part right of its own square mirrored below it, :func:`panel_share` of the tile's
        products, each still a wide GEMM (one panel: the tile itself)."""
        (r0, r1), (c0, c1) = self.rows[i], self.cols[j]
        if not (self.symmetric and i == j):
            return [(slice(r0, r1), slice(c0, c1), 0 if self.symmetric else c1 - c0)]
        b = panel_bounds(r0, r1, panels)
        return [(slice(b[k], b[k + 1]), slice(b[k], r1), b[k + 1] - b[k])
                for k in range(panels) if b[k + 1] > b[k]]

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


@contextmanager
def progress_steps(progress: Any, total: int, desc: str) -> Iterator[Callable[[], None]]:
    """A ``step()`` to call after each of ``total`` tiles: it calls ``progress(done, total)``
    (a callable), advances a tqdm bar (``True`` or ``"tqdm"``) or does nothing (``None`` or
    ``False``); TypeError for anything else, ImportError naming the package when tqdm is
    missing."""
    if progress is None or progress is False:
        yield lambda: None
    elif progress is True or progress == "tqdm":
        try:
            from tqdm.auto import tqdm
        except ImportError:
            raise ImportError(f"progress={progress!r} shows a tqdm bar, but tqdm is not "
                              'installed: pip install "ntkcore[bench]" or pip install tqdm'
                              ) from None
        bar = tqdm(total=total, desc=desc, unit="tile")
        try:
            yield lambda: bar.update(1)
        finally:
            bar.close()
    elif callable(progress):
        done = 0

        def step() -> None:
            nonlocal done
            done += 1
            progress(done, total)

        yield step
    else:
        raise TypeError(f"progress must be None, a callable(done, total), True or 'tqdm'; "
                        f"got {progress!r}")
