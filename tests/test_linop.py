"""The linear-operator interface (ntkcore.linop): composition, adjoint, identity and the SciPy
export, against dense float64 NumPy matrices."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import scipy.sparse.linalg

import ntkcore
from ntkcore.jacobian import DenseBlock, Jacobian, KroneckerBlock
from ntkcore.linop import AdjointOperator, ArrayOperator, IdentityOperator, LinearOperator
from tests.tolerances import gamma


def _dense(backend, op) -> np.ndarray:
    """The matrix of ``op`` from its products with the identity (float64 NumPy)."""
    return backend.to_numpy(op.matmat(backend.asarray(np.eye(op.shape[1]))))


def _check(backend, op, ref: np.ndarray, rng, terms: int) -> None:
    """matmat / matvec / rmatmat / rmatvec / ``@`` of ``op`` against the dense ``ref`` (M, N),
    each within gamma_terms of |ref| |x| (the bound of a sum of ``terms`` products)."""
    m, n = ref.shape
    assert tuple(op.shape) == (m, n)
    v, w = rng.standard_normal((n, 3)), rng.standard_normal((m, 3))
    tol = gamma(np.float64, terms)
    cases = [(op.matmat, v, ref @ v, np.abs(ref) @ np.abs(v)),
             (op.matvec, v[:, 0], ref @ v[:, 0], np.abs(ref) @ np.abs(v[:, 0])),
             (op.__matmul__, v, ref @ v, np.abs(ref) @ np.abs(v)),
             (op.rmatmat, w, ref.T @ w, np.abs(ref.T) @ np.abs(w)),
             (op.rmatvec, w[:, 0], ref.T @ w[:, 0], np.abs(ref.T) @ np.abs(w[:, 0])),
             (op.T.__matmul__, w, ref.T @ w, np.abs(ref.T) @ np.abs(w))]
    for f, x, want, bound in cases:
        got = f(backend.asarray(x))
        assert backend.is_native(got)
        assert np.all(np.abs(backend.to_numpy(got) - want) <= tol * bound + 1e-300)


def test_composition_matches_dense(backend, rng):
    a, b = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    c, s = rng.standard_normal((4, 3)), rng.standard_normal((5, 5))
    A, B, C, S = (ArrayOperator(backend.asarray(x)) for x in (a, b, c, s))
    eye = IdentityOperator(5)
    _check(backend, A, a, rng, 4)
    _check(backend, A + B, a + b, rng, 5)
    _check(backend, A - B, a - b, rng, 5)
    _check(backend, -A, -a, rng, 4)
    _check(backend, 2.5 * A, 2.5 * a, rng, 5)
    _check(backend, A * np.float64(0.5), 0.5 * a, rng, 5)
    _check(backend, A @ C, a @ c, rng, 8)
    _check(backend, A.T, a.T, rng, 5)
    _check(backend, (A @ C).T, (a @ c).T, rng, 8)
    _check(backend, S @ A - 0.3 * (eye @ B), s @ a - 0.3 * b, rng, 10)
    _check(backend, S + 0.3 * eye, s + 0.3 * np.eye(5), rng, 6)
    assert A.T.T is A


def test_adjoint_identity(backend, rng):
    """<A x, y> = <x, A^T y> for a composed operator and a Jacobian (dense + Kronecker
    blocks) as an (N O, P) operator, whose matrix is the dense Jacobian reshaped."""
    n, o = 4, 2
    jd = rng.standard_normal((n, o, 7))
    a, g = rng.standard_normal((n, 3, 5)), rng.standard_normal((n, 3, o, 2))
    J = Jacobian([DenseBlock(backend.asarray(jd)),
                  KroneckerBlock(backend.asarray(a), backend.asarray(g))])
    jop = J.as_operator()
    ref = backend.to_numpy(J.to_dense()).reshape(n * o, J.num_params)
    assert tuple(jop.shape) == ref.shape
    np.testing.assert_allclose(_dense(backend, jop), ref, rtol=0, atol=gamma(np.float64, 10)
                               * np.abs(ref).max() * 10)
    square = ArrayOperator(backend.asarray(rng.standard_normal((n * o, n * o))))
    for op in (jop, 3.0 * (square @ jop) + jop, jop.T @ square):
        x = rng.standard_normal(op.shape[1])
        y = rng.standard_normal(op.shape[0])
        ax = backend.to_numpy(op @ backend.asarray(x))
        aty = backend.to_numpy(op.T @ backend.asarray(y))
        scale = np.abs(_dense(backend, op)).sum() * np.abs(x).max() * np.abs(y).max()
        assert abs(ax @ y - x @ aty) <= gamma(np.float64, 4 * sum(op.shape)) * scale


def test_identity_and_split(backend, rng):
    k = rng.standard_normal((6, 6))
    K = ArrayOperator(backend.asarray(k))
    eye = IdentityOperator(6)
    v = backend.asarray(rng.standard_normal((6, 2)))
    assert eye @ v is v and eye.T @ v is v
    like = backend.asarray(np.zeros(1))
    np.testing.assert_array_equal(backend.to_numpy(eye.diagonal(like)), np.ones(6))
    np.testing.assert_array_equal(backend.to_numpy(eye.columns([1, 4], like)),
                                  np.eye(6)[:, [1, 4]])
    assert eye.split_identity() == (None, 1.0)
    base, shift = (K + 0.5 * eye + 0.25 * eye).split_identity()
    assert shift == 0.75
    np.testing.assert_array_equal(_dense(backend, base), k)
    base, shift = (2.0 * (K + eye)).split_identity()
    assert shift == 2.0
    np.testing.assert_array_equal(_dense(backend, base), 2.0 * k)
    assert K.split_identity() == (K, 0.0)
    # the preconditioners' pieces of a sum: diagonal and columns
    op = K + 0.5 * eye
    ref = k + 0.5 * np.eye(6)
    np.testing.assert_allclose(backend.to_numpy(op.diagonal(like)), np.diag(ref), rtol=0,
                               atol=gamma(np.float64, 2) * np.abs(ref).max())
    np.testing.assert_allclose(backend.to_numpy(op.columns([0, 3], like)), ref[:, [0, 3]],
                               rtol=0, atol=gamma(np.float64, 2) * np.abs(ref).max())


def test_cg_solve_takes_a_composed_ridge(backend, rng):
    """cg_solve(K + c I, y) solves (K + c I) x = y (the ridge is split off for the
    preconditioner), as cg_solve(K, y, reg=c) does."""
    if backend.name == "jax":
        pytest.skip("jax CG is slow in eager mode")
    n, c = 30, 0.1
    f = rng.standard_normal((n, 8))
    k = f @ f.T
    y = rng.standard_normal(n)
    ref = scipy.linalg.solve(k + c * np.eye(n), y, assume_a="pos")
    op = ArrayOperator(backend.asarray(k)) + c * IdentityOperator(n)
    for pc in ("nystrom", "pivoted_cholesky", None):
        x, rep = ntkcore.cg_solve(op, backend.asarray(y), tol=1e-12, preconditioner=pc,
                                  rank=8)
        assert rep.converged
        cond = np.linalg.cond(k + c * np.eye(n))
        err = np.linalg.norm(backend.to_numpy(x) - ref) / np.linalg.norm(ref)
        assert err <= cond * 1e-12 * 10


def test_scipy_export(rng):
    from ntkcore.backends.numpy import to_scipy

    a, c = rng.standard_normal((5, 4)), rng.standard_normal((4, 4))
    A = ArrayOperator(a)
    for op, ref in ((A, a), (A @ ArrayOperator(c) + A, a @ c + a)):
        s = to_scipy(op)
        assert isinstance(s, scipy.sparse.linalg.LinearOperator)
        assert s.shape == ref.shape and s.dtype == np.float64
        v, w = rng.standard_normal(4), rng.standard_normal((5, 2))
        tol = gamma(np.float64, 10)
        np.testing.assert_allclose(s @ v, ref @ v, rtol=0, atol=tol * np.abs(ref).sum())
        np.testing.assert_allclose(s.matvec(v[:, None]), (ref @ v)[:, None], rtol=0,
                                   atol=tol * np.abs(ref).sum())
        np.testing.assert_allclose(s.rmatmat(w), ref.T @ w, rtol=0,
                                   atol=tol * np.abs(ref).sum())
        np.testing.assert_allclose(s.rmatvec(w[:, 0]), ref.T @ w[:, 0], rtol=0,
                                   atol=tol * np.abs(ref).sum())
    # a SciPy solver on the exported K + c I
    n, cc = 20, 0.5
    f = rng.standard_normal((n, 5))
    k = f @ f.T
    y = rng.standard_normal(n)
    x, info = scipy.sparse.linalg.cg(to_scipy(ArrayOperator(k) + cc * IdentityOperator(n)), y,
                                     rtol=1e-12, atol=0.0)
    assert info == 0
    ref = np.linalg.solve(k + cc * np.eye(n), y)
    assert np.linalg.norm(x - ref) <= 10 * 1e-12 * np.linalg.cond(k + cc * np.eye(n)) * \
        np.linalg.norm(ref)
    with pytest.raises(TypeError, match="op must be"):
        to_scipy(a)


def test_bad_compositions_are_named(rng):
    A = ArrayOperator(rng.standard_normal((5, 4)))
    with pytest.raises(ValueError, match=r"cannot add operators of shapes \(5, 4\) and \(4, 4\)"):
        A + ArrayOperator(np.eye(4))
    with pytest.raises(ValueError, match="cannot compose operators"):
        A @ A
    with pytest.raises(TypeError):
        A * np.ones(3)
    with pytest.raises(TypeError):
        A + np.ones((5, 4))

    class NoAdjoint(LinearOperator):
        shape, dtype = (3, 3), np.float64

        def matmat(self, v):
            return v

    with pytest.raises(NotImplementedError, match="NoAdjoint has no adjoint"):
        NoAdjoint().T @ np.ones(3)
    assert isinstance(NoAdjoint().T, AdjointOperator)


@pytest.mark.parametrize("positions", [1, 3])
def test_seng_layer_factor_is_an_operator(rng, positions):
    """SENG's per-layer U = J_b^T (P_b, N) is a LinearOperator equal to the dense Jacobian."""
    torch = pytest.importorskip("torch")
    from ntkcore.backends.torch_seng import _Thin

    n = 6
    a = torch.as_tensor(rng.standard_normal((n, positions, 5)))
    g = torch.as_tensor(rng.standard_normal((n, positions, 1, 4)))
    for J in (Jacobian([KroneckerBlock(a, g)]),
              Jacobian([DenseBlock(torch.as_tensor(rng.standard_normal((n, 1, 7))))])):
        u = J.to_dense()[:, 0, :].T.numpy()  # (P_b, N)
        op = _Thin(J)
        assert isinstance(op, LinearOperator) and tuple(op.shape) == u.shape
        c, v = rng.standard_normal(n), rng.standard_normal(u.shape[0])
        tol = gamma(np.float64, 2 * positions * 20)
        np.testing.assert_allclose(op.matvec(torch.as_tensor(c)).numpy(), u @ c, rtol=0,
                                   atol=tol * (np.abs(u) @ np.abs(c)).max())
        np.testing.assert_allclose((op.T @ torch.as_tensor(v)).numpy(), u.T @ v, rtol=0,
                                   atol=tol * (np.abs(u.T) @ np.abs(v)).max())


def test_array_operator_promotes_a_wider_operand(backend, rng):
    """A float32 ArrayOperator times float64 vectors (both products) runs in float64: equal,
    to float64 rounding, to the float64 product of the float32-rounded matrix."""
    a = backend.asarray(rng.standard_normal((7, 5)), "float32")
    a64 = backend.to_numpy(a).astype(np.float64)
    op = ArrayOperator(a)
    v, w = rng.standard_normal((5, 2)), rng.standard_normal((7, 2))
    av, atw = op.matmat(backend.asarray(v)), op.rmatmat(backend.asarray(w))
    assert av.dtype == atw.dtype == backend.asarray(v).dtype
    tol = gamma(np.float64, 7)
    assert np.abs(backend.to_numpy(av) - a64 @ v).max() <= tol * (np.abs(a64) @ np.abs(v)).max()
    assert (np.abs(backend.to_numpy(atw) - a64.T @ w).max()
            <= tol * (np.abs(a64.T) @ np.abs(w)).max())
