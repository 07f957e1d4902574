#!/usr/bin/env bash
# GPU tests and GPU benchmarks on a machine with one NVIDIA GPU and no network.
#
#   bash benchmarks/gpu.sh OUTDIR           # run from the repository root; < 8 minutes
#   bash benchmarks/gpu.sh --fetch-wheels   # on a machine WITH network: fill ./.whl first
#
# Steps (each logged to OUTDIR; a failing step is recorded and the next one still runs):
#   1. install the wheels carried in ./.whl (pure-Python packages the GPU machine lacks, e.g.
#      array-api-compat), offline; make ntkcore importable (editable install, or a copy of
#      the source tree on PYTHONPATH when setuptools is missing);
#   2. pytest -m gpu (torch-cuda and CuPy backends) with TF32 switched off
#      (NVIDIA_TF32_OVERRIDE=0, CUPY_TF32=0), so float32 accuracy checks see true float32;
#   3. the GPU benchmark selection, `python -m benchmarks --device cuda`, with the libraries'
#      default TF32 settings, which the result JSON records (machine.tf32);
#   4. render OUTDIR/docs/benchmarks.md from that JSON.
# Output: OUTDIR/{summary.txt, nvidia-smi.txt, pip-freeze.txt, install.log, pytest-gpu.log,
# pytest-gpu.xml, bench-cuda.json, bench-cuda.log, docs/}.  Copy bench-cuda.json into
# benchmarks/results/<gpu>-cuda-<date>.json and run `python -m benchmarks.render`.
#
# Time budget (seconds, overridable by environment): PYTEST_BUDGET=150 for the tests,
# BENCH_BUDGET=300 for the benchmarks (each suite at most SUITE_TIMEOUT=60), so the whole
# script stays under 8 minutes including start-up.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
WHEELS=(array-api-compat array-api-strict hypothesis attrs sortedcontainers tqdm
        threadpoolctl)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    "$PY" -m pip download --no-deps --only-binary=:all: --dest .whl "${WHEELS[@]}"
    ls -l .whl
    exit $?
fi
if [[ $# -lt 1 ]]; then
    echo "usage: bash benchmarks/gpu.sh OUTDIR | --fetch-wheels" >&2
    exit 2
fi

OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
PYTEST_BUDGET="${PYTEST_BUDGET:-150}"
BENCH_BUDGET="${BENCH_BUDGET:-300}"
SUITE_TIMEOUT="${SUITE_TIMEOUT:-60}"
GPU_SUITES="${GPU_SUITES:-gram,ntk,providers,regression,smw,sketch,seng}"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "[gpu.sh +$(( $(date +%s) - START ))s] $*" | tee -a "$SUMMARY"; }

# -- 0. facts ------------------------------------------------------------------------------
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || say "nvidia-smi failed (no driver?)"
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"

# -- 1. install ---------------------------------------------------------------------------
{
    if compgen -G ".whl/*.whl" > /dev/null; then
        echo "installing carried wheels:"; ls .whl/*.whl
        "$PY" -m pip install --no-index --no-deps --find-links .whl .whl/*.whl
    else
        echo "no ./.whl directory: using what is installed"
    fi
    if ! "$PY" -c "import ntkcore.backends" 2>/dev/null; then
        "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . \
            || echo "editable install failed"
    fi
} > "$OUT/install.log" 2>&1
if ! "$PY" -c "import ntkcore.backends" 2>>"$OUT/install.log"; then
    # last resort: a copy of the source laid out as the installed package
    SITE="$(mktemp -d)"
    cp -r ntkcore "$SITE/ntkcore" && cp -r backends "$SITE/ntkcore/backends"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    say "ntkcore made importable from a copy in $SITE"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m pip freeze > "$OUT/pip-freeze.txt" 2>/dev/null
"$PY" - <<'PY' 2>&1 | tee -a "$SUMMARY"
import importlib
for name in ("ntkcore", "numpy", "scipy", "torch", "cupy", "jax", "array_api_compat",
             "hypothesis", "pytest", "tqdm", "threadpoolctl", "psutil", "matplotlib"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name:18s} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"  {name:18s} MISSING ({type(exc).__name__})")
try:
    import torch
    print("  torch.cuda:", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception:
    pass
PY

# -- 2. GPU tests, TF32 off ---------------------------------------------------------------
say "pytest -m gpu (TF32 off, budget ${PYTEST_BUDGET}s)"
NVIDIA_TF32_OVERRIDE=0 CUPY_TF32=0 HYPOTHESIS_PROFILE=dev timeout "$PYTEST_BUDGET" \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml" tests \
    > "$OUT/pytest-gpu.log" 2>&1
rc=$?
say "pytest -m gpu exit $rc ($( tail -n 1 "$OUT/pytest-gpu.log" ))"

# -- 3. GPU benchmarks, library-default TF32 (recorded) -----------------------------------
known="$("$PY" -m benchmarks --list 2>/dev/null | awk '{print $1}' | paste -sd, -)"
selected=""
for s in ${GPU_SUITES//,/ }; do
    [[ ",$known," == *",$s,"* ]] && selected="${selected:+$selected,}$s"
done
backends="torch"
"$PY" -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" 2>/dev/null \
    && backends="torch,cupy"
remaining=$(( 470 - ($(date +%s) - START) ))
budget=$(( remaining < BENCH_BUDGET ? remaining : BENCH_BUDGET ))
say "benchmarks --device cuda --backend $backends --suite $selected (budget ${budget}s)"
if [[ -n "$selected" && $budget -gt 30 ]]; then
    timeout "$budget" "$PY" -m benchmarks --device cuda --backend "$backends" \
        --suite "$selected" --repeat 5 --budget 5 --suite-timeout "$SUITE_TIMEOUT" \
        --total-budget $(( budget - 45 )) \
        --blas-env clean --out "$OUT/bench-cuda.json" > "$OUT/bench-cuda.log" 2>&1
    rc=$?
    say "benchmarks exit $rc ($(grep -c ': ok,' "$OUT/bench-cuda.log") suites ok)"
    grep '^\[benchmarks\]' "$OUT/bench-cuda.log" | tee -a "$SUMMARY"
else
    say "benchmarks skipped (no suite or no time left)"
fi

# -- 4. render ----------------------------------------------------------------------------
if [[ -f "$OUT/bench-cuda.json" ]]; then
    "$PY" -m benchmarks.render "$OUT/bench-cuda.json" --docs "$OUT/docs" >> "$SUMMARY" 2>&1 \
        || say "render failed"
fi
say "done in $(( $(date +%s) - START )) s"
