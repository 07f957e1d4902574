"""Measurement primitives shared by all suites.

A suite module ``benchmarks/suites/<name>.py`` defines ``run(cfg: Config) -> list[dict]``
returning rows built with :func:`row`.  Timings come from :func:`measure` (warm-up, several
repetitions, median/min/max, device synchronisation); the runner adds machine facts and the
measured GEMM throughput (:func:`gemm_throughput`).

Writing a suite
---------------
- sizes from ``cfg.pick(quick, full)``; a ``--quick`` run must take seconds;
- time with ``cfg.time(fn, backend)`` (``warm=True`` when ``fn`` was just called, e.g. to check
  its result, so that call is the warm-up); memory with ``cfg.peak_memory("pkg.mod:case",
  **kwargs)`` and ``row(..., mem_method=cfg.mem_method)``; pass ``backend="cupy"`` in the
  kwargs for CuPy cases so the GPU measurement reads CuPy's pool;
- ``row(...)`` per measurement: ``baseline`` (impl name of the same case), ``flops`` (for the
  GEMM fraction), ``roofline_flops`` (the problem's least GEMM work, for the roofline
  share), ``error`` (relative, against an independent float64 reference), ``target``
  (checked by the renderer), ``params["N"]`` (x axis of the plots; rows whose case names differ
  only in N form one line, or set ``params["family"]``);
- iterate over ``cfg.select(CASES)`` (not ``CASES``): it applies ``--case`` and tells the
  runner which cases were planned, so that a suite stopped early lists the ones not run;
- a suite that raises or runs past its timeout keeps the rows it had built with ``row``: the
  runner writes every row to the result file as soon as ``row`` builds it, so even a run
  killed from outside keeps its finished cases;
- long calls (torch.func baselines take seconds to minutes): pass the duration of a call just
  made as ``cfg.time(fn, backend, first_s=...)``; a call longer than ``cfg.long_call_s`` is
  then its own timing (no second call), and :func:`measure` never starts a repetition that
  would overrun the budget.  ``cfg.peak_memory(..., child_warmup=False)`` skips the fresh
  process's warm-up call for such cases (one-time initialisation is negligible next to them).

Peak memory
-----------
:func:`peak_memory` runs one case in a *fresh* Python process (CPU) and reports the growth of
the resident set while the case runs: the case is called once as a warm-up (one-time library
initialisation is not charged to it), the kernel's high-water mark ``VmHWM`` is reset through
``/proc/self/clear_refs``, the case runs again and ``peak = VmHWM - RSS_before``.  The child
runs with a fixed glibc mmap threshold so that large freed blocks go back to the kernel instead
of being silently reused from the heap (which would hide the second run's allocations).  Where
``clear_refs`` cannot be written the fallback is ``ru_maxrss - RSS_before`` without a warm-up.
On a GPU the allocator's own counters are used in-process: ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``, or a CuPy memory hook tracking the pool's bytes in use.

A case for :func:`peak_memory` is named ``"package.module:function"``; the function takes
JSON-serialisable keyword arguments, builds its inputs and returns a zero-argument callable that
runs the measured work (inputs are allocated before the baseline is taken, so they count as
inputs, not as working memory; outputs count as working memory).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("numpy", "torch", "jax", "cupy")

# Rows built with ``row`` during the current suite (the runner salvages them when a suite
# raises or times out) and a callback the runner sets to advance its progress bar.
_EMITTED: list[dict[str, Any]] = []
_ON_MEASURE: Callable[[], None] | None = None
# called with each row as soon as ``row`` builds it (the runner saves it to the result file)
_ON_ROW: Callable[[dict[str, Any]], None] | None = None
# case names the current suite planned to run (set by ``Config.select``)
_PLANNED: list[str] = []


@dataclass(frozen=True)
class Config:
    """What the user asked the runner for.

    quick : a seconds-long smoke run (tiny sizes, one repetition) used by the test suite.
    backends : subset of ("numpy", "torch", "jax", "cupy").
    device : "cpu" or "cuda".
    dtype : "float32" or "float64".
    repeat, warmup : timed and untimed calls per case (``repeat`` is 1 in quick mode).
    budget_s : stop repeating a case once its timed calls have used this many seconds
        (at least one timed call always runs); ``None`` for no limit.
    memory : whether suites should measure peak memory (fresh subprocess per case on CPU).
    extra : free-form options (``--set key=value`` on the command line).
    cases : run only the cases whose name contains one of these substrings (case-insensitive;
        ``--case`` on the command line); empty: all.  Applied by :meth:`select`.
    long_call_s : a call at least this long is timed once (see :meth:`time`).
    """

    quick: bool = False
    backends: tuple[str, ...] = ("numpy", "torch")
    device: str = "cpu"
    dtype: str = "float32"
    repeat: int = 5
    warmup: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    budget_s: float | None = 20.0
    memory: bool = True
    cases: tuple[str, ...] = ()
    long_call_s: float = 10.0

    def select(self, cases: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``cases`` (name -> spec) selected by ``self.cases``, in order.

        Records the selected names for the runner (cases planned but without rows when a
        suite stops are listed as not run).
        """
        wanted = [c.lower() for c in self.cases]
        out = {k: v for k, v in cases.items()
               if not wanted or any(w in str(k).lower() for w in wanted)}
        _PLANNED.extend(str(k) for k in out if str(k) not in _PLANNED)
        return out

    def flag(self, key: str, default: bool) -> bool:
        """Boolean ``--set key=...`` option (1/0, true/false, yes/no, on/off)."""
        v = self.extra.get(key)
        if v is None:
            return default
        if isinstance(v, bool):
            return v
        s = str(v).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"--set {key}={v!r}: expected 1/0, true/false, yes/no or on/off")

    @property
    def reps(self) -> int:
        return 1 if self.quick else self.repeat

    def pick(self, quick: Any, full: Any) -> Any:
        """``quick`` in a quick run, else ``full`` (sizes, repetition counts, ...)."""
        return quick if self.quick else full

    def has(self, backend: str) -> bool:
        """Whether ``backend`` was selected (and so is importable on this device)."""
        return backend in self.backends

    def time(
        self,
        fn: Callable[[], Any],
        backend: str | None = None,
        *,
        warm: bool = False,
        first_s: float | None = None,
    ) -> dict[str, float]:
        """:func:`measure` ``fn`` with this configuration's repeats, warm-up, budget and the
        device synchronisation of ``backend`` on ``self.device``.

        ``warm=True``: the caller has just called ``fn`` (e.g. to check its result), which
        served as the warm-up, so none is added.  ``first_s``: that call's duration (implies
        ``warm``); when it is at least ``long_call_s`` it is the timing itself (one call,
        ``"timed_calls": "first"`` in the result) instead of warming up for more calls of
        the same length.
        """
        if first_s is not None and not self.quick and first_s >= self.long_call_s:
            return {"median_s": float(first_s), "min_s": float(first_s),
                    "max_s": float(first_s), "repeats": 1, "timed_calls": "first"}
        return measure(
            fn,
            repeat=self.reps,
            warmup=0 if (self.quick or warm or first_s is not None) else self.warmup,
            sync=sync_fn(backend, self.device) if backend else None,
            budget_s=None if self.quick else self.budget_s,
        )

    def peak_memory(self, target: str, *, child_warmup: bool = True,
                    **kwargs: Any) -> int | None:
        """Peak working memory of ``target(**kwargs)()`` (see :func:`peak_memory`).

        ``None`` when ``memory`` is off.  Quick runs measure in-process (no subprocess start-up
        cost); full runs use a fresh process on CPU.  ``child_warmup=False``: no warm-up call
        before the measured one (for cases whose one call takes long).
        """
        if not self.memory:
            return None
        fresh = (not self.quick) and self.device == "cpu"
        return peak_memory(target, kwargs, device=self.device, fresh=fresh,
                           warmup=child_warmup)

    @property
    def mem_method(self) -> str | None:
        """How :meth:`peak_memory` measured, for ``row(mem_method=...)``."""
        if not self.memory:
            return None
        if self.device != "cpu":
            return "allocator peak (in-process)"
        return "RSS growth (in-process)" if self.quick else "RSS growth (fresh process)"


# --------------------------------------------------------------------------------------------
# timing


def _block(out: Any) -> None:
    """Wait for JAX's asynchronous dispatch to finish producing ``out`` (no-op otherwise)."""
    jax = sys.modules.get("jax")
    if jax is not None and out is not None:
        try:
            jax.block_until_ready(out)
        except Exception:  # not a pytree of arrays: nothing to wait for
            pass


def measure(
    fn: Callable[[], Any],
    *,
    repeat: int = 5,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
    budget_s: float | None = None,
) -> dict[str, float]:
    """Time ``fn()``: ``warmup`` untimed calls, then up to ``repeat`` timed ones.

    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before starting and after each call
    so that asynchronous devices are timed honestly; JAX results are waited for with
    ``block_until_ready``.  With ``budget_s``, no repetition starts that would take the timed
    calls past the budget, judging by the last call; at least one always runs.
    Returns median/min/max in seconds and the number of timed calls.
    """
    for _ in range(warmup):
        _block(fn())
    if sync:
        sync()
    times: list[float] = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        _block(fn())
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
        if budget_s is not None and sum(times) + times[-1] > budget_s:
            break
    if _ON_MEASURE is not None:
        _ON_MEASURE()
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeats": len(times),
    }


def sync_fn(backend: str | None, device: str) -> Callable[[], None] | None:
    """A callable that waits for queued work of ``backend`` on ``device`` (None on CPU)."""
    if device == "cpu" or backend in (None, "numpy"):
        return None
    if backend == "torch":
        import torch

        return torch.cuda.synchronize
    if backend == "cupy":
        import cupy

        return lambda: cupy.cuda.Device().synchronize()
    return None  # jax: measure() blocks on the result instead


# --------------------------------------------------------------------------------------------
# arrays of each backend


def namespace(backend: str) -> Any:
    """The namespace a user of ``backend`` holds: numpy, torch, jax.numpy or cupy."""
    if backend == "numpy":
        import numpy

        return numpy
    if backend == "torch":
        import torch

        return torch
    if backend == "jax":
        import jax.numpy

        return jax.numpy
    if backend == "cupy":
        import cupy

        return cupy
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def asarray(x: Any, backend: str, device: str = "cpu", dtype: str = "float32") -> Any:
    """Copy the NumPy array ``x`` into ``backend`` on ``device`` with ``dtype``."""
    import numpy as np

    x = np.asarray(x)
    if backend == "numpy":
        return x.astype(dtype)
    if backend == "torch":
        import torch

        return torch.as_tensor(x.astype(dtype), device=device)
    if backend == "jax":
        import jax

        if dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        return jax.device_put(x.astype(dtype), dev)
    if backend == "cupy":
        import cupy

        return cupy.asarray(x.astype(dtype))
    raise ValueError(f"unknown backend {backend!r}")


def to_numpy(x: Any) -> Any:
    """Host NumPy copy of an array of any backend."""
    import numpy as np

    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    return np.asarray(x)


def available_backends(
    device: str, only: tuple[str, ...] | list[str] | None = None
) -> tuple[str, ...]:
    """Backends (of ``only``, default all) that import and have ``device`` on this machine."""
    out = []
    for name in BACKENDS if only is None else [b for b in BACKENDS if b in only]:
        try:
            if name == "numpy":
                ok = device == "cpu"
            elif name == "torch":
                import torch

                ok = device == "cpu" or torch.cuda.is_available()
            elif name == "jax":
                import jax

                ok = device == "cpu" or any(d.platform == "gpu" for d in jax.devices())
            else:
                import cupy

                ok = device == "cuda" and cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            ok = False
        if ok:
            out.append(name)
    return tuple(out)


# --------------------------------------------------------------------------------------------
# GEMM throughput


def gemm_call(backend: str, device: str, dtype: str, n: int) -> Callable[[], Any]:
    """An n x n times n x n matrix product of ``backend`` arrays (standard normal, seed 0),
    as a zero-argument call: the probe of :func:`gemm_throughput`, and the GEMM that
    roofline cases time in the same rounds as their own calls."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = asarray(rng.standard_normal((n, n)), backend, device, dtype)
    b = asarray(rng.standard_normal((n, n)), backend, device, dtype)
    return lambda: a @ b


def gemm_throughput(
    backend: str, device: str, dtype: str, n: int, *, repeat: int = 3
) -> dict[str, Any]:
    """Measured square matrix-multiplication throughput of ``backend`` (n x n times n x n).

    Returns ``gflops`` (from the median time), ``gflops_max`` (from the fastest call) and the
    timing; ``2 n^3`` flops per product.
    """
    t = measure(gemm_call(backend, device, dtype, n), repeat=repeat, warmup=1,
                sync=sync_fn(backend, device), budget_s=10.0)
    flops = 2.0 * n**3
    return {
        "backend": backend,
        "device": device,
        "dtype": dtype,
        "n": n,
        "gflops": flops / t["median_s"] / 1e9,
        "gflops_max": flops / t["min_s"] / 1e9,
        **t,
    }


#: side of the square GEMM timed in the same rounds as a roofline case (CPU)
PAIRED_GEMM_N = 2048


def paired_with_gemm(cfg: Config, fn: Callable[[], Any], first_s: float, backend: str
                     ) -> tuple[dict[str, Any], float]:
    """``fn``'s timing and the GEMM rate (GFLOP/s) of ``backend`` on the CPU in ``cfg.dtype``,
    the two timed in turn in the same rounds (:func:`interleaved`).

    A roofline share divides a row's flops by its time and by the GEMM rate.  On a shared
    machine both drift by tens of percent between phases (on the 2-core development VM the
    two-thread GEMM rate of separate runs ranged 153-272 GFLOP/s, the one-thread rate 107-151
    within one hour); timed in the same rounds they drift together, so their quotient is
    stable where each alone is not.
    """
    n = cfg.pick(256, PAIRED_GEMM_N)
    gemm = gemm_call(backend, "cpu", cfg.dtype, n)
    t0 = time.perf_counter()
    gemm()
    first_g = time.perf_counter() - t0
    timing, _ = interleaved({"case": fn, "gemm": gemm}, {"case": first_s, "gemm": first_g},
                            cfg)
    return timing["case"], 2.0 * n ** 3 / timing["gemm"]["median_s"] / 1e9


def interleaved(fns: dict[str, Callable[[], Any]], first: dict[str, float],
                cfg: Config) -> tuple[dict[str, dict[str, Any]], int]:
    """Timings of ``fns`` called in turn, one call each per round, up to ``cfg.reps`` rounds
    (fewer once the rounds have used ``cfg.budget_s`` per implementation), so that the slow
    and fast phases of a shared machine fall on all of them; an implementation whose checked
    first call (``first[k]``, seconds) took ``cfg.long_call_s`` or more is timed by that
    call.  Returns the timings (as :func:`measure`'s) and the number of rounds."""
    import statistics

    long = {k for k, s in first.items() if not cfg.quick and s >= cfg.long_call_s}
    times: dict[str, list[float]] = {k: [] for k in fns}
    rounds = 0
    for _ in range(max(1, cfg.reps)):
        for k, fn in fns.items():
            if k in long:
                continue
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
        rounds += 1
        spent = max((sum(v) for v in times.values()), default=0.0)
        if not times or (cfg.budget_s is not None and not cfg.quick
                         and spent * (rounds + 1) / rounds > cfg.budget_s):
            break
    out: dict[str, dict[str, Any]] = {}
    for k in fns:
        ts = times[k] or [first[k]]
        out[k] = {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
                  "repeats": len(ts)}
        if k in long:
            out[k]["timed_calls"] = "first"
    return out, rounds


# --------------------------------------------------------------------------------------------
# peak memory


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    rss = _proc_status("VmRSS")
    if rss is not None:
        return rss
    import psutil

    return int(psutil.Process().memory_info().rss)


def _reset_hwm() -> bool:
    """Reset the kernel's resident high-water mark (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmHWM") is not None
    except OSError:
        return False


def _maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


def _load(target: str) -> Callable[..., Callable[[], Any]]:
    mod, _, fn = target.partition(":")
    if not fn:
        raise ValueError(f"peak-memory target must be 'module:function', got {target!r}")
    return getattr(importlib.import_module(mod), fn)


def _cupy_peak(thunk: Callable[[], Any]) -> int:
    """Peak growth of the bytes CuPy's memory pool hands out while ``thunk()`` runs.

    A memory hook counts the rounded size of every block taken from the pool
    (``malloc_postprocess``) and given back (``free_postprocess``).
    """
    import cupy

    class _Peak(cupy.cuda.MemoryHook):
        name = "ntkcore_bench_peak"

        def __init__(self) -> None:
            self.current = 0
            self.peak = 0

        def malloc_postprocess(self, **kwargs: Any) -> None:
            self.current += int(kwargs.get("mem_size", 0))
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kwargs: Any) -> None:
            self.current -= int(kwargs.get("mem_size", 0))

    cupy.cuda.Device().synchronize()
    hook = _Peak()
    with hook:
        out = thunk()
        cupy.cuda.Device().synchronize()
    del out
    return int(hook.peak)


def _measure_in_process(
    thunk: Callable[[], Any], device: str, backend: str | None = None, warmup: bool = True
) -> tuple[int, str]:
    """Peak bytes allocated while ``thunk()`` runs, and how it was measured."""
    if device != "cpu":
        if backend == "cupy":
            return _cupy_peak(thunk), "cupy memory pool"
        if backend == "jax":
            raise NotImplementedError("no resettable peak-memory counter for JAX on GPU")
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = thunk()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return int(peak), "torch.cuda.max_memory_allocated"
    if warmup:  # one-time initialisation is not the case's working memory
        _block(thunk())
    gc.collect()
    base = current_rss()
    if _reset_hwm():
        out = thunk()
        _block(out)
        peak = _proc_status("VmHWM") or 0
        del out
        return max(0, peak - base), "VmHWM"
    out = thunk()
    _block(out)
    del out
    return max(0, _maxrss_bytes() - base), "ru_maxrss"


def peak_memory(
    target: str,
    kwargs: dict[str, Any] | None = None,
    *,
    device: str = "cpu",
    fresh: bool | None = None,
    timeout: float = 900.0,
    warmup: bool = True,
) -> int | None:
    """Peak working memory in bytes of running ``target(**kwargs)()`` once.

    Parameters
    ----------
    target : str
        ``"package.module:function"``; the function builds inputs from ``kwargs`` and returns
        the zero-argument callable to measure.
    kwargs : dict
        JSON-serialisable keyword arguments for ``target``.
    device : "cpu" or "cuda"
        CPU: resident-set growth; CUDA: the allocator's peak (CuPy's pool when
    ``kwargs["backend"] == "cupy"``, else torch's).
    fresh : bool, optional
        Run in a new Python process (default: True on CPU, False on CUDA).
    timeout : float
        Seconds before the child is killed (then ``None`` is returned).
    warmup : bool
        Call the case once before the measured call (CPU only); off for cases so long that
        their one-time initialisation does not matter.

    Returns
    -------
    int or None
        Bytes; ``None`` if the case failed (the reason is printed to stderr).
    """
    kwargs = dict(kwargs or {})
    fresh = (device == "cpu") if fresh is None else fresh
    if not fresh:
        try:
            thunk = _load(target)(**kwargs)
            return _measure_in_process(thunk, device, kwargs.get("backend"), warmup)[0]
        except Exception as exc:
            print(f"[peak_memory] {target} failed in-process: {exc!r}", file=sys.stderr)
            return None
    env = dict(os.environ)
    # a fixed threshold switches off glibc's dynamic one, so freed large blocks are unmapped
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    spec = json.dumps({"target": target, "kwargs": kwargs, "device": device,
                       "warmup": warmup})
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks._harness", "--peak-child", spec],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=str(ROOT),
        )
    except subprocess.TimeoutExpired:
        print(f"[peak_memory] {target} timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return int(json.loads(line)["peak_bytes"])
            except (ValueError, KeyError):
                break
    tail = (proc.stderr or "").strip().splitlines()[-5:]
    print(f"[peak_memory] {target} failed (rc={proc.returncode}): {tail}", file=sys.stderr)
    return None


def alloc_case(nbytes: int) -> Callable[[], Any]:
    """A case that allocates and touches ``nbytes`` (self-check of :func:`peak_memory`)."""
    import numpy as np

    return lambda: np.ones(int(nbytes) // 8, dtype=np.float64)


def _peak_child(spec_json: str) -> None:
    spec = json.loads(spec_json)
    thunk = _load(spec["target"])(**spec["kwargs"])
    peak, method = _measure_in_process(thunk, spec["device"], spec["kwargs"].get("backend"),
                                       spec.get("warmup", True))
    print(json.dumps({"peak_bytes": peak, "method": method}), flush=True)


# --------------------------------------------------------------------------------------------
# rows


def row(
    suite: str,
    case: str,
    impl: str,
    *,
    backend: str,
    device: str,
    dtype: str,
    timing: dict[str, float] | None = None,
    params: dict[str, Any] | None = None,
    peak_mem_bytes: int | None = None,
    flops: float | None = None,
    baseline: str | None = None,
    error: float | None = None,
    note: str = "",
    mem_method: str | None = None,
    target: str | None = None,
    roofline_flops: float | None = None,
    gemm_gflops: float | None = None,
) -> dict[str, Any]:
    """One result row; the schema checked by ``tests/test_benchmarks.py``.

    ``baseline`` names the ``impl`` of the same ``case`` that speed-ups are measured against
    (looked up in the same run, same device and dtype, preferring the same backend);
    ``flops`` lets the renderer report the fraction of measured GEMM throughput reached;
    ``roofline_flops`` is the GEMM flop count of the least work the *problem* needs (the same
    for every implementation of a case; e.g. ``suites.ntk.mlp_roofline_flops``), which the
    renderer divides by the time and the measured GEMM rate (``roofline_share``: 1 = the
    time of those flops at the GEMM rate);
    ``gemm_gflops``: the GEMM rate to divide by instead of the run's (one measured in the
    same rounds as this row's calls, see ``suites.ntk``);
    ``error`` is a relative error against a reference computed in the same run;
    ``params["N"]`` is the size the renderer plots time and memory against;
    ``target`` states a goal the renderer checks, ``"<metric> <op> <value>"`` with metric one
    of ``speedup``, ``time_s``, ``gemm_fraction``, ``roofline_share``, ``mem_ratio`` (peak
    memory over the baseline's), ``peak_mem_bytes``, ``error`` and op one of
    ``>=, <=, >, <``.
    """
    out: dict[str, Any] = {
        "suite": suite,
        "case": case,
        "impl": impl,
        "backend": backend,
        "device": device,
        "dtype": dtype,
        "params": params or {},
        "note": note,
    }
    out.update(timing or {})
    if peak_mem_bytes is not None:
        out["peak_mem_bytes"] = int(peak_mem_bytes)
        if mem_method is not None:
            out["mem_method"] = mem_method
    if flops is not None:
        out["flops"] = float(flops)
    if roofline_flops is not None:
        out["roofline_flops"] = float(roofline_flops)
    if gemm_gflops is not None:
        out["gemm_gflops"] = float(gemm_gflops)
    if baseline is not None:
        out["baseline"] = baseline
    if error is not None:
        out["error"] = float(error)
    if target is not None:
        out["target"] = target
    _EMITTED.append(out)
    if _ON_ROW is not None:
        _ON_ROW(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peak-child":
        _peak_child(sys.argv[2])
    else:
        sys.exit("usage: python -m benchmarks._harness --peak-child SPEC_JSON")
