r"""Suite ``kip``: the KIP loss and its gradient with respect to the support images.

The seed scenario (a user's out-of-memory report): distil a target set into a support set with
the trace-mode eNTK of a small conv net,

    model   Conv2d(1, 64, 3, padding=1), ReLU, Conv2d(64, 64, 3, padding=1), ReLU,
            Flatten, Linear(64*28*28, 10)          (PyTorch default init, seed 0, float32)
    support M = 100 images 1x28x28 (requires grad), one-hot labels
    targets N = 60,000 images 1x28x28, one-hot labels   (standard normal pixels, seed 1)

One measured call is :math:`L = \mathrm{mean}((K_{ts}(K_{ss} + \lambda I)^{-1} Y_s - Y_t)^2)`
(``reg`` = 1e-6 relative to mean(diag K_ss)) followed by ``L.backward()``: the kernel
:math:`K_{ts}` (60,000 x 100), the Cholesky regression and the gradient with respect to the
100 support images.  The Jacobian (N x 10 x 539,146 parameters: 129 TB in float32) is never
formed.

Implementations (``impl``):

- ``kip_loss fused``: :func:`ntkcore.backends.torch_kip.kip_loss` (one pass over the target
  chunks; each chunk's loss, residual and support-gradient contributions are formed at once);
- ``ntk checkpointed``: ``ntkcore.ntk(..., checkpoint=True)`` + ``ntkcore.kernel_regression``
  (the targets' factors are recomputed chunk by chunk in the backward pass);
- ``ntk plain autograd``: ``ntkcore.ntk(..., checkpoint=False)`` + kernel_regression (the
  autograd graph keeps every target's factors: memory grows with N; the baseline).

Cases.  Full run: the seed scenario with ``kip_loss fused`` (``--set kip_targets=N`` changes
N, ``--set kip_unfused=1`` adds ``ntk checkpointed``; target: whole-process peak RSS under
6 GB), and the same model at N = 500 (``--set kip_small_targets=N``) with all three
implementations (memory against N and the price of recomputation).  The seed case runs for
most of an hour on 2 cores, past the runner's default suite timeout: run it as
``python -m benchmarks --suite kip --backend torch --suite-timeout 0 --total-budget 0``.
``--quick``: a 1->4->4 conv net on 8x8 inputs, M = 4, N = 32.
``max_memory`` is 2 GB (``--set kip_max_memory=...``).

Measurement.  Each full-run case runs once, in a fresh process (``python -m
benchmarks.suites.kip --child``): a tiny warm-up call (library initialisation), then the
measured call.  ``peak_mem_bytes`` is the *whole process's* resident high-water mark (model,
inputs, libraries included), the honest "memory on this machine" figure;
``params["working_peak_bytes"]`` is its growth over the resident set just before the call
(``benchmarks._harness`` helpers: VmHWM reset through /proc/self/clear_refs).  Phase times
(support side, target factors, contractions, gradient GEMMs, backward) are in ``params``.
The quick run measures in-process with :meth:`Config.time` / :meth:`Config.peak_memory`.
``error``: relative max-abs difference of the support gradient from the plain autograd one
(N = 500 and quick cases).

Expected duration of the full run (2 cores, float32): the seed case is dominated by the
target factors (one forward and O = 10 backward passes of the conv net per target sample and
the per-sample weights of the 64->64 conv, about 1.3 GFLOP per target).  Measured on the
shared development machine at N = 600 (``kip_loss fused``, ``max_memory`` 2 GB, chunks of 47):
33 ms per target plus 13 s for the support side, whole-process peak RSS 2.0 GB; so about
35 min for N = 60,000 (about three times that for ``ntk checkpointed``), plus a few minutes
for the N = 500 cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks._harness import ROOT, Config, row

SUITE = "kip"
HERE = "benchmarks.suites.kip"
IMPLS = {"fused": "kip_loss fused", "checkpointed": "ntk checkpointed",
         "plain": "ntk plain autograd"}
REG = 1e-6
SEED_TARGETS = 60_000
CHILD_TIMEOUT_S = 6 * 3600


def build(model: str, n_support: int, n_target: int, dtype: str, device: str) -> dict[str, Any]:
    """Model (eval), support (requires grad) and targets with one-hot labels, deterministic.

    ``model``: ``"seed"`` (conv 1->64->64 on 28x28, linear to 10), ``"tiny"`` (conv 1->4->4
    on 8x8) or ``"mlp"`` (32-128-128-10 tanh, for the memory test).
    """
    import torch

    nn = torch.nn
    torch.manual_seed(0)
    if model in ("seed", "tiny"):
        c, hw = (64, 28) if model == "seed" else (4, 8)
        net = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
                            nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
                            nn.Flatten(), nn.Linear(c * hw * hw, 10))
        shape: tuple[int, ...] = (1, hw, hw)
    elif model == "mlp":
        net = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                            nn.Linear(128, 10))
        shape = (32,)
    else:
        raise ValueError(f"unknown model {model!r}")
    tdtype = getattr(torch, dtype)
    net = net.to(device=device, dtype=tdtype).eval()
    gen = torch.Generator().manual_seed(1)

    def data(n: int) -> tuple[Any, Any]:
        x = torch.randn((n, *shape), generator=gen, dtype=torch.float64).to(tdtype)
        labels = torch.randint(0, 10, (n,), generator=gen)
        y = torch.nn.functional.one_hot(labels, 10).to(tdtype)
        return x.to(device), y.to(device)

    xs, ys = data(n_support)
    xt, yt = data(n_target)
    return {"model": net, "xs": xs.requires_grad_(True), "ys": ys, "xt": xt, "yt": yt}


def loss_fn(impl: str, p: dict[str, Any], max_memory: Any, batch_size: int | None,
            timings: dict[str, float] | None = None) -> Any:
    """The KIP loss of ``impl`` (a torch scalar with a graph to ``p["xs"]``)."""
    import torch

    import ntkcore
    from ntkcore.backends.torch_kip import kip_loss

    model, xs, ys, xt, yt = p["model"], p["xs"], p["ys"], p["xt"], p["yt"]
    if impl in ("fused", "checkpointed"):
        return kip_loss(model, xs, ys, xt, yt, reg=REG, max_memory=max_memory,
                        batch_size=batch_size, fused=impl == "fused", timings=timings)
    if impl != "plain":
        raise ValueError(f"unknown impl {impl!r}")
    k_ss = ntkcore.ntk(model, xs, mode="trace", checkpoint=False)
    k_ts = ntkcore.ntk(model, xt, xs, mode="trace", checkpoint=False, max_memory=max_memory)
    k_reg = k_ss + REG * torch.diagonal(k_ss).mean() * torch.eye(
        k_ss.shape[0], dtype=k_ss.dtype, device=k_ss.device)
    pred = ntkcore.kernel_regression(k_reg, ys, k_ts)
    return torch.mean((pred - yt) ** 2)


def case(impl: str, model: str, n_support: int, n_target: int, dtype: str = "float32",
         device: str = "cpu", max_memory: Any = "2GB",
         batch_size: int | None = None) -> Callable[[], Any]:
    """Zero-argument call (loss + backward, returns the support gradient): the peak-memory
    target of :func:`benchmarks._harness.peak_memory` (also used by tests/test_kip.py)."""
    import torch

    p = build(model, n_support, n_target, dtype, device)

    def run() -> Any:
        loss = loss_fn(impl, p, max_memory, batch_size)
        return torch.autograd.grad(loss, p["xs"])[0]

    return run


# --------------------------------------------------------------------------------------------
# one measured call in a fresh process
# --------------------------------------------------------------------------------------------
def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks import _harness

    impl, model, dtype, device = spec["impl"], spec["model"], spec["dtype"], spec["device"]
    warm = build(model, 2, 2, dtype, device)
    torch.autograd.grad(loss_fn(impl, warm, spec["max_memory"], None), warm["xs"])
    del warm
    p = build(model, spec["n_support"], spec["n_target"], dtype, device)
    sync = _harness.sync_fn("torch", device)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    base = _harness.current_rss()
    reset = _harness._reset_hwm()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    loss = loss_fn(impl, p, spec["max_memory"], spec.get("batch_size"), timings)
    if sync:
        sync()
    t1 = time.perf_counter()
    grad = torch.autograd.grad(loss, p["xs"])[0]
    if sync:
        sync()
    t2 = time.perf_counter()
    hwm = _harness._proc_status("VmHWM") if reset else None
    peak = hwm if hwm is not None else _harness._maxrss_bytes()
    out = {"total_s": t2 - t0, "loss_s": t1 - t0, "backward_s": t2 - t1,
           "peak_rss_bytes": int(peak), "working_peak_bytes": int(max(0, peak - base)),
           "loss": float(loss.detach()), "grad": grad.detach().double().cpu().reshape(-1)
           [: spec.get("grad_values", 0)].tolist(), "timings": timings}
    if device != "cpu":
        out["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return out


def _fresh(spec: dict[str, Any]) -> dict[str, Any] | None:
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run([sys.executable, "-m", HERE, "--child", json.dumps(spec)],
                              capture_output=True, text=True, env=env, cwd=str(ROOT),
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"[kip] {spec} timed out", file=sys.stderr)
        return None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    print(f"[kip] {spec} failed (rc={proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
    return None


def _rel(a: list[float], b: list[float]) -> float | None:
    if not a or not b:
        return None
    import numpy as np

    x, y = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-300))


def _seed_row(name: str, impl: str, res: dict[str, Any] | None, cfg: Config, n: int,
              m: int, max_memory: Any, target: str | None, error: float | None,
              baseline: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {"N": n, "M": m, "mode": "trace", "max_memory": max_memory}
    if res is None:
        return row(SUITE, name, IMPLS[impl], backend="torch", device=cfg.device,
                   dtype=cfg.dtype, params=params, note="failed or timed out (see stderr)")
    params.update({k: res[k] for k in ("loss_s", "backward_s", "working_peak_bytes")})
    params.update({f"phase_{k}": v for k, v in res["timings"].items()})
    if "gpu_peak_bytes" in res:
        params["gpu_peak_bytes"] = res["gpu_peak_bytes"]
    t = res["total_s"]
    return row(SUITE, name, IMPLS[impl], backend="torch", device=cfg.device, dtype=cfg.dtype,
               timing={"median_s": t, "min_s": t, "max_s": t, "repeats": 1}, params=params,
               peak_mem_bytes=res["peak_rss_bytes"],
               mem_method="whole-process peak RSS (fresh process)", error=error,
               baseline=baseline, target=target,
               note="one call: loss (kernel, Cholesky regression) + gradient w.r.t. the "
                    "support images")


def run(cfg: Config) -> list[dict[str, Any]]:
    if not cfg.has("torch"):
        return []
    max_memory = cfg.extra.get("kip_max_memory", "2GB")
    rows: list[dict[str, Any]] = []
    if cfg.quick:
        ref = case("plain", "tiny", 4, 32, "float64", cfg.device)()
        for impl in ("fused", "checkpointed", "plain"):
            fn = case(impl, "tiny", 4, 32, cfg.dtype, cfg.device, max_memory, batch_size=8)
            err = float((fn().double() - ref).abs().max() / ref.abs().max())
            timing = cfg.time(fn, "torch")
            mem = cfg.peak_memory(f"{HERE}:case", impl=impl, model="tiny", n_support=4,
                                  n_target=32, dtype=cfg.dtype, device=cfg.device,
                                  max_memory=max_memory, batch_size=8)
            rows.append(row(SUITE, "tiny conv M=4 N=32", IMPLS[impl], backend="torch",
                            device=cfg.device, dtype=cfg.dtype, timing=timing,
                            params={"N": 32, "M": 4, "mode": "trace", "batch_size": 8},
                            peak_mem_bytes=mem, mem_method=cfg.mem_method, error=err,
                            baseline=IMPLS["plain"] if impl != "plain" else None,
                            note="loss + gradient w.r.t. the support; error vs float64 plain"))
        return rows

    base = {"model": "seed", "n_support": 100, "dtype": cfg.dtype, "device": cfg.device,
            "max_memory": max_memory, "grad_values": 20000}
    # N = 500: all three, against the plain graph
    ns = int(cfg.extra.get("kip_small_targets", 500))
    small = {impl: _fresh({**base, "impl": impl, "n_target": ns})
             for impl in ("plain", "checkpointed", "fused")}
    ref = small["plain"]["grad"] if small["plain"] else []
    for impl, res in small.items():
        rows.append(_seed_row(f"seed model M=100 N={ns}", impl, res, cfg, ns, 100, max_memory,
                              None, _rel(res["grad"], ref) if res and impl != "plain" else None,
                              IMPLS["plain"] if impl != "plain" else None))
    n = int(cfg.extra.get("kip_targets", SEED_TARGETS))
    impls = ["fused"] + (["checkpointed"] if cfg.extra.get("kip_unfused") else [])
    for impl in impls:
        res = _fresh({**base, "impl": impl, "n_target": n, "grad_values": 0})
        rows.append(_seed_row(f"seed M=100 N={n}", impl, res, cfg, n, 100, max_memory,
                              "peak_mem_bytes <= 6e9", None, None))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(json.loads(sys.argv[2]))), flush=True)
    else:
        sys.exit("usage: python -m benchmarks.suites.kip --child SPEC_JSON")
