"""Our direct dependencies, read from pyproject.toml (standard library only, so it runs before any
install).

    python .ci/versions.py            # each direct dependency: the version installed, and our range
    python .ci/versions.py --lowest   # pip constraints pinning each one to its lower bound
"""

from __future__ import annotations

import argparse
import re
import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def direct() -> dict[str, str]:
    """{name: specifier} over the dependencies and every extra (first mention wins)."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    found: dict[str, str] = {}
    for req in [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]:
        name, spec = REQUIREMENT.match(req).groups()
        found.setdefault(re.sub(r"[-_.]+", "-", name).lower(), spec.strip())
    return found


def lower_bound(spec: str) -> str | None:
    """The version a `>=X` or `==X` specifier starts at, or None when it has no lower bound."""
    m = re.search(r"(?:>=|==)\s*([^,\s]+)", spec)
    return m.group(1) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lowest", action="store_true", help="print constraints at each lower bound")
    args = ap.parse_args()
    deps = direct()
    if args.lowest:
        for name, spec in deps.items():
            if (low := lower_bound(spec)) is not None:
                print(f"{name}=={low}")
        return
    print("direct dependencies (installed | our range):")
    for name, spec in deps.items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "not installed"
        print(f"  {name:26} {version:18} {spec or '(any)'}")


if __name__ == "__main__":
    main()
