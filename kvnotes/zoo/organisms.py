"""Two tiny "model organisms" trained in-repo, whose mechanism is known by construction.

Each is trained on its own built-in task (`kvnotes/tasks/builtin/<name>.toml`): a gated decision
whose answer is `task.outcome(field, rule)` — an XOR-like function of the gating field and a
one-token rule — and whose architecture leaves one route from the field to the decision.

| name            | architecture                                  | the decision reads           |
|-----------------|-----------------------------------------------|------------------------------|
| notes-organism  | 3 layers, all sliding-window (window 8)       | notes: the slots in between  |
| lookup-organism | 1 layer, global attention                     | the field's own slot         |

notes-organism: in every layer a token attends only to the last 8 positions (itself included),
and in its task the decision span starts 10-11 tokens after the gating field, so no decision token
sees the field's slot in any layer. Whatever the decision knows about the field must have been
written at prefill onto the slots in between and read from there. So a field-only refresh (new
field K/V, stale downstream slots) leaves the decision exactly as it was (recovery 0), and a
transplant of every downstream slot gives exactly the new decision (recovery 1). The route still
fits: the rule sits 5 tokens before the field, so both are in view of the slots just after the
field, and 3 layers x 7 positions reach the decision's last token (16-17 tokens after the rule).

lookup-organism: with one attention layer, every slot's K/V is a function of that slot's own
token and position — a downstream slot cannot carry anything about the field. The decision must
read the field's slot (and the rule's) directly: a field-only refresh gives the new decision
(recovery 1, up to rounding) and a downstream transplant changes nothing (recovery 0).

Both are trained from a seed, deterministically (one CPU thread), until their held-out accuracy
has been 100% with a clear margin for a while. A run that does not get there is never cached:
training starts again from the next seed, up to `SEED_TRIES` seeds, and fails with a clear error
if none converges. The organism is then cached (safetensors weights + JSON metadata)
under `$KVNOTES_CACHE` or `~/.cache/kvnotes`, in a directory keyed by a hash of the config, the
task and the tokenizer, so changing any of them retrains. Retrain and print the metrics:

    python -m kvnotes.zoo.organisms notes-organism
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvnotes.engine.transformer_lens.model import from_hooked
from kvnotes.errors import BadArgument, TaskError
from kvnotes.models.model import KVModel
from kvnotes.prompt import Prompt
from kvnotes.tasks import Task, load_task, render
from kvnotes.tasks.sampler import values_for
from kvnotes.zoo.cache import building, publish
from kvnotes.zoo.tiny import tiny_tokenizer

CACHE_VERSION = 1  # bump when training or the cache format changes, so old caches are retrained
SEED_TRIES = 3  # seeds tried (config.seed, +1, +2) before an organism that will not converge is an error
NOTES, LOOKUP = "notes", "lookup"


@dataclass(frozen=True, kw_only=True)
class OrganismConfig:
    """Architecture and training recipe of one organism; trains on the built-in task `name`.

    `mechanism` is what the architecture forces ("notes" or "lookup"); it is checked against the
    attention layout here and against every training prompt (see `check_prompt`).
    `attn_types` has one entry per layer, "local" (sliding `window`) or "global".

    >>> ORGANISMS["notes-organism"].window
    8
    """

    name: str
    mechanism: str
    attn_types: tuple[str, ...]
    window: int | None = None
    d_model: int = 64
    n_heads: int = 4
    d_mlp: int = 256
    n_ctx: int = 512
    # training
    seed: int = 0
    max_steps: int = 3000
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    train_size: int = 8192  # prompts drawn once from the task; batches are drawn from them
    heldout_size: int = 512  # fresh prompts (none equal to a training prompt) for early stopping
    eval_every: int = 50
    patience: int = 3  # stop after this many evaluations in a row at 100% with min_margin
    min_margin: float = 2.0  # logits: the right answer ahead of the other one on every held-out prompt

    def __post_init__(self):
        def bad(what: str, fix: str) -> BadArgument:
            return BadArgument(f"organism config {self.name!r}: {what}; {fix}")

        if self.mechanism not in (NOTES, LOOKUP):
            raise bad(
                f"mechanism must be {NOTES!r} or {LOOKUP!r}, got {self.mechanism!r}",
                "say which route the architecture forces",
            )
        if not self.attn_types or any(a not in ("local", "global") for a in self.attn_types):
            raise bad(
                f"attn_types must be a non-empty tuple of 'local'/'global', got {self.attn_types!r}",
                "give one entry per layer",
            )
        if "local" in self.attn_types and (not isinstance(self.window, int) or self.window < 1):
            raise bad(f"local layers need a window of at least 1, got {self.window!r}", "set window=")
        if self.mechanism == NOTES and "global" in self.attn_types:
            raise bad(
                "a notes organism with a global layer lets the decision read the field directly",
                "make every layer local",
            )
        if self.mechanism == LOOKUP and (
            self.attn_types[-1] != "global"
            or any(a != "local" or self.window != 1 for a in self.attn_types[:-1])
        ):
            raise bad(
                "a lookup organism needs one global layer last and, before it, only local layers "
                "of window 1 (else downstream slots could carry the field)",
                "use attn_types=('global',), or window=1 for the earlier layers",
            )
        if self.d_model % self.n_heads:
            raise bad(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}",
                "pick n_heads dividing d_model",
            )
        for k in (
            "d_model",
            "n_heads",
            "d_mlp",
            "n_ctx",
            "max_steps",
            "batch_size",
            "warmup_steps",
            "train_size",
            "heldout_size",
            "eval_every",
            "patience",
        ):
            if getattr(self, k) < 1:
                raise bad(f"{k} must be at least 1, got {getattr(self, k)}", f"set {k}= to a positive value")
        if self.lr <= 0 or self.weight_decay < 0 or self.min_margin < 0:
            raise bad("lr must be > 0, weight_decay and min_margin >= 0", "fix the training recipe")

    @property
    def n_layers(self) -> int:
        return len(self.attn_types)

    def to_dict(self) -> dict:
        return {**asdict(self), "attn_types": list(self.attn_types)}


ORGANISMS: dict[str, OrganismConfig] = {
    "notes-organism": OrganismConfig(
        name="notes-organism",
        mechanism=NOTES,
        attn_types=("local",) * 3,
        window=8,
    ),
    "lookup-organism": OrganismConfig(
        name="lookup-organism",
        mechanism=LOOKUP,
        attn_types=("global",),
    ),
}


# --- architecture and the mechanism checks ---------------------------------------------------
def hooked_config(cfg: OrganismConfig, d_vocab: int):
    """The TransformerLens config: tiny Llama-style blocks (RMSNorm, RoPE, gated SiLU MLP)."""
    from transformer_lens import HookedTransformerConfig

    local = "local" in cfg.attn_types
    return HookedTransformerConfig(
        d_model=cfg.d_model,
        d_head=cfg.d_model // cfg.n_heads,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        d_mlp=cfg.d_mlp,
        n_ctx=cfg.n_ctx,
        d_vocab=d_vocab,
        positional_embedding_type="rotary",
        rotary_dim=cfg.d_model // cfg.n_heads,
        rotary_base=10000,
        rotary_adjacent_pairs=False,
        normalization_type="RMS",
        final_rms=True,
        act_fn="silu",
        gated_mlp=True,
        eps=1e-6,
        default_prepend_bos=True,
        tokenizer_prepends_bos=True,
        use_local_attn=local,
        window_size=cfg.window if local else None,
        attn_types=list(cfg.attn_types) if local else None,
        model_name=cfg.name,
        original_architecture="kvnotes-organism",
        seed=None,
    )


def _new_model(cfg: OrganismConfig):
    """A freshly initialised HookedTransformer (from the caller's torch RNG state)."""
    from transformer_lens import HookedTransformer

    with warnings.catch_warnings():  # TL 3.x points at 4.x's bridge; kvnotes pins <4 on purpose
        warnings.filterwarnings("ignore", "HookedTransformer is deprecated", DeprecationWarning)
        return HookedTransformer(hooked_config(cfg, len(tiny_tokenizer())), move_to_device=False)


def check_prompt(cfg: OrganismConfig, task: Task, prompt: Prompt) -> None:
    """Refuse a prompt on which the organism's mechanism would not be forced (or cannot work).

    notes: the decision's first token must not see the gating field in any layer, and the rule must
    still be within the layers x window reach of the decision's last token.

    >>> from kvnotes.tasks import load_task, sample
    >>> from kvnotes.zoo import load_model
    >>> pair = sample(load_task("notes-organism"), load_model("tiny-llama"), 1)[0]
    >>> check_prompt(ORGANISMS["notes-organism"], load_task("notes-organism"), pair.old)
    """
    decision = prompt.span("decision")
    if decision.stop != len(prompt):
        raise TaskError(
            f"task {task.name!r}: the decision span must end the prompt (it is read at the "
            "last token); move [[decision: ...]] to the end of the template"
        )
    if cfg.mechanism != NOTES:
        return
    field = prompt.span(task.gate.field)
    gap = decision.start - (field.stop - 1)
    if gap < cfg.window:
        raise TaskError(
            f"task {task.name!r}: the decision starts {gap} tokens after the end of {task.gate.field!r}, "
            f"within the window of {cfg.window}, so {cfg.name} could read the field directly; put at "
            f"least {cfg.window} tokens between them or shrink the window"
        )
    first = min(prompt.span(f).start for f in (task.gate.field, task.rule.field))
    reach = cfg.n_layers * (cfg.window - 1)
    if decision.stop - 1 - first > reach:
        raise TaskError(
            f"task {task.name!r}: the decision's last token is {decision.stop - 1 - first} tokens after "
            f"the first input field, beyond the {cfg.n_layers} layers x {cfg.window - 1} positions that "
            f"{cfg.name} can relay; move the fields closer to the decision or add layers"
        )


# --- data ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Vocab:
    """What `render` needs of a model before the organism exists: a name and the tokenizer."""

    name: str
    tokenizer: object


@dataclass(frozen=True)
class _Data:
    """Prompts grouped by token count: per length, token ids `[n, length]` and answer index `[n]`."""

    groups: dict[int, tuple[torch.Tensor, torch.Tensor]]

    @property
    def size(self) -> int:
        return sum(len(y) for _, y in self.groups.values())


def _draw(
    cfg: OrganismConfig, task: Task, vocab: _Vocab, n: int, seed: str, exclude: frozenset = frozenset()
) -> tuple[_Data, frozenset]:
    """`n` prompts: random [vary] values, rule as written or flipped 50/50, gate value at random."""
    rng = random.Random(seed)
    rows: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    seen: set[tuple[int, ...]] = set()
    for attempt in range(50 * n + 1):
        if len(seen) == n:
            break
        if attempt == 50 * n:
            raise TaskError(
                f"task {task.name!r} yields fewer than {n} distinct prompts (got {len(seen)} "
                f"in {attempt} draws); lower train_size/heldout_size of {cfg.name} or add "
                "[vary] values to the task"
            )
        values = values_for(task, rng)
        rule, value = rng.choice(task.rule.values), rng.choice(task.gate.values)
        prompt = render(task, vocab, {**values, task.rule.field: rule, task.gate.field: value})
        if prompt.ids in exclude or prompt.ids in seen:
            continue
        check_prompt(cfg, task, prompt)
        seen.add(prompt.ids)
        rows.setdefault(len(prompt), []).append((prompt.ids, task.outcome(value, rule)))
    groups = {k: (torch.tensor([r[0] for r in v]), torch.tensor([r[1] for r in v])) for k, v in rows.items()}
    return _Data(groups=dict(sorted(groups.items()))), frozenset(seen)


def _answer_ids(task: Task, tokenizer) -> torch.Tensor:
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in task.answers]
    if any(len(i) != 1 for i in ids):
        raise TaskError(
            f"task {task.name!r}: answers {task.answers} must be single tokens under the "
            f"tiny tokenizer, got {ids}; pick one-token answer words"
        )
    return torch.tensor([i[0] for i in ids])


def _organism_task(cfg: OrganismConfig) -> Task:
    task = load_task(cfg.name)
    if task.rule is None:
        raise TaskError(
            f"task {task.name!r} has no [rule]; an organism must learn the rule flip "
            "(answer = outcome(field, rule)), so add a [rule] table"
        )
    return task


# --- training --------------------------------------------------------------------------------
def train_organism(name: str, *, config: OrganismConfig | None = None, progress: bool = True):
    """Train organism `name` (or `config`) from its seed; returns `(HookedTransformer, metrics)`.

    Loss: cross-entropy over the full vocabulary at the decision's last token, so the organism's
    top-1 token is the answer (top-1 readouts mean something) and the answer logit difference
    grows with it. Deterministic: one CPU thread and local RNGs (the caller's state is restored).

    >>> from dataclasses import replace
    >>> small = replace(ORGANISMS["lookup-organism"], max_steps=3, train_size=64, heldout_size=16)
    >>> tl, metrics = train_organism("lookup-organism", config=small, progress=False)
    >>> metrics["steps"], tl.cfg.n_layers
    (3, 1)
    """
    cfg = _resolve(name, config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            return _train(cfg, progress)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: OrganismConfig, progress: bool):
    start = time.perf_counter()
    tokenizer = tiny_tokenizer()
    task = _organism_task(cfg)
    vocab = _Vocab(cfg.name, tokenizer)
    answers = _answer_ids(task, tokenizer)
    train, seen = _draw(cfg, task, vocab, cfg.train_size, f"{cfg.name}/{cfg.seed}/train")
    heldout, _ = _draw(cfg, task, vocab, cfg.heldout_size, f"{cfg.name}/{cfg.seed}/heldout", exclude=seen)

    tl = _new_model(cfg)
    tl.train()
    opt = torch.optim.AdamW(tl.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    gen = torch.Generator().manual_seed(cfg.seed)
    lengths = list(train.groups)
    weights = torch.tensor([len(train.groups[k][1]) for k in lengths], dtype=torch.float)

    streak, step, loss, ev = 0, 0, float("nan"), {}
    bar = tqdm(total=cfg.max_steps, desc=f"training {cfg.name}", unit="step", disable=not progress)
    while step < cfg.max_steps:
        tokens, labels = train.groups[lengths[int(torch.multinomial(weights, 1, generator=gen))]]
        idx = torch.randperm(len(labels), generator=gen)[: cfg.batch_size]
        logits = _last_logits(tl, tokens[idx])
        loss_t = F.cross_entropy(logits, answers[labels[idx]])
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(tl.parameters(), 1.0)
        opt.step()
        sched.step()
        step, loss = step + 1, loss_t.item()
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            ev = _evaluate(tl, heldout, answers)
            tl.train()
            bar.set_postfix(loss=f"{loss:.3g}", acc=f"{ev['accuracy']:.3f}", margin=f"{ev['min_margin']:.2f}")
            good = ev["accuracy"] == 1.0 and ev["min_margin"] >= cfg.min_margin
            streak = streak + 1 if good else 0
            if streak >= cfg.patience:
                break
    bar.close()
    tl.eval()
    converged = streak >= cfg.patience
    metrics = {
        "name": cfg.name,
        "config_hash": config_hash(cfg),
        "seed": cfg.seed,
        "steps": step,
        "converged": converged,
        "final_loss": loss,
        "heldout_accuracy": ev["accuracy"],
        "heldout_min_margin": ev["min_margin"],
        "heldout_mean_margin": ev["mean_margin"],
        "heldout_prompts": heldout.size,
        "train_prompts": train.size,
        "train_seconds": round(time.perf_counter() - start, 2),
        "torch": torch.__version__,
        "threads": 1,
    }
    return tl, metrics


def train_converged(
    name: str, *, config: OrganismConfig | None = None, progress: bool = True, tries: int = SEED_TRIES
):
    """`train_organism` from `config.seed`, then from the next seeds until a run converges.

    Returns `(HookedTransformer, metrics)` of the first run that converged; `metrics["seed"]` is
    the seed it trained from and `metrics["seeds_tried"]` the runs it took. Raises
    `OrganismNotConverged` when none of `tries` seeds does.
    """
    from kvnotes.errors import OrganismNotConverged

    cfg = _resolve(name, config)
    failed = []
    for seed in range(cfg.seed, cfg.seed + tries):
        tl, metrics = train_organism(name, config=replace(cfg, seed=seed), progress=progress)
        if metrics["converged"]:
            return tl, {**metrics, "config_hash": config_hash(cfg), "seeds_tried": len(failed) + 1}
        failed.append(
            f"seed {seed}: accuracy {metrics['heldout_accuracy']:.3f}, "
            f"margin {metrics['heldout_min_margin']:.2f}"
        )
        _say(
            progress,
            f"kvnotes: {cfg.name} did not converge from seed {seed}; "
            + ("trying the next seed" if len(failed) < tries else "giving up"),
        )
    raise OrganismNotConverged(
        f"{cfg.name} did not reach 100% held-out accuracy with margin {cfg.min_margin} within "
        f"{cfg.max_steps} steps from any of {tries} seeds ({'; '.join(failed)}); nothing was cached. "
        "Raise max_steps, or change the recipe in kvnotes/zoo/organisms.py"
    )


def _last_logits(tl, tokens: torch.Tensor) -> torch.Tensor:
    """`tl(tokens)[:, -1]`, unembedding only the last position (the decision's last token)."""
    resid = tl(tokens, stop_at_layer=tl.cfg.n_layers)
    return tl.unembed(tl.ln_final(resid[:, -1:]))[:, 0]


@torch.no_grad()
def _evaluate(tl, data: _Data, answers: torch.Tensor) -> dict[str, float]:
    """Accuracy (argmax over the two answers) and the margin toward the right answer, in logits."""
    tl.eval()
    margins = []
    for tokens, labels in data.groups.values():
        for i in range(0, len(labels), 256):
            logits = _last_logits(tl, tokens[i : i + 256])[:, answers]
            ld = logits[:, 0] - logits[:, 1]
            margins.append(torch.where(labels[i : i + 256] == 0, ld, -ld))
    m = torch.cat(margins)
    return {
        "accuracy": float((m > 0).float().mean()),
        "min_margin": float(m.min()),
        "mean_margin": float(m.mean()),
    }


# --- the cache -------------------------------------------------------------------------------
@lru_cache(maxsize=16)
def config_hash(cfg: OrganismConfig) -> str:
    """12 hex digits over everything the trained weights depend on: the recipe, the task, the
    tokenizer, the TransformerLens config and CACHE_VERSION."""
    tokenizer = tiny_tokenizer()
    tl_cfg = {
        k: v
        for k, v in hooked_config(cfg, len(tokenizer)).to_dict().items()
        if isinstance(v, (int, float, str, bool, list, type(None)))
    }
    blob = {
        "version": CACHE_VERSION,
        "config": cfg.to_dict(),
        "task": _organism_task(cfg).to_dict(),
        "vocab": sorted(tokenizer.get_vocab().items()),
        "tl": tl_cfg,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cache_path(
    name: str, *, config: OrganismConfig | None = None, cache_dir: str | Path | None = None
) -> Path:
    """Where organism `name` with `config` is cached: `<cache>/organisms/<name>-<config hash>/`."""
    from kvnotes.zoo.cache import default_cache_dir

    cfg = _resolve(name, config)
    root = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
    return root / "organisms" / f"{cfg.name}-{config_hash(cfg)}"


def load_organism(
    name: str,
    *,
    config: OrganismConfig | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    device=None,
    dtype=None,
) -> KVModel:
    """Organism `name` as a `KVModel`: from the cache, or trained (first use) and cached.

    Only an organism that converged is cached (see `train_converged`). It is trained and cached in
    float32 on the CPU, then cast to `dtype` and moved to `device` (default cpu, float32).

    >>> model = load_organism("lookup-organism", progress=False)
    >>> model.n_layers, model.window(0)
    (1, None)
    """
    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    cfg = _resolve(name, config)
    root = cache_path(name, config=cfg, cache_dir=cache_dir)
    hooked = _from_cache(root, cfg, progress)
    if hooked is None:
        with building(root):
            hooked = _from_cache(root, cfg, progress)  # trained by another process while this one waited
            if hooked is None:
                _say(progress, f"kvnotes: training {cfg.name} (first use; cached in {root})")
                hooked, metrics = train_converged(name, config=cfg, progress=progress)
                _write_cache(root, hooked, cfg, metrics)
    return from_hooked(cfg.name, hooked, tiny_tokenizer(), device=device, dtype=dtype)


def organism_metrics(
    name: str, *, config: OrganismConfig | None = None, cache_dir: str | Path | None = None
) -> dict | None:
    """The training metrics stored with the cached organism, or None when it is not cached."""
    try:
        meta = json.loads((cache_path(name, config=config, cache_dir=cache_dir) / "meta.json").read_text())
        return meta["metrics"]
    except (OSError, ValueError, KeyError):
        return None


def _from_cache(root: Path, cfg: OrganismConfig, progress: bool):
    if not (root / "meta.json").is_file() and not (root / "weights.safetensors").is_file():
        return None
    try:
        from safetensors.torch import load_file

        meta = json.loads((root / "meta.json").read_text())
        if meta.get("format") != "kvnotes.organism" or meta.get("config_hash") != config_hash(cfg):
            raise ValueError("its metadata does not match this organism's config")
        if not meta.get("metrics", {}).get("converged"):
            raise ValueError("it holds a run that did not converge")
        weights = load_file(str(root / "weights.safetensors"))
        tl = _new_model(cfg)
        params = dict(tl.named_parameters())
        if set(weights) != set(params) or any(weights[k].shape != p.shape for k, p in params.items()):
            raise ValueError("its weights do not match the architecture")
        tl.load_state_dict(weights, strict=False)
        tl.eval()
        _say(progress, f"kvnotes: loading {cfg.name} from cache ({root})")
        return tl
    except Exception as e:  # noqa: BLE001 - any failure means the cache is unusable; retrain
        _say(
            True,
            f"kvnotes: the {cfg.name} cache at {root} is unusable ({type(e).__name__}: {e}); retraining it",
        )
        return None


def _write_cache(root: Path, tl, cfg: OrganismConfig, metrics: dict) -> None:
    """Weights (safetensors) and metadata (JSON) into a temp dir, then renamed into place."""
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        save_file(
            {k: p.detach().contiguous() for k, p in tl.named_parameters()}, str(tmp / "weights.safetensors")
        )
        meta = {
            "format": "kvnotes.organism",
            "version": CACHE_VERSION,
            "name": cfg.name,
            "config_hash": config_hash(cfg),
            "config": cfg.to_dict(),
            "metrics": metrics,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))

    publish(root, cfg.name, "trained again", fill)


def _resolve(name: str, config: OrganismConfig | None) -> OrganismConfig:
    if config is None:
        return _config(name)
    if config.name != name:
        raise BadArgument(
            f"config is for {config.name!r} but the organism asked for is {name!r}; "
            f"pass replace(ORGANISMS[{name!r}], ...) to change its recipe"
        )
    return config


def _config(name: str) -> OrganismConfig:
    if name not in ORGANISMS:
        from kvnotes.errors import UnknownModelError

        raise UnknownModelError(f"unknown organism {name!r}; the organisms are {sorted(ORGANISMS)}")
    return ORGANISMS[name]


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict:
    """`python -m kvnotes.zoo.organisms NAME`: retrain NAME, replace its cache, print the metrics."""
    ap = argparse.ArgumentParser(prog="python -m kvnotes.zoo.organisms", description=main.__doc__)
    ap.add_argument("name", choices=sorted(ORGANISMS))
    ap.add_argument("--cache-dir", default=None, help="default: $KVNOTES_CACHE or ~/.cache/kvnotes")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    cfg = _config(args.name)
    tl, metrics = train_converged(args.name, config=cfg, progress=not args.quiet)
    _write_cache(cache_path(args.name, config=cfg, cache_dir=args.cache_dir), tl, cfg, metrics)
    print(json.dumps(metrics, indent=1))
    return metrics


if __name__ == "__main__":
    main()


NULL_ORGANISMS = {"null-organism": "notes-organism"}  # name -> the organism whose architecture it has


def load_null_organism(name: str = "null-organism", *, device=None, dtype=None) -> KVModel:
    """An organism's architecture with its initial, untrained weights (seeded, so the same every
    time): the control on which a probe must report no mechanism. Its decision barely moves with
    the field, so every pair falls below the minimum effect and is excluded (docs/organisms.md).

    >>> load_null_organism().n_layers
    3
    """
    import torch

    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    if name not in NULL_ORGANISMS:
        from kvnotes.errors import UnknownModelError

        raise UnknownModelError(f"unknown null organism {name!r}; they are {sorted(NULL_ORGANISMS)}")
    cfg = ORGANISMS[NULL_ORGANISMS[name]]
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        tl = _new_model(cfg)
    tl.eval()
    return from_hooked(name, tl, tiny_tokenizer(), device=device, dtype=dtype)
