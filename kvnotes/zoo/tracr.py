"""RASP programs compiled by tracr into `KVModel`s whose circuit is known exactly.

tracr (DeepMind's RASP compiler; `pip install -e '.[tracr]'`, JAX's CPU build) turns a program
into transformer weights: every `Aggregate` and `SelectorWidth` becomes an attention head, every
`Map` and `SequenceMap` an MLP, and each writes its own labelled directions of a residual stream
that no two steps share. So the circuit is known before anything is measured: which layer, head
or MLP computes each step, which steps each reads (by query, key, value or MLP input), and, on a
given input, which key positions each query selects.

`compile_program(program, vocab, max_seq_len)` compiles any RASP program (causal attention, as
the notebook engine runs) into a `TracrModel`: a TransformerLens model with learned positions and
no norms, a word-level tokenizer whose first token is `BOS`, the compiled `KnownCircuit`, and the
program itself. `LIBRARY` holds tracr's own library programs whose answer at the last position is
the program's answer on the whole input under causal attention (what the notebook's decision
reads); `load_tracr("tracr-reverse")` compiles one of them. `pairs(model, n)` draws its pair task:
clean and corrupt inputs that differ in one token and change the answer at the last position.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from kvnotes.engine.transformer_lens.model import TransformerLensModel, from_hooked
from kvnotes.errors import BadArgument, MissingDependency, UnknownModelError

BOS, PAD, UNK = "BOS", "PAD", "UNK"
PREFIX = "tracr-"


def _tracr():
    try:
        from tracr.compiler import lib  # noqa: F401
        from tracr.rasp import rasp
    except ImportError as e:
        raise MissingDependency(
            f"tracr models need tracr and JAX's CPU build ({e}); install them with "
            "`pip install -e '.[tracr]'`"
        ) from None
    return rasp


# --- the known circuit ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One compiled RASP expression: where it runs and which labelled directions it reads and writes.

    `reads` maps an input of the component ("query", "key", "value" for a head; "input" for an
    MLP) to the labels of the expressions it reads there (`tokens`, `indices`, `one` are the
    embeddings)."""

    expr: str  # the expression's label, as its residual directions are named
    op: str  # the RASP operation: Aggregate, SelectorWidth, Map, SequenceMap, ...
    kind: str  # "head" or "mlp"
    layer: int
    head: int | None
    reads: dict[str, tuple[str, ...]]
    writes: tuple[str, ...]

    @property
    def node(self) -> str:
        """The component as node-level circuits name it: `L{l}H{h}` or `MLP{l}`."""
        return f"L{self.layer}H{self.head}" if self.kind == "head" else f"MLP{self.layer}"


@dataclass(frozen=True, eq=False)
class KnownCircuit:
    """The compiled program's circuit: every step, in the order the model runs them, and the
    label of the program's output (what the unembedding reads)."""

    program: str
    steps: tuple[Step, ...]
    output: str
    # not saved: what `trace` evaluates (head expr -> selector; label -> RASP expression; a
    # head's hidden output label -> its expression)
    selectors: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    exprs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    aliases: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def nodes(self) -> list[str]:
        """The components that compute some step (`L0H1`, `MLP2`, ...), in model order."""
        return list(dict.fromkeys(s.node for s in self.steps))

    def to_dict(self) -> dict:
        return {
            "program": self.program,
            "output": self.output,
            "nodes": self.nodes,
            "steps": [
                {
                    "expr": s.expr,
                    "op": s.op,
                    "kind": s.kind,
                    "layer": s.layer,
                    "head": s.head,
                    "node": s.node,
                    "reads": {k: list(v) for k, v in s.reads.items()},
                    "writes": list(s.writes),
                }
                for s in self.steps
            ],
        }

    def trace(self, inputs: Sequence[Any]) -> tuple[dict[str, list], dict[str, np.ndarray]]:
        """What the causal model computes on `inputs` (BOS not counted): each expression's value
        at each position (the program evaluated on the input up to that position), and per head
        step which keys each query selects (`[query, key]` booleans, a query's keys up to itself).
        A head's own output label (SelectorWidth's hidden one) carries its expression's value."""
        rasp = _tracr()
        xs = list(inputs)
        values: dict[str, list] = {"tokens": xs, "indices": list(range(len(xs))), "one": [1] * len(xs)}
        for label, expr in self.exprs.items():
            values[label] = [rasp.evaluate(expr, xs[: i + 1])[-1] for i in range(len(xs))]
        for hidden, label in self.aliases.items():
            values[hidden] = values[label]
        selected = {}
        for expr, selector in self.selectors.items():
            m = np.zeros((len(xs), len(xs)), dtype=bool)
            for q in range(len(xs)):
                m[q, : q + 1] = np.array(rasp.evaluate(selector, xs[: q + 1]), dtype=bool)[-1]
            selected[expr] = m
        return values, selected


# --- the model -----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False, kw_only=True, repr=False)
class TracrModel(TransformerLensModel):
    """A compiled RASP program as a `KVModel`: its known circuit, the program and its inputs.

    `values` maps each token string to the RASP value it stands for (`"3"` -> 3)."""

    circuit: KnownCircuit
    program: Any  # the RASP program (a `tracr.rasp.rasp.SOp`)
    vocab: tuple[Any, ...]  # the program's input values
    max_seq_len: int
    values: dict[str, Any]
    reference: Any = field(default=None, compare=False)  # tracr's own assembled (JAX) model

    def evaluate(self, inputs: Sequence[Any]) -> list[Any]:
        """The RASP program's output on `inputs` (without BOS), as the RASP interpreter gives it."""
        return list(_tracr().evaluate(self.program, list(inputs)))

    def text(self, inputs: Sequence[Any]) -> str:
        """The prompt text of `inputs` (tokens separated by spaces; `encode` adds BOS)."""
        return " ".join(str(v) for v in inputs)

    def verification_prompts(self) -> dict:
        """`kvnotes verify`'s prompt pairs: two of the pair task, the shortest and longest inputs
        (the model's vocabulary and context hold no English prompt)."""
        lo = max(2, _min_len(self))
        out = {}
        for label, n in (("short", lo), ("long", self.max_seq_len)):
            p = pairs(self, 1, seed=0, lengths=(n, n))[0]
            out[label] = (p.old, p.new)
        return out

    def answer(self, inputs: Sequence[Any]) -> int:
        """The token id of the program's answer at the last position of `inputs`."""
        return self.answer_token(str(self.evaluate(inputs)[-1]))


def compile_program(
    program,
    vocab: Sequence[Any],
    max_seq_len: int,
    *,
    name: str | None = None,
    mlp_exactness: int = 100,
) -> TracrModel:
    """Compile a RASP `program` over input values `vocab` and inputs up to `max_seq_len` long into
    a `TracrModel` (causal attention). Values must print as one word each (no spaces)."""
    rasp = _tracr()
    from tracr.compiler import (
        basis_inference,
        craft_graph_to_model,
        craft_model_to_transformer,
        expr_to_craft_graph,
        nodes,
        rasp_to_graph,
        validating,
    )
    from tracr.craft import bases

    vocab = tuple(sorted(set(vocab), key=str))
    words = [str(v) for v in vocab]
    bad = [w for w in words if not w or any(c.isspace() for c in w) or w in (BOS, PAD, UNK)]
    if bad or len(set(words)) != len(words):
        raise BadArgument(
            f"tracr inputs must print as distinct single words other than {BOS}/{PAD}/{UNK}; "
            f"these do not: {bad or words}"
        )
    unsupported = validating.static_validate(program)
    if unsupported:
        raise BadArgument(
            "tracr cannot compile this program: "
            + "; ".join(f"{u.expr.name}: {u.reason}" for u in unsupported)
        )
    extracted = rasp_to_graph.extract_rasp_graph(program)
    graph, sources, sink = extracted.graph, extracted.sources, extracted.sink
    basis_inference.infer_bases(graph, sink, set(vocab), max_seq_len)
    expr_to_craft_graph.add_craft_components_to_rasp_graph(
        graph, bos_dir=bases.BasisDirection(rasp.tokens.label, BOS), mlp_exactness=mlp_exactness
    )
    craft = craft_graph_to_model.craft_graph_to_model(graph, sources)
    assembled = craft_model_to_transformer.craft_model_to_transformer(
        craft_model=craft,
        graph=graph,
        sink=sink,
        max_seq_len=max_seq_len,
        causal=True,
        compiler_bos=BOS,
        compiler_pad=PAD,
    )
    if not rasp.is_categorical(sink[nodes.EXPR]):
        raise BadArgument(
            f"{program.label}'s output is numerical; the notebook's decision reads two output "
            "tokens, so compile a program with a categorical output (wrap it in rasp.categorical "
            "of a Map that buckets the number)"
        )
    circuit = _known_circuit(program, graph, sources, craft)
    tokenizer, words_of, values = _tokenizer(vocab, assembled)
    tl = _hooked(assembled, words_of, name or f"{PREFIX}{program.label}", program.label)
    base = from_hooked(name or f"{PREFIX}{program.label}", tl, tokenizer)
    return TracrModel(
        **{f.name: getattr(base, f.name) for f in fields(base)},
        circuit=circuit,
        program=program,
        vocab=vocab,
        max_seq_len=max_seq_len,
        values=values,
        reference=assembled,
    )


def _known_circuit(program, graph, sources, craft) -> KnownCircuit:
    """Every step's component, from tracr's own layer allocation and the assembled blocks."""
    from tracr.compiler import assemble, craft_graph_to_model, nodes
    from tracr.craft import transformers as ct

    _, module_names = assemble._get_model_config_and_module_names(craft)
    layer_of_block = [int(n.split("/")[1].split("_")[1]) for n in module_names]
    halves = craft_graph_to_model._allocate_modules_to_layers(graph, sources)
    # the half-layers that hold a block, in order, are the assembled blocks (a residual block,
    # SelectorWidth's head then MLP, fills its half-layer and the next)
    filled: set[int] = set()
    for n, h in halves.items():
        block = graph.nodes[n].get(nodes.MODEL_BLOCK)
        if block is not None:
            filled |= {h, h + 1} if isinstance(block, ct.SeriesWithResiduals) else {h}
    order = sorted(filled)
    tl_layer = dict(zip(order, layer_of_block))
    steps, selectors, exprs, aliases = [], {}, {}, {}
    for node_id, half in sorted(halves.items(), key=lambda kv: kv[1]):
        node = graph.nodes[node_id]
        block = node.get(nodes.MODEL_BLOCK)
        if block is None:
            continue
        expr = node[nodes.EXPR]
        exprs[expr.label] = expr
        parts = block.blocks if isinstance(block, ct.SeriesWithResiduals) else [block]
        for offset, part in enumerate(parts):
            layer = tl_layer[half + offset]
            if isinstance(part, (ct.AttentionHead, ct.MultiAttentionHead)):
                for head in part.as_multi().heads():
                    steps.append(_head_step(expr, head, layer, craft.blocks[order.index(half + offset)]))
                    aliases.update({w: expr.label for w in steps[-1].writes if w != expr.label})
                selectors[expr.label] = expr.selector
            else:
                steps.append(
                    Step(
                        expr=expr.label,
                        op=type(expr).__name__,
                        kind="mlp",
                        layer=layer,
                        head=None,
                        reads={"input": _labels(part.fst.input_space)},
                        writes=_labels(part.snd.output_space),
                    )
                )
    steps.sort(key=lambda s: (s.layer, s.kind != "head", s.head or 0))
    for n in graph.nodes.values():  # the expressions steps read that no block computes (none but
        e = n.get(nodes.EXPR)  # the embeddings' tokens and indices, which `trace` fills in)
        if e is not None and e.label not in ("tokens", "indices"):
            exprs.setdefault(e.label, e)
    return KnownCircuit(
        program=program.label,
        steps=tuple(steps),
        output=program.label,
        selectors=selectors,
        exprs=exprs,
        aliases=aliases,
    )


def _head_step(expr, head, layer: int, block) -> Step:
    index = next(i for i, h in enumerate(block.as_multi().heads()) if h is head)
    return Step(
        expr=expr.label,
        op=type(expr).__name__,
        kind="head",
        layer=layer,
        head=index,
        reads={
            "query": _labels(head.w_qk.left_space),
            "key": _labels(head.w_qk.right_space),
            "value": _labels(head.w_ov.input_space),
        },
        writes=_labels(head.w_ov.output_space),
    )


def _labels(space) -> tuple[str, ...]:
    """The expression labels a space spans. The BOS direction of `tokens` is left out: it is how
    every head attends to BOS (tracr's default), and it is the same in both prompts of a pair."""
    return tuple(dict.fromkeys(str(d.name) for d in space.basis if (d.name, d.value) != ("tokens", BOS)))


def _tokenizer(vocab: tuple, assembled):
    """A word-level tokenizer over BOS, PAD, UNK, the input values and the output values; the
    token strings in id order; and each string's value."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    outputs = list(assembled.output_encoder.encoding_map)
    values = {str(v): v for v in [*vocab, *outputs]}
    words = [BOS, PAD, UNK, *dict.fromkeys([str(v) for v in vocab] + [str(v) for v in outputs])]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, pad_token=PAD, unk_token=UNK)
    return fast, words, values


def _hooked(assembled, words: list[str], name: str, output: str):
    """tracr's assembled parameters as a TransformerLens model over the tokenizer's ids: no norms,
    learned positions, ReLU MLPs; tokens the program never takes embed to zero, and the
    unembedding reads the output's one-hot directions (other tokens' logits are 0)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    p = {k: {kk: np.asarray(v, dtype=np.float32) for kk, v in d.items()} for k, d in assembled.params.items()}
    c = assembled.model_config
    d_model = p["token_embed"]["embeddings"].shape[1]
    cfg = HookedTransformerConfig(
        n_layers=c.num_layers,
        d_model=d_model,
        d_head=c.key_size,
        n_heads=c.num_heads,
        d_mlp=c.mlp_hidden_size,
        d_vocab=len(words),
        d_vocab_out=len(words),
        n_ctx=p["pos_embed"]["embeddings"].shape[0],
        act_fn="relu",
        normalization_type=None,
        positional_embedding_type="standard",
        model_name=name,
        original_architecture="tracr",
        default_prepend_bos=False,
    )
    tl = HookedTransformer(cfg, move_to_device=False)
    enc = assembled.input_encoder.encoding_map
    w_e = np.zeros((len(words), d_model), dtype=np.float32)
    by_word = {str(k): v for k, v in enc.items()}
    for i, w in enumerate(words):
        if w in by_word:
            w_e[i] = p["token_embed"]["embeddings"][by_word[w]]
    labels = assembled.residual_labels
    w_u = np.zeros((d_model, len(words)), dtype=np.float32)
    for value in assembled.output_encoder.encoding_map:
        w_u[labels.index(f"{output}:{value}"), words.index(str(value))] = 1.0
    sd = {
        "embed.W_E": w_e,
        "pos_embed.W_pos": p["pos_embed"]["embeddings"],
        "unembed.W_U": w_u,
        "unembed.b_U": np.zeros(len(words), dtype=np.float32),
    }
    H, K = c.num_heads, c.key_size
    for l in range(c.num_layers):
        a, m = f"transformer/layer_{l}/attn", f"transformer/layer_{l}/mlp"
        for ours, theirs in (("Q", "query"), ("K", "key"), ("V", "value")):
            sd[f"blocks.{l}.attn.W_{ours}"] = (
                p[f"{a}/{theirs}"]["w"].reshape(d_model, H, K).transpose(1, 0, 2)
            )
            sd[f"blocks.{l}.attn.b_{ours}"] = p[f"{a}/{theirs}"]["b"].reshape(H, K)
        sd[f"blocks.{l}.attn.W_O"] = p[f"{a}/linear"]["w"].reshape(H, K, d_model)
        sd[f"blocks.{l}.attn.b_O"] = p[f"{a}/linear"]["b"]
        sd[f"blocks.{l}.mlp.W_in"] = p[f"{m}/linear_1"]["w"]
        sd[f"blocks.{l}.mlp.b_in"] = p[f"{m}/linear_1"]["b"]
        sd[f"blocks.{l}.mlp.W_out"] = p[f"{m}/linear_2"]["w"]
        sd[f"blocks.{l}.mlp.b_out"] = p[f"{m}/linear_2"]["b"]
    state = tl.state_dict()
    missing = [k for k in state if k not in sd and not k.endswith(("IGNORE", ".mask"))]
    if missing:
        raise AssertionError(f"tracr conversion left TransformerLens parameters unset: {missing[:5]}")
    tl.load_state_dict(
        {**state, **{k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in sd.items()}}
    )
    return tl


# --- the library --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LibraryProgram:
    """A program of tracr's library, with the inputs its pair task draws from."""

    name: str  # the model name is `tracr-{name}`
    make: Callable[[], Any]
    vocab: tuple[Any, ...]
    max_seq_len: int
    min_len: int
    about: str


def _library() -> dict[str, LibraryProgram]:
    def lib():
        from tracr.compiler import lib

        return lib

    rasp = _tracr

    programs = [
        LibraryProgram(
            "reverse",
            lambda: lib().make_reverse(rasp().tokens).named("reverse"),
            ("a", "b", "c", "d"),
            6,
            3,
            "the input reversed; at the last position, the first token",
        ),
        LibraryProgram(
            "hist",
            lambda: lib().make_hist().named("hist"),
            ("a", "b", "c"),
            6,
            3,
            "how often each token occurs; at the last position, the last token's count",
        ),
        LibraryProgram(
            "count",
            lambda: lib().make_count(rasp().tokens, "a").named("count"),
            ("a", "b", "c"),
            6,
            3,
            "how many tokens are `a`",
        ),
        LibraryProgram(
            "dyck",
            lambda: lib().make_shuffle_dyck(["()"]).named("dyck"),
            ("(", ")"),
            6,
            4,
            "whether the parentheses balance (the last position sees the whole input)",
        ),
        LibraryProgram(
            "dyck2",
            lambda: lib().make_shuffle_dyck2().named("dyck2"),
            ("(", ")", "{", "}"),
            6,
            4,
            "whether two kinds of brackets each balance (shuffle-Dyck-2)",
        ),
        LibraryProgram(
            "pattern",
            lambda: lib().detect_pattern(rasp().tokens, "abc").named("pattern"),
            ("a", "b", "c"),
            6,
            4,
            "whether the input ends in `a b c`",
        ),
    ]
    return {p.name: p for p in programs}


def library_names() -> list[str]:
    """The shipped programs' model names (`tracr-reverse`, ...)."""
    return [f"{PREFIX}{n}" for n in TRACR_PROGRAMS]


TRACR_PROGRAMS = ("reverse", "hist", "count", "dyck", "dyck2", "pattern")

_LOADED: dict[str, TracrModel] = {}


def load_tracr(name: str, *, device=None, dtype=None) -> TracrModel:
    """One of `LIBRARY`'s programs, compiled (once per process, in float32 on the CPU), by model
    name: `tracr-reverse`; a copy cast to `dtype` and moved to `device` where those differ."""
    from kvnotes.engine.transformer_lens.model import placed
    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    short = name.removeprefix(PREFIX)
    programs = _library()
    if short not in programs:
        raise UnknownModelError(
            f"no tracr program {name!r}; shipped: {', '.join(library_names())} "
            "(or compile your own with kvnotes.zoo.tracr.compile_program)"
        )
    if name not in _LOADED:
        p = programs[short]
        _LOADED[name] = compile_program(p.make(), p.vocab, p.max_seq_len, name=f"{PREFIX}{short}")
    return placed(_LOADED[name], device, dtype)


# --- pair tasks ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputPair:
    """Two inputs differing in one token (`position`, among the inputs, BOS not counted) whose
    answers at the last position differ: `clean` (the patch source) and `corrupt`."""

    clean: tuple[Any, ...]
    corrupt: tuple[Any, ...]
    position: int
    correct: Any
    wrong: Any


def input_pairs(
    model: TracrModel, n: int, *, seed: int = 0, lengths: tuple[int, int] | None = None, tries: int = 20000
) -> list[InputPair]:
    """`n` distinct pairs for `model`'s program: a random input, one token before the last
    replaced by another value, kept when the program's answer at the last position changes."""
    rng = random.Random(seed)
    lo, hi = lengths or (_min_len(model), model.max_seq_len)
    if not 2 <= lo <= hi <= model.max_seq_len:
        raise BadArgument(f"lengths must lie in 2..{model.max_seq_len} (low <= high), got {(lo, hi)}")
    out: list[InputPair] = []
    seen = set()
    for _ in range(tries):
        if len(out) == n:
            break
        k = rng.randint(lo, hi)
        clean = [rng.choice(model.vocab) for _ in range(k)]
        i = rng.randrange(k - 1)
        corrupt = list(clean)
        corrupt[i] = rng.choice([v for v in model.vocab if v != clean[i]])
        a, b = model.evaluate(clean)[-1], model.evaluate(corrupt)[-1]
        key = (tuple(clean), tuple(corrupt))
        if a is None or b is None or a == b or key in seen:
            continue
        seen.add(key)
        out.append(InputPair(tuple(clean), tuple(corrupt), i, a, b))
    if len(out) < n:
        raise BadArgument(
            f"found only {len(out)} of {n} pairs for {model.name} in {tries} draws; ask for fewer"
        )
    return out


def _min_len(model: TracrModel) -> int:
    short = model.name.removeprefix(PREFIX)
    lib = _library()
    return lib[short].min_len if short in lib else 2


def pairs(model: TracrModel, n: int, *, seed: int = 0, lengths: tuple[int, int] | None = None):
    """`n` prompt pairs (`kvnotes.tasks.Pair`) of `model`'s pair task: the changed token is the
    field, the last token the decision, answers (clean's answer, corrupt's answer)."""
    return [to_pair(model, p, seed=seed) for p in input_pairs(model, n, seed=seed, lengths=lengths)]


def to_pair(model: TracrModel, p: InputPair, *, seed: int = 0):
    """One `InputPair` as a `kvnotes.tasks.Pair` (old: corrupt, new: clean)."""
    from kvnotes.prompt import Template
    from kvnotes.tasks.sampler import GATE, Pair

    def template(inputs) -> Template:
        words = [str(v) for v in inputs]
        parts = [("{field}" if j == p.position else w) for j, w in enumerate(words[:-1])]
        return Template(" ".join(parts) + f" [[decision:{words[-1]}]]")

    old = template(p.corrupt).render(model, field=str(p.corrupt[p.position]))
    new = template(p.clean).render(model, field=str(p.clean[p.position]))
    return Pair(
        task=f"{model.name} pairs",
        kind=GATE,
        changed="field",
        old=old,
        new=new,
        answers=(model.answer_token(str(p.correct)), model.answer_token(str(p.wrong))),
        expected=(1, 0),
        seed=seed,
    )


def pair_set(model: TracrModel, n: int, *, seed: int = 0, lengths: tuple[int, int] | None = None):
    """`model`'s pair task as a pair dataset (`kvnotes.tasks.pairs.PairSet`), which every analysis
    that needs no gated rule runs on (`kvnotes circuits ... --pairs FILE` after `.write(FILE)`);
    each pair's group is its input length."""
    from kvnotes.tasks.pairs import PairSet

    records = [
        {
            "clean": model.text(p.clean),
            "corrupt": model.text(p.corrupt),
            "correct": str(p.correct),
            "wrong": str(p.wrong),
            "group": f"length {len(p.clean)}",
        }
        for p in input_pairs(model, n, seed=seed, lengths=lengths)
    ]
    return PairSet.from_records(records, name=f"{model.name}-pairs", source=f"{model.name}'s pair task")


__all__ = [
    "TRACR_PROGRAMS",
    "InputPair",
    "KnownCircuit",
    "LibraryProgram",
    "Step",
    "TracrModel",
    "compile_program",
    "input_pairs",
    "library_names",
    "load_tracr",
    "pair_set",
    "pairs",
    "to_pair",
]
