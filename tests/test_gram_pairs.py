"""The index-factor (embedding) routes of ntkcore.gram, "pairs" and "tokens", and the
backends' scatter-add, against dense float64 references: the one-hot Jacobian formed in NumPy
and contracted by einsum, and ``np.add.at``."""

from __future__ import annotations

import sys

import array_api_compat
import numpy as np
import pytest

from ntkcore import DenseBlock, Jacobian, KroneckerBlock, gram, plan_gram
from ntkcore.backend import get_backend
from ntkcore.errors import BudgetTooSmallError
from ntkcore.gram import _gram, _tokens_density
from ntkcore.modes import MODES, Mode, check_mode
from tests.conftest import force_panels
from tests.tolerances import kernel_tol

# many small eager JAX operations of changing shapes: compile them without XLA's passes
pytestmark = pytest.mark.usefixtures("jax_quick_compile")

V, O, D = 9, 3, 4
#: each eager JAX call of a new shape compiles: "tokens" (offered to JAX only when forced)
#: is checked there on one case per test
JAX_TOKENS = "JAX: one 'tokens' case of test_index_route_matches_dense runs"
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
@pytest.mark.parametrize("route", ["pairs", "tokens"])
@pytest.mark.parametrize("mode", ["trace", "diagonal", "full"])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("budget", [None, "chunked"])
def test_index_route_matches_dense(monkeypatch, backend, rng, route, mode, cross, budget):
    """Forced "pairs" or "tokens" on the index block (J2 != J1 with another T, or J against
    itself), next to a dense block, whole and in tiles smaller than N with the pairs (padded
    products) in chunks."""
    if backend.name == "jax" and budget is not None:
        pytest.skip("JAX tiles are concatenated: the budget case is covered by the others")
    if backend.name == "jax" and route == "tokens" and (cross or mode != "full"):
        pytest.skip(JAX_TOKENS)
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
    if route == "tokens":  # padded products of its sparse indices
        a1 = backend.asarray(ids1, "int64")
        xp = array_api_compat.array_namespace(a1)
        m = _tokens_density(xp, a1, backend.asarray(ids2, "int64") if cross else a1,
                            check_mode(mode), O, D)[0] * n1 * (n2 if cross else n1)
    max_memory = None
    if budget == "chunked":  # the smallest useful tile, and chunks of fewer pairs than a tile
        monkeypatch.setattr(sys.modules["ntkcore.gram"], "PAIRS_MIN_CHUNK", 4)
        with pytest.raises(BudgetTooSmallError) as err:
            plan_gram(j1, j2, mode=mode, max_memory=1, strategy=route)
        max_memory = err.value.needed + 2_000
        plan = plan_gram(j1, j2, mode=mode, max_memory=max_memory, strategy=route)
        assert plan.tile_rows < n1 and plan.pair_chunk * plan.num_tiles < m, plan
        assert plan.working_bytes <= max_memory
    plan = plan_gram(j1, j2, mode=mode, max_memory=max_memory, strategy=route)
    assert plan.strategies == (route, "dense")
    k = _gram(j1, j2, mode=mode, max_memory=max_memory, strategy=route)
    _close(backend, k, ref, D * V + 6)
    if not cross:  # a self-kernel stays exactly symmetric
        kn = backend.to_numpy(k)
        np.testing.assert_array_equal(kn, kn.transpose(SWAP[mode]))


@pytest.mark.exactness
@pytest.mark.parametrize("route", ["pairs", "tokens"])
@pytest.mark.parametrize("mode", ["trace", "diagonal", "full"])
def test_index_route_in_row_panels(monkeypatch, backend, rng, route, mode):
    """A diagonal tile split into row panels: the route computes the tile once (as a
    self-tile) and slices it per panel; exact and exactly symmetric."""
    if backend.name == "jax":
        pytest.skip("no slice assignment: diagonal tiles are never split into panels")
    force_panels(monkeypatch)
    ids, g = _ids(rng, 12, 4, everywhere=0), rng.standard_normal((12, 4, O, D))
    j = Jacobian([_block(backend, ids, g)])
    plan = plan_gram(j, mode=mode, strategy=route)
    assert plan.panels > 1
    k = _gram(j, mode=mode, strategy=route)
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


@pytest.mark.exactness
@pytest.mark.parametrize("mode", MODES)
def test_block_products(backend, rng, mode):
    """``Mode.block_products`` (the "tokens" route's batched products), each mode's GEMM form
    and the base class's broadcast pairs, against einsum in float64."""
    k, b1, b2 = 3, 4, 2
    x1, x2 = rng.standard_normal((k, b1, O, D)), rng.standard_normal((k, b2, O, D))
    full = np.einsum("kiod,kjpd->kijop", x1, x2)
    ref = {"full": full.reshape(k, b1, b2, O * O), "trace": np.einsum("kijoo->kij", full)[
        ..., None], "diagonal": np.einsum("kijoo->kijo", full)}[mode]
    m = check_mode(mode)
    xb1, xb2 = (backend.asarray(x.reshape(k, -1, O * D)) for x in (x1, x2))
    xp = array_api_compat.array_namespace(xb1)
    for got in (m.block_products(xp, xb1, xb2, O), Mode.block_products(m, xp, xb1, xb2, O)):
        got = backend.to_numpy(got)
        assert got.shape == ref.shape  # each entry sums O D (trace) or D products
        assert np.max(np.abs(got - ref)) <= kernel_tol("float64", O * D) * np.max(np.abs(ref))


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["trace", "diagonal", "full"])
@pytest.mark.parametrize("cross", [False, True])
def test_tokens_route_dense_and_sparse_indices(backend, rng, mode, cross):
    """The "tokens" route with indices of both kinds: one held by every sample (contracted
    dense) and many rare ones (padded groups), with "no index" positions; exact."""
    if backend.name == "jax":
        pytest.skip("JAX: 'tokens' runs one case of test_index_route_matches_dense")
    n1, s, big = 40, 6, 300
    n2 = 24 if cross else n1
    ids1 = rng.integers(-1, big, (n1, s))
    ids2 = rng.integers(-1, big, (n2, s)) if cross else ids1
    ids1[:, 0] = 7
    ids2[:, 1] = 7
    g1, g2 = rng.standard_normal((n1, s, O, D)), rng.standard_normal((n2, s, O, D))
    b1 = KroneckerBlock(backend.asarray(ids1, "int64"), backend.asarray(g1), "emb", one_hot=big)
    b2 = KroneckerBlock(backend.asarray(ids2, "int64"), backend.asarray(g2), "emb", one_hot=big)
    xp = array_api_compat.array_namespace(b1.g)
    beta, dense = _tokens_density(xp, b1.a, b2.a if cross else b1.a, check_mode(mode), O, D)
    assert dense >= 1 and beta > 0
    j1, j2 = Jacobian([b1]), (Jacobian([b2]) if cross else None)
    k = _gram(j1, j2, mode=mode, strategy="tokens")

    def dense_of(ids, g):
        return np.einsum("nsod,nsv->nodv", g, (ids[..., None] == np.arange(big))
                         ).reshape(ids.shape[0], O, D * big)
    jd1 = dense_of(ids1, g1)
    _close(backend, k, _reference(jd1, dense_of(ids2, g2) if cross else jd1, mode), D * big)


def test_planner_takes_tokens_where_indices_repeat(monkeypatch, backend, rng):
    """Indices that repeat across samples (64 samples of 16 positions over 200 indices): the
    cost model prices "tokens" below "pairs" by its counts, but above once its fixed work
    per tile (``TOKENS_TILE_FLOPS``, 1-2 ms) is charged, as it is at this size; offered only
    with a native scatter-add and cheap eager loops; the kernel is exact."""
    n, s, v, d = 64, 16, 200, 16
    ids = rng.integers(0, v, (n, s))
    g = rng.standard_normal((n, s, O, d))
    block = KroneckerBlock(backend.asarray(ids, "int64"), backend.asarray(g), "emb", one_hot=v)
    be = get_backend(array_api_compat.array_namespace(block.g))
    gram_module = sys.modules["ntkcore.gram"]
    counted = []  # the pairs' passes (10 MFLOP) are below the fixed work: nothing is counted
    monkeypatch.setattr(gram_module, "_tokens_density", lambda *a, _f=_tokens_density:
                        counted.append(1) or _f(*a))
    assert plan_gram(Jacobian([block]), mode="trace").strategies[0] != "tokens"
    assert not counted
    monkeypatch.setattr(gram_module, "TOKENS_TILE_FLOPS", 0)  # part of the plan's key
    plan = plan_gram(Jacobian([block]), mode="trace")
    assert plan.strategies == ("tokens",) if be.fast_scatter_add and be.eager_loops else \
        plan.strategies[0] != "tokens"
    assert counted == ([1] if be.fast_scatter_add and be.eager_loops else [])
    jd = np.einsum("nsod,nsv->nodv", g, (ids[..., None] == np.arange(v))).reshape(n, O, d * v)
    _close(backend, gram(Jacobian([block]), mode="trace"), _reference(jd, jd, "trace"), d * v)


@pytest.mark.parametrize("route", ["pairs", "tokens"])
def test_index_routes_differentiable_in_torch(rng, route):
    """The kernel of an index block is differentiable in g through either route (torch
    autograd through the gathers, GEMMs and scatter-adds): the gradient of <W, K> equals
    the one of the dense one-hot kernel, in float64."""
    torch = pytest.importorskip("torch")
    ids = torch.as_tensor(rng.integers(-1, 30, (20, 6)))
    ids[:, 0] = 3  # a token every sample holds: "tokens" contracts it dense
    g = torch.as_tensor(rng.standard_normal((20, 6, O, D)), dtype=torch.float64)
    g.requires_grad_(True)
    w = torch.as_tensor(rng.standard_normal((20, 20)), dtype=torch.float64)
    k = _gram(Jacobian([KroneckerBlock(ids, g, "emb", one_hot=30)]), mode="trace",
              strategy=route)
    (got,) = torch.autograd.grad((k * w).sum(), g)
    one_hot = (ids[..., None] == torch.arange(30)).to(torch.float64)
    jd = torch.einsum("nsod,nsv->nodv", g, one_hot).reshape(20, -1)
    (want,) = torch.autograd.grad((jd @ jd.T * w).sum(), g)
    # each gradient entry sums 20 weighted kernel rows of at most 6 x 6 pairs of O D terms
    tol = kernel_tol("float64", 20 * 36 * O * D, computations=3)
    assert np.max(np.abs(got.numpy() - want.numpy())) <= tol * np.max(np.abs(want.numpy()))


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
