"""SMW solves and the natural-gradient direction against dense float64 solves (numpy.linalg)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ntkcore
import ntkcore.sketch as sk
from ntkcore import DenseBlock, Jacobian, KroneckerBlock
from ntkcore.solve import SMWSolver, sym_gram
from tests.tolerances import solve_tol

pytestmark = pytest.mark.supports("smw_solve", "natural_gradient")


@pytest.fixture
def backend(backend_eager):
    """numpy, torch, array_api_strict: jax would run these Monte-Carlo loops op by op."""
    return backend_eager


def _dense_solve(u: np.ndarray, g: np.ndarray, lam: float, scale: float = 1.0) -> np.ndarray:
    p = u.shape[0]
    return np.linalg.solve(lam * np.eye(p) + scale * u @ u.T, g)


@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=st.integers(1, 40), rho=st.integers(1, 12), k=st.sampled_from([None, 1, 3]),
       log_lam=st.floats(-3, 2), seed=st.integers(0, 2**31))
def test_smw_solve_matches_dense(backend, p, rho, k, log_lam, seed):
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((p, rho))
    g = rng.standard_normal(p if k is None else (p, k))
    lam = 10.0**log_lam
    d = ntkcore.smw_solve(backend.asarray(u), backend.asarray(g), lam)
    assert backend.is_native(d) and tuple(d.shape) == g.shape
    ref = _dense_solve(u, g, lam)
    np.testing.assert_allclose(backend.to_numpy(d), ref, rtol=1e-7,
                               atol=1e-8 * np.abs(ref).max())


def test_smw_solve_float32_stays_float32(backend, rng):
    u = rng.standard_normal((200, 16))
    g = rng.standard_normal(200)
    d = ntkcore.smw_solve(backend.asarray(u, "float32"), backend.asarray(g, "float32"), 0.5)
    assert d.dtype == backend.asarray(g, "float32").dtype
    ref = _dense_solve(u, g, 0.5)
    # rounding u, g to float32 and the float32 solve: eps * cond each, to first order, where
    # cond = cond(0.5 I + u u^T) bounds that of the 16 x 16 SMW system too
    c = np.linalg.cond(0.5 * np.eye(200) + u @ u.T)
    err = np.linalg.norm(backend.to_numpy(d) - ref) / np.linalg.norm(ref)
    assert err <= solve_tol(np.float32, c, computations=2), err


@pytest.mark.parametrize("rho", [1, 5, 8, 12, 13, 40])
@pytest.mark.parametrize("chunk_rows", [None, 7])
@pytest.mark.parametrize("k", [None, 1, 3])
def test_symmetric_gram_panels_and_chunks(backend, rng, monkeypatch, rho, chunk_rows, k):
    """U^T U and U^T v in 1 to 4 row panels (panel width 4 here, uneven at rho = 13), the rows
    of U whole or in chunks of 7 (the last one shorter), against float64 products."""
    import ntkcore.solve as solve

    monkeypatch.setitem(solve.SYRK_PANEL_COLS, "cpu", 4)
    if chunk_rows is not None:
        monkeypatch.setattr(solve, "SYRK_CHUNK_BYTES", chunk_rows * rho * 8)
    u = rng.standard_normal((50, rho))
    v = None if k is None else rng.standard_normal(50 if k == 1 else (50, k))
    xp = _ns(backend)
    gram, uv = solve.gram_and_product(xp, backend.asarray(u),
                                      None if v is None else backend.asarray(v))
    # float64 sums of 50 products: a few eps times the sum of |terms|
    tol = 50 * np.finfo(np.float64).eps * (np.abs(u).T @ np.abs(u))
    assert np.all(np.abs(backend.to_numpy(gram) - u.T @ u) <= tol)
    assert np.array_equal(backend.to_numpy(sym_gram(xp, backend.asarray(u))),
                          backend.to_numpy(gram))
    if v is None:
        assert uv is None
    else:
        assert np.all(np.abs(backend.to_numpy(uv) - u.T @ v)
                      <= 50 * np.finfo(np.float64).eps * (np.abs(u).T @ np.abs(v)))


def test_smw_solve_forms_u_t_g_in_the_gram_pass(backend, rng, monkeypatch):
    """smw_solve takes U^T g from the Gram's pass (the solver's second product with U is
    never made), for one and for k right-hand sides; SMWSolver.solve computes it itself."""
    import ntkcore.solve as solve

    calls = []
    real = solve._ArrayOp.rmatmat
    monkeypatch.setattr(solve._ArrayOp, "rmatmat", lambda self, w: (calls.append(1),
                                                                    real(self, w))[1])
    u = rng.standard_normal((60, 9))
    for g in (rng.standard_normal(60), rng.standard_normal((60, 2))):
        calls.clear()
        d = ntkcore.smw_solve(backend.asarray(u), backend.asarray(g), 0.3)
        np.testing.assert_allclose(backend.to_numpy(d), _dense_solve(u, g, 0.3), rtol=1e-9,
                                   atol=1e-10)
        assert calls == []
        solver = SMWSolver(backend.asarray(u), 0.3)
        np.testing.assert_allclose(backend.to_numpy(solver.solve(backend.asarray(g))),
                                   backend.to_numpy(d), rtol=1e-12, atol=1e-13)
        assert calls == [1]


def _ns(backend):
    import array_api_compat

    return array_api_compat.array_namespace(backend.asarray(np.zeros(1)))


def _jacobian(backend, rng, n=6, o=1):
    return Jacobian([
        KroneckerBlock(backend.asarray(rng.standard_normal((n, 1, 5))),
                       backend.asarray(rng.standard_normal((n, 1, o, 4))), "fc1"),
        DenseBlock(backend.asarray(rng.standard_normal((n, o, 9))), "bn"),
        KroneckerBlock(backend.asarray(rng.standard_normal((n, 3, 6))),
                       backend.asarray(rng.standard_normal((n, 3, o, 3))), "conv"),
    ])


@pytest.mark.parametrize("o", [1, 2])
def test_smw_solve_with_jacobian(backend, rng, o):
    J = _jacobian(backend, rng, o=o)
    jd = backend.to_numpy(J.to_dense())  # (N, O, P)
    u = jd.reshape(-1, jd.shape[2]).T  # columns = the N*O rows
    g = rng.standard_normal((J.num_params, 2))
    d = ntkcore.smw_solve(J, backend.asarray(g), 0.7)
    np.testing.assert_allclose(backend.to_numpy(d), _dense_solve(u, g, 0.7), rtol=1e-9,
                               atol=1e-10)


def test_natural_gradient_matches_dense(backend, rng):
    J = _jacobian(backend, rng)
    n = J.num_samples
    jd = backend.to_numpy(J.to_dense())[:, 0, :]  # (N, P)
    g = rng.standard_normal(J.num_params)
    lam = 0.2
    ref = np.linalg.solve(lam * np.eye(J.num_params) + jd.T @ jd / n, g)
    d = ntkcore.natural_gradient(J, backend.asarray(g), lam)
    np.testing.assert_allclose(backend.to_numpy(d), ref, rtol=1e-9, atol=1e-10)
    d_arr = ntkcore.natural_gradient(backend.asarray(jd), backend.asarray(g), lam)
    np.testing.assert_allclose(backend.to_numpy(d_arr), ref, rtol=1e-9, atol=1e-10)
    # blockwise: one dense solve per block
    db = backend.to_numpy(ntkcore.natural_gradient(J, backend.asarray(g), lam, blockwise=True))
    start = 0
    for size in J.block_sizes:
        jb = jd[:, start:start + size]
        ref_b = np.linalg.solve(lam * np.eye(size) + jb.T @ jb / n, g[start:start + size])
        np.testing.assert_allclose(db[start:start + size], ref_b, rtol=1e-9, atol=1e-10)
        start += size


def test_sketched_solve_matches_formula(backend, rng):
    p, rho, q, lam = 60, 5, 20, 0.3
    u = rng.standard_normal((p, rho))
    g = rng.standard_normal(p)
    s = sk.leverage(backend.asarray(u), q, seed=4)
    d = backend.to_numpy(ntkcore.smw_solve(backend.asarray(u), backend.asarray(g), lam,
                                           sketch=s))
    om = backend.to_numpy(s.matrix())
    xi, x = om @ u, om @ g
    b = np.linalg.solve(lam * np.eye(rho) + xi.T @ xi, xi.T @ x)
    np.testing.assert_allclose(d, (g - u @ b) / lam, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("sketched", [False, True])
def test_solve_with_caller_products_matches_formula(backend, rng, sketched):
    """SMWSolver.solve_with (SENG's per-step path) with products built on sketched_factor."""
    p, rho, q, lam, scale = 60, 5, 20, 0.3, 0.5
    u, g = rng.standard_normal((p, rho)), rng.standard_normal(p)
    ua = backend.asarray(u)
    s = sk.leverage(ua, q, seed=4) if sketched else None
    solver = SMWSolver(ua, lam, sketch=s, scale=scale)
    xi = solver.sketched_factor
    assert sketched or xi is ua
    d = backend.to_numpy(solver.solve_with(backend.asarray(g), lambda v: v @ xi,
                                           lambda b: ua @ b))
    om = backend.to_numpy(s.matrix()) if sketched else np.eye(p)
    eps = np.finfo(np.float64).eps  # Omega U: p products per entry
    np.testing.assert_allclose(backend.to_numpy(xi), om @ u, rtol=0,
                               atol=2 * p * eps * np.abs(om).max() * np.abs(u).max())
    c = lam * np.eye(rho) + scale * (om @ u).T @ (om @ u)
    b = np.linalg.solve(c, scale * (om @ u).T @ (om @ g))
    ref = (g - u @ b) / lam
    tol = solve_tol(np.float64, np.linalg.cond(c), computations=4)
    np.testing.assert_allclose(d, ref, rtol=0, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("kind", ["uniform", "leverage", "gaussian"])
def test_sketched_solve_error_falls_with_q(kind):
    rng = np.random.default_rng(0)
    p, rho, lam = 400, 8, 1.0
    u = rng.standard_normal((p, rho)) * np.linspace(0.2, 3.0, p)[:, None]
    g = u @ rng.standard_normal(rho) + 0.1 * rng.standard_normal(p)
    exact = _dense_solve(u, g, lam)
    errs = []
    for q in (20, 80, 320):
        e = [np.linalg.norm(ntkcore.smw_solve(u, g, lam, sketch=(kind, q, s)) - exact)
             for s in range(15)]
        errs.append(np.mean(e) / np.linalg.norm(exact))
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < 0.5 * errs[0]
    # sampling every row without replacement is exact
    spec = sk.SketchSpec("uniform", p, seed=1, replace=False)
    np.testing.assert_allclose(ntkcore.smw_solve(u, g, lam, sketch=spec), exact, rtol=1e-9)


def test_sketched_natural_gradient_runs_per_block(backend, rng):
    J = _jacobian(backend, rng)
    g = backend.asarray(rng.standard_normal(J.num_params))
    for blockwise in (False, True):
        d = ntkcore.natural_gradient(J, g, 0.5, sketch=("uniform", 6, 3), blockwise=blockwise)
        assert backend.is_native(d) and tuple(d.shape) == (J.num_params,)
        d2 = ntkcore.natural_gradient(J, g, 0.5, sketch=("uniform", 6, 3), blockwise=blockwise)
        np.testing.assert_array_equal(backend.to_numpy(d), backend.to_numpy(d2))


def test_solver_reuse_and_set_damping(rng):
    u = rng.standard_normal((30, 4))
    g = rng.standard_normal(30)
    solver = SMWSolver(u, 1.0, scale=0.25)
    np.testing.assert_allclose(solver.solve(g), _dense_solve(u, g, 1.0, 0.25), rtol=1e-10)
    solver.set_damping(0.1)
    np.testing.assert_allclose(solver.solve(g), _dense_solve(u, g, 0.1, 0.25), rtol=1e-10)


def test_bad_inputs(rng):
    u = rng.standard_normal((10, 3))
    g = rng.standard_normal(10)
    for lam in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="damping"):
            ntkcore.smw_solve(u, g, lam)
    bad = u.copy()
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match="U contains NaN"):
        ntkcore.smw_solve(bad, g, 1.0)
    for spec in (("uniform", 2, 0), ("leverage", 3, 1)):  # NaN row outside or inside the sketch
        with pytest.raises(ValueError, match="U contains NaN"):
            ntkcore.smw_solve(bad, g, 1.0, sketch=spec)
    bad_j = Jacobian([DenseBlock(bad.T[:, None, :])])
    with pytest.raises(ValueError, match="U contains NaN"):
        ntkcore.smw_solve(bad_j, g, 1.0)
    with pytest.raises(ValueError, match="g contains NaN"):
        ntkcore.smw_solve(u, np.full(10, np.inf), 1.0)
    with pytest.raises(ValueError, match="g must have"):
        ntkcore.smw_solve(u, np.ones(9), 1.0)
    with pytest.raises(ValueError, match="U must have shape"):
        ntkcore.smw_solve(np.ones(10), g, 1.0)
    with pytest.raises(ValueError, match="sketch has n"):
        ntkcore.smw_solve(u, g, 1.0, sketch=sk.uniform(9, 3, like=u))
    with pytest.raises(TypeError, match="sketch must be"):
        ntkcore.smw_solve(u, g, 1.0, sketch="uniform")
    J = Jacobian([DenseBlock(rng.standard_normal((4, 2, 10)))])
    with pytest.raises(ValueError, match="O = 1"):
        ntkcore.natural_gradient(J, g, 1.0)
    u_copy = u.copy()
    ntkcore.smw_solve(u, g, 1.0, sketch=("leverage", 4, 0))
    np.testing.assert_array_equal(u, u_copy)  # never mutates inputs


@pytest.mark.parametrize("sketch", [None, ("uniform", 12, 3)])
def test_smw_solve_under_jit_matches_eager(rng, sketch):
    """smw_solve under jax.jit equals the un-jitted float64 result."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    u, g, lam = jnp.asarray(rng.standard_normal((30, 6))), jnp.asarray(rng.standard_normal(30)), 0.3
    eager = np.asarray(ntkcore.smw_solve(u, g, lam, sketch=sketch))
    jitted = np.asarray(jax.jit(lambda a, b: ntkcore.smw_solve(a, b, lam, sketch=sketch))(u, g))
    un = np.asarray(u)
    cond = np.linalg.cond(lam * np.eye(6) + un.T @ un)
    assert np.linalg.norm(jitted - eager) <= solve_tol(np.float64, cond, 4) * np.linalg.norm(eager)
    if sketch is None:
        np.testing.assert_allclose(eager, _dense_solve(un, np.asarray(g), lam), rtol=1e-9)


def test_smw_solve_is_differentiable_through_panels_and_chunks(monkeypatch):
    """torch autograd through the panelled, chunked Gram and the fused U^T g (gradcheck in
    float64 against finite differences, in U and in g)."""
    torch = pytest.importorskip("torch")
    import ntkcore.solve as solve

    monkeypatch.setitem(solve.SYRK_PANEL_COLS, "cpu", 2)
    monkeypatch.setattr(solve, "SYRK_CHUNK_BYTES", 7 * 8 * 8)  # 7 rows of 8 float64
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(30, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(30, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda u, g: ntkcore.smw_solve(u, g, 0.3), (u, g))


@pytest.mark.parametrize("u_dtype,g_dtype", [("float32", "float64"), ("float64", "float32")])
@pytest.mark.parametrize("kind", ["array", "jacobian"])
@pytest.mark.parametrize("sketch", [None, ("gaussian", 30, 3)])
def test_smw_solve_promotes_mixed_dtypes(backend, rng, u_dtype, g_dtype, kind, sketch):
    """U and g of different float dtypes: the products run in the promoted dtype (torch's
    matmul refuses mixed dtypes, so U is cast for them) and d has g's dtype; against the
    float64 dense solve of the rounded inputs, to float32 accuracy (cond <= ~4 here)."""
    n, o = 6, 2
    jac = _jacobian(backend, rng, n=n, o=o)
    if kind == "array":
        u64 = rng.standard_normal((40, 7)) / 4
        U = backend.asarray(u64, u_dtype)
        u64 = backend.to_numpy(U).astype(np.float64)
    else:
        U = Jacobian([b.astype(getattr(_ns(backend), u_dtype)) for b in jac.blocks])
        u64 = backend.to_numpy(U.to_dense()).reshape(n * o, -1).T.astype(np.float64)
    g = backend.asarray(rng.standard_normal(u64.shape[0]), g_dtype)
    d = ntkcore.smw_solve(U, g, 2.0, sketch=sketch)
    assert d.dtype == g.dtype
    if sketch is not None:
        return  # the sketched direction is not the solve; the dtypes are the point here
    ref = _dense_solve(u64, backend.to_numpy(g).astype(np.float64), 2.0)
    err = np.linalg.norm(backend.to_numpy(d).astype(np.float64) - ref) / np.linalg.norm(ref)
    c = np.linalg.cond(2.0 * np.eye(u64.shape[0]) + u64 @ u64.T)
    assert err <= solve_tol(np.float32, c, computations=2), err
