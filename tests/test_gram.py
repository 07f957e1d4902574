"""Tests of ntkcore.gram: every kernel is compared with an einsum over dense Jacobians.

The dense reference is built here, independently of ``Jacobian.to_dense``:
``J[n, o, i * d_in + j] = sum_s g[n, s, o, i] a[n, s, j]`` and
``Theta[n, m, o, p] = sum_k J1[n, o, k] J2[m, p, k]``, all in float64 NumPy.
"""

from __future__ import annotations

import itertools
import re
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ntkcore
from ntkcore._cache import LRUCache
from ntkcore._memory import DEFAULT_FRACTION, default_budget, parse_memory
from ntkcore.gram import BudgetTooSmallError, _gram, plan_gram
from ntkcore.tiling import panel_bounds
from tests.conftest import force_panels
from tests.tolerances import kernel_tol


def fixture_settings(max_examples: int) -> settings:
    """Settings for hypothesis tests that use the ``backend`` fixture (at most the profile's
    example count)."""
    return settings(max_examples=min(max_examples, settings.default.max_examples),
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow], deadline=None)


# The tile loops are tested on ragged tiles down to one sample with small factors: the
# smallest-useful-tile rule is lifted here (test_budget_below_a_useful_tile tests the rule).
pytestmark = [pytest.mark.usefixtures("tiny_tiles"), pytest.mark.supports("gram", "Jacobian")]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def make_factors(spec, n, rng, positions=None):
    """NumPy factors for a block spec list: ("dense", P) or ("kron", S, d_in, d_out)."""
    o = spec["O"]
    out = []
    for i, b in enumerate(spec["blocks"]):
        if b[0] == "dense":
            out.append(("dense", rng.standard_normal((n, o, b[1]))))
        else:
            s = b[1] if positions is None else positions[i]
            out.append(("kron", rng.standard_normal((n, s, b[2])),
                        rng.standard_normal((n, s, o, b[3]))))
    return out


def dense_blocks(factors):
    """Independent dense per-block Jacobians (N, O, P_b)."""
    res = []
    for f in factors:
        if f[0] == "dense":
            res.append(f[1])
        else:
            a, g = f[1], f[2]
            n, _, o, _ = g.shape
            res.append(np.einsum("nsoi,nsj->noij", g, a).reshape(n, o, -1))
    return res


def reduce_mode(k, mode):
    if mode == "full":
        return k
    if mode == "trace":
        return np.einsum("...nmoo->...nm", k)
    return np.einsum("...nmoo->...nmo", k)


def reference(f1, f2, mode, layerwise=False):
    d1, d2 = dense_blocks(f1), dense_blocks(f2)
    per = np.stack([np.einsum("nok,mpk->nmop", x, y) for x, y in zip(d1, d2, strict=True)])
    k = per if layerwise else per.sum(axis=0)
    return reduce_mode(k, mode)


def to_jacobian(backend, factors, dtype="float64"):
    blocks = []
    for i, f in enumerate(factors):
        if f[0] == "dense":
            blocks.append(ntkcore.DenseBlock(backend.asarray(f[1], dtype), name=f"b{i}"))
        else:
            blocks.append(ntkcore.KroneckerBlock(backend.asarray(f[1], dtype),
                                                 backend.asarray(f[2], dtype), name=f"b{i}"))
    return ntkcore.Jacobian(blocks)


@st.composite
def specs(draw, max_blocks=3):
    blocks = []
    for _ in range(draw(st.integers(1, max_blocks))):
        if draw(st.booleans()):
            blocks.append(("dense", draw(st.integers(1, 7))))
        else:
            blocks.append(("kron", draw(st.sampled_from([1, 1, 2, 3, 5])),
                           draw(st.integers(1, 4)), draw(st.integers(1, 4))))
    return {"O": draw(st.integers(1, 3)), "blocks": blocks}


def limit_jax(backend, mode, allowed=("trace",)):
    """JAX compiles every op for every new shape (about 0.1 s each): run only a subset of the
    parametrisations on it to keep the suite fast."""
    if backend.name == "jax" and mode not in allowed:
        pytest.skip("jax: covered by the trace-mode variant and the fixed-shape tests")


def rel_err(x, ref):
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-300))


# ---------------------------------------------------------------------------------------------
# correctness against the dense einsum
# ---------------------------------------------------------------------------------------------
@fixture_settings(12)
@given(spec=specs(), n1=st.integers(1, 6), n2=st.integers(1, 5),
       mode=st.sampled_from(["full", "trace", "diagonal"]),
       strategy=st.sampled_from([None, "positions", "materialise"]),
       symmetric=st.booleans(), layerwise=st.booleans(),
       max_memory=st.sampled_from([None, 2_000, 20_000]),
       other_positions=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_gram_matches_dense_einsum(backend, spec, n1, n2, mode, strategy, symmetric, layerwise,
                                   max_memory, other_positions, seed):
    if backend.name == "jax":
        pytest.skip("jax compiles every new shape (slow); covered by the fixed-shape tests")
    rng = np.random.default_rng(seed)
    f1 = make_factors(spec, n1, rng)
    j1 = to_jacobian(backend, f1)
    if symmetric:
        f2, j2 = f1, None
    else:
        # Kronecker blocks of J2 may have a different number of positions T
        pos = [b[1] + (1 if other_positions else 0) if b[0] == "kron" else None
               for b in spec["blocks"]]
        f2 = make_factors(spec, n2, rng, positions=pos)
        j2 = to_jacobian(backend, f2)
    try:
        k = _gram(j1, j2, mode=mode, layerwise=layerwise, max_memory=max_memory,
                  strategy=strategy)
    except BudgetTooSmallError as e:  # not even a 1 x 1 tile: the stated budget works
        assert max_memory is not None and e.needed > max_memory
        k = _gram(j1, j2, mode=mode, layerwise=layerwise, max_memory=e.needed,
                  strategy=strategy)
    assert backend.is_native(k)
    ref = reference(f1, f2, mode, layerwise)
    assert tuple(k.shape) == ref.shape
    np.testing.assert_allclose(backend.to_numpy(k), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_public_gram_cross_and_self(backend, rng, mode):
    spec = {"O": 3, "blocks": [("kron", 1, 5, 4), ("kron", 4, 3, 2), ("dense", 6)]}
    f1, f2 = make_factors(spec, 7, rng), make_factors(spec, 4, rng)
    j1, j2 = to_jacobian(backend, f1), to_jacobian(backend, f2)
    np.testing.assert_allclose(backend.to_numpy(ntkcore.gram(j1, j2, mode=mode)),
                               reference(f1, f2, mode), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(ntkcore.gram(j1, mode=mode)),
                               reference(f1, f1, mode), rtol=1e-10, atol=1e-10)


def test_single_block_accepted(rng):
    a, g = rng.standard_normal((4, 2, 3)), rng.standard_normal((4, 2, 2, 5))
    k = ntkcore.gram(ntkcore.KroneckerBlock(a, g), mode="trace")
    np.testing.assert_allclose(k, reference([("kron", a, g)], [("kron", a, g)], "trace"),
                               rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# structure: PSD, symmetry, layerwise sums, tiling, strategies
# ---------------------------------------------------------------------------------------------
def test_psd_and_symmetric(backend, rng):
    limit_jax(backend, "full")
    spec = {"O": 2, "blocks": [("kron", 1, 6, 5), ("kron", 3, 4, 3), ("dense", 5)]}
    f = make_factors(spec, 9, rng)
    j = to_jacobian(backend, f)
    n, o = 9, 2
    for max_memory in (None, 3_000):
        full = backend.to_numpy(ntkcore.gram(j, mode="full", max_memory=max_memory))
        tr = backend.to_numpy(ntkcore.gram(j, mode="trace", max_memory=max_memory))
        assert plan_gram(j, mode="full", max_memory=max_memory).symmetric
        mat = full.transpose(0, 2, 1, 3).reshape(n * o, n * o)
        np.testing.assert_allclose(mat, mat.T, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(tr, tr.T, rtol=1e-12, atol=1e-12)
        scale = np.abs(mat).max()
        assert np.linalg.eigvalsh((mat + mat.T) / 2).min() > -1e-10 * scale
        assert np.linalg.eigvalsh((tr + tr.T) / 2).min() > -1e-10 * np.abs(tr).max()


@pytest.mark.exactness
def test_symmetric_tiles_are_mirrored_exactly(rng):
    spec = {"O": 2, "blocks": [("kron", 2, 3, 3), ("dense", 4)]}
    j = to_jacobian_np(make_factors(spec, 11, rng))
    k = ntkcore.gram(j, mode="full", max_memory=4_000)
    plan = plan_gram(j, mode="full", max_memory=4_000)
    assert plan.tile_rows < 11 and plan.num_tiles < (-(-11 // plan.tile_rows)) ** 2
    r = plan.tile_rows
    # an off-diagonal tile and its mirror image agree bit for bit
    np.testing.assert_array_equal(k[:r, r:], k[r:, :r].transpose(1, 0, 3, 2))


SWAP = {"trace": (1, 0), "diagonal": (1, 0, 2), "full": (1, 0, 3, 2)}


@pytest.mark.exactness
@pytest.mark.parametrize("panels", [False, True])
@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_self_kernel_exactly_symmetric(monkeypatch, backend, rng, mode, layerwise, panels):
    """``gram(J)`` is symmetric bit for bit, ``K[n,m,o,p] == K[m,n,p,o]``, for both Kronecker
    strategies, whole, tiled and with diagonal tiles in row panels (the "positions"
    contraction of a diagonal tile alone is symmetric only up to rounding)."""
    limit_jax(backend, mode)

    if panels:
        if backend.name == "jax":
            pytest.skip("no slice assignment: diagonal tiles are never split into panels")
        force_panels(monkeypatch)
    spec = {"O": 3, "blocks": [("kron", 4, 5, 3), ("kron", 1, 3, 4), ("dense", 4)]}
    f = make_factors(spec, 13, rng)
    j = to_jacobian(backend, f)
    ref = reference(f, f, mode, layerwise=layerwise)
    swap = SWAP[mode] if not layerwise else (0, *(a + 1 for a in SWAP[mode]))
    for budget in (None, 12_000) if backend.name != "jax" else (None,):
        for strategy in ("positions", "materialise"):
            k = backend.to_numpy(_gram(j, mode=mode, layerwise=layerwise, max_memory=budget,
                                       strategy=strategy))
            np.testing.assert_array_equal(k, k.transpose(swap))
            np.testing.assert_allclose(k, ref, rtol=1e-10, atol=1e-10)
    if backend.name != "jax":  # larger float32 GEMMs (vectorised kernels, several threads)
        j32 = to_jacobian(backend, make_factors(spec, 150, rng), "float32")
        for strategy in ("positions", "materialise"):
            k = backend.to_numpy(_gram(j32, mode=mode, layerwise=layerwise, strategy=strategy))
            np.testing.assert_array_equal(k, k.transpose(swap))


def to_jacobian_np(factors):
    from tests.conftest import make_case

    return to_jacobian(make_case("numpy"), factors)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_layerwise_sums_to_total(backend, rng, mode):
    limit_jax(backend, mode)
    spec = {"O": 2, "blocks": [("kron", 1, 4, 3), ("dense", 5), ("kron", 3, 2, 3)]}
    f1, f2 = make_factors(spec, 5, rng), make_factors(spec, 3, rng)
    j1, j2 = to_jacobian(backend, f1), to_jacobian(backend, f2)
    for jj in (None, j2):
        lw = backend.to_numpy(ntkcore.gram(j1, jj, mode=mode, layerwise=True))
        tot = backend.to_numpy(ntkcore.gram(j1, jj, mode=mode))
        assert lw.shape == (3, *tot.shape)
        np.testing.assert_allclose(lw.sum(axis=0), tot, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lw, reference(f1, f1 if jj is None else f2, mode,
                                                 layerwise=True), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_tiled_equals_untiled(backend, rng, mode, symmetric):
    limit_jax(backend, mode)
    spec = {"O": 2, "blocks": [("kron", 1, 4, 3), ("kron", 3, 3, 2), ("dense", 4)]}
    f1, f2 = make_factors(spec, 10, rng), make_factors(spec, 7, rng)
    j1 = to_jacobian(backend, f1)
    j2 = None if symmetric else to_jacobian(backend, f2)
    whole = backend.to_numpy(ntkcore.gram(j1, j2, mode=mode))
    assert plan_gram(j1, j2, mode=mode).num_tiles == 1
    for budget in (1_500, "6kB") if backend.name != "jax" else ("6kB",):
        plan = plan_gram(j1, j2, mode=mode, max_memory=budget)
        assert plan.num_tiles > 1
        tiled = backend.to_numpy(ntkcore.gram(j1, j2, mode=mode, max_memory=budget))
        np.testing.assert_allclose(tiled, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_kronecker_strategies_agree(backend, rng, mode):
    limit_jax(backend, mode)
    spec = {"O": 3, "blocks": [("kron", 4, 5, 3), ("kron", 1, 3, 4)]}
    f1 = make_factors(spec, 6, rng)
    f2 = make_factors(spec, 5, rng, positions=[7, 1])
    j1, j2 = to_jacobian(backend, f1), to_jacobian(backend, f2)
    for jj, ff in ((None, f1), (j2, f2)) if backend.name != "jax" else ((j2, f2),):
        pos = _gram(j1, jj, mode=mode, strategy="positions")
        mat = _gram(j1, jj, mode=mode, strategy="materialise")
        assert plan_gram(j1, jj, mode=mode, strategy="positions").strategies == ("positions",
                                                                                   "kron1")
        assert plan_gram(j1, jj, mode=mode, strategy="materialise").strategies == (
            "materialise", "materialise")
        np.testing.assert_allclose(backend.to_numpy(pos), backend.to_numpy(mat), rtol=1e-11,
                                   atol=1e-11)
        np.testing.assert_allclose(backend.to_numpy(pos), reference(f1, ff, mode), rtol=1e-10,
                                   atol=1e-10)


def test_materialise_slab_bounds():
    """Slabs of d_out rows: as many rows as fit the limit, one at least, all without one,
    in the fewest slabs of balanced sizes."""
    slabs = type(sys.modules["ntkcore.gram"].ROUTES["materialise"]).slabs
    assert slabs(5, 10, 25) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert slabs(5, 10, 3) == [slice(i, i + 1) for i in range(5)]
    assert slabs(5, 10, None) == slabs(5, 10, 50) == [slice(0, 5)]
    # a least number of rows above the limit's (MIN_SLAB_GEMM_ROWS), never above d_out
    assert slabs(5, 10, 3, least=2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert slabs(5, 10, 25, least=9) == [slice(0, 5)]
    # balanced: 64 rows in slabs of at most 26 are 22, 21, 21 (not 26, 26, 12)
    assert slabs(64, 1, 26) == [slice(0, 22), slice(22, 43), slice(43, 64)]
    assert slabs(7, 1, 2) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]


def test_materialise_slabs_have_least_gemm_rows():
    """A limit that admits a few rows of weights still forms at least MIN_SLAB_GEMM_ROWS / O
    rows at a time (products of a few GEMM rows re-read all of ``a`` per slab), and up to
    PREFERRED_SLAB_GEMM_ROWS / O where those take at most SLAB_CAP_FACTOR times the limit; a
    limit that admits more keeps its own."""
    from types import SimpleNamespace

    gram_module = sys.modules["ntkcore.gram"]
    route = gram_module.ROUTES["materialise"]
    limit = 2 << 20  # elements: 8 MB of float32
    least, preferred = gram_module.MIN_SLAB_GEMM_ROWS, gram_module.PREFERRED_SLAB_GEMM_ROWS
    cap = gram_module.SLAB_CAP_FACTOR * limit
    cases = {  # (O, r, d_in): d_out rows a slab (768 rows in all)
        (2, 72, 3073): 32,  # least: 64 GEMM rows (the limit: 4, the cap: 18)
        (10, 32, 4609): 7,  # least (the cap: 5)
        (1, 72, 3073): 64,  # least (the cap: 37)
        (2, 8, 385): 340,  # the limit's own, above the preferred 128
        (2, 32, 385): 128,  # preferred: 256 GEMM rows within the cap (the limit: 85)
        (10, 16, 577): 26,  # preferred, 260 GEMM rows (the limit: 22)
        (2, 64, 1093): 59,  # the cap, between least and preferred (the limit: 14)
    }
    for (o, r, d_in), expected in cases.items():
        block = SimpleNamespace(d_out=768, d_in=d_in, num_outputs=o)
        pair = gram_module._Pair("w", block, block, True)
        slabs = route._slabs_of(pair, r, gram_module._Context(None, 0, limit))
        rows = [sl.stop - sl.start for sl in slabs]
        width = r * o * d_in
        by_limit = limit // width
        formula = min(768, max(-(-least // o), min(-(-preferred // o), cap // width), by_limit,
                               1))
        assert formula == expected, (o, r, d_in)
        # the fewest slabs of at most that many rows, balanced, the widest first
        assert len(slabs) == -(-768 // expected) and max(rows) <= expected
        assert rows == sorted(rows, reverse=True) and rows[0] - rows[-1] <= 1
        assert (expected * width <= cap) or expected in (-(-least // o), by_limit)
        assert slabs[0].start == 0 and slabs[-1].stop == 768
        assert all(a.stop == b.start for a, b in itertools.pairwise(slabs))
    # no transient limit (a GPU): one slab of all rows
    whole = route._slabs_of(pair, 48, gram_module._Context(None, 0, None))
    assert whole == [slice(0, 768)]


@pytest.mark.parametrize("panels", [False, True])
@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_materialise_in_slabs(monkeypatch, backend, rng, mode, panels):
    """Per-sample weights formed a few rows of d_out at a time (host memory:
    ``Backend.transient_bytes``) give the float64 reference, self and cross, in panels, with
    an index factor; every slab's weights stay within the limit."""
    limit_jax(backend, mode)
    if panels:
        if backend.name == "jax":
            pytest.skip("no slice assignment: diagonal tiles are never split into panels")
        force_panels(monkeypatch)
    gram_module = sys.modules["ntkcore.gram"]
    route = type(gram_module.ROUTES["materialise"])
    spec = {"O": 2, "blocks": [("kron", 3, 4, 5), ("kron", 2, 3, 7)]}
    f1, f2 = make_factors(spec, 6, rng), make_factors(spec, 4, rng, positions=[5, 1])
    j1, j2 = to_jacobian(backend, f1), to_jacobian(backend, f2)
    rows = 2  # d_out rows per slab: 6 samples x 2 outputs x 4 (or 3) inputs x 2 rows
    limit = 6 * 2 * 4 * rows * 8
    # every backend, GPUs included (which have no limit of their own)
    monkeypatch.setattr(sys.modules["ntkcore.backend"].Backend, "transient_bytes",
                        lambda self, device: limit)
    monkeypatch.setattr(gram_module, "MIN_SLAB_GEMM_ROWS", 1)
    monkeypatch.setattr(gram_module, "PREFERRED_SLAB_GEMM_ROWS", 1)  # the limit's slabs alone
    seen, flat = [], []
    weights, flat_weights = route._weights, route._flat_weights

    def spy(xp, ag, slab, **kwargs):
        seen.append(slab.stop - slab.start)
        return weights(xp, ag, slab, **kwargs)

    def flat_spy(xp, af, rows_, **kwargs):
        flat.append(rows_.stop - rows_.start)
        return flat_weights(xp, af, rows_, **kwargs)

    monkeypatch.setattr(route, "_weights", staticmethod(spy))
    monkeypatch.setattr(route, "_flat_weights", staticmethod(flat_spy))
    for jj, ff in ((None, f1), (j2, f2)):
        k = _gram(j1, jj, mode=mode, strategy="materialise")
        np.testing.assert_allclose(backend.to_numpy(k), reference(f1, ff, mode), rtol=1e-10,
                                   atol=1e-10)
    if mode == "trace":  # flat rows of (o, d): O = 2 times the d_out rows, views of g
        assert flat and max(flat) <= 2 * rows and 2 in flat and not seen
    else:
        assert seen and max(seen) <= rows and 1 in seen and not flat  # remainders of one


@pytest.mark.parametrize("layout", ["contiguous", "channels_first", "unflattenable"])
def test_materialise_flat_slabs_of_any_layout(monkeypatch, rng, layout):
    """Trace mode forms a slab's weights from flat rows of g (O d_out) where g's O and d_out
    axes merge into a view (contiguous, channels-first), and from d_out rows where they do not
    (a g whose d_out axis is outermost); either gives the float64 reference, in slabs."""
    torch = pytest.importorskip("torch")
    gram_module = sys.modules["ntkcore.gram"]
    route = type(gram_module.ROUTES["materialise"])
    n, s, o, din, dout = 6, 5, 3, 4, 7
    a = rng.standard_normal((n, s, din))
    g = rng.standard_normal((n, s, o, dout))
    tg = torch.from_numpy(g)
    if layout == "channels_first":  # stored (N, O, d_out, S)
        tg = tg.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    elif layout == "unflattenable":  # stored (d_out, N, S, O): O and d_out do not merge
        tg = tg.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    assert torch.equal(tg, torch.from_numpy(g))
    j = ntkcore.Jacobian([ntkcore.KroneckerBlock(torch.from_numpy(a), tg)])
    monkeypatch.setattr(sys.modules["ntkcore.backend"].Backend, "transient_bytes",
                        lambda self, device: n * o * din * 2 * 8)  # two d_out rows a slab
    monkeypatch.setattr(gram_module, "MIN_SLAB_GEMM_ROWS", 1)
    monkeypatch.setattr(gram_module, "PREFERRED_SLAB_GEMM_ROWS", 1)
    calls = {"flat": 0, "rows": 0}
    weights, flat_weights = route._weights, route._flat_weights

    def spy(*args, **kwargs):
        calls["rows"] += 1
        return weights(*args, **kwargs)

    def flat_spy(*args, **kwargs):
        calls["flat"] += 1
        return flat_weights(*args, **kwargs)

    monkeypatch.setattr(route, "_weights", staticmethod(spy))
    monkeypatch.setattr(route, "_flat_weights", staticmethod(flat_spy))
    k = _gram(j, mode="trace", strategy="materialise").numpy()
    w = np.einsum("nsod,nsi->nodi", g, a).reshape(n, -1)
    np.testing.assert_allclose(k, w @ w.T, rtol=1e-12, atol=1e-12 * np.abs(w @ w.T).max())
    flat_taken = layout != "unflattenable"
    assert calls == ({"flat": 4, "rows": 0} if flat_taken else {"flat": 0, "rows": 4})


def test_cost_model_picks_the_cheaper_strategy(rng):
    n = 16
    # few positions, wide layer: contracting positions is far cheaper
    few = ntkcore.KroneckerBlock(rng.standard_normal((n, 2, 64)),
                                 rng.standard_normal((n, 2, 1, 64)))
    # many positions, narrow layer: materialising the 4 x 4 weights is cheaper
    many = ntkcore.KroneckerBlock(rng.standard_normal((n, 64, 4)),
                                  rng.standard_normal((n, 64, 1, 4)))
    for mode in ("full", "trace", "diagonal"):
        assert plan_gram(few, mode=mode).strategies == ("positions",)
        assert plan_gram(many, mode=mode).strategies == ("materialise",)
        pos = plan_gram(few, mode=mode, strategy="positions").flops
        mat = plan_gram(few, mode=mode, strategy="materialise").flops
        assert pos < mat
    # a dense layer (S = 1) always takes the Hadamard-product path
    dense_layer = ntkcore.KroneckerBlock(rng.standard_normal((n, 1, 8)),
                                         rng.standard_normal((n, 1, 3, 8)))
    assert plan_gram(dense_layer, mode="full").strategies == ("kron1",)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_working_memory_within_budget(rng, mode, small_ufunc_buffers):
    """NumPy allocations are traced: peak beyond inputs and output stays under max_memory."""
    spec = {"O": 2, "blocks": [("kron", 1, 16, 12), ("kron", 4, 8, 6), ("dense", 30)]}
    f = make_factors(spec, 60, rng)
    j = to_jacobian_np(f)
    budget = 200_000
    for strategy in ("positions", "materialise"):
        for lw in (False, True):
            plan = plan_gram(j, mode=mode, max_memory=budget, strategy=strategy, layerwise=lw)
            assert plan.num_tiles > 1 and plan.working_bytes <= budget
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                k = _gram(j, mode=mode, max_memory=budget, strategy=strategy, layerwise=lw)
                peak = tracemalloc.get_traced_memory()[1] - base
            finally:
                tracemalloc.stop()
            assert peak - k.nbytes <= budget, (strategy, lw, peak - k.nbytes)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_materialise_plan_charges_one_slab_of_weights(monkeypatch, rng, mode, small_ufunc_buffers):
    """Where the backend forms transients in slabs, the planner charges the materialise route
    one slab of per-sample weights a side, not all of them: one tile within a budget that
    held only small tiles of whole weights, the traced peak (NumPy) still within it, and the
    kernel the float64 reference's."""
    gram_module = sys.modules["ntkcore.gram"]
    backend_cls = sys.modules["ntkcore.backend"].Backend
    monkeypatch.setattr(gram_module, "MIN_SLAB_GEMM_ROWS", 1)
    monkeypatch.setattr(gram_module, "PREFERRED_SLAB_GEMM_ROWS", 1)
    spec = {"O": 2, "blocks": [("kron", 4, 24, 32)]}  # 768 weights an output and sample
    f = make_factors(spec, 60, rng)
    j = to_jacobian_np(f)
    budget = 700_000  # the factor slices of all 60 samples, and a slab's weights
    monkeypatch.setattr(backend_cls, "transient_bytes", lambda self, device: None)
    whole = plan_gram(j, mode=mode, max_memory=budget, strategy="materialise")
    limit = 16_000  # bytes: one row of d_out a slab at 60 samples (2 x 24 x 60 x 8 bytes)
    monkeypatch.setattr(backend_cls, "transient_bytes", lambda self, device: limit)
    slabbed = plan_gram(j, mode=mode, max_memory=budget, strategy="materialise")
    assert whole.num_tiles > 1 and slabbed.num_tiles == 1
    assert slabbed.working_bytes <= budget < 60 * 2 * 768 * 8  # all weights of one side
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        k = _gram(j, mode=mode, max_memory=budget, strategy="materialise")
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak - k.nbytes <= budget
    np.testing.assert_allclose(k, reference(f, f, mode), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------
def abs_factors(factors):
    return [tuple(x if isinstance(x, str) else np.abs(x) for x in f) for f in factors]


def expanded_terms(spec, mode):
    """How many products one kernel entry sums, expanded to scalars: per output pair, a dense
    block sums P_b, a Kronecker block S^2 d_in d_out (every pair of positions); trace sums O
    output pairs."""
    per_pair = sum(b[1] if b[0] == "dense" else b[1] ** 2 * b[2] * b[3] for b in spec["blocks"])
    return per_pair * (spec["O"] if mode == "trace" else 1)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_float32_within_derived_bound(backend, rng, mode):
    """Entrywise ``|K - K_ref| <= gamma_n K_abs``: n the products summed per entry (+3 for
    the multiplications of a Kronecker pair), ``K_abs`` the kernel of the factors' absolute
    values; valid for every summation order, strategy and tiling (tests/tolerances.py)."""
    limit_jax(backend, mode)
    spec = {"O": 2, "blocks": [("kron", 1, 16, 8), ("kron", 3, 6, 4), ("dense", 12)]}
    f1, f2 = make_factors(spec, 8, rng), make_factors(spec, 5, rng)
    # reference from the float32-rounded inputs, in float64
    f1 = [tuple(x if isinstance(x, str) else x.astype(np.float32).astype(np.float64)
                for x in f) for f in f1]
    f2 = [tuple(x if isinstance(x, str) else x.astype(np.float32).astype(np.float64)
                for x in f) for f in f2]
    j1, j2 = to_jacobian(backend, f1, "float32"), to_jacobian(backend, f2, "float32")
    ref = reference(f1, f2, mode)
    bound = reference(abs_factors(f1), abs_factors(f2), mode)
    n = expanded_terms(spec, mode) + 3
    k32 = ntkcore.gram(j1, j2, mode=mode)
    assert backend.to_numpy(k32).dtype == np.float32
    err = np.abs(backend.to_numpy(k32) - ref)
    # the output rounding to float32 (u |K|) is within gamma_n K_abs too
    assert np.all(err <= kernel_tol(np.float32, n) * bound), np.max(err / bound)
    k64 = ntkcore.gram(j1, j2, mode=mode, dtype=backend.xp.float64)
    assert backend.to_numpy(k64).dtype == np.float64
    assert np.all(np.abs(backend.to_numpy(k64) - ref) <= kernel_tol(np.float64, n) * bound)
    if backend.name != "jax":  # tiled, with casts tile by tile
        k64s = ntkcore.gram(j1, j2, mode=mode, dtype="float64", max_memory=4_000)
        assert np.all(np.abs(backend.to_numpy(k64s) - ref) <= kernel_tol(np.float64, n) * bound)


# ---------------------------------------------------------------------------------------------
# progress reporting
# ---------------------------------------------------------------------------------------------
def test_progress_callback_called_per_tile(rng):
    spec = {"O": 1, "blocks": [("kron", 1, 5, 5)]}
    j = to_jacobian_np(make_factors(spec, 12, rng))
    for j2 in (None, to_jacobian_np(make_factors(spec, 9, rng))):
        calls: list[tuple[int, int]] = []
        plan = plan_gram(j, j2, mode="trace", max_memory=1_000)
        ntkcore.gram(j, j2, mode="trace", max_memory=1_000,
                     progress=lambda done, total, calls=calls: calls.append((done, total)))
        assert plan.num_tiles > 1
        assert calls == [(i + 1, plan.num_tiles) for i in range(plan.num_tiles)]


def test_progress_tqdm_bar(rng, capsys):
    pytest.importorskip("tqdm")
    spec = {"O": 1, "blocks": [("dense", 5)]}
    j = to_jacobian_np(make_factors(spec, 6, rng))
    ntkcore.gram(j, mode="trace", progress=True)
    ntkcore.gram(j, mode="trace", progress="tqdm")
    assert "tile" in capsys.readouterr().err


@pytest.mark.parametrize("progress", [True, "tqdm"])
def test_progress_bar_without_tqdm_names_the_install(monkeypatch, rng, progress):
    """Without tqdm, a progress bar is an ImportError that says what to install (not a bare
    ModuleNotFoundError from inside gram)."""
    import sys

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # ``import tqdm.auto`` now fails
    j = to_jacobian_np(make_factors({"O": 1, "blocks": [("dense", 5)]}, 6, rng))
    with pytest.raises(ImportError, match=r'pip install "ntkcore\[bench\]" or pip install tqdm'):
        ntkcore.gram(j, mode="trace", progress=progress)


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
def test_validation_errors(rng):
    spec = {"O": 2, "blocks": [("kron", 2, 3, 4), ("dense", 5)]}
    f = make_factors(spec, 4, rng)
    j = to_jacobian_np(f)
    with pytest.raises(ValueError, match="mode"):
        ntkcore.gram(j, mode="sum")
    with pytest.raises(TypeError, match="layerwise"):
        ntkcore.gram(j, layerwise="yes")
    with pytest.raises(TypeError, match="J1"):
        ntkcore.gram(np.ones((3, 2, 4)))
    with pytest.raises(TypeError, match="J2"):
        ntkcore.gram(j, np.ones((3, 2, 4)))
    with pytest.raises(ValueError, match="max_memory"):
        ntkcore.gram(j, max_memory="lots")
    with pytest.raises(ValueError, match="max_memory"):
        ntkcore.gram(j, max_memory=-5)
    with pytest.raises(TypeError, match="dtype"):
        ntkcore.gram(j, dtype=np.int64)
    with pytest.raises(ValueError, match="dtype"):
        ntkcore.gram(j, dtype="float99")
    with pytest.raises(TypeError, match="progress"):
        ntkcore.gram(j, progress=3)
    with pytest.raises(ValueError, match="strategy"):
        plan_gram(j, strategy="magic")

    a, g = f[0][1], f[0][2]
    other_names = ntkcore.Jacobian([ntkcore.KroneckerBlock(a, g, name="b0"),
                                    ntkcore.DenseBlock(f[1][1], name="fc")])
    with pytest.raises(ValueError, match="'b1'"):
        ntkcore.gram(j, other_names)
    kinds = ntkcore.Jacobian([ntkcore.DenseBlock(np.ones((3, 2, 12)), name="b0"),
                              ntkcore.DenseBlock(np.ones((3, 2, 5)), name="b1")])
    with pytest.raises(ValueError, match=r"'b0'.*KroneckerBlock.*DenseBlock"):
        ntkcore.gram(j, kinds)
    shapes = ntkcore.Jacobian([ntkcore.KroneckerBlock(np.ones((3, 2, 4)), np.ones((3, 2, 2, 3)),
                                                      name="b0"),
                               ntkcore.DenseBlock(np.ones((3, 2, 5)), name="b1")])
    with pytest.raises(ValueError, match=r"'b0'.*d_in"):
        ntkcore.gram(j, shapes)
    params = ntkcore.Jacobian([ntkcore.KroneckerBlock(a[:3], g[:3], name="b0"),
                               ntkcore.DenseBlock(np.ones((3, 2, 6)), name="b1")])
    with pytest.raises(ValueError, match=r"'b1'.*P_b"):
        ntkcore.gram(j, params)
    outputs = ntkcore.Jacobian([ntkcore.KroneckerBlock(a[:, :, :1], g[..., :1, :], name="b0")])
    with pytest.raises(ValueError, match="O="):
        ntkcore.gram(ntkcore.Jacobian([j.blocks[0]]), outputs)
    with pytest.raises(ValueError, match="blocks"):
        ntkcore.gram(j, ntkcore.Jacobian([j.blocks[0]]))


def test_mixed_libraries_rejected(rng):
    torch = pytest.importorskip("torch")
    j = to_jacobian_np(make_factors({"O": 1, "blocks": [("dense", 3)]}, 3, rng))
    jt = ntkcore.Jacobian([ntkcore.DenseBlock(torch.ones((2, 1, 3), dtype=torch.float64),
                                              name="b0")])
    with pytest.raises(TypeError, match="J2"):
        ntkcore.gram(j, jt)


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_budget_below_a_useful_tile(monkeypatch, rng, mode, layerwise):
    """A budget that cannot hold a min(N, 8) x min(N, 8) tile raises at once, naming
    max_memory, quoting the value given and stating the smallest budget; that budget works,
    with tiles of at least min(N, 8) samples a side (it used to warn and run 1 x 1 tiles)."""
    import sys

    gram_module = sys.modules["ntkcore.gram"]
    monkeypatch.setattr(gram_module, "MIN_TILE_SAMPLES", 8)
    tiles = []  # no route contracts a tile before the budget is checked
    for route in gram_module.ROUTES.values():
        monkeypatch.setattr(route, "tile", lambda *a, _t=route.tile, **k:
                            tiles.append(1) or _t(*a, **k))
    spec = {"O": 2, "blocks": [("kron", 3, 6, 5), ("kron", 1, 4, 3), ("dense", 7)]}
    for n1, n2 in ((40, None), (40, 5), (3, 30)):
        f1 = make_factors(spec, n1, rng)
        f2 = None if n2 is None else make_factors(spec, n2, rng)
        j1 = to_jacobian_np(f1)
        j2 = None if f2 is None else to_jacobian_np(f2)
        tiles.clear()
        with pytest.raises(ValueError, match=r"max_memory='1kB' \(1000 bytes\)") as info:
            ntkcore.gram(j1, j2, mode=mode, layerwise=layerwise, max_memory="1kB")
        assert not tiles
        need = int(re.search(r"max_memory >= (\d+) bytes", str(info.value)).group(1))
        assert need > 1000 and info.value.needed == need
        with pytest.raises(ValueError, match=f"max_memory >= {need} bytes"):
            ntkcore.gram(j1, j2, mode=mode, layerwise=layerwise, max_memory=need - 1)
        with pytest.raises(ValueError, match="max_memory"):
            plan_gram(j1, j2, mode=mode, layerwise=layerwise, max_memory=need - 1)
        plan = plan_gram(j1, j2, mode=mode, layerwise=layerwise, max_memory=need)
        m2 = n1 if n2 is None else n2
        assert plan.tile_rows >= min(n1, 8) and plan.tile_cols >= min(m2, 8)
        assert plan.working_bytes <= need
        k = ntkcore.gram(j1, j2, mode=mode, layerwise=layerwise, max_memory=need)
        assert tiles  # the counter sees tiles where they are computed
        np.testing.assert_allclose(k, reference(f1, f1 if f2 is None else f2, mode,
                                                layerwise=layerwise), rtol=1e-10, atol=1e-10)
        # the same number from the shapes alone (what ntk() checks before any factor)
        shapes = gram_module.block_shapes(j1)
        assert gram_module.min_budget(shapes, num_outputs=2, n1=n1, n2=m2, mode=mode,
                                      layerwise=layerwise) == need


def test_inputs_not_mutated(rng):
    spec = {"O": 2, "blocks": [("kron", 2, 3, 3), ("dense", 4)]}
    f = make_factors(spec, 5, rng)
    copies = [tuple(x.copy() if not isinstance(x, str) else x for x in b) for b in f]
    j = to_jacobian_np(f)
    ntkcore.gram(j, mode="full", max_memory=2_000, dtype="float32")
    for b, c in zip(f, copies, strict=True):
        for x, y in zip(b[1:], c[1:], strict=True):
            np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------------------------------------
# autograd (KIP-style: gradients flow through the kernel into the factors)
# ---------------------------------------------------------------------------------------------
def test_torch_gradient_through_gram(rng):
    torch = pytest.importorskip("torch")
    a = torch.tensor(rng.standard_normal((5, 3, 4)), requires_grad=True)
    g = torch.tensor(rng.standard_normal((5, 3, 2, 3)))
    j = ntkcore.Jacobian([ntkcore.KroneckerBlock(a, g)])
    loss = (ntkcore.gram(j, mode="full", max_memory=3_000) ** 2).sum()
    (grad,) = torch.autograd.grad(loss, a)
    a2 = a.detach().clone().requires_grad_(True)
    dense = torch.einsum("nsoi,nsj->noij", g, a2).reshape(5, 2, -1)
    ref_loss = (torch.einsum("nok,mpk->nmop", dense, dense) ** 2).sum()
    (ref,) = torch.autograd.grad(ref_loss, a2)
    np.testing.assert_allclose(grad.numpy(), ref.numpy(), rtol=1e-10)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_torch_gradient_through_row_panels(monkeypatch, rng, mode):
    """Autograd through the in-place Hadamard products, panel sums and mirrored writes
    agrees with autograd through the dense einsum."""
    torch = pytest.importorskip("torch")

    force_panels(monkeypatch, rows=2)
    a = torch.tensor(rng.standard_normal((9, 1, 4)), requires_grad=True)
    g = torch.tensor(rng.standard_normal((9, 1, 2, 3)), requires_grad=True)
    j = ntkcore.Jacobian([ntkcore.KroneckerBlock(a, g)])
    assert plan_gram(j, mode=mode).panels > 1
    w = torch.tensor(rng.standard_normal(ntkcore.gram(j, mode=mode).shape))
    grads = torch.autograd.grad((ntkcore.gram(j, mode=mode) * w).sum(), (a, g))
    a2, g2 = (t.detach().clone().requires_grad_(True) for t in (a, g))
    dense = torch.einsum("nsoi,nsj->noij", g2, a2).reshape(9, 2, -1)
    k = torch.einsum("nok,mpk->nmop", dense, dense)
    k = {"full": k, "trace": torch.einsum("nmoo->nm", k),
         "diagonal": torch.einsum("nmoo->nmo", k)}[mode]
    refs = torch.autograd.grad((k * w).sum(), (a2, g2))
    for got, ref in zip(grads, refs, strict=True):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# memory budgets
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "nbytes"), [
    ("2GB", 2 * 10**9), ("2 gb", 2 * 10**9), ("1.5GiB", int(1.5 * 2**30)), ("512MiB", 512 << 20),
    ("512M", 512 * 10**6), ("100kB", 100_000), ("3KiB", 3072), ("1e9", 10**9), ("64B", 64),
    ("1T", 10**12), (12345, 12345), (2.5e6, 2_500_000),
])
def test_parse_memory(text, nbytes):
    assert parse_memory(text) == nbytes


@pytest.mark.parametrize("bad", ["", "GB", "2 parsecs", "-1GB", "0", 0, -3, float("nan"),
                                 float("inf"), "1e999"])
def test_parse_memory_rejects(bad):
    with pytest.raises(ValueError, match="max_memory"):
        parse_memory(bad)


@pytest.mark.parametrize("bad", [None, True, [1], object()])
def test_parse_memory_type_errors(bad):
    with pytest.raises(TypeError, match="budget"):
        parse_memory(bad, "budget")


def test_default_budget():
    class Known:
        def free_memory(self, device):
            return 8 * 2**30

    class Unknown:
        def free_memory(self, device):
            return None

    assert default_budget(Known(), None) == int(8 * 2**30 * DEFAULT_FRACTION)
    assert default_budget(Unknown(), None) == 1 << 30
    assert default_budget(Known(), None, fraction=0.5) == 4 * 2**30


def test_jax_grad_and_jit_through_gram(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    a = jnp.asarray(rng.standard_normal((5, 3, 4)))
    g = jnp.asarray(rng.standard_normal((5, 3, 2, 3)))

    def loss(a_, g_):  # only a_ is traced under grad: g_ stays a concrete array
        j = ntkcore.Jacobian([ntkcore.KroneckerBlock(a_, g_)])
        return jnp.sum(ntkcore.gram(j, mode="full", max_memory=3_000) ** 2)

    def dense_loss(a_, g_):
        d = jnp.einsum("nsoi,nsj->noij", g_, a_).reshape(5, 2, -1)
        return jnp.sum(jnp.einsum("nok,mpk->nmop", d, d) ** 2)

    grad = jax.jit(jax.grad(loss))(a, g)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(jax.grad(dense_loss)(a, g)),
                               rtol=1e-10)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_symmetric_self_products(backend, rng, mode):
    """The symmetric self-products (``x @ x.T`` on one tile) give the dense kernel."""
    limit_jax(backend, mode)
    spec = {"O": 2, "blocks": [("kron", 1, 5, 4), ("kron", 2, 3, 2), ("dense", 3)]}
    f = make_factors(spec, 6, rng)
    j = to_jacobian(backend, f)
    for strategy in ("positions", "materialise"):
        k = _gram(j, mode=mode, strategy=strategy)
        np.testing.assert_allclose(backend.to_numpy(k), reference(f, f, mode), rtol=1e-10,
                                   atol=1e-10)


@pytest.mark.exactness
@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_diagonal_tiles_in_row_panels(monkeypatch, backend, rng, mode, layerwise):
    """Diagonal tiles computed as row panels (upper part mirrored) give the dense kernel,
    with and without budget tiling, and the plan counts the panels' smaller work."""
    limit_jax(backend, mode)

    gram_module = force_panels(monkeypatch)
    spec = {"O": 2, "blocks": [("kron", 1, 4, 3), ("kron", 3, 3, 2), ("dense", 4)]}
    f = make_factors(spec, 13, rng)
    j = to_jacobian(backend, f)
    ref = reference(f, f, mode, layerwise=layerwise)
    for budget in (None, 12_000):
        plan = plan_gram(j, mode=mode, layerwise=layerwise, max_memory=budget)
        if backend.name == "jax":  # no slice assignment: diagonal tiles stay whole
            assert plan.panels == 1
        else:
            assert plan.panels == min(gram_module.SYMMETRIC_MAX_PANELS, plan.tile_rows // 3) > 1
            monkeypatch.setattr(gram_module, "SYMMETRIC_MAX_PANELS", 1)
            unpaneled = plan_gram(j, mode=mode, layerwise=layerwise, max_memory=budget)
            monkeypatch.setattr(gram_module, "SYMMETRIC_MAX_PANELS", 4)
            assert unpaneled.panels == 1 and plan.flops < unpaneled.flops
        for strategy in ("positions", "materialise"):  # materialised weights: once a tile
            ks = _gram(j, mode=mode, layerwise=layerwise, max_memory=budget, strategy=strategy)
            np.testing.assert_allclose(backend.to_numpy(ks), ref, rtol=1e-10, atol=1e-10)
        k = backend.to_numpy(ntkcore.gram(j, mode=mode, layerwise=layerwise,
                                          max_memory=budget))
        np.testing.assert_allclose(k, ref, rtol=1e-10, atol=1e-10)
        # the mirrored lower part is the transpose of the computed upper part, bit for bit
        lead = k.shape[0] if layerwise else None
        kk = k if lead is None else k[0]
        swap = {"trace": (1, 0), "diagonal": (1, 0, 2), "full": (1, 0, 3, 2)}[mode]
        b = panel_bounds(0, plan.tile_rows, plan.panels)[1]
        np.testing.assert_array_equal(kk[b:plan.tile_rows, :b],
                                      kk[:b, b:plan.tile_rows].transpose(swap))


def test_plans_are_reused_by_shape(monkeypatch, rng):
    """Same-shaped Jacobians share a plan (the cost model runs once); a new shape, budget
    or steering constant makes a new one; an explicit budget is reported as given."""
    import sys

    gram_module = sys.modules["ntkcore.gram"]
    # a cache of this test's own: what other tests in this worker planned must not matter
    monkeypatch.setattr(gram_module, "_PLAN_CACHE", LRUCache(3))
    spec = {"O": 2, "blocks": [("kron", 1, 4, 3), ("dense", 5)]}
    j1 = to_jacobian_np(make_factors(spec, 9, rng))
    j2 = to_jacobian_np(make_factors(spec, 9, rng))
    p1 = plan_gram(j1, mode="full", max_memory=12_345)
    assert p1.budget_bytes == 12_345
    assert plan_gram(j2, mode="full", max_memory=12_345) is p1
    assert plan_gram(j1, mode="trace", max_memory=12_345) is not p1
    assert plan_gram(to_jacobian_np(make_factors(spec, 10, rng)), mode="full",
                     max_memory=12_345) is not p1
    calls = []
    real = gram_module._make_plan
    monkeypatch.setattr(gram_module, "_make_plan", lambda *a: calls.append(a) or real(*a))
    plan_gram(j2, mode="full", max_memory=12_345)
    assert calls == []
    monkeypatch.setattr(gram_module, "SYMMETRIC_MAX_PANELS", 3)
    plan_gram(j2, mode="full", max_memory=12_345)
    assert len(calls) == 1
    for name in ("MIN_SLAB_GEMM_ROWS", "PREFERRED_SLAB_GEMM_ROWS", "SLAB_CAP_FACTOR"):
        monkeypatch.setattr(gram_module, name, getattr(gram_module, name) + 1)
        plan_gram(j2, mode="full", max_memory=12_345)
    assert len(calls) == 4  # each slab constant steers the plan (Route.working)
    # a default budget is planned with its leading bits only, and reported exactly
    assert gram_module._round_budget(0b1011011_1111) == 0b1011010_0000
    assert gram_module._round_budget(40) == 40


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_positions_blocks_split_diagonal_tiles_in_gemm_rows(monkeypatch, rng, mode):
    """A block on the "positions" route has (r S) x (r S) Grams: its diagonal tile is split
    into row panels of at least SYMMETRIC_PANEL_ROWS GEMM rows (r S), not samples, so a
    token layer at N = 32 (S = 17) gets panels and fewer flops, with the exact kernel."""
    import sys

    gram_module = sys.modules["ntkcore.gram"]
    spec = {"O": 1, "blocks": [("kron", 17, 512, 512), ("dense", 6)]}
    f = make_factors(spec, 32, rng)
    j = to_jacobian_np(f)
    plan = plan_gram(j, mode=mode)
    assert plan.strategies[0] == "positions"
    rows = gram_module.SYMMETRIC_PANEL_ROWS["cpu"]
    assert plan.panels == min(gram_module.SYMMETRIC_MAX_PANELS, 32 * 17 // rows) > 1
    monkeypatch.setattr(gram_module, "SYMMETRIC_MAX_PANELS", 1)
    assert plan_gram(j, mode=mode).flops > plan.flops
    monkeypatch.setattr(gram_module, "SYMMETRIC_MAX_PANELS", 4)
    k = ntkcore.gram(j, mode=mode)
    np.testing.assert_allclose(k, reference(f, f, mode), rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(k, np.swapaxes(k, 0, 1) if mode != "full"
                                  else k.transpose(1, 0, 3, 2))
