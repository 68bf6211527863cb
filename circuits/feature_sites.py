"""Where SAE features are patched: a trial's region (`REGIONS`: the note slots or the decision
token; the analysis's `site` setting), both runs' residual and SAE code there, and the
whole-residual scan that locates the region and layer to read.

`circuits.features` scores features on these regions: what they decode and what they carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from circuits.heads import read_capture
from circuits.sae import REGIONS, SAEConfig, check_sae, decoder_rows
from kvnotes.analysis.stats import Curve
from kvnotes.analysis.trials import Trial, clusters_of
from kvnotes.capture import CaptureRun, capture_pair, capture_runs
from kvnotes.engine import run
from kvnotes.errors import BadArgument
from kvnotes.hooks import hook_name
from kvnotes.metrics import undefined_recovery
from kvnotes.notebook import Notebook
from kvnotes.types import Float, Tensor

ROWS = 32  # feature sets per batched forward


# --- causing: feature patches at a region --------------------------------------------------------
@dataclass(frozen=True, eq=False)
class FeaturePatcher:
    """One trial's region (`REGIONS`), ready for feature patches: both runs' residual there
    (`x_*`, captured by `kvnotes.capture`), its SAE code (`a_*`) and error
    (`err_* = x − sae_decode(a)`), one row per position of the region.

    A patch of feature set F writes, at every position of the region in the old-value run,
        x' = x_old + Σ_{f∈F} (a_new_f − a_old_f) · d_f  =  decode(a_patched) + (x_old − decode(a_old)),
    with d_f feature f's decoder direction (`decoder_rows`): the features move, the old run's
    error term stays. With `error=True` the error term moves too, so every feature gives x_new.
    """

    trial: Trial
    region: str
    hook_name: str
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    x_old: Float[Tensor, "pos d_model"]
    x_new: Float[Tensor, "pos d_model"]
    a_old: Float[Tensor, "pos d_sae"]
    a_new: Float[Tensor, "pos d_sae"]
    err_old: Float[Tensor, "pos d_model"]
    err_new: Float[Tensor, "pos d_model"]
    decoder: Float[Tensor, "d_sae d_model"]
    base_old: Notebook  # what the region's tokens run against, in each run
    base_new: Notebook

    def deltas(
        self, sets: Sequence[Sequence[int]], *, error: bool = False
    ) -> Float[Tensor, "batch pos d_model"]:
        """What each feature set adds to the old run's residual at the region's positions."""
        mask = self.decoder.new_zeros(len(sets), self.decoder.shape[0])  # the decoder's dtype and device
        for i, feats in enumerate(sets):
            mask[i, list(feats)] = 1.0
        delta = (mask[:, None, :] * (self.a_new - self.a_old)[None]) @ self.decoder
        return delta + (self.err_new - self.err_old)[None] if error else delta

    def recovery(self, sets: Sequence[Sequence[int]], *, error: bool = False) -> Float[Tensor, " n"]:
        """Recovery of each feature set patched toward the new run (batched, `ROWS` per forward)."""
        lds = [
            self.lds(self.base_old, self.deltas(sets[i : i + ROWS], error=error))
            for i in range(0, len(sets), ROWS)
        ]
        return self.trial.recovery(torch.cat(lds)) if lds else undefined_recovery(0, self.decoder.device)

    def ld_reconstructed(self) -> float:
        """The new run's decision logit difference with the region's residual replaced by the SAE's
        reconstruction, error term dropped."""
        return float(self.lds(self.base_new, -self.err_new[None])[0])

    def lds(self, base: Notebook, deltas: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, " batch"]:
        """Decision logit difference with `deltas[i]` added to the residual at the region (row i)."""
        model, n = self.trial.model, deltas.shape[0]

        def add(act, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
            return act + deltas.to(act)

        tok = torch.tensor(self.tokens)[None].expand(n, -1)
        hooks = [(self.hook_name, add)]
        if self.region == "notes":  # rewrite the note slots (K/V of later layers follow), then decide
            nb, _ = run(model, base, tok, self.positions, hooks=hooks, logits_at=())
            return self.trial.ld(nb).cpu()
        _, out = run(model, base, tok, self.positions, write=False, hooks=hooks, vocab=self.trial.vocab)
        return self.trial.score(out.last).cpu()


def region_runs(t: Trial, region: str) -> tuple[CaptureRun, CaptureRun] | None:
    """Both runs at a region (`REGIONS`), as `kvnotes.capture` computes them: the note slots
    against the notebooks before the first of them (None for a pair without notes), or the
    decision token against the notebooks extended by the query before it (shared with the read
    heads)."""
    if region == "notes":
        positions = t.pair.downstream()
        if not positions:
            return None
        tokens = [t.pair.new.ids[p] for p in positions]
        return (
            CaptureRun(t.old_nb.truncate(positions[0]), tokens, positions),
            CaptureRun(t.new_nb.truncate(positions[0]), tokens, positions),
        )
    if region == "decision":
        rc = read_capture(t)
        return CaptureRun(rc.old, [rc.token], [rc.position]), CaptureRun(rc.new, [rc.token], [rc.position])
    raise BadArgument(f"site must be one of {REGIONS}, got {region!r}")


@torch.no_grad()
def feature_patcher(
    trial: Trial, sae, region: str = "notes", *, decoder: Tensor | None = None
) -> FeaturePatcher:
    """Set up `trial` for feature patches at `region` ("notes": the note slots, recomputed from
    the first one; "decision": the last query token, the tokens before it computed once): both
    runs captured at the SAE's hook (`kvnotes.capture.capture_pair`) and encoded."""
    hook, _ = check_sae(sae, trial.model)
    runs = region_runs(trial, region)
    if runs is None:
        raise BadArgument(
            "this pair has no note slots between the field and the decision; use site='decision'"
        )
    both = capture_pair(trial.model, *runs, [hook])
    x_old, x_new = (c[hook][0].float().cpu() for c in (both.old, both.new))
    a_old, a_new = (sae_encode(sae, x) for x in (x_old, x_new))
    err_old, err_new = x_old - sae_decode(sae, a_old), x_new - sae_decode(sae, a_new)
    return FeaturePatcher(
        trial=trial,
        region=region,
        hook_name=hook,
        positions=tuple(runs[0].positions),
        tokens=tuple(runs[0].tokens),
        x_old=x_old,
        x_new=x_new,
        a_old=a_old,
        a_new=a_new,
        err_old=err_old,
        err_new=err_new,
        decoder=decoder_rows(sae).cpu() if decoder is None else decoder,
        base_old=runs[0].notebook,
        base_new=runs[1].notebook,
    )


@torch.no_grad()
def sae_encode(sae, x: Tensor) -> Tensor:
    """The SAE's code for residual rows `x`, on the CPU as float32 whatever the SAE's device."""
    return sae.encode(x.to(sae.device, sae.dtype)).float().cpu()


@torch.no_grad()
def sae_decode(sae, a: Tensor) -> Tensor:
    """The SAE's reconstruction of code rows `a`, on the CPU as float32."""
    return sae.decode(a.to(sae.device, sae.dtype)).float().cpu()


# --- where the conclusion lives: whole-residual patches per layer ----------------------------------
LOCATE_NOTES = 0.5  # "auto" takes the notes when their whole residual carries this much of the decision
LOCATE_SHARE = 0.9  # the layer: the earliest reaching this share of the site's best recovery


def residual_scan(t: Trial, region: str) -> Float[Tensor, " layer"]:
    """Recovery when the whole residual at `region` after each layer is the new run's (one layer
    at a time; at the notes region the note slots are recomputed from there, so later layers'
    K/V follow). NaN everywhere for the notes region of a pair without note slots."""
    model = t.model
    L = model.n_layers
    names = [hook_name(l, "hook_resid_post") for l in range(L)]
    runs = region_runs(t, region)
    if runs is None:
        return undefined_recovery(L, model.device)
    (ref,) = capture_runs(model, runs[1:], names)
    base_old, tokens, positions = runs[0].notebook, runs[0].tokens, runs[0].positions
    rows = torch.arange(L)

    def make(l: int):
        def hook(act, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
            return torch.where((rows == l)[:, None, None].to(act.device), ref[names[l]], act)

        return hook

    tok = torch.tensor(tokens)[None].expand(L, -1)
    hooks = [(n, make(l)) for l, n in enumerate(names)]
    if region == "notes":
        nb, _ = run(model, base_old, tok, positions, hooks=hooks, logits_at=())
        return t.recovery(t.ld(nb).cpu())
    _, out = run(model, base_old, tok, positions, write=False, hooks=hooks, vocab=t.vocab)
    return t.recovery(t.score(out.last).cpu())


def locate(trials: Sequence[Trial], cfg: SAEConfig, *, progress: bool = True) -> tuple[str, int, dict]:
    """The site and layer to read: `cfg`'s where set; else from whole-residual scans over the
    trials. "auto" takes the notes if their residual carries at least `LOCATE_NOTES` of the
    decision at some layer, else the decision; an unset layer is the earliest reaching
    `LOCATE_SHARE` of the site's best. Returns (site, layer, {site: Curve over layers})."""
    model = trials[0].model if trials else None
    sites = REGIONS if cfg.site == "auto" else (cfg.site,)
    scans = {}
    for s in sites:
        vals = [
            residual_scan(t, s).numpy()
            for t in tqdm(trials, desc=f"residual scan ({s})", disable=not progress, unit="pair")
        ]
        if vals and model is not None:
            arr = np.array(vals)
            scans[s] = Curve.of(
                "layer", list(range(model.n_layers)), arr.T.tolist(), clusters=clusters_of(trials)
            )
    site = cfg.site
    if site == "auto":
        notes = [m for m in scans["notes"].means if m is not None] if "notes" in scans else []
        site = "notes" if notes and max(notes) >= LOCATE_NOTES else "decision"
    layer = cfg.layer
    if layer is None:
        if site in scans:
            means = np.array([np.nan if m is None else m for m in scans[site].means])
            best = np.nanmax(means) if np.isfinite(means).any() else np.nan
            ok = np.nonzero(means >= LOCATE_SHARE * best)[0] if np.isfinite(best) else []
            layer = int(ok[0]) if len(ok) else model.n_layers // 2
        else:
            layer = cfg.layer_for(model) if model is not None else 0
    return site, layer, scans
