"""The provider drops zero positions only where the Gram gains more than the read and the
copy cost (``torch_layers.drop_zero_positions``, priced by default; issue 32).

A convolution whose stride skips the last row and column of its input leaves 59 of its 900
positions with zero g: the materialise route would save a few percent of forming the
per-sample weights, a copy of g costs more, so the block keeps them (the same arrays).  A
class-token readout over 65 tokens keeps one position of the last Linear, where the Gram
gains a factor of tens.  Kernels are compared with a dense float64 ``torch.func``
Jacobian; a kept subset of a channels-first g stays channels-first.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ntkcore  # noqa: E402
from ntkcore import KroneckerBlock  # noqa: E402
from ntkcore.backends import torch_layers  # noqa: E402
from ntkcore.backends.torch_jacobian import jacobian  # noqa: E402
from tests.test_torch_norm_blocks import dense, reference, rel, tol_for  # noqa: E402

DT = torch.float64


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 14 * 14, 3)).to(DT)


class ClsReadout(nn.Module):
    """Tokens (N, T, D) -> Linear -> token mixing -> Linear -> token 0 -> head (N, 3)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.first = nn.Linear(d, d)
        self.last = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = h + h.mean(1, keepdim=True)
        return self.head(torch.tanh(self.last(h))[:, 0])


def _trace_ref(model, x):
    r = dense(reference(model, x))
    return torch.einsum("nok,mok->nm", r, r), r.shape[2]


def test_strided_conv_keeps_its_dead_positions():
    model, x = _cnn(), torch.randn(12, 3, 32, 32, dtype=DT)
    blocks = {b.name: b for b in jacobian(model, x).blocks}
    first = blocks["0"]
    assert first.num_positions == 900
    n, s, o, dout = first.g.shape
    assert n * s * (first.a.shape[2] + o * dout) > torch_layers.PRICED_ELEMENTS  # priced
    dead = ~first.g.ne(0).any(dim=(0, 2, 3))
    assert int(dead.sum()) == 59  # row 29 and column 29 of the 30 x 30 map are never read
    assert torch_layers.drop_zero_positions(first) is first
    assert torch_layers.drop_zero_positions(first, priced=False).num_positions == 841
    ref, p = _trace_ref(model, x)
    assert rel(ntkcore.ntk(model, x, mode="trace"), ref) < tol_for(p, 3)


def test_class_token_readout_drops_when_priced():
    torch.manual_seed(0)
    model = ClsReadout(96).to(DT)
    x = torch.randn(16, 65, 96, dtype=DT)
    blocks = {b.name: b for b in jacobian(model, x).blocks}
    assert blocks["first"].num_positions == 65
    assert blocks["last"].num_positions == 1
    ref, p = _trace_ref(model, x)
    assert rel(ntkcore.ntk(model, x, mode="trace"), ref) < tol_for(p, 3)


@pytest.mark.parametrize("gather", [False, True])
def test_kept_positions_keep_the_memory_order(gather):
    """g stored channels-first (N, O, C, S), viewed as (N, S, O, C): the kept positions (one
    range, or gathered) are stored the same way, with the same values."""
    torch.manual_seed(0)
    g = torch.randn(3, 2, 5, 7, dtype=DT).permute(0, 3, 1, 2)  # (N, S, O, C)
    g[:, 0 if gather else 6] = 0
    g[:, 3] = 0 if gather else g[:, 3]
    a = torch.randn(3, 7, 4, dtype=DT)
    kept = torch_layers.drop_zero_positions(KroneckerBlock(a, g, "b"))
    keep = [1, 2, 4, 5, 6] if gather else [0, 1, 2, 3, 4, 5]
    torch.testing.assert_close(kept.g, g[:, keep], rtol=0, atol=0)
    torch.testing.assert_close(kept.a, a[:, keep], rtol=0, atol=0)
    order = sorted(range(4), key=lambda d: -kept.g.stride(d))
    assert order == [0, 2, 3, 1]  # channels-first, as g was
    assert kept.g.is_contiguous() is False and kept.g.permute(order).is_contiguous()
