r"""ntkcore against neural-tangents' empirical NTK (structured derivatives, ``jax.jit``) on the NTK
MLP :math:`y_l = W_l z_{l-1} / \sqrt{d_{l-1}} + b_l`, :math:`W_l, b_l \sim N(0, 1)`.  The peer
runs in ``.venv-nt/`` (``bash benchmarks/peers/make_venv.sh``), else these are skipped."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import asarray, relerr, require, wait

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "benchmarks" / "peers" / "nt_runner.py"
N_REF = 32  # full-mode errors are taken on the leading (N_REF, N_REF, O, O) block
CASES = {  # name -> (widths, N, activation, mode)
    "6x512 tanh N=384 trace": ((256, *[512] * 6, 1), 384, "tanh", "trace"),
    "8x1000 tanh N=512 trace": ((256, *[1000] * 8, 1), 512, "tanh", "trace"),
    "784-512-512-10 relu N=512 full": ((784, 512, 512, 10), 512, "relu", "full"),
}
TEST_CASES = {
    "MLP tiny tanh": ((8, 16, 16, 1), 8, "tanh", "trace"),
    "MLP tiny relu full": ((8, 16, 16, 3), 8, "relu", "full"),
}


def problem(case: str, seed: int = 0) -> dict[str, Any]:
    """Weights (d_out, d_in), biases, inputs (N, d_0) in float64 and the case's settings."""
    widths, n, activation, mode = {**CASES, **TEST_CASES}[case]
    rng = np.random.default_rng(seed)
    return {"weights": [rng.standard_normal((o, i)) for i, o in pairwise(widths)],
            "biases": [rng.standard_normal(o) for o in widths[1:]],
            "x": rng.standard_normal((n, widths[0])),
            "scales": [1.0 / math.sqrt(i) for i in widths[:-1]], "beta": 1.0,
            "widths": widths, "n": n, "activation": activation, "mode": mode}


def reference_ntk(p: dict[str, Any]) -> np.ndarray:
    r"""float64 eNTK from the per-layer formula: :math:`y_l = c_l W_l z_{l-1} + \beta b_l`,
    :math:`g_L = I_O`, :math:`g_{l-1} = (g_l c_l W_l) \odot \phi'(y_{l-1})`; layer l adds
    :math:`\langle g_l[n,o], g_l[m,p]\rangle \langle a_n, a_m\rangle`, :math:`a = [c_l z_{l-1},
    \beta]`.  (N, N) in trace mode, the leading (N_REF, N_REF, O, O) block in full mode."""
    ws, bs, x, cs, beta = p["weights"], p["biases"], p["x"], p["scales"], p["beta"]
    full, tanh = p.get("mode") == "full", p.get("activation", "tanh") == "tanh"
    zs, dphi = [x[:N_REF] if full else x], []
    for l, (w, b) in enumerate(zip(ws[:-1], bs, strict=False)):
        y = cs[l] * zs[-1] @ w.T + beta * b
        zs.append(np.tanh(y) if tanh else np.maximum(y, 0.0))
        dphi.append(1.0 - zs[-1] ** 2 if tanh else (y > 0) * 1.0)
    n, o = zs[0].shape[0], ws[-1].shape[0]
    g, k = np.broadcast_to(np.eye(o), (n, o, o)), 0.0
    for l in reversed(range(len(ws))):
        a = np.concatenate([cs[l] * zs[l], np.full((n, 1), beta)], axis=1)
        k = k + np.einsum("nok,mpk->nmop", g, g) * (a @ a.T)[:, :, None, None]
        if l > 0:
            g = (g @ (cs[l] * ws[l])) * dphi[l - 1][:, None, :]
    return k if full else np.einsum("nmoo->nm", k)


def venv_python() -> Path:
    return Path(os.environ.get("NTKCORE_NT_VENV", ROOT / ".venv-nt")) / "bin" / "python"


def need_venv() -> None:
    """Skip (``NotImplementedError``) without the peer venv."""
    if not venv_python().exists():
        raise NotImplementedError(f"no neural-tangents venv at {venv_python().parent.parent}"
                                  " (bash benchmarks/peers/make_venv.sh)")


class Peer:
    """neural-tangents' kernel of ``p`` (``impl`` 1: Jacobian contraction, 2: NTK-vector
    products, 3: structured derivatives) compiled in the venv, served over a pipe."""

    def __init__(self, p: dict[str, Any], dtype: str = "float32", impl: int = 3) -> None:
        need_venv()
        self._tmp = tempfile.TemporaryDirectory(prefix="ntkcore-nt-")
        tmp = Path(self._tmp.name)
        np.savez(tmp / "in.npz", x=p["x"], **{f"W{i}": w for i, w in enumerate(p["weights"])},
                 **{f"b{i}": b for i, b in enumerate(p["biases"])})
        spec = {"input": str(tmp / "in.npz"), "n_layers": len(p["weights"]),
                "activation": p["activation"], "scales": list(p["scales"]), "beta": p["beta"],
                "impl": impl, "mode": p["mode"], "dtype": dtype}
        (tmp / "spec.json").write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")
        self._proc = subprocess.Popen([str(venv_python()), str(RUNNER), str(tmp / "spec.json")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)
        self.compile_s = float(self._ask(None)["compile_s"])

    def _ask(self, request: str | None) -> dict[str, Any]:
        io = self._proc
        if request is not None:
            io.stdin.write(request + "\n")  # type: ignore[union-attr]
            io.stdin.flush()  # type: ignore[union-attr]
        line = io.stdout.readline()  # type: ignore[union-attr]
        if not line:
            err = io.stderr.read()  # type: ignore[union-attr]
            raise RuntimeError("neural-tangents runner stopped: " + err[-1500:])
        return json.loads(line)

    def time(self, k: int) -> list[float]:
        return [float(t) for t in self._ask(f"time {int(k)}")["times"]]

    def kernel(self, rows: int | None = None) -> np.ndarray:
        path = Path(self._tmp.name) / "kernel.npy"
        self._ask(f"kernel {rows or 0} {path}")
        return np.load(path).astype(np.float64)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._proc.communicate("quit\n", timeout=30)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            self._proc.kill()
        self._tmp.cleanup()


def crop(k: Any, p: dict[str, Any]) -> Any:
    """The part of a kernel that :func:`reference_ntk` computes."""
    return k[:N_REF, :N_REF] if p["mode"] == "full" else k


class VsNeuralTangents:
    """ntkcore (``ntkcore.models.MLP`` on each backend) against neural-tangents impl 3.

    Speed-up: the peer's median time (timed in its process, no compilation) over ntkcore's, one
    call each in turn after a 0.3 s pause (the other library's BLAS threads stop spinning)."""

    params = (["numpy", "torch", "jax"], list(CASES))
    param_names = ("backend", "case")
    timeout = 600
    number, repeat, warmup_time, rounds = 1, 3, 0, 1

    def setup(self, backend: str, case: str) -> None:
        import ntkcore
        from ntkcore.models import MLP

        need_venv()
        require(backend)
        self.p = p = problem(case)
        net = MLP([asarray(w, backend) for w in p["weights"]],
                  [asarray(b, backend) for b in p["biases"]], activation=p["activation"],
                  parameterization="ntk", weight_std=1.0, bias_std=1.0)
        x = asarray(p["x"], backend)
        self.ntkcore = lambda: ntkcore.ntk(net, x, mode=p["mode"])

    def time_ntkcore(self, *_: Any) -> None:
        wait(self.ntkcore())

    def track_speedup(self, *_: Any) -> float:
        ours, peer_times = [], []
        with Peer(self.p) as peer:
            wait(self.ntkcore())
            for _ in range(5):
                time.sleep(0.3)
                t0 = time.perf_counter()
                wait(self.ntkcore())
                ours.append(time.perf_counter() - t0)
                time.sleep(0.3)
                peer_times += peer.time(1)
        return statistics.median(peer_times) / statistics.median(ours)
    track_speedup.unit = "x"  # type: ignore[attr-defined]

    def track_error(self, *_: Any) -> float:
        """ntkcore's relative error against :func:`reference_ntk`."""
        return relerr(crop(self.ntkcore(), self.p), reference_ntk(self.p))
    track_error.unit = "relative"  # type: ignore[attr-defined]

    def track_peer_error(self, backend: str, case: str) -> float:
        """neural-tangents' relative error (numpy row only)."""
        from asv_runner.benchmarks.mark import SkipNotImplemented

        if backend != "numpy":
            raise SkipNotImplemented("the peer's error does not depend on ntkcore's backend")
        with Peer(self.p) as peer:
            k = peer.kernel(N_REF if self.p["mode"] == "full" else None)
        return relerr(k, reference_ntk(self.p))
    track_peer_error.unit = "relative"  # type: ignore[attr-defined]
