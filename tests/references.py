"""Independent reference implementations shared by several test files."""

from __future__ import annotations

import torch


def autograd_jacobian_graph(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(N, O, P) per-sample Jacobian, differentiable in ``x``: plain autograd per sample and
    output with ``create_graph``.  (Not ``torch.func``: its vmap under an outer autograd graph
    gives wrong input gradients through LayerNorm in torch 2.13.)"""
    ps = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        out = model(x[i:i + 1]).reshape(-1)
        rows.append(torch.stack([
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                out[k], ps, create_graph=True, retain_graph=True)])
            for k in range(out.shape[0])]))
    return torch.stack(rows)
