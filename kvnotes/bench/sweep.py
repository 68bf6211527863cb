"""Benchmarks that run several ways side by side in one process and report the ratios.

`patch_sweep`: a per-slot KV transplant sweep over the last 64 slots (all layers) of a prompt,
(a) by the engine — the prefix is never recomputed, a batch of patched notebooks is one forward
over the decision tokens only — (b) the naive way a TransformerLens user would take without a
notebook: one full forward of the whole prompt per patch, with hooks on `hook_rot_k`/`hook_v`
that set every prefix slot's K/V to the patched notebook's, and (c) the strong baselines of
`kvnotes.bench.baselines`: TransformerLens batched and with its own KV cache, nnsight over the Hugging
Face model batched and with Hugging Face's own cache. Every way unembeds only the last position
and only the two answer tokens, as the engine does (no full-vocabulary logits anywhere), and each
is timed as the median of `repeats` sweeps, the ways in turn, at its best batch size. Beside them
the floor (`floor_run`: the decision tokens alone at the engine's batch size, no prefix) is timed
the same way, and engine / floor says how close the engine is to the work no way can skip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.analysis.bench_report import BenchReport, header, machine
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.bench.baselines import (
    BATCH_SIZES,
    WAYS,
    HFTwin,
    PatchPair,
    best_batch_size,
    hf_twin,
    sweep,
    time_side_by_side,
    unavailable,
)
from kvnotes.bench.common import both_backends
from kvnotes.engine import hooked, lens_model, run
from kvnotes.engine.memory import FRACTION, budget, mib, notebook_bytes, row_bytes
from kvnotes.engine.nnsight.model import NNsightModel
from kvnotes.engine.phases import PhaseReport, phases
from kvnotes.engine.transformer_lens import final_logits
from kvnotes.errors import BadOption
from kvnotes.fixtures import POLICY, QUERY, STATE, filled_pair
from kvnotes.hooks import hook_name
from kvnotes.metrics import logit_diff, recovery
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.prompt import Prompt

ENGINE_BATCH = 16  # the engine's batch size in reports written before it was probed


@dataclass(frozen=True, kw_only=True)
class BaselineResult:
    """One strong baseline's sweep: median seconds of `repeats` (min, max), its batch size, its
    time over the engine's (> 1: the engine is faster) and its largest |logit - engine's logit|."""

    name: str
    seconds: float
    min_s: float
    max_s: float
    batch_size: int
    ratio: float
    max_abs_logit_diff: float


@dataclass(frozen=True, kw_only=True)
class SweepResult:
    """One prompt length: the engine's and the naive way's medians (the engine's with min, max and
    batch size), naive / engine, the two ways' largest recovery and logit differences, the
    strong baselines run (`baselines`) and not run, with the reason (`skipped`), and the floor
    (`floor_s`: the work every way must do) with the engine's time over it."""

    tokens: int
    n_patches: int
    engine_s: float
    engine_min_s: float
    engine_max_s: float
    engine_batch: int
    naive_s: float
    ratio: float  # naive_s / engine_s
    max_recovery_diff: float
    max_logit_diff: float
    repeats: int
    baselines: list[BaselineResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    # the floor: the decision tokens alone at the engine's batch size (see `floor_run`), timed
    # beside the ways; engine_s / floor_s says how close the engine is to it (None: not measured)
    floor_s: float | None = None
    floor_min_s: float | None = None
    floor_max_s: float | None = None
    engine_over_floor: float | None = None
    # with `profile`: one more sweep of the engine and of the floor under torch's profiler, their
    # seconds by engine phase (`kvnotes.engine.phases.PhaseReport.to_dict`), keyed "engine", "floor"
    profile: dict | None = None

    @classmethod
    def from_dict(cls, d: dict) -> SweepResult:
        old = {  # reports written before the baselines: one timing, batch 16
            "engine_min_s": d["engine_s"],
            "engine_max_s": d["engine_s"],
            "engine_batch": ENGINE_BATCH,
            "repeats": 1,
        }  # and before the floor: floor_s, floor_min_s, floor_max_s, engine_over_floor stay None
        return cls(**{**old, **d, "baselines": [BaselineResult(**b) for b in d.get("baselines", [])]})


@dataclass(frozen=True)
class SweepReport(BenchReport):
    POINT: ClassVar[type] = SweepResult
    model: str
    machine: str
    results: list[SweepResult]

    @classmethod
    def from_dict(cls, d: dict) -> SweepReport:
        return cls(**{**d, "results": [SweepResult.from_dict(r) for r in d["results"]]})

    def table(self) -> str:
        reps = self.results[0].repeats if self.results else 1
        lines = [header("patch sweep", self.model, self.machine, f"median of {reps} (min–max)")]
        for r in self.results:
            lines += [
                "",
                f"{r.tokens} tokens, {r.n_patches} patches; engine vs naive: max |Δrecovery| "
                f"{r.max_recovery_diff:.2e}, max |Δlogit| {r.max_logit_diff:.2e}",
                f"  {'way':<22}{'batch':>6}{'seconds':>10}  {'(min–max)':<17}{'× engine':>9}"
                f"{'max |Δlogit|':>14}",
                f"  {'engine':<22}{r.engine_batch:>6}{r.engine_s:>10.3f}  "
                f"{f'({r.engine_min_s:.3f}–{r.engine_max_s:.3f})':<17}{1.0:>9.2f}{'—':>14}",
                f"  {'naive (one per patch)':<22}{1:>6}{r.naive_s:>10.3f}  {'':<17}{r.ratio:>9.2f}"
                f"{r.max_logit_diff:>14.2e}",
            ]
            if r.floor_s is not None:
                lines.append(
                    f"  {'floor (no prefix)':<22}{r.engine_batch:>6}{r.floor_s:>10.3f}  "
                    f"{f'({r.floor_min_s:.3f}–{r.floor_max_s:.3f})':<17}"
                    f"{r.floor_s / r.engine_s:>9.2f}{'—':>14}   engine / floor {r.engine_over_floor:.2f}"
                )
            for b in r.baselines:
                lines.append(
                    f"  {b.name:<22}{b.batch_size:>6}{b.seconds:>10.3f}  "
                    f"{f'({b.min_s:.3f}–{b.max_s:.3f})':<17}{b.ratio:>9.2f}{b.max_abs_logit_diff:>14.2e}"
                )
            lines += [f"  {name:<22}skipped: {why}" for name, why in r.skipped.items()]
            lines += _profile_lines(r)
        return "\n".join(lines)


def _profile_lines(r: SweepResult) -> list[str]:
    """Where the engine's and the floor's time goes, by phase (`--profile`), and the engine's time
    over the floor's split by phase."""
    if not r.profile:
        return []
    engine, floor = (PhaseReport.from_dict(r.profile[k]) for k in ("engine", "floor"))
    lines = ["", "  one sweep each under torch's profiler (its overhead included), by engine phase:"]
    lines += [engine.table("engine"), floor.table("floor")]
    by = {p.name: p.seconds for p in floor.phases}
    above = engine.wall - floor.wall
    lines.append(f"  the engine over the floor: {above:.4f} s, by phase (engine − floor):")
    for name, s, _, _ in engine.rows()[:-1]:
        lines.append(f"    {name:<22}{s - by.get(name, 0.0):>+9.4f}")
    lines.append(f"    {'(outside the phases)':<22}{engine.outside - floor.outside:>+9.4f}")
    return lines


def sweep_prompts(model: KVModel, n_tokens: int) -> tuple[Prompt, Prompt]:
    """An aligned (old, new) pair of about `n_tokens` tokens, the field near the start."""
    return filled_pair(model, POLICY + STATE, QUERY, n_tokens)


def _naive_logits(model: KVModel, prompt: Prompt, nb, stop: int, vocab: tuple[int, ...]) -> torch.Tensor:
    """One full forward with every prefix slot's K/V forced to `nb`'s; last-position logits of `vocab`."""
    keys = [k[0].transpose(0, 1) for k in nb.keys]  # [slot, kv_head, d_head]
    values = [v[0].transpose(0, 1) for v in nb.values]
    saved = {}

    def set_k(k, hook):
        k[0, :stop] = keys[hook.layer()]
        return k

    def set_v(v, hook):
        v[0, :stop] = values[hook.layer()]
        return v

    def grab(x, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
        saved["x"] = x[:, -1]

    last = hook_name(model.n_layers - 1, "hook_resid_post")
    hooks = [
        (lambda n: n.endswith("attn.hook_rot_k"), set_k),
        (lambda n: n.endswith("attn.hook_v"), set_v),
        (last, grab),
    ]
    hooked(model).run_with_hooks(torch.tensor([list(prompt.ids)]), return_type=None, fwd_hooks=hooks)
    return final_logits(lens_model(model, "the naive way"), saved["x"], torch.tensor(vocab))


def floor_run(model: KVModel, nb: Notebook, prompt: Prompt, vocab: tuple[int, int]):
    """The floor of a patch sweep, as a `PatchFn`: the decision tokens alone, at the batch's size
    and their own positions, through the engine's forward with an *empty* notebook. That is every
    projection, norm and MLP over the decision tokens and the two answer columns of the unembed,
    the work each way does for a batch of patches whatever it does about the prefix, plus
    attention among the decision tokens themselves only (no prefix slot is read). The engine's
    time over it is what attending to the prefix and patching cost."""
    ids, pos = ops.query_tokens(model, nb, prompt)
    empty, tok = Notebook.empty(model), torch.tensor([ids])

    def floor(batch: Sequence[int]) -> torch.Tensor:
        _, out = run(model, empty, tok.expand(len(batch), -1), pos, write=False, vocab=vocab)
        return out.last

    return floor


@dataclass(frozen=True, eq=False)
class _Pair:
    """One aligned prompt pair ready to sweep: its notebooks, the answer pair the edit moves most
    (recovery is well conditioned on it) with both prompts' logit differences, and the slots."""

    old: Prompt
    new: Prompt
    nb_old: Notebook
    nb_new: Notebook
    vocab: tuple[int, int]
    ld_old: torch.Tensor
    ld_new: torch.Tensor
    slots: list[int]

    @property
    def stop(self) -> int:
        return self.nb_old.next_position


def _pair(model: KVModel, n_tokens: int, n_slots: int) -> _Pair:
    """The sweep's prompts of about `n_tokens` tokens, prefilled, and its last `n_slots` slots."""
    old, new = sweep_prompts(model, n_tokens)
    nb_old, nb_new = ops.prefill(model, old), ops.prefill(model, new)
    ref_old, ref_new = ops.decide(model, nb_old, old).last[0], ops.decide(model, nb_new, new).last[0]
    shift = ref_new - ref_old
    a, b = int(shift.argmax()), int(shift.argmin())
    stop = nb_old.next_position
    return _Pair(
        old=old,
        new=new,
        nb_old=nb_old,
        nb_new=nb_new,
        vocab=(a, b),
        ld_old=logit_diff(ref_old, a, b),
        ld_new=logit_diff(ref_new, a, b),
        slots=list(range(stop - n_slots, stop)),
    )


def _skipped(
    model: KVModel, baselines: Sequence[str], wanted: list, twin: HFTwin, nn: NNsightModel | None
) -> dict[str, str]:
    """Each strong baseline (and the engine on the nnsight backend) that will not run, with why."""
    skipped = {w.name: why for w in wanted if (why := unavailable(w, model, twin))}
    skipped |= {n: "not asked for (the baselines option)" for n in WAYS if n not in baselines}
    if nn is None:
        skipped["engine_nnsight"] = (
            "the nnsight backend was not asked for (--backend nnsight)"
            if model.hf_source is not None
            else f"{model.name} has no Hugging Face counterpart for the nnsight backend to run"
        )
    return dict(sorted(skipped.items()))


def _engine(model: KVModel, nb_old: Notebook, nb_new: Notebook, new: Prompt, vocab: tuple[int, int]):
    """The engine's sweep as a `PatchFn`: a batch of patched notebooks, one forward of the decision."""

    def engine(batch: Sequence[int]) -> torch.Tensor:
        specs = [ops.Patch(positions=(p,)) for p in batch]
        return ops.decide_patched(model, nb_old, nb_new, specs, new, batch_size=len(specs), vocab=vocab).last

    return engine


def _engine_on(nn: NNsightModel, old: Prompt, new: Prompt, vocab: tuple[int, int]):
    """The engine's sweep on another backend's model, over its own notebooks of the same prompts."""
    return _engine(nn, ops.prefill(nn, old), ops.prefill(nn, new), new, vocab)


def _naive(model: KVModel, s: _Pair):
    """The naive way as a `PatchFn` of one patch: a full forward with the patched notebook forced in."""

    def naive(batch: Sequence[int]) -> torch.Tensor:
        (p,) = batch
        patched = ops.patch(s.nb_old, s.nb_new, ops.Patch(positions=(p,)))
        return _naive_logits(model, s.new, patched, s.stop, s.vocab)

    return naive


def _timed_ways(
    model: KVModel,
    s: _Pair,
    runs: dict,
    candidates: Sequence[int],
    repeats: int,
    progress: bool,
) -> tuple[dict, dict[str, int]]:
    """Each way at its best batch size among `candidates`, the naive way and the floor, timed side
    by side `repeats` times: ({way: (Timing, logits)}, {way: batch size})."""
    sizes = {
        name: best_batch_size(fn, s.slots, candidates)
        for name, fn in tqdm(runs.items(), desc="choosing batch sizes", disable=not progress)
    }
    naive = _naive(model, s)
    naive(s.slots[:1])  # warm-up
    floor = floor_run(model, s.nb_old, s.new, s.vocab)
    floor(s.slots[: sizes["engine"]])  # warm-up
    ways = {name: partial(sweep, fn, s.slots, sizes[name]) for name, fn in runs.items()}
    timed = time_side_by_side(
        {
            **ways,
            "naive": partial(sweep, naive, s.slots, 1),
            "floor": partial(sweep, floor, s.slots, sizes["engine"]),
        },
        repeats,
        desc=f"patch sweep ({len(s.old)} tokens)",
        progress=progress,
    )
    return timed, sizes


def _result(
    s: _Pair, timed: dict, sizes: dict[str, int], skipped: dict[str, str], repeats: int
) -> SweepResult:
    """The sweep's result: every way against the engine, in time and in logits."""
    (eng, eng_ab), (nai, naive_ab), (flo, _) = timed.pop("engine"), timed.pop("naive"), timed.pop("floor")
    rec_engine = recovery(logit_diff(eng_ab, 0, 1), s.ld_old, s.ld_new, min_effect=0)
    rec_naive = recovery(logit_diff(naive_ab, 0, 1), s.ld_old, s.ld_new, min_effect=0)
    return SweepResult(
        tokens=len(s.old),
        n_patches=len(s.slots),
        engine_s=eng.median,
        engine_min_s=eng.min,
        engine_max_s=eng.max,
        engine_batch=sizes["engine"],
        naive_s=nai.median,
        ratio=nai.median / eng.median,
        max_recovery_diff=float((rec_engine - rec_naive).abs().max()),
        max_logit_diff=float((eng_ab - naive_ab).abs().max()),
        repeats=max(1, repeats),
        baselines=[
            BaselineResult(
                name=name,
                seconds=t.median,
                min_s=t.min,
                max_s=t.max,
                batch_size=sizes[name],
                ratio=t.median / eng.median,
                max_abs_logit_diff=float((logits - eng_ab).abs().max()),
            )
            for name, (t, logits) in timed.items()
        ],
        skipped=skipped,
        floor_s=flo.median,
        floor_min_s=flo.min,
        floor_max_s=flo.max,
        engine_over_floor=eng.median / flo.median,
    )


def patch_sweep(
    model: KVModel,
    n_tokens: int,
    *,
    n_slots: int = 64,
    batch_size: int | None = None,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    repeats: int = 3,
    baselines: Sequence[str] = tuple(WAYS),
    twin: HFTwin | None = None,
    nn: NNsightModel | None = None,
    profile: bool = False,
    progress: bool = True,
) -> SweepResult:
    """Time the per-slot transplant sweep every way on a prompt of about `n_tokens` tokens.

    batch_size: every batched way's batch size; None picks each way's own among `batch_sizes` by a
    short probe (`best_batch_size`). baselines: the strong baselines to run
    (`kvnotes.bench.baselines.WAYS`). twin: `hf_twin(model)`'s result, to load the Hugging Face
    counterpart once for several lengths. nn: the same weights on the nnsight backend: its engine
    runs beside as `engine_nnsight`, on its own notebooks of the same prompts (the nnsight
    baselines then trace its module). profile: also one sweep of the engine and of the floor under
    torch's profiler, their seconds by engine phase (`kvnotes.engine.phases`).

    >>> from kvnotes import load_model
    >>> r = patch_sweep(load_model("tiny-gqa"), 40, n_slots=4, repeats=1, progress=False)
    >>> [b.name for b in r.baselines]
    ['tl_full_batched', 'tl_kv_cache']
    >>> sorted(r.skipped)
    ['engine_nnsight', 'hf_cache', 'nnsight_full_batched', 'nnsight_hf_cache']
    """
    bad = [n for n in baselines if n not in WAYS]
    if bad:
        raise BadOption(f"unknown baseline(s) {bad}; the baselines are {', '.join(WAYS)}")
    wanted = [WAYS[n] for n in WAYS if n in baselines]
    check_sweep_memory(model, n_tokens, (batch_size,) if batch_size else batch_sizes, full=bool(wanted))
    if twin is None:
        twin = hf_twin(model, need=any(w.hf for w in wanted), nnsight=any(w.nnsight for w in wanted))
    skipped = _skipped(model, baselines, wanted, twin, nn)
    with torch.no_grad():
        # 1) the prompts, their notebooks and the answer pair
        s = _pair(model, n_tokens, n_slots)
        # 2) the ways: each baseline patches the old prompt's cache with the new one's slot, as the engine
        pair = PatchPair(
            model=model,
            dst_ids=s.old.ids,
            src_ids=s.new.ids,
            stop=s.stop,
            vocab=s.vocab,
            hf=twin.hf,
            lm=twin.lm,
        )
        runs = {
            "engine": _engine(model, s.nb_old, s.nb_new, s.new, s.vocab),
            **{w.name: w.make(pair) for w in wanted if w.name not in skipped},
        }
        if nn is not None:
            runs["engine_nnsight"] = _engine_on(nn, s.old, s.new, s.vocab)
        # 3) timed side by side; a given batch size is only warmed up
        candidates = (batch_size,) if batch_size else tuple(batch_sizes)
        timed, sizes = _timed_ways(model, s, runs, candidates, repeats, progress)
        result = _result(s, timed, sizes, skipped, repeats)
        if profile:  # 4) one more sweep of the engine and of the floor, by phase
            floor, b = floor_run(model, s.nb_old, s.new, s.vocab), sizes["engine"]
            reports = {"engine": runs["engine"], "floor": floor}
            by_phase = {k: phases(partial(sweep, fn, s.slots, b)).to_dict() for k, fn in reports.items()}
            result = replace(result, profile=by_phase)
    return result


DECISION_TOKENS = 16  # the sweep's decision tokens at most (the query after the field), for the estimate


def check_sweep_memory(model: KVModel, n_tokens: int, sizes: Sequence[int], *, full: bool) -> None:
    """Refuse, before any forward, a sweep whose largest batch would not fit the device: two
    notebooks of `n_tokens` slots, plus `max(sizes)` rows, each a full forward of `n_tokens`
    tokens where a full-forward baseline runs (`full`), else a decision of `DECISION_TOKENS`
    reading the notebook and one patched slot (`kvnotes.engine.memory.row_bytes`), within
    `FRACTION` of the free memory. The message names the batch sizes or lengths that fit."""
    room = budget(model.device)
    if room is None or not sizes:
        return
    f, b = model.facts, model.dtype.itemsize
    fixed = 2 * notebook_bytes(f, b, n_tokens)
    per = row_bytes(f, b, n_tokens, 0) if full else row_bytes(f, b, DECISION_TOKENS, n_tokens, 1)
    need = fixed + max(sizes) * per
    if need <= room:
        return
    fit = (room - fixed) // per
    way = f"pass --batch-sizes {fit} or less" if fit >= 1 else "pass shorter --tokens"
    raise BadOption(
        f"the patch sweep at {n_tokens} tokens, {max(sizes)} rows a forward, needs ~{mib(need)}, "
        f"more than {FRACTION:.0%} of the free memory on {model.device} ({mib(room)}); {way}"
    )


def patch_sweep_report(
    model: KVModel,
    lengths: list[int],
    *,
    baselines: Sequence[str] = tuple(WAYS),
    nn: NNsightModel | None = None,
    n_slots: int = 64,
    batch_size: int | None = None,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    repeats: int = 3,
    profile: bool = False,
    progress: bool = True,
) -> SweepReport:
    """`patch_sweep` at each length (its options are `patch_sweep`'s); the Hugging Face counterpart,
    if a baseline needs it, loads once (or is `nn`'s own module, when the nnsight backend runs beside)."""
    sizes = (batch_size,) if batch_size else batch_sizes
    for n in lengths:  # every length checked before the first one runs
        check_sweep_memory(model, n, sizes, full=any(b in WAYS for b in baselines))
    ways = [WAYS[n] for n in baselines if n in WAYS]
    need, through = any(w.hf for w in ways), any(w.nnsight for w in ways)
    twin = HFTwin(hf=nn.hf, lm=nn.lm) if nn is not None else hf_twin(model, need=need, nnsight=through)
    return SweepReport(
        model=model.name,
        machine=machine(),
        results=[
            patch_sweep(
                model,
                n,
                n_slots=n_slots,
                batch_size=batch_size,
                batch_sizes=batch_sizes,
                repeats=repeats,
                baselines=baselines,
                twin=twin,
                nn=nn,
                profile=profile,
                progress=progress,
            )
            for n in lengths
        ],
    )


@dataclass(frozen=True)
class SweepConfig(Options):
    tokens: tuple[int, ...] = option((256, 1024), "prompt lengths", least=1, tokens=True)
    slots: int = option(64, "how many trailing slots to sweep", least=1, arg="n_slots")
    repeats: int = option(3, "side-by-side timings per length (the median is reported)", least=1)
    baselines: tuple[str, ...] = option(tuple(WAYS), "strong baselines to run (kvnotes.bench.baselines)")
    # each way runs at the batch size it is fastest at, so no way is timed at another's sweet spot
    batch_sizes: tuple[int, ...] = option(
        BATCH_SIZES, "batch sizes each way's short probe picks from", least=1
    )
    profile: bool = option(
        False, "also break the engine's and the floor's time down by engine phase (torch's profiler)"
    )

    def __post_init__(self):
        super().__post_init__()
        bad = [n for n in self.baselines if n not in WAYS]
        if bad:
            raise BadOption(f"unknown baseline(s) {bad}; the baselines are {', '.join(WAYS)}")


@analysis("patch_sweep", "bench", SweepConfig, SweepReport, in_report=False, order=10)
def _run_patch_sweep(ctx: Context, cfg: SweepConfig) -> SweepReport:
    """Per-slot transplant sweep: engine vs naive full forwards and the strong baselines (and the
    engine on the nnsight backend beside, with --backend nnsight)."""
    tl, nn = both_backends(ctx.model)
    return cfg.call(patch_sweep_report, tl, list(cfg.tokens), nn=nn, progress=ctx.progress)
