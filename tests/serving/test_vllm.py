"""`kvnotes bench serve` against a real vLLM server on Gemma 3 270M.

vLLM runs from its own environment: set KVNOTES_VLLM_PYTHON to its python (`kvnotes vllm-env DIR`
makes one; `.ci/run` makes it in the background while the rest of the suite runs and points
KVNOTES_VLLM_ENV_DONE at a file holding its exit code). Without it the test is skipped, unless
KVNOTES_REQUIRE_VLLM=1 (CI), where that is a failure.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gemma, pytest.mark.timing]  # a real vLLM server


def vllm_python() -> str:
    python = os.environ.get("KVNOTES_VLLM_PYTHON")
    required = os.environ.get("KVNOTES_REQUIRE_VLLM") == "1"
    if not python:
        if required:
            pytest.fail("KVNOTES_REQUIRE_VLLM=1 but KVNOTES_VLLM_PYTHON is not set")
        pytest.skip("no vLLM environment: set KVNOTES_VLLM_PYTHON (make one with `kvnotes vllm-env DIR`)")
    done = os.environ.get("KVNOTES_VLLM_ENV_DONE")
    if done:  # made in the background: wait for it
        deadline = time.monotonic() + 1800
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(2)
        code = Path(done).read_text().strip() if Path(done).exists() else "timeout"
        if code != "0":
            log = Path(done).with_suffix(".log")
            tail = log.read_text()[-3000:] if log.exists() else ""
            pytest.fail(f"making the vLLM environment failed ({code}):\n{tail}")
    return python


def vllm_processes(model_dir: Path) -> list[int]:
    """Pids of processes running vLLM's server on `model_dir` (none should outlive the bench)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "vllm.entrypoints" in cmd and str(model_dir) in cmd:
                out.append(int(proc.name))
    return out


def test_bench_serve_on_a_real_vllm_server(tmp_path, capsys):
    """The whole command, as a user runs it: export, launch, every strategy, the agent loop, stop."""
    from kvnotes.bench.serve import ServeReport
    from kvnotes.cli import main
    from kvnotes.zoo.cache import default_cache_dir

    python = vllm_python()
    out = tmp_path / "serve.json"
    code = main(
        [
            "bench", "serve", "--model", "gemma-3-270m", "--vllm-python", python,
            "--tokens", "768", "--sessions", "2", "--requests", "8", "--rates", "2",
            "--strategies", "erratum,in_place", "--agent-turns", "3", "--agent-prompts", "1",
            "--agent-tokens", "256", "--json", str(out), "--html", str(tmp_path / "serve.html"),
        ]
    )  # fmt: skip
    assert code == 0
    report = ServeReport.from_dict(json.loads(out.read_text()))
    assert ServeReport.from_dict(report.to_dict()) == report
    er, ip = report.point("erratum", 2.0), report.point("in_place", 2.0)
    # the erratum keeps the prefix cache hot; rewriting the field misses everything after it
    assert er.hit_rate > 0.85 and ip.hit_rate < 0.5, (er.hit_rate, ip.hit_rate)
    assert er.ttft_p50 < ip.ttft_p50
    assert 0 < er.ttft_p50 <= er.ttft_p90 <= er.ttft_p99 and er.throughput > 0
    assert ip.decision_agreement is not None  # the fresh prompts' decisions were read
    assert er.decision_agreement is not None and er.ld_gap is not None
    assert er.prompt_tokens > 768 and report.server["block_size"] == 32
    agent = {a.strategy: a for a in report.agent}
    assert set(agent) == {"erratum", "in_place", "recompute"}
    assert agent["erratum"].agreement is not None and agent["erratum"].follows is not None
    assert agent["recompute"].agreement is None  # the reference: agreement with itself is not applicable
    assert agent["recompute"].cumulative_ttft > agent["erratum"].cumulative_ttft  # no reuse costs more
    assert agent["recompute"].hit_rate < agent["erratum"].hit_rate
    assert "serve — gemma-3-270m" in capsys.readouterr().out
    assert (
        "Serving" in (tmp_path / "serve.html").read_text() or "serve" in (tmp_path / "serve.html").read_text()
    )
    assert vllm_processes(default_cache_dir() / "export") == []  # the server and its workers stopped
