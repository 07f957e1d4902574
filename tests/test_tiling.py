"""ntkcore.tiling: the tile grid, the upper-triangle schedule and assembly with mirroring,
against a kernel built whole in NumPy."""

import numpy as np
import pytest

from ntkcore.modes import MODES, check_mode
from ntkcore.tiling import TileGrid, bounds, panel_bounds, panel_share, sizes, square_tile


def test_bounds_and_schedule():
    assert bounds(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert bounds(0, 3) == []
    for n, size in ((7, 3), (6, 3), (2, 3), (0, 3)):  # (size, count) without listing blocks
        blocks = [b - a for a, b in bounds(n, size)]
        assert sizes(n, size) == [(s, blocks.count(s)) for s in dict.fromkeys(blocks)]
    g = TileGrid(7, 5, 3, 2)
    assert g.rows == [(0, 3), (3, 6), (6, 7)] and g.cols == [(0, 2), (2, 4), (4, 5)]
    assert g.schedule() == [(i, j) for i in range(3) for j in range(3)]
    s = TileGrid(7, 99, 3, 2, symmetric=True)
    assert s.cols == s.rows
    assert s.schedule() == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2)]
    assert [s.mirrored(i, j) for i, j in [(1, 0), (0, 1), (1, 1)]] == [True, False, False]


@pytest.mark.parametrize("lead", [0, 1])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_assemble_matches_whole_kernel(mode, lead, symmetric):
    rng = np.random.default_rng(2)
    n1, n2, o = 8, 5, 2
    m = check_mode(mode)
    j1 = rng.standard_normal((2, n1, o, 4))
    j2 = j1 if symmetric else rng.standard_normal((2, n2, o, 4))
    full = np.einsum("bnok,bmpk->bnmop", j1, j2)
    ref = {"full": full, "trace": np.einsum("bnmoo->bnm", full),
           "diagonal": np.einsum("bnmoo->bnmo", full)}[mode]
    if not lead:
        ref = ref.sum(axis=0)
    g = TileGrid(n1, n2, 3, 2, symmetric=symmetric)
    pre = (slice(None),) * lead
    tiles = {(i, j): ref[(*pre, slice(*g.rows[i]), slice(*g.cols[j]))] for i, j in g.schedule()}
    np.testing.assert_array_equal(g.assemble(np, tiles, m, lead), ref)


def test_panel_share():
    assert panel_share(512, 1) == 1.0
    assert panel_share(512, 4) == pytest.approx(10 / 16)
    assert panel_bounds(10, 17, 3) == [10, 12, 14, 17]
    # panels x their widths cover the upper triangle with the diagonal exactly once
    b = panel_bounds(0, 7, 3)
    covered = np.zeros((7, 7), int)
    for k in range(3):
        covered[b[k]:b[k + 1], b[k]:] += 1
    assert (np.triu(covered) == np.triu(np.ones((7, 7), int))).all()


@pytest.mark.parametrize("panels", [1, 2, 3, 4])
@pytest.mark.parametrize("symmetric", [True, False])
def test_pieces_cover_every_entry_once(symmetric, panels):
    """The products of the scheduled tiles, with their mirrored parts, write every kernel
    entry exactly once (ragged tiles, panels wider than a short last tile included)."""
    n1, n2 = 11, 11 if symmetric else 7
    g = TileGrid(n1, n2, 4, 3, symmetric=symmetric)
    written = np.zeros((n1, n2), int)
    for i, j in g.schedule():
        for rows, cols, mirror in g.pieces(i, j, panels):
            written[rows, cols] += 1
            written[cols.start + mirror:cols.stop, rows] += 1
    np.testing.assert_array_equal(written, np.ones((n1, n2), int))


def test_square_tile_and_kernel_operator_default_block():
    """The largest square tile within a byte count; KernelOperator sizes its default tiles
    with it, in the item size of its accumulation dtype (float32 tiles hold twice the pairs)."""
    from ntkcore import DenseBlock, Jacobian, KernelOperator
    from ntkcore.operators import TILE_BYTES

    assert square_tile(100, 1) == 10 and square_tile(99, 1) == 9 and square_tile(3, 8) == 1
    jac = np.ones((3, 2, 4))
    for dtype, item in ((np.float64, 8), (np.float32, 4)):
        j = Jacobian([DenseBlock(jac.astype(dtype))])
        for mode, q in (("trace", 1), ("full", 2)):
            op = KernelOperator(j, mode=mode)
            assert op.block == square_tile(TILE_BYTES, item * q * q)
            assert op.block ** 2 * item * q * q <= TILE_BYTES < (op.block + 1) ** 2 * item * q * q
    j64 = Jacobian([DenseBlock(jac)])
    assert KernelOperator(j64, dtype=np.float32).block == KernelOperator(
        Jacobian([DenseBlock(jac.astype(np.float32))])).block
