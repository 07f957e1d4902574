"""Facts about the machine a benchmark ran on: CPU, threads, library versions, BLAS, GPU, TF32.

Everything is best effort: a fact that cannot be read is recorded as ``None`` rather than
failing the run.  ``collect()`` must be called *after* the array libraries the run uses have
been imported, so that threadpoolctl sees the BLAS/OpenMP libraries they loaded.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "XLA_FLAGS",
    "NVIDIA_TF32_OVERRIDE",
    "CUPY_TF32",
    "CUDA_VISIBLE_DEVICES",
)
#: glibc malloc settings: large thresholds keep freed buffers in the process instead of
#: returning them to the OS, so that the next call does not page-fault them in again
#: (docs/performance.md, "Page faults").  Recorded, never set, by the runner.
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
              "LD_PRELOAD")
PACKAGES = (
    "ntkcore",
    "numpy",
    "scipy",
    "torch",
    "jax",
    "jaxlib",
    "cupy",
    "array_api_compat",
    "array_api_strict",
    "threadpoolctl",
    "matplotlib",
)


def cpu_model() -> str | None:
    """The CPU's marketing name from /proc/cpuinfo (Linux) or platform."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name.replace("_", "-"))
    except Exception:
        mod = sys.modules.get(name)
        return getattr(mod, "__version__", None) if mod else None


def _git() -> dict[str, Any]:
    def run(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            )
            return out.stdout.strip() if out.returncode == 0 else None
        except Exception:
            return None

    status = run("status", "--porcelain", "--untracked-files=no")
    dirty = bool(status) if status is not None else None
    return {"commit": run("rev-parse", "HEAD"), "dirty": dirty}


def blas_info() -> list[dict[str, Any]]:
    """threadpoolctl's view of the BLAS / OpenMP libraries loaded in this process."""
    try:
        from threadpoolctl import threadpool_info

        keep = ("user_api", "internal_api", "prefix", "version", "num_threads",
                "threading_layer", "architecture")
        return [{k: d.get(k) for k in keep} for d in threadpool_info()]
    except Exception as exc:  # threadpoolctl missing or failing
        return [{"error": repr(exc)}]


def blas_kernel() -> str | None:
    """Short text naming the BLAS kernels in use, e.g. ``openblas 0.3.31 Haswell x2``."""
    parts = []
    for d in blas_info():
        if d.get("user_api") == "blas":
            parts.append(
                f"{d.get('internal_api')} {d.get('version')} {d.get('architecture')} "
                f"x{d.get('num_threads')}"
            )
    return "; ".join(parts) or None


def _torch_facts(device: str) -> dict[str, Any] | None:
    if "torch" not in sys.modules:
        return None
    import torch

    out: dict[str, Any] = {
        "version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "mkl": bool(torch.backends.mkl.is_available()),
        "openmp": bool(torch.backends.openmp.is_available()),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        cfg = torch.__config__.show()
        m = re.search(r"BLAS_INFO=(\w+)", cfg)
        out["blas"] = m.group(1) if m else None
    except Exception:
        out["blas"] = None
    if torch.cuda.is_available():
        i = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(i)
        out["cuda"] = {
            "device_name": torch.cuda.get_device_name(i),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
            "total_memory_bytes": int(props.total_memory),
            "multiprocessors": int(props.multi_processor_count),
            "cuda_runtime": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        }
    return out


def _cupy_facts() -> dict[str, Any] | None:
    if "cupy" not in sys.modules:
        return None
    try:
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props.get("name", b"")
        return {
            "version": cupy.__version__,
            "device_name": name.decode() if isinstance(name, bytes) else str(name),
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "driver": cupy.cuda.runtime.driverGetVersion(),
            # CuPy uses TF32 for float32 GEMM only when CUPY_TF32=1
            "tf32": os.environ.get("CUPY_TF32", "0") == "1",
        }
    except Exception as exc:
        return {"error": repr(exc)}


def _jax_facts() -> dict[str, Any] | None:
    if "jax" not in sys.modules:
        return None
    try:
        import jax

        return {
            "version": jax.__version__,
            "devices": [str(d) for d in jax.devices()],
            "default_matmul_precision": str(jax.config.jax_default_matmul_precision),
            "x64": bool(jax.config.jax_enable_x64),
        }
    except Exception as exc:
        return {"error": repr(exc)}


def nvidia_smi() -> dict[str, Any] | None:
    """GPU name, driver and memory from ``nvidia-smi`` (None without one)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
             "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
    except Exception:
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    name, driver, mem, clock = (s.strip() for s in out.stdout.splitlines()[0].split(","))
    return {"name": name, "driver": driver, "memory": mem, "max_sm_clock": clock}


def tf32_state() -> dict[str, Any]:
    """Whether float32 GEMMs may use TF32 on the GPU, by library."""
    out: dict[str, Any] = {"NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE")}
    if "torch" in sys.modules:
        import torch

        out["torch_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
        out["torch_cudnn"] = bool(torch.backends.cudnn.allow_tf32)
    out["cupy"] = os.environ.get("CUPY_TF32", "0") == "1"
    if "jax" in sys.modules:
        import jax

        out["jax_default_matmul_precision"] = str(jax.config.jax_default_matmul_precision)
    if out["NVIDIA_TF32_OVERRIDE"] == "0":
        out["effective"] = False
    else:
        out["effective"] = bool(out.get("torch_matmul") or out["cupy"])
    return out


def collect(device: str = "cpu") -> dict[str, Any]:
    """All machine facts as a JSON-serialisable dict."""
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
        mem_total = int(psutil.virtual_memory().total)
    except Exception:
        physical, mem_total = None, None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    orig = os.environ.get("NTKCORE_BENCH_ORIG_ENV")
    facts: dict[str, Any] = {
        "hostname": platform.node(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": cpu_model(),
        "cpu_physical_cores": physical,
        "cpu_logical": os.cpu_count(),
        "cpu_affinity": affinity,
        "memory_bytes": mem_total,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": {p: _version(p) for p in PACKAGES if importlib.util.find_spec(p) is not None},
        "blas": blas_info(),
        "blas_kernel": blas_kernel(),
        "env": {k: os.environ.get(k) for k in (*BLAS_ENV, *THREAD_ENV, *MALLOC_ENV)},
        "env_before_reexec": json.loads(orig) if orig else None,
        "torch": _torch_facts(device),
        "jax": _jax_facts(),
        "cupy": _cupy_facts(),
        "gpu": nvidia_smi() if device == "cuda" else None,
        "tf32": tf32_state() if device == "cuda" else None,
        "git": _git(),
    }
    return facts


def slug(facts: dict[str, Any], device: str = "cpu") -> str:
    """A short file-name-safe machine name, e.g. ``amd-epyc-2c`` or ``nvidia-h200``."""
    if device == "cuda":
        gpu = (facts.get("gpu") or {}).get("name") or (
            ((facts.get("torch") or {}).get("cuda") or {}).get("device_name")
        ) or (facts.get("cupy") or {}).get("device_name") or "gpu"
        base = str(gpu)
    else:
        cores = facts.get("cpu_affinity") or facts.get("cpu_logical")
        base = f"{facts.get('cpu_model') or 'cpu'}-{cores}c"
    base = re.sub(r"\((r|tm|R|TM)\)|cpu|processor|[0-9]+-core", "", base, flags=re.I)
    s = re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-")
    return re.sub(r"-+", "-", s) or device
