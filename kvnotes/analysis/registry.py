"""The analysis registry: every probe, control, circuit analysis, edit and compose experiment,
regime sweep and benchmark is declared once, in the module that computes it.

An `Analysis` names its report `section` (and so its CLI command), a frozen config dataclass
whose fields are its options (defaults and one-line help), the function that runs it and the
typed result it returns. The CLI's commands and options, `ReportConfig`, the runner
(`kvnotes.analysis.runner`) and the section runners (`run_probes`, `run_circuits`, ...) are all
generated from, or loop over, this registry; `dashboards` registers the panels that draw each
result. Adding an analysis is one `@analysis` (or `register`) beside its code
(docs/adding-an-analysis.md).

    from kvnotes.analysis.registry import analyses
    sorted(analyses())          # ['agent_loop', 'attribution', 'cot_refresh', ...]

The analyses register when their modules are imported; `analyses()` first imports every module
that declares one, found by walking the built-in packages (probes, circuits, kvnotes.bench) and any
package named in the `kvnotes.analyses` entry-point group (`kvnotes.analysis.discovery`): a new
module is found without an edit to any `__init__.py`, and another package adds its own with one
entry point.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints

from tqdm.auto import tqdm

from kvnotes.analysis.spec_form import assemble, help_line, option_entry
from kvnotes.errors import MIN_EFFECT, BadOption, KVNotesError, NeedUnmet, OutOfRange, UnknownAnalysisError
from kvnotes.models.backends import DEFAULT_BACKEND
from kvnotes.tasks.pairs import is_pairs


class Need(Enum):
    """What an analysis needs beyond a model and prompt pairs, declared with `@analysis(...,
    requires=(Need.RULE,))`; `refuse_unmet` checks every one before anything runs."""

    RULE = "a task with a gated rule"  # a rule to flip, a gate field to edit or rewrite
    TEMPLATE = "a task template to draw fresh prompts from"  # resamples, SAE training pairs, filler
    MOVING_CHUNKS = "keys that carry their positions (rotary)"  # splices, re-rotation, compose

    def refusal(self, name: str, task: Any = None, model: Any = None) -> str | None:
        """Why analysis `name` cannot run on `task` and `model` (None where it can, or where what
        this need is about is not known yet: the model before it loads)."""
        if self is Need.MOVING_CHUNKS:
            positions = getattr(getattr(model, "facts", None), "positions", "rotary")
            if positions == "rotary":
                return None
            return (
                f"{name} moves chunks of the cache to other positions, and {model.name} has learned "
                "absolute positions: positions live in the residual stream, not in the "
                "keys, so a moved chunk cannot be re-rotated; run it on a model with rotary positions "
                "(gemma-3-270m, a tiny-* model)"
            )
        if not is_pairs(task):
            return None
        return (
            f"{name} needs {self.value}; {task.source} is a pair dataset: run it with --task "
            "(a built-in task or a task .toml, docs/tasks.md)"
        )


def refuse_unmet(names: Iterable[str], *, task: Any = None, model: Any = None) -> None:
    """Refuse, in one line and before any compute, analyses whose `requires` the task or model does
    not meet (`NeedUnmet`, naming the first and the way out)."""
    for name in names:
        why = unmet(get(name), task=task, model=model)
        if why:
            raise NeedUnmet(why)


def unmet(a: Analysis, *, task: Any = None, model: Any = None) -> str | None:
    """Why `a` cannot run on `task` and `model`, or None."""
    return next((w for need in a.requires if (w := need.refusal(a.name, task, model))), None)


TASK, MODEL = "task", "model"


@dataclass(frozen=True)
class Section:
    """A group of analyses that share a report part (`order-cancel/circuits`) and a CLI command.

    `level` is "task" (run once per task, on shared prompt pairs, collected in one `SectionReport`)
    or "model" (each analysis is its own part, `model/ttft`, and its own `kvnotes bench`
    subcommand). `title` and `intro` head the section in a report; `help` is its command's line in
    `kvnotes --help` (of a command's sections, the first that has one)."""

    name: str
    title: str
    intro: str = ""
    level: str = TASK
    command: str | None = None  # CLI command; None: the section is reached only through the report
    help: str = ""  # the command's one-line help
    order: int = 100  # place in a report (smaller first)


@dataclass(frozen=True)
class Analysis:
    """One analysis, declared once.

    `run(ctx, cfg)` returns an instance of `result` (or None when `cfg` sizes it to nothing);
    `needs` are analyses of the same section whose results it reads from `ctx.results` (they run
    first); `requires` what it needs of the task and model (`Need`: a gated rule, a template,
    moving chunks), refused before anything runs. `default`: run when a command is given no names;
    `in_report`: a part of `kvnotes report`; `flag`: a CLI switch that also turns it on
    (`kvnotes edit --weights`); `quick`: the config fields `ReportConfig.quick()` changes."""

    name: str
    section: str
    config: type
    run: Callable[[Context, Any], Any]
    result: type
    help: str
    quick: Mapping[str, Any] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    default: bool = True
    in_report: bool = True
    flag: str | None = None
    title: str = ""  # a model-level analysis's heading in a report (default: its name)
    order: int = 100  # place within its section (runs, pages and JSON follow it)
    needs_model: bool = True  # False: run gets ctx.model None and ctx.model_name (a server does the work)
    command: str = ""  # a model-level analysis's `kvnotes bench` subcommand (default: its name, - for _)
    requires: tuple[Need, ...] = ()  # what it needs of the task and model, checked before any compute

    def __post_init__(self):
        _check_result(self.name, self.result)
        if not dataclasses.is_dataclass(self.config):
            raise TypeError(f"analysis {self.name!r}: config must be a dataclass, got {self.config!r}")
        names = {f.name for f in dataclasses.fields(self.config)}
        bad = sorted(set(self.quick) - names)
        if bad:
            raise TypeError(f"analysis {self.name!r}: quick sets {bad}, which its config does not have")

    def make_config(self, preset: str = "full", **overrides) -> Any:
        """Its config at a preset, with `overrides` for the fields it has (others are ignored)."""
        own = {f.name for f in dataclasses.fields(self.config)}
        values = {
            **(self.quick if preset == "quick" else {}),
            **{k: v for k, v in overrides.items() if k in own and v is not None},
        }
        try:
            return self.config(**{k: _coerce(self.config, k, v) for k, v in values.items()})
        except (TypeError, ValueError) as e:
            if isinstance(e, KVNotesError):
                raise
            raise BadOption(f"{self.name}: {e}") from e


def _check_result(name: str, cls: type[Any]) -> None:
    """Refuse a result class that does not follow the result protocol
    (`kvnotes.analysis.results.Result`): `to_dict()`, `from_dict(d)` and a notebook view."""
    missing = [m for m in ("to_dict", "from_dict", "_repr_html_") if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(
            f"analysis {name!r}: its result {cls.__name__} lacks {missing}; give it to_dict, from_dict(d) "
            "and a notebook view (inherit kvnotes.display.Displayable)"
        )
    params = [
        p
        for p in inspect.signature(cls.from_dict).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) != 1:
        raise TypeError(
            f"analysis {name!r}: {cls.__name__}.from_dict takes {[p.name for p in params]}; the result "
            "protocol's is from_dict(d), reading what to_dict() wrote"
        )


_ANALYSES: dict[str, Analysis] = {}
_SECTIONS: dict[str, Section] = {}


def register(analysis: Analysis) -> Analysis:
    """Add `analysis` (replacing one of the same name); its section is created if new."""
    _ANALYSES[analysis.name] = analysis
    if analysis.section not in _SECTIONS:
        register_section(
            Section(
                analysis.section, analysis.section.replace("_", " ").capitalize(), command=analysis.section
            )
        )
    return analysis


def analysis(name: str, section: str, config: type, result: type, **options) -> Callable:
    """Register the decorated `run(ctx, cfg)` as analysis `name`; the first paragraph of its
    docstring is its help, whole (`Analysis` takes the other `options`: quick, needs, default,
    in_report, flag, ...)."""

    def add(run_fn: Callable) -> Callable:
        help_ = options.pop("help", None) or help_line(run_fn.__doc__)
        register(Analysis(name, section, config, run_fn, result, help_, **options))
        return run_fn

    return add


def register_section(section: Section) -> Section:
    _SECTIONS[section.name] = section
    return section


def unregister(name: str) -> None:
    """Remove an analysis (and its section, if that leaves it empty)."""
    a = _ANALYSES.pop(name, None)
    if a and not any(x.section == a.section for x in _ANALYSES.values()):
        _SECTIONS.pop(a.section, None)


@cache
def _load_builtin() -> None:
    from kvnotes.analysis.discovery import load_all

    load_all()


def analyses() -> dict[str, Analysis]:
    """Every registered analysis by name, by its section's order, then its own, then its name."""
    _load_builtin()
    return dict(
        sorted(_ANALYSES.items(), key=lambda kv: (_SECTIONS[kv[1].section].order, kv[1].order, kv[0]))
    )


def sections() -> dict[str, Section]:
    _load_builtin()
    return dict(sorted(_SECTIONS.items(), key=lambda kv: kv[1].order))


def get(name: str) -> Analysis:
    found = analyses()
    if name not in found:
        raise UnknownAnalysisError(f"unknown analysis {name!r}; the analyses are {sorted(found)}")
    return found[name]


def result_type(name: str) -> type:
    """The result class of analysis `name` (how a saved result is read back)."""
    return get(name).result


def report_analyses() -> dict[str, Analysis]:
    """The analyses a report runs (every registered one marked `in_report`)."""
    return {k: a for k, a in analyses().items() if a.in_report}


def in_section(section: str) -> list[Analysis]:
    return [a for a in analyses().values() if a.section == section]


def for_command(command: str) -> list[Analysis]:
    secs = {s.name for s in sections().values() if s.command == command}
    return [a for a in analyses().values() if a.section in secs]


def choose(command: str, names: Sequence[str] | str | None, flags: Sequence[str] = ()) -> list[str]:
    """The analyses a command runs: `names` ("all", a list, or a comma-separated string; empty:
    the command's defaults) plus those whose `flag` is in `flags`, checked before any model loads."""
    avail = {a.name: a for a in for_command(command)}
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = [n.replace("-", "_") for n in names or []]  # `memory-placement` names `memory_placement`
    if names in ([], ["all"]):
        names = [n for n, a in avail.items() if a.default]
    bad = [n for n in names if n not in avail]
    if bad:
        raise UnknownAnalysisError(
            f"unknown analysis(es) {bad} for `kvnotes {command}`: it runs {list(avail)} or 'all'"
        )
    names += [n for n, a in avail.items() if a.flag in flags and n not in names]
    return names


def cli_spec() -> dict:
    """What the `kvnotes` command needs from the registry to build its parser, as plain JSON data:
    each command's level, help line and analyses, each analysis's help, flag and options (type, bounds,
    choices, help with its defaults). The parser reads the same from the source without importing
    the analyses (`kvnotes.cli_spec.read`); a test holds the two equal."""
    secs = [
        {"name": s.name, "command": s.command, "level": s.level, "help": s.help} for s in sections().values()
    ]
    found = [
        {
            "name": a.name,
            "section": a.section,
            "command": a.command,
            "help": a.help,
            "default": a.default,
            "flag": a.flag,
            "options": [_option_spec(a, f) for f in dataclasses.fields(a.config)],
        }
        for a in analyses().values()
    ]
    return assemble(MIN_EFFECT, secs, found)


def _option_spec(a: Analysis, f: dataclasses.Field) -> dict:
    hint = base_type(config_hints(a.config)[f.name])
    item = get_args(hint)[0] if get_origin(hint) is tuple else hint
    kind = "list" if get_origin(hint) is tuple else item.__name__ if item in (bool, int, float) else "str"
    return option_entry(f.name, kind, item.__name__ if item in (int, float) else "str", f.default, f.metadata)


# --- configs ------------------------------------------------------------------------------------


def replace_default(cfg_type: type, **defaults) -> type:
    """A config class like `cfg_type` with other defaults (two analyses with the same options)."""
    fields_ = [
        (f.name, f.type, dataclasses.field(default=defaults.get(f.name, f.default), metadata=f.metadata))
        for f in dataclasses.fields(cfg_type)
    ]
    made = dataclasses.make_dataclass(cfg_type.__name__, fields_, bases=(cfg_type,), frozen=True)
    made.__module__ = cfg_type.__module__
    return made


def option(default: Any, help: str, **extra) -> Any:
    """A config field with its one-line help; `extra`: `cli` (its option's name), `choices`,
    `metavar`, `least` and `most` (the range a number, or each number of a tuple, must lie in,
    checked by `Options` and by the CLI as it parses), and a limit the model sets (`LIMITS`,
    checked against the model's outline before the load and the model once loaded:
    `fit_to_model`): `layer` (a layer index), `layers` (a count of layers), `heads` (a count of
    heads over all layers), `tokens` (a length in tokens, which must fit the model's context);
    `skips`: 0 sizes the analysis to nothing (a report leaves it out; its own command's parser
    takes 1 at least, so 0 is refused before the model loads); `arg`: the keyword it is passed to the
    analysis's function as by `Options.call` (default: the field's own name; an option named for
    its command, `sae_layer`, feeds the function's `layer`)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class Options:
    """Base of analysis configs: checks every field declared with `option(..., least=, most=)`."""

    def __post_init__(self):
        from kvnotes.args import Bounded

        for f in dataclasses.fields(self):
            least, most, v = f.metadata.get("least"), f.metadata.get("most"), getattr(self, f.name)
            if (least is None and most is None) or v is None:
                continue
            kind = int if isinstance(least if least is not None else most, int) else float
            try:
                Bounded(kind, least, most, many=isinstance(v, tuple)).check(v)
            except ValueError as e:
                raise BadOption(f"{f.name} ({f.metadata['help']}): {e}") from None

    def call(self, fn: Callable[..., Any], /, *args: Any, **given: Any) -> Any:
        """`fn(*args, **given)`, with every option `fn` takes as a keyword: each field under its `arg`
        (its own name by default), where neither `args` nor `given` fill that parameter. The runner
        passes what it computes from the run (its trials, `min_effect=ctx.min_effect`); the options
        pass themselves, so none is forwarded by hand.

        >>> @dataclass(frozen=True)
        ... class Cfg(Options):
        ...     top: int = option(5, "slots to keep")
        ...     sae_layer: int = option(3, "SAE layer", arg="layer")
        >>> Cfg(top=2).call(lambda trials, *, top, layer, seed: (trials, top, layer, seed), "T", seed=7)
        ('T', 2, 3, 7)
        """
        params = list(inspect.signature(fn).parameters.values())
        filled = {p.name for p in params[: len(args)] if p.kind is not p.VAR_POSITIONAL} | set(given)
        takes = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        passed = {
            arg: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if (arg := f.metadata.get("arg", f.name)) in takes and arg not in filled
        }
        return fn(*args, **given, **passed)


# option(..., KIND=True): what the model sets as its most (`model`: a loaded model or its outline,
# `kvnotes.zoo.outline.Outline`, which have these attributes; None where it does not tell)
LIMITS: dict[str, Callable[[Any], int | None]] = {
    "layer": lambda m: m.n_layers - 1,  # a layer index
    "layers": lambda m: m.n_layers,  # a count of consecutive layers
    "heads": lambda m: m.n_layers * m.n_heads,  # a count of heads, over all layers
    "tokens": lambda m: m.n_ctx,  # a length in tokens
}


def _most(meta: Mapping, model: Any) -> int | None:
    return next((most(model) for kind, most in LIMITS.items() if meta.get(kind)), None)


def refusal(name: str, meta: Mapping, value: Any, model: Any) -> str | None:
    """The one line that refuses `value` of option `name` (its field's metadata `meta`) on `model`,
    naming the option, the model's limit and the way out; None where it fits, where the option has
    no limit, or where the model does not tell it (a hub model's context before the load).

    >>> from kvnotes.zoo.outline import outline
    >>> print(refusal("layer_window", {"layers": True}, 99, outline("tiny-llama")))  # doctest: +ELLIPSIS
    --layer-window 99 is more than tiny-llama's 3 layers; give at most 3, or leave --layer-window out ...
    """
    most = _most(meta, model)
    over = [x for x in (value if isinstance(value, tuple) else (value,)) if most is not None and x > most]
    if not over:
        return None
    flag = "--" + meta.get("cli", name.replace("_", "-"))
    if meta.get("layer"):
        return (
            f"{flag} {value} is out of range for {model.name} ({model.n_layers} layers); "
            f"give a layer in 0..{most}, or leave {flag} out for the default"
        )
    if meta.get("tokens"):
        return (
            f"{flag} {over} do not fit {model.name}'s context of {most} tokens; give lengths of at most "
            f"{most}, or leave {flag} out for the lengths that fit"
        )
    has = f"{most} heads ({model.n_layers} layers x {model.n_heads})" if meta.get("heads") else ""
    return (
        f"{flag} {value} is more than {model.name}'s {has or f'{most} layers'}; give at most {most}, "
        f"or leave {flag} out for a default that fits"
    )


def check_layers(cfg: Any, model: Any) -> None:
    """Refuse a config whose layer indices (`option(..., layer=True)`) the model does not have."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        why = None if v is None or not f.metadata.get("layer") else refusal(f.name, f.metadata, v, model)
        if why:
            raise OutOfRange(why)


def limited_fields(cfg_type: type) -> set[str]:
    """The fields of a config whose values the model limits (`LIMITS`), or that the analysis fits to
    the model as loaded where they are left at their defaults (`option(..., fitted=True)`, read with
    `Context.fit_context`)."""
    return {
        f.name
        for f in dataclasses.fields(cfg_type)
        if f.metadata.get("fitted") or any(f.metadata.get(k) for k in LIMITS)
    }


def fit_to_model(cfg: Any, model: Any, given: Collection[str]) -> Any:
    """`cfg` fitted to `model` (loaded, or its outline before the load): a value the user gave (its
    field in `given`) that the model cannot have is refused (`refusal`); a default one is fitted, so
    that every command run with its defaults fits every model: a list keeps what fits (the model's
    limit itself where nothing does), a single count or length is clipped. A layer index is never
    fitted: a default one beyond the model is refused as a given one is. A default the analysis
    fits itself to the model as loaded (`option(..., fitted=True)`: memory sizes beside a
    conversation, agent-loop turns) is left for it.

    >>> from kvnotes.bench.ttft import TTFTConfig
    >>> from kvnotes.zoo.outline import outline
    >>> fit_to_model(TTFTConfig(), outline("tiny-llama"), given=()).lengths
    (512,)
    >>> fit_to_model(TTFTConfig(lengths=(4096,)), outline("tiny-llama"), ("lengths",))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    kvnotes.errors.OutOfRange: --lengths [4096] do not fit tiny-llama's context of 512 tokens; give ...
    """
    changes = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        why = None if v is None else refusal(f.name, f.metadata, v, model)
        if why is None:
            continue
        if f.name in given or f.metadata.get("layer"):
            raise OutOfRange(why)
        if f.metadata.get("fitted"):
            continue  # the analysis fits it, knowing more than the context (`limited_fields`)
        most = _most(f.metadata, model)
        changes[f.name] = tuple(x for x in v if x <= most) or (most,) if isinstance(v, tuple) else most
    return dataclasses.replace(cfg, **changes) if changes else cfg


@cache
def config_hints(cfg_type: type) -> dict[str, Any]:
    return get_type_hints(cfg_type)


def _coerce(cfg_type: type, name: str, value: Any) -> Any:
    """Lists become tuples where the field is a tuple (JSON and the CLI give lists)."""
    hint = config_hints(cfg_type).get(name)
    if isinstance(value, list) and (get_origin(hint) is tuple or tuple in get_args(hint)):
        return tuple(value)
    return value


def base_type(hint: Any) -> Any:
    """`int | None` → int; other hints unchanged."""
    if get_origin(hint) in (Union, types.UnionType):
        arms = [a for a in get_args(hint) if a is not type(None)]
        return arms[0] if len(arms) == 1 else hint
    return hint


def config_to_dict(cfg: Any) -> dict:
    return {
        f.name: list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v
        for f in dataclasses.fields(cfg)
    }


def config_from_dict(analysis: Analysis, d: Mapping) -> Any:
    own = {f.name for f in dataclasses.fields(analysis.config)}
    bad = sorted(set(d) - own)
    if bad:
        raise BadOption(f"{analysis.name}: unknown option(s) {bad}; it has {sorted(own)}")
    return analysis.config(**{k: _coerce(analysis.config, k, v) for k, v in d.items()})


# --- the context an analysis runs in (kvnotes.analysis.runner runs them) --------------------------


@dataclass
class Context:
    """What every analysis of one run shares: the model, the task (None at model level), the seed
    and minimum effect, results finished so far, and a memo (`shared`) so that analyses asking
    for the same prompt pairs prefill them once."""

    model: Any
    task: Any = None
    model_name: str | None = None  # the name the model was asked for by (set when model is not loaded)
    backend: str = DEFAULT_BACKEND  # the backend the model was asked for on (a BackendName)
    seed: int = 0
    min_effect: float = MIN_EFFECT
    progress: bool = True
    fit_context: bool = False  # model-level benches: drop sizes beyond the model's context
    results: dict[str, Any] = field(default_factory=dict)
    memo: dict[Any, Any] = field(default_factory=dict)

    @property
    def common(self) -> dict:
        """The keyword arguments most analysis functions take from the run: seed and progress."""
        return {"seed": self.seed, "progress": self.progress}

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def say(self, text: str) -> None:
        if self.progress:
            tqdm.write(text, file=sys.stderr)
