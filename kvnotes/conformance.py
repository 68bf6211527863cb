"""`verify(model)`: the invariants of docs/engine.md ("Exactness"), measured on this model.

A user who brings a new architecture runs this first (`kvnotes verify --model DIR`): if all
pass, patching, editing and splicing on that model are exact against full recompute. Eight
invariants compare the engine with itself (and one with TransformerLens); two compare it with an
independent reference, the model's Hugging Face transformers counterpart run on the same weights
(eager attention) in float64, per layer: its cache's K/V and its logits at every position. Every
invariant that is not exact is calibrated per tensor against a float64 forward of the model's own
weights (the truth): a few times the model's dtype's own gap from it (float32, bfloat16 or
float16: the same computation run in that dtype). Models without a Hugging Face counterpart skip
the two, with the reason in the report. Each invariant runs on a generated prompt and on one
longer than any sliding window.
"""

from __future__ import annotations

import copy
import inspect
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import cache, partial
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.display import Displayable
from kvnotes.engine import backend_of, full_logits, in_float64, run
from kvnotes.engine.float64 import hf_cast, hf_in_float64
from kvnotes.errors import BadArgument
from kvnotes.fixtures import POLICY, QUERY, STATE, filled_pair
from kvnotes.metrics import kv_deviation
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.prompt import Prompt

# Every invariant but the two exact ones is calibrated per model and per tensor against a float64
# forward of the same weights (the truth; a bfloat16 or float16 weight is exactly a float64 one):
# each tensor's tolerance is GAP_MULTIPLE times the gap of the same computation in the model's
# dtype from float64 in that tensor (the dtype's rounding there, as measured), and at least
# GAP_FLOOR x the tensor's largest magnitude (two float32 ulps, for a tensor that float32 happens
# to round almost exactly; in another dtype, as many of its own ulps: `gap_floor`). Measured
# (docs/engine.md, "Exactness"): in float32 the engine's error is at most 3.03x that gap on the
# tiny Hugging Face families (1.90x on Gemma 3 270M), while an RMSNorm eps of 1e-5 where the
# checkpoint says 1e-6 moves some tensor by 4.7-26x it on every tiny family but one (gemma-mha,
# 1.3x: float32 cannot see it there) and by 1e5x on Gemma 3 270M; in bfloat16 and float16 the
# engine stays under 2.5x the dtype's own gap on the tiny models.
GAP_MULTIPLE = 4.0
GAP_FLOOR = 2.5e-7
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # the table's column title


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16": the name the report and its JSON carry."""
    return str(dtype).removeprefix("torch.")


def gap_floor(dtype: torch.dtype | str) -> float:
    """The floor of a calibrated tolerance, relative to the tensor's largest magnitude: GAP_FLOOR
    (about two float32 ulps) in float32, the same number of `dtype`'s own ulps otherwise.

    >>> gap_floor("bfloat16") / gap_floor("float32") == 2.0**16  # 8 mantissa bits against 24
    True
    """
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return GAP_FLOOR * torch.finfo(dt).eps / torch.finfo(torch.float32).eps


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
    # the calibrated invariants (gauged against float64): the largest |error| / gap of any of their
    # tensors, i.e. the engine's error in units of the model's dtype's own rounding there
    gap_multiple: float | None = None


@dataclass(frozen=True)
class VerifyReport(Displayable):
    model: str
    passed: bool  # every invariant that ran passed
    invariants: list[InvariantResult]  # the invariants that ran
    prompts: dict[str, int]  # prompt label -> token count
    max_window: int | None
    skipped: dict[str, str] = field(default_factory=dict)  # invariant name -> why it did not run
    reference: str | None = None  # the Hugging Face reference the hf invariants ran against
    # invariant name -> why it does not apply to this architecture (neither run nor passed: a
    # model with learned positions cannot move a chunk, and `ops.rerotate` refuses to)
    not_applicable: dict[str, str] = field(default_factory=dict)
    # the dtype the model computed in, whose own gap from float64 the calibrated tolerances count
    dtype: str = "float32"

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
            not_applicable=d.get("not_applicable", {}),
            dtype=d.get("dtype", "float32"),  # reports written before the dtype was recorded: float32
        )

    def table(self) -> str:
        lines = [
            f"kvnotes verify — {self.model} (prompts: "
            + ", ".join(f"{k} {v} tokens" for k, v in self.prompts.items())
            + f"; largest sliding window: {self.max_window})"
        ]
        lines.append(
            f"dtype: {self.dtype}; tolerances: {GAP_MULTIPLE:g} x the {self.dtype} gap (the same "
            f"computation in {self.dtype}, against float64 of the same weights), at least "
            f"{gap_floor(self.dtype):.2g} x the tensor's largest |value|; 0 for the exact invariants"
        )
        if self.reference:
            lines.append(f"reference: {self.reference}")
        units = f"x {SHORT.get(self.dtype, self.dtype)} gap"
        lines.append(f"{'':3}{'invariant':34}{'max |error|':>14}{'tolerance':>12}{units:>11}  result  worst")
        for i, r in enumerate(self.invariants, 1):
            units = "" if r.gap_multiple is None else f"{r.gap_multiple:.3g}"
            lines.append(
                f"{i:<3}{r.name:34}{r.max_abs_error:>14.3e}{r.tolerance:>12.1e}{units:>11}  "
                f"{'pass' if r.passed else 'FAIL':6}  {r.worst}"
            )
        for name, why in self.not_applicable.items():
            lines.append(f"{'-':3}{name:34}{'n/a':>14}  {why}")
        for name, why in self.skipped.items():
            lines.append(f"{'-':3}{name:34}{'skipped':>14}  {why}")
        verdict = "all invariants pass" if self.passed else "SOME INVARIANTS FAIL"
        if self.skipped or self.not_applicable:
            left = [f"{len(self.invariants)} ran"]
            left += [f"{len(self.not_applicable)} not applicable"] if self.not_applicable else []
            left += [f"{len(self.skipped)} skipped"] if self.skipped else []
            verdict += f" ({', '.join(left)})"
        lines.append(verdict)
        return "\n".join(lines)


def verification_prompts(model: KVModel) -> dict[str, tuple[Prompt, Prompt]]:
    """Two aligned (old, new) prompt pairs: a short one and one longer than any sliding window; or
    the model's own (`model.verification_prompts()`, where its vocabulary or context cannot take
    English prompts: tracr's compiled programs)."""
    own = getattr(model, "verification_prompts", None)
    if own is not None:
        return own()
    window = model.max_window or 0
    # long: past every sliding window and at least 256 tokens, leaving room in n_ctx to re-rotate it
    long = min(max(window + 24, 256), model.n_ctx // 2 - 16)
    return {
        label: filled_pair(model, POLICY, STATE + QUERY, n) for label, n in (("short", 0), ("long", long))
    }


Measure = tuple[str, float, float]  # (which tensor, max |error|, largest |reference| in it)
# a measure against a float64 truth: (which tensor, max |error|, largest |truth| in it, its gap in the dtype)
Gauged = tuple[str, float, float, float]


def _maxdiff_nb(a: Notebook, b: Notebook, what: str = "") -> list[Measure]:
    """`a` against the reference `b`, one measure per layer and per K or V."""
    if not torch.equal(a.positions, b.positions):
        b = b.select(a.positions)
    out = []
    for kind, xs, ys in (("keys", a.keys, b.keys), ("values", a.values, b.values)):
        for l, (x, y) in enumerate(zip(xs, ys)):
            err = (x.to(y.dtype) - y).abs().max().item()
            out.append((f"{what}layer {l} {kind}", err, y.abs().max().item()))
    return out


def _maxdiff(a: torch.Tensor, b: torch.Tensor, what: str = "logits") -> list[Measure]:
    return [(what, (a - b).abs().max().item(), b.abs().max().item())]


# --- float64: the truth the calibrated tolerances measure against --------------------------------
# Each backend gives its float64 forward (`kvnotes.engine.in_float64(model)`); the Hugging Face
# counterpart is cast by `kvnotes.engine.float64.hf_in_float64`.


# --- the Hugging Face reference ------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Reference:
    """transformers' own forward on the verification prompts, in float64 (the truth the hf
    invariants compare with) and in the model's dtype (the rounding gap that sizes their
    tolerances), both on the model's weights in that dtype.

    Per prompt label: the prompt's ids, the cache's post-RoPE keys and values per layer
    (`[batch, n_kv_heads, pos, d_head]`, the notebook's layout) and the logits at every position,
    all float64; `gaps` holds, per tensor ("short: layer 3 keys", "short: logits"), the largest
    |forward in `dtype` - float64 forward| in it, the farthest of the forwards at once and cut in two.
    """

    source: str
    ids: dict[str, tuple[int, ...]]
    keys: dict[str, tuple[torch.Tensor, ...]]
    values: dict[str, tuple[torch.Tensor, ...]]
    logits: dict[str, torch.Tensor]  # [batch, pos, d_vocab]
    gaps: dict[str, float] = field(default_factory=dict)
    dtype: str = "float32"  # the dtype of the weights and of the forward the gaps measure


def hf_reference(
    model: KVModel,
    prompts: dict[str, tuple[Prompt, Prompt]] | None = None,
    *,
    hf_model=None,
    source: str | None = None,
) -> Reference:
    """Run `model`'s Hugging Face counterpart (loaded from `model.hf_source`, or `hf_model` as given,
    which is left as it came: the cast and the shared weights go on a copy; `source` says where a
    given one came from, for the report) on the verification prompts (the `old` prompt of each
    pair), eager attention, with a cache: in float64 throughout (`hf_in_float64`, the truth), and
    in the model's dtype four times, the prompt at once and cut in two at a quarter, a half and
    three quarters through the cache (legitimate computations that round differently; each
    tensor's gap is the farthest of them from the truth, so that one computation's lucky rounding
    does not set the yardstick). A counterpart in another dtype than
    the model's (a float32 checkpoint for a bfloat16 model) is cast to it first (`hf_cast`), and
    given the engine's own weights where the conversion changed them (`HFSource.share`: Gemma's
    norm scales and embedding), so that every forward runs the model's own weights: a bfloat16
    weight is exactly a float64 one.

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
    else:  # left as it came: the cast and the shared weights go on a copy
        source = source or f"transformers' {type(hf_model).__name__} (given)"
        hf_model = copy.deepcopy(hf_model)
    if next(hf_model.parameters()).dtype != model.dtype:
        hf_cast(hf_model, model.dtype)
    if model.hf_source is not None and model.hf_source.share is not None:
        model.hf_source.share(model, hf_model)  # the engine's own weights, where conversion changed them
    if getattr(hf_model.config, "_attn_implementation", "eager") != "eager":
        hf_model.set_attn_implementation("eager")
    hf_model.eval()
    prompts = prompts if prompts is not None else verification_prompts(model)
    ids = {label: list(old.ids) for label, (old, _) in prompts.items()}
    with torch.no_grad():
        with hf_in_float64(hf_model):
            f64 = {label: _hf_forward(hf_model, i) for label, i in ids.items()}
        gaps = _low_gaps(hf_model, ids, f64)
    keys, values, logits = ({label: f64[label][i] for label in ids} for i in range(3))
    dtype = dtype_name(model.dtype)
    source += (
        f"; float64 throughout (the truth), {dtype} beside it for the rounding gap (the farthest of "
        "four: at once, and cut in two at 1/4, 1/2 and 3/4 through its cache)"
    )
    return Reference(
        source=source,
        ids={label: tuple(i) for label, i in ids.items()},
        keys=keys,
        values=values,
        logits=logits,
        gaps=gaps,
        dtype=dtype,
    )


def _low_gaps(hf_model, ids: dict[str, list[int]], f64: dict) -> dict[str, float]:
    """Each tensor's rounding gap in the model's dtype: the farthest from the float64 truth `f64`
    of four legitimate computations, the prompt at once and cut in two at a quarter, a half and
    three quarters through transformers' own cache (other matrix shapes, so other roundings),
    folded in as each is computed (holding all of them, every position's logits among them, costs
    gigabytes on Gemma)."""
    gaps: dict[str, float] = {}
    for label, i in ids.items():
        k64, v64, l64 = f64[label]
        for split in range(4):
            k, v, lg = _hf_forward(hf_model, i, split=len(i) * split // 4)
            for what, xs, ys in (("keys", k, k64), ("values", v, v64)):
                for l, (x, y) in enumerate(zip(xs, ys)):
                    _widest(gaps, f"{label}: layer {l} {what}", (x.double() - y).abs().max().item())
            _widest(gaps, f"{label}: logits, every position", (lg.double() - l64).abs().max().item())
            del k, v, lg
    return gaps


def _widest(gaps: dict[str, float], where: str, gap: float) -> None:
    gaps[where] = max(gaps.get(where, 0.0), gap)


def _hf_forward(hf_model, ids: list[int], split: int | None = None):
    """transformers' cache (post-RoPE keys and values per layer) and logits at every position of
    `ids`: in one forward, or with `split` (0 < split < len) in two (`ids[:split]`, then the rest on
    its cache)."""
    from transformers import DynamicCache

    kv = DynamicCache()
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    parts = [ids] if not split or split >= len(ids) else [ids[:split], ids[split:]]
    logits = torch.cat(
        [hf_model(input_ids=torch.tensor([part]), use_cache=True, **{name: kv}).logits for part in parts],
        dim=1,
    )
    if hasattr(kv, "layers"):
        keys, values = tuple(x.keys for x in kv.layers), tuple(x.values for x in kv.layers)
    else:  # transformers before the layered cache
        keys, values = tuple(kv.key_cache), tuple(kv.value_cache)
    return keys, values, logits


def calibrated_tolerance(gap: float, scale: float, dtype: torch.dtype | str = torch.float32) -> float:
    """The tolerance of one tensor whose computation in `dtype` is `gap` from its float64 truth and
    whose truth has largest magnitude `scale`: GAP_MULTIPLE x gap, at least `gap_floor(dtype)` x scale."""
    return max(GAP_MULTIPLE * gap, gap_floor(dtype) * scale)


def _hf_checks(model: KVModel, label: str, ref: Reference) -> dict[str, Callable[[], list[Gauged]]]:
    """Each check returns one gauged measure per tensor judged: the engine (in the model's dtype)
    against transformers' float64 forward, with that tensor's rounding gap in the model's dtype."""
    ids = list(ref.ids[label])

    def _measure(where: str, mine: torch.Tensor, expected: torch.Tensor) -> Gauged:
        if mine.shape != expected.shape:
            raise BadArgument(
                f"{where}: the engine gives shape {tuple(mine.shape)} where transformers gives "
                f"{tuple(expected.shape)}; the model's Hugging Face counterpart has another layout"
            )
        err = (mine.double() - expected).abs().max().item()
        return where, err, expected.abs().max().item(), ref.gaps[where]

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
def _gauged(mine: list[Measure], reference: list[Measure]) -> list[Gauged]:
    """`mine` (a computation against the float64 truth) gauged by `reference` (the invariant's
    reference computation, in the model's dtype, against the same truth): per tensor, mine's error,
    the truth's scale and the reference's own gap from the truth."""
    return [(w, e, sc, g) for (w, e, sc), (_, g, _) in zip(mine, reference)]


class _Truths:
    """One prompt's float64 truths: named computations, each run once, all of them in one float64
    pass (`prepare`): casting the model to float64 and back costs Gemma 3 270M about 2 s on one
    core, more than some truths themselves. A truth asked for outside `prepare` gets its own pass;
    one asked for inside another (a float64 notebook that a float64 decision reads) joins it."""

    def __init__(self, model: KVModel) -> None:
        self.model = model
        self.computations: dict[str, Callable[[], object]] = {}
        self.values: dict[str, object] = {}
        self.inside = False

    def add(self, key: str, compute: Callable[[], object]) -> Callable[[], Any]:
        self.computations[key] = compute
        return partial(self.get, key)

    def get(self, key: str) -> Any:
        if key not in self.values:
            self.prepare([key])
        return self.values[key]

    def prepare(self, keys: Iterable[str]) -> None:
        todo = [k for k in keys if k not in self.values]
        if todo and self.inside:
            for k in todo:
                if k not in self.values:  # an earlier one may have asked for it
                    self.values[k] = self.computations[k]()
        elif todo:
            with in_float64(self.model):
                self.inside = True
                try:
                    self.prepare(todo)
                finally:
                    self.inside = False


class _Check(NamedTuple):
    run: Callable[[], list]
    truths: tuple[str, ...] = ()  # the float64 truths it reads (`_Truths` keys)


NUDGES = 3  # neighbours of each prefill reference (`nudged`): more draws of the dtype's rounding
NUDGE_SITE = "blocks.0.hook_resid_pre"  # the input embedding, on either backend


def nudged(seed: int) -> tuple[str, Callable]:
    """A hook that moves every input embedding by half its dtype's eps, relative (about one unit in
    the last place), up or down by a seeded coin per element. The dtype cannot tell the two inputs
    apart, so the reference computation on this neighbour is as legitimate a computation of the
    same tensors as the reference itself: one more draw of the dtype's rounding. Where the model
    amplifies rounding (Gemma 3 270M's long prompt in bfloat16, docs/engine.md), legitimate
    computations of one tensor land 0.5 to 10 from the truth, and no single one is a yardstick.
    (A nudge of the full eps, one or two units, hid a planted 10% key error on tiny-gemma3.)"""

    def nudge(x: torch.Tensor, hook=None) -> torch.Tensor:
        g = torch.Generator(device=x.device).manual_seed(seed)
        coin = torch.randint(0, 2, x.shape, generator=g, device=x.device).to(x.dtype)
        return x + x * (2 * coin - 1) * (torch.finfo(x.dtype).eps / 2)

    return (NUDGE_SITE, nudge)


def _checks(
    model: KVModel, old: Prompt, new: Prompt, truths: _Truths, old_gaps: dict[str, float] | None = None
) -> dict[str, _Check]:
    """Each check returns its measures: one per tensor it compares (per layer K, per layer V,
    logits). An exact check's (`Measure`) hold its error against the reference computation; every
    other check's (`Gauged`) hold its error against the reference computation run in float64 (the
    truth, of the same code on the same weights) and the gap of the model's dtype there: the
    farthest from the truth of the reference computation, its neighbours (`nudged`, for the
    prefills) and, for the old prompt's prefill, `old_gaps` (per tensor, "layer 3 keys":
    transformers' computations of the same tensors, `hf_reference`)."""
    edited = _edited_field(old, new)
    field_start = old.span(edited).start
    stop = old.span("decision").start
    nb_old = cache(lambda: ops.prefill(model, old))
    nb_new = cache(lambda: ops.prefill(model, new))
    old_near, new_near = cache(lambda: _near(model, old)), cache(lambda: _near(model, new))
    decided_new = cache(lambda: ops.decide(model, nb_new(), new).last)  # the reference of two checks
    # the same computations in float64: the truths
    old64 = truths.add("old", lambda: ops.prefill(model, old))
    new64 = truths.add("new", lambda: ops.prefill(model, new))
    decided_new64 = truths.add("decided new", lambda: ops.decide(model, new64(), new).last)
    full64 = truths.add("full forward", lambda: full_logits(model, old.ids)[-1].clone())  # not a view
    chunk = list(old.ids[1:stop])  # the prompt without BOS, as a chunk
    q = min(len(old.ids) + 13, model.n_ctx - len(chunk) - 8)  # past the prompt, inside n_ctx
    chunk_at_q64 = truths.add("chunk at q", lambda: ops.prefill(model, chunk, offset=q))
    chunk_at_0_64 = truths.add("chunk at 0", lambda: ops.prefill(model, chunk))
    specs = _patch_specs(model, range(field_start, stop))

    def single(a: Notebook, b: Notebook) -> torch.Tensor:
        return torch.stack([ops.decide(model, ops.patch(a, b, s), new).last[0] for s in specs])

    singles64 = truths.add("single patches", lambda: single(old64(), new64()))

    vs_truth = _vs_truth

    def vs_old(mine: Notebook) -> list[Gauged]:
        """`mine` against the old prompt's prefill, each tensor's gap widened by `old_gaps`."""
        gauged = vs_truth(mine, nb_old(), old64(), near=old_near())
        return [(w, e, sc, max(g, (old_gaps or {}).get(w, 0.0))) for w, e, sc, g in gauged]

    def decide_equals_full():
        full = full_logits(model, old.ids)[-1]
        return vs_truth(ops.decide(model, nb_old(), old).last[0], full, full64())

    def prefix_then_suffix():
        mid = stop // 2
        nb, _ = run(
            model,
            ops.prefill(model, old, upto=mid),
            list(old.ids[mid:stop]),
            torch.arange(mid, stop),
            logits_at=(),
        )
        return vs_old(nb)

    def suffix_recompute():
        nb = ops.recompute_suffix(model, nb_old(), new, field_start)
        return vs_truth(nb, nb_new(), new64(), near=new_near()) + vs_truth(
            ops.decide(model, nb, new).last, decided_new(), decided_new64()
        )

    def deviation_before_field():
        dev = kv_deviation(nb_old(), nb_new())[:, :, nb_old().positions < field_start]
        return [("K/V deviation, every slot before the field", dev.max().item(), 0.0)]

    def patch_all_reproduces_source():
        patched = ops.patch(nb_old(), nb_new(), ops.Patch())
        return _maxdiff(ops.decide(model, patched, new).last, decided_new())

    def rerotation_equals_offset_prefill():
        """Gauged against the offset prefill in float64 (the truth), per tensor by the larger of two
        gaps: the offset prefill's own (the rounding a prefill at those positions cannot avoid)
        and the prefill at 0's, which the moved key carries along (a rotation keeps its error)."""
        at_0 = ops.prefill(model, chunk)
        at_q = ops.prefill(model, chunk, offset=q)
        gauged = vs_truth(
            ops.rerotate(model, at_0, q), at_q, chunk_at_q64(), near=_near(model, chunk, offset=q)
        )
        carried = _maxdiff_nb(at_0, chunk_at_0_64())
        return [(w, e, sc, max(g, g0)) for (w, e, sc, g), (_, g0, _) in zip(gauged, carried)]

    def refresh_unchanged_is_noop():
        return vs_old(ops.refresh(model, nb_old(), old, edited))

    def batched_equals_single():
        batched = ops.decide_patched(model, nb_old(), nb_new(), specs, new, batch_size=3).last
        return vs_truth(batched, single(nb_old(), nb_new()), singles64())

    return {
        "decide_equals_full_forward": _Check(decide_equals_full, ("full forward",)),
        "prefix_then_suffix_equals_prefill": _Check(prefix_then_suffix, ("old",)),
        "suffix_recompute_equals_prefill": _Check(suffix_recompute, ("new", "decided new")),
        "kv_deviation_before_field_is_zero": _Check(deviation_before_field),
        "patch_all_reproduces_source": _Check(patch_all_reproduces_source),
        "rerotation_equals_offset_prefill": _Check(
            rerotation_equals_offset_prefill, ("chunk at q", "chunk at 0")
        ),
        "refresh_unchanged_is_noop": _Check(refresh_unchanged_is_noop, ("old",)),
        "batched_patches_equal_single": _Check(batched_equals_single, ("old", "new", "single patches")),
    }


def _edited_field(old: Prompt, new: Prompt) -> str:
    """The edited field: the generated prompts' `order_status`, else (a model's own prompts) the
    span holding the first position where the two prompts differ."""
    if "order_status" in old.spans:
        return "order_status"
    differ = next(p for p, (a, b) in enumerate(zip(old.ids, new.ids)) if a != b)
    return next(n for n, (a, b) in old.spans.items() if a <= differ < b and n != "decision")


def _near(model: KVModel, prompt, **kw) -> list[Notebook]:
    """`NUDGES` neighbours of `ops.prefill(model, prompt, **kw)` (`nudged`); none where the model has
    no hook at its input (nnsight on a family it does not map, GPT-2)."""
    if NUDGE_SITE not in backend_of(model).hook_names(model):
        return []
    return [ops.prefill(model, prompt, hooks=[nudged(i)], **kw) for i in range(NUDGES)]


def _vs_truth(mine: Notebook | torch.Tensor, ref, truth, what: str = "logits", near=()) -> list[Gauged]:
    """`mine` gauged against `truth` by the reference computation `ref` and its neighbours `near`:
    each tensor's gap is the farthest of them from the truth."""
    diff = _maxdiff_nb if isinstance(truth, Notebook) else partial(_maxdiff, what=what)
    gauged = _gauged(diff(mine, truth), diff(ref, truth))
    for other in near:
        gauged = [(w, e, sc, max(g, g1)) for (w, e, sc, g), (_, g1, _) in zip(gauged, diff(other, truth))]
    return gauged


def _patch_specs(model: KVModel, downstream: range) -> list[ops.Patch]:
    """Eight single-slot patches after the edited field, each of a seeded half of the layers, K
    and V, K only or V only: the batched sweep's workload."""
    rng = random.Random(0)
    return [
        ops.Patch(
            positions=(p,),
            layers=tuple(sorted(rng.sample(range(model.n_layers), k=max(1, model.n_layers // 2)))),
            keys=i % 3 != 1,
            values=i % 3 != 2,
        )
        for i, p in enumerate(list(downstream)[:8])
    ]


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
MOVES_KEYS = ("rerotation_equals_offset_prefill",)  # the invariants that move a chunk's keys


def not_applicable(model: KVModel) -> dict[str, str]:
    """The invariants that cannot apply to `model`'s architecture, each with the reason: on a model
    with learned absolute positions no chunk can be moved (its position is in the residual stream
    every later layer read, not in a rotation of the keys), so `ops.rerotate` refuses any move."""
    if model.facts.positions == "rotary":
        return {}
    why = (
        f"not applicable: {model.name} has {model.facts.positions} absolute positions, added to the "
        "residual stream at the input, so its keys carry no rotation and no chunk can be moved "
        "(ops.rerotate and ops.splice refuse any move with UnsupportedArchitecture)"
    )
    return dict.fromkeys(MOVES_KEYS, why)


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
    has a Hugging Face counterpart and a Hugging Face invariant is asked for; that loads it and runs
    it in the model's dtype and in float64, about two minutes for Gemma 3 270M on 2 cores). Where
    there is one, its gaps on the old prompt's tensors also size the self-invariants that compare
    with the old prompt's prefill (`_checks`).

    Runs in the model's own dtype (`model.dtype`: float32, bfloat16 or float16); every tolerance
    but the exact invariants' zero is that dtype's own gap from float64 times GAP_MULTIPLE.
    """
    names = list(DESCRIPTIONS) if only is None else list(only)
    unknown = [n for n in names if n not in DESCRIPTIONS]
    if unknown:
        raise BadArgument(f"unknown invariant(s) {unknown}; the invariants are {list(DESCRIPTIONS)}")
    prompts = verification_prompts(model)
    skipped: dict[str, str] = {}
    moot = {n: why for n, why in not_applicable(model).items() if n in names}
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
    if reference is not None:  # read by the hf invariants and, for its gaps, by the self-invariants
        mismatch = [k for k, (old, _) in prompts.items() if reference.ids.get(k) != tuple(old.ids)]
        if mismatch or reference.dtype != dtype_name(model.dtype):
            what = f"on other prompts ({mismatch})" if mismatch else f"in {reference.dtype}"
            raise BadArgument(
                f"the reference was computed {what}, not as verify runs {model.name} "
                f"({dtype_name(model.dtype)}); compute it with hf_reference(model) for this model"
            )
    errors: dict[str, dict[str, list]] = {n: {} for n in names if n in SELF_INVARIANTS and n not in moot}
    measures: dict[str, list[Gauged]] = {n: [] for n in wants_hf if n not in skipped}
    with torch.no_grad():
        bar = tqdm(list(prompts.items()), desc=f"verify {model.name}", disable=not progress, unit="prompt")
        for label, (old, new) in bar:
            # one prompt's truths at a time: a long prompt's float64 tensors (Gemma's logits alone
            # are 262k wide) held for every prompt at once cost gigabytes, for one cast of about 2 s
            truths = _Truths(model)
            # transformers' gaps on the old prompt's tensors (where its reference runs), "layer 3 keys"
            shared = {} if reference is None else _gaps_of(reference, label)
            checks = _checks(model, old, new, truths, shared)
            truths.prepare(key for name in errors for key in checks[name].truths)  # one float64 pass
            for name in errors:
                errors[name][label] = checks[name].run()
            if measures:
                assert reference is not None  # measures are kept only where a reference was computed
                hf = _hf_checks(model, label, reference)
                for name in measures:
                    measures[name] += hf[name]()
    results = {name: _self_result(name, per, model.dtype) for name, per in errors.items()}
    results.update({name: _hf_result(name, ms, model.dtype) for name, ms in measures.items()})
    ran = [results[n] for n in names if n in results]
    return VerifyReport(
        model=model.name,
        passed=all(r.passed for r in ran),
        invariants=ran,
        prompts={k: len(v[0]) for k, v in prompts.items()},
        max_window=model.max_window,
        skipped=skipped,
        reference=reference.source if measures else None,
        not_applicable=moot,
        dtype=dtype_name(model.dtype),
    )


def _gaps_of(reference: Reference, label: str) -> dict[str, float]:
    """The reference's gaps of prompt `label`, keyed as the self-invariants name their tensors."""
    return {k.removeprefix(f"{label}: "): g for k, g in reference.gaps.items() if k.startswith(f"{label}: ")}


def _self_result(
    name: str, per: dict[str, list[Measure]] | dict[str, list[Gauged]], dtype: torch.dtype = torch.float32
) -> InvariantResult:
    """Every tensor against its own tolerance (0 for the exact invariants, and for any measure not
    gauged against float64; for the calibrated ones, `calibrated_tolerance` in `dtype`); the
    figures are those of the worst one."""

    def judge(where: str, e: float, s: float, *gap: float) -> tuple[str, float, float, float | None]:
        if gap and name not in EXACT:
            return where, e, calibrated_tolerance(gap[0], s, dtype), gap[0]
        return where, e, 0.0, None

    judged = [judge(f"{label}: {m[0]}", *m[1:]) for label, ms in per.items() for m in ms]
    return _result(name, judged)


def _hf_result(name: str, measures: list[Gauged], dtype: torch.dtype = torch.float32) -> InvariantResult:
    """Every tensor against its own calibrated tolerance; the figures are those of the worst one."""
    return _result(name, [(w, e, calibrated_tolerance(g, s, dtype), g) for w, e, s, g in measures])


def _result(name: str, judged: list[tuple[str, float, float, float | None]]) -> InvariantResult:
    where, err, tol, _ = max(judged, key=lambda m: m[1] / m[2] if m[2] else (math.inf if m[1] else 0.0))
    per_prompt: dict[str, float] = {}
    for w, e, _, _ in judged:
        label = w.split(":")[0]
        per_prompt[label] = max(per_prompt.get(label, 0.0), e)
    units = [e / g for _, e, _, g in judged if g]
    return InvariantResult(
        name=name,
        description=DESCRIPTIONS[name],
        max_abs_error=err,
        tolerance=tol,
        passed=all(e <= t for _, e, t, _ in judged),
        per_prompt=per_prompt,
        worst=where,
        gap_multiple=max(units) if units else None,
    )
