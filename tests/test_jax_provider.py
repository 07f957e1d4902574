"""The JAX provider (ntkcore.backends.jax.jacobian) against dense jax.jacrev references, and
the torch provider / explicit MLP on the same networks."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import ntkcore  # noqa: E402
from ntkcore.backends import jax_provider  # noqa: E402
from ntkcore.backends.jax import jacobian  # noqa: E402
from ntkcore.jacobian import DenseBlock, KroneckerBlock  # noqa: E402
from ntkcore.models import MLP  # noqa: E402
from ntkcore.providers import find_provider  # noqa: E402
from tests.conftest import spy_output_ranges  # noqa: E402
from tests.tolerances import kernel_tol  # noqa: E402


def _dense_reference(f, params, x):
    """Per-leaf dense Jacobians (N, O, P_leaf) in the leaf's own row-major order."""
    leaves, treedef = jax.tree_util.tree_flatten(params)

    def g(ls):
        out = f(jax.tree_util.tree_unflatten(treedef, ls), x)
        return jnp.reshape(out, (x.shape[0], -1))

    jac = jax.jit(jax.jacrev(g))(leaves)  # one compile instead of many eager dispatches
    n = x.shape[0]
    o = jac[0].shape[1]
    return [np.asarray(j).reshape(n, o, -1) for j in jac], leaves


def _np_dense(block):
    """A block's dense Jacobian computed on the host (NumPy)."""
    if isinstance(block, DenseBlock):
        return np.asarray(block.jac)
    return KroneckerBlock(np.asarray(block.a), np.asarray(block.g)).to_dense()


def _np_full(J):
    return np.concatenate([_np_dense(b) for b in J], axis=2)


def _as_leaf_order(block, leaf):
    """A block's dense Jacobian in its leaf's row-major order (undo the .T layout)."""
    d = _np_dense(block)
    if block.name.endswith(".T"):
        n, o = d.shape[:2]
        d = d.reshape(n, o, leaf.shape[1], leaf.shape[0]).swapaxes(2, 3).reshape(n, o, -1)
    return d


def _kernel(jd):
    jd = np.asarray(jd)
    return np.einsum("nop,mqp->nmoq", jd, jd)


def _mlp_params(rng, dims=(3, 5, 4, 2)):
    return {
        "w1": jnp.asarray(rng.standard_normal((dims[0], dims[1]))),  # flax layout
        "b1": jnp.asarray(rng.standard_normal(dims[1])),
        "w2": jnp.asarray(rng.standard_normal((dims[2], dims[1]))),  # torch layout
        "b2": jnp.asarray(rng.standard_normal(dims[2])),
        "w3": jnp.asarray(rng.standard_normal((dims[2], dims[3]))),
        "scale": jnp.asarray(1.5),
    }


def _mlp_apply(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    h = jax.nn.gelu(h @ p["w2"].T + p["b2"], approximate=False)
    return (h @ p["w3"]) * p["scale"]


@pytest.mark.parametrize(("structured", "chunk_size"), [(True, None), (True, 3), (False, 2)])
def test_matches_dense_jacrev(structured, chunk_size, rng):
    p = _mlp_params(rng)
    x = jnp.asarray(rng.standard_normal((7, 3)))
    J = jacobian(_mlp_apply, p, x, structured=structured, chunk_size=chunk_size)
    refs, leaves = _dense_reference(_mlp_apply, p, x)
    kinds = {b.name.removesuffix(".T"): type(b) for b in J}
    if structured:
        assert kinds == {"['b1']": KroneckerBlock, "['b2']": KroneckerBlock,
                         "['scale']": DenseBlock, "['w1']": KroneckerBlock,
                         "['w2']": KroneckerBlock, "['w3']": KroneckerBlock}
        assert J.names[3] == "['w1'].T" and J.names[4] == "['w2']"  # layouts
    else:
        assert all(t is DenseBlock for t in kinds.values())
    assert J.num_outputs == 2 and J.num_samples == 7
    for b, r, leaf in zip(J, refs, leaves, strict=True):
        np.testing.assert_allclose(_as_leaf_order(b, leaf), r, rtol=1e-12, atol=1e-13)
    assert array_is_jax(J.blocks[0].arrays()[0])


def array_is_jax(a):
    import array_api_compat

    return array_api_compat.is_jax_array(a)


def test_pseudo(rng):
    p = _mlp_params(rng)
    x = jnp.asarray(rng.standard_normal((5, 3)))
    J = jacobian(_mlp_apply, p, x)
    Jp = jacobian(_mlp_apply, p, x, pseudo=True)
    assert Jp.num_outputs == 1
    refs, _ = _dense_reference(_mlp_apply, p, x)
    full = np.concatenate(refs, axis=2)
    np.testing.assert_allclose(_kernel(_np_full(Jp))[:, :, 0, 0],
                               _kernel(full).sum(axis=(2, 3)) / 2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_np_full(Jp), _np_full(J).sum(axis=1, keepdims=True) / math.sqrt(2),
                               rtol=1e-12, atol=1e-13)


def test_sequence_layer_weight_sharing_positions(rng):
    """A dense layer applied to T tokens is one KroneckerBlock with S = T."""
    p = {"w": jnp.asarray(rng.standard_normal((3, 4))), "b": jnp.asarray(rng.standard_normal(4)),
         "v": jnp.asarray(rng.standard_normal((4, 2)))}

    def f(q, x):  # x (n, T, 3)
        return jnp.sum(jnp.tanh(x @ q["w"] + q["b"]), axis=1) @ q["v"]

    x = jnp.asarray(rng.standard_normal((5, 6, 3)))
    J = jacobian(f, p, x)
    blk = {b.name: b for b in J}
    assert isinstance(blk["['w'].T"], KroneckerBlock) and blk["['w'].T"].num_positions == 6
    assert isinstance(blk["['b']"], KroneckerBlock)
    refs, leaves = _dense_reference(f, p, x)
    for b, r, leaf in zip(J, refs, leaves, strict=True):
        np.testing.assert_allclose(_as_leaf_order(b, leaf), r, rtol=1e-12, atol=1e-13)


def test_unrecognised_patterns_are_dense_and_correct(rng):
    """Tied weights, a layer inside a nested jit, a bias added after the activation and a
    scaled layer output: never structured wrongly."""
    p = {"w": jnp.asarray(rng.standard_normal((3, 3))), "u": jnp.asarray(rng.standard_normal(
        (3, 2))), "c": jnp.asarray(rng.standard_normal(3)), "d": jnp.asarray(rng.standard_normal(
            2)), "e": jnp.asarray(rng.standard_normal((2, 1)))}

    @jax.jit
    def inner(u, h):
        return h @ u

    def f(q, x):
        h = jnp.tanh(x @ q["w"])
        h = jnp.tanh(h @ q["w"]) + q["c"]  # w tied, c after the activation
        h = 2.0 * inner(q["u"], h) + q["d"]  # u in a nested jit; d added to a scaled output
        return h @ q["e"]  # e: an ordinary dense layer

    x = jnp.asarray(rng.standard_normal((4, 3)))
    with pytest.warns(RuntimeWarning, match=r"\['u'\]\"\] enter a jax.jit-compiled"):
        J = jacobian(f, p, x)
    kinds = {b.name.removesuffix(".T"): type(b).__name__ for b in J}
    assert kinds["['w']"] == "DenseBlock" and kinds["['u']"] == "DenseBlock"
    assert kinds["['c']"] == "DenseBlock" and kinds["['d']"] == "DenseBlock"
    assert kinds["['e']"] == "KroneckerBlock"
    refs, leaves = _dense_reference(f, p, x)
    for b, r, leaf in zip(J, refs, leaves, strict=True):
        np.testing.assert_allclose(_as_leaf_order(b, leaf), r, rtol=1e-12, atol=1e-13)


def test_scalar_output_and_integer_leaves(rng):
    p = {"w": jnp.asarray(rng.standard_normal((3, 4))), "v": jnp.asarray(rng.standard_normal(4)),
         "steps": jnp.asarray(3)}

    def f(q, x):
        return jnp.tanh(x @ q["w"]) @ q["v"]  # (n,)

    x = jnp.asarray(rng.standard_normal((5, 3)))
    J = jacobian(f, p, x)
    assert J.num_outputs == 1 and len(J) == 2  # the integer leaf has no block
    refs, leaves = _dense_reference(f, {"v": p["v"], "w": p["w"]}, x)
    for b, r, leaf in zip(J, refs, leaves, strict=True):
        np.testing.assert_allclose(_as_leaf_order(b, leaf), r, rtol=1e-12, atol=1e-13)


def _layered_params(rng):
    """flax/haiku-style nested params: each layer a dict of its leaves."""
    r = rng.standard_normal
    return {"dense1": {"w": jnp.asarray(r((3, 5))), "b": jnp.asarray(r(5))},  # x @ w
            "dense2": {"w": jnp.asarray(r((4, 5))), "b": jnp.asarray(r(4))},  # x @ w.T
            "mix": {"w": jnp.asarray(r((4, 4))), "gamma": jnp.asarray(r(4))},
            "norm": {"scale": jnp.asarray(r(4)), "shift": jnp.asarray(r(4))},
            "out": {"kernel": jnp.asarray(r((4, 2)))}}


def _layered_apply(p, x):
    h = jnp.tanh(x @ p["dense1"]["w"] + p["dense1"]["b"])
    h = jnp.tanh(h @ p["dense2"]["w"].T + p["dense2"]["b"])
    h = jnp.tanh((h @ p["mix"]["w"]) * p["mix"]["gamma"])  # a recognised weight, grouped
    h = jnp.sin(h * p["norm"]["scale"] + p["norm"]["shift"])  # with an unrecognised leaf
    return h @ p["out"]["kernel"]


def test_layerwise_groups_leaves_per_layer(rng):
    """One block, and one layerwise kernel, per layer dict (weight and bias together, as in
    torch), each equal to the sum of its leaves' kernels from dense float64 jax.jacrev."""
    p = _layered_params(rng)
    x = jnp.asarray(rng.standard_normal((6, 3)))
    J = jacobian(_layered_apply, p, x)
    assert J.names == ("['dense1']", "['dense2']", "['mix']", "['norm']", "['out'].T")
    assert [type(b).__name__ for b in J] == ["KroneckerBlock", "KroneckerBlock", "DenseBlock",
                                            "DenseBlock", "KroneckerBlock"]
    assert J.blocks[0].d_in == 3 + 1 and J.blocks[1].d_in == 5 + 1  # the bias column
    refs, _ = _dense_reference(_layered_apply, p, x)  # leaves: dense1 b, w; dense2 b, w; ...
    leaf_groups = [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    k_layers = np.asarray(ntkcore.ntk((_layered_apply, p), x, layerwise=True))
    assert k_layers.shape == (5, 6, 6, 2, 2)
    for k, idx in zip(k_layers, leaf_groups, strict=True):
        ref = sum(_kernel(refs[i]) for i in idx)
        p_layer = sum(refs[i].shape[2] for i in idx)
        tol = kernel_tol(np.float64, p_layer, computations=10) * np.abs(ref).max()
        np.testing.assert_allclose(k, ref, rtol=0, atol=tol)


def test_layer_groups_of_sequences(rng):
    """stax-style [(W, b), ...] is one block per layer; {'w': [w0, w1], 'b': [b0, b1]} (lists
    of like arrays) stays one block per leaf."""
    r = rng.standard_normal
    stax = [(jnp.asarray(r((3, 4))), jnp.asarray(r(4))), (jnp.asarray(r((4, 2))),
                                                           jnp.asarray(r(2)))]

    def f(q, x):
        return jnp.tanh(x @ q[0][0] + q[0][1]) @ q[1][0] + q[1][1]

    x = jnp.asarray(r((5, 3)))
    J = jacobian(f, stax, x)
    assert J.names == ("[0]", "[1]") and [b.d_in for b in J] == [4, 5]
    refs, _ = _dense_reference(f, stax, x)
    ref = _kernel(np.concatenate(refs, axis=2))
    tol = kernel_tol(np.float64, sum(q.shape[2] for q in refs), computations=10)
    np.testing.assert_allclose(_kernel(_np_full(J)), ref, rtol=0, atol=tol * np.abs(ref).max())
    lists = {"w": [q[0] for q in stax], "b": [q[1] for q in stax]}
    assert jacobian(lambda q, x: f(list(zip(q["w"], q["b"], strict=True)), x), lists, x).names \
        == ("['b'][0]", "['b'][1]", "['w'][0].T", "['w'][1].T")


def test_jitted_apply_fn_keeps_structure(rng):
    """ntk((jax.jit(apply_fn), params), x): the same blocks as the un-jitted function."""
    import warnings

    p = _layered_params(rng)
    x = jnp.asarray(rng.standard_normal((5, 3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "structure lost" warning
        J = jacobian(jax.jit(_layered_apply), p, x)
        K = np.asarray(ntkcore.ntk((jax.jit(_layered_apply), p), x))
    plain = jacobian(_layered_apply, p, x)
    assert J.names == plain.names
    assert [type(b) for b in J] == [type(b) for b in plain]
    refs, _ = _dense_reference(_layered_apply, p, x)
    ref = _kernel(np.concatenate(refs, axis=2))
    tol = kernel_tol(np.float64, sum(r.shape[2] for r in refs), computations=10)
    np.testing.assert_allclose(K, ref, rtol=0, atol=tol * np.abs(ref).max())


def test_select_and_registry(rng):
    p = _mlp_params(rng)
    x = jnp.asarray(rng.standard_normal((4, 3)))
    full = jacobian(_mlp_apply, p, x)
    sub = jacobian(_mlp_apply, p, x, select=["['w2']", "['scale']"])
    assert [n.removesuffix(".T") for n in sub.names] == ["['scale']", "['w2']"]
    np.testing.assert_allclose(_np_full(sub), np.concatenate(
        [_np_dense(full.blocks[2]), _np_dense(full.blocks[4])], axis=2), rtol=1e-14)
    model = (_mlp_apply, p)
    prov = find_provider(model)
    assert prov.name == "jax"
    via = prov.jacobian(model, x, params=["['w2']", "['scale']"])
    np.testing.assert_array_equal(_np_full(via), _np_full(sub))
    with pytest.raises(ValueError, match="unknown leaves"):
        jacobian(_mlp_apply, p, x, select=["['nope']"])


def test_ntk_entry_points(rng):
    p = _mlp_params(rng)
    x1 = jnp.asarray(rng.standard_normal((5, 3)))
    x2 = jnp.asarray(rng.standard_normal((3, 3)))
    r1, _ = _dense_reference(_mlp_apply, p, x1)
    r2, _ = _dense_reference(_mlp_apply, p, x2)
    j1, j2 = np.concatenate(r1, axis=2), np.concatenate(r2, axis=2)
    ref = np.einsum("nop,mqp->nmoq", j1, j2)
    K = ntkcore.ntk((_mlp_apply, p), x1, x2)
    assert array_is_jax(K)
    np.testing.assert_allclose(np.asarray(K), ref, rtol=1e-11, atol=1e-12)
    Kp = ntkcore.pseudo_ntk((_mlp_apply, p), x1, x2)
    np.testing.assert_allclose(np.asarray(Kp), ref.sum(axis=(2, 3)) / 2, rtol=1e-11,
                               atol=1e-12)


def test_verification_fallback(rng, monkeypatch):
    """If a recognised layer were analysed wrongly, the first-sample check catches it."""
    real = jax_provider._find_layers

    def wrong(*args, **kwargs):
        layers = real(*args, **kwargs)
        for ly in layers:
            ly.transposed = not ly.transposed  # claims the wrong layout
        return layers

    monkeypatch.setattr(jax_provider, "_find_layers", wrong)
    jax_provider._PLANS.clear()
    p = _mlp_params(rng)
    x = jnp.asarray(rng.standard_normal((3, 3)))
    with pytest.warns(RuntimeWarning, match="disagreed"):
        J = jacobian(_mlp_apply, p, x)
    jax_provider._PLANS.clear()
    assert all(isinstance(b, DenseBlock) for b in J)
    refs, _ = _dense_reference(_mlp_apply, p, x)
    np.testing.assert_allclose(_np_full(J), np.concatenate(refs, axis=2),
                               rtol=1e-12, atol=1e-13)


def test_errors(rng):
    p = _mlp_params(rng)
    x = jnp.asarray(rng.standard_normal((3, 3)))
    with pytest.raises(TypeError, match="apply_fn"):
        jacobian(3, p, x)
    with pytest.raises(ValueError, match="chunk_size"):
        jacobian(_mlp_apply, p, x, chunk_size=0)
    with pytest.raises(TypeError, match="pseudo"):
        jacobian(_mlp_apply, p, x, pseudo=1)
    with pytest.raises(ValueError, match="floating"):
        jacobian(lambda q, z: z * q["k"], {"k": jnp.asarray(2)}, x)
    with pytest.raises(ValueError, match="sample axis"):
        jacobian(_mlp_apply, p, jnp.zeros((0, 3)))


# ---------------------------------------------------------------------------------------------
# the same network through three providers
# ---------------------------------------------------------------------------------------------
def test_explicit_mlp_in_jax_matches_provider(rng):
    """MLP.jacobian on jax arrays == the jax provider on the MLP's own forward (as apply_fn)
    == jax.jacrev (gelu: exercises the array-API erf under jax tracing)."""
    activation = "gelu"
    dims = (3, 6, 5, 2)
    params = {"w": [jnp.asarray(rng.standard_normal((o, i))) for i, o in pairwise(dims)],
              "b": [jnp.asarray(rng.standard_normal(o)) for o in dims[1:]]}
    net = MLP(params["w"], params["b"], activation=activation)

    def apply_fn(q, x):
        return MLP(q["w"], q["b"], activation=activation)(x)

    x = jnp.asarray(rng.standard_normal((4, 3)))
    # under jax.jit: one compilation instead of an eager dispatch per array-API operation
    k_mlp = _kernel(np.asarray(jax.jit(lambda z: net.jacobian(z).to_dense())(x)))
    k_prov = _kernel(_np_full(jacobian(apply_fn, params, x)))
    refs, _ = _dense_reference(apply_fn, params, x)
    k_ref = _kernel(np.concatenate(refs, axis=2))
    np.testing.assert_allclose(k_mlp, k_ref, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(k_prov, k_ref, rtol=1e-11, atol=1e-12)


def test_jax_provider_matches_torch_provider(rng):
    torch = pytest.importorskip("torch")
    torch_jacobian = pytest.importorskip("ntkcore.backends.torch_jacobian").jacobian
    dims = (4, 7, 5, 3)
    torch_net = torch.nn.Sequential(
        torch.nn.Linear(dims[0], dims[1]), torch.nn.Tanh(),
        torch.nn.Linear(dims[1], dims[2]), torch.nn.GELU(),
        torch.nn.Linear(dims[2], dims[3])).double()
    lin = [m for m in torch_net if isinstance(m, torch.nn.Linear)]
    params = [{"w": jnp.asarray(m.weight.detach().numpy()),
               "b": jnp.asarray(m.bias.detach().numpy())} for m in lin]

    def apply_fn(q, x):
        h = jnp.tanh(x @ q[0]["w"].T + q[0]["b"])
        h = jax.nn.gelu(h @ q[1]["w"].T + q[1]["b"], approximate=False)
        return h @ q[2]["w"].T + q[2]["b"]

    x = rng.standard_normal((6, dims[0]))
    jt = torch_jacobian(torch_net, torch.as_tensor(x))
    jj = jacobian(apply_fn, params, jnp.asarray(x))
    assert all(isinstance(b, KroneckerBlock) for b in jj)
    assert jj.names == ("[0]", "[1]", "[2]") and len(jj) == len(jt)  # torch's grouping
    k_t = _kernel(jt.to_dense().detach().numpy())
    k_j = _kernel(_np_full(jj))
    np.testing.assert_allclose(k_j, k_t, rtol=1e-11, atol=1e-12)
    # the explicit MLP on the same weights (numpy, all-tanh net) gives the torch kernel too
    torch_net[3] = torch.nn.Tanh()
    k_t2 = _kernel(torch_jacobian(torch_net, torch.as_tensor(x)).to_dense().numpy())
    net = MLP([m.weight.detach().numpy() for m in lin], [m.bias.detach().numpy() for m in lin],
              activation="tanh", parameterization="standard")
    np.testing.assert_allclose(_kernel(net.jacobian(x).to_dense()), k_t2, rtol=1e-11,
                               atol=1e-12)


def _wide_params(rng, o=8):
    """A dense layer over 6 positions and a head of ``o`` outputs: the output gradients are
    most of the factor bytes, so a budget below all outputs' factors chunks the outputs."""
    return {"w1": jnp.asarray(rng.standard_normal((4, 6))), "b1": jnp.zeros(6),
            "w2": jnp.asarray(rng.standard_normal((6 * 6, o)))}


def _wide_apply(p, x):  # x (N, 6, 4): six positions of four features
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.reshape(h, (x.shape[0], -1)) @ p["w2"]


@pytest.mark.parametrize("structured", [True, False])
def test_outputs_are_rows_of_the_whole_jacobian(structured, rng):
    """``outputs=(start, stop)``: the Jacobian of those flattened outputs alone, the rows of
    the whole Jacobian (Kronecker and dense blocks alike); bad ranges are refused."""
    p = _wide_params(rng)
    x = jnp.asarray(rng.standard_normal((5, 6, 4)))
    whole = _np_full(jacobian(_wide_apply, p, x, structured=structured))
    for start, stop in ((0, 8), (0, 3), (3, 7), (7, 8)):
        part = jacobian(_wide_apply, p, x, structured=structured, outputs=(start, stop))
        assert part.num_outputs == stop - start
        assert [type(b) for b in part.blocks] == [type(b) for b in jacobian(
            _wide_apply, p, x, structured=structured).blocks]
        # the same reverse passes restricted: entries of a few chained products (depth 2)
        tol = kernel_tol(np.float64, 6 * 6, computations=2) * np.abs(whole).max()
        np.testing.assert_allclose(_np_full(part), whole[:, start:stop], rtol=0, atol=tol)
    for bad in ((0, 9), (3, 3), (-1, 2), [0, 2], (0.0, 2)):
        with pytest.raises(ValueError, match="outputs"):
            jacobian(_wide_apply, p, x, structured=structured, outputs=bad)
    with pytest.raises(ValueError, match="pseudo"):
        jacobian(_wide_apply, p, x, outputs=(0, 2), pseudo=True)


@pytest.mark.parametrize("mode", ["trace", "diagonal"])
def test_ntk_in_output_chunks(monkeypatch, mode, rng):
    """A budget below the factors of all 8 outputs: ``ntk`` of a JAX model computes the trace
    / diagonal kernel a few outputs at a time (the provider's ``"outputs"`` capability), equal
    to the float64 reference; the chunks partition the outputs."""
    import itertools
    import sys

    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 4)
    assert "outputs" in find_provider((_wide_apply, {})).capabilities
    p = _wide_params(rng)
    x = jnp.asarray(rng.standard_normal((12, 6, 4)))
    jd = np.concatenate(_dense_reference(_wide_apply, p, x)[0], axis=2)
    full = _kernel(jd)
    ref = np.einsum("nmoo->nm", full) if mode == "trace" else np.einsum("nmoo->nmo", full)
    with pytest.raises(ntkcore.BudgetTooSmallError) as info:
        ntkcore.ntk((_wide_apply, p), x, mode=mode, max_memory=1000)
    least = info.value.needed
    seen = spy_output_ranges(monkeypatch)
    k = np.asarray(ntkcore.ntk((_wide_apply, p), x, mode=mode, max_memory=least))
    tol = kernel_tol(np.float64, jd.shape[1] * jd.shape[2], computations=2)
    np.testing.assert_allclose(k, ref, rtol=0, atol=tol * np.abs(ref).max())
    chunks = sorted({c for c in seen if c is not None})
    assert len(chunks) > 1 and chunks[0][0] == 0 and chunks[-1][1] == 8
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))


def _tokens_params(rng):
    return {"w": jnp.asarray(rng.standard_normal((3, 4))), "b": jnp.asarray(rng.standard_normal(4)),
            "v": jnp.asarray(rng.standard_normal((4, 2)))}


def _tokens_apply(q, x):  # x (n, T = 6, 3): one dense layer over 6 tokens, a head (S = 1)
    return jnp.sum(jnp.tanh(x @ q["w"] + q["b"]), axis=1) @ q["v"]


@pytest.mark.parametrize(("make", "apply", "shape", "dense"), [
    # w: O d_out d_in = 2 4 3 <= 6 (3 + 2 4); its separate bias follows; v (S = 1) stays
    (_tokens_params, _tokens_apply, (6, 3), {"['w'].T", "['b']"}),
    # the merged layer groups of _layered_params (weight and bias in one block), 6 tokens
    (lambda rng: _layered_params(rng), lambda p, x: _layered_apply(p, x), (6, 3), None),
])
def test_dense_if_smaller(make, apply, shape, dense, rng):
    """``dense_if_smaller=True``: every recognised layer whose per-sample gradient is no
    larger than its factors (``ntkcore.jacobian.dense_is_smaller``, shapes alone) becomes
    that DenseBlock, in the Kronecker block's column order: equal to its ``to_dense`` and to
    ``jacrev``; the other blocks are unchanged; ``ntk`` asks for it and gives the float64
    reference kernel."""
    from ntkcore.jacobian import dense_is_smaller

    p = make(rng)
    x = jnp.asarray(rng.standard_normal((5, *(shape or (3,)))))
    jk = jacobian(apply, p, x)
    jd = jacobian(apply, p, x, dense_if_smaller=True)
    assert "dense_if_smaller" in find_provider((apply, p)).capabilities
    o = jk.num_outputs
    expect = {b.name for b in jk.blocks if isinstance(b, KroneckerBlock) and (
        b.num_positions >= 1 and dense_is_smaller(b.a.shape[-1] + int(b.ones), b.g.shape[-1],
                                                  b.num_positions, o))}
    if dense is not None:
        assert expect == dense
    assert {b.name for b in jd.blocks if isinstance(b, DenseBlock)} == expect | {
        b.name for b in jk.blocks if isinstance(b, DenseBlock)}
    assert expect  # the case has a layer in the dense form
    for bk, bd in zip(jk.blocks, jd.blocks, strict=True):
        assert bk.name == bd.name
        # sums over the positions in two orders (einsum and to_dense)
        dk = _np_dense(bk)
        tol = kernel_tol(np.float64, bk.num_positions if isinstance(bk, KroneckerBlock)
                         else 1, computations=2) * max(np.abs(dk).max(), 1e-300)
        np.testing.assert_allclose(_np_dense(bd), dk, rtol=0, atol=tol)
    refs, _ = _dense_reference(apply, p, x)
    ref = _kernel(np.concatenate(refs, axis=2))
    k = np.asarray(ntkcore.ntk((apply, p), x, mode="trace"))
    kt = np.einsum("nmoo->nm", ref)
    tol = kernel_tol(np.float64, o * sum(r.shape[-1] for r in refs), computations=2)
    np.testing.assert_allclose(k, kt, rtol=0, atol=tol * np.abs(kt).max())
    with pytest.raises(TypeError, match="dense_if_smaller"):
        jacobian(apply, p, x, dense_if_smaller=1)
