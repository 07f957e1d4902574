"""Preconditioned conjugate gradients (ntkcore.cg) against direct float64 solves."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings
from hypothesis import strategies as st

import ntkcore
from ntkcore import cg
from tests.tolerances import gamma

pytestmark = pytest.mark.supports("cg_solve")


def rbf_kernel(rng: np.random.Generator, n: int, d: int = 4, scale: float = 3.0) -> np.ndarray:
    x = rng.standard_normal((n, d))
    sq = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    return np.exp(-sq / scale)


def low_rank_kernel(rng: np.random.Generator, n: int, r: int) -> np.ndarray:
    f = rng.standard_normal((n, r))
    return f @ f.T


def skip_slow_jax(backend, keep: bool = False) -> None:
    """Eager JAX dispatch makes every CG iteration slow (seconds per test); JAX runs only with
    NTKCORE_SLOW_JAX=1 (the code is the same pure array API as for array_api_strict)."""
    if backend.name == "jax" and not (keep and os.environ.get("NTKCORE_SLOW_JAX")):
        pytest.skip("jax CG is slow in eager mode; set NTKCORE_SLOW_JAX=1")


def true_rel_residual(k: np.ndarray, reg: float, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    a = k + reg * np.eye(k.shape[0])
    res = y - a @ x
    return np.linalg.norm(res, axis=0) / np.linalg.norm(y, axis=0)


@pytest.mark.parametrize("preconditioner", [None, "nystrom", "pivoted_cholesky"])
@pytest.mark.parametrize("ycols", [None, 3])
def test_cg_matches_direct_solve(backend, rng, preconditioner, ycols):
    skip_slow_jax(backend, keep=(preconditioner == "nystrom" and ycols == 3))
    n, reg, tol = 60, 1e-2, 1e-10
    k = rbf_kernel(rng, n)
    y = rng.standard_normal((n,) if ycols is None else (n, ycols))
    ref = scipy.linalg.solve(k + reg * np.eye(n), y, assume_a="pos")
    x, report = cg.cg_solve(backend.asarray(k), backend.asarray(y), reg=reg, tol=tol,
                            preconditioner=preconditioner, rank=20)
    assert backend.is_native(x)
    assert tuple(x.shape) == y.shape
    xn = backend.to_numpy(x)
    assert report.converged
    assert report.iterations <= 10 * n
    # the reported residual is the true one
    np.testing.assert_allclose(np.atleast_1d(true_rel_residual(k, reg, xn, y)),
                               report.residuals, rtol=1e-3, atol=1e-14)
    assert report.max_residual <= 10 * tol
    cond = np.linalg.cond(k + reg * np.eye(n))
    err = np.linalg.norm(xn - ref) / np.linalg.norm(ref)
    assert err <= 10 * cond * tol


def test_cg_equals_cholesky_regression_path(backend, rng):
    skip_slow_jax(backend)
    n, m, reg = 50, 7, 1e-3
    k_all = rbf_kernel(rng, n + m)
    k, ks = k_all[:n, :n], k_all[n:, :n]
    y = rng.standard_normal((n, 2))
    ref = ks @ np.linalg.solve(k + reg * np.eye(n), y)
    pred = cg.cg_kernel_regression(backend.asarray(k), backend.asarray(y), backend.asarray(ks),
                                   reg=reg, tol=1e-11, rank=25)
    assert backend.is_native(pred)
    np.testing.assert_allclose(backend.to_numpy(pred), ref, rtol=1e-6, atol=1e-7)


def test_registered_operator_adapter(monkeypatch, rng):
    """A kind of object registered with ``register_operator_adapter`` is wrapped by its
    ``adapt`` (as ``k``) and brought local by its ``local`` (as ``y``), as dask arrays are."""

    class Boxed:  # neither an array nor an operator
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

    monkeypatch.setattr(cg, "_ADAPTERS", list(cg._ADAPTERS))
    cg.register_operator_adapter(lambda o: isinstance(o, Boxed),
                                 lambda o: cg.aslinearoperator(o.a), local=lambda o: o.a)
    n, reg, tol = 30, 1e-2, 1e-10
    k, y = rbf_kernel(rng, n), rng.standard_normal(n)
    ref = scipy.linalg.solve(k + reg * np.eye(n), y, assume_a="pos")
    x, report = cg.cg_solve(Boxed(k), Boxed(y), reg=reg, tol=tol)
    assert report.converged
    cond = np.linalg.cond(k + reg * np.eye(n))
    assert np.linalg.norm(x - ref) / np.linalg.norm(ref) <= 10 * cond * tol


def test_preconditioners_reduce_iterations(rng):
    n, reg = 200, 1e-3
    k = rbf_kernel(rng, n, scale=6.0)
    y = rng.standard_normal(n)
    its = {}
    for pc in (None, "nystrom", "pivoted_cholesky"):
        _, rep = cg.cg_solve(k, y, reg=reg, tol=1e-8, preconditioner=pc, rank=60)
        assert rep.converged
        its[pc] = rep.iterations
        assert rep.preconditioner == ("none" if pc is None else pc)
        assert rep.rank == (0 if pc is None else 60)
    assert its["nystrom"] < its[None] / 2
    assert its["pivoted_cholesky"] < its[None] / 2


def test_float32_torch(rng):
    torch = pytest.importorskip("torch")
    n, reg = 80, 1e-2
    k = rbf_kernel(rng, n)
    y = rng.standard_normal(n)
    x, rep = cg.cg_solve(torch.tensor(k, dtype=torch.float32),
                         torch.tensor(y, dtype=torch.float32), reg=reg)
    assert x.dtype == torch.float32
    assert rep.tol == pytest.approx(max(1e-6, 100 * np.finfo(np.float32).eps))
    assert rep.converged
    a = k + reg * np.eye(n)
    ref = np.linalg.solve(a, y)
    xd = x.numpy().astype(np.float64)
    # CG stops on its float32 recurrence residual <= tol |y|; the true residual differs by the
    # rounding of K, y and of the products with them: gamma_{n+2} (|A| |x| + |y|), in norm
    res_bound = rep.tol + gamma(np.float32, n + 2) * (
        np.linalg.norm(np.abs(a) @ np.abs(xd)) + np.linalg.norm(y)) / np.linalg.norm(y)
    res = np.linalg.norm(y - a @ xd) / np.linalg.norm(y)
    assert res <= res_bound, (res, res_bound)
    # hence the forward error: |x - x*| / |x*| <= cond(A) |r| / |y|
    assert np.linalg.norm(xd - ref) / np.linalg.norm(ref) <= np.linalg.cond(a) * res_bound


class MatmatOnly:
    """A user operator: only shape, dtype and matmat."""

    def __init__(self, k):
        self.k = k
        self.shape = k.shape
        self.dtype = k.dtype
        self.calls = 0

    def matmat(self, v):
        self.calls += 1
        return self.k @ v


class MatvecOnly:
    def __init__(self, k):
        self.k = k
        self.shape = k.shape
        self.dtype = k.dtype

    def matvec(self, v):
        assert v.ndim == 1
        return self.k @ v


@pytest.mark.parametrize("preconditioner", [None, "nystrom", "pivoted_cholesky"])
def test_duck_operators(rng, preconditioner):
    n, reg = 40, 1e-2
    k = rbf_kernel(rng, n)
    y = rng.standard_normal((n, 2))
    ref = np.linalg.solve(k + reg * np.eye(n), y)
    for op in (MatmatOnly(k), MatvecOnly(k)):
        x, rep = cg.cg_solve(op, y, reg=reg, tol=1e-10, preconditioner=preconditioner, rank=10)
        assert rep.converged
        np.testing.assert_allclose(x, ref, rtol=1e-6, atol=1e-8)


def test_generic_operator_fallbacks(rng):
    k = rbf_kernel(rng, 30)
    op = cg.aslinearoperator(MatmatOnly(k))
    like = np.zeros((30, 1))
    np.testing.assert_allclose(op.diagonal(like), np.diag(k))
    np.testing.assert_allclose(op.columns([3, 0, 29], like), k[:, [3, 0, 29]])


def test_nystrom_exact_on_low_rank(backend, rng):
    skip_slow_jax(backend)
    n, r = 50, 6
    k = low_rank_kernel(rng, n, r)
    pc = cg.nystrom_preconditioner(backend.asarray(k), 10, reg=0.1,
                                   like=backend.asarray(np.zeros((n, 1))))
    u, lam = backend.to_numpy(pc.u), backend.to_numpy(pc.eigenvalues)
    np.testing.assert_allclose((u * lam) @ u.T, k, atol=1e-8 * np.abs(k).max())
    np.testing.assert_allclose(np.sort(lam)[::-1][:r], np.linalg.eigvalsh(k)[::-1][:r],
                               rtol=1e-8)
    # sketch rank 10 > rank 6, so lam_10 = 0 and M^{-1} (K + mu I) = mu I exactly
    a = k + 0.1 * np.eye(n)
    ma = backend.to_numpy(pc.apply(backend.asarray(a)))
    np.testing.assert_allclose(ma, 0.1 * np.eye(n), atol=1e-8)


def test_pivoted_cholesky_reference(backend, rng):
    skip_slow_jax(backend)
    n, r = 40, 5
    k = low_rank_kernel(rng, n, r) + 1e-12 * np.eye(n)
    pc = cg.pivoted_cholesky_preconditioner(backend.asarray(k), 8, reg=0.5,
                                            like=backend.asarray(np.zeros((n, 1))))
    lmat = backend.to_numpy(pc.l)
    # independent reference: greedy pivoting, full Schur complements in numpy
    s = k.copy()
    piv = []
    for _ in range(r):
        i = int(np.argmax(np.diag(s)))
        piv.append(i)
        s = s - np.outer(s[:, i], s[:, i]) / s[i, i]
    assert list(pc.pivots[:r]) == piv
    np.testing.assert_allclose(lmat[:, :r] @ lmat[:, :r].T, k, atol=1e-8 * np.abs(k).max())
    # Woodbury application equals the inverse of L L^T + s I
    m = lmat @ lmat.T + pc.shift * np.eye(n)
    v = rng.standard_normal((n, 2))
    np.testing.assert_allclose(backend.to_numpy(pc.apply(backend.asarray(v))),
                               np.linalg.solve(m, v), rtol=1e-7, atol=1e-10)


def test_not_converged_warns_and_reports(rng):
    k = rbf_kernel(rng, 100, scale=8.0)
    y = rng.standard_normal(100)
    seen = []
    with pytest.warns(cg.ConvergenceWarning, match="did not converge"):
        _x, rep = cg.cg_solve(k, y, reg=1e-6, tol=1e-12, maxiter=3, preconditioner=None,
                             callback=lambda it, res: seen.append((it, res)))
    assert not rep.converged
    assert rep.iterations == 3
    assert [s[0] for s in seen] == [1, 2, 3]
    assert [s[1] for s in seen] == list(rep.history)
    assert "NOT converged" in str(rep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cg.cg_solve(k, y, reg=1e-6, tol=1e-12, maxiter=3, preconditioner=None, warn=False)


def test_x0_and_zero_rhs(rng):
    n, reg = 30, 0.1
    k = rbf_kernel(rng, n)
    y = rng.standard_normal((n, 2))
    y[:, 1] = 0.0
    ref = np.linalg.solve(k + reg * np.eye(n), y)
    x, rep = cg.cg_solve(k, y, reg=reg, tol=1e-10, x0=ref, preconditioner=None)
    assert rep.iterations == 0 and rep.converged
    x, rep = cg.cg_solve(k, y, reg=reg, tol=1e-10)
    assert rep.converged
    np.testing.assert_allclose(x, ref, atol=1e-8)
    assert np.all(x[:, 1] == 0)


def test_does_not_mutate_inputs(rng):
    k = rbf_kernel(rng, 20)
    y = rng.standard_normal(20)
    k0, y0 = k.copy(), y.copy()
    cg.cg_solve(k, y, reg=0.1, preconditioner="pivoted_cholesky", rank=5)
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(y, y0)


def test_bad_arguments(rng):
    k = rbf_kernel(rng, 10)
    y = rng.standard_normal(10)
    with pytest.raises(ValueError, match="y has 9 rows"):
        cg.cg_solve(k, y[:9])
    with pytest.raises(ValueError, match="square"):
        cg.cg_solve(k[:, :9], y)
    with pytest.raises(TypeError, match="linear operator"):
        cg.cg_solve("kernel", y)
    with pytest.raises(ValueError, match="preconditioner"):
        cg.cg_solve(k, y, preconditioner="jacobi")
    with pytest.raises(TypeError, match="preconditioner"):
        cg.cg_solve(k, y, preconditioner=3)
    with pytest.raises(ValueError, match="rank"):
        cg.cg_solve(k, y, rank=0)
    with pytest.raises(TypeError, match="rank"):
        cg.cg_solve(k, y, rank=2.5)
    with pytest.raises(ValueError, match="reg"):
        cg.cg_solve(k, y, reg=-1.0)
    with pytest.raises(ValueError, match="tol"):
        cg.cg_solve(k, y, tol=0.0)
    with pytest.raises(ValueError, match="maxiter"):
        cg.cg_solve(k, y, maxiter=-2)
    with pytest.raises(ValueError, match="x0"):
        cg.cg_solve(k, y, x0=y[:5])
    with pytest.raises(TypeError, match="floating"):
        cg.cg_solve(k, np.arange(10))
    with pytest.raises(ValueError, match="NaN"):
        cg.cg_solve(k, np.full(10, np.nan))
    with pytest.raises(TypeError, match="unknown conjugate-gradient option"):
        cg.cg_kernel_regression(k, y, k, tolerance=1e-3)
    with pytest.raises(ValueError, match="k_test_train must have N=10"):
        cg.cg_kernel_regression(k, y, k[:, :4])
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="one library"):
        cg.cg_solve(k, torch.tensor(y))


@settings(max_examples=15)
@given(n=st.integers(2, 40), cols=st.integers(1, 3), reg=st.floats(1e-3, 1.0),
       pc=st.sampled_from([None, "nystrom", "pivoted_cholesky"]), seed=st.integers(0, 2**16))
def test_cg_property(n, cols, reg, pc, seed):
    rng = np.random.default_rng(seed)
    f = rng.standard_normal((n, max(1, n // 2)))
    k = f @ f.T / f.shape[1]
    y = rng.standard_normal((n, cols))
    tol = 1e-9
    x, rep = cg.cg_solve(k, y, reg=reg, tol=tol, preconditioner=pc, rank=max(1, n // 3),
                         maxiter=5 * n)
    assert rep.converged
    assert np.all(true_rel_residual(k, reg, x, y) <= 10 * tol)


def test_public_exports():
    assert ntkcore.cg_solve is cg.cg_solve
    assert ntkcore.CGReport is cg.CGReport


# ---------------------------------------------------------------------------------------------
# KernelOperator: products from Jacobian factors, compared with dense einsum kernels
# ---------------------------------------------------------------------------------------------
def structured_jacobian(rng: np.random.Generator, n: int, o: int):
    from ntkcore import DenseBlock, Jacobian, KroneckerBlock

    parts = [
        ("kron", rng.standard_normal((n, 1, 5)), rng.standard_normal((n, 1, o, 4))),
        ("dense", rng.standard_normal((n, o, 6)), None),
        ("conv", rng.standard_normal((n, 2, 3)), rng.standard_normal((n, 2, o, 2))),
    ]

    def build(asarray):
        blocks = []
        for kind, a, g in parts:
            if kind == "dense":
                blocks.append(DenseBlock(asarray(a), name=kind))
            else:
                blocks.append(KroneckerBlock(asarray(a), asarray(g), name=kind))
        return Jacobian(blocks)

    dense = build(np.asarray).to_dense()  # (N, O, P) float64 reference
    return build, dense


@pytest.mark.parametrize("method", ["tiles", "factors"])
@pytest.mark.parametrize("mode", ["trace", "full"])
def test_kernel_operator_products(backend, rng, method, mode):
    skip_slow_jax(backend)
    from ntkcore.operators import KernelOperator

    n, o, reg = 23, 2, 0.3
    build, d = structured_jacobian(rng, n, o)
    jac = build(backend.asarray)
    if mode == "trace":
        k = np.einsum("nop,mop->nm", d, d)
    else:
        k = np.einsum("nop,mqp->nomq", d, d).reshape(n * o, n * o)
    op = KernelOperator(jac, mode=mode, block=7, reg=reg, method=method)
    assert op.shape == k.shape
    v = rng.standard_normal((k.shape[0], 3))
    got = backend.to_numpy(op.matmat(backend.asarray(v)))
    np.testing.assert_allclose(got, k @ v + reg * v, rtol=1e-10, atol=1e-10)
    got1 = op.matvec(backend.asarray(v[:, 0]))
    assert backend.is_native(got1)
    np.testing.assert_allclose(backend.to_numpy(got1), k @ v[:, 0] + reg * v[:, 0],
                               rtol=1e-10, atol=1e-10)
    like = backend.asarray(v)
    np.testing.assert_allclose(backend.to_numpy(op.diagonal(like)), np.diag(k) + reg,
                               rtol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(op.columns([4, 0], like)),
                               (k + reg * np.eye(k.shape[0]))[:, [4, 0]], rtol=1e-10,
                               atol=1e-10)
    if method == "tiles":
        # symmetric: 4 row blocks -> 4 * 5 / 2 = 10 tiles per product, never the whole kernel
        before = op.tiles_computed
        op.matmat(backend.asarray(v))
        assert op.tiles_computed - before == 10


def test_kernel_operator_cross_and_regression(backend, rng):
    skip_slow_jax(backend)
    from ntkcore.operators import KernelOperator

    n, m, o, reg = 30, 9, 2, 1e-2
    build, d = structured_jacobian(rng, n + m, o)
    jac = build(backend.asarray)
    k_all = np.einsum("nop,mop->nm", d, d)
    y = rng.standard_normal(n)
    ref = k_all[n:, :n] @ np.linalg.solve(k_all[:n, :n] + reg * np.eye(n), y)
    train, test = jac.select(slice(0, n)), jac.select(slice(n, n + m))
    op = KernelOperator(train, block=8, reg=reg)
    cross = KernelOperator(test, train, block=8)
    assert cross.shape == (m, n)
    for pc in ("nystrom", "pivoted_cholesky"):
        pred = cg.cg_kernel_regression(op, backend.asarray(y), cross, tol=1e-11, rank=10,
                                       preconditioner=pc)
        assert backend.is_native(pred)
        np.testing.assert_allclose(backend.to_numpy(pred), ref, rtol=1e-6, atol=1e-8)


def test_kernel_operator_float32_factors_accumulate_in_vector_dtype(rng):
    from ntkcore.operators import KernelOperator

    build, d = structured_jacobian(rng, 15, 1)
    jac = build(lambda a: np.asarray(a, dtype=np.float32))
    k = np.einsum("nop,mop->nm", d, d)
    v = rng.standard_normal((15, 1))
    got = KernelOperator(jac, block=4).matmat(v)
    assert got.dtype == np.float64
    # only the factors were rounded to float32 (relative u each, so 2u per product of a
    # Kronecker pair and 4u per product of two Jacobian entries); the sums run in float64
    # Kernel of |factors|: sum_s |g_s| |a_s| >= |J| entrywise, so kabs @ |v| bounds the sum of
    # |terms|; float64 sums: 20 + 6 + 2 * 2 * 6 = 50 products per entry, 15 per row of K v
    dabs = build(lambda a: np.abs(np.asarray(a))).to_dense()
    kabs = np.einsum("nop,mop->nm", dabs, dabs)
    bound = (gamma(np.float32, 4) + gamma(np.float64, 50 + 15)) * (kabs @ np.abs(v))
    assert np.all(np.abs(got - k @ v) <= bound), np.max(np.abs(got - k @ v) / bound)


def test_kernel_operator_budget_below_a_useful_tile(rng):
    """A max_memory that cannot hold a tile of min(block, 8) samples a side raises at the
    first product, quoting the value and the smallest budget; that budget works."""
    import re

    from ntkcore.operators import KernelOperator

    build, d = structured_jacobian(rng, 30, 2)
    jac = build(np.asarray)
    k = np.einsum("nop,mop->nm", d, d)
    v = rng.standard_normal((30, 2))
    with pytest.raises(ValueError, match=r"max_memory='200B' \(200 bytes\)") as info:
        KernelOperator(jac, block=10, max_memory="200B").matmat(v)
    need = int(re.search(r"max_memory >= (\d+) bytes", str(info.value)).group(1))
    got = KernelOperator(jac, block=10, max_memory=need).matmat(v)
    np.testing.assert_allclose(got, k @ v, rtol=1e-12, atol=1e-12 * np.abs(k).max())


def test_kernel_operator_resolves_the_default_budget_once(monkeypatch, rng):
    """The default budget is read from the device once, when the operator is built, not
    once per tile; every tile gets that budget, still marked as the default (so gram's plan
    cache rounds it), and the products match the dense kernel."""
    from ntkcore.backends.numpy import NumpyBackend
    from ntkcore.operators import KernelOperator

    reads = []
    monkeypatch.setattr(NumpyBackend, "free_memory",
                        lambda self, device: reads.append(1) or 8 * 2**30)
    build, d = structured_jacobian(rng, 30, 2)
    jac = build(np.asarray)
    k = np.einsum("nop,mop->nm", d, d)
    v = rng.standard_normal((30, 2))
    op = KernelOperator(jac, block=10)
    assert op.max_memory == 2 * 2**30 and op.max_memory.default
    got = op.matmat(v)
    assert op.tiles_computed == 6 and len(reads) == 1
    np.testing.assert_allclose(got, k @ v, rtol=1e-12, atol=1e-12 * np.abs(k).max())


def test_kernel_operator_bad_arguments(rng):
    from ntkcore.operators import KernelOperator

    build, _ = structured_jacobian(rng, 10, 2)
    jac = build(np.asarray)
    with pytest.raises(TypeError, match=r"J1 must be an ntkcore\.Jacobian"):
        KernelOperator(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="mode"):
        KernelOperator(jac, mode="diagonal")
    with pytest.raises(ValueError, match="method"):
        KernelOperator(jac, method="magic")
    with pytest.raises(ValueError, match="block"):
        KernelOperator(jac, block=0)
    with pytest.raises(ValueError, match="reg"):
        KernelOperator(jac, reg=-1.0)
    with pytest.raises(ValueError, match="symmetric"):
        KernelOperator(jac, jac.select(slice(0, 3)), reg=1.0)
    op = KernelOperator(jac)
    with pytest.raises(ValueError, match=r"v must have shape \(10, k\)"):
        op.matmat(np.zeros((9, 1)))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="v is a torch"):
        op.matmat(torch.zeros((10, 1), dtype=torch.float64))


def test_kernel_regression_solver_cg(backend, rng):
    skip_slow_jax(backend)
    n, m, reg = 40, 6, 1e-2
    k_all = rbf_kernel(rng, n + m)
    k, ks = backend.asarray(k_all[:n, :n]), backend.asarray(k_all[n:, :n])
    y = backend.asarray(rng.standard_normal(n))
    chol = ntkcore.kernel_regression(k, y, ks, reg=reg)
    it = ntkcore.kernel_regression(k, y, ks, reg=reg, solver="cg", tol=1e-11, rank=15)
    assert backend.is_native(it)
    np.testing.assert_allclose(backend.to_numpy(it), backend.to_numpy(chol), rtol=1e-7,
                               atol=1e-9)
    with pytest.raises(ValueError, match="solver"):
        ntkcore.kernel_regression(k, y, ks, solver="lu")
    with pytest.raises(TypeError, match="only to solver='cg'"):
        ntkcore.kernel_regression(k, y, ks, tol=1e-3)


# -- differentiating through cg_solve: an implicit adjoint, one more solve in the backward --
def _graph_nodes(t) -> int:
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(f for f, _ in node.next_functions)
    return len(seen)


class _CountingOperator(ntkcore.linop.LinearOperator):
    """A dense kernel used only through products, which it counts."""

    symmetric = True

    def __init__(self, k):
        self.k, self.shape, self.dtype, self.calls = k, tuple(k.shape), k.dtype, 0

    def matmat(self, v):
        self.calls += 1
        return self.k @ v


def _grad_problem(rng, n=40, reg=1e-2):
    k = rbf_kernel(rng, n)
    k = (k + k.T) / 2  # exactly symmetric: used as is, so its gradient is not symmetrised
    a = k + reg * np.eye(n)
    return k, rng.standard_normal((n, 2)), rng.standard_normal((n, 2)), reg, np.linalg.cond(a)


@pytest.mark.parametrize("lib", ["torch", "jax"])
def test_cg_gradient_matches_direct_solve_gradient(rng, lib):
    """d/db and d/dK of <w, x(K, b)> through cg_solve against autograd through the
    framework's direct float64 solve."""
    k, b, w, reg, cond = _grad_problem(rng)
    tol = 1e-12
    if lib == "torch":
        torch = pytest.importorskip("torch")

        def grads(solve):
            kt = torch.tensor(k, requires_grad=True)
            bt = torch.tensor(b, requires_grad=True)
            (solve(kt, bt) * torch.tensor(w)).sum().backward()
            return kt.grad.numpy(), bt.grad.numpy()

        eye = torch.eye(len(k), dtype=torch.float64)
        direct = grads(lambda kt, bt: torch.linalg.solve(kt + reg * eye, bt))
    else:
        jax = pytest.importorskip("jax")
        jnp = jax.numpy

        def grads(solve):
            loss = lambda kj, bj: jnp.sum(solve(kj, bj) * w)  # noqa: E731
            return tuple(np.asarray(g) for g in jax.grad(loss, argnums=(0, 1))(
                jnp.asarray(k), jnp.asarray(b)))

        direct = grads(lambda kj, bj: jnp.linalg.solve(kj + reg * jnp.eye(len(k)), bj))
    via_cg = grads(lambda kk, bb: ntkcore.cg_solve(kk, bb, reg=reg, tol=tol,
                                                   preconditioner=None)[0])
    # forward and adjoint solves each within cond * tol (normwise), plus the direct solve's
    # rounding; the K gradient -A^{-1} w x^T carries both
    bound = 2 * cond * tol + 2 * cond * 2 * np.finfo(np.float64).eps
    for got, ref in zip(via_cg, direct, strict=True):
        assert np.linalg.norm(got - ref) <= bound * np.linalg.norm(ref)


def test_cg_backward_is_one_solve_not_the_iterations():
    """torch: the graph of x does not grow with the iterations, and the backward pass costs
    the products of one solve of the cotangent (with K an operator closing over a tensor)."""
    torch = pytest.importorskip("torch")
    k, b, w, reg, cond = _grad_problem(np.random.default_rng(1))
    sizes = []
    for tol in (1e-3, 1e-12):
        kt = torch.tensor(k, requires_grad=True)
        op = _CountingOperator(kt)
        x, report = ntkcore.cg_solve(op, torch.tensor(b), reg=reg, tol=tol,
                                     preconditioner=None)
        sizes.append((report.iterations, _graph_nodes(x)))
        before = op.calls
        (x * torch.tensor(w)).sum().backward()
        _, adjoint = ntkcore.cg_solve(k, w, reg=reg, tol=tol, preconditioner=None)
        assert op.calls - before == adjoint.iterations
        lam, xs = np.linalg.solve(k + reg * np.eye(len(k)), w), x.detach().numpy()
        ref = -lam @ xs.T
        assert np.linalg.norm(kt.grad.numpy() - ref) <= 4 * cond * tol * np.linalg.norm(ref)
    (it_loose, nodes_loose), (it_tight, nodes_tight) = sizes
    assert it_tight > it_loose
    assert nodes_tight == nodes_loose


def test_cg_backward_is_one_solve_jax():
    """jax.grad (eager): the backward pass runs one CG solve of the cotangent (products
    counted on an operator; JAX differentiates with respect to y here, see docs)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    k, b, w, reg, cond = _grad_problem(np.random.default_rng(2), n=20)
    op = _CountingOperator(jnp.asarray(k))

    def loss(bj):
        return jnp.sum(ntkcore.cg_solve(op, bj, reg=reg, tol=1e-12, preconditioner=None)[0] * w)

    _, vjp = jax.vjp(loss, jnp.asarray(b))
    before = op.calls
    (grad,) = vjp(1.0)
    _, adjoint = ntkcore.cg_solve(k, w, reg=reg, tol=1e-12, preconditioner=None)
    assert op.calls - before == adjoint.iterations
    ref = np.linalg.solve(k + reg * np.eye(len(k)), w)
    assert np.linalg.norm(np.asarray(grad) - ref) <= 2 * cond * 1e-12 * np.linalg.norm(ref)
