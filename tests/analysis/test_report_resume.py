"""A report that is killed, or whose part fails, keeps what it finished, and resumes from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvnotes.cli import main
from tests.waiting import until

ARGS = ["report", "--model", "tiny-llama", "--task", "order-cancel", "--quick", "--n", "2"]
ARGS += ["--skip", "memory_blocks,memory_placement,agent_loop,ttft,edit_cost,regime,sae"]

# The real `kvnotes report`, with its circuits part held until the test kills the process: the
# probes part (the first) has finished and been saved by then.
HOLD = """
import pathlib, signal, sys, time
# Ctrl-C reaches a run in the foreground; a process started in the background by a shell without job
# control (as CI may start the suite) inherits SIGINT ignored, and Python then leaves it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
import kvnotes.analysis.report as report
run_part = report._task_part
def held(model, task, section, *args, **kwargs):
    if section.name == "circuits":
        pathlib.Path(sys.argv[1]).touch()
        time.sleep(600)
    return run_part(model, task, section, *args, **kwargs)
report._task_part = held
from kvnotes.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 300) -> None:
    """Until the report holds its second part (HOLD touches `path` there); fails at once if it ended."""
    try:
        until(
            path.exists,
            timeout=seconds,
            what="the report reaching its second part",
            stop=lambda: proc.poll() is not None and f"it ended early:\n{proc.communicate()[1][-3000:]}",
        )
    except AssertionError:
        proc.kill()
        raise


@pytest.mark.timing  # a subprocess signalled mid-run
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_killed_report_keeps_its_first_part_and_resumes_from_it(sig, tmp_path, capsys):
    out, held = tmp_path / "report", tmp_path / "held"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(held), *ARGS, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    _wait_for(held, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert "interrupted; 1 finished part(s) are kept" in err.strip().splitlines()[-1]
    parts = out / "parts"
    assert [p.name for p in parts.glob("*.json")] == ["order-cancel__probes.json"]
    assert not list(parts.glob(".*.tmp"))
    first = json.loads((parts / "order-cancel__probes.json").read_text())

    assert main([*ARGS, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "reused 1 of 4 parts from an earlier run: order-cancel/probes" in said
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["reused"] == ["order-cancel/probes"]
    assert report["parts"]["order-cancel/probes"]["result"] == first["result"]
    assert set(report["parts"]) == {f"order-cancel/{s}" for s in ("probes", "circuits", "edit", "compose")}


def test_a_failing_part_keeps_the_parts_before_it(tmp_path, monkeypatch, capsys):
    import kvnotes.analysis.report as report

    run_part = report._task_part

    def broken(model, task, section, *args, **kwargs):
        if section.name == "edit":
            raise RuntimeError("a planted bug in the edit part")
        return run_part(model, task, section, *args, **kwargs)

    out = tmp_path / "report"
    monkeypatch.setattr(report, "_task_part", broken)
    with pytest.raises(RuntimeError, match="planted bug") as failed:
        main([*ARGS, "--out", str(out)])
    assert "the 2 part(s) finished before it are kept" in " ".join(failed.value.__notes__)
    kept = sorted(p.name for p in (out / "parts").glob("*.json"))
    assert kept == ["order-cancel__circuits.json", "order-cancel__probes.json"]
    monkeypatch.setattr(report, "_task_part", run_part)
    assert main([*ARGS, "--out", str(out)]) == 0
    assert "reused 2 of 4 parts" in capsys.readouterr().out


def test_a_part_from_another_model_is_not_reused(tmp_path, capsys):
    out = tmp_path / "report"
    assert main([*ARGS, "--out", str(out)]) == 0
    probes = out / "parts" / "order-cancel__probes.json"
    d = json.loads(probes.read_text())
    probes.write_text(json.dumps({**d, "fingerprint": "another model's weights"}))
    capsys.readouterr()
    assert main([*ARGS, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "reused 3 of 4 parts" in said and "order-cancel/probes" not in said.split("run:")[1].split("\n")[0]
