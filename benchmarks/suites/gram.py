r"""Suite ``gram``: the eNTK contraction engine on Kronecker and dense blocks.

Random factors (standard normal, seed 0) of one layer; ``O`` outputs.

Cases
-----
``dense layer N=<n> w=<w> O=<o> <mode> [sym]``
    a dense layer ``w + 1 -> w`` (bias column in ``a``): ``a`` (N, 1, w+1), ``g`` (N, 1, O, w).
    Cross kernels ``gram(J1, J2)`` with N1 = N2 = N (the throughput target) and, marked
    ``sym``, ``gram(J)`` which computes only upper-triangle tiles.  Implementations:

    - ``kronecker``: :func:`ntkcore.gram` on the :class:`~ntkcore.KroneckerBlock`,
      :math:`(G G'^\top) \odot (A A'^\top)`;
    - ``dense`` (the baseline): :func:`ntkcore.gram` on a :class:`~ntkcore.DenseBlock` holding
      the materialised Jacobian (N, O, (w+1) w), only where that fits in 1 GB.

    ``flops`` is the Kronecker formula's count :math:`2 N^2 (d_{in} + O^k d_{out})`
    (``k = 2`` for full) for the cross kernels, so "GEMM %" measures how close the contraction
    runs to the machine's GEMM rate; for the dense baseline it is
    :math:`2 N^2 O^k P`.  Target: ``gemm_fraction >= 0.6`` for N >= 1024 (cross kernels).
``conv S=<s> ...``
    a convolution after unfolding patches: ``a`` (N, S, C_in k^2), ``g`` (N, S, O, C_out),
    trace mode.  Implementations ``kronecker`` (the cost model's choice), ``positions`` and
    ``materialise`` (forced), and ``dense`` where it fits; ``flops`` from the plan.
``budget ...``
    a dense layer at N = 4096 with ``max_memory="256MB"``: target
    ``peak_mem_bytes <= 256 MB + output``.
``selfprod n=<n> k=<k>`` (NumPy only)
    the products behind a symmetric tile: ``x @ x.T`` (NumPy dispatches to SYRK),
    ``x @ y.T`` on a copy ``y`` (GEMM with a transposed operand) and ``x @ copy(x.T)``
    (contiguous GEMM), flops :math:`2 n^2 k` each.  These rows are why ``ntkcore.gram``
    leaves ``x @ x.T`` as it is (no contiguous copy).
``gemm n=<n>``
    square matrix product (impl ``gemm``), the throughput reference measured in this run.

``error``: relative max error of the kernel's leading block (up to 32 x 32 samples) against a
float64 NumPy einsum of the factors,
:math:`\sum_{s,t}\langle g[n,s,o], g'[m,t,p]\rangle\langle a[n,s], a'[m,t]\rangle`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks._harness import Config, asarray, row, to_numpy

SUITE = "gram"
HERE = "benchmarks.suites.gram"
DENSE_LIMIT_BYTES = 1 << 30  # materialise the dense baseline only up to this size
MAX_GFLOP = 100.0  # skip forced strategies whose plan exceeds this (CPU run time)

# name -> (kind, N, S, d_in, d_out, O, mode, symmetric, max_memory)
Case = tuple[str, int, int, int, int, int, str, bool, Any]
CASES: dict[str, Case] = {}
for _n, _w in ((256, 256), (1024, 256), (1024, 1024), (2048, 512), (4096, 1024), (4096, 2048)):
    CASES[f"dense layer N={_n} w={_w} O=1 trace"] = ("dense", _n, 1, _w + 1, _w, 1, "trace",
                                                     False, None)
CASES["dense layer N=2048 w=1024 O=1 trace sym"] = ("dense", 2048, 1, 1025, 1024, 1, "trace",
                                                    True, None)
CASES["dense layer N=1024 w=512 O=10 trace"] = ("dense", 1024, 1, 513, 512, 10, "trace",
                                                False, None)
CASES["dense layer N=1024 w=512 O=10 full"] = ("dense", 1024, 1, 513, 512, 10, "full",
                                               False, None)
CASES["dense layer N=1024 w=512 O=10 full sym"] = ("dense", 1024, 1, 513, 512, 10, "full",
                                                   True, None)
CASES["conv S=64 27->32 O=10 N=256 trace"] = ("conv", 256, 64, 27, 32, 10, "trace", True,
                                              None)
CASES["conv S=256 288->64 O=1 N=512 trace"] = ("conv", 512, 256, 288, 64, 1, "trace", True,
                                               None)
CASES["conv S=1024 288->64 O=1 N=256 trace"] = ("conv", 256, 1024, 288, 64, 1, "trace", True,
                                                None)
CASES["conv S=16 64->64 O=1 N=512 trace"] = ("conv", 512, 16, 64, 64, 1, "trace", True, None)
CASES["tokens S=4 512->512 O=1 N=512 trace"] = ("conv", 512, 4, 512, 512, 1, "trace", True,
                                                None)
CASES["budget dense layer N=4096 w=1024 256MB"] = ("dense", 4096, 1, 1025, 1024, 1, "trace",
                                                   True, "256MB")

QUICK_CASES: dict[str, Case] = {
    "dense layer N=64 w=32 O=1 trace": ("dense", 64, 1, 33, 32, 1, "trace", False, None),
    "dense layer N=32 w=16 O=3 full sym": ("dense", 32, 1, 17, 16, 3, "full", True, None),
    "conv S=16 9->4 O=2 N=16 trace": ("conv", 16, 16, 9, 4, 2, "trace", True, None),
    "budget dense layer N=96 w=32 64kB": ("dense", 96, 1, 33, 32, 1, "trace", True, "64kB"),
}


def _factors(n: int, s: int, d_in: int, d_out: int, o: int, seed: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, s, d_in)) / math.sqrt(d_in)
    if s == 1:
        a[:, :, -1] = 1.0  # bias column
    g = rng.standard_normal((n, s, o, d_out)) / math.sqrt(d_out)
    return a, g


def _jacobians(impl: str, backend: str, device: str, dtype: str, n: int, s: int, d_in: int,
               d_out: int, o: int, symmetric: bool) -> tuple[Any, Any]:
    import ntkcore

    out = []
    for seed in (0,) if symmetric else (0, 1):
        a, g = _factors(n, s, d_in, d_out, o, seed)
        if impl == "dense":  # materialised in chunks of samples, straight into ``dtype``
            jac = np.empty((n, o, d_in * d_out), dtype=dtype)
            for i in range(0, n, 64):
                jac[i:i + 64] = np.einsum("nsoi,nsj->noij", g[i:i + 64], a[i:i + 64]).reshape(
                    -1, o, d_in * d_out)
            block: Any = ntkcore.DenseBlock(asarray(jac, backend, device, dtype), name="layer")
        else:
            block = ntkcore.KroneckerBlock(asarray(a, backend, device, dtype),
                                           asarray(g, backend, device, dtype), name="layer")
        out.append(ntkcore.Jacobian([block]))
    return out[0], (None if symmetric else out[1])


def case(impl: str, backend: str, device: str, dtype: str, n: int, s: int, d_in: int,
         d_out: int, o: int, mode: str, symmetric: bool,
         max_memory: Any = None) -> Callable[[], Any]:
    """The zero-argument call of ``impl`` on a case (also the peak-memory target)."""
    from ntkcore.gram import _gram

    j1, j2 = _jacobians(impl, backend, device, dtype, n, s, d_in, d_out, o, symmetric)
    strategy = impl if impl in ("positions", "materialise") else None
    return lambda: _gram(j1, j2, mode=mode, max_memory=max_memory, strategy=strategy)


def _plan(impl: str, n: int, s: int, d_in: int, d_out: int, o: int, mode: str,
          symmetric: bool, max_memory: Any) -> Any:
    """The plan of a case, from zero-stride stand-in factors (only shapes matter)."""
    import ntkcore
    from ntkcore.gram import plan_gram

    zero = np.zeros((1,), dtype=np.float32)
    a = np.broadcast_to(zero, (n, s, d_in))
    g = np.broadcast_to(zero, (n, s, o, d_out))
    j = ntkcore.Jacobian([ntkcore.KroneckerBlock(a, g, name="layer")])
    strategy = impl if impl in ("positions", "materialise") else None
    return plan_gram(j, None if symmetric else j, mode=mode, max_memory=max_memory,
                     strategy=strategy)


def _reference(n: int, s: int, d_in: int, d_out: int, o: int, mode: str,
               symmetric: bool) -> tuple[np.ndarray, int]:
    """float64 einsum of the factors on the leading ``r`` samples of each side."""
    r = max(2, min(32, n, int(math.sqrt(2e7 / (s * s * o * o)))))
    a1, g1 = _factors(n, s, d_in, d_out, o, 0)
    a2, g2 = (a1, g1) if symmetric else _factors(n, s, d_in, d_out, o, 1)
    a1, g1, a2, g2 = a1[:r], g1[:r], a2[:r], g2[:r]
    aa = np.einsum("nsj,mtj->nsmt", a1, a2)
    if mode == "trace":
        gg = np.einsum("nsoi,mtoi->nsmt", g1, g2)
        return np.einsum("nsmt,nsmt->nm", gg, aa), r
    gg = np.einsum("nsoi,mtpi->nsmtop", g1, g2)
    k = np.einsum("nsmtop,nsmt->nmop", gg, aa)
    return (k if mode == "full" else np.einsum("nmoo->nmo", k)), r


def _nominal_flops(impl: str, n: int, s: int, d_in: int, d_out: int, o: int, mode: str,
                   plan: Any) -> float:
    ok = o * o if mode == "full" else o
    if impl == "dense":
        return 2.0 * n * n * ok * d_in * d_out
    if s == 1:
        return 2.0 * n * n * (d_in + ok * d_out)
    return float(plan.flops_all_tiles)


def _gemm_rows(cfg: Config) -> list[dict[str, Any]]:
    rows = []
    n = cfg.pick(128, 2048)
    rng = np.random.default_rng(0)
    for backend in cfg.backends:
        x = asarray(rng.standard_normal((n, n)), backend, cfg.device, cfg.dtype)
        y = asarray(rng.standard_normal((n, n)), backend, cfg.device, cfg.dtype)
        timing = cfg.time(lambda x=x, y=y: x @ y, backend)
        rows.append(row(SUITE, f"gemm n={n}", "gemm", backend=backend, device=cfg.device,
                        dtype=cfg.dtype, timing=timing, params={"N": n},
                        flops=2.0 * n**3, note="square GEMM measured in this run"))
    return rows


def _selfprod_rows(cfg: Config) -> list[dict[str, Any]]:
    if not cfg.has("numpy") or cfg.device != "cpu":
        return []
    rows = []
    for n, k in cfg.pick([(128, 32)], [(1024, 256), (2048, 512), (4096, 1024)]):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, k)).astype(cfg.dtype)
        y = x.copy()
        impls: dict[str, Callable[[], Any]] = {
            "x @ y.T (gemm)": lambda x=x, y=y: x @ y.T,
            "x @ x.T (syrk)": lambda x=x: x @ x.T,
            "x @ copy(x.T)": lambda x=x: x @ np.ascontiguousarray(x.T),
        }
        for impl, fn in impls.items():
            timing = cfg.time(fn, "numpy")
            rows.append(row(SUITE, f"selfprod n={n} k={k}", impl, backend="numpy",
                            device=cfg.device, dtype=cfg.dtype, timing=timing,
                            params={"N": n, "K": k}, flops=2.0 * n * n * k,
                            baseline=None if impl.startswith("x @ y.T") else "x @ y.T (gemm)",
                            note="the self-product of a symmetric diagonal tile"))
    return rows


def run(cfg: Config) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = _gemm_rows(cfg)
    itemsize = np.dtype(cfg.dtype).itemsize
    cases = cfg.pick(QUICK_CASES, CASES)
    for name, (kind, n, s, d_in, d_out, o, mode, sym, max_memory) in cases.items():
        ref, r = _reference(n, s, d_in, d_out, o, mode, sym)
        impls = ["kronecker"] if kind == "dense" else ["kronecker", "positions", "materialise"]
        dense_bytes = n * o * d_in * d_out * itemsize * (1 if sym else 2)
        if dense_bytes <= cfg.pick(DENSE_LIMIT_BYTES // 64, DENSE_LIMIT_BYTES) and \
                max_memory is None:
            impls.append("dense")
        base = "dense" if "dense" in impls else None
        for backend in cfg.backends:
            for impl in impls:
                plan = _plan(impl, n, s, d_in, d_out, o, mode, sym, max_memory)
                if impl in ("positions", "materialise") and plan.flops > MAX_GFLOP * 1e9:
                    continue  # far off the cost model's choice: minutes on a CPU
                fn = case(impl, backend, cfg.device, cfg.dtype, n, s, d_in, d_out, o, mode,
                          sym, max_memory)
                k = to_numpy(fn())
                sub = k[:r, :r]
                err = float(np.max(np.abs(sub - ref)) / max(np.max(np.abs(ref)), 1e-300))
                out_bytes = k.nbytes
                del k
                timing = cfg.time(fn, backend, warm=True)
                del fn
                mem = None
                if not cfg.quick or max_memory is not None:  # quick: only the budget case
                    mem = cfg.peak_memory(f"{HERE}:case", impl=impl, backend=backend,
                                          device=cfg.device, dtype=cfg.dtype, n=n, s=s,
                                          d_in=d_in, d_out=d_out, o=o, mode=mode,
                                          symmetric=sym, max_memory=max_memory)
                target = None
                if impl == "kronecker" and kind == "dense" and not sym and n >= 1024:
                    target = "gemm_fraction >= 0.6"
                if max_memory is not None and impl == "kronecker" and mem is not None:
                    from ntkcore._memory import parse_memory

                    target = f"peak_mem_bytes <= {parse_memory(max_memory) + out_bytes}"
                flops = _nominal_flops(impl, n, s, d_in, d_out, o, mode, plan)
                note = (f"strategy {plan.strategies[0]}, tiles {plan.tile_rows}x"
                        f"{plan.tile_cols} ({plan.num_tiles}); error on {r}x{r} samples")
                if sym and s == 1:
                    note += "; symmetric: flops counted for the whole kernel"
                rows.append(row(
                    SUITE, name, impl, backend=backend, device=cfg.device, dtype=cfg.dtype,
                    timing=timing,
                    params={"N": n, "S": s, "d_in": d_in, "d_out": d_out, "O": o, "mode": mode,
                            "symmetric": sym, "max_memory": max_memory,
                            "strategy": plan.strategies[0]},
                    peak_mem_bytes=mem, mem_method=cfg.mem_method, flops=flops,
                    baseline=base if impl != base else None, error=err, target=target,
                    note=note))
    rows.extend(_selfprod_rows(cfg))
    return rows
