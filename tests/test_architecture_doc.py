"""docs/architecture.md's tree names every module: a module added without its line fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvnotes", "probes", "circuits", "dashboards")


def listed() -> set[str]:
    """The module paths the doc's tree block lists (directories nest by two spaces a level;
    a line may list several modules, comma-separated, before its description)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The tree, one line per module", 1)[1].split("```")[1]
    stack: list[str] = []
    out = set()
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        head = re.split(r"\s{2,}", line.strip())[0]
        names = [n.strip() for n in head.split(",")]
        if len(names) == 1 and names[0].endswith("/"):
            stack = stack[:depth] + [names[0].rstrip("/")]
        elif all(n.endswith(".py") for n in names):
            out |= {"/".join([*stack[:depth], n]) for n in names}
    return out


def test_every_module_has_its_line_in_the_architecture_doc():
    on_disk = {
        str(f.relative_to(ROOT))
        for pkg in PACKAGES
        for f in (ROOT / pkg).rglob("*.py")
        if f.name != "__init__.py"
    }
    text = (ROOT / "docs" / "architecture.md").read_text()
    # the re-exporting old addresses are named in the paragraph under the tree instead
    missing = sorted(m for m in on_disk - listed() if f"`{m}`" not in text)
    assert not missing, f"docs/architecture.md's tree does not list: {missing}; give each its line"


def test_the_tree_lists_no_module_that_is_gone():
    gone = sorted(m for m in listed() if not (ROOT / m).exists() and not m.endswith("__init__.py"))
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"
