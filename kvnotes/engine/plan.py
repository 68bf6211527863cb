"""What a `run()` will compute, whatever the backend: tokens and positions, the keys each layer reads,
and how the fresh K/V go back into the notebook.

Every backend takes a `Plan` and returns `Fresh`; the mask, the sliding-window slot selection, the
activation saver, the softcap and the write-back are written here once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from kvnotes.errors import BadArgument, DeviceMismatch, OutOfRange, ShapeMismatch
from kvnotes.notebook import Notebook
from kvnotes.types import Bool, Float, Int, Tensor

if TYPE_CHECKING:
    from kvnotes.models.model import KVModel

Hook = tuple[str | Callable[[str], bool], Callable]

PREFILL_CHUNK = 1024  # tokens per chunk of a long hook-free append: memory linear in the context
_fast = os.environ.get("KVNOTES_FAST_ATTENTION", "1") != "0"


@contextmanager
def fast_attention(enabled: bool = True) -> Iterator[None]:
    """Turn the fast attention path on or off inside a `with` block (both give the same numbers;
    off, every layer forms the full score matrix as TransformerLens does)."""
    global _fast
    before, _fast = _fast, bool(enabled)
    try:
        yield
    finally:
        _fast = before


def fast_attention_enabled() -> bool:
    return _fast


@dataclass(frozen=True, eq=False)
class Readout:
    """What a run reads out: logits at `positions` (over the whole vocabulary, or the `vocab`
    ids asked for), and activations named in `capture`."""

    logits: Float[Tensor, "batch pos d_vocab"]
    positions: tuple[int, ...]
    activations: dict[str, Tensor] = field(default_factory=dict)

    @property
    def last(self) -> Float[Tensor, "batch d_vocab"]:
        """Logits at the last read-out position."""
        return self.logits[:, -1]


@dataclass(frozen=True, eq=False)
class Resume:
    """Start a forward at block `layer`, with `resid` (`[1 or batch, pos, d_model]`) entering it as
    the computed tokens' residual stream: the blocks before `layer` are not run.

    Exact when nothing those blocks read differs from the run `resid` was captured in (its
    `blocks.{layer}.hook_resid_pre`): a batch of patches that all touch only layers >= `layer`
    (`kvnotes.ops.decide_patched` resumes each batch at its lowest patched layer)."""

    layer: int
    resid: Float[Tensor, "batch pos d_model"]


@dataclass(frozen=True, eq=False)
class Plan:
    """One call's checked inputs: `tok` at `pos` against `notebook` (and `overlay`), unembedding
    the positions `read` (indices `read_idx` among the computed) over columns `cols` (None: all)."""

    notebook: Notebook
    overlay: Notebook | None
    tok: Int[Tensor, "batch pos"]
    pos: Int[Tensor, " pos"]
    read: tuple[int, ...]
    read_idx: Int[Tensor, " read"]
    cols: Int[Tensor, " vocab"] | None
    width: int  # columns of the logits: the whole vocabulary, or len(cols)
    resume: Resume | None = None  # start at this block with this residual (read-only runs)
    stop: int | None = None  # run the blocks below this one only (no logits; K/V of those blocks)

    @property
    def batch(self) -> int:
        return self.tok.shape[0]


@dataclass(frozen=True, eq=False)
class Fresh:
    """What a backend's forward returns: per layer the computed tokens' K/V
    (`[batch, n_kv_heads, pos, d_head]`; None for a block a resumed run skipped), logits
    `[batch, read, width]` and captured activations."""

    keys: Sequence[Tensor | None]
    values: Sequence[Tensor | None]
    logits: Float[Tensor, "batch read d_vocab"]
    activations: dict[str, Tensor] = field(default_factory=dict)

    def every_layer(self) -> tuple[list[Tensor], list[Tensor]]:
        """The K/V of every layer, for writing back (a resumed run skips blocks and never writes)."""
        keys = [k for k in self.keys if k is not None]
        values = [v for v in self.values if v is not None]
        if len(keys) != len(self.keys) or len(values) != len(self.values):
            raise BadArgument("a resumed run skips blocks, so it has no K/V to write there: pass write=False")
        return keys, values


def make_plan(
    model: KVModel,
    notebook: Notebook,
    tokens: Sequence[int] | Tensor,
    positions: Sequence[int] | Tensor | None,
    *,
    write: bool,
    logits_at: Sequence[int] | None,
    vocab: Sequence[int] | None,
    overlay: Notebook | None,
    resume: Resume | None = None,
    stop: int | None = None,
) -> Plan:
    """Check `run()`'s arguments against the model and notebook and resolve their defaults."""
    notebook.check_model(model)
    check_layers(model, notebook, overlay, stop, logits_at)
    tok, pos = tokens_and_positions(notebook, tokens, positions)
    n = tok.shape[1]
    check_inputs(model, notebook, tok, pos)
    batch = max(notebook.batch, tok.shape[0])
    if overlay is not None:
        batch = check_overlay(model, notebook, overlay, batch, write)
    if tok.shape[0] != batch:
        tok = tok.expand(batch, -1)
    early = stop is not None and stop < model.n_layers  # no last block: nothing to unembed
    read = (
        (int(pos[-1]),) if logits_at is None and n and not early else tuple(int(p) for p in logits_at or ())
    )
    read_idx = indices_of(pos, read)
    n_vocab = model.facts.d_vocab_out
    cols = None if vocab is None else torch.as_tensor(list(vocab), dtype=torch.long)
    if cols is not None and cols.numel() and not 0 <= int(cols.min()) <= int(cols.max()) < n_vocab:
        raise OutOfRange(f"vocab ids must lie in 0..{n_vocab - 1}")
    width = n_vocab if cols is None else cols.numel()
    if resume is not None:
        check_resume(model, resume, tok, write)
        if stop is not None and stop <= resume.layer:
            raise OutOfRange(f"stop={stop} is not after the resumed block {resume.layer}: no block would run")
    return Plan(notebook, overlay, tok, pos, read, read_idx, cols, width, resume, stop)


def check_layers(
    model: KVModel, nb: Notebook, overlay: Notebook | None, stop: int | None, logits_at: Sequence[int] | None
) -> None:
    """Refuse a `stop` outside 1..n_layers, logits asked of a run that stops early, and a notebook
    (or overlay) that holds fewer layers than the run reads: one written by a run with `stop`
    serves runs that stop there or earlier."""
    n = model.n_layers
    if stop is not None and not 1 <= stop <= n:
        raise OutOfRange(f"stop={stop} is outside 1..{n} for {model.name}; give the number of blocks to run")
    if stop is not None and stop < n and logits_at:
        raise BadArgument(
            f"a run that stops at block {stop} of {n} has no logits: pass logits_at=() (capture the "
            "residual you read instead), or leave stop out"
        )
    need = n if stop is None else stop
    for name, book in (("notebook", nb), ("overlay", overlay)):
        if book is not None and book.n_layers < need:
            raise ShapeMismatch(
                f"the {name} holds the first {book.n_layers} of {model.name}'s {n} layers (it was written "
                f"by a run with stop={book.n_layers}), and this run reads {need}: run it with "
                f"stop={book.n_layers} or less, or prefill the prompt again without stop"
            )


def check_stop_hooks(model: KVModel, stop: int | None, names: Sequence[str]) -> None:
    """Refuse hooks and captures a run that stops before block `stop` would never reach: a block's
    point at `stop` or later, or a point after the last block (the final norm, the unembedding)."""
    if stop is None or stop >= model.n_layers:
        return
    for name in names:
        block = name.split(".")[1] if name.startswith("blocks.") else None
        late = int(block) >= stop if block is not None and block.isdigit() else name not in EMBED_POINTS
        if late:
            raise BadArgument(
                f"{name!r} is never reached by a run that stops at block {stop}: run up to block "
                f"{stop - 1} only, or give a larger stop (kvnotes.engine.stop_for(model, names))"
            )


EMBED_POINTS = ("hook_embed", "hook_pos_embed")  # the points before the first block


def check_resume(model: KVModel, resume: Resume, tok: Tensor, write: bool) -> None:
    """Refuse a resume that writes, or a residual of the wrong shape (`run` has already refused a
    backend without the `resume` capability)."""
    if write:
        raise BadArgument("a resumed run skips blocks, so it has no K/V to write there: pass write=False")
    if not 0 <= resume.layer < model.n_layers:
        raise OutOfRange(f"resume layer {resume.layer} is outside 0..{model.n_layers - 1}")
    want = (tok.shape[1], model.facts.d_model)
    if (
        resume.resid.ndim != 3
        or tuple(resume.resid.shape[1:]) != want
        or resume.resid.shape[0]
        not in (
            1,
            tok.shape[0],
        )
    ):
        raise ShapeMismatch(
            f"resume residual of shape {tuple(resume.resid.shape)}; want [1 or {tok.shape[0]}, {want[0]}, "
            f"{want[1]}] (batch, computed tokens, d_model)"
        )


def tokens_and_positions(notebook: Notebook, tokens, positions) -> tuple[Tensor, Tensor]:
    """`[batch, pos]` token ids and their positions (default: right after the notebook's last)."""
    tok = torch.as_tensor(tokens, dtype=torch.long)
    tok = tok[None] if tok.ndim == 1 else tok
    n = tok.shape[1]
    pos = (
        torch.arange(notebook.next_position, notebook.next_position + n)
        if positions is None
        else torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    )
    return tok, pos


def check_overlay(model: KVModel, nb: Notebook, overlay: Notebook, batch: int, write: bool) -> int:
    """The batch of a call reading `overlay` over `nb`; refuses writes and mismatched overlays."""
    overlay.check_model(model)
    if write:
        raise BadArgument(
            "an overlay is read-only: pass write=False, or patch the notebook first "
            "(kvnotes.ops.patch / patch_batch) to keep the patched slots"
        )
    if overlay.n_slots and overlay.keys[0].device != nb.keys[0].device:
        raise DeviceMismatch(
            f"the overlay is on {overlay.keys[0].device}, the notebook on {nb.keys[0].device}"
        )
    if overlay.batch not in (1, batch) and batch != 1:
        raise ShapeMismatch(
            f"overlay batch {overlay.batch} does not match batch {batch}; "
            f"give an overlay of batch 1 or {batch}"
        )
    return max(batch, overlay.batch)


def check_inputs(model: KVModel, nb: Notebook, tok: Tensor, pos: Tensor) -> None:
    """Refuse tokens and positions the model or notebook cannot take, naming the way out."""
    device = model.device
    if nb.keys and nb.keys[0].device != device:
        raise DeviceMismatch(
            f"the notebook is on {nb.keys[0].device} but {model.name} is on {device}; "
            f"move it with notebook.to({str(device)!r})"
        )
    if tok.ndim != 2 or tok.shape[1] != pos.shape[0]:
        raise ShapeMismatch(
            f"{tok.shape[-1]} tokens but {pos.shape[0]} positions; give one position per token"
        )
    if tok.shape[0] not in (1, nb.batch) and nb.batch != 1:
        raise ShapeMismatch(
            f"token batch {tok.shape[0]} does not match notebook batch {nb.batch}; give "
            f"tokens of batch 1 or {nb.batch}, or run one notebook row at a time (nb[i])"
        )
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= model.n_ctx):
        raise OutOfRange(
            f"positions must lie in 0..{model.n_ctx - 1} for {model.name}; "
            f"got {int(pos.min())}..{int(pos.max())}"
        )
    if pos.unique().numel() != pos.numel():
        raise BadArgument("positions repeat; give each computed token its own position")
    vocab = model.facts.d_vocab
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= vocab):
        raise OutOfRange(f"token ids must lie in 0..{vocab - 1}; got {int(tok.min())}..{int(tok.max())}")


def indices_of(pos: Tensor, wanted: tuple[int, ...]) -> Tensor:
    """The indices in `pos` of the positions `wanted` (each must be among them)."""
    where = {int(p): i for i, p in enumerate(pos.tolist())}
    missing = [p for p in wanted if p not in where]
    if missing:
        raise OutOfRange(f"logits_at position(s) {missing} are not among the computed positions")
    return torch.tensor([where[p] for p in wanted], dtype=torch.long)


def saver(store: dict[str, Tensor]) -> Callable:
    """A hook function that keeps a detached copy of its activation in `store` under its hook name."""

    def save(act, hook):
        store[hook.name] = act.detach().clone()

    setattr(save, "_saves", True)  # a saver never writes: allowed on read-only sites  # noqa: B010
    return save


def softcap(x: Tensor, cap: float | None) -> Tensor:
    """Gemma's `cap * tanh(x / cap)` where `cap` is positive; `x` itself otherwise."""
    if cap is None or cap <= 0:
        return x
    return cap * torch.tanh(x / cap)


# --- the keys a layer reads ----------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class SlotKeys:
    """Which notebook slots a layer reads (`take`: all when None) and its boolean
    `[computed, read slots + overlay slots + computed]` mask, with its additive form (0 or -inf)."""

    take: slice | Tensor | None
    mask: Bool[Tensor, "pos key"]
    bias: Float[Tensor, "pos key"]


def key_planner(
    nb: Notebook, overlay: Notebook | None, pos: Tensor, device, dtype
) -> Callable[[int | None, bool], SlotKeys]:
    """`keys_for(window, trim)`: the keys a layer with that sliding window reads. Untrimmed, every
    slot (the key axis attention hooks see); trimmed, only the slots inside the window."""
    nb_pos = nb.positions
    ov_pos = overlay.positions if overlay is not None else nb_pos[:0]
    live_nb = ~torch.isin(nb_pos, torch.cat([pos, ov_pos]))
    live_ov = ~torch.isin(ov_pos, pos)
    in_order = nb.n_slots < 2 or bool((nb_pos[1:] > nb_pos[:-1]).all())
    planned: dict[tuple[int | None, bool], SlotKeys] = {}

    def keys_for(window: int | None, trim: bool) -> SlotKeys:
        if (window, trim) in planned:
            return planned[window, trim]
        take: slice | Tensor | None = None
        if trim and window is not None and nb.n_slots:
            lo = int(pos.min()) - window + 1  # no query reads a slot before this position
            if in_order:
                first = int(torch.searchsorted(nb_pos, lo))
                take = slice(first, None) if first else None
            elif bool((nb_pos < lo).any()):
                take = (nb_pos >= lo).nonzero().flatten()
        kept_pos = nb_pos if take is None else nb_pos[take]
        kept_live = live_nb if take is None else live_nb[take]
        key_pos = torch.cat([kept_pos, ov_pos, pos])
        live = torch.cat([kept_live, live_ov, torch.ones_like(pos, dtype=torch.bool)])
        mask = attention_mask(key_pos, live, pos, window).to(device)
        if isinstance(take, Tensor):
            take = take.to(device)
        bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
        planned[window, trim] = SlotKeys(take=take, mask=mask, bias=bias)
        return planned[window, trim]

    return keys_for


def attention_mask(key_pos: Tensor, live: Tensor, pos: Tensor, window: int | None) -> Bool[Tensor, "pos key"]:
    """Boolean `[query, key]`: causal by position, live keys only, inside the sliding window."""
    mask = (key_pos[None, :] <= pos[:, None]) & live[None, :]
    if window is not None:
        mask &= key_pos[None, :] > pos[:, None] - window
    return mask


def take_slots(k: Tensor, v: Tensor, take: slice | Tensor | None) -> tuple[Tensor, Tensor]:
    """The slots `take` of one layer's keys and values (a view for a slice: nothing is copied)."""
    if take is None:
        return k, v
    if isinstance(take, slice):
        return k[:, :, take], v[:, :, take]
    return k.index_select(2, take.to(k.device)), v.index_select(2, take.to(v.device))


# --- the write-back ------------------------------------------------------------------------------
def write_back(
    nb: Notebook, tok: Tensor, pos: Tensor, fresh_k: list[Tensor], fresh_v: list[Tensor]
) -> Notebook:
    """Put fresh K/V into the slots at `pos` (replacing) or after the last slot (appending)."""
    batch = tok.shape[0]
    base = nb.expand(batch) if nb.batch != batch else nb
    is_old = torch.isin(pos, nb.positions)
    new_idx = (~is_old).nonzero().flatten()
    old_idx = is_old.nonzero().flatten()
    target = nb.slot_index(pos[old_idx]) if old_idx.numel() else old_idx

    def merge(old: Tensor, fresh: Tensor) -> Tensor:
        out = torch.cat([old, fresh[:, :, new_idx]], dim=2)
        if old_idx.numel():
            out[:, :, target] = fresh[:, :, old_idx]
        return out

    tokens = torch.cat([base.tokens, tok[:, new_idx]], 1)
    if old_idx.numel():
        tokens[:, target] = tok[:, old_idx]
    # a run that stopped early has K/V for its first blocks only: the notebook it writes holds those
    # (the later blocks' slots for the new tokens were never computed)
    layers = len(fresh_k)
    return replace(
        base,
        keys=tuple(merge(o, f) for o, f in zip(base.keys[:layers], fresh_k, strict=True)),
        values=tuple(merge(o, f) for o, f in zip(base.values[:layers], fresh_v, strict=True)),
        positions=torch.cat([nb.positions, pos[new_idx]]),
        tokens=tokens,
    )
