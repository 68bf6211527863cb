"""What the suite's runtime type checks cost: every analysis once on tiny-llama (the fixture of
tests/analysis/test_results.py), unchecked, under jaxtyping's own import hook and under
tests/typechecks.py's, each in a fresh process (an import hook acts when a module is imported, so
the three ways cannot share one), median of `--repeats`, with the ratios to unchecked.

    python scripts/typecheck_cost.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE = """
import os, sys, time
sys.path.insert(0, {root!r})
way = {way!r}
if way != "unchecked":
    if way == "jaxtyping":
        os.environ["KVNOTES_TYPECHECK"] = "jaxtyping"
    from tests import typechecks
    typechecks.install()
from kvnotes.analysis.registry import MODEL, Context, analyses, sections
from kvnotes.analysis.runner import collect
from tests.analysis.test_results import NAMES, SMALL
from tests.helpers import get_model

model = get_model("tiny-llama")
start = time.perf_counter()
for name, a in analyses().items():
    if name not in NAMES:
        continue
    cfg = a.make_config(**{{**SMALL, "tokens": 256 if name == "edit_cost" else SMALL["tokens"]}})
    if sections()[a.section].level == MODEL:
        a.run(Context(model=model, progress=False), cfg)
    else:
        collect(model, "order-cancel", [name], configs={{name: cfg}}, min_effect=0.0, progress=False)
print(time.perf_counter() - start)
"""
WAYS = ("unchecked", "jaxtyping", "kvnotes")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="runs of each way (median); default 1")
    args = ap.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the suite's workers run torch
    env.pop("KVNOTES_TYPECHECK", None)
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:  # interleaved, so that a change in the machine's load falls on every way
            code = ONE.format(root=str(ROOT), way=way)
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=False
            )
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            times[way].append(float(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(times["unchecked"])
    print(
        f"every analysis once on tiny-llama, {platform.machine()}, {os.cpu_count()} cores, one thread, "
        f"median of {args.repeats}"
    )
    for way in WAYS:
        med = statistics.median(times[way])
        print(f"  {way:10s} {med:7.1f} s  {med / base:5.2f}x unchecked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
