"""Every command in the README's table runs with its defaults on the embedded model: it parses as
written there (its optional parts left out, so every default is in play), its analyses' configs pass
the checks made before the model loads, and their lengths and layers fit Gemma 3 270M as loaded. No
analysis is run: the checks are the ones a command makes before its compute."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from kvnotes.analysis.registry import check_layers, get, refusal
from kvnotes.cli import _configs, build_parser
from kvnotes.zoo.names import EMBEDDED
from kvnotes.zoo.outline import context_length, outline

pytestmark = pytest.mark.gemma

README = Path(__file__).resolve().parents[1] / "README.md"
ROW = re.compile(r"^\| `(kvnotes [^`]+)` \|", re.M)


def documented() -> list[str]:
    """The commands of the README's command table, as written there."""
    rows = ROW.findall(README.read_text())
    assert len(rows) >= 15, f"the README's command table has {len(rows)} rows; is its format changed?"
    return rows


def with_defaults(command: str, tmp: Path) -> list[str]:
    """The command's words with its optional parts (`[...]`) and second alternatives left out, and its
    placeholders filled: the model is the embedded one, files and directories are under `tmp`."""
    text = command.replace("\\|", "|")
    while re.search(r"\[[^\[\]]*\]", text):
        text = re.sub(r"\s*\[[^\[\]]*\]", "", text)
    text = re.sub(r"\s\|\s--\S+ \S+", "", text)  # "--vllm-python PATH | --server URL": the first
    text = text.replace("NAME|all", "all").replace("TASK|task.toml", "TASK")
    fill = {
        "NAME": EMBEDDED,
        "TASK": "order-cancel",
        "N": "4",
        "FILE": str(tmp / "out.json"),
        "DIR…": str(tmp),
        "DIR": str(tmp / "dir"),
        "PATH": str(tmp / "python"),
        "URL": "http://127.0.0.1:9",
    }
    words = [fill.get(w, w) for w in shlex.split(text)][1:]
    if "--pairs" in words:  # an input, read as it is parsed: a pair dataset that exists
        i = words.index("--pairs") + 1
        words[i] = str(tmp / "pairs.jsonl")
        Path(words[i]).write_text('{"clean": "a", "corrupt": "b", "correct": " x", "wrong": " y"}\n')
    return words


@pytest.mark.parametrize("command", documented())
def test_each_documented_command_parses_and_fits_before_the_load(command, tmp_path):
    args = build_parser().parse_args(with_defaults(command, tmp_path))
    if not hasattr(args, "dests"):  # not an analysis command: parsing it was the check
        return
    names = [args.analysis] if hasattr(args, "analysis") else None
    if names is None:
        from kvnotes.analysis.registry import choose

        names = choose(args.command_name, args.names or args.only, flags=[])
    model = outline(EMBEDDED)  # every built-in model: tests/test_defaults_fit_every_model.py
    for name, cfg in _configs(names, args).items():  # the checks the command makes before the load
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            assert value is None or refusal(f.name, f.metadata, value, model) is None, (name, f.name)


def test_every_documented_default_fits_the_loaded_model(gemma, tmp_path):
    """The lengths and layers each command would run with fit the model as loaded; the one bench whose
    room depends on its prompts' token counts (ttft) keeps at least one length, and those pass its own
    check."""
    from kvnotes.bench.ttft import check_lengths, fitting_lengths

    assert gemma.n_ctx == context_length(EMBEDDED)  # what the checks before the load assumed
    for command in documented():
        args = build_parser().parse_args(with_defaults(command, tmp_path))
        if not hasattr(args, "analysis"):
            continue
        a = get(args.analysis)
        cfg = _configs([a.name], args, gemma)[a.name]
        check_layers(cfg, gemma)
        if a.name == "ttft":
            lengths = fitting_lengths(gemma, cfg, fit=True)
            assert lengths, f"{command}: no default length fits {gemma.name}"
            check_lengths(gemma, lengths, seam=cfg.seam, hosts=cfg.hosts)


def test_a_given_length_the_model_cannot_hold_is_refused_before_the_load(capsys):
    from kvnotes.cli import main

    assert main(["bench", "ttft", "--model", EMBEDDED, "--lengths", "512,16384"]) == 2
    err = capsys.readouterr().err
    assert "--lengths [16384] do not fit gemma-3-270m's context of 8192 tokens" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_placeholders_are_filled(tmp_path):
    words = with_defaults("kvnotes bench serve --vllm-python PATH \\| --server URL [--tokens 2048]", tmp_path)
    assert words == ["bench", "serve", "--vllm-python", str(tmp_path / "python")]
    words = with_defaults(
        "kvnotes sweep --backend nnsight --model NAME [--remote [HOST] \\| --dry-run]", tmp_path
    )
    assert words == ["sweep", "--backend", "nnsight", "--model", EMBEDDED]
