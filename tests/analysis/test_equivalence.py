"""TOST (kvnotes/analysis/equivalence.py) against a case worked by hand, and cases that must fail it."""

from __future__ import annotations

import math

import pytest

from kvnotes.analysis.equivalence import tost
from kvnotes.errors import BadArgument

DIFFS = [0.01, -0.02, 0.0, 0.02, 0.01, -0.01]


def test_tost_matches_the_case_worked_by_hand():
    """By hand: n = 6, mean = 0.01 / 6 = 0.0016667; squared deviations sum to 1.08333e-3, so
    sd = sqrt(1.08333e-3 / 5) = 0.0147196 and se = sd / sqrt(6) = 0.0060093. Against margin 0.03:
    t_lower = (0.0016667 + 0.03) / se = 5.2696 and t_upper = (0.0016667 - 0.03) / se = -4.7150, on
    5 degrees of freedom. Student's t table: t(0.95, 5) = 2.015048, so the 90% CI is
    0.0016667 ± 0.0121089 = [-0.0104423, 0.0137756]; and P(T5 > 5.2696) = 0.00164,
    P(T5 < -4.7150) = 0.00263. Tolerances: 1e-6 on the arithmetic (six-digit hand values), 2e-5
    on the p-values (three significant digits from the table)."""
    e = tost(DIFFS, margin=0.03)
    assert e.n == 6 and e.df == 5
    assert math.isclose(e.mean, 0.0016667, abs_tol=1e-6)
    assert math.isclose(e.se, 0.0060093, abs_tol=1e-6)
    assert math.isclose(e.ci[0], -0.0104423, abs_tol=1e-6) and math.isclose(e.ci[1], 0.0137756, abs_tol=1e-6)
    assert math.isclose(e.p_lower, 0.00164, abs_tol=2e-5) and math.isclose(e.p_upper, 0.00263, abs_tol=2e-5)
    assert math.isclose(e.p, e.p_upper, rel_tol=1e-12) and e.equivalent


def test_the_verdict_is_the_ci_inside_the_margin():
    """TOST at alpha is equivalent exactly when the (1 - 2 alpha) CI lies inside ±margin: the CI's
    edge 0.0137756 passes a margin of 0.014 and fails one of 0.0137."""
    assert tost(DIFFS, margin=0.014).equivalent
    assert not tost(DIFFS, margin=0.0137).equivalent


def test_a_real_difference_fails_it():
    """A mean difference of 0.05 against a 0.03 margin: not equivalent, however tight."""
    e = tost([0.05, 0.04, 0.06, 0.05, 0.05], margin=0.03)
    assert not e.equivalent and e.p > 0.5


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_a_difference_beyond_either_margin_fails_by_that_side_s_own_test(sign):
    """By hand, mirrored: differences ±(0.06, 0.05, 0.04, 0.05) against margin 0.03. Mean ±0.05;
    deviations -0.01, 0, 0.01, 0 sum to 2e-4 squared, so sd = sqrt(2e-4 / 3) = 0.0081650 and
    se = 0.0040825. Below: t against -margin is (-0.05 + 0.03) / se = -4.8990 on 3 degrees of
    freedom, P(T3 > -4.8990) = 0.99186, and against +margin (-0.05 - 0.03) / se = -19.596,
    P(T3 < -19.596) = 0.000145; above, the two swap. So the side beyond its margin decides
    (p = 0.99186, not equivalent), where a TOST that ran only the other test would call it
    equivalent (p = 0.000145). Tolerances: 1e-6 on the arithmetic, 2e-5 on the p-values (the
    hand values' last digit)."""
    e = tost([sign * d for d in (0.06, 0.05, 0.04, 0.05)], margin=0.03)
    assert math.isclose(e.mean, sign * 0.05, abs_tol=1e-6) and math.isclose(e.se, 0.0040825, abs_tol=1e-6)
    beyond, inside = (e.p_lower, e.p_upper) if sign < 0 else (e.p_upper, e.p_lower)
    assert math.isclose(beyond, 0.99186, abs_tol=2e-5) and math.isclose(inside, 0.000145, abs_tol=2e-5)
    assert math.isclose(e.p, beyond, rel_tol=1e-12) and not e.equivalent


def test_too_little_data_fails_it_where_a_difference_test_would_not():
    """Mean 0 but a wide spread over four values: a t-test of "no difference" cannot reject
    (p = 1), and TOST cannot claim equivalence either: the absence of evidence is not equivalence."""
    from scipy.stats import ttest_1samp

    x = [0.2, -0.2, 0.1, -0.1]
    assert ttest_1samp(x, 0.0).pvalue > 0.9
    assert not tost(x, margin=0.03).equivalent


def test_answers_that_never_differ_need_enough_of_them():
    """Every difference 0 (no spread for t): the exact binomial test of the rate at which pairs
    differ. By hand, p = (1 - 0.03) ** n: 0.97 ** 48 = 0.2318 (not equivalent: 48 questions cannot
    rule out a 3% flip rate), 0.97 ** 100 = 0.04755 (equivalent). The CI's half-width is the exact
    95% upper bound on that rate, 1 - 0.05 ** (1 / 100) = 0.02951."""
    few, many = tost([0.0] * 48, margin=0.03, bound=1.0), tost([0.0] * 100, margin=0.03, bound=1.0)
    assert math.isclose(few.p, 0.2318, abs_tol=1e-4) and not few.equivalent
    assert math.isclose(many.p, 0.04755, abs_tol=1e-5) and many.equivalent
    assert math.isclose(many.ci[1], 0.02951, abs_tol=1e-5) and math.isclose(
        many.ci[0], -0.02951, abs_tol=1e-5
    )


def test_equal_differences_at_the_margin_fail_and_without_a_bound_are_refused():
    assert not tost([0.04] * 5, margin=0.03).equivalent
    with pytest.raises(BadArgument, match="no spread .* give `bound`"):
        tost([0.0] * 5, margin=0.03)


@pytest.mark.parametrize(
    "kw, match",
    [({"margin": 0.0}, "margin"), ({"margin": 0.03, "alpha": 0.6}, "alpha")],
)
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(BadArgument, match=match):
        tost(DIFFS, **kw)
    with pytest.raises(BadArgument, match="at least two"):
        tost([0.1], margin=0.03)
