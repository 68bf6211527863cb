"""The keystone: every editing method on a composed cache against the same method on a recomputed
one (the paper's "Consequence 2": editing and composing are one notebook, not two tricks).

Per pair of the task, both prompts get a host before them (`host` neutral tokens after BOS), and the
skill is everything from there to the decision: the task's policy, shots, the state block holding
the gating field, and the request. Three old notebooks of the hosted old prompt:

- `composed`: the host prefilled, the skill precompiled alone (after its own BOS), re-rotated to
  its place and spliced, its first `seam` tokens recomputed in context (seam repair);
- `recomputed`: the hosted old prompt prefilled whole;
- `norot`: as composed, but the skill's keys keep the angles of the positions it was compiled at
  (the ablation that must leave the diagonal).

Then the field changes, and every editing method of `probes.edit` (`refresh`, `selective_causal@K`,
`selective_deviation@K`, `suffix`, `erratum`, the `hoist` oracle and `full`) fixes each notebook. A
method's recovery on any of the three is (ld - ld_old) / (ld_full - ld_old) on one scale per pair:
ld_old the recomputed old decision, ld_full the hosted new prompt prefilled whole (every method's
target). One scale, because a composed notebook's own old decision differs from the recomputed one
by the composition's error, and a denominator taken from it can shrink or flip sign: on that scale a
stale composed notebook scores its composition error, and full recompute 1 on every side. The
selective rankings read the slots' changes against that same new notebook. So each method gives a
point (recomputed recovery, composed recovery); on the diagonal, composing changed nothing about
editing. The distance from the diagonal is each pair's composed minus recomputed recovery: a mean
with its CI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm

from kvnotes.analysis.registry import Context, Need, Options, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.trials import MIN_EFFECT, Trial, read_decision
from kvnotes.errors import BadOption, TaskError
from kvnotes.models.model import KVModel
from kvnotes.ops import precompile, prefill
from kvnotes.prompt import Template
from kvnotes.serving.manager import ERRATUM
from kvnotes.tasks import Task, load_task, sample
from kvnotes.tasks.sampler import Pair
from probes.compose import _place
from probes.edit import methods
from probes.regime import filler_text

SIDES = ("composed", "recomputed", "norot")
BUDGETS = (1, 2, 4)  # the selective methods' K (order-cancel on Gemma has fewer than 8 downstream slots)


@dataclass(frozen=True, kw_only=True)
class Keystone(TaskResult):
    """Per editing method m: `composed.m`, `recomputed.m` and `norot.m` (its recovery on each old
    notebook), `gap.m` (composed minus recomputed, per pair) and `norot_gap.m` (the ablation minus
    recomputed). `diagonal` and `norot_diagonal`: the method farthest from the diagonal, its gap
    and CI."""

    PART_PATTERNS = (r"(composed|recomputed|norot|gap|norot_gap)\.[a-z_]+(@\d+)?",)
    methods: tuple[str, ...]
    host: int  # tokens before the skill
    seam: int  # skill tokens recomputed in context
    budgets: tuple[int, ...]
    skill_tokens: tuple[int, ...] = ()  # per pair
    diagonal: dict = field(default_factory=dict)
    norot_diagonal: dict = field(default_factory=dict)

    def cell(self, part: str) -> tuple[str, str] | None:
        """Each method a row; composed, recomputed, norot and the gaps its columns."""
        side, _, method = part.partition(".")
        return (method, side) if method else None


def hosted(model: KVModel, pair: Pair, host_text: str) -> tuple[Pair, int]:
    """`pair` with `host_text` before both prompts (after BOS), and where the task's own text (the
    skill) starts: the same fields, every span moved by the host's tokens. Refused if the host's
    last token and the prompt's first tokenize together."""
    if "{" in host_text or "[[" in host_text:
        raise TaskError("the host text must not hold template syntax ({field} or [[span: ...]])")
    out, shift = [], 0
    for p in (pair.old, pair.new):
        q = Template(host_text + p.template.text, p.template.defaults).render(model, **p.values)
        shift = len(q) - len(p)
        if list(q.ids[shift + 1 :]) != list(p.ids[1:]):
            raise TaskError(
                "the host text and the prompt's first token tokenize together; end the host with "
                "a newline the prompt does not continue"
            )
        out.append(q)
    return replace(pair, old=out[0], new=out[1]), shift + 1


def keystone_trials(model: KVModel, pair: Pair, skill0: int, seam: int) -> dict[str, Trial]:
    """The hosted pair's three old notebooks (`SIDES`) as trials sharing one new notebook, the
    hosted new prompt prefilled whole (every method's target)."""
    old, new = pair.old, pair.new
    d0 = old.span("decision").start
    new_nb = prefill(model, list(new.ids[:d0]))
    host_nb = prefill(model, list(old.ids[:skill0]))
    skill = precompile(model, list(old.ids[skill0:d0]))
    books = {
        "composed": _place(model, host_nb, skill, seam, True),
        "recomputed": prefill(model, list(old.ids[:d0])),
        "norot": _place(model, host_nb, skill, seam, False),
    }
    ld_new = float(read_decision(model, new_nb, new, pair.answers)[0])
    return {
        side: Trial(
            model=model,
            pair=pair,
            old_nb=nb,
            new_nb=new_nb,
            ld_old=float(read_decision(model, nb, old, pair.answers)[0]),
            ld_new=ld_new,
            progress=False,
        )
        for side, nb in books.items()
    }


def keystone(
    model: KVModel,
    task: Task | str,
    *,
    n: int = 32,
    host: int = 32,
    seam: int = 8,
    budgets: Sequence[int] = BUDGETS,
    erratum: str = ERRATUM,
    min_effect: float = MIN_EFFECT,
    seed: int = 0,
    progress: bool = True,
) -> Keystone:
    """Every editing method on the composed, recomputed and not-re-rotated notebooks of `n` hosted
    pairs (module docstring). Pairs whose recomputed decision moves less than `min_effect` are
    excluded (their recovery is noise). Refuses a budget larger than a pair's downstream region
    before any forward."""
    task = load_task(task)
    host_text = filler_text(model, host)
    pairs = [hosted(model, p, host_text) for p in sample(task, model, n, seed=seed)]
    room = min(len(p.downstream()) for p, _ in pairs)
    if max(budgets, default=0) > room:
        raise BadOption(
            f"--budgets {max(budgets)} is larger than the downstream region ({room} slots between the "
            f"field and the decision in the shortest pair of {task.name!r}); use budgets up to {room}"
        )
    acc: dict[str, list[float]] = {}
    labels: dict[str, list[int]] = {}
    excluded, sizes = [], []
    for pair, skill0 in tqdm(pairs, desc="keystone", unit="pair", disable=not progress):
        trials = keystone_trials(model, pair, skill0, seam)
        if not trials["recomputed"].usable(min_effect):
            excluded.append({"seed": pair.seed, "reason": f"decision moved < {min_effect}"})
            continue
        sizes.append(pair.old.span("decision").start - skill0)
        base = trials["recomputed"]
        rec = {side: _recoveries(t, base, budgets, erratum) for side, t in trials.items()}
        for m, full in rec["recomputed"].items():
            got = {
                **{f"{side}.{m}": rec[side][m] for side in SIDES},
                f"gap.{m}": rec["composed"][m] - full,
                f"norot_gap.{m}": rec["norot"][m] - full,
            }
            for k, v in got.items():
                acc.setdefault(k, []).append(v)
                labels.setdefault(k, []).append(pair.template)
    parts = {k: Estimate.of(v, seed=seed, clusters=labels[k]) for k, v in acc.items()}
    names = tuple(k.split(".", 1)[1] for k in acc if k.startswith("gap."))
    diag, norot = _farthest(parts, names, "gap"), _farthest(parts, names, "norot_gap")
    return Keystone.of(
        name="keystone",
        headline=f"gap.{diag['method']}" if diag else "gap.erratum",
        parts=parts,
        excluded=excluded,
        methods=names,
        host=host,
        seam=seam,
        budgets=tuple(budgets),
        skill_tokens=tuple(sizes),
        diagonal=diag,
        norot_diagonal=norot,
        description="every editing method on a composed cache against a recomputed one",
    )


def _recoveries(t: Trial, base: Trial, budgets: Sequence[int], erratum: str) -> dict[str, float]:
    """Each method's recovery on trial `t`'s old notebook, on `base`'s scale (the recomputed pair)."""
    return {m: float(base.recovery(ld)) for m, (ld, _, _) in methods(t, budgets, erratum).items()}


def _farthest(parts: dict[str, Estimate], names: Sequence[str], prefix: str) -> dict:
    """The method whose mean `prefix` gap is largest in size, with its CI."""
    best = None
    for m in names:
        e = parts.get(f"{prefix}.{m}")
        if e is not None and e.mean is not None and (best is None or abs(e.mean) > abs(best[2])):
            best = (m, e, e.mean)
    if best is None:
        return {}
    return {"method": best[0], "gap": best[1].mean, "ci": list(best[1].ci) if best[1].ci else None}


@dataclass(frozen=True)
class KeystoneConfig(Options):
    keystone_pairs: int = option(32, "keystone: pairs (the task's wordings in turn)", least=1, arg="n")
    host: int = option(32, "keystone: host tokens before the composed skill", least=1, tokens=True)
    seam: int = option(8, "skill tokens recomputed in context at the seam", least=0)
    budgets: tuple[int, ...] = option(BUDGETS, "keystone: the selective methods' K", least=1)


@analysis(
    "keystone",
    "compose",
    KeystoneConfig,
    Keystone,
    quick={"keystone_pairs": 4, "budgets": (1, 4)},
    order=4,
    default=False,  # `kvnotes compose keystone` (alone) or `--keystone` (with the rest); reports run it
    flag="keystone",
    requires=(Need.RULE, Need.MOVING_CHUNKS),
)
def _run_keystone(ctx: Context, cfg: KeystoneConfig) -> Keystone:
    """Every editing method on a composed cache against a recomputed one, and without re-rotation."""
    return cfg.call(keystone, ctx.model, ctx.task, min_effect=ctx.min_effect, **ctx.common)
