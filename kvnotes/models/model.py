"""`KVModel`: what a model is, whatever runs it (name, tokenizer, fingerprint, `ModelFacts`), and
`HFSource`, where its Hugging Face counterpart comes from.

This module imports neither TransformerLens nor the engine: each backend's model class
(`kvnotes.engine.transformer_lens.TransformerLensModel`, `kvnotes.engine.nnsight.NNsightModel`)
lives beside its backend, and the engine maps a model to its backend (`kvnotes.engine.backend_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvnotes.errors import BadArgument


@dataclass(frozen=True)
class HFSource:
    """Where the Hugging Face transformers model holding the same weights comes from, for
    `verify`'s reference invariants: `load()` returns it (eager attention, the weights' dtype)."""

    what: str  # e.g. "transformers' LlamaForCausalLM from /path/to/checkpoint"
    load: Callable[[], Any]
    # `share(model, hf_model)`: give a loaded counterpart, already cast to the model's dtype, the
    # very weights the model computes with, where the conversion changed them (a TransformerLens
    # Gemma holds `1 + w` norm scales and a pre-scaled embedding, each rounded once in the model's
    # dtype); None where casting the counterpart already gives them (the conversion only reshapes)
    share: Callable[[Any, Any], None] | None = None


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What a model is, whatever runs it: the widths and per-layer attention facts kvnotes reads."""

    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (fewer under grouped-query attention)
    d_head: int
    d_model: int
    d_mlp: int | None  # None: no MLP (an attention-only model)
    gated_mlp: bool = True  # a gated MLP (three matrices: gate, in, out), as Llama's and Gemma's
    d_vocab: int  # token ids the embedding takes
    d_vocab_out: int  # logits the unembedding gives
    n_ctx: int  # positions the model takes, as loaded
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for global attention
    rope_bases: tuple[float, ...]  # per layer: its RoPE base (Gemma 3's local layers differ)
    rotary_dims: tuple[int, ...]  # per layer: how many of d_head RoPE rotates
    attn_scores_soft_cap: float | None  # None: no softcap on attention scores
    output_logits_soft_cap: float | None  # None: no softcap on the logits
    norm_after_sublayers: bool  # a norm after each sublayer too (Gemma 2/3's sandwich)
    model_type: str  # the architecture, as its source names it ("llama", "Gemma3ForCausalLM", ...)
    # "rotary": keys carry their position (RoPE); "learned": a position embedding is added to the
    # residual stream at the input (GPT-2, tracr), keys carry none, and no chunk can be moved
    positions: str = "rotary"


@dataclass(frozen=True, eq=False, kw_only=True)
class KVModel:
    """A model the notebook engine runs: its name, tokenizer, fingerprint and facts.

    Hook names (`blocks.3.attn.hook_pattern`, ...) mean what they mean in TransformerLens and
    sae-lens on every backend. `load_model` returns a subclass, `TransformerLensModel` or
    `NNsightModel` (`kvnotes.engine.transformer_lens`, `kvnotes.engine.nnsight`); what only one
    backend can do is asked of the engine by capability (`kvnotes.engine.has(model,
    Capability.WEIGHTS)`, `require(...)`).
    """

    name: str
    tokenizer: Any  # a transformers PreTrainedTokenizerBase (not imported: this module stays neutral)
    fingerprint: str
    facts: ModelFacts
    hf_source: HFSource | None = None  # None: no Hugging Face counterpart (tiny, organisms)

    # --- shape facts -------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.facts.n_layers

    @property
    def n_heads(self) -> int:
        return self.facts.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.facts.n_kv_heads

    @property
    def d_head(self) -> int:
        return self.facts.d_head

    @property
    def n_ctx(self) -> int:
        return self.facts.n_ctx

    def window(self, layer: int) -> int | None:
        """Sliding-window length of `layer`, or None for global attention."""
        return self.facts.windows[layer]

    @property
    def max_window(self) -> int | None:
        windows = [w for w in self.facts.windows if w is not None]
        return max(windows) if windows else None

    def rope_base(self, layer: int) -> float:
        return self.facts.rope_bases[layer]

    # --- what each backend's model class supplies ----------------------------------------------
    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    # --- tokens ------------------------------------------------------------------------------
    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos_id = self.tokenizer.bos_token_id
        return ([bos_id] if bos and bos_id is not None else []) + list(ids)

    def token_strings(self, ids) -> list[str]:
        return [self.tokenizer.decode([int(i)]) for i in ids]

    def answer_token(self, text: str) -> int:
        """The single token id of an answer string such as `" yes"`; errors if it is not one token."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise BadArgument(
                f"answer {text!r} is {len(ids)} tokens under {self.name}'s tokenizer; "
                "pick an answer string that is a single token (often with a leading space)"
            )
        return int(ids[0])

    def __repr__(self) -> str:
        c = self.facts
        return (
            f"KVModel({self.name!r}, layers={c.n_layers}, heads={c.n_heads}/"
            f"{c.n_kv_heads} kv, d_head={c.d_head}, fingerprint={self.fingerprint[:12]})"
        )
