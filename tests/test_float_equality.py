"""No exact float comparison in the tests or the doctests (tests/float_equality.py says the rule)."""

from __future__ import annotations

import pytest

from tests.float_equality import float_fields, scan_source, scan_tree


@pytest.fixture(scope="module")
def floats() -> frozenset[str]:
    return float_fields()


def test_the_suite_compares_no_computed_float_exactly():
    found = scan_tree()
    assert not found, "exact float comparisons (use a tolerance, or say `# exact: <why>`):\n" + "\n".join(
        map(str, found)
    )


@pytest.mark.parametrize(
    "line",
    [
        "assert x == 0.0",
        "assert x != -1.5",
        "assert r.recovery == 0",  # an int literal beside a field the project types as a float
        "assert est['k4'].mean == 1",
        "assert got.tolist() == [0.25, 1.0]",
        "assert 0.5 == f(x)",
        "assert a < b == 2.0",
    ],
)
def test_a_planted_exact_comparison_is_found(line, floats):
    assert [f.line for f in scan_source(f"x = 1\n{line}\n", "planted.py", floats)] == [2]


@pytest.mark.parametrize(
    "source",
    [
        "assert x == 0.0  # exact: the same slot copied\n",
        "# exact: a fraction of agreeing decisions\nassert r.agree == 1.0\n",
        "assert abs(x - 0.5) < 1e-6\n",
        "assert n == 3 and len(xs) == 0\n",
        "assert x == pytest.approx(0.5, abs=1e-6)\n",
    ],
)
def test_what_is_exact_or_toleranced_passes(source, floats):
    assert list(scan_source(source, "ok.py", floats)) == []


def test_doctests_are_checked_too(floats):
    from tests.float_equality import scan_doctests

    bad = 'def f():\n    """\n    >>> g() == 0.5\n    True\n    >>> h().recovery\n    0.999\n    """\n'
    found = list(scan_doctests(bad, "m.py", floats))
    assert [f.line for f in found] == [3, 5]
    assert "unrounded float output" in found[1].text
    ok = 'def f():\n    """\n    >>> round(h().recovery, 2)\n    1.0\n    """\n'
    assert list(scan_doctests(ok, "m.py", floats)) == []
    assert "recovery" in floats and "ld_old" in floats  # read from the project's own annotations
