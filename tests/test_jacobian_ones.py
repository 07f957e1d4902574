"""KroneckerBlock with an implicit ones column (``ones=True``: the factor is [a, 1], a stored
without the column) against float64 references built from the explicit factor [a, 1]:
the dense einsum of tests/test_gram.py for kernels, dense Jacobian products for jvp / vjp,
and torch.func for the torch provider, whose Linear layers give such blocks."""

from __future__ import annotations

import numpy as np
import pytest

import ntkcore
from ntkcore import Jacobian, KroneckerBlock
from ntkcore.gram import _gram
from tests.conftest import force_panels
from tests.test_gram import dense_blocks, reference
from tests.tolerances import kernel_tol

pytestmark = [pytest.mark.usefixtures("tiny_tiles", "jax_quick_compile"),
              pytest.mark.supports("gram", "Jacobian")]

MODES = ["full", "trace", "diagonal"]


def _factors(rng, n, positions, o=2, d_in=3, d_out=4):
    """Per block: a (N, S, d_in) without the ones column, g (N, S, O, d_out), and the
    explicit factor [a, 1] for the reference."""
    out = []
    for s in positions:
        a = rng.standard_normal((n, s, d_in))
        g = rng.standard_normal((n, s, o, d_out))
        out.append((a, g, np.concatenate([a, np.ones((n, s, 1))], axis=2)))
    return out


def _jacobian(backend, factors, ones=True):
    return Jacobian([KroneckerBlock(backend.asarray(a if ones else ax), backend.asarray(g),
                                    f"b{i}", ones=ones)
                     for i, (a, g, ax) in enumerate(factors)])


def _explicit(factors):
    return [("kron", ax, g) for _, g, ax in factors]


@pytest.mark.parametrize("mode", MODES)
def test_implicit_ones_gram_matches_dense(monkeypatch, backend, rng, mode):
    """Self and cross kernels (the other side implicit or explicit), every strategy, row
    panels and budget tiles, layerwise: the kernel of the explicit factor [a, 1]."""
    if backend.name == "jax" and mode != "trace":
        pytest.skip("jax: the trace-mode variant covers it (compiles per shape)")
    force_panels(monkeypatch)
    f1 = _factors(rng, 11, [1, 3])
    f2 = _factors(rng, 7, [1, 2])
    j1 = _jacobian(backend, f1)
    assert [b.d_in for b in j1.blocks] == [4, 4]
    assert [b.num_params for b in j1.blocks] == [16, 16]
    for j2, ff in ((None, f1), (_jacobian(backend, f2), f2),
                   (_jacobian(backend, f2, ones=False), f2)):
        for layerwise in (False, True):
            ref = reference(_explicit(f1), _explicit(ff), mode, layerwise=layerwise)
            tol = kernel_tol(np.float64, 64, computations=4) * np.abs(ref).max()
            for strategy in (None, "positions", "materialise"):
                for budget in (None, 20_000):
                    k = _gram(j1, j2, mode=mode, layerwise=layerwise, max_memory=budget,
                              strategy=strategy)
                    np.testing.assert_allclose(backend.to_numpy(k), ref, rtol=0, atol=tol)


def test_implicit_ones_products_match_dense(backend, rng):
    """to_dense, jvp, vjp, the factor products and the explicit factor of a block with
    ``ones=True`` equal those of the explicit factor [a, 1] (float64 einsum references)."""
    (a, g, ax), = _factors(rng, 5, [3])
    blk = KroneckerBlock(backend.asarray(a), backend.asarray(g), "fc", ones=True)
    dense = dense_blocks([("kron", ax, g)])[0]  # (N, O, d_out (d_in + 1))
    tol = kernel_tol(np.float64, 64) * max(1.0, np.abs(dense).max())
    np.testing.assert_allclose(backend.to_numpy(blk.to_dense()), dense, rtol=0, atol=tol)
    np.testing.assert_array_equal(backend.to_numpy(blk.explicit_a()), ax)
    np.testing.assert_array_equal(backend.to_numpy(blk.dense_a()), ax)
    v = rng.standard_normal(blk.num_params)
    c = rng.standard_normal((5, 2))
    ref_jvp = dense @ v
    ref_vjp = np.einsum("nop,no->p", dense, c)
    np.testing.assert_allclose(backend.to_numpy(blk.jvp(backend.asarray(v))), ref_jvp,
                               rtol=0, atol=tol * np.abs(v).sum())
    np.testing.assert_allclose(backend.to_numpy(blk.vjp(backend.asarray(c))), ref_vjp,
                               rtol=0, atol=tol * 10 * np.abs(c).sum())
    m = rng.standard_normal((4, 2))
    np.testing.assert_allclose(backend.to_numpy(blk.a_times(backend.asarray(m))), ax @ m,
                               rtol=1e-12, atol=1e-12)
    x = rng.standard_normal((5, 3, 2))
    np.testing.assert_allclose(backend.to_numpy(blk.a_transpose_times(backend.asarray(x))),
                               np.einsum("nsi,nsk->ik", ax, x), rtol=1e-12, atol=1e-12)


def test_implicit_ones_kept_by_block_operations(rng):
    """select, astype, with_arrays and Jacobian.concatenate keep ``ones``; an index factor
    cannot have it."""
    f = _factors(rng, 6, [1])
    j = _jacobian(type("B", (), {"asarray": staticmethod(np.asarray)}), f)
    both = Jacobian.concatenate([j.select(slice(0, 2)), j.select(slice(2, 6))])
    assert both.blocks[0].ones and j.select([0, 3]).blocks[0].ones
    assert j.blocks[0].astype(np.float32).ones and j.pseudo().blocks[0].ones
    np.testing.assert_array_equal(both.blocks[0].explicit_a(), f[0][2])
    np.testing.assert_allclose(ntkcore.gram(both, mode="trace"),
                               reference(_explicit(f), _explicit(f), "trace"), rtol=1e-12)
    with pytest.raises(ValueError, match="index factor"):
        KroneckerBlock(np.zeros((2, 1), dtype=np.int64), np.zeros((2, 1, 1, 3)), one_hot=4,
                       ones=True)


def test_torch_linear_blocks_use_the_input_without_a_copy(rng):
    """The torch provider's Linear blocks keep the bias column implicit: the first layer's
    factor is the input itself (no copy), and the kernel equals the float64 torch.func
    Jacobian contraction."""
    torch = pytest.importorskip("torch")
    from torch.func import functional_call, jacrev, vmap

    from ntkcore.backends.torch_jacobian import jacobian

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3),
                                torch.nn.Tanh(), torch.nn.Linear(3, 2, bias=False)).double()
    x = torch.from_numpy(rng.standard_normal((6, 5)))
    j = jacobian(model, x)
    assert [b.ones for b in j.blocks] == [True, True, False]
    assert j.blocks[0].a.data_ptr() == x.data_ptr()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, xn):
        return functional_call(model, p, (xn[None],))[0]

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    flat = torch.cat([jac[k].reshape(6, 2, -1) for k in params], dim=2)  # (N, O, P)
    ref = torch.einsum("nok,mpk->nmop", flat, flat).numpy()
    got = ntkcore.ntk(model, x, mode="full").numpy()
    tol = kernel_tol(np.float64, flat.shape[2], computations=4) * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)
