"""The per-model report: every probe, circuit, edit and compose experiment on one model and its
tasks, run part by part, each part saved as it finishes so an interrupted run resumes.

    from kvnotes import load_model
    from kvnotes.analysis.report import ReportConfig, run_report
    report = run_report(load_model("gemma-3-270m"), ["order-cancel"], "out/report",
                        ReportConfig.quick())
    report.part("order-cancel", "circuits").results["read_heads"]

A report is data (`report.json`, schema `SCHEMA`, documented in docs/reports.md); `dashboards/`
renders it. It sits here because it composes every analysis layer (probes and circuits) and
renders nothing.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kvnotes.analysis.registry import (
    MIN_EFFECT,
    MODEL,
    TASK,
    Analysis,
    BadOption,
    Context,
    Section,
    analyses,
    config_from_dict,
    config_to_dict,
    fit_to_model,
    report_analyses,
    sections,
    unmet,
)
from kvnotes.analysis.results import Result, SectionReport
from kvnotes.analysis.runner import collect, run_meta, run_one
from kvnotes.batches import sharing_enabled
from kvnotes.display import Displayable
from kvnotes.engine import backend_of
from kvnotes.errors import KVNotesError, ReportFileError, ResultSchemaError
from kvnotes.models.backends import BackendName
from kvnotes.models.model import KVModel
from kvnotes.tasks import TaskSource, load_task

SCHEMA = "kvnotes.report/4"
# /1 is migrated on load (its config was flat); /2 wrote a circuits section in a layout of its own
# (kind "CircuitReport", each analysis a top-level key), which SectionReport still reads; /1 to /3
# keyed a section's results as "probes" and a part's kind by its result's class name (/4: "results",
# and each part's kind is "section" or "analysis", with the section's or the analysis's name)
READS = ("kvnotes.report/1", "kvnotes.report/2", "kvnotes.report/3", SCHEMA)


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """The sizes of a report run: the seed, the minimum effect, analyses to `skip`, and each
    analysis's own config (its registered options). `full()` is the documented run; `quick()` a
    fast look (each analysis's `quick` sizes). Overrides name a config field and apply to every
    analysis that has it (`ReportConfig.quick(n=4, k_max=6)`). JSON-safe; a saved part is reused
    only when the config it was computed with equals this one."""

    preset: str = "full"  # "full" or "quick": the sizes these started from
    seed: int = 0
    min_effect: float = MIN_EFFECT  # pairs whose decision moves less (logits) are excluded, and listed
    skip: tuple[str, ...] = ()  # analyses left out
    analyses: Mapping[str, Any] = field(default_factory=dict)  # name -> its config

    def __post_init__(self):
        if self.preset not in ("full", "quick"):
            raise BadOption(f"ReportConfig.preset must be 'full' or 'quick', got {self.preset!r}")
        known = report_analyses()
        bad = sorted((set(self.skip) | set(self.analyses)) - set(known))
        if bad:
            raise BadOption(f"unknown analysis(es) {bad} in the report config; a report runs {sorted(known)}")
        object.__setattr__(self, "skip", tuple(self.skip))
        object.__setattr__(
            self,
            "analyses",
            {k: self.analyses.get(k) or a.make_config(self.preset) for k, a in known.items()},
        )

    @classmethod
    def full(cls, **overrides) -> ReportConfig:
        return cls._make("full", overrides)

    @classmethod
    def quick(cls, **overrides) -> ReportConfig:
        return cls._make("quick", overrides)

    @classmethod
    def _make(cls, preset: str, overrides: Mapping) -> ReportConfig:
        top = {k: overrides[k] for k in ("seed", "min_effect", "skip") if k in overrides}
        rest = {k: v for k, v in overrides.items() if k not in top}
        known = report_analyses()
        fields_ = {f.name for a in known.values() for f in fields(a.config)}
        bad = sorted(set(rest) - fields_)
        if bad:
            raise BadOption(
                f"unknown report option(s) {bad}; the options are seed, min_effect, skip and "
                f"the analyses' own: {sorted(fields_)}"
            )
        if "n" in rest and (not isinstance(rest["n"], int) or rest["n"] < 2):
            raise BadOption(f"n must be at least 2 (CIs need two pairs), got {rest['n']!r}")
        return cls(
            preset=preset, **top, analyses={k: a.make_config(preset, **rest) for k, a in known.items()}
        )

    @property
    def n(self) -> int:
        """The prompt pairs most analyses run on (what a listing of reports shows)."""
        sizes = [c.n for k, c in self.analyses.items() if hasattr(c, "n") and k not in self.skip]
        return max(set(sizes), key=sizes.count) if sizes else 0

    def config(self, name: str) -> Any:
        return self.analyses[name]

    def sizes(self) -> str:
        """One line of what sets a run's cost: pairs and the main sizes per analysis."""
        keys = ("n", "k_max", "draws", "distances", "sae_train_pairs", "turns", "lengths", "tokens")
        parts = []
        for name, c in self.analyses.items():
            if name in self.skip:
                continue
            got = [f"{k} {getattr(c, k)}" for k in keys if hasattr(c, k)]
            parts.append(f"{name} ({', '.join(got)})" if got else name)
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "preset": self.preset,
            "seed": self.seed,
            "min_effect": self.min_effect,
            "skip": list(self.skip),
            "analyses": {k: config_to_dict(c) for k, c in self.analyses.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> ReportConfig:
        known = {"preset", "seed", "min_effect", "skip", "analyses"}
        bad = sorted(set(d) - known)
        if bad:
            raise ReportFileError(f"unknown report config key(s) {bad}; known: {sorted(known)}")
        reg = report_analyses()
        unknown = sorted(set(d.get("analyses", {})) - set(reg))
        if unknown:
            raise ReportFileError(f"the report config names analyses this kvnotes does not have: {unknown}")
        return cls(
            preset=d.get("preset", "full"),
            seed=d.get("seed", 0),
            min_effect=float(d.get("min_effect", MIN_EFFECT)),
            skip=tuple(d.get("skip", ())),
            analyses={k: config_from_dict(reg[k], v) for k, v in d.get("analyses", {}).items()},
        )

    @classmethod
    def from_v1(cls, d: Mapping) -> ReportConfig:
        """A `kvnotes.report/1` config (one flat set of sizes) in today's terms."""
        v1 = {
            "n",
            "seed",
            "min_effect",
            "regime_n",
            "distances",
            "k_max",
            "draws",
            "sae_train_pairs",
            "sae_eval_pairs",
            "sae_samples",
            "compose_n",
            "seams",
            "offsets",
            "turns",
            "memory",
            "ttft_lengths",
            "edit_cost_tokens",
            "preset",
        }
        bad = sorted(set(d) - v1)
        if bad:
            raise ReportFileError(f"unknown report config key(s) {bad}; known: {sorted(v1)}")
        base = cls._make(d.get("preset", "full"), {})
        n, cn, k = d.get("n", 8), d.get("compose_n", 4), d.get("k_max", 12)
        draws = d.get("draws", 32)
        per = {
            "regime": {"n": d.get("regime_n", 4), "distances": d.get("distances")},
            "read_heads": {"n": n, "k_max": k, "draws": draws},
            "write_heads": {"n": n, "k_max": k, "draws": max(draws // 2, 1)},
            "scrubbing": {"n": n, "k_max": k},
            "sae": {
                "n": n,
                "sae_train_pairs": d.get("sae_train_pairs"),
                "sae_eval_pairs": d.get("sae_eval_pairs"),
                "sae_samples": d.get("sae_samples"),
            },
            "seam_repair": {"n": cn, "seams": d.get("seams"), "offsets": d.get("offsets")},
            "memory_blocks": {"questions": 2 * cn},
            "agent_loop": {"prompts": min(cn, 2), "turns": d.get("turns")},
            "ttft": {"lengths": d.get("ttft_lengths")},
            "edit_cost": {"tokens": d.get("edit_cost_tokens")},
        }
        configs = {}
        for name, c in base.analyses.items():
            values = per.get(name, {"n": n} if hasattr(c, "n") else {})
            configs[name] = replace(
                c,
                **{key: tuple(v) if isinstance(v, list) else v for key, v in values.items() if v is not None},
            )
        skip = () if d.get("memory", True) else ("memory_blocks",)
        return cls(
            preset=base.preset,
            seed=d.get("seed", 0),
            min_effect=float(d.get("min_effect", MIN_EFFECT)),
            skip=skip,
            analyses=configs,
        )


_SECTION_KINDS = ("SectionReport", "ProbeReport", "CircuitReport")  # schema /1 to /3: class names
SECTION, ANALYSIS = "section", "analysis"  # a part's kind from schema /4


def _result_class(key: str, d: Mapping) -> type[Result]:
    """The class a saved part's result is read as: a task section's (or a skipped part's)
    SectionReport, or the result class of the model-level analysis the part is named by (schema /4:
    its `name`; older: the key's last segment, else the class name once stored as its kind)."""
    kind, name = d.get("kind"), d.get("name") or key.rpartition("/")[2]
    if kind == SECTION or kind in _SECTION_KINDS:
        return SectionReport
    found = analyses()
    if name in found and sections()[found[name].section].level == MODEL:
        return found[name].result
    by_class = {a.result.__name__: a.result for a in found.values() if sections()[a.section].level == MODEL}
    if kind != ANALYSIS and kind in by_class:
        return by_class[kind]
    raise ReportFileError(
        f"part {key!r} has kind {kind!r} and name {name!r}; kvnotes reads a section, or a model-level "
        f"analysis of {sorted(n for n, a in found.items() if sections()[a.section].level == MODEL)}"
    )


@dataclass(frozen=True)
class Part:
    """One finished piece of a report: its result object and how long it took."""

    key: str  # "order-cancel/circuits" or "model/ttft"
    result: Any  # a task section's SectionReport, or a model-level analysis's result
    seconds: float

    def to_dict(self) -> dict:
        """`kind` "section" (a task section's results, or a part that was skipped) or "analysis" (a
        model-level analysis's result), and `name`: the section's or the analysis's."""
        kind = SECTION if isinstance(self.result, SectionReport) else ANALYSIS
        return {
            "kind": kind,
            "name": self.key.rpartition("/")[2],
            "seconds": self.seconds,
            "result": self.result.to_dict(),
        }

    @classmethod
    def from_dict(cls, key: str, d: Mapping) -> Part:
        return cls(key=key, result=_result_class(key, d).from_dict(d["result"]), seconds=d["seconds"])


@dataclass(frozen=True)
class Report(Displayable):
    """Every part of a report run on one model, with what a reader needs to reproduce it."""

    model: str
    tasks: tuple[str, ...]
    config: ReportConfig
    parts: Mapping[str, Part]
    meta: Mapping = field(default_factory=dict)  # model info, versions, machine, started, run time

    def part(self, task: str, section: str) -> Any:
        """The result of `section` ("probes", "circuits", ...) for `task`, or of a model-level analysis
        ("ttft", ...) for `task` "model"; None when the report has no such part."""
        p = self.parts.get(f"{task}/{section}")
        return p.result if p else None

    @property
    def seconds(self) -> float:
        return round(sum(p.seconds for p in self.parts.values()), 1)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "tasks": list(self.tasks),
            "config": self.config.to_dict(),
            "meta": dict(self.meta),
            "parts": {k: p.to_dict() for k, p in self.parts.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Report:
        """Read a report's JSON: this schema, or `kvnotes.report/1` migrated (its flat config)."""
        got = d.get("schema") if isinstance(d, Mapping) else type(d).__name__
        if got not in READS:
            raise ReportFileError(
                f"not a report this kvnotes reads (schema {got!r}; it reads {list(READS)}); rewrite it "
                "with `kvnotes report --model M --task T --out DIR`, then `kvnotes render DIR` "
                "redraws the page"
            )
        config = ReportConfig.from_v1(d["config"]) if got == READS[0] else ReportConfig.from_dict(d["config"])
        return cls(
            model=d["model"],
            tasks=tuple(d["tasks"]),
            config=config,
            parts={k: Part.from_dict(k, v) for k, v in d["parts"].items()},
            meta=d.get("meta", {}),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """Read a report.json (or the report.json inside a directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "report.json"
        if not path.is_file():
            raise ReportFileError(f"{path} does not exist; write a report with `kvnotes report --out DIR`")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ReportFileError(
                f"{path} is not valid JSON ({e}); rerun `kvnotes report` to rewrite it"
            ) from e
        if not isinstance(d, dict) or d.get("schema") not in READS:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise ReportFileError(
                f"{path} is not a report this kvnotes reads (schema {got!r}; it reads {list(READS)}); "
                "rewrite it with `kvnotes report --model M --task T --out DIR`, then `kvnotes render DIR` "
                "redraws the page"
            )
        try:
            return cls.from_dict(d)
        except ReportFileError as e:  # already says what is wrong: add only the file
            raise ReportFileError(f"{path}: {e}; rerun `kvnotes report` to rewrite it") from e
        except (KeyError, TypeError, ValueError, ResultSchemaError) as e:
            raise ReportFileError(
                f"{path} is not a readable kvnotes report ({type(e).__name__}: {e}); "
                "rerun `kvnotes report` to rewrite it"
            ) from e

    def __repr__(self) -> str:
        return (
            f"Report({self.model}, tasks {list(self.tasks)}, {len(self.parts)} parts, "
            f"{self.config.preset}, {self.seconds:.0f} s)"
        )


def plan_parts(
    model: KVModel, tasks: Sequence[TaskSource], cfg: ReportConfig, *, progress: bool = True
) -> list[tuple[str, Callable]]:
    """The parts of a report in run order: per task each section, then each model-level analysis."""
    out: list[tuple[str, Callable]] = []
    run_ = [a for a in report_analyses().values() if a.name not in cfg.skip]
    secs = sections()
    for task in tasks:
        memo: dict = {}  # the task's sections share its prompt pairs and what was computed on them
        # what this task and model cannot serve is left out (a pair dataset has no rule to flip)
        fits = [a for a in run_ if not unmet(a, task=task, model=model)]
        todo = [s for s in secs.values() if s.level == TASK and any(a.section == s.name for a in fits)]
        for i, sec in enumerate(todo):
            names = [a.name for a in fits if a.section == sec.name]
            shared = memo if sharing_enabled() else {}  # unshared: each section on its own
            last = i == len(todo) - 1  # the task's last section lets its pairs go after it
            part = partial(_task_part, model, task, sec, names, cfg, progress, shared, last)
            out.append((f"{task.name}/{sec.name}", part))
    for a in run_:
        if secs[a.section].level == MODEL:
            out.append((f"model/{a.name}", partial(_model_part, model, a, cfg, progress)))
    return out


def _task_part(
    model: KVModel,
    task: TaskSource,
    section: Section,
    names: list[str],
    cfg: ReportConfig,
    progress: bool,
    memo: dict,
    last: bool = False,
) -> SectionReport:
    """`section`'s analyses `names` on one task, as one SectionReport (`memo`: shared by the task's
    sections; emptied after the `last` one, so a report over many tasks holds one task's pairs)."""
    try:
        return collect(
            model,
            task,
            names,
            configs={n: fit_to_model(cfg.config(n), model, given=()) for n in names},
            seed=cfg.seed,
            min_effect=cfg.min_effect,
            progress=progress,
            memo=memo,
            fit_context=True,
        )
    finally:
        if last:
            memo.clear()


def _model_part(model: KVModel, a: Analysis, cfg: ReportConfig, progress: bool) -> Any:
    """A model-level analysis through the runner: what the model cannot serve is refused (and the
    part skipped, saying why) before any compute, and its calls are profiled under its name."""
    ctx = Context(model=model, seed=cfg.seed, min_effect=cfg.min_effect, progress=progress, fit_context=True)
    return run_one(ctx, a.name, fit_to_model(cfg.config(a.name), model, given=()))


def _part_file(out: Path, key: str) -> Path:
    return out / "parts" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", key.replace("/", "__")) + ".json")


def _part_head(model: KVModel, cfg: ReportConfig) -> dict:
    """What a saved part must match to be reused: the model (name, backend, fingerprint of its
    weights and tokenizer) and the whole config."""
    fp = getattr(model, "fingerprint", None)
    backend = backend_of(model).name
    return {"model": model.name, "backend": backend, "fingerprint": fp, "config": cfg.to_dict()}


def _load_part(path: Path, key: str, head: Mapping) -> Part | None:
    """A saved part computed under `head` (`_part_head`), or None (missing, stale or unreadable)."""
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        # a part saved before backends were recorded ran on TransformerLens
        old = BackendName.TRANSFORMER_LENS
        if any(d.get(k, old if k == "backend" else None) != v for k, v in head.items()):
            return None
        return Part.from_dict(key, d)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, ReportFileError):
        return None


def model_info(model: KVModel) -> dict:
    return {
        "name": model.name,
        "backend": backend_of(model).name,
        "n_layers": model.n_layers,
        "n_heads": model.n_heads,
        "n_kv_heads": model.n_kv_heads,
        "d_head": model.d_head,
        "d_model": model.facts.d_model,
        "n_ctx": model.n_ctx,
        "rope_bases": sorted({model.rope_base(l) for l in range(model.n_layers)}),
    }


def run_report(
    model: KVModel,
    tasks: Sequence[TaskSource | str],
    out: str | Path,
    cfg: ReportConfig | None = None,
    *,
    resume: bool = True,
    progress: bool = True,
    on_part: Callable[[Report], object] | None = None,
) -> Report:
    """Run every part of the report for `model` on `tasks`, saving each to `out/parts/` as it
    finishes and `out/report.json` after each part (so a partial report can be rendered).

    With `resume` a part saved earlier for the same model (name, backend, fingerprint) and config
    is read back, not rerun; `meta["reused"]` lists them. A run that is killed keeps every part
    finished before it (each is written whole, then renamed into place), and a part that fails
    says so and which parts are kept. `on_part(report)` is called after each part (the CLI
    re-renders the HTML there).

    >>> import tempfile
    >>> from kvnotes import load_model
    >>> cfg = ReportConfig.quick(n=2, distances=(0,), draws=2, k_max=2, sae_train_pairs=2, sae_eval_pairs=2,
    ...                          sae_samples=256, seams=(0,), turns=0, skip=("memory_blocks",), lengths=(),
    ...                          tokens=0)
    >>> r = run_report(load_model("tiny-llama"), ["order-cancel"], tempfile.mkdtemp(), cfg, progress=False)
    >>> [k.split("/")[1] for k in r.parts]  # no per-model benches: they were sized 0
    ['probes', 'regime', 'circuits', 'edit', 'compose', 'memory']
    """
    cfg = cfg or ReportConfig.full()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = _distinct_tasks(tasks)
    t0 = time.perf_counter()
    meta = {"model_info": model_info(model), **run_meta(), "task_sources": {t.name: t.source for t in tasks}}
    done: dict[str, Part] = {}
    reused: list[str] = []
    steps = plan_parts(model, tasks, cfg, progress=progress)
    bar = tqdm(steps, desc="report", unit="part", disable=not progress or None, file=sys.stderr)
    head = _part_head(model, cfg)
    for key, fn in bar:
        bar.set_postfix_str(key)
        path = _part_file(out, key)
        part = _load_part(path, key, head) if resume else None
        if part is not None:
            reused.append(key)
            _say(progress, f"report {key}: reusing {path}")
        else:
            part = _compute_part(model, key, fn, cfg, progress, kept=len(done), out=out)
            if part is None:  # sized to nothing (a bench with no lengths): not a part
                continue
            _save_part(path, head, part)
            _say(progress, f"report {key}: done in {part.seconds:.1f} s")
        done[key] = part
        report = Report(
            model=model.name,
            tasks=tuple(t.name for t in tasks),
            config=cfg,
            parts=dict(done),
            meta={
                **meta,
                "run_seconds": round(time.perf_counter() - t0, 1),
                "reused": list(reused),
                "pending": [k for k, _ in steps if k not in done],
            },
        )
        report.save(out / "report.json")
        if on_part:
            on_part(report)
    return report  # the one saved last


def _distinct_tasks(tasks: Sequence[TaskSource | str]) -> list[TaskSource]:
    """The report's tasks, loaded; at least one, none twice."""
    tasks = [load_task(t) for t in tasks]
    if not tasks:
        raise KVNotesError("a report needs at least one task (--task order-cancel)")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise KVNotesError(f"task names repeat in {names}; pass each task once")
    return tasks


def _say(progress: bool, text: str) -> None:
    if progress:
        tqdm.write(text, file=sys.stderr)


def _compute_part(
    model: KVModel, key: str, fn: Callable, cfg: ReportConfig, progress: bool, *, kept: int, out: Path
) -> Part | None:
    """Run one part: a part this model or task cannot run is an empty, `skipped` one; a bug or an
    interrupt propagates with a note of the `kept` parts finished before it."""
    _say(progress, f"report {key}: running")
    s = time.perf_counter()
    try:
        result = fn()
    except KVNotesError as e:  # this model or task cannot run the part: say why, go on
        result = _skipped(model, key, cfg, e)
        _say(progress, f"report {key}: skipped ({e})")
    except BaseException as e:  # a bug or an interrupt: what finished stays, and says so
        e.add_note(
            f"report part {key} did not finish; the {kept} part(s) finished before it are "
            f"kept in {out / 'parts'}, and the same `kvnotes report` command resumes from them"
        )
        raise
    if result is None:
        return None
    return Part(key=key, result=result, seconds=round(time.perf_counter() - s, 1))


def _save_part(path: Path, head: Mapping, part: Part) -> None:
    """Write a part whole, then rename it into place: a kill leaves the old part or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({**head, **part.to_dict()}))
    tmp.replace(path)


def _skipped(model: KVModel, key: str, cfg: ReportConfig, error: KVNotesError) -> SectionReport:
    """A part that cannot run on this model or task (a task without {filler} for the regime, a
    context too short for a bench): an empty report whose `meta["skipped"]` says why."""
    task = key.split("/")[0]
    return SectionReport(
        model=model.name,
        task=task,
        n=0,
        seed=cfg.seed,
        results={},
        meta={"skipped": f"{type(error).__name__}: {error}"},
    )
