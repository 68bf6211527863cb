"""The known-circuit builder checked on programs no one chose: random RASP programs
(`kvnotes.zoo.rasp_programs`), compiled, each with a few pairs of its task; on every pair only the
known circuit's edges carrying the clean prompt's values must give the clean decision exactly
(recovery 1), and the known circuit's edges into the logit carrying the corrupt prompt's values
(everything else clean) the corrupt one (recovery 0).

    python -m circuits.random_programs --programs 200          # the full run (docs/circuits.md)
    python -m circuits.random_programs --programs 50 --reads selection   # the old rule: it fails

A program the checks before scoring refuse (it does not compile to 2-5 layers, or its compiled
model answers wrongly on most pairs) is counted by reason, not scored.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from circuits.edges import edge_patcher
from circuits.ground_truth import READS, known_edges
from kvnotes.errors import BadArgument

LAYERS = (2, 5)  # the compiled programs' depth this check covers
# tracr's weights are exact one-hot reads and saturated softmaxes: a patched run recovers the
# clean decision to float32 rounding (observed < 1e-5 of the effect); 1e-3 is far below any edge
TOL = 1e-3


@dataclass(frozen=True)
class ProgramCheck:
    """One program's pairs: recovery with only the known edges clean (`full`, each pair) and
    with the known edges into the logit corrupt (`cut`)."""

    seed: int
    ops: tuple[str, ...]
    layers: int
    heads: int
    known_edges: tuple[int, ...]
    full: tuple[float, ...]
    cut: tuple[float, ...]

    @property
    def passed(self) -> bool:
        return all(abs(f - 1) <= TOL for f in self.full) and all(abs(c) <= TOL for c in self.cut)


@dataclass(frozen=True)
class RandomProgramsReport:
    """Every scored program, and the programs refused before scoring, by reason."""

    reads: str
    seed: int
    checks: list[ProgramCheck]
    refused: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> list[ProgramCheck]:
        return [c for c in self.checks if not c.passed]

    def table(self) -> str:
        pairs = sum(len(c.full) for c in self.checks)
        full = [f for c in self.checks for f in c.full]
        cut = [x for c in self.checks for x in c.cut]
        lines = [
            f"known circuits (rule: {self.reads}) on {len(self.checks)} random programs, "
            f"{pairs} pairs, seeds from {self.seed}, {self.seconds:.0f} s",
            f"  layers: {_counts(c.layers for c in self.checks)}; known edges a pair: "
            f"{min(c_ for c in self.checks for c_ in c.known_edges)}-"
            f"{max(c_ for c in self.checks for c_ in c.known_edges)}"
            if self.checks
            else "  none scored",
        ]
        if full:
            lines.append(
                f"  only the known circuit clean: recovery {min(full):.4f} to {max(full):.4f}; "
                f"its edges into the logit cut: {min(cut):+.4f} to {max(cut):+.4f}"
            )
        lines.append(
            f"  failed: {len(self.failed)}"
            + "".join(
                f"\n    seed {c.seed} {'/'.join(c.ops)}: "
                f"full {min(c.full):.4f}, cut {max(c.cut, key=abs):+.4f}"
                for c in self.failed[:10]
            )
        )
        if self.refused:
            lines.append(
                "  refused before scoring: " + ", ".join(f"{k} {v}" for k, v in self.refused.items())
            )
        return "\n".join(lines)


def _counts(xs) -> str:
    out: dict[int, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(out.items()))


def check_program(drawn, *, n_pairs: int = 3, reads: str = "scores") -> ProgramCheck | str:
    """Compile one drawn program and check its known circuit on `n_pairs` pairs; a string says
    why the program was refused before scoring."""
    from kvnotes.zoo.tracr import compile_program, pairs

    model = compile_program(drawn.program, drawn.vocab, drawn.max_seq_len, name=f"tracr-{drawn.name}")
    if not LAYERS[0] <= model.n_layers <= LAYERS[1]:
        return f"{model.n_layers} layers"
    try:
        ps = pairs(model, n_pairs, seed=drawn.seed)
    except BadArgument as e:
        return "the model fails its pairs" if "compiled model fails" in str(e) else "too few pairs"
    full, cut, sizes = [], [], []
    for pair in ps:
        site = edge_patcher(model, pair)
        truth = known_edges(model, site, reads=reads)
        into_logit = np.array([lab.endswith("->LOGIT") for lab in site.graph.labels])
        keep = np.ones_like(truth)
        keep[truth & into_logit] = False
        f, c = site.patch(np.stack([truth, keep]))
        full.append(float(f))
        cut.append(float(c))
        sizes.append(int(truth.sum()))
    return ProgramCheck(
        drawn.seed, drawn.ops, model.n_layers, model.n_heads, tuple(sizes), tuple(full), tuple(cut)
    )


def check_random_programs(
    n: int, *, seed: int = 0, n_pairs: int = 3, reads: str = "scores", progress: bool = True
) -> RandomProgramsReport:
    """`n` random programs that compile and pass the checks, from seed `seed` on, each checked."""
    from kvnotes.zoo.rasp_programs import programs

    if reads not in READS:
        raise BadArgument(f"reads must be one of {READS}, got {reads!r}")
    start = time.perf_counter()
    checks: list[ProgramCheck] = []
    refused: dict[str, int] = {}
    draws = programs(100 * n + 100, seed=seed)
    with tqdm(total=n, desc="random programs", unit="program", disable=not progress or None) as bar:
        for drawn, screened in draws:
            if len(checks) == n:
                break
            got = check_program(drawn, n_pairs=n_pairs, reads=reads)
            if isinstance(got, str):
                refused[got] = refused.get(got, 0) + 1
                continue
            checks.append(got)
            refused.update({f"screened: {k}": v for k, v in screened.items()})
            bar.update()
    return RandomProgramsReport(reads, seed, checks, refused, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m circuits.random_programs", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--programs", type=int, default=200, help="programs to check (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="the first program's seed (default 0)")
    ap.add_argument("--pairs", type=int, default=3, help="pairs a program (default 3)")
    ap.add_argument("--reads", choices=READS, default="scores", help="the builder's rule (default scores)")
    args = ap.parse_args(argv)
    report = check_random_programs(args.programs, seed=args.seed, n_pairs=args.pairs, reads=args.reads)
    print(report.table())
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["LAYERS", "ProgramCheck", "RandomProgramsReport", "check_program", "check_random_programs"]
