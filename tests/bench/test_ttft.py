"""The time-to-first-token benchmark: the composed path is exact when the seam covers the chunk,
prefix caching is exact, the spliced chunk's decision agrees with full recompute after many hosts
(on the notes organism and on Gemma), and the report has the documented JSON shape. (No timing is
asserted: speed is a benchmark.)"""

from __future__ import annotations

import json

import pytest
import torch

from kvnotes.bench.common import text_ids
from kvnotes.bench.edit_cost import EditCostReport, edit_cost
from kvnotes.bench.multihost import (
    DEFAULT_SEAM,
    QUERY,
    SUFFIX,
    MultiHost,
    chunk_ids,
    compose_and_decide,
    reuse_prefix,
    seam_agreement,
)
from kvnotes.bench.ttft import TTFTReport, ttft
from kvnotes.cli import main
from kvnotes.errors import BadArgument, OutOfRange
from kvnotes.hosts import HOST_LINE
from kvnotes.ops import decide, precompile, prefill
from kvnotes.zoo import default_task
from tests.helpers import assert_close, assert_notebooks_close, get_model


def test_composed_context_with_a_full_seam_equals_full_prefill(rotary_model):
    """The composed path splices a moved chunk: RoPE models only (learned positions refuse it)."""
    model = rotary_model
    chunk = text_ids(model, 40)
    suffix, query = model.encode(SUFFIX, bos=False), model.encode(QUERY, bos=False)
    host = model.encode(HOST_LINE)
    full = decide(model, prefill(model, [*host, *chunk, *suffix]), query).last[0]
    composed = compose_and_decide(model, host, precompile(model, chunk), suffix, query, seam=len(chunk))
    assert_close(composed, full, what="seam over the whole chunk = full recompute")


def test_prefix_caching_reuses_the_shared_prefix_exactly(model):
    case = MultiHost.bench(model, chunk_ids(model, 40), 2)
    a, b = case.context(0), case.context(1)
    other_host = reuse_prefix(model, prefill(model, a), b)  # shares only BOS with a
    assert_notebooks_close(other_host, prefill(model, b), what="prefix cache, another host")
    longer = [*a, *model.encode(" More.", bos=False)]  # shares all of a
    assert_notebooks_close(
        reuse_prefix(model, prefill(model, a), longer), prefill(model, longer), what="a kept"
    )


def test_a_seam_over_the_whole_chunk_agrees_after_every_host(gemma3):
    case = MultiHost.bench(gemma3, chunk_ids(gemma3, 40), 8)
    r = seam_agreement(gemma3, case, seam=40)
    # exact: fractions of agreeing decisions
    assert r.hosts == 8 and r.agreement == 1.0 and r.top1_rate == 1.0
    assert min(r.cosine) > 1 - 1e-6
    assert r.composed_ld == pytest.approx(r.full_ld, abs=1e-4)


def test_hosts_must_differ_and_fit():
    model = get_model("tiny-llama")
    case = MultiHost.bench(model, [], 16)
    assert len({h[1] for h in case.hosts}) == 16  # different from the first token after BOS
    with pytest.raises(OutOfRange, match="2 to 16 host lines"):
        MultiHost.bench(model, [], 17)
    with pytest.raises(BadArgument, match="every host must differ"):
        MultiHost(hosts=(case.hosts[0],) * 2, chunk=(), lives=case.lives[:2], query=(), answers=(1, 2))


def test_notes_organism_decides_as_full_recompute_at_the_default_seam():
    # The organism's own task: the policy line spliced after 8 hosts, each with its own status line
    # (alternating, so both answers occur). Its decision reaches back 3 layers x 7 positions, only
    # to layer-0 K/V of the chunk, which no host changes: the splice is exact at any seam.
    model = get_model("notes-organism")
    case = MultiHost.from_task(model, default_task(model.name), 8)
    r = seam_agreement(model, case, seam=DEFAULT_SEAM)
    assert r.agreement == 1.0 and r.balance == 0.5  # exact: fractions of agreeing decisions
    assert min(r.cosine) > 1 - 1e-6 and r.min_margin > 1.0


def test_ttft_report_round_trips_with_exponents():
    report = ttft(get_model("tiny-llama"), [128, 256], repeats=2, hosts=4, timed_hosts=2, progress=False)
    assert [p.tokens for p in report.results] == [128, 256]
    assert report.exponent_full is not None and report.exponent_composed is not None
    assert report.exponent_multi_host_composed is not None
    for p in report.results:  # medians of 2 side-by-side repeats, with their spread
        assert p.repeats == 2 and p.composed_min_s <= p.composed_s <= p.composed_max_s
        assert p.full_min_s <= p.full_s <= p.full_max_s and p.ratio == p.full_s / p.composed_s
        assert p.prefix_cached_min_s <= p.prefix_cached_s <= p.prefix_cached_max_s
        for w in ("composed", "full", "prefix_cached"):
            lo, med, hi = (getattr(p, f"multi_host_{w}{x}") for x in ("_min_s", "_s", "_max_s"))
            assert lo <= med <= hi
        assert p.multi_host_ratio == p.multi_host_prefix_cached_s / p.multi_host_composed_s
        assert p.prefix_cached_max_err < 1e-4  # prefix caching is exact
        assert (p.hosts, p.timed_hosts) == (4, 2)
        for rate in (p.multi_host_top1_rate, p.decision_agreement, p.decision_balance):
            assert 0.0 <= rate <= 1.0
        # the null baseline: an unrelated context's logits, never the composed answer's own
        assert p.null_cosine is not None and p.null_cosine < 1.0
    assert TTFTReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    text = report.table()
    assert "growth exponent" in text and "2 different hosts" in text and "prefix-cached" in text


def test_a_report_written_before_the_four_paths_still_loads():
    point = dict(tokens=128, chunk_tokens=54, composed_s=0.5, full_s=1.0, ratio=2.0, logit_cosine=0.99)
    point |= dict(top1_agree=True, composed_min_s=0.4, composed_max_s=0.6, full_min_s=0.9, full_max_s=1.1)
    point |= dict(repeats=3, null_cosine=0.97)
    old = dict(model="m", machine="x", seam=8, suffix_tokens=21, results=[point])
    report = TTFTReport.from_dict({**old, "exponent_composed": None, "exponent_full": None})
    assert report.results[0].multi_host_composed_s is None and report.exponent_multi_host_composed is None
    assert "—" in report.table() and "different hosts" not in report.table()


def test_lengths_that_do_not_fit_are_named():
    with pytest.raises(OutOfRange, match=r"lengths \[10, 100000\] do not fit"):
        ttft(get_model("tiny-llama"), [10, 128, 100000], progress=False)
    with pytest.raises(BadArgument, match="timed_hosts=9 must lie in 2..hosts"):
        ttft(get_model("tiny-llama"), [128], hosts=8, timed_hosts=9, progress=False)


def test_cli_bench_ttft_writes_the_documented_json(tmp_path):
    out = tmp_path / "ttft.json"
    args = [
        "bench",
        "ttft",
        "--model",
        "tiny-gqa",
        "--lengths",
        "128,160",
        "--hosts",
        "4",
        "--timed-hosts",
        "2",
    ]
    assert main([*args, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {"model", "results", "exponent_composed", "exponent_full", "exponent_multi_host_composed"} <= set(
        d
    )
    assert all({"tokens", "composed_s", "full_s", "ratio"} <= set(r) for r in d["results"])
    assert all(r["hosts"] == 4 and r["timed_hosts"] == 2 and r["multi_host_ratio"] for r in d["results"])


def test_edit_cost_moves_the_field_and_round_trips(tmp_path):
    report = edit_cost(get_model("tiny-gemma3"), 300, (0.2, 0.8), progress=False)
    a, b = report.results
    assert a.field_position < b.field_position and a.tokens == b.tokens
    assert a.suffix_tokens > b.suffix_tokens and a.erratum_tokens == b.erratum_tokens
    # suffix recompute is exact, so its answer is full recompute's; the erratum's is measured
    for p in (a, b):
        assert p.suffix_agrees is True and p.suffix_recovery == pytest.approx(1.0, abs=1e-3)
        assert p.erratum_agrees is not None and p.erratum_recovery is not None and p.repeats == 3
    assert EditCostReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    out = tmp_path / "cost.json"
    assert main(["bench", "edit-cost", "--model", "tiny-llama", "--tokens", "200", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["results"]) == 5


# last in the module: the gemma fixture gives torch every core until the module ends
#
# The spliced chunk must decide as full recompute. Decision agreement alone cannot tell a splice
# without re-rotation from a correct one: on a pilot of 48 other contexts (seeds 100-105) the
# correct splice agreed on 47 and the one without re-rotation on 46, so separating them by
# agreement would take some 760 contexts (one-sided 5% errors each way). What a missing
# re-rotation does is dilute the chunk's keys: it pulls the decision toward the boundary (on the
# pilot, the spliced log-odds difference over full recompute's had median 0.68 without
# re-rotation, 1.06 with it). So each context also counts as kept when the spliced decision keeps
# at least KEEP of full recompute's log-odds difference, on its side (one-sided: the correct
# splice overshoots by a few tenths, as it may). On the pilot that held for 44/48 contexts with
# re-rotation and 21/48 without. With N_SEEDS x 8 = 40 contexts and the bar at KEPT_SHARE, a
# binomial with the pilot's rates gives a correct splice under the bar, or one without
# re-rotation over it, with probability < 1e-3 each (< 9% each at the ends of the pilot rates'
# 95% Clopper-Pearson intervals, 0.80 and 0.59). Both were fixed on the pilot, before these
# contexts (seeds 0-4) were run. Decision agreement keeps its bar of 0.9, set for the default
# seam before either (a splice moves the log-odds by a few tenths, so contexts that close to
# the boundary may flip).
KEEP = 0.7
KEPT_SHARE = 29 / 40
N_SEEDS = 5


@pytest.fixture(scope="module")
def spliced(gemma):
    """order-cancel, where Gemma 3 270M's answer moves with the order's status: its policy and
    few-shot block precompiled once per prompt sample, spliced after 8 hosts with alternating
    statuses, against full recompute of each context."""
    cases = [MultiHost.from_task(gemma, "order-cancel", 8, seed=seed) for seed in range(N_SEEDS)]
    runs = [seam_agreement(gemma, case, seam=DEFAULT_SEAM) for case in cases]
    return cases, [f for r in runs for f in r.full_ld], [c for r in runs for c in r.composed_ld]


def _without_rerotation(monkeypatch):
    """The chunk's slots moved to their new positions with their keys left at the old angles."""
    from dataclasses import replace

    import kvnotes.ops

    def moved(model, notebook, positions):  # noqa: ARG001 - the signature of kvnotes.ops.rerotate
        shift = positions if isinstance(positions, int) else None
        new = notebook.positions + shift if shift is not None else torch.as_tensor(positions).reshape(-1)
        return replace(notebook, positions=new, spans={})

    monkeypatch.setattr(kvnotes.ops, "rerotate", moved)


def _check_splice(full: list[float], composed: list[float]) -> None:
    assert len(full) == 8 * N_SEEDS and 0 < sum(f > 0 for f in full) < len(full), full  # both answers
    agree = sum((c > 0) == (f > 0) for c, f in zip(composed, full)) / len(full)
    kept = sum(c / f >= KEEP for c, f in zip(composed, full)) / len(full)
    assert agree >= 0.9 and kept >= KEPT_SHARE, (agree, kept, list(zip(full, composed)))


@pytest.mark.gemma
@pytest.mark.parametrize("planted", [None, _without_rerotation])
def test_gemma_decides_as_full_recompute_at_the_default_seam(gemma, spliced, monkeypatch, planted):
    cases, full, composed = spliced
    if planted is None:
        _check_splice(full, composed)
        return
    planted(monkeypatch)
    again = []  # the spliced decisions again (full recompute does not splice: it is reused)
    for case in cases:
        chunk, (a, b) = precompile(gemma, list(case.chunk)), case.answers
        for host, live in zip(case.hosts, case.lives):
            out = compose_and_decide(
                gemma, list(host), chunk, list(live), list(case.query), seam=DEFAULT_SEAM
            )
            again.append(float(out[a] - out[b]))
    with pytest.raises(AssertionError):
        _check_splice(full, again)
