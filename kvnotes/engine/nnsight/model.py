"""`NNsightModel`: a Hugging Face transformers model, wrapped by nnsight, as a `KVModel`, and the
pieces that build one (`from_module`, `from_lm`, `check_plain_kv`).

A notebook's layout is the layout of a Hugging Face cache: per layer, post-RoPE keys and values
`[batch, kv_head, slot, d_head]`, so the backend (`backend.py`) runs the model's own forward on the
notebook's slots. This module says what a model is: its facts, windows, RoPE bases, and which hook
names it answers to. The loaders that find a checkpoint and call `from_module` are in
`kvnotes.zoo.nnsight`.

Hook names are TransformerLens's (`blocks.{l}.attn.hook_z`, `blocks.{l}.hook_resid_post`, ...),
mapped per family to nnsight module paths in `kvnotes.models.sites.MODULE_SITES`: the same analysis
code runs on both backends.

Where a family keeps its layers and its positions is a `Layout`: RoPE decoders (`model.layers`, a
`model.rotary_emb`) and GPT-2 (`transformer.h`, learned positions `wpe` added at the input, which
the forward takes as `position_ids`, so a notebook runs there exactly; moving a chunk refuses).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from kvnotes.errors import BadArgument, UnsupportedArchitecture
from kvnotes.models.model import KVModel, ModelFacts
from kvnotes.models.sites import ATTENTION_SITES, MODULE_SITES, ORDER, ModuleSite

# Layer types whose cache is a plain per-layer K/V over every token (or a window of them).
_PLAIN_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Model types whose cache is not a per-layer K/V of every token: state-space and recurrent models,
# hybrids with such layers, and caches that store something else.
_NOT_KV = {
    "mamba": "a state-space model: its cache is a recurrent state, not keys and values",
    "mamba2": "a state-space model: its cache is a recurrent state, not keys and values",
    "falcon_mamba": "a state-space model: its cache is a recurrent state, not keys and values",
    "rwkv": "a recurrent model: its cache is a recurrent state, not keys and values",
    "recurrent_gemma": "a recurrent model (Griffin): most layers keep a recurrent state",
    "jamba": "a hybrid with Mamba layers, whose cache is a recurrent state",
    "zamba": "a hybrid with Mamba layers, whose cache is a recurrent state",
    "zamba2": "a hybrid with Mamba layers, whose cache is a recurrent state",
    "bamba": "a hybrid with Mamba layers, whose cache is a recurrent state",
    "falcon_h1": "a hybrid with Mamba layers, whose cache is a recurrent state",
    "granitemoehybrid": "a hybrid with Mamba layers, whose cache is a recurrent state",
    "nemotron_h": "a hybrid with Mamba layers, whose cache is a recurrent state",
    "lfm2": "a hybrid with convolution layers, whose cache is a convolution state",
    "qwen3_next": "a hybrid with linear-attention layers, whose cache is a recurrent state",
    "minimax": "a hybrid with linear-attention layers, whose cache is a recurrent state",
    "xlstm": "a recurrent model: its cache is a recurrent state, not keys and values",
}


@dataclass(frozen=True)
class Layout:
    """Where a transformers family keeps its decoder layers, and how it keeps positions."""

    decoder: str  # the decoder module under the causal LM ("model", "transformer")
    layers: str  # its list of layers ("layers", "h")
    positions: str  # "rotary" (a `rotary_emb` beside the layers) or "learned" (added at the input)
    probes: tuple[str, str]  # a weight of the first layer and one of the last, for the fingerprint
    gated_mlp: bool = True

    def layer_list(self, hf):
        return getattr(getattr(hf, self.decoder), self.layers)


_ROPE = Layout("model", "layers", "rotary", ("self_attn.q_proj.weight", "mlp.down_proj.weight"))
LAYOUTS: dict[str, Layout] = {  # model_type -> layout; every other family: `_ROPE`
    "gpt2": Layout("transformer", "h", "learned", ("attn.c_attn.weight", "mlp.c_proj.weight"), False),
}


def layout(config) -> Layout:
    return LAYOUTS.get(getattr(config.get_text_config(), "model_type", ""), _ROPE)


@dataclass(frozen=True, eq=False, kw_only=True)
class NNsightModel(KVModel):
    """A `KVModel` on nnsight: a Hugging Face causal LM (`hf`) wrapped by nnsight (`lm`).

    The engine runs `hf` itself, and hooks are nnsight interventions on its module tree. `lm` is
    nnsight's model object, for the user's own interventions (`kvnotes.engine.nnsight.feed`).
    """

    lm: Any = None  # nnsight.modeling.transformers.TransformersModel
    hf: Any = None  # the transformers PreTrainedModel inside it
    layer_types: tuple[str, ...] = ()
    source: str = ""
    weights: bool = True  # False: built without weights for remote runs (load_nnsight(remote=True))

    @property
    def text_config(self):
        return self.hf.config.get_text_config()

    @property
    def layout(self) -> Layout:
        return layout(self.hf.config)

    @property
    def layers(self):
        return self.layout.layer_list(self.hf)

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    def site(self, name: str) -> tuple[int, str, ModuleSite | None]:
        """(layer, site name, ModuleSite) for a hook name such as `blocks.3.attn.hook_z`; None
        for the attention internals. Errors name the sites this backend has."""
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blocks" or not parts[1].isdigit():
            raise BadArgument(f"hook {name!r} is not a per-layer point; {self._known()}")
        layer, what = int(parts[1]), parts[2]
        if not 0 <= layer < self.n_layers:
            raise BadArgument(f"hook {name!r}: {self.name} has layers 0..{self.n_layers - 1}")
        if what in ATTENTION_SITES:
            return layer, what, None
        sites = MODULE_SITES.get(self.facts.model_type)
        if sites is None:
            raise BadArgument(
                f"hook {name!r}: kvnotes has no map of {self.facts.model_type!r} modules to hook names; "
                "write the intervention in nnsight directly (kvnotes.engine.nnsight.feed), or use a family "
                f"it maps: {', '.join(sorted(MODULE_SITES))}"
            )
        if what not in sites:
            raise BadArgument(f"hook {name!r}: {self._known()}")
        return layer, what, sites[what]

    def hook_names(self) -> list[str]:
        """Every hook name this model answers to, in execution order."""
        sites = MODULE_SITES.get(self.facts.model_type, {})
        have = [s for s in ORDER if s in sites or s in ATTENTION_SITES]
        return [f"blocks.{l}.{s}" for l in range(self.n_layers) for s in have]

    def _known(self) -> str:
        sites = [s for s in ORDER if s in MODULE_SITES.get(self.facts.model_type, {}) or s in ATTENTION_SITES]
        return f"the nnsight backend's hook points are blocks.{{layer}}.{{{', '.join(sites)}}}"

    def __repr__(self) -> str:
        c = self.facts
        return (
            f"NNsightModel({self.name!r}, {type(self.hf).__name__}, layers={c.n_layers}, heads={c.n_heads}/"
            f"{c.n_kv_heads} kv, d_head={c.d_head}, fingerprint={self.fingerprint[:12]})"
        )


# --- checks ---------------------------------------------------------------------------------------
def check_plain_kv(config) -> tuple[str, ...]:
    """The layer types of a config whose cache is a plain per-layer K/V, or a clear refusal."""
    c = config.get_text_config()
    why = _NOT_KV.get(getattr(config, "model_type", "")) or _NOT_KV.get(getattr(c, "model_type", ""))
    if why:
        raise UnsupportedArchitecture(
            f"{config.model_type} is {why}; a kvnotes notebook is per-layer keys and values of "
            "every token, so this model cannot run on either backend"
        )
    if getattr(c, "is_encoder_decoder", False) or getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitecture(
            f"{config.model_type} is an encoder-decoder model; kvnotes runs decoder-only causal LMs"
        )
    types = tuple(getattr(c, "layer_types", None) or ())
    odd = sorted(set(types) - _PLAIN_LAYER_TYPES)
    if odd:
        raise UnsupportedArchitecture(
            f"{config.model_type} has layers of type {', '.join(odd)}, whose cache is not a plain "
            "per-layer K/V over the tokens; kvnotes supports full and sliding-window attention layers"
        )
    return types


def _windows(c, types: tuple[str, ...]) -> tuple[int | None, ...]:
    n = c.num_hidden_layers
    w = getattr(c, "sliding_window", None)
    if types:
        return tuple(w if t == "sliding_attention" else None for t in types)
    if getattr(c, "model_type", "") == "mistral" and w:
        return (w,) * n
    return (None,) * n


def _facts(hf, c, types: tuple[str, ...]) -> ModelFacts:
    n_heads = c.num_attention_heads
    d_head = getattr(c, "head_dim", None) or c.hidden_size // n_heads
    n = c.num_hidden_layers
    kind = layout(hf.config)
    rotary = kind.positions == "rotary"
    return ModelFacts(
        n_layers=n,
        n_heads=n_heads,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or n_heads,
        d_head=d_head,
        d_model=c.hidden_size,
        d_mlp=getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size,
        gated_mlp=kind.gated_mlp,  # Llama, Qwen and Gemma gate their MLPs; GPT-2 does not
        d_vocab=c.vocab_size,
        d_vocab_out=hf.get_output_embeddings().weight.shape[0],
        n_ctx=getattr(c, "max_position_embeddings", 2048),
        windows=_windows(c, types),
        rope_bases=tuple(_rope_base(c, types, l) if rotary else 0.0 for l in range(n)),
        rotary_dims=(int(d_head * getattr(c, "partial_rotary_factor", 1.0)) if rotary else 0,) * n,
        attn_scores_soft_cap=getattr(c, "attn_logit_softcapping", None) or None,
        output_logits_soft_cap=getattr(c, "final_logit_softcapping", None) or None,
        norm_after_sublayers=c.model_type in ("gemma2", "gemma3_text", "gemma3"),
        model_type=c.model_type,
        positions=kind.positions,
    )


def _rope_base(c, types: tuple[str, ...], layer: int) -> float:
    """The RoPE base of `layer` in a text config (per layer type where the config says so)."""
    params = getattr(c, "rope_parameters", None) or {}
    if types and types[layer] in params:
        params = params[types[layer]]
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def _fingerprint(hf, tokenizer) -> str:
    h = hashlib.sha256(b"nnsight")
    h.update(hf.config.get_text_config().to_json_string(use_diff=False).encode())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items())[:: max(1, len(vocab) // 4096)]).encode())
    dtype = hf.get_input_embeddings().weight.dtype
    if dtype != torch.float32:  # a float32 model's fingerprint stands as it was
        h.update(f"dtype {dtype}".encode())  # a notebook's K/V are in the model's dtype
    kind = layout(hf.config)
    layers = kind.layer_list(hf)
    first, last = (layers[i].get_parameter(p) for i, p in zip((0, -1), kind.probes))
    with torch.no_grad():
        for t in (hf.get_input_embeddings().weight[:4], first[:4], last[:, :4]):
            h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


# --- building ---------------------------------------------------------------------------------------
def from_module(hf, tokenizer, name: str, source: str, reference, attn, types=None) -> NNsightModel:
    """A loaded transformers causal LM as an `NNsightModel` (attn: switch its attention first)."""
    from nnsight.modeling.transformers import TransformersModel

    types = check_plain_kv(hf.config) if types is None else types
    if attn is not None:
        hf.set_attn_implementation(attn)
    hf.eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    kind = layout(hf.config)
    decoder = getattr(hf, kind.decoder, None)
    if not hasattr(decoder, kind.layers) or (
        kind.positions == "rotary" and not hasattr(decoder, "rotary_emb")
    ):
        raise UnsupportedArchitecture(
            f"{type(hf).__name__} keeps its decoder layers or rotary embedding elsewhere than "
            f"{kind.decoder}.{kind.layers} / {kind.decoder}.rotary_emb; kvnotes' nnsight backend "
            "needs both to read the cache"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = TransformersModel(hf, tokenizer=tokenizer, task="text-generation")
    return from_lm(name, source, lm, tokenizer, types, _fingerprint(hf, tokenizer), reference)


def from_lm(name, source, lm, tokenizer, types, fingerprint, reference, weights: bool = True) -> NNsightModel:
    """nnsight's model object `lm` (a `TransformersModel`) as an `NNsightModel`."""
    hf = lm._module
    c = hf.config.get_text_config()
    return NNsightModel(
        name=name,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        hf_source=reference,
        lm=lm,
        hf=hf,
        facts=_facts(hf, c, types),
        layer_types=types,
        source=source,
        weights=weights,
    )
