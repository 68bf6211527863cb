"""A rank-one edit of one MLP's `W_out`, aimed three ways: the weight-edit baseline's edits.

The edit, for one pair at layer L: the key k is the MLP's hidden activation (`hook_post`, the
input of `W_out`) at the decision's last token of the OLD prompt; v* is the MLP output wanted
there; the update is

    W_out += k (v* − k·W_out − b_out)ᵀ / (kᵀk)

so that k maps to v* exactly. ROME whitens k with the covariance C of keys over a corpus (C⁻¹k
in place of the first k); this is the covariance-free version (C = identity): any other hidden
activation h moves by (h·k / k·k)(v* − k·W_out − b_out), the more the more it resembles k.

Two targets v*, one function each:
- `match_decision` (default): ROME's own aim. The smallest change of the MLP output at the key
  for which the old prompt's decision equals the new run's (ld_new), solved through the layers
  above L by Gauss-Newton. It reaches the target at any layer, so contamination and drift are
  the costs of an edit that works.
- `match_residual`: state matching. Move the MLP output at the key by the new-minus-old
  residual stream after layer L at that token, so the edited run's residual stream there is the
  new run's. Exact at the last layer, but at a middle layer the decision token's own state may
  not yet hold the conclusion (on the notes organism it is read from the notes in the last
  layer), and then this edit barely moves the decision.

That decision-keyed, identity-covariance edit is built to contaminate: every request of the task
shares its key. `rome` is ROME itself (Meng et al. 2022), the third target: the key k* is the
hidden activation at the changed field's LAST token (the subject), C is the second moment of the
layer's hidden activations over fresh prompts of the task (`key_covariance`, plus a ridge), v* is
the pre-norm MLP output there optimised by Adam until the decision reads the new value, and

    W_out += C⁻¹k* (v* − k*·W_out − b_out)ᵀ / (k*ᵀ C⁻¹ k*)

`probes.weights` measures them against the erratum.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvnotes.analysis.trials import Trial, read_decision
from kvnotes.engine import Capability, hooked, require, run, stop_for
from kvnotes.engine.guard import allow
from kvnotes.errors import KVNotesError, OutOfRange
from kvnotes.hooks import hook_name
from kvnotes.metrics import Metric, logit_diff
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import decide, prefill
from kvnotes.prompt import Prompt
from kvnotes.tasks import Task, load_task, sample
from kvnotes.types import Float, Tensor


@dataclass(frozen=True, kw_only=True, eq=False)
class RankOneEdit:
    """A rank-one change of `blocks.{layer}.mlp.W_out` that maps the hidden activation `key` to the
    pre-norm MLP output `value` exactly; apply it with `applied(model, edit)`.

    `target` is the wanted contribution to the residual stream (after the post-MLP norm, if the
    model has one) and `old` the unedited one, both at the key's token; they are kept so the
    achieved change can be checked against the wanted one.

    `direction` is C⁻¹k for ROME's covariance C (None: k itself, the covariance-free edit);
    `position` the key's token in the old prompt (None: the decision's last token).
    """

    layer: int
    key: Float[Tensor, " d_mlp"]
    value: Float[Tensor, " d_model"]
    target: Float[Tensor, " d_model"]
    old: Float[Tensor, " d_model"]
    direction: Float[Tensor, " d_mlp"] | None = None
    position: int | None = None

    def delta(self, model: KVModel) -> Float[Tensor, "d_mlp d_model"]:
        """ΔW = c (v* − k·W_out − b_out)ᵀ / (kᵀc), c = C⁻¹k (or k), against the model's current
        weights (float64 math); k still maps to v* exactly."""
        mlp = hooked(model).blocks[self.layer].mlp
        k = self.key.double()
        current = k @ mlp.W_out.double() + mlp.b_out.double()
        if self.direction is None:
            return (torch.outer(k, self.value.double() - current) / (k @ k)).to(mlp.W_out.dtype)
        c = self.direction.double()
        return (torch.outer(c, self.value.double() - current) / (k @ c)).to(mlp.W_out.dtype)


EditTarget = Callable[..., RankOneEdit]  # (trial, layer, *, new_nb=None) -> RankOneEdit

COV_PROMPTS = 32  # prompts whose every token gives ROME's key covariance
COV_SEED = 1000  # their sampler seed is the trials' + COV_SEED: other prompts than the edited ones
RIDGE = 1e-2  # ROME's C + λI, λ = RIDGE · trace(C)/d_mlp: 1% of the mean eigenvalue
ROME_STEPS, ROME_LR, ROME_DECAY = (
    30,
    0.2,
    1e-2,
)  # Adam on v*: steps, lr (× rms of the old output), |δ|² penalty


@dataclass(frozen=True, eq=False)
class KeyCovariance:
    """ROME's key statistics at one layer: the second moment C = E[h hᵀ] of the MLP's hidden
    activation (`hook_post`) over every token of `prompts` prompts of `task` (`tokens` in all),
    and the ridge λ added before solving, (C + λI)⁻¹k. Made by `key_covariance`."""

    layer: int
    task: str
    prompts: int
    tokens: int
    second_moment: Float[Tensor, "d_mlp d_mlp"]  # float64
    ridge: float  # λ, absolute
    ridge_fraction: float  # λ / (trace(C)/d_mlp)
    seconds: float  # computing it (once per model, layer and task in a run)

    @functools.cached_property
    def _factor(self) -> Tensor:
        eye = torch.eye(self.second_moment.shape[0], dtype=torch.float64)
        return torch.linalg.cholesky(self.second_moment + self.ridge * eye)

    def solve(self, k: Float[Tensor, " d_mlp"]) -> Float[Tensor, " d_mlp"]:
        """(C + λI)⁻¹ k, in k's dtype."""
        return torch.cholesky_solve(k.double()[:, None], self._factor)[:, 0].to(k.dtype)

    def describe(self) -> str:
        return (
            f"second moment of {self.tokens} tokens ({self.prompts} {self.task} prompts) "
            f"+ ridge λ={self.ridge:.3g} ({self.ridge_fraction:g}·trace(C)/d)"
        )


@allow(torch.float64)  # the keys' second moment accumulates in float64 on the model's device
def key_covariance(
    model: KVModel,
    task: Task | str,
    layer: int,
    *,
    prompts: int = COV_PROMPTS,
    seed: int = COV_SEED,
    ridge: float = RIDGE,
) -> KeyCovariance:
    """The second moment of layer `layer`'s MLP hidden activations over every token (BOS and
    decision included) of the old prompts of `prompts` fresh pairs of `task` (sampler `seed`),
    with the ridge λ = `ridge`·trace(C)/d_mlp. The sample is small (hundreds to thousands of
    tokens against d_mlp dimensions), so C alone can be singular; relative to the mean eigenvalue
    the ridge leaves the well-sampled directions whitened and keeps the solve finite.

    >>> from kvnotes import load_model
    >>> c = key_covariance(load_model("tiny-llama"), "order-cancel", 1, prompts=2)
    >>> c.prompts, c.second_moment.shape[0] == load_model("tiny-llama").cfg.d_mlp
    (2, True)
    """
    s = time.perf_counter()
    task = load_task(task)
    post = hook_name(layer, "mlp.hook_post")
    d = model.facts.d_mlp
    total, n = torch.zeros(d, d, dtype=torch.float64, device=model.device), 0
    stop = stop_for(model, [post])  # the blocks after the edited layer cannot change its MLP
    with torch.no_grad():
        for pair in sample(task, model, prompts, seed=seed):
            ids = list(pair.old.ids)
            _, out = run(model, Notebook.empty(model), ids, capture=[post], logits_at=(), stop=stop)
            h = out.activations[post][0].double()
            total += h.T @ h
            n += h.shape[0]
    c = total / n
    return KeyCovariance(
        layer=layer,
        task=task.name,
        prompts=prompts,
        tokens=n,
        second_moment=c,
        ridge=ridge * float(torch.trace(c)) / d,
        ridge_fraction=ridge,
        seconds=time.perf_counter() - s,
    )


@contextmanager
def applied(model: KVModel, edit: RankOneEdit) -> Iterator[KVModel]:
    """The model with `edit` applied in place for the block's duration; on exit, even on an
    error, `W_out` is restored bit for bit from a saved copy (models are cached and shared).

    Notebooks keep the model's fingerprint across the edit, so a notebook prefilled before it
    is accepted but stale above the edited layer: prefill again inside the block.

    >>> from kvnotes import load_model
    >>> m = load_model("tiny-llama")
    >>> w = hooked(m).blocks[1].mlp.W_out.clone()
    >>> d_mlp, d_model = m.facts.d_mlp, m.facts.d_model
    >>> e = RankOneEdit(layer=1, key=torch.ones(d_mlp), value=torch.zeros(d_model),
    ...                 target=torch.zeros(d_model), old=torch.zeros(d_model))
    >>> with applied(m, e):
    ...     changed = not torch.equal(hooked(m).blocks[1].mlp.W_out, w)
    >>> changed, torch.equal(hooked(m).blocks[1].mlp.W_out, w)
    (True, True)
    """
    w = hooked(model).blocks[edit.layer].mlp.W_out
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.add_(edit.delta(model))
        yield model
    finally:
        with torch.no_grad():
            w.copy_(saved)


def check_layer(model: KVModel, layer: int | None) -> int:
    """The layer to edit: `layer`, or the middle one (n_layers // 2) when None. Weight edits write
    TransformerLens's MLP weights (`W_out`), so they run on that backend only."""
    require(model, Capability.WEIGHTS, "weight edits (they write TransformerLens's MLP weights)")
    if layer is None:
        return model.n_layers // 2
    if not 0 <= layer < model.n_layers:
        raise OutOfRange(
            f"layer {layer} is out of range for {model.name} ({model.n_layers} layers); "
            f"pick a layer in 0..{model.n_layers - 1}, or None for the middle one"
        )
    return layer


def match_decision(
    trial: Trial, layer: int, *, new_nb: Notebook | None = None, steps: int = 30
) -> RankOneEdit:
    """ROME's target, without its covariance or KL terms: a small change u of the layer's MLP
    output at the key for which the old prompt's decision reaches the new run's (ld_new).

    The decision is read through the layers above with the edit emulated by hooks on the old
    notebook (`edit_hooks`; it is the edit itself on the decision tokens). u is solved from 0 by
    Gauss-Newton on the one constraint ld(u) = ld_new: each step adds the minimum-norm solution
    of the linearised constraint, halved until |ld − ld_new| shrinks (the full step can overshoot
    where attention switches). Each try is one forward and one backward over the decision tokens.
    It stops within 0.1% of the effect, or after `steps` tries, keeping the best u. `new_nb`
    (default `trial.new_nb`) gives ld_new; the timing loop passes a fresh prefill, so that
    reading the target is counted in the edit's cost.
    """
    m, pair = trial.model, trial.pair
    post, out = hook_name(layer, "mlp.hook_post"), hook_name(layer, "hook_mlp_out")
    goal = decision_ld(
        m, pair.new, pair.answers, trial.new_nb if new_nb is None else new_nb, metric=trial.metric
    )
    acts = decide(m, trial.old_nb, pair.old, capture=[post, out], vocab=pair.answers).activations
    key, y_old = acts[post][0, -1], acts[out][0, -1]
    tol = 1e-3 * abs(goal - trial.ld_old) + 1e-5

    def gap_and_grad(u: Tensor) -> tuple[float, Tensor]:
        u = u.clone().requires_grad_(True)
        hooks = edit_hooks(m, layer, key, u)
        logits = decide(m, trial.old_nb, pair.old, hooks=hooks, vocab=trial.vocab).last
        score = trial.score(logits)[0]
        (g,) = torch.autograd.grad(score, u)
        return goal - score.item(), g

    u = torch.zeros_like(y_old)
    gap, g = gap_and_grad(u)
    step = 1.0
    for _ in range(steps):
        if abs(gap) <= tol or not float(g @ g) > 0:
            break
        trial_u = u + step * (gap / (g @ g)) * g
        trial_gap, trial_g = gap_and_grad(trial_u)
        if abs(trial_gap) < abs(gap):
            u, gap, g, step = trial_u, trial_gap, trial_g, min(1.0, 2 * step)
        else:
            step /= 2
    value = _mlp_out(m, layer, key) + u
    return RankOneEdit(layer=layer, key=key, value=value, target=_contribution(m, layer, value), old=y_old)


def match_residual(trial: Trial, layer: int, *, new_nb: Notebook | None = None) -> RankOneEdit:
    """A state-matching target: move the layer's MLP output at the key by the new-minus-old
    residual stream after that layer (`hook_resid_post`) at the decision token, so the edited old
    run's residual stream there is the new run's. Exact at the last layer; below it the decision
    also reads the other (still old) tokens, and on a model that keeps its conclusion in notes
    the decision token's own state barely differs at a middle layer (docs/edit-compose.md).
    """
    m, pair = trial.model, trial.pair
    post, out, resid = (
        hook_name(layer, "mlp.hook_post"),
        hook_name(layer, "hook_mlp_out"),
        hook_name(layer, "hook_resid_post"),
    )
    old = decide(m, trial.old_nb, pair.old, capture=[post, out, resid], vocab=pair.answers).activations
    new = decide(
        m, trial.new_nb if new_nb is None else new_nb, pair.new, capture=[resid], vocab=pair.answers
    ).activations
    key, y_old = old[post][0, -1], old[out][0, -1]
    target = y_old + (new[resid][0, -1] - old[resid][0, -1])
    x_old = _mlp_out(m, layer, key).double()
    value = pre_norm_value(m, layer, x_old, target.double()).to(key.dtype)
    return RankOneEdit(layer=layer, key=key, value=value, target=target, old=y_old)


def rome(
    trial: Trial,
    layer: int,
    *,
    new_nb: Notebook | None = None,
    covariance: KeyCovariance | None = None,
    steps: int = ROME_STEPS,
) -> RankOneEdit:
    """ROME (Meng et al. 2022) on one pair, without its KL term: key, covariance and value.

    - k*: the MLP's hidden activation at the changed field's last token of the OLD prompt;
    - v*: the pre-norm MLP output there, x_old + δ, for which the old prompt's decision reads the
      new run's (ld_new). δ is optimised with the rest of the model frozen: Adam from 0 for
      `steps` steps (lr `ROME_LR` × the rms of x_old), on ((ld(δ) − ld_new) / effect)² +
      `ROME_DECAY`·|δ|²/|x_old|², each step one forward and backward over the tokens from the
      field's last one to the decision against the prefix's notebook. The δ of lowest loss is
      kept; it stops early within 1% of the effect. Deterministic.
    - the update whitens k* by `covariance` (`key_covariance` of the pair's task at `layer` when
      None): ΔW = C⁻¹k* (v* − k*·W_out − b_out)ᵀ / (k*ᵀC⁻¹k*), exact at k* (`RankOneEdit`).

    Where no path leads from that MLP output at the field to the decision (on the notes organism
    above layer 0: the decision reads notes, which read the field at layer 1's attention), the
    gradient is 0 and so is the edit.
    """
    m, pair = trial.model, trial.pair
    cov = key_covariance(m, pair.task, layer) if covariance is None else covariance
    if cov.layer != layer:
        raise KVNotesError(f"the key covariance is of layer {cov.layer}, not {layer}; compute it there")
    post, out = hook_name(layer, "mlp.hook_post"), hook_name(layer, "hook_mlp_out")
    goal = decision_ld(
        m, pair.new, pair.answers, trial.new_nb if new_nb is None else new_nb, metric=trial.metric
    )
    p = pair.field_span.stop - 1
    rest = list(pair.old.ids[p:])
    prefix = prefill(m, pair.old, upto=p)
    acts = decide(m, prefix, rest, capture=[post, out], vocab=trial.vocab).activations
    key, y_old = acts[post][0, 0], acts[out][0, 0]
    x_old = _mlp_out(m, layer, key).detach()
    effect = abs(goal - trial.ld_old) or 1.0

    def at_key(y, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
        head = _contribution(m, layer, x_old + delta).expand(y.shape[0], 1, -1)
        return torch.cat([head, y[:, 1:]], dim=1)

    delta = torch.zeros_like(x_old, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=ROME_LR * float(x_old.norm()) / math.sqrt(x_old.numel()))
    best, best_loss = torch.zeros_like(x_old), math.inf
    for step in range(steps + 1):
        opt.zero_grad()
        score = trial.score(decide(m, prefix, rest, hooks=[(out, at_key)], vocab=trial.vocab).last)[0]
        loss = ((score - goal) / effect) ** 2 + ROME_DECAY * (delta @ delta) / (x_old @ x_old)
        if loss.item() < best_loss:
            best, best_loss = delta.detach().clone(), loss.item()
        if abs(score.item() - goal) <= 1e-2 * effect or step == steps:
            break
        loss.backward()
        opt.step()
    value = (x_old + best).detach()
    return RankOneEdit(
        layer=layer,
        key=key,
        value=value,
        target=_contribution(m, layer, value).detach(),
        old=y_old,
        direction=cov.solve(key),
        position=p,
    )


def edit_hooks(model: KVModel, layer: int, key: Tensor, u: Tensor) -> list:
    """Hooks that make layer `layer`'s MLP output what it is after the update k uᵀ/(kᵀk), at every
    computed token: x + (h·k / k·k) u before the post-MLP norm, h being the token's hook_post.
    Differentiable in `u`; on decision tokens read against an unedited notebook it is the edit."""
    store: dict[str, Tensor] = {}

    def save(h, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
        store["h"] = h
        return h

    def edited(_unedited, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
        h = store["h"]
        coef = (h @ key) / (key @ key)
        return _contribution(model, layer, _mlp_out(model, layer, h) + coef[..., None] * u)

    return [(hook_name(layer, "mlp.hook_post"), save), (hook_name(layer, "hook_mlp_out"), edited)]


def _mlp_out(model: KVModel, layer: int, h: Tensor) -> Tensor:
    """The MLP's output for hidden activations h (its hook_post), before any post-MLP norm."""
    mlp = hooked(model).blocks[layer].mlp
    return h @ mlp.W_out + mlp.b_out


def _contribution(model: KVModel, layer: int, x: Tensor) -> Tensor:
    """What an MLP output x adds to the residual stream: x, or ln2_post(x) where the model has one."""
    return hooked(model).blocks[layer].ln2_post(x) if model.facts.norm_after_sublayers else x


def pre_norm_value(model: KVModel, layer: int, x_old: Tensor, target: Tensor) -> Tensor:
    """The MLP output (before `ln2_post`) whose contribution to the residual stream is `target`.

    Without a post-MLP norm that is `target` itself, and the edit is exact. With one (Gemma 2/3:
    y = w ⊙ x / rms(x)), a rank-one change of W_out only moves y on the sphere of normalised
    outputs, so we take the point of that sphere closest to `target` (least squares; the scale
    of x is kept at the unedited one, so the norm's eps acts as before) and the edit is exact
    only where the target lies on it.
    """
    if not model.facts.norm_after_sublayers:
        return target
    ln = hooked(model).blocks[layer].ln2_post
    rho2 = x_old.pow(2).mean()
    a = ln.w.double() * torch.sqrt(rho2 / (rho2 + ln.eps))  # y = a ⊙ s for x = rms(x_old)·s, mean(s²) = 1
    d = target.numel()
    ay, a2 = a * target, a * a
    # min |a⊙s − y|² s.t. |s|² = d: s = a y / (a² + λ) with λ > −min a², |s|² decreasing in λ
    lo, hi = -float(a2.min()), float(ay.norm()) / math.sqrt(d) - float(a2.min())
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(((ay / (a2 + mid)) ** 2).sum()) > d else (lo, mid)
    s = ay / (a2 + hi)
    return s * torch.sqrt(rho2)


def decision_ld(
    model: KVModel,
    prompt: Prompt,
    answers: Sequence[int],
    nb: Notebook | None = None,
    *,
    metric: Metric = logit_diff,
) -> float:
    """The decision's logit difference (or `metric`) on `prompt`, prefilled unless `nb` is given."""
    nb = prefill(model, prompt) if nb is None else nb
    return float(read_decision(model, nb, prompt, answers, metric=metric)[0])
