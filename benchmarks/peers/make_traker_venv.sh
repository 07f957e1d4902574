#!/usr/bin/env bash
# Create the private virtual environment in which traker (TRAK's reference implementation) runs.
#
# traker 0.3.2 is the peer of ntkcore.attribution in the `attribution` benchmark suite.  It is
# never a dependency of ntkcore: it lives in its own venv next to the same CPU torch as the
# project (fast_jl, its CUDA projector, is not installed; on a CPU traker uses BasicProjector).
# Usage: bash benchmarks/peers/make_traker_venv.sh [VENV_DIR]
# (default: .venv-traker in the repository root, which is git-ignored).
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
