"""Running analyses: one entry for every analysis, task-level or model-level. `run_analysis` runs
analyses (and what they need) over one context, in registry order, each checked first and timed;
`run_one` runs one (a bench, `verify`, a prompt's attribution: how the CLI and the report run a
model-level analysis); `collect` gathers a task section's results in one `SectionReport` (the
report's task parts and the CLI's task commands call it), and `run_section`, which checks the names
against a command first, is the runner behind `run_probes` and `run_circuits`.

    from kvnotes import load_model
    from kvnotes.analysis.runner import run_section
    run_section("probe", load_model("tiny-llama"), "order-cancel", ["field_refresh"], n=2)
"""

from __future__ import annotations

import platform
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from kvnotes.analysis.registry import (
    MIN_EFFECT,
    Context,
    analyses,
    check_layers,
    choose,
    config_to_dict,
    get,
    refuse_unmet,
)
from kvnotes.analysis.results import SectionReport
from kvnotes.engine.profile import label


def versions(
    packages: tuple[str, ...] = (
        "kvnotes",
        "torch",
        "transformer-lens",
        "transformers",
        "sae-lens",
        "plotly",
    ),
) -> dict[str, str | None]:
    """Python's and each installed package's version (None where one is missing), for result metadata."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def run_meta() -> dict:
    """Where and with what a result was computed: machine, processor, package versions, start time."""
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "versions": versions(),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def run_analysis(
    ctx: Context, names: Sequence[str], configs: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict]:
    """Run the named analyses (and what they need, first) in registry order on one context; any
    the context's task or model cannot serve (`Analysis.requires`) is refused before the first runs.

    Returns the results (by name; an analysis sized to nothing is left out) and the run's meta:
    `run_meta()`, the seed and minimum effect, and seconds per analysis and in all."""
    configs = dict(configs or {})
    wanted = _with_needs(names)
    # before anything runs: what the task or model cannot give (a pair dataset has no rule to flip)
    refuse_unmet([n for n in analyses() if n in wanted], task=ctx.task, model=ctx.model)
    if ctx.model is not None:  # before anything runs: a bad layer fails now, not after the prefills
        for n in wanted:
            check_layers(configs.get(n) or get(n).make_config(), ctx.model)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    for name in [n for n in analyses() if n in wanted]:
        a = get(name)
        cfg = configs.get(name) or a.make_config()
        s = time.perf_counter()
        with label(name):  # an active engine profile files this analysis's calls under its name
            result = a.run(ctx, cfg)
        timings[name] = round(time.perf_counter() - s, 2)
        if result is not None:
            ctx.results[name] = result
        ctx.say(f"{a.section} {name}: done in {timings[name]:.1f} s")
    meta = {
        **run_meta(),
        "seed": ctx.seed,
        "min_effect": ctx.min_effect,
        "timings": timings,
        "seconds": round(time.perf_counter() - t0, 1),
        "configs": {n: config_to_dict(configs.get(n) or get(n).make_config()) for n in wanted},
    }
    if ctx.task is not None:
        meta["task_source"] = ctx.task.source
    return {n: ctx.results[n] for n in analyses() if n in wanted and n in ctx.results}, meta


def run_one(ctx: Context, name: str, cfg: Any = None) -> Any:
    """Run analysis `name` (and what it needs) through `run_analysis`, with the same checks, profile
    label and progress; its result, or None where `cfg` sized it to nothing. A model-level analysis
    (a bench, `verify`, a prompt's attribution) runs this way from the CLI and the report."""
    results, _ = run_analysis(ctx, [name], {name: cfg} if cfg is not None else None)
    return results.get(name)


def _with_needs(names: Sequence[str]) -> set[str]:
    out: set[str] = set()
    todo = list(names)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += list(get(n).needs)
    return out


def collect(
    model,
    task,
    names: Sequence[str],
    *,
    n: int | None = None,
    overrides: Mapping | None = None,
    configs: Mapping | None = None,
    preset: str = "full",
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
    progress: bool = True,
    memo: dict | None = None,
    fit_context: bool = False,
) -> SectionReport:
    """Run task-level analyses `names` on one model and task, sharing prompt pairs among them, and
    collect their results in one `SectionReport`.

    Each analysis's config is `configs[name]`, else its `preset` with `overrides` (and `n`) for the
    fields it has; `memo` is the run's shared memo: a loaded SAE, say, or one dict passed to every
    section of a report on one task, so that they share prompt pairs and what was computed on them.
    `fit_context`: sizes the analyses fit to the model as loaded (agent-loop turns) are fitted,
    where the configs hold their defaults (`Context.fit_context`)."""
    from kvnotes.tasks import load_task

    task = load_task(task)
    over = {**(overrides or {}), **({"n": n} if n is not None else {})}
    cfgs = {k: (configs or {}).get(k) or get(k).make_config(preset, **over) for k in names}
    memo = memo if memo is not None else {}
    ctx = Context(
        model=model,
        task=task,
        seed=seed,
        min_effect=min_effect,
        progress=progress,
        memo=memo,
        fit_context=fit_context,
    )
    results, meta = run_analysis(ctx, names, cfgs)
    sizes = [c.n for c in cfgs.values() if hasattr(c, "n")]
    return SectionReport(
        model=model.name,
        task=task.name,
        n=n if n is not None else (sizes[0] if sizes else 0),
        seed=seed,
        results=results,
        meta=meta,
    )


def run_section(
    command: str,
    model,
    task,
    names: Sequence[str] | str | None = ("all",),
    **kwargs,
) -> SectionReport:
    """Run the analyses `names` of command `command` ("probe", "circuits", "edit", ...; "all" or
    empty: its defaults) on one model and task: the names are checked before anything runs, then
    `collect` runs them (`kwargs` are its own)."""
    return collect(model, task, choose(command, names), **kwargs)


__all__ = ["collect", "run_analysis", "run_meta", "run_one", "run_section", "versions"]
