"""Shared test helpers: one `assert_close` with per-dtype tolerances, notebook comparison,
and the task-like templates every suite uses."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kvnotes.fixtures import FILLER, POLICY, QUERY, STATE  # the task verify uses
from kvnotes.notebook import Notebook
from kvnotes.ops import prefill
from kvnotes.prompt import Prompt, Template
from kvnotes.zoo import load_model
from kvnotes.zoo.tiny import TINY_BASE, TINY_CONFIGS, TINY_HF, TINY_WINDOW

MODEL_NAMES: tuple[str, ...] = (*TINY_CONFIGS, *TINY_HF)
# Keys that carry their position (RoPE): re-rotation and splices move them. The learned-position
# models (tiny-attn-only, tiny-gpt2) add positions to the residual stream at the input, so moving
# a chunk refuses there by design; their own tests say so (tests/engine/test_learned_positions.py).
ROTARY_NAMES: tuple[str, ...] = tuple(
    n for n, c in TINY_CONFIGS.items() if {**TINY_BASE, **c}["positional_embedding_type"] == "rotary"
)
LEARNED_NAMES: tuple[str, ...] = tuple(n for n in MODEL_NAMES if n not in ROTARY_NAMES)
WINDOWED: tuple[str, ...] = tuple(n for n, c in TINY_CONFIGS.items() if c.get("use_local_attn"))

# (rtol, atol) per dtype. The atol is relative-ish: it is scaled by the reference tensor's largest
# magnitude when that exceeds 1 (as `kvnotes.conformance` does). With a plain elementwise atol of
# 2e-5, re-rotation to position 400 fails by a hair (|error| up to 4e-5 on keys of magnitude ~3):
# fp32 RoPE tables at large angles carry ~position * 6e-8 rounding, in the full forward too.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, what: str) -> None:
    """`torch.testing.assert_close` with `expected`'s dtype tolerance (atol scaled by its largest
    magnitude when > 1); `what` names the check in the failure message."""
    rtol, atol = TOLERANCES[expected.dtype]
    if expected.numel():
        atol *= max(1.0, expected.detach().abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_notebooks_close(actual: Notebook, expected: Notebook, *, what: str, exact: bool = False) -> None:
    """Same positions (as a set), same tokens, and K/V slot by slot (matched by position)."""
    assert actual.fingerprint == expected.fingerprint, f"{what}: fingerprints differ"
    assert sorted(actual.positions.tolist()) == sorted(expected.positions.tolist()), (
        f"{what}: positions differ: {actual.positions.tolist()} vs {expected.positions.tolist()}"
    )
    if not torch.equal(actual.positions, expected.positions):
        actual = actual.select(expected.positions)
    assert torch.equal(actual.tokens, expected.tokens), f"{what}: tokens differ"
    assert actual.n_layers == expected.n_layers
    for l in range(expected.n_layers):
        for kind, a, e in (
            ("keys", actual.keys[l], expected.keys[l]),
            ("values", actual.values[l], expected.values[l]),
        ):
            if exact:
                assert torch.equal(a, e), f"{what}: layer {l} {kind} not bit-identical"
            else:
                assert_close(a, e, what=f"{what}: layer {l} {kind}")


def max_kv_diff(a: Notebook, b: Notebook) -> float:
    """Largest |difference| over every layer's keys and values (slots matched by position)."""
    if not torch.equal(a.positions, b.positions):
        b = b.select(a.positions)
    return max(
        max((x - y).abs().max().item() for x, y in zip(a.keys, b.keys)),
        max((x - y).abs().max().item() for x, y in zip(a.values, b.values)),
    )


def full_logits(model, ids) -> torch.Tensor:
    """Ground truth: TransformerLens's own full forward, `[pos, d_vocab]`."""
    return model.tl(torch.tensor([list(ids)]))[0]


@cache
def get_model(name: str):
    """Each tiny model is built once per session (building is deterministic from the seed)."""
    return load_model(name)


# --- the shared task -----------------------------------------------------------------------------
TEMPLATE = Template(POLICY + STATE + QUERY)  # 69 tokens under the tiny tokenizer (window: 8)
LONG_TEMPLATE = Template(POLICY + "".join(FILLER.format(i=i) for i in range(8)) + STATE + QUERY)
OLD, NEW = "pending", "shipped"  # same token count: the aligned pair
WINDOW = TINY_WINDOW


@dataclass(frozen=True)
class Case:
    """The shared task on one model: aligned old/new prompts and their prefilled notebooks."""

    model: object
    old: Prompt
    new: Prompt
    nb_old: Notebook
    nb_new: Notebook

    @property
    def ids(self) -> list[int]:
        return list(self.old.ids)

    @property
    def field(self) -> int:
        return self.old.span("order_status").start

    @property
    def stop(self) -> int:
        return self.old.span("decision").start


def make_case(model) -> Case:
    old = TEMPLATE.render(model, order_status=OLD)
    new = old.with_values(model, order_status=NEW)
    return Case(model=model, old=old, new=new, nb_old=prefill(model, old), nb_new=prefill(model, new))


def readings(printed: str) -> dict[str, str]:
    """A command's printed reading block (`kvnotes.cli._emit`): analysis or section -> its line."""
    lines = printed.split("\nreading:\n", 1)[1].splitlines() if "\nreading:\n" in printed else []
    return dict(ln.strip().split(": ", 1) for ln in lines if ln.startswith("  ") and ": " in ln)
