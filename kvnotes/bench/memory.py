"""Peak memory of one call, measured the best way the machine allows: CUDA's allocator statistics,
Linux's resettable peak RSS, or the peak RSS of a fresh subprocess; and the memory free for one
more call (how the prefill bench decides a way would not fit)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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
    """Free memory for one more call: CUDA's free memory, or MemAvailable (capped by a cgroup v2
    limit) on Linux; None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
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
    return int(re.search(rf"^{field}:\s+(\d+)", text, re.M).group(1)) * 1024
