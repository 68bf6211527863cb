"""Tiny random Hugging Face checkpoints of every supported family, built offline in seconds.

Each family is a seeded random transformers model saved with the tiny tokenizer. Weights are drawn
large enough that attention is sharp, so a wrong window, RoPE base or scale shows up in the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

from kvnotes.zoo.tiny import tiny_tokenizer

N_TOKENS = 40
WINDOW = 8  # smaller than the prompt, so sliding layers really slide
ATOL = 1e-4

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
_GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _gemma3_rope(full: dict) -> dict:
    return {
        "full_attention": {"rope_theta": 1_000_000.0, **full},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }


FAMILIES: dict[str, tuple[type, dict]] = {
    "llama-gqa": (tf.LlamaConfig, {"num_key_value_heads": 2}),
    "llama3-rope-scaling": (tf.LlamaConfig, {"num_key_value_heads": 2, "rope_parameters": _LLAMA3_ROPE}),
    "mistral-window-gqa": (tf.MistralConfig, {"num_key_value_heads": 2, "sliding_window": WINDOW}),
    "qwen2-bias": (tf.Qwen2Config, {"num_key_value_heads": 2}),
    "qwen2-sliding": (
        tf.Qwen2Config,
        {
            "num_key_value_heads": 2,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
        },
    ),
    "qwen3-qknorm-gqa": (tf.Qwen3Config, {"num_key_value_heads": 2, "head_dim": 16}),
    "gemma-mha": (tf.GemmaConfig, {"num_key_value_heads": 4, "head_dim": 16}),
    "gemma2-softcaps-window": (
        tf.Gemma2Config,
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3-text": (
        tf.Gemma3TextConfig,
        {
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": _GEMMA3_TYPES,
            "query_pre_attn_scalar": 32,
            "rope_parameters": _gemma3_rope({"rope_type": "default"}),
        },
    ),
    "gemma3-linear-rope": (
        tf.Gemma3TextConfig,
        {
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": _GEMMA3_TYPES,
            "rope_parameters": _gemma3_rope({"rope_type": "linear", "factor": 8.0}),
        },
    ),
}


def _config(cls: type, extra: dict):
    tok = tiny_tokenizer()
    n_layers = len(extra.get("layer_types", ())) or 3
    base = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "vocab_size": len(tok),
        "max_position_embeddings": 128,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    return cls(**{**base, **extra})


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Large random weights (sharp attention); norms stay near init (1, or 0 in Gemma's 1+w)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.add_(0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            elif p.ndim == 2:
                p.copy_(noise * 1.5 / p.shape[1] ** 0.5)
            else:
                p.copy_(0.1 * noise)


def build_checkpoint(name: str, path: Path, *, families: dict | None = None):
    """Save family `name` to `path`; return (the eager transformers model, prompt ids, its logits)."""
    cls, extra = (families or FAMILIES)[name]
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(_config(cls, extra), attn_implementation="eager")
    _randomize(hf, seed=0)
    hf.eval()
    hf.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    tok = tiny_tokenizer()
    g = torch.Generator().manual_seed(1)
    ids = [tok.bos_token_id] + torch.randint(3, len(tok), (N_TOKENS - 1,), generator=g).tolist()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return hf, ids, logits
