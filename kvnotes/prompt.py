"""Prompts from templates with named fields, carrying the token positions of every named span.

Template syntax:
  `{field}`          a field, filled from the values given to `render` (span name = field name)
  `[[name: text]]`   a named static span (rule, query, decision, ...); may contain fields
  `{{` / `}}`        literal braces

Spans are mapped to tokens through the tokenizer's character offsets, never by guessing, so
they are right under real tokenizers (a token that straddles a span edge belongs to the span).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvnotes.errors import TemplateError, TokenCountChanged, UnknownField, UnsupportedTokenizer

_TOKEN_RE = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}|\[\[([A-Za-z_][A-Za-z0-9_]*):\s?|\]\]")


@dataclass(frozen=True)
class Template:
    """A prompt template with `{field}`s and `[[span: ...]]`s (see the module docstring).

    >>> t = Template("Status: {order_status}.\\n[[decision:A:]]")
    >>> t.fields
    ('order_status',)
    """

    text: str
    defaults: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self._parse({f: "" for f in self.fields})  # validates brackets early

    @property
    def fields(self) -> tuple[str, ...]:
        seen: list[str] = []
        for m in _TOKEN_RE.finditer(self.text):
            if m.group(1) and m.group(1) not in seen:
                seen.append(m.group(1))
        return tuple(seen)

    @property
    def span_names(self) -> tuple[str, ...]:
        """Every span the template names: its fields and its `[[name: ...]]` spans."""
        return tuple(self._parse({f: "" for f in self.fields})[1])

    def _parse(self, values: Mapping[str, str]) -> tuple[str, dict[str, tuple[int, int]]]:
        out: list[str] = []
        length = 0
        spans: dict[str, tuple[int, int]] = {}
        stack: list[tuple[str, int]] = []
        last = 0
        for m in _TOKEN_RE.finditer(self.text):
            lit = self.text[last : m.start()]
            out.append(lit)
            length += len(lit)
            last = m.end()
            tok = m.group(0)
            if tok in ("{{", "}}"):
                out.append(tok[0])
                length += 1
            elif m.group(1):
                name = m.group(1)
                if name not in values:
                    raise UnknownField(f"template field {name!r} has no value; pass {name}=...")
                val = str(values[name])
                if name in spans:
                    raise TemplateError(
                        f"field {name!r} appears twice; spans must be unique, so rename one of them"
                    )
                spans[name] = (length, length + len(val))
                out.append(val)
                length += len(val)
            elif m.group(2):
                stack.append((m.group(2), length))
            else:  # "]]"
                if not stack:
                    raise TemplateError(
                        f"unmatched ']]' at character {m.start()} of the template; remove "
                        "it or open a span before it with [[name: ..."
                    )
                name, start = stack.pop()
                if name in spans:
                    raise TemplateError(
                        f"span {name!r} appears twice; spans must be unique, so rename one of them"
                    )
                spans[name] = (start, length)
        if stack:
            raise TemplateError(f"span [[{stack[-1][0]}: ...]] is never closed with ']]'")
        out.append(self.text[last:])
        return "".join(out), spans

    def fill(self, **values: str) -> str:
        """The template's text with its fields filled (no tokenizer: for text inside a prompt)."""
        return self.layout(**values)[0]

    def layout(self, **values: str) -> tuple[str, dict[str, tuple[int, int]]]:
        """The filled text and every span's character range `[start, end)` (no tokenizer)."""
        return self._parse({f: str({**self.defaults, **values}[f]) for f in self.fields})

    def render(self, model, **values: str) -> Prompt:
        """Fill the fields and tokenize with `model`'s tokenizer (BOS first when it has one)."""
        vals = {**self.defaults, **values}
        unknown = set(values) - set(self.fields)
        if unknown:
            raise UnknownField(f"unknown field(s) {sorted(unknown)}; this template has {list(self.fields)}")
        text, char_spans = self._parse(vals)
        ids, offsets = _tokenize(model, text)
        spans = {name: _token_range(offsets, cs, ce, name, text) for name, (cs, ce) in char_spans.items()}
        return Prompt(
            text=text,
            ids=tuple(ids),
            spans=spans,
            char_spans=char_spans,
            values={f: str(vals[f]) for f in self.fields},
            template=self,
            offsets=tuple(offsets),
        )


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: its text, token ids, and `spans` as token ranges `[start, end)`."""

    text: str
    ids: tuple[int, ...]
    spans: Mapping[str, tuple[int, int]]
    char_spans: Mapping[str, tuple[int, int]]
    values: Mapping[str, str]
    template: Template
    offsets: tuple[tuple[int, int], ...] = ()

    def __len__(self) -> int:
        return len(self.ids)

    def span(self, name: str) -> range:
        if name not in self.spans:
            raise UnknownField(f"no span {name!r}; this prompt has {sorted(self.spans)}")
        return range(*self.spans[name])

    def with_values(self, model, **values: str) -> Prompt:
        """The same template with some fields changed; errors if any slot would move."""
        other = self.template.render(model, **{**self.values, **values})
        self.check_aligned(other)
        return other

    def check_aligned(self, other: Prompt) -> None:
        """Both prompts must have the same token count and the same span positions."""
        changed = [f for f in self.template.fields if self.values.get(f) != other.values.get(f)]
        what = f"field {', '.join(repr(c) for c in changed)}" if changed else "the prompt"
        if len(self.ids) != len(other.ids):
            raise TokenCountChanged(
                f"{what} value changes the token count ({len(self.ids)} → {len(other.ids)}), so "
                "slots no longer line up; pick a value with the same token count, or use an "
                "erratum or a suffix recompute"
            )
        moved = [n for n in self.spans if self.spans[n] != other.spans.get(n)]
        if moved:
            raise TokenCountChanged(
                f"{what} value moves span(s) {moved} ({[self.spans[n] for n in moved]} → "
                f"{[other.spans.get(n) for n in moved]}); use an erratum or a suffix recompute"
            )

    def delimiters(self, model, start: int = 0, end: int | None = None) -> list[int]:
        """Positions in `[start, end)` whose token is only punctuation and/or whitespace."""
        end = len(self.ids) if end is None else end
        strs = model.token_strings(self.ids[start:end])
        return [start + i for i, s in enumerate(strs) if s and is_delimiter(s)]


def is_delimiter(s: str) -> bool:
    """Whether token text `s` is only punctuation and/or whitespace (true of the empty string)."""
    return all(c.isspace() or unicodedata.category(c).startswith("P") for c in s)


def _tokenize(model, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    tok = model.tokenizer
    if not getattr(tok, "is_fast", False):
        raise UnsupportedTokenizer(
            f"{model.name}'s tokenizer is not a fast tokenizer, so character offsets are "
            "unavailable; load the model with a `tokenizers`-backed tokenizer"
        )
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    if tok.bos_token_id is not None:
        ids, offsets = [tok.bos_token_id] + ids, [(0, 0)] + offsets
    return ids, offsets


def _token_range(offsets, cs: int, ce: int, name: str, text: str) -> tuple[int, int]:
    hit = [i for i, (a, b) in enumerate(offsets) if b > a and a < ce and b > cs]
    if not hit:
        if cs == ce:  # an empty span sits before the first token that starts at/after it
            nxt = [i for i, (a, b) in enumerate(offsets) if b > a and a >= cs]
            i = nxt[0] if nxt else len(offsets)
            return (i, i)
        raise TemplateError(
            f"span {name!r} ({text[cs:ce]!r}) maps to no token; give it text that "
            "tokenizes to at least one token"
        )
    return (hit[0], hit[-1] + 1)


def free_prompt(model, text: str) -> Prompt:
    """Free-form `text` as a Prompt whose last token is its `decision` span, so that
    `prefill(model, p)` holds every token before it and `decide(model, nb, p)` reads the model's
    next-token logits after the whole text. The text is taken literally (braces and brackets are
    not template syntax); BOS first when the tokenizer has one. `free_pair` makes two to patch.

    >>> from kvnotes import load_model, prefill, decide
    >>> model = load_model("tiny-llama")
    >>> p = free_prompt(model, "The order {id} has shipped")
    >>> nb = prefill(model, p)
    >>> nb.n_slots == len(p) - 1, tuple(decide(model, nb, p).last.shape)
    (True, (1, 512))
    """
    ids, offsets = _tokenize(model, text)
    first = 1 if len(ids) and ids[0] == getattr(model.tokenizer, "bos_token_id", None) else 0
    if len(ids) - first < 2:
        raise TemplateError(
            f"{text!r} is {len(ids) - first} token(s); a free prompt needs at least 2, one to read "
            "the decision at and one before it"
        )
    last = offsets[-1]
    return Prompt(
        text=text,
        ids=tuple(ids),
        spans={"decision": (len(ids) - 1, len(ids))},
        char_spans={"decision": (int(last[0]), int(last[1]))},
        values={},
        template=_literal(text),
        offsets=tuple(offsets),
    )


def _literal(text: str) -> Template:
    """A template that fills to `text` exactly (braces escaped); text holding `[[`/`]]`, which
    template syntax cannot write literally, gets an empty template (its prompt has no fields)."""
    try:
        return Template(text.replace("{", "{{").replace("}", "}}"))
    except TemplateError:
        return Template("")


def free_pair(model, old: str, new: str) -> tuple[Prompt, Prompt]:
    """Two free-form texts as prompts to patch between (`free_prompt` each): refused, naming both
    counts, unless they tokenize to the same number of tokens (patching lines slots up by
    position)."""
    a, b = free_prompt(model, old), free_prompt(model, new)
    if len(a) != len(b):
        raise TokenCountChanged(
            f"the two texts are {len(a)} and {len(b)} tokens; patching matches slots by position, so "
            "give texts of one length (change a word for one that tokenizes to as many tokens)"
        )
    return a, b
