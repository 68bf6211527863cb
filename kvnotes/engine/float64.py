"""Float64 forwards, the truth `verify` measures a model's own dtype (float32, bfloat16, float16)
against: `float64_everywhere` (torch's float32 spelled as float64 for a while), `hf_in_float64` (a
transformers module cast to float64 with its rotary embeddings rebuilt) and `hf_cast` (a
transformers module in a lower dtype, its build-time constants kept as built). Each backend's
`in_float64(model)` is built from these.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def float64_everywhere() -> Iterator[None]:
    """For its duration, `torch.float32`, `torch.float` and `Tensor.float()` mean float64.

    transformers' modeling code computes its RMSNorms, softmax and RoPE angles in float32 whatever
    the model's dtype (`x.float()`, `x.to(torch.float32)`, `dtype=torch.float`), and so does the
    nnsight backend's re-rotation: a model cast to float64 would still round there in float32.
    Under this context it does not, so a float64 forward is float64 throughout.
    """
    saved = torch.float32, torch.float, torch.Tensor.float
    torch.float32 = torch.float = torch.float64
    torch.Tensor.float = torch.Tensor.double
    try:
        yield
    finally:
        torch.float32, torch.float, torch.Tensor.float = saved


def _computed_buffers(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """The buffers `module` computes when built and never saves (rotary inverse frequencies,
    Gemma's embedding scale), each with its owner and name, as they are now."""
    return [
        (m, n, b)
        for m in module.modules()
        for n, b in m._buffers.items()
        if b is not None and n in m._non_persistent_buffers_set
    ]


def _put_back(kept: list[tuple[torch.nn.Module, str, torch.Tensor]]) -> None:
    for m, n, b in kept:
        m._buffers[n] = b


def hf_cast(hf_model: Any, dtype: torch.dtype) -> Any:
    """`hf_model` with its weights cast to `dtype` in place (bfloat16, float16), its computed
    buffers kept as they were built (float32 rotary inverse frequencies: in bfloat16, a rotation
    angle at position 500 would be off by up to a radian), as transformers'
    `from_pretrained(dtype=...)` leaves them. Returns `hf_model`."""
    kept = _computed_buffers(hf_model)
    hf_model.to(dtype)
    _put_back(kept)
    return hf_model


@contextmanager
def hf_in_float64(hf_model: Any) -> Iterator[Any]:
    """`hf_model` in float64 for the duration, its rotary embeddings rebuilt in float64 (their
    inverse frequencies were computed in float32 at load); left as it came afterwards, bit for bit
    (float32, bfloat16 or float16 to float64 and back is exact, and the computed buffers, float32
    in a bfloat16 model, are put back as they were)."""
    # each parameter's and buffer's own dtype, put back one by one (a model may mix them: a float32
    # norm weight in a bfloat16 model, `kvnotes.zoo.hf.share_weights`)
    dtypes = [(p, p.dtype) for p in hf_model.parameters()]
    buffer_dtypes = [
        (m, n, b.dtype) for m in hf_model.modules() for n, b in m._buffers.items() if b is not None
    ]
    kept = _computed_buffers(hf_model)
    rotaries = [(n, m) for n, m in hf_model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")]

    def put(name: str, module) -> None:
        parent, _, attr = name.rpartition(".")
        setattr(hf_model.get_submodule(parent) if parent else hf_model, attr, module)

    hf_model.to(torch.float64)
    try:
        with float64_everywhere():
            for name, m in rotaries:
                put(name, type(m)(m.config).to(torch.float64))
            yield hf_model
    finally:
        for name, m in rotaries:
            put(name, m)
        for p, dtype in dtypes:
            p.data = p.data.to(dtype)
        for m, n, dtype in buffer_dtypes:
            m._buffers[n] = m._buffers[n].to(dtype)
        _put_back(kept)
