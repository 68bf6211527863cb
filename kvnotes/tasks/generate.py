"""Pair datasets made from templates, nothing downloaded: IOI and greater-than, fitted to a tokenizer.

Each generator draws candidates (names, places, years) and keeps only those that fit the model's
tokenizer: one-token answers, and a corrupt prompt of the clean one's token count. Each template is
a `group`, so CIs cluster by template. Formulations and metrics: docs/tasks.md, "Generated pair
datasets".

    >>> from kvnotes import load_model
    >>> ps = greater_than_pairs(load_model("tiny-llama"), 4)
    >>> r = ps.records[0]
    >>> r.clean, r.correct, r.wrong
    ('The war lasted from the year 1642 to the year 16', '5', '3')
    >>> r.corrupt
    'The war lasted from the year 1601 to the year 16'
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from kvnotes.errors import BadArgument, PairsError
from kvnotes.tasks.pairs import PairSet

NAMES = (
    "Mary", "John", "James", "Anna", "David", "Sarah", "Michael", "Laura", "Paul", "Emma",
    "Peter", "Alice", "Thomas", "Kate", "George", "Lucy", "Daniel", "Jane", "Robert", "Helen",
    "Mark", "Rachel", "Steven", "Linda", "Richard", "Susan", "Andrew", "Julia", "Simon", "Grace",
)  # fmt: skip
PLACES = (
    "store",
    "park",
    "school",
    "office",
    "hospital",
    "station",
    "garden",
    "restaurant",
    "library",
    "market",
)
OBJECTS = ("drink", "book", "ring", "bag", "letter", "gift", "ball", "key", "card", "flower")

# IOI templates: {A} is the indirect object (the answer), {B} the subject named twice; the corrupt
# prompt names a third person {C} where the clean one repeats {B} (the "ABC" baseline).
IOI_TEMPLATES = (
    "When {A} and {B} went to the {place}, {S} gave a {object} to",
    "Then, {A} and {B} had a long argument. Afterwards, {S} said to",
    "After {A} and {B} went to the {place}, {S} gave a {object} to",
    "While {A} and {B} were working at the {place}, {S} gave a {object} to",
)
GT_NOUNS = ("war", "expedition", "drought", "siege", "reign", "famine", "journey", "dynasty")
GT_TEMPLATE = "The {noun} lasted from the year {century}{yy} to the year {century}"
CORRUPT_YY = "01"


def _fits(model) -> Callable[[str], bool]:
    tok = model.tokenizer
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"]) == 1


def _count(model, text: str) -> int:
    return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def single_token_words(model, words: Sequence[str]) -> list[str]:
    """The `words` that are one token with a leading space (" Mary") under `model`'s tokenizer."""
    one = _fits(model)
    return [w for w in words if one(" " + w)]


def ioi_pairs(model, n: int, *, seed: int = 0, name: str = "ioi") -> PairSet:
    """`n` IOI pairs: "When Mary and John went to the store, John gave a drink to" → " Mary" (correct)
    vs " John" (wrong); corrupt repeats a third name instead of the subject ("..., Bob gave ..."), so
    the prompt no longer singles out the indirect object. Half the pairs name the answer first (ABBA),
    half second (BABA); the template is the pair's group. Names that are not one token under the
    model's tokenizer are skipped, and a pair whose corrupt prompt tokenizes to another count is
    redrawn."""
    names = single_token_words(model, NAMES)
    if len(names) < 3:
        raise PairsError(
            f"only {len(names)} of the candidate names are one token under {model.name}'s tokenizer "
            f"({names}); IOI needs three per pair: use a model with a word-level vocabulary (gemma-3-270m)"
        )
    places, objects = PLACES, OBJECTS

    def draw(i: int, rng: random.Random) -> dict | None:
        t = i % len(IOI_TEMPLATES)
        a, b, c = rng.sample(names, 3)
        fill = {"place": rng.choice(places), "object": rng.choice(objects)}
        first, second = (a, b) if (i // len(IOI_TEMPLATES)) % 2 == 0 else (b, a)
        tpl = IOI_TEMPLATES[t]
        clean = tpl.format(A=first, B=second, S=b, **fill)
        corrupt = tpl.format(A=first, B=second, S=c, **fill)
        if _count(model, clean) != _count(model, corrupt):
            return None
        return {"clean": clean, "corrupt": corrupt, "correct": " " + a, "wrong": " " + b, "group": f"ioi-{t}"}

    return _make(model, n, seed, name, draw, "ioi")


def greater_than_pairs(model, n: int, *, seed: int = 0, name: str = "greater-than") -> PairSet:
    """`n` greater-than pairs: "The war lasted from the year 1732 to the year 17" → the decade digit
    of the end year. Where digits are single tokens (Gemma, the tiny models) the answer is one digit:
    correct is the start's decade digit + 1 (every year of that decade is later), wrong its decade
    digit − 1 (every year earlier), so the metric is logit(d+1) − logit(d−1). Corrupt starts in year
    ..01 ("1701"), after which both digits are later decades. A tokenizer that does not split the year
    into digits after the century (GPT-2's "32") is refused: the two-digit formulation is not built."""
    one = _fits(model)
    if not all(one(str(d)) for d in range(10)):
        raise PairsError(
            f"the digits 0-9 are not each one token under {model.name}'s tokenizer, so a decade digit "
            "is not a one-token answer; greater-than pairs here need a tokenizer that splits digits "
            "(gemma-3-270m)"
        )

    def draw(i: int, rng: random.Random) -> dict | None:
        century = rng.choice(("11", "12", "13", "14", "15", "16", "17", "18"))
        decade = rng.randint(2, 8)  # both decade - 1 >= 1 and decade + 1 <= 9 exist
        yy = f"{decade}{rng.randint(0, 9)}"
        noun = GT_NOUNS[i % len(GT_NOUNS)]
        clean = GT_TEMPLATE.format(noun=noun, century=century, yy=yy)
        corrupt = GT_TEMPLATE.format(noun=noun, century=century, yy=CORRUPT_YY)
        if (
            _count(model, clean) != _count(model, corrupt)
            or _count(model, clean + "9") != _count(model, clean) + 1
        ):
            return None  # the year does not split into digits here
        return {
            "clean": clean,
            "corrupt": corrupt,
            "correct": str(decade + 1),
            "wrong": str(decade - 1),
            "group": f"gt-{noun}",
        }

    return _make(model, n, seed, name, draw, "greater-than")


def _make(model, n: int, seed: int, name: str, draw: Callable, kind: str) -> PairSet:
    """`n` distinct records from `draw(i, rng)` (None: a candidate that does not fit; redrawn), checked
    under the model's tokenizer as a loaded file would be."""
    if n < 1:
        raise BadArgument(f"n must be at least 1, got {n}")
    records, seen = [], set()
    for tries in range(50 * n):
        rng = random.Random(f"{kind}/{seed}/{tries}")
        r = draw(len(records), rng)
        if r is not None and r["clean"] not in seen:
            seen.add(r["clean"])
            records.append(r)
        if len(records) == n:
            break
    if len(records) < n:
        raise PairsError(
            f"only {len(records)} of {n} {kind} pairs fit {model.name}'s tokenizer after {50 * n} draws; "
            "ask for fewer"
        )
    ps = PairSet.from_records(records, name=name, source=f"<{kind} pairs for {model.name}>")
    ps.check(model)
    return ps


GENERATORS = {"ioi": ioi_pairs, "greater-than": greater_than_pairs}

__all__ = ["GENERATORS", "greater_than_pairs", "ioi_pairs", "single_token_words"]
