"""Pair datasets: clean/corrupt prompt pairs of any shape (IOI, greater-than), read from JSONL.

One JSON object a line (schema and a worked example: docs/tasks.md, "Pair datasets"):

    {"clean": "When Mary and John went to the store, John gave a drink to",
     "corrupt": "When Mary and John went to the store, Bob gave a drink to",
     "correct": " Mary", "wrong": " John", "group": "ioi-0"}

A `PairSet` stands wherever a `Task` does in the trial-based analyses (`kvnotes.analysis.trials.make_trials`,
the runner's `Context.task`): its pairs are `kvnotes.tasks.Pair`s whose old prompt is the corrupt
one and whose new prompt is the clean one (the patch source), with answers (correct, wrong), the
positions where the two differ as the `changed` span and the last token as the `decision` span. An
analysis that needs a task's gated rule or its template refuses a PairSet before any compute
(`kvnotes.analysis.registry.Need`).

    >>> from kvnotes import load_model
    >>> ps = PairSet.from_records([{"clean": "Status: pending. Reply:", "corrupt": "Status: shipped. Reply:",
    ...     "correct": " cancel", "wrong": " deny"}], name="toy")
    >>> pair = ps.sample(load_model("tiny-llama"), 1)[0]
    >>> pair.old.text, pair.new.spans, pair.expected
    ('Status: shipped. Reply:', {'changed': (4, 5), 'decision': (10, 11)}, (1, 0))
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvnotes.errors import BadArgument, PairsError
from kvnotes.prompt import Prompt, Template, _tokenize
from kvnotes.tasks.pair import Pair

PAIRS = "pairs"  # the `kind` of a pair read from a pair dataset (a task's pairs are "gate" or "rule")
CHANGED, DECISION = "changed", "decision"  # the spans every pair has, computed from its prompts
KEYS = ("clean", "corrupt", "correct", "wrong")
OPTIONAL = ("spans", "group")
SCHEMA = "schema: docs/tasks.md, Pair datasets"


@dataclass(frozen=True, kw_only=True)
class PairRecord:
    """One line of a pair dataset: two prompt texts, two one-token answers, named token spans.

    `line` is its 1-based line in the file (its 1-based index for records given in memory), the
    number every error about it names."""

    clean: str
    corrupt: str
    correct: str
    wrong: str
    spans: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    group: str | None = None
    line: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in KEYS}
        if self.spans:
            out["spans"] = {k: list(v) for k, v in self.spans.items()}
        if self.group is not None:
            out["group"] = self.group
        return out


@dataclass(frozen=True)
class PairSet:
    """A pair dataset: clean/corrupt prompt pairs with per-pair answers, usable wherever the
    trial-based analyses take a task (`make_trials(model, pairset, n)`, `collect(model, pairset,
    ["edges"])`). Build one with `load_pairs(path)` or `PairSet.from_records(records, name=...)`.

    `groups` are the distinct `group` ids in file order; a pair's `template` is its group's index,
    so `clusters_of(trials)` clusters CIs by group and `template=i` draws from group i alone."""

    name: str
    records: tuple[PairRecord, ...]
    source: str = "<records>"
    model: str | None = None  # a Task's field: the model it was made for (none here)

    def __post_init__(self):
        if not self.records:
            raise PairsError(
                f"pair dataset {self.source}: no pairs; give at least one line "
                f'{{"clean": ..., "corrupt": ..., "correct": ..., "wrong": ...}} ({SCHEMA})'
            )

    @classmethod
    def from_records(
        cls, records: Iterable[Mapping[str, Any]], *, name: str = "pairs", source: str = "<records>"
    ) -> PairSet:
        """A PairSet from in-memory records (dicts with the JSONL keys), checked as a file's lines are."""
        return cls(
            name=name, records=tuple(_record(r, i + 1, source) for i, r in enumerate(records)), source=source
        )

    def __len__(self) -> int:
        return len(self.records)

    @property
    def groups(self) -> tuple[str | None, ...]:
        seen: list[str | None] = []
        for r in self.records:
            if r.group not in seen:
                seen.append(r.group)
        return tuple(seen)

    @property
    def n_templates(self) -> int:
        return len(self.groups)

    def write(self, path: str | Path) -> Path:
        """Write the pairs as JSONL (one object a line), readable by `load_pairs`."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in self.records), encoding="utf-8")
        return path

    def check(self, model) -> None:
        """Check every pair under `model`'s tokenizer (token counts, one-token answers, spans in
        range), raising a `PairsError` that names the line; nothing is computed."""
        for r in self.records:
            _pair(self, r, model)

    def sample(self, model, n: int | None = None, *, seed: int = 0, template: int | None = None) -> list:
        """`n` pairs (default: all) as `kvnotes.tasks.Pair`s, every pair of the set checked first.

        seed 0 takes them in file order, another seed in a seeded shuffle; `template=i` takes only
        group i's pairs. Asking for more pairs than there are is an error naming how many there are."""
        self.check(model)  # every line, before any compute
        pool = list(self.records)
        if template is not None:
            if not 0 <= template < self.n_templates:
                raise BadArgument(
                    f"pair dataset {self.source} has {self.n_templates} group(s) "
                    f"({list(self.groups)}); give a group index 0..{self.n_templates - 1}"
                )
            pool = [r for r in pool if r.group == self.groups[template]]
        n = len(pool) if n is None else n
        if not 1 <= n <= len(pool):
            where = "" if template is None else f" in group {self.groups[template]!r}"
            raise BadArgument(
                f"pair dataset {self.source} has {len(pool)} pair(s){where}; ask for 1 to {len(pool)} "
                f"(got n={n}), or add pairs to the file"
            )
        if seed:
            random.Random(f"{self.name}/{seed}").shuffle(pool)
        return [_pair(self, r, model) for r in pool[:n]]


def load_pairs(
    path_or_records: str | Path | Iterable[Mapping[str, Any]] | PairSet, *, name: str | None = None
) -> PairSet:
    """A pair dataset from a JSONL file (or from records in memory), checked line by line.

    Structure is checked here (JSON, keys, types, identical prompts, span shapes); what needs the
    tokenizer (equal token counts, one-token answers, spans in range) when its pairs are drawn for a
    model (`PairSet.check(model)`, `sample`), before any prefill. `name` defaults to the file's stem.
    """
    if isinstance(path_or_records, PairSet):
        return path_or_records
    if not isinstance(path_or_records, (str, Path)):
        return PairSet.from_records(path_or_records, name=name or "pairs")
    path = Path(path_or_records).expanduser()
    src = str(path_or_records)
    if not path.is_file():
        raise PairsError(f"pair dataset {src} does not exist; pass the path of a .jsonl file ({SCHEMA})")
    records = []
    for i, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise PairsError(
                f"pair dataset {src}, line {i}: not valid JSON ({e.msg} at column {e.colno}); "
                f"write one JSON object per line ({SCHEMA})"
            ) from None
        records.append(_record(obj, i, src))
    if not records:
        raise PairsError(
            f"pair dataset {src} is empty; write one JSON object per line with {', '.join(KEYS)} ({SCHEMA})"
        )
    return PairSet(name=name or path.stem, records=tuple(records), source=src)


def _record(obj: Any, line: int, src: str) -> PairRecord:
    """One line's object as a `PairRecord`, its structure checked (no tokenizer needed)."""
    at = f"pair dataset {src}, line {line}"
    if not isinstance(obj, Mapping):
        raise PairsError(f"{at}: expected a JSON object, got {type(obj).__name__}; {SCHEMA}")
    missing = [k for k in KEYS if k not in obj]
    if missing:
        raise PairsError(f"{at}: missing key(s) {missing}; every line needs {list(KEYS)} ({SCHEMA})")
    unknown = sorted(set(obj) - set(KEYS) - set(OPTIONAL))
    if unknown:
        raise PairsError(f"{at}: unknown key(s) {unknown}; the keys are {list(KEYS + OPTIONAL)} ({SCHEMA})")
    bad = [k for k in KEYS if not isinstance(obj[k], str) or not obj[k]]
    if bad:
        raise PairsError(f"{at}: {bad} must be non-empty strings ({SCHEMA})")
    if obj["clean"] == obj["corrupt"]:
        raise PairsError(
            f"{at}: clean and corrupt are the same text, so nothing changes between them; "
            "make corrupt differ where the answer should turn"
        )
    if obj["correct"] == obj["wrong"]:
        raise PairsError(f"{at}: correct and wrong are both {obj['correct']!r}; give two different answers")
    group = obj.get("group")
    if group is not None and not isinstance(group, (str, int)):
        raise PairsError(f"{at}: group must be a string or an integer (a template id), got {group!r}")
    return PairRecord(
        clean=obj["clean"],
        corrupt=obj["corrupt"],
        correct=obj["correct"],
        wrong=obj["wrong"],
        spans=_spans(obj.get("spans") or {}, at),
        group=None if group is None else str(group),
        line=line,
    )


def _spans(spans: Any, at: str) -> dict[str, tuple[int, int]]:
    if not isinstance(spans, Mapping):
        raise PairsError(f"{at}: spans must be an object {{name: [start, stop]}}, got {spans!r}")
    out = {}
    for k, v in spans.items():
        if k in (CHANGED, DECISION):
            raise PairsError(
                f"{at}: span name {k!r} is reserved (computed from the prompts); rename your span"
            )
        ok = isinstance(v, Sequence) and len(v) == 2 and all(type(x) is int for x in v)
        if not ok or not 0 <= v[0] < v[1]:
            raise PairsError(
                f"{at}: span {k!r} must be [start, stop] token indices with 0 <= start < stop "
                f"(BOS counted), got {v!r}"
            )
        out[str(k)] = (v[0], v[1])
    return out


def _pair(ps: PairSet, r: PairRecord, model) -> Pair:
    """Record `r` as a `Pair` under `model`'s tokenizer; a `PairsError` naming its line otherwise."""
    at = f"pair dataset {ps.source}, line {r.line}"
    clean, corrupt = (_prompt(model, text) for text in (r.clean, r.corrupt))
    if len(clean.ids) != len(corrupt.ids):
        raise PairsError(
            f"{at}: clean is {len(clean.ids)} tokens and corrupt {len(corrupt.ids)} under "
            f"{model.name}'s tokenizer, so slots do not line up; reword corrupt to {len(clean.ids)} tokens"
        )
    diff = [i for i, (a, b) in enumerate(zip(clean.ids, corrupt.ids)) if a != b]
    if not diff:
        raise PairsError(f"{at}: clean and corrupt tokenize the same; make corrupt differ in a token")
    last = len(clean.ids) - 1
    if diff[-1] == last:
        raise PairsError(
            f"{at}: clean and corrupt differ at their last token, where the decision is read; "
            "end both with the same token (the decision reads the next-token logits there)"
        )
    try:
        answers = (model.answer_token(r.correct), model.answer_token(r.wrong))
    except BadArgument as e:
        raise PairsError(f"{at}: {e}") from None
    for k, (a, b) in r.spans.items():
        if b > len(clean.ids):
            raise PairsError(
                f"{at}: span {k!r} [{a}, {b}] is out of range: the prompt has {len(clean.ids)} "
                f"tokens (BOS counted), so stop must be at most {len(clean.ids)}"
            )
    spans = {**r.spans, CHANGED: (diff[0], diff[-1] + 1), DECISION: (last, last + 1)}
    clean, corrupt = (_with_spans(p, spans) for p in (clean, corrupt))
    return Pair(
        task=ps.name,
        kind=PAIRS,
        changed=CHANGED,
        old=corrupt,
        new=clean,
        answers=answers,
        expected=(1, 0),  # corrupt leans away from the correct answer, clean toward it
        seed=0,
        template=ps.groups.index(r.group),
    )


def _prompt(model, text: str) -> Prompt:
    """`text` tokenized as a prompt (BOS first where the tokenizer has one), with no spans yet."""
    ids, offsets = _tokenize(model, text)
    literal = text.replace("{", "{{").replace("}", "}}")
    template = Template(literal) if "[[" not in text and "]]" not in text else Template("")
    return Prompt(
        text=text,
        ids=tuple(ids),
        spans={},
        char_spans={},
        values={},
        template=template,
        offsets=tuple(offsets),
    )


def _with_spans(p: Prompt, spans: Mapping[str, tuple[int, int]]) -> Prompt:
    chars = {k: (p.offsets[a][0], p.offsets[b - 1][1]) for k, (a, b) in spans.items()}
    return Prompt(
        text=p.text,
        ids=p.ids,
        spans=dict(spans),
        char_spans=chars,
        values={},
        template=p.template,
        offsets=p.offsets,
    )


def is_pairs(task: Any) -> bool:
    """Whether `task` is a pair dataset (a `PairSet`) rather than a gated-decision `Task`."""
    return isinstance(task, PairSet)


__all__ = ["PairRecord", "PairSet", "load_pairs", "is_pairs", "PAIRS"]
