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
program itself. It refuses a program whose answer at the last position needs later positions
(`check_causal`): the causal model computes RASP under the causal mask (`evaluate_causal`), which
`KnownCircuit.trace` and the pair tasks read. The shipped programs (`TRACR_PROGRAMS`) are six of
tracr's library and two written here (`count-first`, `rank-first`); `load_tracr("tracr-reverse")`
compiles one, and `load_program("my.py:prog", vocab, max_seq_len)` a user's. `pairs(model, n)`
draws its pair task: clean and corrupt inputs that differ in one token and change the answer at
the last position, each checked on the compiled model (`draw_pairs`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvnotes.engine.transformer_lens.model import TransformerLensModel, from_hooked
from kvnotes.errors import BadArgument, MissingDependency, UnknownModelError
from kvnotes.zoo.names import PROGRAM_SPEC, check_program_spec

BOS, PAD, UNK = "BOS", "PAD", "UNK"
PREFIX = "tracr-"


def tracr_rasp():
    try:
        from tracr.compiler import lib  # noqa: F401
        from tracr.rasp import rasp
    except ImportError as e:
        raise MissingDependency(
            f"tracr models need tracr and JAX's CPU build ({e}); install them with "
            "`pip install -e '.[tracr]'`"
        ) from None
    return rasp


# --- RASP under the causal mask -----------------------------------------------------------------
MIXED = object()  # a categorical Aggregate whose selected keys hold different values (no one value)


def make_evaluator(*, causal: bool):
    """A RASP evaluator that remembers each expression's value (a program's shared parts are
    evaluated once) and each attention step's selection; `causal=True` masks every selection to
    the keys up to its query, as the compiled model attends (`length` at a position is then the
    number of positions up to it). A categorical Aggregate that would average different values
    gives `MIXED` (tracr's model would mix their one-hot directions)."""
    global _EVALUATOR
    if _EVALUATOR is None:
        rasp: Any = tracr_rasp()  # tracr's module, imported at run time (its types are not read)

        class Evaluator(rasp.DefaultRASPEvaluator):
            def __init__(self, causal: bool):
                super().__init__()
                self.causal = causal
                self.memo: dict[int, Any] = {}
                self.selected: dict[str, np.ndarray] = {}

            def evaluate(self, expr, xs):
                key = expr.unique_id
                if key not in self.memo:
                    self.memo[key] = super().evaluate(expr, xs)
                return self.memo[key]

            def _selection(self, sop, xs) -> np.ndarray:
                m = np.array(self.evaluate(sop.selector, xs), dtype=bool).reshape(len(xs), len(xs))
                if self.causal:
                    m &= np.tri(len(xs), dtype=bool)
                self.selected[sop.label] = m
                return m

            def eval_selector_width(self, sop, xs):
                return [int(row.sum()) for row in self._selection(sop, xs)]

            def eval_aggregate(self, sop, xs):
                m, values = self._selection(sop, xs), self.evaluate(sop.sop, xs)
                out = []
                for row in m:
                    chosen = [v for v, s in zip(values, row) if s]
                    if not chosen:
                        out.append(sop.default)
                    elif rasp.is_categorical(sop):
                        out.append(chosen[0] if all(v == chosen[0] for v in chosen) else MIXED)
                    else:
                        out.append(sum(chosen) / len(chosen))
                return out

            def eval_length(self, sop, xs):
                return list(range(1, len(xs) + 1)) if self.causal else [len(xs)] * len(xs)

        _EVALUATOR = Evaluator
    return _EVALUATOR(causal)


_EVALUATOR: Any = None


def evaluate_causal(program, inputs: Sequence[Any]) -> list[Any]:
    """`program`'s value at each position as the causal model computes it: every attention step
    reads only the keys up to its query. At the last position this is the program's answer on
    the whole input only for a program that needs no later position (`compile_program` checks)."""
    return list(make_evaluator(causal=True).evaluate(program, list(inputs)))


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
        at each position, every attention step reading only the keys up to its query (RASP's
        evaluation under the causal mask, `evaluate_causal`), and per head step which keys each
        query selects (`[query, key]` booleans, lower triangular). A head's own output label
        (SelectorWidth's hidden one) carries its expression's value."""
        run = make_evaluator(causal=True)
        xs = list(inputs)
        values: dict[str, list] = {"tokens": xs, "indices": list(range(len(xs))), "one": [1] * len(xs)}
        selector = tracr_rasp().Selector
        for label, expr in self.exprs.items():
            if not isinstance(expr, selector):
                values[label] = list(run.evaluate(expr, xs))
        for hidden, label in self.aliases.items():
            values[hidden] = values[label]
        return values, {expr: run.selected[expr] for expr in self.selectors}


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
    outputs: tuple[Any, ...] = ()  # the program's output values, in the output encoder's order
    reference: Any = field(default=None, compare=False)  # tracr's own assembled (JAX) model
    source: str = "tracr library"  # where the program comes from (`FILE.py:NAME` for a user's)

    def evaluate(self, inputs: Sequence[Any]) -> list[Any]:
        """The RASP program's output on `inputs` (without BOS), as the RASP interpreter gives it
        (on the whole input: at the last position the same as `answer_of`, which
        `compile_program` checks)."""
        return list(tracr_rasp().evaluate(self.program, list(inputs)))

    def answer_of(self, inputs: Sequence[Any]) -> Any:
        """The program's answer at the last position of `inputs` as the causal model computes it
        (`evaluate_causal`); `MIXED` or None where the model has no one answer."""
        return evaluate_causal(self.program, inputs)[-1]

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
        return self.answer_token(str(self.answer_of(inputs)))


def compile_program(
    program,
    vocab: Collection[Any],
    max_seq_len: int,
    *,
    name: str | None = None,
    mlp_exactness: int = 100,
    source: str = "your program",
) -> TracrModel:
    """Compile a RASP `program` over input values `vocab` and inputs up to `max_seq_len` long into
    a `TracrModel` (causal attention). Values must print as one word each (no spaces)."""
    rasp = tracr_rasp()
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
    check_causal(program, vocab, max_seq_len)
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
        outputs=tuple(assembled.output_encoder.encoding_map),
        reference=assembled,
        source=source,
    )


# logits: a pair's decision must move at least this much (the analyses' MIN_EFFECT, which lives above
# the zoo in kvnotes.analysis.registry; tests/models/test_tracr_programs.py keeps the two equal)
PAIR_FLOOR = 0.1
CAUSAL_CHECKS = 256  # random inputs `check_causal` evaluates both ways (besides every short one)


def check_causal(program, vocab: Sequence[Any], max_seq_len: int, *, seed: int = 0) -> None:
    """Refuse `program` if its answer at the last position needs later positions: on every input
    of up to 3 tokens and `CAUSAL_CHECKS` random longer ones, the causal evaluation's last value
    (what the compiled model computes) must be RASP's answer on the whole input. The refusal names
    the attention step where the two evaluations first part (it reads keys after its query)."""
    import itertools

    rng = random.Random(seed)
    vocab = list(vocab)
    short = [list(x) for n in range(1, min(3, max_seq_len) + 1) for x in itertools.product(vocab, repeat=n)]
    drawn = [[rng.choice(vocab) for _ in range(rng.randint(1, max_seq_len))] for _ in range(CAUSAL_CHECKS)]
    for xs in short + drawn:
        causal, whole = make_evaluator(causal=True), make_evaluator(causal=False)
        try:
            a, b = causal.evaluate(program, xs)[-1], whole.evaluate(program, xs)[-1]
        except (ValueError, TypeError) as e:
            raise BadArgument(
                f"{program.label} cannot be evaluated on {' '.join(map(str, xs))} ({e}): a step "
                "compares or computes with an Aggregate's empty (None) or mixed value; give every "
                "query of that Aggregate exactly one key (or keys of one value) up to itself"
            ) from None
        if a is not MIXED and b is not MIXED and not _same(a, b):
            raise BadArgument(
                f"{program.label} is not causal: its answer at the last position needs later "
                f"positions ({_first_split(program, xs, causal, whole)}; on {' '.join(map(str, xs))} "
                f"the causal model computes {a!r} where the program's answer is {b!r}); the notebook "
                "runs the model causally, so rewrite that step to select only keys up to its query"
            )


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(float(a) - float(b)) <= 1e-9
    return a == b


def _first_split(program, xs, causal, whole) -> str:
    """The first expression (inputs before outputs) whose values differ between the causal and
    the whole-input evaluation of `xs`, with the first position where they do."""
    order: list = []
    seen: set[int] = set()

    def visit(e) -> None:
        if e.unique_id in seen:
            return
        seen.add(e.unique_id)
        for c in e.children:
            visit(c)
        order.append(e)

    visit(program)
    for e in order:
        if e.unique_id not in causal.memo or e.unique_id not in whole.memo:
            continue
        u, v = causal.memo[e.unique_id], whole.memo[e.unique_id]
        if len(u) and not isinstance(u[0], list):
            bad = [i for i, (x, y) in enumerate(zip(u, v)) if not _same(x, y)]
            if bad:
                return f"{e.label} ({type(e).__name__}) at position {bad[0]} reads keys after it"
    return f"{program.label} at the last position"


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
    origin: str = "tracr library"  # where the program comes from (its report's header)


def _library() -> dict[str, LibraryProgram]:
    def lib():
        from tracr.compiler import lib

        return lib

    rasp = tracr_rasp

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
        LibraryProgram(
            "count-first",
            lambda: _count_first(),
            ("a", "b", "c"),
            6,
            3,
            "how many tokens equal the first one (a counting head keyed on the changed token)",
            "kvnotes",
        ),
        LibraryProgram(
            "rank-first",
            lambda: _rank_first(),
            ("a", "b", "c", "d"),
            6,
            3,
            "how many tokens sort before the first one (a comparison that needs no later position)",
            "kvnotes",
        ),
    ]
    return {p.name: p for p in programs}


def _first():
    """Every position's copy of the first token (one head, keyed on the index 0)."""
    rasp = tracr_rasp()
    zero = rasp.categorical(rasp.Map(lambda i: 0, rasp.indices)).named("zero")
    at_first = rasp.Select(rasp.indices, zero, rasp.Comparison.EQ).named("at_first")
    return rasp.categorical(rasp.Aggregate(at_first, rasp.tokens)).named("first")


def _count_first():
    """How many tokens equal the first one. When the first token changes, the counting head's
    query and its own key there change together (it selects itself in both prompts)."""
    rasp = tracr_rasp()
    same = rasp.Select(rasp.tokens, _first(), rasp.Comparison.EQ).named("same_as_first")
    return rasp.categorical(rasp.SelectorWidth(same)).named("count-first")


def _rank_first():
    """How many tokens sort before the first one: the first token's rank, read at the last
    position, where every key is in view (sorting needs later positions; this does not)."""
    rasp = tracr_rasp()
    before = rasp.Select(rasp.tokens, _first(), rasp.Comparison.LT).named("sorts_before_first")
    return rasp.categorical(rasp.SelectorWidth(before)).named("rank-first")


def library_names() -> list[str]:
    """The shipped programs' model names (`tracr-reverse`, ...)."""
    return [f"{PREFIX}{n}" for n in TRACR_PROGRAMS]


TRACR_PROGRAMS = ("reverse", "hist", "count", "dyck", "dyck2", "pattern", "count-first", "rank-first")

_LOADED: dict[str, TracrModel] = {}


def load_tracr(name: str, *, device=None, dtype=None) -> TracrModel:
    """One of the shipped programs (`TRACR_PROGRAMS`), compiled (once per process, in float32 on
    the CPU), by model name: `tracr-reverse`; a copy cast to `dtype` and moved to `device` where
    those differ."""
    from kvnotes.engine.transformer_lens.model import placed
    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    short = name.removeprefix(PREFIX)
    programs = _library()
    if short not in programs:
        raise UnknownModelError(
            f"no tracr program {name!r}; shipped: {', '.join(library_names())} "
            "(or name your own program as FILE.py:NAME; kvnotes.zoo.tracr.load_program)"
        )
    if name not in _LOADED:
        p = programs[short]
        _LOADED[name] = compile_program(
            p.make(), p.vocab, p.max_seq_len, name=f"{PREFIX}{short}", source=p.origin
        )
    return placed(_LOADED[name], device, dtype)


@dataclass(frozen=True)
class ProgramSource:
    """A user's RASP program as `read_program` found it in its file, checked and not yet compiled."""

    program: Any  # a rasp.SOp
    vocab: Collection[Any]
    max_seq_len: int
    name: str  # the program's name in its file
    source: str  # FILE.py:NAME as given
    mlp_exactness: int = 100


def read_program(
    spec: str, vocab: Collection[Any] | None = None, max_seq_len: int | None = None
) -> ProgramSource:
    """Import `FILE.py` of `spec` (`FILE.py:NAME`) and check what tracr needs of it, compiling
    nothing: NAME is a RASP SOp or a function of no arguments that returns one, and `vocab` and
    `max_seq_len` are given or defined in the file (`VOCAB`, `MAX_SEQ_LEN`). Each wrong part is a
    clear error that says what to define. Importing FILE.py runs it, as `python FILE.py` would."""
    import importlib.util

    rasp = tracr_rasp()
    check_program_spec(spec)
    m = PROGRAM_SPEC.match(spec)
    assert m is not None
    path, attr = Path(m["file"]).expanduser().resolve(), m["name"]
    where = importlib.util.spec_from_file_location(f"kvnotes_program_{path.stem}", path)
    assert where is not None and where.loader is not None
    module = importlib.util.module_from_spec(where)
    where.loader.exec_module(module)
    if not hasattr(module, attr):
        raise UnknownModelError(f"{m['file']} defines no {attr!r}; name one of its RASP programs")
    program = getattr(module, attr)
    if callable(program) and not isinstance(program, rasp.RASPExpr):
        program = program()
    if not isinstance(program, rasp.SOp):
        raise BadArgument(
            f"{spec} is a {type(program).__name__}, not a RASP SOp; define {attr} as a program "
            "(e.g. rasp.Map(...)) or a function of no arguments that returns one"
        )
    vocab = getattr(module, "VOCAB", None) if vocab is None else vocab
    max_seq_len = getattr(module, "MAX_SEQ_LEN", None) if max_seq_len is None else max_seq_len
    if vocab is None or max_seq_len is None:
        raise BadArgument(
            f"{spec}: tracr needs the input values and the longest input; define VOCAB = "
            f"{{...}} and MAX_SEQ_LEN = N in {m['file']}"
        )
    exactness = int(getattr(module, "MLP_EXACTNESS", 100))
    return ProgramSource(program, vocab, int(max_seq_len), attr, f"{m['file']}:{attr}", exactness)


def load_program(
    spec: str,
    vocab: Collection[Any] | None = None,
    max_seq_len: int | None = None,
    *,
    device=None,
    dtype=None,
) -> TracrModel:
    """A user's RASP program, `FILE.py:NAME`, compiled (once per process) as `tracr-NAME`: NAME
    in FILE.py is a RASP SOp or a function of no arguments that returns one; `vocab` and
    `max_seq_len` default to FILE.py's `VOCAB` and `MAX_SEQ_LEN`, and tracr's `mlp_exactness` to
    its `MLP_EXACTNESS` where it sets one (else 100). Importing FILE.py runs it, as
    `python FILE.py` would: load only programs you trust."""
    from kvnotes.engine.transformer_lens.model import placed
    from kvnotes.models.placement import placement

    device, dtype = placement(device, dtype)
    if spec not in _LOADED:
        read = read_program(spec, vocab, max_seq_len)
        _LOADED[spec] = compile_program(
            read.program,
            read.vocab,
            read.max_seq_len,
            name=f"{PREFIX}{read.name}",
            source=read.source,
            mlp_exactness=read.mlp_exactness,
        )
    return placed(_LOADED[spec], device, dtype)


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


@dataclass(frozen=True)
class PairDraw:
    """What `draw_pairs` found: the pairs kept, and how many candidates the compiled model was
    checked on and dropped: `wrong` (its answer on either prompt is not the causal evaluation's)
    and `small` (both right, but the decision moves less than `min_effect` logits)."""

    pairs: list[InputPair]
    checked: int
    wrong: int
    small: int
    examples: tuple[str, ...] = ()  # a few dropped pairs, for the refusal

    @property
    def dropped(self) -> int:
        return self.wrong + self.small


def draw_pairs(
    model: TracrModel,
    n: int,
    *,
    seed: int = 0,
    lengths: tuple[int, int] | None = None,
    tries: int = 20000,
    min_effect: float = PAIR_FLOOR,
) -> PairDraw:
    """`n` distinct pairs for `model`'s program: a random input, one token before the last
    replaced by another value, kept when the answer at the last position (the causal evaluation,
    `evaluate_causal`) changes and the compiled model gets both prompts right with a decision
    that moves at least `min_effect` logits (`PAIR_FLOOR`, the analyses' `MIN_EFFECT`). Refused, with
    the reason, when the answer never moves, or when the model gets most candidates wrong."""
    floor = min_effect
    rng = random.Random(seed)
    lo, hi = lengths or (_min_len(model), model.max_seq_len)
    if not 2 <= lo <= hi <= model.max_seq_len:
        raise BadArgument(f"lengths must lie in 2..{model.max_seq_len} (low <= high), got {(lo, hi)}")
    kept: list[InputPair] = []
    seen: set = set()
    checked = wrong = small = draws = 0
    examples: list[str] = []
    while len(kept) < n and draws < tries and not _failing(checked, wrong + small, n):
        batch = []
        while len(batch) < 2 * (n - len(kept)) + 4 and draws < tries:
            draws += 1
            k = rng.randint(lo, hi)
            clean = [rng.choice(model.vocab) for _ in range(k)]
            i = rng.randrange(k - 1)
            corrupt = list(clean)
            corrupt[i] = rng.choice([v for v in model.vocab if v != clean[i]])
            a, b = model.answer_of(clean), model.answer_of(corrupt)
            key = (tuple(clean), tuple(corrupt))
            if a is None or b is None or a is MIXED or b is MIXED or a == b or key in seen:
                continue
            seen.add(key)
            batch.append(InputPair(tuple(clean), tuple(corrupt), i, a, b))
        for p, (ok, effect) in zip(batch, _model_check(model, batch)):
            if len(kept) == n:
                break
            checked += 1
            if ok and effect >= floor:
                kept.append(p)
                continue
            wrong += not ok
            small += ok
            if len(examples) < 2:
                why = "answered wrongly" if not ok else f"moves {effect:.3f} logits"
                examples.append(f"{model.text(p.clean)} / {model.text(p.corrupt)}: {why}")
    name = model.name
    if _failing(checked, wrong + small, n) or (checked and (wrong + small) * 2 > checked):
        raise BadArgument(
            f"{name}: the compiled model fails {wrong + small} of the {checked} pairs it was checked "
            f"on ({wrong} answered wrongly, {small} moving less than {floor} logits; e.g. "
            f"{'; '.join(examples)}): tracr's numerical MLPs round inexactly, so compile with a "
            "larger mlp_exactness (compile_program(..., mlp_exactness=1000), or MLP_EXACTNESS = 1000 "
            "beside a FILE.py:NAME program) or a shorter max_seq_len"
        )
    if not kept:
        raise BadArgument(
            f"{name}'s answer at the last position never moved in {draws} one-token changes of "
            "random inputs: a program whose answer is constant has no pair task (fewer pairs "
            "cannot help); give it an answer that depends on the input"
        )
    if len(kept) < n:
        raise BadArgument(
            f"found only {len(kept)} of {n} pairs for {name} in {draws} draws (the answer "
            "rarely moves, or few distinct inputs exist at these lengths); ask for fewer"
        )
    return PairDraw(kept, checked, wrong, small, tuple(examples))


def _failing(checked: int, dropped: int, n: int) -> bool:
    """Whether the compiled model has failed most of enough checked pairs to stop drawing."""
    return checked >= 4 * n + 16 and dropped * 2 > checked


def _model_check(model: TracrModel, batch: list[InputPair]) -> list[tuple[bool, float]]:
    """Per pair: whether the compiled model's answer on both prompts is the causal evaluation's
    (its largest output logit, by a margin), and the decision's move in logits (the logit
    difference correct - wrong on the clean prompt minus that on the corrupt one)."""
    if not batch:
        return []
    from kvnotes.metrics import logit_diff

    cols = torch.tensor([model.answer_token(str(v)) for v in model.outputs])
    by_len: dict[int, list[int]] = {}
    for j, p in enumerate(batch):
        by_len.setdefault(len(p.clean), []).append(j)
    out: list[tuple[bool, float]] = [(False, 0.0)] * len(batch)
    with torch.no_grad():
        for js in by_len.values():
            rows = [model.encode(model.text(x)) for j in js for x in (batch[j].clean, batch[j].corrupt)]
            last = model.tl(torch.tensor(rows))[:, -1].double()
            top = last[:, cols].topk(min(2, len(cols)), dim=-1)
            for r, j in enumerate(js):
                p = batch[j]
                ok = True
                for row, want in ((2 * r, p.correct), (2 * r + 1, p.wrong)):
                    margin = float(top.values[row, 0] - top.values[row, -1]) if len(cols) > 1 else 1.0
                    ok &= model.outputs[int(top.indices[row, 0])] == want and margin > MARGIN
                ld = logit_diff(
                    last[2 * r : 2 * r + 2],
                    (model.answer_token(str(p.correct)), model.answer_token(str(p.wrong))),
                )
                out[j] = (ok, float(ld[0] - ld[1]))
    return out


# A compiled categorical output is its value's one-hot direction (logit 1, the others 0): an
# answer counts as the model's when it leads the runner-up by more than half of that
MARGIN = 0.5


def input_pairs(
    model: TracrModel, n: int, *, seed: int = 0, lengths: tuple[int, int] | None = None, tries: int = 20000
) -> list[InputPair]:
    """`draw_pairs`' pairs."""
    return draw_pairs(model, n, seed=seed, lengths=lengths, tries=tries).pairs


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
    "CAUSAL_CHECKS",
    "MIXED",
    "PAIR_FLOOR",
    "TRACR_PROGRAMS",
    "InputPair",
    "KnownCircuit",
    "LibraryProgram",
    "PairDraw",
    "Step",
    "TracrModel",
    "check_causal",
    "compile_program",
    "draw_pairs",
    "evaluate_causal",
    "input_pairs",
    "library_names",
    "load_program",
    "read_program",
    "ProgramSource",
    "load_tracr",
    "make_evaluator",
    "pair_set",
    "pairs",
    "to_pair",
    "tracr_rasp",
]
