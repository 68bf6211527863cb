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
