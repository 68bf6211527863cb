"""The flake hunt: run the tests a change added or touched many times, in a random order, while a CPU
hog keeps every core busy, before the change lands. A race that an idle machine hides shows here.

    python .ci/flake_hunt.py                       # the test files changed since origin/main (or HEAD~1)
    python .ci/flake_hunt.py --base 3f874fe --runs 20
    python .ci/flake_hunt.py tests/dashboards/test_browser.py::test_edge_graph_hover_and_size_slider

Which tests: every `test_*.py` under tests/ that differs from `--base` (committed, staged, unstaged or
new), and every test file that imports a changed helper module of tests/ (`tests/waiting.py`, say);
or the test ids given. Each is run `--runs` times (pytest-repeat) in one random order
(pytest-randomly, seed printed), in each of `--sessions` fresh pytest processes. Exit code: pytest's.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def default_base() -> str:
    for ref in ("origin/main", "HEAD~1"):
        if (
            subprocess.run(
                ["git", "rev-parse", "--verify", "-q", ref], cwd=ROOT, capture_output=True
            ).returncode
            == 0
        ):
            return git("merge-base", ref, "HEAD").strip() if ref.startswith("origin/") else ref
    return "HEAD"


def changed_files(base: str) -> set[Path]:
    names = (
        git("diff", "--name-only", base, "--").split()
        + git("ls-files", "--others", "--exclude-standard").split()
    )
    return {ROOT / n for n in names if (ROOT / n).is_file()}


def imported_modules(path: Path) -> set[str]:
    """The dotted names a test file imports (`tests.waiting`, `tests.dashboards.browser`, ...)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def tests_of(changed: set[Path]) -> list[str]:
    """The test files among `changed`, and the test files that import a changed helper of tests/."""
    tests_dir = ROOT / "tests"
    files = {
        p for p in changed if p.is_relative_to(tests_dir) and p.name.startswith("test_") and p.suffix == ".py"
    }
    helpers = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in changed
        if p.is_relative_to(tests_dir) and p.suffix == ".py" and not p.name.startswith("test_")
    }
    if helpers:
        files |= {p for p in tests_dir.rglob("test_*.py") if imported_modules(p) & helpers}
    return sorted(str(p.relative_to(ROOT)) for p in files)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flake_hunt", description=__doc__.split("\n\n")[0])
    p.add_argument("tests", nargs="*", help="test files or ids (default: those the change added or touched)")
    p.add_argument(
        "--base", help="the commit the change is measured from (default: origin/main, else HEAD~1)"
    )
    p.add_argument("--runs", type=int, default=10, help="times each test runs in a session (default 10)")
    p.add_argument(
        "--sessions", type=int, default=1, help="fresh pytest processes, each its own order (default 1)"
    )
    p.add_argument("--no-hog", action="store_true", help="run on the idle machine (to compare)")
    args, extra = p.parse_known_args(argv)
    if args.runs < 1 or args.sessions < 1:
        p.error("--runs and --sessions take a count of at least 1")
    base = args.base or default_base()
    tests = args.tests or tests_of(changed_files(base))
    if not tests:
        print(f"flake hunt: no test file differs from {base}; name the tests to run", file=sys.stderr)
        return 0
    print(
        f"flake hunt: {len(tests)} test file(s) or id(s), {args.runs} run(s) each, {args.sessions} session(s)"
    )
    for t in tests:
        print(f"  {t}")
    hog = None
    if not args.no_hog:
        hog = subprocess.Popen(
            [sys.executable, str(ROOT / ".ci" / "hog.py"), "--seconds", "7200", "--watch", str(os.getpid())]
        )
    codes = []
    try:
        for s in range(args.sessions):
            t0 = time.monotonic()
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--count={args.runs}",
                *extra,
                *tests,
            ]
            code = subprocess.run(cmd, cwd=ROOT).returncode
            codes.append(code)
            print(
                f"flake hunt: session {s + 1}/{args.sessions} exited {code} in {time.monotonic() - t0:.0f} s"
            )
    finally:
        if hog is not None:
            hog.terminate()
            hog.wait(10)
    failed = sum(c != 0 for c in codes)
    load = "idle" if args.no_hog else "under a CPU hog"
    print(
        f"flake hunt: {len(codes) - failed} of {len(codes)} session(s) passed, "
        f"{args.runs} run(s) each, {load}"
    )
    return max(codes, key=lambda c: c != 0)


if __name__ == "__main__":
    sys.exit(main())
