#!/usr/bin/env bash
# The venv of neural-tangents 0.6.5 (jax 0.4.25, numpy < 2: not the project's own env).
# Usage: bash benchmarks/peers/make_venv.sh [VENV_DIR]  (default: .venv-nt, git-ignored)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-nt}"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet -r "$here/requirements-nt.txt" -c "$here/requirements-nt.lock"
"$venv/bin/python" - <<'PY'
import jax, jaxlib, numpy, neural_tangents
print("neural-tangents", neural_tangents.__version__, "jax", jax.__version__,
      "jaxlib", jaxlib.__version__, "numpy", numpy.__version__)
PY
