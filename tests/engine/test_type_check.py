"""The type check CI runs (`python -m mypy`, `[tool.mypy]` in pyproject.toml) passes on the engine and
the models, and catches a backend that reads an attribute its model class lacks: a copy of the nnsight
backend planted with `model.tl` (TransformerLens's model, which `NNsightModel` has not) fails it,
while the same copy unplanted passes. One cold mypy run, about 8 s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]
BACKEND = ROOT / "kvnotes" / "engine" / "nnsight" / "backend.py"
RIGHT = "            return model.hf(torch.tensor([list(ids)], device=model.device)).logits[0]"
PLANTED = "            return model.tl(torch.tensor([list(ids)], device=model.device))[0]"


def test_the_type_check_passes_and_catches_a_backend_reading_another_model_class(tmp_path):
    source = BACKEND.read_text()
    assert RIGHT in source, "the line to plant in moved: update RIGHT"
    clean, planted = tmp_path / "clean_backend.py", tmp_path / "planted_backend.py"
    clean.write_text(source)
    planted.write_text(source.replace(RIGHT, PLANTED))
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "kvnotes/engine", "kvnotes/models"]
    cmd += [str(clean), str(planted)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert errors, out.stdout + out.stderr
    assert all(line.startswith(str(planted)) for line in errors), "\n".join(errors)
    assert any('"NNsightModel" has no attribute "tl"' in line for line in errors), "\n".join(errors)


PACKAGES = ("kvnotes", "probes", "circuits", "dashboards")
CALLER = """from kvnotes.analysis.trials import make_trials
from kvnotes.models.model import KVModel


def trials_of(model: KVModel) -> int:
    return len(make_trials(model, "order-cancel", {n}))
"""


def test_every_package_is_checked():
    import tomllib

    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert sorted(files) == sorted(PACKAGES), files


def test_a_call_across_packages_with_a_wrong_argument_fails_the_check(tmp_path):
    """What the check holds outside the engine: an annotated caller's call into another package
    agrees with the callee's signature (`n`, a count, given as text fails; as a number passes)."""
    right, wrong = tmp_path / "right_caller.py", tmp_path / "wrong_caller.py"
    right.write_text(CALLER.format(n="8"))
    wrong.write_text(CALLER.format(n='"eight"'))
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["--cache-dir", str(tmp_path / "cache"), str(right), str(wrong)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert errors and all(line.startswith(str(wrong)) for line in errors), out.stdout + out.stderr
    assert any('Argument 3 to "make_trials"' in line and "[arg-type]" in line for line in errors), errors


PROBE = """def unannotated():
    x: int = "a"
    return x


def count(n: int) -> int:
    return n


def annotated(y: int) -> int:
    return count("eight") + y
"""


def test_the_engine_is_checked_strictly_and_the_rest_at_its_calls(tmp_path):
    """The same module as `kvnotes.engine.probe` fails on its unannotated body and on its bad call;
    as `kvnotes.bench.probe` only on the call (the levels of `[tool.mypy]`'s overrides)."""
    for pkg in ("kvnotes", "kvnotes/engine", "kvnotes/bench"):
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    for pkg in ("engine", "bench"):
        (tmp_path / "kvnotes" / pkg / "probe.py").write_text(PROBE)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "kvnotes/engine/probe.py", "kvnotes/bench/probe.py"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    codes = {
        (line.split(":")[0], line.rsplit("[", 1)[-1].rstrip("]"))
        for line in out.stdout.splitlines()
        if ": error:" in line
    }
    assert codes == {
        ("kvnotes/engine/probe.py", "assignment"),
        ("kvnotes/engine/probe.py", "arg-type"),
        ("kvnotes/bench/probe.py", "arg-type"),
    }, out.stdout + out.stderr
