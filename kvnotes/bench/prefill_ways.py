"""The ways the prefill bench runs, each a timed call and an untimed readout of what it computed
(`CALLS`): the notebook engine on each backend, the Hugging Face twin fed in chunks and in one
forward, and TransformerLens `run_with_cache`; and the comparison of their outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvnotes import engine, ops
from kvnotes.bench.common import text_ids
from kvnotes.engine import hooked, run
from kvnotes.engine.nnsight.model import NNsightModel
from kvnotes.errors import BadArgument
from kvnotes.models.model import KVModel
from kvnotes.types import Float, Tensor


def context_ids(model: KVModel, n: int) -> list[int]:
    """`n` token ids: BOS (where the tokenizer has one), then neutral policy-like lines."""
    bos = model.encode("")
    return [*bos, *text_ids(model, n - len(bos))][:n]


def compared_layers(model: KVModel) -> list[int]:
    """The layers whose keys and values are compared: the first sliding-window layer and the last
    global one where the model has both, else the first and the last."""
    local = [l for l in range(model.n_layers) if model.window(l) is not None]
    full = [l for l in range(model.n_layers) if model.window(l) is None]
    return [local[0], full[-1]] if local and full else sorted({0, model.n_layers - 1})


@dataclass(frozen=True, eq=False)
class Outcome:
    """What a way's output is checked on: the last position's logits and, per compared layer, the
    post-RoPE keys and the values it holds, oldest slot first."""

    logits: Float[Tensor, " d_vocab"]
    keys: tuple[Float[Tensor, "n_kv_heads _slot d_head"], ...]  # slots differ by layer
    values: tuple[Float[Tensor, "n_kv_heads _slot d_head"], ...]


def device_of(model: KVModel) -> torch.device:
    return model.device


@dataclass(frozen=True, eq=False)
class Runners:
    """What the ways run on: the TransformerLens-backend model, its Hugging Face twin and the
    nnsight-backend model of the same weights (either may be None: that way is skipped)."""

    model: KVModel
    hf: Any = None
    nn: NNsightModel | None = None

    @property
    def nnsight(self) -> NNsightModel:
        """The nnsight-backend model, for the ways that run on it (run only where it is given)."""
        if self.nn is None:
            raise BadArgument("this way runs on the nnsight backend, and no nnsight model was given")
        return self.nn


def _kvnotes(r: Runners, ids: list[int]):
    return ops.prefill(r.model, ids)


def _kvnotes_nnsight(r: Runners, ids: list[int]):
    return ops.prefill(r.nnsight, ids)


def _kvnotes_readout(r: Runners, nb, ids: list[int], layers: list[int]) -> Outcome:
    return _notebook_readout(r.model, nb, ids, layers)


def _kvnotes_nnsight_readout(r: Runners, nb, ids: list[int], layers: list[int]) -> Outcome:
    return _notebook_readout(r.nnsight, nb, ids, layers)


def _notebook_readout(model: KVModel, nb, ids: list[int], layers: list[int]) -> Outcome:
    # the last token again at its own position, not written: it replaces its slot, so it attends to
    # exactly what it attended to in the prefill; one token's compute, for its logits
    _, out = run(model, nb, ids[-1:], [len(ids) - 1], write=False)
    return Outcome(
        logits=out.last[0].cpu(),
        keys=tuple(nb.keys[l][0].cpu() for l in layers),
        values=tuple(nb.values[l][0].cpu() for l in layers),
    )


def _transformers(r: Runners, ids: list[int]):
    with torch.inference_mode():
        return r.hf(
            input_ids=torch.tensor([ids], device=device_of(r.model)), use_cache=True, logits_to_keep=1
        )


def _transformers_chunked(r: Runners, ids: list[int]):
    """The twin fed `engine.PREFILL_CHUNK` tokens at a time into one `DynamicCache(config=...)`
    (read when called, so both sides chunk alike); the last chunk's output, whose cache is the
    whole context's."""
    from transformers import DynamicCache

    chunk = engine.PREFILL_CHUNK
    with torch.inference_mode():
        cache = DynamicCache(config=r.hf.config)
        for a in range(0, len(ids), chunk):
            piece = torch.tensor([ids[a : a + chunk]], device=device_of(r.model))
            out = r.hf(input_ids=piece, cache=cache, use_cache=True, logits_to_keep=1)
        return out


def _transformers_readout(r: Runners, out, ids: list[int], layers: list[int]) -> Outcome:  # noqa: ARG001
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    if hasattr(cache, "layers"):
        keys, values = [x.keys for x in cache.layers], [x.values for x in cache.layers]
    else:  # transformers before the layered cache
        keys, values = cache.key_cache, cache.value_cache
    return Outcome(
        logits=out.logits[0, -1].cpu(),
        keys=tuple(keys[l][0].cpu() for l in layers),
        values=tuple(values[l][0].cpu() for l in layers),
    )


def _transformer_lens(r: Runners, ids: list[int]):
    return hooked(r.model).run_with_cache(torch.tensor([ids], device=device_of(r.model)))


def _transformer_lens_readout(r: Runners, out, ids: list[int], layers: list[int]) -> Outcome:  # noqa: ARG001
    logits, cache = out

    def held(l: int, site: str) -> Tensor:  # [pos, kv_head, d_head] -> [kv_head, pos, d_head]
        return cache[f"blocks.{l}.attn.{site}"][0].transpose(0, 1).cpu()

    return Outcome(
        logits=logits[0, -1].cpu(),
        keys=tuple(held(l, "hook_rot_k") for l in layers),
        values=tuple(held(l, "hook_v") for l in layers),
    )


# way -> (the timed call, the untimed readout of its output)
CALLS: dict[str, tuple[Callable, Callable]] = {
    "kvnotes": (_kvnotes, _kvnotes_readout),
    "kvnotes_nnsight": (_kvnotes_nnsight, _kvnotes_nnsight_readout),
    "transformers_chunked": (_transformers_chunked, _transformers_readout),
    "transformers": (_transformers, _transformers_readout),
    "transformer_lens": (_transformer_lens, _transformer_lens_readout),
}


def load_hf_twin(model: KVModel):
    """`model`'s Hugging Face twin (`KVModel.hf_source`), with SDPA attention, on the model's device."""
    hf = model.hf_source.load()
    if getattr(hf.config, "_attn_implementation", None) != "sdpa":
        hf.set_attn_implementation("sdpa")
    return hf.to(device_of(model)).eval()


def diffs(mine: Outcome, ref: Outcome) -> tuple[float, float]:
    """Max |difference| of the logits, and of the keys and values over the last slots both hold."""
    kv = 0.0
    for a, b in [*zip(mine.keys, ref.keys), *zip(mine.values, ref.values)]:
        m = min(a.shape[1], b.shape[1])
        kv = max(kv, float((a[:, -m:] - b[:, -m:]).abs().max()))
    return float((mine.logits - ref.logits).abs().max()), kv
