"""The patching widget clicked in a real JupyterLab: a headless JupyterLab on 127.0.0.1 (random
token), a notebook of the cells of docs/patching.ipynb tagged `clicked-in-jupyterlab` (they build
`PatchingView.from_task` on tiny-llama and on the notes organism), and Chromium (Playwright)
clicking it. Each click goes through the widget's front end to the
kernel and back: the status line and the figure's title must show the numbers that
`PatchSession` computes in this process for the same selection, and the console must stay clean.

On the notes organism the answers are known by construction: every slot between the field and
the decision carries the change (recovery 1), a slot before the field carries nothing (0).

Needs JupyterLab (the `notebook` and `dev` extras), Playwright and Debian's Chromium; without them
the test skips, unless KVNOTES_REQUIRE_BROWSER=1 (CI), where it fails.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from probes.interactive import PatchSession, PatchState
from tests.dashboards.browser import Watched, unavailable
from tests.helpers import get_model
from tests.waiting import until

pytestmark = pytest.mark.timing  # a JupyterLab server, a kernel and a browser

DOCS = Path(__file__).resolve().parents[2] / "docs" / "patching.ipynb"
TAG = "clicked-in-jupyterlab"  # the cells of docs/patching.ipynb that this test opens and clicks
START_TIMEOUT_S = 120  # JupyterLab's server; the CI machine has 2 shared cores
RUN_TIMEOUT_MS = 240_000  # a fresh kernel imports torch and loads both models
CLICK_TIMEOUT_S = 60  # one click: a round trip to the kernel and a decision forward
STATUS = re.compile(r"logit diff old (\S+), patched (\S+), new (\S+); recovery (\S+)")


def shown(state: PatchState) -> tuple[str, str, str, str]:
    """What the widget's status line shows for `state`, formatted as the widget formats it."""
    return (
        f"{state.ld_old:+.3f}",
        f"{state.ld_patched:+.3f}",
        f"{state.ld_new:+.3f}",
        f"{state.recovery + 0.0:.2f}",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


@pytest.fixture
def lab(tmp_path) -> Iterator[dict]:
    """JupyterLab serving a folder with the notebook; {"url", "api", "token"}; stopped afterwards.
    One per test run: a second run in the same JupyterLab would find the first run's kernel, widgets
    and workspace (its notebook tab restored, hidden, in front of the locators), and fail on them."""
    try:
        import jupyterlab  # noqa: F401
        import nbformat
    except ImportError as e:
        unavailable(f"{e.name} is not installed (pip install -e '.[dev]')")
    root = tmp_path / "lab"
    root.mkdir()
    docs = nbformat.read(DOCS, as_version=4)
    nb = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    )
    nb.cells = [c for c in docs.cells if TAG in c.metadata.get("tags", [])]
    assert [c.cell_type for c in nb.cells] == ["code"] * 3, f"{DOCS.name}: expected 3 code cells tagged {TAG}"
    nbformat.write(nb, root / "widget.ipynb")

    port, token = free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(root / ".config"),  # none of the user's settings
        "JUPYTER_RUNTIME_DIR": str(root / ".rt"),
        "JUPYTERLAB_SETTINGS_DIR": str(root / ".settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(root / ".ws"),
    }
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = root / "server.log"
    server = subprocess.Popen(
        cmd, env=env, cwd=Path(__file__).resolve().parents[2], stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        try:
            until(
                lambda: get_json(f"{api}/status?token={token}"),
                timeout=START_TIMEOUT_S,
                what="JupyterLab answering its status API",
                every=0.5,
                stop=lambda: server.poll() is not None and f"JupyterLab exited ({server.returncode})",
            )
        except AssertionError as e:
            pytest.fail(f"{e}\n{log.read_text()[-3000:]}")
        yield {
            "url": f"http://127.0.0.1:{port}/lab/tree/widget.ipynb?token={token}",
            "api": api,
            "token": token,
            "log": log,
        }
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def wait_kernel_idle(lab: dict) -> None:
    """Until the notebook's kernel has started and is idle (JupyterLab drops a run sent earlier)."""
    try:
        until(
            lambda: get_json(f"{lab['api']}/sessions?token={lab['token']}"),
            lambda sessions: sessions and sessions[0]["kernel"]["execution_state"] == "idle",
            timeout=START_TIMEOUT_S,
            what="the notebook's kernel started and idle",
            every=0.5,
        )
    except AssertionError as e:
        pytest.fail(f"{e}\n{lab['log'].read_text()[-3000:]}")


class View:
    """One PatchingView as the browser shows it, inside its cell's output."""

    def __init__(self, page, cell, session: PatchSession):
        self.page, self.cell, self.session = page, cell, session

    def button(self, position: int):
        return self.cell.locator(".widget-toggle-button").nth(self.session.positions.index(position))

    def click(self, name: str) -> None:
        self.cell.get_by_role("button", name=name, exact=True).click()

    def expect(self, state: PatchState, what: str) -> None:
        """Wait until the status line and the figure show `state`'s numbers, then check every number in
        the status line that was waited for; else fail, saying what shows."""
        want = shown(state)
        line, title = f"patched {want[1]}, new {want[2]}; recovery {want[3]}", f"recovery {want[3]}"
        seen = until(
            lambda: self.cell.evaluate(SHOWN),
            lambda s: line in s["status"] and s["title"] == title,
            timeout=CLICK_TIMEOUT_S,
            what=f"{what}: the widget showing patched {want[1]}, recovery {want[3]}",
        )
        old, patched, new, rec = STATUS.search(seen["status"]).groups()
        assert (old, patched, new, rec) == want, what


# What a view's cell shows: its status line and its figure's title.
SHOWN = """cell => ({
  status: ([...cell.querySelectorAll('.widget-label')].find(e => e.textContent.includes('logit diff'))
           || {textContent: ''}).textContent,
  title: (cell.querySelector('.gtitle') || {textContent: null}).textContent,
})"""


def test_patching_view_clicked_in_jupyterlab(lab, browser, notes_organism):
    tiny = PatchSession.from_task(get_model("tiny-llama"), "order-cancel", 0)
    organism = PatchSession.from_task(notes_organism, "notes-organism", 0)
    w = Watched(browser, width=1400, height=1000)
    page = w.page
    try:
        page.goto(lab["url"])
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=RUN_TIMEOUT_MS)
        wait_kernel_idle(lab)
        page.locator(".jp-Cell .jp-InputPrompt").first.click()
        for _ in range(3):
            page.keyboard.press("Shift+Enter")
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        for i in (1, 2):
            cells.nth(i).locator(".widget-toggle-button").first.wait_for(timeout=RUN_TIMEOUT_MS)
        small, org = View(page, cells.nth(1), tiny), View(page, cells.nth(2), organism)

        # tiny-llama: the token strip and the figure are drawn (a box draws its children one by one);
        # nothing patched yet
        until(
            lambda: small.cell.locator(".widget-toggle-button").count(),
            lambda n: n == len(tiny.positions),
            timeout=CLICK_TIMEOUT_S,
            what=f"tiny-llama's {len(tiny.positions)} slot buttons drawn",
        )
        until(
            lambda: small.cell.locator(".js-plotly-plot .main-svg").count(),
            timeout=CLICK_TIMEOUT_S,
            what="tiny-llama's figure drawn",
        )
        layers = range(tiny.model.n_layers)
        small.expect(tiny.patch((), layers), "tiny-llama, before any click")
        # a click on the changed field's token transplants its slot in every layer
        (field,) = tiny.changed
        assert "mod-warning" in (small.button(field).get_attribute("class") or "")  # highlighted as changed
        small.button(field).click()
        small.expect(tiny.patch((field,), layers), "tiny-llama, field slot clicked")
        # the layer slider, by keyboard on its lower handle: layers 1..n-1
        small.cell.locator(".noUi-handle").first.focus()
        page.keyboard.press("ArrowRight")
        small.expect(tiny.patch((field,), range(1, tiny.model.n_layers)), "tiny-llama, layers from 1")
        small.click("clear")
        small.expect(tiny.patch((), range(1, tiny.model.n_layers)), "tiny-llama, cleared")

        # the notes organism: every slot between the field and the decision moves the decision all the way
        everything = range(organism.model.n_layers)
        for p in organism.downstream:
            org.button(p).click()
        notes = organism.patch(organism.downstream, everything)
        assert abs(notes.recovery - 1) < 1e-3
        org.expect(notes, "notes organism, every downstream slot clicked")
        org.click("clear")
        before = organism.positions[1]  # the first slot after <bos>, well before the field
        assert before < min(organism.changed)
        org.button(before).click()
        nothing = organism.patch((before,), everything)
        # the same slot in both runs: no change, up to float32 rounding of the overlay's forward
        # against the cached decision (4e-8 seen; recovery is a ratio of logit differences ~1)
        assert abs(nothing.recovery) < 1e-5
        org.expect(nothing, "notes organism, a slot before the field clicked")
        assert w.errors == [], f"browser console: {w.errors}"
    finally:
        w.context.close()
