"""scripts/kernel_sweep.py: the settings a CPU offers, its refusals, and one real run of one
low-precision test under another kernel setting, read back from its JUnit XML."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("kernel_sweep", ROOT / "scripts" / "kernel_sweep.py")
assert _spec is not None and _spec.loader is not None
sweep = importlib.util.module_from_spec(_spec)
sys.modules["kernel_sweep"] = sweep  # dataclasses look their module up by name
_spec.loader.exec_module(sweep)


def test_a_setting_is_offered_only_where_the_cpu_has_its_instructions():
    avx2_only = [s.name for s in sweep.offered({"avx2", "fma"})]
    assert avx2_only == ["default", "aten-avx2", "onednn-avx2", "cpu-avx2"]
    everything = {f for s in sweep.SETTINGS for f in s.needs}
    assert [s.name for s in sweep.offered(everything)] == [s.name for s in sweep.SETTINGS]
    assert [s.name for s in sweep.offered(set())] == ["default"]  # no /proc/cpuinfo: torch's own only


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--settings", "aten-avx9"], "unknown setting"),
        (["--threads", "0"], "--threads takes positive integers"),
        (["--load", "busy"], "--load takes idle and/or hog"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        ([], "--out DIR is required"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_before_any_run(argv, says, tmp_path, capsys):
    out = [] if argv == [] else ["--out", str(tmp_path / "out")]
    assert sweep.main(argv + out) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_the_junit_figures_are_read_back(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="t" name="test_bfloat16_verify_x">'
        '<properties><property name="x gap prefill_kv" value="2.5"/>'
        '<property name="fault rope" value="9.1"/></properties></testcase>'
        '<testcase classname="t" name="test_b"><failure message="no"/></testcase>'
        '<testcase classname="t" name="test_c"><skipped/></testcase></testsuite></testsuites>'
    )
    passed, failed, failures, figures = sweep.read_junit(xml)
    assert (passed, failed, failures) == (1, 1, ["t::test_b"])
    # the figures are parsed from the XML's text: exact up to float parsing, so a relative 1e-12
    expected = {"test_bfloat16_verify_x: x gap prefill_kv": 2.5, "test_bfloat16_verify_x: fault rope": 9.1}
    assert figures == pytest.approx(expected, rel=1e-12)
    assert sweep.read_junit(tmp_path / "missing.xml")[2] == ["no JUnit XML was written (pytest did not run)"]


def test_one_low_precision_test_runs_under_another_kernel_setting(tmp_path):
    """A real run: one quick low-precision test under `aten-avx2` (the probe shows ATen at AVX2),
    its JUnit XML read back, the summary written; a -k that selects nothing fails the run. Both
    runs collect the test's own file, not the whole tree (about 15 s a run)."""
    if "aten-avx2" not in [s.name for s in sweep.offered(sweep.cpu_flags())]:
        pytest.skip("this CPU has no AVX2")
    out, path = tmp_path / "sweep", "tests/test_verify_dtypes.py"
    one = ["--settings", "aten-avx2", "--threads", "1", "-k", "the_floor_is_as_many_ulps", path]
    code = sweep.main(["--out", str(out), *one])
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and summary["probes"]["aten-avx2"]["aten"] == "AVX2"
    (run,) = summary["runs"]
    assert (run["setting"], run["threads"], run["passed"], run["failed"]) == ("aten-avx2", 1, 1, 0)
    nothing = ["--settings", "default", "--threads", "1", "-k", "no_such_test", path]
    assert sweep.main(["--out", str(out), *nothing]) == 1
