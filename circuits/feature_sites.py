"""Where SAE features are patched: a trial's site (note slots or the decision token), its residual
and SAE code there, and the whole-residual scan that locates the site and layer to read.

`circuits.features` scores features on these sites: what they decode and what they carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from circuits.heads import read_site
from circuits.sae import REGIONS, SAEConfig, check_sae, decoder_rows
from kvnotes.analysis.results import Curve
from kvnotes.engine import run
from kvnotes.errors import BadArgument
from kvnotes.hooks import hook_name
from kvnotes.notebook import Notebook
from kvnotes.types import Float, Tensor
from probes.trials import Trial, clusters_of

ROWS = 32  # feature sets per batched forward


# --- causing: feature patches at a site ----------------------------------------------------------
@dataclass(frozen=True, eq=False)
class FeatureSite:
    """One trial's site, ready for feature patches: both runs' residual there (`x_*`), its SAE
    code (`a_*`) and error (`err_* = x − decode(a)`), one row per site position.

    A patch of feature set F writes, at every site position of the old-value run,
        x' = x_old + Σ_{f∈F} (a_new_f − a_old_f) · d_f  =  decode(a_patched) + (x_old − decode(a_old)),
    with d_f feature f's decoder direction (`decoder_rows`): the features move, the old run's
    error term stays. With `error=True` the error term moves too, so every feature gives x_new.
    """

    trial: Trial
    site: str
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
    base_old: Notebook  # what the site's tokens run against, in each run
    base_new: Notebook

    def deltas(
        self, sets: Sequence[Sequence[int]], *, error: bool = False
    ) -> Float[Tensor, "batch pos d_model"]:
        """What each feature set adds to the old run's residual at the site positions."""
        mask = torch.zeros(len(sets), self.decoder.shape[0])
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
        return self.trial.recovery(torch.cat(lds)) if lds else torch.zeros(0, dtype=torch.float64)

    def ld_reconstructed(self) -> float:
        """The new run's decision logit difference with the site's residual replaced by the SAE's
        reconstruction, error term dropped."""
        return float(self.lds(self.base_new, -self.err_new[None])[0])

    def lds(self, base: Notebook, deltas: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, " batch"]:
        """Decision logit difference with `deltas[i]` added to the residual at the site (row i)."""
        model, n = self.trial.model, deltas.shape[0]

        def add(act, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
            return act + deltas.to(act)

        tok = torch.tensor(self.tokens)[None].expand(n, -1)
        hooks = [(self.hook_name, add)]
        if self.site == "notes":  # rewrite the note slots (K/V of later layers follow), then decide
            nb, _ = run(model, base, tok, self.positions, hooks=hooks, logits_at=())
            return self.trial.ld(nb).cpu()
        _, out = run(model, base, tok, self.positions, write=False, hooks=hooks, vocab=self.trial.vocab)
        return self.trial.score(out.last).cpu()


def site_inputs(t: Trial, site: str) -> tuple[list[int], list[int], Notebook, Notebook]:
    """What a site's tokens are and what they run against in each run: the note slots against
    the notebooks before the first of them (empty for a pair without notes), or the decision
    token against the notebooks extended by the query before it (shared with the read heads)."""
    if site == "notes":
        positions = t.pair.downstream()
        if not positions:
            return [], [], t.old_nb, t.new_nb
        tokens = [t.pair.new.ids[p] for p in positions]
        return positions, tokens, t.old_nb.truncate(positions[0]), t.new_nb.truncate(positions[0])
    if site == "decision":
        rs = read_site(t)
        return [rs.position], [rs.token], rs.old, rs.new
    raise BadArgument(f"site must be one of {REGIONS}, got {site!r}")


@torch.no_grad()
def feature_site(trial: Trial, sae, site: str = "notes", *, decoder: Tensor | None = None) -> FeatureSite:
    """Set up `trial` for feature patches at `site` ("notes": the note slots, recomputed from the
    first one; "decision": the last query token, the tokens before it computed once)."""
    hook, _ = check_sae(sae, trial.model)
    model = trial.model
    positions, tokens, base_old, base_new = site_inputs(trial, site)
    if not positions:
        raise BadArgument(
            "this pair has no note slots between the field and the decision; use site='decision'"
        )

    def capture(base: Notebook) -> Tensor:
        _, out = run(model, base, tokens, positions, write=False, capture=[hook], logits_at=())
        return out.activations[hook][0].float().cpu()

    x_old, x_new = capture(base_old), capture(base_new)
    a_old, a_new = (encode(sae, x) for x in (x_old, x_new))
    err_old, err_new = x_old - decode(sae, a_old), x_new - decode(sae, a_new)
    return FeatureSite(
        trial=trial,
        site=site,
        hook_name=hook,
        positions=tuple(positions),
        tokens=tuple(tokens),
        x_old=x_old,
        x_new=x_new,
        a_old=a_old,
        a_new=a_new,
        err_old=err_old,
        err_new=err_new,
        decoder=decoder_rows(sae).cpu() if decoder is None else decoder,
        base_old=base_old,
        base_new=base_new,
    )


@torch.no_grad()
def encode(sae, x: Tensor) -> Tensor:
    """The SAE's code for residual rows `x`, on the CPU as float32 whatever the SAE's device."""
    return sae.encode(x.to(sae.device, sae.dtype)).float().cpu()


@torch.no_grad()
def decode(sae, a: Tensor) -> Tensor:
    """The SAE's reconstruction of code rows `a`, on the CPU as float32."""
    return sae.decode(a.to(sae.device, sae.dtype)).float().cpu()


# --- where the conclusion lives: whole-residual patches per layer ----------------------------------
LOCATE_NOTES = 0.5  # "auto" takes the notes when their whole residual carries this much of the decision
LOCATE_SHARE = 0.9  # the layer: the earliest reaching this share of the site's best recovery


def residual_scan(t: Trial, site: str) -> Float[Tensor, " layer"]:
    """Recovery when the whole residual at `site` after each layer is the new run's (one layer
    at a time; at the notes site the note slots are recomputed from there, so later layers'
    K/V follow). NaN everywhere for the notes site of a pair without note slots."""
    model = t.model
    L = model.n_layers
    names = [hook_name(l, "hook_resid_post") for l in range(L)]
    positions, tokens, base_old, base_new = site_inputs(t, site)
    if not positions:
        return torch.full((L,), float("nan"), dtype=torch.float64)
    _, ref = run(model, base_new, tokens, positions, write=False, capture=names, logits_at=())
    rows = torch.arange(L)

    def make(l: int):
        def hook(act, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
            return torch.where((rows == l)[:, None, None].to(act.device), ref.activations[names[l]], act)

        return hook

    tok = torch.tensor(tokens)[None].expand(L, -1)
    hooks = [(n, make(l)) for l, n in enumerate(names)]
    if site == "notes":
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
