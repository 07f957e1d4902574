"""The README's promises: the two set-up commands come first, and the API tour prints, on any
machine, exactly the lines the README shows.

The tour prints no digit that depends on the platform: its checks print ``True``/``False``
against a bound and the accuracy is rounded.  It is run twice, once as it is and once as on
another machine: ATen's portable CPU kernels, MKL limited to SSE4.2, OpenBLAS's Sandybridge
kernels, one thread, and torch's matrix products rounded one ulp off below the diagonal
(``tests/perturbed_products.py``).  The second run also reports the quantities the README's
bounds rest on, and the test checks that each printed bound holds with them
(``tests/tolerances.py``): a bound that only one machine's rounding kept would fail here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.tolerances import kernel_tol, solve_tol, unit_roundoff

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

#: what the tour's printed checks compare with, as the README's code writes it
BOUND_TEXT = "1e-9"
REGRESSION_BOUND = RESIDUAL_BOUND = float(BOUND_TEXT)

#: appended to the tour in the second run: the facts behind its printed lines
FACTS = """
import json, os
_a = K + 1e-3 * torch.eye(len(K), dtype=K.dtype)
_w = torch.linalg.eigvalsh(_a)
_top2 = pred.topk(2, dim=1).values
_full = ntkcore.gram(Jb, mode="full")                              # (128, 128, 10, 10)
_jj = _full.permute(0, 2, 1, 3).reshape(1280, 1280)               # Jb Jb^T, rows (n, o)
_s2 = torch.linalg.eigvalsh(_jj)[-1].item()                        # sigma_max(Jb)^2
with open(os.environ["TOUR_FACTS"], "w") as _f:
    json.dump({
        "cond": (_w[-1] / _w[0]).item(),
        "margin": (_top2[:, 0] - _top2[:, 1]).tolist(),
        "pred_norm": pred.norm().item(),
        "correct": int((pred.argmax(1) == y[1000:]).sum()), "n_test": len(y) - 1000,
        "num_params": J.num_params, "fan_in": 64 + 256,
        "smw_cond": (0.1 + _s2) / 0.1,
        "diff": diff.item(), "res": res.item(),
    }, _f)
"""

#: environment of the "another machine" run
OTHER_MACHINE = {
    "ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "OPENBLAS_CORETYPE": "Sandybridge", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}


def _tour() -> tuple[str, str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## A tour of the API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    out = re.search(r"```text\n(.*?)```", section, re.S)
    assert code and out, "the tour needs a ```python block followed by a ```text block"
    assert code.start() < out.start()
    return code.group(1), out.group(1)


def _run(code: str, env: dict[str, str] | None = None) -> list[str]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.splitlines()


def test_setup_commands_come_first():
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    assert blocks[0] == ("bash", 'pip install torch==2.13.0 -e ".[bench]" && python -m ntkcore '
                                 "demo\n")
    test_command = "python -m pytest -q -n auto --dist loadfile"
    assert blocks[1][0] == "bash" and blocks[1][1].strip().endswith(test_command)
    # CI runs the README's command, not a variant of it
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command in ci.splitlines()


def test_tour_prints_no_platform_digits():
    """Every print of the tour is an integer, a name, a shape, a bool or a rounded value: a
    printed float64 result would show the BLAS's last digits."""
    code, want = _tour()
    for line in want.strip().splitlines():
        for number in re.findall(r"\d+\.\d+", line):
            assert len(number.split(".")[1]) <= 2, f"unrounded number in {line!r}"
    assert f"diff.item() < {BOUND_TEXT})" in code
    assert f"res.item() < {BOUND_TEXT})" in code


@pytest.mark.slow
def test_tour_prints_the_readme_text():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    code, want = _tour()
    assert _run(code) == want.strip().splitlines()


@pytest.mark.slow
def test_tour_prints_the_same_on_another_machine_and_its_bounds_hold(tmp_path):
    """The tour's output on "another machine" (module docstring), and the bounds behind it.

    * ``diff < 1e-9``: two backward-stable solves of one system of condition ``cond`` differ
      by at most ``2 cond eps`` (relative, in norm, to first order).
    * ``res < 1e-9``: the damped system's residual is of the order ``eps cond(0.1 I +
      Jb^T Jb)``; the bound keeps it with a factor 2 (two computations).
    * the rounded accuracy: across machines a prediction moves by at most the solve's error
      plus the kernel's rounding amplified by ``cond`` (tests/tolerances.py), in norm; a label
      can change only where the two highest predictions are closer than twice that.  No test
      digit is, so the accuracy itself is the same everywhere, and rounding to two decimals
      is a margin on top.
    """
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    code, want = _tour()
    facts_file = tmp_path / "facts.json"
    wrapped = ("from tests.perturbed_products import perturbed_products\n"
               "with perturbed_products():\n" + textwrap.indent(code + FACTS, "    "))
    got = _run(wrapped, {**OTHER_MACHINE, "TOUR_FACTS": str(facts_file)})
    assert got == want.strip().splitlines()

    f = json.loads(facts_file.read_text(encoding="utf-8"))
    eps = 2 * unit_roundoff(np.float64)
    assert solve_tol(np.float64, f["cond"], computations=2) < REGRESSION_BOUND, f["cond"]
    assert f["diff"] < solve_tol(np.float64, f["cond"], computations=2)
    assert 2 * eps * f["smw_cond"] < RESIDUAL_BOUND, f["smw_cond"]

    move = (solve_tol(np.float64, f["cond"], computations=2) + f["cond"] * kernel_tol(
        np.float64, f["num_params"] + f["fan_in"], computations=2)) * f["pred_norm"]
    close = [m for m in f["margin"] if m <= 2 * move]
    assert not close, (move, sorted(f["margin"])[:5])
    acc = round(f["correct"] / f["n_test"], 2)
    assert f"test accuracy {acc}" in want
    # two decimals absorb at least one changed label either way
    assert round((f["correct"] - 1) / f["n_test"], 2) == acc == round(
        (f["correct"] + 1) / f["n_test"], 2)
