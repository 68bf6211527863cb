"""Typed, JSON-serialisable analysis results: per-prompt values, their mean, a bootstrap 95% CI,
and `SectionReport`, the one container of a report section's results.

A `TaskResult` holds one or more named `Estimate`s ("parts") and says which one is its
headline; `to_dict()` puts the headline's `mean`/`ci`/`values` at the top level and every part
under its own name in the same shape, so `{"mean", "ci", "values"}` reads the same everywhere.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from kvnotes.analysis.codec import decode_fields, expect_shape, field_hints, from_json_value, to_json_value
from kvnotes.analysis.migrate import section_results
from kvnotes.analysis.stats import Curve, Estimate
from kvnotes.display import Displayable
from kvnotes.errors import ResultSchemaError


@runtime_checkable
class Result(Protocol):
    """What every analysis's result is, task-level or model-level: JSON both ways with one signature
    (`from_dict(d)` reads what `to_dict()` wrote) and a notebook view (`_repr_html_`, from
    `kvnotes.display.Displayable`). The registry refuses a result class that does not follow it."""

    def to_dict(self) -> dict: ...

    @classmethod
    def from_dict(cls, d: Mapping) -> Result: ...

    def _repr_html_(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class TaskResult(Displayable):
    """One analysis's figures. The statistics are named `parts` (each an Estimate over prompt
    pairs; `headline` names the one whose mean is the result's `mean`), `curves` and `tables` of
    rows. Everything else an analysis reports is a typed field of its own subclass, declared next
    to the function that computes it (`FieldRefresh`, `ReadHeads`, ...).

    A subclass declares the parts, curves and tables it writes: `PARTS` (always present),
    `PART_PATTERNS` (regular expressions for families such as `layer_3`), `CURVES` and `TABLES`.
    Construction checks them, so a producer cannot write a name that its panel does not read,
    and `part(name)` refuses a name the class does not declare. `to_dict`/`from_dict` round-trip
    exactly; in JSON the headline's `mean`/`ci`/`values` sit at the top level, each part, curve
    and table under its own name, and the typed fields under `details`.
    """

    PARTS: ClassVar[tuple[str, ...]] = ()
    PART_PATTERNS: ClassVar[tuple[str, ...]] = ()
    CURVES: ClassVar[tuple[str, ...]] = ()
    CURVE_PATTERNS: ClassVar[tuple[str, ...]] = ()
    TABLES: ClassVar[tuple[str, ...]] = ()
    OPEN: ClassVar[bool] = False  # True: any part, curve and table names (the generic result)
    # parts measured in-sample (names or patterns): labelled so in tables and listed under
    # `in_sample` in JSON, beside the out-of-sample figures a headline should be
    IN_SAMPLE: ClassVar[tuple[str, ...]] = ()

    name: str
    headline: str
    parts: Mapping[str, Estimate]
    curves: Mapping[str, Curve] = field(default_factory=dict)
    tables: Mapping[str, list] = field(default_factory=dict)
    description: str = ""
    excluded: tuple[Mapping, ...] = ()  # pairs left out, each with its index and the reason
    not_applicable: str | None = None  # why this analysis could not run here (then parts are empty)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.__repr__ = TaskResult.__repr__  # a subclass's dataclass keeps the one-line repr

    def __post_init__(self):
        if self.headline not in self.parts:
            raise ValueError(f"headline {self.headline!r} is not one of the parts {list(self.parts)}")
        names = [*self.parts, *self.curves, *self.tables]
        clash = {n for n in names if names.count(n) > 1} | (set(names) & _RESERVED)
        if clash:
            raise ValueError(
                f"part, curve and table names must be distinct and not reserved: {sorted(clash)}"
            )
        self._check_names()
        for f in self.detail_fields():
            object.__setattr__(
                self, f, from_json_value(field_hints(type(self))[f], to_json_value(getattr(self, f)), f)
            )

    def _check_names(self) -> None:
        if self.OPEN:
            return
        cls = type(self).__name__
        kinds = (
            ("part", self.parts, self.PARTS, self.PART_PATTERNS),
            ("curve", self.curves, self.CURVES, self.CURVE_PATTERNS),
            ("table", self.tables, self.TABLES, ()),
        )
        for kind, have, declared, patterns in kinds:
            extra = [n for n in have if n not in declared and not any(re.fullmatch(p, n) for p in patterns)]
            if extra:
                raise TypeError(
                    f"{cls} does not declare the {kind}(s) {extra}: add them to its "
                    f"{kind.upper()}S (or a pattern) so its panel can read them"
                )
            missing = [] if self.not_applicable else [n for n in declared if n not in have]
            if missing:
                raise TypeError(f"{cls} needs the {kind}(s) {missing}, which the producer did not write")

    @classmethod
    def of(cls, **fields_) -> TaskResult:
        """Construct from plain values (lists, dicts, numpy numbers), each turned into its field's
        declared type first: what producers call."""
        hints = field_hints(cls)  # type: ignore[arg-type]  # a class is hashable; mypy reads its instances' __hash__
        return cls(
            **{
                k: from_json_value(hints[k], to_json_value(v), k) if k in _TYPED_CORE or k not in _CORE else v
                for k, v in fields_.items()
            }
        )

    @classmethod
    def detail_fields(cls) -> list[str]:
        """The typed fields beyond the statistics (saved under `details` in JSON)."""
        return [f.name for f in dataclasses.fields(cls) if f.name not in _CORE]

    def declares(self, part: str) -> bool:
        return self.OPEN or part in self.PARTS or any(re.fullmatch(p, part) for p in self.PART_PATTERNS)

    def part(self, name: str) -> Estimate:
        """The part `name` (an empty Estimate when the analysis could not run or the part is a
        family member not measured); a name the class does not declare is a TypeError."""
        if not self.declares(name):
            raise TypeError(
                f"{type(self).__name__} has no part {name!r}; it declares "
                f"{list(self.PARTS) + list(self.PART_PATTERNS)}"
            )
        return self.parts.get(name) or Estimate.of([])

    def curve(self, name: str) -> Curve | None:
        """The curve `name`, or None where it was not measured; an undeclared name is a TypeError."""
        if not (self.OPEN or name in self.CURVES or any(re.fullmatch(p, name) for p in self.CURVE_PATTERNS)):
            raise TypeError(f"{type(self).__name__} has no curve {name!r}; it declares {list(self.CURVES)}")
        return self.curves.get(name)

    def in_sample(self) -> list[str]:
        """The parts of this result measured in-sample (`IN_SAMPLE`)."""
        return [k for k in self.parts if any(re.fullmatch(p, k) for p in self.IN_SAMPLE)]

    def notes(self) -> list[tuple[str, str]]:
        """Further table rows a result class adds after its figures (how its controls were chosen)."""
        return []

    GRID_ROWS: ClassVar[str] = "method"  # what the rows of `grid()` are

    def cell(self, part: str) -> tuple[str, str] | None:
        """Where `part` sits in this result's small table (`grid`): (row, column), one row per
        method (or size), one column per figure; None: a row of its own. A subclass whose parts
        cross methods with figures says how."""
        return None

    def grid(self) -> list[str]:
        """The parts `cell` places, as a small table: methods as rows, each figure a column (mean
        [95% CI]; counts and seconds plain), the headline starred. No lines when it places none."""
        placed = {k: c for k in self.parts if (c := self.cell(k)) is not None}
        if not placed:
            return []
        rows = list(dict.fromkeys(r for r, _ in placed.values()))
        cols = list(dict.fromkeys(c for _, c in placed.values()))
        ns = sorted({self.parts[k].n for k in placed if self.parts[k].mean is not None})
        each = len(ns) > 1  # counts differ: each cell says its own

        def shown(k: str) -> str:
            e = self.parts[k]
            if e.mean is None:
                return "n/a"
            star = " *" if k == self.headline else ""
            return _shown(k, e, n=False) + (f" n={e.n}" if each else "") + star

        text = {c: shown(k) for k, c in placed.items()}
        inside = {placed[k][1] for k in self.in_sample() if k in placed}
        shown_cols = [c + (" (in-sample)" if c in inside else "") for c in cols]
        head = [f"{self.name} by {self.GRID_ROWS}", *shown_cols]
        body = [[r, *(text.get((r, c), "") for c in cols)] for r in rows]
        note = "" if each or not ns else f"n={ns[0]} each"
        if "n/a" in text.values():
            note += ("; " if note else "") + "n/a: no usable pairs"
        return _aligned([head, *body], f"({note})" if note else "")

    def curve_tables(self) -> list[str]:
        """The curves as small tables: one per x axis, each curve a column of its means."""
        by_x: dict = {}
        for k, c in self.curves.items():
            by_x.setdefault((c.x_name, c.x), []).append((k, c))
        out = []
        for (x_name, xs), curves in by_x.items():
            head = [f"{self.name}: {x_name}", *(k for k, _ in curves)]
            body = [[f"{x:.3g}", *(_mean(c.points[i]) for _, c in curves)] for i, x in enumerate(xs)]
            out += _aligned([head, *body], "(means)")
        return out

    def dropped(self) -> int:
        """Non-finite values left out of all this result's parts and curves (0: none)."""
        return sum(e.dropped for e in self.parts.values()) + sum(
            p.dropped for c in self.curves.values() for p in c.points
        )

    @property
    def estimate(self) -> Estimate:
        return self.parts[self.headline]

    @property
    def mean(self) -> float | None:
        return self.estimate.mean

    def __getitem__(self, part: str) -> Estimate:
        return self.parts[part]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            **self.estimate.to_dict(),
            "headline": self.headline,
            "description": self.description,
            **({"in_sample": self.in_sample()} if self.in_sample() else {}),
            **{k: v.to_dict() for k, v in self.parts.items()},
            **{k: v.to_dict() for k, v in self.curves.items()},
            **{k: to_json_value(v) for k, v in self.tables.items()},
            "details": {f: to_json_value(getattr(self, f)) for f in self.detail_fields()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> TaskResult:
        """Read back what `to_dict` wrote: as the result class of its analysis (`d["name"]`) when
        called on TaskResult itself, else as this class. A result saved before results carried
        their name (report schema /3 and older) is read by `SectionReport.from_dict`, which knows it."""
        named = isinstance(d, Mapping) and isinstance(d.get("name"), str)
        expect_shape(named, "result", "a result with a name", d)
        name = d["name"]
        if cls is TaskResult:
            from kvnotes.analysis.registry import UnknownAnalysisError, result_type

            try:
                cls = result_type(name)
            except UnknownAnalysisError as e:
                raise ResultSchemaError(f"{e}: this kvnotes cannot read its saved result") from e
        expect_shape(isinstance(d, Mapping) and "headline" in d, name, "a result with a headline", d)
        rest = {k: v for k, v in d.items() if k not in _RESERVED}
        details = d.get("details", {})
        expect_shape(isinstance(details, Mapping), f"{name}.details", "a mapping", details)
        core = {
            "name": name,
            "headline": d["headline"],
            "description": d.get("description", ""),
            "parts": {k: v for k, v in rest.items() if isinstance(v, Mapping) and "x" not in v},
            "curves": {k: v for k, v in rest.items() if isinstance(v, Mapping) and "x" in v},
            "tables": {k: v for k, v in rest.items() if isinstance(v, list)},
        }
        clash = sorted(set(core) & set(details))
        expect_shape(not clash, f"{name}.details", f"free of the keys {clash}", details)
        try:
            return decode_fields(cls, {**core, **details}, name)
        except (TypeError, ValueError) as e:
            if isinstance(e, ResultSchemaError):
                raise
            raise ResultSchemaError(f"{name}: {e}") from e

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name}: {self.headline} {self.estimate}; parts {list(self.parts)})"
        )

    def rows(self) -> list[tuple[str, str]]:
        """One row per part that `cell` leaves out of the grid (the headline starred, in-sample
        parts labelled so), and the class's `notes`. The grid and the curves print as small
        tables (`grid`, `curve_tables`)."""
        inside = set(self.in_sample())
        return [
            (
                f"{self.name}.{k}"
                + (" (in-sample)" if k in inside else "")
                + (" *" if k == self.headline else ""),
                _shown(k, v),
            )
            for k, v in self.parts.items()
            if self.cell(k) is None
        ] + self.notes()


def _shown(name: str, e: Estimate, *, n: bool = True) -> str:
    """A part as its table row shows it: a count of tokens or a time as a plain mean (a bootstrap
    CI of a count that never varies, or of one machine's timings, says nothing), the rest with its
    CI; `n=False`: without the count of values (a grid states it once)."""
    last = re.split(r"[.@]", name)[-1]
    if e.mean is None or not (last.endswith(("tokens", "seconds")) or name.startswith("ttft")):
        return str(e) if n else str(e).replace(f" n={e.n}", "")
    unit = "tokens" if last.endswith("tokens") else "s"
    return f"{e.mean:.4g} {unit}" + (f" (mean of {e.n})" if n else "")


def _mean(e: Estimate) -> str:
    return "n/a" if e.mean is None else f"{e.mean:+.3f}"


def _aligned(table: list[list[str]], note: str) -> list[str]:
    """A small table's lines: its first column left-aligned, the others right-aligned, two spaces
    between; `note` after the header."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in table
    ]
    return ["", f"{lines[0]}   {note}", *lines[1:]]


@dataclass(frozen=True, kw_only=True)
class GenericResult(TaskResult):
    """A result with any part, curve and table names and no typed fields (quick experiments)."""

    OPEN: ClassVar[bool] = True


_RESERVED = {"name", "mean", "ci", "values", "clusters", "headline", "description", "details", "in_sample"}
_CORE = {"name", "headline", "parts", "curves", "tables", "description"}
_TYPED_CORE = {"tables"}  # core fields whose plain values `of` converts (parts and curves hold objects)


@dataclass(frozen=True)
class SectionReport(Displayable):
    """Every analysis of one report section (probes, circuits, edit, ...) run on one model and
    task, with the run's sizes and seed. `results` maps each analysis's name to its result.

    One JSON layout for every section: `{"model", "task", "n", "seed", "results": {name: result},
    "meta"}`; `from_dict` also reads the older layouts: `"probes"` for the results (report schema
    /1 and /3) and the circuits layout of `kvnotes.report/2` (each analysis a top-level key)."""

    model: str
    task: str
    n: int
    seed: int
    results: Mapping[str, TaskResult] = field(default_factory=dict)
    meta: Mapping = field(default_factory=dict)  # versions, machine, timings, min_effect, ...

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "task": self.task,
            "n": self.n,
            "seed": self.seed,
            "results": {k: v.to_dict() for k, v in self.results.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> SectionReport:
        """Read what `to_dict` wrote, or an older layout: the results under `"probes"`, or a
        circuits section of `kvnotes.report/2` (each analysis a top-level key); a result saved
        without its name (before /4) takes its key's."""
        named = section_results(d)
        return cls(
            model=d["model"],
            task=d["task"],
            n=d["n"],
            seed=d["seed"],
            results={k: TaskResult.from_dict(v) for k, v in named.items()},
            meta=d.get("meta", {}),
        )

    def __repr__(self) -> str:
        return self.table()

    def table(self) -> str:
        """A readable table: one row per figure (its own n), each analysis's methods crossed with
        its figures as a small table (`TaskResult.grid`) and its curves as small tables, the
        headline of each analysis starred, and the pairs each analysis left out, with why. The
        header names the task only where an analysis read it."""
        rows = [r for p in self.results.values() for r in p.rows()]
        width = max([len(a) for a, _ in rows] + [10])
        task = (
            []
            if all(getattr(p, "TASK_FREE", False) for p in self.results.values())
            else [f"task {self.task}"]
        )
        head = " · ".join([self.model, *task, f"seed {self.seed}"]) + "   (mean [95% CI] n; * each headline)"
        lines = [head, "-" * len(head)]
        for p in self.results.values():  # each analysis: its rows, then its small tables
            lines += [f"{a:<{width}}  {b}" for a, b in p.rows()] + p.grid() + p.curve_tables()
        lines += [line for p in self.results.values() for line in _dropped(p)]
        if len(lines) > 2 and lines[2] == "":  # a small table first: no blank line under the rule
            del lines[2]
        return "\n".join(lines)


def _dropped(r: TaskResult) -> list[str]:
    """One line naming the pairs `r` left out and why, or none."""
    if not r.excluded:
        return []
    each = [
        ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in e.items() if k != "reason"
        )
        + (f": {e['reason']}" if "reason" in e else "")
        for e in r.excluded
    ]
    return [f"{r.name}: {len(each)} pair{'s' if len(each) != 1 else ''} left out ({'; '.join(each)})"]
