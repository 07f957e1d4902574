#!/usr/bin/env bash
# Create the private virtual environment in which neural-tangents (the peer library) runs.
#
# neural-tangents 0.6.5 works with jax 0.4.23-0.4.25 and numpy < 2, which cannot live in the
# project's own environment (jax 0.10, numpy 2.x); the benchmark talks to it only through a
# subprocess and .npz files.  Usage: bash benchmarks/peers/make_venv.sh [VENV_DIR]
# (default: .venv-nt in the repository root, which is git-ignored).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-nt}"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
# requirements-nt.txt names what we need; requirements-nt.lock pins the versions that worked
"$venv/bin/pip" install --quiet -r "$here/requirements-nt.txt" -c "$here/requirements-nt.lock"
"$venv/bin/python" - <<'PY'
import jax, jaxlib, numpy, neural_tangents
print("neural-tangents", neural_tangents.__version__, "jax", jax.__version__,
      "jaxlib", jaxlib.__version__, "numpy", numpy.__version__)
PY
