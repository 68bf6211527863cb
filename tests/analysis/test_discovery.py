"""Adding an analysis touches one file plus its panel: a module dropped into `probes/` with one
`@analysis`, and a `*_panels.py` module dropped into `dashboards/`, are found with no `__init__.py`,
list or entry point edited. The test puts both files in temporary directories on the packages'
search paths (`probes.__path__`, `dashboards.__path__`), so the tree is never written to, and takes
them away after."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import dashboards
import probes
from dashboards.registry import PANELS, load_panels, panel_modules
from kvnotes import cli_spec as source_spec
from kvnotes.analysis import discovery
from kvnotes.analysis.registry import _load_builtin, analyses, cli_spec, report_analyses, unregister

ANALYSIS = '''
"""A probe added as one file."""
from dataclasses import dataclass

from kvnotes.analysis.registry import Context, analysis, option
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.trials import PairOptions, shared_trials


@dataclass(frozen=True, kw_only=True)
class DroppedFlips(TaskResult):
    PARTS = ("flips",)
    threshold: float


RULES = {"strict": ">", "loose": ">="}  # module constants the parser reads without importing this


@dataclass(frozen=True)
class DroppedFlipsConfig(PairOptions):
    threshold: float = option(0.0, "logit difference above which the first answer is chosen")
    rule: str = option(tuple(RULES)[0], f"how a flip is counted, of {', '.join(RULES)}", choices=tuple(RULES))


@analysis("dropped_flips", "probes", DroppedFlipsConfig, DroppedFlips, quick={"n": 2}, order=99)
def run_dropped_flips(ctx: Context, cfg: DroppedFlipsConfig) -> DroppedFlips:
    """How often the changed field flips the decision."""
    trials = cfg.call(shared_trials, ctx)
    above = (lambda x: x > cfg.threshold) if cfg.rule == "strict" else (lambda x: x >= cfg.threshold)
    flips = [float(above(t.ld_old) != above(t.ld_new)) for t in trials]
    return DroppedFlips.of(
        name="dropped_flips", headline="flips", threshold=cfg.threshold, parts={"flips": Estimate.of(flips)}
    )
'''

PANEL = """
from dashboards.figures import Panel
from dashboards.registry import panel


@panel("dropped_flips")
def dropped_flips_panels(r, key):
    return [Panel(title="Dropped-in flips", reading=f"flips {r.part('flips')}", key=f"{key}/dropped_flips")]
"""

HELPER = '''
"""A helper module that declares no analysis: not imported to find the analyses."""
raise RuntimeError("imported")
'''


@pytest.fixture
def dropped_in(tmp_path):
    """The two files, on the packages' paths; everything they registered is gone after."""
    code, panels_dir = tmp_path / "probes", tmp_path / "dashboards"
    code.mkdir()
    panels_dir.mkdir()
    (code / "dropped_flips.py").write_text(textwrap.dedent(ANALYSIS))
    (code / "dropped_helper.py").write_text(textwrap.dedent(HELPER))
    (panels_dir / "dropped_flips_panels.py").write_text(textwrap.dedent(PANEL))
    probes.__path__.append(str(code))
    dashboards.__path__.append(str(panels_dir))
    _load_builtin.cache_clear()
    load_panels.cache_clear()
    try:
        yield
    finally:
        probes.__path__.remove(str(code))
        dashboards.__path__.remove(str(panels_dir))
        unregister("dropped_flips")
        PANELS.pop("dropped_flips", None)
        for name in ("probes.dropped_flips", "probes.dropped_helper", "dashboards.dropped_flips_panels"):
            sys.modules.pop(name, None)
        _load_builtin.cache_clear()
        load_panels.cache_clear()


def test_a_dropped_in_module_is_found_listed_run_and_drawn(dropped_in):
    from dashboards.render import panels
    from kvnotes.analysis.runner import run_section
    from kvnotes.zoo import load_model

    assert "probes.dropped_flips" in discovery.declaring("probes")
    assert "probes.dropped_helper" not in discovery.declaring("probes")  # no analysis: not imported
    assert "dropped_flips" in analyses() and "dropped_flips" in report_analyses()
    listed = {a["name"]: a for a in cli_spec()["commands"]["probe"]["analyses"]}
    assert listed["dropped_flips"]["help"] == "how often the changed field flips the decision"
    # the parser reads it from the source as the registry has it: nothing regenerated, no import
    assert source_spec.read() == json.loads(json.dumps(cli_spec()))
    options = {o["name"]: o for o in listed["dropped_flips"]["options"]}
    assert options["rule"]["choices"] == ["strict", "loose"] and options["rule"]["shown"] == "strict"
    assert "dashboards.dropped_flips_panels" in panel_modules()

    report = run_section(
        "probe", load_model("tiny-llama"), "order-cancel", ["dropped_flips"], n=2, progress=False
    )
    assert report.results["dropped_flips"].part("flips").n == 2
    assert "dropped_flips" in report.meta["timings"]  # it went through the runner
    drawn = panels(report, "order-cancel/probes")
    assert "Dropped-in flips" in [p.title for p in drawn]  # its own panel, not the generic one


def test_once_taken_away_it_is_gone():
    assert "dropped_flips" not in analyses()
    assert "dashboards.dropped_flips_panels" not in panel_modules()


def test_the_built_in_packages_are_walked_and_a_third_party_one_needs_one_entry_point(monkeypatch):
    builtin = ["kvnotes.analysis.model_commands", "probes", "circuits", "kvnotes.bench"]
    assert discovery.packages()[:4] == builtin
    found = discovery.declaring("kvnotes.bench")
    assert {"kvnotes.bench.ttft", "kvnotes.bench.sweep", "kvnotes.bench.prefill"} <= set(found)
    assert "kvnotes.bench.common" not in found  # helpers are not imported to find the analyses

    class EntryPoint:
        name, value = "mine", "my_analyses"

    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [EntryPoint()])
    assert discovery.packages() == [*builtin, "my_analyses"]


NOT_CONSTANT = '''
from dataclasses import dataclass

from kvnotes.analysis.registry import Options, analysis, option
from kvnotes.analysis.results import TaskResult


def pairs() -> int:
    return 8


@dataclass(frozen=True)
class ComputedConfig(Options):
    n: int = option(pairs(), "prompt pairs")


@analysis("computed", "probes", ComputedConfig, TaskResult)
def _run_computed(ctx, cfg):
    """A default computed by a call."""
'''


def test_a_default_computed_by_a_call_is_named_where_it_is(tmp_path):
    """The source reader refuses what it cannot evaluate, naming the file and line, so the parser
    builds the spec from the registry instead (`kvnotes.cli_spec.load`)."""
    code = tmp_path / "probes"
    code.mkdir()
    (code / "computed.py").write_text(NOT_CONSTANT)
    probes.__path__.append(str(code))
    try:
        with pytest.raises(source_spec.NotStatic, match=r"computed\.py:14: `pairs\(\)`"):
            source_spec.read()
    finally:
        probes.__path__.remove(str(code))
    assert "computed" not in {a["name"] for a in source_spec.read()["commands"]["probe"]["analyses"]}
