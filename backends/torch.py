"""PyTorch backend: differentiable torch.linalg primitives and ``torch.Generator`` on the
tensor's device; re-exports the Jacobian provider (``torch_jacobian``), SENG (``torch_seng``)
and KIP (``torch_kip``) as ``ntkcore.backends.torch.jacobian``, ``.SENG``, ``.kip_loss``, ...
"""

from __future__ import annotations

from typing import Any

import torch

from ntkcore.backend import Array, Backend, Device

from . import torch_recycle as recycle
from ._host import host_free_memory


class TorchBackend(Backend):
    """Backend for ``torch.Tensor`` on CPU or CUDA."""

    name = "torch"

    def cholesky(self, a: Array, *, shift: float = 0.0) -> Array | None:
        if shift:
            a = a.clone()  # a fresh tensor: the in-place diagonal update stays differentiable
            a.diagonal().add_(shift)
        l, info = torch.linalg.cholesky_ex(a)
        if bool(torch.any(info != 0)):
            return None
        return l

    def solve_triangular(self, a: Array, b: Array, *, lower: bool = True,
                         transpose: bool = False) -> Array:
        if b.ndim == 1:
            return self.solve_triangular(a, b[:, None], lower=lower, transpose=transpose)[:, 0]
        # op(a) = a.mT is upper triangular exactly when a is lower
        return torch.linalg.solve_triangular(a.mT if transpose else a, b,
                                             upper=lower == transpose)

    def cho_solve(self, l: Array, b: Array) -> Array:
        # two triangular solves: faster than torch.cholesky_solve on CPU in our timings (torch 2.13,
        # r = 256..1024, 1..64 right-hand sides), the same values
        if b.ndim == 1:
            return self.cho_solve(l, b[:, None])[:, 0]
        y = torch.linalg.solve_triangular(l, b, upper=False)
        return torch.linalg.solve_triangular(l.mT, y, upper=True)

    def erf(self, x: Array) -> Array:
        return torch.special.erf(x)

    fast_scatter_add = True

    def scatter_add(self, idx: Array, x: Array, size: int) -> Array:
        # -1 rows go to a spare last row (no boolean mask: no device sync); index_add is
        # differentiable in x
        idx = torch.where(idx < 0, size, idx)
        return x.new_zeros((size + 1, *x.shape[1:])).index_add(0, idx, x)[:size]

    def transient_product(self, a: Array, b: Array) -> Array:
        # a batched product of one dtype, off the graph: into torch_recycle's memory (on the
        # host a kept storage, no fresh pages; small or GPU products: a plain allocation)
        if (a.ndim != 3 or b.ndim != 3 or a.dtype != b.dtype or a.shape[0] != b.shape[0]
                or self.tracks_gradient(a, b)):
            return a @ b
        shape = (a.shape[0], a.shape[1], b.shape[2])
        return torch.bmm(a, b, out=recycle.empty(shape, a.dtype, a.device))

    def stop_gradient(self, x: Array) -> Array:
        return x.detach()

    def tracks_gradient(self, *xs: Array) -> bool:
        return torch.is_grad_enabled() and any(x.requires_grad for x in xs)

    def implicit_solve(self, x: Array, residual: Array, solve: Any) -> Array:
        return x + _ImplicitSolve.apply(residual, solve) if residual.requires_grad else x

    def scalar(self, x: Array) -> float:
        return float(x.detach())

    def generator(self, seed: int | None, device: Device) -> TorchGenerator:
        return TorchGenerator(seed, torch.device(device) if device is not None else None)

    @staticmethod
    def seed_from(seed: Any) -> int:
        if isinstance(seed, torch.Generator):
            return int(torch.randint(2**63 - 1, (), generator=seed, device=seed.device))
        return Backend.seed_from(seed)

    def free_memory(self, device: Device) -> int | None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            return int(torch.cuda.mem_get_info(dev)[0])
        return host_free_memory()

    def synchronize(self, device: Device) -> None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def is_gpu(self, device: Device) -> bool:
        return device is not None and torch.device(device).type == "cuda"


_MULTINOMIAL_MAX = 2**24


class _ImplicitSolve(torch.autograd.Function):
    """Zero in the forward pass; ``solve`` of the cotangent in the backward pass."""

    @staticmethod
    def forward(ctx: Any, residual: Array, solve: Any) -> Array:
        ctx.solve = solve
        return torch.zeros_like(residual)

    @staticmethod
    def backward(ctx: Any, grad: Array) -> tuple[Array, None]:
        return ctx.solve(grad), None


class TorchGenerator:
    """``torch.Generator`` on the target device; draws never leave that device."""

    def __init__(self, seed: int | None, device: torch.device | None) -> None:
        self.device = device or torch.device("cpu")
        self.gen = torch.Generator(device=self.device)
        if seed is None:
            self.gen.seed()
        else:
            self.gen.manual_seed(int(seed))

    def integers(self, low: int, high: int, shape: tuple[int, ...]) -> Array:
        return torch.randint(low, high, shape, generator=self.gen, device=self.device,
                             dtype=torch.int64)

    def choice(self, n: int, size: int, *, p: Array | None = None,
               replace: bool = True) -> Array:
        if p is None:
            if replace:
                return self.integers(0, n, (size,))
            return torch.randperm(n, generator=self.gen, device=self.device)[:size]
        weights = torch.clamp(p.detach().to(device=self.device, dtype=torch.float64), min=0)
        if n <= _MULTINOMIAL_MAX:
            return torch.multinomial(weights, size, replacement=replace, generator=self.gen)
        # torch.multinomial refuses more than 2**24 categories.
        u = torch.rand(size if replace else n, generator=self.gen, device=self.device,
                       dtype=torch.float64)
        if replace:  # inverse CDF
            cdf = torch.cumsum(weights, 0)
            idx = torch.searchsorted(cdf, u * cdf[-1], right=True)
            return torch.clamp(idx, max=n - 1)
        # Efraimidis-Spirakis keys log(u)/p: the top `size` keys are a successive sample.
        keys = torch.log(u) / weights
        return torch.topk(keys, size).indices

    def normal(self, shape: tuple[int, ...], dtype: Any) -> Array:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=dtype)

    def uniform(self, shape: tuple[int, ...], dtype: Any) -> Array:
        return torch.rand(shape, generator=self.gen, device=self.device, dtype=dtype)


from .torch_jacobian import (  # noqa: E402, F401
    from_block_order,
    in_provider_pass,
    jacobian,
    model_lock,
    to_block_order,
)


def __getattr__(name: str) -> Any:
    # SENG is imported lazily (it imports ntkcore.solve, which must not be imported while this
    # backend module is still initialising).
    if name == "SENG":
        from .torch_seng import SENG

        return SENG
    if name in ("checkpointed_ntk", "kip_loss"):  # KIP: ntkcore.backends.torch_kip
        from . import torch_kip

        return getattr(torch_kip, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
