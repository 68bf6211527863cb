"""Tiny seeded random models, one per RoPE variant the engine claims to support exactly.

They exist for fast exactness tests: each builds in well under a second, deterministically.

| name          | what it exercises                                                      |
|---------------|------------------------------------------------------------------------|
| tiny-llama    | full rotary, NeoX half-split pairs, multi-head attention               |
| tiny-gptj     | full rotary, GPT-J adjacent (interleaved) pairs                        |
| tiny-neox     | partial rotary (a quarter of d_head), NeoX pairs, LayerNorm, GELU MLP  |
| tiny-gqa      | grouped-query attention (4 query heads share 2 KV heads)               |
| tiny-gemma2   | alternating sliding-window / global layers, attention and logit softcaps |
| tiny-gemma3   | per-layer RoPE bases (local 1e4, global 1e6), sliding windows, qk-norm, |
|               | one KV head, norms before and after each sublayer                      |
| tiny-attn-only| learned absolute positions, no norms, attention-only blocks (tracr's shape) |
| tiny-gpt2     | a seeded transformers GPT2LMHeadModel (learned positions, LayerNorm with |
|               | biases, gelu_new, tied embeddings) through the Hugging Face loader     |

tiny-gpt2 is built by transformers, not from a TransformerLens config, so `verify` runs it against
transformers' own forward of the same weights (`TINY_HF`, `build_tiny_hf`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

TINY_WINDOW = 8  # sliding window of the tiny local layers: prompts of 40+ tokens exceed it

TINY_BASE = dict(  # what every tiny model shares; TINY_CONFIGS holds what each changes
    d_model=64,
    d_head=16,
    n_heads=4,
    n_layers=3,
    d_mlp=128,
    n_ctx=512,
    positional_embedding_type="rotary",
    normalization_type="RMS",
    final_rms=True,
    act_fn="silu",
    gated_mlp=True,
    rotary_adjacent_pairs=False,
    eps=1e-6,
    default_prepend_bos=True,
    tokenizer_prepends_bos=True,
)

TINY_CONFIGS: dict[str, dict] = {
    "tiny-llama": dict(rotary_dim=16, rotary_base=10000),
    "tiny-gptj": dict(rotary_dim=16, rotary_adjacent_pairs=True, rotary_base=10000),
    "tiny-neox": dict(
        rotary_dim=4,
        rotary_base=10000,
        normalization_type="LN",
        final_rms=False,
        act_fn="gelu_new",
        gated_mlp=False,
        eps=1e-5,
    ),
    "tiny-gqa": dict(rotary_dim=16, n_key_value_heads=2, rotary_base=500000),
    "tiny-gemma2": dict(
        rotary_dim=16,
        n_key_value_heads=2,
        act_fn="gelu_pytorch_tanh",
        use_normalization_before_and_after=True,
        use_local_attn=True,
        window_size=TINY_WINDOW,
        attn_types=["local", "global", "local", "global"],
        n_layers=4,
        attn_scores_soft_cap=50.0,
        output_logits_soft_cap=30.0,
        rotary_base=10000,
    ),
    "tiny-gemma3": dict(
        rotary_dim=16,
        n_key_value_heads=1,
        act_fn="gelu_pytorch_tanh",
        use_qk_norm=True,
        use_normalization_before_and_after=True,
        use_local_attn=True,
        window_size=TINY_WINDOW,
        attn_types=["local", "local", "global", "local"],
        n_layers=4,
        rotary_base=1_000_000,
        rotary_base_local=10_000,
    ),
    "tiny-attn-only": dict(
        positional_embedding_type="standard",
        normalization_type=None,
        final_rms=False,
        attn_only=True,
        gated_mlp=False,
        act_fn="relu",
    ),
}

# Tiny models built as transformers models and converted through `kvnotes.zoo.hf`.
TINY_HF: tuple[str, ...] = ("tiny-gpt2",)

# A small fixed corpus in the register of the built-in tasks, so the BPE learns useful merges.
_CORPUS = """
Policy: an order may be cancelled while its status is pending. Once an order has shipped,
deny the cancellation and offer a return instead. Refunds are allowed within 30 days.
Account access: an admin may reset passwords; a suspended user may not. Viewer accounts
can read but not write. Answer with one word: cancel or deny, allow or deny, yes or no.
order_status: pending. order_status: shipped. account_role: admin. account_role: suspended_user.
Customer: Alice, Bob, Carol, Dave, Erin, Frank, Grace, Heidi. Order id: 1234, 5678, 9012.
Q: Can the order be cancelled? A: cancel. Q: Can the order be cancelled? A: deny.
[STATE UPDATE] order_status -> shipped; overrides any earlier value and conclusion.
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9
, . ; : ! ? ( ) [ ] { } < > / \\ - _ = + * & % $ # @ " '
"""


@lru_cache(maxsize=1)
def tiny_tokenizer():
    """A deterministic byte-level BPE tokenizer (vocab 512) trained on a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<pad>", "<eos>", "<bos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


def build_tiny(name: str, seed: int = 0, *, device=None, dtype=None, **changes):
    """Build tiny model `name` (see the table above) with weights drawn from `seed` in float32, then
    cast to `dtype` and moved to `device` once (`kvnotes.models.placement`; default cpu, float32).
    `changes` replace config fields (`n_layers=1`: a model whose every K/V depends on its own token
    and position alone, so recomputing a changed slot is exact)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from kvnotes.engine.transformer_lens.model import from_hooked
    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    tokenizer = tiny_tokenizer()
    cfg = HookedTransformerConfig(
        **{**TINY_BASE, **TINY_CONFIGS[name], **changes},
        d_vocab=len(tokenizer),
        model_name=name,
        seed=seed,
        original_architecture="kvnotes-tiny",
    )
    torch.manual_seed(seed)
    tl = HookedTransformer(cfg, move_to_device=False)
    with torch.no_grad():  # sharper attention than the default init, so masking bugs show
        for block in tl.blocks:
            block.attn.W_Q.mul_(4.0)
    return from_hooked(name, tl, tokenizer, device=device, dtype=dtype)


def compiled_organism(name: str, config, write, *, device=None, dtype=None):
    """An organism whose weights are written, not trained (the gated and mixed organisms): a
    HookedTransformer of `config(name, d_vocab)` on the tiny tokenizer, its initial draw overwritten
    by `write(tl)` in float32, then cast to `dtype` and moved to `device` once. The caller's RNG is
    left as it was."""
    from transformer_lens import HookedTransformer

    from kvnotes.engine.transformer_lens.model import from_hooked
    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):  # the initial draw is overwritten; keep the caller's RNG
        tl = HookedTransformer(config(name, len(tokenizer)), move_to_device=False)
    write(tl)
    return from_hooked(name, tl, tokenizer, device=device, dtype=dtype)


def tiny_gpt2_hf(seed: int = 0):
    """tiny-gpt2 as transformers builds it: a `GPT2LMHeadModel` (3 layers, 4 heads, d_model 64,
    512 positions, the tiny tokenizer's vocabulary), eager attention, weights drawn from `seed`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_tokenizer()
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_positions=512,
        n_embd=64,
        n_layer=3,
        n_head=4,
        activation_function="gelu_new",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(cfg)
    hf.set_attn_implementation("eager")
    _sharpen(hf, seed)
    return hf.eval()


def _sharpen(hf, seed: int) -> None:
    """Weights large enough that attention is sharp and every position embedding differs by O(1),
    so a wrong position or mask shows in the logits (GPT-2's init, std 0.02, is nearly uniform);
    norms near 1 with biases. Conv1D weights are `[in, out]`: scaled by 1.5 / sqrt(in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if ".ln_" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(("wte.weight", "wpe.weight")):
                p.copy_(noise)
            elif p.ndim == 2:
                p.copy_(noise * 1.5 / p.shape[0] ** 0.5)
            else:
                p.copy_(0.1 * noise)


def build_tiny_hf(name: str, seed: int = 0, *, device=None, dtype=None):
    """Build `name` in `TINY_HF` with transformers and convert it through the Hugging Face loader
    (in float32, then cast to `dtype` and moved to `device`); its `hf_source` rebuilds the same
    transformers model (float32, on the CPU), `verify`'s independent reference."""
    from kvnotes.models.model import HFSource
    from kvnotes.models.placement import placement
    from kvnotes.zoo.hf import tl_from_hf_model

    device, dtype = placement(device, dtype)
    if name not in TINY_HF:
        raise KeyError(name)
    source = HFSource(
        what=f"transformers' GPT2LMHeadModel built by kvnotes.zoo.tiny ({name}, seed {seed})",
        load=lambda: tiny_gpt2_hf(seed),
    )
    return tl_from_hf_model(
        tiny_gpt2_hf(seed), tiny_tokenizer(), name, hf_source=source, device=device, dtype=dtype
    )
