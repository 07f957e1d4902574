"""ntkcore.attribution.TRAK against independent float64 references.

The reference scores are computed in kernel form from the dense per-sample gradients of the
output function (``torch.func`` on an equivalent torch network, float64):
``T = K_*(K + lam I)^{-1} diag(q)`` by a direct NumPy solve, which equals TRAK's primal
``J_*(J^T J + lam I)^{-1} J^T diag(q)`` by the push-through identity.  With ``dim`` at least
the number of parameters the features are the exact Jacobian (``allocate_exact``), so TRAK
must match to rounding (tolerance from eps and the condition number, tests/tolerances.py), on
both sides of its solve (primal dim < N, dual dim >= N).  Models: a torch ``nn.Module`` and a
JAX ``(apply_fn, params)`` pair (the backend adapters' one-output wrapping) and
:class:`ntkcore.models.MLP` on every array namespace (the generic chain-rule route on full-mode
features).  Projected features are checked for unbiasedness over seeds with a tolerance from
``feature_variance``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ntkcore
from ntkcore.attribution import OUTPUTS, TRAK, Custom, Margin, Output, adapter_for
from ntkcore.models import MLP
from tests.conftest import HAS_JAX, make_case
from tests.tolerances import kernel_tol, solve_tol

torch = pytest.importorskip("torch")
# many small eager JAX operations of changing shapes: compile them without XLA's passes
pytestmark = pytest.mark.usefixtures("jax_quick_compile")

D_IN, HIDDEN, CLASSES = 4, 5, 3


def _weights(seed: int = 0, classes: int = CLASSES):
    rng = np.random.default_rng(seed)
    return ([rng.standard_normal((HIDDEN, D_IN)) / 2, rng.standard_normal((classes, HIDDEN))],
            [rng.standard_normal(HIDDEN) / 2, rng.standard_normal(classes)])


def _torch_net(ws, bs, device="cpu"):
    net = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(),
                              torch.nn.Linear(HIDDEN, ws[1].shape[0])).double()
    with torch.no_grad():
        for layer, w, b in zip((net[0], net[2]), ws, bs, strict=True):
            layer.weight.copy_(torch.as_tensor(w))
            layer.bias.copy_(torch.as_tensor(b))
    return net.to(device)


def _model(case, ws, bs):
    """The network of ``ws, bs`` in the form ``case`` holds: a torch module, a JAX pair, or an
    MLP of the case's arrays (numpy, array_api_strict, cupy)."""
    if case.name.startswith("torch"):
        return _torch_net(ws, bs, case.device)
    if case.name == "jax":
        import jax.numpy as jnp

        return _jax_apply, {"w0": jnp.asarray(ws[0]), "b0": jnp.asarray(bs[0]),
                          "w1": jnp.asarray(ws[1]), "b1": jnp.asarray(bs[1])}
    return MLP([case.asarray(w) for w in ws], [case.asarray(b) for b in bs], activation="tanh",
               parameterization="standard")


def _jax_apply(p, x):
    """The network as a JAX ``apply_fn`` (one function for every checkpoint, as in practice)."""
    import jax.numpy as jnp

    return jnp.tanh(x @ p["w0"].T + p["b0"]) @ p["w1"].T + p["b1"]


def _data(n: int, m: int, seed: int = 1, classes: int = CLASSES):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, D_IN)), rng.integers(0, classes, n),
            rng.standard_normal((m, D_IN)), rng.integers(0, classes, m))


def _grads(net, fn, x, y):
    """Dense per-sample gradients of ``fn(net(x), y)`` (N, P), float64, torch.func."""
    params = {k: v.detach() for k, v in net.named_parameters()}
    yt = None if y is None else torch.as_tensor(y)

    def f(w, xi, yi):
        out = torch.func.functional_call(net, w, (xi[None],))
        return fn.value(out, None if yi is None else yi[None])[0]

    dims = (None, 0, None if yt is None else 0)
    g = torch.func.vmap(torch.func.grad(f), in_dims=dims)(params, torch.as_tensor(x), yt)
    return torch.cat([v.reshape(len(x), -1) for v in g.values()], 1).numpy()


def _reference(nets, fn, x, y, xs, ys, lam, q_fn):
    """TRAK's ensemble in kernel form: mean over nets of K_*(K + lam I)^{-1}, times the mean
    over nets of Q; and the largest condition number of K + lam I."""
    total, qsum, cond = 0.0, 0.0, 1.0
    for net in nets:
        j, js = _grads(net, fn, x, y), _grads(net, fn, xs, ys)
        k = j @ j.T
        total = total + np.linalg.solve(k + lam * np.eye(len(k)), (js @ j.T).T).T
        w = np.linalg.eigvalsh(k)
        cond = max(cond, (w.max() + lam) / (max(w.min(), 0.0) + lam))
        with torch.no_grad():
            qsum = qsum + q_fn(net(torch.as_tensor(x)))
    return total / len(nets) * (qsum / len(nets))[None, :], cond



def _q_margin(y):
    return lambda out: (1 - out.softmax(1)[torch.arange(len(y)), torch.as_tensor(y)]).numpy()


def _tol(cond: float, p: int) -> float:
    return solve_tol(np.float64, cond, computations=2) + cond * kernel_tol(np.float64, p, 4)


@pytest.mark.parametrize("n", [6, 50])  # dual (P = 43 >= N) and primal (P < N) solves
def test_exact_scores_every_backend(backend, n):
    """dim >= P: the features are the Jacobian and TRAK equals the kernel-form reference,
    results in the input's namespace, device and dtype."""
    case = backend
    if case.name == "jax" and n > 43:
        pytest.skip("JAX's primal solve: test_ensemble_of_checkpoints_and_seeds (compile time)")
    ws, bs = _weights()
    x, y, xs, ys = _data(n, 5)
    lam = 1e-3
    model = _model(case, ws, bs)
    trak = TRAK(model, dim=1000, seed=0, reg=lam)
    yl, ysl = case.asarray(y, "int64"), case.asarray(ys, "int64")
    got = trak.fit(case.asarray(x), yl).score(case.asarray(xs), ysl)
    assert case.is_native(got) and got.shape == (5, n)
    assert str(got.dtype).endswith("float64")
    ref, cond = _reference([_torch_net(ws, bs)], Margin(), x, y, xs, ys, lam, _q_margin(y))
    err = np.abs(case.to_numpy(got) - ref).max() / np.abs(ref).max()
    assert err <= _tol(cond, 43), (err, cond)
    assert trak.features_[0].shape == (n, 43)  # the exact Jacobian's width
    assert np.allclose(case.to_numpy(trak.weights_), _q_margin(y)(
        _torch_net(ws, bs)(torch.as_tensor(x)).detach()), rtol=1e-12)


def test_reg_zero_is_the_pseudo_inverse_limit():
    """lam = 0 with dim >= N: the dual K_* K^{-1} Q (the lam -> 0+ limit), no jitter."""
    ws, bs = _weights()
    x, y, xs, ys = _data(8, 4)
    net = _torch_net(ws, bs)
    trak = TRAK(net, dim=1000, reg=0.0).fit(torch.as_tensor(x), torch.as_tensor(y))
    got = trak.score(torch.as_tensor(xs), torch.as_tensor(ys)).numpy()
    ref, cond = _reference([net], Margin(), x, y, xs, ys, 0.0, _q_margin(y))
    assert trak.jitter_ == (0.0,)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= _tol(cond, 43)


def test_float32_in_float32_out():
    ws, bs = _weights()
    x, y, xs, ys = _data(30, 4)
    net = _torch_net(ws, bs).float()
    got = TRAK(net, dim=1000, reg=1e-2).fit(torch.as_tensor(x, dtype=torch.float32),
                                             torch.as_tensor(y)).score(
        torch.as_tensor(xs, dtype=torch.float32), torch.as_tensor(ys))
    assert got.dtype == torch.float32
    ref, cond = _reference([_torch_net(ws, bs)], Margin(), x, y, xs, ys, 1e-2, _q_margin(y))
    err = np.abs(got.double().numpy() - ref).max() / np.abs(ref).max()
    assert err <= solve_tol(np.float32, cond, 2) + cond * kernel_tol(np.float32, 43, 4) + \
        20 * np.finfo(np.float32).eps, (err, cond)


@pytest.mark.parametrize("kind", ["torch", "jax", "mlp"])
def test_ensemble_of_checkpoints_and_seeds(kind):
    """A list of checkpoints: the per-checkpoint scores averaged, times the averaged Q
    (traker's ensemble); exact seeds repeat the same member, leaving the average unchanged."""
    if kind == "jax" and not HAS_JAX:
        pytest.skip("jax not installed")
    case = make_case({"torch": "torch", "jax": "jax", "mlp": "numpy"}[kind])
    nets = [_weights(0), _weights(5)]
    x, y, xs, ys = _data(50, 3)  # N > P = 43: the primal solve
    lam = 1e-2
    models = [_model(case, *wb) for wb in nets]
    trak = TRAK(models, dim=1000, seed=[0, 1], reg=lam)
    got = trak.fit(case.asarray(x), case.asarray(y, "int64")).score(
        case.asarray(xs), case.asarray(ys, "int64"))
    assert len(trak.features_) == 4
    ref, cond = _reference([_torch_net(*wb) for wb in nets], Margin(), x, y, xs, ys, lam,
                           _q_margin(y))
    assert np.abs(case.to_numpy(got) - ref).max() / np.abs(ref).max() <= _tol(cond, 43)


@pytest.mark.parametrize("kind", ["torch", "mlp"])  # (the JAX adapter: tests above)
def test_exact_trak_kernel_form(kind):
    """dim=None: exact TRAK from the unprojected eNTK (ntk of the one-output model, or the
    full-mode kernel contracted with the output gradients), two checkpoints."""
    case = make_case({"torch": "torch", "mlp": "numpy"}[kind])
    nets = [_weights(0), _weights(5)]
    x, y, xs, ys = _data(12, 3)
    lam = 1e-2
    trak = TRAK([_model(case, *wb) for wb in nets], dim=None, reg=lam)
    got = trak.fit(case.asarray(x), case.asarray(y, "int64")).score(
        case.asarray(xs), case.asarray(ys, "int64"))
    assert case.is_native(got) and got.shape == (3, 12)
    ref, cond = _reference([_torch_net(*wb) for wb in nets], Margin(), x, y, xs, ys, lam,
                           _q_margin(y))
    assert np.abs(case.to_numpy(got) - ref).max() / np.abs(ref).max() <= _tol(cond, 43)


def test_regression_output_and_custom_function():
    """``output="output"`` (Q = 1) and a user function with its own Q, against the reference."""
    ws, bs = _weights(classes=1)
    x, _, xs, _ = _data(10, 3)
    net = _torch_net(ws, bs)
    lam = 1e-2
    got = TRAK(net, dim=1000, output="output", reg=lam).fit(torch.as_tensor(x)).score(
        torch.as_tensor(xs)).numpy()
    ref, cond = _reference([net], Output(), x, None, xs, None, lam,
                           lambda out: np.ones(len(out)))
    assert np.abs(got - ref).max() / np.abs(ref).max() <= _tol(cond, 31)

    ws, bs = _weights()
    net = _torch_net(ws, bs)
    x, y, xs, ys = _data(10, 3)

    def fn(out, t):
        return out[:, 0] * t[:, 0] - out[:, 1] ** 2

    def weights(out, t):
        return torch.sigmoid(out[:, 2]) * t[:, 1]

    yt = np.stack([y + 0.5, y - 1.0], 1)
    yst = np.stack([ys + 0.5, ys - 1.0], 1)
    trak = TRAK(net, dim=1000, output=Custom(fn, weights), reg=lam)
    got = trak.fit(torch.as_tensor(x), torch.as_tensor(yt)).score(
        torch.as_tensor(xs), torch.as_tensor(yst)).numpy()
    ref, cond = _reference([net], Custom(fn), x, yt, xs, yst, lam, lambda out: weights(
        out, torch.as_tensor(yt)).numpy())
    assert np.abs(got - ref).max() / np.abs(ref).max() <= _tol(cond, 43)


def test_margin_functions_against_autograd():
    """Margin.value is log(p / (1 - p)); output_grad is its autograd gradient; Q = 1 - p."""
    rng = np.random.default_rng(3)
    out = torch.as_tensor(rng.standard_normal((7, 4)) * 3, dtype=torch.float64)
    y = torch.as_tensor(rng.integers(0, 4, 7))
    m = Margin()
    p = out.softmax(1)[torch.arange(7), y]
    assert torch.allclose(m.value(out, y), torch.log(p / (1 - p)), rtol=1e-12)
    assert torch.allclose(m.loss_weights(out, y), 1 - p, rtol=1e-12)
    g = torch.func.vmap(torch.func.grad(lambda o, t: m.value(o[None], t[None])[0]))(out, y)
    assert torch.allclose(m.output_grad(out, y), g, rtol=1e-12, atol=1e-15)
    assert set(OUTPUTS) >= {"margin", "output", "custom"}


@settings(max_examples=20)
@given(st.integers(2, 6), st.integers(0, 2**31 - 1), st.floats(0.1, 60.0))
def test_margin_is_stable_and_exact(classes, seed, scale):
    """The margin, its output gradient and Q against float64 log-odds and autograd for logits
    of any scale (no overflow of the log-sum-exp); Q = 1 - p = sigmoid(-margin)."""
    rng = np.random.default_rng(seed)
    out = torch.as_tensor(rng.standard_normal((5, classes)) * scale, dtype=torch.float64)
    y = torch.as_tensor(rng.integers(0, classes, 5))
    m = Margin()
    value, q = m.value(out, y), m.loss_weights(out, y)
    others = out.clone()
    others[torch.arange(5), y] = -math.inf
    ref = out[torch.arange(5), y] - torch.logsumexp(others, 1)
    eps = np.finfo(np.float64).eps
    assert torch.isfinite(value).all() and torch.isfinite(q).all()
    assert torch.allclose(value, ref, rtol=0, atol=16 * eps * (1 + float(out.abs().max())))
    assert torch.allclose(q, torch.sigmoid(-ref), rtol=16 * eps * (1 + float(out.abs().max())),
                          atol=1e-300)
    g = torch.func.vmap(torch.func.grad(lambda o, t: m.value(o[None], t[None])[0]))(out, y)
    assert torch.allclose(m.output_grad(out, y), g, rtol=0, atol=16 * eps)
    assert torch.allclose(g.sum(1), torch.zeros(5, dtype=torch.float64), atol=16 * eps)


def test_features_unbiased_over_seeds():
    """E[Phi Phi^T] = K, the exact kernel of the margin: the mean over S seeds lies within
    Z standard errors sqrt(Var / S) of K entry by entry (Var from feature_variance of the
    same one-output model), and a 30 % bias would be rejected."""
    ws, bs = _weights()
    x, y, _, _ = _data(6, 1)
    net = _torch_net(ws, bs)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    dim, seeds, z = 12, 200, 5.0
    trak = TRAK(net, dim=dim, seed=list(range(seeds)), reg=1.0).fit(xt, yt)
    est = np.mean([(p @ p.T).numpy() for p in trak.features_], axis=0)
    j = _grads(net, Margin(), x, y)
    k = j @ j.T
    model1, zin = adapter_for(net).one_output(net, Margin(), xt, yt)
    var = ntkcore.feature_variance(model1, zin, dim=dim).numpy()
    se = np.sqrt(var / seeds)
    assert np.all(np.abs(est - k) <= z * se + 1e-12), np.max(np.abs(est - k) / se)
    assert np.any(np.abs(1.3 * est - k) > z * se)


def test_bad_inputs_are_named():
    ws, bs = _weights()
    net = _torch_net(ws, bs)
    x, y, xs, ys = (torch.as_tensor(a) for a in _data(10, 3))
    with pytest.raises(RuntimeError, match="not fitted"):
        TRAK(net, dim=8).score(xs, ys)
    with pytest.raises(ValueError, match="output must be one of"):
        TRAK(net, dim=8, output="hinge")
    with pytest.raises(TypeError, match="output must be"):
        TRAK(net, dim=8, output=3)
    with pytest.raises(ValueError, match="reg must be non-negative"):
        TRAK(net, dim=8, reg=-1)
    with pytest.raises(TypeError, match="seed"):
        TRAK(net, dim=8, seed=[0, 1.5])
    with pytest.raises(ValueError, match="empty list"):
        TRAK([], dim=8)
    with pytest.raises(TypeError, match="no Jacobian provider"):
        TRAK(object(), dim=8)
    trak = TRAK(net, dim=8)
    with pytest.raises(ValueError, match="y_train must have one row per sample"):
        trak.fit(x, y[:5])
    with pytest.raises(ValueError, match="y_train is required"):
        trak.fit(x)
    with pytest.raises(TypeError, match="integer class labels"):
        trak.fit(x, y.double())
    with pytest.raises(ValueError, match=r"labels in \[1, 7\]"):
        trak.fit(x, torch.where(y == 0, 7, y))
    bad = x.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="x_train contains NaN"):
        trak.fit(bad, y)
    with pytest.raises(TypeError, match="y_train is a numpy"):
        trak.fit(x, y.numpy())
    trak.fit(x, y)
    with pytest.raises(ValueError, match="y_test must have one row"):
        trak.score(xs, ys[:2])
    with pytest.raises(ValueError, match="one output"):
        TRAK(net, dim=8, output="output").fit(x)
    with pytest.raises(NotImplementedError, match="output_grad"):
        mlp = MLP([w for w in _weights()[0]], activation="tanh")
        TRAK(mlp, dim=8, output=lambda o, t: o[:, 0]).fit(x.numpy())
    assert x.isfinite().all()  # inputs untouched
    assert math.isfinite(float(trak.score(xs, ys).sum()))


def test_zarr_store_resumes_and_matches_memory(tmp_path, monkeypatch):
    """store=: [Phi | Q] per member in Zarr chunks; an interrupted fit resumes (only the missing
    chunks are featurized), the scores equal the in-memory fit's, and a store of another
    model is refused."""
    pytest.importorskip("zarr")
    pytest.importorskip("dask")
    import ntkcore.attribution as attribution

    monkeypatch.setattr(attribution, "STORE_CHUNK_ROWS", 8)
    ws, bs = _weights()
    x, y, xs, ys = (torch.as_tensor(a) for a in _data(30, 4))
    net = _torch_net(ws, bs)
    mem = TRAK(net, dim=12, seed=[0, 1], reg=1e-2).fit(x, y)
    want = mem.score(xs, ys)

    calls, kill = [], [True]
    real = TRAK._featurize

    def failing(self, m, xx, yy, start, stop, reserve):
        calls.append((start, stop))
        if kill[0] and len(calls) == 4:  # the probe, chunks 0:8, 8:16; killed at 16:24
            raise KeyboardInterrupt
        return real(self, m, xx, yy, start, stop, reserve)

    monkeypatch.setattr(TRAK, "_featurize", failing)
    with pytest.raises(KeyboardInterrupt):
        TRAK(net, dim=12, seed=[0, 1], reg=1e-2, store=tmp_path / "s").fit(x, y)
    done_before = calls[1:3]  # the two chunks completed before the kill
    calls.clear()
    kill[0] = False
    stored = TRAK(net, dim=12, seed=[0, 1], reg=1e-2, store=tmp_path / "s").fit(x, y)
    # member 0: the probe and the two chunks left; member 1: the probe and all four chunks
    chunks = [(0, 8), (8, 16), (16, 24), (24, 30)]
    assert calls[0] == calls[3] == (0, 1)
    assert sorted(done_before + calls[1:3]) == chunks and sorted(calls[4:]) == chunks
    got = stored.score(xs, ys)
    assert got.dtype == want.dtype
    for a, b in zip(stored.features_, mem.features_, strict=True):  # rows of other batches
        assert np.abs(a.compute() - b.numpy()).max() <= kernel_tol(np.float64, 43) * \
            float(b.abs().max())
    cond = max(float(np.linalg.cond(p.numpy().T @ p.numpy() + 1e-2 * np.eye(12)))
               for p in mem.features_)
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= _tol(cond, 43), (err, cond)
    assert np.abs(stored.weights_.numpy() - mem.weights_.numpy()).max() <= \
        kernel_tol(np.float64, 43)

    other = _torch_net(*_weights(7))
    with pytest.raises(ValueError, match="parameters"):
        TRAK(other, dim=12, seed=[0, 1], store=tmp_path / "s").fit(x, y)

    # dim >= N: the dual solve reads the whole stored member back; exact features, so it
    # matches the float64 reference
    exact = TRAK(net, dim=1000, reg=1e-2, store=tmp_path / "dual").fit(x, y).score(xs, ys)
    ref, cond = _reference([net], Margin(), x.numpy(), y.numpy(), xs.numpy(), ys.numpy(),
                           1e-2, _q_margin(y.numpy()))
    assert np.abs(exact.numpy() - ref).max() / np.abs(ref).max() <= _tol(cond, 43)


def test_integer_inputs_travel_exactly():
    """Token ids (int64) are packed with the labels into one float row per sample and unpacked
    exactly: the projected-exact scores of an embedding model equal its kernel form, and ids
    beyond the float's exact integers are refused."""
    from ntkcore.backends.torch_attribution import OneOutput, pack

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(40, 3), torch.nn.Flatten(),
                              torch.nn.Linear(12, 3)).double()
    ids = torch.randint(0, 40, (9, 4))
    y = torch.randint(0, 3, (9,))
    z = pack(ids, y, torch.float64)
    wrapped = OneOutput(net, Margin(), ids, y)
    with torch.no_grad():
        assert torch.equal(wrapped(z)[:, 0], Margin().value(net(ids), y))
    a = TRAK(net, dim=10**4, reg=1e-2).fit(ids, y).score(ids[:3], y[:3])
    b = TRAK(net, dim=None, reg=1e-2).fit(ids, y).score(ids[:3], y[:3])
    k = ntkcore.ntk(wrapped, z, mode="trace").numpy()
    w = np.linalg.eigvalsh(k)
    cond = (w.max() + 1e-2) / (max(w.min(), 0.0) + 1e-2)
    assert float((a - b).abs().max() / b.abs().max()) <= _tol(cond, 160 + 39)
    with pytest.raises(ValueError, match=r"not exact in torch\.float32"):
        pack(torch.tensor([[2**24 + 1]]), None, torch.float32)


def test_each_checkpoint_gets_its_own_projection():
    """Checkpoint 0 projects with the seed itself (its features are those of
    ``ntkcore.features`` of the one-output model), checkpoint 1 with the seed's child, so two
    copies of one network are two different members."""
    ws, bs = _weights()
    x, y, _, _ = _data(8, 1)
    net = _torch_net(ws, bs)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    trak = TRAK([net, _torch_net(ws, bs)], dim=16, seed=3).fit(xt, yt)
    model1, z = adapter_for(net).one_output(net, Margin(), xt, yt)
    assert torch.equal(trak.features_[0], ntkcore.features(model1, z, dim=16, seed=3))
    assert not torch.allclose(trak.features_[0], trak.features_[1])
    assert torch.equal(trak.features_[1], ntkcore.features(
        model1, z, dim=16, seed=ntkcore.sketch.spawn_seed(3, 1)))


@pytest.mark.parametrize("kind", ["torch", "mlp"])
def test_probe_fixes_one_split_for_fit_and_score(kind):
    """``probe=k`` splits dim by the first k training samples' kernel shares, once, in fit:
    a test set made of training samples gets exactly their training features (the same
    projection), and the pair form ``probe=(x[:k], y[:k])`` is the same probe."""
    ws, bs = _weights()
    x, y, _, _ = _data(30, 5)
    if kind == "torch":
        model, xa, ya = _torch_net(ws, bs), torch.as_tensor(x), torch.as_tensor(y)
    else:
        from ntkcore.models import MLP

        model = MLP([np.asarray(w) for w in ws], [np.asarray(b) for b in bs], activation="tanh")
        xa, ya = x, y
    trak = TRAK(model, dim=12, seed=3, reg=1e-3, probe=8).fit(xa, ya)
    phi = np.asarray(trak.features_[0])
    sub = np.asarray(TRAK(model, dim=12, seed=3, reg=1e-3, probe=8).fit(xa, ya).score(
        xa[10:15], ya[10:15]))
    np.testing.assert_array_equal(sub, np.asarray(trak.score(xa[10:15], ya[10:15])))
    whole = np.asarray(trak.score(xa, ya))
    tol = 64 * np.finfo(np.float64).eps * np.abs(whole).max() * 30
    np.testing.assert_allclose(sub, whole[10:15], rtol=0, atol=tol)
    pair = TRAK(model, dim=12, seed=3, reg=1e-3, probe=(xa[:8], ya[:8])).fit(xa, ya)
    np.testing.assert_array_equal(np.asarray(pair.features_[0]), phi)
    plain = TRAK(model, dim=12, seed=3, reg=1e-3).fit(xa, ya)
    assert not np.allclose(np.asarray(plain.features_[0]), phi)  # the probe changes the split
    with pytest.raises(TypeError, match="probe must be"):
        TRAK(model, dim=12, probe="first").fit(xa, ya)


def test_store_refuses_another_probe(tmp_path):
    """A probe pair fixes the dim split: a store written with one is not resumed with another
    (its fingerprint holds the probe's arrays, not just "a probe was given")."""
    pytest.importorskip("zarr")
    ws, bs = _weights()
    x, y, _, _ = _data(20, 5)
    net, xa, ya = _torch_net(ws, bs), torch.as_tensor(x), torch.as_tensor(y)
    store = tmp_path / "trak"
    TRAK(net, dim=12, seed=3, probe=(xa[:8], ya[:8]), store=store).fit(xa, ya)
    TRAK(net, dim=12, seed=3, probe=(xa[:8], ya[:8]), store=store).fit(xa, ya)  # resumes
    with pytest.raises(ValueError, match=r"probe|differ|fingerprint"):
        TRAK(net, dim=12, seed=3, probe=(xa[8:16], ya[8:16]), store=store).fit(xa, ya)
