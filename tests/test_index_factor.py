"""KroneckerBlock index factors (``one_hot``) in every array library: each operation equals the
same operation on the block whose factor a is the materialised one-hot rows (float64), and
that block's operations are tested against dense references elsewhere (test_jacobian,
test_gram, test_sketch); here also directly against the dense Jacobian."""

from __future__ import annotations

import numpy as np
import pytest

from ntkcore import DenseBlock, Jacobian, KroneckerBlock, gram, smw_solve
from ntkcore.analysis import layer_traces
from ntkcore.gram import _gram
from ntkcore.sketch import sketch_jacobian
from tests.tolerances import kernel_tol, solve_tol

# many small eager JAX operations of changing shapes: compile them without XLA's passes
pytestmark = pytest.mark.usefixtures("jax_quick_compile")

V, D, N, S, O = 11, 3, 4, 5, 2


def _blocks(backend, rng):
    idx = rng.integers(-1, V, (N, S))
    idx[0, :2] = [V - 1, -1]
    g = rng.standard_normal((N, S, O, D))
    one_hot = (idx[..., None] == np.arange(V)).astype(np.float64)
    ib = KroneckerBlock(backend.asarray(idx, "int64"), backend.asarray(g), "emb", one_hot=V)
    db = KroneckerBlock(backend.asarray(one_hot), backend.asarray(g), "emb")
    dense = DenseBlock(backend.asarray(rng.standard_normal((N, O, 6))), "other")
    jd = np.concatenate([np.einsum("nsod,nsv->nodv", g, one_hot).reshape(N, O, D * V),
                         backend.to_numpy(dense.jac)], axis=2)
    return Jacobian([ib, dense]), Jacobian([db, dense]), jd


def _close(backend, x, ref, tol):
    x = backend.to_numpy(x)
    assert np.max(np.abs(x - ref)) <= tol * max(np.max(np.abs(ref)), 1e-300)


def test_index_factor_products(backend, rng):
    j, twin, jd = _blocks(backend, rng)
    assert j.blocks[0].num_params == V * D and j.blocks[0].a_width == 1
    tol = kernel_tol("float64", jd.shape[2] + 2, computations=2)
    _close(backend, j.to_dense(), jd, tol)
    k_full = np.einsum("nop,mqp->nmoq", jd, jd)
    for mode, ref in (("full", k_full), ("trace", np.einsum("nop,mop->nm", jd, jd)),
                      ("diagonal", np.einsum("nop,mop->nmo", jd, jd))):
        _close(backend, gram(j, mode=mode), ref, tol)
        for strategy in ("positions", "materialise"):
            _close(backend, _gram(j, mode=mode, strategy=strategy), ref, tol)
    _close(backend, gram(j[1:3], j, mode="full"), k_full[1:3], tol)
    v = rng.standard_normal(jd.shape[2])
    c = rng.standard_normal((N, O))
    _close(backend, j.jvp(backend.asarray(v)), jd @ v, tol)
    _close(backend, j.vjp(backend.asarray(c)), np.einsum("no,nop->p", c, jd), tol)
    _close(backend, layer_traces(j), backend.to_numpy(layer_traces(twin)), tol)
    assert j.nbytes < twin.nbytes


@pytest.mark.parametrize("method", ["uniform", "leverage", "gaussian", "sparse_sign"])
def test_index_factor_sketch(backend, rng, method):
    j, twin, _ = _blocks(backend, rng)
    js = sketch_jacobian(j, 20, method=method, seed=4)
    js2 = sketch_jacobian(twin, 20, method=method, seed=4)
    tol = kernel_tol("float64", V * D + 8, computations=2)
    for b, b2 in zip(js.blocks, js2.blocks, strict=True):
        for x, x2 in zip(b.arrays(), b2.arrays(), strict=True):
            _close(backend, x, backend.to_numpy(x2), tol)


def test_index_factor_smw(backend, rng):
    j, _, jd = _blocks(backend, rng)
    p = jd.shape[2]
    u = jd.reshape(N * O, p).T
    g = rng.standard_normal(p)
    a = 0.7 * np.eye(p) + u @ u.T
    ref = np.linalg.solve(a, g)
    d = backend.to_numpy(smw_solve(j, backend.asarray(g), 0.7))
    cond = np.linalg.cond(a)
    assert np.linalg.norm(d - ref) <= np.linalg.norm(ref) * (
        solve_tol("float64", cond, computations=2) + kernel_tol("float64", p, 2) * cond)


@pytest.mark.parametrize("method", ["tiles", "factors"])
def test_index_factor_kernel_operator(backend, rng, method):
    from ntkcore import KernelOperator

    j, _, jd = _blocks(backend, rng)
    op = KernelOperator(j, mode="trace", method=method)
    v = rng.standard_normal((N, 2))
    ref = np.einsum("nop,mop->nm", jd, jd) @ v
    _close(backend, op.matmat(backend.asarray(v)), ref,
           kernel_tol("float64", jd.shape[2] + N + 2, computations=2))
