"""Concurrent and interrupted torch-provider calls: correct kernels, an unchanged model.

The reference kernels come from plain per-sample autograd (float64, single-threaded, no
``torch.func`` and no parameter swapping), so they are independent of the provider's hooks,
Kronecker factors and ``functional_call``.  The model of issue 15 (item 3) has a BatchNorm in
eval mode (here a subclass with its own ``forward`` that uses ``torch.addcmul``: since issue
18 a plain BatchNorm's block comes from the hooks, and ``F.batch_norm`` calls are recognised
too): a DenseBlock built by ``torch.func.functional_call``, which swaps the
module's parameters in place while it runs, next to Linear layers whose Kronecker factors come
from forward hooks.  Before the provider took a per-model lock and filtered its hooks by thread,
three threads of 15 calls gave wrong kernels (0.4 max abs error), functorch internal asserts
and BatchNorm parameters permanently replaced by plain tensors in 6 of 6 trials.
"""

from __future__ import annotations

import math
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ntkcore  # noqa: E402

DT = torch.float64
EPS = torch.finfo(DT).eps


class _FuncBatchNorm(nn.BatchNorm1d):
    """An eval-mode BatchNorm1d with its own ``forward`` that applies its affine with
    ``torch.addcmul``, a use of its parameters that neither the hooks nor the functional calls
    of ``torch_functional`` recognise: the provider takes it through ``torch.func``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xhat = (x - self.running_mean) / torch.sqrt(self.running_var + self.eps)
        return torch.addcmul(self.bias, xhat, self.weight)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), _FuncBatchNorm(32), nn.Tanh(),
                         nn.Linear(32, 4)).to(DT).eval()


def _autograd_jacobian(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(N, O, P) per-sample Jacobian: one plain backward per sample and output."""
    ps = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        out = model(x[i:i + 1]).reshape(-1)
        rows.append(torch.stack([
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[k], ps,
                                                                  retain_graph=True)])
            for k in range(out.shape[0])]))
    return torch.stack(rows)


def _references(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Full eNTK (N, N, O, O), pseudo-NTK (N, N) and an absolute tolerance.

    Each entry is a dot product of length P; its rounding error is below
    gamma_P * sum_p |J_p J'_p| <= P eps max|J|^2 (plus the same for the reference; the
    pseudo-NTK's rows are sums of O entries over sqrt(O), so up to O times larger), so the
    tolerance is 4 P O eps max|J|^2 -- far below the 0.4 errors of the race.
    """
    jac = _autograd_jacobian(model, x)
    full = torch.einsum("nop,mqp->nmoq", jac, jac)
    js = jac.sum(1) / math.sqrt(jac.shape[1])
    pseudo = js @ js.T
    tol = 4 * jac.shape[2] * EPS * float(jac.abs().max()) ** 2 * jac.shape[1]
    return full, pseudo, tol


def _snapshot(model: nn.Module) -> dict:
    """Everything a call must leave as it was: tensor identities, flags, hooks, values."""
    return {
        "params": [(n, p, p.requires_grad, p.detach().clone()) for n, p in
                   model.named_parameters()],
        "buffers": [(n, b, b.clone()) for n, b in model.named_buffers()],
        "training": [m.training for m in model.modules()],
        "hooks": [(dict(m._forward_hooks), dict(m._forward_pre_hooks),
                   dict(m._backward_hooks)) for m in model.modules()],
    }


def _assert_unchanged(model: nn.Module, snap: dict) -> None:
    now = list(model.named_parameters())
    assert len(now) == len(snap["params"])
    for (n, p), (n0, p0, rg0, v0) in zip(now, snap["params"], strict=True):
        assert n == n0 and p is p0, f"parameter {n} was replaced"
        assert isinstance(p, nn.Parameter) and p.requires_grad == rg0
        assert torch.equal(p.detach(), v0), f"parameter {n} changed value"
    for (n, b), (n0, b0, v0) in zip(model.named_buffers(), snap["buffers"], strict=True):
        assert n == n0 and b is b0 and torch.equal(b, v0), f"buffer {n} changed"
    assert [m.training for m in model.modules()] == snap["training"]
    hooks = [(dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
             for m in model.modules()]
    assert hooks == snap["hooks"]


def test_concurrent_calls_give_reference_kernels_and_leave_model_unchanged():
    model = _model()
    seen = []
    model[0].register_forward_hook(lambda mod, args, out: seen.append(1))  # a user's hook
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(24, 8, generator=gen, dtype=DT) for _ in range(4)]
    refs = [_references(model, x) for x in xs]
    snap = _snapshot(model)
    errors: list[str] = []

    def work(i: int) -> None:
        full, pseudo, tol = refs[i]
        try:
            for r in range(8):
                if r % 2:
                    k = ntkcore.pseudo_ntk(model, xs[i])
                    err = float((k - pseudo).abs().max())
                else:
                    k = ntkcore.ntk(model, xs[i], mode="full")
                    err = float((k - full).abs().max())
                if not err <= tol:
                    errors.append(f"thread {i} call {r}: max abs error {err:.3g} > {tol:.3g}")
        except Exception as exc:
            errors.append(f"thread {i}: {exc!r}"[:300])

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: the races show in every run
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert not errors, "\n".join(errors)
    _assert_unchanged(model, snap)


class _Interrupting(nn.Module):
    """Tanh that raises KeyboardInterrupt on its ``at``-th call (counted from 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(32, dtype=DT))  # a DenseBlock (torch.func pass)
        self.calls = 0
        self.at = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return torch.tanh(h * self.scale)


@pytest.mark.parametrize("at", [1, 2], ids=["hooked-forward", "torch.func-pass"])
def test_interrupt_mid_call_leaves_no_hook_and_restores_parameters(at):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), _Interrupting(), nn.Linear(32, 3)).to(DT).train()
    model[0].register_forward_pre_hook(lambda mod, args: None)
    x = torch.randn(6, 8, dtype=DT)
    full, _, tol = _references(model, x)
    snap = _snapshot(model)
    model[1].calls, model[1].at = 0, at
    with pytest.raises(KeyboardInterrupt):
        ntkcore.ntk(model, x, mode="full")
    assert model[1].calls == at  # the interrupt hit the pass it was meant for
    _assert_unchanged(model, snap)
    # the model's lock was released: another thread can run a correct call at once
    model[1].at = 0
    out: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: out.append(ntkcore.ntk(model, x, mode="full")))
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the model's lock was not released by the interrupted call"
    assert float((out[0] - full).abs().max()) <= tol
    _assert_unchanged(model, snap)


def test_user_hooks_and_training_flags_are_unchanged():
    # a training-mode model without sample coupling, a user forward hook that sees the calls,
    # a frozen parameter and a buffer: all as before after ntk and pseudo_ntk
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.0), nn.LayerNorm([16]), nn.Tanh(),
                          nn.BatchNorm1d(16), nn.Linear(16, 2)).to(DT)
    model.train()
    model[4].eval()  # running statistics: no coupling
    model[2].bias.requires_grad_(False)
    calls = []
    model[5].register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    x = torch.randn(7, 5, dtype=DT)
    full, pseudo, tol = _references(model, x)
    snap = _snapshot(model)
    calls.clear()
    k = ntkcore.ntk(model, x, mode="full")
    assert float((k - full).abs().max()) <= tol
    assert float((ntkcore.pseudo_ntk(model, x) - pseudo).abs().max()) <= tol
    assert calls  # the user's hook ran (on the provider's forwards) and is still there
    _assert_unchanged(model, snap)


def test_seng_training_thread_with_concurrent_ntk_calls():
    # the documented recipe: a training loop that holds model_lock(model) around forward,
    # backward and step() is unaffected by ntk() calls on the same model in another thread
    # (without the lock the ntk thread's backward can see step()'s in-place update and raise,
    # and its torch.func pass can hide the LayerNorm's parameters from the training forward)
    from ntkcore.backends.torch import SENG
    from ntkcore.backends.torch_jacobian import model_lock

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 5, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (16,), generator=gen)
    x_probe = torch.randn(6, 5, generator=gen, dtype=DT)

    def train(model, lock):
        opt = SENG(model, lr=0.2, damping=0.5, update_freq=2)
        for _ in range(6):
            with lock:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 16), nn.LayerNorm(16), nn.Tanh(),
                             nn.Linear(16, 3)).to(DT)

    alone = net()
    train(alone, threading.Lock())
    model = net()
    done = threading.Event()
    errors: list[str] = []

    def probe():
        try:
            while not done.is_set():
                ntkcore.ntk(model, x_probe, mode="trace")
        except Exception as exc:
            errors.append(repr(exc)[:300])

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    t = threading.Thread(target=probe)
    t.start()
    try:
        train(model, model_lock(model))
    finally:
        done.set()
        t.join(timeout=60)
        sys.setswitchinterval(old)
    assert not errors, errors
    for p, q in zip(model.parameters(), alone.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0,
                                   atol=64 * EPS * float(q.detach().abs().max()))
