"""Tests of the structured Jacobian (ntkcore/jacobian.py) against dense float64 references.

The reference Jacobian of a Kronecker block is built here with an einsum of its factors,
``J[n, o, i * d_in + j] = sum_s g[n, s, o, i] a[n, s, j]`` (row-major weight (d_out, d_in)),
independently of ``to_dense``; for one case it is also checked against torch autograd of the
layer itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ntkcore
from tests.tolerances import kernel_tol


def fixture_settings(max_examples: int) -> settings:
    return settings(max_examples=min(max_examples, settings.default.max_examples),
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow], deadline=None)


@st.composite
def jacobian_specs(draw):
    """(N, O, blocks) with blocks ("dense", P) or ("kron", S, d_in, d_out); N, S, O may be 1."""
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            blocks.append(("dense", draw(st.integers(1, 6))))
        else:
            blocks.append(("kron", draw(st.integers(1, 4)), draw(st.integers(1, 4)),
                           draw(st.integers(1, 4))))
    return draw(st.integers(1, 5)), draw(st.integers(1, 3)), blocks


def np_factors(spec, rng):
    n, o, blocks = spec
    out = []
    for b in blocks:
        if b[0] == "dense":
            out.append(("dense", rng.standard_normal((n, o, b[1]))))
        else:
            out.append(("kron", rng.standard_normal((n, b[1], b[2])),
                        rng.standard_normal((n, b[1], o, b[3]))))
    return out


def np_dense(factors):
    parts = []
    for f in factors:
        if f[0] == "dense":
            parts.append(f[1])
        else:
            n, _, o, _ = f[2].shape
            parts.append(np.einsum("nsoi,nsj->noij", f[2], f[1]).reshape(n, o, -1))
    return np.concatenate(parts, axis=2)


def build(backend, factors, names=None):
    blocks = []
    for i, f in enumerate(factors):
        name = None if names is None else names[i]
        if f[0] == "dense":
            blocks.append(ntkcore.DenseBlock(backend.asarray(f[1]), name=name))
        else:
            blocks.append(ntkcore.KroneckerBlock(backend.asarray(f[1]), backend.asarray(f[2]),
                                                 name=name))
    return ntkcore.Jacobian(blocks)


def skip_jax(backend):
    if backend.name == "jax":
        pytest.skip("jax compiles every new shape; covered by the fixed-shape tests")


# ---------------------------------------------------------------------------------------------
# dense form and products
# ---------------------------------------------------------------------------------------------
@fixture_settings(15)
@given(spec=jacobian_specs(), seed=st.integers(0, 2**31 - 1))
def test_dense_jvp_vjp_match_reference(backend, spec, seed):
    skip_jax(backend)
    rng = np.random.default_rng(seed)
    f = np_factors(spec, rng)
    j = build(backend, f)
    dense = np_dense(f)
    n, o, p = dense.shape
    assert (j.num_samples, j.num_outputs, j.num_params) == (n, o, p)
    assert sum(j.block_sizes) == p
    np.testing.assert_allclose(backend.to_numpy(j.to_dense()), dense, rtol=1e-12, atol=1e-12)
    v = rng.standard_normal(p)
    jv = j.jvp(backend.asarray(v))
    assert backend.is_native(jv)
    np.testing.assert_allclose(backend.to_numpy(jv), dense @ v, rtol=1e-10, atol=1e-10)
    c = rng.standard_normal((n, o))
    jtc = j.vjp(backend.asarray(c))
    assert backend.is_native(jtc)
    np.testing.assert_allclose(backend.to_numpy(jtc), np.einsum("nop,no->p", dense, c),
                               rtol=1e-10, atol=1e-10)


def test_jvp_vjp_promote_mixed_dtypes(backend, rng):
    """A float32 Jacobian times a float64 vector runs in float64, as NumPy's matmul would
    (torch's refuses mixed dtypes): exact products of the float32-rounded factors."""
    f = np_factors((4, 3, [("kron", 1, 3, 2), ("kron", 3, 2, 4), ("dense", 5)]), rng)
    f32 = backend.asarray(np.zeros(1), "float32").dtype
    j = ntkcore.Jacobian([b.astype(f32) for b in build(backend, f).blocks])
    assert j.dtype == f32
    # the float64 dense Jacobian of the float32-rounded factors
    dense = np_dense([tuple(x.astype(np.float32).astype(np.float64)
                            if isinstance(x, np.ndarray) else x for x in fac) for fac in f])
    v, c = rng.standard_normal(dense.shape[2]), rng.standard_normal((4, 3))
    jv, jtc = j.jvp(backend.asarray(v)), j.vjp(backend.asarray(c))
    assert jv.dtype == jtc.dtype == backend.asarray(v).dtype  # float64
    np.testing.assert_allclose(backend.to_numpy(jv), dense @ v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(jtc), np.einsum("nop,no->p", dense, c),
                               rtol=1e-12, atol=1e-12)


def test_fixed_shapes_all_backends(backend, rng):
    """One mixed Jacobian on every backend (jax included)."""
    f = np_factors((4, 3, [("kron", 1, 3, 2), ("kron", 3, 2, 4), ("dense", 5)]), rng)
    j = build(backend, f)
    dense = np_dense(f)
    np.testing.assert_allclose(backend.to_numpy(j.to_dense()), dense, rtol=1e-12)
    v, c = rng.standard_normal(dense.shape[2]), rng.standard_normal((4, 3))
    np.testing.assert_allclose(backend.to_numpy(j.jvp(backend.asarray(v))), dense @ v,
                               rtol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(j.vjp(backend.asarray(c))),
                               np.einsum("nop,no->p", dense, c), rtol=1e-10)
    sel = j.select([3, 1])
    np.testing.assert_allclose(backend.to_numpy(sel.to_dense()), dense[[3, 1]], rtol=1e-12)
    cat = ntkcore.Jacobian.concatenate([j[0:2], j[2:4]])
    np.testing.assert_allclose(backend.to_numpy(cat.to_dense()), dense, rtol=1e-12)


def test_kronecker_matches_torch_autograd_of_a_linear_layer(rng):
    """The factor convention (row-major (d_out, d_in), bias as a ones column) equals autograd."""
    torch = pytest.importorskip("torch")
    n, s, din, dout = 3, 4, 5, 2
    x = torch.tensor(rng.standard_normal((n, s, din)))
    w = torch.tensor(rng.standard_normal((dout, din)))
    bias = torch.tensor(rng.standard_normal(dout))
    head = torch.tensor(rng.standard_normal((dout, s, 2)))  # f_o = sum_{s,i} y[s,i] h[i,s,o]

    def f(w_, b_, xi):
        y = xi @ w_.T + b_  # (S, d_out)
        return torch.einsum("si,iso->o", torch.tanh(y), head)

    jw, jb = torch.func.vmap(torch.func.jacrev(f, argnums=(0, 1)), in_dims=(None, None, 0))(
        w, bias, x)  # (N, O, d_out, d_in), (N, O, d_out)
    ref = torch.cat([jw, jb[..., None]], dim=3).reshape(n, 2, -1).numpy()
    y = x @ w.T + bias
    g = torch.einsum("nsi,iso->nsoi", 1 - torch.tanh(y) ** 2, head)  # df_o / dy_s
    a = torch.cat([x, torch.ones(n, s, 1, dtype=x.dtype)], dim=2)
    block = ntkcore.KroneckerBlock(a, g)
    np.testing.assert_allclose(block.to_dense().numpy(), ref, rtol=1e-12, atol=1e-12)
    assert block.num_params == dout * (din + 1)


def test_per_sample_weights(backend, rng):
    skip_jax(backend)
    a, g = rng.standard_normal((3, 4, 2)), rng.standard_normal((3, 4, 2, 5))
    blk = ntkcore.KroneckerBlock(backend.asarray(a), backend.asarray(g))
    np.testing.assert_allclose(backend.to_numpy(blk.per_sample_weights()),
                               np.einsum("nsoi,nsj->noij", g, a), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# selection, concatenation, output contraction, names
# ---------------------------------------------------------------------------------------------
def test_select_and_concatenate(backend, rng):
    skip_jax(backend)
    f = np_factors((6, 2, [("kron", 2, 3, 2), ("dense", 4)]), rng)
    j = build(backend, f, names=["conv", "head"])
    dense = np_dense(f)
    np.testing.assert_allclose(backend.to_numpy(j[1:4].to_dense()), dense[1:4], rtol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(j.select(2).to_dense()), dense[[2]],
                               rtol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(j.select([5, 0, 0]).to_dense()),
                               dense[[5, 0, 0]], rtol=1e-12)
    parts = [j[0:1], j[1:5], j[5:6]]
    cat = ntkcore.Jacobian.concatenate(parts)
    assert cat.names == ("conv", "head") and cat.num_samples == 6
    np.testing.assert_allclose(backend.to_numpy(cat.to_dense()), dense, rtol=1e-12)


def test_concatenate_consume_drops_each_blocks_pieces_once_stacked(rng, monkeypatch):
    """``consume=True`` (what ``ntk`` uses for its sample batches): same result, the list is
    emptied, and when the second block is stacked the first block's pieces are already gone
    (the peak is the pieces plus one stacked block, not twice the pieces)."""
    import weakref

    from tests.conftest import make_case

    npc = make_case("numpy")
    f = np_factors((6, 2, [("kron", 2, 3, 2), ("dense", 4)]), rng)
    dense = np_dense(f)
    whole = build(npc, f, ["conv", "head"])
    parts = [whole[k:k + 2] for k in (0, 2, 4)]
    del whole
    first_block = [weakref.ref(j.blocks[0].a) for j in parts]
    alive_at_second: list[int] = []
    xp = parts[0].xp
    real = xp.concat

    def spy(arrays, axis=0):
        if len(alive_at_second) == 0 and arrays[0].ndim == 3 and arrays[0].shape[2] == 4:
            alive_at_second.append(sum(r() is not None for r in first_block))
        return real(arrays, axis=axis)

    monkeypatch.setattr(xp, "concat", spy)
    cat = ntkcore.Jacobian.concatenate(parts, consume=True)
    assert parts == [] and alive_at_second == [0]
    np.testing.assert_allclose(cat.to_dense(), dense, rtol=1e-12)


def _batches(backend, rng, sizes, positions=None):
    """Jacobians of consecutive sample batches of ``sizes`` (a Kronecker block of 3
    positions, or ``positions[i]`` in batch i, an index block of 2, or ``positions[i] - 1``
    but at least 1, and a dense block storing 3 of its 5 columns), and the float64 dense
    reference of all their samples."""
    from ntkcore.jacobian import trusted_blocks

    parts, dense = [], []
    for i, n in enumerate(sizes):
        s = 3 if positions is None else positions[i]
        si = 2 if positions is None else max(1, positions[i] - 1)
        a, g = rng.standard_normal((n, s, 2)), rng.standard_normal((n, s, 2, 3))
        idx = rng.integers(-1, 4, (n, si))
        gi = rng.standard_normal((n, si, 2, 3))
        stored = rng.standard_normal((n, 2, 3))
        with trusted_blocks():
            blocks = [ntkcore.KroneckerBlock(backend.asarray(a), backend.asarray(g), "conv"),
                      ntkcore.KroneckerBlock(backend.asarray(idx, "int64"), backend.asarray(gi),
                                             "emb", one_hot=4),
                      ntkcore.DenseBlock(backend.asarray(stored), "head",
                                         backend.asarray(np.array([0, 2, 4]), "int64"), 5)]
        parts.append(ntkcore.Jacobian(blocks))
        onehot = (idx[..., None] == np.arange(4)).astype(float)
        head = np.zeros((n, 2, 5))
        head[..., [0, 2, 4]] = stored
        dense.append(np.concatenate([np.einsum("nsoi,nsj->noij", g, a).reshape(n, 2, -1),
                                     np.einsum("nsoi,nsj->noij", gi, onehot).reshape(n, 2, -1),
                                     head], axis=2))
    return parts, np.concatenate(dense)


@pytest.mark.parametrize("positions", [None, [3, 3, 2, 3], [2, 3, 3, 1], [1, 2, 1, 4]])
def test_sample_stack_writes_batches_in_place(backend, rng, positions):
    """``SampleStack`` (how ``ntk`` assembles held factors): batches written into arrays
    allocated for all samples give the stacked Jacobian exactly (its blocks' layout, stored
    columns and index factor kept), also where batches have different numbers of positions
    (a provider dropping positions per batch): fewer are padded with g = 0 (index -1), more
    move the block to larger arrays; the arrays equal :meth:`Jacobian.concatenate`'s, which
    pads to the most positions too."""
    from ntkcore.jacobian import SampleStack

    skip_jax(backend)
    parts, dense = _batches(backend, rng, [2, 1, 3, 2], positions)
    stack = SampleStack(8)
    for p in parts:
        stack.add(p)
    assert stack.rest == []  # every batch written in place
    j = stack.result()
    assert j.names == ("conv", "emb", "head") and j.num_samples == 8
    assert j.blocks[1].one_hot == 4 and j.blocks[2].num_stored == 3
    most = 3 if positions is None else max(positions)
    assert (j.blocks[0].num_positions, j.blocks[1].num_positions) == \
        (most, 2 if positions is None else max(1, most - 1))
    cat = ntkcore.Jacobian.concatenate(parts)
    for b, c in zip(j.blocks, cat.blocks, strict=True):
        for x, y in zip(b.arrays(), c.arrays(), strict=True):
            np.testing.assert_array_equal(backend.to_numpy(x), backend.to_numpy(y))
    # products of 6 terms of O(1) numbers (the einsum order differs from to_dense's)
    np.testing.assert_allclose(backend.to_numpy(j.to_dense()), dense, rtol=0,
                               atol=kernel_tol(np.float64, 6) * 6)
    with pytest.raises(ValueError, match="holds 2"):
        short = SampleStack(3)
        short.add(parts[0])
        short.result()
    over = SampleStack(2)
    over.add(parts[1])
    with pytest.raises(ValueError, match="got 3"):
        over.add(parts[0])


def test_sample_stack_peak_is_the_factors_and_one_batch(rng, small_ufunc_buffers):
    """NumPy's allocations (tracemalloc) while stacking batches made one at a time: the
    factors plus about one batch with ``SampleStack``, where concatenating the batches held
    the factors and a stacked copy of the largest block besides."""
    import tracemalloc

    from ntkcore.jacobian import SampleStack
    from tests.conftest import make_case

    npc = make_case("numpy")
    n, batch = 64, 4

    def batch_of(k):
        return ntkcore.Jacobian([ntkcore.DenseBlock(npc.asarray(rng.standard_normal((k, 2, 4000))),
                                                    "big"),
                                 ntkcore.DenseBlock(npc.asarray(rng.standard_normal((k, 2, 50))),
                                                    "small")])

    factors = n * 2 * 4050 * 8
    SampleStack(batch).add(batch_of(batch))  # first calls (imports, caches) before tracing
    peaks = []
    for stacked in (True, False):
        tracemalloc.start()
        try:
            stack, parts = SampleStack(n), []
            for _ in range(n // batch):
                (stack.add if stacked else parts.append)(batch_of(batch))
            j = stack.result() if stacked else ntkcore.Jacobian.concatenate(parts, consume=True)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert j.num_samples == n
        del j
    # one batch's arrays and the random draws behind them: 2 x 4 x 2 x 4050 x 8 bytes
    assert peaks[0] <= factors + 2 * batch * 2 * 4050 * 8 + 2**16
    assert peaks[1] >= factors + n * 2 * 4000 * 8  # the largest block stacked beside
    assert peaks[0] < peaks[1]


def test_sample_stack_peak_when_positions_grow(rng, small_ufunc_buffers):
    """A block whose later batches have more positions moves to larger arrays once, every
    batch still written in place: the peak (NumPy's allocations, tracemalloc) is the
    factors plus that block's old arrays and a batch.  (Concatenation's is about the same
    under tracemalloc, the factors and a stacked block, but with glibc the freed pieces
    stay resident: ``2 F``, see ``SampleStack``.)"""
    import tracemalloc

    from ntkcore.jacobian import SampleStack
    from tests.conftest import make_case

    npc = make_case("numpy")
    n, batch, s0, s1 = 64, 4, 8, 10

    def batch_of(k, s):
        return ntkcore.Jacobian([ntkcore.KroneckerBlock(
            npc.asarray(rng.standard_normal((k, s if i == 0 else s1, 40))),
            npc.asarray(rng.standard_normal((k, s if i == 0 else s1, 2, 50))), f"b{i}")
            for i in range(4)])

    block = n * s1 * (40 + 2 * 50) * 8  # bytes of one block of all samples, 10 positions
    SampleStack(batch).add(batch_of(batch, s0))  # first calls before tracing
    tracemalloc.start()
    try:
        stack = SampleStack(n)
        for i in range(n // batch):
            stack.add(batch_of(batch, s0 if i < 2 else s1))
            assert stack.rest == []  # written in place, grown at the third batch
        j = stack.result()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert j.num_samples == n and j.blocks[0].num_positions == s1
    one_batch = 2 * batch * 4 * s1 * (40 + 2 * 50) * 8  # a batch and its random draws
    assert 4 * block <= peak <= 4 * block + block * s0 // s1 + one_batch + 2**16
    # the first two batches' samples: the last two positions of block 0 are g = 0 padding
    assert not j.blocks[0].g[:2 * batch, s0:].any() and j.blocks[0].g[2 * batch:, s0:].all()


def test_sample_stack_concatenates_arrays_that_record_gradients(rng):
    """Factors that record gradients (a kernel differentiated in its inputs) are not written
    in place: concatenated, and the gradient reaches every batch."""
    torch = pytest.importorskip("torch")

    from ntkcore.jacobian import SampleStack

    xs = [torch.randn(2, 1, 3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    stack = SampleStack(6)
    for x in xs:
        stack.add(ntkcore.Jacobian([ntkcore.DenseBlock(2 * x, "d")]))
    assert len(stack.rest) == 3
    j = stack.result()
    j.blocks[0].jac.sum().backward()
    assert all(torch.equal(x.grad, torch.full_like(x, 2.0)) for x in xs)


def test_concatenate_rejects_different_blocks(rng):
    f = np_factors((3, 1, [("dense", 2)]), rng)
    from tests.conftest import make_case

    npc = make_case("numpy")
    with pytest.raises(ValueError, match="same blocks"):
        ntkcore.Jacobian.concatenate([build(npc, f, ["a"]), build(npc, f, ["b"])])
    with pytest.raises(ValueError, match="at least one"):
        ntkcore.Jacobian.concatenate([])


def test_contract_outputs_and_pseudo(backend, rng):
    skip_jax(backend)
    f = np_factors((4, 3, [("kron", 2, 3, 2), ("dense", 4)]), rng)
    j = build(backend, f)
    dense = np_dense(f)
    w = rng.standard_normal(3)
    jc = j.contract_outputs(backend.asarray(w))
    assert jc.num_outputs == 1
    np.testing.assert_allclose(backend.to_numpy(jc.to_dense()),
                               np.einsum("nop,o->np", dense, w)[:, None, :], rtol=1e-12)
    jp = j.pseudo()
    np.testing.assert_allclose(backend.to_numpy(jp.to_dense()),
                               dense.sum(axis=1, keepdims=True) / np.sqrt(3), rtol=1e-12)


def test_names_default_and_custom(rng):
    f = np_factors((2, 1, [("dense", 2), ("kron", 1, 2, 2), ("dense", 1)]), rng)
    from tests.conftest import make_case

    j = build(make_case("numpy"), f, names=["fc1", None, "out"])
    assert j.names == ("fc1", "block1", "out")
    assert len(j) == 3 and [b.name for b in j] == list(j.names)


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
def test_block_validation(rng):
    a, g = rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 2, 5, 6))
    with pytest.raises(ValueError, match=r"KroneckerBlock conv1: a has N=3 samples but g has N=2"):
        ntkcore.KroneckerBlock(a, g[:2], name="conv1")
    with pytest.raises(ValueError, match="S=2 positions but g has S=1"):
        ntkcore.KroneckerBlock(a, g[:, :1], name="conv1")
    with pytest.raises(ValueError, match=r"conv1 factor a must have shape \(N, S, d_in\)"):
        ntkcore.KroneckerBlock(a[:, 0], g, name="conv1")
    with pytest.raises(ValueError, match=r"factor g must have shape \(N, S, O, d_out\)"):
        ntkcore.KroneckerBlock(a, g[..., 0])
    with pytest.raises(ValueError, match=r"DenseBlock fc jac must have shape \(N, O, P_b\)"):
        ntkcore.DenseBlock(a[..., 0], name="fc")
    with pytest.raises(TypeError, match="real floating"):
        ntkcore.DenseBlock(np.ones((2, 2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="must be an array"):
        ntkcore.DenseBlock([[[1.0]]])
    torch = pytest.importorskip("torch")
    with pytest.raises((ValueError, TypeError), match=r"different array libraries|array"):
        ntkcore.KroneckerBlock(a, torch.as_tensor(g))


def test_jacobian_validation(rng):
    torch = pytest.importorskip("torch")
    d = ntkcore.DenseBlock(rng.standard_normal((3, 2, 4)), name="fc")
    with pytest.raises(ValueError, match="at least one block"):
        ntkcore.Jacobian([])
    with pytest.raises(TypeError, match="block 0 must be a DenseBlock or KroneckerBlock"):
        ntkcore.Jacobian([np.ones((3, 2, 4))])
    with pytest.raises(ValueError, match=r"block 'b' has N=4 samples but block 'fc' has N=3"):
        ntkcore.Jacobian([d, ntkcore.DenseBlock(np.ones((4, 2, 1)), name="b")])
    with pytest.raises(ValueError, match=r"block 'b' has O=1 outputs"):
        ntkcore.Jacobian([d, ntkcore.DenseBlock(np.ones((3, 1, 1)), name="b")])
    with pytest.raises(ValueError, match=r"block 't' uses a different array library"):
        ntkcore.Jacobian([d, ntkcore.DenseBlock(torch.ones((3, 2, 1), dtype=torch.float64),
                                                name="t")])
    j = ntkcore.Jacobian([d])
    with pytest.raises(ValueError, match=r"v must have shape \(4,\)"):
        j.jvp(np.ones(7))
    with pytest.raises(ValueError, match=r"c must have shape \(3, 2\)"):
        j.vjp(np.ones((2, 3)))


def test_inputs_not_mutated(rng):
    f = np_factors((3, 2, [("kron", 2, 3, 2), ("dense", 4)]), rng)
    copies = [[x.copy() for x in b[1:]] for b in f]
    from tests.conftest import make_case

    j = build(make_case("numpy"), f)
    j.jvp(np.ones(j.num_params))
    j.vjp(np.ones((3, 2)))
    j.to_dense()
    j.pseudo()
    for b, c in zip(f, copies, strict=True):
        for x, y in zip(b[1:], c, strict=True):
            np.testing.assert_array_equal(x, y)


def test_nbytes_counts_every_factor_array(backend, rng):
    """``Jacobian.nbytes`` is the bytes of its factor arrays (dense ``jac``, Kronecker ``a``
    and ``g``), item size from each array's dtype: what the memory budget charges."""
    a = backend.asarray(rng.standard_normal((3, 2, 4)), "float32")
    g = backend.asarray(rng.standard_normal((3, 2, 5, 6)), "float32")
    d = backend.asarray(rng.standard_normal((3, 5, 7)))
    j = ntkcore.Jacobian([ntkcore.KroneckerBlock(a, g, "k"), ntkcore.DenseBlock(d, "d")])
    assert j.nbytes == (3 * 2 * 4 + 3 * 2 * 5 * 6) * 4 + 3 * 5 * 7 * 8


# -- DenseBlock with stored columns (the others exactly zero) --------------------------------
def _columns_case(backend, rng, n=4, o=3, size=11, cols=(0, 2, 3, 7, 10)):
    """A DenseBlock storing ``cols`` of ``size`` columns, and its dense (N, O, size) float64
    reference written here with zeros elsewhere (independently of ``to_dense``)."""
    stored = rng.standard_normal((n, o, len(cols)))
    dense = np.zeros((n, o, size))
    dense[..., list(cols)] = stored
    block = ntkcore.DenseBlock(backend.asarray(stored), "d", backend.asarray(cols, "int64"), size)
    return block, dense


def test_dense_block_columns_products(backend, rng):
    """to_dense, J v, J^T c, select, astype and contract_outputs of a block that stores 5 of
    its 11 columns, against the zero-filled dense reference."""
    block, dense = _columns_case(backend, rng)
    assert (block.num_params, block.num_stored) == (11, 5)
    np.testing.assert_array_equal(backend.to_numpy(block.to_dense()), dense)
    v, c = rng.standard_normal(11), rng.standard_normal((4, 3))
    # products of at most 22 terms of O(1) numbers, in float64
    tol = dict(rtol=kernel_tol(np.float64, 22), atol=kernel_tol(np.float64, 22) * 22)
    np.testing.assert_allclose(backend.to_numpy(block.jvp(backend.asarray(v))), dense @ v, **tol)
    np.testing.assert_allclose(backend.to_numpy(block.vjp(backend.asarray(c))),
                               np.einsum("nop,no->p", dense, c), **tol)
    j = ntkcore.Jacobian([block, ntkcore.DenseBlock(backend.asarray(dense), "full")])
    assert j.num_params == 22
    np.testing.assert_array_equal(backend.to_numpy(j.select([2, 0]).to_dense()),
                                  np.concatenate([dense, dense], axis=2)[[2, 0]])
    f32 = backend.asarray(np.zeros(1), "float32").dtype
    b32 = block.astype(f32)
    assert b32.dtype == f32 and b32.num_params == 11
    w = rng.standard_normal(3)
    np.testing.assert_allclose(
        backend.to_numpy(j.contract_outputs(backend.asarray(w)).to_dense()),
        np.einsum("nop,o->np", np.concatenate([dense, dense], axis=2), w)[:, None, :], **tol)


def test_dense_block_columns_concatenate(backend, rng):
    """Batches with the same stored columns stay compact; with different ones (or one batch
    storing all) they are expanded, and the stacked Jacobian is the stacked reference."""
    b1, d1 = _columns_case(backend, rng)
    b2, d2 = _columns_case(backend, rng, n=2)
    b3, d3 = _columns_case(backend, rng, n=3, cols=(1, 2, 3, 8, 9))
    same = ntkcore.Jacobian.concatenate([ntkcore.Jacobian([b1]), ntkcore.Jacobian([b2])])
    assert same.blocks[0].num_stored == 5
    np.testing.assert_array_equal(backend.to_numpy(same.to_dense()), np.concatenate([d1, d2]))
    for other, d_other in ((b3, d3), (b2.expanded(), d2)):
        mixed = ntkcore.Jacobian.concatenate([ntkcore.Jacobian([b1]), ntkcore.Jacobian([other])])
        assert mixed.blocks[0].columns is None and mixed.num_params == 11
        np.testing.assert_array_equal(backend.to_numpy(mixed.to_dense()),
                                      np.concatenate([d1, d_other]))


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_dense_block_columns_gram(backend, rng, mode):
    """Self and cross Grams (same and different stored columns, and against a block storing
    all) equal the Grams of the zero-filled references."""
    b1, d1 = _columns_case(backend, rng)
    b2, d2 = _columns_case(backend, rng, n=2)
    b3, d3 = _columns_case(backend, rng, n=3, cols=(1, 2, 3, 8, 9))
    sub = {"full": "nop,mqp->nmoq", "trace": "nop,mop->nm", "diagonal": "nop,mop->nmo"}[mode]
    tol = kernel_tol(np.float64, 11, computations=2)
    for left, dl, right, dr in ((b1, d1, None, d1), (b1, d1, b2, d2), (b1, d1, b3, d3),
                                (b3, d3, b2.expanded(), d2)):
        k = ntkcore.gram(ntkcore.Jacobian([left]),
                         None if right is None else ntkcore.Jacobian([right]), mode=mode)
        ref = np.einsum(sub, dl, dr)
        assert np.abs(backend.to_numpy(k) - ref).max() <= tol * np.abs(ref).max()


def test_dense_block_columns_sketch_and_features(backend, rng):
    """Consumers that mix parameter columns (sketches, random features, merged outputs) see
    the same block as its expanded twin: equal results for one seed."""
    from ntkcore.features import features
    from ntkcore.sketch import sketch_jacobian

    block, dense = _columns_case(backend, rng, size=40, cols=tuple(range(0, 40, 3)))
    twin = block.expanded()
    # the two sum the same non-zero products (the twin adds zeros) in possibly another order
    tol = dict(rtol=kernel_tol(np.float64, 40, computations=2),
               atol=kernel_tol(np.float64, 40, computations=2) * 40)
    np.testing.assert_array_equal(backend.to_numpy(twin.jac), dense)
    for method in ("gaussian", "sparse_sign", "leverage"):
        a = sketch_jacobian(ntkcore.Jacobian([block]), 7, method=method, seed=3)
        b = sketch_jacobian(ntkcore.Jacobian([twin]), 7, method=method, seed=3)
        np.testing.assert_allclose(backend.to_numpy(a.to_dense()), backend.to_numpy(b.to_dense()),
                                   **tol)
    for mode in ("full", "trace"):
        for method in ("gaussian", "sparse_sign"):
            fa = features(ntkcore.Jacobian([block]), dim=9, mode=mode, method=method, seed=4)
            fb = features(ntkcore.Jacobian([twin]), dim=9, mode=mode, method=method, seed=4)
            np.testing.assert_allclose(backend.to_numpy(fa), backend.to_numpy(fb), **tol)


def test_dense_block_columns_validation(rng):
    jac = rng.standard_normal((2, 1, 3))
    with pytest.raises(ValueError, match="strictly increasing"):
        ntkcore.DenseBlock(jac, "d", np.array([0, 2, 2]), 5)
    with pytest.raises(ValueError, match="strictly increasing"):
        ntkcore.DenseBlock(jac, "d", np.array([0, 2, 5]), 5)  # out of range
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        ntkcore.DenseBlock(jac, "d", np.array([0, 2]), 5)
    with pytest.raises(ValueError, match="need size"):
        ntkcore.DenseBlock(jac, "d", np.array([0, 1, 2]))
    with pytest.raises(TypeError, match="integer dtype"):
        ntkcore.DenseBlock(jac, "d", np.array([0.0, 1.0, 2.0]), 5)
    with pytest.raises(ValueError, match="size=4 but jac has 3 columns"):
        ntkcore.DenseBlock(jac, "d", size=4)


def test_dense_block_columns_under_jax_jit(rng):
    """Traced columns are not value-checked (unknown under jit), and a cross Gram of blocks
    whose columns cannot be compared expands both: the kernel is still exact."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    jac, cols = rng.standard_normal((3, 2, 4)), np.array([1, 3, 4, 7])

    def kernel(jac, cols):
        b = ntkcore.DenseBlock(jac, "d", cols, 9)
        b2 = ntkcore.DenseBlock(jac[:2], "d", cols, 9)
        return ntkcore.gram(ntkcore.Jacobian([b]), ntkcore.Jacobian([b2]), mode="trace")

    k = jax.jit(kernel)(jnp.asarray(jac), jnp.asarray(cols))  # float64: conftest enables x64
    tol = kernel_tol(np.float64, 8)
    np.testing.assert_allclose(np.asarray(k), np.einsum("nop,mop->nm", jac, jac[:2]),
                               rtol=tol, atol=tol * 8)
