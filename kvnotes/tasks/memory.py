"""A generated multi-session memory task: what a user told an assistant over past sessions, and
questions whose answer is one of those facts.

An episode's memory is a log of past sessions ("Session 3:", then user and assistant lines) grown
with small talk to a target size in tokens. Six facts about the user sit at random lines in it (the
city they live in, their pet, drink, job, sport and colour), one per attribute, except one attribute
the user updates in a later session (an earlier line states the old value, a later one the new).
Each question asks one attribute as a cloze ("Answer: The user lives in") read at its last token:
the answer is correct when the true value's first token scores highest among the attribute's values.

One further fact is the episode's *edit*: the memory exists in two versions that differ only in
that fact's value tokens (same count), for editing a cache by erratum or in place. Every piece is
tokenized on its own and the pieces' ids concatenated, so an episode's tokens are the same in every
layout a probe puts them in (memory early or late), and the value's positions are known exactly.

No model is needed, only its `encode` (text to ids, no BOS): the values each attribute may take are
those whose ids have one length and distinct first tokens under that tokenizer.

>>> from kvnotes.zoo import load_model
>>> model = load_model("tiny-llama")
>>> ep = memory_episode(lambda s: model.encode(s, bos=False), size=400, seed=0, index=0, facts=2)
>>> 300 < len(ep.memory_old) == len(ep.memory_new) <= 400, len(ep.questions)
(True, 2)
>>> a, b = ep.edit.span
>>> ep.memory_old[:a] == ep.memory_new[:a] and ep.memory_old[b:] == ep.memory_new[b:]
True
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvnotes.errors import TaskError

Encode = Callable[[str], list[int]]

HEADER = "Notes kept from earlier sessions with the user.\n"
CONVERSATION = (
    "Current session:\n"
    "User: Hello again. I have a question about myself.\n"
    "Assistant: Of course. I will check what you told me before.\n"
)
ERRATUM = "Correction from the user: {statement}\n"


@dataclass(frozen=True)
class Attribute:
    """A fact the user can state: `before` + value + `after` (first person), the question, the cloze
    the answer follows, and the values it may take."""

    name: str
    before: str
    after: str
    question: str
    cloze: str
    values: tuple[str, ...]


ATTRIBUTES = (
    Attribute(
        "city",
        "I live in",
        " these days.",
        "Which city does the user live in?",
        "The user lives in",
        (" Paris", " London", " Berlin", " Tokyo", " Madrid", " Rome", " Lisbon", " Vienna"),
    ),
    Attribute(
        "pet",
        "At home I have a pet",
        " that I adore.",
        "What pet does the user have?",
        "The user has a pet",
        (" dog", " cat", " parrot", " rabbit", " hamster"),
    ),
    Attribute(
        "drink",
        "Every morning I drink",
        " before work.",
        "What does the user drink every morning?",
        "Every morning the user drinks",
        (" tea", " coffee", " milk", " juice"),
    ),
    Attribute(
        "job",
        "I work as a",
        " in a big team.",
        "What is the user's job?",
        "The user works as a",
        (" nurse", " teacher", " lawyer", " pilot", " chef"),
    ),
    Attribute(
        "sport",
        "On weekends I play",
        " with friends.",
        "Which sport does the user play on weekends?",
        "On weekends the user plays",
        (" tennis", " golf", " chess", " soccer"),
    ),
    Attribute(
        "colour",
        "My favourite colour is",
        ", always has been.",
        "What is the user's favourite colour?",
        "The user's favourite colour is",
        (" red", " blue", " green", " yellow"),
    ),
)
UPDATE = "Something changed since we last spoke. "
NOTED = "\nAssistant: Noted, I will remember that.\n"

SMALL_TALK = (
    ("The weather was grey and windy all week.", "Grey weeks can be tiring. I hope it clears soon."),
    ("I finished reading a long novel about sailors.", "That sounds absorbing. Did you like the ending?"),
    ("I tried a new recipe for soup last night.", "Cooking something new is a nice way to end a day."),
    ("My neighbour is painting his fence again.", "Some people enjoy keeping things tidy."),
    ("I could not sleep well on Tuesday.", "Poor sleep happens. A calm evening routine may help."),
    ("I watched an old film with my family.", "Old films can be a pleasant shared evening."),
    ("The train was late twice this week.", "Delays are frustrating, especially on busy days."),
    ("I started learning to knit a scarf.", "Knitting takes patience, and a scarf is a good start."),
    ("I cleaned out the attic over the weekend.", "That is a big job. It must feel good to be done."),
    ("My phone screen cracked when I dropped it.", "That is annoying. A case can help next time."),
    ("I went for a long walk by the river.", "Walks by water are often very calming."),
    ("A friend visited and we talked for hours.", "Long talks with friends are worth a lot."),
    ("I am thinking about planting a small garden.", "A garden is a lovely project for the spring."),
    ("The shop near me closed down last month.", "It is sad when a familiar place closes."),
    ("I fixed the leaking tap in the kitchen.", "Well done. Small repairs add up."),
    ("I have been going to bed earlier lately.", "Regular sleep is a good habit."),
    ("I bought a new lamp for the living room.", "Good light makes a room feel warmer."),
    ("The meeting on Friday ran very long.", "Long meetings can drain the end of a week."),
    ("I sorted all my old photos into albums.", "That must have brought back many memories."),
    ("My cousin is getting married next year.", "Congratulations to your cousin."),
    ("I lost my umbrella on the bus.", "That happens to many people. I hope it turns up."),
    ("I have been listening to a history podcast.", "History podcasts can be fascinating."),
    ("I repainted the door of the shed.", "A fresh coat of paint changes a lot."),
    ("I am saving up for a new bicycle.", "Saving for something you want is satisfying."),
)


@dataclass(frozen=True)
class Question:
    """One cloze question: its ids (`"\\nQuestion: ...\\nAnswer: <cloze>"`), the attribute, the
    candidate values' first tokens, and which of them is true (`truth`, an index into `candidates`)."""

    attribute: str
    ids: tuple[int, ...]
    candidates: tuple[int, ...]
    truth: int
    updated: bool = False  # the attribute the user updated in a later session


@dataclass(frozen=True)
class Edit:
    """The episode's edited fact: `span` (the value's ids within the memory), the old and new value's
    index into `question.candidates`, and the erratum line that states the new value."""

    attribute: str
    span: tuple[int, int]
    old: int
    new: int
    question: Question
    erratum: tuple[int, ...]


@dataclass(frozen=True)
class MemoryEpisode:
    """One user's memory in two versions (`memory_old`, `memory_new`: ids without BOS, differing only
    in `edit.span`), the current session's `conversation`, and one question per attribute stated
    (answered from `memory_old`)."""

    size: int
    memory_old: tuple[int, ...]
    memory_new: tuple[int, ...]
    conversation: tuple[int, ...]
    questions: tuple[Question, ...]
    edit: Edit

    @property
    def overhead(self) -> int:
        """Tokens an episode needs beside its memory: BOS, the conversation, the erratum, and the
        longest question."""
        return 1 + len(self.conversation) + len(self.edit.erratum) + max(len(q.ids) for q in self.questions)


def usable_values(encode: Encode, attribute: Attribute) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The attribute's values a question can tell apart under `encode`, and the tokens they share
    before the one that tells them apart: with a `prefix` of length k, every value's ids start with
    it and their k-th tokens differ (k = 0 where each value is one token). The largest such set;
    refused when it has fewer than two values."""
    ids = {v: encode(v) for v in attribute.values}
    best: tuple[tuple[int, ...], tuple[str, ...]] = ((), ())
    for prefix in [(), *sorted({tuple(x[:1]) for x in ids.values()})]:
        k, picked, seen = len(prefix), [], set()
        for v, x in ids.items():
            if len(x) > k and tuple(x[:k]) == prefix and x[k] not in seen:
                picked.append(v)
                seen.add(x[k])
        if len(picked) > len(best[1]):
            best = (prefix, tuple(picked))
    if len(best[1]) < 2:
        raise TaskError(
            f"the memory task's {attribute.name!r} values {list(attribute.values)} do not give two that "
            "a question can tell apart under this tokenizer"
        )
    return best


def overhead(encode: Encode) -> int:
    """The most tokens an episode needs beside its memory, under `encode`: BOS, the conversation, the
    longest erratum and the longest question (any attribute, any value)."""
    errata = [
        len(encode(ERRATUM.format(statement=a.before + v + a.after))) for a in ATTRIBUTES for v in a.values
    ]
    questions = [
        len(encode(f"\nQuestion: {a.question}\nAnswer: {a.cloze}")) + len(usable_values(encode, a)[0])
        for a in ATTRIBUTES
    ]
    return 1 + len(encode(CONVERSATION)) + max(errata) + max(questions)


def _edit_choice(rng: random.Random, encode: Encode, values: dict) -> tuple[str, int, int]:
    """The attribute to edit, its old and its new value: two values of one token count, so that the
    edit keeps every later position."""
    options = []
    for name, (_, vals) in values.items():
        n = [len(encode(v)) for v in vals]
        pairs = [(i, j) for i in range(len(vals)) for j in range(len(vals)) if i != j and n[i] == n[j]]
        if pairs:
            options.append((name, pairs))
    if not options:
        raise TaskError("no attribute of the memory task has two values of one token count to edit between")
    name, pairs = rng.choice(options)
    return (name, *rng.choice(pairs))


def memory_episode(
    encode: Encode, *, size: int, seed: int, index: int, facts: int = len(ATTRIBUTES)
) -> MemoryEpisode:
    """Episode `index` of the task with at most `size` memory tokens (short of it by less than one
    line of small talk), drawn from `seed` alone, about `facts` of the attributes (2 to 6; fewer fit a small
    context under a character-level tokenizer). Refuses a size too small for the facts."""
    if not 2 <= facts <= len(ATTRIBUTES):
        raise TaskError(f"facts={facts}: a memory episode states 2 to {len(ATTRIBUTES)} attributes")
    rng = random.Random(f"memory-placement/{seed}/{size}/{index}/{facts}")
    chosen = set(rng.sample(range(len(ATTRIBUTES)), facts))
    attr = {a.name: a for i, a in enumerate(ATTRIBUTES) if i in chosen}
    values = {name: usable_values(encode, a) for name, a in attr.items()}
    edited, old, new = _edit_choice(rng, encode, values)
    truth = {name: rng.randrange(len(values[name][1])) for name in attr} | {edited: old}
    updated = rng.choice([name for name in attr if name != edited])
    stale = rng.choice([i for i in range(len(values[updated][1])) if i != truth[updated]])

    def fact(name: str, value: int, prefix: str = "") -> list[list[int]]:
        a = attr[name]
        return [encode("User: " + prefix + a.before), encode(values[name][1][value]), encode(a.after + NOTED)]

    stated = {name: fact(name, truth[name]) for name in attr} | {
        updated: fact(updated, truth[updated], UPDATE)
    }
    early = fact(updated, stale)
    lines = [*stated.values(), early]
    used = sum(len(p) for line in lines for p in line) + len(encode(HEADER))
    if size < used:
        raise TaskError(f"a memory of {size} tokens is too small for its facts; give at least {used}")
    talk: list[list[list[int]]] = []
    while True:
        head = [encode(f"Session {len(talk) // 7 + 1}:\n")] if len(talk) % 7 == 0 else []
        user, reply = rng.choice(SMALL_TALK)
        line = [*head, encode(f"User: {user}\nAssistant: {reply}\n")]
        if used + sum(len(p) for p in line) > size:
            break
        talk += [[head[0]]] if head else []
        talk.append(line[-1:])
        used += sum(len(p) for p in line)
    order = [*attr, "early"]
    rng.shuffle(order)
    i, j = order.index("early"), order.index(updated)
    order[min(i, j)], order[max(i, j)] = "early", updated  # the stale statement before the update
    at = sorted(rng.choices(range(min(1, len(talk)), len(talk) + 1), k=len(order)))
    merged: list[list[list[int]]] = []
    for i, line in enumerate([*talk, None], start=0):
        merged += [early if name == "early" else stated[name] for a, name in zip(at, order) if a == i]
        merged += [line] if line is not None else []
    talk = merged
    pieces = [encode(HEADER), *[p for line in talk for p in line]]
    value_piece = stated[edited][1]
    start = sum(len(p) for p in pieces[: next(k for k, p in enumerate(pieces) if p is value_piece)])
    old_ids = [t for p in pieces for t in p]
    new_value = encode(values[edited][1][new])
    new_ids = old_ids[:start] + new_value + old_ids[start + len(new_value) :]
    questions = tuple(_question(encode, attr[n], values[n], truth[n], n == updated) for n in attr)
    a = attr[edited]
    erratum = encode(ERRATUM.format(statement=a.before + values[edited][1][new] + a.after))
    return MemoryEpisode(
        size=size,
        memory_old=tuple(old_ids),
        memory_new=tuple(new_ids),
        conversation=tuple(encode(CONVERSATION)),
        questions=questions,
        edit=Edit(
            edited,
            (start, start + len(new_value)),
            old,
            new,
            next(q for q in questions if q.attribute == edited),
            tuple(erratum),
        ),
    )


def _question(encode: Encode, a: Attribute, values: tuple, truth: int, updated: bool) -> Question:
    prefix, vals = values
    ids = encode(f"\nQuestion: {a.question}\nAnswer: {a.cloze}") + list(prefix)
    return Question(a.name, tuple(ids), tuple(encode(v)[len(prefix)] for v in vals), truth, updated)
