"""The generated multi-session memory task (kvnotes/tasks/memory.py): drawn from the seed alone, the
size a bound, the two memories differing only in the edited value, every question's truth stated in
the memory, the update after the stale statement; on a word-piece and a character-level tokenizer."""

from __future__ import annotations

import pytest

from kvnotes.errors import TaskError
from kvnotes.tasks.memory import ATTRIBUTES, SMALL_TALK, UPDATE, memory_episode, overhead, usable_values
from kvnotes.zoo import load_model

ATTR = {a.name: a for a in ATTRIBUTES}


@pytest.fixture(scope="module", params=["gemma-3-270m", "tiny-llama"])
def encode(request):
    model = load_model(request.param)
    return lambda s: model.encode(s, bos=False)


def _find(seq, sub) -> list[int]:
    return [i for i in range(len(seq) - len(sub) + 1) if list(seq[i : i + len(sub)]) == list(sub)]


def test_an_episode_is_drawn_from_the_seed_alone(encode):
    a = memory_episode(encode, size=600, seed=3, index=1, facts=2)
    assert a == memory_episode(encode, size=600, seed=3, index=1, facts=2)
    assert a != memory_episode(encode, size=600, seed=3, index=2, facts=2)


@pytest.mark.parametrize("size", [450, 900])
def test_the_memory_is_at_most_its_size_and_short_by_under_a_line(encode, size):
    ep = memory_episode(encode, size=size, seed=0, index=0, facts=2)
    longest = max(len(encode(f"Session 9:\nUser: {u}\nAssistant: {r}\n")) for u, r in SMALL_TALK)
    assert size - longest < len(ep.memory_old) <= size


def test_the_two_memories_differ_only_in_the_edited_value(encode):
    ep = memory_episode(encode, size=900, seed=1, index=0, facts=3)
    a, b = ep.edit.span
    assert len(ep.memory_old) == len(ep.memory_new)
    assert ep.memory_old[:a] == ep.memory_new[:a] and ep.memory_old[b:] == ep.memory_new[b:]
    assert ep.memory_old[a:b] != ep.memory_new[a:b]
    q = ep.edit.question
    assert q.candidates[ep.edit.old] != q.candidates[ep.edit.new] and q.truth == ep.edit.old
    assert _find(ep.edit.erratum, ep.memory_new[a:b]), "the erratum states the new value"


def test_every_question_s_truth_is_stated_in_the_memory_and_the_update_comes_last(encode):
    for index in range(4):
        ep = memory_episode(encode, size=900, seed=0, index=index)
        assert len(ep.questions) == len(ATTRIBUTES) and sum(q.updated for q in ep.questions) == 1
        for q in ep.questions:
            a = ATTR[q.attribute]
            prefix, values = usable_values(encode, a)
            stated = encode("User: " + (UPDATE if q.updated else "") + a.before) + encode(values[q.truth])
            at = _find(ep.memory_old, stated)
            assert len(at) == 1, (q.attribute, index)
            if q.updated:  # the stale value was stated once, earlier
                stale = [v for i, v in enumerate(values) if i != q.truth]
                earlier = [
                    i for v in stale for i in _find(ep.memory_old, encode("User: " + a.before) + encode(v))
                ]
                assert len(earlier) == 1 and earlier[0] < at[0]


def test_a_character_level_tokenizer_reads_the_token_that_tells_values_apart():
    """Under the organisms' 512-token BPE " Paris" is four tokens and most cities start with " ":
    the question ends with that shared token and the candidates are the next ones, all distinct."""
    m = load_model("notes-organism")
    prefix, values = usable_values(lambda s: m.encode(s, bos=False), ATTR["city"])
    assert len(prefix) == 1 and len(values) >= 5
    firsts = [m.encode(v, bos=False)[1] for v in values]
    assert len(set(firsts)) == len(firsts)


def test_the_overhead_bounds_every_episode_s(encode):
    """What a probe checks the context against: no episode needs more beside its memory."""
    worst = max(
        memory_episode(encode, size=600, seed=s, index=i, facts=2).overhead
        for s in range(3)
        for i in range(8)
    )
    assert worst <= overhead(encode) <= worst + 20


def test_bad_sizes_and_fact_counts_are_refused(encode):
    with pytest.raises(TaskError, match="too small for its facts; give at least"):
        memory_episode(encode, size=40, seed=0, index=0)
    with pytest.raises(TaskError, match="2 to 6"):
        memory_episode(encode, size=900, seed=0, index=0, facts=7)
