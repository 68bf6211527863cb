"""Waiting for the very state a test asserts, and saying what was seen when it never came.

A test that waits on a browser, a server, a thread or a subprocess waits with `until`: it reads the
state it will assert on, again and again, until that state is the one it wants, and returns it, so
that the assertion reads the state that was waited for rather than a proxy read a moment earlier.
On a timeout it fails with the last state it read (or the error reading it raised), so a race that
a loaded machine exposes says what it is.

    >>> until(lambda: 41 + 1, lambda v: v == 42, timeout=1, what="the answer")
    42
    >>> until(lambda: "loading", lambda v: v == "ready", timeout=0.05, what="the page")
    Traceback (most recent call last):
    tests.waiting.NeverCame: the page: not so after 0.05 s; last saw 'loading'
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class NeverCame(AssertionError):
    """The state a test waited for did not come in time; the message holds the last state seen."""


def until(
    read: Callable[[], T],
    ok: Callable[[T], Any] = bool,
    *,
    timeout: float,
    what: str,
    every: float = 0.05,
    show: Callable[[T], Any] = repr,
    stop: Callable[[], str | None] | None = None,
) -> T:
    """`read()` until `ok(state)` holds; that state. An exception from `read` (a server not yet
    listening, a file not yet written) counts as not yet. After `timeout` seconds, `NeverCame` names
    `what` and the last state (`show(state)`) or error. `stop`, if given, is asked between reads and
    ends the wait at once with its message (a child process that died will never become ready)."""
    end = time.monotonic() + timeout
    last = "nothing (not read once)"
    while True:
        try:
            state = read()
        except Exception as e:  # not yet: keep the error to show if it never passes
            last = f"an error: {type(e).__name__}: {e}"
        else:
            if ok(state):
                return state
            last = show(state)
        if stop is not None and (why := stop()):
            raise NeverCame(f"{what}: {why}; last saw {last}")
        if time.monotonic() > end:
            raise NeverCame(f"{what}: not so after {timeout:g} s; last saw {last}")
        time.sleep(every)
