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
*transformer_lens*: `hooked(model).run_with_cache(ids)`, what a TransformerLens user runs: it keeps every
activation and the logits at every position, so it is slow and memory-hungry by design; a length
whose estimated cache would not fit in free memory is skipped with the estimate as the reason.

Each way is timed `repeats` times, in turn (median, min, max), with its peak memory above the
level before the call. The numbers are checked, not assumed: each way's last-position logits and
the keys and values of a sliding and a global layer (over the slots both hold: transformers keeps
only the last `sliding_window - 1` in a sliding layer) against kvnotes's.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_all_start_methods, get_context
from typing import ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from kvnotes.analysis.bench_report import BenchReport, header, machine
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.bench.common import both_backends, growth_exponent
from kvnotes.bench.memory import MIB, RUSAGE, available_bytes, maxrss, measured, memory_method
from kvnotes.bench.prefill_ways import (
    CALLS,
    Outcome,
    Runners,
    compared_layers,
    context_ids,
    device_of,
    diffs,
    load_hf_twin,
)
from kvnotes.engine import hooked
from kvnotes.engine.nnsight.model import NNsightModel
from kvnotes.errors import OutOfRange
from kvnotes.models.model import KVModel

WAYS = ("kvnotes", "kvnotes_nnsight", "transformers_chunked", "transformers", "transformer_lens")
HF_WAYS = ("transformers_chunked", "transformers")  # the ways that run the Hugging Face twin
REFERENCE = "transformers_chunked"  # the way `PrefillPoint.speedup` reads kvnotes against
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
            header("prefill", self.model, self.machine),
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


def _in_subprocess(
    model_name: str, way: str, ids: list[int], repeats: int, layers: list[int]
) -> tuple[list[float], int, Outcome]:
    """One way at one length in a fresh process: the model loaded by name, a short warm-up, then
    `repeats` timings; the peak is ru_maxrss after them above ru_maxrss before them."""
    from kvnotes.zoo import load_model

    model = load_model(model_name)
    r = Runners(
        model=model,
        hf=load_hf_twin(model) if way in HF_WAYS else None,
        nn=load_model(model_name, backend="nnsight") if way == "kvnotes_nnsight" else None,
    )
    call, readout = CALLS[way]
    call(r, ids[:16])
    before = maxrss()
    seconds, seen = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call(r, ids)
        seconds.append(time.perf_counter() - t0)
        if seen is None:
            seen = readout(r, out, ids, layers)
        del out
    return seconds, max(0, maxrss() - before), seen


# --- how much run_with_cache needs ----------------------------------------------------------------
def tl_cache_polynomial(model: KVModel) -> np.ndarray:
    """Bytes that `run_with_cache` keeps (every activation and the logits) as a polynomial in the
    token count (`np.polyval` coefficients): exact, since each is linear in tokens or, for the
    attention scores and pattern, quadratic; fitted on three short contexts."""
    sizes = []
    for n in CALIBRATION:
        logits, cache = hooked(model).run_with_cache(
            torch.tensor([context_ids(model, n)], device=device_of(model))
        )
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
    nn: NNsightModel | None = None,
    tl_margin: float = TL_MARGIN,
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
    device = device_of(model)
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
    skips = _skips(model, lengths, has_hf, device, has_nn=nn is not None, tl_margin=tl_margin)
    runners = Runners(model=model, hf=hf, nn=nn)
    if method != RUSAGE:  # first calls pay one-off costs: a short context through each way first
        for w in [w for w in WAYS if any(w not in s for s in skips.values())]:
            CALLS[w][0](runners, context_ids(model, 16))
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
                    call, readout = CALLS[w]
                    s, peak, out = measured(lambda call=call, ids=ids: call(runners, ids), method, device)
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
        exponents={w: _memory_exponent(points, w) for w in WAYS},
    )


def _skips(
    model: KVModel,
    lengths: list[int],
    has_hf: bool,
    device: torch.device,
    *,
    has_nn: bool = False,
    tl_margin: float = TL_MARGIN,
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
            need = tl_margin * float(np.polyval(poly, n))
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
            logit, kv = diffs(seen[w], ref)
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


def _memory_exponent(points: list[PrefillPoint], way: str) -> float | None:
    """The growth exponent of `way`'s peak memory over the lengths where it ran and used any."""
    xy = [(p.tokens, w.peak_mib) for p in points for w in p.ways if w.name == way and w.peak_mib > 0]
    return growth_exponent([x for x, _ in xy], [y for _, y in xy])


@dataclass(frozen=True)
class PrefillConfig(Options):
    lengths: tuple[int, ...] = option((1024, 4096, 8192), "context lengths (tokens)", least=1, tokens=True)
    repeats: int = option(3, "side-by-side timings per length (the median is reported)", least=1)
    # run_with_cache's transient tensors come on top of what it keeps: a length is skipped before
    # it can exhaust memory
    tl_margin: float = option(
        TL_MARGIN, "TransformerLens's estimated cache is multiplied by this against free memory", least=1.0
    )


@analysis(
    "prefill",
    "bench",
    PrefillConfig,
    PrefillReport,
    quick={"lengths": (256, 1024), "repeats": 1},
    in_report=False,
    title="Prefill: kvnotes (each backend), transformers (chunked and whole), TransformerLens",
    order=40,
)
def _run_prefill(ctx: Context, cfg: PrefillConfig) -> PrefillReport | None:
    """Prefill one context every way: kvnotes (on the nnsight backend too with --backend nnsight),
    transformers (SDPA) fed in kvnotes's chunks and in one forward, TransformerLens run_with_cache."""
    lengths = [n for n in cfg.lengths if n <= ctx.model.n_ctx] if ctx.fit_context else list(cfg.lengths)
    if not lengths:
        return None
    tl, nn = both_backends(ctx.model)
    return cfg.call(prefill_bench, tl, lengths, nn=nn, progress=ctx.progress)
