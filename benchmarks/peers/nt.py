"""Run neural-tangents' empirical NTK (implementations 1-3) in its own virtual environment.

neural-tangents 0.6.5 needs jax 0.4.23-0.4.25 and numpy < 2, which cannot share an
environment with this project (numpy 2, jax 0.10).  ``bash benchmarks/peers/make_venv.sh``
creates ``.venv-nt/`` (git-ignored); this module passes the weights and inputs through an
``.npz`` file to ``nt_runner.py`` running in that venv and reads back timings, peak memory
and the kernels (for an accuracy check on our side).

Set ``NTKCORE_NT_VENV`` to use a venv elsewhere.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RUNNER = HERE / "nt_runner.py"
IMPL_NAMES = {1: "jacobian contraction", 2: "NTK-vector products", 3: "structured derivatives"}


def venv_python() -> Path:
    venv = Path(os.environ.get("NTKCORE_NT_VENV", ROOT / ".venv-nt"))
    return venv / "bin" / "python"


@functools.lru_cache(maxsize=1)
def status() -> tuple[bool, str]:
    """(usable, versions or the reason it is not)."""
    py = venv_python()
    if not py.exists():
        return False, (f"no neural-tangents venv at {py.parent.parent} "
                       "(create it with `bash benchmarks/peers/make_venv.sh`)")
    code = ("import sys, types; sys.modules['neural_tangents.experimental'] = "
            "types.ModuleType('x'); import neural_tangents, jax, numpy; "
            "print(f'neural-tangents {neural_tangents.__version__}, jax {jax.__version__}, "
            "numpy {numpy.__version__}')")
    try:
        out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=180,
                             env=_env())
    except subprocess.TimeoutExpired:
        return False, "importing neural-tangents timed out"
    if out.returncode != 0:
        tail = " ".join(out.stderr.strip().splitlines()[-2:])
        return False, f"neural-tangents does not import in {py}: {tail}"
    return True, out.stdout.strip()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run(
    weights: list[np.ndarray],
    biases: list[np.ndarray],
    x: np.ndarray,
    *,
    scales: list[float],
    beta: float,
    activation: str = "tanh",
    impls: tuple[int, ...] = (1, 2, 3),
    mode: str = "trace",
    dtype: str = "float32",
    repeat: int = 5,
    warmup: int = 1,
    budget_s: float | None = 20.0,
    memory: bool = True,
    separate: bool = True,
    timeout: float = 600.0,
    kernel_rows: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, np.ndarray], dict[str, Any]]:
    """Time ``nt.empirical_ntk_fn`` on the MLP ``weights``/``biases`` (ntkcore layout).

    ``separate``: one process per implementation (fair peak-memory figures).
    ``kernel_rows``: return only the kernel's leading ``[:r, :r]`` block (the rest of a large
    full-mode kernel is not written to disk).  Returns
    (per-implementation results, kernels by ``"impl<k>"``, versions).  A result carries
    ``error`` instead of timings when that implementation failed (e.g. out of memory).
    """
    ok, why = status()
    if not ok:
        raise RuntimeError(why)
    results: list[dict[str, Any]] = []
    kernels: dict[str, np.ndarray] = {}
    versions: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ntkcore-nt-") as tmp:
        arrays = {f"W{i}": w for i, w in enumerate(weights)}
        arrays.update({f"b{i}": b for i, b in enumerate(biases)})
        np.savez(Path(tmp) / "in.npz", x=x, **arrays)
        groups = [(i,) for i in impls] if separate else [tuple(impls)]
        for group in groups:
            tag = "-".join(map(str, group))
            spec = {
                "input": str(Path(tmp) / "in.npz"), "n_layers": len(weights),
                "activation": activation, "scales": list(scales), "beta": beta,
                "impls": list(group), "mode": mode, "dtype": dtype, "repeat": repeat,
                "warmup": warmup, "budget_s": budget_s, "memory": memory,
                "out": str(Path(tmp) / f"out{tag}.json"),
                "kernel_out": str(Path(tmp) / f"k{tag}.npz"),
                "kernel_rows": kernel_rows,
            }
            spec_path = Path(tmp) / f"spec{tag}.json"
            spec_path.write_text(json.dumps(spec))
            try:
                proc = subprocess.run([str(venv_python()), str(RUNNER), str(spec_path)],
                                      capture_output=True, text=True, timeout=timeout,
                                      env=_env(), cwd=tmp)
            except subprocess.TimeoutExpired:
                results += [{"impl": i, "error": f"timed out after {timeout:.0f} s"}
                            for i in group]
                continue
            if proc.returncode != 0 or not Path(spec["out"]).exists():
                tail = " ".join(proc.stderr.strip().splitlines()[-3:])
                reason = f"runner exited with {proc.returncode}"
                if proc.returncode in (-9, 137):
                    reason += " (killed: out of memory?)"
                results += [{"impl": i, "error": f"{reason}: {tail}"[:1500]} for i in group]
                continue
            doc = json.loads(Path(spec["out"]).read_text())
            results += doc["results"]
            versions = doc["versions"]
            if Path(spec["kernel_out"]).exists():
                with np.load(spec["kernel_out"]) as z:
                    kernels.update({k: z[k] for k in z.files})
    return results, kernels, versions


class Interleaved:
    """A neural-tangents kernel function kept compiled in the peer venv, timed on request.

    ``with Interleaved(weights, biases, x, ...) as peer: peer.time(k)`` runs ``k`` timed calls
    of implementation ``impl`` and returns their durations in seconds.  Alternating
    ``peer.time`` with timed calls of ntkcore puts both libraries in the same stretches of
    machine time, so that slow phases of a shared machine do not favour either side.
    ``compile_s`` is the first call's duration (tracing, compilation and one run).
    """

    def __init__(self, weights: list[np.ndarray], biases: list[np.ndarray], x: np.ndarray, *,
                 scales: list[float], beta: float, activation: str = "tanh", impl: int = 3,
                 mode: str = "trace", dtype: str = "float32", timeout: float = 600.0) -> None:
        ok, why = status()
        if not ok:
            raise RuntimeError(why)
        self._tmp = tempfile.TemporaryDirectory(prefix="ntkcore-nt-")
        tmp = Path(self._tmp.name)
        arrays = {f"W{i}": w for i, w in enumerate(weights)}
        arrays.update({f"b{i}": b for i, b in enumerate(biases)})
        np.savez(tmp / "in.npz", x=x, **arrays)
        spec = {"input": str(tmp / "in.npz"), "n_layers": len(weights), "activation": activation,
                "scales": list(scales), "beta": beta, "impls": [impl], "mode": mode,
                "dtype": dtype, "serve": True}
        (tmp / "spec.json").write_text(json.dumps(spec))
        self.timeout = timeout
        self._proc = subprocess.Popen([str(venv_python()), str(RUNNER), str(tmp / "spec.json")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp)
        self.compile_s = float(self._reply()["compile_s"])

    def _reply(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            err = self._proc.stderr.read() if self._proc.stderr is not None else ""
            tail = " ".join(err.strip().splitlines()[-3:])
            raise RuntimeError(f"neural-tangents runner stopped: {tail}"[:1500])
        return json.loads(line)

    def time(self, k: int) -> list[float]:
        """Durations (seconds) of ``k`` timed calls."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"time {int(k)}\n")
        self._proc.stdin.flush()
        return [float(t) for t in self._reply()["times"]]

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write("quit\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=30)
            except Exception:
                self._proc.kill()
        self._tmp.cleanup()

    def __enter__(self) -> Interleaved:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
