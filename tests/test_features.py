"""ntkcore.features: projected eNTK features and their error model.

References are independent: kernels of dense float64 Jacobians (``np.einsum``) or
:func:`ntkcore.ntk` (itself tested against torch.func / jax.jacrev).  Monte-Carlo checks average
M independent projections and accept a mean within Z standard errors; the standard error of the
kernel estimate comes from the predicted variance (so the unbiasedness check is as tight as the
error model says), and the error model is checked against the measured squared errors with
their own empirical standard error.  Each check is shown to reject a wrong answer (a 50 % bias,
half the variance), so it can fail.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

import ntkcore
from ntkcore import DenseBlock, Jacobian, KroneckerBlock
from ntkcore.features import GridLayout, PairsLayout, _grid_pairs, allocate, allocate_exact
from ntkcore.models import MLP
from ntkcore.sketch import split_kronecker
from tests.conftest import make_case
from tests.tolerances import kernel_tol

# many small eager JAX operations of changing shapes: compile them without XLA's passes
pytestmark = pytest.mark.usefixtures("jax_quick_compile")

Z = 5.0  # standard errors allowed per entry

# One set of shapes for the MLP tests, so that JAX's eager operations (one XLA compile per
# primitive and shape, kept in memory for the process: --dist loadfile runs this file in one)
# are compiled once for the whole file: N_X samples go as a first batch of
# ntkcore._memory.PROBE_SAMPLES = 1 and a rest of 9 (or one at a time); probes have 8 samples.
N_X, N_PROBE = 10, 8


# -- fixtures and references -----------------------------------------------------------------
def _factors(rng: np.random.Generator, n: int = 5, o: int = 2):
    """A Kronecker block (S=2 positions, d_in 8, d_out 6) and a dense block of 10 parameters."""
    return (rng.standard_normal((n, 2, 8)), rng.standard_normal((n, 2, o, 6)),
            rng.standard_normal((n, o, 10)))


def _jacobian(backend, a, g, jac) -> Jacobian:
    return Jacobian([KroneckerBlock(backend.asarray(a), backend.asarray(g), "kron"),
                     DenseBlock(backend.asarray(jac), "dense")])


def _dense_kernel(a, g, jac, mode):
    """The exact kernel from the materialised per-sample gradients, in float64 NumPy."""
    w = np.einsum("nsod,nsi->nodi", g, a).reshape(a.shape[0], g.shape[2], -1)
    jd = np.concatenate([w, jac], axis=2)  # (N, O, P)
    if mode == "pseudo":
        jp = jd.sum(axis=1) / math.sqrt(jd.shape[1])
        return jp @ jp.T
    full = np.einsum("nok,mpk->nmop", jd, jd)
    return full if mode == "full" else np.einsum("nmoo->nm", full)


def _feature_kernel(phi: np.ndarray, mode: str) -> np.ndarray:
    return np.einsum("nod,mpd->nmop", phi, phi) if mode == "full" else phi @ phi.T


def _draws(backend, model, x, mode, dim, seeds, **kw) -> np.ndarray:
    return np.stack([_feature_kernel(backend.to_numpy(ntkcore.features(
        model, x, dim=dim, seed=s, mode=mode, **kw)), mode) for s in seeds])


def _unbiased_violation(samples: np.ndarray, exact: np.ndarray, var: np.ndarray) -> float:
    """Largest excess of |mean - exact| over Z standard errors sqrt(var / M) (<= 0: pass)."""
    tol = Z * np.sqrt(var / samples.shape[0]) + 1e-10 * np.abs(exact).max()
    return float(np.max(np.abs(samples.mean(axis=0) - exact) - tol))


def _mlp(backend, widths=(3, 5, 4, 2), seed=0):
    return MLP.random(widths, xp=backend.xp, seed=seed, dtype=backend.xp.float64,
                      device=backend.device, activation="tanh")


# -- the split of dim and the grid -----------------------------------------------------------
def test_allocate_rule():
    assert allocate(15, (48, 10)) == (12, 3)  # as sketch.split_budget(15, (48, 10))
    assert allocate(3, (1000, 1, 1)) == (1, 1, 1)  # at least one each
    assert allocate(10, (1, 1, 1)) == (4, 3, 3)  # ties go to the lower index
    assert allocate(7, (0.0, 0.0)) == (4, 3)  # an all-zero probe: equal weights
    for dim, w in itertools.product((5, 17, 64, 1000), ((3, 1, 7), (1e-9, 1.0, 5.0, 2.0))):
        q = allocate(dim, w)
        assert sum(q) == dim and min(q) >= 1
        ideal = [dim * wi / sum(w) for wi in w]
        bumped = sum(1 for v in ideal if v < 1)  # blocks raised to their one column
        assert all(abs(qi - v) <= 1 + bumped for qi, v in zip(q, ideal, strict=True))
    with pytest.raises(ValueError, match="dim=2 is smaller than the number of parameter blocks"):
        allocate(2, (1, 1, 1))


def test_allocate_exact_rule():
    """A block whose share reaches its width gets exactly its width; the rest of dim is split
    again over the other blocks (largest remainders), until none reaches its width."""
    assert allocate_exact(40, (1, 2, 37), (40, 48, 20)) == (7, 13, 20)  # allocate(20, (1, 2))
    assert allocate_exact(15, (48, 10), (48, 3)) == (12, 3)
    # round 1: (30, 10, 60), block 1 exact; round 2: allocate(95, (30, 60)) = (32, 63), block
    # 0 exact; round 3: block 2 gets 100 - 5 - 32 = 63 < 70
    assert allocate_exact(100, (30, 10, 60), (32, 5, 70)) == (32, 5, 63)
    assert allocate_exact(100, (50, 25, 25), (1000, 10, 5)) == (85, 10, 5)
    assert allocate_exact(7, (1, 1), (2, 3)) == (2, 3)  # all exact: the total width
    for dim, w, widths in itertools.product((3, 17, 64, 1000), ((3, 1, 7), (1.0, 5.0, 2.0)),
                                            ((4, 50, 9), (100, 100, 100))):
        q = allocate_exact(dim, w, widths)
        assert sum(q) == min(dim, sum(widths)) and min(q) >= 1
        assert all(qi <= wi for qi, wi in zip(q, widths, strict=True))
        free = [b for b in range(3) if q[b] < widths[b]]
        if free:  # the projected blocks share what the exact ones leave, by allocate
            rest = allocate(dim - sum(q[b] for b in range(3) if b not in free),
                            [w[b] for b in free])
            assert tuple(q[b] for b in free) == rest


def test_grid_pairs_count_cells_by_enumeration():
    for q, q_a in [(1, 1), (6, 3), (7, 3), (12, 4), (13, 4), (5, 7), (9, 1)]:
        cells = [(i // q_a, i % q_a) for i in range(q)]
        rows = sum(1 for c, d in itertools.permutations(cells, 2) if c[0] == d[0])
        cols = sum(1 for c, d in itertools.permutations(cells, 2) if c[1] == d[1])
        assert _grid_pairs(q, q_a) == (rows, cols)
    assert split_kronecker(12, 8, 6, cells=True) == (4, 3)
    assert split_kronecker(1, 8, 6, cells=True) == (1, 1)


@pytest.mark.parametrize("ones", [False, True])
@pytest.mark.parametrize("s, d_in, d_out, r, q", [(64, 27, 16, 10, 300), (4, 50, 40, 1, 64),
                                                  (1, 9, 7, 3, 11)])
def test_pairs_orders_agree_with_the_dense_weight(rng, ones, s, d_in, d_out, r, q):
    """Both contraction orders of a pairs block (factors first; each sample's weight first)
    give gamma_i^T X alpha_i of the dense per-sample weight X (float64, to rounding); the
    cost rule picks the weight order for a first convolution's shape and never for an index
    factor."""
    a = rng.standard_normal((5, s, d_in - ones))
    g = rng.standard_normal((5, s, r, d_out))
    block = KroneckerBlock(a, g, ones=ones)
    layout = PairsLayout("gaussian", q, d_in, d_out)
    sk = layout.sketches(0, 0, g)
    x = np.einsum("nsro,nsd->nrod", g, np.concatenate([a, np.ones((5, s, 1))], -1) if ones else a)
    om_a, om_g = sk[0].transposed(np.float64), sk[1].transposed(np.float64)  # (d_in, q), (d_out, q)
    ref = np.einsum("oi,nrod,di->nri", om_g, x, om_a) * math.sqrt(q)
    for order in (True, False):
        np.testing.assert_allclose(replace(layout, khatri_rao=order).apply(block, sk), ref,
                                   rtol=0, atol=1e-13 * np.abs(ref).max())
    assert layout.by_weights(block, r) == ((s, d_in, d_out, r) == (64, 27, 16, 10))
    idx = KroneckerBlock(rng.integers(0, 1000, (5, s)), g, one_hot=1000)
    assert not PairsLayout("gaussian", q, 1000, d_out).by_weights(idx, r)


def test_full_grid_variance_is_the_closed_form(rng):
    """The grid formula with q = q_A q_G equals (T+F_A)/q_A + (T+F_G)/q_G + (N+K^2+F_A+F_G)/q."""
    st = dict(zip(("kernel_sq", "norm_product", "trace_sq", "frob_a", "frob_g"),
                  rng.uniform(0.1, 3.0, 5), strict=True))
    for q_a, q_g in [(1, 1), (3, 4), (5, 2)]:
        q = q_a * q_g
        got = GridLayout("grid", q, 8, 6, q_a, q_g).variance(st)
        want = ((st["trace_sq"] + st["frob_a"]) / q_a + (st["trace_sq"] + st["frob_g"]) / q_g
                + (st["norm_product"] + st["kernel_sq"] + st["frob_a"] + st["frob_g"]) / q)
        assert got == pytest.approx(want, rel=1e-13)


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_pair_statistics_two_routes_agree(backend, rng, mode):
    """The Kronecker pair statistics from per-sample weights and from the factors' Grams
    agree (and K is the exact kernel of the block)."""
    from ntkcore.features import _pair_stats
    from ntkcore.modes import check_mode

    a, g, jac = _factors(rng)
    block = check_mode(mode).feature_jacobian(_jacobian(backend, a, g, jac)).blocks[0]
    dense, factored = _pair_stats(block, factored=False), _pair_stats(block, factored=True)
    assert set(dense) == set(factored) == {"kernel", "kernel_sq", "norm_product", "trace_sq",
                                           "frob_a", "frob_g"}
    ref = _dense_kernel(a, g, np.zeros_like(jac), "full")  # the Kronecker block alone
    ref = ref.transpose(0, 2, 1, 3).reshape(2 * len(a), -1) if mode == "full" else \
        np.einsum("nmoo->nm", ref)
    for key in dense:
        want = backend.to_numpy(dense[key])
        scale = np.abs(want).max()
        np.testing.assert_allclose(backend.to_numpy(factored[key]), want, rtol=0,
                                   atol=kernel_tol("float64", 4 * 48, 4) * scale)
    np.testing.assert_allclose(backend.to_numpy(dense["kernel"]), ref, rtol=0,
                               atol=kernel_tol("float64", 48, 2) * np.abs(ref).max())


# -- shapes, namespaces, reproducibility -----------------------------------------------------
@pytest.mark.parametrize("mode", ["trace", "full", "pseudo"])
def test_shapes_namespace_and_layerwise(backend, rng, mode):
    net = _mlp(backend)
    x = backend.asarray(rng.standard_normal((N_X, 3)))
    phi = ntkcore.features(net, x, dim=24, mode=mode)
    assert backend.is_native(phi)
    assert tuple(phi.shape) == ((N_X, 2, 24) if mode == "full" else (N_X, 24))
    parts = ntkcore.features(net, x, dim=24, mode=mode, layerwise=True)
    assert isinstance(parts, tuple) and len(parts) == 3
    np.testing.assert_array_equal(np.concatenate([backend.to_numpy(p) for p in parts], axis=-1),
                                  backend.to_numpy(phi))


@pytest.mark.parametrize("mode", ["trace", "full", "pseudo"])
def test_one_space_for_every_x(backend, rng, mode):
    """Same seed: the same projection whatever x (rows of a concatenation equal separate
    calls), in one call or in sample batches; another seed: another projection."""
    net = _mlp(backend)
    xn = rng.standard_normal((N_X, 3))
    x = backend.asarray(xn)
    phi = backend.to_numpy(ntkcore.features(net, x, dim=24, seed=5, mode=mode))
    again = backend.to_numpy(ntkcore.features(net, x, dim=24, seed=5, mode=mode))
    np.testing.assert_array_equal(phi, again)
    other = backend.to_numpy(ntkcore.features(net, x, dim=24, seed=6, mode=mode))
    assert not np.allclose(phi, other)
    parts = [backend.to_numpy(ntkcore.features(net, backend.asarray(xn[s]), dim=24, seed=5,
                                               mode=mode)) for s in (slice(0, 8), slice(8, N_X))]
    scale = np.abs(phi).max()
    tol = kernel_tol("float64", 64, computations=2) * scale
    np.testing.assert_allclose(np.concatenate(parts), phi, rtol=0, atol=tol)
    with pytest.raises(ntkcore.BudgetTooSmallError) as info:
        ntkcore.features(net, x, dim=24, seed=5, mode=mode, max_memory=1)
    calls = []  # the smallest budget: one sample at a time (the first is the probe)
    batched = backend.to_numpy(ntkcore.features(net, x, dim=24, seed=5, mode=mode,
                                                max_memory=info.value.needed,
                                                progress=lambda d, t: calls.append((d, t))))
    assert calls == [(i, N_X) for i in range(1, N_X + 1)]
    np.testing.assert_allclose(batched, phi, rtol=0, atol=tol)


def test_generator_seed_is_drawn_once(rng):
    net = MLP.random((3, 4, 2), xp=np, seed=0)
    x = rng.standard_normal((4, 3))
    s = ntkcore.backend.seed_from(np.random.default_rng(7))
    a = ntkcore.features(net, x, dim=8, seed=np.random.default_rng(7))
    np.testing.assert_array_equal(a, ntkcore.features(net, x, dim=8, seed=s))


# -- agreement with sketch_jacobian + gram ---------------------------------------------------
def test_full_grid_equals_sketch_jacobian_gram(backend, rng):
    """Full mode, Gaussian, whole grids: Phi Phi^T is gram(sketch_jacobian(J)) of the same
    Omega (same grid (4, 3) for the Kronecker block, same seeds, same draws).  One block per
    Jacobian, so that both take all ``dim`` columns for it (``features`` splits ``dim`` with
    equal weights, ``sketch_jacobian`` by block size)."""
    a, g, jac = _factors(rng)
    for block, q in zip(_jacobian(backend, a, g, jac).blocks, (12, 3), strict=True):
        J = Jacobian([block])
        phi = backend.to_numpy(ntkcore.features(J, dim=q, seed=3, mode="full",
                                                method="gaussian", kronecker="grid"))
        js = ntkcore.sketch.sketch_jacobian(J, q, method="gaussian", seed=3)
        assert [b.num_params for b in js.blocks] == [q]
        ref = backend.to_numpy(ntkcore.gram(js, mode="full"))
        got = _feature_kernel(phi, "full")
        np.testing.assert_allclose(got, ref, rtol=0,
                                   atol=kernel_tol("float64", 58, 2) * 4 * np.abs(ref).max())


# -- small blocks exact ----------------------------------------------------------------------
def _dense_columns(a, g, jac, mode):
    """The per-block Jacobian columns in float64 NumPy: (Kronecker (N, R, ...), dense)."""
    n, o = jac.shape[:2]
    w = np.einsum("nsod,nsi->nodi", g, a).reshape(n, o, -1)
    if mode == "full":
        return w, jac
    return w.reshape(n, -1), jac.reshape(n, -1)


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_small_blocks_are_exact(backend, rng, mode):
    """A block whose share of dim reaches its width is its Jacobian itself (every seed, every
    backend); when every block is, Phi Phi^T is the exact kernel with fewer than dim columns."""
    a, g, jac = _factors(rng)
    jac = 10 * jac  # the dense block's trace share (~1000 of ~1100) gives it its whole width
    J = _jacobian(backend, a, g, jac)
    kron, dense = _dense_columns(a, g, jac, mode)
    for seed in (0, 1):
        parts = ntkcore.features(J, dim=30, mode=mode, probe=J, seed=seed, layerwise=True)
        assert tuple(int(p.shape[-1]) for p in parts) == ((20, 10) if mode == "full"
                                                          else (10, 20))
        np.testing.assert_array_equal(backend.to_numpy(parts[1]), dense)
    phi = backend.to_numpy(ntkcore.features(J, dim=500, mode=mode, seed=3))  # all exact
    assert phi.shape[-1] == kron.shape[-1] + dense.shape[-1] < 500
    np.testing.assert_allclose(phi, np.concatenate([kron, dense], axis=-1), rtol=0,
                               atol=kernel_tol("float64", 2, 1) * np.abs(kron).max())
    var = backend.to_numpy(ntkcore.feature_variance(J, dim=500, mode=mode))
    assert not var.any()
    assert ntkcore.choose_dim(J, target=1e-9, mode=mode) <= kron.shape[-1] + dense.shape[-1]


# -- unbiasedness ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["trace", "full", "pseudo"])
@pytest.mark.parametrize(("method", "kronecker"), [("gaussian", "grid"),
                                                   ("sparse_sign", "pairs")])
def test_unbiased_on_a_jacobian(backend_eager, rng, mode, method, kronecker):
    a, g, jac = _factors(rng)
    J = _jacobian(backend_eager, a, g, jac)
    exact = _dense_kernel(a, g, jac, mode)
    kw = dict(method=method, kronecker=kronecker)
    var = backend_eager.to_numpy(ntkcore.feature_variance(J, dim=19, mode=mode, **kw))
    samples = _draws(backend_eager, J, None, mode, 19, range(300), **kw)
    assert _unbiased_violation(samples, exact, var) <= 0
    assert _unbiased_violation(1.5 * samples, exact, var) > 0  # a 50 % bias is caught


def test_cross_kernel_of_separate_calls_is_unbiased(backend_eager, rng):
    """features(x1) @ features(x2).T estimates ntk(x1, x2) (same seed, separate calls)."""
    net = _mlp(backend_eager)
    x1, x2 = rng.standard_normal((4, 3)), rng.standard_normal((3, 3))
    b1, b2 = backend_eager.asarray(x1), backend_eager.asarray(x2)
    exact = backend_eager.to_numpy(ntkcore.ntk(net, b1, b2, mode="trace"))
    var = backend_eager.to_numpy(ntkcore.feature_variance(
        net, backend_eager.asarray(np.concatenate([x1, x2])), dim=16))[:4, 4:]
    samples = np.stack([
        backend_eager.to_numpy(ntkcore.features(net, b1, dim=16, seed=s))
        @ backend_eager.to_numpy(ntkcore.features(net, b2, dim=16, seed=s)).T
        for s in range(300)])
    assert _unbiased_violation(samples, exact, var) <= 0
    assert _unbiased_violation(1.5 * samples, exact, var) > 0  # a 50 % bias is caught


# -- the error model -------------------------------------------------------------------------
CASES = [*itertools.product(["trace", "full"], ["gaussian", "sparse_sign"], ["grid", "pairs"],
                            [False]), ("full", "gaussian", "pairs", True),
         ("trace", "sparse_sign", "grid", True)]


@pytest.mark.parametrize(("mode", "method", "kronecker", "exact_dense"), CASES)
def test_predicted_variance_matches_measured(rng, mode, method, kronecker, exact_dense):
    """E||Phi Phi^T - K||_F^2 = sum of the predicted variances, per entry and in total, within
    Z empirical standard errors of M draws; half the predicted variance is rejected.
    ``exact_dense``: the dense block is exact (variance 0), the Kronecker block gets the rest."""
    a, g, jac = _factors(rng, n=4)
    if exact_dense:
        jac = 10 * jac
    J = _jacobian(make_case("numpy"), a, g, jac)
    exact = _dense_kernel(a, g, jac, mode)
    # partial grids: split_kronecker(cells=True) of the Kronecker block's share is not a product
    dim = 30 if exact_dense else 13
    kw = dict(mode=mode, method=method, kronecker=kronecker,
              probe=J if exact_dense else None)
    if exact_dense:
        from ntkcore.features import FeatureSpec

        spec = FeatureSpec(dim, method, mode=mode, probe=J, kronecker=kronecker)
        methods = [p.method for p in spec.plan(spec.mode.feature_jacobian(J), J)]
        assert methods == [kronecker, "exact"]
    var = np.asarray(ntkcore.feature_variance(J, dim=dim, **kw))
    m = 2000
    sq = np.stack([(_feature_kernel(np.asarray(ntkcore.features(J, dim=dim, seed=s, **kw)),
                                    mode) - exact) ** 2 for s in range(m)])

    def violation(pred: np.ndarray) -> float:
        tot = sq.reshape(m, -1).sum(axis=1)
        se_tot = tot.std(ddof=1) / math.sqrt(m)
        per = np.max(np.abs(sq.mean(axis=0) - pred) - Z * sq.std(axis=0, ddof=1) / math.sqrt(m)
                     - 1e-12 * pred.max())
        return max(per, abs(tot.mean() - pred.sum()) - Z * se_tot)

    assert violation(var) <= 0
    assert violation(0.5 * var) > 0
    err = ntkcore.feature_error(J, dim=dim, **kw)
    assert err == pytest.approx(math.sqrt(var.sum() / (exact**2).sum()), rel=1e-12)


def test_choose_dim_is_the_smallest_meeting_the_target(backend, rng):
    net = _mlp(backend, seed=1)
    x = backend.asarray(rng.standard_normal((N_PROBE, 3)))
    d = ntkcore.choose_dim(net, x, target=0.2)
    assert ntkcore.feature_error(net, x, dim=d) <= 0.2
    assert d == 3 or ntkcore.feature_error(net, x, dim=d - 1) > 0.2
    assert ntkcore.choose_dim(net, x, target=1e6) == 3  # one column per block suffices
    with pytest.raises(ValueError, match="not reached below max_dim=8"):
        ntkcore.choose_dim(net, x, target=1e-3, max_dim=8)
    with pytest.raises(ValueError, match="target must be a positive"):
        ntkcore.choose_dim(net, x, target=0.0)


def test_probe_allocates_by_trace_share(backend, rng):
    net = _mlp(backend)
    probe_np = rng.standard_normal((N_PROBE, 3))
    probe = backend.asarray(probe_np)
    kb = backend.to_numpy(ntkcore.ntk(net, probe, mode="trace", layerwise=True))
    widths = [2 * size for size in net.block_sizes]  # trace mode: O = 2 outputs merged
    want = allocate_exact(24, [np.trace(k) for k in kb], widths)
    x = backend.asarray(rng.standard_normal((N_X, 3)))
    parts = ntkcore.features(net, x, dim=24, probe=probe, layerwise=True)
    assert tuple(int(p.shape[-1]) for p in parts) == want
    default = ntkcore.features(net, x, dim=24, layerwise=True)
    equal = [1.0] * len(widths)  # the default split: equal weights, small blocks exact
    assert want != allocate_exact(24, equal, widths)  # the probe changes the split
    assert tuple(int(p.shape[-1]) for p in default) == allocate_exact(24, equal, widths)
    assert allocate_exact(24, equal, widths) != allocate_exact(24, net.block_sizes, widths)
    # the same probe gives the same space for another x
    phi = backend.to_numpy(ntkcore.features(net, x, dim=24, probe=probe, seed=2))
    head = backend.to_numpy(ntkcore.features(net, x[:2, ...], dim=24, probe=probe, seed=2))
    np.testing.assert_allclose(head, phi[:2], rtol=0,
                               atol=kernel_tol("float64", 64, 2) * np.abs(phi).max())


# -- the providers ---------------------------------------------------------------------------
def test_torch_module_with_a_dense_block(rng):
    torch = pytest.importorskip("torch")
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 3)).double()
    x = torch.as_tensor(rng.standard_normal((5, 4)))
    from ntkcore.backends.torch import jacobian

    J = jacobian(net, x)
    assert any(isinstance(b, DenseBlock) for b in J.blocks)  # LayerNorm
    for mode, exact in (("trace", ntkcore.ntk(net, x, mode="trace")),
                        ("pseudo", ntkcore.pseudo_ntk(net, x))):
        var = ntkcore.feature_variance(net, x, dim=30, mode=mode).detach().numpy()
        samples = np.stack([_feature_kernel(ntkcore.features(
            net, x, dim=30, seed=s, mode=mode).detach().numpy(), mode) for s in range(200)])
        assert _unbiased_violation(samples, exact.detach().numpy(), var) <= 0


def test_torch_cnn_float32(rng):
    """Convolution blocks (S = 16 positions) in float32: unbiased in full mode against
    ntk in float64 (the float32 rounding, ~1e-6 relative, is far below the 5 standard
    errors); the features stay float32."""
    torch = pytest.importorskip("torch")
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(48, 2))
    x = torch.as_tensor(rng.standard_normal((4, 1, 6, 6)), dtype=torch.float32)
    exact = ntkcore.ntk(net.double(), x.double()).detach().numpy()
    var = ntkcore.feature_variance(net, x.double(), dim=40, mode="full").detach().numpy()
    net = net.float()
    phi = ntkcore.features(net, x, dim=40, mode="full")
    assert phi.dtype == torch.float32 and tuple(phi.shape) == (4, 2, 40)
    samples = np.stack([_feature_kernel(ntkcore.features(
        net, x, dim=40, seed=s, mode="full").detach().double().numpy(), "full")
        for s in range(200)])
    assert _unbiased_violation(samples, exact, var) <= 0


def _jax_model(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    p = {"w1": jnp.asarray(rng.standard_normal((5, 3))), "b1": jnp.zeros(5),
         "w2": jnp.asarray(rng.standard_normal((2, 5)))}

    def apply_fn(p, x):
        return jnp.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T

    return jax, (apply_fn, p), jnp.asarray(rng.standard_normal((4, 3)))


def test_jax_pair(rng):
    _, model, x = _jax_model(rng)
    exact = np.asarray(ntkcore.ntk(model, x, mode="full"))
    var = np.asarray(ntkcore.feature_variance(model, x, dim=12, mode="full"))
    samples = np.stack([_feature_kernel(np.asarray(ntkcore.features(
        model, x, dim=12, seed=s, mode="full")), "full") for s in range(100)])
    assert _unbiased_violation(samples, exact, var) <= 0
    assert _unbiased_violation(1.5 * samples, exact, var) > 0  # a 50 % bias is caught


def test_jax_grad_through_exact_features_is_the_kernel_gradient(rng):
    """dim >= the 2 x 30 merged parameters: every block is exact, Phi Phi^T is the trace eNTK,
    and jax.grad of a scalar of it (in x and in the parameters) equals jax.grad through
    ntkcore.ntk (itself tested against jax.jacrev)."""
    jax, (apply_fn, p), x = _jax_model(rng)
    jnp = jax.numpy
    c = jnp.asarray(rng.standard_normal((4, 4)))

    def through_features(z, q):
        phi = ntkcore.features((apply_fn, q), z, dim=64, seed=1)
        assert phi.shape == (4, 60)
        return jnp.sum((phi @ phi.T) * c)

    def through_kernel(z, q):
        return jnp.sum(ntkcore.ntk((apply_fn, q), z, mode="trace") * c)

    got = jax.grad(through_features, argnums=(0, 1))(x, p)
    want = jax.grad(through_kernel, argnums=(0, 1))(x, p)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0,
                                   atol=kernel_tol("float64", 60, 4) * np.abs(w).max())


def test_jax_grad_through_projected_features(rng):
    """Projected features (dim 12 < 60): jax.grad of a scalar of Phi in x and in the
    parameters against central finite differences (jax.test_util.check_grads, float64); the
    same seed gives the same projection at every perturbed point."""
    jax, (apply_fn, p), x = _jax_model(rng)
    from jax.test_util import check_grads

    def f(z, q):
        return jax.numpy.sum(ntkcore.features((apply_fn, q), z, dim=12, seed=1) ** 3)

    check_grads(f, (x, p), order=1, modes=["rev"])


def test_error_model_on_every_backend(backend, rng):
    """feature_variance / feature_error computed on each backend equal NumPy's."""
    a, g, jac = _factors(rng)
    kw = dict(dim=13, mode="full", method="sparse_sign", kronecker="grid")
    want = np.asarray(ntkcore.feature_variance(_jacobian(make_case("numpy"), a, g, jac), **kw))
    J = _jacobian(backend, a, g, jac)
    got = ntkcore.feature_variance(J, **kw)
    assert backend.is_native(got)
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=0,
                               atol=kernel_tol("float64", 48 * 48, 4) * np.abs(want).max())


# -- bad input -------------------------------------------------------------------------------
def test_bad_arguments_name_the_argument(rng):
    net = MLP.random((3, 4, 2), xp=np, seed=0)
    x = rng.standard_normal((4, 3))
    cases = [
        (dict(dim=0), ValueError, "dim must be a positive integer"),
        (dict(dim="8"), TypeError, "dim must be a positive integer"),
        (dict(dim=1), ValueError, "dim=1 is smaller than the number of parameter blocks"),
        (dict(dim=8, mode="diagonal"), ValueError, "mode must be one of .*mode='full'"),
        (dict(dim=8, mode="bogus"), ValueError, "mode must be one of"),
        (dict(dim=8, method="uniform"), ValueError, "method must be one of"),
        (dict(dim=8, kronecker="kr"), ValueError, "kronecker must be one of"),
        (dict(dim=8, seed=None), TypeError, "seed must be .* not None"),
        (dict(dim=8, seed=-1), TypeError, "seed must be"),
        (dict(dim=8, layerwise="yes"), TypeError, "layerwise must be True or False"),
        (dict(dim=8, check_finite=1), TypeError, "check_finite must be True or False"),
        (dict(dim=8, max_memory=100), ntkcore.BudgetTooSmallError, "max_memory >= "),
        (dict(dim=8, probe=[1, 2]), TypeError, "probe must be an array"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            ntkcore.features(net, x, **kw)
    with pytest.raises(TypeError, match="x is required"):
        ntkcore.features(net, dim=8)
    with pytest.raises(TypeError, match="x must be an array"):
        ntkcore.features(net, [[1.0, 2.0, 3.0]], dim=8)
    with pytest.raises(ValueError, match="x has no samples"):
        ntkcore.features(net, x[:0], dim=8)
    bad = x.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="x contains NaN"):
        ntkcore.features(net, bad, dim=8)
    assert not np.isnan(x).any()  # the caller's array is untouched
    J = net.jacobian(x)
    with pytest.raises(ValueError, match="x must be None when model is a Jacobian"):
        ntkcore.features(J, x, dim=8)
    with pytest.raises(TypeError, match="probe must be a Jacobian"):
        ntkcore.features(J, dim=8, probe=x)
    with pytest.raises(TypeError, match="has no Jacobian provider"):
        ntkcore.features(object(), x, dim=8)


def test_budget_error_states_a_budget_that_works(backend, rng):
    net = MLP.random((3, 4, 2), xp=backend.xp, seed=0, dtype=backend.xp.float64,
                     device=backend.device)
    x = backend.asarray(rng.standard_normal((4, 3)))
    with pytest.raises(ntkcore.BudgetTooSmallError) as info:
        ntkcore.features(net, x, dim=8, max_memory=100)
    need = info.value.needed
    want = backend.to_numpy(ntkcore.features(net, x, dim=8))
    np.testing.assert_allclose(backend.to_numpy(ntkcore.features(net, x, dim=8, max_memory=need)),
                               want, rtol=0, atol=kernel_tol("float64", 8, 2) * np.abs(want).max())


def test_budget_charges_what_a_batch_allocates(rng, small_ufunc_buffers):
    """NumPy allocations (tracemalloc) of features stay within max_memory plus the result
    (not charged: its batches and their concatenation); the pairs layout is charged its
    (S, R, q) products, not a q x q grid (which would make 22 MB too small here)."""
    import tracemalloc

    net = MLP.random((20, 64, 64, 10), xp=np, seed=0, activation="tanh")
    x = rng.standard_normal((64, 20))
    for kronecker in ("pairs", "grid"):
        calls = []
        tracemalloc.start()
        try:
            phi = ntkcore.features(net, x, dim=2048, max_memory=22_000_000, kronecker=kronecker,
                                   progress=lambda d, t, seen=calls: seen.append(t))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert calls[-1] > 1  # streamed in several batches
        assert peak <= 22_000_000 + 2 * phi.nbytes


def test_nonfinite_jacobian_is_reported(rng):
    a, g, jac = _factors(rng)
    jac[2, 0, 3] = np.inf
    J = _jacobian(make_case("numpy"), a, g, jac)
    with pytest.raises(ValueError, match="samples 1:5 contain NaN or Inf"):
        ntkcore.features(J, dim=8)  # the probe (sample 0), then samples 1:5


def test_differentiable_in_the_inputs_torch():
    """The features carry autograd graphs to x (the provider's create_graph factors): the
    gradient of a function of them passes torch's finite-difference gradcheck in float64."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(),
                              torch.nn.Linear(5, 2)).double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda z: ntkcore.features(net, z, dim=16, seed=1).pow(2).sum(), (x,))


# -- a projection added in one file with one registry line ------------------------------------
def test_a_toy_projection_registered_in_one_line(rng, monkeypatch):
    """A Rademacher projection (Omega = R / sqrt(q), R = +-1), defined here and registered with
    one line, is a ``method`` of features, feature_variance, choose_dim and the sketches;
    checked against float64 references computed from the toy's own Omega."""
    from ntkcore.sketch import SKETCHES, Sketch, make_sketch, sketch_jacobian, spawn_seed

    class Rademacher(Sketch):
        kind = "rademacher"
        feature_method = True

        def _draw(self, xp, gen, wide):
            self.omega = xp.astype(2 * gen.integers(0, 2, (self.q, self.n)) - 1, wide) \
                / math.sqrt(self.q)

        def _apply_rows(self, xp, flat, dtype):
            return xp.astype(self.omega, dtype) @ flat

        @staticmethod
        def variance(stats, q):  # i.i.d. entries with E r^2 = E r^4 = 1
            return (stats["kernel_sq"] + stats["norm_product"]
                    - 2 * stats["square_products"]) / q

    monkeypatch.setitem(SKETCHES, "rademacher", Rademacher)  # the one registry line

    jac = rng.standard_normal((6, 2, 40))
    J = Jacobian([DenseBlock(jac, "dense")])
    q = 9
    omega = np.asarray(Rademacher(40, q, spawn_seed(5, 0, 0)).bind(jac).omega)
    assert set(np.unique(np.abs(omega) * math.sqrt(q))) == {1.0}
    phi = ntkcore.features(J, dim=q, seed=5, mode="full", method="rademacher")
    want = np.einsum("nop,qp->noq", jac, omega)
    tol = kernel_tol("float64", 40, 2) * np.abs(jac).max() * np.abs(omega).max() * 40
    np.testing.assert_allclose(phi, want, rtol=0, atol=tol)

    # variance: (K^2 + |x|^2 |y|^2 - 2 sum x_i^2 y_i^2) / q over all rows (n, o), float64
    x = jac.reshape(12, 40)
    k = x @ x.T
    ref = (k**2 + np.outer((x**2).sum(1), (x**2).sum(1)) - 2 * (x**2) @ (x**2).T) / q
    var = ntkcore.feature_variance(J, dim=q, mode="full", method="rademacher")
    np.testing.assert_allclose(var, ref.reshape(6, 2, 6, 2).transpose(0, 2, 1, 3), rtol=1e-12)
    d = ntkcore.choose_dim(J, target=0.3, mode="full", method="rademacher")
    assert ntkcore.feature_error(J, dim=d, mode="full", method="rademacher") <= 0.3
    assert d == 1 or ntkcore.feature_error(J, dim=d - 1, mode="full",
                                           method="rademacher") > 0.3

    # the sketches: sketch_jacobian's dense block is J Omega^T, make_sketch (SMW) Omega U
    js, sk = sketch_jacobian(J, q, method="rademacher", seed=5, return_sketch=True)
    np.testing.assert_allclose(np.asarray(js.blocks[0].jac), want, rtol=0, atol=tol)
    np.testing.assert_array_equal(np.asarray(sk.block_sketches[0].omega), omega)
    u = rng.standard_normal((40, 3))
    got = make_sketch("rademacher", u, q, seed=7).apply(u)
    ref_u = np.asarray(Rademacher(40, q, 7).bind(u).omega) @ u
    np.testing.assert_allclose(got, ref_u, rtol=0, atol=tol)

    # unbiased: Phi Phi^T averaged over seeds is the kernel within Z standard errors
    m = 400
    mean = sum(_feature_kernel(np.asarray(ntkcore.features(J, dim=q, seed=s, mode="full",
                                                          method="rademacher")), "full")
               for s in range(m)) / m
    exact = np.einsum("nok,mpk->nmop", jac, jac)
    assert np.all(np.abs(mean - exact) <= Z * np.sqrt(var / m) + 1e-12 * np.abs(exact).max())
