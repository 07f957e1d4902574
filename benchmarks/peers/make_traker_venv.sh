#!/usr/bin/env bash
# The venv of traker 0.3.2 (TRAK's reference, peer of benchmarks/attribution.py; no dependency
# of ntkcore), same CPU torch, no fast_jl (BasicProjector on a CPU).
# Usage: bash benchmarks/peers/make_traker_venv.sh [VENV_DIR]  (default: .venv-traker, git-ignored)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-traker}"
python="${PYTHON:-python3}"

"$python" -m venv --system-site-packages "$venv"
"$venv/bin/pip" install --quiet "torch==2.13.0" "traker==0.3.2"
"$venv/bin/python" - <<'PY'
import torch, numpy, trak
from importlib.metadata import version
print("traker", version("traker"), "torch", torch.__version__, "numpy", numpy.__version__)
PY
