"""The panel modules are found by name (`dashboards.registry.panel_modules()`: every `*_panels`
module) and loaded by the renderer; the helpers every panel module shares live in `dashboards.figures`."""

from __future__ import annotations

import importlib
import sys

from dashboards import figures
from dashboards.registry import PANELS, SUMMARIES, load_panels, panel_modules


def test_load_panels_imports_every_panel_module_and_their_panels():
    load_panels()
    assert {"dashboards.probe_panels", "dashboards.circuit_panels", "dashboards.edit_panels"} <= set(
        panel_modules()
    )
    assert all(name in sys.modules for name in panel_modules())
    assert {"note_map", "read_heads", "write_heads", "sae", "regime", "ttft", "serve"} <= set(PANELS)
    assert "probes" in SUMMARIES and {"verify", "prompt_attribution", "slot_sweep"} <= set(PANELS)


def test_the_shared_helpers_keep_their_old_address():
    old = importlib.import_module("dashboards.probe_panels")
    for name in ("est", "n_note", "say", "series"):
        assert getattr(old, name) is getattr(figures, name)
