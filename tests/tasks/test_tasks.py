"""Tasks: built-in and TOML tasks load, the sampler's pairs align and vary, bad files are named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvnotes.errors import TaskError, TokenCountChanged, UnknownTaskError
from kvnotes.tasks import GATE, RULE, builtin_tasks, load_task, sample
from kvnotes.tasks.task import Task
from tests.helpers import get_model

GENERAL = ["order-cancel", "account-access", "refund-window"]
DOCS = Path(__file__).parents[2] / "docs" / "tasks.md"


def docs_example() -> str:
    """The complete example task file in docs/tasks.md (the first ```toml block)."""
    m = re.search(r"```toml\n(.*?)```", DOCS.read_text(), re.S)
    assert m, "docs/tasks.md must hold a complete ```toml example"
    return m.group(1)


@pytest.fixture(scope="module")
def llama():
    return get_model("tiny-llama")


def test_builtin_tasks_are_listed_and_load():
    assert set(GENERAL) <= set(builtin_tasks())
    for name in builtin_tasks():
        task = load_task(name)
        assert task.name == name and task.source.endswith(f"{name}.toml")
        # the mixed organisms are compiled to read the gate alone: dissociation is not applicable
        if name != "mixed-organism":
            assert task.rule is not None, f"{name} needs a rule for the dissociation probe"


@pytest.mark.parametrize("name", GENERAL)
def test_task_round_trips_through_dict(name):
    task = load_task(name)
    again = Task.from_dict(task.to_dict())
    assert again.to_dict() == task.to_dict()


def test_gate_pairs_differ_only_in_the_gating_field_and_align(llama):
    task = load_task("order-cancel")
    pairs = sample(task, llama, 6, seed=3)
    for p in pairs:
        assert p.kind == GATE and p.changed == "order_status"
        assert len(p.old.ids) == len(p.new.ids) and p.old.spans == p.new.spans
        diff = [j for j, (a, b) in enumerate(zip(p.old.ids, p.new.ids)) if a != b]
        assert diff and set(diff) <= set(p.field_span), "only the field's tokens may differ"
        assert p.expected[0] != p.expected[1]
        assert p.expected == (
            task.outcome(p.old.values["order_status"]),
            task.outcome(p.new.values["order_status"]),
        )
        assert {k: v for k, v in p.old.values.items() if k != "order_status"} == {
            k: v for k, v in p.new.values.items() if k != "order_status"
        }
    # the direction alternates, so neither value is always the old one
    assert [p.old.values["order_status"] for p in pairs[:2]] == ["pending", "shipped"]


def test_sampler_varies_names_ids_and_shot_order_and_is_seeded(llama):
    task = load_task("order-cancel")  # one template: its shots vary too (tests/tasks/test_templates.py)
    a, b = sample(task, llama, 8, seed=0, template=0), sample(task, llama, 8, seed=0, template=0)
    assert [p.old.text for p in a] == [p.old.text for p in b]
    assert len({p.old.values["customer"] for p in a}) > 2
    assert len({p.old.values["order_id"] for p in a}) == 8
    assert len({p.old.values["shots"] for p in a}) == 8
    shots = a[0].old.values["shots"]
    assert shots.count("order_status: pending") == shots.count("order_status: shipped") == 2
    assert [p.old.text for p in sample(task, llama, 8, seed=1, template=0)] != [p.old.text for p in a]


def test_shots_answer_by_the_written_rule(llama):
    shots = sample(load_task("order-cancel"), llama, 1)[0].old.values["shots"]
    for block in shots.strip().split("\n\n"):
        status = re.search(r"order_status: (\w+)", block).group(1)
        answer = re.search(r"decision: (\w+)", block).group(1)
        assert answer == {"pending": "cancel", "shipped": "deny"}[status]


def test_rule_pairs_hold_the_field_and_flip_the_rule(llama):
    task = load_task("order-cancel")
    for p in sample(task, llama, 4, kind=RULE):
        assert p.kind == RULE and p.changed == "cancel_status"
        assert p.old.values["order_status"] == p.new.values["order_status"]
        assert (p.old.values["cancel_status"], p.new.values["cancel_status"]) == ("pending", "shipped")
        assert p.expected[0] == 1 - p.expected[1]
        diff = [j for j, (a, b) in enumerate(zip(p.old.ids, p.new.ids)) if a != b]
        assert set(diff) <= set(p.field_span)
        # notes for a rule pair come after both the rule and the gating field
        assert p.downstream()[0] >= p.old.span("order_status").stop


def test_downstream_is_between_field_and_decision(llama):
    p = sample(load_task("order-cancel"), llama, 1)[0]
    d = p.downstream()
    assert d[0] == p.field_span.stop and d[-1] == p.old.span("decision").start - 1


def test_unaligned_values_name_the_field(llama):
    # under the tiny tokenizer "admin" is one token and "viewer" five
    with pytest.raises(TokenCountChanged, match="field 'account_role'.*token count"):
        sample(load_task("account-access"), llama, 1)


def test_multi_token_answer_is_refused(llama):
    d = load_task("order-cancel").to_dict()
    d["answers"] = [" cancel", " refuse politely"]
    with pytest.raises(TaskError, match="answers: answer ' refuse politely'.*single token"):
        sample(Task.from_dict(d), llama, 1)


def test_docs_example_loads(tmp_path):
    path = tmp_path / "task.toml"
    path.write_text(docs_example())
    task = load_task(str(path))
    assert task.rule is not None and task.shots is not None and task.vary
    assert task.gate.outcomes == (0, 0, 1, 1)  # sampled and probed on Gemma in tests/test_gemma.py


def test_unknown_task_lists_builtins():
    with pytest.raises(UnknownTaskError, match="'order-cancle'.*order-cancel"):
        load_task("order-cancle")
    with pytest.raises(UnknownTaskError, match="does not exist"):
        load_task("/nonexistent/task.toml")


GOOD = load_task("order-cancel").to_dict()


def _with(**changes):
    d = {**GOOD, **{k: v for k, v in changes.items() if v is not None}}
    return {k: v for k, v in d.items() if k not in [k2 for k2, v2 in changes.items() if v2 is None]}


BAD = [
    ("not TOML", "name = 'x\n", "not valid TOML"),
    ("missing gate", _with(gate=None), r"\[gate\]: missing table"),
    ("gate field type", _with(gate={"field": 3, "values": ["a", "b"]}), r"gate\.field: must be a string"),
    (
        "gate values",
        _with(gate={"field": "order_status", "values": ["pending"]}),
        r"gate\.values: must be a list of at least 2",
    ),
    (
        "same outcome",
        _with(gate={"field": "order_status", "values": ["pending", "shipped"], "outcomes": [0, 0]}),
        r"gate\.outcomes: every value leads to the same answer",
    ),
    (
        "field not in template",
        _with(gate={"field": "status", "values": ["pending", "shipped"]}),
        r"gate\.field: 'status' does not appear in the template",
    ),
    ("three answers", _with(answers=[" a", " b", " c"]), r"answers: a gated decision has exactly two"),
    ("unknown key", _with(anwsers=[" a", " b"]), r"\['anwsers'\]: unknown key"),
    (
        "no decision span",
        _with(template=GOOD["template"].replace("[[decision:decision:]]", "decision:")),
        r"template: needs a \[\[decision",
    ),
    ("unfilled field", _with(template=GOOD["template"] + "{mystery}"), r"template: field\(s\) \['mystery'\]"),
    (
        "rule values",
        _with(rule={"field": "cancel_status", "values": ["a", "b", "c"]}),
        r"rule\.values: must be exactly two",
    ),
    ("shots count", _with(shots={"template": "x", "count": 0}), r"shots\.count: must be at least 1"),
    ("vary kind", _with(vary={"customer": 7}), r"vary\.customer: must be a non-empty list"),
    ("bad brackets", _with(template="[[decision: x"), r"template: .*never closed"),
]


@pytest.mark.parametrize("data,pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_task_files_name_the_key(tmp_path, data, pattern):
    import tomli_w

    path = tmp_path / "bad.toml"
    path.write_text(data if isinstance(data, str) else tomli_w.dumps(data))
    with pytest.raises(TaskError, match=pattern) as info:
        load_task(str(path))
    assert str(path) in str(info.value) and "docs/tasks.md" in str(info.value)
