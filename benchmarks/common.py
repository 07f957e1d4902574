"""What every asv benchmark module of ntkcore shares: backends, timing in turns, the GEMM rate
and working memory.

asv runs each benchmark in a process of its own after ``setup(*params)`` (``NotImplementedError``
skips it).  :func:`in_turns` times callables one call each per round, so a ratio of its medians is
stable on a shared machine; :func:`gemm_rate` is what roofline shares divide by;
:func:`working_memory` is the resident-set growth of a call."""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: Backend parameter values: an array library and, after the dash, a device.
BACKENDS = ("numpy", "torch", "jax", "torch-cuda", "cupy")
CPU_BACKENDS = ("numpy", "torch")


def require(backend: str) -> Any:
    """The module of ``backend``, or ``NotImplementedError`` (skipped) when its library or device
    is missing or ``NTKCORE_BENCH_BACKENDS`` (comma-separated) does not list it."""
    chosen = os.environ.get("NTKCORE_BENCH_BACKENDS")
    if chosen and backend not in chosen.split(","):
        raise NotImplementedError(f"{backend} is not in NTKCORE_BENCH_BACKENDS")
    lib, _, device = backend.partition("-")
    try:
        mod = __import__(lib)
    except ImportError as exc:
        raise NotImplementedError(f"{lib} is not installed") from exc
    if device == "cuda" and not mod.cuda.is_available():
        raise NotImplementedError("no CUDA device")
    if lib == "cupy":
        try:
            mod.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise NotImplementedError("no CUDA device") from exc
    return mod


def asarray(x: Any, backend: str, dtype: str = "float32") -> Any:
    """``x`` (anything NumPy reads) as an array of ``backend`` in ``dtype``."""
    lib, _, device = backend.partition("-")
    a = np.asarray(x, dtype=dtype)
    if lib == "numpy":
        return a
    if lib == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(a)).to(device or "cpu")
    if lib == "jax":
        import jax.numpy as jnp

        return jnp.asarray(a)
    if lib == "cupy":
        import cupy

        return cupy.asarray(a)
    raise ValueError(f"unknown backend {backend!r}")


def to64(x: Any) -> np.ndarray:
    """A float64 NumPy copy of an array of any backend (references are computed in float64)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    elif hasattr(x, "get"):
        x = x.get()
    return np.asarray(x, dtype=np.float64)


def relerr(x: Any, ref: Any) -> float:
    """Relative Frobenius error of ``x`` against the float64 reference ``ref``."""
    x64, r64 = to64(x), to64(ref)
    return float(np.linalg.norm(x64 - r64) / max(np.linalg.norm(r64), 1e-300))


def wait(out: Any) -> Any:
    """Wait for asynchronous work that produced ``out`` (JAX dispatch, a CUDA stream)."""
    if "jax" in sys.modules and out is not None:
        try:
            sys.modules["jax"].block_until_ready(out)
        except Exception:  # not a pytree of arrays
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.cuda.Stream.null.synchronize()
        except Exception:
            pass
    return out


def in_turns(fns: dict[str, Callable[[], Any]], rounds: int = 5,
             budget_s: float = 60.0) -> dict[str, float]:
    """Median seconds of each of ``fns``, called in turn one call each per round, after a
    warm-up; at most ``rounds`` rounds, none starting past ``budget_s``, at least one."""
    for fn in fns.values():
        wait(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    for _ in range(rounds):
        t_round = time.perf_counter()
        for k, fn in fns.items():
            t0 = time.perf_counter()
            wait(fn())
            times[k].append(time.perf_counter() - t0)
        last = time.perf_counter() - t_round
        if time.perf_counter() - start + last > budget_s:
            break
    return {k: statistics.median(v) for k, v in times.items()}


def ratio_in_turns(fns: dict[str, Callable[[], Any]], num: str, den: str,
                   rounds: int = 7) -> float:
    """``in_turns`` median of ``fns[num]`` over that of ``fns[den]``, timed in the same
    rounds."""
    t = in_turns(fns, rounds=rounds)
    return t[num] / t[den]


def gemm(backend: str, dtype: str = "float32", n: int = 2048) -> tuple[Callable[[], Any], float]:
    """A callable multiplying two ``n x n`` matrices of ``backend`` and its flop count."""
    rng = np.random.default_rng(0)
    a = asarray(rng.standard_normal((n, n)), backend, dtype)
    b = asarray(rng.standard_normal((n, n)), backend, dtype)
    return (lambda: a @ b), 2.0 * n**3


def gemm_rate(backend: str, dtype: str = "float32", n: int = 2048) -> float:
    """Measured GEMM throughput of ``backend`` in FLOP/s (median of 5 calls)."""
    fn, flops = gemm(backend, dtype, n)
    return flops / in_turns({"gemm": fn}, rounds=5)["gemm"]


def roofline_share(fn: Callable[[], Any], flops: float, backend: str,
                   dtype: str = "float32", rounds: int = 5, n: int = 2048) -> float:
    """``flops`` at the GEMM rate over ``fn``'s time, the GEMM timed in the same rounds: the
    share of the roofline ``fn`` reaches (1.0: as fast as an ``n x n`` GEMM per flop)."""
    g, g_flops = gemm(backend, dtype, n)
    t = in_turns({"case": fn, "gemm": g}, rounds=rounds)
    return flops / t["case"] / (g_flops / t["gemm"])


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


def working_memory(fn: Callable[[], Any]) -> float:
    """Bytes by which the resident set grows while ``fn()`` runs (Linux), its output included.

    After a warm-up (glibc's mmap threshold at 64 KiB: freed blocks go back to the kernel),
    ``VmHWM`` is reset; the result is ``VmHWM - VmRSS`` before the call.  On CUDA: the
    allocator's peak above what was allocated before."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        wait(fn())
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = wait(fn())
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return float(peak)
    if not sys.platform.startswith("linux"):
        raise NotImplementedError("working memory is read from /proc (Linux)")
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD, before the warm-up
    out = wait(fn())
    del out
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = wait(fn())
    peak = _status("VmHWM") - before
    del out
    return float(peak)
