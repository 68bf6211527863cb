"""The form of the parser's spec: what the registry (`kvnotes.analysis.registry.cli_spec`) and the
source reader (`kvnotes.cli_spec.read`) both build, written once so the two cannot drift apart.
It imports nothing of kvnotes, so reading the spec from the source stays free of torch."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

# the option metadata the parser reads; the last four are the limits a model sets (registry.LIMITS)
LIMIT_KEYS = ("layer", "layers", "heads", "tokens")
KEEP = ("help", "cli", "choices", "metavar", "least", "most", "skips", *LIMIT_KEYS)


def help_line(doc: str | None) -> str:
    """An analysis's one-line help from its run function's docstring: the first paragraph, whole,
    on one line, lowercased to run on after the command's name (unless its first word is an acronym)."""
    first = " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split()).rstrip(".")
    word = first.split(" ")[0]
    return first[:1].lower() + first[1:] if len(word) == 1 or word[1:].islower() else first


def option_entry(name: str, kind: str, item: str, default: Any, meta: Mapping) -> dict:
    """One option as the parser reads it: `kind` (bool, int, float, str or list), `item` (a list's
    items, int, float or str), the default as shown, and the metadata in `KEEP`."""
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
    return {
        "name": name,
        "kind": kind,
        "item": item,
        "shown": shown,
        **{k: list(v) if isinstance(v := meta[k], tuple) else v for k in KEEP if k in meta},
    }


def assemble(min_effect: float, sections: Iterable[Mapping], analyses: Iterable[Mapping]) -> dict:
    """The spec: `sections` (name, command, level, help) and `analyses` (name, section, command,
    help, default, flag, options), each already in the registry's order."""
    sections, analyses = list(sections), list(analyses)
    commands: dict[str, dict] = {}
    for sec in sections:
        if sec["command"]:
            entry = commands.setdefault(sec["command"], {"level": sec["level"], "help": "", "analyses": []})
            entry["help"] = entry["help"] or sec["help"]
    for command, entry in commands.items():
        homes = {s["name"] for s in sections if s["command"] == command}
        for a in (a for a in analyses if a["section"] in homes):
            entry["analyses"].append(
                {
                    "name": a["name"],
                    "command": a["command"] or a["name"].replace("_", "-"),
                    "help": a["help"],
                    "default": a["default"],
                    "flag": a["flag"],
                    "options": a["options"],
                }
            )
    return {"min_effect": min_effect, "commands": commands}
