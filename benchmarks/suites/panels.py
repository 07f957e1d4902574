r"""Suite ``panels``: diagonal tiles of a symmetric Gram as row panels, or one product each.

The symmetric trace / full eNTK ``ntkcore.gram(J, mode=...)`` of a real MLP Jacobian
(``ntkcore.models.MLP`` in the NTK parameterisation, weights and inputs standard normal, seed
0, as in the ``peers`` suite), computed two ways on the same Jacobian:

- ``one product per tile`` (the baseline): ``SYMMETRIC_MAX_PANELS = 1``, each diagonal tile
  as one GEMM per factor (NumPy dispatches ``x @ x.T`` to SYRK);
- ``row panels``: the default, up to ``SYMMETRIC_MAX_PANELS`` row panels of at least
  ``SYMMETRIC_PANEL_ROWS`` samples, each against the columns to its right, the rest mirrored:
  (p+1)/(2p) of the GEMM work.

=============================================  ===================  =====  =====  ======
case                                           widths               N      mode   rounds
=============================================  ===================  =====  =====  ======
``MLP 8x1000 tanh N=512 trace``                256-8x1000-1         512    trace  10
``MLP 784-512-512-10 relu N=1024 full``        784-512-512-10       1024   full   3
=============================================  ===================  =====  =====  ======

The two variants are timed in alternating rounds in one process (the first round is the
warm-up), so that slow and fast phases of a shared machine hit both.  ``error``: relative max
Frobenius error of the leading 32 x 32 samples against the float64 NumPy per-layer formula
of the ``peers`` suite (``reference_ntk``).  ``flops``: the
plan's count for the whole kernel, so "GEMM %" shows what the symmetry saves.  NumPy and
PyTorch backends; about 1 min on 2 cores.  These rows inform
``ntkcore.gram.SYMMETRIC_PANEL_ROWS`` / ``SYMMETRIC_MAX_PANELS``.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np

from benchmarks._harness import Config, asarray, row, to_numpy

SUITE = "panels"

CASES = {  # name -> (widths, N, activation, mode, rounds)
    "MLP 8x1000 tanh N=512 trace": ((256, *[1000] * 8, 1), 512, "tanh", "trace", 10),
    "MLP 784-512-512-10 relu N=1024 full": ((784, 512, 512, 10), 1024, "relu", "full", 3),
}
QUICK_CASES = {"MLP 8-600-600-1 N=256 trace": ((8, 600, 600, 1), 256, "tanh", "trace", 1)}


def run(cfg: Config) -> list[dict[str, Any]]:
    import statistics
    import sys
    import time

    import ntkcore
    import ntkcore.gram  # the module (ntkcore.gram is also the name of the function)
    from benchmarks.peers.suite import reference_ntk
    from ntkcore.models import MLP

    gram_module = sys.modules["ntkcore.gram"]
    rows = []
    cases = cfg.select(cfg.pick(QUICK_CASES, CASES))
    for name, (widths, n, act, mode, rounds) in cases.items():
        rng = np.random.default_rng(0)
        ws = [rng.standard_normal((o, i)) for i, o in pairwise(widths)]
        bs = [rng.standard_normal(o) for o in widths[1:]]
        x = rng.standard_normal((n, widths[0]))
        ref = reference_ntk({"weights": ws, "biases": bs, "x": x[:32], "beta": 1.0,
                             "scales": [1.0 / np.sqrt(i) for i in widths[:-1]],
                             "activation": act, "mode": mode})
        for backend in cfg.backends:
            if backend not in ("numpy", "torch"):
                continue
            net = MLP([asarray(w, backend, cfg.device, cfg.dtype) for w in ws],
                      [asarray(b, backend, cfg.device, cfg.dtype) for b in bs],
                      activation=act, parameterization="ntk", weight_std=1.0, bias_std=1.0)
            jac = net.jacobian(asarray(x, backend, cfg.device, cfg.dtype))
            default = gram_module.SYMMETRIC_MAX_PANELS
            variants = {"one product per tile": 1, "row panels": default}
            times: dict[str, list[float]] = {v: [] for v in variants}
            kernels = {}
            try:
                for _ in range(rounds + 1):  # the first round is the warm-up
                    for impl, p in variants.items():
                        gram_module.SYMMETRIC_MAX_PANELS = p
                        t0 = time.perf_counter()
                        k = ntkcore.gram(jac, mode=mode)
                        times[impl].append(time.perf_counter() - t0)
                        kernels.setdefault(impl, to_numpy(k)[:32, :32].astype(np.float64))
                        del k
            finally:
                gram_module.SYMMETRIC_MAX_PANELS = default
            for impl, ts in times.items():
                ts = ts[1:]
                gram_module.SYMMETRIC_MAX_PANELS = variants[impl]
                plan = gram_module.plan_gram(jac, mode=mode)
                gram_module.SYMMETRIC_MAX_PANELS = default
                err = float(np.linalg.norm(kernels[impl] - ref) / np.linalg.norm(ref))
                rows.append(row(
                    SUITE, name, impl, backend=backend, device=cfg.device, dtype=cfg.dtype,
                    timing={"median_s": statistics.median(ts), "min_s": min(ts),
                            "max_s": max(ts), "repeats": len(ts)},
                    params={"N": n, "widths": list(widths), "mode": mode,
                            "panels": plan.panels},
                    flops=plan.flops_all_tiles,
                    baseline=None if impl == "one product per tile" else
                    "one product per tile", error=err,
                    note=f"{plan.panels} panel(s) per diagonal tile, plan flops "
                         f"{plan.flops / 1e9:.2f} G; alternating rounds"))
    return rows


