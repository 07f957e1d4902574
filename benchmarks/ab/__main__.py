"""``python -m benchmarks.ab``: time two source trees side by side on the cases of
``cases.py`` (public API only), for "no slowdown" checks of a refactor on one machine.

Each round runs every case once per tree, one fresh process per (case, tree), alternating which
tree goes first; the medians over all timed calls of all rounds are compared.  Writes a JSON
file with every timing and prints a markdown table.  Example::

    git archive 5cac18a | tar -x -C /tmp/before && ln -s ../backends /tmp/before/ntkcore/backends
    python -m benchmarks.ab --before /tmp/before --after . --rounds 3 seng=20 gram_conv_np=5

A tree is any checkout with ``ntkcore/backends`` importable from its root (a source checkout
needs that symlink; ``pip install -e`` alone maps it for the installed tree only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CASES_FILE = Path(__file__).with_name("cases.py")


def time_case(tree: str, case: str, reps: int) -> list[float]:
    """``reps`` timings of ``case`` in a fresh process whose working directory is ``tree``."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, str(CASES_FILE), case, str(reps)], cwd=tree,
                         capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"{case} in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="source tree timed as 'before'")
    ap.add_argument("--after", required=True, help="source tree timed as 'after'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="ab.json")
    ap.add_argument("cases", nargs="+", help="NAME=REPS (timed calls per process)")
    args = ap.parse_args(argv)
    cases = {c.split("=")[0]: int(c.split("=")[1]) if "=" in c else 3 for c in args.cases}
    trees = {"before": args.before, "after": args.after}
    res: dict[str, dict[str, list[float]]] = {c: {k: [] for k in trees} for c in cases}
    for rnd in range(args.rounds):
        order = list(trees.items()) if rnd % 2 == 0 else list(trees.items())[::-1]
        for case, reps in cases.items():
            for name, tree in order:
                res[case][name] += time_case(tree, case, reps)
    Path(args.out).write_text(json.dumps({"trees": trees, "rounds": args.rounds,
                                          "timings_s": res}, indent=1))
    print("| case | before median ms | after median ms | after/before |\n|---|---|---|---|")
    for case, t in res.items():
        b, a = statistics.median(t["before"]), statistics.median(t["after"])
        print(f"| {case} | {b * 1e3:.2f} | {a * 1e3:.2f} | {a / b:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
