"""The causal probes and controls of kvnotes, over gated-decision tasks.

    from kvnotes import load_model
    from probes import make_trials, field_refresh, run_probes
    model = load_model("gemma-3-270m")
    trials = make_trials(model, "order-cancel", n=8)
    field_refresh(trials).estimate          # recovery: mean, 95% CI, per-prompt values
    run_probes(model, "order-cancel", n=8)   # all six, as one SectionReport

Each probe is declared in the analysis registry (`kvnotes.analysis.registry`) beside its code; the
`probe`, `edit` and `compose` commands and the report run them from there.
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
        "probes",
        "Causal probes and the note map",
        order=10,
        command="probe",
        help="causal probes of where a model keeps its conclusion, and the regime sweep",
        intro="Where the decision reads its conclusion: the changed "
        "field's own slots, or the notes downstream.",
    )
)
register_section(
    Section(
        "regime",
        "Regime",
        order=20,
        command="probe",
        intro="The same probes as filler pushes the field away from the decision.",
    )
)

# every name is imported from its module on first use: importing `probes` (or one of its modules,
# which runs this file first) loads none of the probes
_LAZY = {
    "Estimate": "kvnotes.analysis.stats",
    "SectionReport": "kvnotes.analysis.results",
    "TaskResult": "kvnotes.analysis.results",
    "Trial": "kvnotes.analysis.trials",
    "make_trials": "kvnotes.analysis.trials",
    "agent_loop": "probes.agent",
    "field_refresh": "probes.causal",
    "note_map": "probes.causal",
    "notes_transplant": "probes.causal",
    "seam_repair": "probes.compose",
    "dissociation": "probes.controls",
    "false_note_injection": "probes.controls",
    "knockout": "probes.controls",
    "cot_refresh": "probes.cot",
    "edit_methods": "probes.edit",
    "keystone": "probes.keystone",
    "memory_blocks": "probes.memory",
    "memory_placement": "probes.placement",
    "regime": "probes.regime",
    "weight_edit": "probes.weights",
}
_, _lazy_getattr, _ = lazy_package(__name__, _LAZY)


def __getattr__(name: str):
    """`PROBES`: the probe command's default analyses, read from the registry on first use (not at
    import: finding the analyses imports this package's modules, and circuits', in turn); any
    other exported name from its module (`_LAZY`)."""
    if name == "PROBES":
        return tuple(a.name for a in for_command("probe") if a.default)
    return _lazy_getattr(name)


def __dir__() -> list[str]:
    return list(__all__)


def check_names(names: Sequence[str]) -> list[str]:
    """The probes `names` asks for ("all": the six probes and controls; "regime" is its own sweep)."""
    return choose("probe", names)


def run_probes(
    model: KVModel,
    task: Task | str,
    names: Sequence[str] = ("all",),
    *,
    n: int = 8,
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
    progress: bool = True,
) -> SectionReport:
    """Run the named probes on `n` pairs of `task`, sharing prefills and note maps among them.

    >>> from kvnotes import load_model
    >>> report = run_probes(load_model("tiny-llama"), "order-cancel", ["field_refresh"], n=2,
    ...                     progress=False)
    >>> report.results["field_refresh"].parts["deviation_before_field"].values  # exact: invariant 4
    (0.0, 0.0)
    """
    return run_section("probe", model, task, names, n=n, seed=seed, min_effect=min_effect, progress=progress)


__all__ = [
    "PROBES",
    "run_probes",
    "make_trials",
    "Trial",
    "SectionReport",
    "TaskResult",
    "Estimate",
    "field_refresh",
    "notes_transplant",
    "note_map",
    "knockout",
    "dissociation",
    "false_note_injection",
    "regime",
    "UnknownAnalysisError",
    "MIN_EFFECT",
    "edit_methods",
    "keystone",
    "seam_repair",
    "agent_loop",
    "cot_refresh",
    "memory_blocks",
    "memory_placement",
    "weight_edit",
]
