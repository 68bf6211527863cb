"""Serving: keep a long prompt's prefix cache hot while a field inside it changes.

A server with automatic prefix caching (vLLM, SGLang, most hosted APIs) reuses the keys and values
of the longest token prefix it has seen before. Rewrite one field inside a long prompt and every
token after it misses: their keys and values were computed while attending to the old value. The
conclusions a model drew from the field sit in those downstream tokens (docs/probes.md), so
patching the field alone would not do either. An *erratum* appended before the question keeps the
whole earlier prompt byte-identical, so it stays cached, and gives the decision a fresh,
authoritative note to read.

`PromptManager` is that pattern for application code. It holds a template with named fields and
their current values and renders plain prompt text, so it works with any OpenAI-compatible server
and with the kvnotes engine (`EngineSession`). Strategies:

- `erratum` (default): the prompt as first rendered, then one erratum line per change, then the
  tail (the question). Compacts under `Compaction`'s policy.
- `in_place`: the template rendered with the current values (the prompt rewritten each change).
- `hoist`: the template's lines that hold a mutable field moved to just before the tail, so
  everything before them never changes: the oracle, when an application can afford to lay its
  prompt out that way.

Template syntax: `{name}` is a field, `{{` and `}}` are literal braces; nothing else is special.

>>> m = PromptManager("Policy.\\nstatus: {status}\\nMore policy.\\n", {"status": "pending"},
...                   tail="decision:", compaction=NEVER)
>>> m.update("status", "shipped")
'erratum'
>>> print(m.render())
Policy.
status: pending
More policy.
<BLANKLINE>
[STATE UPDATE] status → shipped; overrides any earlier value and conclusion.
decision:
>>> m.render().startswith(m.stable_prefix), m.fresh() == PromptManager(
...     m.template, m.values, tail="decision:").render()
(True, True)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvnotes.errors import BadArgument, UnknownField

ERRATUM = "\n[STATE UPDATE] {field} → {value}; overrides any earlier value and conclusion.\n"
STRATEGIES = ("erratum", "in_place", "hoist")

_FIELD = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


def template_fields(template: str) -> tuple[str, ...]:
    """The `{name}` fields of `template`, in order of first appearance.

    >>> template_fields("{a} and {{b}} and {c}{a}")
    ('a', 'c')
    """
    seen: list[str] = []
    for m in _FIELD.finditer(template):
        if m.group(1) and m.group(1) not in seen:
            seen.append(m.group(1))
    return tuple(seen)


def fill(template: str, values: Mapping[str, str]) -> str:
    """`template` with its fields replaced by `values` and `{{`/`}}` by single braces."""

    def one(m: re.Match) -> str:
        if m.group(1) is None:
            return m.group(0)[0]
        return str(values[m.group(1)])

    return _FIELD.sub(one, template)


def escape(text: str) -> str:
    """`text` as a template that renders to itself (braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def approx_tokens(text: str) -> int:
    """A tokenizer-free estimate: one token per 4 bytes of UTF-8 (pass a real counter when you
    have one: `count_tokens=lambda s: len(tokenizer.encode(s))`)."""
    return math.ceil(len(text.encode("utf-8")) / 4)


@dataclass(frozen=True)
class Compaction:
    """When the `erratum` strategy rewrites the prompt with the current values.

    The trade: an erratum is prefilled once (the next request finds it in the prefix cache), but
    it stays in the context, so every later request carries it: more keys to attend over, more
    cache to hold, less room left in the context window. A compaction removes that growth at the
    price an `in_place` rewrite pays on every change: one cold prefill of the whole prompt, since
    the rewritten prefix is new to the cache. Compacting once the errata reach a fixed share of
    the prompt bounds the carried overhead by that share while paying one cold prefill per
    `share × prompt / erratum` changes (with the defaults, an 8,000-token prompt and 25-token
    errata, one per 80 changes) instead of one per change. `max_tokens` caps the absolute growth
    for short prompts, where a share alone would allow little; `max_errata` caps the count, as a
    model reads a long stack of corrections less reliably than one (`probe agent-loop` measures
    it). Any limit may be None (off).
    """

    max_share: float | None = 0.25  # errata tokens / (prompt tokens without errata)
    max_tokens: int | None = 1024  # errata tokens
    max_errata: int | None = None

    def __post_init__(self):
        if self.max_share is not None and not self.max_share > 0:
            raise BadArgument(f"max_share must be positive or None, got {self.max_share}")
        for name in ("max_tokens", "max_errata"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise BadArgument(f"{name} must be at least 1 or None, got {v}")

    def due(self, errata_tokens: int, prompt_tokens: int, n_errata: int) -> str | None:
        """Why the prompt should be compacted now (None: not yet)."""
        if self.max_errata is not None and n_errata > self.max_errata:
            return f"{n_errata} errata > max_errata={self.max_errata}"
        if self.max_tokens is not None and errata_tokens > self.max_tokens:
            return f"{errata_tokens} errata tokens > max_tokens={self.max_tokens}"
        if self.max_share is not None and errata_tokens > self.max_share * prompt_tokens:
            return f"errata are {errata_tokens}/{prompt_tokens} of the prompt > max_share={self.max_share}"
        return None


DEFAULT_COMPACTION = Compaction()
NEVER = Compaction(max_share=None, max_tokens=None, max_errata=None)


@dataclass(frozen=True)
class Erratum:
    field: str
    value: str
    text: str
    tokens: int


class PromptManager:
    """A prompt template with mutable fields, rendered for a prefix-caching server.

    `template` is the prompt up to the question; `tail` (the question, e.g. "decision:") is
    appended after the errata. `values` must give every field. `mutable` names the fields that
    may change (default: all). `erratum` is the correction line, with `{field}` and `{value}`.
    `count_tokens` counts a string's tokens for the compaction policy (default `approx_tokens`).
    """

    def __init__(
        self,
        template: str,
        values: Mapping[str, str],
        *,
        tail: str = "",
        strategy: str = "erratum",
        mutable: Sequence[str] | None = None,
        erratum: str = ERRATUM,
        compaction: Compaction = DEFAULT_COMPACTION,
        count_tokens: Callable[[str], int] = approx_tokens,
    ):
        if strategy not in STRATEGIES:
            raise BadArgument(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        fields = template_fields(template)
        if not fields:
            raise BadArgument("the template has no {field}; write each changing value as {name}")
        missing = [f for f in fields if f not in values]
        if missing:
            raise UnknownField(f"the template's field(s) {missing} have no value; pass them in values=")
        extra = sorted(set(values) - set(fields))
        if extra:
            raise UnknownField(f"values {extra} are not fields of the template; it has {list(fields)}")
        mutable = tuple(fields if mutable is None else mutable)
        unknown = [f for f in mutable if f not in fields]
        if unknown:
            raise UnknownField(f"mutable field(s) {unknown} are not in the template; it has {list(fields)}")
        for probe in ("{field}", "{value}"):
            if probe not in erratum:
                raise BadArgument(f"the erratum line must contain {probe}, got {erratum!r}")
        self.template, self.tail, self.strategy = template, tail, strategy
        self.fields, self.mutable = fields, mutable
        self.erratum_format, self.compaction, self.count_tokens = erratum, compaction, count_tokens
        self.values: dict[str, str] = {f: str(values[f]) for f in fields}
        self.hoisted = hoist(template, mutable)
        self._reset()
        self.compactions = 0
        self.last_compaction: str | None = None  # why the last compaction happened

    def _reset(self) -> None:
        self.base_values = dict(self.values)
        self._base = fill(self.template, self.base_values)
        self._base_tokens = self.count_tokens(self._base + self.tail)
        self.errata: list[Erratum] = []

    # --- changes -----------------------------------------------------------------------------
    def update(self, field: str, value: str) -> str:
        """Set `field` to `value`. Returns what the next prompt does about it: "unchanged" (the
        value was current), "erratum" (one line appended), "compacted" (the erratum tipped the
        policy; the prompt was rewritten) or "rewrite" (in_place / hoist)."""
        if field not in self.fields:
            raise UnknownField(f"{field!r} is not a field of the template; it has {list(self.fields)}")
        if field not in self.mutable:
            raise BadArgument(f"{field!r} is not mutable; the mutable fields are {list(self.mutable)}")
        value = str(value)
        if self.values[field] == value:
            return "unchanged"
        self.values[field] = value
        if self.strategy != "erratum":
            return "rewrite"
        text = self.erratum_format.format(field=field, value=value)
        self.errata.append(Erratum(field, value, text, self.count_tokens(text)))
        reason = self.compaction.due(self.errata_tokens, self._base_tokens, len(self.errata))
        if reason:
            self.compact(reason)
            return "compacted"
        return "erratum"

    def compact(self, reason: str = "asked") -> None:
        """Rewrite the prompt with the current values and drop the errata (one cold prefill)."""
        self._reset()
        self.compactions += 1
        self.last_compaction = reason

    @property
    def errata_tokens(self) -> int:
        return sum(e.tokens for e in self.errata)

    # --- rendering ----------------------------------------------------------------------------
    @property
    def stable_prefix(self) -> str:
        """The text every prompt starts with until the next compaction (erratum) or change."""
        if self.strategy == "erratum":
            return self._base
        if self.strategy == "hoist":
            return fill(self.hoisted[0], self.values)
        return fill(self.template, self.values)

    def context(self) -> str:
        """The prompt without its tail: what a cache holds between requests."""
        if self.strategy == "erratum":
            return self._base + "".join(e.text for e in self.errata)
        if self.strategy == "hoist":
            return fill("".join(self.hoisted), self.values)
        return fill(self.template, self.values)

    def render(self) -> str:
        """The prompt to send now."""
        return self.context() + self.tail

    def fresh(self) -> str:
        """The template rendered with the current values and no errata: the reference prompt a
        strategy's decision should match."""
        return fill(self.template, self.values) + self.tail

    def __repr__(self) -> str:
        return (
            f"PromptManager(strategy={self.strategy!r}, values={self.values}, errata={len(self.errata)}, "
            f"compactions={self.compactions})"
        )


def hoist(template: str, mutable: Sequence[str]) -> tuple[str, str]:
    """(`template` without its lines that hold a mutable field, those lines in order): the hoisted
    layout is their concatenation, the changing lines last.

    >>> hoist("a\\nx: {x}\\nb\\n", ["x"])
    ('a\\nb\\n', 'x: {x}\\n')
    """
    keep, moved = [], []
    for line in template.splitlines(keepends=True):
        (moved if set(template_fields(line)) & set(mutable) else keep).append(line)
    if moved and not moved[-1].endswith("\n"):
        moved[-1] += "\n"
    return "".join(keep), "".join(moved)


class EngineSession:
    """A `PromptManager` served by the kvnotes engine, as a prefix-caching server would: the
    context is prefilled once; while the new context extends the old one (errata), only the new
    text is appended; otherwise (a rewrite, a compaction) it is prefilled again. `decide()` reads
    the tail's last logits. `computed` counts the tokens each call prefilled.

    Appending encodes the new text on its own, as the agent loop does (`probes.agent`), so the
    tokens at a boundary may differ from the whole prompt's tokenization.
    """

    def __init__(self, model, manager: PromptManager):
        self.model, self.manager = model, manager
        self.nb = None
        self._text = ""
        self.computed: list[int] = []

    def decide(self):
        """The logits at the tail's last token, `[vocab]`."""
        from kvnotes.ops import append, decide, prefill

        m, target = self.model, self.manager.context()
        if self.nb is not None and target.startswith(self._text):
            new = m.encode(target[len(self._text) :], bos=False) if len(target) > len(self._text) else []
            if new:
                self.nb = append(m, self.nb, new)
            n = len(new)
        else:
            ids = m.encode(target)
            self.nb = prefill(m, ids)
            n = len(ids)
        self._text = target
        tail = m.encode(self.manager.tail, bos=False)
        self.computed.append(n + len(tail))
        return decide(m, self.nb, tail).last[0]
