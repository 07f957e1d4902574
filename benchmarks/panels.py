"""Diagonal tiles of a symmetric Gram ``ntkcore.gram(J, mode=...)``: row panels (the default,
(p+1)/(2p) of the GEMM work) against one product per tile (``SYMMETRIC_MAX_PANELS = 1``); they
inform ``ntkcore.gram.SYMMETRIC_PANEL_ROWS`` / ``SYMMETRIC_MAX_PANELS``."""

import sys
from itertools import pairwise
from typing import Any

import numpy as np

import ntkcore
from benchmarks import peer
from benchmarks.common import CPU_BACKENDS, asarray, in_turns, relerr, require
from ntkcore.models import MLP

GRAM = sys.modules["ntkcore.gram"]  # the module (ntkcore.gram is also the function)
N_REF = 32
# case -> (widths, N, activation, mode)
CASES = {"MLP 8x1000 tanh N=512 trace": ((256, *[1000] * 8, 1), 512, "tanh", "trace"),
         "MLP 784-512-512-10 relu N=512 full": ((784, 512, 512, 10), 512, "relu", "full")}


def reference_ntk(ws: list[np.ndarray], bs: list[np.ndarray], x: np.ndarray, act: str,
                  mode: str, scales: list[float]) -> np.ndarray:
    """float64 eNTK of the MLP (:func:`benchmarks.peer.reference_ntk`, biases unscaled)."""
    return peer.reference_ntk({"weights": ws, "biases": bs, "x": x, "scales": scales,
                               "beta": 1.0, "activation": act, "mode": mode})


class SymmetricGram:
    """Row panels against one product per diagonal tile, ``ntkcore.models.MLP`` (NTK).

    Error: leading 32 x 32 against :func:`reference_ntk`; flops share: plan flops over all tiles."""
    params, param_names = ([*CPU_BACKENDS, "torch-cuda", "cupy"], list(CASES)), ("backend", "case")
    timeout, number, repeat, warmup_time, rounds = 300, 1, 2, 0, 1

    def setup(self, backend: str, case: str) -> None:
        require(backend)
        widths, n, act, self.mode = CASES[case]
        rng = np.random.default_rng(0)
        self.ws = [rng.standard_normal((o, i)) for i, o in pairwise(widths)]
        self.bs = [rng.standard_normal(o) for o in widths[1:]]
        self.x, self.act = rng.standard_normal((n, widths[0])), act
        net = MLP([asarray(w, backend) for w in self.ws], [asarray(b, backend) for b in self.bs],
                  activation=act, parameterization="ntk", weight_std=1.0, bias_std=1.0)
        jac = net.jacobian(asarray(self.x, backend))
        self.default, self.plan = GRAM.SYMMETRIC_MAX_PANELS, GRAM.plan_gram(jac, mode=self.mode)
        self.gram = lambda: ntkcore.gram(jac, mode=self.mode)

    def teardown(self, *_: Any) -> None:
        GRAM.SYMMETRIC_MAX_PANELS = getattr(self, "default", GRAM.SYMMETRIC_MAX_PANELS)

    def gram_with(self, panels: int) -> Any:
        GRAM.SYMMETRIC_MAX_PANELS = panels
        return self.gram()

    def time_one_product(self, *_: Any) -> None:
        self.gram_with(1)

    def time_row_panels(self, *_: Any) -> None:
        self.gram_with(self.default)

    def track_speedup(self, *_: Any) -> float:
        """One product's time over the row panels', timed in turns."""
        t = in_turns({"one": lambda: self.gram_with(1),
                      "panels": lambda: self.gram_with(self.default)}, rounds=2)
        return t["one"] / t["panels"]

    def track_error(self, *_: Any) -> float:
        ref = reference_ntk(self.ws, self.bs, self.x[:N_REF], self.act, self.mode,
                            [1.0 / np.sqrt(w.shape[1]) for w in self.ws])
        return max(relerr(self.gram_with(p)[:N_REF, :N_REF], ref) for p in (1, self.default))

    def track_flops_share(self, *_: Any) -> float:
        return self.plan.flops / self.plan.flops_all_tiles

    track_speedup.unit, track_error.unit = "x", "relative"  # type: ignore[attr-defined]
    track_flops_share.unit = "share"  # type: ignore[attr-defined]
