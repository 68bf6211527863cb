"""Every command and every analysis, run with its defaults, fits every built-in model (tiny-*, the
organisms, tracr-* and Gemma): the walk of the README's table (`tests/test_readme_commands.py`)
crossed with the built-in models, plus each analysis by name. It computes nothing: no model loads
and nothing runs forward; each model is its outline (`kvnotes.zoo.outline`), and each config is what
the command would run with (`kvnotes.cli._configs`: defaults fitted to the model, given values
checked), held to the model's limits (`kvnotes.analysis.registry.refusal`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvnotes.analysis.registry import analyses, choose, refusal, sections
from kvnotes.cli import _configs, _refuse_unfit, build_parser
from kvnotes.errors import OutOfRange
from kvnotes.zoo.outline import known_names, outline
from tests.test_readme_commands import documented, with_defaults

MODELS = known_names()


def every_command(tmp: Path) -> list[list[str]]:
    """The README's commands with their defaults, and every analysis named on its own command."""
    words = [with_defaults(c, tmp) for c in documented()]
    for a in analyses().values():
        command = sections()[a.section].command
        if command == "bench":
            words.append(["bench", a.command or a.name.replace("_", "-")])
        elif command:
            words.append([command, a.name])
    return [w for w in words if "--model" in w or _takes_model(w)]


def _takes_model(words: list[str]) -> bool:
    return hasattr(build_parser().parse_args(words), "dests")


def on(words: list[str], model: str) -> list[str]:
    """`words` with `--model model` in place of the one they name (or added)."""
    if "--model" in words:
        i = words.index("--model")
        return [*words[:i], "--model", model, *words[i + 2 :]]
    return [*words, "--model", model]


def unfit(words: list[str], model: str) -> list[str]:
    """What does not fit `model` in the command's configs, as the command would run them; [] if all fits."""
    args = build_parser().parse_args(on(words, model))
    if not hasattr(args, "dests"):  # no analysis options (verify, export, pairs, ...): parsing is the check
        return []
    for dest in args.dests:  # the README's own sizes are Gemma's: every default in play instead
        setattr(args, dest, None)
    names = [args.analysis] if hasattr(args, "analysis") else choose(args.command_name, args.names, flags=[])
    _refuse_unfit(args)
    found = outline(model)
    assert found is not None
    bad = []
    for name, cfg in _configs(names, args).items():
        for f in dataclasses.fields(cfg):
            v = getattr(cfg, f.name)
            if f.metadata.get("fitted"):  # nothing is given here: the analysis fits it to the model as loaded
                continue
            why = None if v is None else refusal(f.name, f.metadata, v, found)
            if why:
                bad.append(f"{name}: {why}")
    return bad


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the walk loaded a model")

    monkeypatch.setattr("kvnotes.zoo.load_model", refuse)


@pytest.mark.parametrize("model", MODELS)
def test_every_command_s_defaults_fit_every_built_in_model(model, tmp_path, no_load):
    bad = {" ".join(w): why for w in every_command(tmp_path) if (why := unfit(w, model))}
    assert bad == {}


def test_the_walk_covers_every_family_and_analysis(tmp_path):
    families = {"tiny-llama", "notes-organism", "mixed-organism-25", "gated-organism", "tracr-reverse"}
    assert families | {"gemma-3-270m"} <= set(MODELS)
    named = {w[1] for w in every_command(tmp_path)}
    commanded = [a for a in analyses().values() if sections()[a.section].command]
    assert {a.command or a.name.replace("_", "-") for a in commanded if a.section == "bench"} <= named
    assert {a.name for a in commanded if a.section != "bench"} <= named


def _plant(monkeypatch, name: str, **defaults) -> None:
    """Analysis `name` with other defaults, for this test only."""
    from kvnotes.analysis import registry

    a = registry.get(name)
    planted = dataclasses.replace(a, config=registry.replace_default(a.config, **defaults))
    monkeypatch.setitem(registry._ANALYSES, name, planted)


def test_a_planted_default_that_does_not_fit_fails_the_walk(monkeypatch, tmp_path, no_load):
    """A layer index is never fitted: a default one beyond the model is refused as a given one is."""
    assert unfit(["edit", "weight_edit"], "tiny-llama") == []
    _plant(monkeypatch, "weight_edit", layer=5)
    with pytest.raises(OutOfRange, match="--layer 5 is out of range for tiny-llama"):
        unfit(["edit", "weight_edit"], "tiny-llama")


def test_a_default_beyond_the_model_is_fitted_to_it(monkeypatch, no_load):
    """Counts and lengths left at their defaults fit themselves: a window of layers to the model's
    layers, lengths to its context (the longest that fits where none does)."""
    _plant(monkeypatch, "note_map", layer_window=99)
    _plant(monkeypatch, "regime", distances=(9000,))
    args = build_parser().parse_args(["probe", "note_map,regime", "--model", "lookup-organism"])
    configs = _configs(["note_map", "regime"], args)
    assert configs["note_map"].layer_window == 1 and configs["regime"].distances == (512,)
