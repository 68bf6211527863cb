"""`Task`: a gated decision — a template, one gating field, two answers, and a rule that flips.

A task is data, not code: built-in tasks are TOML files in `kvnotes/tasks/builtin/`, and a
user's task file has the same schema (documented with a complete example in `docs/tasks.md`).
Every key is checked when the file is read, and an error names the key, the problem and the fix.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvnotes.errors import TaskError, UnknownTaskError
from kvnotes.prompt import Template

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
        return d

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "<dict>") -> Task:
        return _parse(d, source)


# --- loading -------------------------------------------------------------------------------
def builtin_tasks() -> list[str]:
    """Names of the built-in tasks."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def load_task(name_or_path: str | Path | Task) -> Task:
    """A built-in task by name (`builtin_tasks()`), or a task from a TOML file.

    >>> [t for t in builtin_tasks() if not t.endswith("organism")]
    ['account-access', 'order-cancel', 'refund-window']
    """
    if isinstance(name_or_path, Task):
        return name_or_path
    s = str(name_or_path)
    path = Path(s).expanduser()
    if not s.endswith(".toml"):
        if (BUILTIN_DIR / f"{s}.toml").is_file():
            path = BUILTIN_DIR / f"{s}.toml"
        else:
            raise UnknownTaskError(
                f"unknown task {s!r}: built-in tasks are {builtin_tasks()}; or pass a task file "
                "(`something.toml`, schema in docs/tasks.md)"
            )
    if not path.is_file():
        raise UnknownTaskError(f"task file {s!r} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"task file {s}: not valid TOML ({e}); see docs/tasks.md for the schema") from None
    return _parse(data, str(path))


def _parse(d: Mapping, src: str) -> Task:
    def fail(key: str, problem: str) -> TaskError:
        return TaskError(f"task file {src}: {key}: {problem} (schema: docs/tasks.md)")

    def need(table: Mapping, key: str, kind: type, where: str = ""):
        full = f"{where}{key}"
        if key not in table:
            raise fail(full, f"missing; add `{key} = ...`" + (f" under [{where[:-1]}]" if where else ""))
        v = table[key]
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise fail(full, f"must be {_kind(kind)}, got {type(v).__name__} {v!r}")
        return v

    def strings(table: Mapping, key: str, where: str, at_least: int) -> tuple[str, ...]:
        v = need(table, key, list, where)
        if len(v) < at_least or not all(isinstance(x, str) and x for x in v):
            raise fail(f"{where}{key}", f"must be a list of at least {at_least} non-empty strings, got {v!r}")
        if len(set(v)) != len(v):
            raise fail(f"{where}{key}", f"values repeat: {v!r}")
        return tuple(v)

    def table(key: str, required: bool) -> Mapping | None:
        if key not in d:
            if required:
                raise fail(f"[{key}]", "missing table")
            return None
        if not isinstance(d[key], Mapping):
            raise fail(f"[{key}]", f"must be a table, got {type(d[key]).__name__}")
        return d[key]

    known = {"name", "description", "template", "answers", "gate", "rule", "shots", "vary", "model"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise fail(str(unknown), f"unknown key(s); the known top-level keys are {sorted(known)}")
    name = need(d, "name", str)
    text = need(d, "template", str)
    try:
        template = Template(text)
    except ValueError as e:
        raise fail("template", str(e)) from None
    answers = strings(d, "answers", "", 2)
    if len(answers) != 2:
        raise fail("answers", f"a gated decision has exactly two answers, got {len(answers)}")

    g = table("gate", True)
    gate_field = need(g, "field", str, "gate.")
    values = strings(g, "values", "gate.", 2)
    outcomes = tuple(g.get("outcomes", range(len(values))))
    if len(outcomes) != len(values) or not all(isinstance(o, int) and o in (0, 1) for o in outcomes):
        raise fail(
            "gate.outcomes",
            f"must give one answer index (0 or 1) per value in gate.values, got "
            f"{list(outcomes)!r} for {len(values)} values",
        )
    if len(set(outcomes)) < 2:
        raise fail("gate.outcomes", "every value leads to the same answer, so nothing is gated")
    gate = Gate(field=gate_field, values=values, outcomes=outcomes)

    rule = None
    if (r := table("rule", False)) is not None:
        rv = strings(r, "values", "rule.", 2)
        if len(rv) != 2:
            raise fail("rule.values", f"must be exactly two strings (as written, flipped), got {list(rv)!r}")
        rule = Rule(field=need(r, "field", str, "rule."), values=rv)

    shots = None
    if (s := table("shots", False)) is not None:
        count = need(s, "count", int, "shots.")
        if count < 1:
            raise fail("shots.count", f"must be at least 1, got {count}")
        shots = Shots(template=need(s, "template", str, "shots."), count=count)

    vary: dict[str, tuple[str, ...] | Digits] = {}
    for k, v in (table("vary", False) or {}).items():
        digits = v.get("digits") if isinstance(v, Mapping) and set(v) == {"digits"} else None
        if isinstance(digits, int) and not isinstance(digits, bool) and 1 <= digits <= 12:
            vary[k] = Digits(n=v["digits"])
        elif isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            vary[k] = tuple(v)
        else:
            raise fail(f"vary.{k}", f"must be a non-empty list of strings or {{ digits = N }}, got {v!r}")

    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise fail("model", f"must be a model name string, got {model!r}")
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
    )
    _check_fields(task, fail)
    return task


def _check_fields(task: Task, fail) -> None:
    named = [(task.gate.field, "gate.field")] + ([(task.rule.field, "rule.field")] if task.rule else [])
    for f, where in named:
        if f not in task.template.fields:
            raise fail(where, f"{f!r} does not appear in the template as {{{f}}}")
    provided = {task.gate.field, *task.vary, *RESERVED}
    if task.rule:
        provided.add(task.rule.field)
    missing = [f for f in task.template.fields if f not in provided]
    if missing:
        raise fail(
            "template",
            f"field(s) {missing} have no values; add them under [vary] "
            f"(or make one the [gate] or [rule] field)",
        )
    if "decision" not in task.template.span_names:
        raise fail("template", "needs a [[decision: ...]] span: the tokens the answer is read after")
    if task.shots:
        if "shots" not in task.template.fields:
            raise fail("shots", "a [shots] table needs a {shots} field in the template to go into")
        try:
            shot_fields = Template(task.shots.template).fields
        except ValueError as e:
            raise fail("shots.template", str(e)) from None
        bad = [f for f in shot_fields if f not in {task.gate.field, "answer", "filler", *task.vary}]
        if bad:
            raise fail(
                "shots.template",
                f"field(s) {bad} unknown; a shot may use {{{task.gate.field}}}, "
                "{answer}, {filler} and the [vary] fields",
            )
    elif "shots" in task.template.fields:
        raise fail("template", "uses {shots} but the file has no [shots] table")


def _kind(t: type) -> str:
    return {str: "a string", int: "an integer", list: "a list", dict: "a table"}.get(t, t.__name__)
