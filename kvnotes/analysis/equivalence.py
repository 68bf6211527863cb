"""Equivalence by two one-sided tests (TOST): is a mean difference within ±margin?

A difference test that fails to reject "no difference" says nothing about equivalence: too few
samples fail it too. TOST turns the question round. Its two null hypotheses are that the mean
difference is at most -margin, and that it is at least +margin; equivalence is claimed only when
both are rejected at level alpha, that is when the (1 - 2 alpha) confidence interval of the mean lies
inside (-margin, +margin). With few samples or a wide spread, TOST fails: it cannot claim what the
data do not show.

Each one-sided test is Student's t on the paired differences (`scipy.stats.ttest_1samp` against
-margin with `alternative="greater"`, and against +margin with `alternative="less"`).

Differences that are all equal have no spread, and t has nothing to work with. Where their common
value is at least the margin, they are not equivalent (p = 1). Where every difference is 0, as when
a spliced cache answers every question as recompute does, the test needs `bound`, the largest a
single difference can be (1 for differences of right-or-wrong answers): the mean difference is then
at most `bound` times the rate at which pairs differ at all, and "no pair of n differed" rejects a
rate of margin / bound with the exact binomial p = (1 - margin / bound) ** n. So 48 questions
answered alike do not show equivalence at a 0.03 margin (p = 0.97 ** 48 = 0.23), and 100 do
(p = 0.048): the test asks for the data a claim needs.

>>> e = tost([0.01, -0.02, 0.0, 0.02, 0.01, -0.01], margin=0.03)
>>> e.equivalent, round(e.p, 4)
(True, 0.0026)
>>> tost([0.05, 0.04, 0.06, 0.05], margin=0.03).equivalent
False
>>> [tost([0.0] * n, margin=0.03, bound=1.0).equivalent for n in (48, 100)]
[False, True]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvnotes.errors import BadArgument


@dataclass(frozen=True)
class Equivalence:
    """A TOST: the mean difference, its standard error and degrees of freedom, the two one-sided
    p-values (`p_lower`: the mean is above -margin; `p_upper`: below +margin), their larger `p`,
    the (1 - 2 alpha) confidence interval, and whether equivalence holds at `alpha`."""

    n: int
    mean: float
    se: float
    df: int
    margin: float
    alpha: float
    p_lower: float
    p_upper: float
    p: float
    ci: tuple[float, float]
    equivalent: bool

    def to_dict(self) -> dict:
        return {**asdict(self), "ci": list(self.ci)}

    def __str__(self) -> str:
        verdict = "equivalent" if self.equivalent else "not shown equivalent"
        level = 100 * (1 - 2 * self.alpha)
        return (
            f"{self.mean:+.3f} [{self.ci[0]:+.3f}, {self.ci[1]:+.3f}] ({level:g}% CI), margin "
            f"±{self.margin:g}: {verdict} (TOST p = {self.p:.3g}, n = {self.n})"
        )


def tost(
    diffs: Sequence[float], *, margin: float, alpha: float = 0.05, bound: float | None = None
) -> Equivalence:
    """Two one-sided t-tests of paired `diffs` against ±`margin`; `bound`: the largest size one
    difference can have, for the exact test when every difference is 0 (module docstring)."""
    from scipy.stats import t as student
    from scipy.stats import ttest_1samp

    x = [float(d) for d in diffs if d is not None and math.isfinite(float(d))]
    if margin <= 0:
        raise BadArgument(f"margin={margin}: an equivalence margin must be positive")
    if not 0 < alpha < 0.5:
        raise BadArgument(f"alpha={alpha}: give a level between 0 and 0.5")
    if len(x) < 2:
        raise BadArgument(f"TOST needs at least two finite differences, got {len(x)}")
    n, mean = len(x), sum(x) / len(x)
    sd = math.sqrt(sum((v - mean) ** 2 for v in x) / (n - 1))
    se = sd / math.sqrt(n)
    if se == 0:
        p_lower, p_upper, half = _without_spread(x, margin, alpha, bound)
    else:
        p_lower = float(ttest_1samp(x, -margin, alternative="greater").pvalue)
        p_upper = float(ttest_1samp(x, margin, alternative="less").pvalue)
        half = float(student.ppf(1 - alpha, n - 1)) * se
    p = max(p_lower, p_upper)
    return Equivalence(
        n=n,
        mean=mean,
        se=se,
        df=n - 1,
        margin=margin,
        alpha=alpha,
        p_lower=p_lower,
        p_upper=p_upper,
        p=p,
        ci=(mean - half, mean + half),
        equivalent=p < alpha,
    )


def _without_spread(
    x: list[float], margin: float, alpha: float, bound: float | None
) -> tuple[float, float, float]:
    """p_lower, p_upper and the CI's half-width for differences that are all equal."""
    n, value = len(x), x[0]
    if abs(value) >= margin:  # every pair differs by at least the margin
        return float(value <= -margin), float(value >= margin), 0.0
    if any(x) or bound is None:
        raise BadArgument(
            f"all {n} differences are {value:g}: a t-test has no spread to work with; for differences "
            "bounded in size, give `bound` (1 for right-or-wrong answers) for the exact test"
        )
    p = (1 - margin / bound) ** n if margin < bound else 0.0  # no pair of n differed
    return p, p, bound * (1 - alpha ** (1 / n))  # the exact one-sided bound on the rate pairs differ
