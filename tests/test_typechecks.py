"""The suite's runtime type checks (tests/typechecks.py) catch what they claim to, on kvnotes' own
code as the suite imports it: a jaxtyping array function binds its named dimensions across its
arguments, a plain function's argument and return value and a dataclass's field are checked, a
closure is checked with checks built once, and every module of the packages is instrumented."""

from __future__ import annotations

import ast
import sys

import pytest
import torch

from tests import typechecks


def test_an_array_function_binds_its_dimensions_across_arguments():
    from kvnotes.rope import rotate

    x, angles = torch.zeros(1, 3, 8), torch.zeros(4, 8)  # n is 3 in x and 4 in cos and sin
    with pytest.raises(Exception, match=r"(?s)[Tt]ype-check error.*rotate"):
        rotate(x, angles, angles)
    assert rotate(x, angles[:3], angles[:3]).shape == x.shape  # the same call with n alike passes


def test_a_plain_function_s_wrong_argument_names_the_function_and_the_parameter():
    from kvnotes.batches import plan_batches

    with pytest.raises(Exception, match=r"(?s)kvnotes\.batches\.plan_batches.*n_layers"):
        plan_batches([0, 0], "6", 1)  # n_layers: int
    assert plan_batches([0, 0], 6, 1) == [[0, 1]]


def test_a_wrong_return_value_is_caught():
    def count(x: int) -> str:
        return x  # type: ignore[return-value]

    with pytest.raises(Exception, match=r"(?s)count \(its return value\)"):
        typechecks.checked(count)(1)


def test_a_dataclass_field_of_the_wrong_type_is_caught():
    from kvnotes.ops import Patch

    with pytest.raises(Exception, match=r"(?s)Patch.*keys"):
        Patch(keys="yes")  # keys: bool
    assert Patch(keys=False).keys is False


def test_a_closure_is_checked_with_checks_built_once():
    def outer(v):
        def inner(x: int) -> int:
            return x

        return typechecks.checked(inner)(v)

    assert outer(1) == 1
    built = len(typechecks._CHECKERS)
    assert outer(2) == 2 and len(typechecks._CHECKERS) == built  # defined again, not built again
    with pytest.raises(Exception, match="inner"):
        outer("a")


def test_a_name_only_a_type_checker_imports_reads_as_any():
    ns: dict = {}
    exec("from __future__ import annotations\ndef f(x: OnlyForMypy) -> int:\n    return 1", ns)
    assert typechecks.checked(ns["f"])("anything") == 1


SOURCE = '''
"""doc"""
from __future__ import annotations
Logits = Float[Tensor, "batch vocab"]
def arrays(x: Float[Tensor, "n"]) -> int: ...
def alias(x) -> Logits: ...
def plain(x: int, *, y: str = "") -> bool: ...
def bare(x): ...
@no_type_check
def skipped(x: int): ...
class Fields:
    a: Int[Tensor, "n"]
class Plain:
    a: int
'''


def test_the_hook_gives_each_definition_the_check_its_annotations_call_for():
    tree = typechecks.instrument(ast.parse(SOURCE), typechecks.DTYPES)
    decorators = {
        node.name: [ast.unparse(d) for d in node.decorator_list]
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    jax = "_kvnotes_jaxtyping.jaxtyped(typechecker=_kvnotes_beartype.beartype)"
    assert decorators == {
        "arrays": [jax],
        "alias": [jax],  # an alias of an array type is an array type
        "plain": ["_kvnotes_checks.checked"],
        "bare": [],  # nothing to check
        "skipped": ["no_type_check"],
        "Fields": [jax],
        "Plain": ["_kvnotes_checks.checked_class"],
    }
    # the imports the checks use come after the docstring and the __future__ import
    assert ast.unparse(tree.body[2]) == "import jaxtyping as _kvnotes_jaxtyping"


def test_every_module_of_the_packages_the_suite_imported_is_instrumented():
    import kvnotes.ops  # noqa: F401 - at least one

    ours = [
        m
        for name, m in list(sys.modules.items())
        if name.split(".")[0] in typechecks.PACKAGES and str(getattr(m, "__file__", "")).endswith(".py")
    ]
    assert ours and [m.__name__ for m in ours if "_kvnotes_checks" not in vars(m)] == []
