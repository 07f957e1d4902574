"""ntkcore.models.MLP: forward pass and hand-written Jacobian against independent autodiff.

References: a torch forward written here with torch.nn.functional / torch.erf (not through
ntkcore) differentiated by torch.func.jacrev, the same with jax.jacrev, scipy.special.erf, and
float64 np.einsum kernels.
"""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import erf as scipy_erf

import ntkcore
from ntkcore.models import ACTIVATIONS, MLP, erf
from ntkcore.providers import find_provider
from tests.tolerances import kernel_tol

pytestmark = pytest.mark.supports("models.MLP")

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------------------------------
# independent references
# ---------------------------------------------------------------------------------------------
def _np_weights(widths, rng, bias=True):
    ws = [rng.standard_normal((o, i)) for i, o in pairwise(widths)]
    bs = [rng.standard_normal(o) for o in widths[1:]] if bias else None
    return ws, bs


def _scales(widths, parameterization, weight_std, bias_std):
    if parameterization == "ntk":
        return [weight_std / math.sqrt(d) for d in widths[:-1]], bias_std
    return [1.0] * (len(widths) - 1), 1.0


def _torch_act(name, y):
    F = torch.nn.functional
    return {
        "relu": F.relu,
        "tanh": torch.tanh,
        "erf": torch.erf,
        "gelu": lambda v: F.gelu(v, approximate="none"),
        "identity": lambda v: v,
    }[name](y)


def _torch_reference_jacobian(widths, ws, bs, x, activation, parameterization,
                              weight_std=1.0, bias_std=1.0):
    """Dense (N, O, P) Jacobian in the MLP's documented block order, by torch.func.jacrev."""
    cs, beta = _scales(widths, parameterization, weight_std, bias_std)
    bias = bs is not None
    theta = []
    for i, w in enumerate(ws):
        blk = np.concatenate([w, bs[i][:, None]], axis=1) if bias else w
        theta.append(blk.reshape(-1))
    theta = torch.as_tensor(np.concatenate(theta))
    xt = torch.as_tensor(x)

    def f(th):
        z, start = xt, 0
        for l, (d_in, d_out) in enumerate(pairwise(widths)):
            k = d_in + (1 if bias else 0)
            blk = th[start:start + d_out * k].reshape(d_out, k)
            start += d_out * k
            y = cs[l] * (z @ blk[:, :d_in].T)
            if bias:
                y = y + beta * blk[:, d_in]
            z = _torch_act(activation, y) if l < len(ws) - 1 else y
        return z

    jac = torch.func.jacrev(f)(theta)  # (N, O, P)
    return f(theta).numpy(), jac.numpy()


def _kernel(jd):
    return np.einsum("nop,mqp->nmoq", jd, jd)


# ---------------------------------------------------------------------------------------------
# erf
# ---------------------------------------------------------------------------------------------
def test_erf_float64_matches_scipy(backend):
    x = np.concatenate([np.linspace(-7, 7, 4001), [0.0, 1e-300, -1e-12, 1.0, -1.0, 6.0, 40.0,
                                                   -np.inf, np.inf]])
    xb = backend.asarray(x)
    out = erf(xb)
    assert backend.is_native(out) and out.dtype == xb.dtype
    got = backend.to_numpy(out)
    ref = scipy_erf(x)
    assert np.max(np.abs(got - ref)) < 5e-16
    small = (np.abs(x) < 1) & (x != 0)
    assert np.max(np.abs(got[small] - ref[small]) / np.abs(ref[small])) < 2e-15
    assert np.array_equal(np.sign(got), np.sign(ref))


def test_erf_float32():
    x = np.linspace(-6, 6, 2001, dtype=np.float32)
    got = erf(x)
    assert got.dtype == np.float32
    assert np.max(np.abs(got - scipy_erf(x.astype(np.float64)))) < 2e-7  # the docstring's bound


# ---------------------------------------------------------------------------------------------
# Jacobian vs torch.func on the same weights
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("parameterization", ["ntk", "standard"])
@pytest.mark.parametrize("bias", [True, False])
def test_jacobian_matches_torch_jacrev(activation, parameterization, bias, rng):
    widths = (4, 7, 6, 3)
    ws, bs = _np_weights(widths, rng, bias)
    x = rng.standard_normal((5, 4))
    net = MLP(ws, bs, activation=activation, parameterization=parameterization,
              weight_std=1.3, bias_std=0.7)
    f_ref, j_ref = _torch_reference_jacobian(widths, ws, bs, x, activation, parameterization,
                                             1.3, 0.7)
    np.testing.assert_allclose(net(x), f_ref, rtol=1e-13, atol=1e-13)
    J = net.jacobian(x)
    assert [type(b).__name__ for b in J] == ["KroneckerBlock"] * 3
    assert J.names == ("layer0", "layer1", "layer2")
    assert J.num_params == net.num_params == j_ref.shape[2]
    np.testing.assert_allclose(J.to_dense(), j_ref, rtol=1e-12, atol=1e-13)
    # pseudo: the Jacobian of sum_o f_o / sqrt(O)
    jp = J.pseudo().to_dense()
    np.testing.assert_allclose(net.jacobian(x, pseudo=True).to_dense(), jp,
                               rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(jp[:, 0], j_ref.sum(axis=1) / math.sqrt(3), rtol=1e-12,
                               atol=1e-13)


def test_single_layer_and_single_output(rng):
    for widths in [(3, 2), (3, 5, 1)]:
        ws, bs = _np_weights(widths, rng)
        x = rng.standard_normal((4, 3))
        net = MLP(ws, bs, activation="tanh")
        _, j_ref = _torch_reference_jacobian(widths, ws, bs, x, "tanh", "ntk")
        np.testing.assert_allclose(net.jacobian(x).to_dense(), j_ref, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(net.jacobian(x, pseudo=True).to_dense()[:, 0],
                                   j_ref.sum(1) / math.sqrt(widths[-1]), rtol=1e-12, atol=1e-13)


@settings(max_examples=10)
@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    n=st.integers(1, 5),
    activation=st.sampled_from(ACTIVATIONS),
    parameterization=st.sampled_from(["ntk", "standard"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_jacobian_property(widths, n, activation, parameterization, bias, seed):
    rng = np.random.default_rng(seed)
    ws, bs = _np_weights(widths, rng, bias)
    x = rng.standard_normal((n, widths[0]))
    net = MLP(ws, bs, activation=activation, parameterization=parameterization)
    _, j_ref = _torch_reference_jacobian(widths, ws, bs, x, activation, parameterization)
    np.testing.assert_allclose(net.jacobian(x).to_dense(), j_ref, rtol=1e-11, atol=1e-12)


def test_autodiff_through_with_parameters_agrees(rng):
    """The flat order of flat_parameters/with_parameters is the Jacobian's column order."""
    widths = (3, 5, 4, 2)
    ws, bs = _np_weights(widths, rng)
    net = MLP([torch.as_tensor(w) for w in ws], [torch.as_tensor(b) for b in bs],
              activation="gelu")
    x = torch.as_tensor(rng.standard_normal((4, 3)))
    theta = net.flat_parameters()
    jac = torch.func.jacrev(lambda th: net.with_parameters(th)(x))(theta)
    torch.testing.assert_close(net.jacobian(x).to_dense(), jac, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(net.with_parameters(theta)(x).numpy(), net(x).numpy())


# ---------------------------------------------------------------------------------------------
# every namespace gives the same kernel
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_same_kernel_on_every_backend(backend, activation, rng):
    widths = (3, 6, 5, 2)
    ws, bs = _np_weights(widths, rng)
    x = rng.standard_normal((4, 3))
    _, j_ref = _torch_reference_jacobian(widths, ws, bs, x, activation, "ntk")
    net = MLP([backend.asarray(w) for w in ws], [backend.asarray(b) for b in bs],
              activation=activation)
    xb = backend.asarray(x)
    out = net(xb)
    if backend.name == "jax":  # jit: stricter than eager (no value-dependent Python) and fast
        import jax

        jd = jax.jit(lambda z: net.jacobian(z).to_dense())(xb)
    else:
        jd = net.jacobian(xb).to_dense()
    assert backend.is_native(out) and backend.is_native(jd)
    assert jd.dtype == xb.dtype
    k = backend.to_numpy(jd)
    np.testing.assert_allclose(_kernel(k), _kernel(j_ref), rtol=1e-11, atol=1e-12)


def test_float32_close_to_float64(rng):
    widths = (5, 16, 16, 3)
    ws, bs = _np_weights(widths, rng)
    x = rng.standard_normal((6, 5))
    net64 = MLP(ws, bs, activation="erf")
    net32 = MLP([w.astype(np.float32) for w in ws], [b.astype(np.float32) for b in bs],
                activation="erf")
    j64 = net64.jacobian(x).to_dense()
    j32 = net32.jacobian(x.astype(np.float32)).to_dense()
    assert j32.dtype == np.float32
    k64, k32 = _kernel(j64), _kernel(j32.astype(np.float64))
    # first order (tests/tolerances.py): a float32 Jacobian entry sums the fan-ins (5, 16, 16)
    # forward and the fan-outs (3, 16, 16) backward, plus one erf/erf' evaluation per layer
    # (the erf approximation is good to 4 ulps, test_erf_float32); twice in a kernel product
    n = 2 * ((5 + 16 + 16) + (3 + 16 + 16) + 3 * 4)
    assert np.max(np.abs(k32 - k64)) / np.max(np.abs(k64)) <= kernel_tol(np.float32, n)


def test_dtype_promotion(rng):
    ws, bs = _np_weights((3, 4, 2), rng)
    net = MLP([w.astype(np.float32) for w in ws], [b.astype(np.float32) for b in bs])
    x = rng.standard_normal((2, 3))  # float64
    assert net(x).dtype == np.float64
    assert net.jacobian(x).dtype == np.float64


# ---------------------------------------------------------------------------------------------
# parameterisations, initialisation, accessors
# ---------------------------------------------------------------------------------------------
def test_ntk_and_standard_same_function_scaled_jacobian(rng):
    """NTK weights (W, b) and standard weights (c W, beta b) give the same function; the
    Jacobians differ by exactly those factors per column."""
    widths = (4, 5, 3)
    ws, bs = _np_weights(widths, rng)
    sw, sb = 1.4, 0.3
    ntk = MLP(ws, bs, activation="tanh", weight_std=sw, bias_std=sb)
    cs = [sw / math.sqrt(d) for d in widths[:-1]]
    std = MLP([c * w for c, w in zip(cs, ws, strict=True)], [sb * b for b in bs],
              activation="tanh", parameterization="standard")
    x = rng.standard_normal((3, 4))
    np.testing.assert_allclose(ntk(x), std(x), rtol=1e-13)
    scale = np.concatenate([np.tile(np.r_[np.full(i, c), sb], o)
                            for c, i, o in zip(cs, widths[:-1], widths[1:], strict=True)])
    np.testing.assert_allclose(ntk.jacobian(x).to_dense(), std.jacobian(x).to_dense() * scale,
                               rtol=1e-12, atol=1e-14)


def test_random_init_statistics_and_placement(backend):
    widths = (400, 300, 2)
    net = MLP.random(widths, xp=backend.xp, seed=3, parameterization="standard",
                     weight_std=2.0, bias_std=0.5, dtype=backend.xp.float32)
    w0 = backend.to_numpy(net.weights[0])
    b0 = backend.to_numpy(net.biases[0])
    assert backend.is_native(net.weights[0]) and w0.dtype == np.float32
    assert w0.shape == (300, 400) and b0.shape == (300,)
    assert abs(w0.std() - 2.0 / math.sqrt(400)) < 0.02 * 2.0 / math.sqrt(400)
    assert abs(b0.std() - 0.5) < 0.1
    f32 = backend.xp.float32  # one dtype throughout: jax compiles each (shape, dtype) draw
    ntk = MLP.random(widths, xp=backend.xp, seed=3, dtype=f32)
    assert abs(backend.to_numpy(ntk.weights[0]).std() - 1.0) < 0.02
    same = MLP.random(widths, xp=backend.xp, seed=3, dtype=f32)
    np.testing.assert_array_equal(backend.to_numpy(ntk.weights[1]),
                                  backend.to_numpy(same.weights[1]))
    other = MLP.random(widths, xp=backend.xp, seed=4, dtype=f32)
    assert not np.array_equal(backend.to_numpy(ntk.weights[1]),
                              backend.to_numpy(other.weights[1]))
    nob = MLP.random(widths, xp=backend.xp, seed=0, bias=False, dtype=f32)
    assert nob.biases is None and nob.num_params == 300 * 400 + 2 * 300
    default = MLP.random((3, 2), xp=backend.xp, seed=0)
    assert default.dtype == backend.xp.asarray(0.0).dtype  # the namespace's default float


def test_parameters_layout_and_roundtrip(rng):
    widths = (3, 4, 2)
    ws, bs = _np_weights(widths, rng)
    net = MLP(ws, bs)
    blocks = net.parameters()
    assert [b.shape for b in blocks] == [(4, 4), (2, 5)]
    np.testing.assert_array_equal(blocks[0][:, :3], ws[0])
    np.testing.assert_array_equal(blocks[0][:, 3], bs[0])
    flat = net.flat_parameters()
    assert flat.shape == (net.num_params,) == (4 * 4 + 2 * 5,)
    assert flat[1 * 4 + 3] == bs[0][1] and flat[2 * 4 + 1] == ws[0][2, 1]
    twin = net.with_parameters(flat)
    for a, b in zip([*twin.weights, *twin.biases], [*ws, *bs], strict=True):
        np.testing.assert_array_equal(a, b)  # the same values: views of flat, no arithmetic
    x = rng.standard_normal((2, 3))
    # The same forward on the same values, but twin's weights are strided views: a BLAS may
    # sum their products in another order.  First order, for this ReLU net (tests/tolerances):
    # layer 1 errs by 2 gamma_3 c1 |x||W1|^T and layer 2 adds 2 gamma_4 c2 |z1||W2|^T, with
    # |z1| <= m1 = c1 |x||W1|^T + |b1|.
    (c1, c2), _ = _scales(widths, "ntk", 1.0, 1.0)
    m1 = c1 * np.abs(x) @ np.abs(ws[0]).T + np.abs(bs[0])
    bound = kernel_tol(np.float64, 4, computations=2) * 2 * c2 * (m1 @ np.abs(ws[1]).T)
    assert np.all(np.abs(twin(x) - net(x)) <= bound)
    assert net.block_sizes == (16, 10) and net.widths == widths


def test_params_subset(rng):
    widths = (3, 5, 4, 2)
    ws, bs = _np_weights(widths, rng)
    net = MLP(ws, bs, activation="relu")
    x = rng.standard_normal((4, 3))
    full = net.jacobian(x).to_dense()
    sub = net.jacobian(x, params=["layer1", 2])
    assert sub.names == ("layer1", "layer2")
    np.testing.assert_allclose(sub.to_dense(), full[:, :, 20:], rtol=1e-14)
    with pytest.raises(ValueError, match="params"):
        net.jacobian(x, params=["conv0"])
    # through ntk(): the kernel of the selected layers only (independent torch reference)
    _, ref = _torch_reference_jacobian(widths, ws, bs, x, "relu", "ntk")
    jl = ref[:, :, 20:]
    np.testing.assert_allclose(ntkcore.ntk(net, x, params=["layer1", "layer2"], mode="trace"),
                               np.einsum("nop,mop->nm", jl, jl), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("parameterization", ["ntk", "standard"])
@pytest.mark.parametrize("activation", ["gelu", "tanh", "relu", "erf", "identity"])
def test_does_not_mutate_inputs(rng, activation, parameterization):
    """The forward and backward passes update only arrays they made (in place), never the
    inputs or the parameters (with the standard parameterisation c = 1, the first layer's
    block input is x itself)."""
    ws, bs = _np_weights((3, 4, 4, 2), rng)
    x = rng.standard_normal((5, 3))
    copies = [a.copy() for a in [*ws, *bs, x]]
    net = MLP(ws, bs, activation=activation, parameterization=parameterization)
    for pseudo in (False, True):
        net.jacobian(x, pseudo=pseudo).to_dense()
    net(x)
    for a, c in zip([*ws, *bs, x], copies, strict=True):
        np.testing.assert_array_equal(a, c)


# ---------------------------------------------------------------------------------------------
# registry and errors
# ---------------------------------------------------------------------------------------------
def test_registered_provider(rng):
    ws, bs = _np_weights((3, 4, 2), rng)
    net = MLP(ws, bs)
    x = rng.standard_normal((3, 3))
    p = find_provider(net)
    assert p.name == "mlp"
    np.testing.assert_array_equal(p.jacobian(net, x).to_dense(), net.jacobian(x).to_dense())
    jp = p.jacobian(net, x, pseudo=True, params=None)
    assert jp.num_outputs == 1
    assert ntkcore.models.MLP is MLP


@pytest.mark.parametrize("case", ["numpy", "torch", "array_api_strict"])
@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_ntk_and_pseudo_ntk_accept_the_mlp(case, mode, rng):
    """ntk()/pseudo_ntk() on the MLP (jax arrays are covered by the Jacobian test above and
    by tests/test_jax_provider.py; the gram engine's own tests cover every backend)."""
    from conftest import make_case

    backend = make_case(case)
    widths = (3, 6, 5, 2)
    ws, bs = _np_weights(widths, rng)
    x1, x2 = rng.standard_normal((5, 3)), rng.standard_normal((4, 3))
    _, j1 = _torch_reference_jacobian(widths, ws, bs, x1, "tanh", "ntk")
    _, j2 = _torch_reference_jacobian(widths, ws, bs, x2, "tanh", "ntk")
    full = np.einsum("nop,mqp->nmoq", j1, j2)
    ref = {"full": full, "trace": np.einsum("nmoo->nm", full),
           "diagonal": np.einsum("nmoo->nmo", full)}[mode]
    net = MLP([backend.asarray(w) for w in ws], [backend.asarray(b) for b in bs],
              activation="tanh")
    K = ntkcore.ntk(net, backend.asarray(x1), backend.asarray(x2), mode=mode)
    assert backend.is_native(K)
    np.testing.assert_allclose(backend.to_numpy(K), ref, rtol=1e-11, atol=1e-12)
    if mode == "full":
        Kp = ntkcore.pseudo_ntk(net, backend.asarray(x1), backend.asarray(x2))
        np.testing.assert_allclose(backend.to_numpy(Kp), full.sum(axis=(2, 3)) / 2,
                                   rtol=1e-11, atol=1e-12)
        Kl = ntkcore.ntk(net, backend.asarray(x1), layerwise=True, mode="trace")
        assert Kl.shape == (3, 5, 5)
        _, j11 = _torch_reference_jacobian(widths, ws, bs, x1, "tanh", "ntk")
        starts = np.cumsum([0, *net.block_sizes])
        for l in range(3):
            jl = j11[:, :, starts[l]:starts[l + 1]]
            np.testing.assert_allclose(backend.to_numpy(Kl)[l],
                                       np.einsum("nop,mop->nm", jl, jl), rtol=1e-11,
                                       atol=1e-12)


def test_errors(rng):
    ws, bs = _np_weights((3, 4, 2), rng)
    with pytest.raises(ValueError, match="activation"):
        MLP(ws, bs, activation="sigmoid")
    with pytest.raises(ValueError, match="parameterization"):
        MLP(ws, bs, parameterization="mup")
    with pytest.raises(ValueError, match=r"weights\[1\]"):
        MLP([ws[0], ws[1].T], None)
    with pytest.raises(ValueError, match=r"biases\[0\]"):
        MLP(ws, [bs[1], bs[0]])
    with pytest.raises(ValueError, match="biases has 1"):
        MLP(ws, bs[:1])
    with pytest.raises(TypeError, match=r"weights\[1\] has dtype"):
        MLP([ws[0], ws[1].astype(np.float32)])
    with pytest.raises(TypeError, match="weights"):
        MLP([])
    with pytest.raises(TypeError, match="weights"):
        MLP([ws[0], torch.as_tensor(ws[1])])
    with pytest.raises(ValueError, match="weight_std"):
        MLP(ws, bs, weight_std=0.0)
    net = MLP(ws, bs)
    with pytest.raises(ValueError, match=r"x must have shape \(N, 3\)"):
        net(np.ones((2, 4)))
    with pytest.raises(ValueError, match="x must have shape"):
        net.jacobian(np.ones(3))
    with pytest.raises(TypeError, match="x"):
        net(torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating"):
        net(np.ones((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="theta"):
        net.with_parameters(np.ones(3))
    with pytest.raises(TypeError, match="pseudo"):
        net.jacobian(np.ones((2, 3)), pseudo="yes")
    with pytest.raises(ValueError, match="widths"):
        MLP.random((3,), xp=np)
    with pytest.raises(ValueError, match=r"widths\[1\]"):
        MLP.random((3, 0, 2), xp=np)
    with pytest.raises(TypeError, match="xp"):
        MLP.random((3, 2), xp="numpy")
    with pytest.raises(TypeError, match="dtype"):
        MLP.random((3, 2), xp=np, dtype=np.int32)
