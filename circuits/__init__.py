"""Head-level circuits of the notes: who writes the conclusion, who reads it, what a scrubbed
hypothesis preserves, how fast gradients rank it, and which SAE features carry it.

    from kvnotes import load_model
    from circuits import make_trials, read_heads, run_circuits
    model = load_model("gemma-3-270m")
    trials = make_trials(model, "order-cancel", n=8)
    read_heads(trials).tables["ranking"][:5]           # the heads that read the conclusion
    run_circuits(model, "order-cancel", n=8)          # every analysis, as one SectionReport

Each analysis is declared in the registry (`kvnotes.analysis.registry`) beside its code.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvnotes.analysis.registry import (
    MIN_EFFECT,
    Section,
    UnknownAnalysisError,
    choose,
    for_command,
    register_section,
)
from kvnotes.analysis.results import SectionReport
from kvnotes.analysis.runner import run_section
from kvnotes.lazy import lazy_package
from kvnotes.models.model import KVModel
from kvnotes.tasks import Task

register_section(
    Section(
        "circuits",
        "Circuits",
        order=30,
        command="circuits",
        help="head-level read/write circuits, causal scrubbing, attribution patching and SAE features "
        "(docs/circuits.md)",
        intro=(
            "Which heads write the conclusion onto the notes and which read it at the decision; "
            "what a scrubbed "
            "hypothesis keeps; how gradients rank it; which SAE features carry it."
        ),
    )
)

# every name is imported from its module on first use: importing `circuits` (or one of its
# modules, which runs this file first) loads none of the analyses
_LAZY = {
    "SectionReport": "kvnotes.analysis.results",
    "make_trials": "kvnotes.analysis.trials",
    "Attribution": "circuits.attribution",
    "attribute": "circuits.attribution",
    "attribution": "circuits.attribution",
    "EdgeBenchReport": "circuits.edge_bench",  # `kvnotes bench edges`
    "edge_bench": "circuits.edge_bench",
    "EdgeCircuits": "circuits.edge_circuits",
    "analyse_edges": "circuits.edge_circuits",
    "sae_analysis": "circuits.features",
    "GroundTruthReport": "circuits.ground_truth",  # `kvnotes bench ground-truth`
    "ground_truth_bench": "circuits.ground_truth",
    "Head": "circuits.heads",
    "all_heads": "circuits.heads",
    "read_sweep": "circuits.heads",
    "write_sweep": "circuits.heads",
    "PromptAttribution": "circuits.prompt_attribution",
    "attribute_prompt": "circuits.prompt_attribution",
    "read_heads": "circuits.read_write",
    "write_heads": "circuits.read_write",
    "scrubbing": "circuits.scrubbing",
}
_, _lazy_getattr, _ = lazy_package(__name__, _LAZY)


def __getattr__(name: str):
    """`ANALYSES`: the circuits command's analyses, read from the registry on first use (not at
    import: finding the analyses imports this package's modules in turn); any other exported name
    from its module (`_LAZY`)."""
    if name == "ANALYSES":
        return tuple(a.name for a in for_command("circuits"))
    return _lazy_getattr(name)


def __dir__() -> list[str]:
    return list(__all__)


def check_analyses(names: Sequence[str]) -> list[str]:
    return choose("circuits", names)


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
) -> SectionReport:
    """Run the named circuit analyses on `n` pairs of `task`, sharing prefills among them.

    Scrubbing's hypothesis uses the top `k_max` read heads (so it runs the read side first); the
    write side draws half as many random head sets. `sae_config` is a `circuits.sae.SAEConfig`,
    `sae` a loaded sae-lens SAE (else one is trained).

    >>> from kvnotes import load_model
    >>> r = run_circuits(load_model("tiny-llama"), "order-cancel", ["read_heads"], n=2, min_effect=0.0,
    ...                  progress=False)
    >>> round(r.results["read_heads"].parts["all_heads"].mean, 2)  # every head patched: the new decision
    1.0
    """
    from kvnotes.analysis.registry import get

    configs = {"write_heads": get("write_heads").make_config(n=n, k_max=k_max, draws=max(draws // 2, 1))}
    memo = {k: v for k, v in {"sae_config": sae_config, "sae": sae}.items() if v is not None}
    run = {"seed": seed, "min_effect": min_effect, "progress": progress, "memo": memo}
    overrides = {"k_max": k_max, "draws": draws}
    return run_section("circuits", model, task, names, n=n, overrides=overrides, configs=configs, **run)


__all__ = [
    "ANALYSES",
    "SectionReport",
    "run_circuits",
    "read_heads",
    "write_heads",
    "scrubbing",
    "attribution",
    "attribute",
    "Attribution",
    "attribute_prompt",
    "analyse_edges",
    "EdgeCircuits",
    "EdgeBenchReport",
    "GroundTruthReport",
    "edge_bench",
    "ground_truth_bench",
    "PromptAttribution",
    "Head",
    "all_heads",
    "read_sweep",
    "write_sweep",
    "sae_analysis",
    "UnknownAnalysisError",
    "check_analyses",
    "make_trials",
]
