"""An interactive patching view for Jupyter: click slots of the old notebook, pick layers and K/V,
and watch the decision move as those slots are transplanted from the counterfactual run.

The view only draws: a `probes.interactive.PatchSession` prefills both prompts once and runs each
change as one forward over the decision tokens (the prefix is never recomputed), so the chart
follows the clicks live even on the real model. In a notebook:

    from kvnotes import load_model
    from dashboards.widget import PatchingView

    view = PatchingView.from_task(load_model("gemma-3-270m"), "order-cancel")
    view                                              # click tokens, drag the layer range
    view.select(positions=view.downstream, layers=range(0, 9)).recovery   # or set it from code

Needs the `notebook` extra (ipywidgets, anywidget): `pip install 'kvnotes[notebook]'`.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from contextlib import contextmanager

from dashboards.figures import visible
from kvnotes.errors import MissingDependency
from kvnotes.models.model import KVModel
from kvnotes.prompt import Prompt
from probes.interactive import PatchSession, PatchState

_INSTALL = "pip install 'kvnotes[notebook]'"
_CHANGED_STYLE = "warning"  # slots whose token differs between old and new

__all__ = ["PatchingView", "PatchState", "PatchSession"]


def _require_widgets():
    """Import the notebook extra's packages, or say which is missing and how to install it."""
    try:
        import anywidget  # noqa: F401  (plotly's FigureWidget runs on it)
        import ipywidgets
    except ImportError as e:
        name = e.name or "ipywidgets"
        raise MissingDependency(
            f"PatchingView needs {name}, which is not installed (the `notebook` extra: ipywidgets, "
            f"anywidget): {_INSTALL}"
        ) from e
    import plotly.graph_objects as go

    return ipywidgets, go


def _answer_id(model: KVModel, answer: str | int) -> int:
    return answer if isinstance(answer, int) else model.answer_token(answer)


class PatchingView:
    """Click slots of the old notebook, pick layers and K/V, and watch the decision move.

    Draws a `probes.interactive.PatchSession` (which prefills both prompts once and does every
    transplant); `view.widget` is the ipywidgets root; `view.select(...)` sets it from code;
    `view.state` is the current `PatchState`. `view.changed` are the slots whose token differs
    (the field) and `view.downstream` every slot after the last of them.
    """

    def __init__(
        self,
        model: KVModel,
        old: Prompt,
        new: Prompt,
        answers: tuple[str | int, str | int] = (" cancel", " deny"),
        *,
        session: PatchSession | None = None,
    ):
        w, go = _require_widgets()
        self.session = session or PatchSession(model, old, new, answers)
        s = self.session
        self.model, self.old, self.new, self.answers = s.model, s.old, s.new, s.answers
        self.nb_old, self.nb_new, self.ld_old, self.ld_new = s.nb_old, s.nb_new, s.ld_old, s.ld_new
        self.positions, self.changed, self.downstream = s.positions, s.changed, s.downstream
        old_str, new_str = s.old_tokens, s.new_tokens
        self._buttons = {}
        for p, a, b in zip(self.positions, old_str, new_str):
            tip = f"position {p}: {a!r}" + (f" → {b!r}" if a != b else "")
            self._buttons[p] = w.ToggleButton(
                value=False,
                description=visible(a),
                description_allow_html=False,
                tooltip=tip,
                button_style=_CHANGED_STYLE if a != b else "",
                layout=w.Layout(width="auto", height="auto", margin="1px", padding="0 4px"),
            )
        self._tokens = w.Box(
            list(self._buttons.values()),
            layout=w.Layout(display="flex", flex_flow="row wrap", align_items="flex-start"),
        )
        n = model.n_layers
        self._layers = w.IntRangeSlider(
            value=(0, n - 1), min=0, max=n - 1, step=1, description="layers", continuous_update=False
        )
        self._keys = w.Checkbox(value=True, description="K (keys)", indent=False)
        self._values = w.Checkbox(value=True, description="V (values)", indent=False)
        clear = w.Button(description="clear", tooltip="patch nothing")
        field = w.Button(description="changed", tooltip="the slots whose token differs (the field)")
        down = w.Button(description="all downstream", tooltip="every slot after the last changed token")
        clear.on_click(lambda _: self._set_positions(()))
        field.on_click(lambda _: self._set_positions(self.changed))
        down.on_click(lambda _: self._set_positions(self.downstream))
        self._status = w.Label()  # plain text, never HTML

        first, second = (html.escape(repr(a)) for a in model.token_strings(self.answers))  # plotly reads tags
        self.figure = go.FigureWidget(
            data=[
                go.Bar(
                    x=["old", "patched", "new"],
                    y=[self.ld_old, self.ld_old, self.ld_new],
                    marker_color=["#888888", "#d62728", "#1f77b4"],
                )
            ],
            layout=go.Layout(
                height=300,
                width=460,
                margin=dict(l=50, r=10, t=50, b=30),
                yaxis_title=f"logit diff {first} − {second}",
            ),
        )

        controls = w.HBox([self._layers, self._keys, self._values, clear, field, down])
        self.widget = w.VBox([self._tokens, controls, self._status, self.figure])

        self._hold = False
        for wid in (*self._buttons.values(), self._layers, self._keys, self._values):
            wid.observe(lambda _: self._refresh(), names="value")
        self.state: PatchState = self._compute()
        self._show()

    @classmethod
    def from_task(cls, model: KVModel, task: str = "order-cancel", seed: int = 0) -> PatchingView:
        """A view on one sampled pair of a task (its gating field changed; answers from the task)."""
        session = PatchSession.from_task(model, task, seed)
        return cls(model, session.old, session.new, session=session)

    # --- programmatic API --------------------------------------------------------------------
    def select(
        self,
        positions: Iterable[int] = (),
        layers: Iterable[int] | None = None,
        keys: bool = True,
        values: bool = True,
    ) -> PatchState:
        """Set the widgets to patch `positions` x `layers` (None: all; a contiguous range, as the
        slider shows) with K and/or V, re-decide once, and return the new state."""
        pos = self.session.check_positions(positions)
        lo, hi = self._layer_range(layers)
        with self._held():
            for p, b in self._buttons.items():
                b.value = p in pos
            self._layers.value = (lo, hi)
            self._keys.value, self._values.value = bool(keys), bool(values)
        return self.state

    def _layer_range(self, layers: Iterable[int] | None) -> tuple[int, int]:
        ls = self.session.layer_range(layers)
        if ls != tuple(range(ls[0], ls[-1] + 1)):
            raise ValueError(
                f"layers {list(ls)} are not contiguous; the view's slider selects a range such "
                "as range(a, b) (for any set of layers use PatchSession.patch)"
            )
        return ls[0], ls[-1]

    def _set_positions(self, positions: Sequence[int]) -> None:
        with self._held():
            for p, b in self._buttons.items():
                b.value = p in positions

    @contextmanager
    def _held(self):
        """Set many widgets and re-decide once at the end, not once per widget."""
        self._hold = True
        try:
            yield
        finally:
            self._hold = False
            self._refresh()

    # --- compute and show --------------------------------------------------------------------
    def _compute(self) -> PatchState:
        pos = tuple(p for p, b in self._buttons.items() if b.value)
        lo, hi = self._layers.value
        return self.session.patch(
            pos, range(lo, hi + 1), keys=bool(self._keys.value), values=bool(self._values.value)
        )

    def _refresh(self) -> None:
        if self._hold:
            return
        self.state = self._compute()
        self._show()

    def _show(self) -> None:
        s = self.state
        what = "K+V" if s.keys and s.values else "K" if s.keys else "V" if s.values else "nothing"
        sel = (
            f"{len(s.positions)} slot(s) × layers {s.layers[0]}–{s.layers[-1]} ({what})"
            if not s.empty
            else "nothing patched"
        )
        # (+ 0.0: an exact zero shows as 0.00, never -0.00)
        rec = "n/a (old and new decide alike)" if math.isnan(s.recovery) else f"{s.recovery + 0.0:.2f}"
        with self.figure.batch_update():
            self.figure.data[0].y = [s.ld_old, s.ld_patched, s.ld_new]
            self.figure.layout.title.text = f"recovery {rec}"
        self._status.value = (
            f"{sel}: logit diff old {s.ld_old:+.3f}, patched {s.ld_patched:+.3f}, "
            f"new {s.ld_new:+.3f}; recovery {rec}"
        )

    # --- display -----------------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        s = self.state
        return (
            f"PatchingView({self.model.name!r}, {len(self.positions)} slots, "
            f"{len(self.changed)} changed, patched {len(s.positions)}: recovery {s.recovery:.2f})"
        )
