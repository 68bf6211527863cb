"""The fixed commands are one table (`kvnotes.cli.COMMANDS`): each row becomes its parser, and no
function but the table's builder and the registry's builds a subcommand by hand."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import kvnotes.cli as cli

BUILDERS = {"_add_command", "add_analysis_commands"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_each_row_is_a_command_that_runs_its_function():
    commands = _subparsers(cli.build_parser())
    for row in cli.COMMANDS:
        parser = commands[row.name]
        leaves = _subparsers(parser).values() if row.kinds else [parser]
        for leaf in leaves:
            assert leaf.get_default("func") is row.run, row.name
            has_model = any("--model" in a.option_strings for a in leaf._actions)
            assert has_model == (cli.TAKES_MODEL in row.args), row.name


def functions_that_add_parsers(source: str) -> set[str]:
    """The names of the functions in `source` that call `.add_parser(`."""
    found = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
            if any(isinstance(c.func, ast.Attribute) and c.func.attr == "add_parser" for c in calls):
                found.add(fn.name)
    return found


def test_no_subcommand_is_built_by_hand():
    found = functions_that_add_parsers(Path(cli.__file__).read_text())
    assert found == BUILDERS, f"subcommands built outside the table: {sorted(found - BUILDERS)}"


def test_a_planted_hand_built_subcommand_is_seen():
    planted = "def _add_extra(sub):\n    x = sub.add_parser('extra', help='x')\n"
    assert functions_that_add_parsers(planted) == {"_add_extra"}
