"""The torch adapter of :mod:`ntkcore.attribution`: a module's outputs without autograd, and
the module wrapped into a one-output model of ``z = [x, y]`` (one row per sample)."""

from __future__ import annotations

import torch
from torch import nn

from ntkcore.attribution import ModelAdapter, OutputFunction

__all__ = ["ADAPTER", "OneOutput", "TorchAdapter", "pack"]


def _exact_range(dtype: torch.dtype) -> int:
    """Integers of magnitude below this are exact in the floating ``dtype``."""
    return 2 ** {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24}.get(dtype, 53)


def pack(x: torch.Tensor, y: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``z = [x.reshape(N, -1), y.reshape(N, -1)]`` in the floating ``dtype`` (N, D + K);
    integer inputs and labels must be exact in it."""
    n = x.shape[0]
    cols = [x.reshape(n, -1)] + ([] if y is None else [y.reshape(n, -1)])
    for name, c in zip(("x", "y"), cols, strict=False):
        if not c.dtype.is_floating_point and c.numel() and \
                int(c.abs().max()) >= _exact_range(dtype):
            raise ValueError(f"{name} holds integers of magnitude >= {_exact_range(dtype)}, "
                             f"not exact in {dtype}: they cannot travel with the inputs")
    return torch.cat([c.to(dtype) for c in cols], dim=1)


class OneOutput(nn.Module):
    r"""``f(net(x), y)[:, None]`` as a module of ``z = pack(x, y)``: the inputs and targets are
    unpacked (reshaped, cast back to their dtypes) and the output function ``fn`` (array-API
    code, differentiated by autograd) is applied to the network's outputs."""

    def __init__(self, net: nn.Module, fn: OutputFunction, x: torch.Tensor,
                 y: torch.Tensor | None) -> None:
        super().__init__()
        self.net, self.fn = net, fn
        self.x_shape, self.x_dtype = tuple(x.shape[1:]), x.dtype
        self.x_width = x[0:1].numel()
        self.y_shape = None if y is None else tuple(y.shape[1:])
        self.y_dtype = None if y is None else y.dtype

    @staticmethod
    def _cast(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return c.to(dtype) if dtype.is_floating_point else c.round().to(dtype)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        n = z.shape[0]
        x = self._cast(z[:, :self.x_width].reshape(n, *self.x_shape), self.x_dtype)
        y = None if self.y_shape is None else self._cast(
            z[:, self.x_width:].reshape(n, *self.y_shape), self.y_dtype)
        out = self.net(x)
        return self.fn.value(out.reshape(n, -1), y)[:, None]


class TorchAdapter(ModelAdapter):
    def outputs(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = model(x)
        return out.reshape(out.shape[0], -1).detach()

    def one_output(self, model: nn.Module, fn: OutputFunction, x: torch.Tensor,
                   y: torch.Tensor | None) -> tuple[nn.Module, torch.Tensor]:
        floats = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
        dtype = x.dtype if x.dtype.is_floating_point else (floats[0] if floats
                                                          else torch.get_default_dtype())
        return OneOutput(model, fn, x, y), pack(x, y, dtype)


ADAPTER = TorchAdapter()
