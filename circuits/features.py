"""SAE features of the conclusion: does a feature that *decodes* it also *carry* it?

A TopK sparse autoencoder (sae-lens) is trained on the residual stream after one block
(`blocks.{L}.hook_resid_post`, the hook name sae-lens uses), on every position from the changed
field through the last token of fresh prompt pairs of the task. At a *site* — the note slots (every
position after the field and before the decision) or the decision's last query token — each
feature is then scored twice:

- decoding: on held-out prompts, how well its activation at the site separates the two
  conclusions (AUC, as max(AUC, 1 − AUC): 0.5 is chance, 1.0 a perfect separation either way);
- causing: in the old-value run its activation at the site is moved to the new-value run's,
  keeping the SAE's error term, and the decision's recovery is read (0: still the old decision,
  1: the new one). At the notes site the patch is written during prefill, so later layers' K/V
  at the note slots are recomputed from it before the decision reads them.

The hypothesis under test, not a result to reproduce: a feature can decode the conclusion at
AUC 1.0 yet be causally useless alone, while the causal content is spread over ~10–30 features
along a low-rank direction. `topk_curve` patches together the k features that push hardest along
the conclusion direction (ranked on the other half of the trials); `random_curve` patches k random
features among those whose activation changes between the two runs. A feature's AUC is measured
on held-out prompts, never on the trials it is patched in.

    from kvnotes import load_model
    from kvnotes.analysis.trials import make_trials
    from circuits.features import sae_analysis
    from circuits.sae import SAEConfig, train_sae
    model = load_model("gemma-3-270m")
    trials = make_trials(model, "order-cancel", 8)
    sae = train_sae(model, "order-cancel")             # about a minute; sae.save_model(path) keeps it
    res = sae_analysis(trials, "order-cancel", sae=sae)
    res["single_feature_recovery"], res["best_auc"], res.curves["topk_curve"]
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Int
from scipy.stats import rankdata
from tqdm.auto import tqdm

from circuits.feature_sites import (
    LOCATE_NOTES,
    LOCATE_SHARE,
    FeaturePatcher,
    feature_patcher,
    locate,
    sae_decode,
    sae_encode,
)
from circuits.feature_sites import residual_scan as residual_scan  # its old address
from circuits.sae import (
    EVAL_SEED,
    TRAIN_SEED,
    Residuals,
    SAEConfig,
    check_sae,
    collect_residuals,
    decoder_rows,
    load_sae,
    train_sae,
)
from kvnotes.analysis.registry import Context, Need, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import CONFIDENCE, N_RESAMPLES, Curve, Estimate
from kvnotes.analysis.trials import (
    MIN_EFFECT,
    PairOptions,
    Trial,
    clusters_of,
    shared_trials,
    split_by_effect,
)
from kvnotes.engine.guard import allow
from kvnotes.errors import BadArgument
from kvnotes.tasks import Task, load_task, sample
from kvnotes.types import Float, Tensor

Labels = Int[np.ndarray, " n"] | Bool[np.ndarray, " n"]  # the answer index (conclusion) of each prompt
TOP = 32  # features ranked by AUC whose single-feature recovery is measured


# --- the result -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopFeature:
    """One of the top features by held-out AUC, with its single-feature recovery where measured."""

    feature: int
    auc: float
    score: float  # max(AUC, 1 - AUC)
    high_for: str  # the answer it fires for
    recovery: Estimate | None = None


@dataclass(frozen=True)
class Located:
    """Where the SAE was placed, what was asked for, and the rule that chose."""

    site: str
    layer: int
    asked: dict[str, Any]
    rule: str


@dataclass(frozen=True, kw_only=True)
class SAEFeatures(TaskResult):
    """SAE features that decode the conclusion (AUC) against those that carry it (patched)."""

    PARTS = (
        "best_auc",
        "reconstruction",
        "single_feature_recovery",
        "best_causal_feature",
        "all_features",
        "features_only",
        "reconstruction_decision",
        "reconstruction_recovery",
    )
    CURVES = ("scan_notes", "scan_decision")
    CURVE_PATTERNS = ("topk_curve", "auc_topk_curve", "random_curve")
    layer: int
    hook_name: str
    site: str
    d_sae: int
    k: int | None
    L0: float
    dead_features: int
    mse: float
    training_seconds: float | None
    n_train_activations: int | None
    sae_model_name: str | None
    best_feature: dict[str, Any]  # feature, auc, high_for, n_auc_ge_0.95, n_auc_ge_0.99
    top_features: tuple[TopFeature, ...]
    n_eval_prompts: int
    eval_seed: int
    config: dict[str, Any]  # the SAEConfig used
    note: str
    located: Located
    seconds: dict[str, float]  # per stage
    best_causal_feature: dict[str, Any] | None = None  # with the causal patches (no usable trials: None)
    topk_cross_fitted: bool | None = None
    topk_features: tuple[int, ...] | None = None
    topk_push: tuple[float, ...] | None = None
    no_features: Any = None
    random_pool_sizes: tuple[int, ...] | None = None
    random_draws: int | None = None
    n_trials: int | None = None


# --- decoding: AUC ---------------------------------------------------------------------------
def feature_auc(scores: Float[np.ndarray, "n f"], labels: Labels) -> Float[np.ndarray, " f"]:
    """Per column, P(score of a label-1 prompt > score of a label-0 prompt), ties counted half:
    the Mann–Whitney U of the label-1 prompts over n1 * n0, from average ranks (vectorised)."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    n1 = int(labels.sum())
    n0 = len(labels) - n1
    if n1 == 0 or n0 == 0:
        raise BadArgument(
            f"AUC needs prompts of both conclusions; got {n1} of one and {n0} of the other; "
            "give labels with both values"
        )
    ranks = rankdata(scores, axis=0)
    return (ranks[labels].sum(0) - n1 * (n1 + 1) / 2) / (n1 * n0)


def auc_estimate(scores: Float[np.ndarray, " n"], labels: Labels, *, seed: int = 0) -> Estimate:
    """One feature's decoding score max(AUC, 1 − AUC), with a percentile-bootstrap CI over prompts.

    `values` are per-prompt placements in the winning orientation (for a prompt of one
    conclusion, the share of the other conclusion's prompts it ranks beyond, ties half): they
    average to the AUC exactly. Resamples holding a single conclusion are skipped.
    """
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    a = float(feature_auc(s[:, None], y)[0])
    s = s if a >= 0.5 else -s
    pos, neg = s[y], s[~y]
    place_pos = (pos[:, None] > neg[None]).mean(1) + 0.5 * (pos[:, None] == neg[None]).mean(1)
    place_neg = (pos[None] > neg[:, None]).mean(1) + 0.5 * (pos[None] == neg[:, None]).mean(1)
    values = np.empty(len(s))
    values[y], values[~y] = place_pos, place_neg
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(s), size=(N_RESAMPLES, len(s)))
    sb, yb = s[idx], y[idx]
    n1 = yb.sum(1)
    ok = (n1 > 0) & (n1 < len(s))
    sb, yb, n1 = sb[ok], yb[ok], n1[ok]
    u = (rankdata(sb, axis=1) * yb).sum(1) - n1 * (n1 + 1) / 2
    boot = u / (n1 * (len(s) - n1))
    tail = (1 - CONFIDENCE) / 2 * 100
    ci = (float(np.percentile(boot, tail)), float(np.percentile(boot, 100 - tail))) if len(boot) else None
    return Estimate(values=tuple(float(v) for v in values), mean=max(a, 1 - a), ci=ci)


# --- the analysis --------------------------------------------------------------------------------
def sae_analysis(
    trials: Sequence[Trial],
    task: Task | str,
    *,
    cfg: SAEConfig | None = None,
    sae=None,
    min_effect: float = MIN_EFFECT,
    progress: bool = True,
) -> TaskResult:
    """Which SAE features at the site decode the conclusion, and which carry it (module docstring).

    Trains an SAE (`train_sae`) unless `sae` is given (its layer then comes from its hook name).
    Decoding is measured on `cfg.n_eval_pairs` fresh pairs (both prompts each), causing on the
    trials whose decision moves (|ld_new − ld_old| >= `min_effect`; the others are listed under
    `details["excluded"]`).

    Parts: `single_feature_recovery` (headline: the best-AUC feature patched alone), `best_auc`
    (that feature's AUC, CI over held-out prompts), `best_causal_feature` (the best single feature
    among the top 32 by AUC, picked on these trials: optimistic), `all_features` (every feature
    and the error term: the whole residual at the site, a sanity figure), `features_only` (every
    feature, the old error term kept), `reconstruction` (per held-out prompt, the share of the
    site's variance the SAE explains), `reconstruction_decision` (in the new run, ld with the
    site's residual replaced by its reconstruction, error dropped, over ld_new; unstable where
    ld_new is near 0) and `reconstruction_recovery` (the same run as a recovery). Curves
    `topk_curve` (features by push along the conclusion direction, cross-fitted over trials),
    `auc_topk_curve` (by held-out AUC) and `random_curve` (mean over `cfg.draws` random sets of
    features that change at the site). `details["top_features"]` pairs each top-32 feature's AUC
    with its single-feature recovery.

    >>> from kvnotes import load_model
    >>> from probes import make_trials
    >>> model = load_model("tiny-llama")
    >>> trials = make_trials(model, "order-cancel", 2, progress=False)
    >>> cfg = SAEConfig(n_train_pairs=4, n_eval_pairs=4, training_samples=512, max_k=4, draws=2)
    >>> res = sae_analysis(trials, "order-cancel", cfg=cfg, min_effect=0.0, progress=False)
    >>> res.name, res.headline, res.located.site in ("notes", "decision")
    ('sae', 'single_feature_recovery', True)
    >>> sorted(res.curves)
    ['auc_topk_curve', 'random_curve', 'scan_decision', 'scan_notes', 'topk_curve']
    """
    if not trials:
        raise BadArgument("no trials: make some with probes.make_trials(model, task, n)")
    cfg = asked = cfg or SAEConfig()
    model, task = trials[0].model, load_task(task)
    kind = trials[0].pair.kind
    _check_seeds(trials, cfg)
    clock = _Clock()
    used, excluded = split_by_effect(trials, min_effect)
    # 1) where: the site and layer (the given SAE's layer, else a whole-residual scan), then the SAE
    if sae is not None:
        cfg = replace(cfg, layer=check_sae(sae, model, layer=cfg.layer)[1])
    site, layer, scans = locate(used, cfg, progress=progress)
    cfg = replace(cfg, site=site, layer=layer)
    clock.lap("scan")
    if sae is None:
        sae = train_sae(model, task, cfg, kind=kind, progress=progress)
        clock.lap("train")
    hook, layer = check_sae(sae, model, layer=cfg.layer)
    decoder = decoder_rows(sae).cpu()
    # 2) decoding: per-feature AUC on fresh held-out pairs
    pairs = sample(task, model, cfg.n_eval_pairs, seed=EVAL_SEED + cfg.seed, kind=kind)
    held = collect_residuals(model, pairs, hook, progress=progress)
    dec = _decoding(sae, held, cfg, model.token_strings(list(pairs[0].answers)))
    clock.lap("decoding")
    # 3) causing: feature patches at the site of every trial whose decision moves
    causal = _causing(trials, used, excluded, sae, decoder, dec["ranked"][:TOP], cfg, progress)
    clock.lap("patches")
    # 4) the result
    return _result(sae, dec, causal, scans, cfg, asked, hook, layer, excluded, clock)


def _causing(
    trials: Sequence[Trial],
    used: Sequence[Trial],
    excluded: list,
    sae,
    decoder: Tensor,
    top: Sequence[int],
    cfg: SAEConfig,
    progress: bool,
) -> dict | None:
    """Every feature patch (`_causal`) at the site of each usable trial; at the notes site a trial
    without note slots is added to `excluded`. None when no trial is left."""
    if cfg.site == "notes":
        excluded += [
            {"index": trials.index(t), "reason": "no note slots between the field and the decision"}
            for t in used
            if not t.pair.downstream()
        ]
        used = [t for t in used if t.pair.downstream()]
    patchers = [
        feature_patcher(t, sae, cfg.site, decoder=decoder)
        for t in tqdm(used, desc=f"SAE sites ({cfg.site})", disable=not progress, unit="pair")
    ]
    return _causal(patchers, top, cfg, progress) if patchers else None


def _result(
    sae,
    dec: dict,
    causal: dict | None,
    scans: dict,
    cfg: SAEConfig,
    asked: SAEConfig,
    hook: str,
    layer: int,
    excluded: list,
    clock: _Clock,
) -> SAEFeatures:
    """The parts, curves and details of `sae_analysis`, gathered into its typed result."""
    details = _details(sae, dec, causal, cfg, hook, layer, excluded)
    parts = {"best_auc": dec["best_auc"], "reconstruction": Estimate.of(dec["reconstruction"])}
    curves: dict[str, Curve] = {}
    if causal:
        parts |= causal["parts"]
        curves = causal["curves"]
        details |= causal["details"]
    else:
        parts |= {name: Estimate.of([]) for name in SAEFeatures.PARTS if name not in parts}
        details["not_applicable"] = "no usable trials"
    curves |= {f"scan_{s}": c for s, c in scans.items()}
    details["located"] = _located(cfg, asked, layer)
    details["seconds"] = clock.laps
    return SAEFeatures.of(
        name="sae",
        headline="single_feature_recovery",
        parts=parts,
        curves=curves,
        **details,
        description=(
            f"TopK SAE at {hook}, site {cfg.site}: features that decode the conclusion "
            "(AUC) against features that carry it (patched toward the new run, error kept)"
        ),
    )


def _top_features(dec: dict, causal: dict | None) -> list[dict]:
    """The top features by held-out AUC, each with its single-feature recovery where measured."""
    rows = []
    for j, f in enumerate(dec["ranked"][:TOP]):
        row = {"feature": f, "auc": float(dec["auc"][f]), "score": float(dec["score"][f])}
        row["high_for"] = dec["high_for"][f]
        if causal:
            row["recovery"] = Estimate.of(
                causal["singles"][:, j].tolist(), clusters=causal["labels"]
            ).to_dict()
        rows.append(row)
    return rows


def _details(
    sae, dec: dict, causal: dict | None, cfg: SAEConfig, hook: str, layer: int, excluded: list
) -> dict:
    """The SAE's figures, the decoding's best feature and top features, and what was excluded."""
    kv = sae.cfg.metadata.kvnotes or {}
    best = dec["ranked"][0]
    return {
        "layer": layer,
        "hook_name": hook,
        "site": cfg.site,
        "d_sae": int(sae.cfg.d_sae),
        "k": getattr(sae.cfg, "k", None),
        "L0": dec["L0"],
        "dead_features": dec["dead"],
        "mse": dec["mse"],
        "training_seconds": kv.get("train_seconds"),
        "n_train_activations": kv.get("n_train_activations"),
        "sae_model_name": sae.cfg.metadata.model_name,
        "best_feature": {
            "feature": best,
            "auc": float(dec["auc"][best]),
            "high_for": dec["high_for"][best],
            "n_auc_ge_0.95": int((dec["score"] >= 0.95).sum()),
            "n_auc_ge_0.99": int((dec["score"] >= 0.99).sum()),
        },
        "top_features": _top_features(dec, causal),
        "n_eval_prompts": len(dec["labels"]),
        "eval_seed": EVAL_SEED + cfg.seed,
        "excluded": excluded,
        "config": cfg.to_dict(),
        "note": (
            "best_auc and best_causal_feature pick their feature on the prompts they are "
            "measured on (optimistic); AUC is max(AUC, 1 - AUC)"
        ),
    }


def _located(cfg: SAEConfig, asked: SAEConfig, layer: int) -> dict:
    """Where the SAE was placed, what was asked for, and the rule that chose (`Located`)."""
    return {
        "site": cfg.site,
        "layer": layer,
        "asked": {"site": asked.site, "layer": asked.layer},
        "rule": (
            f"scan_<site>: recovery with the whole residual at the site after one layer from the new "
            f"run; 'auto' takes the notes if that reaches {LOCATE_NOTES} at some layer, else the "
            f"decision; an unset layer is the earliest reaching {LOCATE_SHARE} of the site's best"
        ),
    }


class _Clock:
    """Seconds per phase, for the results."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self.last, 2)
        self.laps["total"] = round(now - self.start, 2)
        self.last = now


def _check_seeds(trials: Sequence[Trial], cfg: SAEConfig) -> None:
    ours = {TRAIN_SEED + cfg.seed: "training", EVAL_SEED + cfg.seed: "held-out"}
    clash = sorted({t.pair.seed for t in trials} & set(ours))
    if clash:
        raise BadArgument(
            f"the trials were sampled with seed {clash[0]}, the seed of the SAE's "
            f"{ours[clash[0]]} prompts; make trials with another seed or set "
            "SAEConfig(seed=...)"
        )


@allow(torch.float32)  # an SAE is a model of its own, trained and read in float32 (sae-lens's dtype)
@torch.no_grad()
def _decoding(sae, held: Residuals, cfg: SAEConfig, answers: Sequence[str]) -> dict:
    """Per-feature AUC on the held-out prompts' site activations, and reconstruction figures."""
    at = held.at(cfg.site)
    keep = [i for i, x in enumerate(at) if len(x)]
    xs = [at[i] for i in keep]
    codes = np.stack([sae_encode(sae, x).mean(0).numpy() for x in xs])  # [prompt, d_sae]
    labels = np.array([held.labels[i] for i in keep])
    auc = feature_auc(codes, labels)
    score = np.maximum(auc, 1 - auc)
    ranked = [int(f) for f in np.argsort(-score, kind="stable")]
    mu = torch.cat(xs).mean(0)
    recon = [
        1 - float(((x - sae_decode(sae, sae_encode(sae, x))) ** 2).sum() / ((x - mu) ** 2).sum()) for x in xs
    ]
    x_all = held.all()
    a_all = sae_encode(sae, x_all)
    return {
        "auc": auc,
        "score": score,
        "ranked": ranked,
        "labels": labels,
        "high_for": [answers[int(a >= 0.5)] for a in auc],
        "best_auc": auc_estimate(codes[:, ranked[0]], labels, seed=cfg.seed),
        "reconstruction": recon,
        "L0": float((a_all != 0).sum(-1).float().mean()),
        "dead": int(((a_all != 0).sum(0) == 0).sum()),
        "mse": float(((sae_decode(sae, a_all) - x_all) ** 2).mean()),
    }


def push_ranking(patchers: Sequence[FeaturePatcher]) -> tuple[list[int], Float[Tensor, " d_sae"]]:
    """Features ordered by how hard their change pushes along the conclusion direction.

    The direction u is the mean over trials and site positions of x_new − x_old, each trial signed
    so that + favours answer 0 (pairs alternate which way they flip); a feature's push is its mean
    signed change in activation times d_f · u. Returns the order (largest push first) and the pushes.
    """
    sign = [1.0 if s.trial.pair.expected[1] == 0 else -1.0 for s in patchers]
    dx = torch.stack([g * (s.x_new - s.x_old).mean(0) for g, s in zip(sign, patchers)]).mean(0)
    u = dx / dx.norm().clamp_min(1e-12)
    da = torch.stack([g * (s.a_new - s.a_old).mean(0) for g, s in zip(sign, patchers)]).mean(0)
    push = da * (patchers[0].decoder @ u)
    return [int(f) for f in torch.argsort(-push, stable=True)], push


def _causal(patchers: Sequence[FeaturePatcher], top: Sequence[int], cfg: SAEConfig, progress: bool) -> dict:
    """Every patch of the analysis on every usable trial (see `sae_analysis`).

    The top-k order is cross-fitted: each trial's features are ranked on the other half of the
    trials (even/odd), so the curve measures a direction that generalises across prompts (with
    one trial it falls back to in-sample ranking and says so).
    """
    d_sae, n = patchers[0].decoder.shape[0], len(patchers)
    folds = [list(range(0, n, 2)), list(range(1, n, 2))]
    crossed = n >= 2
    by_fold = [push_ranking([patchers[j] for j in folds[1 - f]])[0] if crossed else None for f in (0, 1)]
    everywhere, push = push_ranking(patchers)
    ks = list(range(1, min(cfg.max_k, d_sae) + 1))
    random_ks = sorted({min(2**i, ks[-1]) for i in range(ks[-1].bit_length() + 1)})
    singles, topk, auc_topk, rnd, whole, feats_only = ([] for _ in range(6))
    recon, recon_rec, no_features, pools = ([] for _ in range(4))
    for i, s in enumerate(tqdm(patchers, desc="SAE feature patches", disable=not progress, unit="pair")):
        pool = [int(f) for f in ((s.a_new - s.a_old) != 0).any(0).nonzero().flatten()]
        ranked = by_fold[i % 2] if crossed else everywhere
        rng = random.Random(f"sae/{cfg.seed}/{i}")
        draws = [rng.sample(pool, min(k, len(pool))) for k in random_ks for _ in range(cfg.draws)]
        groups: dict[str, Sequence[Sequence[int]]] = {  # per kind, the feature sets patched
            "none": [[]],
            "features_only": [range(d_sae)],
            "singles": [[f] for f in top],
            "topk": [ranked[:k] for k in ks],
            "auc_topk": [top[:k] for k in ks],
            "random": draws,
        }
        r = s.recovery([x for g in groups.values() for x in g]).numpy()
        got = dict(zip(groups, np.split(r, np.cumsum([len(g) for g in groups.values()])[:-1])))
        no_features.append(float(got["none"][0]))
        feats_only.append(float(got["features_only"][0]))
        singles.append(got["singles"])
        topk.append(got["topk"])
        auc_topk.append(got["auc_topk"])
        rnd.append(got["random"].reshape(len(random_ks), cfg.draws).mean(1))
        whole.append(float(s.recovery([range(d_sae)], error=True)[0]))
        ld_recon = s.ld_reconstructed()
        recon.append(ld_recon / s.trial.ld_new)
        recon_rec.append(float(s.trial.recovery(ld_recon)))
        pools.append(len(pool))
    singles, topk, auc_topk, rnd = (np.array(v) for v in (singles, topk, auc_topk, rnd))
    best_causal = int(np.argmax(singles.mean(0)))
    labels = clusters_of([s.trial for s in patchers])  # every list above has one value per site
    return {
        "singles": singles,
        "labels": labels,
        "parts": {
            "single_feature_recovery": Estimate.of(singles[:, 0].tolist(), clusters=labels),
            "best_causal_feature": Estimate.of(singles[:, best_causal].tolist(), clusters=labels),
            "all_features": Estimate.of(whole, clusters=labels),
            "features_only": Estimate.of(feats_only, clusters=labels),
            "reconstruction_decision": Estimate.of(recon, clusters=labels),
            "reconstruction_recovery": Estimate.of(recon_rec, clusters=labels),
        },
        "curves": {
            "topk_curve": Curve.of("k", ks, topk.T.tolist(), clusters=labels),
            "auc_topk_curve": Curve.of("k", ks, auc_topk.T.tolist(), clusters=labels),
            "random_curve": Curve.of("k", random_ks, rnd.T.tolist(), clusters=labels),
        },
        "details": {
            "best_causal_feature": {"feature": top[best_causal], "auc_rank": best_causal},
            "topk_cross_fitted": crossed,
            "topk_features": everywhere[: ks[-1]],
            "topk_push": [float(push[f]) for f in everywhere[: ks[-1]]],
            "no_features": no_features,
            "random_pool_sizes": pools,
            "random_draws": cfg.draws,
            "n_trials": len(patchers),
        },
    }


@dataclass(frozen=True)
class SAEOptions(PairOptions):
    sae_site: str = option(
        "auto",
        "where the SAE reads and features are patched: the note slots, the decision "
        "token, or auto (the notes if their residual carries the decision, else the "
        "decision; docs/circuits.md)",
        choices=("auto", "notes", "decision"),
        arg="site",
    )
    sae_layer: int | None = option(
        None,
        "residual layer of a trained SAE (default: located by a whole-residual scan)",
        least=0,
        layer=True,
        arg="layer",
    )
    sae: str | None = option(
        None,
        "use this sae-lens SAE (a local directory, or a pretrained release with "
        "--sae-id) instead of training one",
        metavar="DIR_OR_RELEASE",
    )
    sae_id: str | None = option(None, "with a pretrained release: the SAE's id in it")
    sae_train_pairs: int = option(96, "fresh pairs the SAE is trained on", least=1, arg="n_train_pairs")
    sae_eval_pairs: int = option(32, "fresh pairs features are decoded on", least=1, arg="n_eval_pairs")
    sae_samples: int = option(
        60_000, "activations the SAE's trainer sees in all", least=1, arg="training_samples"
    )


@analysis(
    "sae",
    "circuits",
    SAEOptions,
    SAEFeatures,
    quick={"n": 6, "sae_train_pairs": 48, "sae_eval_pairs": 16, "sae_samples": 24_000},
    order=5,
    requires=(Need.TEMPLATE,),
)
def _run_sae(ctx: Context, cfg: SAEOptions) -> SAEFeatures:
    """SAE features: which decode the conclusion, which carry it."""
    sae_cfg = ctx.memo.get("sae_config") or cfg.call(SAEConfig, seed=ctx.seed)
    sae = ctx.memo.get("sae")
    if sae is None and cfg.sae:
        sae = load_sae(cfg.sae, cfg.sae_id, model=ctx.model)
    return sae_analysis(
        cfg.call(shared_trials, ctx),
        ctx.task,
        cfg=sae_cfg,
        sae=sae,
        min_effect=ctx.min_effect,
        progress=ctx.progress,
    )
