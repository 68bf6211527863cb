"""`Analysis.requires`: what an analysis needs of its task and model, refused in one line before any
compute (a pair dataset has no rule to flip; a model with learned positions cannot move chunks), and
the rule-free analyses running on a pair dataset, from Python and through the CLI."""

from __future__ import annotations

import json

import pytest

from kvnotes.analysis.registry import Context, Need, analyses, get
from kvnotes.analysis.report import ReportConfig, plan_parts
from kvnotes.analysis.runner import collect, run_analysis
from kvnotes.cli import main
from kvnotes.errors import NeedUnmet
from kvnotes.tasks import PairSet, load_pairs
from tests.helpers import get_model
from tests.tasks.test_pairs import GOOD

FOUR = [*GOOD, *({**r, "group": "again"} for r in GOOD)]  # four pairs, two groups of two


@pytest.fixture
def no_forward(monkeypatch):
    """Any forward of any model fails the test: a refusal must come before compute."""
    from kvnotes.engine.transformer_lens import TransformerLensBackend

    def boom(*args, **kwargs):
        raise AssertionError("a forward ran before the refusal")

    monkeypatch.setattr(TransformerLensBackend, "forward", boom)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return PairSet.from_records(FOUR, name="toy").write(tmp_path_factory.mktemp("pairs") / "toy.jsonl")


def test_rule_analyses_refuse_a_pair_set_before_any_forward(no_forward):
    ctx = Context(model=get_model("tiny-llama"), task=load_pairs(FOUR), progress=False)
    for name in ("dissociation", "false_note_injection", "edit_methods", "scrubbing", "regime"):
        with pytest.raises(NeedUnmet, match=f"^{name} needs a task .* is a pair dataset: run it with --task"):
            run_analysis(ctx, [name])


def test_moving_chunks_refuse_learned_positions_before_any_forward(no_forward):
    ctx = Context(model=get_model("tiny-attn-only"), task="order-cancel", progress=False)
    with pytest.raises(NeedUnmet, match="memory_blocks moves chunks .* residual stream"):
        run_analysis(ctx, ["memory_blocks"])


def test_every_splicing_analysis_declares_moving_chunks():
    moving = {n for n, a in analyses().items() if Need.MOVING_CHUNKS in a.requires}
    assert {"seam_repair", "agent_loop", "keystone", "memory_blocks", "memory_placement", "ttft"} <= moving
    assert not {"edges", "read_heads", "note_map", "attribution"} & {
        n for n, a in analyses().items() if a.requires
    }


def test_head_circuits_run_on_a_pair_set():
    report = collect(
        get_model("tiny-llama"),
        load_pairs(FOUR, name="toy"),
        ["read_heads"],
        overrides={"k_max": 2, "draws": 2},
        n=4,
        min_effect=0.0,
        progress=False,
    )
    assert report.task == "toy" and report.meta["task_source"] == "<records>"
    assert report.results["read_heads"].part("top_k").n == 4


def test_the_report_leaves_out_what_a_pair_set_cannot_run():
    keys = [
        k
        for k, _ in plan_parts(get_model("tiny-llama"), [load_pairs(FOUR, name="toy")], ReportConfig.quick())
    ]
    parts = dict(plan_parts(get_model("tiny-llama"), [load_pairs(FOUR, name="toy")], ReportConfig.quick()))
    assert "toy/probes" in keys and "toy/edit" not in keys
    probes = parts["toy/probes"].args[3]
    assert "note_map" in probes and "dissociation" not in probes


def test_the_cli_runs_edges_on_pairs(tmp_path, pairs_file, capsys):
    out = tmp_path / "edges.json"
    sizes = ["--ig-steps", "2", "--exact-edges", "8", "--exhaustive-edges", "0", "--recall-k", "4"]
    argv = ["circuits", "edges", "--pairs", str(pairs_file), "--model", "tiny-llama", "--n", "2", *sizes]
    assert main([*argv, "--circuit-draws", "1", "--min-effect", "0", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["task"] == "toy" and "rho_eap" in d["results"]["edges"]


def test_the_cli_refuses_a_rule_analysis_on_pairs_in_one_line(pairs_file, capsys, no_forward):
    assert main(["probe", "dissociation", "--pairs", str(pairs_file), "--model", "org/no-such-model"]) == 2
    err = capsys.readouterr().err.strip()  # refused before the (missing) hub model would load
    assert err.count("\n") == 0 and "dissociation needs a task with a gated rule" in err
    assert str(pairs_file) in err and "--task" in err


def test_the_cli_refuses_a_splice_on_learned_positions(capsys, no_forward):
    assert main(["bench", "ttft", "--model", "tiny-attn-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "learned absolute positions" in err and "residual stream" in err


def test_the_cli_writes_generated_pairs(tmp_path, capsys):
    out = tmp_path / "gt.jsonl"
    assert main(["pairs", "greater-than", "--n", "6", "--model", "tiny-llama", "--out", str(out)]) == 0
    ps = load_pairs(out)
    assert len(ps) == 6 and ps.name == "gt"
    ps.check(get_model("tiny-llama"))
    assert get("edges").requires == ()
