"""The analyses behind `kvnotes verify`, `kvnotes attribute` and `kvnotes sweep`: model-level, with
no task, in the section "tools". Registered like every other analysis, so that the CLI runs them
through the runner, a report or a notebook reads their saved JSON back by their name, and the
dashboard draws each with the panel registered for that name.

`verify` and the slot sweep are declared here, beside no code of theirs (`kvnotes.conformance`
and `kvnotes.serving.remote` compute them); the prompt's attribution is declared beside its code,
in `circuits/prompt_attribution.py`. Their commands keep their own arguments (prompt files, a
remote host), so the section has no generated command; none of them is a part of `kvnotes report`.

    from kvnotes.analysis.runner import run_one
    run_one(Context(model=load_model("tiny-llama")), "verify")
"""

from __future__ import annotations

from dataclasses import dataclass

from kvnotes.analysis.registry import MODEL, Context, Options, Section, analysis, option, register_section
from kvnotes.conformance import VerifyReport
from kvnotes.serving.remote import SlotSweep

TOOLS = register_section(
    Section(
        "tools",
        "Checks and tools on one model",
        level=MODEL,
        order=70,
        intro="The engine's exactness invariants, a prompt's slot attribution, the per-slot sweep.",
    )
)


@dataclass(frozen=True)
class VerifyConfig(Options):
    """`verify` takes nothing beyond the model."""


@analysis("verify", "tools", VerifyConfig, VerifyReport, in_report=False, default=False, order=1)
def _run_verify(ctx: Context, cfg: VerifyConfig) -> VerifyReport:
    """The exactness invariants on one model (and, where transformers has it, against its forward)."""
    from kvnotes.conformance import verify

    del cfg
    return verify(ctx.model)


@dataclass(frozen=True)
class SlotSweepConfig(Options):
    task: str | None = option(
        None,
        "a built-in task or a task.toml (default: the model's own task for an organism, else order-cancel)",
    )
    slots: int | None = option(None, "sweep only the last N slots before the decision", least=1)
    batch_size: int = option(8, "patches per decision trace", least=1)
    remote: str = option("", "'' here, 'local' for a dry run of the remote path, 'ndif', or a host")


@analysis("slot_sweep", "tools", SlotSweepConfig, SlotSweep, in_report=False, default=False, order=3)
def _run_slot_sweep(ctx: Context, cfg: SlotSweepConfig) -> SlotSweep:
    """The per-slot transplant sweep as one nnsight session, here or on NDIF."""
    from kvnotes.serving.remote import slot_sweep
    from kvnotes.tasks import load_task
    from kvnotes.tasks.sampler import sample
    from kvnotes.zoo import default_task

    task = load_task(cfg.task or default_task(ctx.model.name))
    pair = sample(task, ctx.model, 1, seed=ctx.seed)[0]
    slots = pair.downstream()[-cfg.slots :] if cfg.slots else None
    remote = {"": False, "ndif": True}.get(cfg.remote, cfg.remote)
    return cfg.call(slot_sweep, ctx.model, pair, slots, remote=remote)
