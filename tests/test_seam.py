"""The backend seam holds: outside the engine (`kvnotes/engine`) and the model loaders (`kvnotes/zoo`),
no code of the four packages reads a model's TransformerLens module (`.tl`) or its TransformerLens
config (`model.cfg`, a property of the TransformerLens model class alone). What needs the module's
weights, config or calls asks `kvnotes.engine.hooked(model, what)`, which is typed and refuses,
naming a backend that has the module, where the model's backend has none; what any model has is in
`model.facts`. The count covers code and the examples in docstrings (a doctest is code a user
copies). Tests may look inside: they test the seam.
"""

from __future__ import annotations

import ast
import doctest
from pathlib import Path

import pytest

from kvnotes import load_model
from kvnotes.engine import hooked
from kvnotes.errors import MissingCapability

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvnotes", "probes", "circuits", "dashboards")
INSIDE = ("kvnotes/engine/", "kvnotes/zoo/")  # where the module is built and run


def _is_model(node: ast.AST) -> bool:
    """`model`, `m` or `<anything>.model`: a KVModel by the project's naming."""
    return (isinstance(node, ast.Name) and node.id in ("model", "m")) or (
        isinstance(node, ast.Attribute) and node.attr == "model"
    )


def _tl_reads(tree: ast.AST) -> list[int]:
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and (n.attr == "tl" or (n.attr == "cfg" and _is_model(n.value)))
    ]


def tl_reads(path: Path) -> list[str]:
    """Each `.tl` attribute read in `path`'s code or in its docstrings' examples, as `file:line`."""
    text = path.read_text()
    tree = ast.parse(text)
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    found = [f"{name}:{line}" for line in _tl_reads(tree)]
    parser = doctest.DocTestParser()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ">>>" in node.value:
            for ex in parser.get_examples(node.value):
                try:
                    example = ast.parse(ex.source)
                except SyntaxError:  # a continuation shown alone; not code on its own
                    continue
                found += [f"{name}:{node.lineno} (docstring example)" for _ in _tl_reads(example)]
    return found


def outside_the_seam() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return [p for p in files if not p.relative_to(ROOT).as_posix().startswith(INSIDE)]


def test_no_transformer_lens_module_is_read_past_the_seam():
    files = outside_the_seam()
    assert len(files) > 100  # the packages were found
    reads = [r for p in files for r in tl_reads(p)]
    assert reads == [], "read the module through kvnotes.engine.hooked(model, what): " + ", ".join(reads)


def test_the_count_sees_a_read_in_code_and_in_a_docstring(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        'def f(model, sae):\n    """>>> f(m).tl.blocks[0]\n    """\n'
        "    x = sae.cfg.d_sae + model.cfg.d_model\n"
        "    return self.model.cfg, model.tl.blocks[0].attn.W_Q\n"
    )
    assert len(tl_reads(planted)) == 4  # not sae.cfg: another library's config


def test_hooked_refuses_a_model_without_the_module_naming_the_way_out():
    pytest.importorskip("nnsight")
    model = load_model("tiny-gpt2", backend="nnsight")
    with pytest.raises(MissingCapability, match="edge circuits needs 'weights'.*--backend transformer-lens"):
        hooked(model, "edge circuits")
