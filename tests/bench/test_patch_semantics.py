"""`kvnotes bench patch-semantics`: kvnotes' patch with later slots recomputed is TransformerLens's
run_with_hooks sweep (the bench checks it in the run and reports by how much), kvnotes' default
answers another question (by how much it differs is reported beside the field's effect), the
command writes its JSON and the panel reads it."""

from __future__ import annotations

import json

from kvnotes.bench.patch_semantics import SemanticsReport, patch_semantics
from kvnotes.cli import main
from kvnotes.zoo import load_model
from tests.helpers import readings


def test_the_bench_times_three_ways_and_checks_two_agree():
    r = patch_semantics(load_model("tiny-gqa"), 32, repeats=1, progress=False)
    (p,) = r.results
    assert p.slots >= 10 and p.tokens > p.slots
    assert p.agree < 1e-4  # float32, two code paths: measured 3e-6
    # the two semantics differ on this model (measured 0.01-0.35 logits on the tiny models)
    assert p.semantics_gap > 1e-3 and p.effect > 0
    assert min(p.keep_s, p.recompute_s, p.run_with_hooks_s) > 0
    assert "run_with_hooks" in r.table() and "median of 1" in r.table()


def test_the_command_writes_its_report_and_the_panel_reads_it(tmp_path, capsys):
    from dashboards.bench_panels import patch_semantics_panels

    out = tmp_path / "s.json"
    argv = ["bench", "patch-semantics", "--model", "tiny-llama", "--prompt-length", "32", "--repeats", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    assert readings(capsys.readouterr().out)["patch_semantics"].startswith("Recomputing later positions")
    d = json.loads(out.read_text())
    r = SemanticsReport.from_dict(d)
    assert r.model == "tiny-llama" and r.results[0].agree < 1e-4
    (panel,) = patch_semantics_panels(r, "k")
    assert "run_with_hooks" in panel.reading and len(panel.figure.data[0].x) == 3
