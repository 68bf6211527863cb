"""Two small real reports for the dashboard tests, built once per test session and shared by
test_server.py and test_browser.py (a plain module, not a conftest, so fixtures elsewhere in
tests/dashboards stay independent).

- `tiny-llama` on tests/data/xss-task.toml: order-cancel whose request line (and name) is hostile HTML.
- `notes-organism` on tests/data/notes-organism-filler.toml: its own task, with real effects.

Sizes are the smallest that still fill every figure; `min_effect=0.0` keeps tiny-llama's small
effects in the note map, so the hostile request tokens reach the page.
"""

from __future__ import annotations

import os
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

NAMES = {
    "xss": ("tiny-llama", XSS_TASK, "tiny-llama/xss-run"),
    "organism": ("notes-organism", ORGANISM_TASK, "notes-organism"),
}


def build(model: str, task: Path, out: Path) -> Path:
    """Run a quick report and render its index.html into `out`."""
    from dashboards.render import write_report
    from kvnotes import load_model
    from kvnotes.analysis.report import ReportConfig, run_report

    report = run_report(load_model(model), [str(task)], out, ReportConfig.quick(**SIZES), progress=False)
    write_report(report, out)
    return out


def report_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"xss": dir, "organism": dir}, both under one root (`root()`), built once for the whole run:
    the first worker to ask builds them under a file lock, the others (and, where .ci/run names one
    directory for both, the load pass after the suite) read what it wrote. Read-only for the tests."""
    from filelock import FileLock

    base = root(tmp_path_factory)
    base.mkdir(parents=True, exist_ok=True)
    with FileLock(str(base.parent / f"{base.name}.lock")):
        if not (base / "built").exists():
            for model, task, sub in NAMES.values():
                build(model, task, base / sub)
            (base / "built").write_text("every report is complete\n")
    return {key: base / sub for key, (_, _, sub) in NAMES.items()}


def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory above both reports (the dashboard finds them by walking it): $KVNOTES_SAMPLE_REPORTS,
    else one beside every xdist worker's temporary directory (their common parent)."""
    given = os.environ.get("KVNOTES_SAMPLE_REPORTS")
    if given:
        return Path(given)
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return shared / "dashboard-reports"
