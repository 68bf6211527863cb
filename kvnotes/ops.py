"""Every notebook operation, built from `run` plus tensor surgery (see the table in docs/engine.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from kvnotes.batches import fixed_batches, plan_batches, rows_per_forward, run_rows, sharing_enabled
from kvnotes.engine import Capability, Hook, Readout, has, move_keys, run, stop_for
from kvnotes.engine.phases import phase
from kvnotes.errors import BadArgument, BadArgumentType, OutOfRange, ShapeMismatch
from kvnotes.hooks import hook_name
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.prompt import Prompt
from kvnotes.types import Float, Tensor

PromptLike = Prompt | str | Sequence[int]
DECISION = "decision"  # the span a decision is read from


def _ids(model: KVModel, prompt: PromptLike) -> list[int]:
    if isinstance(prompt, Prompt):
        return list(prompt.ids)
    if isinstance(prompt, str):
        return model.encode(prompt)
    return [int(t) for t in prompt]


def _stop(prompt: PromptLike, upto: int | str | None, n: int) -> int:
    if upto is None:
        return prompt.spans[DECISION][0] if isinstance(prompt, Prompt) and DECISION in prompt.spans else n
    if isinstance(upto, str):
        if not isinstance(prompt, Prompt):
            raise BadArgumentType(
                f"upto={upto!r} names a span, which needs a Prompt, not raw text or ids; "
                "render the prompt from a Template, or pass upto as a token index"
            )
        return prompt.span(upto).start
    if not 0 <= upto <= n:
        raise OutOfRange(f"upto={upto} is outside the prompt's 0..{n} tokens")
    return upto


# --- prefill / decide ----------------------------------------------------------------------
def prefill(
    model: KVModel,
    prompt: PromptLike,
    *,
    upto: int | str | None = None,
    offset: int = 0,
    hooks: Sequence[Hook] = (),
) -> Notebook:
    """Prefill `prompt` into a new notebook: the context that a decision later reads.

    Stops before position `upto` (or the start of span `upto`); by default before the prompt's
    `decision` span if it has one (that is what `decide` computes), else after the last token.
    `offset` places the prompt at positions `offset, offset+1, ...` (a chunk in isolation).

    >>> from kvnotes import load_model, Template
    >>> model = load_model("tiny-llama")
    >>> template = Template("order_status: {order_status}.\\n[[decision:A:]]")
    >>> prompt = template.render(model, order_status="shipped")
    >>> nb = prefill(model, prompt)
    >>> nb.n_slots, len(prompt)              # the two decision tokens are left for `decide`
    (8, 10)
    >>> decide(model, nb, prompt).last.shape
    torch.Size([1, 512])
    """
    ids = _ids(model, prompt)
    stop = _stop(prompt, upto, len(ids))
    nb, _ = run(
        model,
        Notebook.empty(model),
        ids[:stop],
        torch.arange(offset, offset + stop),
        hooks=hooks,
        logits_at=(),
    )
    if isinstance(prompt, Prompt):
        spans = {k: (a + offset, b + offset) for k, (a, b) in prompt.spans.items() if b <= stop}
        nb = replace(nb, spans=spans)
    return nb


def common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    """The length of the longest token prefix every sequence in `sequences` starts with.

    >>> common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]])
    2
    """
    if not sequences:
        return 0
    first, n = sequences[0], min(len(s) for s in sequences)
    for s in sequences[1:]:
        i = 0
        while i < n and s[i] == first[i]:
            i += 1
        n = i
    return n


class Prefixes:
    """Prefilled prompts kept so that a later prompt computes only what it does not share with
    one of them: a task's policy and examples, a pair's start before its changed field, the same
    pair at another filler length. A prompt extends the kept notebook whose tokens share its
    longest start (cut to that start); prefill-then-append equals one prefill (invariant 2), so
    a prompt prefilled through `Prefixes` gives the slots `prefill` gives, up to float rounding.

    >>> from kvnotes import load_model
    >>> model = load_model("tiny-llama")
    >>> shared = Prefixes(model)
    >>> a = shared.prefill(model.encode("Policy: refunds within 30 days. Order 7 shipped."))
    >>> b = shared.prefill(model.encode("Policy: refunds within 30 days. Order 8 is late."))
    >>> a.n_slots + b.n_slots - shared.computed   # tokens b took from a instead of computing them
    16
    """

    def __init__(self, model: KVModel):
        self.model = model
        self._kept: list[tuple[tuple[int, ...], Notebook]] = []
        self.computed = 0  # tokens prefilled so far (what sharing saves is the rest)

    def longest(self, ids: Sequence[int]) -> tuple[int, Notebook | None]:
        """The longest start of `ids` a kept notebook shares: its length and that notebook cut to
        it (0 and None when none shares a token)."""
        ids = tuple(ids)
        best, source = 0, None
        for key, nb in self._kept:
            n = common_prefix([key, ids])
            if n > best:
                best, source = n, nb
        if source is None:
            return 0, None
        return best, source if source.n_slots == best else source.truncate(best)

    def prefill(self, prompt: PromptLike, *, upto: int | str | None = None, keep: bool = True) -> Notebook:
        """`prefill(model, prompt, upto=upto)`, computing only the tokens after the longest start
        a kept notebook shares; `keep` (default) keeps the result for later prompts."""
        ids = _ids(self.model, prompt)
        stop = _stop(prompt, upto, len(ids))
        have, base = self.longest(ids[:stop])
        nb = base if base is not None else Notebook.empty(self.model)
        if stop > have:
            nb, _ = run(self.model, nb, ids[have:stop], torch.arange(have, stop), logits_at=())
            self.computed += stop - have
        return self._keep(prompt, ids, stop, nb, keep)

    def prefill_and_decide(
        self, prompt: PromptLike, *, vocab: Sequence[int] | None = None, keep: bool = True
    ) -> tuple[Notebook, Float[Tensor, "1 d_vocab"]]:
        """`prefill(prompt)` and `decide(model, nb, prompt).last` in one forward: the decision
        tokens are computed with the prompt's unshared tokens, their logits read, and their slots
        dropped (a decision alone pays the weights' streaming whatever its length, so this saves
        a forward per prompt). The same numbers up to float rounding (invariant 1)."""
        ids = _ids(self.model, prompt)
        stop = _stop(prompt, None, len(ids))
        if stop == len(ids):
            raise BadArgument("prefill_and_decide needs a prompt with a decision span after its context")
        have, base = self.longest(ids[:stop])
        nb = base if base is not None else Notebook.empty(self.model)
        nb, out = run(self.model, nb, ids[have:], torch.arange(have, len(ids)), vocab=vocab)
        self.computed += stop - have
        return self._keep(prompt, ids, stop, nb.truncate(stop), keep), out.last

    def _keep(self, prompt: PromptLike, ids: list[int], stop: int, nb: Notebook, keep: bool) -> Notebook:
        """`nb` with the prompt's spans before `stop`, kept for later prompts when `keep`."""
        spans = {k: v for k, v in prompt.spans.items() if v[1] <= stop} if isinstance(prompt, Prompt) else {}
        nb = replace(nb, spans=spans)
        if keep:
            self._kept.append((tuple(ids[:stop]), nb))
        return nb


def prefiller(model: KVModel) -> Callable[[PromptLike], Notebook]:
    """`prefill(model, prompt)` as a one-argument function that, while sharing is on
    (`kvnotes.batches.sharing`), computes only what a prompt does not share with one it
    prefilled before (`Prefixes`): a host context every question starts with, a transcript one
    turn longer than the last."""
    if not sharing_enabled():
        return lambda prompt: prefill(model, prompt)
    return Prefixes(model).prefill


def query_tokens(model: KVModel, notebook: Notebook, query: PromptLike) -> tuple[list[int], Tensor]:
    """The tokens a decision computes and their positions (right after the notebook).

    A Prompt with a `decision` span contributes that span onward; a Prompt without one, its
    tokens beyond the notebook; text is encoded without BOS; ids are taken as given.
    """
    start = notebook.next_position
    if isinstance(query, Prompt):
        if DECISION in notebook.spans:
            raise BadArgument(
                "this notebook already holds the decision span; prefill without `upto` (it stops "
                "before the decision) or pass the query tokens explicitly"
            )
        first = query.spans[DECISION][0] if DECISION in query.spans else start
        ids = list(query.ids[first:])
    elif isinstance(query, str):
        ids = model.encode(query, bos=False)
    else:
        ids = [int(t) for t in query]
    if not ids:
        raise OutOfRange(
            "nothing to decide: the query is empty (does the notebook already hold the whole prompt?); "
            "for free-form text prefill all but its last token and decide that one: "
            "p = free_prompt(model, text); decide(model, prefill(model, p), p)"
        )
    return ids, torch.arange(start, start + len(ids))


def decide(
    model: KVModel,
    notebook: Notebook,
    query: PromptLike,
    *,
    hooks: Sequence[Hook] = (),
    capture: Sequence[str] = (),
    vocab: Sequence[int] | None = None,
    overlay: Notebook | None = None,
) -> Readout:
    """Read the decision: compute the query tokens after the notebook without writing them.

    The readout's logits are at the query's last token (see `query_tokens` for what is computed);
    `vocab` restricts them to those token ids (e.g. the answer tokens), skipping the full unembed.
    `overlay`: slots read in place of the notebook's at the same positions (see `run`).
    """
    ids, pos = query_tokens(model, notebook, query)
    _, out = run(
        model, notebook, ids, pos, write=False, hooks=hooks, capture=capture, vocab=vocab, overlay=overlay
    )
    return out


# --- patching (tensor surgery) -------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Patch:
    """Which K/V to copy from a source notebook: slots (by position) x layers x KV heads x K/V.

    None means all. JSON-safe: every field is a tuple of ints or a bool.
    """

    positions: tuple[int, ...] | None = None
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    keys: bool = True
    values: bool = True

    def __post_init__(self):
        if not (self.keys or self.values):
            raise BadArgument("a Patch must copy keys, values or both; leave keys=True or values=True")
        for name in ("positions", "layers", "heads"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(int(x) for x in v))


def _patch_mask(patch: Patch, nb: Notebook, n_kv: int) -> Tensor:
    """Boolean `[layer, kv_head, slot]` selection of `patch` over `nb`'s layout."""
    layers = _choose(patch.layers, nb.n_layers, "layer", "layers")
    heads = _choose(patch.heads, n_kv, "KV head", "KV heads")
    slots = torch.zeros(nb.n_slots, dtype=torch.bool)
    if patch.positions is None:
        slots[:] = True
    elif patch.positions:
        slots[nb.slot_index(patch.positions)] = True
    return layers[:, None, None] & heads[None, :, None] & slots[None, None, :]


def _choose(chosen: tuple[int, ...] | None, n: int, what: str, plural: str) -> Tensor:
    """A boolean mask over `n` items: all when `chosen` is None; errors name the bad indices."""
    mask = torch.zeros(n, dtype=torch.bool)
    if chosen is None:
        mask[:] = True
        return mask
    bad = [i for i in chosen if not -n <= i < n]
    if bad:
        raise OutOfRange(f"{what}(s) {bad} out of range: the model has {n} {plural} (0..{n - 1})")
    mask[list(chosen)] = True
    return mask


def _aligned_source(dst: Notebook, src: Notebook) -> Notebook:
    dst.check_compatible(src)
    if torch.equal(dst.positions, src.positions):
        return src
    return src.select(dst.positions)  # same positions in another slot order


def patch(dst: Notebook, src: Notebook, spec: Patch = Patch()) -> Notebook:
    """Copy the K/V selected by `spec` from `src` into `dst` (slots matched by position)."""
    return patch_batch(dst, src, [spec])


def patch_batch(dst: Notebook, src: Notebook, specs: Sequence[Patch]) -> Notebook:
    """N patched copies of batch-1 `dst` stacked along batch, one per spec, in one vectorised op."""
    touched = patched_slots(dst, src, specs)
    idx = dst.slot_index(touched.positions)

    def stack(kv: Tensor, patched: Tensor) -> Tensor:
        out = kv.expand(len(specs), -1, -1, -1).clone()
        out[:, :, idx] = patched
        return out

    return replace(
        dst,
        keys=tuple(stack(k, t) for k, t in zip(dst.keys, touched.keys)),
        values=tuple(stack(v, t) for v, t in zip(dst.values, touched.values)),
        tokens=dst.tokens.expand(len(specs), -1).clone(),
    )


def patched_slots(dst: Notebook, src: Notebook, specs: Sequence[Patch]) -> Notebook:
    """Only the slots of batch-1 `dst` that some spec touches, one batch row per spec, patched:
    what the rows of `patch_batch(dst, src, specs)` differ in. As `run`'s `overlay` over `dst`
    it gives the same decisions without copying the unpatched slots."""
    if dst.batch != 1 or src.batch != 1:
        raise ShapeMismatch(
            f"patch_batch takes batch-1 notebooks, got batches {dst.batch} and {src.batch}; "
            "index one with nb[i]"
        )
    src = _aligned_source(dst, src)
    n_kv, n = dst.keys[0].shape[1], len(specs)
    masks = torch.stack([_patch_mask(s, dst, n_kv) for s in specs])  # [N, layer, kv_head, slot]
    touched = masks.flatten(0, 2).any(0).nonzero().flatten()  # slots any patch touches
    device = dst.keys[0].device
    masks = masks[..., touched].to(device)
    at = touched.to(device)
    use_k = torch.tensor([s.keys for s in specs], device=device)[:, None, None]
    use_v = torch.tensor([s.values for s in specs], device=device)[:, None, None]
    keys, values = [], []
    for l in range(dst.n_layers):
        for out, use, s_kv, d_kv in (
            (keys, use_k, src.keys[l], dst.keys[l]),
            (values, use_v, src.values[l], dst.values[l]),
        ):
            # dst's touched slots per row, then src's K/V written where the row's spec patches:
            # copies only (a broadcast `torch.where` over the rows took 3-4x as long)
            rows, heads, cols = (masks[:, l] & use).nonzero(as_tuple=True)  # [N, kv_head, touched]
            kv = d_kv.index_select(2, at).expand(n, -1, -1, -1).clone()
            kv[rows, heads, cols] = s_kv[0, heads, at[cols]]
            out.append(kv)
    return replace(
        dst,
        keys=tuple(keys),
        values=tuple(values),
        positions=dst.positions[touched],
        tokens=dst.tokens[:, touched].expand(n, -1).clone(),
        spans={},
    )


def _prompt_of(nb: Notebook, what: str) -> list[int]:
    """The token ids of a notebook that holds one slot per position from 0 (a prefilled prompt)."""
    if not torch.equal(torch.sort(nb.positions).values, torch.arange(nb.n_slots)):
        raise BadArgument(
            f"{what} must hold one slot per position from 0 (a prefilled prompt) to be recomputed "
            "downstream of a patch; prefill the prompt whole, or patch with downstream='keep'"
        )
    return nb.tokens[0, torch.argsort(nb.positions)].tolist()


def _prompts_of(dst: Notebook, src: Notebook) -> tuple[list[int], list[int]]:
    """Both notebooks' prompts (`_prompt_of`), refused unless from one model and of one length."""
    dst_ids, src_ids = _prompt_of(dst, "the patched notebook"), _prompt_of(src, "the source notebook")
    dst.check_compatible(src)
    if len(dst_ids) != len(src_ids):
        raise ShapeMismatch(
            f"the notebooks hold {len(dst_ids)} and {len(src_ids)} positions; patch between prompts "
            "of one length (a pair whose fields tokenize to the same count)"
        )
    return dst_ids, src_ids


def patch_recompute(model: KVModel, dst: Notebook, src: Notebook, spec: Patch = Patch()) -> Notebook:
    """TransformerLens's activation patching on a notebook: `spec`'s K/V taken from `src`, and every
    position from the first patched one on recomputed reading them, as `run_with_hooks` with
    `attn.hook_k`/`attn.hook_v` replaced computes them. (`patch` keeps every later slot as `dst`
    computed it: the question "what does the decision read from this slot", where this one asks
    "what does the whole prompt compute with this slot changed".)

    Both notebooks hold their prompts whole from position 0, at the same positions. The source's
    K/V are captured from its own tokens recomputed from the first patched position (the hook
    points' values, before rotation), so the result is the same on every backend and rotation.

    >>> from kvnotes import load_model, Template
    >>> model = load_model("tiny-llama")
    >>> tpl = Template("status: {s}. Then the order waits.\\n[[decision:A:]]")
    >>> old, new = tpl.render(model, s="shipped"), tpl.render(model, s="pending")
    >>> dst, src = prefill(model, old), prefill(model, new)
    >>> spec = Patch(positions=tuple(old.span("s")))
    >>> kept = decide(model, patch(dst, src, spec), old).last
    >>> recomputed = decide(model, patch_recompute(model, dst, src, spec), old).last
    >>> bool((kept - recomputed).abs().max() > 1e-4)  # later slots read the patch: they moved
    True
    """
    dst_ids, src_ids = _prompts_of(dst, src)
    n_kv = dst.keys[0].shape[1]
    mask = _patch_mask(spec, dst, n_kv)  # [layer, kv_head, slot]
    if not mask.any():
        return dst
    slot_pos = dst.positions.tolist()
    start = min(slot_pos[s] for s in mask.any(0).any(0).nonzero().flatten().tolist())
    sites = [("attn.hook_k", spec.keys), ("attn.hook_v", spec.values)]
    names = [hook_name(l, site) for l in range(dst.n_layers) if mask[l].any() for site, on in sites if on]
    pos = torch.arange(start, len(dst_ids))
    stop = stop_for(model, names)  # the blocks after the last patched layer cannot change its K/V
    _, got = run(
        model, src.truncate(start), src_ids[start:], pos, write=False, capture=names, logits_at=(), stop=stop
    )
    hooks = []
    for name in names:
        l = int(name.split(".")[1])
        at = mask[l].nonzero()  # (kv_head, slot) pairs
        heads = at[:, 0]
        rows = torch.tensor([slot_pos[s] - start for s in at[:, 1].tolist()], dtype=torch.long)

        def put(act: Tensor, hook=None, rows=rows, heads=heads, new=got.activations[name]) -> Tensor:
            act = act.clone()
            act[:, rows, heads] = new[:, rows, heads].to(act.dtype)
            return act

        hooks.append((name, put))
    nb, _ = run(model, dst.truncate(start), dst_ids[start:], pos, hooks=hooks, logits_at=())
    return replace(nb, spans=dst.spans)


def _recomputed_rows(
    model: KVModel,
    dst: Notebook,
    src: Notebook,
    specs: Sequence[Patch],
    query: list[int],
    batch_size: int,
    hooks: Sequence[Hook],
    vocab: Sequence[int] | None,
    progress: bool,
) -> Tensor:
    """`decide_patched(..., downstream="recompute")`'s logits `[n, vocab]`: the source's hook_k /
    hook_v captured once from the earliest patched position, then per batch one forward of the
    prompt's rest and the query, each row writing its own patch into those hook points."""
    dst_ids, src_ids = _prompts_of(dst, src)
    n, n_kv, slot_pos = len(dst_ids), dst.keys[0].shape[1], dst.positions
    masks = [_patch_mask(s, dst, n_kv) for s in specs]  # [layer, kv_head, slot] each
    starts = [int(slot_pos[m.any(0).any(0)].min()) if m.any() else n for m in masks]
    first = min(starts)
    sites = {"attn.hook_k": [s.keys for s in specs], "attn.hook_v": [s.values for s in specs]}
    names = {
        (l, site): hook_name(l, site)
        for l in range(dst.n_layers)
        for site, on in sites.items()
        if any(o and m[l].any() for o, m in zip(on, masks))
    }
    pos = torch.arange(first, n)
    _, got = run(
        model,
        src.truncate(first),
        src_ids[first:],
        pos,
        write=False,
        capture=list(names.values()),
        logits_at=(),
    )
    order = sorted(range(len(specs)), key=starts.__getitem__)
    out: list[Tensor | None] = [None] * len(specs)
    for a in tqdm(range(0, len(order), batch_size), desc="patches", unit="batch", disable=not progress):
        rows = order[a : a + batch_size]
        p0 = min(starts[i] for i in rows)
        ours = []
        for (l, site), name in names.items():
            at = [
                (r, *hs)
                for r, i in enumerate(rows)
                if sites[site][i]
                for hs in masks[i][l].nonzero().tolist()  # (kv_head, slot)
            ]
            if not at:
                continue
            r_, h_, t_ = (torch.tensor(x, dtype=torch.long) for x in zip(*at))
            t_ = slot_pos[t_] - p0  # the slot's token among this forward's

            def put(act: Tensor, hook=None, r_=r_, h_=h_, t_=t_, new=got.activations[name], off=p0 - first):
                act = act.clone()
                act[r_, t_, h_] = new[0, t_ + off, h_].to(act.dtype)
                return act

            ours.append((name, put))
        tokens = torch.tensor([dst_ids[p0:] + query] * len(rows))
        at_pos = torch.arange(p0, n + len(query))
        _, ro = run(model, dst.truncate(p0), tokens, at_pos, write=False, hooks=[*ours, *hooks], vocab=vocab)
        for r, i in enumerate(rows):
            out[i] = ro.last[r]
    return torch.stack([o for o in out if o is not None])


OVERLAY_BYTES = 256 * 2**20  # the patched slots' K/V one forward may hold (rows x touched slots)


def patch_batches(
    dst: Notebook, specs: Sequence[Patch], n_query: int, first: Sequence[int] | None = None
) -> list[list[int]]:
    """The indices of `specs` (in order) in the batches `decide_patched` runs them in by default:
    `kvnotes.batches.plan_batches` (rows share forwards; a batch starts at its lowest `first`
    layer, all 0 by default), each batch's patched K/V under `OVERLAY_BYTES` (rows x the slots
    any of its rows touches)."""
    first = [0] * len(specs) if first is None else list(first)
    per_slot = sum(k.shape[1] * k.shape[-1] * k.element_size() for k in dst.keys) * 2  # K and V, all layers
    every = set(dst.positions.tolist())
    touch = [every if s.positions is None else set(s.positions) for s in specs]

    # plan_batches grows j one row at a time for each i: the union of rows i..j-1, kept as it grows
    grown_i, grown_j, union = -1, 0, set[int]()

    def fits(i: int, j: int) -> bool:
        nonlocal grown_i, grown_j, union
        if grown_i != i or grown_j != j - 1:
            grown_i, union = i, set().union(*touch[i : j - 1])
        union |= touch[j - 1]
        grown_j = j
        return (j - i) * len(union) * per_slot <= OVERLAY_BYTES

    return plan_batches(first, dst.n_layers, n_query, fits)


def first_layer(spec: Patch, n_layers: int) -> int:
    """The lowest layer `spec` patches: a decision's blocks below it read nothing patched."""
    return 0 if spec.layers is None or not spec.layers else min(l % n_layers for l in spec.layers)


def decide_patched(
    model: KVModel,
    dst: Notebook,
    src: Notebook,
    specs: Sequence[Patch],
    prompt: PromptLike,
    *,
    batch_size: int | None = None,
    progress: bool = False,
    hooks: Sequence[Hook] = (),
    vocab: Sequence[int] | None = None,
    downstream: str = "keep",
) -> Readout:
    """Decision logits for each patch in `specs` (one batch row each: `.last` is `[n, d_vocab]`),
    the same shape `decide` reads out.

    `downstream="keep"` (default): every slot a patch does not touch stays as `dst` computed it, so
    the decision alone reads the patch (what the decision reads from a slot). Equal to
    `[decide(model, patch(dst, src, s), prompt).last[0] for s in specs]` (up to float
    rounding), but each batch of patches is one forward over the decision tokens, reading `dst`
    as it is plus only the patched slots per row (`patched_slots`, `run`'s overlay): the
    notebook is never copied. `batch_size`: patches per forward, in the order given (default:
    `patch_batches`, sized to the decision and the model, the patches in order of their lowest
    patched layer). Without `hooks`, on a backend that can resume, each batch starts at its
    lowest patched layer from the unpatched decision's residual (`kvnotes.batches.run_rows`).
    `vocab`: only these token ids' logits (columns in that order). In hooks on attention
    scores or patterns the key axis is `dst`'s slots (a patched slot's own column masked), then
    the patched slots, then the decision tokens.

    `downstream="recompute"`: TransformerLens's activation patching, every position after the
    first patched one recomputed reading the patch (`patch_recompute`): `batch_size` patches
    (default 16) per forward, each forward from the lowest first patched position of its rows
    over the rest of the prompt and the decision tokens, the prefix before it read from `dst`.
    """
    if downstream not in ("keep", "recompute"):
        raise BadArgument(
            f"downstream={downstream!r}: use 'keep' (the notebook's later slots as they are) or "
            "'recompute' (every later position recomputed, as TransformerLens's hooks patch)"
        )
    ids, pos = query_tokens(model, dst, prompt)
    if downstream == "recompute" and specs:
        out = _recomputed_rows(model, dst, src, specs, ids, batch_size or 16, hooks, vocab, progress)
        return Readout(logits=out[:, None], positions=(int(pos[-1]),))
    resume = not hooks and has(model, Capability.RESUME)
    first = [first_layer(s, dst.n_layers) if resume else 0 for s in specs]
    batches = fixed_batches(len(specs), batch_size)
    most = max((dst.n_slots if s.positions is None else len(s.positions) for s in specs), default=0)
    if batches is None and sharing_enabled():
        order = sorted(range(len(specs)), key=lambda i: first[i])
        at = patch_batches(dst, [specs[i] for i in order], len(ids), [first[i] for i in order])
        cap = rows_per_forward(model, dst, len(ids), patched=most) - 1  # what the free memory holds
        batches = [[order[k] for k in b[a : a + cap]] for b in at for a in range(0, len(b), cap)]

    def make(rows: list[int], base: bool) -> tuple[Sequence[Hook], Notebook]:
        chosen = [specs[i] for i in rows] + ([Patch(positions=())] if base else [])
        with phase("overlay"):
            return hooks, patched_slots(dst, src, chosen)

    out = run_rows(
        model,
        dst,
        ids,
        pos,
        first,
        make,
        vocab=vocab,
        batches=batches,
        resume=resume,
        progress=progress,
        desc="patches",
        patched=most,
    )
    return Readout(logits=out[:, None], positions=(int(pos[-1]),))


# --- edits ---------------------------------------------------------------------------------
def recompute(model: KVModel, notebook: Notebook, prompt: PromptLike, positions: Iterable[int]) -> Notebook:
    """Selective recompute: run `prompt`'s tokens at `positions` again against the notebook.

    Everything else stays stale; the recomputed tokens see each other causally.
    """
    ids = _ids(model, prompt)
    pos = _recomputed(ids, notebook, positions)
    nb, _ = run(model, notebook, [ids[p] for p in pos], pos, logits_at=())
    return nb


def decide_recomputed(
    model: KVModel,
    notebook: Notebook,
    prompt: Prompt,
    positions: Iterable[int],
    *,
    vocab: Sequence[int] | None = None,
) -> Readout:
    """`decide(model, recompute(model, notebook, prompt, positions), prompt)` as one forward:
    the recomputed tokens and the decision tokens run together, nothing written. The decision
    reads the recomputed tokens' fresh K/V in place of their stale slots, as it reads the written
    slots after `recompute` (a small forward costs the weights' streaming, so this saves one).

    >>> from kvnotes import load_model, Template
    >>> model = load_model("tiny-llama")
    >>> tpl = Template("status: {s}.\\n[[decision:A:]]")
    >>> old, new = tpl.render(model, s="shipped"), tpl.render(model, s="pending")
    >>> nb = prefill(model, old)
    >>> one = decide_recomputed(model, nb, new, new.span("s")).last
    >>> two = decide(model, refresh(model, nb, new, "s"), new).last
    >>> bool((one - two).abs().max() < 1e-4)
    True
    """
    ids = _ids(model, prompt)
    pos = _recomputed(ids, notebook, positions)
    q_ids, q_pos = query_tokens(model, notebook, prompt)
    tokens = [ids[p] for p in pos] + list(q_ids)
    _, out = run(model, notebook, tokens, pos + q_pos.tolist(), write=False, vocab=vocab)
    return out


def _recomputed(ids: Sequence[int], notebook: Notebook, positions: Iterable[int]) -> list[int]:
    """`positions` sorted, each checked to be a token of the prompt and a slot of the notebook."""
    pos = sorted(set(int(p) for p in positions))
    bad = [p for p in pos if not 0 <= p < len(ids)]
    if bad:
        raise OutOfRange(f"position(s) {bad} are outside the prompt's 0..{len(ids) - 1}")
    notebook.slot_index(pos)  # every recomputed position must be a slot already
    return pos


def refresh(model: KVModel, notebook: Notebook, prompt: Prompt, fields: str | Sequence[str]) -> Notebook:
    """In-place field edit: recompute only the tokens of `fields` (new values in `prompt`)."""
    names = [fields] if isinstance(fields, str) else list(fields)
    pos = [p for name in names for p in prompt.span(name)]
    return recompute(model, notebook, prompt, pos)


def recompute_suffix(model: KVModel, notebook: Notebook, prompt: PromptLike, start: int | str) -> Notebook:
    """Drop every slot from `start` (a position or span name) on and prefill `prompt` from there."""
    ids = _ids(model, prompt)
    stop = notebook.next_position
    begin = _stop(prompt, start, len(ids))
    if stop > len(ids):
        raise OutOfRange(f"the notebook holds {stop} positions but the prompt has {len(ids)} tokens")
    nb, _ = run(model, notebook.truncate(begin), ids[begin:stop], torch.arange(begin, stop), logits_at=())
    return nb


def append(
    model: KVModel, notebook: Notebook, text_or_ids: str | Sequence[int], *, span: str | None = None
) -> Notebook:
    """Append tokens after the last slot (an erratum line, a new turn); earlier slots untouched."""
    ids = (
        model.encode(text_or_ids, bos=False)
        if isinstance(text_or_ids, str)
        else [int(t) for t in text_or_ids]
    )
    start = notebook.next_position
    nb, _ = run(model, notebook, ids, torch.arange(start, start + len(ids)), logits_at=())
    if span:
        nb = replace(nb, spans={**nb.spans, span: (start, start + len(ids))})
    return nb


# --- composition ---------------------------------------------------------------------------
def rerotate(model: KVModel, notebook: Notebook, positions: Sequence[int] | Tensor | int) -> Notebook:
    """Move every slot to new `positions` (or shift all by an int offset) by re-rotating keys.

    Values are position-free and are shared; each layer's keys turn with that layer's RoPE. A model
    with learned absolute positions (GPT-2, tracr) refuses any move with `UnsupportedArchitecture`
    before computing anything (its positions are in the residual stream, not in its keys); a move of
    zero returns the same keys.
    """
    notebook.check_model(model)
    if isinstance(positions, int):
        new = notebook.positions + positions
    else:
        new = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    if new.shape != notebook.positions.shape:
        raise ShapeMismatch(
            f"{new.numel()} new positions for {notebook.n_slots} slots; give one position "
            "per slot, or an int to shift them all"
        )
    if new.unique().numel() != new.numel():
        raise BadArgument("new positions repeat; give each slot its own position")
    keys = tuple(move_keys(model, l, k, notebook.positions, new) for l, k in enumerate(notebook.keys))
    shift = {int(a): int(b) for a, b in zip(notebook.positions.tolist(), new.tolist())}
    spans = {
        n: (shift[a], shift[b - 1] + 1)
        for n, (a, b) in notebook.spans.items()
        if b > a and a in shift and b - 1 in shift
    }
    return replace(notebook, keys=keys, positions=new, spans=spans)


def precompile(model: KVModel, chunk: Sequence[int]) -> Notebook:
    """A chunk's notebook computed in isolation, as a cached skill or memory block is: after its
    own BOS (the attention sink any prefill has), which is then dropped. Slots at 1..len(chunk);
    `splice` re-rotates them to wherever they go."""
    ids = [int(t) for t in chunk]
    bos = model.tokenizer.bos_token_id
    nb = prefill(model, ([bos] if bos is not None else []) + ids)
    return nb if bos is None else nb.select(list(range(1, len(ids) + 1)))


def splice(
    model: KVModel, host: Notebook, chunk: Notebook, *, offset: int | None = None, seam: int = 0
) -> Notebook:
    """Place a precompiled `chunk` after `host` (at `offset`, default right after it), re-rotated,
    then repair the seam by recomputing the chunk's first `seam` tokens in context.

    On learned absolute positions a chunk that must move is refused (`rerotate`); one prefilled at
    its target positions (`prefill(model, ids, offset=...)`) splices without a move."""
    host.check_compatible(chunk)
    start = host.next_position if offset is None else offset
    if host.n_slots and start <= int(host.positions.max()):
        raise OutOfRange(
            f"offset {start} overlaps the host, whose last slot is at "
            f"{int(host.positions.max())}; splice at a later offset"
        )
    order = torch.argsort(chunk.positions)
    placed = rerotate(model, chunk, start + (chunk.positions - chunk.positions[order[0]]))
    nb = host.concat(placed)
    if seam < 0 or seam > chunk.n_slots:
        raise OutOfRange(f"seam={seam} must lie in 0..{chunk.n_slots} (the chunk's length)")
    if seam:
        seam_pos = placed.positions[order[:seam]]
        toks = placed.tokens[:, order[:seam]]
        nb, _ = run(model, nb, toks, seam_pos, logits_at=())
    return nb
