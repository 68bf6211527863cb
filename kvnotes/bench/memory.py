"""Peak memory of one call, measured the best way the machine allows: CUDA's allocator statistics,
Linux's resettable peak RSS, or the peak RSS of a fresh subprocess; and the memory free for one
more call (how the prefill bench decides a way would not fit).

`scaling` measures how memory grows with the prompt and the batch against
`kvnotes.engine.memory`'s formulas: a notebook's bytes against its tokens (exact), an overlay's
against its patches (exact), and a decision's peak live tensor bytes against the notebook's
length and the batch (fitted slope beside the formula's).
`python -m kvnotes.bench.memory --model tiny-llama --tokens 64,128,256,512 --batches 2,4,8,16`
prints the table (`--json FILE` writes it)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kvnotes.engine.memory import system_free

HWM = "VmHWM after resetting it through /proc/self/clear_refs (peak RSS above VmRSS before)"
RUSAGE = (
    "ru_maxrss of a fresh subprocess per way and length (its peak above its own peak after loading "
    "the model: a lower bound; the repeats run in turn inside it)"
)
CUDA = "torch.cuda.max_memory_allocated above memory_allocated before (reset_peak_memory_stats)"
MIB = 2**20


def _status(field: str) -> int:
    """A `/proc/self/status` figure (kB there) in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+)", text, re.M).group(1)) * 1024


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def memory_method(device: torch.device) -> str:
    """How peak memory is measured here: CUDA's allocator statistics, Linux's resettable peak RSS,
    or (where /proc/self/clear_refs is not writable) the peak RSS of one subprocess per measurement."""
    if device.type == "cuda":
        return CUDA
    return HWM if _reset_hwm() else RUSAGE


def trim() -> None:
    """Collect garbage and hand freed heap back to the OS, so the level before a call is what lives."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measured(call: Callable[[], Any], method: str, device: torch.device) -> tuple[float, int, Any]:
    """(seconds, peak bytes above the level before, output) of one call."""
    trim()
    if method == CUDA:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _status("VmRSS")
        _reset_hwm()
    t0 = time.perf_counter()
    out = call()
    if method == CUDA:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if method == CUDA else _status("VmHWM")
    return seconds, max(0, peak - before), out


def maxrss() -> int:
    """This process's peak RSS in bytes (Linux reports kB, macOS bytes)."""
    import resource  # Unix only

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def available_bytes(device: torch.device) -> int | None:
    """Free memory for one more call (`kvnotes.engine.memory.system_free`: CUDA's free memory and
    its allocator's unused reserve, or MemAvailable capped by a cgroup v2 limit on Linux)."""
    return system_free(device)


# --- how memory scales -------------------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Live tensor bytes the ops inside the block allocate, and their peak: each op's outputs
    counted once per storage while a tensor holding it lives (a view outliving its base is not
    counted). Exact and the same on every run, unlike RSS; on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self._seen = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        if key in self._seen or key == 0:
            return
        n = t.untyped_storage().nbytes()
        self._seen.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n


def peak_bytes(call: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes one call allocates above what lived before: CUDA's allocator statistics on
    CUDA, else the peak of `LiveBytes` (the call's output counted until it is dropped)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        call()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    with LiveBytes() as live:
        call()
    return live.peak


def slope(xs: Sequence[int | float], ys: Sequence[int | float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def scaling(model, tokens: Sequence[int], batches: Sequence[int], patched: int = 4) -> dict:
    """Bytes against prompt length and batch size, measured beside `kvnotes.engine.memory`'s
    formulas. Rows: for each length, the notebook's K/V bytes (measured, formula) and the peak of
    one decision reading it; for each batch size B (at the shortest length), the overlay of B
    patches of the same `patched` slots (measured, formula) and the peak of their batched forward.
    Slopes: the fitted bytes per token / per row, and the formula's."""
    from kvnotes import ops
    from kvnotes.analysis.bench_report import machine
    from kvnotes.engine.memory import notebook_bytes, row_bytes, slot_bytes
    from kvnotes.fixtures import POLICY, QUERY, STATE, filled_pair

    f, b, dev = model.facts, model.dtype.itemsize, model.device
    by_len = []
    with torch.no_grad():
        for n in tokens:
            old, new = filled_pair(model, POLICY + STATE, QUERY, n)
            nb = ops.prefill(model, old)
            q = len(ops.query_tokens(model, nb, new)[0])
            nbytes = sum(k.nbytes + v.nbytes for k, v in zip(nb.keys, nb.values, strict=True))
            peak = peak_bytes(lambda nb=nb, new=new: ops.decide(model, nb, new), dev)
            by_len.append(
                dict(
                    tokens=nb.n_slots,
                    query=q,
                    notebook=nbytes,
                    formula=notebook_bytes(f, b, nb.n_slots),
                    peak_decide=peak,
                )
            )
        old, new = filled_pair(model, POLICY + STATE, QUERY, min(tokens))
        dst, src = ops.prefill(model, old), ops.prefill(model, new)
        slots = tuple(range(dst.n_slots - patched, dst.n_slots))
        by_batch = []
        for B in batches:
            specs = [ops.Patch(positions=slots)] * B
            ov = ops.patched_slots(dst, src, specs)
            ov_bytes = sum(k.nbytes + v.nbytes for k, v in zip(ov.keys, ov.values, strict=True))

            def call(specs=specs):
                return ops.decide_patched(model, dst, src, specs, new, batch_size=len(specs)).last

            by_batch.append(
                dict(
                    batch=B,
                    overlay=ov_bytes,
                    formula=B * patched * slot_bytes(f, b),
                    peak_forward=peak_bytes(call, dev),
                )
            )
    q = by_len[0]["query"]
    return dict(
        model=model.name,
        machine=machine(),
        device=str(dev),
        dtype=str(model.dtype),
        method=CUDA if dev.type == "cuda" else "live tensor bytes (kvnotes.bench.memory.LiveBytes)",
        by_tokens=by_len,
        by_batch=by_batch,
        slopes=dict(
            notebook_per_token=slope([r["tokens"] for r in by_len], [r["notebook"] for r in by_len]),
            notebook_formula=slot_bytes(f, b),
            decide_per_token=slope([r["tokens"] for r in by_len], [r["peak_decide"] for r in by_len]),
            decide_formula=row_bytes(f, b, q, 1) - row_bytes(f, b, q, 0),
            overlay_per_row=slope([r["batch"] for r in by_batch], [r["overlay"] for r in by_batch]),
            overlay_formula=patched * slot_bytes(f, b),
            forward_per_row=slope([r["batch"] for r in by_batch], [r["peak_forward"] for r in by_batch]),
            forward_formula=row_bytes(f, b, q, dst.n_slots, patched),
        ),
    )


def scaling_table(d: dict) -> str:
    """`scaling`'s result as text: bytes against tokens and batch, and the slopes beside the formula's."""
    lines = [
        f"memory scaling — {d['model']} — {d['device']} {d['dtype']} — {d['machine']}",
        f"peak: {d['method']}",
        "",
        f"{'tokens':>7}{'notebook B':>14}{'formula B':>14}{'decide peak B':>16}",
    ]
    lines += [
        f"{r['tokens']:>7}{r['notebook']:>14,}{r['formula']:>14,}{r['peak_decide']:>16,}"
        for r in d["by_tokens"]
    ]
    lines += ["", f"{'batch':>7}{'overlay B':>14}{'formula B':>14}{'forward peak B':>16}"]
    lines += [
        f"{r['batch']:>7}{r['overlay']:>14,}{r['formula']:>14,}{r['peak_forward']:>16,}"
        for r in d["by_batch"]
    ]
    s = d["slopes"]
    lines += [
        "",
        "slopes (bytes per token / per row): fitted vs formula",
        f"  notebook per token  {s['notebook_per_token']:>12,.0f} vs {s['notebook_formula']:>12,}",
        f"  decide per token    {s['decide_per_token']:>12,.0f} vs {s['decide_formula']:>12,} (upper bound)",
        f"  overlay per row     {s['overlay_per_row']:>12,.0f} vs {s['overlay_formula']:>12,}",
        f"  forward per row     {s['forward_per_row']:>12,.0f} vs {s['forward_formula']:>12,} (upper bound)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import json

    from kvnotes.zoo import load_model

    p = argparse.ArgumentParser(prog="python -m kvnotes.bench.memory", description=scaling.__doc__)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--tokens", default="64,128,256,512", help="notebook lengths (comma-separated)")
    p.add_argument("--batches", default="2,4,8,16", help="batch sizes (comma-separated)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--json", help="also write the result as JSON")
    a = p.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    d = scaling(load_model(a.model, device=a.device, dtype=a.dtype), ints(a.tokens), ints(a.batches))
    print(scaling_table(d))
    if a.json:
        Path(a.json).write_text(json.dumps(d, indent=2))


if __name__ == "__main__":
    main()
