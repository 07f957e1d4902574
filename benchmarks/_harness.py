"""Measurement primitives shared by all suites.

A suite module ``benchmarks/suites/<name>.py`` defines ``run(cfg: Config) -> list[dict]``
returning rows built with :func:`row`.  Timings come from :func:`measure` (warm-up, several
repetitions, median/min/max, device synchronisation); the runner adds machine facts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Config:
    """What the user asked the runner for.

    quick : a seconds-long smoke run (tiny sizes, one repetition) used by the test suite.
    backends : subset of ("numpy", "torch", "jax", "cupy").
    device : "cpu" or "cuda".
    dtype : "float32" or "float64".
    """

    quick: bool = False
    backends: tuple[str, ...] = ("numpy", "torch")
    device: str = "cpu"
    dtype: str = "float32"
    repeat: int = 5
    warmup: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def reps(self) -> int:
        return 1 if self.quick else self.repeat


def measure(
    fn: Callable[[], Any],
    *,
    repeat: int = 5,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` timed ones.

    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before starting and after each call
    so that asynchronous devices are timed honestly.  Returns median/min/max in seconds.
    """
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeats": len(times),
    }


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
) -> dict[str, Any]:
    """One result row; the schema checked by ``tests/test_benchmarks.py``.

    ``baseline`` names the ``impl`` of the same ``case`` that speed-ups are measured against;
    ``flops`` lets the renderer report the fraction of measured GEMM throughput reached;
    ``error`` is a relative error against a reference computed in the same run.
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
    if flops is not None:
        out["flops"] = float(flops)
    if baseline is not None:
        out["baseline"] = baseline
    if error is not None:
        out["error"] = float(error)
    return out
