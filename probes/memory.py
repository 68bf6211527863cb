"""Memory blocks: facts precompiled together vs in independent blocks, on a two-hop question.

Block A maps customers to order ids, block B maps order ids to statuses; the question needs both
("can Carol's order be cancelled?" → Carol's id → that id's status). *Colocated*: A and B are
precompiled as one chunk; *split*: each is precompiled on its own (B never saw A) and both are
spliced in turn, re-rotated, with `seam` tokens of each repaired. Each is compared with a full
prefill of the same text: answer agreement and logit cosine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tqdm.auto import tqdm

from kvnotes.analysis.registry import Context, Need, Options, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.metrics import logit_cosine
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import decide, precompile, prefiller, splice

NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi")
MEMORY_HEADER = "Customer memory, written by the support system.\n"
QUESTION = "\nOnly pending orders can be cancelled.\nQuestion: can {name}'s order be cancelled?\nAnswer:"


def _block(model: KVModel, text: str) -> Notebook:
    return precompile(model, model.encode(text, bos=False))


@dataclass(frozen=True, kw_only=True)
class MemoryBlocks(TaskResult):
    """Answer agreement and logit cosine with the facts in separate blocks (`split_*`) or in one
    (`colocated_*`), against prefilling them in context; `reference_correct`: that prefill's accuracy."""

    PARTS = ("split_agree", "colocated_agree", "split_cosine", "colocated_cosine", "reference_correct")
    people: int
    seam: int


def memory_blocks(
    model: KVModel, *, n: int = 8, people: int = 4, seam: int = 2, seed: int = 0, progress: bool = True
) -> TaskResult:
    """Parts: `split_agree` (headline), `colocated_agree`, `split_cosine`, `colocated_cosine`, and
    `reference_correct` (whether full recompute itself answers the two-hop question right: if the
    model cannot do the task, agreement only says the splice kept its guess)."""
    answers = [model.answer_token(" cancel"), model.answer_token(" deny")]
    acc: dict[str, list[float]] = {}
    host = model.encode(MEMORY_HEADER)
    pf = prefiller(model)  # the host (and a transcript's earlier turns) computed once
    for i in tqdm(range(n), desc="memory blocks", disable=not progress, unit="prompt"):
        rng = random.Random(f"memory/{seed}/{i}")
        names = rng.sample(NAMES, people)
        ids = [str(rng.randint(10000, 99999)) for _ in names]
        status = [rng.choice(["pending", "shipped"]) for _ in names]
        order_a = rng.sample(range(people), people)
        order_b = rng.sample(range(people), people)
        a = "".join(f"{names[j]}'s order is number {ids[j]}.\n" for j in order_a)
        b = "".join(f"Order {ids[j]} is {status[j]}.\n" for j in order_b)
        target = rng.randrange(people)
        q = model.encode(QUESTION.format(name=names[target]), bos=False)
        ref = decide(model, pf(host + model.encode(a + b, bos=False)), q).last[0]
        correct = 0 if status[target] == "pending" else 1
        acc.setdefault("reference_correct", []).append(float(int(ref[answers].argmax()) == correct))
        both, block_a, block_b = _block(model, a + b), _block(model, a), _block(model, b)
        colocated = splice(model, pf(host), both, seam=min(seam, both.n_slots))
        separate = splice(model, pf(host), block_a, seam=min(seam, block_a.n_slots))
        separate = splice(model, separate, block_b, seam=min(seam, block_b.n_slots))
        for name, nb in (("colocated", colocated), ("split", separate)):
            out = decide(model, nb, q).last[0]
            same = out[answers].argmax() == ref[answers].argmax()
            acc.setdefault(f"{name}_agree", []).append(float(same))
            acc.setdefault(f"{name}_cosine", []).append(float(logit_cosine(out, ref)))
    order = ["split_agree", "colocated_agree", "split_cosine", "colocated_cosine", "reference_correct"]
    return MemoryBlocks.of(
        name="memory_blocks",
        headline="split_agree",
        parts={k: Estimate.of(acc[k]) for k in order},
        people=people,
        seam=seam,
        description="two-hop question over facts precompiled together vs in separate blocks",
    )


@dataclass(frozen=True)
class MemoryConfig(Options):
    questions: int = option(8, "memory-blocks questions", least=1, arg="n")
    people: int = option(4, "people per memory (each with an order number and a status)", least=1)
    seam: int = option(2, "block tokens recomputed in context at each seam", least=0)


@analysis(
    "memory_blocks",
    "compose",
    MemoryConfig,
    MemoryBlocks,
    quick={"questions": 4},
    order=2,
    requires=(Need.MOVING_CHUNKS,),
)
def _run_memory_blocks(ctx: Context, cfg: MemoryConfig) -> MemoryBlocks:
    """Two-hop questions over facts precompiled together vs in separate blocks."""
    return cfg.call(memory_blocks, ctx.model, **ctx.common)
