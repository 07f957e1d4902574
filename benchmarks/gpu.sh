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
#   3. the asv benchmarks matching GPU_BENCH on the CUDA backends only
#      (NTKCORE_BENCH_BACKENDS=torch-cuda,cupy), with the libraries' default TF32 settings;
#      results saved under the machine name gpu-<model> when the tree is a git checkout;
#   4. render OUTDIR/docs/benchmarks.md from them.
# Output: OUTDIR/{summary.txt, nvidia-smi.txt, pip-freeze.txt, install.log, pytest-gpu.log,
# pytest-gpu.xml, asv-cuda.log, asv-results/, docs/}.  Copy asv-results/gpu-*/ into
# benchmarks/results/asv/ and run `python -m benchmarks.render --machine gpu-<model>`.
#
# Budgets (seconds, overridable by environment): PYTEST_BUDGET=150, BENCH_BUDGET=300: the
# whole script stays under 8 minutes including start-up.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
WHEELS=(array-api-compat array-api-strict hypothesis attrs sortedcontainers tqdm
        threadpoolctl asv asv-runner json5 tabulate pympler pyyaml packaging)

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
GPU_BENCH="${GPU_BENCH:-^(gram|ntk|providers|regression|smw|sketch|seng|real_models)}"
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
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda:', torch.cuda.is_available())" \
    2>&1 | tee -a "$SUMMARY"

# -- 2. GPU tests, TF32 off ---------------------------------------------------------------
say "pytest -m gpu (TF32 off, budget ${PYTEST_BUDGET}s)"
NVIDIA_TF32_OVERRIDE=0 CUPY_TF32=0 HYPOTHESIS_PROFILE=dev timeout "$PYTEST_BUDGET" \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest-gpu.xml" tests \
    > "$OUT/pytest-gpu.log" 2>&1
rc=$?
say "pytest -m gpu exit $rc ($( tail -n 1 "$OUT/pytest-gpu.log" ))"

# -- 3. GPU benchmarks (asv, CUDA backends only), library-default TF32 ---------------------
remaining=$(( 470 - ($(date +%s) - START) ))
budget=$(( remaining < BENCH_BUDGET ? remaining : BENCH_BUDGET ))
gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' '-')"
commit="$(git rev-parse HEAD 2>/dev/null)"
save=(); [[ -n "$commit" ]] && save=(--set-commit-hash="$commit")
say "asv run -b '$GPU_BENCH' on torch-cuda,cupy (budget ${budget}s; saved: ${commit:-no, not a git checkout})"
if [[ $budget -gt 30 ]]; then
    "$PY" -m asv machine --yes --machine "gpu-${gpu_name:-unknown}" > /dev/null 2>&1
    NTKCORE_BENCH_BACKENDS=torch-cuda,cupy timeout "$budget" "$PY" -m asv run --python=same \
        "${save[@]}" --machine "gpu-${gpu_name:-unknown}" -b "$GPU_BENCH" \
        > "$OUT/asv-cuda.log" 2>&1
    say "asv exit $? ($(grep -c ' ok$' "$OUT/asv-cuda.log") benchmarks ok, $(grep -c 'failed$' "$OUT/asv-cuda.log") failed)"
    cp -r benchmarks/results/asv "$OUT/asv-results" 2>/dev/null
else
    say "benchmarks skipped (no time left)"
fi

# -- 4. render ----------------------------------------------------------------------------
if [[ -n "$commit" ]]; then
    mkdir -p "$OUT/docs"
    "$PY" -m benchmarks.render --machine "gpu-${gpu_name:-unknown}" --out "$OUT/docs/benchmarks.md" \
        >> "$SUMMARY" 2>&1 || say "render failed"
fi
say "done in $(( $(date +%s) - START )) s"
