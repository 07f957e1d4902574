"""Matrix products that round like a different BLAS: a test-only perturbation.

No BLAS promises that ``X @ X.T`` comes out exactly symmetric, nor one summation order: MKL
on an AMD CPU, OpenBLAS builds, cuBLAS and Accelerate each round in their own way.  A promise
of exactness (a symmetric self-kernel, a resumed store equal to an uninterrupted one) must
therefore hold by construction, and the suite checks it under :func:`perturbed_products`: in
that context every floating-point self-product (``@``, ``matmul``, ``mm``, ``bmm``,
``addmm``, ``tensordot``, ``linear``, ... whose two operands share memory, as ``X @ X.T``
and ``X.mT @ X`` do) of torch and of array_api_strict returns its strictly lower triangle
(row index > column index over the last two axes, also of a rectangular panel) moved one
ulp up, non-zero entries only.  Products of two different arrays are left alone: every BLAS
rounds them somehow, but none turns an exact product (a sum with one non-zero term) into an
inexact one, which a blanket perturbation would.  The perturbation is deterministic (the
same product gives the same result), differentiable (it adds a constant) and far inside
every tolerance of the suite (one ulp per entry), so a test fails under it only where it
relied on the rounding of one BLAS.

NumPy's ``ndarray.__matmul__`` is a C slot that cannot be replaced, and JAX compiles its
products, so those two run unperturbed (NumPy's ``x @ x.T`` calls SYRK, which is symmetric
on every machine seen so far, and JAX never takes the panelled paths).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import numpy as np


def _lower_mask_np(shape: tuple[int, ...]) -> np.ndarray:
    r, c = shape[-2], shape[-1]
    return np.arange(r)[:, None] > np.arange(c)[None, :]


def perturb_numpy(x: np.ndarray) -> np.ndarray:
    """``x`` with its non-zero strictly-lower entries (last two axes) one ulp up (a copy)."""
    if x.ndim < 2 or not np.issubdtype(x.dtype, np.floating):
        return x
    mask = _lower_mask_np(x.shape) & (x != 0)
    return np.where(mask, np.nextafter(x, np.inf), x)


def _torch_mode() -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    products = {
        torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.tensordot,
        torch.nn.functional.linear, torch.linalg.matmul,
        torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
    }

    def perturb(out: Any) -> Any:
        if not isinstance(out, torch.Tensor) or out.ndim < 2 or not out.is_floating_point():
            return out
        r, c = out.shape[-2], out.shape[-1]
        with torch.no_grad():
            rows = torch.arange(r, device=out.device)[:, None]
            cols = torch.arange(c, device=out.device)[None, :]
            base = out.detach()
            mask = (rows > cols) & (base != 0)
            up = torch.nextafter(base, torch.full_like(base, float("inf")))
            delta = torch.where(mask, up - base, torch.zeros_like(base))
        return out + delta  # exact: base + (up - base) == up

    def shared(x: Any, y: Any) -> bool:
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                and x.numel() > 0 and y.numel() > 0):
            return False
        try:
            return bool(x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr())
        except (NotImplementedError, RuntimeError):  # torch.func's wrappers have no storage
            return False

    class PerturbedProducts(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            first = 1 if func in (torch.addmm, torch.baddbmm) else 0  # (input, x, y)
            if func in products and len(args) >= first + 2 and shared(args[first],
                                                                       args[first + 1]):
                return perturb(out)
            return out

    return PerturbedProducts()


@contextlib.contextmanager
def _strict_patched() -> Iterator[None]:
    import array_api_strict as strict
    from array_api_strict._array_object import Array

    def wrap(fn: Any) -> Any:
        def product(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            x, y = args[0], args[1] if len(args) > 1 else None
            if (isinstance(out, Array) and isinstance(x, Array) and isinstance(y, Array)
                    and np.may_share_memory(x._array, y._array)):
                return Array._new(perturb_numpy(out._array), device=out.device)
            return out

        return product

    saved = [(Array, name, getattr(Array, name)) for name in ("__matmul__", "__rmatmul__")]
    saved += [(strict, name, getattr(strict, name)) for name in ("matmul", "tensordot")]
    linalg = getattr(strict, "linalg", None)
    if linalg is not None and hasattr(linalg, "matmul"):
        saved.append((linalg, "matmul", linalg.matmul))
    for owner, name, fn in saved:
        setattr(owner, name, wrap(fn))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextlib.contextmanager
def perturbed_products() -> Iterator[None]:
    """Within this context, torch and array_api_strict matrix products round like another
    BLAS (see the module docstring)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_strict_patched())
        if importlib.util.find_spec("torch") is not None:
            stack.enter_context(_torch_mode())
        yield
