"""Patching attention-head outputs: at the decision (the read side) and at the note slots
during prefill (the write side), many head sets per batched forward.

A head is a *query* head `(layer, head)`. Under grouped- and multi-query attention (Gemma 3
270M: four query heads share its one KV head) the heads of a group read the same keys and
values and differ only by their queries and output weights; patching one head's output
(`hook_z`) leaves what its siblings read untouched, so each query head is its own component.

Read side, for each trial (`read_capture`, both runs captured by `kvnotes.capture`): the query
tokens before the decision position are computed once onto both notebooks, so a head patch
costs one token's forward. `output` patching replaces the head's `hook_z` at the decision with
the new-value run's; `path` patching adds only the change in what its attention brings from
chosen slots (the note slots, or the field):
z + Σ_{s∈slots} (p_new[s]·v_new[s] − p_old[s]·v_old[s]), everything else kept as in the run.

Write side: the old-value notebook is rebuilt from the first note slot with the chosen
heads' `hook_z` at the note slots taken from the new-value run, so later layers' K/V at
those slots are recomputed from there, and the decision is read from the rebuilt notebook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from kvnotes.analysis.trials import Trial
from kvnotes.batches import fixed_batches, run_rows
from kvnotes.capture import CaptureRun, capture_pair, capture_runs
from kvnotes.hooks import hook_name
from kvnotes.metrics import undefined_recovery
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import query_tokens
from kvnotes.types import Bool, Float, Tensor

Head = tuple[int, int]


def all_heads(model: KVModel) -> list[Head]:
    """Every query head, layer-major: index = layer * n_heads + head."""
    return [(l, h) for l in range(model.n_layers) for h in range(model.n_heads)]


def kv_head(model: KVModel, head: int) -> int:
    """The KV head a query head reads (query heads are grouped in order under each KV head)."""
    return head // (model.n_heads // model.n_kv_heads)


def grouping(model: KVModel) -> dict:
    """How the model's query heads share keys and values, for the results."""
    g = model.n_heads // model.n_kv_heads
    kind = "multi-query" if model.n_kv_heads == 1 else "grouped-query" if g > 1 else "multi-head"
    return {
        "n_layers": model.n_layers,
        "n_heads": model.n_heads,
        "n_kv_heads": model.n_kv_heads,
        "queries_per_kv_head": g,
        "attention": kind,
        "note": (
            "heads are query heads: under grouped/multi-query attention the heads of a group "
            "read the same keys and values and differ only by their queries and output "
            "weights; a head patch replaces one query head's output, never the shared K/V"
        ),
    }


def masks_for(model: KVModel, sets: Sequence[Sequence[Head]]) -> Bool[Tensor, "batch layer n_heads"]:
    """One boolean `[layer, head]` mask per head set."""
    m = torch.zeros(len(sets), model.n_layers, model.n_heads, dtype=torch.bool)
    for i, heads in enumerate(sets):
        for l, h in heads:
            m[i, l, h] = True
    return m


def _hook_z(l: int) -> str:
    """The hook name of layer `l`'s per-head attention outputs."""
    return hook_name(l, "attn.hook_z")


# --- read side -------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class HeadReadCapture:
    """Both runs captured at a trial's decision position, ready for head patches: both notebooks
    extended by the query tokens before it, and each run's head outputs there (`z`:
    `[layer, head, d_head]`) and attention patterns (`pattern`: per layer `[head, slot]`, slots of
    the extended notebook then the decision token itself), and the decision token's own values
    (`v_self`: `[layer, n_kv_heads, d_head]`)."""

    old: Notebook
    new: Notebook
    token: int
    position: int
    z_old: Float[Tensor, "layer n_heads d_head"]
    z_new: Float[Tensor, "layer n_heads d_head"]
    pattern_old: tuple[Tensor, ...]
    pattern_new: tuple[Tensor, ...]
    v_self_old: Float[Tensor, "layer n_kv_heads d_head"]
    v_self_new: Float[Tensor, "layer n_kv_heads d_head"]


def read_capture(t: Trial) -> HeadReadCapture:
    """The trial's `HeadReadCapture` (`kvnotes.capture.capture_pair` at the decision token, the
    query tokens before it written first; computed once, cached on the trial)."""
    if "read_capture" in t.cache:
        return t.cache["read_capture"]
    model = t.model
    ids, pos = query_tokens(model, t.old_nb, t.pair.new)
    zs = [_hook_z(l) for l in range(model.n_layers)]
    pats = [hook_name(l, "attn.hook_pattern") for l in range(model.n_layers)]
    vals = [hook_name(l, "attn.hook_v") for l in range(model.n_layers)]
    old, new = (CaptureRun(nb, ids, pos, written=len(ids) - 1) for nb in (t.old_nb, t.new_nb))
    both = capture_pair(model, old, new, zs + pats + vals)
    cap = HeadReadCapture(
        old=both.old.notebook,
        new=both.new.notebook,
        token=ids[-1],
        position=int(pos[-1]),
        z_old=both.old.stacked(zs),
        z_new=both.new.stacked(zs),
        pattern_old=tuple(both.old[n][0, :, -1] for n in pats),
        pattern_new=tuple(both.new[n][0, :, -1] for n in pats),
        v_self_old=both.old.stacked(vals),
        v_self_new=both.new.stacked(vals),
    )
    t.cache["read_capture"] = cap
    return cap


def path_delta(t: Trial, positions: Sequence[int]) -> Float[Tensor, "layer n_heads d_head"]:
    """Per head, the change in what its attention at the decision brings from `positions`
    (new run minus old run): Σ_s p[s]·v[s] over those slots; the decision's own position is
    its own key and value. Over every position the deltas add up to z_new - z_old."""
    cap = read_capture(t)
    model = t.model
    kv = torch.tensor([kv_head(model, h) for h in range(model.n_heads)])
    out = torch.zeros_like(cap.z_old)
    slots = [p for p in positions if p != cap.position]
    itself = len(slots) < len(positions)
    for nb, pats, v_self, sign in (
        (cap.new, cap.pattern_new, cap.v_self_new, 1.0),
        (cap.old, cap.pattern_old, cap.v_self_old, -1.0),
    ):
        idx = nb.slot_index(slots) if slots else None
        for l in range(model.n_layers):
            if idx is not None:
                p = pats[l][:, idx]  # [head, slots]
                v = nb.values[l][0][kv][:, idx]  # [head, slots, d_head]
                out[l] += sign * torch.einsum("hs,hsd->hd", p, v)
            if itself:
                out[l] += sign * pats[l][:, -1:] * v_self[l][kv]
    return out


def read_hooks(masks: Tensor, source: Tensor, *, add: bool) -> list:
    """`hook_z` hooks for one decision token: where `masks[b, l, h]`, replace (or, with `add`,
    add to) head h's output with `source[l, h]`."""

    def make(l: int):
        def hook(z, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
            m = masks[:, l][:, None, :, None].to(z.device)  # [B, 1, head, 1]
            s = source[l][None, None].to(z)
            return z + m * s if add else torch.where(m, s, z)

        return hook

    layers = masks.any(0).any(-1).nonzero().flatten().tolist()
    return [(_hook_z(l), make(l)) for l in layers]


def read_sweep(
    t: Trial,
    sets: Sequence[Sequence[Head]],
    *,
    path: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> Float[Tensor, " n"]:
    """Recovery for each head set patched at the decision (new → old run).

    path=None: output patching (each head's whole output from the new run). path=positions:
    path patching (only the part of each head's attention that lands on those slots changes).
    Batched forwards (`batch_size` sets each, in order; default: planned by
    `kvnotes.batches.run_rows`, each batch started at its lowest patched layer).
    """
    cap = read_capture(t)
    source = cap.z_new if path is None else path_delta(t, path)

    hooks = partial(read_hooks, source=source, add=path is not None)
    return head_rows(t, cap.old, [cap.token], [cap.position], sets, hooks, batch_size)


def head_rows(
    t: Trial,
    nb: Notebook,
    ids: Sequence[int],
    positions: Sequence[int],
    sets: Sequence[Sequence[Head]],
    hooks: Callable[[Tensor], list],
    batch_size: int | None,
) -> Float[Tensor, " n"]:
    """Recovery of each head set: `ids` at `positions` after `nb`, with `hooks(masks)` for each
    batch's `[row, layer, head]` masks (one unchanged row more where `run_rows` asks for it)."""
    if not sets:
        return undefined_recovery(0, t.model.device)

    def make(rows: list[int], base: bool) -> tuple[list, None]:
        return hooks(masks_for(t.model, [sets[i] for i in rows] + ([[]] if base else []))), None

    logits = run_rows(
        t.model,
        nb,
        ids,
        torch.tensor(list(positions)),
        first_layers(t.model, sets),
        make,
        vocab=t.vocab,
        batches=fixed_batches(len(sets), batch_size),
        desc="head sets",
    )
    return t.recovery(t.score(logits).cpu())


def first_layers(model: KVModel, sets: Sequence[Sequence[Head]]) -> list[int]:
    """The lowest layer of each head set (the last layer for an empty set: it changes nothing)."""
    return [min((l % model.n_layers for l, _ in s), default=model.n_layers - 1) for s in sets]


# --- write side ------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class HeadWriteCapture:
    """The note slots' recompute and the decision in one pass: the old notebook before the
    first note slot, the note tokens then the query tokens with their positions, and the new
    run's head outputs at the note slots (per layer `[pos, head, d_head]`)."""

    base: Notebook
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    n_notes: int
    z_new: tuple[Tensor, ...]


def write_capture(t: Trial) -> HeadWriteCapture | None:
    """The trial's `HeadWriteCapture` (cached), or None when the pair has no note slots. Only the
    new run is captured (`kvnotes.capture.capture_runs`): the old one is recomputed when patched."""
    if "write_capture" in t.cache:
        return t.cache["write_capture"]
    notes = t.pair.downstream()
    cap = None
    if notes:
        model = t.model
        pos = tuple(notes)
        ids = tuple(t.pair.new.ids[p] for p in pos)
        q_ids, q_pos = query_tokens(model, t.old_nb, t.pair.new)
        zs = [_hook_z(l) for l in range(model.n_layers)]
        (new,) = capture_runs(model, [CaptureRun(t.new_nb.truncate(pos[0]), ids, pos)], zs)
        cap = HeadWriteCapture(
            base=t.old_nb.truncate(pos[0]),
            tokens=ids + tuple(q_ids),
            positions=pos + tuple(q_pos.tolist()),
            n_notes=len(pos),
            z_new=tuple(new[n][0] for n in zs),
        )
    t.cache["write_capture"] = cap
    return cap


def write_hooks(masks: Tensor, z_new: Sequence[Tensor], n_total: int) -> list:
    """`hook_z` hooks over the note slots (the first `len(z_new[l])` computed tokens of
    `n_total`): where `masks[b, l, h]`, head h's output at every note slot is the new run's."""
    n = z_new[0].shape[0]
    at_note = torch.arange(n_total) < n

    def make(l: int):
        src = torch.cat([z_new[l], z_new[l].new_zeros(n_total - n, *z_new[l].shape[1:])])

        def hook(z, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
            m = (masks[:, l][:, None, :, None] & at_note[None, :, None, None]).to(z.device)
            return torch.where(m, src[None].to(z), z)

        return hook

    layers = masks.any(0).any(-1).nonzero().flatten().tolist()
    return [(_hook_z(l), make(l)) for l in layers]


def write_sweep(
    t: Trial, sets: Sequence[Sequence[Head]], *, batch_size: int | None = None
) -> Float[Tensor, " n"]:
    """Recovery for each head set whose outputs at the note slots come from the new run while
    the old notebook's note slots are recomputed (NaN for every set when there are no notes).

    The note slots and the query are computed in one pass, the query attending to the
    recomputed note slots as it would after writing them; batched as `read_sweep` is."""
    cap = write_capture(t)
    if cap is None:
        return undefined_recovery(len(sets), t.model.device)
    n = len(cap.tokens)

    hooks = partial(write_hooks, z_new=cap.z_new, n_total=n)
    return head_rows(t, cap.base, list(cap.tokens), list(cap.positions), sets, hooks, batch_size)


Sweep = Callable[[Trial, Sequence[Sequence[Head]]], Tensor]


# --- ranking read heads on a subset of the trials --------------------------------------------
def read_scores(t: Trial) -> Float[Tensor, " n"]:
    """Each head's recovery with its output alone patched at the decision (`all_heads` order): the
    single-head scores `read_heads` ranks by, computed once and cached on the trial."""
    if "read_scores" not in t.cache:
        t.cache["read_scores"] = read_sweep(t, [[h] for h in all_heads(t.model)])
    return t.cache["read_scores"]


def ranked_read_heads(trials: Sequence[Trial], k: int) -> list[Head]:
    """The `k` heads of highest mean single-head read recovery over `trials` (ties in `all_heads`
    order): `read_heads`' ranking, on whichever trials are given.

    >>> from kvnotes import load_model
    >>> from probes import make_trials
    >>> trials = make_trials(load_model("tiny-llama"), "order-cancel", 2, progress=False)
    >>> len(ranked_read_heads(trials[1:], 4))  # ranked on the second trial only
    4
    """
    heads = all_heads(trials[0].model)
    mean = torch.stack([read_scores(t) for t in trials]).mean(0)
    order = sorted(range(len(heads)), key=lambda j: -float(mean[j]))  # stable, as read_heads sorts
    return [heads[j] for j in order[:k]]


def cross_fitted_heads(trials: Sequence[Trial], k: int) -> tuple[list[list[Head]], bool]:
    """For each trial, the top `k` read heads ranked on the OTHER half of the trials (even and odd
    indices, as `cross_fitted_notes` splits them), so a trial's own scores never choose its heads.
    With one trial it falls back to in-sample and says so (False)."""
    if len(trials) < 2:
        return [ranked_read_heads(trials, k) for _ in trials], False
    halves = [ranked_read_heads(trials[j::2], k) for j in (0, 1)]
    return [list(halves[1 - i % 2]) for i in range(len(trials))], True
