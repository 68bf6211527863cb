"""Time to first token: a composed context against full prefill of the same context, side by side.

The context is `BOS + host line + chunk + suffix`, then a query whose last token gives the first
answer token. *Composed*: the chunk was precompiled in isolation once (not timed, as a cached
skill or policy would be); per request it is spliced after the host line with re-rotation, its
first `seam` tokens are recomputed in context (it was computed without the host line), the live
`suffix` is computed, and the query is decided. *Full*: the whole context is prefilled and the
query decided. Both readouts are compared (logit cosine, top-1), so the speed is never bought
with a different answer unnoticed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.bench import machine
from kvnotes.conformance import FILLER
from kvnotes.engine import run
from kvnotes.errors import OutOfRange
from kvnotes.metrics import logit_cosine
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook

HOST = "You are the store's order assistant. Follow the policy below.\n"
QUERY = "\nQ: Can the order be cancelled? Answer cancel or deny.\nA:"
SUFFIX = "Customer: Alice. Order id: 1234.\norder_status: shipped.\n"


@dataclass(frozen=True)
class TTFTPoint:
    tokens: int         # context + query
    chunk_tokens: int
    composed_s: float
    full_s: float
    ratio: float        # full / composed
    logit_cosine: float
    top1_agree: bool


@dataclass(frozen=True)
class TTFTReport:
    model: str
    machine: str
    seam: int
    suffix_tokens: int
    results: list[TTFTPoint]
    exponent_composed: float | None
    exponent_full: float | None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TTFTReport:
        return cls(**{**d, "results": [TTFTPoint(**r) for r in d["results"]]})

    def table(self) -> str:
        lines = [f"time to first token — {self.model} — {self.machine}",
                 f"composed = precompiled chunk spliced (seam {self.seam}) "
                 f"+ {self.suffix_tokens}-token live suffix",
                 f"{'tokens':>7}{'chunk':>7}{'composed s':>12}{'full s':>10}{'ratio':>9}"
                 f"{'cosine':>10}{'top-1':>7}"]
        for r in self.results:
            lines.append(f"{r.tokens:>7}{r.chunk_tokens:>7}{r.composed_s:>12.3f}{r.full_s:>10.2f}"
                         f"{r.ratio:>8.1f}x{r.logit_cosine:>10.5f}{'same' if r.top1_agree else 'DIFF':>7}")
        if self.exponent_full is not None:
            lines.append(f"growth exponent (time ∝ tokens^e): composed {self.exponent_composed:.2f}, "
                         f"full {self.exponent_full:.2f}")
        return "\n".join(lines)


def _text_ids(model: KVModel, n: int) -> list[int]:
    """`n` token ids of neutral policy-like text (no BOS)."""
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += model.encode("".join(FILLER.format(i=j) for j in range(i, i + 50)), bos=False)
        i += 50
    return ids[:n]


def precompile(model: KVModel, chunk: list[int]) -> Notebook:
    """A chunk's notebook computed in isolation (after its own BOS, which is then dropped)."""
    nb = ops.prefill(model, [model.tokenizer.bos_token_id or 0, *chunk])
    return nb.select(list(range(1, len(chunk) + 1)))


def compose_and_decide(model: KVModel, host: list[int], chunk_nb: Notebook, suffix: list[int],
                       query: list[int], *, seam: int) -> torch.Tensor:
    """The host tokens, the spliced chunk (seam repaired), the live suffix; the query's last logits."""
    host = ops.prefill(model, host)
    nb = ops.splice(model, host, chunk_nb, seam=seam)
    nb, _ = run(model, nb, suffix, logits_at=())
    return ops.decide(model, nb, query).last[0]


def ttft(model: KVModel, lengths: list[int], *, seam: int = 8, progress: bool = True) -> TTFTReport:
    """Composed vs full time to first token at each total length in `lengths` (tokens)."""
    suffix = model.encode(SUFFIX, bos=False)
    query = model.encode(QUERY, bos=False)
    host = model.encode(HOST)
    fixed = len(host) + len(suffix) + len(query)
    bad = [n for n in lengths if n - fixed <= seam or n > model.n_ctx]
    if bad:
        raise OutOfRange(f"lengths {bad} do not fit: each must exceed {fixed + seam} tokens (host, suffix, "
                         f"query and seam) and stay within {model.name}'s n_ctx={model.n_ctx}")
    points = []
    for n in tqdm(lengths, desc="ttft", disable=not progress, unit="length"):
        chunk = _text_ids(model, n - fixed)
        chunk_nb = precompile(model, chunk)  # offline: not part of time to first token
        t0 = time.perf_counter()
        composed = compose_and_decide(model, host, chunk_nb, suffix, query, seam=seam)
        t1 = time.perf_counter()
        nb = ops.prefill(model, [*host, *chunk, *suffix])
        full = ops.decide(model, nb, query).last[0]
        t2 = time.perf_counter()
        points.append(TTFTPoint(tokens=n, chunk_tokens=len(chunk), composed_s=t1 - t0, full_s=t2 - t1,
                                ratio=(t2 - t1) / (t1 - t0), logit_cosine=float(logit_cosine(composed, full)),
                                top1_agree=bool(composed.argmax() == full.argmax())))
    exp_c = exp_f = None
    if len(points) >= 2:
        x = np.log([p.tokens for p in points])
        exp_c = float(np.polyfit(x, np.log([p.composed_s for p in points]), 1)[0])
        exp_f = float(np.polyfit(x, np.log([p.full_s for p in points]), 1)[0])
    return TTFTReport(model=model.name, machine=machine(), seam=seam, suffix_tokens=len(suffix),
                      results=points, exponent_composed=exp_c, exponent_full=exp_f)
