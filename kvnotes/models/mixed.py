"""Mixed organisms: a decision that reads the field directly AND reads notes, in a known share.

The trained organisms (`kvnotes.models.organisms`) each leave one route open, so field refresh =
0 / transplant = 1 (or the reverse) follow from the attention masks alone. On a real model both
routes are open and the question is their mix. A mixed organism is a case whose mix is known:
its weights are compiled by hand (in the spirit of tracr), not trained, so every figure the
probes should report follows from the construction below and `share`, the notes' share.

Two layers, two heads, no normalisation, no MLP (its weights are 0). The residual stream has one
named direction per feature (`DIMS`); every query and key lives in head dimensions that RoPE
leaves alone (`rotary_dim` = 4 of 16), so attention is by content wherever the prompt puts things.

- layer 0, head 0, the note writer: a `;` token (a *writer*) attends to the gating field's value
  token and copies the value's sign (+1 for the value whose answer is `answers[0]`, -1 for the
  other) into `note`, and a 1 into `has_note`. Every other token (and a `;` before the field)
  attends to the first token, which carries nothing. So the notes are exactly the `;` slots
  between the field and the decision.
- layer 1, head 0, the direct read: every token attends to the field's value token and writes
  (1 - share) x its sign into `out`.
- layer 1, head 1, the note read: every token attends evenly to the slots with `has_note` and
  writes share x the mean of their `note` into `out`.
- unembedding: `out` x GAIN onto the first answer, minus that onto the second.

So at the decision ld = 2 GAIN ((1 - share) sign(field) + share mean(note)), linear in both routes,
and the softmaxes are saturated (scores 0 or SCORE = 30 logits, so a leak of e^-30 per slot):

| probe (recovery toward the new value's decision)    | known answer       |
|------------------------------------------------------|--------------------|
| field-only refresh                                   | 1 - share          |
| notes transplant (every downstream slot)             | share              |
| note map: single-slot transplant at each note        | share / notes      |
| note map: any other downstream slot                  | 0                  |
| false-note injection at the notes (all of them)      | share              |
| knockout of the notes (fraction of the effect lost)  | share / 2          |

Knockout removes the notes' term from ld_new, share x ld_new; the effect ld_new - ld_old is
2 x ld_new because the two values' decisions are symmetric, so the fraction lost is share / 2.

These hold for any prompt of the `mixed-organism` task (`designed_notes` lists its note slots);
tests/models/test_mixed_organism.py checks each one through the probes, at n = 32.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kvnotes.errors import TaskError, UnknownModelError
from kvnotes.models.model import KVModel
from kvnotes.models.tiny import tiny_tokenizer

MIXED_ORGANISMS: dict[str, float] = {"mixed-organism-25": 0.25, "mixed-organism-75": 0.75}
TASK = "mixed-organism"
WRITER = ";"  # token text (stripped) of the slots that take notes
SCORE = 30.0  # attention logit of a matching key; every other key scores 0
GAIN = 4.0  # logits per unit of `out`: the decision's logit difference is +-2 GAIN = +-8
D_MODEL, N_HEADS, D_HEAD, ROTARY_DIM = 32, 2, 16, 4
DIMS = {"one": 0, "first": 1, "field": 2, "sign": 3, "writer": 4, "has_note": 5, "note": 6, "out": 7}
_Q = ROTARY_DIM  # the head dimensions content lives in: past the rotated ones
_Q2 = ROTARY_DIM + 1


def hooked_config(name: str, d_vocab: int):
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig(
        d_model=D_MODEL,
        d_head=D_HEAD,
        n_heads=N_HEADS,
        n_layers=2,
        d_mlp=4,
        n_ctx=512,
        d_vocab=d_vocab,
        act_fn="relu",
        positional_embedding_type="rotary",
        rotary_dim=ROTARY_DIM,
        rotary_base=10000,
        normalization_type=None,
        default_prepend_bos=True,
        tokenizer_prepends_bos=True,
        model_name=name,
        original_architecture="kvnotes-mixed-organism",
        seed=None,
    )


def token_ids(tokenizer) -> dict[str, object]:
    """The ids the weights are compiled for: the first token, the gating field's two values (each
    as it follows a space), the writers (every token whose text is `;` up to spaces), the answers."""
    from kvnotes.tasks import load_task

    task = load_task(TASK)

    def one(text: str) -> int:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise TaskError(
                f"task {TASK!r}: {text!r} is {len(ids)} tokens under the tiny tokenizer; the mixed "
                "organism needs one-token field values and answers"
            )
        return ids[0]

    values = [one(" " + v) for v in task.gate.values]
    signs = [1.0 if task.outcome(v) == 0 else -1.0 for v in task.gate.values]
    writers = [i for t, i in tokenizer.get_vocab().items() if tokenizer.decode([i]).strip() == WRITER]
    return {
        "first": tokenizer.bos_token_id,
        "values": dict(zip(values, signs)),
        "writers": sorted(writers),
        "answers": [one(a) for a in task.answers],
    }


def compile_weights(share: float, tl) -> None:
    """Set `tl`'s weights (in place) to the construction in the module docstring."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    d = DIMS
    ids = token_ids(_tokenizer())
    with torch.no_grad():
        for p in tl.parameters():
            p.zero_()
        W_E = tl.embed.W_E
        W_E[:, d["one"]] = 1.0
        W_E[ids["first"], d["first"]] = 1.0
        for tok, sign in ids["values"].items():
            W_E[tok, d["field"]] = 1.0
            W_E[tok, d["sign"]] = sign
        for tok in ids["writers"]:
            W_E[tok, d["writer"]] = 1.0
        scale = tl.blocks[0].attn.attn_scale
        s = SCORE * float(scale)

        a0 = tl.blocks[0].attn  # the note writer
        a0.W_Q[0, d["one"], _Q] = s  # everyone looks at the first token...
        a0.W_K[0, d["first"], _Q] = 1.0
        a0.W_Q[0, d["writer"], _Q2] = 2 * s  # ...a writer looks at the field's value twice as hard
        a0.W_K[0, d["field"], _Q2] = 1.0
        a0.W_V[0, d["field"], _Q] = 1.0
        a0.W_V[0, d["sign"], _Q2] = 1.0
        a0.W_O[0, _Q, d["has_note"]] = 1.0
        a0.W_O[0, _Q2, d["note"]] = 1.0

        a1 = tl.blocks[1].attn
        a1.W_Q[0, d["one"], _Q] = s  # head 0 reads the field directly
        a1.W_K[0, d["field"], _Q] = 1.0
        a1.W_V[0, d["sign"], _Q] = 1.0
        a1.W_O[0, _Q, d["out"]] = 1.0 - share
        a1.W_Q[1, d["one"], _Q] = s  # head 1 reads the notes
        a1.W_K[1, d["has_note"], _Q] = 1.0
        a1.W_V[1, d["note"], _Q] = 1.0
        a1.W_O[1, _Q, d["out"]] = share

        first, second = ids["answers"]
        tl.unembed.W_U[d["out"], first] = GAIN
        tl.unembed.W_U[d["out"], second] = -GAIN


def designed_notes(prompt) -> list[int]:
    """The positions the mixed organism writes notes onto in `prompt` (a `mixed-organism` prompt):
    its writer tokens after the gating field and before the decision."""
    from kvnotes.tasks import load_task

    task = load_task(TASK)
    field, decision = prompt.span(task.gate.field), prompt.span("decision")
    writers = set(token_ids(_tokenizer())["writers"])
    return [p for p in range(field.stop, decision.start) if prompt.ids[p] in writers]


def load_mixed_organism(name: str) -> KVModel:
    """Mixed organism `name` ("mixed-organism-25": notes' share 0.25; "-75": 0.75) as a KVModel.

    >>> m = load_mixed_organism("mixed-organism-25")
    >>> m.n_layers, m.window(0)
    (2, None)
    """
    from transformer_lens import HookedTransformer

    if name not in MIXED_ORGANISMS:
        raise UnknownModelError(f"unknown mixed organism {name!r}; they are {sorted(MIXED_ORGANISMS)}")
    tokenizer = _tokenizer()
    with torch.random.fork_rng(devices=[]):  # the initial draw is overwritten; keep the caller's RNG
        tl = HookedTransformer(hooked_config(name, len(tokenizer)), move_to_device=False)
    compile_weights(MIXED_ORGANISMS[name], tl)
    return KVModel.wrap(name, tl, tokenizer)


@lru_cache(maxsize=1)
def _tokenizer():
    return tiny_tokenizer()
