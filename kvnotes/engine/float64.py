"""Float64 forwards, the truth `verify` measures float32 against: `float64_everywhere` (torch's
float32 spelled as float64 for a while) and `hf_in_float64` (a transformers module cast to float64 with
its rotary embeddings rebuilt). Each backend's `in_float64(model)` is built from these.
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


@contextmanager
def hf_in_float64(hf_model: Any) -> Iterator[Any]:
    """`hf_model` in float64 for the duration, its rotary embeddings rebuilt in float64 (their
    inverse frequencies were computed in float32 at load); left as it came afterwards (float32
    to float64 and back is exact)."""
    dtype = next(hf_model.parameters()).dtype
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
        hf_model.to(dtype)
