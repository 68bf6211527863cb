"""The patch-sweep benchmark's two ways compute the same recoveries (timings are reported, never asserted)."""

from __future__ import annotations

import json

from kvnotes.bench import SweepReport, patch_sweep, sweep_prompts
from kvnotes.cli import main


def test_engine_and_naive_sweeps_agree(gemma3):
    r = patch_sweep(gemma3, 80, n_slots=12, batch_size=5, progress=False)
    assert r.tokens >= 80 and r.n_patches == 12
    assert r.max_recovery_diff <= 1e-4
    assert r.max_logit_diff <= 1e-4
    assert r.engine_s > 0 and r.naive_s > 0


def test_sweep_prompts_are_aligned_and_close_to_the_asked_length(gemma3):
    old, new = sweep_prompts(gemma3, 120)
    assert len(old) == len(new) and 120 <= len(old) < 120 + 40
    assert old.values != new.values


def test_cli_patch_sweep_writes_json(tmp_path):
    out = tmp_path / "sweep.json"
    assert (
        main(
            [
                "bench",
                "patch-sweep",
                "--model",
                "tiny-gqa",
                "--tokens",
                "60,90",
                "--slots",
                "8",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    d = json.loads(out.read_text())
    assert SweepReport.from_dict(d).to_dict() == d
    assert d["model"] == "tiny-gqa" and all(r["tokens"] >= t for r, t in zip(d["results"], (60, 90)))
    for r in d["results"]:
        assert {"tokens", "engine_s", "naive_s", "ratio", "max_recovery_diff"} <= set(r)
        assert r["max_recovery_diff"] <= 1e-4
