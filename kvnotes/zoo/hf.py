"""Hugging Face checkpoints (Llama, Mistral, Qwen2/3, Gemma 1-3, GPT-2) as `KVModel`s.

The transformers config is mapped field by field to `HookedTransformerConfig` kwargs (one small
function per family), the weights go through TransformerLens's own converters, and they are loaded
unprocessed (no LayerNorm folding, no centering) so TL's logits equal the HF model's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.pretrained import weight_conversions as wc
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvnotes.engine.transformer_lens.model import TransformerLensModel, from_hooked
from kvnotes.errors import UnknownModelError, UnsupportedArchitecture
from kvnotes.models.model import HFSource, KVModel
from kvnotes.zoo.names import N_CTX_CAP  # the default context: min(max_position_embeddings, it)

_ACTIVATIONS = {  # transformers' ACT2FN name -> TransformerLens act_fn
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_fast": "gelu_fast",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
}

_CONVERTERS: dict[str, Callable] = {
    "LlamaForCausalLM": wc.convert_llama_weights,
    "MistralForCausalLM": wc.convert_mistral_weights,
    "Qwen2ForCausalLM": wc.convert_qwen2_weights,
    "Qwen3ForCausalLM": wc.convert_qwen3_weights,
    "GemmaForCausalLM": wc.convert_gemma_weights,
    "Gemma2ForCausalLM": wc.convert_gemma_weights,
    "Gemma3ForCausalLM": wc.convert_gemma_weights,
    "Gemma3ForConditionalGeneration": wc.convert_gemma_weights,
    "GPT2LMHeadModel": wc.convert_gpt2_weights,
}


# --- loading -------------------------------------------------------------------------------------
def load_hf(name_or_dir: str, *, dtype=None, device=None, n_ctx: int | None = None) -> KVModel:
    """Load a local checkpoint directory or a hub name (HF cache first) as a `KVModel`: the weights
    read in `dtype` (default float32), converted on the CPU, then moved to `device` (default cpu).

    n_ctx: the context length; default min(max_position_embeddings, 8192).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    local = Path(name_or_dir).expanduser().is_dir()
    source = str(Path(name_or_dir).expanduser()) if local else name_or_dir
    config = _fetch(AutoConfig.from_pretrained, source, local)
    tl_config_from_hf(config)  # refuse an unsupported architecture before loading any weights
    tokenizer = _fetch(AutoTokenizer.from_pretrained, source, local)
    hf_model = _fetch(AutoModelForCausalLM.from_pretrained, source, local, dtype=dtype)
    overrides = {} if n_ctx is None else {"n_ctx": n_ctx}
    reference = HFSource(
        what=f"transformers' {type(hf_model).__name__} from {source}",
        load=lambda: _fetch(
            AutoModelForCausalLM.from_pretrained, source, local, dtype=dtype, attn_implementation="eager"
        ),
        share=share_weights,
    )
    return tl_from_hf_model(
        hf_model, tokenizer, name_or_dir, hf_source=reference, device=device, dtype=dtype, **overrides
    )


def tl_from_hf_model(
    hf_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    name: str,
    *,
    hf_source: HFSource | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **cfg_overrides: Any,
) -> TransformerLensModel:
    """Convert a loaded transformers causal LM into a `KVModel` (weights unprocessed), then cast it
    to `dtype` and move it to `device` (None: as `hf_model` has them).

    hf_source: how to load that transformers model again, for `verify`'s reference invariants.
    """
    cfg = tl_kwargs(hf_model, tokenizer, name, **cfg_overrides)
    state_dict = convert_weights(hf_model, cfg)
    tl = hooked_from_state_dict(cfg, state_dict)
    return from_hooked(name, tl, tokenizer, hf_source, device=device, dtype=dtype)


def tl_kwargs(
    hf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str, **cfg_overrides: Any
) -> dict:
    """All `HookedTransformerConfig` kwargs for `hf_model`: its config, tokenizer and dtype."""
    return {
        **tl_config_from_hf(hf_model.config),
        **_bos_fields(tokenizer),
        "model_name": Path(name).name or name,
        "dtype": hf_model.dtype,
        "device": str(hf_model.device),  # where the converted weights live
        **cfg_overrides,
    }


def convert_weights(hf_model: PreTrainedModel, cfg: dict) -> dict[str, torch.Tensor]:
    """TL's converter for `cfg`'s architecture, with keys named as `cfg`'s model names them.

    The Mistral, Qwen2 and Gemma converters always emit grouped-query keys (`attn._W_K`), so
    they are run with explicit KV heads and the keys renamed when `n_key_value_heads` is None;
    GPT-2's emits no unembedding bias, which is zero.
    """
    convert = _CONVERTERS[cfg["original_architecture"]]
    kv = cfg.get("n_key_value_heads") or cfg["n_heads"]
    state_dict = convert(hf_model, HookedTransformerConfig(**{**cfg, "n_key_value_heads": kv}))
    if cfg.get("n_key_value_heads") is None:
        state_dict = {k.replace("attn._", "attn."): v for k, v in state_dict.items()}
    if "unembed.b_U" not in state_dict:  # GPT-2's lm_head has no bias (the other converters emit zeros)
        w_u = state_dict["unembed.W_U"]
        state_dict["unembed.b_U"] = w_u.new_zeros(w_u.shape[1])
    return state_dict


def hooked_from_state_dict(
    cfg: dict, state_dict: dict[str, torch.Tensor], *, assign: bool = False
) -> HookedTransformer:
    """Build `HookedTransformer(cfg)` and load `state_dict` as is, checking every weight arrived.

    assign: adopt the given tensors instead of copying them (they must already have cfg's dtype).
    """
    tl = HookedTransformer(HookedTransformerConfig(**cfg), move_to_device=False)
    missing, unexpected = tl.load_state_dict(state_dict, strict=False, assign=assign)
    buffers = {n for n, _ in tl.named_buffers()}
    missing = [k for k in missing if k not in buffers]
    if missing or unexpected:
        raise UnsupportedArchitecture(
            f"converted weights do not fit the TransformerLens model for {cfg.get('model_name')}: "
            f"missing {missing[:6]}, unexpected {unexpected[:6]}; this checkpoint has weights its "
            "config does not declare (or lacks some it does), so kvnotes cannot load it exactly"
        )
    return tl


# --- the counterpart on the engine's own weights (verify's reference) ----------------------------
# (transformers' norm, TransformerLens's) per block, where TransformerLens holds `1 + w`: Gemma 1's
# two norms, Gemma 2 and 3's four (around attention and around the MLP), Gemma 3's QK norms
_GEMMA_NORMS = (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2"))
_GEMMA_SANDWICH_NORMS = (
    ("input_layernorm", "ln1"),
    ("post_attention_layernorm", "ln1_post"),
    ("pre_feedforward_layernorm", "ln2"),
    ("post_feedforward_layernorm", "ln2_post"),
)
_QK_NORMS = (("self_attn.q_norm", "attn.q_norm"), ("self_attn.k_norm", "attn.k_norm"))


def share_weights(model: TransformerLensModel, hf_model: PreTrainedModel) -> None:
    """Give transformers' counterpart, already cast to the model's dtype, the very weights the
    engine computes with (`HFSource.share`), so that a float64 forward of each is one function.

    Only Gemma's conversion changes values: TransformerLens holds each norm scale as `1 + w` and
    the embedding pre-multiplied by sqrt(d_model), both computed in float32 and then rounded once
    to the model's dtype, while transformers keeps `w` and the bare embedding in that dtype, adds
    the 1 in float32 as it runs and multiplies by the scale rounded to the dtype (sqrt(640) is
    25.25 in bfloat16). In float32 both sides round alike; in bfloat16 every norm scale may differ
    by 2^-9 and every embedding by 0.2%, and on verify's long prompt that alone moved Gemma 3 270M's
    layer-6 keys by 3.3 in float64, more than the bfloat16 gap the comparison is judged by
    (docs/engine.md, "Exactness"). Here transformers gets `engine scale - 1` as a float32 norm weight
    (exact: a 16-bit scale less 1 fits float32's 24 bits; its forward adds the 1 back in float32)
    and the engine's embedding with a scale of 1 (a new parameter: the output head, tied to the
    old one, keeps the bare embedding, which is what the engine's unembedding holds).
    """
    arch = model.tl.cfg.original_architecture
    if not arch.startswith("Gemma") or model.dtype == torch.float32:
        return  # the conversion only reshapes, or float32 rounds both sides alike
    tl, base = model.tl, _gemma_base(hf_model)
    norms = _GEMMA_SANDWICH_NORMS if tl.cfg.use_normalization_before_and_after else _GEMMA_NORMS
    norms += _QK_NORMS if tl.cfg.use_qk_norm else ()

    def put(norm: torch.nn.Module, scale: torch.Tensor) -> None:
        norm.weight = torch.nn.Parameter(scale.detach().float() - 1, requires_grad=False)

    with torch.no_grad():
        for block, layer in zip(tl.blocks, base.layers):
            for hf_name, tl_name in norms:
                put(layer.get_submodule(hf_name), block.get_submodule(tl_name).w)
        put(base.norm, tl.ln_final.w)
        base.embed_tokens.weight = torch.nn.Parameter(tl.embed.W_E.detach().clone(), requires_grad=False)
        base.embed_tokens.embed_scale = torch.ones((), dtype=torch.float32, device=tl.embed.W_E.device)


def _gemma_base(hf_model: PreTrainedModel):
    """The text model holding `layers`, `embed_tokens` and `norm` (under `language_model` in a
    Gemma 3 with a vision tower)."""
    inner = getattr(hf_model, "model", hf_model)
    language = getattr(hf_model, "language_model", None) or getattr(inner, "language_model", None)
    return getattr(language, "model", language) if language is not None else inner


# --- config mapping ------------------------------------------------------------------------------
def tl_config_from_hf(hf_config: Any) -> dict:
    """`HookedTransformerConfig` kwargs for a transformers config (architecture, RoPE, windows)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _FAMILIES:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not supported by kvnotes' Hugging Face loader; "
            f"supported: {', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[model_type](hf_config)


def _llama(c) -> dict:
    _refuse_biases(c, "attention_bias", "mlp_bias")
    return _assemble(c, "LlamaForCausalLM", ["full_attention"] * c.num_hidden_layers)


def _mistral(c) -> dict:
    """Every layer slides when `sliding_window` is set (None: all global)."""
    kind = "sliding_attention" if getattr(c, "sliding_window", None) else "full_attention"
    return _assemble(c, "MistralForCausalLM", [kind] * c.num_hidden_layers)


def _qwen2(c) -> dict:
    """q/k/v biases convert; with `use_sliding_window`, layers >= max_window_layers slide."""
    return _assemble(c, "Qwen2ForCausalLM", _layer_types(c))


def _qwen3(c) -> dict:
    _refuse_biases(c, "attention_bias")
    return {**_assemble(c, "Qwen3ForCausalLM", _layer_types(c)), "use_qk_norm": True}


def _gemma(c) -> dict:
    """Gemma 1: attention scale is TL's default sqrt(d_head), as in HF."""
    _refuse_gemma_extras(c)
    return _assemble(c, "GemmaForCausalLM", ["full_attention"] * c.num_hidden_layers)


def _gemma2(c) -> dict:
    _refuse_gemma_extras(c)
    return {**_assemble(c, "Gemma2ForCausalLM", _layer_types(c)), **_gemma_sandwich(c)}


def _gemma3_text(c) -> dict:
    _refuse_gemma_extras(c)
    return {**_assemble(c, "Gemma3ForCausalLM", _layer_types(c)), **_gemma_sandwich(c), "use_qk_norm": True}


def _gemma3(c) -> dict:
    """Multimodal Gemma 3: the text tower only (TL's converter skips the vision tower)."""
    return {**_gemma3_text(c.text_config), "original_architecture": "Gemma3ForConditionalGeneration"}


def _gpt2(c) -> dict:
    """GPT-2: LayerNorm with biases, an ungated MLP, learned absolute positions added at the input
    (keys carry no rotation), tied embeddings (the converter reads `lm_head`, which is `wte`)."""
    refused = [f for f in ("scale_attn_by_inverse_layer_idx", "add_cross_attention") if getattr(c, f, False)]
    if refused:
        raise UnsupportedArchitecture(
            f"gpt2 with {', '.join(refused)}=True: the notebook engine does not reproduce it exactly"
        )
    if c.activation_function not in _ACTIVATIONS:
        raise UnsupportedArchitecture(
            f"gpt2: activation {c.activation_function!r} has no TransformerLens equivalent here; "
            f"supported: {sorted(_ACTIVATIONS)}"
        )
    return dict(
        d_model=c.n_embd,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=c.n_inner or 4 * c.n_embd,
        n_layers=c.n_layer,
        d_vocab=c.vocab_size,
        n_ctx=min(c.n_positions, N_CTX_CAP),  # the converter keeps W_pos's first n_ctx rows
        eps=float(c.layer_norm_epsilon),
        act_fn=_ACTIVATIONS[c.activation_function],
        normalization_type="LN",
        gated_mlp=False,
        positional_embedding_type="standard",
        use_attn_scale=bool(getattr(c, "scale_attn_weights", True)),
        original_architecture="GPT2LMHeadModel",
        init_weights=False,
    )


_FAMILIES: dict[str, Callable[[Any], dict]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "gemma3": _gemma3,
}


def _assemble(c, architecture: str, layer_types: list[str]) -> dict:
    """The fields every supported family shares, plus its windows and RoPE."""
    d_head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    windows = _windows(c, layer_types)
    return dict(
        d_model=c.hidden_size,
        d_head=d_head,
        n_heads=c.num_attention_heads,
        n_key_value_heads=None if kv == c.num_attention_heads else kv,
        d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers,
        d_vocab=c.vocab_size,
        n_ctx=min(c.max_position_embeddings, N_CTX_CAP),
        eps=float(c.rms_norm_eps),
        act_fn=_act_fn(c),
        normalization_type="RMS",
        final_rms=True,
        gated_mlp=True,
        positional_embedding_type="rotary",
        rotary_dim=d_head,
        rotary_adjacent_pairs=False,
        original_architecture=architecture,
        init_weights=False,
        **windows,
        **_rope(c, windows.get("attn_types")),
    )


def _gemma_sandwich(c) -> dict:
    """Gemma 2/3: post-sublayer norms, sqrt(query_pre_attn_scalar) scale, optional softcaps."""
    out = {"use_normalization_before_and_after": True, "attn_scale": math.sqrt(c.query_pre_attn_scalar)}
    if getattr(c, "attn_logit_softcapping", None) is not None:
        out["attn_scores_soft_cap"] = float(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None) is not None:
        out["output_logits_soft_cap"] = float(c.final_logit_softcapping)
    return out


def _layer_types(c) -> list[str]:
    return list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)


def _windows(c, layer_types: list[str]) -> dict:
    """`use_local_attn` / `window_size` / `attn_types` from HF layer types and `sliding_window`."""
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedArchitecture(
            f"{c.model_type}: layer types {unknown} are not supported (only sliding_attention "
            "and full_attention)"
        )
    window = getattr(c, "sliding_window", None)
    if window is None or "sliding_attention" not in layer_types:
        return {}
    attn_types = ["local" if t == "sliding_attention" else "global" for t in layer_types]
    return {"use_local_attn": True, "window_size": int(window), "attn_types": attn_types}


def _act_fn(c) -> str:
    name = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
    if name not in _ACTIVATIONS:
        raise UnsupportedArchitecture(
            f"{c.model_type}: activation {name!r} has no TransformerLens equivalent here; "
            f"supported: {sorted(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


# --- RoPE ----------------------------------------------------------------------------------------
def _rope(c, attn_types: list[str] | None) -> dict:
    """rotary_base (+ rotary_base_local) and the scaling fields, from `rope_parameters`.

    transformers 5 keeps RoPE in `config.rope_parameters`, nested per layer type for Gemma 3
    (`{"full_attention": {...}, "sliding_attention": {...}}`); older configs use `rope_theta`
    and `rope_scaling`.
    """
    params = _rope_parameters(c)
    nested = "full_attention" in params or "sliding_attention" in params
    glob = params.get("full_attention", {}) if nested else params
    local = params.get("sliding_attention", glob) if nested else params
    has_local = "local" in (attn_types or ())
    separate_local = has_local and local is not glob  # sliding layers have their own RoPE
    out: dict[str, Any] = {"rotary_base": _theta(glob, c)}
    if separate_local:
        if _rope_type(local) != "default":
            raise UnsupportedArchitecture(
                f"{c.model_type}: RoPE scaling {_rope_type(local)!r} on sliding layers is not supported"
            )
        out["rotary_base_local"] = _theta(local, c)
    # TL applies linear scaling to global layers only, and llama3 scaling to every layer; each
    # matches HF only when HF scales exactly those layers.
    return {
        **out,
        **_rope_scaling(c, glob, linear_ok=separate_local or not has_local, llama3_ok=not separate_local),
    }


def _rope_parameters(c) -> dict:
    params = getattr(c, "rope_parameters", None)
    if params:
        return dict(params)
    legacy = dict(getattr(c, "rope_scaling", None) or {})
    theta = getattr(c, "rope_theta", None)
    return {**legacy, **({"rope_theta": theta} if theta is not None else {})}


def _rope_type(params: dict) -> str:
    return params.get("rope_type") or params.get("type") or "default"


def _theta(params: dict, c) -> float:
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    return float(theta) if theta is not None else 10000.0


def _rope_scaling(c, params: dict, *, linear_ok: bool, llama3_ok: bool) -> dict:
    kind = _rope_type(params)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitecture(f"{c.model_type}: partial_rotary_factor is not supported")
    if kind == "default":
        return {}
    if kind == "linear" and linear_ok:
        return {"rotary_scaling_factor": float(params["factor"])}
    if kind == "llama3" and llama3_ok:
        return {
            "use_NTK_by_parts_rope": True,
            "NTK_original_ctx_len": int(
                params.get("original_max_position_embeddings", c.max_position_embeddings)
            ),
            "NTK_by_parts_low_freq_factor": float(params.get("low_freq_factor", 1.0)),
            "NTK_by_parts_high_freq_factor": float(params.get("high_freq_factor", 4.0)),
            "NTK_by_parts_factor": float(params.get("factor", 8.0)),
        }
    raise UnsupportedArchitecture(
        f"{c.model_type}: RoPE type {kind!r} is not supported here (supported: default, llama3, "
        "and linear on global layers)"
    )


def _refuse_biases(c, *fields: str) -> None:
    on = [f for f in fields if getattr(c, f, False)]
    if on:
        raise UnsupportedArchitecture(
            f"{c.model_type} with {', '.join(on)}=True: TransformerLens's converter drops those biases"
        )


def _refuse_gemma_extras(c) -> None:
    _refuse_biases(c, "attention_bias")
    if getattr(c, "use_bidirectional_attention", False):
        raise UnsupportedArchitecture(f"{c.model_type} with use_bidirectional_attention=True is not causal")


def _bos_fields(tokenizer: PreTrainedTokenizerBase) -> dict:
    """Whether the tokenizer adds BOS itself, and whether TL should prepend one by default."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a")["input_ids"]
    return {
        "tokenizer_prepends_bos": bos is not None and len(ids) > 0 and ids[0] == bos,
        "default_prepend_bos": bos is not None,
    }


# --- fetching ------------------------------------------------------------------------------------
def _fetch(load: Callable, source: str, local: bool, **kwargs: Any):
    """`load(source)` offline first; a hub name then tries the hub unless HF_HUB_OFFLINE is set."""
    if local:
        if not (Path(source) / "config.json").is_file():
            raise UnknownModelError(
                f"{source} is a directory but has no config.json, so it is not a Hugging Face "
                "checkpoint; it needs config.json, the weights (*.safetensors) and the "
                "tokenizer files"
            )
        try:
            return load(source, local_files_only=True, **kwargs)
        except OSError as e:
            raise UnknownModelError(
                f"{source} is a directory but not a loadable Hugging Face checkpoint ({e}); it "
                "needs config.json, the weights (*.safetensors) and the tokenizer files"
            ) from e
    try:
        return load(source, local_files_only=True, **kwargs)
    except (OSError, ValueError) as cache_miss:
        if _offline():
            raise UnknownModelError(_unreachable(source, "HF_HUB_OFFLINE is set")) from cache_miss
    try:
        return load(source, **kwargs)
    except (OSError, ValueError) as e:
        if _hub_answered(e):
            raise UnknownModelError(
                f"{source!r} is not a local directory and the Hugging Face hub has no model by "
                f"that name that we may read ({e}). Check the name, or pass a local checkpoint "
                "directory, or use a built-in model name"
            ) from e
        raise UnknownModelError(_unreachable(source, str(e).splitlines()[0])) from e


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or os.environ.get(
        "TRANSFORMERS_OFFLINE", ""
    ).upper() in ("1", "ON", "YES", "TRUE")


def _unreachable(name: str, why: str) -> str:
    return (
        f"cannot load {name!r}: it is not a local directory, it is not in the Hugging Face cache, "
        f"and the Hugging Face hub could not be reached ({why}). Download the checkpoint where the "
        f"hub is reachable (e.g. `hf download {name} --local-dir DIR`), copy it here and pass that "
        "local directory, or use a built-in model name"
    )


def _hub_answered(e: BaseException) -> bool:
    """Whether the hub was reached and refused (no such repo, gated), rather than unreachable."""
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, RepositoryNotFoundError

    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, (RepositoryNotFoundError, GatedRepoError, EntryNotFoundError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
