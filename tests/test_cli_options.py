"""Every option of every `kvnotes` command refuses an out-of-range value where it is parsed: exit 2,
one line naming the option and the value, no traceback, nothing written, no model loaded."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvnotes.args import Bounded, WritablePath
from kvnotes.cli import build_parser, main

REQUIRED = {  # a valid value for each required argument, so only the option under test is wrong
    "model": "tiny-llama",
    "prompt": "prompt.txt",
    "answers": [" yes", " no"],
    "report": "report.json",
}


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(subcommand words, parser) for every command that runs something."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sp in action.choices.items():
            yield from _leaves(sp, (*path, name))


def _checked(action: argparse.Action) -> bool:
    return isinstance(action.type, Bounded | WritablePath)


PARSER = build_parser()
OPTIONS = [
    (words, leaf, action) for words, leaf in _leaves(PARSER) for action in leaf._actions if _checked(action)
]
IDS = [f"{' '.join(w)} {a.option_strings[0] if a.option_strings else a.dest}" for w, _, a in OPTIONS]


def _base_argv(words, leaf, tmp: Path, skip: argparse.Action) -> list[str]:
    argv = list(words)
    for action in leaf._actions:
        if action is skip or not (action.required or not action.option_strings):
            continue
        if action.dest == "help" or isinstance(action, argparse._SubParsersAction):
            continue
        if isinstance(action.type, WritablePath):
            value: str | list[str] = str(tmp / "fresh" / action.dest)
        else:
            value = REQUIRED.get(action.dest, str(tmp))
        values = value if isinstance(value, list) else [value]
        argv += [*action.option_strings[:1], *values] if action.option_strings else values
    return argv


def _bad_number(b: Bounded):
    below = (
        st.integers(max_value=int(b.least) - 1)
        if b.kind is int and b.least is not None
        else st.floats(max_value=b.least, exclude_max=True, allow_nan=False, allow_infinity=False)
        if b.least is not None
        else st.nothing()
    )
    above = st.integers(min_value=int(b.most) + 1) if b.most is not None else st.nothing()
    bad = st.one_of(below, above).map(str)
    if b.many:  # one bad item among good ones
        good = str(b.least if b.least is not None else 1)
        return bad.map(lambda x: f"{good},{x}")
    return bad


def _bad_path(w: WritablePath, tmp: Path):
    a_file = tmp / "a-file.txt"
    choices = [f"/proc/kvnotes-nowhere/{'out' if w.is_dir else 'x.json'}", str(a_file / "inside")]
    choices.append(str(a_file) if w.is_dir else str(tmp))  # a file for a directory, and the reverse
    return st.sampled_from(choices)


def _refuse(*a, **k):
    raise AssertionError("a bad option reached the model load")


def _run(argv: list[str], *, load: bool = True) -> tuple[int, str]:
    """`kvnotes argv`: its exit code and what it printed to stderr. Without `load`, reaching a model
    load (or the dashboard's server) fails the test."""
    err = io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stderr(err))
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        if not load:
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            mp.setattr("kvnotes.zoo.load_model", _refuse)
            mp.setattr("dashboards.server.serve", _refuse)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


@pytest.mark.parametrize("words, leaf, action", OPTIONS, ids=IDS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_out_of_range_value_is_refused_in_one_line(words, leaf, action, data, tmp_path):
    (tmp_path / "a-file.txt").write_text("x")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    kind = action.type
    bad = data.draw(_bad_number(kind) if isinstance(kind, Bounded) else _bad_path(kind, tmp_path))
    flag = action.option_strings[0] if action.option_strings else None
    argv = _base_argv(words, leaf, tmp_path, skip=action)
    argv += [f"{flag}={bad}"] if flag else [bad]
    code, err = _run(argv, load=False)
    assert code == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert (flag or action.metavar or action.dest) in lines[0] and bad.split(",")[-1] in lines[0], lines[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "something was written"


def test_every_number_and_output_path_of_the_cli_is_checked():
    """A new option of a plain `type=int` (or an output path with no check) fails here."""
    loose = []
    for words, leaf in _leaves(PARSER):
        for action in leaf._actions:
            name = f"{' '.join(words)} {'/'.join(action.option_strings) or action.dest}"
            if action.type in (int, float):
                loose.append(name)
            writes = set(action.option_strings) & {"--out", "--json", "--html"} or action.dest == "dir"
            if writes and not isinstance(action.type, WritablePath):
                loose.append(name)
    assert loose == []
    assert len(OPTIONS) > 60  # the registry's options are in the sweep, not only the fixed commands


def test_a_layer_the_model_lacks_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "r.json"
    for argv in (
        ["edit", "weight_edit", "--model", "tiny-llama", "--layer", "3", "--json", str(out)],
        ["circuits", "sae", "--model", "tiny-llama", "--sae-layer", "7", "--json", str(out)],
    ):
        code, err = _run(argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "out of range for tiny-llama (3 layers)" in err and not out.exists()


def test_a_port_in_use_is_one_line(tmp_path):
    import socket

    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text(json.dumps({"schema": "kvnotes.report/2"}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, err = _run(["dashboard", str(tmp_path), "--port", str(s.getsockname()[1])])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--port 0 for a free one" in err


REFUSE = (
    "import sys, time\nt0 = time.perf_counter()\nimport kvnotes.cli_spec as spec\n{setup}"
    "from kvnotes.cli import main\n"
    "try:\n    main(['bench', 'patch-sweep', '--model', 'tiny-llama', '--tokens', '-5'])\n"
    "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules, time.perf_counter() - t0)\n"
)


def _refuse(tmp_path: Path, setup: str = "") -> tuple[list[str], str]:
    env = {**os.environ, "KVNOTES_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-c", REFUSE.format(setup=setup)], capture_output=True, text=True, env=env
    )
    return run.stdout.split(), run.stderr


def test_the_first_refusal_after_install_imports_no_torch(tmp_path):
    """The parser's spec is read from the analyses' source: refusing a value costs no torch import,
    even with an empty kvnotes cache (a fresh install); what was read is kept for the next call."""
    (code, torch_imported, _), err = _refuse(tmp_path)
    assert (code, torch_imported) == ("2", "False"), err
    assert "argument --tokens: -5 is below 1" in err
    kept = list((tmp_path / "cache" / "cli").glob("spec-*.json"))
    assert len(kept) == 1
    from kvnotes import cli_spec

    assert json.loads(kept[0].read_text()) == cli_spec.read()


def test_where_the_source_cannot_be_read_the_registry_builds_the_spec_once(tmp_path):
    """A declaration the reader cannot evaluate (NotStatic) sends the first call to the registry
    (torch imported); the spec it built is kept, so the next call reads it and imports no torch."""
    setup = "def _planted():\n    raise spec.NotStatic('planted')\nspec.read = _planted\n"
    (code, torch_imported, _), err = _refuse(tmp_path, setup)
    assert (code, torch_imported) == ("2", "True"), err  # built from the registry
    assert "argument --tokens: -5 is below 1" in err
    (code, torch_imported, _), err = _refuse(tmp_path, setup)
    assert (code, torch_imported) == ("2", "False"), err  # then from the cache
    assert len(list((tmp_path / "cache" / "cli").glob("spec-*.json"))) == 1


def test_the_source_reads_as_the_registry_says():
    """The parser's spec read from the source, no analysis imported, is the registry's own, option by
    option: kind, default as shown, help, bounds, choices and limits, in the registry's order."""
    from kvnotes import cli_spec
    from kvnotes.analysis.registry import LIMITS, analyses, sections
    from kvnotes.analysis.registry import cli_spec as registry_spec
    from kvnotes.analysis.spec_form import LIMIT_KEYS

    read = cli_spec.read()
    assert read == json.loads(json.dumps(registry_spec()))
    listed = {a["name"] for c in read["commands"].values() for a in c["analyses"]}
    assert listed == {a.name for a in analyses().values() if sections()[a.section].command}
    assert set(LIMITS) == set(LIMIT_KEYS)  # every limit an option may carry reaches the parser


def test_a_reader_that_misreads_a_field_is_caught(monkeypatch):
    """The comparison above can fail: a reader that drops the fields a config inherits, or reads every
    annotation as a string, no longer says what the registry says."""
    from kvnotes import cli_spec
    from kvnotes.analysis.registry import cli_spec as registry_spec

    built = json.loads(json.dumps(registry_spec()))
    own_only = cli_spec._Reader._class_fields

    def no_bases(self, cls):
        fields = own_only(self, cls)
        own = {s.target.id for s in cls.node.body if isinstance(s, cli_spec.ast.AnnAssign)}
        return fields and {k: f for k, f in fields.items() if k in own}

    monkeypatch.setattr(cli_spec._Reader, "_class_fields", no_bases)
    assert cli_spec.read() != built
    monkeypatch.undo()
    monkeypatch.setattr(cli_spec, "_kind", lambda reader, mod, node: ("str", "str"))
    assert cli_spec.read() != built


def test_each_analysis_command_takes_its_help_from_its_section():
    from kvnotes.analysis.registry import sections

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    shown = {c.dest: c.help for c in subs._choices_actions}
    declared: dict[str, str] = {}
    for sec in sections().values():
        if sec.command and sec.help:
            declared.setdefault(sec.command, sec.help)
    assert set(declared) == {"probe", "circuits", "edit", "compose", "bench"}
    assert {c: shown[c] for c in declared} == declared


NO_TORCH = (
    "import sys\nfrom kvnotes.cli import main\n"
    "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
    "print(code, 'torch' in sys.modules)\n"
)


def _refusal_without_torch(argv: list[str], tmp_path: Path) -> tuple[str, str, str]:
    """`kvnotes argv` in a fresh interpreter: its exit code, whether torch was imported, its stderr."""
    env = {**os.environ, "KVNOTES_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    code, torch_imported = run.stdout.split()
    return code, torch_imported, run.stderr


def _checkpoint(tmp_path: Path) -> str:
    """A Hugging Face checkpoint directory with a config.json only (Llama's field names)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


REFUSALS = {  # each class of refusal that needs no model: argv, then what its one line must say
    "model name": (["probe", "all", "--model", "gemma-3-270mm"], "did you mean gemma-3-270m?"),
    "task file": (["probe", "--model", "tiny-llama", "--task", "no.toml"], "no.toml' does not exist"),
    "pair file": (["probe", "--model", "tiny-llama", "--pairs", "no.jsonl"], "no.jsonl does not exist"),
    "jsonl line": (["probe", "--model", "tiny-llama", "--pairs", "bad.jsonl"], "line 2: not valid JSON"),
    "layer": (["edit", "weight_edit", "--model", "tiny-llama", "--layer", "3"], "(3 layers); give a layer"),
    "checkpoint layer": (["edit", "weight_edit", "--model", "ckpt", "--layer", "2"], "ckpt (2 layers)"),
    "layer count": (["probe", "note_map", "--model", "tiny-llama", "--layer-window", "99"], "3 layers"),
    "head count": (["circuits", "read_heads", "--model", "lookup-organism", "--k-max", "5"], "4 heads"),
    "length": (["bench", "ttft", "--model", "tiny-llama", "--lengths", "600"], "context of 512 tokens"),
    "memory size": (
        ["probe", "memory_placement", "--model", "notes-organism", "--memory-sizes", "1000"],
        "--memory-sizes [1000] do not fit notes-organism's context of 512 tokens",
    ),
    "checkpoint context": (["bench", "prefill", "--model", "ckpt", "--lengths", "300"], "of 256 tokens"),
}


@pytest.mark.parametrize("case", REFUSALS, ids=list(REFUSALS))
def test_a_refusal_that_needs_no_model_imports_no_torch(case, tmp_path):
    """Names, files, a JSONL's syntax, and the layers, heads and context a model's outline gives (a
    built-in's as shipped, a checkpoint's config.json) are refused in one line, exit 2, before torch
    is imported: a structural check of "a fraction of a second", not a timed one."""
    pair = '{"clean": "a", "corrupt": "b", "correct": " x", "wrong": " y"}'
    (tmp_path / "bad.jsonl").write_text(f"{pair}\n{{bad\n")
    _checkpoint(tmp_path)
    argv, said = REFUSALS[case]
    code, torch_imported, err = _refusal_without_torch(argv, tmp_path)
    assert (code, torch_imported) == ("2", "False"), err
    assert said in err and len(err.strip().splitlines()) == 1, err


DANGLING = {"a", "an", "the", "and", "or", "of", "to", "with", "after", "one", "in", "on", "for", "by", "vs"}


def _helps(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, help line) for every subcommand at every depth."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield (*path, choice.dest), choice.help or ""
            for name, sp in action.choices.items():
                yield from _helps(sp, (*path, name))


def test_every_help_line_is_whole():
    """Each command's help line, as `kvnotes ... --help` lists it, is there and does not stop
    mid-sentence (the first line of a wrapped docstring once did: "... after one"); an analysis's
    help is its docstring's whole first paragraph; `kvnotes --help` opens for a user."""
    from kvnotes.analysis.registry import analyses

    helps = dict(_helps(PARSER))
    assert len(helps) > 20
    for words, text in helps.items():
        last = text.rstrip(".").split()[-1:] if text else []
        assert last and last[0].lower() not in DANGLING and text.count("(") == text.count(")"), (words, text)
    for a in analyses().values():
        para = " ".join((a.run.__doc__ or "").strip().split("\n\n")[0].split()).rstrip(".")
        assert a.help.lower() == para.lower(), (a.name, a.help)
    assert PARSER.description.startswith("kvnotes: the KV cache as a notebook of conclusions")
