"""The kernel sweep: the tests that compare bfloat16 or float16 figures (`pytest -m low_precision`,
the bfloat16 Gemma 3 270M verify and its planted faults among them) under every CPU kernel setting
this machine offers, at each thread count, idle and under a CPU hog.

    python scripts/kernel_sweep.py --out DIR [--settings default,aten-avx2,...] [--threads 1,2]
                                   [--load idle,hog] [--repeats N] [-k EXPR] [--list] [PATH ...]

A CPU's kernels round differently (the order and width of a matmul's accumulation), so a
low-precision check that passes on one machine may fail on the next; this runs the same checks
under the kernels another machine would pick. The settings, each kept only where the CPU has the
instructions (read from /proc/cpuinfo):

  default                          torch's own choice for this CPU
  aten-avx2, aten-avx512           ATEN_CPU_CAPABILITY: ATen's vectorised kernels (softmax, norms, ...)
  onednn-avx2, onednn-avx512-core, ONEDNN_MAX_CPU_ISA: the instruction set oneDNN's matmuls may use
  onednn-avx512-core-vnni, onednn-avx512-core-bf16, onednn-avx512-core-amx
  cpu-avx2                         both at AVX2: the kernels an AVX2-only CPU runs (CI runs this one)

Each run is a fresh `python -m pytest -n 0 -m low_precision PATH ...` (the variables only take
effect when torch loads; PATH defaults to `tests`, and naming a file saves collecting the whole
tree, about 15 s a run) with OMP_NUM_THREADS set, under `.ci/hog.py` when the load is `hog`; its
JUnit XML is kept in DIR/<setting>-t<threads>-<load>-r<i>/junit.xml and the figures the tests
record (the bfloat16 verify's largest error in units of the bfloat16 gap, each planted fault's
error over its tolerance) are read from there. Before the runs, a probe under each setting records the ATen
capability torch reports and the instruction set oneDNN says it dispatched a bfloat16 matmul to, so
a setting that took no effect shows. DIR/summary.json holds everything; a table goes to stdout.
The exit code is 0 when every run passed, 1 when one failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Setting:
    name: str
    env: dict[str, str]
    needs: tuple[str, ...]  # /proc/cpuinfo flags the setting needs


SETTINGS = (
    Setting("default", {}, ()),
    Setting("aten-avx2", {"ATEN_CPU_CAPABILITY": "avx2"}, ("avx2",)),
    Setting(
        "aten-avx512", {"ATEN_CPU_CAPABILITY": "avx512"}, ("avx512f", "avx512bw", "avx512vl", "avx512dq")
    ),
    Setting("onednn-avx2", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, ("avx2",)),
    Setting(
        "onednn-avx512-core",
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
        ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    ),
    Setting("onednn-avx512-core-vnni", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, ("avx512_vnni",)),
    Setting("onednn-avx512-core-bf16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, ("avx512_bf16",)),
    Setting("onednn-avx512-core-amx", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, ("amx_bf16", "amx_tile")),
    # both at once: the kernels an AVX2-only CPU (most laptops and many cloud machines) runs
    Setting("cpu-avx2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, ("avx2",)),
)

# what each probe prints: the ATen capability, then oneDNN's verbose lines for one bfloat16 matmul
_PROBE = (
    "import torch\n"
    "print('aten:', torch.backends.cpu.get_cpu_capability())\n"
    "a = torch.randn(64, 64).bfloat16()\n"
    "torch.nn.functional.linear(a, a)\n"
)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty elsewhere: only `default` is offered)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def offered(flags: set[str]) -> list[Setting]:
    return [s for s in SETTINGS if all(f in flags for f in s.needs)]


@dataclass
class Run:
    setting: str
    threads: int
    load: str
    repeat: int
    exit_code: int
    wall_s: float
    passed: int
    failed: int
    failures: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)  # property name -> value, as the tests record


def probe(setting: Setting) -> dict[str, str]:
    """What torch reports under `setting`: its ATen capability and oneDNN's dispatched ISA."""
    env = {**os.environ, **setting.env, "ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    aten = re.search(r"^aten: (\S+)", out.stdout, re.M)
    isa = re.search(r"onednn_verbose,[^\n]*?,isa:([^\n]+)", out.stdout)
    # no line: oneDNN took no bfloat16 matmul at this instruction set (AVX2 has no bfloat16 in it), ATen did
    none = "none (the bfloat16 matmul ran on ATen's own kernel)"
    return {"aten": aten.group(1) if aten else "?", "onednn_isa": isa.group(1).strip() if isa else none}


def read_junit(path: Path) -> tuple[int, int, list[str], dict[str, float]]:
    """(passed, failed, the failed tests' ids, the recorded figures) from a JUnit XML file."""
    if not path.is_file():
        return 0, 0, ["no JUnit XML was written (pytest did not run)"], {}
    passed, failed, failures, figures = 0, 0, [], {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            failures.append(name)
        elif case.find("skipped") is None:
            passed += 1
        for prop in case.iter("property"):
            try:
                figures[f"{case.get('name')}: {prop.get('name')}"] = float(prop.get("value", "nan"))
            except ValueError:
                pass
    return passed, failed, failures, figures


def run_one(
    setting: Setting,
    threads: int,
    load: str,
    repeat: int,
    out: Path,
    keyword: str | None,
    paths: tuple[str, ...] = ("tests",),
) -> Run:
    where = out / f"{setting.name}-t{threads}-{load}-r{repeat}"
    where.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **setting.env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider"]
    cmd += ["-m", "low_precision", f"--junitxml={where / 'junit.xml'}", *paths]
    cmd += ["-k", keyword] if keyword else []
    hog = None
    if load == "hog":
        hog = subprocess.Popen([sys.executable, str(ROOT / ".ci" / "hog.py"), "--seconds", "3600"])
    start = time.monotonic()
    try:
        with open(where / "pytest.log", "w") as log:
            code = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False
            ).returncode
    finally:
        if hog is not None:
            hog.terminate()
            hog.wait()
    wall = time.monotonic() - start
    passed, failed, failures, figures = read_junit(where / "junit.xml")
    return Run(setting.name, threads, load, repeat, code, round(wall, 1), passed, failed, failures, figures)


def _row(run: Run) -> str:
    verdict = "pass" if run.exit_code == 0 else "FAIL"
    gap = {k.split(": ", 1)[1]: v for k, v in run.figures.items() if "bfloat16_verify" in k}
    worst = max(((v, k) for k, v in gap.items() if k.startswith("x gap ")), default=None)
    faults = [f"{k.removeprefix('fault ')} {v:.3g}" for k, v in gap.items() if k.startswith("fault ")]
    shown = f"{worst[0]:.2f}x ({worst[1].removeprefix('x gap ')})" if worst else "-"
    return (
        f"{run.setting:26}{run.threads:>3}  {run.load:5}{run.repeat:>3}  {verdict:5}{run.passed:>4}/"
        f"{run.passed + run.failed:<4}{run.wall_s:>8.0f}s  {shown:48} {'; '.join(faults)}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--out", required=False, help="folder for the JUnit XML, logs and summary.json")
    ap.add_argument("--settings", default="all", help="comma-separated setting names (default: all offered)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--load", default="idle", help="idle, hog or idle,hog (default idle)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each combination (default 1)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression to run fewer of the tests")
    ap.add_argument("--list", action="store_true", help="list the settings this CPU offers and exit")
    ap.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default: tests)")
    args = ap.parse_args(argv)
    available = offered(cpu_flags())
    if args.list:
        for s in available:
            print(f"{s.name:26} {' '.join(f'{k}={v}' for k, v in s.env.items()) or '(torch default)'}")
        return 0
    names = [s.name for s in available] if args.settings == "all" else args.settings.split(",")
    by_name = {s.name: s for s in SETTINGS}
    unknown = [n for n in names if n not in by_name]
    missing = [n for n in names if n in by_name and by_name[n] not in available]
    loads = args.load.split(",")
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        threads = []
    problem = (
        f"unknown setting(s) {unknown}; the settings are {[s.name for s in SETTINGS]}"
        if unknown
        else f"this CPU lacks the instructions for {missing}; it offers {[s.name for s in available]}"
        if missing
        else f"--load takes idle and/or hog, got {args.load!r}"
        if not loads or any(x not in ("idle", "hog") for x in loads)
        else f"--threads takes positive integers, got {args.threads!r}"
        if not threads or min(threads) < 1
        else "--repeats must be at least 1"
        if args.repeats < 1
        else "--out DIR is required (where the results go)"
        if not args.out
        else None
    )
    if problem:
        print(f"kernel_sweep: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [by_name[n] for n in names]
    probes = {s.name: probe(s) for s in chosen}
    for name, p in probes.items():
        print(f"{name:26} ATen {p['aten']:8} oneDNN {p['onednn_isa']}", flush=True)
    runs: list[Run] = []
    head = f"{'setting':26}{'thr':>3}  {'load':5}{'rep':>3}  result tests     wall"
    print(f"{head}  worst x gap (bf16 Gemma verify)  planted faults: error / tolerance")
    for s in chosen:
        for t in threads:
            for load in loads:
                for r in range(1, args.repeats + 1):
                    runs.append(run_one(s, t, load, r, out, args.keyword, tuple(args.paths)))
                    print(_row(runs[-1]), flush=True)
                    summary = {
                        "machine": {"cpu": platform.processor() or platform.machine(), "python": sys.version},
                        "probes": probes,
                        "settings": {s.name: s.env for s in chosen},
                        "runs": [asdict(x) for x in runs],
                    }
                    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    bad = [x for x in runs if x.exit_code != 0]
    print(f"{len(runs) - len(bad)} of {len(runs)} runs passed; {out / 'summary.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
