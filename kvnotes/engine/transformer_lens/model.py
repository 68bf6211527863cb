"""`TransformerLensModel`: a `KVModel` on TransformerLens, and `from_hooked`, which makes one of a
`HookedTransformer` (refusing what the engine cannot run exactly)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from copy import deepcopy
from dataclasses import dataclass

import torch
from transformer_lens import HookedTransformer
from transformer_lens.components.mlps.gated_mlp import GatedMLP

from kvnotes.errors import UnsupportedArchitecture
from kvnotes.models.model import HFSource, KVModel, ModelFacts
from kvnotes.models.placement import same_device

# Config fields that decide what a notebook's K/V mean; they enter the fingerprint.
_FINGERPRINT_FIELDS = (
    "d_model",
    "d_head",
    "n_heads",
    "n_key_value_heads",
    "n_layers",
    "d_vocab",
    "d_mlp",
    "act_fn",
    "normalization_type",
    "rotary_dim",
    "rotary_base",
    "rotary_base_local",
    "rotary_adjacent_pairs",
    "window_size",
    "attn_types",
    "use_qk_norm",
    "attn_scores_soft_cap",
    "output_logits_soft_cap",
    "use_NTK_by_parts_rope",
)


class ViewsGatedMLP(GatedMLP):
    """TransformerLens's gated MLP, multiplying by its weights as they are stored.

    TL's version copies each transposed weight into contiguous memory on every call (to match
    Hugging Face's bfloat16 rounding), three 640 x 2048 copies per layer on Gemma 3 270M: 44% of
    a one-token decision patch's time. Same parameters, same hook points, same result up to
    float32 rounding; the weights are read live, so an in-place weight edit takes effect.
    """

    def forward(self, x):
        if self.cfg.is_layer_norm_activation() and self.hook_mid is not None and self.ln is not None:
            return super().forward(x)
        x = x.to(self.W_gate.device)
        pre_act = self.hook_pre(x @ self.W_gate)
        pre_linear = self.hook_pre_linear(x @ self.W_in)
        post_act = self.hook_post(self.act_fn(pre_act) * pre_linear + self.b_in)
        return post_act @ self.W_out + self.b_out


@dataclass(frozen=True, eq=False, kw_only=True, repr=False)
class TransformerLensModel(KVModel):
    """A `KVModel` on TransformerLens: the engine runs `tl`'s own modules and hook points."""

    tl: HookedTransformer

    @property
    def n_ctx(self) -> int:
        """Read live from TransformerLens's config, where a user may raise it (docs/engine.md)."""
        return self.tl.cfg.n_ctx

    @property
    def cfg(self):
        """TransformerLens's config (this backend only; backend-neutral code reads `facts`)."""
        return self.tl.cfg

    @property
    def device(self) -> torch.device:
        return self.tl.embed.W_E.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tl.embed.W_E.dtype


def from_hooked(
    name: str,
    tl: HookedTransformer,
    tokenizer,
    hf_source: HFSource | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> TransformerLensModel:
    """A TransformerLens `HookedTransformer` as a `TransformerLensModel`: frozen, in eval mode, checked
    (`check_supported`), learned-position models given rotation hook points, gated MLPs that read
    their weights as stored (`ViewsGatedMLP`).

    device, dtype: cast and move `tl` there first, in place (None: leave it as it is), so the
    fingerprint reads the weights as the model will run them (`place_hooked`)."""
    place_hooked(tl, device, dtype)
    tl.eval()
    for p in tl.parameters():
        p.requires_grad_(False)
    check_supported(tl)
    _rotation_hooks(tl)
    for block in tl.blocks:
        if type(getattr(block, "mlp", None)) is GatedMLP:
            block.mlp.__class__ = ViewsGatedMLP
    return TransformerLensModel(
        name=name,
        tl=tl,
        tokenizer=tokenizer,
        fingerprint=_fingerprint(tl, tokenizer),
        facts=_tl_facts(tl),
        hf_source=hf_source,
    )


def place_hooked(
    tl: HookedTransformer, device: torch.device | str | None, dtype: torch.dtype | None
) -> HookedTransformer:
    """Cast `tl` to `dtype` (`cast_hooked`), then move it to `device` (TransformerLens's own `to`,
    quietly), in place, once each (None: leave it), with its config following. Weights built in
    float32 are cast here once, so a bfloat16 model holds exactly the float32 weights rounded."""
    if dtype is not None and tl.embed.W_E.dtype != dtype:
        cast_hooked(tl, dtype)
    if device is not None and not same_device(tl.embed.W_E.device, device):
        tl.to(str(device), print_details=False)
    return tl


def cast_hooked(tl: HookedTransformer, dtype: torch.dtype) -> None:
    """`tl.to(dtype)`, in place, with its config following, in one pass. TransformerLens's own `to`
    first casts every tensor of a fresh `state_dict()` and drops the copies (a no-op: Gemma 3
    270M's float64 round trip takes 7 s with it on one core, 2 s without), then calls
    `nn.Module.to`, which is all that changes the model."""
    tl.cfg.dtype = dtype
    torch.nn.Module.to(tl, dtype)


def placed(
    model: TransformerLensModel,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    *,
    copy: bool = True,
) -> TransformerLensModel:
    """`model` on `device` in `dtype`: `model` itself where it is already there, else a new model
    (its `HookedTransformer` deep-copied, cast and moved, the fingerprint read again), so a cached
    model stays as cached; the same class with every other field kept (a `TracrModel` stays one).
    copy=False moves `model`'s own `HookedTransformer` instead (the caller drops `model`)."""
    if (device is None or same_device(model.device, device)) and (dtype is None or model.dtype == dtype):
        return model
    tl = place_hooked(deepcopy(model.tl) if copy else model.tl, device, dtype)
    return dataclasses.replace(model, tl=tl, fingerprint=_fingerprint(tl, model.tokenizer))


def _tl_facts(tl: HookedTransformer) -> ModelFacts:
    c = tl.cfg
    rotary = c.positional_embedding_type == "rotary"
    return ModelFacts(
        n_layers=c.n_layers,
        n_heads=c.n_heads,
        n_kv_heads=c.n_key_value_heads or c.n_heads,
        d_head=c.d_head,
        d_model=c.d_model,
        d_mlp=None if c.attn_only else c.d_mlp,
        gated_mlp=bool(c.gated_mlp) and not c.attn_only,
        d_vocab=c.d_vocab,
        d_vocab_out=c.d_vocab_out,
        n_ctx=c.n_ctx,
        windows=tuple(c.window_size if b.attn.attn_type == "local" else None for b in tl.blocks),
        rope_bases=tuple(float(b.attn._rotary_base()) if rotary else 0.0 for b in tl.blocks),
        rotary_dims=((c.rotary_dim or 0) if rotary else 0,) * c.n_layers,
        attn_scores_soft_cap=c.attn_scores_soft_cap if (c.attn_scores_soft_cap or 0) > 0 else None,
        output_logits_soft_cap=c.output_logits_soft_cap if (c.output_logits_soft_cap or 0) > 0 else None,
        norm_after_sublayers=bool(c.use_normalization_before_and_after),
        model_type=c.original_architecture or "",
        positions="rotary" if rotary else "learned",
    )


def _rotation_hooks(tl: HookedTransformer) -> None:
    """Give learned-position models the `hook_rot_q`/`hook_rot_k` points RoPE models have: their
    rotation is the identity, so the points fire with the queries and keys as they are, and code
    that reads the keys a notebook stores reads them by one name on every model."""
    if tl.cfg.positional_embedding_type == "rotary":
        return
    from transformer_lens.hook_points import HookPoint

    for block in tl.blocks:
        for name in ("hook_rot_q", "hook_rot_k"):
            if not hasattr(block.attn, name):
                setattr(block.attn, name, HookPoint())
    tl.setup()


def check_supported(tl: HookedTransformer) -> None:
    """Refuse configs whose attention the engine cannot reproduce exactly, with the reason."""
    c = tl.cfg
    problems = []
    if c.positional_embedding_type not in ("rotary", "standard"):
        problems.append(
            f"positional_embedding_type={c.positional_embedding_type!r} (RoPE or learned absolute only)"
        )
    for flag in (
        "use_dynamic_ntk_rope",
        "use_logn_attn",
        "use_attn_in",
        "use_split_qkv_input",
        "parallel_attn_mlp",
        "use_attention_sinks",
        "load_in_4bit",
        "scale_attn_by_inverse_layer_idx",
        "post_embedding_ln",
    ):
        if getattr(c, flag, False):
            problems.append(f"{flag}=True")
    if c.attention_dir != "causal":
        problems.append("non-causal attention")
    if c.original_architecture in ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM"):
        problems.append(f"{c.original_architecture} (post-norm / full-width qk-norm)")
    if c.clip_qkv is not None:
        problems.append("clip_qkv")
    if problems:
        raise UnsupportedArchitecture(
            "the notebook engine cannot represent this model's attention exactly: "
            + "; ".join(problems)
            + ". Supported: pre-norm (or norm-free) decoder-only models with RoPE (Llama, Mistral, "
            "Qwen2/3, Gemma 1-3) or learned absolute positions (GPT-2, tracr's compiled programs)."
        )


def _fingerprint(tl: HookedTransformer, tokenizer) -> str:
    h = hashlib.sha256()
    cfg = {k: getattr(tl.cfg, k, None) for k in _FINGERPRINT_FIELDS}
    for k in ("positional_embedding_type", "attn_only"):  # entered only where they differ from
        if getattr(tl.cfg, k) not in ("rotary", False):  # RoPE models', whose fingerprints stand
            cfg[k] = getattr(tl.cfg, k)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items())[:: max(1, len(vocab) // 4096)]).encode())
    h.update(str(len(vocab)).encode())
    if tl.embed.W_E.dtype != torch.float32:  # a float32 model's fingerprint stands as it was
        h.update(f"dtype {tl.embed.W_E.dtype}".encode())  # a notebook's K/V are in the model's dtype
    with torch.no_grad():
        last = tl.blocks[-1].attn.W_O[0, :4] if tl.cfg.attn_only else tl.blocks[-1].mlp.W_out[:4]
        for t in (tl.embed.W_E[:4], tl.blocks[0].attn.W_Q[0, :4], last):
            h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()
