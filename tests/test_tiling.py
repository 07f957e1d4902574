"""ntkcore.tiling: the tile grid, the upper-triangle schedule and assembly with mirroring,
against a kernel built whole in NumPy."""

import numpy as np
import pytest

from ntkcore.modes import MODES, check_mode
from ntkcore.tiling import TileGrid, bounds


def test_bounds_and_schedule():
    assert bounds(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert bounds(0, 3) == []
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
