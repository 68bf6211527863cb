"""Loading a model on the nnsight backend: a local Hugging Face checkpoint directory, a hub name, the
embedded Gemma 3 270M (exported once as a checkpoint) or the tiny GPT-2, as an `NNsightModel`
(`kvnotes.engine.nnsight`), or built without weights for remote runs."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch

from kvnotes.engine.nnsight.model import NNsightModel, check_plain_kv, from_lm, from_module
from kvnotes.errors import MissingDependency, UnknownModelError
from kvnotes.models.model import HFSource

_INSTALL = "pip install 'nnsight>=0.8' (a kvnotes dependency: reinstall kvnotes)"


def nnsight_available() -> str | None:
    """None when nnsight imports, else how to install it."""
    try:
        import nnsight  # noqa: F401
    except ImportError:
        return _INSTALL
    return None


def load_nnsight(
    name: str, *, device=None, dtype=None, attn: str | None = None, remote: bool = False
) -> NNsightModel:
    """Load `name` on the nnsight backend: a local Hugging Face checkpoint directory, a hub name,
    or the embedded `gemma-3-270m` (exported once as a checkpoint into the kvnotes cache).

    attn: the attention implementation the model runs ("sdpa", "eager", "flash_attention_2", ...;
        default: transformers' choice, SDPA where the model supports it); a call that hooks
        attention scores or patterns switches to kvnotes' eager attention for that call.
    remote: build the model without its weights (nnsight's meta build: config and tokenizer
        only), for experiments that run on NDIF (`kvnotes.serving.remote`); local runs need the weights.
    device, dtype: where the model runs and in what (default cpu, float32; `kvnotes.models.placement`):
        checkpoints are read in `dtype`, then moved; a remote build ignores `device`.
    """
    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    problem = nnsight_available()
    if problem:
        raise MissingDependency(f"the nnsight backend needs nnsight: {problem}")
    from kvnotes.zoo.catalog import builtin_names
    from kvnotes.zoo.names import EMBEDDED

    if remote:
        return _meta(name)
    if name == EMBEDDED:
        return _from_dir(str(gemma_checkpoint()), EMBEDDED, device, dtype=dtype, attn=attn, local=True)
    path = Path(name).expanduser()
    if path.is_dir():
        return _from_dir(str(path), name, device, dtype=dtype, attn=attn, local=True)
    from kvnotes.zoo.tiny import TINY_HF, tiny_gpt2_hf, tiny_tokenizer

    if name in TINY_HF:  # built by transformers in-process: its own module runs here
        reference = HFSource(what=f"transformers' GPT2LMHeadModel ({name}, rebuilt)", load=tiny_gpt2_hf)
        hf = tiny_gpt2_hf().to(dtype).to(device)
        return from_module(hf, tiny_tokenizer(), name, name, reference, attn or "sdpa")
    if name in builtin_names():
        raise UnknownModelError(
            f"{name} is a TransformerLens-only model (it has no Hugging Face checkpoint); run it on "
            "the transformer-lens backend, or give the nnsight backend a checkpoint directory, a hub "
            "name, or gemma-3-270m"
        )
    if "/" not in name:
        raise UnknownModelError(
            f"unknown model {name!r}: the nnsight backend takes a local Hugging Face checkpoint "
            "directory, a hub name such as 'Qwen/Qwen3-0.6B', or gemma-3-270m"
        )
    return _from_dir(name, name, device, dtype=dtype, attn=attn, local=False)


def gemma_checkpoint() -> Path:
    """The embedded Gemma 3 270M as a Hugging Face checkpoint directory in the kvnotes cache,
    exported from the GGUF once (the same float32 weights the TransformerLens backend runs)."""
    from kvnotes.zoo.cache import default_cache_dir
    from kvnotes.zoo.export import STAMP, cached

    out = default_cache_dir() / "export" / "gemma-3-270m"
    try:
        if json.loads((out / STAMP).read_text()).get("model") == "gemma-3-270m":
            return out
    except (OSError, ValueError):
        pass
    from kvnotes.zoo.gemma import load_gemma_270m

    return cached(load_gemma_270m())


def _from_dir(
    source: str, name: str, device: torch.device, *, dtype: torch.dtype, attn: str | None, local: bool
) -> NNsightModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvnotes.zoo.hf import _fetch

    config = _fetch(AutoConfig.from_pretrained, source, local)
    types = check_plain_kv(config)  # before any weights load
    tokenizer = _fetch(AutoTokenizer.from_pretrained, source, local)
    hf = _fetch(AutoModelForCausalLM.from_pretrained, source, local, dtype=dtype, attn_implementation=attn)
    hf = hf.to(device)  # before the fingerprint, which reads the weights wherever they are
    reference = HFSource(
        what=f"transformers' {type(hf).__name__} from {source}",
        load=lambda: _fetch(
            AutoModelForCausalLM.from_pretrained, source, local, dtype=dtype, attn_implementation="eager"
        ),
    )
    return from_module(hf, tokenizer, name, source, reference, None, types)


def _meta(name: str) -> NNsightModel:
    """`name` as nnsight builds it for remote use: config and tokenizer, modules on the meta device
    (no weights read or downloaded). Only remote experiments can run it."""
    from nnsight.modeling.transformers import TransformersModel
    from transformers import AutoConfig, AutoTokenizer

    from kvnotes.zoo.hf import _fetch

    local = Path(name).expanduser().is_dir()
    source = str(Path(name).expanduser()) if local else name
    config = _fetch(AutoConfig.from_pretrained, source, local)
    types = check_plain_kv(config)
    tokenizer = _fetch(AutoTokenizer.from_pretrained, source, local)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = TransformersModel(source, tokenizer=tokenizer, task="text-generation")
    h = hashlib.sha256(b"nnsight-meta")
    h.update(config.get_text_config().to_json_string(use_diff=False).encode())
    h.update(str(len(tokenizer)).encode())
    return from_lm(name, source, lm, tokenizer, types, h.hexdigest(), None, weights=False)
