"""kvnotes: the KV cache as a notebook of conclusions — patch it, edit it, splice it.

    from kvnotes import load_model, Template, prefill, decide
    model = load_model("gemma-3-270m")
    prompt = Template("Status: {status}.\\n[[decision:Answer:]]").render(model, status="shipped")
    nb = prefill(model, prompt)
    decide(model, nb, prompt).last

Imports are lazy: `import kvnotes` costs nothing until a name is used.
"""

from __future__ import annotations

from kvnotes.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "kvnotes.zoo",
    "KVModel": "kvnotes.models.model",
    "Notebook": "kvnotes.notebook",
    "Template": "kvnotes.prompt",
    "Prompt": "kvnotes.prompt",
    "free_prompt": "kvnotes.prompt",
    "free_pair": "kvnotes.prompt",
    "run": "kvnotes.engine",
    "Readout": "kvnotes.engine",
    "prefill": "kvnotes.ops",
    "decide": "kvnotes.ops",
    "Patch": "kvnotes.ops",
    "patch": "kvnotes.ops",
    "patch_batch": "kvnotes.ops",
    "patched_slots": "kvnotes.ops",
    "decide_patched": "kvnotes.ops",
    "patch_recompute": "kvnotes.ops",
    "recompute": "kvnotes.ops",
    "refresh": "kvnotes.ops",
    "recompute_suffix": "kvnotes.ops",
    "append": "kvnotes.ops",
    "rerotate": "kvnotes.ops",
    "splice": "kvnotes.ops",
    "precompile": "kvnotes.ops",
    "logit_diff": "kvnotes.metrics",
    "answer_logprob": "kvnotes.metrics",
    "recovery": "kvnotes.metrics",
    "logit_cosine": "kvnotes.metrics",
    "agreement": "kvnotes.metrics",
    "kv_deviation": "kvnotes.metrics",
    "verify": "kvnotes.conformance",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
