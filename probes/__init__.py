"""The causal probes and controls of kvnotes, over gated-decision tasks.

from kvnotes import load_model
from probes import make_trials, field_refresh, run_probes
model = load_model("gemma-3-270m")
trials = make_trials(model, "order-cancel", n=8)
field_refresh(trials).estimate          # recovery: mean, 95% CI, per-prompt values
run_probes(model, "order-cancel", n=8)   # all six, as one ProbeReport
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Sequence

from kvnotes.errors import KVNotesError
from kvnotes.models.model import KVModel
from kvnotes.tasks import RULE, Task, load_task
from probes.agent import agent_loop
from probes.causal import field_refresh, note_map, notes_transplant
from probes.compose import seam_repair
from probes.controls import dissociation, false_note_injection, knockout
from probes.cot import cot_refresh
from probes.edit import edit_methods
from probes.memory import memory_blocks
from probes.regime import regime
from probes.results import Estimate, ProbeReport, ProbeResult
from probes.trials import MIN_EFFECT, Trial, make_trials
from probes.weights import weight_edit

PROBES = ("field_refresh", "notes_transplant", "note_map", "knockout", "dissociation", "false_note_injection")


class UnknownProbeError(KVNotesError):
    """A probe name that kvnotes does not have."""


def check_names(names: Sequence[str]) -> list[str]:
    names = list(PROBES) if list(names) == ["all"] else list(names)
    bad = [n for n in names if n not in PROBES]
    if bad:
        raise UnknownProbeError(
            f"unknown probe(s) {bad}: the probes are {list(PROBES)}, 'all', or 'regime' (its own sweep)"
        )
    return names


def run_probes(
    model: KVModel,
    task: Task | str,
    names: Sequence[str] = ("all",),
    *,
    n: int = 8,
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
    progress: bool = True,
) -> ProbeReport:
    """Run the named probes on `n` pairs of `task`, sharing prefills and note maps among them.

    >>> from kvnotes import load_model
    >>> report = run_probes(load_model("tiny-llama"), "order-cancel", ["field_refresh"], n=2,
    ...                     progress=False)
    >>> report.probes["field_refresh"].parts["deviation_before_field"].values
    (0.0, 0.0)
    """
    names = check_names(names)
    task = load_task(task)
    t0 = time.perf_counter()
    gate = [n_ for n_ in names if n_ != "dissociation"]
    trials = make_trials(model, task, n, seed=seed, progress=progress) if gate else []
    timings, results = {}, {}
    for name in names:
        s = time.perf_counter()
        if name == "dissociation":
            if task.rule is None:
                results[name] = _not_applicable(name, f"task {task.name!r} has no [rule] to flip")
                continue
            rule_trials = make_trials(model, task, n, seed=seed, kind=RULE, progress=progress)
            results[name] = dissociation(rule_trials, min_effect=min_effect)
        else:
            fn = {
                "field_refresh": field_refresh,
                "notes_transplant": notes_transplant,
                "note_map": note_map,
                "knockout": knockout,
                "false_note_injection": false_note_injection,
            }[name]
            results[name] = fn(trials, min_effect=min_effect)
        timings[name] = round(time.perf_counter() - s, 2)
        if progress:
            print(f"probe {name}: done in {timings[name]:.1f} s", file=sys.stderr, flush=True)
    meta = {
        "min_effect": min_effect,
        "seconds": round(time.perf_counter() - t0, 1),
        "timings": timings,
        "machine": f"{platform.machine()}",
        "task_source": task.source,
        "prompt_tokens": [len(t.pair.old) for t in trials],
    }
    return ProbeReport(model=model.name, task=task.name, n=n, seed=seed, probes=results, meta=meta)


def _not_applicable(name: str, why: str) -> ProbeResult:
    return ProbeResult(
        name=name, headline="notes", parts={"notes": Estimate.of([])}, details={"not_applicable": why}
    )


__all__ = [
    "PROBES",
    "run_probes",
    "make_trials",
    "Trial",
    "ProbeReport",
    "ProbeResult",
    "Estimate",
    "field_refresh",
    "notes_transplant",
    "note_map",
    "knockout",
    "dissociation",
    "false_note_injection",
    "regime",
    "UnknownProbeError",
    "MIN_EFFECT",
    "edit_methods",
    "seam_repair",
    "agent_loop",
    "cot_refresh",
    "memory_blocks",
    "weight_edit",
]
