"""SENG in PyTorch training loops (issue 17), each with torch's own machinery: a real
``torch.amp.GradScaler``, ``torch.autocast``, ``Optimizer.add_param_group``, ``torch.compile``
and the preconditioner form followed by ``torch.optim.SGD``.

Tolerances: a SENG step solves, per block, :math:`(\\lambda I + U U^\\top / N) d = g` with
:math:`\\operatorname{cond} \\le 1 + \\sum_n \\|u_n\\|^2 / (N \\lambda)` (the trace of
:math:`U U^\\top/N` bounds its largest eigenvalue; :math:`u_n` = sample n's gradient over all
parameters bounds every block's), so two computations of it in a dtype differ by at most
``solve_tol(dtype, cond, 2)`` relative (tests/tolerances.py), plus the Gram's rounding
``cond * gamma(dtype, P)`` where the factors differ.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vjp, vmap  # noqa: E402

from ntkcore.backends.torch import SENG  # noqa: E402
from tests.tolerances import gamma, solve_tol  # noqa: E402

LAM, LR, N = 0.5, 0.3, 10


class Net(nn.Module):
    """Linear (Kronecker) -> tanh -> LayerNorm (dense, torch.func) -> Linear (Kronecker)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.ln(torch.tanh(self.fc1(x))))


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return Net().to(dtype)


def _data(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 6, generator=g).to(dtype), torch.randint(0, 4, (N,), generator=g)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _cond_bound(model, x, y):
    """1 + sum_n |u_n|^2 / (N lambda) in float64 (see the module docstring)."""
    m64 = _model(torch.float64)
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    params = {k: v.detach() for k, v in m64.named_parameters()}

    def loss1(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(m64, p, (xi[None],)), yi[None])

    ps = vmap(grad(loss1), in_dims=(None, 0, 0))(params, x.double(), y)
    sq = sum(v.reshape(N, -1).square().sum(1) for v in ps.values())
    return 1.0 + float(sq.sum()) / (N * LAM)


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _assert_same_update(model, before, expected, rtol):
    """||(theta - theta0) - (expected - theta0)|| <= rtol ||expected - theta0||."""
    got = torch.cat([(p.detach() - b).double().reshape(-1)
                     for p, b in zip(model.parameters(), before, strict=True)])
    ref = torch.cat([(e - b).double().reshape(-1)
                     for e, b in zip(expected, before, strict=True)])
    assert float((got - ref).norm()) <= rtol * float(ref.norm()), float(
        (got - ref).norm() / ref.norm())


def _plain_steps(x, y, steps=2, **kw):
    model = _model(**{k: v for k, v in kw.items() if k == "dtype"})
    opt = SENG(model, lr=LR, damping=LAM, **{k: v for k, v in kw.items() if k != "dtype"})
    for _ in range(steps):
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    return _snapshot(model)


# -- GradScaler --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["scaler.step", "unscale_ first"])
def test_grad_scaler_step_equals_the_unscaled_step(mode):
    # scaling by 2**10 and unscaling are exact in float32, so the captured output gradients
    # and the gradients are those of the unscaled backward up to the order of the roundings
    # of N / scale: the steps agree to the float32 solve tolerance
    x, y = _data()
    model = _model()
    before = _snapshot(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    kw = {"grad_scaler": scaler} if mode == "unscale_ first" else {}
    opt = SENG(model, lr=LR, damping=LAM, momentum=0.5, **kw)
    for _ in range(2):
        _scaled_step(model, opt, scaler, x, y, unscale=mode == "unscale_ first")
    expected = _plain_steps(x, y, momentum=0.5)
    _assert_same_update(model, before, expected,
                        solve_tol(torch.float32, _cond_bound(model, x, y), computations=2))


def _scaled_step(model, opt, scaler, x, y, unscale=False):
    """One GradScaler training step; ``unscale``: unscale_ first, as for gradient clipping."""
    opt.zero_grad()
    scaler.scale(_loss(model, x, y)).backward()
    if unscale:
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def test_grad_scaler_unscale_without_the_argument_is_loud():
    x, y = _data()
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = SENG(model, lr=LR, damping=LAM)
    before = _snapshot(model)
    scaler.scale(_loss(model, x, y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(ValueError, match="grad_scaler=scaler"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    with pytest.raises(TypeError, match="grad_scaler"):
        SENG(model, grad_scaler=2.0)


def test_grad_scaler_skips_a_non_finite_step():
    # an Inf in the batch: GradScaler finds Inf/NaN, the step is skipped (no error, nothing
    # changes, the scale backs off) and the next step is that of a fresh optimizer
    x, y = _data()
    model = _model()
    before = _snapshot(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = SENG(model, lr=LR, damping=LAM)
    bad = x.clone()
    bad[0, 0] = float("inf")
    _scaled_step(model, opt, scaler, bad, y)
    assert scaler.get_scale() == 2.0**9 and opt._step == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    _scaled_step(model, opt, scaler, x, y)
    expected = _plain_steps(x, y, steps=1)
    _assert_same_update(model, before, expected,
                        solve_tol(torch.float32, _cond_bound(model, x, y), computations=2))


# -- autocast ----------------------------------------------------------------------------------
def test_autocast_bfloat16_step_equals_the_step_of_its_own_forward():
    # Under autocast the layers see bfloat16 inputs and output gradients.  The reference is
    # the damped natural-gradient step built in float64 from those same bfloat16 values
    # (captured here by the test's own hooks): Linear per-sample gradients N gy_n [a_n, 1]^T,
    # LayerNorm ones pulled back from the model output's gradient by torch.func (float64), and
    # the mean gradient p.grad.  SENG casts the captured values to float32 before its linear
    # algebra, so it differs from the reference by float32 rounding only: the solve
    # (solve_tol) and the products with the factors (gamma over the P_b <= 56 terms of a
    # block's sums, plus the fan-ins 6 + 8 of the float32 torch.func pass to first order),
    # times the condition number; one more bfloat16 rounding (u = 2**-8) is far above it.
    x, y = _data()
    model = _model()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = SENG(model, lr=LR, damping=LAM)
    seen = {}

    def keep(name):
        def hook(mod, args, out):
            seen[name] = {"a": args[0].detach()}
            out.register_hook(lambda g: seen[name].__setitem__("gy", g.detach()))
        return hook

    handles = [getattr(model, k).register_forward_hook(keep(k)) for k in ("fc1", "fc2")]
    handles.append(model.register_forward_hook(keep("out")))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = _loss(model, x, y)
    loss.backward()
    for h in handles:
        h.remove()
    assert seen["fc2"]["gy"].dtype == seen["fc2"]["a"].dtype == torch.bfloat16
    grads = {k: p.grad.double() for k, p in model.named_parameters()}
    opt.step()

    def kron(name):  # (N, d_out * (d_in + 1)): [W | b] row-major
        a, gy = seen[name]["a"].double(), seen[name]["gy"].double() * N
        return torch.einsum("no,ni->noi", gy, torch.cat([a, torch.ones(N, 1).double()], 1))

    m64 = _model(torch.float64)
    m64.load_state_dict({k: v.double() for k, v in before.items()})
    ln = {k: v.double() for k, v in before.items() if k.startswith("ln.")}
    base = {k: v.double() for k, v in before.items()}

    def pull(e, xi):
        return vjp(lambda p: functional_call(m64, {**base, **p}, (xi[None],))[0], ln)[1](e)[0]

    ps = vmap(pull)(seen["out"]["gy"].double() * N, x.double())
    blocks = {"fc1": kron("fc1").reshape(N, -1), "fc2": kron("fc2").reshape(N, -1),
              "ln": torch.cat([ps["ln.weight"], ps["ln.bias"]], 1)}
    cond = 1.0
    for name, u in blocks.items():
        names = [f"{name}.weight", f"{name}.bias"]
        if name == "ln":
            g = torch.cat([grads[k] for k in names])
        else:
            g = torch.cat([grads[names[0]], grads[names[1]][:, None]], 1).reshape(-1)
        a = LAM * torch.eye(u.shape[1], dtype=torch.float64) + u.T @ u / N
        cond = max(cond, float(torch.linalg.cond(a)))
        d = torch.linalg.solve(a, g)
        if name != "ln":
            d = d.reshape(before[names[1]].shape[0], -1)
            d = [d[:, :-1].reshape(before[names[0]].shape), d[:, -1]]
        else:
            d = list(torch.split(d, [8, 8]))
        for k, dk in zip(names, d, strict=True):
            expected = before[k].double() - LR * dk
            got = dict(model.named_parameters())[k].detach().double()
            change = (expected - before[k].double()).norm()
            tol = solve_tol(torch.float32, cond, 2) + cond * gamma(torch.float32, 56 + 6 + 8)
            assert float((got - expected).norm()) <= tol * float(change), k


# -- add_param_group ---------------------------------------------------------------------------
def test_param_group_added_later_gets_the_same_steps():
    x, y = _data(torch.float64)
    model = _model(torch.float64)
    before = _snapshot(model)
    first = [model.fc1.weight, model.fc1.bias]
    opt = SENG(first, lr=LR, damping=LAM, model=model, momentum=0.5, update_freq=2)
    opt.add_param_group({"params": [p for p in model.parameters()
                                    if all(p is not q for q in first)]})
    for _ in range(3):  # refresh, cached, refresh
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    expected = _plain_steps(x, y, steps=3, dtype=torch.float64, momentum=0.5, update_freq=2)
    _assert_same_update(model, before, expected,
                        solve_tol(torch.float64, _cond_bound(model, x, y), computations=2))


def test_param_group_added_between_steps_is_updated():
    x, y = _data(torch.float64)
    model = _model(torch.float64)
    opt = SENG(model.fc1.parameters(), lr=LR, damping=LAM, model=model, update_freq=3)
    _loss(model, x, y).backward()
    opt.step()  # the next step would reuse the curvature: the hooks are off
    opt.add_param_group({"params": list(model.fc2.parameters())})
    head = [p.detach().clone() for p in model.fc2.parameters()]
    opt.zero_grad()
    _loss(model, x, y).backward()
    opt.step()
    assert all(not torch.equal(p, h) for p, h in zip(model.fc2.parameters(), head, strict=True))
    assert opt._refreshes == 2
    with pytest.raises(ValueError, match="do not belong to the model"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 2 and len(opt.units) == 2  # refused, nothing changed


# -- torch.compile -----------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["SENG then compile", "compile then SENG"])
def test_torch_compile_in_either_order(order):
    torch._dynamo.reset()
    x, y = _data(torch.float64)
    model = _model(torch.float64)
    before = _snapshot(model)
    if order == "SENG then compile":
        opt = SENG(model, lr=LR, damping=LAM, update_freq=2)
        run = torch.compile(model, backend="aot_eager")
    else:
        run = torch.compile(model, backend="aot_eager")
        opt = SENG(run, lr=LR, damping=LAM, update_freq=2)
    for _ in range(3):
        opt.zero_grad()
        _loss(run, x, y).backward()
        opt.step()
    assert opt._refreshes == 2 and set(opt._solvers) == {"fc1", "fc2", "dense:ln"}
    expected = _plain_steps(x, y, steps=3, dtype=torch.float64, update_freq=2)
    _assert_same_update(model, before, expected,
                        solve_tol(torch.float64, _cond_bound(model, x, y), computations=2))
    torch._dynamo.reset()


# -- the preconditioner form -------------------------------------------------------------------
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "GradScaler"])
def test_precondition_then_sgd_equals_the_seng_step(scaled):
    x, y = _data()
    model = _model()
    before = _snapshot(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    seng = SENG(model, damping=LAM, weight_decay=0.01, update_freq=2, grad_scaler=scaler)
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
    for _ in range(3):
        sgd.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        scaler.unscale_(sgd)
        seng.precondition()
        scaler.step(sgd)
        scaler.update()
    expected = _plain_steps(x, y, steps=3, weight_decay=0.01, update_freq=2)
    _assert_same_update(model, before, expected,
                        solve_tol(torch.float32, _cond_bound(model, x, y), computations=2))


def test_precondition_leaves_a_non_finite_gradient_to_the_scaler():
    x, y = _data()
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    seng = SENG(model, damping=LAM, grad_scaler=scaler)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = _snapshot(model)
    bad = x.clone()
    bad[0, 0] = float("nan")
    scaler.scale(_loss(model, bad, y)).backward()
    scaler.unscale_(adam)
    seng.precondition()  # no error: scaler.step skips the step
    scaler.step(adam)
    scaler.update()
    assert seng._step == 0 and scaler.get_scale() == 2.0**9
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    plain = SENG(_model(), damping=LAM)
    m = plain.model
    _loss(m, bad, y).backward()
    with pytest.raises(ValueError, match="NaN or Inf"):
        plain.precondition()
