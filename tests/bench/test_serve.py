"""The erratum-aware prompt manager (kvnotes.serving.manager) and the serve workload, no server."""

from __future__ import annotations

import random
import time
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvnotes.bench import serve as bench_serve
from kvnotes.bench import serve_client
from kvnotes.bench.serve import run_point
from kvnotes.bench.serve_workload import Values, schedule, sessions
from kvnotes.errors import BadArgument, UnknownField
from kvnotes.serving.manager import NEVER, Compaction, PromptManager, fill, hoist
from kvnotes.serving.vllm import CacheCounters, Completion, Server
from kvnotes.tasks import load_task

TEMPLATE = (
    "Policy: refunds within 30 days.\nitem: {item} {{sku}}\nstatus: {status}\n"
    "Note 1: the shop opens at nine.\nNote 2: parcels ship daily.\n"
)
VALUES = {"item": "lamp", "status": "pending"}
TAIL = "decision:"
words = lambda s: len(s.split())  # noqa: E731  a deterministic token counter for the policy

updates = st.lists(
    st.tuples(
        st.sampled_from(["item", "status"]), st.sampled_from(["lamp", "desk", "pending", "shipped", "12"])
    ),
    max_size=12,
)


def manager(strategy: str = "erratum", compaction: Compaction = NEVER, **kw) -> PromptManager:
    return PromptManager(
        TEMPLATE, VALUES, tail=TAIL, strategy=strategy, compaction=compaction, count_tokens=words, **kw
    )


@settings(max_examples=60, deadline=None)
@given(updates)
def test_rendering_is_deterministic(ops):
    a, b = manager(), manager()
    for f, v in ops:
        assert a.update(f, v) == b.update(f, v)
        assert a.render() == b.render()


@settings(max_examples=60, deadline=None)
@given(updates)
def test_the_prompt_before_the_first_erratum_never_changes(ops):
    m = manager()
    first = m.render()
    prefix = first.removesuffix(TAIL)
    before, current, changes = m.context(), dict(VALUES), 0
    for f, v in ops:
        m.update(f, v)
        changes += current[f] != v  # one erratum per real change, none for a repeated value
        current[f] = v
        assert m.stable_prefix == prefix
        assert m.render().startswith(prefix)  # byte-identical: its prefix-cache blocks survive
        assert m.context().startswith(before)  # each request extends the last: only new errata miss
        before = m.context()
    assert len(m.errata) == changes and m.values == current


@settings(max_examples=60, deadline=None)
@given(updates)
def test_compaction_gives_the_fresh_render(ops):
    m = manager()
    for f, v in ops:
        m.update(f, v)
    m.compact()
    assert m.render() == m.fresh() == fill(TEMPLATE, m.values) + TAIL
    assert m.errata == [] and m.compactions == 1


@settings(max_examples=40, deadline=None)
@given(updates)
def test_in_place_is_the_fresh_render_and_hoist_keeps_the_same_lines(ops):
    ip, ho = manager("in_place"), manager("hoist")
    still = hoist(TEMPLATE, ["item", "status"])[0]
    for f, v in ops:
        ip.update(f, v)
        ho.update(f, v)
        assert ip.render() == ip.fresh()
        assert sorted(ho.render().splitlines()) == sorted(ho.fresh().splitlines())
        assert ho.render().startswith(fill(still, ho.values))  # the unchanging lines first


def test_an_erratum_names_the_field_and_value_and_no_change_writes_none():
    m = manager()
    assert m.update("status", "pending") == "unchanged"
    assert m.update("status", "shipped") == "erratum"
    assert "[STATE UPDATE] status → shipped" in m.render()
    assert m.render().endswith("overrides any earlier value and conclusion.\n" + TAIL)
    assert "status: pending" in m.render()  # the prefix keeps the old value: that is the point
    assert m.fresh().count("shipped") == 1 and "pending" not in m.fresh()


def test_the_policy_compacts_when_errata_pass_their_share():
    m = manager(compaction=Compaction(max_share=0.5, max_tokens=None))
    base = words(m.render())
    per = words(m.erratum_format.format(field="status", value="shipped"))
    acts = [m.update("status", v) for v in ["shipped", "pending"] * 4]
    first = acts.index("compacted")
    assert first == int(0.5 * base // per)  # the first erratum that takes the errata past half the prompt
    assert m.last_compaction and "max_share" in m.last_compaction
    assert Compaction(max_errata=2).due(1, 100, 3) == "3 errata > max_errata=2"
    assert Compaction().due(10, 1000, 1) is None


@pytest.mark.parametrize(
    "make, error, words_in_message",
    [
        (lambda: PromptManager(TEMPLATE, {"item": "x"}), UnknownField, "status"),
        (lambda: PromptManager(TEMPLATE, {**VALUES, "colour": "red"}), UnknownField, "colour"),
        (
            lambda: PromptManager(TEMPLATE, VALUES, strategy="rewrite"),
            BadArgument,
            "erratum, in_place, hoist",
        ),
        (lambda: PromptManager(TEMPLATE, VALUES, mutable=["price"]), UnknownField, "price"),
        (lambda: PromptManager(TEMPLATE, VALUES, erratum="fixed: {value}"), BadArgument, "{field}"),
        (lambda: PromptManager("no fields here", {}), BadArgument, "{name}"),
        (lambda: Compaction(max_share=0.0), BadArgument, "max_share"),
    ],
)
def test_bad_input_names_the_problem(make, error, words_in_message):
    with pytest.raises(error, match=words_in_message.replace("{", r"\{").replace("}", r"\}")):
        make()


def test_updates_to_unknown_or_fixed_fields_are_refused_and_change_nothing():
    m = manager(mutable=["status"])
    before = m.render()
    with pytest.raises(UnknownField, match="price"):
        m.update("price", "3")
    with pytest.raises(BadArgument, match="not mutable"):
        m.update("item", "desk")
    assert m.render() == before


def test_engine_session_prefills_once_then_appends_only_errata(gemma3):
    """On the engine an erratum costs its own tokens; the decision equals a prefill of the same
    tokens; an in-place rewrite costs the whole prompt and equals the fresh prompt's decision."""
    import torch

    from kvnotes.ops import decide, prefill
    from kvnotes.serving.manager import EngineSession

    m = gemma3
    er = EngineSession(m, manager())
    ip = EngineSession(m, manager("in_place"))
    first = er.decide()
    ip.decide()
    er.manager.update("status", "shipped")
    ip.manager.update("status", "shipped")
    out, ref = er.decide(), ip.decide()
    tail = m.encode(TAIL, bos=False)
    line = m.encode(er.manager.errata[0].text, bos=False)
    assert er.computed == [len(m.encode(er.manager.stable_prefix)) + len(tail), len(line) + len(tail)]
    assert ip.computed[1] == len(m.encode(ip.manager.context())) + len(tail)
    ids = m.encode(er.manager.stable_prefix) + line
    torch.testing.assert_close(out, decide(m, prefill(m, ids), tail).last[0], rtol=1e-5, atol=1e-5)
    fresh = m.encode(ip.manager.fresh().removesuffix(TAIL))
    torch.testing.assert_close(ref, decide(m, prefill(m, fresh), tail).last[0], rtol=1e-5, atol=1e-5)
    assert not torch.equal(first, out)


# --- the serve bench's workload -----------------------------------------------------------------
def test_numeric_values_alternate_sides_and_do_not_repeat():
    task = load_task("refund-window")
    v = Values(task, random.Random(0))
    seen, cur = [], v.first()
    for _ in range(30):
        cur = v.next(cur)
        seen.append(cur)
    sides = [v.outcome(x) for x in seen]
    assert all(a != b for a, b in zip(sides, sides[1:]))
    assert len(set(seen)) == len(seen)
    assert all(v.outcome(x) == task.outcome(x) for x in task.gate.values)  # the listed values agree


def test_named_values_toggle():
    task = load_task("order-cancel")
    v = Values(task, random.Random(0))
    assert v.ranges is None
    assert v.next("pending") == "shipped" and v.next("shipped") == "pending"


def test_sessions_share_the_policy_and_hold_their_own_state():
    task = load_task("refund-window")
    ss = sessions(task, words, 300, 3, seed=0)
    texts = [fill(s.template, {s.field: s.initial}) + s.tail for s in ss]
    assert all(words(t) >= 300 for t in texts) and all(words(t) < 340 for t in texts)
    assert all(s.tail == "outcome:" and s.field == "days_since_purchase" for s in ss)
    head = texts[0][: texts[0].rindex("item:")]  # the last item line opens the session's own state
    assert all(t.startswith(head) for t in texts)  # rule and examples shared
    assert len({t[len(head) :][:40] for t in texts}) == 3  # each session's state its own


def test_every_strategy_answers_the_same_changes_at_the_same_times():
    task = load_task("refund-window")
    ss = sessions(task, words, 200, 2, seed=0)
    plans = {
        s: schedule(task, ss, s, 2.0, 10, seed=1, count_tokens=words, compaction=NEVER)
        for s in ("erratum", "in_place", "hoist")
    }
    (f0, p0), (f1, p1), (_, p2) = plans.values()
    assert [(p.at, p.session, p.value, p.fresh) for p in p0] == [
        (p.at, p.session, p.value, p.fresh) for p in p1
    ]
    assert [p.prompt for p in p1] == [p.fresh for p in p1]  # in_place sends the fresh prompt
    assert all(p.prompt.startswith(f0[p.session].removesuffix(ss[p.session].tail)) for p in p0)
    assert [p.value for p in p2] == [p.value for p in p0]
    assert all(b.at > a.at for a, b in zip(p0, p0[1:]))


class StaleCache(Server):
    """A stand-in for vLLM whose prefix cache is wrong: a request under a salt an earlier request
    used answers as the first prompt under that salt did (what a stale block would give); one under
    a new salt is computed from scratch, its decision a fixed function of its text. Nothing listens
    at its url: `complete` is this object's own."""

    def __init__(self):
        super().__init__(url="http://127.0.0.1:9", model="stale-cache")
        self.first: dict[str | None, str] = {}
        self.sent: list[tuple[str, str | None, int]] = []  # prompt, salt, decision given

    @staticmethod
    def truth(prompt: str) -> int:
        return zlib.crc32(prompt.encode()) % 2

    def count_tokens(self, text: str) -> int:
        return words(text)

    def counters(self) -> CacheCounters:
        return CacheCounters(queries=0.0, hits=0.0)

    async def complete(self, client, server, prompt, *, answers=(), salt=None, timeout=0):
        d = self.truth(self.first.setdefault(salt, prompt))
        self.sent.append((prompt, salt, d))
        lps = (-0.1, -2.0) if d == 0 else (-2.0, -0.1)
        now = time.perf_counter()
        return Completion(ttft=1e-3, latency=1e-3, sent=now, text="", answer_logprobs=lps, prompt_tokens=10)


def _self_reference(monkeypatch, memo: dict):
    """In-place's own completions taken as the fresh prompts' reference (its prompt is the fresh
    prompt's text), as the bench once did."""
    real = bench_serve.drive

    async def drive(server, planned, *a, **kw):
        done = await real(server, planned, *a, **kw)
        memo.update({p.fresh: c for p, c in zip(planned, done)})
        return done

    monkeypatch.setattr(bench_serve, "drive", drive)


@pytest.mark.parametrize("planted", [None, _self_reference])
def test_in_place_agreement_is_read_against_a_request_computed_from_scratch(monkeypatch, planted):
    server, memo = StaleCache(), {}
    monkeypatch.setattr(serve_client, "complete", server.complete)
    if planted:
        planted(monkeypatch, memo)
    task = load_task("refund-window")
    ss = sessions(task, words, 200, 2, seed=0)
    p = run_point(server, task, ss, "in_place", 1000.0, 16, (0, 1), reference=memo, progress=False)
    run = [(q, d) for q, s, d in server.sent if s.startswith("kvnotes-in_place-")][len(ss) :]  # after priming
    refs = [s for _, s, _ in server.sent if s.startswith("kvnotes-reference-")]
    assert len(run) == 16
    want = sum(d == server.truth(q) for q, d in run) / len(run)
    assert want < 1, "the stale cache changed no decision here: the check could not fail"
    try:
        # 1e-12: a share of 16 counts, computed two ways
        assert abs(p.decision_agreement - want) < 1e-12, (p.decision_agreement, want)
        salts = [s for _, s, _ in server.sent]
        assert refs and all(salts.count(s) == 1 for s in refs)  # each reference computed from scratch
    except AssertionError:
        if planted:
            return
        raise
    assert not planted, "the planted bug passed"
