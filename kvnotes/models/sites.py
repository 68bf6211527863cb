"""Where TransformerLens's hook names live in a Hugging Face decoder layer, per model family.

The nnsight model answers to these names and the nnsight backend fires them at these modules (each a
`ModuleSite`), so the same analysis code runs on both backends (`MODULE_SITES`; `kvnotes.hooks.SITES`
is another thing: the per-layer point names of the hook helpers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModuleSite:
    """Where a TransformerLens hook point lives in a Hugging Face decoder layer.

    path: the module, relative to the decoder layer (`""`: the layer itself).
    port: "input" (the module's first argument), "output", or "output0" (first of a tuple).
    heads: view the last axis as `[n_heads, d_head]` ("q"), `[n_kv_heads, d_head]` ("kv"), or not.
    writable: a hook may return a replacement. A site whose module input is not the residual
        stream itself (the residual is added outside it) is read-only: writing it would change the
        next sublayer's input but not the residual, which is not what the TransformerLens point means.
    """

    path: str
    port: str
    heads: str | None = None
    writable: bool = True


_PLAIN: dict[str, ModuleSite] = {  # Llama, Mistral, Qwen2/3, Gemma 1: pre-norm, one norm per sublayer
    "hook_resid_pre": ModuleSite("", "input"),
    "attn.hook_q": ModuleSite("self_attn.q_proj", "output", heads="q"),
    "attn.hook_k": ModuleSite("self_attn.k_proj", "output", heads="kv"),
    "attn.hook_v": ModuleSite("self_attn.v_proj", "output", heads="kv"),
    "attn.hook_z": ModuleSite("self_attn.o_proj", "input", heads="q"),
    "hook_attn_out": ModuleSite("self_attn", "output0"),
    "hook_resid_mid": ModuleSite("post_attention_layernorm", "input", writable=False),
    "mlp.hook_post": ModuleSite("mlp.down_proj", "input"),
    "hook_mlp_out": ModuleSite("mlp", "output"),
    "hook_resid_post": ModuleSite("", "output"),
}
_SANDWICH: dict[str, ModuleSite] = {  # Gemma 2/3: a norm after each sublayer too
    **_PLAIN,
    "hook_attn_out": ModuleSite("post_attention_layernorm", "output"),
    "hook_resid_mid": ModuleSite("pre_feedforward_layernorm", "input", writable=False),
    "hook_mlp_out": ModuleSite("post_feedforward_layernorm", "output"),
}
MODULE_SITES: dict[str, dict[str, ModuleSite]] = {  # model_type -> hook name -> its module
    "llama": _PLAIN,
    "mistral": _PLAIN,
    "qwen2": _PLAIN,
    "qwen3": _PLAIN,
    "gemma": _PLAIN,
    "gemma2": _SANDWICH,
    "gemma3_text": _SANDWICH,
    "gemma3": _SANDWICH,
}
# The attention internals, fired by kvnotes' own eager attention function (kvnotes.engine.nnsight), in the
# order they fire; a run that hooks or captures one of them runs that call on eager attention.
ATTENTION_SITES = ("attn.hook_attn_scores", "attn.hook_pattern")
# Execution order inside a decoder layer (the order nnsight must visit them in).
ORDER = (
    "hook_resid_pre",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    *ATTENTION_SITES,
    "attn.hook_z",
    "hook_attn_out",
    "hook_resid_mid",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)
