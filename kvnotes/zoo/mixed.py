"""Mixed organisms: a decision that reads the field directly AND reads notes, in a known share,
through the notes' values at one layer and their keys at another.

The trained organisms (`kvnotes.zoo.organisms`) each leave one route open, so field refresh =
0 / transplant = 1 (or the reverse) follow from the attention masks alone. On a real model both
routes are open and the question is their mix, and what differs between two runs can sit in the
keys as well as the values, at any layer. A mixed organism is a case whose mix is known: its
weights are compiled by hand (in the spirit of tracr), not trained, so every figure the probes
should report follows from the construction below, `share` (the notes' share of the decision)
and `KEY_PART` (the part of that share read through the notes' keys).

Three layers, two heads, no normalisation, no MLP (its weights are 0). The residual stream has one
named direction per feature (`DIMS`). Head dimensions 0-3 are rotated by RoPE (`rotary_dim` 4 of
16, NeoX pairing: dims 1 and 3 are the low-frequency pair, `ROTARY_BASE` ** -1/2 = 1e-3 radians
per token); everything but one key lives in the dimensions past them, where attention is by
content wherever the prompt puts things.

- layer 0, head 0, the note writer: a `;` token (a *writer*) attends to the gating field's value
  token and copies the value's sign (+1 for the value whose answer is `answers[0]`, -1 for the
  other) into `note`, and a 1 into `has_note`. Every other token (and a `;` before the field)
  attends to the first token, which carries nothing. So the notes are exactly the `;` slots
  between the field and the decision: two in every prompt of the `mixed-organism` task.
- layer 1, head 0, the direct read: every token attends to the field's value token and writes
  (1 - share) x its sign into `out`.
- layer 1, head 1, the value route: every token attends evenly to the slots with `has_note` (a key
  the same in both runs) and writes share (1 - KEY_PART) x the mean of their `note` (a value that
  differs) into `out`.
- layer 2, heads 0 and 1, the key route: head 0's key is `note` in the low-frequency rotary pair,
  head 1's is -`note` past the rotary dims; each query is constant. So head 0 attends to the notes
  that say +1 and head 1 to those that say -1 (a note of the other sign scores -SCORE, every other
  slot 0). Both read `has_note`, 1 at every note in both runs, and write +-share KEY_PART into `out`:
  head 0 gives share KEY_PART x [some note says +1], head 1 -share KEY_PART x [some note says -1].
  With two notes, [some +1] - [some -1] = mean(note) for each of the four sign patterns
  ((1 - 0), (1 - 1), (0 - 1)), so this route too is linear in each note, and what it reads
  differs between the runs only in the notes' keys.
- unembedding: `out` x GAIN onto the first answer, minus that onto the second.

So at the decision, with s the field's sign and n the mean of the notes' signs as the decision
reads them at layer 1 (values) and at layer 2 (keys),

    ld = 2 GAIN ((1 - share) s + share (1 - KEY_PART) n_values@1 + share KEY_PART n_keys@2),

linear in every route. The softmaxes are saturated: scores are 0 or SCORE = 30 logits, except head 0
at layer 2, where the rotary pair turns SCORE into SCORE cos(1e-3 d) for a note d tokens before the
decision. Over the whole context (d < n_ctx = 512) that stays above 26 logits (cos 0.51 = 0.87), so
each slot off the winners leaks at most e^-26 (1e-11); within a prompt of the task (d < 40) it
varies by less than 0.03 logits. Both notes carry the same value there, so how the winners share
their weight does not matter. (The high-frequency pair turns 1 radian per token: there a note's
score would swing between +SCORE and -SCORE with its distance.) In a pair the field's sign flips, so
each probe's recovery (toward the new value's decision) is the share of the routes it moves:

| probe (recovery toward the new value's decision)  | known answer (k = KEY_PART, notes = 2)  |
|----------------------------------------------------|-----------------------------------------|
| field-only refresh                                 | 1 - share                               |
| notes transplant, K and V (every downstream slot)  | share                                   |
| notes transplant, K only                           | share k                                 |
| notes transplant, V only                           | share (1 - k)                           |
| notes transplant at layer 0, 1, 2 alone            | 0, share (1 - k), share k               |
| note map: single-slot transplant at each note      | share / notes                           |
| note map: each note at layer 0, 1, 2 alone         | 0, share (1 - k) / notes, share k / notes |
| note map: any other downstream slot                | 0                                       |
| false-note injection at 1, both notes              | share / notes, share                    |
| knockout of the notes (fraction of the effect lost)| share / 2                               |

A single note moves n halfway in both routes: (+1 + -1) / 2 = 0 in the values, and
[some +1] - [some -1] = 1 - 1 = 0 in the keys. Knockout removes the notes' terms (with no note in
view the three note heads spread over slots whose `note` and `has_note` are 0) from ld_new, share x
ld_new; the effect ld_new - ld_old is 2 x ld_new because the two values' decisions are symmetric, so
the fraction lost is share / 2. A transplant that copies only values, only keys or only the last
layer recovers share (1 - k), share k or share k instead of share, each a known part short; so does
a note map restricted the same way, per note.

These hold for any prompt of the `mixed-organism` task (`designed_notes` lists its note slots;
`designed_answers` gives the table for a share); tests/models/test_mixed_organism.py checks each
one through the probes, at n = 32, and that a transplant copying only values, only keys or only
the last layer fails those checks.
"""

from __future__ import annotations

from functools import partial
from typing import TypedDict

import torch

from kvnotes.errors import TaskError, UnknownModelError
from kvnotes.models.model import KVModel
from kvnotes.zoo.tiny import compiled_organism, tiny_tokenizer

MIXED_ORGANISMS: dict[str, float] = {"mixed-organism-25": 0.25, "mixed-organism-75": 0.75}
TASK = "mixed-organism"
WRITER = ";"  # token text (stripped) of the slots that take notes
NOTES = 2  # note slots in every prompt of the task: the ";" after the field
SCORE = 30.0  # attention logit of a matching key; every other key scores 0 (or -SCORE)
GAIN = 4.0  # logits per unit of `out`: the decision's logit difference is +-2 GAIN = +-8
KEY_PART = 0.6  # the part of the notes' share read through their keys (layer 2); the rest, values (layer 1)
N_LAYERS, D_MODEL, N_HEADS, D_HEAD, ROTARY_DIM = 3, 32, 2, 16, 4
ROTARY_BASE = 1e6  # the low-frequency pair turns 1e-3 rad per token: cos > 0.87 across n_ctx = 512
N_CTX = 512
DIMS = {"one": 0, "first": 1, "field": 2, "sign": 3, "writer": 4, "has_note": 5, "note": 6, "out": 7}
LOW_PAIR = 1  # the head dimension of the low-frequency rotary pair (NeoX pairing: with dim 3)
_Q = ROTARY_DIM  # the head dimensions content lives in: past the rotated ones
_Q2 = ROTARY_DIM + 1


def hooked_config(name: str, d_vocab: int):
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig(
        d_model=D_MODEL,
        d_head=D_HEAD,
        n_heads=N_HEADS,
        n_layers=N_LAYERS,
        d_mlp=4,
        n_ctx=N_CTX,
        d_vocab=d_vocab,
        act_fn="relu",
        positional_embedding_type="rotary",
        rotary_dim=ROTARY_DIM,
        rotary_base=ROTARY_BASE,
        rotary_adjacent_pairs=False,
        normalization_type=None,
        default_prepend_bos=True,
        tokenizer_prepends_bos=True,
        model_name=name,
        original_architecture="kvnotes-mixed-organism",
        seed=None,
    )


def designed_answers(share: float) -> dict[str, float]:
    """The module docstring's table for notes' share `share`: each probe's recovery toward the new
    value's decision (knockout: the fraction of the effect lost). `note` is one note's single-slot
    transplant (and injection), `note_layer_{l}` one note at layer l alone, `layer_{l}` every
    downstream slot at layer l alone, `other_slot` a downstream slot that is not a note."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    by_layer = (0.0, share * (1 - KEY_PART), share * KEY_PART)  # what each layer reads of the notes
    out = {
        "field_refresh": 1 - share,
        "kv": share,
        "k_only": share * KEY_PART,
        "v_only": share * (1 - KEY_PART),
        "note": share / NOTES,
        "other_slot": 0.0,
        "inject_one": share / NOTES,
        "inject_all": share,
        "knockout": share / 2,
    }
    out.update({f"layer_{l}": v for l, v in enumerate(by_layer)})
    out.update({f"note_layer_{l}": v / NOTES for l, v in enumerate(by_layer)})
    return out


class CompiledIds(TypedDict):
    """The token ids a compiled organism's weights are built for (`token_ids`)."""

    first: int
    values: dict[int, float]  # each gating value's id -> the sign of the answer it leads to
    writers: list[int]
    answers: list[int]


def token_ids(tokenizer) -> CompiledIds:
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
    ids = token_ids(tiny_tokenizer())
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
        s = SCORE * float(tl.blocks[0].attn.attn_scale)

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
        a1.W_Q[1, d["one"], _Q] = s  # head 1, the value route: keys alike in both runs, values not
        a1.W_K[1, d["has_note"], _Q] = 1.0
        a1.W_V[1, d["note"], _Q] = 1.0
        a1.W_O[1, _Q, d["out"]] = share * (1 - KEY_PART)

        a2 = tl.blocks[2].attn  # the key route: keys differ between the runs, values not
        a2.W_Q[0, d["one"], LOW_PAIR] = s  # head 0: notes saying +1, by a rotated key
        a2.W_K[0, d["note"], LOW_PAIR] = 1.0
        a2.W_Q[1, d["one"], _Q] = s  # head 1: notes saying -1, by an unrotated key
        a2.W_K[1, d["note"], _Q] = -1.0
        for h, sign in ((0, 1.0), (1, -1.0)):
            a2.W_V[h, d["has_note"], _Q] = 1.0
            a2.W_O[h, _Q, d["out"]] = sign * share * KEY_PART

        first, second = ids["answers"]
        tl.unembed.W_U[d["out"], first] = GAIN
        tl.unembed.W_U[d["out"], second] = -GAIN


def designed_notes(prompt) -> list[int]:
    """The positions the mixed organism writes notes onto in `prompt` (a `mixed-organism` prompt):
    its writer tokens after the gating field and before the decision."""
    from kvnotes.tasks import load_task

    task = load_task(TASK)
    field, decision = prompt.span(task.gate.field), prompt.span("decision")
    writers = set(token_ids(tiny_tokenizer())["writers"])
    return [p for p in range(field.stop, decision.start) if prompt.ids[p] in writers]


def load_mixed_organism(name: str, *, device=None, dtype=None) -> KVModel:
    """Mixed organism `name` ("mixed-organism-25": notes' share 0.25; "-75": 0.75) as a KVModel.

    >>> m = load_mixed_organism("mixed-organism-25")
    >>> m.n_layers, m.window(0)
    (3, None)
    """
    if name not in MIXED_ORGANISMS:
        raise UnknownModelError(f"unknown mixed organism {name!r}; they are {sorted(MIXED_ORGANISMS)}")
    write = partial(compile_weights, MIXED_ORGANISMS[name])
    return compiled_organism(name, hooked_config, write, device=device, dtype=dtype)


def designed_edges(share: float) -> dict[str, float]:
    """The edges of the construction's circuit in `circuits.edges`' graph, each with the share of the
    effect that corrupting it alone removes (recovery units): the direct read (1 - share) along
    EMB@field -> KV1.0@field -> L1H0@decision -> LOGIT; the note writer (share) from the field into
    L0H0 at the notes; the value route (share (1 - KEY_PART)) through KV1.1 at the notes into L1H1; and
    the key route, one half per layer-2 head (share KEY_PART / 2 each: a pair flips the field's sign,
    so each head's "some note says ±1" term moves half of the route's part of the effect). Every
    other edge moves nothing."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    direct, values, key = 1 - share, share * (1 - KEY_PART), share * KEY_PART / 2
    out = {
        "EMB@field->KV1.0@field": direct,
        "KV1.0@field->L1H0@decision": direct,
        "L1H0@decision->LOGIT": direct,
        "EMB@field->KV0.0@field": share,
        "KV0.0@field->L0H0@notes": share,
        "L0H0@notes->KV1.1@notes": values,
        "KV1.1@notes->L1H1@decision": values,
        "L1H1@decision->LOGIT": values,
    }
    for h in (0, 1):
        out[f"L0H0@notes->KV2.{h}@notes"] = key
        out[f"KV2.{h}@notes->L2H{h}@decision"] = key
        out[f"L2H{h}@decision->LOGIT"] = key
    return out
