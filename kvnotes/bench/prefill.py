"""Prefill one context side by side: the notebook engine on each backend, transformers, TransformerLens.

The context is BOS plus neutral policy-like lines (as `kvnotes bench ttft` builds it), N tokens.
*kvnotes*: `ops.prefill` on the TransformerLens backend (the notebook is the KV cache; no position
is unembedded). *kvnotes_nnsight*: `ops.prefill` on the nnsight backend (the Hugging Face model's
own forward and attention kernels, fed the notebook as its cache; run with `--backend nnsight`).
*transformers_chunked*: the model's Hugging Face twin with SDPA attention fed the context in
chunks of the engine's `PREFILL_CHUNK` tokens (1,024), as kvnotes prefills, into its own
`DynamicCache(config=...)` (which, as the notebook's fast path, keeps a sliding layer's window
only), `model(chunk, cache=cache, use_cache=True, logits_to_keep=1)` under
`torch.inference_mode()`: the strongest plain-transformers prefill, and the one kvnotes's speed is
read against (`PrefillPoint.speedup`). *transformers*: the same twin over the whole context in one
forward (only the last position is unembedded), reported beside it.
*transformer_lens*: `model.tl.run_with_cache(ids)`, what a TransformerLens user runs: it keeps every
activation and the logits at every position, so it is slow and memory-hungry by design; a length
whose estimated cache would not fit in free memory is skipped with the estimate as the reason.

Each way is timed `repeats` times, in turn (median, min, max), with its peak memory above the
level before the call. The numbers are checked, not assumed: each way's last-position logits and
the keys and values of a sliding and a global layer (over the slots both hold: transformers keeps
only the last `sliding_window - 1` in a sliding layer) against kvnotes's.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from kvnotes import engine, ops
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.bench.sweep import BenchReport, both_backends, machine
from kvnotes.bench.ttft import _text_ids
from kvnotes.engine import run
from kvnotes.errors import OutOfRange
from kvnotes.models.model import KVModel
from kvnotes.types import Float, Tensor

WAYS = ("kvnotes", "kvnotes_nnsight", "transformers_chunked", "transformers", "transformer_lens")
HF_WAYS = ("transformers_chunked", "transformers")  # the ways that run the Hugging Face twin
REFERENCE = "transformers_chunked"  # the way `PrefillPoint.speedup` reads kvnotes against
HWM = "VmHWM after resetting it through /proc/self/clear_refs (peak RSS above VmRSS before)"
RUSAGE = (
    "ru_maxrss of a fresh subprocess per way and length (its peak above its own peak after loading "
    "the model: a lower bound; the repeats run in turn inside it)"
)
CUDA = "torch.cuda.max_memory_allocated above memory_allocated before (reset_peak_memory_stats)"
MIB = 2**20
TL_MARGIN = 1.25  # run_with_cache's transient tensors on top of what it keeps
CALIBRATION = (8, 16, 24)  # token counts whose run_with_cache sizes fit its memory polynomial


@dataclass(frozen=True)
class WayResult:
    name: str
    seconds: float  # median of `repeats`
    min_s: float
    max_s: float
    tokens_per_s: float  # tokens / median seconds
    peak_mib: float  # peak memory above the level before the call (the largest of the repeats)
    # max |difference| from kvnotes's last-position logits and its keys/values of the compared
    # layers (None for kvnotes itself, the reference)
    max_abs_logit_diff: float | None
    max_abs_kv_diff: float | None = None
    repeats: int = 1


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int
    ways: list[WayResult]
    skipped: dict[str, str]  # way -> why it did not run at this length
    # REFERENCE's median seconds over kvnotes's (> 1: kvnotes is faster); None where either did
    # not run (and in reports written before the chunked way)
    speedup: float | None = None


@dataclass(frozen=True)
class PrefillReport(BenchReport):
    POINT: ClassVar[type] = PrefillPoint
    model: str
    machine: str
    memory_method: str
    compared_layers: list[int]
    results: list[PrefillPoint]
    exponents: dict[str, float | None]  # way -> peak memory ∝ tokens^e (None below two lengths)

    @classmethod
    def from_dict(cls, d: dict) -> PrefillReport:
        points = [PrefillPoint(**{**p, "ways": [WayResult(**w) for w in p["ways"]]}) for p in d["results"]]
        return cls(**{**d, "results": points})

    def table(self) -> str:
        reps = max((w.repeats for p in self.results for w in p.ways), default=1)
        lines = [
            f"prefill — {self.model} — {self.machine}",
            f"one context (BOS + filler) prefilled {len(WAYS)} ways in turn; median of {reps} [min, max]",
            f"peak memory: {self.memory_method}",
            f"Δlogit, ΔK/V: max |difference| from kvnotes's last-position logits and its keys/values "
            f"of layers {self.compared_layers}",
            f"× kvnotes: a way's median over kvnotes's; the headline compares with {REFERENCE}",
            f"{'tokens':>7}  {'way':<21}{'seconds [min, max]':>26}{'× kvnotes':>10}{'tokens/s':>10}"
            f"{'peak MiB':>10}{'Δlogit':>10}{'ΔK/V':>10}",
        ]

        def num(x: float | None) -> str:
            return "—" if x is None else f"{x:.1e}"

        def times(p: PrefillPoint, w: WayResult) -> str:
            ours = next((x.seconds for x in p.ways if x.name == "kvnotes"), None)
            return "—" if ours is None else f"{w.seconds / ours:.2f}"

        for p in self.results:
            first = True
            for w in p.ways:
                spread = f"{w.seconds:.3f} [{w.min_s:.3f}, {w.max_s:.3f}]"
                lines.append(
                    f"{p.tokens if first else '':>7}  {w.name:<21}{spread:>26}{times(p, w):>10}"
                    f"{w.tokens_per_s:>10.0f}{w.peak_mib:>10.1f}{num(w.max_abs_logit_diff):>10}"
                    f"{num(w.max_abs_kv_diff):>10}"
                )
                first = False
            for name, why in p.skipped.items():
                lines.append(f"{p.tokens if first else '':>7}  {name:<21}skipped: {why}")
                first = False
            if p.speedup is not None:
                lines.append(f"{'':>7}  kvnotes is {p.speedup:.2f}× as fast as {REFERENCE}")
        fitted = {k: v for k, v in self.exponents.items() if v is not None}
        if fitted:
            lines.append(
                "peak memory growth exponent (peak ∝ tokens^e): "
                + ", ".join(f"{k} {v:.2f}" for k, v in fitted.items())
            )
        return "\n".join(lines)


# --- the context and the ways ---------------------------------------------------------------------
def context_ids(model: KVModel, n: int) -> list[int]:
    """`n` token ids: BOS (where the tokenizer has one), then neutral policy-like lines."""
    bos = model.encode("")
    return [*bos, *_text_ids(model, n - len(bos))][:n]


def compared_layers(model: KVModel) -> list[int]:
    """The layers whose keys and values are compared: the first sliding-window layer and the last
    global one where the model has both, else the first and the last."""
    local = [l for l in range(model.n_layers) if model.window(l) is not None]
    full = [l for l in range(model.n_layers) if model.window(l) is None]
    return [local[0], full[-1]] if local and full else sorted({0, model.n_layers - 1})


@dataclass(frozen=True, eq=False)
class Outcome:
    """What a way's output is checked on: the last position's logits and, per compared layer, the
    post-RoPE keys and the values it holds, oldest slot first."""

    logits: Float[Tensor, " d_vocab"]
    keys: tuple[Float[Tensor, "n_kv_heads _slot d_head"], ...]  # slots differ by layer
    values: tuple[Float[Tensor, "n_kv_heads _slot d_head"], ...]


def _device(model: KVModel) -> torch.device:
    return model.device


@dataclass(frozen=True, eq=False)
class Runners:
    """What the ways run on: the TransformerLens-backend model, its Hugging Face twin and the
    nnsight-backend model of the same weights (either may be None: that way is skipped)."""

    model: KVModel
    hf: Any = None
    nn: KVModel | None = None


def _kvnotes(r: Runners, ids: list[int]):
    return ops.prefill(r.model, ids)


def _kvnotes_nnsight(r: Runners, ids: list[int]):
    return ops.prefill(r.nn, ids)


def _kvnotes_readout(r: Runners, nb, ids: list[int], layers: list[int]) -> Outcome:
    return _notebook_readout(r.model, nb, ids, layers)


def _kvnotes_nnsight_readout(r: Runners, nb, ids: list[int], layers: list[int]) -> Outcome:
    return _notebook_readout(r.nn, nb, ids, layers)


def _notebook_readout(model: KVModel, nb, ids: list[int], layers: list[int]) -> Outcome:
    # the last token again at its own position, not written: it replaces its slot, so it attends to
    # exactly what it attended to in the prefill; one token's compute, for its logits
    _, out = run(model, nb, ids[-1:], [len(ids) - 1], write=False)
    return Outcome(
        logits=out.last[0].cpu(),
        keys=tuple(nb.keys[l][0].cpu() for l in layers),
        values=tuple(nb.values[l][0].cpu() for l in layers),
    )


def _transformers(r: Runners, ids: list[int]):
    with torch.inference_mode():
        return r.hf(input_ids=torch.tensor([ids], device=_device(r.model)), use_cache=True, logits_to_keep=1)


def _transformers_chunked(r: Runners, ids: list[int]):
    """The twin fed `engine.PREFILL_CHUNK` tokens at a time into one `DynamicCache(config=...)`
    (read when called, so both sides chunk alike); the last chunk's output, whose cache is the
    whole context's."""
    from transformers import DynamicCache

    chunk = engine.PREFILL_CHUNK
    with torch.inference_mode():
        cache = DynamicCache(config=r.hf.config)
        for a in range(0, len(ids), chunk):
            piece = torch.tensor([ids[a : a + chunk]], device=_device(r.model))
            out = r.hf(input_ids=piece, cache=cache, use_cache=True, logits_to_keep=1)
        return out


def _transformers_readout(r: Runners, out, ids: list[int], layers: list[int]) -> Outcome:  # noqa: ARG001
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    if hasattr(cache, "layers"):
        keys, values = [x.keys for x in cache.layers], [x.values for x in cache.layers]
    else:  # transformers before the layered cache
        keys, values = cache.key_cache, cache.value_cache
    return Outcome(
        logits=out.logits[0, -1].cpu(),
        keys=tuple(keys[l][0].cpu() for l in layers),
        values=tuple(values[l][0].cpu() for l in layers),
    )


def _transformer_lens(r: Runners, ids: list[int]):
    return r.model.tl.run_with_cache(torch.tensor([ids], device=_device(r.model)))


def _transformer_lens_readout(r: Runners, out, ids: list[int], layers: list[int]) -> Outcome:  # noqa: ARG001
    logits, cache = out

    def held(l: int, site: str) -> Tensor:  # [pos, kv_head, d_head] -> [kv_head, pos, d_head]
        return cache[f"blocks.{l}.attn.{site}"][0].transpose(0, 1).cpu()

    return Outcome(
        logits=logits[0, -1].cpu(),
        keys=tuple(held(l, "hook_rot_k") for l in layers),
        values=tuple(held(l, "hook_v") for l in layers),
    )


# way -> (the timed call, the untimed readout of its output)
_CALLS: dict[str, tuple[Callable, Callable]] = {
    "kvnotes": (_kvnotes, _kvnotes_readout),
    "kvnotes_nnsight": (_kvnotes_nnsight, _kvnotes_nnsight_readout),
    "transformers_chunked": (_transformers_chunked, _transformers_readout),
    "transformers": (_transformers, _transformers_readout),
    "transformer_lens": (_transformer_lens, _transformer_lens_readout),
}


def load_hf_twin(model: KVModel):
    """`model`'s Hugging Face twin (`KVModel.hf_source`), with SDPA attention, on the model's device."""
    hf = model.hf_source.load()
    if getattr(hf.config, "_attn_implementation", None) != "sdpa":
        hf.set_attn_implementation("sdpa")
    return hf.to(_device(model)).eval()


def _diffs(mine: Outcome, ref: Outcome) -> tuple[float, float]:
    """Max |difference| of the logits, and of the keys and values over the last slots both hold."""
    kv = 0.0
    for a, b in [*zip(mine.keys, ref.keys), *zip(mine.values, ref.values)]:
        m = min(a.shape[1], b.shape[1])
        kv = max(kv, float((a[:, -m:] - b[:, -m:]).abs().max()))
    return float((mine.logits - ref.logits).abs().max()), kv


# --- peak memory ----------------------------------------------------------------------------------
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


def _trim() -> None:
    """Collect garbage and hand freed heap back to the OS, so the level before a call is what lives."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _measured(call: Callable[[], Any], method: str, device: torch.device) -> tuple[float, int, Any]:
    """(seconds, peak bytes above the level before, output) of one call."""
    _trim()
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


def _maxrss() -> int:
    """This process's peak RSS in bytes (Linux reports kB, macOS bytes)."""
    import resource  # Unix only

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _in_subprocess(
    model_name: str, way: str, ids: list[int], repeats: int, layers: list[int]
) -> tuple[list[float], int, Outcome]:
    """One way at one length in a fresh process: the model loaded by name, a short warm-up, then
    `repeats` timings; the peak is ru_maxrss after them above ru_maxrss before them."""
    from kvnotes.models import load_model

    model = load_model(model_name)
    r = Runners(
        model=model,
        hf=load_hf_twin(model) if way in HF_WAYS else None,
        nn=load_model(model_name, backend="nnsight") if way == "kvnotes_nnsight" else None,
    )
    call, readout = _CALLS[way]
    call(r, ids[:16])
    before = _maxrss()
    seconds, seen = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call(r, ids)
        seconds.append(time.perf_counter() - t0)
        if seen is None:
            seen = readout(r, out, ids, layers)
        del out
    return seconds, max(0, _maxrss() - before), seen


# --- how much run_with_cache needs ----------------------------------------------------------------
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


def tl_cache_polynomial(model: KVModel) -> np.ndarray:
    """Bytes that `run_with_cache` keeps (every activation and the logits) as a polynomial in the
    token count (`np.polyval` coefficients): exact, since each is linear in tokens or, for the
    attention scores and pattern, quadratic; fitted on three short contexts."""
    sizes = []
    for n in CALIBRATION:
        logits, cache = model.tl.run_with_cache(torch.tensor([context_ids(model, n)], device=_device(model)))
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cache.values()}
        sizes.append(logits.nbytes + sum(storages.values()))  # views of one tensor count once
        del logits, cache
    return np.polyfit(CALIBRATION, sizes, 2)


# --- the benchmark --------------------------------------------------------------------------------
def prefill_bench(
    model: KVModel,
    lengths: list[int],
    *,
    repeats: int = 3,
    hf_model=None,
    nn: KVModel | None = None,
    progress: bool = True,
) -> PrefillReport:
    """Prefill a context of each length in `lengths` (tokens) every way, timed side by side.

    model: the TransformerLens-backend model. hf_model: the Hugging Face twin to use (default:
    `nn`'s own module when given, else loaded from `model.hf_source` with SDPA attention; for
    Gemma 3 270M that takes about a minute). nn: the same weights on the nnsight backend, for the
    `kvnotes_nnsight` way. A way that cannot run at a length is in that point's `skipped`, with
    the reason.

    >>> from kvnotes import load_model
    >>> report = prefill_bench(load_model("tiny-llama"), [64], repeats=1, progress=False)
    >>> [w.name for w in report.results[0].ways], list(report.results[0].skipped)
    (['kvnotes', 'transformer_lens'], ['kvnotes_nnsight', 'transformers_chunked', 'transformers'])
    """
    bad = [n for n in lengths if not isinstance(n, int) or n < 2]
    if bad:
        raise OutOfRange(f"lengths {bad} are too short: a context needs at least 2 tokens (BOS and one)")
    device = _device(model)
    method = memory_method(device)
    layers = compared_layers(model)
    reps = max(1, repeats)
    hf = hf_model if hf_model is not None else (nn.hf if nn is not None else None)
    fits = any(n <= model.n_ctx for n in lengths)
    if hf is None and model.hf_source is not None and fits and method != RUSAGE:
        if progress:  # loaded first, so the free memory that skips are judged on counts it
            tqdm.write(f"prefill bench: loading {model.hf_source.what}", file=sys.stderr)
        hf = load_hf_twin(model)
    has_hf = hf is not None or (method == RUSAGE and model.hf_source is not None)
    skips = _skips(model, lengths, has_hf, device, has_nn=nn is not None)
    runners = Runners(model=model, hf=hf, nn=nn)
    if method != RUSAGE:  # first calls pay one-off costs: a short context through each way first
        for w in [w for w in WAYS if any(w not in s for s in skips.values())]:
            _CALLS[w][0](runners, context_ids(model, 16))
    points = []
    bar = tqdm(lengths, desc="prefill", disable=not progress, unit="length")
    for n in bar:
        ids = context_ids(model, n)
        ways = [w for w in WAYS if w not in skips[n]]
        seconds: dict[str, list[float]] = {w: [] for w in ways}
        peaks: dict[str, int] = dict.fromkeys(ways, 0)
        seen: dict[str, Outcome] = {}
        if method == RUSAGE:
            for w in ways:
                bar.set_postfix_str(f"{w} (subprocess)")
                seconds[w], peaks[w], seen[w] = _spawned(model.name, w, ids, reps, layers)
        else:
            for r in range(reps):  # side by side: each way in turn, every repeat
                for w in ways:
                    bar.set_postfix_str(f"{w} {r + 1}/{reps}")
                    call, readout = _CALLS[w]
                    s, peak, out = _measured(lambda call=call, ids=ids: call(runners, ids), method, device)
                    seconds[w].append(s)
                    peaks[w] = max(peaks[w], peak)
                    if r == 0:
                        seen[w] = readout(runners, out, ids, layers)
                    del out
        points.append(_point(n, ways, seconds, peaks, seen, skips[n], reps))
    return PrefillReport(
        model=model.name,
        machine=machine(),
        memory_method=method,
        compared_layers=layers,
        results=points,
        exponents={w: _exponent(points, w) for w in WAYS},
    )


def _skips(
    model: KVModel, lengths: list[int], has_hf: bool, device: torch.device, *, has_nn: bool = False
) -> dict[int, dict]:
    """Per length, the ways that cannot run there and why (checked before anything is timed)."""
    free = available_bytes(device)
    poly = None
    out = {}
    for n in lengths:
        why: dict[str, str] = {}
        if n > model.n_ctx:
            why = dict.fromkeys(WAYS, f"{n} tokens exceed {model.name}'s n_ctx={model.n_ctx}")
        if not has_nn:
            why["kvnotes_nnsight"] = (
                "the nnsight backend was not asked for (kvnotes bench prefill --backend nnsight)"
                if model.hf_source is not None
                else f"{model.name} has no Hugging Face checkpoint for the nnsight backend to run"
            )
        if not has_hf:
            why |= dict.fromkeys(
                HF_WAYS, f"{model.name} has no Hugging Face twin (it is built from a TransformerLens config)"
            )
        if "transformer_lens" not in why and free is not None:
            poly = tl_cache_polynomial(model) if poly is None else poly
            need = TL_MARGIN * float(np.polyval(poly, n))
            if need > free:
                why["transformer_lens"] = (
                    f"run_with_cache would need about {need / 2**30:.1f} GiB (every activation, "
                    f"the attention patterns quadratic in tokens, and logits at every position); "
                    f"{free / 2**30:.1f} GiB is free"
                )
        out[n] = {w: why[w] for w in WAYS if w in why}
    return out


def _spawned(name: str, way: str, ids: list[int], reps: int, layers: list[int]):
    """`_in_subprocess` in a fresh process: forked from a server that has imported kvnotes once
    (so each measurement does not pay the imports again) where there is one, else spawned."""
    if "forkserver" in get_all_start_methods():
        ctx = get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
    else:
        ctx = get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_in_subprocess, name, way, ids, reps, layers).result()


def _point(n, ways, seconds, peaks, seen, skipped, reps) -> PrefillPoint:
    ref = seen.get("kvnotes")
    results = []
    for w in ways:
        logit = kv = None
        if ref is not None and w != "kvnotes":
            logit, kv = _diffs(seen[w], ref)
        med = float(np.median(seconds[w]))
        results.append(
            WayResult(
                name=w,
                seconds=med,
                min_s=min(seconds[w]),
                max_s=max(seconds[w]),
                tokens_per_s=n / med,
                peak_mib=peaks[w] / MIB,
                max_abs_logit_diff=logit,
                max_abs_kv_diff=kv,
                repeats=reps,
            )
        )
    med = {w.name: w.seconds for w in results}
    speedup = med[REFERENCE] / med["kvnotes"] if REFERENCE in med and "kvnotes" in med else None
    return PrefillPoint(tokens=n, ways=results, skipped=dict(skipped), speedup=speedup)


def _exponent(points: list[PrefillPoint], way: str) -> float | None:
    """The slope of log peak memory on log tokens (1: linear), over the lengths where it ran."""
    xy = [(p.tokens, w.peak_mib) for p in points for w in p.ways if w.name == way and w.peak_mib > 0]
    if len({x for x, _ in xy}) < 2:
        return None
    x, y = np.log([a for a, _ in xy]), np.log([b for _, b in xy])
    return float(np.polyfit(x, y, 1)[0])


@dataclass(frozen=True)
class PrefillConfig(Options):
    lengths: tuple[int, ...] = option((1024, 4096, 8192), "context lengths (tokens)", least=1)
    repeats: int = option(3, "side-by-side timings per length (the median is reported)", least=1)


@analysis(
    "prefill",
    "bench",
    PrefillConfig,
    PrefillReport,
    quick={"lengths": (256, 1024), "repeats": 1},
    in_report=False,
    title="Prefill: kvnotes (each backend), transformers (chunked and whole), TransformerLens",
)
def _run_prefill(ctx: Context, cfg: PrefillConfig) -> PrefillReport | None:
    """Prefill one context every way: kvnotes (on the nnsight backend too with --backend nnsight),
    transformers (SDPA) fed in kvnotes's chunks and in one forward, TransformerLens run_with_cache."""
    lengths = [n for n in cfg.lengths if n <= ctx.model.n_ctx] if ctx.fit_context else list(cfg.lengths)
    if not lengths:
        return None
    tl, nn = both_backends(ctx.model)
    return prefill_bench(tl, lengths, repeats=cfg.repeats, nn=nn, progress=ctx.progress)
