"""A model as a Hugging Face checkpoint directory, for servers that load those (vLLM, TGI, SGLang).

`export(model, out)` writes `config.json`, `model.safetensors` and the tokenizer files of any model
kvnotes loads with a Hugging Face counterpart: the embedded `gemma-3-270m` (its GGUF dequantized to
float32 by transformers, so the server reads the same weights the engine runs) and checkpoints
loaded from a directory, in the model's dtype (`load_model(..., dtype="bfloat16")` exports
bfloat16 weights). A stamp (`kvnotes-export.json`) records what was exported, so `cached()`
can reuse a directory instead of writing 1 GB again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvnotes.engine.float64 import hf_cast
from kvnotes.errors import KVNotesError

STAMP = "kvnotes-export.json"


def _stamp(model) -> dict:
    return {"format": "kvnotes.hf-export", "model": model.name, "fingerprint": model.fingerprint}


def is_export_of(out: Path, model) -> bool:
    """Whether `out` holds a finished export of `model` (same name and weights)."""
    f = Path(out) / STAMP
    try:
        return json.loads(f.read_text()) == _stamp(model)
    except (OSError, ValueError):
        return False


def export(model, out: str | Path, *, progress: bool = True) -> Path:
    """Write `model` (a KVModel: `kvnotes export NAME DIR` loads it by name) to `out` as a Hugging
    Face checkpoint.

    The directory is written beside `out` and renamed into place, so an interrupted export never
    leaves a directory that looks finished. An existing `out` is refused unless it is an earlier
    export (which is replaced)."""
    out = Path(out).expanduser()
    if out.exists() and not (out / STAMP).exists() and any(out.iterdir()):
        raise KVNotesError(
            f"{out} exists and is not an earlier kvnotes export; pass a new or empty directory"
        )
    if model.hf_source is None:
        raise KVNotesError(
            f"{model.name} has no Hugging Face counterpart to export (a TransformerLens-only model); "
            "gemma-3-270m and models loaded from a checkpoint directory have one"
        )
    if progress:
        print(f"exporting {model.name} to {out} ({model.hf_source.what})", flush=True)
    hf = model.hf_source.load()
    if next(hf.parameters()).dtype != model.dtype:  # a model loaded with dtype=: its own weights
        hf_cast(hf, model.dtype)
    hf.hf_quantizer = None  # a GGUF's weights arrive dequantized; transformers would refuse to save
    if getattr(hf.config, "quantization_config", None) is not None:
        del hf.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(tmp, safe_serialization=True)
    model.tokenizer.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps(_stamp(model), indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def cached(model, root: str | Path | None = None, *, progress: bool = True) -> Path:
    """An export of `model` under the kvnotes cache (`$KVNOTES_CACHE/export/NAME`), written once."""
    from kvnotes.zoo.cache import building, default_cache_dir

    root = Path(root) if root else default_cache_dir() / "export"
    out = root / model.name.replace("/", "--")
    if not is_export_of(out, model):
        with building(out):
            if not is_export_of(out, model):  # written by another process while this one waited
                export(model, out, progress=progress)
    return out
