"""`verify(model)`: the invariants of docs/engine.md ("Exactness"), measured on this model.

A user who brings a new architecture runs this first (`kvnotes verify --model DIR`): if all
pass, patching, editing and splicing on that model are exact against full recompute. Eight
invariants compare the engine with itself (and one with TransformerLens); two compare it with an
independent reference, the model's Hugging Face transformers counterpart run on the same weights
(eager attention), per layer: its cache's K/V and its logits at every position. Models without a
Hugging Face counterpart skip those two, with the reason in the report. Each invariant runs on a
generated prompt and on one longer than any sliding window.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import cache

import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.display import Displayable
from kvnotes.engine import run
from kvnotes.errors import BadArgument, TokenCountChanged
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
# So this one invariant gets a looser relative tolerance, which grows with the farthest position
# past HF_POSITIONS as RTOL_HF's does (the angles' rounding grows with the position: a Hugging Face
# forward on the nnsight backend, computing cos/sin per call, drifts 2.9e-4 of the scale on
# Gemma's 551-token chunk moved to 565); a real RoPE mistake (wrong base, off-by-one position,
# wrong pairing) errs by O(|k|), three orders of magnitude above it.
RTOL_SHIFTED = 2e-4
# The Hugging Face reference invariants judge every (prompt, layer, K or V) tensor and the logits
# on their own: |engine - transformers| <= rtol * max|transformers tensor| + ATOL_HF, with
# rtol = RTOL_HF * max(1, n / HF_POSITIONS) on an n-token prompt. The two implementations round
# differently in float32 (TransformerLens's precomputed RoPE tables vs cos/sin of position *
# inv_freq per call, other matmul splits); the RoPE angle's rounding grows with the position
# (~ position * 6e-8 rad), and the drift compounds over layers, so the tolerance grows with the
# prompt's length. Measured worst ratio (docs/engine.md, "Exactness"): 4.5e-5 on Gemma 3 270M's
# 552-token prompt (layer 9 values), under 4e-6 on the tiny checkpoints; a real error in a layer
# (a slot rotated one position off, a window one slot too wide, a wrong RoPE base) errs by O(1)
# of that layer's own scale.
RTOL_HF = 2.5e-4
HF_POSITIONS = 512
ATOL_HF = 1e-6

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
    # where the figures come from: the prompt, or for per-layer invariants the prompt, layer and
    # quantity with the highest error / tolerance ratio (its error and its own tolerance above)
    worst: str = ""


@dataclass(frozen=True)
class VerifyReport(Displayable):
    model: str
    passed: bool  # every invariant that ran passed
    invariants: list[InvariantResult]  # the invariants that ran
    prompts: dict[str, int]  # prompt label -> token count
    max_window: int | None
    skipped: dict[str, str] = field(default_factory=dict)  # invariant name -> why it did not run
    reference: str | None = None  # the Hugging Face reference the hf invariants ran against

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
            skipped=d.get("skipped", {}),
            reference=d.get("reference"),
        )

    def table(self) -> str:
        lines = [
            f"kvnotes verify — {self.model} (prompts: "
            + ", ".join(f"{k} {v} tokens" for k, v in self.prompts.items())
            + f"; largest sliding window: {self.max_window})"
        ]
        if self.reference:
            lines.append(f"reference: {self.reference}")
        lines.append(f"{'':3}{'invariant':34}{'max |error|':>14}{'tolerance':>12}  result  worst")
        for i, r in enumerate(self.invariants, 1):
            lines.append(
                f"{i:<3}{r.name:34}{r.max_abs_error:>14.3e}{r.tolerance:>12.1e}  "
                f"{'pass' if r.passed else 'FAIL':6}  {r.worst}"
            )
        for name, why in self.skipped.items():
            lines.append(f"{'-':3}{name:34}{'skipped':>14}  {why}")
        verdict = "all invariants pass" if self.passed else "SOME INVARIANTS FAIL"
        if self.skipped:
            verdict += f" ({len(self.invariants)} ran, {len(self.skipped)} skipped)"
        lines.append(verdict)
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


Measure = tuple[str, float, float]  # (which tensor, max |error|, largest |reference| in it)


def _maxdiff_nb(a: Notebook, b: Notebook, what: str = "") -> list[Measure]:
    """`a` against the reference `b`, one measure per layer and per K or V."""
    if not torch.equal(a.positions, b.positions):
        b = b.select(a.positions)
    out = []
    for l, (x, y) in enumerate(zip(a.keys, b.keys)):
        out.append((f"{what}layer {l} keys", (x - y).abs().max().item(), y.abs().max().item()))
    for l, (x, y) in enumerate(zip(a.values, b.values)):
        out.append((f"{what}layer {l} values", (x - y).abs().max().item(), y.abs().max().item()))
    return out


def _maxdiff(a: torch.Tensor, b: torch.Tensor, what: str = "logits") -> list[Measure]:
    return [(what, (a - b).abs().max().item(), b.abs().max().item())]


# --- the Hugging Face reference ------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Reference:
    """transformers' own forward on the verification prompts: what the hf invariants compare with.

    Per prompt label: the prompt's ids, the cache's post-RoPE keys and values per layer
    (`[batch, n_kv_heads, pos, d_head]`, the notebook's layout), and the logits at every position.
    """

    source: str
    ids: dict[str, tuple[int, ...]]
    keys: dict[str, tuple[torch.Tensor, ...]]
    values: dict[str, tuple[torch.Tensor, ...]]
    logits: dict[str, torch.Tensor]  # [batch, pos, d_vocab]


def hf_reference(
    model: KVModel, prompts: dict[str, tuple[Prompt, Prompt]] | None = None, *, hf_model=None
) -> Reference:
    """Run `model`'s Hugging Face counterpart (loaded from `model.hf_source`, or `hf_model` as given)
    on the verification prompts (the `old` prompt of each pair), eager attention, with a cache.

    The cache is a plain `DynamicCache`, whose every layer keeps every slot (the config-built
    default trims sliding layers to their window), so every slot of every layer is compared.
    """
    if hf_model is None:
        if model.hf_source is None:
            raise BadArgument(
                f"{model.name} has no Hugging Face counterpart to run as a reference (it is built "
                "from a TransformerLens config); load a Hugging Face checkpoint directory with "
                "load_model(DIR), or pass hf_model="
            )
        hf_model, source = model.hf_source.load(), model.hf_source.what
    else:
        source = f"transformers' {type(hf_model).__name__} (given)"
    if getattr(hf_model.config, "_attn_implementation", "eager") != "eager":
        hf_model.set_attn_implementation("eager")
    hf_model.eval()
    prompts = prompts if prompts is not None else verification_prompts(model)
    ids, keys, values, logits = {}, {}, {}, {}
    with torch.no_grad():
        for label, (old, _) in prompts.items():
            ids[label] = tuple(old.ids)
            keys[label], values[label], logits[label] = _hf_forward(hf_model, list(old.ids))
    return Reference(source=source, ids=ids, keys=keys, values=values, logits=logits)


def _hf_forward(hf_model, ids: list[int]):
    from transformers import DynamicCache

    kv = DynamicCache()
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    out = hf_model(input_ids=torch.tensor([ids]), use_cache=True, **{name: kv})
    if hasattr(kv, "layers"):
        keys, values = tuple(x.keys for x in kv.layers), tuple(x.values for x in kv.layers)
    else:  # transformers before the layered cache
        keys, values = tuple(kv.key_cache), tuple(kv.value_cache)
    return keys, values, out.logits


def hf_tolerance(scale: float, n_positions: int) -> float:
    """The hf invariants' tolerance for one tensor of an `n_positions`-token prompt whose
    reference has largest magnitude `scale`."""
    return RTOL_HF * max(1.0, n_positions / HF_POSITIONS) * scale + ATOL_HF


def _hf_checks(model: KVModel, label: str, ref: Reference) -> dict[str, Callable[[], list]]:
    """Each check returns [(where, max abs error, its tolerance)], one per tensor judged."""
    ids = list(ref.ids[label])

    def _measure(where: str, mine: torch.Tensor, expected: torch.Tensor) -> tuple[str, float, float]:
        if mine.shape != expected.shape:
            raise BadArgument(
                f"{where}: the engine gives shape {tuple(mine.shape)} where transformers gives "
                f"{tuple(expected.shape)}; the model's Hugging Face counterpart has another layout"
            )
        err = (mine - expected).abs().max().item()
        return where, err, hf_tolerance(expected.abs().max().item(), len(ids))

    def kv_equals_cache():
        nb = ops.prefill(model, ids)
        nb = nb.select(torch.arange(len(ids)))  # slot order = position order, as in the HF cache
        out = []
        for l in range(model.n_layers):
            out.append(_measure(f"{label}: layer {l} keys", nb.keys[l], ref.keys[label][l]))
            out.append(_measure(f"{label}: layer {l} values", nb.values[l], ref.values[label][l]))
        return out

    def logits_equal():
        _, readout = run(model, Notebook.empty(model), ids, logits_at=range(len(ids)))
        return [_measure(f"{label}: logits, every position", readout.logits, ref.logits[label])]

    return {
        "prefill_kv_equals_transformers": kv_equals_cache,
        "logits_equal_transformers": logits_equal,
    }


# --- the eight self-consistency invariants -------------------------------------------------------
def _checks(model: KVModel, old: Prompt, new: Prompt) -> dict[str, Callable[[], list[Measure]]]:
    """Each check returns its measures: one per tensor it compares (per layer K, per layer V,
    logits), each with its error and the reference tensor's own largest magnitude."""
    field_start = old.span("order_status").start
    stop = old.span("decision").start
    nb_old = cache(lambda: ops.prefill(model, old))
    nb_new = cache(lambda: ops.prefill(model, new))
    decided_new = cache(lambda: ops.decide(model, nb_new(), new).last)  # the reference of two checks

    def decide_equals_full():
        full = model.full_logits(old.ids)[-1]
        return _maxdiff(ops.decide(model, nb_old(), old).last[0], full)

    def prefix_then_suffix():
        mid = stop // 2
        nb, _ = run(
            model,
            ops.prefill(model, old, upto=mid),
            list(old.ids[mid:stop]),
            torch.arange(mid, stop),
            logits_at=(),
        )
        return _maxdiff_nb(nb, nb_old())

    def suffix_recompute():
        nb = ops.recompute_suffix(model, nb_old(), new, field_start)
        return _maxdiff_nb(nb, nb_new()) + _maxdiff(ops.decide(model, nb, new).last, decided_new())

    def deviation_before_field():
        dev = kv_deviation(nb_old(), nb_new())[:, :, nb_old().positions < field_start]
        return [("K/V deviation, every slot before the field", dev.max().item(), 0.0)]

    def patch_all_reproduces_source():
        patched = ops.patch(nb_old(), nb_new(), ops.Patch())
        return _maxdiff(ops.decide(model, patched, new).last, decided_new())

    def rerotation_equals_offset_prefill():
        chunk = list(old.ids[1:stop])  # the prompt without BOS, as a chunk
        q = min(len(old.ids) + 13, model.n_ctx - len(chunk) - 8)  # past the prompt, inside n_ctx
        moved = ops.rerotate(model, ops.prefill(model, chunk), q)
        # the offset prefill's own rounding grows with its farthest position (as RTOL_HF's does)
        grow = max(1.0, (q + len(chunk)) / HF_POSITIONS)
        return [(w, e, s * grow) for w, e, s in _maxdiff_nb(moved, ops.prefill(model, chunk, offset=q))]

    def refresh_unchanged_is_noop():
        return _maxdiff_nb(ops.refresh(model, nb_old(), old, "order_status"), nb_old())

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
        batched = ops.decide_patched(model, nb_old(), nb_new(), specs, new, batch_size=3)
        single = torch.stack(
            [ops.decide(model, ops.patch(nb_old(), nb_new(), s), new).last[0] for s in specs]
        )
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
    "prefill_kv_equals_transformers": (
        "prefill's K/V = the Hugging Face transformers cache of the same prompt, per layer"
    ),
    "logits_equal_transformers": "logits at every position = Hugging Face transformers' forward",
}
EXACT = {"kv_deviation_before_field_is_zero", "patch_all_reproduces_source"}
SHIFTED = {"rerotation_equals_offset_prefill"}
HF_INVARIANTS = ("prefill_kv_equals_transformers", "logits_equal_transformers")
SELF_INVARIANTS = tuple(n for n in DESCRIPTIONS if n not in HF_INVARIANTS)


def verify(
    model: KVModel,
    *,
    progress: bool = True,
    only: Iterable[str] | None = None,
    reference: Reference | None = None,
) -> VerifyReport:
    """Measure the invariants on `model`; see `VerifyReport.table()` for a readable summary.

    only: the names of the invariants to run (default all, `DESCRIPTIONS`).
    reference: a `hf_reference(model)` computed beforehand (default: computed here when the model
    has a Hugging Face counterpart; that loads it, about a minute for Gemma 3 270M).
    """
    names = list(DESCRIPTIONS) if only is None else list(only)
    unknown = [n for n in names if n not in DESCRIPTIONS]
    if unknown:
        raise BadArgument(f"unknown invariant(s) {unknown}; the invariants are {list(DESCRIPTIONS)}")
    prompts = verification_prompts(model)
    skipped: dict[str, str] = {}
    wants_hf = [n for n in names if n in HF_INVARIANTS]
    if wants_hf and reference is None:
        if model.hf_source is None:
            why = (
                f"{model.name} has no Hugging Face counterpart (built from a TransformerLens config), "
                "so there is no independent reference to run"
            )
            skipped = dict.fromkeys(wants_hf, why)
        else:
            reference = hf_reference(model, prompts)
    if reference is not None and wants_hf:
        mismatch = [k for k, (old, _) in prompts.items() if reference.ids.get(k) != tuple(old.ids)]
        if mismatch:
            raise BadArgument(
                f"the reference was computed on other prompts ({mismatch}) than verify uses for "
                f"{model.name}; compute it with hf_reference(model) for this model"
            )
    errors: dict[str, dict[str, list[Measure]]] = {n: {} for n in names if n in SELF_INVARIANTS}
    measures: dict[str, list[tuple[str, float, float]]] = {n: [] for n in wants_hf if n not in skipped}
    with torch.no_grad():
        bar = tqdm(list(prompts.items()), desc=f"verify {model.name}", disable=not progress, unit="prompt")
        for label, (old, new) in bar:
            checks = _checks(model, old, new)
            for name in errors:
                errors[name][label] = checks[name]()
            if measures:
                hf = _hf_checks(model, label, reference)
                for name in measures:
                    measures[name] += hf[name]()
    results = {name: _self_result(name, per) for name, per in errors.items()}
    results.update({name: _hf_result(name, ms) for name, ms in measures.items()})
    ran = [results[n] for n in names if n in results]
    return VerifyReport(
        model=model.name,
        passed=all(r.passed for r in ran),
        invariants=ran,
        prompts={k: len(v[0]) for k, v in prompts.items()},
        max_window=model.max_window,
        skipped=skipped,
        reference=reference.source if measures else None,
    )


def _self_result(name: str, per: dict[str, list[Measure]]) -> InvariantResult:
    """Every tensor against its own tolerance (0 for the exact invariants, else
    max(ATOL_FLOOR, rtol x its own largest magnitude)); the figures are those of the worst one."""
    rtol = RTOL_SHIFTED if name in SHIFTED else RTOL

    def tol(scale: float) -> float:
        return 0.0 if name in EXACT else max(ATOL_FLOOR, rtol * scale)

    judged = [(f"{label}: {where}", e, tol(s)) for label, ms in per.items() for where, e, s in ms]
    where, err, t = max(judged, key=lambda m: m[1] / m[2] if m[2] else (math.inf if m[1] else 0.0))
    return InvariantResult(
        name=name,
        description=DESCRIPTIONS[name],
        max_abs_error=err,
        tolerance=t,
        passed=all(e <= t for _, e, t in judged),
        per_prompt={label: max(e for _, e, _ in ms) for label, ms in per.items()},
        worst=where,
    )


def _hf_result(name: str, measures: list[tuple[str, float, float]]) -> InvariantResult:
    """Every tensor against its own tolerance; the figures are those of the worst one."""
    judged = measures
    where, err, tol = max(judged, key=lambda m: m[1] / m[2])
    per_prompt: dict[str, float] = {}
    for w, e, _ in judged:
        label = w.split(":")[0]
        per_prompt[label] = max(per_prompt.get(label, 0.0), e)
    return InvariantResult(
        name=name,
        description=DESCRIPTIONS[name],
        max_abs_error=err,
        tolerance=tol,
        passed=all(e <= t for _, e, t in judged),
        per_prompt=per_prompt,
        worst=where,
    )
