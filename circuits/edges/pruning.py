"""Edge pruning (Bhaskar et al. 2024, "Finding Transformer Circuits with Edge Pruning") on the
notebook's edge graph: a learned mask per edge, each the share of the new run's value the edge
carries (the rest the old run's, as `EdgePatcher.patch` interchanges it), pushed toward a target
sparsity while the decision stays the full model's.

- **Masks.** Hard concrete (Louizos et al. 2018): z = clamp(sigmoid((log u - log(1 - u) + log_alpha)
  / beta) (r - l) + l, 0, 1), u uniform, beta = 2/3, stretched to (l, r) = (-0.1, 1.1), so a mask is
  exactly 0 or 1 with positive probability; one z per edge and pair, drawn afresh every step.
- **Loss.** The decision's squared gap to the full model's, in units of the pair's effect
  ((recovery - 1)^2, averaged over the pairs; the paper fits the KL divergence of the whole
  vocabulary, where the notebook's patching forward reads only the answer columns), plus the
  Lagrangian l1 (s - t) + l2 (s - t)^2 of the expected edge sparsity s (the mean probability that a
  mask is 0) against the target t, which rises linearly from 0 over the warm-up.
- **Optimiser**, the paper's for IOI on GPT-2: AdamW without weight decay on the log alphas
  (initialised at 10, sd 0.01: every edge in), learning rate 0.8, and on the multipliers l1, l2 by
  gradient ascent at 0.8; 3000 steps, the target reached at step 2500 (`PruneSettings`).
- **Ranking.** Each edge's learned log alpha (`scores`: as P(z > 0), monotone in it); `kept` is the paper's
  deterministic circuit: the round(expected number of non-zero masks) edges of largest log alpha.

The engine's part: every step is one forward of the computed tokens per pair against the shared
prefix's notebook, with the masks as the patch's differentiable shares (`EdgePatcher.soft`), so a
mask reaches the reader's input, the keys before the softmax and the values after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from circuits.edges.patcher import EdgePatcher
from kvnotes.errors import BadArgument

BETA, LEFT, RIGHT = 2 / 3, -0.1, 1.1  # the hard concrete's temperature and stretch (Louizos et al.)
_SHIFT = BETA * math.log(-LEFT / RIGHT)  # P(z > 0) = sigmoid(log_alpha - _SHIFT)


@dataclass(frozen=True)
class PruneSettings:
    """The optimiser and its schedule (defaults: the paper's IOI runs on GPT-2)."""

    steps: int = 3000
    warmup: int = 2500  # steps over which the target sparsity rises linearly from 0
    target: float = 0.98  # edge sparsity at the end of the warm-up (the share of edges pruned)
    lr: float = 0.8  # AdamW on the log alphas
    reg_lr: float = 0.8  # gradient ascent on the Lagrange multipliers
    init: float = 10.0  # the log alphas' initial mean (sd 0.01)
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or not 0 <= self.warmup <= self.steps:
            raise BadArgument(f"need steps >= 1 and 0 <= warmup <= steps, got {self.steps} and {self.warmup}")
        if not 0 <= self.target <= 1:
            raise BadArgument(f"the target sparsity is a share of the edges, in [0, 1]; got {self.target}")
        if not (self.lr > 0 and self.reg_lr > 0):
            raise BadArgument(f"the learning rates must be positive, got {self.lr} and {self.reg_lr}")

    def target_at(self, step: int) -> float:
        return self.target if step >= self.warmup else self.target * step / max(self.warmup, 1)


@dataclass(frozen=True)
class Pruned:
    """One pruning run: every edge's learned log alpha, the deterministic circuit it implies, that
    circuit's recovery (averaged over the pairs), and what the run cost."""

    log_alpha: np.ndarray
    kept: np.ndarray  # bool per edge
    recovery: float
    sparsity: float  # the expected edge sparsity at the end
    steps: int
    forwards: int
    backwards: int

    @property
    def scores(self) -> np.ndarray:
        """The ranking score: each edge's probability of being kept, P(z > 0), monotone in its log
        alpha and never negative (so a ranking by |score|, as the benches rank, is the log alphas')."""
        return keep_probability(torch.as_tensor(self.log_alpha)).numpy()

    @property
    def size(self) -> int:
        return int(self.kept.sum())


def keep_probability(log_alpha: torch.Tensor) -> torch.Tensor:
    """P(z > 0) per edge: the hard concrete's mass above 0."""
    return torch.sigmoid(log_alpha - _SHIFT)


def sample_masks(log_alpha: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    """`rows` draws of every edge's hard-concrete mask, differentiable in the log alphas."""
    u = torch.rand((rows, len(log_alpha)), generator=generator, dtype=log_alpha.dtype)
    u = u.clamp(1e-6, 1 - 1e-6)
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / BETA)
    return (s * (RIGHT - LEFT) + LEFT).clamp(0.0, 1.0)


def deterministic_circuit(log_alpha: np.ndarray) -> np.ndarray:
    """The paper's circuit at the end: as many edges as the expected number of non-zero masks, those
    of largest log alpha."""
    n = int(round(float(keep_probability(torch.as_tensor(log_alpha)).sum())))
    kept = np.zeros(len(log_alpha), dtype=bool)
    kept[np.argsort(-log_alpha, kind="stable")[:n]] = True
    return kept


def prune_edges(
    patchers: Sequence[EdgePatcher],
    settings: PruneSettings = PruneSettings(),
    *,
    progress: Callable[[int, float, float], None] | None = None,
) -> Pruned:
    """Learn edge masks over `patchers` (one pair each, the same model) and rank the edges by them.
    `progress(step, loss, sparsity)` is called every step when given."""
    if not patchers:
        raise BadArgument("edge pruning needs at least one pair's EdgePatcher")
    n_edges = len(patchers[0].graph)
    if any(len(p.graph) != n_edges for p in patchers):
        raise BadArgument("every pair must come from the same model (the same edge graph)")
    gen = torch.Generator().manual_seed(settings.seed)
    noise = torch.randn(n_edges, generator=gen, dtype=torch.float64)
    log_alpha = (settings.init + 0.01 * noise).requires_grad_()
    lambdas = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    masks_opt = torch.optim.AdamW([log_alpha], lr=settings.lr, weight_decay=0.0)
    reg_opt = torch.optim.AdamW([lambdas], lr=settings.reg_lr, weight_decay=0.0, maximize=True)
    f0 = sum(p.forwards for p in patchers)
    b0 = sum(p.backwards for p in patchers)
    for step in range(settings.steps):
        z = sample_masks(log_alpha, len(patchers), gen)
        gap = torch.stack([(p.soft(z[i : i + 1])[0] - 1.0) ** 2 for i, p in enumerate(patchers)]).mean()
        sparsity = 1.0 - keep_probability(log_alpha).mean()
        off = sparsity - settings.target_at(step)
        loss = gap + lambdas[0] * off + lambdas[1] * off**2
        masks_opt.zero_grad()
        reg_opt.zero_grad()
        loss.backward()
        for p in patchers:
            p.backwards += 1
        masks_opt.step()
        reg_opt.step()
        if progress is not None:
            progress(step, float(loss), float(sparsity))
    la = log_alpha.detach().numpy().copy()
    kept = deterministic_circuit(la)
    recovery = float(np.mean([p.patch(kept[None])[0] for p in patchers]))
    return Pruned(
        log_alpha=la,
        kept=kept,
        recovery=recovery,
        sparsity=float(1.0 - keep_probability(torch.as_tensor(la)).mean()),
        steps=settings.steps,
        forwards=sum(p.forwards for p in patchers) - f0,
        backwards=sum(p.backwards for p in patchers) - b0,
    )
