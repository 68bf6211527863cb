"""The names and contexts a loader needs without importing another loader: the embedded model's
name and context, and the Hugging Face context cap (every built-in name is listed by
`kvnotes.zoo.catalog.builtin_names`, which imports the loaders, and without torch by
`kvnotes.zoo.outline.known_names`; a model's context before the load by
`kvnotes.zoo.outline.context_length`)."""

from __future__ import annotations

import re
from pathlib import Path

from kvnotes.errors import UnknownModelError

EMBEDDED = "gemma-3-270m"
EMBEDDED_N_CTX = 8192  # Gemma 3 270M supports 32K; 8192 keeps RoPE tables and masks small
# Hugging Face checkpoints on TransformerLens: min(max_position_embeddings, N_CTX_CAP). RoPE tables and
# masks grow with n_ctx and the notebook engine rarely needs more (`load_hf(..., n_ctx=)` changes it).
N_CTX_CAP = 8192

# A user's RASP program as a model name: FILE.py:NAME (`kvnotes.zoo.tracr.load_program` compiles it)
PROGRAM_SPEC = re.compile(r"^(?P<file>.+\.py):(?P<name>[A-Za-z_]\w*)$")


def is_program_spec(name: str) -> bool:
    """Whether a model name names a user's RASP program, `FILE.py:NAME`, rather than a model.

    >>> is_program_spec("programs/same.py:same_ends"), is_program_spec("tracr-reverse")
    (True, False)
    """
    return re.match(r"^.+\.py:", name) is not None


def check_program_spec(spec: str) -> None:
    """Refuse a `FILE.py:NAME` that is malformed or whose file is missing, before anything is
    imported or compiled."""
    m = PROGRAM_SPEC.match(spec)
    if m is None:
        raise UnknownModelError(
            f"{spec!r} is not FILE.py:NAME; name a RASP program NAME (a Python identifier) defined in FILE.py"
        )
    if not Path(m["file"]).expanduser().is_file():
        raise UnknownModelError(
            f"no file {m['file']!r} for the RASP program {spec!r}; give the path of a Python file "
            f"that defines {m['name']}"
        )
