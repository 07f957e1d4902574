r"""Suite ``peers``: ntkcore against neural-tangents' empirical NTK on the same MLP weights.

For each case, one MLP in the NTK parameterisation

.. math:: y_l = W_l z_{l-1} / \sqrt{d_{l-1}} + b_l,\quad z_l = \phi(y_l),\quad f = y_L,

with :math:`W_l, b_l \sim \mathcal N(0, 1)` drawn once in float64 NumPy, and the eNTK of N
Gaussian inputs, in the case's mode: ``trace``, :math:`\Theta(X, X) \in \mathbb R^{N\times N}`
(:math:`\sum_o`), or ``full``, :math:`\Theta(X, X) \in \mathbb R^{N\times N\times O\times O}`:

=========================================  ===================  ======  =====  ====
case                                       widths               phi     N      mode
=========================================  ===================  ======  =====  ====
``MLP 6x512 tanh N=384``                   256-6x512-1          tanh    384    trace
``MLP 8x1000 tanh N=512``                  256-8x1000-1         tanh    512    trace
``MLP 784-512-512-10 relu N=1024 full``    784-512-512-10       relu    1024   full
=========================================  ===================  ======  =====  ====

- ``ntkcore`` (each selected backend): ``ntkcore.ntk(ntkcore.models.MLP(...), x,
  mode=...)`` (Kronecker blocks, per layer :math:`(G G^\top)\odot(A A^\top)`);
- ``neural-tangents impl 1/2/3``: ``nt.empirical_ntk_fn(f, trace_axes=(-1,) or (),
  vmap_axes=0, implementation=k)`` under ``jax.jit`` in the peer venv (``nt.py``), the model
  written with
  ``lax.dot_general`` so that implementation 3's structured rules apply.  JIT compilation is
  excluded from the timing (it is the first call, which doubles as the warm-up; its time is
  given in the note).  Implementations 1 and 2 are skipped, with the reason in the table,
  where their N x O x P Jacobian or their ~2 N^2 O^2 P flops would not fit the suite's
  memory or time budget (the 8 x 1000 MLP; the 784-512-512-10 MLP at N = 1024, whose
  Jacobian is 27 GB in float32).

The baseline is neural-tangents' structured derivatives (implementation 3); target for
ntkcore: >= 1.5x faster. Every row with a timing also gets a roofline share: the case's
least GEMM work (``benchmarks.suites.ntk.mlp_roofline_flops``) over its time and the GEMM
rate of its backend (ntkcore's rows: a 2048^2 GEMM timed after each of its turns in the
interleaved rounds; the peer's: the run's GEMM measurement). Timing is interleaved:
neural-tangents impl 3 stays compiled in a runner process (``nt.Interleaved``) and each round
gives ntkcore (every backend) and the peer one turn of the same number of calls, for about a
minute per case; the
medians are over all rounds. A shared machine has slow and fast phases (on the development
VM the same GEMM ran at 83 and at 143 GFLOP/s minutes apart), and timing one library after
the other let such a phase decide the ratio. Implementations 1 and 2 are timed in their own
runs.
``error``: relative Frobenius error against an independent float64
NumPy evaluation of the same per-layer formula written out in this file, on all N samples
for the trace cases and on the leading (32, 32, O, O) block for the full-mode case (the
peer's kernel is cropped to that block inside its process, so the 0.4 GB kernel is not
copied back).

Duration (2 shared AMD cores, float32, numpy/torch/jax, memory on): 394 s for the three
cases in the last full run, about 2 min of it interleaved timing (one minute per trace case,
three rounds of the full-mode case), the rest neural-tangents' compilation, its impls 1/2 on
the 6x512 MLP, and a fresh-process memory run per backend.  The full-mode kernel has 105 M
entries (0.4 GB); one ntkcore call takes ~3 s and one neural-tangents call ~8 s.  Run it with
``--suite-timeout 900`` (the default 420 s may stop it).  ``--case`` selects cases, e.g.
``python -m benchmarks --suite peers --case "784-512"``.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import numpy as np

from benchmarks._harness import (
    PAIRED_GEMM_N,
    Config,
    _block,
    asarray,
    gemm_call,
    row,
    sync_fn,
    to_numpy,
)
from benchmarks.peers import nt
from benchmarks.suites.ntk import mlp_roofline_flops

SUITE = "peers"
HERE = "benchmarks.peers.suite"
BASELINE = "neural-tangents impl 3"

# name -> (widths, N, activation, mode); quick runs use the "tiny" cases only
# (the same architectures and N as the ``ntk`` suite's torch.nn models)
CASES = {
    "MLP 6x512 tanh N=384": ((256, *[512] * 6, 1), 384, "tanh", "trace"),
    "MLP 8x1000 tanh N=512": ((256, *[1000] * 8, 1), 512, "tanh", "trace"),
    "MLP 784-512-512-10 relu N=1024 full": ((784, 512, 512, 10), 1024, "relu", "full"),
}
QUICK_CASES = {
    "MLP tiny tanh": ((8, 16, 16, 1), 8, "tanh", "trace"),
    "MLP tiny relu full": ((8, 16, 16, 3), 8, "relu", "full"),
}
# full-mode errors are taken on the leading (N_REF, N_REF, O, O) block
N_REF = 32
# neural-tangents impl 1 materialises the N x O x P Jacobian: skip it above this many bytes
JACOBIAN_LIMIT = 3 * 2**30
# ... and impls 1 and 2 above this many flops per call (minutes per case on 2 cores)
FLOP_LIMIT = 6e11
# seconds of timed calls per neural-tangents implementation (its calls take up to ~10 s)
NT_BUDGET_S = 10.0


def problem(case: str, seed: int = 0) -> dict[str, Any]:
    widths, n, activation, mode = {**CASES, **QUICK_CASES}[case]
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal((o, i)) for i, o in pairwise(widths)]
    biases = [rng.standard_normal(o) for o in widths[1:]]
    x = rng.standard_normal((n, widths[0]))
    scales = [1.0 / math.sqrt(i) for i in widths[:-1]]
    return {"weights": weights, "biases": biases, "x": x, "scales": scales, "beta": 1.0,
            "widths": widths, "n": n, "activation": activation, "mode": mode}


def _act(name: str, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """phi(y) and phi'(y) for the suite's activations."""
    if name == "tanh":
        t = np.tanh(y)
        return t, 1.0 - t**2
    if name == "relu":
        return np.maximum(y, 0.0), (y > 0).astype(y.dtype)
    raise ValueError(f"unknown activation {name!r}")


def reference_ntk(p: dict[str, Any]) -> np.ndarray:
    """eNTK in float64 from the per-layer formula (independent of ntkcore).

    Forward :math:`y_l = c_l W_l z_{l-1} + \\beta b_l`, :math:`z_l = \\phi(y_l)`; backward
    :math:`g_L = I_O`, :math:`g_{l-1} = (g_l c_l W_l) \\odot \\phi'(y_{l-1})`; layer l adds
    :math:`\\langle g_l[n,o], g_l[m,p]\\rangle \\langle a_n, a_m\\rangle` with
    :math:`a = [c_l z_{l-1}, \\beta]` to :math:`\\Theta[n, m, o, p]`.

    Returns (N, N) summed over o = p in ``trace`` mode (all N samples) and
    (m, m, O, O) with m = min(N, N_REF) (the leading samples) in ``full`` mode.
    """
    ws, bs, x, cs, beta = p["weights"], p["biases"], p["x"], p["scales"], p["beta"]
    full = p.get("mode", "trace") == "full"
    if full:
        x = x[:N_REF]
    zs, dphi = [x], []
    for l, (w, b) in enumerate(zip(ws, bs, strict=True)):
        y = cs[l] * zs[-1] @ w.T + beta * b
        if l < len(ws) - 1:
            z, d = _act(p.get("activation", "tanh"), y)
            zs.append(z)
            dphi.append(d)
    n, o = x.shape[0], ws[-1].shape[0]
    g = np.broadcast_to(np.eye(o), (n, o, o)).copy()  # d f_o / d y_L
    k = np.zeros((n, n, o, o) if full else (n, n))
    for l in reversed(range(len(ws))):
        a = np.concatenate([cs[l] * zs[l], np.full((n, 1), beta)], axis=1)
        if full:
            k += np.einsum("nok,mpk->nmop", g, g) * (a @ a.T)[:, :, None, None]
        else:
            k += np.einsum("nok,mok->nm", g, g) * (a @ a.T)
        if l > 0:
            g = (g @ (cs[l] * ws[l])) * dphi[l - 1][:, None, :]
    return k


def ntkcore_case(backend: str, device: str, dtype: str, case: str) -> Callable[[], Any]:
    """Inputs in ``backend``; returns the call computing ntkcore's eNTK in the case's mode."""
    import ntkcore
    from ntkcore.models import MLP

    p = problem(case)
    ws = [asarray(w, backend, device, dtype) for w in p["weights"]]
    bs = [asarray(b, backend, device, dtype) for b in p["biases"]]
    x = asarray(p["x"], backend, device, dtype)
    net = MLP(ws, bs, activation=p["activation"], parameterization="ntk", weight_std=1.0,
              bias_std=1.0)
    return lambda: ntkcore.ntk(net, x, mode=p["mode"])


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _params(p: dict[str, Any]) -> dict[str, Any]:
    widths = p["widths"]
    n_params = sum((i + 1) * o for i, o in pairwise(widths))
    return {"N": p["n"], "O": widths[-1], "P": n_params, "widths": list(widths),
            "activation": p["activation"], "mode": p["mode"],
            "family": "MLP " + "-".join(map(str, widths[1:-1]))}


def _roofline(p: dict[str, Any]) -> float:
    """The case's least GEMM work (``suites.ntk.mlp_roofline_flops``: forward, output
    gradients, symmetric Kronecker Grams), for the roofline share of every row."""
    return mlp_roofline_flops(p["widths"], p["n"], p["mode"])


def _crop(k: Any, p: dict[str, Any]) -> np.ndarray:
    """The part of a kernel that :func:`reference_ntk` computes, as float64 NumPy."""
    k = to_numpy(k)
    if p["mode"] == "full":
        m = min(p["n"], N_REF)
        k = k[:m, :m]
    return np.asarray(k, dtype=np.float64)


def _err_note(p: dict[str, Any]) -> str:
    if p["mode"] == "full" and p["n"] > N_REF:
        return f" (error on the leading {N_REF} samples)"
    return ""


#: Seconds of interleaved timing per case (all libraries together), and the length of one
#: library's turn (about a second's worth of calls, at least one).
INTERLEAVE_BUDGET_S = 60.0
INTERLEAVE_TURN_S = 1.0
#: Idle seconds before each turn: BLAS and OpenMP worker threads keep spinning for a while
#: after a call (OpenBLAS for ~0.1 s), and spinning threads of the previous turn's library
#: would take a core from the next one.
INTERLEAVE_PAUSE_S = 0.3


def _timing(times: list[float], rounds: int) -> dict[str, Any]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "repeats": len(times), "timed_calls": f"interleaved, {rounds} rounds"}


def _time_calls(fn: Callable[[], Any], backend: str, device: str, k: int) -> list[float]:
    """Durations of ``k`` calls of ``fn`` (synchronised on asynchronous devices)."""
    sync = sync_fn(backend, device)
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        _block(fn())  # JAX dispatches asynchronously
        if sync:
            sync()
        out.append(time.perf_counter() - t0)
    return out


def _interleaved_timings(cfg: Config, p: dict[str, Any],
                         ours: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Time ntkcore (each backend) and neural-tangents impl 3 in alternating turns.

    A shared machine has slow and fast phases lasting seconds to minutes; timing one library
    after the other lets a phase change decide the ratio.  Each round gives every library
    one turn of the same number of calls (about ``INTERLEAVE_TURN_S`` of the slowest), and
    rounds repeat until ``INTERLEAVE_BUDGET_S`` is spent (at least 3 rounds; 1 in quick
    runs).  Returns the timings, or None if the peer could not be started.
    """
    try:
        peer = nt.Interleaved(p["weights"], p["biases"], p["x"], scales=p["scales"],
                              beta=p["beta"], activation=p["activation"], mode=p["mode"],
                              dtype=cfg.dtype)
    except Exception as exc:
        print(f"[peers] interleaved neural-tangents runner failed: {exc!r}", file=sys.stderr)
        return None
    gemm_n = cfg.pick(256, PAIRED_GEMM_N)
    gemms = {b: gemm_call(b, cfg.device, cfg.dtype, gemm_n) for b in ours}
    for gemm in gemms.values():
        _block(gemm())  # warm-up (JAX compiles)
    with peer:
        slowest = max([o["first_s"] for o in ours.values()] + [0.0])
        calls = max(1, int(INTERLEAVE_TURN_S / max(slowest, 1e-3)))
        times: dict[str, list[float]] = {b: [] for b in ours}
        gemm_times: dict[str, list[float]] = {b: [] for b in ours}
        peer_times: list[float] = []
        t_start, rounds = time.perf_counter(), 0
        min_rounds = 1 if cfg.quick else 3
        while rounds < min_rounds or (
                not cfg.quick and rounds < 50
                and time.perf_counter() - t_start < INTERLEAVE_BUDGET_S):
            for backend, o in ours.items():
                time.sleep(INTERLEAVE_PAUSE_S)
                times[backend] += _time_calls(o["fn"], backend, cfg.device, calls)
                gemm_times[backend] += _time_calls(gemms[backend], backend, cfg.device, 1)
            time.sleep(INTERLEAVE_PAUSE_S)
            peer_times += peer.time(calls)
            rounds += 1
    note = (f"; timed interleaved with {BASELINE}: {rounds} rounds of {calls} call(s) per "
            "library, median over all")
    return {"ours": {b: _timing(t, rounds) for b, t in times.items()},
            "gemm_gflops": {b: 2.0 * gemm_n ** 3 / statistics.median(t) / 1e9
                            for b, t in gemm_times.items()},
            "peer": _timing(peer_times, rounds), "note": note}


def _neural_tangents_rows(cfg: Config, p: dict[str, Any], params: dict[str, Any],
                          ref: np.ndarray) -> list[dict[str, Any]]:
    """Rows of neural-tangents' implementations (impls 1/2 skipped where too large)."""
    case = params["family"]
    rows: list[dict[str, Any]] = []
    impls = [1, 2, 3]
    n, o, n_par = p["n"], params["O"], params["P"]
    jac_bytes = n * o * n_par * np.dtype(cfg.dtype).itemsize
    flops = 2.0 * n * n * o * o * n_par  # J J^T, also the order of impl 2's work
    for impl, why in (
        (1, jac_bytes > JACOBIAN_LIMIT
         and f"its N x O x P Jacobian alone is {jac_bytes / 2**30:.1f} GiB"),
        (1, flops > FLOP_LIMIT and f"~{flops / 1e12:.1f} TFLOP per call (2 N^2 O^2 P)"),
        (2, flops > FLOP_LIMIT and f"~{flops / 1e12:.1f} TFLOP per call (N^2 O^2 P order)"),
    ):
        if why and impl in impls:
            impls.remove(impl)
            rows.append(row(
                SUITE, case, f"neural-tangents impl {impl}", backend="jax", device="cpu",
                dtype=cfg.dtype, params=params,
                note=f"{nt.IMPL_NAMES[impl]}: not run: {why}",
            ))
    results, kernels, versions = nt.run(
        p["weights"], p["biases"], p["x"], scales=p["scales"], beta=p["beta"],
        activation=p["activation"], impls=tuple(impls), mode=p["mode"], dtype=cfg.dtype,
        repeat=cfg.reps, warmup=0,  # the first (compiling) call is the warm-up
        budget_s=None if cfg.quick else min(cfg.budget_s or NT_BUDGET_S, NT_BUDGET_S),
        memory=cfg.memory and not cfg.quick, separate=not cfg.quick,
        kernel_rows=min(p["n"], N_REF) if p["mode"] == "full" else None,
    )
    vers = ", ".join(f"{k} {v}" for k, v in versions.items() if k != "devices")
    for res in results:
        impl = f"neural-tangents impl {res['impl']}"
        name = nt.IMPL_NAMES[res["impl"]]
        if "error" in res:
            rows.append(row(SUITE, case, impl, backend="jax", device="cpu", dtype=cfg.dtype,
                            params=params, note=f"{name}: failed: {res['error'][:300]}"))
            continue
        k = kernels.get(f"impl{res['impl']}")
        timing = {key: res[key] for key in ("median_s", "min_s", "max_s", "repeats")}
        rows.append(row(
            SUITE, case, impl, backend="jax", device="cpu", dtype=cfg.dtype, timing=timing,
            params=params, peak_mem_bytes=res.get("peak_mem_bytes"),
            roofline_flops=_roofline(p),
            mem_method="RSS growth (fresh process)" if "peak_mem_bytes" in res else None,
            baseline=None if impl == BASELINE else BASELINE,
            error=None if k is None else _rel(_crop(k, p), ref),
            note=f"{name}; {p['mode']} eNTK{_err_note(p)}; jit first call "
                 f"{res.get('compile_s', float('nan')):.2g} s; {vers}",
        ))
    return rows


def run(cfg: Config) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if cfg.device != "cpu":
        nt_ok, nt_info = False, "neural-tangents runs on the CPU venv only"
    elif cfg.quick and cfg.extra.get("peers_nt") != "1":
        # the peer's start-up (JAX import + compilation) would dominate a smoke run
        nt_ok, nt_info = False, "skipped in --quick runs (add --set peers_nt=1)"
    else:
        nt_ok, nt_info = nt.status()
    cases = cfg.select(cfg.pick(QUICK_CASES, CASES))
    for case in cases:
        p = problem(case)
        ref = reference_ntk(p)
        params = _params(p)
        params["family"] = case
        # ntkcore: the checked first call and the memory run now; the timing below
        ours: dict[str, dict[str, Any]] = {}
        for backend in cfg.backends:
            if backend not in ("numpy", "torch", "jax", "cupy"):
                continue
            fn = ntkcore_case(backend, cfg.device, cfg.dtype, case)
            t0 = time.perf_counter()
            k = fn()
            first_s = time.perf_counter() - t0
            err = _rel(_crop(k, p), ref)
            del k
            mem = cfg.peak_memory(f"{HERE}:ntkcore_case", child_warmup=first_s < cfg.long_call_s,
                                  backend=backend, device=cfg.device, dtype=cfg.dtype, case=case)
            ours[backend] = {"fn": fn, "first_s": first_s, "error": err, "mem": mem}
        peer_rows: list[dict[str, Any]] = []
        interleaved = None
        if nt_ok:
            peer_rows = _neural_tangents_rows(cfg, p, params, ref)
            interleaved = _interleaved_timings(cfg, p, ours)
        for backend, o in ours.items():
            gemm_gflops = None
            if interleaved is not None:
                timing, how = interleaved["ours"][backend], interleaved["note"]
                gemm_gflops = interleaved["gemm_gflops"][backend]
            else:
                timing, how = cfg.time(o["fn"], backend, first_s=o["first_s"]), ""
            rows.append(row(
                SUITE, case, "ntkcore", backend=backend, device=cfg.device, dtype=cfg.dtype,
                timing=timing, params=params, peak_mem_bytes=o["mem"],
                mem_method=cfg.mem_method, baseline=BASELINE if nt_ok else None,
                roofline_flops=_roofline(p), gemm_gflops=gemm_gflops,
                error=o["error"], target="speedup >= 1.5" if nt_ok else None,
                note=f"{p['mode']} eNTK" + _err_note(p) + how
                + ("" if nt_ok else f"; neural-tangents not run: {nt_info}"),
            ))
        ours.clear()
        for r in peer_rows:
            if interleaved is not None and r["impl"] == BASELINE and "median_s" in r:
                r.update(interleaved["peer"])
                r["note"] += interleaved["note"]
            rows.append(r)
    return rows
