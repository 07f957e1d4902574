"""The README's promises: the two set-up commands come first, and the API tour's output is real."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _tour() -> tuple[str, str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## A tour of the API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    out = re.search(r"```text\n(.*?)```", section, re.S)
    assert code and out, "the tour needs a ```python block followed by a ```text block"
    assert code.start() < out.start()
    return code.group(1), out.group(1)


def _same_line(got: str, want: str) -> bool:
    """Equal words; numbers equal to 1e-6 relative, or both below 1e-8 (rounding-level)."""
    if NUMBER.sub("#", got) != NUMBER.sub("#", want):
        return False
    for a, b in zip(NUMBER.findall(got), NUMBER.findall(want), strict=True):
        x, y = float(a), float(b)
        if abs(x) < 1e-8 and abs(y) < 1e-8:
            continue
        if not math.isclose(x, y, rel_tol=1e-6, abs_tol=0.0):
            return False
    return True


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


def test_same_line_can_fail():
    assert _same_line("accuracy 0.97", "accuracy 0.9700000001")
    assert _same_line("err 3e-12", "err 4e-13")
    assert not _same_line("accuracy 0.97", "accuracy 0.96")
    assert not _same_line("ndarray 1e-12", "Tensor 1e-12")
    assert not _same_line("err 3e-12", "err 3e-3")


@pytest.mark.slow
def test_tour_output_is_real():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    code, want = _tour()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    got_lines, want_lines = r.stdout.strip().splitlines(), want.strip().splitlines()
    assert len(got_lines) == len(want_lines), r.stdout
    for got, exp in zip(got_lines, want_lines, strict=True):
        assert _same_line(got, exp), f"README says {exp!r}, the code prints {got!r}"
