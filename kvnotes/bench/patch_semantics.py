"""TransformerLens's activation patching against kvnotes' own, side by side
(`kvnotes bench patch-semantics`): a per-slot sweep over a changed field and every slot after it,
three ways in one process.

- `keep`: `decide_patched` (kvnotes' default): each patched slot's K/V, every other slot as the
  old notebook holds it, so only the decision reads the patch;
- `recompute`: `decide_patched(..., downstream="recompute")`: every position after the patched
  one recomputed reading it, batched from each batch's first patched position;
- `run_with_hooks`: the strongest plain TransformerLens way to ask the same: the new prompt's
  activations cached once (`run_with_cache`), then the old prompt batched, one row per slot, each
  row's `attn.hook_k`/`attn.hook_v` at its slot replaced from the cache in every layer.

`recompute` and `run_with_hooks` answer one question and must agree (float32 tolerance, checked in
the run); `keep` answers another, and the report gives how far apart the two questions' answers are
beside the field's whole effect."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.analysis.bench_report import BenchReport, header, machine
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.engine import Capability, hooked, require
from kvnotes.errors import KVNotesError, OutOfRange
from kvnotes.fixtures import FILLER
from kvnotes.models.model import KVModel

WAYS = ("keep", "recompute", "run_with_hooks")
AGREE = 1e-3  # recompute vs run_with_hooks, logits: float32 forwards of two code paths (bfloat16 models: 0.1)


@dataclass(frozen=True)
class SemanticsPoint:
    tokens: int  # the prompt's length
    slots: int  # slots swept (the field and every slot after it)
    keep_s: float  # medians of `repeats` side-by-side timings
    recompute_s: float
    run_with_hooks_s: float
    agree: float  # largest |recompute - run_with_hooks| over every row's logits
    semantics_gap: float  # largest |keep - recompute| in the decision's logit difference
    effect: float  # |new - old| in that logit difference: the field's whole effect
    repeats: int = 1


@dataclass(frozen=True)
class SemanticsReport(BenchReport):
    POINT: ClassVar[type] = SemanticsPoint
    model: str
    machine: str
    results: list[SemanticsPoint]

    def table(self) -> str:
        reps = self.results[0].repeats if self.results else 1
        lines = [
            header("per-slot sweep, two patching semantics", self.model, self.machine, f"median of {reps}"),
            f"{'tokens':>7}{'slots':>7}{'keep s':>9}{'recompute s':>13}{'run_with_hooks s':>18}"
            f"{'hooks/recompute':>17}{'|recompute-hooks|':>19}{'|keep-recompute|':>18}{'effect':>8}",
        ]
        for r in self.results:
            lines.append(
                f"{r.tokens:>7}{r.slots:>7}{r.keep_s:>9.3f}{r.recompute_s:>13.3f}{r.run_with_hooks_s:>18.3f}"
                f"{r.run_with_hooks_s / r.recompute_s:>16.2f}x{r.agree:>19.1e}{r.semantics_gap:>18.4f}"
                f"{r.effect:>8.3f}"
            )
        lines.append(
            "keep: only the decision reads the patch; recompute and run_with_hooks: every later "
            "position recomputed reading it (TransformerLens's activation patching)"
        )
        return "\n".join(lines)


def _hooks_way(model: KVModel, old_ids: list[int], new_ids: list[int], slots: list[int], batch: int):
    """TransformerLens's own sweep: the new run cached once, the old prompt batched with each row's
    slot replaced at every layer's hook_k and hook_v; the last position's logits per slot."""
    tl = hooked(model)
    names = [f"blocks.{l}.attn.hook_{s}" for l in range(tl.cfg.n_layers) for s in "kv"]

    def sweep() -> torch.Tensor:
        with torch.no_grad():
            _, cache = tl.run_with_cache(torch.tensor([new_ids]), names_filter=lambda n: n in names)
            out = []
            for a in range(0, len(slots), batch):
                rows = torch.arange(len(slots[a : a + batch]))
                at = torch.tensor(slots[a : a + batch])

                def put(act, hook, rows=rows, at=at):
                    act[rows, at] = cache[hook.name][0, at]
                    return act

                toks = torch.tensor([old_ids] * len(rows))
                out.append(tl.run_with_hooks(toks, fwd_hooks=[(n, put) for n in names])[:, -1])
            return torch.cat(out)

    return sweep


def patch_semantics(
    model: KVModel, n_tokens: int = 64, *, repeats: int = 3, batch: int = 16, progress: bool = True
) -> SemanticsReport:
    """The per-slot sweep three ways (module docstring) on a prompt of about `n_tokens` with the
    changed field at its middle; refused where `recompute` and `run_with_hooks` disagree."""
    require(model, Capability.TRANSFORMER_LENS, "the run_with_hooks way of the patch-semantics bench")
    from kvnotes.prompt import Template

    n_lines = max(2, n_tokens // max(1, len(model.encode(FILLER.format(i=10), bos=False))))
    lines = [FILLER.format(i=i) for i in range(n_lines)]
    k = n_lines // 2
    tpl = Template(
        "".join(lines[:k])
        + "order_status: {order_status}\n"
        + "".join(lines[k:])
        + "[[decision:Q: Can the order be cancelled?\nA:]]"
    )
    old = tpl.render(model, order_status="pending")
    new = old.with_values(model, order_status="shipped")
    if len(old) > model.n_ctx:
        raise OutOfRange(
            f"{len(old)} tokens exceed {model.name}'s n_ctx={model.n_ctx}; lower --prompt-length"
        )
    dst, src = ops.prefill(model, old), ops.prefill(model, new)
    d0 = old.span("decision").start
    slots = list(range(old.span("order_status").start, d0))
    specs = [ops.Patch(positions=(p,)) for p in slots]
    ways = {
        "keep": lambda: ops.decide_patched(model, dst, src, specs, old).last,
        "recompute": lambda: (
            ops.decide_patched(model, dst, src, specs, old, downstream="recompute", batch_size=batch).last
        ),
        "run_with_hooks": _hooks_way(model, list(old.ids), list(new.ids), slots, batch),
    }
    seconds: dict[str, list[float]] = {w: [] for w in WAYS}
    got = {w: go().float() for w, go in ways.items()}  # warm-up: first calls pay one-off costs
    for _ in tqdm(range(max(1, repeats)), desc="patch semantics", unit="repeat", disable=not progress):
        for w, go in ways.items():  # side by side, in turn, each repeat
            t0 = time.perf_counter()
            got[w] = go().float()
            seconds[w].append(time.perf_counter() - t0)
    agree = float((got["recompute"] - got["run_with_hooks"]).abs().max())
    if agree > (AGREE if model.dtype == torch.float32 else 0.1):
        raise KVNotesError(
            f"recompute and run_with_hooks disagree by {agree:.3g} logits on {model.name}: the two "
            "ways of TransformerLens's patching must compute the same; report this as a bug"
        )
    on_new, on_old = ops.decide(model, src, new).last[0], ops.decide(model, dst, old).last[0]
    a, b = _answers(on_new, on_old)

    def ld(x: torch.Tensor) -> torch.Tensor:
        return x[..., a].double() - x[..., b].double()

    effect = abs(float(ld(on_new) - ld(on_old)))
    point = SemanticsPoint(
        tokens=len(old),
        slots=len(slots),
        keep_s=float(np.median(seconds["keep"])),
        recompute_s=float(np.median(seconds["recompute"])),
        run_with_hooks_s=float(np.median(seconds["run_with_hooks"])),
        agree=agree,
        semantics_gap=float((ld(got["keep"]) - ld(got["recompute"])).abs().max()),
        effect=effect,
        repeats=max(1, repeats),
    )
    return SemanticsReport(model=model.name, machine=machine(), results=[point])


def _answers(new: torch.Tensor, old: torch.Tensor) -> tuple[int, int]:
    """The new prompt's top token and the old one's (the old one's runner-up where they agree)."""
    a, b = int(new.argmax()), int(old.argmax())
    return (a, b) if a != b else (a, int(old.topk(2).indices[1]))


@dataclass(frozen=True)
class SemanticsConfig(Options):
    prompt_length: int = option(64, "prompt length in tokens", least=0, tokens=True, skips=True)
    repeats: int = option(3, "side-by-side timings (the median is reported)", least=1)
    batch: int = option(16, "patched rows per forward, for both batched ways", least=1)


@analysis(
    "patch_semantics",
    "bench",
    SemanticsConfig,
    SemanticsReport,
    quick={"prompt_length": 32, "repeats": 1},
    title="Patching semantics: kvnotes' and TransformerLens's",
    order=35,
    in_report=False,
)
def _run_patch_semantics(ctx: Context, cfg: SemanticsConfig) -> SemanticsReport | None:
    """A per-slot sweep with later slots kept (kvnotes) and recomputed (TransformerLens's run_with_hooks)."""
    tokens = min(cfg.prompt_length, ctx.model.n_ctx) if ctx.fit_context else cfg.prompt_length
    if not tokens:
        return None
    return cfg.call(patch_semantics, ctx.model, tokens, progress=ctx.progress)
