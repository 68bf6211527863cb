"""Two small real reports for the dashboard tests, built once per test session and shared by
test_server.py and test_browser.py (a plain module, not a conftest, so fixtures elsewhere in
tests/dashboards stay independent).

- `tiny-llama` on tests/data/xss-task.toml: order-cancel whose request line (and name) is hostile HTML.
- `notes-organism` on tests/data/notes-organism-filler.toml: its own task, with real effects.

Sizes are the smallest that still fill every figure; `min_effect=0.0` keeps tiny-llama's small
effects in the note map, so the hostile request tokens reach the page.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent.parent / "data"
XSS_TASK = DATA / "xss-task.toml"
ORGANISM_TASK = DATA / "notes-organism-filler.toml"
SIZES = dict(
    n=3,
    draws=4,
    k_max=4,
    sae_train_pairs=4,
    sae_eval_pairs=4,
    sae_samples=2048,
    lengths=(256, 400),
    tokens=256,
    turns=3,
    min_effect=0.0,
)
# what the hostile request line of xss-task.toml holds, as the page must show it (as text)
XSS_SCRIPT = "<script>window.__pwned=1</script>"
XSS_IMG = '<img src=x onerror="window.__pwned=2">'
XSS_AMP = "Tom & Jerry"
XSS_TASK_NAME = "xss-order-cancel <img src=x onerror=\"window.__pwned=4\"> & 'Tom'"  # the task's name

_built: dict[str, Path] = {}


def build(model: str, task: Path, out: Path) -> Path:
    """Run a quick report and render its index.html into `out`."""
    from dashboards.render import write_report
    from kvnotes import load_model
    from kvnotes.analysis.report import ReportConfig, run_report

    report = run_report(load_model(model), [str(task)], out, ReportConfig.quick(**SIZES), progress=False)
    write_report(report, out)
    return out


def report_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"xss": dir, "organism": dir}, both under one root (`root()`), built on first use."""
    if not _built:
        base = root(tmp_path_factory)
        _built["xss"] = build("tiny-llama", XSS_TASK, base / "tiny-llama" / "xss-run")
        _built["organism"] = build("notes-organism", ORGANISM_TASK, base / "notes-organism")
    return dict(_built)


def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory above both reports (the dashboard finds them by walking it)."""
    return tmp_path_factory.getbasetemp() / "dashboard-reports"
