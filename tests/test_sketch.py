"""Sketches: reproducibility, unbiasedness, leverage variance, Kronecker structure, low rank.

Unbiasedness tests average M independent sketched Grams and accept the mean when it lies within
Z standard errors (the empirical per-draw standard deviation / sqrt(M)) of the exact Gram in
every entry; a biased scheme (successive sampling with the naive scale) is shown to fail the
same check, so the check can fail.
"""

from __future__ import annotations

import numpy as np
import pytest

import ntkcore.sketch as sk
from ntkcore import DenseBlock, Jacobian, KroneckerBlock


@pytest.fixture
def backend(backend_eager):
    """numpy, torch, array_api_strict: jax would run these Monte-Carlo loops op by op."""
    return backend_eager

Z = 5.0  # standard errors allowed per entry; with ~100 entries a false alarm has p < 1e-4

ROW_KINDS = [("uniform", True), ("uniform", False), ("leverage", True), ("leverage", False),
             ("gaussian", True), ("sparse_sign", True)]


def _heavy_rows(rng: np.random.Generator, n: int = 40, rho: int = 4) -> np.ndarray:
    u = rng.standard_normal((n, rho))
    u[:3] *= 30.0  # a few heavy rows
    return u


def _mean_and_se(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = samples.shape[0]
    return samples.mean(axis=0), samples.std(axis=0, ddof=1) / np.sqrt(m)


def _assert_unbiased(samples: np.ndarray, exact: np.ndarray) -> None:
    mean, se = _mean_and_se(samples)
    tol = Z * se + 1e-9 * np.abs(exact).max()
    worst = np.max(np.abs(mean - exact) - tol)
    assert worst <= 0, f"mean deviates from the exact value by more than {Z} standard errors"


@pytest.mark.parametrize(("kind", "replace"), ROW_KINDS)
def test_same_seed_same_sketch(backend, rng, kind, replace):
    u = backend.asarray(_heavy_rows(rng))
    s1 = sk.make_sketch(kind, u, 12, seed=7, replace=replace)
    s2 = sk.make_sketch(kind, u, 12, seed=7, replace=replace)
    s3 = sk.make_sketch(kind, u, 12, seed=8, replace=replace)
    a1, a2, a3 = (backend.to_numpy(s.apply(u)) for s in (s1, s2, s3))
    assert backend.is_native(s1.apply(u))
    np.testing.assert_array_equal(a1, a2)
    assert not np.array_equal(a1, a3)
    # apply agrees with the dense matrix
    np.testing.assert_allclose(backend.to_numpy(s1.matrix()) @ backend.to_numpy(u), a1,
                               rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize(("kind", "replace"), ROW_KINDS)
def test_row_sketch_gram_unbiased(backend, kind, replace):
    rng = np.random.default_rng(3)
    u_np = _heavy_rows(rng)
    u = backend.asarray(u_np)
    exact = u_np.T @ u_np
    draws = 300
    samples = np.empty((draws, *exact.shape))
    for i in range(draws):
        s = sk.make_sketch(kind, u, 10, seed=1000 + i, replace=replace)
        x = backend.to_numpy(s.apply(u))
        samples[i] = x.T @ x
    _assert_unbiased(samples, exact)


@pytest.mark.parametrize("replace", [True, False])
def test_leverage_operator_identity_in_expectation(replace):
    # E[Omega^T Omega] = I on the diagonal (off-diagonal is zero for every draw without
    # replacement; with replacement too since one row per draw).
    rng = np.random.default_rng(4)
    u = rng.standard_normal((25, 4)) + 0.5
    u[:3] *= 3.0  # moderately heavy: every row is drawn often enough for a reliable SE
    draws = 1000
    diag = np.empty((draws, 25))
    for i in range(draws):
        m = sk.leverage(u, 8, seed=i, replace=replace).matrix()
        diag[i] = np.diag(m.T @ m)
    mean, se = _mean_and_se(diag)
    assert np.all(np.abs(mean - 1.0) <= Z * se + 1e-12)


def test_unbiasedness_check_detects_a_biased_scheme():
    # Successive sampling without replacement with the naive scale 1/sqrt(q p_j) is biased
    # (heavy rows are included at most once); the same check must reject it.
    rng = np.random.default_rng(3)
    u = _heavy_rows(rng)
    exact = u.T @ u
    p = np.sum(u * u, axis=1)
    p /= p.sum()
    q, draws = 10, 300
    samples = np.empty((draws, *exact.shape))
    for i in range(draws):
        idx = np.random.default_rng(i).choice(u.shape[0], q, replace=False, p=p)
        x = u[idx] / np.sqrt(q * p[idx])[:, None]
        samples[i] = x.T @ x
    with pytest.raises(AssertionError):
        _assert_unbiased(samples, exact)


def test_leverage_has_lower_variance_than_uniform_on_heavy_rows():
    rng = np.random.default_rng(5)
    u = _heavy_rows(rng, n=200, rho=5)
    exact = u.T @ u
    errs = {}
    for kind in ("uniform", "leverage"):
        e = []
        for i in range(200):
            x = sk.make_sketch(kind, u, 20, seed=i).apply(u)
            e.append(np.linalg.norm(x.T @ x - exact) ** 2)
        errs[kind] = np.mean(e)
    assert errs["leverage"] < 0.25 * errs["uniform"]


def test_without_replacement_full_sample_is_exact(backend, rng):
    u_np = rng.standard_normal((15, 3))
    u = backend.asarray(u_np)
    for kind in ("uniform", "leverage"):
        x = backend.to_numpy(sk.make_sketch(kind, u, 15, seed=1, replace=False).apply(u))
        np.testing.assert_allclose(x.T @ x, u_np.T @ u_np, rtol=1e-10)


def test_unbound_sketch_binds_on_apply(backend, rng):
    s = sk.uniform(20, 5, seed=3)
    assert not s.bound
    with pytest.raises(RuntimeError, match="not drawn"):
        _ = s.indices
    x = backend.asarray(rng.standard_normal((20, 2)))
    y = s.apply(x)
    assert backend.is_native(y) and tuple(y.shape) == (5, 2)
    assert backend.is_native(s.indices)
    if backend.name != "numpy":
        with pytest.raises(ValueError, match="was drawn for"):
            s.apply(rng.standard_normal((20, 2)))
    # a namespace works as `like`
    s2 = sk.uniform(20, 5, seed=3, like=backend.xp)
    np.testing.assert_array_equal(backend.to_numpy(s2.apply(x)), backend.to_numpy(y))


def test_bad_arguments():
    u = np.ones((10, 2))
    with pytest.raises(ValueError, match="q"):
        sk.uniform(10, 0)
    with pytest.raises(TypeError, match="q"):
        sk.uniform(10, 2.5)
    with pytest.raises(ValueError, match="without replacement"):
        sk.uniform(10, 11, replace=False)
    with pytest.raises(ValueError, match="without replacement"):
        sk.leverage(u, 11, replace=False)
    with pytest.raises(TypeError, match="seed"):
        sk.uniform(10, 2, seed=-1)
    with pytest.raises(ValueError, match="n=10"):
        sk.uniform(10, 2, like=u).apply(np.ones((9, 2)))
    with pytest.raises(ValueError, match="NaN"):
        sk.leverage(np.full((10, 2), np.nan), 3)
    with pytest.raises(ValueError, match="kind"):
        sk.SketchSpec("fancy", 3)
    with pytest.raises(TypeError, match="Jacobian"):
        sk.sketch_jacobian(u, 3)


# -- Jacobians ----------------------------------------------------------------------------------
def _jacobian(backend, rng, n=5, o=2):
    blocks = [
        KroneckerBlock(backend.asarray(rng.standard_normal((n, 1, 12))),
                       backend.asarray(rng.standard_normal((n, 1, o, 9))), "fc"),
        DenseBlock(backend.asarray(rng.standard_normal((n, o, 30))), "dense"),
        KroneckerBlock(backend.asarray(rng.standard_normal((n, 3, 8))),
                       backend.asarray(rng.standard_normal((n, 3, o, 10))), "conv"),
    ]
    return Jacobian(blocks)


def _dense_gram(jd: np.ndarray) -> np.ndarray:
    return np.einsum("nap,mbp->nmab", jd, jd)


@pytest.mark.parametrize("method", ["uniform", "leverage", "gaussian", "sparse_sign"])
def test_kronecker_sketch_matches_materialised_row_sampling(backend, rng, method):
    J = _jacobian(backend, rng)
    js, jsk = sk.sketch_jacobian(J, 80, method=method, seed=11, return_sketch=True)
    assert [type(b) for b in js] == [type(b) for b in J]
    v_np = rng.standard_normal(J.num_params)
    sv = backend.to_numpy(jsk.apply(backend.asarray(v_np)))
    start = 0
    out = 0
    for b, bs, sketch in zip(J.blocks, js.blocks, jsk.block_sketches, strict=True):
        dense = backend.to_numpy(b.to_dense())  # (N, O, P_b)
        if isinstance(b, KroneckerBlock):
            sk_a, sk_g = sketch
            om_a = np.eye(b.d_in) if sk_a is None else backend.to_numpy(sk_a.matrix())
            om_g = np.eye(b.d_out) if sk_g is None else backend.to_numpy(sk_g.matrix())
            omega = np.kron(om_g, om_a)  # parameter index i_out * d_in + i_in
            assert isinstance(bs, KroneckerBlock)
        else:
            omega = backend.to_numpy(sketch.matrix())
        np.testing.assert_allclose(backend.to_numpy(bs.to_dense()),
                                   np.einsum("nop,qp->noq", dense, omega), rtol=1e-10,
                                   atol=1e-10)
        vb = v_np[start:start + b.num_params]
        np.testing.assert_allclose(sv[out:out + omega.shape[0]], omega @ vb, rtol=1e-10,
                                   atol=1e-10)
        start += b.num_params
        out += omega.shape[0]
    assert out == sv.shape[0]


@pytest.mark.parametrize("method", ["uniform", "leverage"])
def test_sketch_jacobian_gram_unbiased(method):
    rng = np.random.default_rng(8)

    class _Np:
        name = "numpy"

        @staticmethod
        def asarray(x):
            return np.asarray(x, dtype=np.float64)

    J = _jacobian(_Np, rng, n=3, o=1)
    exact = _dense_gram(J.to_dense())
    draws = 300
    samples = np.empty((draws, *exact.shape))
    for i in range(draws):
        samples[i] = _dense_gram(sk.sketch_jacobian(J, 60, method=method, seed=i).to_dense())
    _assert_unbiased(samples, exact)


def test_spawn_seed_is_numpy_seed_sequence():
    """spawn_seed(s, *k) is SeedSequence(s, spawn_key=k)'s first 64-bit word (low 63 bits),
    i.e. what nested SeedSequence.spawn hands out, for seeds and keys of 1, 2 and 3 words."""
    rng = np.random.default_rng(3)
    cases = [(0, ()), (0, (0,)), (11, (2, 1)), (2**32, (5,)), (2**70 + 5, (1, 2)),
             (123, (2**40, 7, 0)), (7, (1000,))]
    cases += [(int(rng.integers(2**62)), tuple(int(k) for k in rng.integers(2**33, size=m)))
              for m in rng.integers(0, 7, size=200)]
    for seed, keys in cases:
        ref = np.random.SeedSequence(seed, spawn_key=keys).generate_state(1, np.uint64)[0]
        assert sk.spawn_seed(seed, *keys) == int(ref) & (2**63 - 1), (seed, keys)
    child = np.random.SeedSequence(11).spawn(3)[2].spawn(2)[1]
    assert sk.spawn_seed(11, 2, 1) == int(child.generate_state(1, np.uint64)[0]) & (2**63 - 1)
    assert sk.spawn_seed(None, 1, 2) is None


def test_budget_split():
    assert sk.split_budget(10, (50, 50)) == (5, 5)
    assert sk.split_budget(1000, (10, 90)) == (10, 90)
    assert all(q >= 1 for q in sk.split_budget(3, (1000, 1, 5)))
    qa, qg = sk.split_kronecker(100, 400, 100)
    assert qa * qg == pytest.approx(100, rel=0.2) and qa / 400 == pytest.approx(qg / 100, rel=0.3)


def test_sketch_jacobian_large_q_is_identity(rng):
    J = Jacobian([DenseBlock(rng.standard_normal((2, 1, 5)))])
    np.testing.assert_array_equal(sk.sketch_jacobian(J, 5).to_dense(), J.to_dense())


# -- low-rank compression ---------------------------------------------------------------------
def test_low_rank_matches_truncated_svd(backend, rng):
    n, s, d_in, d_out = 4, 9, 7, 5
    a = rng.standard_normal((n, s, d_in))
    g = rng.standard_normal((n, s, 1, d_out))
    block = KroneckerBlock(backend.asarray(a), backend.asarray(g), "conv")
    m = np.einsum("nso,nsi->noi", g[:, :, 0], a)  # per-sample gradients (n, d_out, d_in)
    for r in (1, 3):
        cb, err = sk.low_rank(block, r)
        assert cb.num_positions == r
        approx = backend.to_numpy(cb.to_dense()).reshape(n, d_out, d_in)
        for i in range(n):
            uu, ss, vv = np.linalg.svd(m[i])
            best = (uu[:, :r] * ss[:r]) @ vv[:r]
            np.testing.assert_allclose(approx[i], best, rtol=1e-8, atol=1e-8)
            ref = np.sqrt(np.sum(ss[r:] ** 2) / np.sum(ss**2))
            np.testing.assert_allclose(backend.to_numpy(err)[i], ref, rtol=1e-8, atol=1e-12)
    # exact when r >= rank(M_n) (= min(d_out, d_in) = 5 here)
    cb, err = sk.low_rank(Jacobian([block]), 5)
    np.testing.assert_allclose(backend.to_numpy(cb.to_dense()),
                               backend.to_numpy(block.to_dense()), rtol=1e-8, atol=1e-8)
    assert np.max(backend.to_numpy(err)) < 1e-7


def test_low_rank_rejects_multiple_outputs(rng):
    block = KroneckerBlock(rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4, 2, 3)))
    with pytest.raises(ValueError, match="O = 1"):
        sk.low_rank(block, 2)


def test_one_pass_leverage_weights(backend, rng, monkeypatch):
    # chunked column norms (several chunks, a ragged last one) and row norms vs einsum
    monkeypatch.setattr(sk, "_SQ_CHUNK_BYTES", 4 * 7 * 3)  # 3 rows of 7 columns per chunk
    x = rng.standard_normal((11, 7))
    x[2] *= 40.0
    xs = backend.asarray(x, "float64")
    np.testing.assert_allclose(backend.to_numpy(sk.column_norms_squared(xs)),
                               np.einsum("ij,ij->j", x, x), rtol=1e-12)
    u = rng.standard_normal((9, 2, 3))
    np.testing.assert_allclose(backend.to_numpy(sk.row_norms_squared(backend.asarray(u,
                                                                                     "float64"))),
                               np.einsum("ijk,ijk->i", u, u), rtol=1e-12)


@pytest.mark.parametrize("method", ["uniform", "leverage"])
@pytest.mark.parametrize("replace", [True, False])
def test_row_sketch_indices_sorted_and_apply_on_any_axis(backend, rng, method, replace):
    # rows of Omega are stored by increasing index; apply on the first, a middle and the last
    # axis of a 3-D operand agrees with the dense (q, n) matrix
    n, q = 12, 5
    w = rng.standard_normal((n, 3))
    s = (sk.uniform(n, q, seed=3, replace=replace, like=backend.asarray(w, "float64"))
         if method == "uniform" else sk.leverage(backend.asarray(w, "float64"), q, seed=3,
                                                  replace=replace))
    idx = backend.to_numpy(s.indices)
    assert np.all(np.diff(idx) >= 0)
    omega = backend.to_numpy(s.matrix())
    x = rng.standard_normal((n, 4, n))
    xs = backend.asarray(x, "float64")
    np.testing.assert_allclose(backend.to_numpy(s.apply(xs, axis=0)),
                               np.einsum("qn,nab->qab", omega, x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(s.apply(xs, axis=2)),
                               np.einsum("qn,abn->abq", omega, x), rtol=1e-12, atol=1e-12)
    y = rng.standard_normal((4, n, 2))
    np.testing.assert_allclose(backend.to_numpy(s.apply(backend.asarray(y, "float64"), axis=1)),
                               np.einsum("qn,anb->aqb", omega, y), rtol=1e-12, atol=1e-12)


def test_sparse_sign_diagonal_with_collisions():
    """docs/math.md: diag(Omega^T Omega) is 1 for columns whose nnz rows are distinct (every
    column when nnz = 1); colliding draws add up, so other entries are 0, 2, ... / nnz, and
    only the mean is 1."""
    for nnz, q in ((1, 5), (3, 4)):
        s = sk.sparse_sign(4000, q, nnz=nnz, seed=3, like=np.zeros(1))
        omega = np.asarray(s.matrix())
        diag = np.einsum("qn,qn->n", omega, omega)
        rows, signs = np.asarray(s.rows), np.asarray(s.signs) * np.sqrt(nnz)
        distinct = np.array([len(set(rows[:, j])) == nnz for j in range(4000)])
        np.testing.assert_allclose(diag[distinct], 1.0, rtol=4 * np.finfo(float).eps)
        # the entry the rows and signs give: (1/nnz) sum_{k,l} s_k s_l [r_k == r_l]
        same = rows[:, None, :] == rows[None, :, :]
        expected = np.einsum("kn,ln,kln->n", signs, signs, same) / nnz
        np.testing.assert_allclose(diag, expected, rtol=4 * np.finfo(float).eps)
        if nnz == 1:
            assert distinct.all()
        else:
            assert (~distinct).sum() > 1000 and np.any(np.abs(diag - 1) > 0.5)
            _assert_unbiased(diag[:, None], np.ones(1))


# -- pinned draws ---------------------------------------------------------------------------
# The same seed must give the same sketch release after release (saved seeds, checkpoints of
# SENG's sketch seeds).  numpy's PCG64 and torch's CPU generator have stable streams; jax's
# depends on configuration flags (threefry_partitionable), so it is not pinned here.
def _pinned_draws(backend) -> dict:
    n = 16
    j = np.arange(n, dtype=np.float64)
    x = backend.asarray(np.sqrt(j + 1.0) - 0.3 * j)  # distinct entries: apply(x) shows indices
    u_np = np.stack([np.cos(j), np.sin(2 * j) + 1.5], 1)
    u_np[3] *= 4.0
    u = backend.asarray(u_np)
    out = {}
    for name, s in [
        ("uniform", sk.uniform(n, 5, seed=5, like=x)),
        ("uniform_norep", sk.uniform(n, 5, seed=5, replace=False, like=x)),
        ("leverage", sk.leverage(u, 5, seed=5)),
        ("leverage_norep", sk.leverage(u, 5, seed=5, replace=False)),
        ("gaussian", sk.gaussian(n, 5, seed=5, like=x)),
        ("sparse_sign", sk.sparse_sign(n, 5, seed=5, like=x)),
        ("sparse_sign_nnz2", sk.sparse_sign(n, 5, nnz=2, seed=6, like=x)),
    ]:
        idx = backend.to_numpy(s.indices).tolist() if isinstance(s, sk.RowSketch) else None
        out[name] = (idx, backend.to_numpy(s.apply(x)))
    J = Jacobian([
        DenseBlock(backend.asarray(np.cos(np.arange(24.0)).reshape(2, 1, 12))),
        KroneckerBlock(backend.asarray(np.sin(np.arange(24.0) + 0.5).reshape(2, 3, 4)),
                       backend.asarray(np.cos(np.arange(30.0) * 0.7).reshape(2, 3, 1, 5)))])
    v = backend.asarray(np.sqrt(np.arange(32.0) + 2.0))
    for method, replace in (("leverage", False), ("uniform", True), ("sparse_sign", True)):
        _, jsk = sk.sketch_jacobian(J, 10, method=method, seed=9, replace=replace,
                                    return_sketch=True)
        out[f"jacobian_{method}"] = (None, backend.to_numpy(jsk.apply(v)))
    return out


@pytest.mark.parametrize("name", ["numpy", "array_api_strict", "torch"])
def test_pinned_draws(name):
    """Fixed seeds give the indices and values that the code before the refactor of
    sketch.py gave (array_api_strict draws with numpy's generator on the host)."""
    pytest.importorskip(name)
    from conftest import make_case

    got = _pinned_draws(make_case(name))
    pinned = _PINNED["torch" if name == "torch" else "numpy"]
    assert got.keys() == pinned.keys()
    for key, (idx, values) in pinned.items():
        assert got[key][0] == idx, key
        values = np.asarray(values)
        # each value is a sum of at most 4 products: a few roundings of the largest one
        tol = 16 * np.finfo(np.float64).eps * np.max(np.abs(values))
        np.testing.assert_allclose(got[key][1], values, rtol=0, atol=tol, err_msg=key)


_PINNED = {  # computed with the code of main before the refactor of sketch.py
    "numpy": {
        "uniform": ([0, 7, 10, 12, 12], [1.7888543819998317, 1.3030500540697605, 0.566395643677035,
            0.00993042343944573, 0.00993042343944573]),
        "uniform_norep": ([0, 7, 8, 10, 12], [1.7888543819998317, 1.3030500540697605,
            1.0733126291998991, 0.566395643677035, 0.00993042343944573]),
        "leverage": ([1, 3, 3, 10, 10], [1.89811439713976, 0.7360227277973784, 0.7360227277973784,
            0.5213256777854383, 0.5213256777854383]),
        "leverage_norep": ([0, 3, 7, 11, 13], [1.9403767214946188, 1.1, 0.979200460970316,
            0.3849618807879829, -0.22721457382769944]),
        "gaussian": (None, [-0.10021761180390079, -1.2633575691020928, -1.6190827374555623,
            0.09479061566403768, 0.5475393019466306]),
        "sparse_sign": (None, [-2.42134512152984, -0.8809502999638354, -0.25047212340666003,
            -0.1542486889354091, -0.6142135623730951]),
        "sparse_sign_nnz2": (None, [0.0034346915721069626, -0.26794919243112303,
            -2.6716722834779754, 1.709881702710083, 0.5481506004231369]),
        "jacobian_leverage": (None, [1.8942601989667414, 2.874324881228343, 3.1405026041968847,
            3.7025883838009808, 6.871137144030944, 8.636969813527617, 9.585769161172196,
            11.880713496077492, 8.856987825416711, 10.75566385543759]),
        "jacobian_uniform": (None, [3.4641016151377544, 3.872983346207417, 5.744562646538029,
            5.744562646538029, 7.745966692414833, 8.366600265340756, 7.745966692414833,
            8.366600265340756, 10.000000000000002, 10.488088481701515]),
        "jacobian_sparse_sign": (None, [-2.1474768247823546, -1.610475130654508,
            -0.4432736152956096, -4.139691660322477, 0.8259811341630217, 0.8239175333777249, 0.0,
            0.0, 3.7416573867739413, 3.7498777205897564]),
    },
    "torch": {
        "uniform": ([3, 6, 13, 14, 15], [1.967739820199815, 1.5129259388799963,
            -0.2832518775267394, -0.5849851741237843, -0.8944271909999159]),
        "uniform_norep": ([3, 6, 7, 10, 11], [1.967739820199815, 1.5129259388799963,
            1.3030500540697605, 0.566395643677035, 0.29355389333242216]),
        "leverage": ([3, 3, 3, 3, 5], [0.7360227277973784, 0.7360227277973784, 0.7360227277973784,
            0.7360227277973784, 4.005140216834667]),
        "leverage_norep": ([3, 4, 11, 13, 14], [1.1, 1.4081559731756772, 0.38496188078798277,
            -0.2272145738276994, -0.6440378465051765]),
        "gaussian": (None, [-0.7688473775111169, 1.4323765749380861, -1.784989106400941,
            0.5493173117327966, -0.4760485746823302]),
        "sparse_sign": (None, [2.2135913579209325, 2.0416192529637796, 0.4446421097303448,
            0.9554437785387733, -0.3353111118493155]),
        "sparse_sign_nnz2": (None, [0.5951416456236027, 3.536217234310529, 0.18665888769165173,
            -0.5669751558766616, -0.5317454909001946]),
        "jacobian_leverage": (None, [1.8942601989667416, 2.874324881228343, 3.702588383800981,
            4.228805026536312, 8.432872152172791, 8.633968130949619, 7.613215029800639,
            7.768651721225773, 8.85698782541671, 9.015475028047577]),
        "jacobian_uniform": (None, [3.4641016151377544, 5.477225575051661, 5.477225575051661,
            6.244997998398397, 7.745966692414833, 7.958224257542216, 7.745966692414833,
            7.958224257542216, 8.563488385776754, 8.755950357709132]),
        "jacobian_sparse_sign": (None, [-0.9698816079456809, -2.8284271247461903,
            1.075978163664093, 1.3166247903553998, 0.5009833003453434, -1.4175216216710158,
            0.3782060614588767, -1.0963614068901135, -4.69041575982343, 14.694811008879075]),
    },
}
