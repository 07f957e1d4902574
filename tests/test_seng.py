"""The SENG optimizer against dense damped natural-gradient steps built from torch.func
per-sample gradients and torch.linalg.solve (float64), plus training and distributed checks."""

from __future__ import annotations

import io
import os
import socket
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402

from ntkcore.backends.torch import SENG  # noqa: E402

LAM = 0.5
LR = 0.3


class Net(nn.Module):
    """Conv (Kronecker, S = 16 positions) -> LayerNorm (dense fallback) -> Linear (S = 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.ln = nn.LayerNorm(48)
        self.fc = nn.Linear(48, 5)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.fc(self.ln(h))


# block layout: (name, [param names], kronecker?)
BLOCKS = [("conv", ["conv.weight", "conv.bias"], True), ("ln", ["ln.weight", "ln.bias"], False),
          ("fc", ["fc.weight", "fc.bias"], True)]


def _data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 1, 4, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (n,), generator=g))


def _model(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def _per_sample(model, params, x, y):
    def loss1(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    return vmap(grad(loss1), in_dims=(None, 0, 0))(params, x, y)


def _flat(tensors, names, kron, lead=()):
    """Block vector in SENG's layout: [W | b] row-major for Kronecker blocks."""
    if kron:
        w, b = tensors[names[0]], tensors[names[1]]
        d_out = b.shape[-1]
        return torch.cat([w.reshape(*lead, d_out, -1), b[..., None]], -1).reshape(*lead, -1)
    return torch.cat([tensors[k].reshape(*lead, -1) for k in names], -1)


def _dense_direction(per_sample, g_vec, names, kron, lam, n):
    u = _flat(per_sample, names, kron, lead=(n,))  # (N, P_b)
    p = u.shape[1]
    return torch.linalg.solve(lam * torch.eye(p, dtype=torch.float64) + u.T @ u / n, g_vec)


def _step_reference(model, params, x_curv, y_curv, g_tensors, lam, wd=0.0):
    """theta - LR * d per block, with U from (x_curv, y_curv) and gradient g_tensors."""
    ps = _per_sample(model, params, x_curv, y_curv)
    out = {}
    for _, names, kron in BLOCKS:
        g_vec = _flat(g_tensors, names, kron) + wd * _flat(params, names, kron)
        d = _dense_direction(ps, g_vec, names, kron, lam, x_curv.shape[0])
        out[tuple(names)] = _flat(params, names, kron) - LR * d
    return out


def _assert_params(model, expected, atol=1e-10):
    current = {k: v.detach() for k, v in model.named_parameters()}
    for _, names, kron in BLOCKS:
        torch.testing.assert_close(_flat(current, names, kron), expected[tuple(names)],
                                   rtol=1e-9, atol=atol)


def _loss_backward(model, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def test_one_step_equals_dense_natural_gradient():
    model = _model()
    x, y = _data()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = SENG(model, lr=LR, damping=LAM, weight_decay=0.01)
    _loss_backward(model, x, y)
    mean_g = {k: v.mean(0) for k, v in _per_sample(model, params, x, y).items()}
    opt.step()
    _assert_params(model, _step_reference(model, params, x, y, mean_g, LAM, wd=0.01))


def test_update_freq_reuses_old_curvature_and_damping_schedule():
    model = _model(1)
    x1, y1 = _data(seed=1)
    x2, y2 = _data(seed=2)
    lams = {0: 0.5, 1: 0.2}
    opt = SENG(model, lr=LR, damping=1.0, update_freq=2, damping_schedule=lambda k: lams[k])
    _loss_backward(model, x1, y1)
    opt.step()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt.zero_grad()
    _loss_backward(model, x2, y2)
    mean_g = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    opt.step()
    # curvature: per-sample gradients of batch 1 at the parameters of step 1 (not refreshed)
    model_at_1 = _model(1)
    params_1 = {k: v.detach().clone() for k, v in model_at_1.named_parameters()}
    ps = _per_sample(model_at_1, params_1, x1, y1)
    for _, names, kron in BLOCKS:
        d = _dense_direction(ps, _flat(mean_g, names, kron), names, kron, 0.2, 8)
        got = _flat({k: v.detach() for k, v in model.named_parameters()}, names, kron)
        torch.testing.assert_close(got, _flat(params, names, kron) - LR * d, rtol=1e-9,
                                   atol=1e-10)


def test_sketch_is_seeded_and_exact_when_large():
    x, y = _data()
    outs = []
    for sketch, size, seed in (("leverage", 20, 3), ("leverage", 20, 3), ("leverage", 20, 4),
                               ("uniform", 10_000, 0), (None, 1, 0)):
        model = _model()
        opt = SENG(model, lr=LR, damping=LAM, sketch=sketch, sketch_size=size, seed=seed)
        _loss_backward(model, x, y)
        opt.step()
        outs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[3], outs[4], rtol=1e-12, atol=1e-12)


def test_state_dict_round_trip():
    model = _model()
    opt = SENG(model, lr=LR, damping=LAM, momentum=0.9, update_freq=3, sketch="uniform",
               sketch_size=30)
    batches = [_data(seed=s) for s in range(6)]
    for x, y in batches[:2]:
        opt.zero_grad()
        _loss_backward(model, x, y)
        opt.step()
    model2 = _model(7)
    model2.load_state_dict(model.state_dict())
    opt2 = SENG(model2, lr=1.0, damping=2.0, momentum=0.9, update_freq=3, sketch="uniform",
                sketch_size=30)
    buffer = io.BytesIO()  # through bytes, as a checkpoint on disk would be
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer))
    for m, o in ((model, opt), (model2, opt2)):
        for x, y in batches[2:]:
            o.zero_grad()
            _loss_backward(m, x, y)
            o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)


def test_float32_model_and_errors():
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    opt = SENG(model, lr=0.1, damping=1.0)
    with pytest.raises(RuntimeError, match="no captured"):
        opt.step()  # no forward/backward yet
    x = torch.randn(6, 5)
    nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0, 1, 2])).backward()
    opt.step()
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(TypeError, match="needs the model"):
        SENG(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="damping"):
        SENG(model, damping=0.0)
    with pytest.raises(ValueError, match="sketch"):
        SENG(model, sketch="fancy")
    with pytest.raises(ValueError, match="update_freq"):
        SENG(model, update_freq=0)


def test_low_rank_mode_runs():
    model = _model()
    x, y = _data()
    opt = SENG(model, lr=LR, damping=LAM, low_rank=2)
    _loss_backward(model, x, y)
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- training: digits --------------------------------------------------------------------------
def _digits_epochs(opt_name, lr, target, max_epochs=10, **kw):
    from sklearn.datasets import load_digits

    xs, ys = load_digits(return_X_y=True)
    xs = (xs - xs.mean(0)) / (xs.std(0) + 1e-6)
    x = torch.as_tensor(xs, dtype=torch.float32)
    y = torch.as_tensor(ys)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    elif opt_name == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        opt = SENG(model, lr=lr, momentum=0.9, **kw)
    crit = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(0)
    for epoch in range(1, max_epochs + 1):
        perm = torch.randperm(x.shape[0], generator=gen)
        for s in range(0, x.shape[0], 128):
            idx = perm[s:s + 128]
            opt.zero_grad()
            crit(model(x[idx]), y[idx]).backward()
            opt.step()
        with torch.no_grad():
            if float(crit(model(x), y)) <= target:
                return epoch
    return max_epochs + 1


def test_seng_beats_tuned_sgd_and_adam_on_digits():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = 3e-4
        seng = _digits_epochs("seng", 0.5, target, damping=0.1)
        assert seng <= 8
        # each baseline gets its best learning rate from a grid around its usual optimum
        sgd = min(_digits_epochs("sgd", lr, target, max_epochs=seng) for lr in (0.3, 0.5))
        adam = min(_digits_epochs("adam", lr, target, max_epochs=seng)
                   for lr in (0.03, 0.05, 0.1))
    finally:
        torch.set_num_threads(threads)
    assert seng < sgd and seng < adam, (seng, sgd, adam)


# -- distributed -------------------------------------------------------------------------------
def _ddp_worker(rank, world, port, outdir):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model(5)
        ddp = nn.parallel.DistributedDataParallel(model)
        x, y = _data(n=16, seed=9)
        xl, yl = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
        opt = SENG(ddp, lr=LR, damping=LAM)
        nn.functional.cross_entropy(ddp(xl), yl).backward()
        opt.step()
        torch.save({k: v.detach() for k, v in model.named_parameters()},
                   Path(outdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.skipif(sys.platform == "win32", reason="gloo spawn test is POSIX-only here")
def test_distributed_directions_are_averaged(tmp_path):
    import torch.multiprocessing as mp

    # spawn, not fork: the test process runs JAX's and torch's threads (tests/conftest.py
    # imports jax), and a forked child of a multithreaded process can deadlock on a lock held
    # by a thread that does not exist in it (Python warns); fresh interpreters cost ~5 s
    method = "spawn"
    mp.start_processes(_ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2,
                       join=True, start_method=method)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = _model(5)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = _data(n=16, seed=9)
    ps = _per_sample(model, params, x, y)
    mean_g = {k: v.mean(0) for k, v in ps.items()}
    for _, names, kron in BLOCKS:
        g_vec = _flat(mean_g, names, kron)
        ds = []
        for r in range(2):
            local = {k: v[r * 8:(r + 1) * 8] for k, v in ps.items()}
            ds.append(_dense_direction(local, g_vec, names, kron, LAM, 8))
        expected = _flat(params, names, kron) - LR * (ds[0] + ds[1]) / 2
        for r in range(2):
            torch.testing.assert_close(_flat(got[r], names, kron), expected, rtol=1e-9,
                                       atol=1e-10)


@pytest.mark.parametrize("sketch", [None, "leverage", "gaussian"])
def test_cached_direction_equals_smw_solver(sketch):
    # the per-step fast path (factors cached at the refresh) == the generic SMWSolver.solve,
    # for Kronecker (S = 16 and S = 1) and dense blocks, sketched or not
    x, y = _data()
    model = _model()
    opt = SENG(model, lr=LR, damping=LAM, sketch=sketch, sketch_size=20, seed=1)
    _loss_backward(model, x, y)
    opt.step()
    gen = torch.Generator().manual_seed(5)
    assert set(opt._directions) == set(opt._solvers) and len(opt._solvers) == 3
    for name, solver in opt._solvers.items():
        g = torch.randn(solver.op.shape[0], generator=gen, dtype=torch.float64)
        torch.testing.assert_close(opt._directions[name](g), solver.solve(g), rtol=1e-10,
                                   atol=1e-12)


def test_hooks_attached_only_before_refresh_steps():
    model = _model()
    x, y = _data()
    opt = SENG(model, lr=LR, damping=LAM, update_freq=3)

    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    attached = []
    for _ in range(7):
        attached.append(hooks() > 0)
        opt.zero_grad()
        _loss_backward(model, x, y)
        opt.step()
    assert attached == [True, False, False, True, False, False, True]
    assert opt._refreshes == 3
    opt.remove_hooks()
    assert hooks() == 0


def _param_snapshot(model):
    return [(p, p.detach().clone()) for p in model.parameters()]


def _assert_same_params(model, snap):
    for p, (p0, v0) in zip(model.parameters(), snap, strict=True):
        assert p is p0 and torch.equal(p.detach(), v0)


@pytest.mark.parametrize("update_freq", [1, 2])
@pytest.mark.parametrize("call", ["ntk", "pseudo_ntk", "ntk_before_backward"])
def test_ntk_between_backward_and_step_does_not_change_the_update(call, update_freq):
    # issue 15, item 4: ntkcore's own forward/backward passes on a model with SENG attached
    # must not be captured as the training batch (before the fix: 0.31 max abs difference)
    import ntkcore

    x, y = _data()
    x_other = _data(n=5, seed=7)[0]

    def train(with_ntk):
        model = _model()
        opt = SENG(model, lr=LR, damping=LAM, update_freq=update_freq)
        for _ in range(3):  # refresh, (non-refresh,) refresh/non-refresh steps
            opt.zero_grad()
            if with_ntk and call == "ntk_before_backward":
                out = model(x)
                ntkcore.ntk(model, x_other, mode="trace")
                nn.functional.cross_entropy(out, y).backward()
            else:
                _loss_backward(model, x, y)
                if with_ntk:
                    (ntkcore.pseudo_ntk(model, x_other) if call == "pseudo_ntk"
                     else ntkcore.ntk(model, x_other, mode="full"))
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    plain, with_ntk = train(False), train(True)
    # the same operations on the same data: equal to the last bit (up to thread scheduling of
    # the BLAS, hence a few ulps of the parameters' size)
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(with_ntk, plain, rtol=0,
                               atol=16 * eps * float(plain.abs().max()))


@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "cached"])
@pytest.mark.parametrize("where", ["fc.weight", "ln.bias"])
def test_nan_gradient_raises_and_leaves_parameters(refresh, where):
    # issue 15, item 5: a NaN gradient never reaches the parameters, on any step
    model = _model()
    x, y = _data()
    opt = SENG(model, lr=LR, damping=LAM, update_freq=1 if refresh else 3, momentum=0.5)
    if not refresh:
        _loss_backward(model, x, y)
        opt.step()
        opt.zero_grad()
    _loss_backward(model, x, y)
    dict(model.named_parameters())[where].grad.view(-1)[1] = float("nan")
    snap = _param_snapshot(model)
    with pytest.raises(ValueError, match=rf"gradient of parameter '{where}'.*NaN or Inf"):
        opt.step()
    _assert_same_params(model, snap)
    assert opt._step == (0 if refresh else 1)


def _coupled_model(layer):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), layer, nn.LayerNorm(16), nn.Tanh(),
                         nn.Linear(16, 3)).double().train()


@pytest.mark.parametrize("layer, match", [
    (lambda: nn.BatchNorm1d(16), "BatchNorm"),
    (lambda: nn.BatchNorm1d(16, affine=False), "BatchNorm"),
    (lambda: nn.BatchNorm1d(16, track_running_stats=False).eval(), "BatchNorm"),
    (lambda: nn.Dropout(0.3), "Dropout"),
], ids=["batchnorm", "batchnorm-nonaffine", "batchnorm-no-running-stats", "dropout"])
def test_samples_that_interact_raise_a_clear_error(layer, match):
    # issue 15, item 5: batch statistics couple the samples (no per-sample gradients); a
    # Dropout's mask cannot be replayed by the torch.func pass of the dense layers.  Before
    # the fix: vmap errors, or (non-affine BatchNorm) a silent step.
    model = _coupled_model(layer())
    opt = SENG(model, lr=0.1, damping=1.0)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    snap = _param_snapshot(model)
    with pytest.raises(ValueError, match=rf"SENG.*module '1' is a {match}"):
        opt.step()
    _assert_same_params(model, snap)


def test_dropout_with_only_kronecker_layers_is_exact():
    # the hooks see the real (dropped-out) inputs, so per-sample gradients are exact for the
    # mask of this forward: the step equals the dense reference with that mask
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))
    model = model.double().train()
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = SENG(model, lr=LR, damping=LAM)
    masks = []
    model[2].register_forward_hook(lambda m, a, out: masks.append((out != 0).double() / 0.7))
    nn.functional.cross_entropy(model(x), y).backward()
    mask = masks[0]

    def loss1(p, xi, yi, mi):
        h = torch.tanh(xi[None] @ p["0.weight"].T + p["0.bias"]) * mi[None]
        return nn.functional.cross_entropy(h @ p["3.weight"].T + p["3.bias"], yi[None])

    ps = vmap(grad(loss1), in_dims=(None, 0, 0, 0))(params, x, y, mask)
    opt.step()
    for names in (["0.weight", "0.bias"], ["3.weight", "3.bias"]):
        g = _flat({k: v.mean(0) for k, v in ps.items()}, names, True)
        d = _dense_direction(ps, g, names, True, LAM, 8)
        got = _flat({k: v.detach() for k, v in model.named_parameters()}, names, True)
        torch.testing.assert_close(got, _flat(params, names, True) - LR * d, rtol=1e-9,
                                   atol=1e-10)


def test_non_finite_direction_raises_and_leaves_parameters_and_momentum():
    # a finite gradient whose direction overflows (simulated: the cached solver of one block
    # returns NaN) must not reach the parameters or the momentum buffers either
    model = _model()
    x, y = _data()
    opt = SENG(model, lr=LR, damping=LAM, update_freq=3, momentum=0.5)
    for _ in range(2):
        opt.zero_grad()
        _loss_backward(model, x, y)
        opt.step()
    bufs = {id(p): opt.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    opt._directions["dense:ln"] = lambda g: torch.full_like(g, float("nan"))
    opt.zero_grad()
    _loss_backward(model, x, y)
    snap = _param_snapshot(model)
    with pytest.raises(ValueError, match=r"direction of block 'dense:ln'.*no parameter"):
        opt.step()
    _assert_same_params(model, snap)
    for p in model.parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], bufs[id(p)])
    assert opt._step == 2


class _DoubledLinear(nn.Linear):
    """A Linear subclass with a forward of its own, y = W (2 x) + b: not the Kronecker factors
    (x, dL/dy) of torch's Linear; SENG must take it as a dense layer (torch_layers.FORWARD)."""

    def forward(self, x):
        return nn.functional.linear(2 * x, self.weight, self.bias)


def test_linear_subclass_with_its_own_forward_gets_exact_per_sample_gradients():
    model = _model(3)
    fc = _DoubledLinear(48, 5).double()
    fc.load_state_dict(model.fc.state_dict())
    model.fc = fc
    x, y = _data(seed=3)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = SENG(model, lr=LR, damping=LAM)
    _loss_backward(model, x, y)
    mean_g = {k: v.mean(0) for k, v in _per_sample(model, params, x, y).items()}
    opt.step()
    _assert_params(model, _step_reference(model, params, x, y, mean_g, LAM))
