r"""Suite ``features``: projected eNTK features (``ntkcore.features``, issue 19).

Three kinds of case (``--case error``, ``--case throughput``, ``--case scale`` select them):

``error <model> N=256``
    Kernel relative Frobenius error :math:`\|\Phi\Phi^\top - \Theta\|_F / \|\Theta\|_F` of
    trace-mode features against the exact trace eNTK (``ntkcore.ntk``) of N = 256 inputs, for
    dim = 256, 1024, 4096, 16384, each Kronecker layout that ``ntkcore.features`` offers
    (``kronecker=``, read at run time) and two splits of ``dim`` over the blocks: ``default``
    (equal weights per block) and ``probe`` (``probe=`` the first 32 inputs: each block's
    share of the kernel trace).  Five seeds per point: the row's ``error`` is the median,
    ``params`` hold every seed's error, their root mean square (``error_rms``), the same on
    the leading (64, 64) block of the kernel (``error_subset``, ``error_subset_rms``) and the
    error the error model predicts on those 64 inputs (``error_pred``,
    ``ntkcore.feature_error``: a root mean square over seeds, so it is compared with
    ``error_subset_rms``; the relative error depends on N, hence the same 64 inputs).  The
    error is heavy-tailed over seeds: the median sits below the root mean square.  The
    Jacobian of the 256 inputs is computed once and passed to ``ntkcore.features`` (the error
    does not depend on how the factors were obtained).  Projections larger than the error
    cases' ``max_memory`` (2 GB) are skipped with a row saying so.  Models: the ``ntk``
    suite's 6x512 tanh MLP, CNN (32x32x3, O = 10) and transformer block (T = 16, d = 64,
    O = 10), same initialisation and inputs.
``throughput <model> N=<n> dim=2048`` (N = 256 and 2048; 256 and 1024 for the CNN)
    Samples per second of ``ntkcore.features`` (trace; and pseudo when O > 1) against
    ``ntkcore.ntk`` (the exact trace kernel of the same N inputs: its cost grows like N^2, that
    of features like N, hence two N) and, in the N = 256 case, against the
    per-sample-gradient-then-project baseline ``torch.func vmap(grad) + Gaussian``
    (``benchmarks/baselines/torch_func.py``: the gradient of :math:`\sum_o f_o/\sqrt{O}` per
    sample, i.e. the pseudo-NTK's, TRAK's single scalar per sample, then a dense Gaussian
    P x dim projection generated in chunks, regenerated per batch of 64 when it exceeds
    512 MB).  The baseline runs on the first 64 inputs (its cost is linear in N: per batch,
    2 P dim flops per sample plus P dim normal draws), so compare samples per second.  All
    implementations of a case are timed interleaved: after one checked call each, every round
    calls each once (the order alternating), 3 rounds; a checked call over ``--long-call``
    seconds (default 10) is that implementation's timing instead (one call).  ``median_s`` is
    per call, ``params["samples_per_s"]`` is N / median (the rows name no ``baseline``: the
    generic speed-up, a ratio of times, would compare different N; the renderer gives ratios
    of samples per second, against the baseline of the same model).  With O > 1 the
    baseline's like-for-like is ``features pseudo``; ``features trace`` estimates the sum over
    the O outputs.
``scale CNN digits N=100000 dim=4096`` (not in ``--quick`` runs)
    100,000 augmented scikit-learn digits (8x8; the 1437 training digits shifted by up to one
    pixel, rescaled in intensity and with Gaussian noise; the 360 test digits untouched) and a
    small CNN (Conv 1->16 3x3, tanh, Conv 16->32 3x3 stride 2, tanh, Linear 512->10, O = 10,
    PyTorch default initialisation): trace features at dim = 4096 streamed within
    ``max_memory="2GB"``, then the primal ridge solve (``ntkcore.FeatureRidge``, one-hot
    targets, :math:`\lambda = 10^{-3}\,\mathrm{tr}(K)/N`), test accuracy of the argmax; next to
    the exact eNTK regression (``ntkcore.ntk`` + ``ntkcore.kernel_regression``, same relative
    :math:`\lambda`) on the first 16,000 of the same training inputs (a 1 GB float32 kernel,
    the top of the issue's 8,000-16,000 range: the largest subset whose process peak stays
    within the features path's, about 4 GB; its N^2 pairs cost ~0.2 MFLOP each).  Each runs once in
    a fresh process; ``peak_mem_bytes`` is that process's resident high-water mark
    (``VmHWM``, Python, torch and the data included; ``params["rss_start_bytes"]`` is the
    resident set before the measured work), ``median_s`` the wall time of features (or
    kernels) plus solve plus test predictions, split in ``default``.

Options (``--set KEY=VALUE``): ``features_n`` (256), ``features_dims`` (256,1024,4096,16384),
``features_seeds`` (5), ``features_pred_n`` (64), ``features_probe_n`` (32),
``features_splits`` (default,probe), ``features_error_budget`` (2GB); ``features_tp_n``
(comma-separated N of the throughput cases, for every model; default per model, above),
``features_tp_dim`` (2048), ``features_base_n`` (64), ``features_rounds`` (3),
``features_memory`` (1: peak memory of each throughput implementation in a fresh process);
``scale_n`` (100000), ``scale_dim`` (4096), ``scale_exact_n`` (16000; 0 skips the exact
path), ``scale_budget`` (2GB), ``scale_reg`` (1e-3).

Expected duration (measured with one thread on the shared 2-core machine, load 8-14): error
cases ~1.5 (MLP), ~14 (CNN: its 1024-position convolution), ~1.5 (transformer) min;
throughput cases ~0.5-5 min each (the 6x512 MLP's baseline: ~1-2 min per call, 3 GFLOP
per sample and 3e9 normal draws per batch); the scale case ~6 min on a quiet machine.
Measured once (2 torch threads, the machine shared with other jobs, load average 1-5):
features of 100,000 inputs + FeatureRidge 77 s (features 51 s, solve 26 s), peak RSS
3.9 GiB, test accuracy 0.992; exact eNTK regression at N = 8,000 56 s (kernels 41 s,
solve 14 s), 2.4 GiB, 0.997; at N = 16,000 301 s (kernels 264 s, solve 37 s), 3.4 GiB,
0.994.  At N = 5000 / exact 2000 (``--set scale_n=5000 --set scale_exact_n=2000``), one
thread, load 14: 47 s (1.1 GB, 0.994) and 42 s (1.0 GB, 0.994).  Run it on its own:
``python -m benchmarks --suite features --case scale --suite-timeout 0 --total-budget 0``.
"""

from __future__ import annotations

import inspect
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks._harness import ROOT, Config, row

SUITE = "features"
HERE = "benchmarks.suites.features"
BASELINE = "torch.func vmap(grad) + Gaussian"

ERROR_MODELS = {"MLP 6x512 tanh": "mlp6x512", "CNN": "cnn", "Transformer block": "transformer"}
QUICK_MODELS = {"MLP tiny": "mlp_tiny", "CNN tiny": "cnn_tiny",
                "Transformer tiny": "transformer_tiny"}
OUTPUTS = {"mlp6x512": 1, "mlp_tiny": 1, "cnn": 10, "cnn_tiny": 10, "transformer": 10,
           "transformer_tiny": 3}

#: throughput cases: N per model (the baseline runs in the first); ``--set features_tp_n``
#: replaces them for every model
TP_SIZES = {"mlp6x512": (256, 2048), "cnn": (256, 1024), "transformer": (256, 2048)}

#: --set defaults: (quick, full)
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "features_n": (16, 256),
    "features_dims": ("16,64", "256,1024,4096,16384"),
    "features_seeds": (2, 5),
    "features_pred_n": (8, 64),
    "features_probe_n": (8, 32),
    "features_splits": ("default,probe", "default,probe"),
    "features_error_budget": ("256MB", "2GB"),
    "features_tp_n": ("16", ""),  # "": TP_SIZES
    "features_tp_dim": (64, 2048),
    "features_base_n": (8, 64),
    "features_rounds": (1, 3),
    "scale_n": (2000, 100_000),
    "scale_dim": (256, 4096),
    "scale_exact_n": (500, 16_000),
    "scale_budget": ("256MB", "2GB"),
    "scale_reg": (1e-3, 1e-3),
}


def _opt(cfg: Config, key: str) -> Any:
    """``--set key=...`` converted to the type of its default."""
    default = cfg.pick(*DEFAULTS[key])
    v = cfg.extra.get(key)
    if v is None:
        return default
    return type(default)(float(v)) if isinstance(default, int) else type(default)(v)


def _ints(s: str) -> list[int]:
    return [int(float(v)) for v in str(s).split(",") if v.strip()]


def build(kind: str, n: int, dtype: str, device: str) -> tuple[Any, Any]:
    """The model and inputs of the ``ntk`` suite (same initialisation and inputs)."""
    from benchmarks.suites.ntk import build as ntk_build

    return ntk_build(kind, n, dtype, device)


def layouts() -> tuple[str | None, ...]:
    """The Kronecker layouts ``ntkcore.features`` offers, read at run time (``None``: it takes
    no ``kronecker=`` argument)."""
    import ntkcore

    par = inspect.signature(ntkcore.features).parameters.get("kronecker")
    if par is None:
        return (None,)
    found = getattr(sys.modules["ntkcore.features"], "KRONECKER_LAYOUTS", None)
    if found:  # the default first
        return tuple(sorted(found, key=lambda k: k != par.default))
    return (par.default,)


def _kw(layout: str | None) -> dict[str, Any]:
    return {} if layout is None else {"kronecker": layout}


def _rms(errs: list[float]) -> float | None:
    """Root mean square over seeds: what the error model predicts,
    sqrt(E ||Phi Phi^T - K||_F^2) / ||K||_F."""
    return math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else None


# -- error against dim --------------------------------------------------------------------------
def predicted(model: Any, x: Any, points: list[tuple[str | None, str, int]],
              probe: Any) -> dict[tuple[str | None, str, int], float]:
    """Predicted relative Frobenius error (``ntkcore.feature_error``) of trace features on
    ``x`` for each ``(layout, split, dim)``: ``split`` "default" (equal weights) or "probe"
    (``probe`` given).  The pair statistics do not depend on the layout, split or dim, so they are
    computed once (the helpers behind ``feature_error``; its public form, one call per point,
    when those helpers are not there)."""
    import ntkcore
    from ntkcore.providers import find_provider

    F = sys.modules["ntkcore.features"]
    try:
        J = F._merge(find_provider(model).jacobian(model, x), "trace")
        sums, k2 = F._sums(J.xp, [F._pair_stats(b) for b in J.blocks])
        weights = {"default": None, "probe": F._weights(probe, model, "trace", None, True)}
        return {pt: F._relative_error(F._plan(J, pt[2], "auto", weights[pt[1]],
                                              *([] if pt[0] is None else [pt[0]])), sums, k2)
                for pt in points}
    except (AttributeError, TypeError):  # the helpers changed: the public function
        return {pt: ntkcore.feature_error(model, x, dim=pt[2], **_kw(pt[0]),
                                          probe=probe if pt[1] == "probe" else None)
                for pt in points}


def _error_rows(cfg: Config, name: str, model_name: str, kind: str) -> list[dict[str, Any]]:
    import torch

    import ntkcore
    from benchmarks.baselines.torch_func import kernel_error
    from ntkcore.errors import BudgetTooSmallError
    from ntkcore.providers import find_provider

    n, n_pred = _opt(cfg, "features_n"), _opt(cfg, "features_pred_n")
    n_probe, seeds = _opt(cfg, "features_probe_n"), _opt(cfg, "features_seeds")
    dims = _ints(_opt(cfg, "features_dims"))
    splits = [s.strip() for s in _opt(cfg, "features_splits").split(",") if s.strip()]
    budget = _opt(cfg, "features_error_budget")
    model, x = build(kind, n, cfg.dtype, cfg.device)
    n_pred, n_probe = min(n_pred, n), min(n_probe, n)
    p = sum(v.numel() for v in model.parameters())
    jac = find_provider(model).jacobian(model, x)
    probe_j = jac.select(slice(0, n_probe))
    k = ntkcore.ntk(model, x, mode="trace").to(torch.float64)
    k_sub = k[:n_pred, :n_pred]
    points = [(lay, split, d) for lay in layouts() for split in splits for d in dims]
    pred = predicted(model, x[:n_pred], points, x[:n_probe])
    rows = []
    for lay, split, d in points:
        errs, errs_sub, note = [], [], ""
        t0 = time.perf_counter()
        for seed in range(seeds):
            try:
                phi = ntkcore.features(jac, dim=d, seed=seed, max_memory=budget, **_kw(lay),
                                       probe=probe_j if split == "probe" else None)
            except BudgetTooSmallError as exc:
                need = getattr(exc, "needed", None)
                note = (f"not run: max_memory={budget} is too small for the projections "
                        f"(it would need {need / 1e9:.2g} GB)" if need else
                        f"not run: {exc}")
                break
            phi = phi.to(torch.float64)
            errs.append(kernel_error(phi @ phi.T, k))
            errs_sub.append(kernel_error(phi[:n_pred] @ phi[:n_pred].T, k_sub))
            del phi
        params = {"kind": "error", "model": model_name, "N": n, "P": p, "O": OUTPUTS[kind],
                  "dim": d, "kronecker": lay, "split": split, "seeds": len(errs),
                  "errors": errs, "n_pred": n_pred, "errors_subset": errs_sub,
                  "error_subset": statistics.median(errs_sub) if errs_sub else None,
                  "error_subset_rms": _rms(errs_sub),
                  "error_pred": pred[(lay, split, d)],
                  "error_min": min(errs) if errs else None,
                  "error_max": max(errs) if errs else None, "error_rms": _rms(errs),
                  "seconds": time.perf_counter() - t0, "max_memory": budget}
        rows.append(row(
            SUITE, name, "ntkcore.features", backend="torch", device=cfg.device,
            dtype=cfg.dtype, params=params,
            error=statistics.median(errs) if errs else None,
            note=note or (f"trace mode; median over {len(errs)} seeds against ntkcore.ntk on "
                          f"{n} inputs; predicted on the first {n_pred}")))
    return rows


# -- throughput ---------------------------------------------------------------------------------
def throughput_case(impl: str, kind: str, n: int, dim: int, dtype: str, device: str,
                    base_n: int) -> Callable[[], Any]:
    """The zero-argument call of ``impl`` (also the peak-memory target)."""
    import ntkcore

    model, x = build(kind, n, dtype, device)
    if impl == "ntkcore.features trace":
        return lambda: ntkcore.features(model, x, dim=dim, seed=0)
    if impl == "ntkcore.features pseudo":
        return lambda: ntkcore.features(model, x, dim=dim, seed=0, mode="pseudo")
    if impl == "ntkcore.ntk trace":
        return lambda: ntkcore.ntk(model, x, mode="trace")
    if impl == BASELINE:
        from benchmarks.baselines.torch_func import gradient_projection

        xb = x[:base_n]
        return lambda: gradient_projection(model, xb, dim=dim, seed=0)
    raise ValueError(f"unknown impl {impl!r}")


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, dict[str, Any]]:
    """Time each callable once per round, the order alternating between rounds (so that a
    slow phase of a shared machine hits every implementation); median/min/max per call."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(max(1, rounds)):
        for k in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
                "repeats": len(v), "timed_calls": "interleaved"} for k, v in times.items()}


def _tp_sizes(cfg: Config, kind: str) -> tuple[int, ...]:
    given = _ints(_opt(cfg, "features_tp_n"))
    return tuple(given) if given else TP_SIZES.get(kind, (256,))


def _throughput_rows(cfg: Config, name: str, model_name: str, kind: str, n: int,
                     with_baseline: bool) -> list[dict[str, Any]]:
    dim = _opt(cfg, "features_tp_dim")
    base_n = min(_opt(cfg, "features_base_n"), n)
    o = OUTPUTS[kind]
    impls = ["ntkcore.features trace", *(["ntkcore.features pseudo"] if o > 1 else []),
             "ntkcore.ntk trace", *([BASELINE] if with_baseline else [])]
    fns, counts, shapes, first = {}, {}, {}, {}
    for impl in impls:
        fn = throughput_case(impl, kind, n, dim, cfg.dtype, cfg.device, base_n)
        t0 = time.perf_counter()
        out = fn()  # the checked call is the warm-up
        first[impl] = time.perf_counter() - t0
        shapes[impl] = tuple(out.shape)
        counts[impl] = base_n if impl == BASELINE else n
        want = (counts[impl], counts[impl]) if impl == "ntkcore.ntk trace" else \
            (counts[impl], dim)
        if shapes[impl] != want:
            raise AssertionError(f"{impl} returned shape {shapes[impl]}, expected {want}")
        del out
        fns[impl] = fn
    # a call over --long-call seconds is its own timing (not repeated), as in the ntk suite
    long = {k for k, t in first.items() if not cfg.quick and t >= cfg.long_call_s}
    timing = interleaved({k: f for k, f in fns.items() if k not in long},
                         _opt(cfg, "features_rounds"))
    timing.update({k: {"median_s": first[k], "min_s": first[k], "max_s": first[k],
                       "repeats": 1, "timed_calls": "first"} for k in long})
    model, _ = build(kind, 1, cfg.dtype, cfg.device)
    p = sum(v.numel() for v in model.parameters())
    memory = cfg.flag("features_memory", True)
    rows = []
    for impl in impls:
        t = timing[impl]
        mem = None
        if memory:
            # the one-time initialisation is negligible next to the baseline's or a long call
            mem = cfg.peak_memory(f"{HERE}:throughput_case",
                                  child_warmup=impl != BASELINE and impl not in long,
                                  impl=impl, kind=kind, n=n,
                                  dim=dim, dtype=cfg.dtype, device=cfg.device, base_n=base_n)
        note = {"ntkcore.features trace": "trace features (the O outputs' sum)",
                "ntkcore.features pseudo": "pseudo-NTK features (one backward pass per sample)",
                "ntkcore.ntk trace": "the exact trace kernel (N x N) of the same inputs",
                BASELINE: f"per-sample gradient of sum_o f_o/sqrt(O), then a dense Gaussian "
                          f"(P x dim) projection, on the first {base_n} inputs"}[impl]
        rows.append(row(
            SUITE, name, impl, backend="torch", device=cfg.device, dtype=cfg.dtype, timing=t,
            params={"kind": "throughput", "model": model_name, "N": counts[impl],
                    "N_case": n, "dim": dim, "P": p, "O": o,
                    "samples_per_s": counts[impl] / t["median_s"],
                    "rounds": t["repeats"]},
            peak_mem_bytes=mem, mem_method=cfg.mem_method if mem is not None else None,
            flops=2.0 * p * dim * counts[impl] if impl == BASELINE else None,
            note=note + ("; one call (its first, which took over --long-call s)"
                         if impl in long else "")))
    return rows


# -- scale ---------------------------------------------------------------------------------------
def digits_data(n_train: int, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """``(x_train (n, 1, 8, 8), y_train one-hot (n, 10), x_test, labels_test)`` as float32
    torch tensors (labels int64): the 1437 training digits of a fixed split, augmented to
    ``n_train`` (the first 1437 unchanged, then random shifts by -1..1 pixel in each
    direction, intensity x U(0.8, 1.2), Gaussian noise of 0.05); the 360 test digits as
    they are; all standardised with the training digits' mean and standard deviation."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y))
    test, train = perm[:360], perm[360:]
    x = x.reshape(-1, 8, 8) / 16.0
    base, yb = x[train], y[train]
    idx = np.arange(n_train) % len(train)
    xs = base[idx].copy()
    aug = np.arange(n_train) >= len(train)
    m = int(aug.sum())
    if m:
        pad = np.pad(base[idx[aug]], ((0, 0), (1, 1), (1, 1)))
        dy, dx = rng.integers(0, 3, m), rng.integers(0, 3, m)
        rows_ = dy[:, None] + np.arange(8)[None, :]  # (m, 8)
        cols = dx[:, None] + np.arange(8)[None, :]
        shifted = pad[np.arange(m)[:, None, None], rows_[:, :, None], cols[:, None, :]]
        scale = rng.uniform(0.8, 1.2, (m, 1, 1))
        xs[aug] = shifted * scale + 0.05 * rng.standard_normal((m, 8, 8))
    mu, sd = base.mean(), base.std()

    def t(a: Any) -> Any:
        return torch.as_tensor(((a - mu) / sd)[:, None], dtype=torch.float32)

    onehot = np.eye(10, dtype=np.float32)[yb[idx]]
    return t(xs), torch.as_tensor(onehot), t(x[test]), torch.as_tensor(y[test])


def digits_cnn() -> Any:
    """The scale case's small CNN (PyTorch default initialisation, seed 0)."""
    import torch

    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.Tanh(),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 10)).eval()


def scale_job(job: str, n: int, dim: int, budget: str, reg: float) -> dict[str, Any]:
    """One scale run in this process: ``job`` "features" (features + FeatureRidge) or
    "exact" (ntk + kernel_regression) on the first ``n`` augmented digits; wall times, the
    resident high-water mark and the test accuracy."""
    import torch

    import ntkcore
    from benchmarks._harness import _proc_status, _reset_hwm, current_rss

    x, y, x_test, labels = digits_data(n)
    model = digits_cnn()
    rss0 = current_rss()
    hwm_reset = _reset_hwm()
    t0 = time.perf_counter()
    if job == "features":
        phi = ntkcore.features(model, x, dim=dim, seed=0, max_memory=budget)
        phi_test = ntkcore.features(model, x_test, dim=dim, seed=0, max_memory=budget)
        t1 = time.perf_counter()
        lam = reg * float(torch.linalg.vector_norm(phi)) ** 2 / n  # tr(Phi Phi^T) / N
        pred = ntkcore.FeatureRidge(alpha=lam).fit(phi, y).predict(phi_test)
    elif job == "exact":
        k = ntkcore.ntk(model, x, mode="trace", max_memory=budget)
        k_test = ntkcore.ntk(model, x_test, x, mode="trace", max_memory=budget)
        t1 = time.perf_counter()
        lam = reg * float(torch.sum(torch.diagonal(k))) / n
        pred = ntkcore.kernel_regression(k, y, k_test, reg=lam)
    else:
        raise ValueError(f"unknown scale job {job!r}")
    t2 = time.perf_counter()
    acc = float((pred.argmax(1) == labels).to(torch.float64).mean())
    hwm = _proc_status("VmHWM") if hwm_reset else None
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"job": job, "N": n, "dim": dim, "seconds_kernel": t1 - t0,
            "seconds_solve": t2 - t1, "seconds": t2 - t0, "accuracy": acc, "reg": lam,
            "peak_rss_bytes": int(hwm if hwm is not None else maxrss),
            "rss_start_bytes": int(rss0), "ru_maxrss_bytes": int(maxrss),
            "threads": torch.get_num_threads()}


def _scale_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """:func:`scale_job` in a fresh Python process (its own resident high-water mark)."""
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", ""))
                                        if p)
    proc = subprocess.run([sys.executable, "-m", HERE, "--scale-child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(ROOT))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"scale job {spec} failed (rc={proc.returncode}): "
                       f"{proc.stderr.strip()[-2000:]}")


def _scale_rows(cfg: Config, name: str) -> list[dict[str, Any]]:
    n, dim = _opt(cfg, "scale_n"), _opt(cfg, "scale_dim")
    n_exact, budget, reg = _opt(cfg, "scale_exact_n"), _opt(cfg, "scale_budget"), \
        _opt(cfg, "scale_reg")
    jobs = [("features", n, "ntkcore.features + FeatureRidge")]
    if n_exact > 0:
        jobs.append(("exact", min(n_exact, n), "ntkcore.ntk + kernel_regression (exact)"))
    rows = []
    for job, nj, impl in jobs:
        res = _scale_child({"job": job, "n": nj, "dim": dim, "budget": budget, "reg": reg},
                           timeout=6 * 3600)
        t = res["seconds"]
        what = (f"trace features dim={dim} within max_memory={budget} (train and test), then "
                f"the primal ridge solve" if job == "features" else
                f"exact trace eNTK of the first {nj} training inputs (max_memory={budget}) "
                "and kernel_regression")
        rows.append(row(
            SUITE, name, impl, backend="torch", device=cfg.device, dtype="float32",
            timing={"median_s": t, "min_s": t, "max_s": t, "repeats": 1,
                    "timed_calls": "first"},
            params={"kind": "scale", "N": nj, "dim": dim if job == "features" else None,
                    "max_memory": budget, "accuracy": res["accuracy"], "reg": res["reg"],
                    "seconds_kernel": res["seconds_kernel"],
                    "seconds_solve": res["seconds_solve"],
                    "rss_start_bytes": res["rss_start_bytes"], "threads": res["threads"],
                    "test_n": 360},
            peak_mem_bytes=res["peak_rss_bytes"],
            mem_method="process resident high-water mark (VmHWM, fresh process)",
            note=f"{what}; test accuracy on the 360 held-out digits; one run"))
    return rows


# -- run ----------------------------------------------------------------------------------------
def cases(cfg: Config) -> dict[str, tuple[str, Any]]:
    """Case name -> (kind of case, model)."""
    models = cfg.pick(QUICK_MODELS, ERROR_MODELS)
    n, dim_tp = _opt(cfg, "features_n"), _opt(cfg, "features_tp_dim")
    out: dict[str, tuple[str, Any]] = {}
    for label, kind in models.items():
        out[f"error {label} N={n}"] = ("error", (label, kind))
    for label, kind in models.items():
        sizes = _tp_sizes(cfg, kind)
        for n_tp in sizes:
            out[f"throughput {label} N={n_tp} dim={dim_tp}"] = (
                "throughput", (label, kind, n_tp, n_tp == sizes[0]))
    if not cfg.quick:
        out[f"scale CNN digits N={_opt(cfg, 'scale_n')} dim={_opt(cfg, 'scale_dim')}"] = (
            "scale", None)
    return out


def run(cfg: Config) -> list[dict[str, Any]]:
    if not cfg.has("torch"):
        return []
    rows: list[dict[str, Any]] = []
    for name, (what, spec) in cfg.select(cases(cfg)).items():
        if what == "error":
            rows += _error_rows(cfg, name, *spec)
        elif what == "throughput":
            rows += _throughput_rows(cfg, name, *spec)
        else:
            rows += _scale_rows(cfg, name)
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--scale-child":
        spec = json.loads(sys.argv[2])
        print(json.dumps(scale_job(spec["job"], int(spec["n"]), int(spec["dim"]),
                                   spec["budget"], float(spec["reg"]))), flush=True)
    else:
        sys.exit(f"usage: python -m {HERE} --scale-child SPEC_JSON")
