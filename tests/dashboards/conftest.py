"""The headless browser, launched once per test module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dashboards.browser import ARGS, CHROMIUM, Watched, unavailable


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.is_file():
        unavailable(f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("the playwright package is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def watched(browser) -> Iterator[Watched]:
    w = Watched(browser)
    yield w
    w.context.close()
