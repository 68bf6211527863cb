"""Model-level analyses (benches, `verify`, a prompt's attribution) run through the runner, like
task-level ones: its checks refuse a bad layer before the analysis runs, from the CLI and from the
report, and its profile label files the analysis's engine calls under its name."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from kvnotes.analysis.registry import Analysis, Context, Options, get, option, register, unregister
from kvnotes.analysis.report import ReportConfig, _model_part
from kvnotes.analysis.runner import run_one
from kvnotes.cli import main
from kvnotes.display import Displayable
from kvnotes.engine import profile
from kvnotes.errors import OutOfRange
from kvnotes.zoo import load_model

CALLS: list[tuple[int, str]] = []


@dataclass(frozen=True)
class LayerConfig(Options):
    layer: int = option(0, "the layer to read", layer=True)


@dataclass(frozen=True)
class LayerRead(Displayable):
    layer: int

    def table(self) -> str:
        return f"layer {self.layer}"

    def to_dict(self) -> dict:
        return {"layer": self.layer}

    @classmethod
    def from_dict(cls, d) -> LayerRead:
        return cls(d["layer"])


def _read(ctx: Context, cfg: LayerConfig) -> LayerRead:
    CALLS.append((cfg.layer, profile._label))  # the label an engine profile files its calls under
    return LayerRead(cfg.layer)


@pytest.fixture
def layer_read():
    register(Analysis("layer_read", "bench", LayerConfig, _read, LayerRead, "read one layer"))
    CALLS.clear()
    yield
    unregister("layer_read")


def test_a_model_level_analysis_runs_through_the_runner(layer_read):
    model = load_model("tiny-llama")
    assert run_one(Context(model=model, progress=False), "layer_read", LayerConfig(layer=1)) == LayerRead(1)
    with pytest.raises(OutOfRange, match="layer 99 is out of range for tiny-llama"):
        run_one(Context(model=model, progress=False), "layer_read", LayerConfig(layer=99))
    assert CALLS == [(1, "layer_read")]  # labelled; the bad layer refused before the analysis ran


def test_the_cli_and_the_report_refuse_a_bad_layer_before_it_runs(layer_read, capsys):
    assert main(["bench", "layer-read", "--model", "tiny-llama", "--layer", "99"]) == 2
    assert "layer 99 is out of range for tiny-llama" in capsys.readouterr().err
    cfg = ReportConfig.quick()
    cfg = replace(cfg, analyses={**cfg.analyses, "layer_read": LayerConfig(layer=99)})
    with pytest.raises(OutOfRange):
        _model_part(load_model("tiny-llama"), get("layer_read"), cfg, progress=False)
    assert CALLS == []
