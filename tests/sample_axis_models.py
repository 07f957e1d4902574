"""Models whose layers see inputs without a leading sample axis, shared by the provider's and
SENG's sample-axis tests (tests/test_torch_sample_axis.py, tests/test_seng_sample_axis.py)."""

from __future__ import annotations

import torch
from torch import nn


class Buffer(nn.Module):
    """A fixed buffer (T, 3) into a Linear: its output is shared by every sample.  Every
    trainable layer is a Linear (no dense layer besides the one the shared input forces)."""

    def __init__(self, t: int = 5, out: int = 3) -> None:
        super().__init__()
        self.register_buffer("z", torch.randn(t, 3))
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, out)

    def forward(self, x):  # x (N, T)
        return self.b(x @ torch.tanh(self.a(self.z)))


class SeqFirst(nn.Module):
    """``nn.TransformerEncoderLayer`` with its default ``batch_first=False``: its Linear and
    LayerNorm layers see (T, N, d) tensors (sample axis 1); its attention's ``out_proj``
    weight is used outside the Linear's ``forward`` (no hooked call at all)."""

    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0)
        self.o = nn.Linear(4, out)

    def forward(self, x):  # x (N, T, d)
        return self.o(self.enc(x.transpose(0, 1)).mean(0))


class BufferConv(nn.Module):
    """A Conv1d on a fixed unbatched (C, L) buffer with C_in == C_out == T."""

    def __init__(self, t: int = 5, out: int = 3) -> None:
        super().__init__()
        self.register_buffer("z", torch.randn(t, 8))
        self.c = nn.Conv1d(t, t, 3)
        self.l = nn.Linear(t, out)

    def forward(self, x):  # x (N, 6)
        return self.l(x @ torch.tanh(self.c(self.z)).T)
