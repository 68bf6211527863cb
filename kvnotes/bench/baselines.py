"""The strong baselines of the patch sweep: the same per-slot transplants done the ways a
TransformerLens or nnsight user would do them without kvnotes.

Every way computes what `ops.decide_patched(model, dst, src, [Patch(positions=(p,))], ...)`
computes: the decision tokens attend to the destination prompt's K/V at every prefix slot except
slot `p`, whose K and V at every layer are the source prompt's; the result is the logits of the two
answer tokens at the last position (only those two columns are unembedded, as the engine does).

- `tl_full_batched`: one TransformerLens forward over B copies of the whole prompt, hooks on
  `hook_rot_k`/`hook_v`.
- `tl_kv_cache`: TransformerLens's own `TransformerLensKeyValueCache`, prefilled once and repeated
  to the batch once per run; per batch the patched rows overwritten, only the decision tokens run
  (the cache is frozen: nothing appended), the rows restored.
- `nnsight_full_batched`: one nnsight trace of the Hugging Face model over B copies of the whole
  prompt, `k_proj`/`v_proj` outputs set.
- `nnsight_hf_cache`: Hugging Face's `DynamicCache(config=...)`, prefilled once and repeated to the
  batch once per run with its past recorded; per batch the patched rows overwritten, only the
  decision tokens run, traced by nnsight, what they appended rolled back with the cache's `crop`,
  the rows restored.

The two cache ways are written as a skilled user would; what was tried for them and not kept:
a fresh copy of the repeated cache per batch (deepcopy and `batch_repeat_interleave`, or
`expand(B).clone()`: a copy of the whole cache per batch); eager attention instead of SDPA (about
4x slower for `nnsight_hf_cache` in a smoke run at 1,024 tokens, batch 16); calling the Hugging
Face decoder directly instead of through an nnsight trace (no clear difference in smoke runs on a
loaded machine); a `StaticCache`, which cannot be rolled back on Gemma's sliding layers (its
`StaticSlidingWindowLayer` is a ring buffer, croppable only when no longer than the window). A
last batch smaller than the rest gets a repeated cache of its own size (64 patches over the
candidate sizes never leave one).

A way is built in two steps: its function (above) does the work done once per prompt pair
(capturing the source K/V, prefilling a cache; not timed, as the engine's prefills are not) and
returns a `PatchFn`, which computes one batch of patches, one per slot given, and returns their
answer logits `[n, 2]`. `sweep` runs a `PatchFn` over
all the slots in batches, `best_batch_size` picks the batch size by a short probe, and
`time_side_by_side` times several ways in turn.

The Hugging Face ways run the model's Hugging Face counterpart (`KVModel.hf_source`, with SDPA
attention) wrapped by nnsight; a model without one (the tiny and organism models) or a machine
without nnsight skips them, and `unavailable` says why.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from kvnotes.engine import hooked, lens_model
from kvnotes.engine.transformer_lens import final_logits
from kvnotes.errors import BadArgument
from kvnotes.hooks import hook_name
from kvnotes.models.model import KVModel
from kvnotes.types import Float, Tensor

PatchFn = Callable[[Sequence[int]], Tensor]  # slots -> answer logits [len(slots), 2]
BATCH_SIZES = (4, 8, 16, 32, 64)  # the candidates `best_batch_size` probes
_INSTALL_NNSIGHT = "pip install 'nnsight>=0.8'"


@dataclass(frozen=True, eq=False)
class PatchPair:
    """What every way shares: the destination prompt (whose K/V the decision reads) and the source
    prompt (where a patched slot's K/V come from) as token ids, aligned, with the same decision
    tokens `dst_ids[stop:]`; the two answer ids; and for the Hugging Face ways the model's Hugging
    Face counterpart and its nnsight wrapper (None when there is none)."""

    model: KVModel
    dst_ids: tuple[int, ...]
    src_ids: tuple[int, ...]
    stop: int
    vocab: tuple[int, int]
    hf: torch.nn.Module | None = None
    lm: Any = None  # nnsight's TransformersModel around `hf` (nnsight's types are not read: Any)

    def __post_init__(self):
        if len(self.dst_ids) != len(self.src_ids) or self.dst_ids[self.stop :] != self.src_ids[self.stop :]:
            raise BadArgument(
                f"the two prompts must be aligned ({len(self.dst_ids)} vs {len(self.src_ids)} tokens) and "
                f"share the decision tokens after position {self.stop}; build them with filled_pair"
            )


# --- TransformerLens ---------------------------------------------------------------------------
def _last_resid(model: KVModel) -> tuple[tuple[str, Callable], dict]:
    """A hook that keeps the last block's residual stream at the last position, and its store."""
    saved: dict[str, Tensor] = {}

    def grab(x, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
        saved["x"] = x[:, -1]

    return (hook_name(model.n_layers - 1, "hook_resid_post"), grab), saved


def _rows_and_slots(slots: Sequence[int]) -> tuple[Tensor, Tensor]:
    return torch.arange(len(slots)), torch.tensor(list(slots), dtype=torch.long)


@torch.no_grad()
def tl_full_batched(pair: PatchPair) -> PatchFn:
    """B full TransformerLens forwards of the destination prompt as one batch. Hooks on every
    layer's `hook_rot_k` (post-RoPE) and `hook_v` set the prefix to the destination's K/V and row
    i's slot to the source's; without freezing the rest of the prefix, the patched slot would also
    change every later slot's K/V, which is another experiment than the engine's."""
    model, stop = pair.model, pair.stop
    lens = lens_model(model, "the TransformerLens ways")
    names = lambda n: n.endswith(("attn.hook_rot_k", "attn.hook_v"))  # noqa: E731
    kv = {}
    for which, ids in (("src", pair.src_ids), ("dst", pair.dst_ids)):
        _, cache = hooked(model).run_with_cache(torch.tensor([ids]), names_filter=names, return_type=None)
        kv[which] = {name: act[0, :stop] for name, act in cache.items()}  # [slot, kv_head, d_head]
    tokens = torch.tensor([pair.dst_ids])
    slots_now: list[int] = []  # the batch being run, read by the hook

    def patch(x, hook):
        rows, at = _rows_and_slots(slots_now)
        x[:, :stop] = kv["dst"][hook.name]
        x[rows, at] = kv["src"][hook.name][at]
        return x

    grab, saved = _last_resid(model)
    hooks = [(lambda n: n in kv["dst"], patch), grab]
    vocab = torch.tensor(pair.vocab)

    def run(slots: Sequence[int]) -> Float[Tensor, "n 2"]:
        slots_now[:] = slots
        hooked(model).run_with_hooks(tokens.expand(len(slots), -1), return_type=None, fwd_hooks=hooks)
        return final_logits(lens, saved["x"], vocab)

    return run


def _tl_put(cache, rows: Tensor, at: Tensor, source) -> None:
    """`source`'s (a batch-1 `TransformerLensKeyValueCache`) K/V at slots `at` into `cache`'s rows
    `rows`, in place, in every layer."""
    for e, s in zip(cache.entries, source.entries):
        e.past_keys[rows, at] = s.past_keys[0, at]  # [batch, slot, kv_head, d_head]
        e.past_values[rows, at] = s.past_values[0, at]


@torch.no_grad()
def tl_kv_cache(pair: PatchPair) -> PatchFn:
    """TransformerLens's own KV cache: each prompt's prefix prefilled once into a
    `TransformerLensKeyValueCache`; the destination's entries are repeated to the batch once per
    batch size (not per batch), and per batch row i's slot is overwritten with the source's
    entry, only the decision tokens run against the frozen cache (nothing is appended, so nothing
    is rolled back) and the overwritten rows are restored from the destination.

    TL caches keys *before* RoPE (after any qk-norm) and rotates every cached key again on each
    call, from position 0; the patched slot keeps its position, so the source's pre-RoPE key is
    copied as it is. TL masks sliding windows by position, so slots outside a window need nothing.
    """
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache as KVCache
    from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry as Entry

    model, stop, tl = pair.model, pair.stop, hooked(pair.model)
    lens = lens_model(model, "the TransformerLens ways")

    def prefill(ids: Sequence[int]) -> KVCache:
        cache = KVCache.init_cache(tl.cfg, tl.cfg.device, 1)
        prefix = torch.tensor([list(ids[:stop])])
        tl(prefix, past_kv_cache=cache, attention_mask=torch.ones_like(prefix), return_type=None)
        return cache

    src, dst = prefill(pair.src_ids), prefill(pair.dst_ids)
    decision = torch.tensor([list(pair.dst_ids[stop:])])
    grab, saved = _last_resid(model)
    vocab = torch.tensor(pair.vocab)
    caches: dict[int, KVCache] = {}  # batch size -> the destination's cache repeated to it

    def repeated(b: int) -> KVCache:
        if b not in caches:
            entries = [
                Entry(
                    past_keys=d.past_keys.repeat(b, 1, 1, 1),
                    past_values=d.past_values.repeat(b, 1, 1, 1),
                    frozen=True,
                )
                for d in dst.entries
            ]  # [batch, slot, kv_head, d_head]
            caches[b] = KVCache(entries, torch.ones(b, stop, dtype=torch.int), frozen=True)
        return caches[b]

    def run(slots: Sequence[int]) -> Float[Tensor, "n 2"]:
        rows, at = _rows_and_slots(slots)
        cache = repeated(len(slots))
        _tl_put(cache, rows, at, src)  # 1) overwrite the patched rows
        tokens = decision.expand(len(slots), -1)
        tl.run_with_hooks(  # 2) the decision tokens only
            tokens,
            past_kv_cache=cache,
            attention_mask=torch.ones_like(tokens),
            return_type=None,
            fwd_hooks=[grab],
        )
        _tl_put(cache, rows, at, dst)  # 3) restore the rows
        return final_logits(lens, saved["x"], vocab)

    return run


# --- Hugging Face through nnsight --------------------------------------------------------------
def _hf_answer_logits(hf: torch.nn.Module, h: Tensor, vocab: tuple[int, int]) -> Float[Tensor, "n 2"]:
    """The Hugging Face head on final-norm states `h` [n, d_model], only the `vocab` columns."""
    head = hf.get_output_embeddings()
    logits = h @ head.weight[list(vocab)].T
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias[list(vocab)]
    cap = getattr(hf.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def _projections(lm, ids: Sequence[int], stop: int) -> tuple[list[Tensor], list[Tensor]]:
    """Every layer's `k_proj` and `v_proj` outputs over the first `stop` tokens of `ids`."""
    ks: list[Tensor] = []
    vs: list[Tensor] = []
    with lm.trace(torch.tensor([list(ids)])) as tracer:
        for layer in lm.model.layers:
            ks.append(layer.self_attn.k_proj.output[0, :stop].clone())  # [slot, n_kv_heads * d_head]
            vs.append(layer.self_attn.v_proj.output[0, :stop].clone())
        tracer.stop()
    return ks, vs


@torch.no_grad()
def nnsight_full_batched(pair: PatchPair) -> PatchFn:
    """B full forwards of the Hugging Face model as one nnsight trace over a batch of B copies of
    the destination prompt. Each layer's `k_proj` and `v_proj` outputs (before qk-norm and RoPE,
    which the model then applies by position) are set to the destination's over the prefix and row
    i's slot to the source's, so the keys the decision reads are the source's post-RoPE keys at that
    slot. Sliding windows are the model's own masks. The trace stops at the final norm."""
    lm, hf, stop = pair.lm, pair.hf, pair.stop
    src_k, src_v = _projections(lm, pair.src_ids, stop)
    dst_k, dst_v = _projections(lm, pair.dst_ids, stop)
    tokens = torch.tensor([pair.dst_ids])

    def run(slots: Sequence[int]) -> Float[Tensor, "n 2"]:
        rows, at = _rows_and_slots(slots)
        with lm.trace(tokens.expand(len(slots), -1)) as tracer:
            for l, layer in enumerate(lm.model.layers):
                k = layer.self_attn.k_proj.output
                k[:, :stop] = dst_k[l]
                k[rows, at] = src_k[l][at]
                v = layer.self_attn.v_proj.output
                v[:, :stop] = dst_v[l]
                v[rows, at] = src_v[l][at]
            h = lm.model.norm.output[:, -1].save()
            tracer.stop()
        return _hf_answer_logits(hf, h, pair.vocab)

    return run


def _hf_put(cache, rows: Tensor, at: Tensor, source) -> None:
    """`source`'s (a batch-1 `DynamicCache`) K/V at slots `at` into `cache`'s rows `rows`, in place,
    in every layer that still holds those slots."""
    for layer, s in zip(cache.layers, source.layers):
        first = layer.get_seq_length() - layer.keys.shape[-2]  # first position the layer holds
        keep = at >= first  # sliding layers: only slots still inside the window
        j = at[keep] - first
        layer.keys[rows[keep], :, j] = s.keys[0].transpose(0, 1)[j]  # [slot, kv_head, d_head]
        layer.values[rows[keep], :, j] = s.values[0].transpose(0, 1)[j]


def _hf_caches(pair: PatchPair):
    """What both Hugging Face cache ways build once: each prompt's prefix prefilled into a
    `DynamicCache(config=...)` (source, destination), the decision tokens, and `repeated(b)`: the
    destination's cache repeated to batch `b` with its past recorded, made once per batch size."""
    from transformers import DynamicCache

    hf, stop = pair.hf, pair.stop
    if hf is None:
        raise BadArgument("the Hugging Face cache ways need the model's counterpart (hf_twin)")

    def prefill(ids: Sequence[int]) -> DynamicCache:
        cache = DynamicCache(config=hf.config)
        hf(torch.tensor([list(ids[:stop])]), cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    src, dst = prefill(pair.src_ids), prefill(pair.dst_ids)
    decision = torch.tensor([list(pair.dst_ids[stop:])])
    caches: dict[int, DynamicCache] = {}  # batch size -> the destination's cache repeated to it

    def repeated(b: int) -> DynamicCache:
        if b not in caches:
            cache = copy.deepcopy(dst)
            cache.batch_repeat_interleave(b)
            cache.activate_past_recording()
            caches[b] = cache
        return caches[b]

    return src, dst, decision, repeated


@torch.no_grad()
def nnsight_hf_cache(pair: PatchPair) -> PatchFn:
    """Hugging Face's own cache, used as a skilled user would: each prompt's prefix prefilled once
    by the Hugging Face model into a `DynamicCache(config=...)`; the destination's cache repeated
    to the batch once per batch size (not per batch), with its past recorded; per batch 1) row i's
    slot overwritten in place with the source's entry, 2) only the decision tokens run, traced by
    nnsight with `cache=` (transformers 5.24's name; `past_key_values=` is deprecated) and an
    attention mask over the cache and the tokens (without one, nnsight supplies a mask of the
    tokens alone whenever the cache is not passed as `past_key_values`, and the logits come out
    wrong), 3) what they appended rolled back with the cache's own `crop`, 4) the rows restored.

    A sliding-window layer keeps only its last `sliding_window - 1` positions, and once it holds
    that many, `crop` raises unless the cache records its past (`activate_past_recording`: it then
    keeps the appended tokens until the crop, and the crop slices back the same window). A slot
    before the window is not patched there: no decision token can attend to it in that layer, so
    the patch has no effect in it. The cache holds keys *after* RoPE, which the slot keeps (same
    position)."""
    lm = pair.lm

    def last_hidden(tokens: Tensor, mask: Tensor, cache) -> Tensor:
        with lm.trace(tokens, attention_mask=mask, cache=cache) as tracer:
            h = lm.model.norm.output[:, -1].save()
            tracer.stop()
        return h

    return _hf_cache_way(pair, last_hidden)


# --- Hugging Face alone ------------------------------------------------------------------------
@torch.no_grad()
def hf_cache(pair: PatchPair) -> PatchFn:
    """`nnsight_hf_cache` without nnsight: the way a skilled transformers user writes it, and the
    strongest peer way. The same `DynamicCache` work (each prefix prefilled once, the destination's
    cache repeated to the batch once per batch size with its past recorded; per batch 1) row i's
    slot overwritten, 2) the decision tokens run, 3) the cache cropped back, 4) the rows restored),
    with step 2 a direct call of the decoder (`hf.model`, no tracing) whose last hidden state, after
    the final norm, goes through the answer columns of the output head."""
    hf = pair.hf

    def last_hidden(tokens: Tensor, mask: Tensor, cache) -> Tensor:
        return hf.model(tokens, attention_mask=mask, cache=cache, use_cache=True).last_hidden_state[:, -1]

    return _hf_cache_way(pair, last_hidden)


def _hf_cache_way(pair: PatchPair, last_hidden: Callable[[Tensor, Tensor, Any], Tensor]) -> PatchFn:
    """A Hugging Face cache way's batch: 1) each row's slot overwritten with the source's entry, 2)
    `last_hidden(tokens, mask, cache)`: the decision tokens run against the cache (the mask covers
    the cache and the tokens), the last position's final-norm state, 3) what they appended cropped,
    4) the rows restored; the answer columns of the output head on that state."""
    hf, stop = pair.hf, pair.stop
    src, dst, decision, repeated = _hf_caches(pair)
    n_dec = decision.shape[1]

    def run(slots: Sequence[int]) -> Float[Tensor, "n 2"]:
        rows, at = _rows_and_slots(slots)
        cache = repeated(len(slots))
        _hf_put(cache, rows, at, src)  # 1) overwrite
        tokens = decision.expand(len(slots), -1)
        mask = torch.ones(len(slots), stop + n_dec, dtype=torch.long)  # cache + tokens
        h = last_hidden(tokens, mask, cache)  # 2) the decision tokens only
        cache.crop(-n_dec)  # 3) roll back what they appended
        _hf_put(cache, rows, at, dst)  # 4) restore
        return _hf_answer_logits(hf, h, pair.vocab)

    return run


# --- the registry of ways ----------------------------------------------------------------------
@dataclass(frozen=True)
class Way:
    name: str
    make: Callable[[PatchPair], PatchFn]
    hf: bool  # runs the Hugging Face counterpart
    nnsight: bool = False  # through nnsight


WAYS: dict[str, Way] = {
    w.name: w
    for w in (
        Way("tl_full_batched", tl_full_batched, hf=False),
        Way("tl_kv_cache", tl_kv_cache, hf=False),
        Way("nnsight_full_batched", nnsight_full_batched, hf=True, nnsight=True),
        Way("nnsight_hf_cache", nnsight_hf_cache, hf=True, nnsight=True),
        Way("hf_cache", hf_cache, hf=True),
    )
}


@dataclass(frozen=True, eq=False)
class HFTwin:
    """A model's Hugging Face counterpart and nnsight's wrapper of it, or why there is none."""

    hf: torch.nn.Module | None = None
    lm: Any = None  # nnsight's TransformersModel around `hf` (nnsight's types are not read: Any)
    problem: str | None = None


def hf_twin(model: KVModel, *, need: bool = True, nnsight: bool = True) -> HFTwin:
    """`model`'s Hugging Face counterpart (SDPA attention, eval mode) when a baseline `need`s it,
    and nnsight's wrapper of it when one runs through nnsight (`nnsight`; without nnsight installed
    the counterpart still loads, for `hf_cache`). Loading can take a minute (Gemma's GGUF is
    dequantized again).

    nnsight 0.8 deprecates `LanguageModel` for `TransformersModel(..., task="text-generation")`,
    the same class without the warning; it wraps the loaded module in a transformers pipeline."""
    if not need or model.hf_source is None:
        return HFTwin()
    hf = model.hf_source.load().eval()
    hf.set_attn_implementation("sdpa")
    if not hasattr(getattr(hf, "model", None), "layers"):
        return HFTwin(problem=f"{type(hf).__name__} keeps its decoder layers elsewhere than model.layers")
    if not nnsight:
        return HFTwin(hf=hf)
    try:
        from nnsight.modeling.transformers import TransformersModel
    except ImportError:
        return HFTwin(hf=hf, problem=f"nnsight is not installed: {_INSTALL_NNSIGHT}")
    return HFTwin(hf=hf, lm=TransformersModel(hf, tokenizer=model.tokenizer, task="text-generation"))


def unavailable(way: Way, model: KVModel, twin: HFTwin) -> str | None:
    """Why `way` cannot run on `model` with `twin` (None: it can)."""
    if not way.hf:
        return None
    if model.hf_source is None:
        return (
            f"{model.name} has no Hugging Face counterpart (a TransformerLens-only model); "
            "models loaded from a checkpoint (load_hf) and gemma-3-270m have one"
        )
    if twin.hf is None:
        return twin.problem or "its Hugging Face counterpart was not loaded (hf_twin(model))"
    if way.nnsight and twin.lm is None:
        return twin.problem or "nnsight's wrapper of the counterpart was not made (hf_twin(model))"
    return None


# --- running and timing ------------------------------------------------------------------------
def sweep(run: PatchFn, slots: Sequence[int], batch_size: int) -> Float[Tensor, "n 2"]:
    """`run` over `slots` in batches of `batch_size`, concatenated in slot order."""
    with torch.no_grad():
        return torch.cat([run(slots[i : i + batch_size]) for i in range(0, len(slots), batch_size)])


def best_batch_size(
    run: PatchFn, slots: Sequence[int], candidates: Sequence[int] = BATCH_SIZES, *, budget_s: float = 5.0
) -> int:
    """The candidate batch size with the least time per patch, by one call per candidate after a
    warm-up call (these calls are not part of any reported timing). Candidates are tried in
    increasing order; the probe stops at one 10% slower per patch than the best so far (a larger
    batch only costs memory from there) or after a call longer than `budget_s` (per-call overheads
    are long amortised by then: a full forward of a long prompt)."""
    sizes = sorted({min(max(1, c), len(slots)) for c in candidates})
    sweep(run, slots[: sizes[0]], sizes[0])  # warm-up: first calls allocate
    best, best_t = sizes[0], float("inf")
    for b in sizes:
        t0 = time.perf_counter()
        sweep(run, slots[:b], b)
        took = time.perf_counter() - t0
        if took / b < best_t:
            best, best_t = b, took / b
        elif took / b > 1.1 * best_t:
            break
        if took > budget_s:
            break
    return best


@dataclass(frozen=True)
class Timing:
    """Seconds over repeats: median, min and max."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Timing:
        return cls(statistics.median(seconds), min(seconds), max(seconds))


def time_side_by_side(
    ways: dict[str, Callable[[], Tensor]], repeats: int, *, desc: str = "timing", progress: bool = True
) -> dict[str, tuple[Timing, Tensor]]:
    """Time each zero-argument callable `repeats` times, the ways in turn within each repeat (so a
    slow spell of the machine hits them alike); each way's timing and its last result."""
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    last: dict[str, Tensor] = {}
    with tqdm(total=max(1, repeats) * len(ways), desc=desc, disable=not progress) as bar:
        for r in range(max(1, repeats)):
            for name, fn in ways.items():
                bar.set_postfix_str(f"repeat {r + 1}: {name}")
                t0 = time.perf_counter()
                last[name] = fn()
                seconds[name].append(time.perf_counter() - t0)
                bar.update()
    return {name: (Timing.of(s), last[name]) for name, s in seconds.items()}
