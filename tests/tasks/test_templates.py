"""Task templates: the paraphrases of the built-in tasks render and align, pairs cycle through
them (or keep to one), and a malformed `[[variants]]` entry is named with its fix."""

from __future__ import annotations

import random

import pytest

from kvnotes.errors import TaskError, TokenCountChanged
from kvnotes.tasks import GATE, RULE, Task, load_task, sample
from kvnotes.tasks.sampler import render, shots_text, values_for
from tests.helpers import get_model

GENERAL = ["order-cancel", "account-access", "refund-window"]
ORGANISMS = ["notes-organism", "lookup-organism"]


@pytest.fixture(scope="module")
def llama():
    return get_model("tiny-llama")


def _values(task: Task, gate_value: str) -> dict[str, str]:
    rng = random.Random(0)
    vals = {**values_for(task, rng), "shots": shots_text(task, rng, ""), task.gate.field: gate_value}
    if task.rule:
        vals[task.rule.field] = task.rule.values[0]
    return vals


@pytest.mark.parametrize("name", GENERAL)
def test_every_template_keeps_the_fields_and_renders_on_the_tiny_tokenizer(name, llama):
    task = load_task(name)
    assert task.n_templates >= 3 and task.has_filler
    texts = set()
    for k in range(task.n_templates):
        t = task.with_template(k)
        assert {task.gate.field, task.rule.field, "filler"} <= set(t.template.fields)
        assert t.template.text.endswith("]]") and "decision" in t.template.span_names
        for v in task.gate.values:
            p = render(t, llama, _values(t, v))
            assert p.span("decision").stop == len(p)  # the decision ends the prompt
            assert len(p.span(task.gate.field)) >= 1
        texts.add(t.template.text)
    assert len(texts) == task.n_templates
    assert task.with_template(0).template == load_task(name).template  # template 0 is unchanged


@pytest.mark.parametrize("kind", [GATE, RULE])
@pytest.mark.parametrize("template", [0, 1, 2, 3])
def test_order_cancel_templates_align_on_the_tiny_tokenizer(llama, template, kind):
    task = load_task("order-cancel")
    for filler in ("", "Note 1: The warehouse restocks its shelves.\n"):
        for p in sample(task, llama, 4, template=template, kind=kind, filler=filler):
            assert p.template == template and p.old.spans == p.new.spans
            diff = [j for j, (a, b) in enumerate(zip(p.old.ids, p.new.ids)) if a != b]
            assert diff and set(diff) <= set(p.field_span)
            assert p.downstream()


@pytest.mark.parametrize(
    "name,error",
    [("account-access", TokenCountChanged), ("refund-window", TaskError)],
    ids=["account-access: admin/viewer differ", "refund-window: ' refund' is 3 tokens"],
)
def test_tiny_tokenizer_limits_are_the_same_for_every_template(llama, name, error):
    # the tiny BPE splits these values (or answers) unevenly, as it does for template 0
    for k in range(load_task(name).n_templates):
        with pytest.raises(error):
            sample(load_task(name), llama, 1, template=k)


def test_pairs_cycle_through_the_templates_balanced_and_seeded(llama):
    task = load_task("order-cancel")
    pairs = sample(task, llama, 8, seed=2)
    assert [p.template for p in pairs] == [0, 1, 2, 3, 1, 2, 3, 0]
    assert [p.old.text for p in pairs] == [p.old.text for p in sample(task, llama, 8, seed=2)]
    for k in range(4):  # each template's pairs go both ways
        mine = [p for p in pairs if p.template == k]
        assert {p.old.values["order_status"] for p in mine} == {"pending", "shipped"}
    # a pair drawn while cycling is the pair its template gives at the same index
    one = sample(task, llama, 8, seed=2, template=0)
    assert [p.old.ids for p in pairs if p.template == 0] == [one[0].old.ids, one[7].old.ids]


def test_template_zero_reproduces_the_one_template_task(llama):
    task = load_task("order-cancel")
    single = Task.from_dict({k: v for k, v in task.to_dict().items() if k != "variants"})
    assert single.n_templates == 1
    old = sample(single, llama, 5, seed=4)
    for kind in (GATE, RULE):
        a = sample(single, llama, 5, seed=4, kind=kind)
        b = sample(task, llama, 5, seed=4, kind=kind, template=0)
        assert [(p.old.ids, p.new.ids, p.expected) for p in a] == [
            (p.old.ids, p.new.ids, p.expected) for p in b
        ]
    assert [p.template for p in old] == [0] * 5


def test_out_of_range_template_says_how_many(llama):
    with pytest.raises(TaskError, match=r"'order-cancel' has 4 template\(s\), numbered 0 to 3"):
        sample(load_task("order-cancel"), llama, 2, template=4)


@pytest.mark.parametrize("name", ORGANISMS)
def test_organism_tasks_keep_one_template(name):
    assert load_task(name).n_templates == 1


GOOD = load_task("order-cancel").to_dict()
T1 = GOOD["variants"][0]


def _variants(*entries):
    return {**GOOD, "variants": list(entries)}


BAD = [
    ("not an array", {**GOOD, "variants": "x"}, r"variants: must be an array of tables"),
    (
        "no template",
        _variants({"shots": T1["shots"]}),
        r"\[\[variants\]\] #1 \(template 1\)\.template: missing",
    ),
    ("template type", _variants({"template": 3}), r"#1 \(template 1\)\.template: must be a string"),
    ("unknown key", _variants(T1, {**T1, "shot": "x"}), r"#2 \(template 2\): \['shot'\]: unknown key"),
    ("shots type", _variants({**T1, "shots": ["x"]}), r"#1 \(template 1\)\.shots: must be a string"),
    (
        "no gate field",
        _variants({**T1, "template": T1["template"].replace("{order_status}", "shipped")}),
        r"#1 \(template 1\)\.template: 'order_status' does not appear",
    ),
    (
        "no filler",
        _variants({**T1, "template": T1["template"].replace("{filler}", "")}),
        r"#1 \(template 1\)\.template: needs a \{filler\} field",
    ),
    (
        "shots field without shots",
        _variants({"template": T1["template"]}),
        r"#1 \(template 1\)\.template: uses \{shots\} but the entry has no `shots = \.\.\.`",
    ),
    (
        "shots without a [shots] table",
        {**_variants(T1), "shots": None},
        r"#1 \(template 1\)\.shots: needs a top-level \[shots\] table",
    ),
    (
        "repeats template 0",
        _variants({"template": GOOD["template"], "shots": GOOD["shots"]["template"]}),
        "repeats template 0",
    ),
    (
        "unknown shot field",
        _variants({**T1, "shots": "{mystery}"}),
        r"#1 \(template 1\)\.shots: field\(s\) \['mystery'\]",
    ),
]


@pytest.mark.parametrize("data,pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_variants_name_the_entry(tmp_path, data, pattern):
    import tomli_w

    data = {k: v for k, v in data.items() if v is not None}
    if "shots" not in data:  # template 0 without examples, so only the variant's shots are wrong
        data["template"] = data["template"].replace("{shots}", "")
    path = tmp_path / "bad.toml"
    path.write_text(tomli_w.dumps(data))
    with pytest.raises(TaskError, match=pattern) as info:
        load_task(str(path))
    assert str(path) in str(info.value) and "docs/tasks.md" in str(info.value)


def test_variants_round_trip_through_a_file(tmp_path):
    import tomli_w

    path = tmp_path / "task.toml"
    path.write_text(tomli_w.dumps(GOOD))
    again = load_task(str(path))
    assert again.to_dict() == GOOD and again.n_templates == 4
    assert again.with_template(2).shots is None and again.with_template(1).shots.count == 4


@pytest.mark.gemma
def test_every_template_renders_and_aligns_on_gemma(gemma):
    # tokenization only: no forward pass
    for name in GENERAL:
        task = load_task(name)
        for k in range(task.n_templates):
            for kind in (GATE, RULE):
                for p in sample(
                    task, gemma, 4, template=k, kind=kind, filler="Note 1: Parcels are weighed.\n"
                ):
                    assert p.old.spans == p.new.spans and p.old.ids[0] == 2


def test_docs_variants_example_loads(tmp_path):
    import re
    from pathlib import Path

    blocks = re.findall(
        r"```toml\n(.*?)```", (Path(__file__).parents[2] / "docs" / "tasks.md").read_text(), re.S
    )
    path = tmp_path / "task.toml"
    path.write_text(blocks[0] + "\n" + blocks[1])  # the complete example, then its [[variants]]
    task = load_task(str(path))
    assert task.n_templates == 3 and task.with_template(2).shots is None
