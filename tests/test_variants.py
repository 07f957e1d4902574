"""A kernel mode and a Gram route are classes in one registry each: a toy mode and a toy
route, defined and registered here only, are used by gram, plan_gram and ntk without any other
edit, and their kernels match float64 einsum references over dense Jacobians."""

import sys

import array_api_compat.numpy as xp
import numpy as np
import pytest

import ntkcore
from ntkcore import _api as api
from ntkcore import modes
from ntkcore.gram import Route, _gram, _take, _take_inputs, plan_gram
from ntkcore.jacobian import DenseBlock, Jacobian, KroneckerBlock, flat_weights
from ntkcore.models import MLP

pytestmark = [pytest.mark.usefixtures("tiny_tiles"), pytest.mark.supports("gram", "ntk")]


class SummedMode(modes.TraceMode):
    r"""Toy mode "summed": :math:`\sum_{o,p} \Theta[n,m,o,p]`, shape (N1, N2), the trace
    kernel of the Jacobian of :math:`\sum_o f_o` (its pieces sum the outputs, then contract
    as trace mode does)."""

    __slots__ = ()
    name = "summed"

    def dense(self, xp, j1, j2, same):
        s1 = xp.sum(j1, axis=1, keepdims=True)
        return super().dense(xp, s1, s1 if same else xp.sum(j2, axis=1, keepdims=True), same)

    def positions(self, xp, aa, g1, g2, same):
        s1 = xp.sum(g1, axis=2, keepdims=True)
        return super().positions(xp, aa, s1, s1 if same else xp.sum(g2, axis=2, keepdims=True),
                                 same)

    def pair_products(self, xp, x1, x2, o):
        m = x1.shape[0]
        s1, s2 = (xp.sum(xp.reshape(x, (m, o, -1)), axis=1) for x in (x1, x2))
        return super().pair_products(xp, s1, s2, 1)


class SplitColumnsRoute(Route):
    """Toy route "split": any block as its (materialised) per-sample Jacobian, contracted as
    two GEMMs over the halves of its columns and summed: exact, but not the dense route's
    contraction.  Claims one flop per sample pair, so the planner always prefers it."""

    name = "split"

    def offers(self, pair, forced):
        return forced in (None, "split")

    def _rows(self, xp, block, sl, dtype):
        if isinstance(block, DenseBlock):
            return _take(xp, block.jac, sl, dtype)
        a = _take_inputs(xp, block, sl, dtype, False)  # ones column appended
        return flat_weights(xp, a, _take(xp, block.g, sl, dtype), block.one_hot)

    def cost(self, pair, mode, o, r, c, chunk=None):
        p = pair.b1.num_params
        return (r + c) * o * p * 2, r * c

    def tile(self, xp, pair, rows, cols, same, dtype, mode, ctx):
        j1, j2 = self._rows(xp, pair.b1, rows, dtype), self._rows(xp, pair.b2, cols, dtype)
        h = j1.shape[2] // 2
        t = mode.dense(xp, j1[:, :, :h], j2[:, :, :h], False)
        return t + mode.dense(xp, j1[:, :, h:], j2[:, :, h:], False)


@pytest.fixture
def summed(monkeypatch):
    """Register the toy mode for one test."""
    monkeypatch.setitem(modes._REGISTRY, "summed", SummedMode("summed"))


@pytest.fixture
def split(monkeypatch):
    """Register the toy route for one test (the plan cache keys on the routes)."""
    monkeypatch.setitem(sys.modules["ntkcore.gram"].ROUTES, "split", SplitColumnsRoute())


def _jacobians(rng, n1=11, n2=7, o=3):
    def one(n, t):
        return Jacobian([
            DenseBlock(rng.standard_normal((n, o, 13)), name="dense"),
            KroneckerBlock(rng.standard_normal((n, 1, 5)), rng.standard_normal((n, 1, o, 4)),
                           name="kron1"),
            KroneckerBlock(rng.standard_normal((n, t, 6)), rng.standard_normal((n, t, o, 3)),
                           name="positions"),
            KroneckerBlock(rng.integers(-1, 9, (n, t)), rng.standard_normal((n, t, o, 2)),
                           one_hot=9, name="index")])
    return one(n1, 4), one(n2, 5)


def _reference(j1, j2, mode):
    d1, d2 = j1.to_dense(), j2.to_dense()
    if mode == "summed":
        return np.einsum("nok,mpk->nm", d1, d2)
    k = np.einsum("nok,mpk->nmop", d1, d2)
    return {"full": k, "trace": np.einsum("nmoo->nm", k),
            "diagonal": np.einsum("nmoo->nmo", k)}[mode]


@pytest.mark.parametrize("strategy", [None, "positions", "materialise", "pairs", "tokens"])
def test_toy_mode_in_gram(summed, strategy):
    rng = np.random.default_rng(0)
    j1, j2 = _jacobians(rng)
    assert plan_gram(j1, j2, mode="summed", max_memory=2**13, strategy=strategy).num_tiles > 1
    for a, b in ((j1, j2), (j1, None)):
        k = _gram(a, b, mode="summed", strategy=strategy, max_memory=2**13)
        np.testing.assert_allclose(k, _reference(a, a if b is None else b, "summed"),
                                   rtol=1e-12, atol=1e-10)
    sym = ntkcore.gram(j1, mode="summed")
    np.testing.assert_array_equal(sym, sym.T)  # mirrored exactly, as the built-in modes
    # its own dense() reads the O axis: the materialise route keeps the (r, O, P) rows
    assert modes.TraceMode.flat_rows and not SummedMode.flat_rows
    assert SummedMode.block_products is modes.Mode.block_products  # its own pair_products
    with pytest.raises(ValueError, match=r"mode must be one of \('full', 'trace', 'diagonal'"
                                         r", 'summed'\)"):
        ntkcore.gram(j1, mode="Summed")


def test_toy_mode_in_ntk(monkeypatch, summed):
    mlp = MLP.random([4, 6, 3], xp=xp, seed=0, dtype=xp.float64)
    x = np.random.default_rng(1).standard_normal((9, 4))
    j = mlp.jacobian(x) if hasattr(mlp, "jacobian") else ntkcore.jacobian(mlp, x)
    ref = _reference(j, j, "summed")
    np.testing.assert_allclose(ntkcore.ntk(mlp, x, mode="summed"), ref, rtol=1e-12)
    streamed, real = [], api._streamed
    monkeypatch.setattr(api, "_streamed", lambda *a: streamed.append(1) or real(*a))
    np.testing.assert_allclose(ntkcore.ntk(mlp, x, mode="summed", max_memory=3000), ref,
                               rtol=1e-12)  # factors beyond the budget: row blocks, assembled
    assert streamed  # by the mode's transpose


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_toy_route_in_gram_and_ntk(split, mode):
    rng = np.random.default_rng(2)
    j1, j2 = _jacobians(rng)
    plan = plan_gram(j1, j2, mode=mode)
    assert plan.strategies == ("split",) * 4  # the planner took the registered route
    assert plan_gram(j1, None, mode=mode, max_memory=2**14).num_tiles > 1
    for a, b in ((j1, j2), (j1, None)):
        k = ntkcore.gram(a, b, mode=mode, max_memory=2**14)
        np.testing.assert_allclose(k, _reference(a, a if b is None else b, mode),
                                   rtol=1e-12, atol=1e-10)
    mlp = MLP.random([4, 6, 3], xp=xp, seed=0, dtype=xp.float64)
    x = rng.standard_normal((9, 4))
    j = ntkcore.jacobian(mlp, x) if not hasattr(mlp, "jacobian") else mlp.jacobian(x)
    np.testing.assert_allclose(ntkcore.ntk(mlp, x, mode=mode), _reference(j, j, mode),
                               rtol=1e-12, atol=1e-12)


def test_toy_mode_on_toy_route(summed, split):
    rng = np.random.default_rng(3)
    j1, j2 = _jacobians(rng)
    np.testing.assert_allclose(ntkcore.gram(j1, j2, mode="summed"),
                               _reference(j1, j2, "summed"), rtol=1e-12, atol=1e-10)
