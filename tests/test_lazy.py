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
