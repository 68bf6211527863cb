"""Head-level circuits of the notes: who writes the conclusion, who reads it, what a scrubbed
hypothesis preserves, how fast gradients rank it, and which SAE features carry it.

    from kvnotes import load_model
    from probes import make_trials
    from circuits import read_heads, run_circuits
    model = load_model("gemma-3-270m")
    trials = make_trials(model, "order-cancel", n=8)
    read_heads(trials).tables["ranking"][:5]           # the heads that read the conclusion
    run_circuits(model, "order-cancel", n=8)          # every analysis, as one CircuitReport
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from circuits.attribution import Attribution, attribute, attribution
from circuits.heads import Head, all_heads, read_sweep, write_sweep
from circuits.prompt_attribution import PromptAttribution, attribute_prompt
from circuits.read_write import read_heads, write_heads
from circuits.scrubbing import scrubbing
from kvnotes.bench import versions
from kvnotes.errors import KVNotesError
from kvnotes.models.model import KVModel
from kvnotes.tasks import Task, load_task
from probes.results import ProbeReport, ProbeResult
from probes.trials import MIN_EFFECT, make_trials

ANALYSES = ("read_heads", "write_heads", "scrubbing", "attribution", "sae")
_META = ("model", "task", "n", "seed", "meta")


class UnknownAnalysisError(KVNotesError):
    """An analysis name that `circuits` does not have."""


@dataclass(frozen=True)
class CircuitReport(ProbeReport):
    """Every circuit analysis on one model and task; in JSON each analysis is a top-level key."""

    @property
    def analyses(self) -> Mapping[str, ProbeResult]:
        return self.probes

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "task": self.task,
            "n": self.n,
            "seed": self.seed,
            **{k: v.to_dict() for k, v in self.probes.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> CircuitReport:
        return cls(
            model=d["model"],
            task=d["task"],
            n=d["n"],
            seed=d["seed"],
            probes={k: ProbeResult.from_dict(k, v) for k, v in d.items() if k not in _META},
            meta=d.get("meta", {}),
        )


def check_analyses(names: Sequence[str]) -> list[str]:
    names = list(ANALYSES) if list(names) in (["all"], []) else list(names)
    bad = [n for n in names if n not in ANALYSES]
    if bad:
        raise UnknownAnalysisError(f"unknown analysis(es) {bad}: the analyses are {list(ANALYSES)} or 'all'")
    return names


def run_circuits(
    model: KVModel,
    task: Task | str,
    names: Sequence[str] = ("all",),
    *,
    n: int = 8,
    seed: int = 0,
    k_max: int = 12,
    draws: int = 32,
    sae_config=None,
    sae=None,
    min_effect: float = MIN_EFFECT,
    progress: bool = True,
) -> CircuitReport:
    """Run the named circuit analyses on `n` pairs of `task`, sharing prefills among them.

    Scrubbing's hypothesis uses the top `k_max` read heads (so it runs the read side first);
    `sae_config` is a `circuits.sae.SAEConfig`, `sae` a loaded sae-lens SAE (else one is trained).

    >>> from kvnotes import load_model
    >>> r = run_circuits(load_model("tiny-llama"), "order-cancel", ["read_heads"], n=2, min_effect=0.0,
    ...                  progress=False)
    >>> round(r.analyses["read_heads"].parts["all_heads"].mean, 2)  # every head patched: the new decision
    1.0
    """
    names = check_analyses(names)
    task = load_task(task)
    t0 = time.perf_counter()
    trials = make_trials(model, task, n, seed=seed, progress=progress)
    results: dict[str, ProbeResult] = {}
    timings: dict[str, float] = {}

    def timed(name: str, fn):
        s = time.perf_counter()
        results[name] = fn()
        timings[name] = round(time.perf_counter() - s, 1)
        if progress:
            print(f"circuits {name}: done in {timings[name]:.1f} s", file=sys.stderr, flush=True)

    if "read_heads" in names or "scrubbing" in names:
        timed(
            "read_heads",
            lambda: read_heads(trials, k_max=k_max, draws=draws, seed=seed, min_effect=min_effect),
        )
    if "write_heads" in names:
        timed(
            "write_heads",
            lambda: write_heads(
                trials, k_max=k_max, draws=max(draws // 2, 1), seed=seed, min_effect=min_effect
            ),
        )
    if "scrubbing" in names:
        ranking = results["read_heads"].tables.get("ranking", [])
        heads = [(r["layer"], r["head"]) for r in ranking[:k_max]]
        timed("scrubbing", lambda: scrubbing(trials, task, heads, seed=seed, min_effect=min_effect))
    if "attribution" in names:
        timed("attribution", lambda: attribution(trials, min_effect=min_effect))
    if "sae" in names:
        from circuits.features import sae_analysis
        from circuits.sae import SAEConfig

        cfg = sae_config or SAEConfig(seed=seed)
        timed(
            "sae",
            lambda: sae_analysis(trials, task, cfg=cfg, sae=sae, min_effect=min_effect, progress=progress),
        )
    results = {k: results[k] for k in ANALYSES if k in results}
    meta = {
        "min_effect": min_effect,
        "k_max": k_max,
        "draws": draws,
        "timings": timings,
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": platform.machine(),
        "task_source": task.source,
        "prompt_tokens": [len(t.pair.old) for t in trials],
        "versions": versions(),
    }
    return CircuitReport(model=model.name, task=task.name, n=n, seed=seed, probes=results, meta=meta)


__all__ = [
    "ANALYSES",
    "CircuitReport",
    "run_circuits",
    "read_heads",
    "write_heads",
    "scrubbing",
    "attribution",
    "attribute",
    "Attribution",
    "attribute_prompt",
    "PromptAttribution",
    "Head",
    "all_heads",
    "read_sweep",
    "write_sweep",
    "UnknownAnalysisError",
    "check_analyses",
    "make_trials",
]
