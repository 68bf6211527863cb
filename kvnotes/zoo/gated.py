"""The gated organism: a compiled model with RMSNorm, a gated MLP that writes the notes, grouped-query
attention, and a decision whose *query* depends on the field, so that edge-attribution methods are
checked against a designed answer on each of those (`designed_edges`).

The mixed organisms (`kvnotes.zoo.mixed`) have no norms, no MLPs, one query head per KV head and
a constant decision query. This one has all four, and is compiled by hand in the same way (every
weight zeroed, then set): two layers of four query heads over two KV heads (heads 0 and 1 share KV
head 0; heads 2 and 3, and KV head 1, are zero), RMSNorm before each sublayer and before the
unembedding (weights 1, eps `EPS`), a SiLU-gated MLP, RoPE on head dimensions 0-3 only (all content
lives past them, so attention goes by content wherever the prompt puts things). It runs the
`mixed-organism` task: field `order_status` (pending -> " cancel", shipped -> " deny"), the two `;`
after it are the notes, the decision `A:` at the end.

**The residual stream.** One named direction per feature (`DIMS`). Every token carries `one` = M
(`BALLAST` = 16, a massive constant, as real models have) and a `pad` that brings its embedding's
squared norm to M^2 + 2: the first token has `first` and `pad` 1, a field value `field` 1 and
`sign` s (+1 for pending, the value whose answer is `answers[0]`; -1 for shipped), a `;` `writer`
and `pad` 1, a token of the decision span (`A`, `:`) `dec` and `pad` 1, every other token `pad`
sqrt 2. Each later feature is written by one writer, at +-1 (or at a value the same in both runs),
so at every position the squared norm is a constant of the position's kind, the same in both runs
and in every run with some edges corrupted (a corrupted edge flips a sign, nothing else): **RMSNorm
is an exact fixed scale**, r(n2) = sqrt(n2 / d_model + EPS), and the weights that read a position
divide it out (`_rms`). The squared norms at each norm's input:

| position                                  | layer 0 | MLP 0   | layer 1 | final   |
|-------------------------------------------|---------|---------|---------|---------|
| the notes (the two `;` after the field)   | M^2 + 2 | M^2 + 4 | M^2 + 5 |         |
| the decision span                         | M^2 + 2 | M^2 + 4 | M^2 + 4 | M^2 + 6 |
| every other position (prefix, field, ...) | M^2 + 2 | M^2 + 3 | M^2 + 3 |         |

(Positions other than the decision get a layer-1 output that depends on how many notes they see,
but not on the field, so it too is the same in both runs.)

**Layer 0, KV head 0** (keys: `first` and `field`; values: `sign`, `field`, `first`), read by two
query heads, both saturated (scores 0, SCORE = 30 or 2 SCORE):
- head 0, the note writer's reader: a `;` attends to the field's value token (2 SCORE, against
  SCORE for the first token) and writes its `sign` into `copy`, its `field` (1 in both runs) into
  `has_note`; every other token (and the `;` before the field, with no field in view) attends to
  the first token and writes its `first` into `nofield`. So `nofield` is 1 everywhere but at the
  notes, `has_note` 1 only there.
- head 1, the query's source: a decision token attends to the field's value token and writes its
  sign into `qsign` (s); every other token attends to the first token, whose `sign` is 0.

**MLP 0, the note writer** (gated: silu(x W_gate) * (x W_in) W_out, one hidden unit): its gate reads
`writer` (pre-activation GATE = 4 at a `;`, 0 elsewhere, and silu(0) = 0), its linear input reads
`copy`, and W_out = 1 / silu(GATE), so it writes `note` = s at the notes and 0 everywhere else (the
`;` before the field has `copy` 0). The MLP, not the head, writes the note.

**Layer 1, KV head 0** (keys: `has_note`, `first`, and `nofield` - `first`, which is 1 at every
position but the notes and the first token, where it is 0 exactly; values: `note`, `first`), read
by two query heads:
- head 0, the value route (saturated): query SCORE on `has_note`, -SCORE on `nofield` - `first`:
  the notes score 30, the first token 0, the rest -30. It writes the notes' mean `note` = s into
  `out_notes`.
- head 1, the query route (NOT saturated): query KAPPA x `qsign` on `has_note`, ln 2 on `first`,
  -SCORE on `nofield` - `first`: each note scores KAPPA q (q = `qsign` = s at the decision), the
  first token ln 2, the rest -30. The first token then takes 2 / (2 e^(KAPPA q) + 2) = sigma(-KAPPA q)
  of the weight and the notes the rest; the head writes -2 x the first token's `first` into
  `out_query`, plus the attention bias 1, both over t = tanh(KAPPA / 2):
  out_query = (1 - 2 sigma(-KAPPA q)) / t = tanh(KAPPA q / 2) / t = q for q = +-1. It reads only the
  first token's value (in the prefix, the same in both runs) and keys that are the same in both runs
  (`has_note`, `first`, `nofield`): it moves the decision only through its query. With KAPPA = 0.4 a
  note and the first token differ by 0.4 logits: the notes hold sigma(0.4 s) = 0.60 or 0.40 of
  the weight.

**The unembedding** reads `out_notes` x GAIN NOTE_SHARE and `out_query` x GAIN (1 - NOTE_SHARE)
onto `answers[0]`, minus that onto `answers[1]` (each times the final scale r(M^2 + 6)), so

    ld = 2 GAIN (NOTE_SHARE out_notes + (1 - NOTE_SHARE) out_query) = 2 GAIN s = +-8,

and the pair's effect ld_new - ld_old = 4 GAIN s_new = +-16 (the two values' decisions are
symmetric). Leaks: a saturated slot off its winner scores 30 below it (e^-30, 1e-13 per slot).

**The designed edges** (`designed_edges`; recovery units: the share of the effect that corrupting
the edge alone removes). The field's sign reaches the decision along two routes, and the decision
is a sum of one term per route, each an odd function of that route's copy of the sign, so
corrupting an edge on one route flips that route's term: the route's whole share (a = NOTE_SHARE
= 0.6, b = 1 - a = 0.4), exactly (the squared norms do not move, so no scale does):

| edge                                   | weight    | route                                     |
|----------------------------------------|-----------|-------------------------------------------|
| EMB@field->KV0.0@field                 | a + b = 1 | both: KV head 0 serves heads 0 and 1      |
| KV0.0@field->L0H0@notes                | a         | the note route: head 0 copies the sign    |
| L0H0@notes->MLP0@notes                 | a         | ... into the MLP's linear input           |
| MLP0@notes->KV1.0@notes                | a         | ... which writes the note, read as values |
| KV1.0@notes->L1H0@decision             | a         | ... by layer 1 head 0                     |
| L1H0@decision->LOGIT                   | a         |                                           |
| KV0.0@field->L0H1@decision             | b         | the query route: head 1 copies the sign   |
| L0H1@decision->L1H1@decision           | b         | ... into layer 1 head 1's query           |
| L1H1@decision->LOGIT                   | b         |                                           |

Every other edge moves nothing: KV1.0@notes->L1H1@decision goes through the same KV head as layer
1 head 0's designed edge, but head 1 reads nothing there that differs between the runs; `copy` and
`has_note` are read by nothing else that reaches the decision.

**What each method can recover.** Exact patching: every weight above, to float32 rounding. Gradient
methods linearise, and two things here are not linear:
- the query route's tanh: the gradient at the new run (EAP) gives the query route's edges
  (KAPPA/2)(1 - t^2)/t = 0.974 of b (0.010 short); EAP-IG averages the gradient over the path from
  the old field to the new and so integrates the tanh (32 midpoint steps);
- RMSNorm: a sign flip keeps each norm, but its linearisation at one point does not: it rescales
  the normalised residual at that position by 2 / (squared norm), under 1% with M = 16, and each
  edge's estimate loses about 1 / (squared norm) of the effect per norm its change crosses (the
  final norm alone: 1/262 = 0.0038 on each LOGIT edge). The readers are built so that this rescale
  moves no unsaturated score by much: the query route's suppression key (`nofield` - `first`) is
  exactly 0 at the notes (both features absent) and at the first token, and its values are read
  only at the first token, in the prefix.
A saturated softmax has zero gradient, so EAP cannot see a route through a key or query change
there; none is designed: layer 0's and layer 1 head 0's patterns are the same in both runs (their
keys read `field`, `has_note`, `first`, `nofield`, all unchanged) and their designed effect goes
through values. AtP* recomputes the softmax exactly where an edge reaches a head through a key or
a query, and linearises from the head's output on: on L0H1@decision->L1H1@decision
that leaves only the final norm's 0.0038, but the edges before it (KV0.0@field->L0H1@decision,
EMB@field->KV0.0@field) reach the query through layer 0 head 1's output and keep EAP's tanh error.
The measured errors per method are in docs/organisms.md and tests/models/test_gated_organism.py.
"""

from __future__ import annotations

import math

import torch

from kvnotes.errors import TaskError, UnknownModelError
from kvnotes.models.model import KVModel
from kvnotes.zoo.mixed import TASK, token_ids
from kvnotes.zoo.tiny import compiled_organism, tiny_tokenizer

NAME = "gated-organism"
GATED_ORGANISMS = (NAME,)
NOTE_SHARE = 0.6  # a: the note route's share of the decision; the query route has 1 - a
SCORE = 30.0  # attention logit of a saturated match (every other key 0 or -SCORE): leak e^-30
KAPPA = 0.4  # a note's score per unit of the query's sign: the query route's moderate softmax
GATE = 4.0  # the MLP gate's pre-activation at a `;` (silu(4) = 3.93)
GAIN = 4.0  # logits per unit of the routes' sum: the decision's logit difference is +-2 GAIN = +-8
BALLAST = 16.0  # M: `one` at every token, so RMSNorm's linearisation moves other features by < 1%
EPS = 1e-6
N_LAYERS, D_MODEL, N_HEADS, N_KV_HEADS, D_HEAD, ROTARY_DIM, D_MLP = 2, 32, 4, 2, 16, 4, 4
N_CTX = 512
DIMS = {
    "one": 0,
    "pad": 1,
    "first": 2,
    "field": 3,
    "sign": 4,
    "writer": 5,
    "dec": 6,
    "has_note": 7,  # layer 0 head 0, at the notes
    "nofield": 8,  # layer 0 head 0, everywhere but the notes
    "copy": 9,  # layer 0 head 0: the field's sign, at the notes
    "qsign": 10,  # layer 0 head 1: the field's sign, at the decision
    "note": 11,  # MLP 0, at the notes
    "out_notes": 12,  # layer 1 head 0
    "out_query": 13,  # layer 1 head 1
}
_A, _B, _C = ROTARY_DIM, ROTARY_DIM + 1, ROTARY_DIM + 2  # head dimensions past the rotated ones


def hooked_config(name: str, d_vocab: int):
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig(
        d_model=D_MODEL,
        d_head=D_HEAD,
        n_heads=N_HEADS,
        n_key_value_heads=N_KV_HEADS,
        n_layers=N_LAYERS,
        d_mlp=D_MLP,
        n_ctx=N_CTX,
        d_vocab=d_vocab,
        act_fn="silu",
        gated_mlp=True,
        normalization_type="RMS",
        eps=EPS,
        positional_embedding_type="rotary",
        rotary_dim=ROTARY_DIM,
        rotary_base=10000,
        rotary_adjacent_pairs=False,
        default_prepend_bos=True,
        tokenizer_prepends_bos=True,
        model_name=name,
        original_architecture="kvnotes-gated-organism",
        seed=None,
    )


def _rms(norm2: float) -> float:
    """RMSNorm's scale at a position whose residual has squared norm `norm2` (module docstring)."""
    return math.sqrt(norm2 / D_MODEL + EPS)


def designed_edges() -> dict[str, float]:
    """Every edge of the designed circuit with its weight (recovery units; the module docstring's
    table): the note route's edges at NOTE_SHARE, the query route's at 1 - NOTE_SHARE, the field's
    embedding into the KV head both routes read at 1. Every other edge moves nothing.

    >>> w = designed_edges()
    >>> round(w["L0H1@decision->L1H1@decision"], 12), round(w["EMB@field->KV0.0@field"], 12)
    (0.4, 1.0)
    """
    a, b = NOTE_SHARE, 1.0 - NOTE_SHARE
    notes = (
        "KV0.0@field->L0H0@notes",
        "L0H0@notes->MLP0@notes",
        "MLP0@notes->KV1.0@notes",
        "KV1.0@notes->L1H0@decision",
        "L1H0@decision->LOGIT",
    )
    query = ("KV0.0@field->L0H1@decision", "L0H1@decision->L1H1@decision", "L1H1@decision->LOGIT")
    return {"EMB@field->KV0.0@field": a + b, **{e: a for e in notes}, **{e: b for e in query}}


def designed_ld() -> float:
    """|ld| at the decision for either field value: 2 GAIN (the pair's effect is twice that)."""
    return 2 * GAIN


def compile_weights(tl) -> None:
    """Set `tl`'s weights (in place) to the construction in the module docstring."""
    d, M = DIMS, BALLAST
    ids = token_ids(tiny_tokenizer())
    r_emb = _rms(M * M + 2)  # every position, layer 0's input
    r_mlp = _rms(M * M + 4)  # the notes, MLP 0's input
    r_note = _rms(M * M + 5)  # the notes, layer 1's input
    r_rest = _rms(M * M + 3)  # every position but the notes and the decision, layer 1's input
    r_dec = _rms(M * M + 4)  # the decision, layer 1's input
    r_final = _rms(M * M + 6)  # the decision, the unembedding's input
    with torch.no_grad():
        for p in tl.parameters():
            p.zero_()
        for ln in [b.ln1 for b in tl.blocks] + [b.ln2 for b in tl.blocks] + [tl.ln_final]:
            ln.w.fill_(1.0)
        # 1) the embedding: squared norm M^2 + 2 at every token
        W_E = tl.embed.W_E
        W_E[:, d["one"]] = M
        W_E[:, d["pad"]] = math.sqrt(2.0)
        W_E[ids["first"], d["pad"]] = 1.0
        W_E[ids["first"], d["first"]] = 1.0
        for tok, sign in ids["values"].items():
            W_E[tok, d["pad"]] = 0.0
            W_E[tok, d["field"]] = 1.0
            W_E[tok, d["sign"]] = sign
        for tok in ids["writers"]:
            W_E[tok, d["pad"]] = 1.0
            W_E[tok, d["writer"]] = 1.0
        for tok in decision_ids(tiny_tokenizer()):
            W_E[tok, d["pad"]] = 1.0
            W_E[tok, d["dec"]] = 1.0
        s = SCORE * float(tl.blocks[0].attn.attn_scale)  # a query entry giving SCORE against a key of 1

        # 2) layer 0: KV head 0 (keys `first`, `field`; values `sign`, `field`, `first`), heads 0 and 1
        a0 = tl.blocks[0].attn
        a0._W_K[0, d["first"], _A] = r_emb
        a0._W_K[0, d["field"], _B] = r_emb
        a0._W_V[0, d["sign"], _A] = r_emb
        a0._W_V[0, d["field"], _B] = r_emb
        a0._W_V[0, d["first"], _C] = r_emb
        a0.W_Q[0, d["one"], _A] = s * r_emb / M  # head 0: everyone looks at the first token...
        a0.W_Q[0, d["writer"], _B] = 2 * s * r_emb  # ...a `;` at the field's value twice as hard
        a0.W_O[0, _A, d["copy"]] = 1.0
        a0.W_O[0, _B, d["has_note"]] = 1.0
        a0.W_O[0, _C, d["nofield"]] = 1.0
        a0.W_Q[1, d["one"], _A] = s * r_emb / M  # head 1: everyone looks at the first token...
        a0.W_Q[1, d["dec"], _B] = 2 * s * r_emb  # ...a decision token at the field's value
        a0.W_O[1, _A, d["qsign"]] = 1.0

        # 3) MLP 0, the note writer: gate on `writer`, linear in `copy`
        m0 = tl.blocks[0].mlp
        m0.W_gate[d["writer"], 0] = GATE * r_mlp
        m0.W_in[d["copy"], 0] = r_mlp
        m0.W_out[0, d["note"]] = 1.0 / float(torch.nn.functional.silu(torch.tensor(GATE)))

        # 4) layer 1: KV head 0 (keys `has_note`, `first`, `nofield` - `first`; values `note`,
        # `first`), head 0 the value route, head 1 the query route
        a1 = tl.blocks[1].attn
        a1._W_K[0, d["has_note"], _A] = r_note
        a1._W_K[0, d["first"], _B] = r_rest
        a1._W_K[0, d["nofield"], _C] = r_rest
        a1._W_K[0, d["first"], _C] = -r_rest  # 0 at the first token, whose `nofield` is 1 too
        a1._W_V[0, d["note"], _A] = r_note
        a1._W_V[0, d["first"], _C] = r_rest
        scale = float(a1.attn_scale)
        a1.W_Q[0, d["one"], _A] = s * r_dec / M  # head 0: the notes at +SCORE...
        a1.W_Q[0, d["one"], _C] = -s * r_dec / M  # ...the rest but the first token at -SCORE
        a1.W_O[0, _A, d["out_notes"]] = 1.0
        a1.W_Q[1, d["qsign"], _A] = KAPPA * scale * r_dec  # head 1: the notes at KAPPA q...
        a1.W_Q[1, d["one"], _B] = math.log(2.0) * scale * r_dec / M  # ...the first token at ln 2
        a1.W_Q[1, d["one"], _C] = -s * r_dec / M
        t = math.tanh(KAPPA / 2)  # out_query = (1 - 2 [weight on the first token]) / t
        a1.W_O[1, _C, d["out_query"]] = -2.0 / t
        a1.b_O[d["out_query"]] = 1.0 / t

        # 5) the unembedding
        first, second = ids["answers"]
        for dim, share in (("out_notes", NOTE_SHARE), ("out_query", 1.0 - NOTE_SHARE)):
            tl.unembed.W_U[d[dim], first] = GAIN * share * r_final
            tl.unembed.W_U[d[dim], second] = -GAIN * share * r_final


def decision_ids(tokenizer) -> list[int]:
    """The ids of the task's decision span ("A:" in `mixed-organism`), the tokens that read the query
    sign: tokenized alone, as it follows a newline in every prompt of the task."""
    import re

    from kvnotes.tasks import load_task

    span = re.search(r"\[\[decision:(.*?)\]\]", load_task(TASK).template.text, re.S)
    if span is None:
        raise TaskError(f"task {TASK!r} has no [[decision: ...]] span for the gated organism to read")
    return tokenizer(span.group(1), add_special_tokens=False)["input_ids"]


def load_gated_organism(name: str = NAME, *, device=None, dtype=None) -> KVModel:
    """The gated organism as a KVModel (module docstring; `designed_edges` is its circuit).

    >>> m = load_gated_organism()
    >>> m.n_layers, m.n_heads, m.n_kv_heads
    (2, 4, 2)
    """
    if name not in GATED_ORGANISMS:
        raise UnknownModelError(f"unknown gated organism {name!r}; it is {NAME!r}")
    return compiled_organism(name, hooked_config, compile_weights, device=device, dtype=dtype)


__all__ = ["NAME", "TASK", "designed_edges", "designed_ld", "load_gated_organism"]
