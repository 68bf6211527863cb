"""A new analysis added by registering it in this one file (docs/adding-an-analysis.md): it shows in
`kvnotes probe --help`, runs from `kvnotes probe` and in `kvnotes report`, is saved in report.json,
reads back exactly, and draws its own panel — with no other file of kvnotes edited."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from dashboards.figures import Panel, ci_bars, est, n_note
from dashboards.registry import PANELS, panel
from kvnotes.analysis.registry import Analysis, Context, option, register, report_analyses, unregister
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.trials import PairOptions, shared_trials
from kvnotes.cli import main

# --- the whole of the new analysis -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DecisionFlips(TaskResult):
    """How often the changed field flips the decision, and by how many logits it moves it."""

    PARTS = ("flips", "margin")
    threshold: float


@dataclass(frozen=True)
class FlipsConfig(PairOptions):
    threshold: float = option(0.0, "logit difference above which the first answer is chosen")


def _run_decision_flips(ctx: Context, cfg: FlipsConfig) -> DecisionFlips:
    trials = cfg.call(shared_trials, ctx)
    flips = [float((t.ld_old > cfg.threshold) != (t.ld_new > cfg.threshold)) for t in trials]
    margin = [abs(t.ld_new - t.ld_old) for t in trials]
    return DecisionFlips.of(
        name="decision_flips",
        headline="flips",
        threshold=cfg.threshold,
        parts={"flips": Estimate.of(flips), "margin": Estimate.of(margin)},
    )


def flips_panels(r: DecisionFlips, key: str) -> list[Panel]:
    fig = ci_bars(
        [est(r.part("flips"), "decision flipped"), est(r.part("margin"), "|move| (logits)")],
        title="Decision flips",
        y_title="value",
    )
    return [
        Panel(
            title="Decision flips",
            figure=fig,
            note=n_note(r),
            key=f"{key}/decision_flips",
            reading=f"The field flips the decision in {r.part('flips')} of pairs (threshold {r.threshold}).",
        )
    ]


def _register() -> None:
    register(
        Analysis(
            "decision_flips",
            "probes",
            FlipsConfig,
            _run_decision_flips,
            DecisionFlips,
            "how often the changed field flips the decision",
            quick={"n": 2},
            order=7,
        )
    )
    panel("decision_flips")(flips_panels)


# --- the checks ---------------------------------------------------------------------------------


@pytest.fixture
def registered():
    _register()
    yield
    unregister("decision_flips")
    PANELS.pop("decision_flips", None)


def test_it_shows_in_the_help_of_its_command(registered, capsys):
    with pytest.raises(SystemExit) as e:
        main(["probe", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "decision_flips: how often the changed field flips the decision" in text
    assert "--threshold THRESHOLD" in text and "(default 0.0)" in text


def test_it_runs_from_its_command(registered, tmp_path, capsys):
    out = tmp_path / "flips.json"
    assert (
        main(
            [
                "probe",
                "decision_flips",
                "--model",
                "tiny-llama",
                "--n",
                "3",
                "--threshold",
                "0.5",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "decision_flips.flips *" in capsys.readouterr().out
    d = json.loads(out.read_text())["results"]["decision_flips"]
    # exact: the config value, stored and read back
    assert d["details"]["threshold"] == 0.5 and len(d["flips"]["values"]) == 3


def test_it_runs_in_the_report_is_saved_reads_back_and_draws_its_panel(registered, tmp_path):
    from kvnotes.analysis.report import Report

    others = [n for n in report_analyses() if n != "decision_flips"]
    out = tmp_path / "report"
    argv = (
        f"report --model tiny-llama --task order-cancel --quick --n 2 --skip {','.join(others)} --out {out}"
    )
    assert main(argv.split()) == 0
    saved = json.loads((out / "report.json").read_text())
    assert list(saved["parts"]) == ["order-cancel/probes"]
    r = saved["parts"]["order-cancel/probes"]["result"]["results"]["decision_flips"]
    assert r["headline"] == "flips" and r["details"] == {
        "excluded": [],
        "not_applicable": None,
        "threshold": 0.0,
    }
    back = Report.load(out).part("order-cancel", "probes").results["decision_flips"]
    assert isinstance(back, DecisionFlips) and back.to_dict() == r
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "Decision flips" in page and "The field flips the decision in" in page


def test_it_is_gone_once_unregistered(registered, capsys):
    unregister("decision_flips")
    assert main(["probe", "decision_flips", "--model", "tiny-llama"]) == 2
    assert "unknown analysis(es) ['decision_flips']" in capsys.readouterr().err
