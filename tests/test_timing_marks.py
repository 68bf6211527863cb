"""Every test that waits on a browser, a server, a thread or a subprocess's signal carries the `timing`
mark, so that `.ci/run` runs it a second time under a CPU hog (its load pass) and a race fails CI on
the submitting machine rather than on the next one.

Read from the test files' syntax: a test is timing-sensitive when its body, or a fixture of its own
module that it asks for, starts a thread, a process or a server, sends a signal, waits with
`tests.waiting.until`, or drives the browser (the `browser`, `watched` and `lab` fixtures).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
BROWSER_FIXTURES = {"browser", "watched", "lab"}
OWN = {
    "test_timing_marks.py",
    "test_waiting.py",
}  # this check's and the wait helper's own tests: nothing real waits
CALLS = {
    ("subprocess", "Popen"),
    ("threading", "Thread"),
    (None, "Popen"),
    (None, "Thread"),
    (None, "serve_forever"),
    (None, "send_signal"),
    ("os", "kill"),
    (None, "wait_for_function"),
    (None, "until"),
}


def _called(node: ast.AST) -> set[tuple[str | None, str]]:
    """(owner, name) of every call under `node`: ("subprocess", "Popen"), (None, "serve_forever")."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name):
                out.add((None, f.id))
            elif isinstance(f, ast.Attribute):
                out.add((None, f.attr))
                if isinstance(f.value, ast.Name):
                    out.add((f.value.id, f.attr))
    return out


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The `pytest.mark.NAME`s among decorators (or in a `pytestmark` value)."""
    names = set()
    for d in decorators:
        for n in ast.walk(d):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark":
                names.add(n.attr)
    return names


def timing_sensitive_unmarked(source: str) -> list[str]:
    """The test functions of a module's source that wait on something timing-sensitive, unmarked."""
    tree = ast.parse(source)
    module_marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            module_marks |= _marks([node.value])
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    sensitive_fixtures = {
        name for name, f in functions.items() if not name.startswith("test_") and _called(f) & CALLS
    }
    out = []
    for name, f in functions.items():
        if not name.startswith("test_"):
            continue
        asks = {a.arg for a in f.args.args}
        sensitive = _called(f) & CALLS or asks & (BROWSER_FIXTURES | sensitive_fixtures)
        if sensitive and "timing" not in module_marks | _marks(f.decorator_list):
            out.append(name)
    return out


def test_every_timing_sensitive_test_is_marked():
    unmarked = {
        str(path.relative_to(TESTS.parent)): names
        for path in sorted(TESTS.rglob("test_*.py"))
        if path.name not in OWN and (names := timing_sensitive_unmarked(path.read_text()))
    }
    assert not unmarked, (
        f"tests that wait on a browser, server, thread or signal without @pytest.mark.timing: {unmarked}; "
        "mark them so that .ci/run's load pass runs them under a CPU hog"
    )


MARKED = """
import pytest, threading
@pytest.mark.timing
def test_a():
    threading.Thread(target=print).start()
"""


@pytest.mark.parametrize(
    "source, unmarked",
    [
        (MARKED, []),
        (MARKED.replace("@pytest.mark.timing\n", ""), ["test_a"]),  # the mark forgotten
        ("import pytest\npytestmark = [pytest.mark.timing]\ndef test_b(watched):\n    pass\n", []),
        ("def test_b(watched):\n    pass\n", ["test_b"]),  # the browser, through its fixture
        # a fixture of the module that starts a server, asked for by an unmarked test
        ("def server():\n    s.serve_forever()\ndef test_c(server):\n    pass\n", ["test_c"]),
        ("def test_d():\n    assert 1 + 1 == 2\n", []),  # nothing to wait on
    ],
    ids=["marked", "unmarked", "module-mark", "browser-fixture", "server-fixture", "plain"],
)
def test_the_check_finds_what_it_should(source, unmarked):
    assert timing_sensitive_unmarked(source) == unmarked
