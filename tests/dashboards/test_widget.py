"""The interactive patching view: exact against the engine's own patch + decide, widgets wired to
the state and the live figure, token text kept out of HTML, and a clear missing-extra error."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import fields

import pytest
import torch

from dashboards.figures import visible as token_label
from dashboards.widget import PatchingView, PatchState
from kvnotes.analysis.trials import make_trials
from kvnotes.engine.transformer_lens.model import TransformerLensModel
from kvnotes.errors import KVNotesError, MissingDependency, OutOfRange
from kvnotes.ops import Patch, decide, patch
from kvnotes.prompt import Template
from tests.helpers import TEMPLATE, assert_close, get_model

ipywidgets = pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")


@pytest.fixture(scope="module")
def view() -> PatchingView:
    """One view on tiny-llama's shared task; each test sets the selection it needs."""
    model = get_model("tiny-llama")
    old = TEMPLATE.render(model, order_status="pending")
    return PatchingView(model, old, old.with_values(model, order_status="shipped"))


def engine_ld(v: PatchingView, spec: Patch) -> torch.Tensor:
    """The independent computation: `ops.patch` then `ops.decide`, unbatched."""
    out = decide(v.model, patch(v.nb_old, v.nb_new, spec), v.new, vocab=v.answers).last[0]
    return out[0] - out[1]


def t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)  # the engine computes in float32


def test_every_slot_and_layer_reproduces_the_new_decision(case):
    v = PatchingView(case.model, case.old, case.new)
    s = v.select(positions=v.positions, layers=range(case.model.n_layers))
    assert_close(t(s.ld_patched), t(v.ld_new), what=f"{case.model.name}: all slots x layers")
    assert s.recovery == pytest.approx(1.0, abs=1e-4)
    assert s.positions == v.positions and s.layers == tuple(range(case.model.n_layers))


def test_nothing_selected_is_the_old_decision(view):
    s = view.select(positions=())
    # exact: nothing selected returns ld_old itself, so recovery is 0/x
    assert s.empty and s.ld_patched == view.ld_old and s.recovery == 0.0
    out = decide(view.model, view.nb_old, view.old, vocab=view.answers).last[0]
    assert_close(t(s.ld_old), out[0] - out[1], what="ld_old")
    s = view.select(positions=view.downstream, keys=False, values=False)  # neither K nor V
    assert s.empty and s.ld_patched == view.ld_old


def test_slot_range_at_a_layer_range_equals_engine_patch_and_decide(case):
    v = PatchingView(case.model, case.old, case.new)
    positions = range(case.field, case.stop)  # the field and every note after it
    layers = range(1, case.model.n_layers)
    s = v.select(positions=positions, layers=layers)
    expected = engine_ld(v, Patch(positions=tuple(positions), layers=tuple(layers)))
    assert_close(t(s.ld_patched), expected, what=f"{case.model.name}: slot range x layers 1..")
    assert s.recovery == pytest.approx((s.ld_patched - s.ld_old) / (s.ld_new - s.ld_old))


@pytest.mark.parametrize("keys, values", [(True, False), (False, True)], ids=["K-only", "V-only"])
def test_keys_only_and_values_only(view, keys, values):
    s = view.select(positions=view.downstream, keys=keys, values=values)
    assert (s.keys, s.values) == (keys, values)
    expected = engine_ld(view, Patch(positions=view.downstream, keys=keys, values=values))
    assert_close(t(s.ld_patched), expected, what=f"keys={keys} values={values}")
    both = view.select(positions=view.downstream).ld_patched
    assert s.ld_patched != both  # a half transplant is not the whole one


def test_toggling_a_button_updates_state_and_figure(view):
    view.select(positions=())
    p = view.downstream[-1]
    view._buttons[p].value = True  # as a click does
    s = view.state
    assert s.positions == (p,)
    assert_close(t(s.ld_patched), engine_ld(view, Patch(positions=(p,))), what="after a click")
    assert tuple(view.figure.data[0].y) == (s.ld_old, s.ld_patched, s.ld_new)
    assert f"{s.recovery:.2f}" in view.figure.layout.title.text
    view._layers.value = (0, 0)  # and dragging the slider
    assert view.state.layers == (0,)
    assert view.figure.data[0].y[1] == view.state.ld_patched
    view._buttons[p].value = False
    assert view.state.empty and view.figure.data[0].y[1] == view.ld_old


def test_buttons_show_every_slot_with_the_changed_one_highlighted(view):
    buttons = view._buttons
    assert list(buttons) == list(view.positions) == list(range(view.nb_old.n_slots))
    field = tuple(view.old.span("order_status"))
    assert view.changed == field
    assert view.downstream == tuple(range(field[-1] + 1, view.old.span("decision").start))
    assert {p for p, b in buttons.items() if b.button_style} == set(field)
    strs = view.model.token_strings(view.old.ids[: view.nb_old.n_slots])
    assert [b.description for b in buttons.values()] == [token_label(s) for s in strs]
    assert any("↵" in b.description for b in buttons.values())
    assert all(" " not in b.description for b in buttons.values())
    assert buttons[3].tooltip.startswith("position 3")
    lo, hi = view._layers.min, view._layers.max
    assert (lo, hi) == (0, view.model.n_layers - 1)


def test_the_view_never_mutates_its_notebooks(view):
    before = [k.clone() for k in view.nb_old.keys] + [x.clone() for x in view.nb_old.values]
    view.select(positions=view.positions)
    after = list(view.nb_old.keys) + list(view.nb_old.values)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_state_to_dict_is_json_safe_and_undefined_recovery_is_none():
    model = get_model("tiny-llama")
    old = TEMPLATE.render(model, order_status="pending")
    same = PatchingView(model, old, old)  # nothing differs: recovery is undefined
    assert same.changed == () and same.downstream == same.positions
    s = same.select(positions=[1, 2])
    assert math.isnan(s.recovery)
    d = json.loads(json.dumps(s.to_dict()))
    assert d["recovery"] is None and d["positions"] == [1, 2]
    assert isinstance(s, PatchState)


def test_from_task_matches_make_trials():
    model = get_model("tiny-llama")
    v = PatchingView.from_task(model, "order-cancel", seed=0)
    trial = make_trials(model, "order-cancel", 1, progress=False)[0]
    assert v.answers == trial.pair.answers
    assert_close(t(v.ld_old), t(trial.ld_old), what="ld_old")
    assert_close(t(v.ld_new), t(trial.ld_new), what="ld_new")
    assert v.changed == tuple(trial.pair.field_span)
    assert v.downstream == tuple(trial.pair.downstream())


def test_bad_selections_name_the_problem(view):
    with pytest.raises(OutOfRange, match=r"position\(s\) \[999\]"):
        view.select(positions=[999])
    with pytest.raises(ValueError, match="not contiguous"):
        view.select(positions=[1], layers=[0, 2])
    with pytest.raises(OutOfRange, match="3 layers"):
        view.select(positions=[1], layers=range(2, 4))


def test_display_delegates_to_the_widget(view):
    bundle = view._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == view.widget.model_id
    assert isinstance(view.widget, ipywidgets.Box)


class ScriptTokens(TransformerLensModel):
    """tiny-llama whose token strings are hostile markup."""

    def token_strings(self, ids) -> list[str]:
        return [f"<script>alert({s!r})</script>" for s in super().token_strings(ids)]


def test_token_text_is_never_rendered_as_html():
    m = get_model("tiny-llama")
    evil = ScriptTokens(**{f.name: getattr(m, f.name) for f in fields(m) if f.init})  # the same model
    old = TEMPLATE.render(evil, order_status="pending")
    v = PatchingView(evil, old, old.with_values(evil, order_status="shipped"))

    def walk(w):
        yield w
        for c in getattr(w, "children", ()):
            yield from walk(c)

    widgets = list(walk(v.widget))
    assert not [w for w in widgets if isinstance(w, ipywidgets.HTML | ipywidgets.HTMLMath)]
    assert all(not getattr(w, "description_allow_html", False) for w in widgets)
    assert all(b.description.startswith("<script>") for b in v._buttons.values())  # shown as text
    assert "<script>" not in v._status.value
    assert "<script>" not in v.figure.layout.yaxis.title.text  # plotly titles read tags: escaped
    assert "&lt;script&gt;" in v.figure.layout.yaxis.title.text


@pytest.mark.parametrize("missing", ["ipywidgets", "anywidget"])
def test_missing_notebook_extra_names_package_and_fix(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now raises ImportError
    model = get_model("tiny-llama")
    old = Template("order_status: {order_status}.\n[[decision:A:]]").render(model, order_status="pending")
    with pytest.raises(MissingDependency, match=rf"{missing}.*pip install 'kvnotes\[notebook\]'") as e:
        PatchingView(model, old, old)
    assert isinstance(e.value, KVNotesError)
