"""Benchmarks that run two ways side by side in one process and report the ratio.

`patch_sweep`: a per-slot KV transplant sweep over the last 64 slots (all layers) of a prompt,
(a) by the engine — the prefix is never recomputed, a chunk of patched notebooks is one batched
forward over the decision tokens only — and (b) the way a TransformerLens user would do it
without a notebook: one full forward of the whole prompt per patch, with hooks on
`hook_rot_k`/`hook_v` that set every prefix slot's K/V to the patched notebook's, unembedding
only the last position and only the two answer tokens, as the engine does (the fair version of
naive: no full-vocabulary logits at every position).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.analysis import MODEL, Context, Section, analysis, option, register_section
from kvnotes.conformance import POLICY, QUERY, STATE, filled_pair
from kvnotes.display import Displayable
from kvnotes.engine import final_logits
from kvnotes.hooks import hook_name
from kvnotes.metrics import logit_diff, recovery
from kvnotes.models.model import KVModel
from kvnotes.prompt import Prompt


@dataclass(frozen=True)
class SweepResult:
    tokens: int
    n_patches: int
    engine_s: float
    naive_s: float
    ratio: float
    max_recovery_diff: float
    max_logit_diff: float


class BenchReport(Displayable):
    """JSON for a benchmark report dataclass whose `results` are `POINT` dataclasses."""

    POINT: ClassVar[type]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        return cls(**{**d, "results": [cls.POINT(**r) for r in d["results"]]})


@dataclass(frozen=True)
class SweepReport(BenchReport):
    POINT: ClassVar[type] = SweepResult
    model: str
    machine: str
    results: list[SweepResult]

    def table(self) -> str:
        lines = [
            f"patch sweep — {self.model} — {self.machine}",
            f"{'tokens':>7}{'patches':>8}{'engine s':>10}{'naive s':>10}{'ratio':>9}"
            f"{'max |Δrecovery|':>17}{'max |Δlogit|':>14}",
        ]
        for r in self.results:
            lines.append(
                f"{r.tokens:>7}{r.n_patches:>8}{r.engine_s:>10.3f}{r.naive_s:>10.2f}"
                f"{r.ratio:>8.1f}x{r.max_recovery_diff:>17.2e}{r.max_logit_diff:>14.2e}"
            )
        return "\n".join(lines)


def machine() -> str:
    return (
        f"{platform.machine()} {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)"
    )


def sweep_prompts(model: KVModel, n_tokens: int) -> tuple[Prompt, Prompt]:
    """An aligned (old, new) pair of about `n_tokens` tokens, the field near the start."""
    return filled_pair(model, POLICY + STATE, QUERY, n_tokens)


def _naive_logits(model: KVModel, prompt: Prompt, nb, stop: int, vocab: tuple[int, ...]) -> torch.Tensor:
    """One full forward with every prefix slot's K/V forced to `nb`'s; last-position logits of `vocab`."""
    keys = [k[0].transpose(0, 1) for k in nb.keys]  # [slot, kv_head, d_head]
    values = [v[0].transpose(0, 1) for v in nb.values]
    saved = {}

    def set_k(k, hook):
        k[0, :stop] = keys[hook.layer()]
        return k

    def set_v(v, hook):
        v[0, :stop] = values[hook.layer()]
        return v

    def grab(x, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
        saved["x"] = x[:, -1]

    last = hook_name(model.n_layers - 1, "hook_resid_post")
    hooks = [
        (lambda n: n.endswith("attn.hook_rot_k"), set_k),
        (lambda n: n.endswith("attn.hook_v"), set_v),
        (last, grab),
    ]
    model.tl.run_with_hooks(torch.tensor([list(prompt.ids)]), return_type=None, fwd_hooks=hooks)
    return final_logits(model, saved["x"], torch.tensor(vocab))


def patch_sweep(
    model: KVModel, n_tokens: int, *, n_slots: int = 64, batch_size: int = 16, progress: bool = True
) -> SweepResult:
    """Time the per-slot transplant sweep both ways on a prompt of about `n_tokens` tokens."""
    old, new = sweep_prompts(model, n_tokens)
    with torch.no_grad():
        nb_old, nb_new = ops.prefill(model, old), ops.prefill(model, new)
        stop = nb_old.next_position
        ref_old, ref_new = ops.decide(model, nb_old, old).last[0], ops.decide(model, nb_new, new).last[0]
        # the answer pair whose logit difference the edit moves most: recovery is well conditioned
        shift = ref_new - ref_old
        a, b = int(shift.argmax()), int(shift.argmin())
        ld_old, ld_new = logit_diff(ref_old, a, b), logit_diff(ref_new, a, b)
        slots = list(range(stop - n_slots, stop))
        specs = [ops.Patch(positions=(p,)) for p in slots]

        ops.decide_patched(model, nb_old, nb_new, specs[:batch_size], new, batch_size=batch_size)
        _naive_logits(model, new, nb_old, stop, (a, b))  # warm both paths before timing either
        t0 = time.perf_counter()
        engine = ops.decide_patched(model, nb_old, nb_new, specs, new, batch_size=batch_size, vocab=(a, b))
        engine_s = time.perf_counter() - t0

        naive = []
        t0 = time.perf_counter()
        for spec in tqdm(specs, desc=f"naive sweep ({len(old)} tokens)", disable=not progress):
            naive.append(_naive_logits(model, new, ops.patch(nb_old, nb_new, spec), stop, (a, b))[0])
        naive_s = time.perf_counter() - t0
    naive_ab = torch.stack(naive)
    rec_engine = recovery(logit_diff(engine, 0, 1), ld_old, ld_new)
    rec_naive = recovery(logit_diff(naive_ab, 0, 1), ld_old, ld_new)
    return SweepResult(
        tokens=len(old),
        n_patches=len(specs),
        engine_s=engine_s,
        naive_s=naive_s,
        ratio=naive_s / engine_s,
        max_recovery_diff=float((rec_engine - rec_naive).abs().max()),
        max_logit_diff=float((engine - naive_ab).abs().max()),
    )


def patch_sweep_report(model: KVModel, lengths: list[int], **kwargs) -> SweepReport:
    return SweepReport(
        model=model.name, machine=machine(), results=[patch_sweep(model, n, **kwargs) for n in lengths]
    )


@dataclass(frozen=True)
class SweepConfig:
    tokens: tuple[int, ...] = option((256, 1024), "prompt lengths")
    slots: int = option(64, "how many trailing slots to sweep")


register_section(Section("bench", "Benchmarks", level=MODEL, command="bench", order=60))


@analysis("patch_sweep", "bench", SweepConfig, SweepReport, in_report=False)
def _run_patch_sweep(ctx: Context, cfg: SweepConfig) -> SweepReport:
    """Per-slot transplant sweep: engine vs naive full forwards."""
    return patch_sweep_report(ctx.model, list(cfg.tokens), n_slots=cfg.slots, progress=ctx.progress)
