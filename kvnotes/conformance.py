"""`verify(model)`: the eight invariants of docs/engine.md ("Exactness"), measured on this model.

A user who brings a new architecture runs this first (`kvnotes verify --model DIR`): if all
eight pass, patching, editing and splicing on that model are exact against full recompute.
Each invariant runs on a generated prompt and on one longer than any sliding window.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.display import Displayable
from kvnotes.engine import run
from kvnotes.errors import TokenCountChanged
from kvnotes.metrics import kv_deviation
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.prompt import Prompt, Template

# fp32 tolerances, relative to the largest magnitude of the reference tensor.
RTOL = 2e-5
ATOL_FLOOR = 1e-5
# Re-rotation compares against a prefill at *another absolute offset*. That prefill is itself not
# bit-identical to the one at offset 0 in fp32: every attention score is rounded at other angles,
# and the drift compounds over layers. On Gemma 3 270M with a ~700-token chunk the values — which
# re-rotation never touches — already differ from the offset-0 prefill by ~2e-4 of their scale.
# So this one invariant gets a looser relative tolerance; a real RoPE mistake (wrong base, off-by-one
# position, wrong pairing) errs by O(|k|), four orders of magnitude above it.
RTOL_SHIFTED = 2e-4

POLICY = (
    "[[policy:Policy: an order may be cancelled while its status is pending. Once an order "
    "has shipped, deny the cancellation and offer a return instead.]]\n"
)
FILLER = "Note {i}: refunds are allowed within 30 days; keep the customer informed.\n"
STATE = "Customer: Alice. Order id: 1234.\norder_status: {order_status}.\n"
QUERY = "[[query:Q: Can the order be cancelled?]]\n[[decision:A:]]"
VALUES = ("pending", "shipped", "delivered", "processing", "returned", "cancelled", "open", "closed")


@dataclass(frozen=True)
class InvariantResult:
    name: str
    description: str
    max_abs_error: float
    tolerance: float
    passed: bool
    per_prompt: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class VerifyReport(Displayable):
    model: str
    passed: bool
    invariants: list[InvariantResult]
    prompts: dict[str, int]  # prompt label -> token count
    max_window: int | None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> VerifyReport:
        return cls(
            model=d["model"],
            passed=d["passed"],
            prompts=d["prompts"],
            max_window=d["max_window"],
            invariants=[InvariantResult(**r) for r in d["invariants"]],
        )

    def table(self) -> str:
        lines = [
            f"kvnotes verify — {self.model} (prompts: "
            + ", ".join(f"{k} {v} tokens" for k, v in self.prompts.items())
            + f"; largest sliding window: {self.max_window})"
        ]
        lines.append(f"{'':2}{'invariant':34}{'max |error|':>14}{'tolerance':>12}  result")
        for i, r in enumerate(self.invariants, 1):
            lines.append(
                f"{i:<2}{r.name:34}{r.max_abs_error:>14.3e}{r.tolerance:>12.1e}  "
                f"{'pass' if r.passed else 'FAIL'}"
            )
        lines.append("all invariants pass" if self.passed else "SOME INVARIANTS FAIL")
        return "\n".join(lines)


def verification_prompts(model: KVModel) -> dict[str, tuple[Prompt, Prompt]]:
    """Two aligned (old, new) prompt pairs: a short one and one longer than any sliding window."""
    window = model.max_window or 0
    # long: past every sliding window and at least 256 tokens, leaving room in n_ctx to re-rotate it
    long = min(max(window + 24, 256), model.n_ctx // 2 - 16)
    return {
        label: filled_pair(model, POLICY, STATE + QUERY, n) for label, n in (("short", 0), ("long", long))
    }


def filled_pair(model: KVModel, before: str, after: str, min_tokens: int) -> tuple[Prompt, Prompt]:
    """An aligned (old, new) `order_status` pair of template `before + filler lines + after`,
    with just enough filler lines for at least `min_tokens` tokens."""
    n_filler = 0
    while True:
        filler = "".join(FILLER.format(i=i) for i in range(n_filler))
        old, new = _aligned_pair(model, Template(before + filler + after))
        if len(old) >= min_tokens:
            return old, new
        n_filler += max(1, (min_tokens - len(old)) // 40)  # creep up: lines are 14-40 tokens


def _aligned_pair(model: KVModel, tpl: Template) -> tuple[Prompt, Prompt]:
    for a in VALUES:
        old = tpl.render(model, order_status=a)
        for b in VALUES:
            if b == a:
                continue
            try:
                return old, old.with_values(model, order_status=b)
            except TokenCountChanged:
                continue
    raise TokenCountChanged(f"no two order_status values tokenize to the same length under {model.name}")


def _maxdiff_nb(a: Notebook, b: Notebook) -> tuple[float, float]:
    if not torch.equal(a.positions, b.positions):
        b = b.select(a.positions)
    err = max(
        max((x - y).abs().max().item() for x, y in zip(a.keys, b.keys)),
        max((x - y).abs().max().item() for x, y in zip(a.values, b.values)),
    )
    scale = max(max(x.abs().max().item() for x in a.keys), max(x.abs().max().item() for x in a.values))
    return err, scale


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    return (a - b).abs().max().item(), b.abs().max().item()


def _checks(model: KVModel, old: Prompt, new: Prompt) -> dict[str, Callable[[], tuple[float, float]]]:
    """Each check returns (max abs error, magnitude of the reference)."""
    field_start = old.span("order_status").start
    stop = old.span("decision").start
    nb_old = ops.prefill(model, old)
    nb_new = ops.prefill(model, new)
    decided_new = ops.decide(model, nb_new, new).last  # the reference decision of two checks

    def decide_equals_full():
        full = model.tl(torch.tensor([list(old.ids)]))[0, -1]
        return _maxdiff(ops.decide(model, nb_old, old).last[0], full)

    def prefix_then_suffix():
        mid = stop // 2
        nb, _ = run(
            model,
            ops.prefill(model, old, upto=mid),
            list(old.ids[mid:stop]),
            torch.arange(mid, stop),
            logits_at=(),
        )
        return _maxdiff_nb(nb, nb_old)

    def suffix_recompute():
        nb = ops.recompute_suffix(model, nb_old, new, field_start)
        e1, s1 = _maxdiff_nb(nb, nb_new)
        e2, s2 = _maxdiff(ops.decide(model, nb, new).last, decided_new)
        return max(e1, e2), max(s1, s2)

    def deviation_before_field():
        dev = kv_deviation(nb_old, nb_new)[:, :, nb_old.positions < field_start]
        return dev.max().item(), 0.0

    def patch_all_reproduces_source():
        patched = ops.patch(nb_old, nb_new, ops.Patch())
        return _maxdiff(ops.decide(model, patched, new).last, decided_new)

    def rerotation_equals_offset_prefill():
        chunk = list(old.ids[1:stop])  # the prompt without BOS, as a chunk
        q = min(len(old.ids) + 13, model.n_ctx - len(chunk) - 8)  # past the prompt, inside n_ctx
        moved = ops.rerotate(model, ops.prefill(model, chunk), q)
        return _maxdiff_nb(moved, ops.prefill(model, chunk, offset=q))

    def refresh_unchanged_is_noop():
        return _maxdiff_nb(ops.refresh(model, nb_old, old, "order_status"), nb_old)

    def batched_equals_single():
        rng = random.Random(0)
        downstream = [p for p in range(field_start, stop)]
        specs = [
            ops.Patch(
                positions=(p,),
                layers=tuple(sorted(rng.sample(range(model.n_layers), k=max(1, model.n_layers // 2)))),
                keys=i % 3 != 1,
                values=i % 3 != 2,
            )
            for i, p in enumerate(downstream[:8])
        ]
        batched = ops.decide_patched(model, nb_old, nb_new, specs, new, batch_size=3)
        single = torch.stack([ops.decide(model, ops.patch(nb_old, nb_new, s), new).last[0] for s in specs])
        return _maxdiff(batched, single)

    return {
        "decide_equals_full_forward": decide_equals_full,
        "prefix_then_suffix_equals_prefill": prefix_then_suffix,
        "suffix_recompute_equals_prefill": suffix_recompute,
        "kv_deviation_before_field_is_zero": deviation_before_field,
        "patch_all_reproduces_source": patch_all_reproduces_source,
        "rerotation_equals_offset_prefill": rerotation_equals_offset_prefill,
        "refresh_unchanged_is_noop": refresh_unchanged_is_noop,
        "batched_patches_equal_single": batched_equals_single,
    }


DESCRIPTIONS = {
    "decide_equals_full_forward": "decide on a prefilled notebook = logits of one full forward",
    "prefix_then_suffix_equals_prefill": (
        "prefill(prefix) then run(suffix) = prefill(prefix+suffix), every slot"
    ),
    "suffix_recompute_equals_prefill": (
        "suffix recompute from the edited field = prefill of the edited prompt"
    ),
    "kv_deviation_before_field_is_zero": "every slot before the edited field has exactly zero KV deviation",
    "patch_all_reproduces_source": "patching every slot and layer from a source reproduces its decision",
    "rerotation_equals_offset_prefill": "re-rotating an isolated chunk 0 -> q = prefilling it at offset q",
    "refresh_unchanged_is_noop": "field refresh with an unchanged value changes nothing",
    "batched_patches_equal_single": "a batched sweep of N patches = N single patches",
}
EXACT = {"kv_deviation_before_field_is_zero", "patch_all_reproduces_source"}
SHIFTED = {"rerotation_equals_offset_prefill"}


def verify(model: KVModel, *, progress: bool = True) -> VerifyReport:
    """Measure the eight invariants on `model`; see `VerifyReport.table()` for a readable summary."""
    prompts = verification_prompts(model)
    errors: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in DESCRIPTIONS}
    steps = [(label, pair) for label, pair in prompts.items()]
    with torch.no_grad():
        bar = tqdm(steps, desc=f"verify {model.name}", disable=not progress, unit="prompt")
        for label, (old, new) in bar:
            for name, check in _checks(model, old, new).items():
                errors[name][label] = check()
    results = []
    for name, per in errors.items():
        err = max(e for e, _ in per.values())
        scale = max(s for _, s in per.values())
        rtol = RTOL_SHIFTED if name in SHIFTED else RTOL
        tol = 0.0 if name in EXACT else max(ATOL_FLOOR, rtol * scale)
        results.append(
            InvariantResult(
                name=name,
                description=DESCRIPTIONS[name],
                max_abs_error=err,
                tolerance=tol,
                passed=err <= tol,
                per_prompt={k: e for k, (e, _) in per.items()},
            )
        )
    return VerifyReport(
        model=model.name,
        passed=all(r.passed for r in results),
        invariants=results,
        prompts={k: len(v[0]) for k, v in prompts.items()},
        max_window=model.max_window,
    )
