"""The per-model report: every probe, circuit, edit and compose experiment on one model and its
tasks, run part by part, each part saved as it finishes so an interrupted run resumes.

    from kvnotes import load_model
    from circuits.report import ReportConfig, run_report
    report = run_report(load_model("gemma-3-270m"), ["order-cancel"], "out/report",
                        ReportConfig.quick())
    report.part("order-cancel", "circuits").analyses["read_heads"]

A report is data (`report.json`, schema `SCHEMA`, documented in docs/reports.md); `dashboards/`
renders it. It sits here because it composes every analysis layer (probes and circuits) and
renders nothing.
"""

from __future__ import annotations

import json
import platform
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path

from tqdm.auto import tqdm

from kvnotes.bench import BenchReport, versions
from kvnotes.display import Displayable
from kvnotes.errors import KVNotesError
from kvnotes.models.model import KVModel
from kvnotes.tasks import Task, load_task
from kvnotes.ttft import EditCostReport, TTFTReport
from probes.results import ProbeReport

SCHEMA = "kvnotes.report/1"
MODEL_PARTS = ("ttft", "edit_cost")  # once per model
TASK_PARTS = ("probes", "regime", "circuits", "edit", "compose")  # once per task


class ReportFileError(KVNotesError):
    """A report.json (or a saved part) that kvnotes cannot read."""


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """The sizes of a report run. `full()` is the documented run; `quick()` a fast look (the same
    analyses on fewer pairs, draws and lengths). JSON-safe; a saved part is reused only when the
    config it was computed with equals this one."""

    n: int = 8  # prompt pairs for probes, circuits and edits
    seed: int = 0
    min_effect: float = 0.1  # pairs whose decision moves less (logits) are excluded, and listed
    regime_n: int = 4
    distances: tuple[int, ...] = (0, 16, 32, 64, 128, 256, 512, 768)
    k_max: int = 12  # top-k vs random-k head curves, k = 1..k_max
    draws: int = 32  # random head sets per k
    sae_train_pairs: int = 96
    sae_eval_pairs: int = 32
    sae_samples: int = 60_000
    compose_n: int = 4
    seams: tuple[int, ...] = (0, 1, 2, 4, 8, 16)
    offsets: tuple[int, ...] = (32, 128)
    turns: int = 28  # agent loop: errata turns
    memory: bool = True  # two-hop memory blocks
    ttft_lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    edit_cost_tokens: int = 2048
    preset: str = "full"  # "full" or "quick": the sizes these started from

    def __post_init__(self):
        if self.preset not in ("full", "quick"):
            raise ValueError(f"ReportConfig.preset must be 'full' or 'quick', got {self.preset!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int | float) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"ReportConfig.{f.name} must be >= 0, got {v}")
        if self.n < 2:
            raise ValueError(f"ReportConfig.n must be at least 2 (CIs need two pairs), got {self.n}")

    @classmethod
    def full(cls, **overrides) -> ReportConfig:
        return cls(**overrides)

    @classmethod
    def quick(cls, **overrides) -> ReportConfig:
        sizes = dict(
            n=6,
            regime_n=3,
            distances=(0, 64, 256),
            k_max=8,
            draws=16,
            sae_train_pairs=48,
            sae_eval_pairs=16,
            sae_samples=24_000,
            compose_n=2,
            seams=(0, 2, 8),
            offsets=(32,),
            turns=6,
            memory=True,
            ttft_lengths=(256, 512, 1024, 2048),
            edit_cost_tokens=1024,
            preset="quick",
        )
        return cls(**{**sizes, **overrides})

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping) -> ReportConfig:
        known = {f.name: f for f in fields(cls)}
        bad = sorted(set(d) - set(known))
        if bad:
            raise ReportFileError(f"unknown report config key(s) {bad}; known: {sorted(known)}")
        return cls(
            **{
                k: tuple(v) if isinstance(v, list) else float(v) if k == "min_effect" else v
                for k, v in d.items()
            }
        )


# Result classes a part may hold, by the name stored in its "kind".
KINDS: dict[str, type] = {}


def _kinds() -> dict[str, type]:
    if not KINDS:
        from circuits import CircuitReport

        KINDS.update({c.__name__: c for c in (ProbeReport, CircuitReport, TTFTReport, EditCostReport)})
    return KINDS


@dataclass(frozen=True)
class Part:
    """One finished piece of a report: its result object and how long it took."""

    key: str  # "order-cancel/circuits" or "model/ttft"
    result: ProbeReport | BenchReport
    seconds: float

    def to_dict(self) -> dict:
        return {"kind": type(self.result).__name__, "seconds": self.seconds, "result": self.result.to_dict()}

    @classmethod
    def from_dict(cls, key: str, d: Mapping) -> Part:
        kinds = _kinds()
        if d.get("kind") not in kinds:
            raise ReportFileError(f"part {key!r} has kind {d.get('kind')!r}; kvnotes reads {sorted(kinds)}")
        return cls(key=key, result=kinds[d["kind"]].from_dict(d["result"]), seconds=d["seconds"])


@dataclass(frozen=True)
class Report(Displayable):
    """Every part of a report run on one model, with what a reader needs to reproduce it."""

    model: str
    tasks: tuple[str, ...]
    config: ReportConfig
    parts: Mapping[str, Part]
    meta: Mapping = field(default_factory=dict)  # model info, versions, machine, started, run time

    def part(self, task: str, section: str) -> ProbeReport | BenchReport | None:
        """The result of `section` ("probes", "circuits", ...) for `task` ("model" for per-model parts)."""
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
        if not isinstance(d, Mapping) or d.get("schema") != SCHEMA:
            got = d.get("schema") if isinstance(d, Mapping) else type(d).__name__
            raise ReportFileError(
                f"not a kvnotes report (schema {got!r}, expected {SCHEMA!r}); "
                "write one with `kvnotes report --model M --task T --out DIR`"
            )
        return cls(
            model=d["model"],
            tasks=tuple(d["tasks"]),
            config=ReportConfig.from_dict(d["config"]),
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
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise ReportFileError(
                f"{path} is not a kvnotes report (schema {got!r}, expected {SCHEMA!r}); "
                "write one with `kvnotes report --model M --task T --out DIR`"
            )
        try:
            return cls.from_dict(d)
        except ReportFileError as e:  # already says what is wrong: add only the file
            raise ReportFileError(f"{path}: {e}; rerun `kvnotes report` to rewrite it") from e
        except (KeyError, TypeError, ValueError) as e:
            raise ReportFileError(
                f"{path} is not a readable kvnotes report ({type(e).__name__}: {e}); "
                "rerun `kvnotes report` to rewrite it"
            ) from e

    def __repr__(self) -> str:
        return (
            f"Report({self.model}, tasks {list(self.tasks)}, {len(self.parts)} parts, "
            f"{self.config.preset}, {self.seconds:.0f} s)"
        )


def plan(
    model: KVModel, tasks: Sequence[Task], cfg: ReportConfig, *, progress: bool = True
) -> list[tuple[str, Callable]]:
    """The parts of a report in run order: per task, then per model (a bench sized 0 is left out)."""
    out: list[tuple[str, Callable]] = []
    for task in tasks:
        out += [(f"{task.name}/{s}", _task_part(model, task, s, cfg, progress)) for s in TASK_PARTS]
    sized = {"ttft": bool(cfg.ttft_lengths), "edit_cost": bool(cfg.edit_cost_tokens)}
    out += [(f"model/{s}", _model_part(model, s, cfg, progress)) for s in MODEL_PARTS if sized[s]]
    return out


def _task_part(
    model: KVModel, task: Task, section: str, cfg: ReportConfig, progress: bool
) -> Callable[[], ProbeReport]:
    c, quiet = cfg, {"progress": progress}

    def report(results: dict, n: int) -> ProbeReport:
        return ProbeReport(model=model.name, task=task.name, n=n, seed=c.seed, probes=results)

    def probes():
        from probes import run_probes

        return run_probes(model, task, n=c.n, seed=c.seed, min_effect=c.min_effect, **quiet)

    def regime():
        from probes.regime import regime

        return report(
            {
                "regime": regime(
                    model,
                    task,
                    n=c.regime_n,
                    distances=c.distances,
                    seed=c.seed,
                    min_effect=c.min_effect,
                    **quiet,
                )
            },
            c.regime_n,
        )

    def circuits():
        from circuits import run_circuits
        from circuits.sae import SAEConfig

        sae = SAEConfig(
            seed=c.seed,
            n_train_pairs=c.sae_train_pairs,
            n_eval_pairs=c.sae_eval_pairs,
            training_samples=c.sae_samples,
        )
        return run_circuits(
            model,
            task,
            n=c.n,
            seed=c.seed,
            k_max=c.k_max,
            draws=c.draws,
            sae_config=sae,
            min_effect=c.min_effect,
            **quiet,
        )

    def edit():
        from probes import make_trials
        from probes.edit import edit_methods

        trials = make_trials(model, task, c.n, seed=c.seed, **quiet)
        return report({"edit_methods": edit_methods(trials)}, c.n)

    def compose():
        from probes.agent import agent_loop
        from probes.compose import seam_repair
        from probes.memory import memory_blocks

        results = {
            "seam_repair": seam_repair(
                model, task, n=c.compose_n, seams=c.seams, offsets=c.offsets, seed=c.seed, **quiet
            )
        }
        if c.memory:
            results["memory_blocks"] = memory_blocks(model, n=2 * c.compose_n, seed=c.seed, **quiet)
        if c.turns:
            results["agent_loop"] = agent_loop(
                model, task, n=min(c.compose_n, 2), turns=c.turns, seed=c.seed, **quiet
            )
        return report(results, c.compose_n)

    parts = {"probes": probes, "regime": regime, "circuits": circuits, "edit": edit, "compose": compose}
    return parts[section]


def _model_part(model: KVModel, section: str, cfg: ReportConfig, progress: bool) -> Callable[[], BenchReport]:
    from kvnotes.ttft import edit_cost, ttft

    if section == "ttft":
        return lambda: ttft(model, [n for n in cfg.ttft_lengths if n <= model.n_ctx], progress=progress)
    return lambda: edit_cost(model, min(cfg.edit_cost_tokens, model.n_ctx), progress=progress)


def _part_file(out: Path, key: str) -> Path:
    return out / "parts" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", key.replace("/", "__")) + ".json")


def _load_part(path: Path, key: str, model: str, cfg: ReportConfig) -> Part | None:
    """A saved part computed for this model and config, or None (missing, stale or unreadable)."""
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if d.get("model") != model or d.get("config") != cfg.to_dict():
            return None
        return Part.from_dict(key, d)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, ReportFileError):
        return None


def model_info(model: KVModel) -> dict:
    return {
        "name": model.name,
        "n_layers": model.n_layers,
        "n_heads": model.n_heads,
        "n_kv_heads": model.n_kv_heads,
        "d_head": model.d_head,
        "d_model": model.cfg.d_model,
        "n_ctx": model.n_ctx,
        "rope_bases": sorted({model.rope_base(l) for l in range(model.n_layers)}),
    }


def run_report(
    model: KVModel,
    tasks: Sequence[Task | str],
    out: str | Path,
    cfg: ReportConfig | None = None,
    *,
    resume: bool = True,
    progress: bool = True,
    on_part: Callable[[Report], None] | None = None,
) -> Report:
    """Run every part of the report for `model` on `tasks`, saving each to `out/parts/` as it
    finishes and `out/report.json` after each part (so a partial report can be rendered).

    With `resume` a part saved earlier for the same model and config is read back, not rerun.
    `on_part(report)` is called after each part (the CLI re-renders the HTML there).

    >>> import tempfile
    >>> from kvnotes import load_model
    >>> cfg = ReportConfig.quick(n=2, distances=(0,), draws=2, k_max=2, sae_train_pairs=2, sae_eval_pairs=2,
    ...                          sae_samples=256, seams=(0,), turns=0, memory=False, ttft_lengths=(),
    ...                          edit_cost_tokens=0)
    >>> r = run_report(load_model("tiny-llama"), ["order-cancel"], tempfile.mkdtemp(), cfg, progress=False)
    >>> [k.split("/")[1] for k in r.parts]  # no per-model benches: they were sized 0
    ['probes', 'regime', 'circuits', 'edit', 'compose']
    """
    cfg = cfg or ReportConfig.full()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [load_task(t) for t in tasks]
    if not tasks:
        raise KVNotesError("a report needs at least one task (--task order-cancel)")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise KVNotesError(f"task names repeat in {names}; pass each task once")
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    meta = {
        "model_info": model_info(model),
        "versions": versions(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "started": started,
        "task_sources": {t.name: t.source for t in tasks},
    }
    done: dict[str, Part] = {}
    reused: list[str] = []
    steps = plan(model, tasks, cfg, progress=progress)
    bar = tqdm(steps, desc="report", unit="part", disable=not progress or None, file=sys.stderr)

    def current() -> Report:
        return Report(
            model=model.name,
            tasks=tuple(names),
            config=cfg,
            parts=dict(done),
            meta={
                **meta,
                "run_seconds": round(time.perf_counter() - t0, 1),
                "reused": list(reused),
                "pending": [k for k, _ in steps if k not in done],
            },
        )

    for key, fn in bar:
        bar.set_postfix_str(key)
        path = _part_file(out, key)
        part = _load_part(path, key, model.name, cfg) if resume else None
        if part is not None:
            reused.append(key)
            if progress:
                tqdm.write(f"report {key}: reusing {path}", file=sys.stderr)
        else:
            if progress:
                tqdm.write(f"report {key}: running", file=sys.stderr)
            s = time.perf_counter()
            try:
                result = fn()
            except KVNotesError as e:  # this model or task cannot run the part: say why, go on
                result = _skipped(model, key, cfg, e)
                if progress:
                    tqdm.write(f"report {key}: skipped ({e})", file=sys.stderr)
            part = Part(key=key, result=result, seconds=round(time.perf_counter() - s, 1))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"model": model.name, "config": cfg.to_dict(), **part.to_dict()}))
            if progress:
                tqdm.write(f"report {key}: done in {part.seconds:.1f} s", file=sys.stderr)
        done[key] = part
        report = current()
        report.save(out / "report.json")
        if on_part:
            on_part(report)
    return report  # the one saved last


def _skipped(model: KVModel, key: str, cfg: ReportConfig, error: KVNotesError) -> ProbeReport:
    """A part that cannot run on this model or task (a task without {filler} for the regime, a
    context too short for a bench): an empty report whose `meta["skipped"]` says why."""
    task = key.split("/")[0]
    return ProbeReport(
        model=model.name,
        task=task,
        n=0,
        seed=cfg.seed,
        probes={},
        meta={"skipped": f"{type(error).__name__}: {error}"},
    )
