r"""Suite ``providers``: the eNTK of the same MLP through each provider and array library.

Networks (the ``ntk`` suite's MLPs; weights from ``MLP.random(..., xp=numpy, seed=0,
parameterization="standard")``, i.e. :math:`W \sim \mathcal{N}(0, 1/d_{in})`,
:math:`b \sim \mathcal{N}(0, 1)`, converted to every library; inputs standard normal, seed 1):

==========================  ==============================================  =====  ======
case                        widths                                          N      mode
==========================  ==============================================  =====  ======
``MLP 6x512 tanh N=384``    256 -> 6 x 512 (tanh) -> 1                      384    trace
``MLP 8x1000 tanh N=512``   256 -> 8 x 1000 (tanh) -> 1                     512    trace
==========================  ==============================================  =====  ======

Implementations (all ``ntkcore.ntk(model, x, mode="trace")``):

- ``MLP numpy`` / ``MLP torch`` / ``MLP jax`` / ``MLP cupy``: the explicit
  :class:`ntkcore.models.MLP` (hand-written Kronecker factors, no autodiff) on that library;
- ``torch provider``: the equivalent ``torch.nn.Sequential`` through the torch provider
  (forward hooks + output-batched backward); the baseline of the case;
- ``jax provider``: a hand-written JAX ``apply_fn`` (``x @ W.T + b``) through the JAX provider
  (dense layers recognised in the jaxpr, ``vmap(jacrev)`` of the perturbed program).  Its
  first call traces and compiles (excluded by the warm-up).

``error``: relative Frobenius error of the kernel's leading (32, 32) block against the
float64 NumPy MLP kernel of those 32 samples.  ``--quick``: a 8-16-16-1 net at N = 16.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import numpy as np

from benchmarks._harness import Config, asarray, row, to_numpy

SUITE = "providers"
HERE = "benchmarks.suites.providers"
BASELINE = "torch provider"
N_REF = 32

CASES: dict[str, tuple[tuple[int, ...], int]] = {
    "MLP 6x512 tanh N=384": ((256, *[512] * 6, 1), 384),
    "MLP 8x1000 tanh N=512": ((256, *[1000] * 8, 1), 512),
}
QUICK_CASES: dict[str, tuple[tuple[int, ...], int]] = {
    "MLP tiny N=16": ((8, 16, 16, 1), 16),
}
MODE = "trace"


def _weights(widths: tuple[int, ...]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    from ntkcore.models import MLP

    net = MLP.random(widths, xp=np, seed=0, parameterization="standard", dtype=np.float64)
    assert net.biases is not None
    return list(net.weights), list(net.biases)


def _inputs(widths: tuple[int, ...], n: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((n, widths[0]))


def _impls(cfg: Config) -> list[tuple[str, str]]:
    """(impl, backend) pairs available under ``cfg``."""
    out = [(f"MLP {b}", b) for b in ("numpy", "torch", "jax", "cupy") if cfg.has(b)]
    if cfg.device == "cuda":
        out = [(i, b) for i, b in out if b != "numpy"]
    if cfg.has("torch"):
        out.append((BASELINE, "torch"))
    if cfg.has("jax"):
        out.append(("jax provider", "jax"))
    return out


def case(impl: str, widths: tuple[int, ...], n: int, dtype: str,
         device: str) -> Callable[[], Any]:
    """The zero-argument call of ``impl`` (also the peak-memory target)."""
    import ntkcore
    from ntkcore.models import MLP

    ws, bs = _weights(tuple(widths))
    x_np = _inputs(tuple(widths), n)
    if impl.startswith("MLP "):
        backend = impl.split(" ", 1)[1]
        net = MLP([asarray(w, backend, device, dtype) for w in ws],
                  [asarray(b, backend, device, dtype) for b in bs],
                  activation="tanh", parameterization="standard")
        x = asarray(x_np, backend, device, dtype)
        return lambda: ntkcore.ntk(net, x, mode=MODE)
    if impl == BASELINE:
        import torch

        layers: list[Any] = []
        for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
            lin = torch.nn.Linear(w.shape[1], w.shape[0])
            with torch.no_grad():
                lin.weight.copy_(torch.as_tensor(w))
                lin.bias.copy_(torch.as_tensor(b))
            layers.append(lin)
            if i < len(ws) - 1:
                layers.append(torch.nn.Tanh())
        model = torch.nn.Sequential(*layers).to(device=device, dtype=getattr(torch, dtype))
        model.eval()
        x = asarray(x_np, "torch", device, dtype)
        return lambda: ntkcore.ntk(model, x, mode=MODE)
    if impl == "jax provider":
        import jax.numpy as jnp

        params = [(asarray(w, "jax", device, dtype), asarray(b, "jax", device, dtype))
                  for w, b in zip(ws, bs, strict=True)]

        def apply_fn(p: Any, z: Any) -> Any:
            for i, (w, b) in enumerate(p):
                z = z @ w.T + b
                if i < len(p) - 1:
                    z = jnp.tanh(z)
            return z

        x = asarray(x_np, "jax", device, dtype)
        return lambda: ntkcore.ntk((apply_fn, params), x, mode=MODE)
    raise ValueError(f"unknown impl {impl!r}")


def reference(widths: tuple[int, ...], n: int) -> np.ndarray:
    """float64 NumPy MLP trace kernel of the first ``min(n, N_REF)`` samples."""
    import ntkcore
    from ntkcore.models import MLP

    ws, bs = _weights(widths)
    net = MLP(ws, bs, activation="tanh", parameterization="standard")
    return np.asarray(ntkcore.ntk(net, _inputs(widths, n)[:N_REF], mode=MODE))


def _flops(widths: tuple[int, ...], n: int) -> float:
    """Trace-mode contraction flops with O = 1: per layer the (N, N) Grams of a (d_in + 1)
    and of g (d_out), each as a full GEMM."""
    per_pair = sum(2 * (a + 1 + b) for a, b in pairwise(widths))
    return float(n) * n * per_pair


def run(cfg: Config) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cases = cfg.pick(QUICK_CASES, CASES)
    for name, (widths, n) in cases.items():
        ref = reference(widths, n)
        m = ref.shape[0]
        p = sum(o * (i + 1) for i, o in pairwise(widths))
        impls = _impls(cfg)
        base = BASELINE if any(i == BASELINE for i, _ in impls) else None
        for impl, backend in impls:
            try:
                fn = case(impl, widths, n, cfg.dtype, cfg.device)
                k = to_numpy(fn())
                err = float(np.linalg.norm(k[:m, :m] - ref) / np.linalg.norm(ref))
                del k
                timing = cfg.time(fn, backend)
                del fn
            except Exception as exc:  # one failing library must not hide the others
                rows.append(row(SUITE, name, impl, backend=backend, device=cfg.device,
                                dtype=cfg.dtype, params={"N": n, "widths": list(widths)},
                                note=f"failed: {type(exc).__name__}: {exc}"))
                continue
            mem = cfg.peak_memory(f"{HERE}:case", impl=impl, widths=list(widths), n=n,
                                  dtype=cfg.dtype, device=cfg.device)
            rows.append(row(
                SUITE, name, impl, backend=backend, device=cfg.device, dtype=cfg.dtype,
                timing=timing,
                params={"N": n, "O": widths[-1], "P": p, "mode": MODE, "widths": list(widths)},
                peak_mem_bytes=mem, mem_method=cfg.mem_method,
                flops=_flops(widths, n), baseline=base if impl != base else None, error=err,
                note=f"error vs float64 NumPy MLP kernel on the first {m} samples",
            ))
    return rows
