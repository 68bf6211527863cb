"""Programs no one here chose: the checks a compiled program passes before it is scored (causal,
answered right, an answer that moves), the known-circuit builder on seeded random programs (and
the old rule, planted back, failing on one), and a user's own program from the command line."""

from __future__ import annotations

import importlib.util
import json
import os
import random

import numpy as np
import pytest
import torch

if importlib.util.find_spec("tracr") is None and not os.environ.get("KVNOTES_REQUIRE_TRACR"):
    pytest.skip("the tracr extra is not installed: pip install -e '.[tracr]'", allow_module_level=True)

from circuits.edges import edge_patcher  # noqa: E402
from circuits.random_programs import check_program, check_random_programs  # noqa: E402
from kvnotes.errors import BadArgument  # noqa: E402
from kvnotes.zoo.rasp_programs import random_program  # noqa: E402
from kvnotes.zoo.tracr import (  # noqa: E402
    TRACR_PROGRAMS,
    compile_program,
    draw_pairs,
    evaluate_causal,
    load_tracr,
    pairs,
)

# tracr's weights are one-hot reads and saturated softmaxes: a patched run recovers the clean
# decision to float32 rounding (observed < 1e-5 of the effect); 1e-3 is far below any edge's share
TOL = 1e-3

SAME_ENDS = """
from tracr.rasp import rasp

VOCAB = {"x", "y", "z"}
MAX_SEQ_LEN = 5
NOT_A_PROGRAM = 3


def same_ends():
    zero = rasp.Map(lambda i: 0, rasp.indices)
    first = rasp.Aggregate(rasp.Select(rasp.indices, zero, rasp.Comparison.EQ), rasp.tokens)
    same = rasp.SequenceMap(lambda a, b: "same" if a == b else "other", rasp.tokens, first)
    return rasp.categorical(same).named("same_ends")
"""


def _first_of(sop):
    from tracr.rasp import rasp

    zero = rasp.Map(lambda i: 0, rasp.indices)
    return rasp.Aggregate(rasp.Select(rasp.indices, zero, rasp.Comparison.EQ), sop)


def _width(mlp_exactness: int):
    """How many tokens equal this one, up to 10: tracr's numerical MLP decodes the width, and
    rounds wrongly near max_seq_len when `mlp_exactness` is low."""
    from tracr.rasp import rasp

    w = rasp.SelectorWidth(rasp.Select(rasp.tokens, rasp.tokens, rasp.Comparison.EQ))
    prog = rasp.categorical(rasp.Map(lambda n: n, w)).named("width")
    return compile_program(prog, ["a", "b"], 10, mlp_exactness=mlp_exactness)


def test_a_program_that_needs_later_positions_is_refused_in_one_line():
    """The first token of the reversed input: RASP's answer at the last position is the last
    token, but the causal model's position 0 sees only itself, so it answers the first token."""
    from tracr.compiler import lib
    from tracr.rasp import rasp

    program = rasp.categorical(_first_of(lib.make_reverse(rasp.tokens))).named("first_of_reverse")
    with pytest.raises(BadArgument, match="is not causal") as e:
        compile_program(program, ["a", "b", "c"], 5)
    assert "\n" not in str(e.value) and "select only keys up to its query" in str(e.value)


@pytest.mark.parametrize("short", TRACR_PROGRAMS)
def test_the_causal_evaluation_is_what_the_compiled_model_answers(short):
    """On random inputs of every length, the compiled model's most likely output token at the last
    position is the causal evaluation's answer, which the known circuit's trace carries too (the
    whole-input evaluation differs from it on programs whose earlier positions read later ones)."""
    model = load_tracr(f"tracr-{short}")
    rng = random.Random(0)
    inputs = [[rng.choice(model.vocab) for _ in range(rng.randint(2, model.max_seq_len))] for _ in range(16)]
    answered = 0
    for xs in inputs:
        answer = model.answer_of(xs)
        if answer is None:  # an Aggregate with no key to select (pattern below its length): no answer
            continue
        answered += 1
        assert answer == evaluate_causal(model.program, xs)[-1]
        values, _ = model.circuit.trace(xs)
        assert values[model.program.label][-1] == answer
        logits = model.tl(torch.tensor([model.encode(model.text(xs))]))[0, -1]  # BOS first
        outs = [model.answer_token(str(v)) for v in model.outputs]
        assert model.outputs[int(logits[outs].argmax())] == answer, (short, xs)
    assert answered >= 8


def test_a_constant_answer_is_refused_as_such():
    from tracr.rasp import rasp

    model = compile_program(rasp.categorical(rasp.Map(lambda x: "k", rasp.tokens)).named("k"), ["a", "b"], 4)
    with pytest.raises(BadArgument, match="never moved") as e:
        draw_pairs(model, 4)
    assert "fewer pairs cannot help" in str(e.value) and "ask for fewer" not in str(e.value)


def test_a_model_that_rounds_wrongly_is_refused_and_its_dropped_pairs_are_counted():
    """At mlp_exactness 10 the width MLP answers most pairs wrongly: refused, naming the fix. At
    50 it fails a few (near max_seq_len): those are dropped and counted, and every kept pair is one
    the compiled model answers right on both prompts with a decision that moves."""
    with pytest.raises(BadArgument, match="mlp_exactness"):
        draw_pairs(_width(10), 8)
    model = _width(50)
    draw = draw_pairs(model, 16, seed=0)
    assert draw.wrong > 0 and draw.checked == len(draw.pairs) + draw.dropped
    for pair in pairs(model, 16, seed=0):
        assert edge_patcher(model, pair).effect >= 0.1  # MIN_EFFECT: the clean answer wins by it


def test_the_pair_floor_is_the_analyses_own():
    from kvnotes.analysis.registry import MIN_EFFECT
    from kvnotes.zoo.tracr import PAIR_FLOOR

    # one number written in two layers; 1e-12 catches any drift between them
    assert PAIR_FLOOR == pytest.approx(MIN_EFFECT, rel=0, abs=1e-12)


# 50 seeded programs in 5 chunks (xdist spreads them); `python -m circuits.random_programs
# --programs 200` is the full run the docs report
@pytest.mark.parametrize("chunk", range(5))
def test_the_known_circuit_is_exact_on_random_programs(chunk):
    report = check_random_programs(10, seed=10_000 * (chunk + 1), n_pairs=2, progress=False)
    assert len(report.checks) == 10
    for c in report.checks:
        assert 2 <= c.layers <= 5 and min(c.known_edges) > 0
        assert np.allclose(c.full, 1.0, atol=TOL), (c.seed, c.ops, c.full)
        assert np.allclose(c.cut, 0.0, atol=TOL), (c.seed, c.ops, c.cut)
    assert not report.failed


def test_the_old_rule_planted_back_fails_on_a_program_the_generator_finds():
    """The old rule follows a head's query and key only where its selection differs: on random
    program 1061 (a counting head reads a value its own query changes) its circuit recovers half
    the clean decision, where the scores rule recovers all of it."""
    old = check_random_programs(1, seed=1061, n_pairs=4, reads="selection", progress=False)
    assert old.failed and min(old.failed[0].full) < 1 - 0.1
    new = check_program(random_program(old.failed[0].seed), n_pairs=4, reads="scores")
    assert not isinstance(new, str) and new.passed


def test_the_old_rule_fails_on_count_first_and_the_scores_rule_does_not():
    from circuits.ground_truth import known_edges

    model = load_tracr("tracr-count-first")
    worst = {"scores": 1.0, "selection": 1.0}
    for pair in pairs(model, 4, seed=0):
        site = edge_patcher(model, pair)
        for reads in worst:
            got = float(site.patch(known_edges(model, site, reads=reads)[None])[0])
            worst[reads] = min(worst[reads], got)
    assert worst["scores"] == pytest.approx(1.0, abs=TOL)
    assert worst["selection"] < 1 - 0.1


def test_a_user_s_program_runs_from_the_command_line(tmp_path, capsys):
    from kvnotes.cli import main

    (tmp_path / "same.py").write_text(SAME_ENDS)
    spec = f"{tmp_path / 'same.py'}:same_ends"
    out, pairs_file = tmp_path / "gt.json", tmp_path / "same.jsonl"
    # `--program` (argparse's unique prefix of --programs) is the spelling a user of one program types
    bench = ["bench", "ground-truth", "--program", f"{spec},reverse", "--n", "2", "--json", str(out)]
    assert main(bench) == 0
    printed = capsys.readouterr().out
    assert f"same_ends ({tmp_path / 'same.py'}:same_ends); reverse (tracr library)" in printed
    # the reading names the best method of each program, from the table's own figures
    from circuits.ground_truth import GroundTruthReport
    from dashboards.circuit_panels import best_methods
    from tests.helpers import readings

    best = best_methods(GroundTruthReport.from_dict(json.loads(out.read_text())))
    said = readings(printed)["ground_truth"]
    assert set(best) == {"same_ends", "reverse"} and said.startswith("The best method reaches edge-level")
    assert all(f"{p} {m} {a:.2f}" in said for p, (m, a) in best.items()), said
    programs = json.loads(out.read_text())["programs"]
    assert programs["same_ends"]["faithfulness"] == pytest.approx(1.0, abs=TOL)
    assert programs["same_ends"]["checked"] >= 2
    assert main(["pairs", "tracr", "--model", spec, "--n", "3", "--out", str(pairs_file)]) == 0
    assert len(pairs_file.read_text().splitlines()) == 3
    assert main(["circuits", "edges", "--model", spec, "--pairs", str(pairs_file), "--n", "3"]) == 0


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("missing.py:same_ends", "no file"),
        ("same.py:nonesuch", "defines no 'nonesuch'"),
        ("same.py:NOT_A_PROGRAM", "not a RASP SOp"),
        ("novocab.py:same_ends", "define VOCAB"),
        ("wordy", "no tracr program 'wordy'"),
    ],
)
def test_a_bad_program_name_is_refused_with_its_fix(name, says, tmp_path, monkeypatch, capsys):
    from kvnotes.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "same.py").write_text(SAME_ENDS)
    (tmp_path / "novocab.py").write_text(SAME_ENDS.replace('VOCAB = {"x", "y", "z"}', ""))

    def compiled(*args, **kwargs):
        raise AssertionError(f"{name}: a program was compiled before the bad name was refused")

    # refused before anything compiles or is scored: `reverse`, named first, is never run
    monkeypatch.setattr("kvnotes.zoo.tracr.compile_program", compiled)
    monkeypatch.setattr("circuits.ground_truth.score_program", compiled)
    assert main(["bench", "ground-truth", "--programs", f"reverse,{name}", "--n", "2"]) == 2
    assert says in capsys.readouterr().err
