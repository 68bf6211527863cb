"""`run()` on the nnsight backend: the Hugging Face forward, fed the notebook as its cache.

`NNsightBackend.forward` builds a `DynamicCache` whose layer l holds the notebook's slots (then an
overlay's, if any), passes the computed tokens with their own `position_ids` and one additive
attention mask per layer type (`plan.attention_mask`: causal by position, live slots only, inside
the layer's window), and
reads the fresh K/V back from the end of the cache. The key axis is the engine's: the notebook's
slots in slot order, the overlay's, then the computed tokens.

Hooks are TransformerLens-style `(name_or_filter, fn)` pairs over TransformerLens hook names, run
as nnsight interventions: inside `lm.trace`, each named point is read (`.input` / `.output` of the
module the family map names), handed to `fn(activation, hook)`, and written back when `fn` returns
a tensor. Attention scores and patterns are not module outputs under SDPA; a call that hooks or
captures them runs on kvnotes' own eager attention (`kvnotes_eager`, registered with transformers'
`AttentionInterface`), which fires `hook_attn_scores` and `hook_pattern` with TransformerLens's
meaning, and warns once that it did.

`feed(model, notebook, tokens)` gives users the same feeding for their own nnsight code:

    with feed(model, nb, tokens) as fed, model.lm.trace(fed.ids):
        model.lm.model.layers[3].output[:, -1] += steer
        logits = model.lm.output.logits.save()
    nb2 = fed.notebook()
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvnotes import rope
from kvnotes.engine import plan as planning
from kvnotes.engine.backend import Capability
from kvnotes.engine.float64 import float64_everywhere, hf_in_float64
from kvnotes.engine.nnsight.model import NNsightModel
from kvnotes.engine.plan import Fresh, Hook, Plan, saver, softcap, take_slots, write_back
from kvnotes.errors import BadArgument, MissingCapability, UnsupportedArchitecture
from kvnotes.models.backends import BackendName
from kvnotes.models.model import KVModel
from kvnotes.models.sites import MODULE_SITES, ORDER, ModuleSite
from kvnotes.notebook import Notebook
from kvnotes.types import Tensor

EAGER = "kvnotes_eager"
_state = threading.local()  # the hooks our eager attention fires, for the call in flight


class EagerAttention(UserWarning):
    """A call ran on kvnotes' eager attention because it hooks attention scores or patterns."""


@dataclass(frozen=True)
class HookPoint:
    """What a hook function receives as `hook`, as TransformerLens passes its HookPoint."""

    name: str

    def layer(self) -> int:
        return int(self.name.split(".")[1])


@dataclass
class _HookPlan:
    """The hooks of one call, resolved to sites: per layer, (site, [(name, fn)]) in execution order."""

    per_layer: dict[int, list[tuple[str, ModuleSite, list[tuple[str, Callable | None]]]]] = field(
        default_factory=dict
    )
    attention: dict[tuple[int, str], list[tuple[str, Callable | None]]] = field(default_factory=dict)


def _resolve(model: NNsightModel, hooks: Sequence, capture: Sequence[str], captured: dict) -> _HookPlan:
    wanted: dict[str, list[tuple[str, Callable | None]]] = {}
    names = model.hook_names()
    for target, fn in hooks:
        matched = [n for n in names if target(n)] if callable(target) else [target]
        for n in matched:
            wanted.setdefault(n, []).append((n, fn))
    for n in capture:
        wanted.setdefault(n, []).append((n, saver(captured)))
    plan = _HookPlan()
    by_layer: dict[int, dict[str, tuple[ModuleSite, list[tuple[str, Callable | None]]]]] = {}
    for n, fns in wanted.items():
        layer, what, site = model.site(n)
        if site is None:
            plan.attention[layer, what] = fns
            continue
        if not site.writable and any(fn is not None and not getattr(fn, "_saves", False) for _, fn in fns):
            _guard_read_only(n, fns)
        by_layer.setdefault(layer, {})[what] = (site, fns)
    for layer, sites in by_layer.items():
        ordered = sorted(sites.items(), key=lambda kv: ORDER.index(kv[0]))
        plan.per_layer[layer] = [(what, site, fns) for what, (site, fns) in ordered]
    return plan


def _guard_read_only(name: str, fns: list) -> None:
    """Wrap hooks on a read-only site so that returning a replacement is an error, not a no-op."""
    for i, (n, fn) in enumerate(fns):

        def checked(act, hook, fn=fn, n=n):
            out = fn(act, hook=hook)
            if out is not None:
                raise BadArgument(
                    f"{n} is read-only on the nnsight backend: in a Hugging Face layer the residual is "
                    "added outside the module that sees it, so a replacement would not reach the "
                    "residual stream; write hook_attn_out or hook_resid_pre/post instead"
                )

        fns[i] = (n, checked)


def _fire(fns, act: Tensor) -> Tensor | None:
    """Run each hook on `act` in turn; the last replacement (if any) is the new value."""
    out = None
    for name, fn in fns:
        res = fn(act if out is None else out, hook=HookPoint(name))
        if res is not None:
            out = res
    return out


# --- the cache and the masks ---------------------------------------------------------------------
def _inputs(
    model: NNsightModel, nb: Notebook, overlay: Notebook | None, pos: Tensor, batch: int, *, trim: bool = True
):
    """(DynamicCache of the notebook's slots, masks, position_ids).

    trim: a sliding-window layer gets only the slots inside its window (as the fast path of the
    TransformerLens backend reads them): no computed token can attend to the others, and a long
    context then costs those layers the window, not the context. Off where the key axis is observed
    (attention hooks: it is the notebook's every slot, then the overlay's, then the computed tokens,
    as on the other backend).
    """
    from transformers import DynamicCache

    keys_for = planning.key_planner(nb, overlay, pos, model.device, model.dtype)
    windows = {model.window(l) for l in range(model.n_layers)}
    bias = {w: keys_for(w, trim).bias[None, None] for w in windows}  # [1, 1, pos, key]
    if model.layer_types:
        sliding = next(
            (model.window(l) for l, t in enumerate(model.layer_types) if t == "sliding_attention"), None
        )
        masks: Tensor | dict[str, Tensor] = {
            t: bias[sliding if t == "sliding_attention" else None] for t in set(model.layer_types)
        }
    elif len(bias) == 1:
        masks = next(iter(bias.values()))
    else:
        raise BadArgument(f"{model.name} mixes windows without declaring layer types; kvnotes cannot mask it")

    def layer(l):
        k, v = take_slots(nb.keys[l], nb.values[l], keys_for(model.window(l), trim).take)
        k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
        if overlay is not None:  # one copy here; otherwise the cache's own update makes the only one
            k = torch.cat([k, overlay.keys[l].expand(batch, -1, -1, -1)], 2)
            v = torch.cat([v, overlay.values[l].expand(batch, -1, -1, -1)], 2)
        return k, v

    cache = DynamicCache(ddp_cache_data=[layer(l) for l in range(model.n_layers)])
    return cache, masks, pos.to(device=model.device)[None].expand(batch, -1)


# --- feeding the forward -------------------------------------------------------------------------
class _Feed:
    """Forward kwargs handed to the model's top module by a pre-hook while a call is in flight:
    nnsight prepares only the token ids (it would split a mask per row, and cannot take one per
    layer type), the cache, masks and positions arrive here."""

    def __init__(self):
        self.kwargs: dict | None = None

    def __call__(self, module, args, kwargs):
        if self.kwargs is not None:
            kwargs.update(self.kwargs)
        return args, kwargs


def _feeder(model: NNsightModel) -> _Feed:
    feed = getattr(model.hf, "_kvnotes_feed", None)
    if feed is None:
        feed = _Feed()
        model.hf.register_forward_pre_hook(feed, with_kwargs=True)
        model.hf._kvnotes_feed = feed
    return feed


@contextmanager
def _attention_impl(model: NNsightModel, eager: bool) -> Iterator[None]:
    if not eager:
        yield
        return
    _register()
    before = model.hf.config._attn_implementation
    warnings.warn(
        "attention scores and patterns do not exist under the model's fused attention kernels: "
        f"this call runs on kvnotes' eager attention (was {before!r})",
        EagerAttention,
        stacklevel=4,
    )
    model.hf.set_attn_implementation(EAGER)
    try:
        yield
    finally:
        model.hf.set_attn_implementation(before)


class NNsightBackend:
    """`run()` on the Hugging Face module nnsight wraps (`model.hf`), its hooks nnsight interventions:
    a `Backend[NNsightModel]`."""

    name = BackendName.NNSIGHT
    capabilities = frozenset(
        {
            Capability.TRANSFORMERS_MODULE,
            Capability.FEED,
            Capability.REMOTE,
            Capability.HOOK_ATTN_SCORES,
            Capability.HOOK_PATTERN,
            Capability.NNSIGHT,
        }
    )

    def forward(
        self, model: NNsightModel, plan: Plan, hooks: Sequence[Hook], capture: Sequence[str]
    ) -> Fresh:
        """Fresh K/V of the computed tokens, logits at the read positions, captured activations."""
        if not model.weights:
            raise BadArgument(
                f"{model.name} was loaded without its weights (remote=True): it runs only remote "
                "experiments (kvnotes.serving.remote); load it with its weights for local runs"
            )
        # 1) the hooks resolved to module sites; the notebook as a DynamicCache, one mask per layer type
        tok, read_idx, n = plan.tok, plan.read_idx, plan.tok.shape[1]
        captured: dict[str, Tensor] = {}
        sites = _resolve(model, hooks, capture, captured)
        cache, masks, position_ids = _inputs(
            model, plan.notebook, plan.overlay, plan.pos, plan.batch, trim=not sites.attention
        )
        kwargs = dict(
            cache=cache,
            attention_mask=masks,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=read_idx.to(model.device) if read_idx.numel() else torch.tensor([n - 1]),
        )
        # 2) the model's own forward (traced where hooks need it): logits [batch, read, d_vocab]
        logits = _logits(model, tok.to(model.device), kwargs, sites, plan)
        # 3) the fresh K/V: the last n slots of every cache layer, [batch, n_kv_heads, pos, d_head]
        fresh_k, fresh_v = _fresh(cache, n)
        return Fresh(keys=fresh_k, values=fresh_v, logits=logits, activations=captured)

    def move_keys(self, model: NNsightModel, layer: int, keys: Tensor, old: Tensor, new: Tensor) -> Tensor:
        return _move_keys(model, layer, keys, old, new)

    def full_logits(self, model: NNsightModel, ids: Sequence[int]) -> Tensor:
        with torch.no_grad():
            return model.hf(torch.tensor([list(ids)], device=model.device)).logits[0]

    def hook_names(self, model: NNsightModel) -> list[str]:
        return model.hook_names()

    def watched(self, model: NNsightModel) -> bool:
        return False  # hooks exist only as run()'s arguments here

    @contextmanager
    def in_float64(self, model: NNsightModel) -> Iterator[NNsightModel]:
        """The Hugging Face module in float64, its rotary embeddings rebuilt in float64
        (`hf_in_float64`), and float32 spelled as float64 meanwhile (transformers computes norms,
        softmax and RoPE angles in float32 whatever the model's dtype, and so does `move_keys`)."""
        with hf_in_float64(model.hf), float64_everywhere():
            yield model


NNSIGHT = NNsightBackend()


def _logits(model: NNsightModel, ids: Tensor, kwargs: dict, sites: _HookPlan, plan: Plan) -> Tensor:
    """The forward's logits at the read positions (columns `plan.cols`)."""
    with _attention_impl(model, bool(sites.attention)):  # autograd as the caller has it (attribution)
        _state.attention = sites.attention
        try:
            if sites.per_layer:
                logits = _traced(model, ids, kwargs, sites)
            elif plan.cols is not None and model.facts.model_type in MODULE_SITES:
                return _answer_columns(model, ids, kwargs, plan.read_idx, plan.cols)
            else:
                logits = model.hf(input_ids=ids, **kwargs).logits
        finally:
            _state.attention = {}
    if not plan.read_idx.numel():
        logits = logits[:, :0]
    if plan.cols is not None:
        logits = logits[..., plan.cols.to(logits.device)]
    return logits


def _fresh(cache, n: int) -> tuple[list[Tensor], list[Tensor]]:
    """The computed tokens' K/V: the last `n` slots of every cache layer."""
    return [layer.keys[:, :, -n:] for layer in cache.layers], [
        layer.values[:, :, -n:] for layer in cache.layers
    ]


def _answer_columns(model: NNsightModel, ids, kwargs, read_idx, cols) -> Tensor:
    """The decoder alone, then only the `cols` rows of the unembedding at the read positions (and
    the final softcap where the family has one): for a batched decision over two answer tokens,
    a 262k-token vocabulary's head would cost more than the layers. Families in `MODULE_SITES` only, whose
    causal-LM head is exactly `lm_head` then the optional softcap."""
    kwargs = {k: v for k, v in kwargs.items() if k != "logits_to_keep"}
    h = model.hf.model(input_ids=ids, **kwargs).last_hidden_state[:, read_idx.to(ids.device)]
    head = model.hf.get_output_embeddings()
    cols = cols.to(h.device)
    logits = h @ head.weight[cols].T
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias[cols]
    return softcap(logits, getattr(model.text_config, "final_logit_softcapping", None))


def _traced(model: NNsightModel, ids: Tensor, kwargs: dict, plan: _HookPlan) -> Tensor:
    """The forward as one nnsight trace, every planned hook an intervention at its module."""
    feed = _feeder(model)
    lm, heads, kv, d = model.lm, model.n_heads, model.n_kv_heads, model.d_head
    feed.kwargs = kwargs
    try:
        with lm.trace(ids):
            layers = model.layout.layer_list(lm)
            for l in sorted(plan.per_layer):
                layer = layers[l]
                for _, site, fns in plan.per_layer[l]:
                    envoy = layer
                    for part in filter(None, site.path.split(".")):
                        envoy = getattr(envoy, part)
                    port = "output" if site.port == "output0" else site.port
                    value = getattr(envoy, port)
                    act = value[0] if site.port == "output0" else value
                    shaped = act
                    if site.heads:
                        shaped = act.view(*act.shape[:-1], heads if site.heads == "q" else kv, d)
                    new = _fire(fns, shaped)
                    if new is not None and site.writable:
                        new = new.reshape(act.shape).to(act.dtype)
                        setattr(envoy, port, (new, *value[1:]) if site.port == "output0" else new)
            logits = lm.output.logits.save()
    finally:
        feed.kwargs = None
    return logits


# --- re-rotation -------------------------------------------------------------------------------
def _move_keys(model: NNsightModel, layer: int, keys: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """Move post-RoPE keys from positions `old` to `new` with the layer's own rotary embedding
    (its base and scaling, computed as the model's forward computes them): undo the rotation
    at `old`, apply the one at `new`, each from the model's own cos/sin at those positions, so
    a moved key equals the key a prefill at `new` writes. A scaled RoPE's magnitude factor
    (`attention_scaling`: YaRN, LongRoPE) is divided out of both, so only the angle moves."""
    if model.facts.positions != "rotary":  # learned positions: rotation is the identity (a move of
        return keys  # zero; `kvnotes.engine.move_keys` refuses any other)
    cfg_rope = getattr(model.text_config, "rope_parameters", None) or {}
    kinds = {v.get("rope_type") for v in cfg_rope.values() if isinstance(v, dict)} | {
        cfg_rope.get("rope_type")
    }
    if kinds & {"dynamic", "longrope"}:
        raise UnsupportedArchitecture(
            f"{model.name}'s RoPE ({', '.join(sorted(k for k in kinds if k))}) changes its frequencies "
            "with the sequence length, so a stored key cannot be moved to a new position exactly"
        )
    bare = rope.unrotate(keys.float(), *_cos_sin(model, layer, old, keys))  # in float32, as HF's RoPE
    return rope.rotate(bare, *_cos_sin(model, layer, new, keys)).to(keys.dtype)


def _cos_sin(model: NNsightModel, layer: int, positions: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
    rotary = model.hf.model.rotary_emb
    args = (model.layer_types[layer],) if model.layer_types and _takes_layer_type(rotary) else ()
    probe = like.new_zeros(1, dtype=torch.float32)
    cos, sin = rotary(probe, positions.to(like.device).reshape(1, -1), *args)  # [1, slot, rotary_dim]
    scale = _attention_scaling(rotary, args)
    return cos[0].float() / scale, sin[0].float() / scale


def _takes_layer_type(rotary) -> bool:
    return "layer_type" in inspect.signature(rotary.forward).parameters


def _attention_scaling(rotary, args: tuple) -> float:
    if args:
        return float(
            getattr(rotary, f"{args[0]}_attention_scaling", getattr(rotary, "attention_scaling", 1.0))
        )
    return float(getattr(rotary, "attention_scaling", 1.0))


# --- kvnotes' eager attention --------------------------------------------------------------------
def _eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Eager attention that fires `blocks.{l}.attn.hook_attn_scores` and `.hook_pattern`
    (`[batch, head, query, key]`, masked scores -inf as in TransformerLens) for the call in flight."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scaling = module.head_dim**-0.5 if scaling is None else scaling
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = planning.softcap(scores, softcap)
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        scores = torch.where(mask == 0, scores, float("-inf"))
    hooks = getattr(_state, "attention", {})
    layer = getattr(module, "layer_idx", None)
    fns = hooks.get((layer, "attn.hook_attn_scores"))
    if fns and (new := _fire(fns, scores)) is not None:
        scores = new
    pattern = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    pattern = torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)
    fns = hooks.get((layer, "attn.hook_pattern"))
    if fns and (new := _fire(fns, pattern)) is not None:
        pattern = new
    out = (pattern @ value).transpose(1, 2).contiguous()
    return out, pattern


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(EAGER, _eager)
        _registered = True


# --- the user's own nnsight code, fed a notebook -------------------------------------------------
@dataclass
class Fed:
    """A call set up by `feed`: pass `ids` to `model.lm.trace`; after the trace, `notebook()` is the
    notebook with the computed tokens' K/V written (as `run(..., write=True)` returns it)."""

    model: object
    ids: Tensor
    positions: Tensor
    base: Notebook
    cache: Any  # the DynamicCache the trace writes into

    def notebook(self) -> Notebook:
        n = self.ids.shape[1]
        if self.cache.layers[0].keys.shape[2] != self.base.n_slots + n:
            raise BadArgument("the trace has not run yet: call notebook() after the `with` block")
        fresh_k, fresh_v = _fresh(self.cache, n)
        return write_back(self.base, self.ids.cpu(), self.positions, fresh_k, fresh_v)


@contextmanager
def feed(model: KVModel, notebook: Notebook, tokens, positions=None) -> Iterator[Fed]:
    """Feed `notebook` to the next forward of `model.lm` (an nnsight trace the caller writes), with
    `tokens` at `positions` (default: right after the notebook), as `run()` would."""
    if not isinstance(model, NNsightModel):
        raise MissingCapability(
            f"feed() needs 'feed', which {model.name} does not offer (a {type(model).__name__}, not an "
            f"NNsightModel); load it with --backend {BackendName.NNSIGHT} "
            f"(load_model(name, backend={str(BackendName.NNSIGHT)!r}))"
        )
    notebook.check_model(model)
    tok, pos = planning.tokens_and_positions(notebook, tokens, positions)
    planning.check_inputs(model, notebook, tok, pos)
    batch = max(notebook.batch, tok.shape[0])
    tok = tok.expand(batch, -1)
    cache, masks, position_ids = _inputs(model, notebook, None, pos, batch, trim=False)
    f = _feeder(model)
    f.kwargs = dict(cache=cache, attention_mask=masks, position_ids=position_ids, use_cache=True)
    try:
        yield Fed(model=model, ids=tok.to(model.device), positions=pos, base=notebook, cache=cache)
    finally:
        f.kwargs = None
