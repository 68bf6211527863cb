"""Typed results: every registered analysis's result reads back from its JSON exactly, and a producer
whose field or part names drift from what its panel reads fails loudly, never as a `?` on a page."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvnotes.analysis.registry import MODEL, Context, analyses, get, sections
from kvnotes.analysis.results import GenericResult, TaskResult
from kvnotes.analysis.runner import collect
from kvnotes.analysis.stats import Estimate
from kvnotes.errors import ResultSchemaError
from tests.dashboards.sample_reports import SIZES
from tests.helpers import get_model

# small sizes for every analysis that has them, so each runs on the tiny model in seconds
SMALL = {
    **SIZES,
    "distances": (0, 16),
    "seams": (0, 2),
    "offsets": (32,),
    "lengths": (128, 256),
    "tokens": (128,),
    "slots": 8,
    "cot_tokens": 4,
    "prompt": "Policy: an order may be cancelled while its status is pending.\norder_status: shipped.\nA:",
    "answers": (" yes", " no"),
    "top": 2,
    "steps": 1,
    "repeats": 1,  # a bench's timings: one each (the round trip reads a median of one as well)
    "limit": 8,  # bench acdc: ACDC's first 8 forwards both ways (a whole run on tiny-llama: 69)
}
# analyses that need a server, not a model (`bench serve`), round-trip in their own tests against it
# (tests/test_vllm.py); so does the slot sweep, one nnsight session (tests/serving/test_remote.py)
NAMES = [n for n, a in analyses().items() if a.needs_model and n != "slot_sweep"]


@pytest.fixture(scope="module")
def results() -> dict:
    """One result of every registered analysis on tiny-llama, each as its producer made it."""
    model = get_model("tiny-llama")
    out = {}
    for name, a in analyses().items():
        if name not in NAMES:
            continue
        over = {**SMALL, "tokens": 256 if name == "edit_cost" else SMALL["tokens"]}
        cfg = a.make_config(**over)
        if sections()[a.section].level == MODEL:
            out[name] = a.run(Context(model=model, progress=False), cfg)
        else:
            report = collect(
                model, "order-cancel", [name], configs={name: cfg}, min_effect=0.0, progress=False
            )
            out[name] = report.results[name]
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_result_round_trips_exactly(results, name):
    r = results[name]
    assert isinstance(r, get(name).result)
    data = json.loads(json.dumps(r.to_dict()))  # through JSON text, as report.json holds it
    back = type(r).from_dict(data)
    assert type(back) is type(r)
    assert back == r
    assert back.to_dict() == data


def test_a_renamed_field_fails_the_page_not_silently(results):
    """A producer that writes `sizes` where the false-note panel reads `ks`: rendering fails with
    the missing attribute, and the real class refuses its JSON naming the unknown key."""
    from dashboards.render import panels

    real = results["false_note_injection"]
    assert panels(real)  # the page draws with the field as the panel reads it
    fields_ = [("sizes", tuple[int, ...])]
    drifted_cls = dataclasses.make_dataclass(
        "FalseNoteInjection", fields_, bases=(TaskResult,), frozen=True, kw_only=True
    )
    drifted_cls.PART_PATTERNS = type(real).PART_PATTERNS
    drifted = drifted_cls.of(name=real.name, headline=real.headline, parts=dict(real.parts), sizes=real.ks)
    with pytest.raises(AttributeError, match="ks"):
        panels(drifted)
    with pytest.raises(ResultSchemaError, match=r"unknown key\(s\) \['sizes'\]"):
        TaskResult.from_dict(drifted.to_dict())


def test_a_renamed_or_undeclared_part_fails_where_it_is_made(results):
    real = results["knockout"]
    parts = {("top_notes" if k == "top" else k): v for k, v in real.parts.items()}
    with pytest.raises(TypeError, match=r"does not declare the part\(s\) \['top_notes'\]"):
        type(real).of(**{**_fields(real), "parts": parts, "headline": "random"})
    with pytest.raises(TypeError, match=r"has no part 'top_notes'"):
        real.part("top_notes")  # a panel asking for a part the class does not declare


def test_saved_json_missing_a_typed_field_is_refused(results):
    d = results["note_map"].to_dict()
    del d["details"]["layer_window"]
    with pytest.raises(ResultSchemaError, match=r"needs key\(s\) \['layer_window'\]"):
        TaskResult.from_dict(d)
    d = results["note_map"].to_dict()
    d["details"]["maps"][0]["recovery"] = "high"
    with pytest.raises(ResultSchemaError, match=r"maps\[0\]\.recovery should be a list"):
        TaskResult.from_dict(d)


def test_an_unknown_analysis_name_is_refused():
    with pytest.raises(ResultSchemaError, match="unknown analysis 'nope'"):
        TaskResult.from_dict({"name": "nope", "headline": "x", "x": Estimate.of([1.0]).to_dict()})


def test_generic_results_take_any_names():
    r = GenericResult(
        name="mine", headline="a", parts={"a": Estimate.of([1.0, 2.0]), "b.seconds": Estimate.of([])}
    )
    assert GenericResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def _fields(r) -> dict:
    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}


def test_non_finite_values_are_counted_not_hidden():
    from dashboards.render import panels

    e = Estimate.of([0.5, float("nan"), 0.7, float("inf"), None])
    assert (e.n, e.dropped) == (2, 3) and "3 undefined or non-finite left out" in str(e)
    assert Estimate.from_dict(json.loads(json.dumps(e.to_dict()))) == e
    assert "dropped" not in Estimate.of([1.0, 2.0]).to_dict()  # JSON unchanged when nothing is dropped
    r = GenericResult(name="mine", headline="a", parts={"a": e, "b": Estimate.of([1.0, float("nan")])})
    assert r.dropped() == 4
    assert "4 undefined or non-finite value(s) left out" in panels(r)[0].note


def test_a_section_s_header_says_only_what_its_rows_bear_out():
    """No section-wide n (each row carries its own; a keystone run once printed n=0 over 16 pairs),
    the task named only where an analysis read one, the star explained, and every pair an analysis
    left out named with its reason."""
    from kvnotes.analysis.results import SectionReport
    from probes.placement import MemoryPlacement

    e = Estimate.of([0.5, 0.7, 0.9])
    mine = GenericResult(
        name="mine", headline="a", parts={"a": e}, excluded=({"seed": 3, "reason": "decision moved < 0.1"},)
    )
    table = SectionReport(model="m", task="order-cancel", n=0, seed=0, results={"mine": mine}).table()
    head = table.splitlines()[0]
    assert "n=" not in head and "task order-cancel" in head and "* each headline" in head
    assert "mine.a *" in table and "n=3" in table
    assert "mine: 1 pair left out (seed 3: decision moved < 0.1)" in table.splitlines()
    assert MemoryPlacement.TASK_FREE
    free = GenericResult(name="free", headline="a", parts={"a": e})
    object.__setattr__(free, "TASK_FREE", True)  # as a generated-episode analysis declares it
    head = SectionReport(model="m", task="order-cancel", n=0, seed=0, results={"free": free}).table()
    assert "order-cancel" not in head.splitlines()[0]


def test_counts_and_times_print_as_plain_numbers_and_curves_in_three_figures():
    """A count of tokens or a time has no CI in the table (`refresh.tokens +3.000 [+3.000, +3.000]`
    said nothing); a curve's x reads in 3 significant figures, not `0.00340136`."""
    from kvnotes.analysis.stats import Curve

    r = GenericResult(
        name="edit_methods",
        headline="refresh",
        parts={
            "refresh": Estimate.of([0.5, 0.7]),
            "refresh.tokens": Estimate.of([3.0, 3.0]),
            "refresh.seconds": Estimate.of([0.25, 0.75]),
        },
        curves={"faithfulness": Curve.of("fraction of edges", [0.00340136, 0.5], [[0.1, 0.3], [0.9, 1.1]])},
    )
    rows = dict(r.rows())
    assert rows["edit_methods.refresh.tokens"] == "3 tokens (mean of 2)"
    assert rows["edit_methods.refresh.seconds"] == "0.5 s (mean of 2)"
    assert rows["edit_methods.refresh *"].startswith("+0.600 [")
    assert "edit_methods.faithfulness" not in rows  # a curve is a small table of its own
    assert [line.split() for line in r.curve_tables()[2:]] == [["0.0034", "+0.200"], ["0.5", "+1.000"]]


def test_methods_print_as_rows_of_a_small_table():
    """A result whose parts cross methods with figures prints them as the docs' tables do: one row
    per method, one column per figure, the count stated once, the headline starred."""
    from dataclasses import dataclass

    @dataclass(frozen=True, kw_only=True)
    class Crossed(GenericResult):
        def cell(self, part):
            method, _, what = part.partition(".")
            return (method, what or "recovery")

    r = Crossed(
        name="edit_methods",
        headline="erratum",
        parts={
            "refresh": Estimate.of([0.0, 0.2]),
            "refresh.tokens": Estimate.of([3.0, 3.0]),
            "erratum": Estimate.of([0.9, 1.0]),
            "erratum.tokens": Estimate.of([31.0, 31.0]),
        },
    )
    assert r.rows() == []  # every part sits in the grid
    _, head, *body = r.grid()
    assert head.split()[:5] == ["edit_methods", "by", "method", "recovery", "tokens"] and "(n=2 each)" in head
    assert [line.split()[0] for line in body] == ["refresh", "erratum"]
    erratum = body[1].split()
    assert erratum[1] == "+0.950" and erratum[4] == "*" and erratum[5:] == ["31", "tokens"]
