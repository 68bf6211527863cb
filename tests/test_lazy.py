"""kvnotes.lazy: a package's names resolve to their modules' objects on first use, an unknown name
is refused naming the package, and `dir()` lists exactly the exported names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvnotes.models
import kvnotes.serving
from kvnotes.lazy import lazy_exports


def test_a_name_resolves_to_its_module_s_object():
    names, getattr_, dir_ = lazy_exports("pkg", {"join": "os.path", "dumps": "json"})
    import json
    import os.path

    assert names == ["dumps", "join"] and dir_() == names
    assert getattr_("join") is os.path.join and getattr_("dumps") is json.dumps


def test_an_unknown_name_is_refused_naming_the_package():
    with pytest.raises(AttributeError, match="module 'kvnotes.serving' has no attribute 'nope'"):
        _ = kvnotes.serving.nope  # type: ignore[attr-defined]
    assert sorted(dir(kvnotes.models)) == sorted(kvnotes.models.__all__)


def test_importing_the_package_imports_none_of_its_names_modules():
    code = "import json, sys, kvnotes, kvnotes.models; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ours = [m for m in json.loads(done.stdout) if m.split(".")[0] == "kvnotes"]
    assert ours == ["kvnotes", "kvnotes.lazy", "kvnotes.models"]


def _package(root, init: str) -> None:
    pkg = root / "shadowpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(init)
    (pkg / "scrub.py").write_text("def scrub():\n    return 'the function'\n")


@pytest.mark.parametrize("maker, expected", [("lazy_package", "function"), ("lazy_exports", "module")])
def test_a_name_its_own_submodule_has_stays_the_exported_object(tmp_path, maker, expected):
    """`lazy_package` keeps `pkg.scrub` the function after `import pkg.scrub`; plain `lazy_exports`
    (the fault it guards against) lets the import bind the module over it."""
    _package(
        tmp_path,
        f"from kvnotes.lazy import {maker}\n"
        f"__all__, __getattr__, __dir__ = {maker}(__name__, {{'scrub': 'shadowpkg.scrub'}})\n",
    )
    code = (
        "import shadowpkg.scrub, shadowpkg, types\n"
        "from shadowpkg.scrub import scrub as direct\n"
        "got = shadowpkg.scrub\n"
        "print('module' if isinstance(got, types.ModuleType) else 'function', got is direct or None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    kind, same = done.stdout.split()
    assert kind == expected, done.stdout
    assert same == ("True" if expected == "function" else "None")


@pytest.mark.parametrize("package", ["probes", "circuits"])
def test_importing_an_analysis_package_loads_none_of_its_analyses(package):
    code = f"import json, sys, {package}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ours = [m for m in json.loads(done.stdout) if m.split(".")[0] in ("probes", "circuits")]
    assert ours == [package]
