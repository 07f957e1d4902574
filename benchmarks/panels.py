"""Diagonal tiles of a symmetric Gram ``ntkcore.gram(J, mode=...)``: row panels (the default,
(p+1)/(2p) of the GEMM work) against one product per tile (``SYMMETRIC_MAX_PANELS = 1``); they
inform ``ntkcore.gram.SYMMETRIC_PANEL_ROWS`` / ``SYMMETRIC_MAX_PANELS``."""

import sys
from itertools import pairwise
from typing import Any

import numpy as np

import ntkcore
from benchmarks.common import CPU_BACKENDS, asarray, in_turns, relerr, require
from ntkcore.models import MLP

GRAM = sys.modules["ntkcore.gram"]  # the module (ntkcore.gram is also the function)
N_REF = 32
# case -> (widths, N, activation, mode)
CASES = {"MLP 8x1000 tanh N=512 trace": ((256, *[1000] * 8, 1), 512, "tanh", "trace"),
         "MLP 784-512-512-10 relu N=512 full": ((784, 512, 512, 10), 512, "relu", "full")}


def reference_ntk(ws: list[np.ndarray], bs: list[np.ndarray], x: np.ndarray, act: str,
                  mode: str, scales: list[float]) -> np.ndarray:
    r"""eNTK of an MLP in float64 from the per-layer formula (independent of ntkcore).

    Forward :math:`y_l = c_l W_l z_{l-1} + b_l`, :math:`z_l = \phi(y_l)`; backward
    :math:`g_L = I_O`, :math:`g_{l-1} = (g_l c_l W_l) \odot \phi'(y_{l-1})`; layer l adds
    :math:`\langle g_l[n,o], g_l[m,p]\rangle \langle a_n, a_m\rangle`,
    :math:`a = [c_l z_{l-1}, 1]`, to :math:`\Theta[n, m, o, p]`.  Returns (N, N) summed over
    o = p (``trace``) or (N, N, O, O) (``full``).
    """
    zs, dphi = [x], []
    for l, (w, b) in enumerate(zip(ws, bs, strict=True)):
        y = scales[l] * zs[-1] @ w.T + b
        if l < len(ws) - 1:
            zs.append(np.tanh(y) if act == "tanh" else np.maximum(y, 0.0))
            dphi.append(1.0 - zs[-1] ** 2 if act == "tanh" else (y > 0).astype(y.dtype))
    n, o = x.shape[0], ws[-1].shape[0]
    g = np.broadcast_to(np.eye(o), (n, o, o)).copy()  # d f_o / d y_L
    k = np.zeros((n, n, o, o) if mode == "full" else (n, n))
    for l in reversed(range(len(ws))):
        a = np.concatenate([scales[l] * zs[l], np.ones((n, 1))], axis=1)
        if mode == "full":
            k += np.einsum("nok,mpk->nmop", g, g) * (a @ a.T)[:, :, None, None]
        else:
            k += np.einsum("nok,mok->nm", g, g) * (a @ a.T)
        if l > 0:
            g = (g @ (scales[l] * ws[l])) * dphi[l - 1][:, None, :]
    return k


class SymmetricGram:
    """Row panels against one product per diagonal tile, ``ntkcore.models.MLP`` (NTK
    parameterisation, weights and inputs standard normal, seed 0); ``track_error``: leading
    32 x 32 samples against :func:`reference_ntk`; ``track_flops_share``: the plan's flops over
    those of computing every tile (what the symmetry saves)."""
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
        GRAM.SYMMETRIC_MAX_PANELS = self.default

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
