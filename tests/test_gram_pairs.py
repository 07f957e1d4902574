"""The "pairs" route of index-factor (embedding) blocks in ntkcore.gram and the backends'
scatter-add, against dense float64 references: the one-hot Jacobian formed in NumPy and
contracted by einsum, and ``np.add.at``."""

from __future__ import annotations

import sys

import array_api_compat
import numpy as np
import pytest

from ntkcore import DenseBlock, Jacobian, KroneckerBlock, gram, plan_gram
from ntkcore.backend import get_backend
from ntkcore.errors import BudgetTooSmallError
from ntkcore.gram import _gram
from tests.conftest import force_panels
from tests.tolerances import kernel_tol

# many small eager JAX operations of changing shapes: compile them without XLA's passes
pytestmark = pytest.mark.usefixtures("jax_quick_compile")

V, O, D = 9, 3, 4
SWAP = {"trace": (1, 0), "diagonal": (1, 0, 2), "full": (1, 0, 3, 2)}


def _ids(rng, n, s, *, everywhere=None):
    """Token ids in [-1, V) with repeats within and across samples, a -1 ("no index") and,
    ``everywhere``, one token at the first position of every sample."""
    ids = rng.integers(-1, V, (n, s))
    ids[0, :3] = [2, 2, -1]
    if everywhere is not None:
        ids[:, 0] = everywhere
    return ids


def _dense(ids, g):
    """The one-hot Jacobian (N, O, D V) in float64: sum_s g[n,s,o,:] (x) e_{i_ns}."""
    one_hot = (ids[..., None] == np.arange(V)).astype(np.float64)
    return np.einsum("nsod,nsv->nodv", g, one_hot).reshape(ids.shape[0], O, D * V)


def _reference(jd1, jd2, mode):
    full = np.einsum("nop,mqp->nmoq", jd1, jd2)
    return {"full": full, "trace": np.einsum("nmoo->nm", full),
            "diagonal": np.einsum("nmoo->nmo", full)}[mode]


def _pairs(ids1, ids2):
    """Matching positions over all sample pairs, M (the route's work)."""
    return int(sum(((a[:, None] == ids2.reshape(-1)[None, :]) & (a[:, None] >= 0)).sum()
                   for a in ids1.reshape(1, -1)))


def _block(backend, ids, g):
    return KroneckerBlock(backend.asarray(ids, "int64"), backend.asarray(g), "emb", one_hot=V)


def _close(backend, k, ref, n):
    k = backend.to_numpy(k)
    assert k.shape == ref.shape
    assert np.max(np.abs(k - ref)) <= kernel_tol("float64", n, computations=2) * np.max(
        np.abs(ref))


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["trace", "diagonal", "full"])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("budget", [None, "chunked"])
def test_pairs_route_matches_dense(monkeypatch, backend, rng, mode, cross, budget):
    """Forced "pairs" on the index block (J2 != J1 with another T, or J against itself),
    next to a dense block, whole and in tiles smaller than N with the pairs in chunks."""
    if backend.name == "jax" and budget is not None:
        pytest.skip("JAX tiles are concatenated: the budget case is covered by the others")
    n1, s, n2, t = 13, 5, 10, 3
    ids1, g1 = _ids(rng, n1, s, everywhere=4), rng.standard_normal((n1, s, O, D))
    ids2, g2 = _ids(rng, n2, t), rng.standard_normal((n2, t, O, D))
    other1, other2 = rng.standard_normal((n1, O, 6)), rng.standard_normal((n2, O, 6))
    j1 = Jacobian([_block(backend, ids1, g1), DenseBlock(backend.asarray(other1), "w")])
    j2 = Jacobian([_block(backend, ids2, g2), DenseBlock(backend.asarray(other2), "w")])
    jd1 = np.concatenate([_dense(ids1, g1), other1], axis=2)
    jd2 = np.concatenate([_dense(ids2, g2), other2], axis=2) if cross else jd1
    ref = _reference(jd1, jd2, mode)
    j2 = j2 if cross else None
    m = _pairs(ids1, ids2 if cross else ids1)
    max_memory = None
    if budget == "chunked":  # the smallest useful tile, and chunks of fewer pairs than a tile
        monkeypatch.setattr(sys.modules["ntkcore.gram"], "PAIRS_MIN_CHUNK", 4)
        with pytest.raises(BudgetTooSmallError) as err:
            plan_gram(j1, j2, mode=mode, max_memory=1, strategy="pairs")
        max_memory = err.value.needed + 2_000
        plan = plan_gram(j1, j2, mode=mode, max_memory=max_memory, strategy="pairs")
        assert plan.tile_rows < n1 and plan.pair_chunk * plan.num_tiles < m, plan
        assert plan.working_bytes <= max_memory
    plan = plan_gram(j1, j2, mode=mode, max_memory=max_memory, strategy="pairs")
    assert plan.strategies == ("pairs", "dense")
    k = _gram(j1, j2, mode=mode, max_memory=max_memory, strategy="pairs")
    _close(backend, k, ref, D * V + 6)
    if not cross:  # a self-kernel stays exactly symmetric
        kn = backend.to_numpy(k)
        np.testing.assert_array_equal(kn, kn.transpose(SWAP[mode]))


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["trace", "diagonal", "full"])
def test_pairs_route_in_row_panels(monkeypatch, backend, rng, mode):
    """A diagonal tile split into row panels: the route computes the tile once (as a
    self-tile) and slices it per panel; exact and exactly symmetric."""
    if backend.name == "jax":
        pytest.skip("no slice assignment: diagonal tiles are never split into panels")
    force_panels(monkeypatch)
    ids, g = _ids(rng, 12, 4, everywhere=0), rng.standard_normal((12, 4, O, D))
    j = Jacobian([_block(backend, ids, g)])
    plan = plan_gram(j, mode=mode, strategy="pairs")
    assert plan.panels > 1
    k = _gram(j, mode=mode, strategy="pairs")
    _close(backend, k, _reference(_dense(ids, g), _dense(ids, g), mode), D * V)
    kn = backend.to_numpy(k)
    np.testing.assert_array_equal(kn, kn.transpose(SWAP[mode]))


def test_planner_counts_the_pairs(backend, rng):
    """The cost model takes the route where few positions match (spread-out tokens) and a
    contraction of all positions where every position matches (one token everywhere); the
    route is offered only with a native scatter-add; the kernel is exact either way."""
    n, s, big = 24, 8, 200
    g = rng.standard_normal((n, s, O, D))
    spread = KroneckerBlock(backend.asarray(rng.integers(0, big, (n, s)), "int64"),
                            backend.asarray(g), "emb", one_hot=big)
    padded = KroneckerBlock(backend.asarray(np.zeros((n, s), dtype=np.int64), "int64"),
                            backend.asarray(g), "emb", one_hot=big)
    fast = get_backend(array_api_compat.array_namespace(spread.g)).fast_scatter_add
    for block, want in ((spread, "pairs"), (padded, None)):
        plan = plan_gram(Jacobian([block]), mode="trace")
        if want == "pairs" and fast:
            assert plan.strategies == ("pairs",)
        else:
            assert plan.strategies[0] != "pairs"
        ids = backend.to_numpy(block.a)
        jd = np.einsum("nsod,nsv->nodv", g, (ids[..., None] == np.arange(big))
                       ).reshape(n, O, D * big)
        _close(backend, gram(Jacobian([block]), mode="trace"),
               _reference(jd, jd, "trace"), D * big)


def test_scatter_add(backend, rng):
    """``Backend.scatter_add`` (native, or the standard's one-hot products) sums the rows of
    x into their cells and drops the ``-1`` rows, in x's dtype."""
    idx = np.array([3, -1, 0, 3, 5, 3, -1, 0])
    x = rng.standard_normal((idx.size, 2))
    ref = np.zeros((6, 2))
    for i, row in zip(idx, x, strict=True):
        if i >= 0:
            ref[i] += row
    xb = backend.asarray(x)
    be = get_backend(array_api_compat.array_namespace(xb))
    out = be.scatter_add(backend.asarray(idx, "int64"), xb, 6)
    assert out.dtype == xb.dtype
    np.testing.assert_allclose(backend.to_numpy(out), ref, rtol=1e-15, atol=1e-15)
