"""Sparse autoencoders (sae-lens) on the residual stream of task prompts: train one on this
machine in about a minute, or load a pretrained one from a local directory or a release name.

An SAE here reads `blocks.{L}.hook_resid_post` (the hook name sae-lens uses) and is trained on
every position but the first of fresh prompt pairs of a task (the first token's residual is an
outlier in most models). `circuits.features` asks what its features decode and what they cause.

    from kvnotes import load_model
    from circuits.sae import SAEConfig, load_sae, train_sae
    model = load_model("gemma-3-270m")
    sae = train_sae(model, "order-cancel", SAEConfig(layer=10))
    sae.save_model("saes/gemma-L10")                       # cfg.json + safetensors
    sae = load_sae("saes/gemma-L10", model=model)          # the local-path route
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlparse

import torch
from tqdm.auto import tqdm

from kvnotes.engine import run, stop_for
from kvnotes.engine.guard import allow
from kvnotes.errors import (
    BadArgument,
    MissingDependency,
    OutOfRange,
    SAEMismatch,
    UnknownSAEError,
)
from kvnotes.hooks import hook_name
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.tasks import GATE, Pair, TaskSource, load_task, sample
from kvnotes.types import Float, Tensor

REGIONS = ("notes", "decision")  # where SAE features are read: the note slots or the decision token
_HOOK_RE = re.compile(r"^blocks\.(\d+)\.hook_resid_post$")
TRAIN_SEED, EVAL_SEED = 1000, 2000  # + cfg.seed: prompts other than the trials' (sampled with seed 0, ...)


@dataclass(frozen=True, kw_only=True)
class SAEConfig:
    """What to train and where to look. JSON-safe (`to_dict`), validated on construction.

    layer: the residual stream after this block (None: `sae_analysis` locates it with a residual
    scan; `train_sae` alone takes the middle one, n_layers // 2).
    site: "notes" (the pair's note slots), "decision" (the last query token), or "auto" (the
    notes if patching their whole residual carries the decision, else the decision).
    expansion: d_sae = expansion * d_model; k: active features per token (TopK).
    n_train_pairs / n_eval_pairs: fresh pairs (both prompts each) to train on / to decode on.
    training_samples: activations the trainer sees in all (several passes over the collected ones).
    max_k: the top-k curves run k = 1..max_k; the random control at k = 1, 2, 4, ... and max_k,
    with `draws` random sets at each.
    """

    layer: int | None = None
    site: str = "auto"
    expansion: int = 4
    k: int = 16
    n_train_pairs: int = 96
    n_eval_pairs: int = 32
    training_samples: int = 60_000
    batch_size: int = 256
    lr: float = 1e-3
    max_k: int = 32
    draws: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.site not in (*REGIONS, "auto"):
            raise BadArgument(f"site must be one of {REGIONS} or 'auto', got {self.site!r}")
        if self.layer is not None and (not _is_int(self.layer) or self.layer < 0):
            raise BadArgument(
                f"layer must be None (the middle layer) or a block index >= 0, got {self.layer!r}"
            )
        for name in (
            "expansion",
            "k",
            "n_train_pairs",
            "n_eval_pairs",
            "training_samples",
            "batch_size",
            "max_k",
            "draws",
        ):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise BadArgument(f"{name} must be a positive integer, got {v!r}")
        if self.training_samples < self.batch_size:
            raise BadArgument(
                f"training_samples ({self.training_samples}) is less than one batch "
                f"({self.batch_size}); raise it or lower batch_size"
            )
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise BadArgument(f"lr must be a positive finite number, got {self.lr!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise BadArgument(f"seed must be an integer >= 0, got {self.seed!r}")

    def layer_for(self, model: KVModel) -> int:
        """The block whose output the SAE reads on `model`."""
        layer = model.n_layers // 2 if self.layer is None else self.layer
        if not layer < model.n_layers:
            raise OutOfRange(
                f"layer {layer} is out of range: {model.name} has {model.n_layers} "
                f"layers (0..{model.n_layers - 1})"
            )
        return layer

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _training_bar(progress: bool) -> contextlib.AbstractContextManager:
    """sae-lens's training progress bar, silenced when `progress` is False (`fit` has no switch)."""
    from sae_lens.training import sae_trainer

    if progress or not hasattr(sae_trainer, "tqdm"):
        return contextlib.nullcontext()
    return mock.patch.object(sae_trainer, "tqdm", functools.partial(sae_trainer.tqdm, disable=True))


def _sae_lens():
    try:
        import sae_lens
    except ImportError as e:
        raise MissingDependency("circuits.sae needs sae-lens: pip install 'sae-lens>=6'") from e
    return sae_lens


# --- activations -----------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Residuals:
    """Residual vectors at `hook_name` for each prompt, from the changed field through the last
    token; `notes[i]` are the rows of prompt i's note slots (its decision is the last row) and
    `labels[i]` the answer index prompt i should get (its conclusion). `context` holds each
    pair's shared positions before the field (the first token left out)."""

    hook_name: str
    vectors: tuple[Float[Tensor, "_pos d_model"], ...]
    notes: tuple[tuple[int, ...], ...]
    labels: tuple[int, ...]
    context: tuple[Float[Tensor, "_pos d_model"], ...] = ()

    def all(self) -> Float[Tensor, "n d_model"]:
        """Every vector of every prompt, each shared context once, stacked (what the SAE trains on)."""
        return torch.cat([*self.context, *self.vectors])

    def at(self, site: str) -> list[Float[Tensor, "pos d_model"]]:
        """Each prompt's vectors at `site` (its note slots, or its last token)."""
        if site not in REGIONS:
            raise BadArgument(f"site must be one of {REGIONS}, got {site!r}")
        if site == "notes":
            return [v[list(n)] for v, n in zip(self.vectors, self.notes)]
        return [v[-1:] for v in self.vectors]


@allow(torch.float32)  # an SAE is a model of its own, trained and read in float32 (sae-lens's dtype)
def collect_residuals(
    model: KVModel, pairs: Sequence[Pair], hook_name: str, *, stop_early: bool = True, progress: bool = True
) -> Residuals:
    """Run both prompts of each pair to their last token and keep the residual at `hook_name`
    at every position but the first.

    The two prompts share every token before the field, so that prefix is computed once and both
    continuations run as one batch of two against it: the numbers of two full runs, at half the cost.
    Both runs stop after the block `hook_name` reads (`kvnotes.engine.stop_for`): the blocks after it
    cannot change it, so reading block L costs L + 1 blocks, not all of them (`stop_early=False` runs
    every block: the same numbers, bit for bit; `scripts/residual_stop.py` times the two).
    """
    vectors, notes, labels, context = [], [], [], []
    stop = stop_for(model, [hook_name]) if stop_early else None
    for pair in tqdm(pairs, desc=f"residuals at {hook_name}", disable=not progress, unit="pair"):
        start = pair.field_span.start
        prefix = pair.old.ids[:start]
        nb, pre = run(model, Notebook.empty(model), prefix, capture=[hook_name], logits_at=(), stop=stop)
        context.append(pre.activations[hook_name][0, 1:].float().cpu())
        ids = torch.tensor([pair.old.ids[start:], pair.new.ids[start:]])
        _, out = run(model, nb, ids, capture=[hook_name], logits_at=(), stop=stop)
        rows = tuple(p - start for p in pair.downstream())
        for x, label in zip(out.activations[hook_name].float().cpu(), pair.expected):
            vectors.append(x)
            notes.append(rows)
            labels.append(int(label))
    return Residuals(
        hook_name=hook_name,
        vectors=tuple(vectors),
        notes=tuple(notes),
        labels=tuple(labels),
        context=tuple(context),
    )


# --- training --------------------------------------------------------------------------------
def train_sae(
    model: KVModel,
    task: TaskSource | str,
    cfg: SAEConfig = SAEConfig(),
    *,
    kind: str = GATE,
    progress: bool = True,
):
    """Collect residuals on `cfg.n_train_pairs` fresh pairs of `task` and train a TopK SAE on them.

    Returns an inference `sae_lens.SAE` whose metadata names the model and hook (and, under
    `kvnotes`, the task, seed, sample count and training time); `sae.save_model(path)` keeps it
    and `load_sae(path, model=model)` reads it back.

    >>> from kvnotes import load_model
    >>> model = load_model("tiny-llama")
    >>> sae = train_sae(model, "order-cancel", SAEConfig(n_train_pairs=4, training_samples=512),
    ...                 progress=False)
    >>> sae.cfg.metadata.hook_name, sae.cfg.d_sae == 4 * model.facts.d_model
    ('blocks.1.hook_resid_post', True)
    """
    task = load_task(task)
    hook = hook_name(cfg.layer_for(model), "hook_resid_post")
    pairs = sample(task, model, cfg.n_train_pairs, seed=TRAIN_SEED + cfg.seed, kind=kind)
    residuals = collect_residuals(model, pairs, hook, progress=progress)
    return fit_sae(residuals, cfg, model=model, task=task.name, progress=progress)


@allow(torch.float32)  # an SAE is a model of its own, trained and read in float32 (sae-lens's dtype)
def fit_sae(
    residuals: Residuals,
    cfg: SAEConfig = SAEConfig(),
    *,
    model: KVModel | None = None,
    task: str = "",
    progress: bool = True,
):
    """Train a TopK SAE with sae-lens's `SAETrainer` on `residuals` (seeded, wandb off); return
    it as an inference `sae_lens.SAE`.

    Inputs are scaled to mean norm sqrt(d_in) during training (folded back into the weights
    afterwards, as sae-lens does), and the decoder bias starts at the data's mean.
    progress: show sae-lens's training bar.
    """
    sl = _sae_lens()
    from sae_lens.config import LoggingConfig, SAETrainerConfig
    from sae_lens.saes.sae import SAEMetadata

    x = residuals.all().float().cpu()
    n, d_in = x.shape
    d_sae = cfg.expansion * d_in
    if cfg.k > d_sae:
        raise BadArgument(f"k={cfg.k} exceeds the SAE's {d_sae} features; lower k or raise expansion")
    device = str(model.device) if model is not None else "cpu"
    scale = math.sqrt(d_in) / float(x.norm(dim=-1).mean())
    steps = math.ceil(cfg.training_samples / cfg.batch_size)
    per_pass = math.ceil(n / cfg.batch_size)
    meta = SAEMetadata(
        model_name=model.name if model is not None else None,
        hook_name=residuals.hook_name,
        hook_head_index=None,
        prepend_bos=True,
        dataset=f"kvnotes task {task!r}: every position but the first of fresh prompt pairs",
    )
    trainer_cfg = SAETrainerConfig(
        total_training_samples=cfg.training_samples,
        train_batch_size_samples=cfg.batch_size,
        lr=cfg.lr,
        lr_end=cfg.lr,
        lr_warm_up_steps=steps // 20,
        lr_decay_steps=steps // 5,
        device=device,
        dead_feature_window=2 * per_pass,  # silent for two passes over the data
        feature_sampling_window=steps + 1,
        logger=LoggingConfig(log_to_wandb=False),
    )
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # seeded, and the caller's RNG state is left alone
        torch.manual_seed(cfg.seed)
        sae = sl.TopKTrainingSAE(sl.TopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=cfg.k, metadata=meta))
        with torch.no_grad():
            sae.b_dec.copy_(x.mean(0) * scale)
        trainer = sl.SAETrainer(trainer_cfg, sae, data_provider=_batches(x, cfg.batch_size, cfg.seed))
        trainer.activation_scaler.scaling_factor = scale  # preset: fit() folds it in at the end
        with _training_bar(progress):
            trainer.fit()
    seconds = time.perf_counter() - t0
    sae.cfg.metadata.kvnotes = {
        "task": task,
        "train_seed": TRAIN_SEED + cfg.seed,
        "n_train_prompts": len(residuals.vectors),
        "n_train_activations": n,
        "train_seconds": round(seconds, 2),
        "training_samples": cfg.training_samples,
        "model_fingerprint": model.fingerprint if model is not None else None,
    }
    with tempfile.TemporaryDirectory() as tmp:  # sae-lens's documented path to an inference SAE
        sae.save_inference_model(tmp)
        return sl.SAE.load_from_disk(tmp, device=device)


def _batches(x: Tensor, size: int, seed: int) -> Iterator[Tensor]:
    """Endless shuffled batches of rows of `x`: one permutation per pass, passes chained."""
    g = torch.Generator().manual_seed(seed)
    queue = torch.empty(0, dtype=torch.long)
    while True:
        while queue.numel() < size:
            queue = torch.cat([queue, torch.randperm(len(x), generator=g)])
        idx, queue = queue[:size], queue[size:]
        yield x[idx]


# --- loading and checking ----------------------------------------------------------------------
def load_sae(
    source: str | Path, sae_id: str | None = None, *, model: KVModel | None = None, layer: int | None = None
):
    """An inference SAE from a local directory that `sae.save_model` wrote (cfg.json and weights),
    or from the hub as a sae-lens pretrained release and `sae_id`.

    It must read a residual stream (`blocks.{L}.hook_resid_post`); with `model`, of that model's
    width at one of its layers; with `layer`, at that layer. Without a network a release fails at
    once with UnknownSAEError (no retries): pass the directory a downloaded SAE was saved to.

    >>> load_sae("no-such-release", "layer_0")
    Traceback (most recent call last):
    ...
    kvnotes.errors.UnknownSAEError: 'no-such-release' is neither a local directory nor a sae-lens ...
    """
    sl = _sae_lens()
    device = str(model.device) if model is not None else "cpu"
    path = Path(source)
    if path.is_dir():
        if not (path / "cfg.json").is_file():
            raise UnknownSAEError(
                f"{path} is a directory but has no cfg.json, so sae-lens did not "
                "save an SAE there; save one with sae.save_model(path)"
            )
        try:
            sae = sl.SAE.load_from_disk(path, device=device)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise UnknownSAEError(
                f"{path} holds no loadable sae-lens SAE ({type(e).__name__}: {e}); "
                "save one with sae.save_model(path)"
            ) from e
    else:
        sae = _from_release(str(source), sae_id, device)
    check_sae(sae, model, layer=layer)
    return sae


def _from_release(release: str, sae_id: str | None, device: str):
    sl = _sae_lens()
    from sae_lens.loading.pretrained_saes_directory import get_pretrained_saes_directory

    releases = get_pretrained_saes_directory()
    if release not in releases and "/" not in release:
        raise UnknownSAEError(
            f"{release!r} is neither a local directory nor a sae-lens pretrained release; pass the "
            "directory an SAE was saved to (sae.save_model(path)), or a release name from sae-lens's "
            "pretrained_saes.yaml with its sae_id"
        )
    ids = list(releases[release].saes_map) if release in releases else []
    if sae_id is None or (ids and sae_id not in ids):
        which = f"one of its sae_ids (e.g. {ids[:3]})" if ids else "an sae_id (the SAE's folder in the repo)"
        raise UnknownSAEError(
            f"release {release!r} needs {which}, got {sae_id!r}; or pass a local directory instead"
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if not offline and not _hub_reachable():
        raise UnknownSAEError(
            f"cannot fetch release {release!r} ({sae_id}): the Hugging Face hub is not reachable from "
            "here. Download it where the hub is reachable, save it with sae.save_model(DIR), copy DIR "
            "here and pass that local directory (or set HF_HUB_OFFLINE=1 to use a cached copy)"
        )
    try:
        return sl.SAE.from_pretrained(release, sae_id, device=device)
    except (OSError, ValueError) as e:
        raise UnknownSAEError(
            f"cannot load release {release!r} ({sae_id}): {str(e).splitlines()[0]}; "
            "pass a local directory instead"
        ) from e


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host answers at all (sae-lens would otherwise retry for ~25 s)."""
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def check_sae(sae, model: KVModel | None = None, *, layer: int | None = None) -> tuple[str, int]:
    """The SAE's hook name and layer, checked: a residual stream (`blocks.{L}.hook_resid_post`)
    with a linear decoder, at `layer` if given, of `model`'s width at one of its layers if given."""
    hook = sae.cfg.metadata.hook_name
    m = _HOOK_RE.match(hook or "")
    if m is None:
        raise SAEMismatch(
            f"this SAE reads {hook!r}, not a residual stream 'blocks.{{L}}.hook_resid_post'; "
            "feature patching here needs a resid_post SAE"
        )
    at = int(m.group(1))
    if layer is not None and at != layer:
        raise SAEMismatch(
            f"this SAE reads layer {at} ({hook}) but layer {layer} was asked for; load "
            "an SAE of that layer, or drop `layer`"
        )
    if model is not None:
        trained_on = sae.cfg.metadata.model_name or "an unnamed model"
        if sae.cfg.d_in != model.facts.d_model:
            raise SAEMismatch(
                f"the SAE's d_in is {sae.cfg.d_in} (trained on {trained_on}) but "
                f"{model.name}'s d_model is {model.facts.d_model}; train one for this "
                "model with train_sae(model, task)"
            )
        if at >= model.n_layers:
            raise SAEMismatch(
                f"the SAE reads {hook} (trained on {trained_on}) but {model.name} has "
                f"{model.n_layers} layers (0..{model.n_layers - 1})"
            )
    if sae.cfg.normalize_activations != "none" or sae.cfg.reshape_activations != "none":
        raise SAEMismatch(
            f"this SAE normalises or reshapes its input at run time (normalize_activations="
            f"{sae.cfg.normalize_activations!r}, reshape_activations={sae.cfg.reshape_activations!r}), so "
            "a feature's contribution to the residual depends on the input; use one with 'none'"
        )
    return hook, at


@allow(torch.float32)  # an SAE is a model of its own, trained and read in float32 (sae-lens's dtype)
@torch.no_grad()
def decoder_rows(sae) -> Float[Tensor, "d_sae d_model"]:
    """The direction each feature adds to the residual: decode(a) = a @ rows + decode(0).

    Read off the SAE's own `decode` (sae-lens's decoders are affine in the activations), so any
    decoder-norm rescaling it applies is included.
    """
    n = sae.cfg.d_sae
    zero = sae.decode(torch.zeros(1, n, device=sae.device, dtype=sae.dtype))
    rows = []
    for start in range(0, n, 1024):  # one-hot codes, a chunk at a time (d_sae may be 65k)
        idx = torch.arange(start, min(start + 1024, n), device=sae.device)
        onehot = torch.zeros(len(idx), n, device=sae.device, dtype=sae.dtype)
        onehot[torch.arange(len(idx)), idx] = 1
        rows.append(sae.decode(onehot) - zero)
    return torch.cat(rows).float()
