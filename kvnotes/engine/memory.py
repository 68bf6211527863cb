"""Memory a batched forward needs and memory the device has free: what the batch planner
(`kvnotes.batches`) caps rows per forward by, and what a sweep checks before it starts.

Estimates, in bytes, from `ModelFacts` and the element size `b` of the model's dtype (L layers,
H query heads, G key/value heads, d_head, d_model, d_mlp, V = d_vocab_out):

- a notebook: `2 * L * G * d_head * b` per slot (K and V, every layer), exactly `notebook_bytes`;
- one row of a batched forward of `q` query tokens reading `S` notebook slots and `P` patched
  slots of its own (`row_bytes`): its overlay `P * 2 * L * G * d_head * b` (every layer), plus one
  block's activations at a time, `q * (4 * d_model + 2 * H * d_head + 2 * G * d_head + m * d_mlp) * b`
  (residual copies, queries and attention out, keys and values, m = 3 for a gated MLP else 2),
  the scores and pattern `2 * H * q * k * b`, the keys and values laid end to end for two blocks
  `4 * G * d_head * k * b` (one block's copy may live while the next is made) and the mask, bias
  and positions `(5 * q + KEY_BOOKKEEPING) * k` over its `k = S + P + q` keys, plus the read
  logits `4 * V` (float32, one position).

The terms are upper bounds of what one block holds at once; the planner lets a batch take
`FRACTION` of the free memory, so that what the estimate leaves out (allocator slack, temporaries)
has room. `free_bytes` reads CUDA's free memory plus what its allocator holds unused, or the
process's available memory on the CPU; `pretend_free` stands a chosen figure in for it (tests).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

import torch

from kvnotes.models.model import ModelFacts

FRACTION = 0.5  # of the free memory, what one batch's rows may take
MIB = 2**20
KEY_BOOKKEEPING = 64  # bytes a key costs in positions and masks (int64 and bool copies; 45 measured)

FreeReader = Callable[[torch.device], "int | None"]
_reader: ContextVar[FreeReader | None] = ContextVar("kvnotes_free_reader", default=None)


def slot_bytes(facts: ModelFacts, itemsize: int) -> int:
    """One notebook slot's K and V over every layer."""
    return 2 * facts.n_layers * facts.n_kv_heads * facts.d_head * itemsize


def notebook_bytes(facts: ModelFacts, itemsize: int, n_slots: int, batch: int = 1) -> int:
    """A notebook's K/V tensors: linear in slots (and in its batch)."""
    return batch * n_slots * slot_bytes(facts, itemsize)


def row_bytes(facts: ModelFacts, itemsize: int, n_query: int, n_slots: int, n_patched: int = 0) -> int:
    """One row of a batched forward (the module's formula): its overlay of `n_patched` slots,
    one block's activations over `n_query` tokens and `n_slots + n_patched + n_query` keys, and
    its read logits."""
    f, q = facts, n_query
    k = n_slots + n_patched + q
    mlp = (3 if f.gated_mlp else 2) * (f.d_mlp or 0)
    act = q * (4 * f.d_model + 2 * f.n_heads * f.d_head + 2 * f.n_kv_heads * f.d_head + mlp)
    attn = 2 * f.n_heads * q * k + 4 * f.n_kv_heads * f.d_head * k
    per_key = (5 * q + KEY_BOOKKEEPING) * k  # float32 bias, bool mask, int64 positions and liveness
    return n_patched * slot_bytes(f, itemsize) + (act + attn) * itemsize + per_key + 4 * f.d_vocab_out


def system_free(device: torch.device) -> int | None:
    """Free memory on `device`: CUDA's free memory (`torch.cuda.mem_get_info`) plus what the
    caching allocator reserved and does not use (`memory_reserved - memory_allocated`); on the CPU,
    Linux's MemAvailable capped by a cgroup v2 limit; None where neither can be read (MPS, others)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        free = _meminfo("MemAvailable")
    except (OSError, AttributeError):
        return None
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    return free


def _meminfo(field: str) -> int:
    text = Path("/proc/meminfo").read_text()
    found = re.search(rf"^{field}:\s+(\d+)", text, re.M)
    if found is None:
        raise OSError(f"no {field} in /proc/meminfo")
    return int(found.group(1)) * 1024


def free_bytes(device: torch.device) -> int | None:
    """Free memory on `device` as the planner sees it: `system_free`, or inside `pretend_free` /
    `reading_free` the reader they set."""
    reader = _reader.get()
    return (reader or system_free)(torch.device(device))


@contextlib.contextmanager
def reading_free(reader: FreeReader) -> Iterator[None]:
    """Read free memory through `reader(device)` inside the block (a device's own API, a test's)."""
    token = _reader.set(reader)
    try:
        yield
    finally:
        _reader.reset(token)


def pretend_free(n_bytes: int) -> contextlib.AbstractContextManager[None]:
    """Plan inside the block as if every device had `n_bytes` free (a small GPU, in a test)."""
    return reading_free(lambda device: n_bytes)


def budget(device: torch.device) -> int | None:
    """Bytes one batch's rows may take on `device` (`FRACTION` of the free), None if unknown."""
    free = free_bytes(device)
    return None if free is None else int(free * FRACTION)


def mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


__all__ = [
    "FRACTION",
    "budget",
    "free_bytes",
    "notebook_bytes",
    "pretend_free",
    "reading_free",
    "row_bytes",
    "slot_bytes",
    "system_free",
]
