"""scripts/device-check.sh: bad arguments are refused in one line before anything runs; every step
is recorded in summary.json with its exit code and wall time, a failing step fails the check
without stopping the rest. The steps themselves stand in as `true` / `false` here (a second);
the real CPU dry run (`--device cpu --dry-run`) runs in CI (.ci/run), on tiny-llama."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device-check.sh"
STEPS = ["verify-float32", "verify-bfloat16", "patch-sweep", "prefill", "memory", "report"]


def check(*args: str, kvnotes: str = "true", python: str = "true") -> subprocess.CompletedProcess:
    env = {**os.environ, "KVNOTES": kvnotes, "PYTHON": python}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "--out DIR is required"),
        (("--out",), "--out needs a value"),
        (("--out", "x", "--device", "tpu"), "--device must be cpu, cuda, cuda:N or mps, got 'tpu'"),
        (("--out", "x", "--fast"), "unknown argument '--fast'"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(tmp_path, args, says):
    done = check(*[str(tmp_path / a) if a == "x" else a for a in args])
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and says in done.stderr and "usage:" in done.stderr
    assert not (tmp_path / "x").exists()  # nothing written


def test_every_step_is_recorded_in_the_summary(tmp_path):
    done = check("--out", str(tmp_path / "out"), "--device", "cpu", "--dry-run")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["passed"] is True and summary["dry_run"] is True and summary["device"] == "cpu"
    assert [s["step"] for s in summary["steps"]] == STEPS
    assert all(s["exit_code"] == 0 and s["wall_s"] >= 0 and s["timeout_s"] > 0 for s in summary["steps"])
    verify = summary["steps"][1]["command"]
    assert (
        verify[:1] == ["true"] and "--dtype" in verify and verify[verify.index("--dtype") + 1] == "bfloat16"
    )
    assert {"torch", "device_name", "nvidia_smi", "machine"} <= set(summary)


def test_a_failing_step_fails_the_check_and_the_rest_still_run(tmp_path):
    done = check("--out", str(tmp_path), "--dry-run", "--device", "cpu", kvnotes="false")
    assert done.returncode == 1
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [s["exit_code"] for s in steps] == [1, 1, 1, 1, 0, 1]  # the memory bench runs as PYTHON
    assert "verify-float32 failed (exit 1" in done.stderr


def test_the_script_parses_and_is_shellcheck_clean():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout


def test_ci_runs_the_cpu_dry_run():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/device-check.sh --device cpu --dry-run" in ci
