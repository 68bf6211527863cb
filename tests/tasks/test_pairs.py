"""Pair datasets (kvnotes.tasks.pairs): the JSONL round trip, every refusal naming its line, trials
with per-pair answers, and the generators fitting a tokenizer."""

from __future__ import annotations

import json

import pytest

from kvnotes.analysis.trials import clusters_of, make_trials
from kvnotes.errors import BadArgument, PairsError
from kvnotes.tasks import PairSet, load_pairs, load_task
from kvnotes.tasks.generate import greater_than_pairs, ioi_pairs
from tests.helpers import get_model

# Under tiny-llama's tokenizer: the status words are one token each, as are " cancel" and " deny".
GOOD = [
    {
        "clean": "Status: pending. Reply:",
        "corrupt": "Status: shipped. Reply:",
        "correct": " cancel",
        "wrong": " deny",
    },
    {
        "clean": "Order pending; reply:",
        "corrupt": "Order shipped; reply:",
        "correct": " deny",
        "wrong": " cancel",
        "group": "semicolon",
        "spans": {"status": [2, 3]},
    },
]


@pytest.fixture(scope="module")
def llama():
    return get_model("tiny-llama")


def _write(tmp_path, lines: list[str]):
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(x + "\n" for x in lines))
    return f


def test_the_jsonl_round_trip_keeps_every_record(tmp_path, llama):
    ps = PairSet.from_records(GOOD, name="toy")
    back = load_pairs(ps.write(tmp_path / "toy.jsonl"))
    assert back.name == "toy" and back.source == str(tmp_path / "toy.jsonl")
    assert [r.to_dict() for r in back.records] == [r.to_dict() for r in ps.records]
    assert [json.loads(x) for x in (tmp_path / "toy.jsonl").read_text().splitlines()][1] == GOOD[1]
    assert load_task(tmp_path / "toy.jsonl").records == back.records  # a .jsonl is a task source too
    assert back.groups == (None, "semicolon")


def test_pairs_map_onto_old_corrupt_new_clean_with_changed_and_decision_spans(llama):
    pairs = PairSet.from_records(GOOD).sample(llama)
    p = pairs[1]
    assert p.new.text == GOOD[1]["clean"] and p.old.text == GOOD[1]["corrupt"]
    assert p.answers == (llama.answer_token(" deny"), llama.answer_token(" cancel"))
    assert p.expected == (1, 0)
    diff = [i for i, (a, b) in enumerate(zip(p.new.ids, p.old.ids)) if a != b]
    assert list(p.field_span) == diff
    assert p.new.spans["decision"] == (len(p.new) - 1, len(p.new))
    assert p.new.spans["status"] == (2, 3) and p.template == 1


def test_make_trials_takes_a_pair_set_with_per_pair_answers(llama):
    ps = PairSet.from_records(GOOD, name="toy")
    trials = make_trials(llama, ps, 2, progress=False)
    assert [t.pair.answers for t in trials] == [
        (llama.answer_token(" cancel"), llama.answer_token(" deny")),
        (llama.answer_token(" deny"), llama.answer_token(" cancel")),
    ]
    assert clusters_of(trials) == [0, 1]  # clustered by group
    assert [t.old_nb.n_slots for t in trials] == [len(t.pair.old) - 1 for t in trials]


def test_asking_for_more_pairs_than_the_file_has_says_how_many(llama):
    with pytest.raises(BadArgument, match="has 2 pair"):
        PairSet.from_records(GOOD).sample(llama, 3)


def _line(**over) -> str:
    return json.dumps({**GOOD[0], **over})


NO_WRONG = json.dumps({k: v for k, v in GOOD[0].items() if k != "wrong"})
LONGER = _line(corrupt="Status: shipped now. Reply:")
REFUSALS = {
    "malformed JSON": ([_line(), '{"clean": "a"'], 2, "not valid JSON"),
    "missing key": ([NO_WRONG], 1, r"missing key\(s\) \['wrong'\]"),
    "token counts differ": ([_line(), LONGER], 2, r"clean is 11 tokens and corrupt \d+ under"),
    "answer not one token": ([_line(correct=" xyzzy")], 1, r"answer ' xyzzy' is \d+ tokens"),
    "span out of range": ([_line(spans={"status": [3, 40]})], 1, r"span 'status' \[3, 40\] is out of range"),
    "identical prompts": ([_line(corrupt=GOOD[0]["clean"])], 1, "clean and corrupt are the same text"),
    "empty file": (["", "  "], None, "is empty"),
}


@pytest.mark.parametrize("lines,line,match", REFUSALS.values(), ids=list(REFUSALS))
def test_bad_input_is_refused_naming_the_line_and_the_way_out(tmp_path, llama, lines, line, match):
    with pytest.raises(PairsError, match=match) as info:
        load_pairs(_write(tmp_path, lines)).check(llama)
    if line is not None:
        assert f"line {line}:" in str(info.value)
    assert "\n" not in str(info.value)


def test_greater_than_pairs_fit_the_tokenizer(llama):
    ps = greater_than_pairs(llama, 8)
    tok = llama.tokenizer
    for r in ps.records:
        assert len(tok(r.clean)["input_ids"]) == len(tok(r.corrupt)["input_ids"])
        assert int(r.correct) == int(r.clean.split("year ")[1][2]) + 1 == int(r.wrong) + 2
    assert len(ps.groups) == 8


def test_ioi_refuses_a_tokenizer_without_one_token_names(llama):
    with pytest.raises(PairsError, match="one token under tiny-llama's tokenizer"):
        ioi_pairs(llama, 4)


@pytest.mark.gemma
def test_ioi_pairs_fit_gemma_s_tokenizer(gemma):
    ps = ioi_pairs(gemma, 8)
    for p in ps.sample(gemma):
        assert len(p.new) == len(p.old) and len(list(p.field_span)) == 1
    assert all(
        len(gemma.tokenizer(a, add_special_tokens=False)["input_ids"]) == 1
        for r in ps.records
        for a in (r.correct, r.wrong)
    )
    assert len(ps.groups) == 4


def test_code_that_needs_a_gated_task_refuses_a_pair_dataset_by_name(tmp_path, llama):
    """`load_gated_task` passes a Task through and refuses a pair dataset, naming it and what needed
    a gate; the agent loop, which toggles one, refuses through it before any compute."""
    from kvnotes.tasks import TaskError, load_gated_task
    from probes.agent import agent_loop

    path = str(greater_than_pairs(llama, 2, name="gt-two").write(tmp_path / "gt-two.jsonl"))
    assert load_gated_task("order-cancel").gate.field == "order_status"
    with pytest.raises(TaskError, match=r"the agent loop .* is a pair dataset"):
        agent_loop(llama, path, n=1, turns=1)
