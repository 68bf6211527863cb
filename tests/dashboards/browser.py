"""What every browser test shares: Debian's Chromium driven headless by Playwright, a page that
collects its console errors, page errors and requests, and the rule for a missing browser (skip,
saying how to install it; fail under KVNOTES_REQUIRE_BROWSER=1, as in CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def unavailable(why: str) -> None:
    if os.environ.get("KVNOTES_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{why}; KVNOTES_REQUIRE_BROWSER=1 requires the browser tests to run")
    pytest.skip(
        f"{why}: install it with `apt-get install chromium` (and `pip install -e '.[dev]'`) "
        "to run the browser tests"
    )


class Watched:
    """A page with its console errors, page errors and requests collected."""

    def __init__(self, browser, width: int = 1280, height: int = 900):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))
