"""`Task`: a gated decision — a template, one gating field, two answers, and a rule that flips.

A task is data, not code: built-in tasks are TOML files in `kvnotes/tasks/builtin/`, and a
user's task file has the same schema (documented with a complete example in `docs/tasks.md`).
Every key is checked when the file is read, and an error names the key, the problem and the fix.

A task may word its prompt several ways: the top-level `template` (and `[shots]`) is template 0,
and each `[[variants]]` entry adds one more (template 1, 2, ...) with the same fields, so that a
figure over pairs is not a figure about one wording.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, overload

from kvnotes.errors import TaskError, UnknownTaskError
from kvnotes.prompt import Template
from kvnotes.tasks.pairs import PairSet, is_pairs, load_pairs

BUILTIN_DIR = Path(__file__).parent / "builtin"
RESERVED = ("shots", "filler")  # template fields the sampler fills itself


@dataclass(frozen=True, kw_only=True)
class Gate:
    """The gating field: its values, and which answer each value leads to under the written rule."""

    field: str
    values: tuple[str, ...]
    outcomes: tuple[int, ...]  # outcomes[i] indexes Task.answers for values[i]


@dataclass(frozen=True, kw_only=True)
class Rule:
    """The rule span: a template field whose one flip (written → flipped) inverts every outcome."""

    field: str
    values: tuple[str, str]  # (as written, flipped)


@dataclass(frozen=True, kw_only=True)
class Shots:
    """Few-shot examples: `count` renderings of `template`, each a solved case, in shuffled order."""

    template: str
    count: int


@dataclass(frozen=True, kw_only=True)
class Variant:
    """Another wording of the task's prompt (template 1, 2, ...): its `template`, and `shots`, the
    template of its own few-shot examples (their count is the task's `[shots].count`), or None
    for a variant without examples."""

    template: Template
    shots: str | None = None


@dataclass(frozen=True, kw_only=True)
class Digits:
    """A random decimal id with `n` digits (the first non-zero), e.g. an order id."""

    n: int


@dataclass(frozen=True, kw_only=True)
class Task:
    """A gated decision (see the module docstring). Build one with `load_task`.

    >>> task = load_task("order-cancel")
    >>> task.gate.field, task.gate.values, task.answers
    ('order_status', ('pending', 'shipped'), (' cancel', ' deny'))
    """

    name: str
    description: str = ""
    template: Template
    answers: tuple[str, str]
    gate: Gate
    rule: Rule | None = None
    shots: Shots | None = None
    vary: Mapping[str, tuple[str, ...] | Digits] = field(default_factory=dict)
    model: str | None = None  # the model this task is made for (organisms), or None for any
    source: str = ""  # the file it came from
    variants: tuple[Variant, ...] = ()  # templates 1, 2, ... (template 0 is `template`/`shots`)

    @property
    def n_templates(self) -> int:
        """How many wordings the task has: 1 + its variants."""
        return 1 + len(self.variants)

    def with_template(self, i: int) -> Task:
        """The task with template `i` as its only one (0: `template` and `shots`; i ≥ 1: variant i).

        >>> t = load_task("order-cancel")
        >>> t.n_templates > 1, t.with_template(0).template == t.template, t.with_template(1).n_templates
        (True, True, 1)
        """
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_templates:
            raise TaskError(
                f"task {self.name!r} has {self.n_templates} template(s), numbered 0 to "
                f"{self.n_templates - 1}; template {i!r} does not exist (omit it to draw pairs "
                "across all of them)"
            )
        if i == 0:
            return replace(self, variants=())
        v = self.variants[i - 1]
        shots = None if v.shots is None else Shots(template=v.shots, count=self.shots.count)
        return replace(self, template=v.template, shots=shots, variants=())

    def outcome(self, value: str, rule: str | None = None) -> int:
        """Index of the answer that `value` of the gating field leads to under `rule`."""
        i = self.gate.outcomes[self.gate.values.index(value)]
        if rule is not None and self.rule is not None and rule == self.rule.values[1]:
            i = 1 - i
        return i

    @property
    def has_filler(self) -> bool:
        return "filler" in self.template.fields

    def to_dict(self) -> dict:
        """The task as a TOML-shaped dict (what `from_dict` and task files accept)."""
        d: dict = {
            "name": self.name,
            "description": self.description,
            "template": self.template.text,
            "answers": list(self.answers),
            "gate": {
                "field": self.gate.field,
                "values": list(self.gate.values),
                "outcomes": list(self.gate.outcomes),
            },
        }
        if self.model:
            d["model"] = self.model
        if self.rule:
            d["rule"] = {"field": self.rule.field, "values": list(self.rule.values)}
        if self.shots:
            d["shots"] = {"template": self.shots.template, "count": self.shots.count}
        if self.vary:
            d["vary"] = {
                k: ({"digits": v.n} if isinstance(v, Digits) else list(v)) for k, v in self.vary.items()
            }
        if self.variants:
            d["variants"] = [
                {"template": v.template.text, **({} if v.shots is None else {"shots": v.shots})}
                for v in self.variants
            ]
        return d

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "<dict>") -> Task:
        return _parse(d, source)


# --- loading -------------------------------------------------------------------------------
def builtin_tasks() -> list[str]:
    """Names of the built-in tasks."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


TaskSource = Task | PairSet  # what the trial-based analyses take: a gated-decision task or a pair dataset


def load_task(name_or_path: str | Path | TaskSource) -> TaskSource:
    """A built-in task by name (`builtin_tasks()`), or a task from a TOML file; a `.jsonl` path is
    a pair dataset (`kvnotes.tasks.pairs.load_pairs`), and a Task or PairSet is returned as it is.

    >>> [t for t in builtin_tasks() if not t.endswith("organism")]
    ['account-access', 'order-cancel', 'refund-window']
    """
    if isinstance(name_or_path, Task) or is_pairs(name_or_path):  # a PairSet stands where a Task does
        return name_or_path
    s = str(name_or_path)
    path = Path(s).expanduser()
    if s.endswith(".jsonl"):  # a pair dataset (docs/tasks.md, Pair datasets)
        return load_pairs(path)
    if not s.endswith(".toml"):
        if (BUILTIN_DIR / f"{s}.toml").is_file():
            path = BUILTIN_DIR / f"{s}.toml"
        else:
            raise UnknownTaskError(
                f"unknown task {s!r}: built-in tasks are {builtin_tasks()}; or pass a task file "
                "(`something.toml`, schema in docs/tasks.md)"
            )
    if not path.is_file():
        raise UnknownTaskError(
            f"task file {s!r} does not exist; pass the path of a task .toml (schema in docs/tasks.md) "
            f"or a built-in task: {', '.join(builtin_tasks())}"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"task file {s}: not valid TOML ({e}); see docs/tasks.md for the schema") from None
    return _parse(data, str(path))


_KNOWN = {"name", "description", "template", "answers", "gate", "rule", "shots", "vary", "model", "variants"}


@dataclass(frozen=True)
class _Reader:
    """Reads one task file's values, each error naming the file, the key and the way out."""

    d: Mapping
    src: str

    def fail(self, key: str, problem: str) -> TaskError:
        return TaskError(f"task file {self.src}: {key}: {problem} (schema: docs/tasks.md)")

    def need(self, table: Mapping, key: str, kind: type, where: str = ""):
        full = f"{where}{key}"
        if key not in table:
            raise self.fail(full, f"missing; add `{key} = ...`" + (f" under [{where[:-1]}]" if where else ""))
        v = table[key]
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise self.fail(full, f"must be {_kind(kind)}, got {type(v).__name__} {v!r}")
        return v

    def strings(self, table: Mapping, key: str, where: str, at_least: int) -> tuple[str, ...]:
        v = self.need(table, key, list, where)
        if len(v) < at_least or not all(isinstance(x, str) and x for x in v):
            raise self.fail(
                f"{where}{key}", f"must be a list of at least {at_least} non-empty strings, got {v!r}"
            )
        if len(set(v)) != len(v):
            raise self.fail(f"{where}{key}", f"values repeat: {v!r}")
        return tuple(v)

    @overload
    def table(self, key: str, required: Literal[True]) -> Mapping: ...

    @overload
    def table(self, key: str, required: bool) -> Mapping | None: ...

    def table(self, key: str, required: bool) -> Mapping | None:
        d = self.d
        if key not in d:
            if required:
                raise self.fail(f"[{key}]", "missing table")
            return None
        if not isinstance(d[key], Mapping):
            raise self.fail(f"[{key}]", f"must be a table, got {type(d[key]).__name__}")
        return d[key]


def load_gated_task(name_or_path: str | Path | TaskSource, what: str = "this") -> Task:
    """`load_task`, where a gated-decision `Task` is needed (a rule, templates, a gate): a pair
    dataset is refused, naming it and `what` needed the task.

    >>> load_gated_task("order-cancel").gate.field
    'order_status'
    """
    task = load_task(name_or_path)
    if not isinstance(task, Task):
        raise TaskError(
            f"{what} needs a gated-decision task (a built-in task or a task.toml, docs/tasks.md), and "
            f"{task.name!r} is a pair dataset"
        )
    return task


def _parse(d: Mapping, src: str) -> Task:
    """A task from a task file's parsed TOML, checked key by key (`_Reader`) and then as a whole."""
    r = _Reader(d, src)
    unknown = sorted(set(d) - _KNOWN)
    if unknown:
        raise r.fail(str(unknown), f"unknown key(s); the known top-level keys are {sorted(_KNOWN)}")
    name = r.need(d, "name", str)
    text = r.need(d, "template", str)
    try:
        template = Template(text)
    except ValueError as e:
        raise r.fail("template", str(e)) from None
    answers = r.strings(d, "answers", "", 2)
    if len(answers) != 2:
        raise r.fail("answers", f"a gated decision has exactly two answers, got {len(answers)}")
    gate = _parse_gate(r)
    rule = _parse_rule(r)
    shots = _parse_shots(r)
    vary = _parse_vary(r)
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise r.fail("model", f"must be a model name string, got {model!r}")
    variants = _parse_variants(d.get("variants", []), r.fail)
    task = Task(
        name=name,
        description=str(d.get("description", "")),
        template=template,
        answers=answers,
        gate=gate,
        rule=rule,
        shots=shots,
        vary=vary,
        model=model,
        source=src,
        variants=variants,
    )
    _check_fields(task, r.fail)
    _check_variants(task, r.fail)
    return task


def _parse_gate(r: _Reader) -> Gate:
    """`[gate]`: the field whose value gates the decision, its values and the answer each leads to."""
    g = r.table("gate", True)
    gate_field = r.need(g, "field", str, "gate.")
    values = r.strings(g, "values", "gate.", 2)
    outcomes = tuple(g.get("outcomes", range(len(values))))
    if len(outcomes) != len(values) or not all(isinstance(o, int) and o in (0, 1) for o in outcomes):
        raise r.fail(
            "gate.outcomes",
            f"must give one answer index (0 or 1) per value in gate.values, got "
            f"{list(outcomes)!r} for {len(values)} values",
        )
    if len(set(outcomes)) < 2:
        raise r.fail("gate.outcomes", "every value leads to the same answer, so nothing is gated")
    return Gate(field=gate_field, values=values, outcomes=outcomes)


def _parse_rule(r: _Reader) -> Rule | None:
    """`[rule]` (optional): a field whose two values, as written and flipped, invert the gate."""
    if (t := r.table("rule", False)) is None:
        return None
    rv = r.strings(t, "values", "rule.", 2)
    if len(rv) != 2:
        raise r.fail("rule.values", f"must be exactly two strings (as written, flipped), got {list(rv)!r}")
    return Rule(field=r.need(t, "field", str, "rule."), values=rv)


def _parse_shots(r: _Reader) -> Shots | None:
    """`[shots]` (optional): the worked-example template and how many examples precede the prompt."""
    if (s := r.table("shots", False)) is None:
        return None
    count = r.need(s, "count", int, "shots.")
    if count < 1:
        raise r.fail("shots.count", f"must be at least 1, got {count}")
    return Shots(template=r.need(s, "template", str, "shots."), count=count)


def _parse_vary(r: _Reader) -> dict[str, tuple[str, ...] | Digits]:
    """`[vary]` (optional): each other field's values, a list of strings or `{ digits = N }`."""
    vary: dict[str, tuple[str, ...] | Digits] = {}
    for k, v in (r.table("vary", False) or {}).items():
        digits = v.get("digits") if isinstance(v, Mapping) and set(v) == {"digits"} else None
        if isinstance(digits, int) and not isinstance(digits, bool) and 1 <= digits <= 12:
            vary[k] = Digits(n=v["digits"])
        elif isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            vary[k] = tuple(v)
        else:
            raise r.fail(f"vary.{k}", f"must be a non-empty list of strings or {{ digits = N }}, got {v!r}")
    return vary


def _parse_variants(raw, fail) -> tuple[Variant, ...]:
    """The `[[variants]]` entries: each a table with `template` and an optional `shots` string."""
    if not isinstance(raw, list) or not all(isinstance(v, Mapping) for v in raw):
        raise fail(
            "variants",
            f"must be an array of tables, one `[[variants]]` block per extra template, got {raw!r}",
        )
    out = []
    for k, v in enumerate(raw, start=1):
        where = f"[[variants]] #{k} (template {k})"
        unknown = sorted(set(v) - {"template", "shots"})
        if unknown:
            raise fail(f"{where}: {unknown}", "unknown key(s); a variant has `template` and optional `shots`")
        text = v.get("template")
        if not isinstance(text, str):
            raise fail(
                f"{where}.template",
                'missing; add `template = """..."""` (the prompt in this wording) to the entry'
                if text is None
                else f"must be a string, got {type(text).__name__} {text!r}",
            )
        shots = v.get("shots")
        if shots is not None and not isinstance(shots, str):
            raise fail(
                f"{where}.shots",
                f"must be a string (one few-shot example in this variant's layout), got {shots!r}",
            )
        try:
            out.append(Variant(template=Template(text), shots=shots))
        except ValueError as e:
            raise fail(f"{where}.template", str(e)) from None
    return tuple(out)


def _check_fields(task: Task, fail) -> None:
    named = [(task.gate.field, "gate.field")] + ([(task.rule.field, "rule.field")] if task.rule else [])
    for f, where in named:
        if f not in task.template.fields:
            raise fail(where, f"{f!r} does not appear in the template as {{{f}}}")
    _check_template(task, task.template, task.shots.template if task.shots else None, fail)


def _check_template(task: Task, template: Template, shots: str | None, fail, where: str = "") -> None:
    """One template (and its few-shot template) against the task's fields; `where` names a
    variant's entry ("" for template 0, whose keys are `template` and `shots`)."""
    at_t, at_s = (f"{where}.template", f"{where}.shots") if where else ("template", "shots.template")
    provided = {task.gate.field, *task.vary, *RESERVED}
    if task.rule:
        provided.add(task.rule.field)
    missing = [f for f in template.fields if f not in provided]
    if missing:
        raise fail(
            at_t,
            f"field(s) {missing} have no values; add them under [vary] "
            f"(or make one the [gate] or [rule] field)",
        )
    if "decision" not in template.span_names:
        raise fail(at_t, "needs a [[decision: ...]] span: the tokens the answer is read after")
    if shots is not None:
        if "shots" not in template.fields:
            raise fail(
                f"{where}.shots" if where else "shots",
                "a `shots` template needs a {shots} field in this variant's template to go into"
                if where
                else "a [shots] table needs a {shots} field in the template to go into",
            )
        try:
            shot_fields = Template(shots).fields
        except ValueError as e:
            raise fail(at_s, str(e)) from None
        bad = [f for f in shot_fields if f not in {task.gate.field, "answer", "filler", *task.vary}]
        if bad:
            raise fail(
                at_s,
                f"field(s) {bad} unknown; a shot may use {{{task.gate.field}}}, "
                "{answer}, {filler} and the [vary] fields",
            )
    elif "shots" in template.fields:
        lacks = "the entry has no `shots = ...`" if where else "the file has no [shots] table"
        raise fail(at_t, f"uses {{shots}} but {lacks}")


def _check_variants(task: Task, fail) -> None:
    """Every variant keeps the gate and rule fields, {filler} exactly when template 0 has it, and
    its own few-shot layout; no two templates are the same."""
    texts = [task.template.text]
    for k, v in enumerate(task.variants, start=1):
        where = f"[[variants]] #{k} (template {k})"
        for f in [task.gate.field] + ([task.rule.field] if task.rule else []):
            if f not in v.template.fields:
                raise fail(
                    f"{where}.template",
                    f"{f!r} does not appear in it as {{{f}}}; every template needs the gate and rule fields",
                )
        if ("filler" in v.template.fields) != task.has_filler:
            raise fail(
                f"{where}.template",
                "has {filler} but template 0 does not; add it to every template or to none"
                if not task.has_filler
                else "needs a {filler} field like template 0 (the regime sweep fills it): put it "
                "after the gate field, before the query",
            )
        if v.shots is not None and task.shots is None:
            raise fail(
                f"{where}.shots",
                "needs a top-level [shots] table: its `count` is the number of examples of every template",
            )
        _check_template(task, v.template, v.shots, fail, where)
        if v.template.text in texts:
            raise fail(
                f"{where}.template",
                f"repeats template {texts.index(v.template.text)}; give it its own wording",
            )
        texts.append(v.template.text)


def _kind(t: type) -> str:
    return {str: "a string", int: "an integer", list: "a list", dict: "a table"}.get(t, t.__name__)
