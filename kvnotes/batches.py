"""Many variants of one decision as few batched forwards: which rows go together, and each batch
started at the lowest block it changes.

A sweep (of K/V patches, of head patches) asks for one decision per row, each row changing the
model from some block on. Two facts make it cheap: a small forward's time is the model's weights
streamed from memory whatever its rows, so rows should share forwards; and a row that changes
nothing below block l computes, below l, exactly what the unchanged decision computes, so its
batch can start at l from that decision's residual (`kvnotes.engine.Resume`).

    from kvnotes.batches import run_rows
    logits = run_rows(model, nb, ids, pos, first, make)   # make(rows, base) -> (hooks, overlay)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from kvnotes.engine import Capability, Hook, Resume, has, run, stop_for
from kvnotes.engine.memory import FRACTION, budget, free_bytes, mib, row_bytes
from kvnotes.errors import BadArgument
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.types import Float, Tensor

_sharing = os.environ.get("KVNOTES_SHARING", "1") != "0"
UNSHARED_ROWS = 16  # the unshared way's rows per forward: the fixed batch sweeps used before planning

FORWARD_TOKEN_ROWS = 84  # a block's fixed cost (its weights streamed), in query token-rows of compute
MAX_ROWS = 256  # rows per batched forward at most


@contextmanager
def sharing(enabled: bool = True) -> Iterator[None]:
    """Share what pairs share inside a `with` block (the default), or not: `sharing(False)` is the
    unshared way `kvnotes bench analyses` times beside it (every prompt prefilled from its first
    token, sweeps in fixed batches of `UNSHARED_ROWS` from block 0, nothing memoised across a
    report's sections). Both give the same numbers up to float rounding. `KVNOTES_SHARING=0`
    turns it off for a whole process."""
    global _sharing
    before, _sharing = _sharing, bool(enabled)
    try:
        yield
    finally:
        _sharing = before


def sharing_enabled() -> bool:
    return _sharing


Make = Callable[[list[int], bool], tuple[Sequence[Hook], Notebook | None]]


def plan_batches(
    first: Sequence[int],
    n_layers: int,
    n_query: int,
    fits: Callable[[int, int], bool] | None = None,
    max_rows: int = MAX_ROWS,
) -> list[list[int]]:
    """Rows `0..len(first)-1`, in order, cut into the batches of least summed cost.

    A batch of rows i..j-1 starts at block `first[i]` (rows come sorted by their first block) and
    costs `(n_layers - first[i]) * (FORWARD_TOKEN_ROWS + rows * n_query)`: every block it runs
    streams its weights whatever the rows (Gemma 3 270M on 2 cores: 9 ms a block for 7 rows of a
    2-token decision, 32 ms for 126), then pays per row. Each batch holds at most `max_rows`
    rows (`MAX_ROWS` by default; `run_rows` passes what fits the device's free memory,
    `rows_per_forward`), and `fits(i, j)` (when given) must accept it (a memory bound, say).

    >>> [len(b) for b in plan_batches([0] * 2 + [5] * 100, 6, 1)]   # the late rows go together
    [2, 100]
    """
    n = len(first)
    best = [0.0] + [float("inf")] * n  # best[j]: the cheapest batches of rows[:j]
    cut = [0] * (n + 1)
    for i in range(n):
        for j in range(i + 1, min(n, i + max(1, min(max_rows, MAX_ROWS))) + 1):
            if j - i > 1 and fits is not None and not fits(i, j):
                break
            cost = best[i] + (n_layers - first[i]) * (FORWARD_TOKEN_ROWS + (j - i) * n_query)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    batches, j = [], n
    while j > 0:
        batches.append(list(range(cut[j], j)))
        j = cut[j]
    return batches[::-1]


def run_rows(
    model: KVModel,
    nb: Notebook,
    ids: Sequence[int],
    pos: Tensor,
    first: Sequence[int],
    make: Make,
    *,
    vocab: Sequence[int] | None = None,
    batches: Sequence[Sequence[int]] | None = None,
    resume: bool = True,
    progress: bool = False,
    desc: str = "rows",
    patched: int = 0,
) -> Float[Tensor, "n d_vocab"]:
    """Decision logits of each row: `ids` at `pos` read after `nb`, row r changed from block
    `first[r]` on by what `make` returns for its batch.

    `make(rows, base)` gives the hooks and overlay of a batch of row indices (each hook masks by
    its row); with `base`, one more row is last in the batch and must be left unchanged: the
    decision whose residual later batches resume from. `batches` (row indices; default
    `plan_batches` over the rows sorted by first block) are run in turn, each from its lowest
    first block when the backend can resume and `resume` allows (False where a hook outside
    `make`'s may sit below a row's first block): from block 0 otherwise. Before any forward, the
    batches are held to what fits the device's free memory (`rows_per_forward`, each row reading
    at most `patched` slots of its own): planned batches are cut to fit, and given batches that
    cannot fit are refused in one line naming the batch size that does."""
    n, L = len(first), model.n_layers
    width = model.facts.d_vocab_out if vocab is None else len(vocab)
    if batches is None and not _sharing:
        batches = fixed_batches(n, UNSHARED_ROWS)
    resume = resume and _sharing and has(model, Capability.RESUME) and n > 0 and max(first) > 0
    want = max((len(b) for b in batches), default=0) + 1 if batches is not None else None
    cap = rows_per_forward(model, nb, len(ids), patched=patched, want=want) - 1  # one base row more
    if batches is None:
        order = sorted(range(n), key=lambda i: first[i]) if resume else list(range(n))
        at = [first[i] if resume else 0 for i in order]
        batches = [[order[k] for k in b] for b in plan_batches(at, L, len(ids), max_rows=cap)]
    starts = {min(first[i] for i in b) for b in batches} if resume else set()
    need = sorted(l for l in starts if l > 0)
    resid: dict[int, Tensor] = {}
    out: Tensor | None = None
    for rows in tqdm(batches, desc=desc, disable=not progress, unit="batch"):
        rows = list(rows)
        start = min(first[i] for i in rows) if resume else 0
        base = bool(need) and not resid and start == 0  # this batch also computes the residuals
        if need and not resid and not base:
            resid = layer_inputs(model, nb, ids, pos, need)
        hooks, overlay = make(rows, base)
        tok = torch.as_tensor(list(ids))[None].expand(len(rows) + base, -1)  # one row per batch row
        capture = [f"blocks.{l}.hook_resid_pre" for l in need] if base else []
        again = Resume(start, resid[start]) if start > 0 else None
        _, r = run(
            model,
            nb,
            tok,
            pos,
            write=False,
            hooks=hooks,
            capture=capture,
            vocab=vocab,
            overlay=overlay,
            resume=again,
        )
        if base:
            resid = {l: r.activations[f"blocks.{l}.hook_resid_pre"][-1:] for l in need}
        if out is None:
            out = r.last.new_zeros(n, width)
        out[rows] = r.last[: len(rows)]
    return out if out is not None else torch.zeros(0, width, dtype=model.dtype, device=model.device)


def rows_per_forward(
    model: KVModel, nb: Notebook, n_query: int, *, patched: int = 0, want: int | None = None
) -> int:
    """Rows one forward of `n_query` tokens after `nb` may hold: `MAX_ROWS`, or fewer where
    `kvnotes.engine.memory.row_bytes` of them would pass `FRACTION` of the device's free memory
    (at least 2: a row and the unchanged one). Refuses, before any forward, when `want` rows
    (a given batch size) or two rows do not fit, naming the way out."""
    per = row_bytes(model.facts, model.dtype.itemsize, n_query, nb.n_slots, patched)
    room = budget(model.device)
    if room is None:
        return MAX_ROWS
    fit = room // per
    where = f"{FRACTION:.0%} of the {mib(free_bytes(model.device) or 0)} free on {model.device}"
    if fit < 2:
        raise BadArgument(
            f"one row of this forward ({n_query} query tokens over {nb.n_slots} slots, {patched} "
            f"patched) needs ~{mib(per)}, more than {where}; use a shorter prompt or fewer slots"
        )
    if want is not None and want > fit:
        raise BadArgument(
            f"a batch of {want - 1} rows needs ~{mib(want * per)}, more than {where}; "
            f"pass batch_size={fit - 1} or less"
        )
    return min(fit, MAX_ROWS + 1)


def fixed_batches(n: int, size: int | None) -> list[list[int]] | None:
    """Rows `0..n-1` in batches of `size`, in order (None for `size` None: let `run_rows` plan them)."""
    if size is None:
        return None
    if size < 1:
        raise BadArgument(f"batch_size must be at least 1, got {size}")
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def layer_inputs(
    model: KVModel, nb: Notebook, ids: Sequence[int], pos: Tensor, layers: Sequence[int]
) -> dict[int, Tensor]:
    """The unchanged decision's residual entering each block in `layers` (`[1, pos, d_model]`)."""
    names = {l: f"blocks.{l}.hook_resid_pre" for l in layers if l > 0}
    stop = stop_for(model, list(names.values()))  # nothing after the last block read is needed
    _, r = run(model, nb, ids, pos, write=False, capture=list(names.values()), logits_at=(), stop=stop)
    return {l: r.activations[n] for l, n in names.items()}


__all__ = [
    "FORWARD_TOKEN_ROWS",
    "MAX_ROWS",
    "UNSHARED_ROWS",
    "fixed_batches",
    "layer_inputs",
    "plan_batches",
    "rows_per_forward",
    "run_rows",
    "sharing",
    "sharing_enabled",
]
