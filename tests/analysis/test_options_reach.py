"""Every option of every analysis reaches its computation: declared once, in its config, and either
passed by `cfg.call(fn, ...)` (to a parameter `fn` takes, under the option's `arg`) or read by its
runner as `cfg.name`. An option that reaches nothing would be a flag the CLI takes and ignores.

The check reads the runner's source (and the helpers of its module it hands `cfg` to); a planted
option no one reads, a runner that forwards a field by hand (`top=cfg.top`) and a call whose
function does not take the option are each caught."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import textwrap
import types

import pytest

from kvnotes.analysis.registry import Options, analyses, option


def _functions(module: types.ModuleType) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(inspect.getsource(module))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _resolve(module: types.ModuleType, node: ast.expr, where: ast.FunctionDef):
    """The object a name or dotted name in `module` stands for (imported in the function `where`,
    or at the module's top)."""
    if isinstance(node, ast.Name):
        for imp in (n for n in ast.walk(where) if isinstance(n, ast.ImportFrom)):
            for alias in imp.names:
                if (alias.asname or alias.name) == node.id:
                    return getattr(importlib.import_module(imp.module or ""), alias.name)
        return getattr(module, node.id)
    if isinstance(node, ast.Attribute):
        return getattr(_resolve(module, node.value, where), node.attr)
    raise AssertionError(f"cfg.call's function is not a name: {ast.unparse(node)}")


def reach(run) -> tuple[set[str], list[str]]:
    """(the options `run` reads or passes, the lines where it forwards one by hand) for the runner
    `run(ctx, cfg)`, following the helpers of its module that it hands `cfg` to."""
    module = sys.modules[run.__module__]
    defs = _functions(module)
    config = analyses_by_run()[run].config
    fields = dataclasses.fields(config)
    names = {f.name for f in fields}
    used: set[str] = set()
    by_hand: list[str] = []
    todo, seen = [run.__name__], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "cfg" and node.attr != "call":
                used |= _derived(config, node.attr) if node.attr not in names else {node.attr}
            if isinstance(node, ast.keyword) and isinstance(node.value, ast.Attribute):
                if ast.unparse(node.value.value) == "cfg" and node.value.attr in names:
                    by_hand.append(f"{name}: {node.arg}=cfg.{node.value.attr}")
            if not isinstance(node, ast.Call):
                continue
            if ast.unparse(node.func) == "cfg.call":
                takes = inspect.signature(_resolve(module, node.args[0], defs[name])).parameters
                used |= {f.name for f in fields if f.metadata.get("arg", f.name) in takes}
            elif any(ast.unparse(a) == "cfg" for a in node.args):
                callee = ast.unparse(node.func)
                assert callee in defs, f"{run.__name__} hands cfg to {callee}, which the check cannot follow"
                todo.append(callee)
    return used, by_hand


def _derived(config: type, attr: str) -> set[str]:
    """The fields a property of the config reads (`cfg.method_list` reads `methods`)."""
    prop = getattr(config, attr)
    assert isinstance(prop, property), f"cfg.{attr} is neither a field nor a property of {config.__name__}"
    tree = ast.parse(textwrap.dedent(inspect.getsource(prop.fget)))
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self"}


def analyses_by_run() -> dict:
    return {a.run: a for a in analyses().values()}


@pytest.mark.parametrize("name", sorted(analyses()))
def test_every_option_reaches_its_computation_and_none_is_forwarded_by_hand(name):
    a = analyses()[name]
    used, by_hand = reach(a.run)
    unread = sorted({f.name for f in dataclasses.fields(a.config)} - used)
    assert not unread, f"{name}: options that reach nothing: {unread}"
    assert not by_hand, f"{name} forwards options by hand (let cfg.call pass them): {by_hand}"


PLANTED = '''
from dataclasses import dataclass

from kvnotes.analysis.registry import Options, option


def count(trials, *, top):
    return trials, top


@dataclass(frozen=True)
class PlantedConfig(Options):
    top: int = option(5, "slots to keep")
    draws: int = option(8, "random draws")


def _run_ignored(ctx, cfg: PlantedConfig):
    """`draws` reaches nothing."""
    return cfg.call(count, "trials")


def _run_by_hand(ctx, cfg: PlantedConfig):
    """Both read, one forwarded by hand."""
    return count("trials", top=cfg.top), cfg.draws


def _run_both(ctx, cfg: PlantedConfig):
    """Both reach the computation."""
    return cfg.call(count, "trials"), cfg.draws
'''


def test_the_check_catches_an_option_that_reaches_nothing_and_one_forwarded_by_hand(tmp_path, monkeypatch):
    (tmp_path / "planted_runners.py").write_text(textwrap.dedent(PLANTED))
    monkeypatch.syspath_prepend(str(tmp_path))
    import planted_runners as m

    from kvnotes.analysis.registry import Analysis
    from kvnotes.analysis.results import TaskResult

    made = {
        fn: Analysis(fn.__name__, "probes", m.PlantedConfig, fn, TaskResult, "planted")
        for fn in (m._run_ignored, m._run_by_hand, m._run_both)
    }
    monkeypatch.setattr(sys.modules[__name__], "analyses_by_run", lambda: made)
    assert reach(m._run_ignored)[0] == {"top"}  # draws reaches nothing
    assert reach(m._run_by_hand) == ({"top", "draws"}, ["_run_by_hand: top=cfg.top"])
    assert reach(m._run_both) == ({"top", "draws"}, [])
    assert m.PlantedConfig(top=2).call(m.count, "trials") == ("trials", 2)
    sys.modules.pop("planted_runners", None)


def test_call_leaves_to_the_runner_what_it_passes_itself():
    @dataclasses.dataclass(frozen=True)
    class Cfg(Options):
        n: int = option(8, "pairs")
        sae_layer: int = option(3, "layer", arg="layer")

    def fn(trials, n=0, *, layer, seed=0):
        return trials, n, layer, seed

    assert Cfg().call(fn, "T") == ("T", 8, 3, 0)
    assert Cfg().call(fn, "T", 2) == ("T", 2, 3, 0)  # n filled positionally: not passed again
    assert Cfg().call(fn, "T", layer=1, seed=4) == ("T", 8, 1, 4)  # given wins over the option
