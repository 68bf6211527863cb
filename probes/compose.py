"""Composition: splice a precompiled chunk into other contexts and repair the seam.

For each sampled task prompt, the chunk is everything between BOS and the line of the gating
field (the policy and the few-shot block, for the built-in tasks). It is precompiled once in
isolation, then spliced after a host context of `offset` neutral tokens with per-layer
re-rotation, its first `b` tokens recomputed in context (seam repair), the live state block and
request computed after it, and the decision read. The reference is a full prefill of the same
composed text. The ablation skips re-rotation: the chunk's keys keep their old positions' angles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from kvnotes.analysis.registry import Context, Need, Options, Section, analysis, option, register_section
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.engine import run
from kvnotes.errors import TaskError
from kvnotes.metrics import logit_cosine
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import decide, precompile, prefiller, splice
from kvnotes.tasks import Task, load_task, sample
from probes.regime import filler_text

SEAMS = (0, 1, 2, 4, 8, 16)
OFFSETS = (32, 128)


def _place(model: KVModel, host: Notebook, chunk: Notebook, seam: int, rerotate: bool) -> Notebook:
    if rerotate:
        return splice(model, host, chunk, seam=seam)
    moved = replace(chunk, positions=chunk.positions - int(chunk.positions.min()) + host.next_position)
    nb = host.concat(moved)  # keys still rotated for their old positions: the ablation
    if seam:
        nb, _ = run(model, nb, moved.tokens[:, :seam], moved.positions[:seam], logits_at=())
    return nb


def chunk_end(p, field: str) -> int:
    """Token index where the line holding `field` starts: the chunk ends there."""
    line_start = p.text.rfind("\n", 0, p.char_spans[field][0]) + 1
    end = next(i for i, (a, b) in enumerate(p.offsets) if b > a and a >= line_start)
    if end <= 1:
        raise TaskError(f"task prompt has nothing before the {field!r} line to precompile as a chunk")
    return end


@dataclass(frozen=True, kw_only=True)
class SeamRepair(TaskResult):
    """Per seam b (chunk tokens recomputed): logit `cosine@b`, answer `agree@b` and `top1@b` against
    prefilling in context, and the same without RoPE re-rotation (`norot_*`)."""

    PART_PATTERNS = (r"(cosine|agree|top1|norot_cosine|norot_agree)@\d+",)
    seams: tuple[int, ...]
    offsets: tuple[int, ...]  # host context lengths before the chunk
    chunk_tokens: tuple[int, ...]  # per prompt


def seam_repair(
    model: KVModel,
    task: Task | str,
    *,
    n: int = 4,
    seams: Sequence[int] = SEAMS,
    offsets: Sequence[int] = OFFSETS,
    seed: int = 0,
    progress: bool = True,
) -> TaskResult:
    """Spliced chunk vs full recompute for every seam length `b` in `seams`, at each host offset.

    Parts, per b: `cosine@b` (logit cosine over the vocabulary), `agree@b` (same answer among the
    task's two), `top1@b` (same top-1 token), and `norot_cosine@b` / `norot_agree@b` without
    re-rotation. Values run over prompts × offsets. Headline: cosine at the largest b.
    """
    task = load_task(task)
    seams = sorted(set(int(b) for b in seams))
    acc: dict[str, list[float]] = {}
    labels: dict[str, list[int]] = {}  # the template of the prompt behind each value in acc

    def add(name: str, value: float) -> None:
        acc.setdefault(name, []).append(value)
        labels.setdefault(name, []).append(pair.template)

    pairs = sample(task, model, n, seed=seed)
    chunk_sizes = []
    pf = prefiller(model)  # the host (and a transcript's earlier turns) computed once
    for pair in tqdm(pairs, desc="seam repair", disable=not progress, unit="prompt"):
        p = pair.old
        ids = list(p.ids)
        c0, c1 = 1, chunk_end(p, task.gate.field)
        d0 = p.span("decision").start
        chunk_ids, live, query = ids[c0:c1], ids[c1:d0], ids[d0:]
        chunk_sizes.append(len(chunk_ids))
        chunk = precompile(model, chunk_ids)
        answers = torch.tensor(pair.answers)
        for off in offsets:
            host_ids = model.encode(filler_text(model, off))[: off + 1]  # BOS + off tokens
            ref = decide(model, pf(host_ids + chunk_ids + live), query).last[0]
            host = pf(host_ids)
            for b in seams:
                for label, rot in (("", True), ("norot_", False)):
                    nb = _place(model, host, chunk, min(b, len(chunk_ids)), rot)
                    nb, _ = run(model, nb, live, logits_at=())
                    out = decide(model, nb, query).last[0]
                    add(f"{label}cosine@{b}", float(logit_cosine(out, ref)))
                    add(f"{label}agree@{b}", float(out[answers].argmax() == ref[answers].argmax()))
                    if rot:
                        add(f"top1@{b}", float(out.argmax() == ref.argmax()))
    order = [f"{k}@{b}" for k in ("cosine", "agree", "top1", "norot_cosine", "norot_agree") for b in seams]
    return SeamRepair.of(
        name="seam_repair",
        headline=f"cosine@{seams[-1]}",
        parts={k: Estimate.of(acc[k], clusters=labels[k]) for k in order},
        seams=seams,
        offsets=offsets,
        chunk_tokens=chunk_sizes,
        description="precompiled policy chunk spliced after a host context, first b tokens recomputed",
    )


@dataclass(frozen=True)
class SeamConfig(Options):
    n: int = option(4, "prompts (each at every offset)", least=1)
    seams: tuple[int, ...] = option(SEAMS, "chunk tokens recomputed at the seam", least=0)
    offsets: tuple[int, ...] = option(OFFSETS, "host context lengths before the chunk", least=0, tokens=True)


register_section(
    Section(
        "compose",
        "Composing",
        order=50,
        command="compose",
        help="splice a precompiled chunk, repair the seam, compare to recompute",
        intro=("A precompiled chunk spliced into a new context, the seam repaired; errata over many turns."),
    )
)


@analysis(
    "seam_repair",
    "compose",
    SeamConfig,
    SeamRepair,
    quick={"n": 2, "seams": (0, 2, 8), "offsets": (32,)},
    order=1,
    requires=(Need.RULE, Need.MOVING_CHUNKS),
)
def _run_seam_repair(ctx: Context, cfg: SeamConfig) -> SeamRepair:
    """Splice a precompiled chunk after a host context, repair the seam, compare to prefill."""
    return cfg.call(seam_repair, ctx.model, ctx.task, **ctx.common)
