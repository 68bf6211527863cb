"""`tests.waiting.until`, the one way the suite waits: it returns the state it waited for and, when that
never comes, says what it saw last."""

from __future__ import annotations

import itertools

import pytest

from tests.waiting import NeverCame, until


def test_it_returns_the_state_that_passed_not_a_later_read():
    reads = itertools.count()
    assert until(lambda: next(reads), lambda n: n >= 3, timeout=5, what="three reads", every=0) == 3


def test_a_read_that_raises_is_not_yet_and_its_error_is_what_it_saw():
    def read():
        raise ConnectionRefusedError("nobody listens on port 1")

    with pytest.raises(NeverCame, match=r"the server: not so after 0.05 s; last saw an error: "
                       r"ConnectionRefusedError: nobody listens on port 1"):  # fmt: skip
        until(read, timeout=0.05, what="the server")


def test_stop_ends_the_wait_at_once_with_its_reason():
    with pytest.raises(NeverCame, match=r"the kernel: it exited with code 1; last saw 'starting'"):
        until(lambda: "starting", lambda s: s == "idle", timeout=60, what="the kernel",
              stop=lambda: "it exited with code 1")  # fmt: skip
