"""Memory: the notebook's and the overlay's bytes are the formulas exactly; a decision's peak grows
at most linearly in the notebook; the batch planner caps rows by the free memory it reads; a sweep
or a given batch size that would not fit is refused before any forward, naming the option that
fits, and runs with it."""

from __future__ import annotations

import pytest
import torch

import kvnotes.batches as batches
import kvnotes.ops as ops
from kvnotes.bench import memory as bm
from kvnotes.bench.sweep import check_sweep_memory, patch_sweep
from kvnotes.engine.memory import (
    FRACTION,
    free_bytes,
    notebook_bytes,
    pretend_free,
    row_bytes,
    slot_bytes,
)
from kvnotes.errors import BadArgument, BadOption
from kvnotes.fixtures import POLICY, QUERY, STATE, filled_pair
from kvnotes.zoo import load_model


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def scaled(model):
    return bm.scaling(model, [48, 96, 192], [2, 4, 8], patched=3)


def test_notebook_and_overlay_bytes_are_the_formula_exactly(model, scaled):
    f, b = model.facts, model.dtype.itemsize
    assert slot_bytes(f, b) == 2 * 3 * 4 * 16 * 4  # tiny-llama: 3 layers, 4 kv heads, d_head 16, float32
    for r in scaled["by_tokens"]:
        assert r["notebook"] == r["formula"] == notebook_bytes(f, b, r["tokens"])
    for r in scaled["by_batch"]:
        assert r["overlay"] == r["formula"] == r["batch"] * 3 * slot_bytes(f, b)
    s = scaled["slopes"]
    # integer bytes on a line: the fitted slope is the formula's up to float rounding of the fit
    assert s["notebook_per_token"] == pytest.approx(s["notebook_formula"], rel=1e-9)
    assert s["overlay_per_row"] == pytest.approx(s["overlay_formula"], rel=1e-9)


def test_peaks_grow_at_most_linearly_and_under_the_formula(scaled):
    """Live tensor bytes are counted exactly (no RSS): a peak `a + c * n` with `a >= 0` grows by at
    most the ratio of the lengths; 5% covers the few tokens `filled_pair` adds beyond the asked
    length. The fitted slopes stay under the formula's (an upper bound the planner relies on)."""
    t = scaled["by_tokens"]
    ratio = t[-1]["tokens"] / t[0]["tokens"]
    assert t[-1]["peak_decide"] > t[0]["peak_decide"]  # it does grow with the notebook
    assert t[-1]["peak_decide"] <= 1.05 * ratio * t[0]["peak_decide"]
    bt = scaled["by_batch"]
    assert bt[-1]["peak_forward"] <= 1.05 * bt[-1]["batch"] / bt[0]["batch"] * bt[0]["peak_forward"]
    s = scaled["slopes"]
    assert 0 < s["decide_per_token"] <= s["decide_formula"]
    assert 0 < s["forward_per_row"] <= s["forward_formula"]


def test_live_bytes_sees_a_quadratic_allocation():
    """The measure can fail a linear bound: an n x n allocation's peak grows as n squared."""

    def peak(n):
        return bm.peak_bytes(lambda: torch.ones(n, n).sum(), torch.device("cpu"))

    assert peak(100) >= 100 * 100 * 4
    assert peak(400) > 1.05 * 4 * peak(100)


def test_free_memory_is_read_and_can_be_pretended():
    cpu = torch.device("cpu")
    real = free_bytes(cpu)
    assert real is None or real > 0
    with pretend_free(12345):
        assert free_bytes(cpu) == 12345
    assert (free_bytes(cpu) is None) == (real is None)  # the pretence ends with the block


def test_plan_batches_holds_max_rows():
    assert [len(b) for b in batches.plan_batches([0] * 10, 4, 1)] == [10]  # no cap: one forward
    capped = batches.plan_batches([0] * 10, 4, 1, max_rows=3)
    assert max(len(b) for b in capped) <= 3 and sum(capped, []) == list(range(10))


@pytest.fixture(scope="module")
def pair(model):
    old, new = filled_pair(model, POLICY + STATE, QUERY, 40)
    return ops.prefill(model, old), ops.prefill(model, new), new


def _count_forwards(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = batches.run

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(batches, "run", counted)
    return calls


def test_a_batch_that_would_not_fit_is_refused_before_any_forward(model, pair, monkeypatch):
    dst, src, new = pair
    q = len(ops.query_tokens(model, dst, new)[0])
    per = row_bytes(model.facts, model.dtype.itemsize, q, dst.n_slots, 1)  # one patched slot a row
    free = int(6 * per / FRACTION) + 1  # room for 6 rows: a batch of 5 and the unchanged one
    specs = [ops.Patch(positions=(p,)) for p in range(dst.n_slots - 12, dst.n_slots)]
    calls = _count_forwards(monkeypatch)
    with pretend_free(free), pytest.raises(BadArgument, match=r"batch_size=5 or less"):
        ops.decide_patched(model, dst, src, specs, new, batch_size=12)
    assert calls == []  # refused before any forward
    with pretend_free(free):
        fitted = ops.decide_patched(model, dst, src, specs, new, batch_size=5).last
        planned = ops.decide_patched(model, dst, src, specs, new).last  # planned: cut to fit by itself
    assert calls  # with the option applied, it runs
    want = ops.decide_patched(model, dst, src, specs, new, batch_size=12).last
    # same logits whatever the batches: float32 rounding of differently batched matmuls
    assert (fitted - want).abs().max() < 1e-4 and (planned - want).abs().max() < 1e-4
    with pretend_free(int(per / FRACTION)), pytest.raises(BadArgument, match="shorter prompt"):
        ops.decide_patched(model, dst, src, specs, new)


def test_a_sweep_that_would_not_fit_is_refused_before_it_starts(model, monkeypatch):
    f, b = model.facts, model.dtype.itemsize
    n = 40
    per = row_bytes(f, b, n, 0)
    free = int((2 * notebook_bytes(f, b, n) + 3 * per) / FRACTION) + 1  # three full rows fit
    prefills: list[int] = []
    real = ops.prefill
    monkeypatch.setattr(ops, "prefill", lambda *a, **k: prefills.append(1) or real(*a, **k))
    with pretend_free(free):
        with pytest.raises(BadOption, match=r"--batch-sizes 3 or less"):
            patch_sweep(model, n, n_slots=2, repeats=1, batch_sizes=(4, 8), progress=False)
        assert prefills == []
        with pytest.raises(BadOption, match="shorter --tokens"):
            check_sweep_memory(model, 4 * n, (1,), full=True)
        r = patch_sweep(model, n, n_slots=2, repeats=1, batch_sizes=(2, 3), progress=False)
    assert prefills and r.n_patches == 2


def test_an_edge_analysis_that_would_not_fit_is_refused_before_any_forward(model, monkeypatch):
    from circuits.edges import patcher as P
    from kvnotes.tasks import load_task
    from kvnotes.tasks.sampler import sample

    pair = sample(load_task("order-cancel"), model, 1, seed=0)[0]
    start, _ = P.groups_of(model, pair)
    n = len(pair.new.ids) - start
    need = (2 + P.PATCH_ROWS) * model.n_layers * row_bytes(model.facts, model.dtype.itemsize, n, start)
    forwards: list[int] = []
    real_prefill, real_capture = P.prefill, P.capture_pair
    monkeypatch.setattr(P, "prefill", lambda *a, **k: forwards.append(1) or real_prefill(*a, **k))
    monkeypatch.setattr(P, "capture_pair", lambda *a, **k: forwards.append(1) or real_capture(*a, **k))
    with pretend_free(int(need / FRACTION) - 1), pytest.raises(BadArgument, match="shorter prompt"):
        P.edge_patcher(model, pair)
    assert forwards == []
    with pretend_free(int(need / FRACTION) + 1):
        site = P.edge_patcher(model, pair)
    assert forwards and site.n_tokens == n
