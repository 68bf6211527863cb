"""The decision metric, recovery and rank correlation: one definition each, in float64."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from scipy.stats import spearmanr

from kvnotes.analysis.trials import make_trials
from kvnotes.errors import MIN_EFFECT, SmallEffect
from kvnotes.metrics import answer_columns, answer_logprob, logit_diff, recovery, spearman
from kvnotes.ops import Patch, decide
from tests.helpers import get_model

TASK = "order-cancel"


def test_logit_diff_casts_to_float64_before_subtracting():
    logits = torch.tensor([[3.0, 1e-8, 0.5], [-2.0, 7.0, 1.0]], dtype=torch.float32)
    got = logit_diff(logits, (0, 1))
    assert got.dtype == torch.float64 and got.shape == (2,)
    want = [float(logits[i, 0]) - float(logits[i, 1]) for i in range(2)]  # float64 arithmetic
    assert got.tolist() == want
    # exact: the point is float32 rounding, checked at its exact value (3 - 1e-8 rounds to 3)
    assert got[0].item() != 3.0  # subtracting in float32 rounds 3 - 1e-8 to 3
    assert torch.equal(logit_diff(logits, 0, 1), got)  # the two-int call is the same metric


def test_answer_logprob_is_the_first_answers_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 4.0]], dtype=torch.float32)
    got = answer_logprob(logits, (2, 0))
    assert got.dtype == torch.float64
    for row, value in zip(logits.tolist(), got.tolist()):
        want = row[2] - math.log(sum(math.exp(x) for x in row))
        assert value == pytest.approx(want, abs=1e-12)


def test_answer_columns_restricts_the_unembed_only_for_logit_diff():
    assert answer_columns(logit_diff, (7, 3)) == ((7, 3), (0, 1))
    assert answer_columns(answer_logprob, (7, 3)) == (None, (7, 3))


def test_recovery_guards_a_zero_denominator():
    got = recovery(torch.tensor([0.5, 2.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 3.0]))
    # exact: halves and integers
    assert got.dtype == torch.float64 and got.tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="undefined"):
        recovery(torch.tensor([0.3, 0.5]), torch.tensor([1.0, 2.0]), torch.tensor([2.0, 2.0]))
    soft = recovery(
        torch.tensor([0.3, 0.5]), torch.tensor([1.0, 2.0]), torch.tensor([2.0, 2.0]), undefined="nan"
    )
    assert soft[0].item() == pytest.approx(-0.7) and math.isnan(soft[1].item())
    # exact: 0.5 / 2.0 is exact in binary
    assert recovery(1.5, 1.0, 3.0).item() == 0.25  # plain floats too


def test_spearman_is_none_for_a_constant_ranking():
    a, b = [0.1, 0.4, 0.2, 0.9], [1.0, 3.0, 2.0, 2.5]
    assert spearman(a, b) == pytest.approx(float(spearmanr(a, b).statistic))
    assert spearman([1.0, 1.0, 1.0], b[:3]) is None


@pytest.fixture(scope="module")
def model():
    return get_model("tiny-llama")


def test_default_trials_read_the_float64_logit_difference(model):
    trials = make_trials(model, TASK, 2, progress=False)
    for t in trials:
        assert t.metric is logit_diff and t.vocab == t.pair.answers
        for value, nb, prompt in ((t.ld_old, t.old_nb, t.pair.old), (t.ld_new, t.new_nb, t.pair.new)):
            o = decide(model, nb, prompt, vocab=t.pair.answers).last[0]
            assert value == float(o[0].double()) - float(o[1].double())
            assert abs(value - float(o[0] - o[1])) < 1e-5  # what it was when subtracted in float32
        assert float(t.ld(t.new_nb)[0]) == t.ld_new
        # recovery as the trial computed it before: (ld - ld_old) / (ld_new - ld_old) in float64
        ld = torch.tensor([t.ld_old, t.ld_new, 0.5 * (t.ld_old + t.ld_new)], dtype=torch.float64)
        assert torch.equal(t.recovery(ld), (ld - t.ld_old) / (t.ld_new - t.ld_old))


def test_make_trials_with_answer_logprob(model):
    trials = make_trials(model, TASK, 2, progress=False, metric=answer_logprob)
    for t in trials:
        assert t.metric is answer_logprob and t.vocab is None
        for value, nb, prompt in ((t.ld_old, t.old_nb, t.pair.old), (t.ld_new, t.new_nb, t.pair.new)):
            logits = decide(model, nb, prompt).last[0]
            assert logits.shape[-1] == model.cfg.d_vocab_out
            assert value == pytest.approx(float(answer_logprob(logits, t.pair.answers)), abs=1e-9)
            assert value < 0.0
        assert float(t.ld(t.old_nb)[0]) == pytest.approx(t.ld_old, abs=1e-9)
        # every slot from the new run, then none: back in log-probabilities (the tiny model's effect
        # is small, so batched float32 rounding would dominate a comparison in recovery units)
        rec = t.sweep([Patch(), Patch(positions=())])
        lds = t.ld_old + rec * (t.ld_new - t.ld_old)
        assert lds.tolist() == pytest.approx([t.ld_new, t.ld_old], abs=1e-5)


def test_recovery_flags_an_effect_under_the_minimum_and_only_there():
    """A 0.02-logit change recovered 0.98 is mostly noise: recovery warns SmallEffect, naming the
    smallest effect, how many prompts and the way out; at 0.1 logits (MIN_EFFECT) and above it is
    silent, and min_effect=0 silences it."""
    with pytest.warns(SmallEffect, match=r"effect of 0\.02 logits \(1 of 2 prompts.*min_effect=0") as w:
        got = recovery(torch.tensor([0.0196, 0.5]), torch.tensor([0.0, 0.0]), torch.tensor([0.02, 1.0]))
    assert len(w) == 1 and got.tolist() == pytest.approx([0.98, 0.5], abs=1e-6)  # float32 inputs
    assert MIN_EFFECT == pytest.approx(0.1)  # the analyses' threshold, which the warning names
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails here
        recovery(0.05, 0.0, MIN_EFFECT)
        recovery(0.05, 0.0, -0.5)
        recovery(0.0196, 0.0, 0.02, min_effect=0)
