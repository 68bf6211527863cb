"""The `kvnotes` command. The one composition root allowed to import from every layer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2))
        print(f"wrote {path}", file=sys.stderr)


def _emit(report, path: str | None) -> int:
    """Print a result's table and write its JSON if asked; the command's success exit code."""
    print(report.table())
    _write_json(path, report.to_dict())
    return 0


def _ints(text: str) -> list[int]:
    """A comma-separated list of integers from the command line ("512,1024")."""
    return [int(x) for x in text.split(",") if x.strip()]


def cmd_verify(args) -> int:
    from kvnotes.conformance import verify
    from kvnotes.models import load_model

    report = verify(load_model(args.model))
    _emit(report, args.json)
    return 0 if report.passed else 1


def cmd_bench_patch_sweep(args) -> int:
    from kvnotes.bench import patch_sweep_report
    from kvnotes.models import load_model

    lengths = _ints(args.tokens)
    report = patch_sweep_report(load_model(args.model), lengths, n_slots=args.slots)
    return _emit(report, args.json)


def cmd_bench_ttft(args) -> int:
    from kvnotes.models import load_model
    from kvnotes.ttft import ttft

    lengths = _ints(args.lengths)
    report = ttft(load_model(args.model), lengths, seam=args.seam)
    return _emit(report, args.json)


def cmd_bench_edit_cost(args) -> int:
    from kvnotes.models import load_model
    from kvnotes.ttft import edit_cost

    report = edit_cost(load_model(args.model), args.tokens)
    return _emit(report, args.json)


def cmd_edit(args) -> int:
    from kvnotes.errors import KVNotesError
    from kvnotes.models import load_model
    from kvnotes.tasks import builtin_tasks, load_task
    from probes import make_trials
    from probes.edit import ERRATUM, edit_methods
    from probes.results import ProbeReport

    if args.weights and args.n < 2:  # before the (slow) model load
        raise KVNotesError(
            f"--weights needs --n 2 or more (contamination is read on another pair's "
            f"prompt), got --n {args.n}"
        )
    task = load_task(args.task or (args.model if args.model in builtin_tasks() else "order-cancel"))
    model = load_model(args.model)
    trials = make_trials(model, task, args.n, seed=args.seed)
    results = {"edit_methods": edit_methods(trials, erratum=args.erratum or ERRATUM)}
    if args.weights:
        from probes.weights import drift_trials, weight_edit

        other = drift_trials(model, task, args.n, seed=args.seed)  # another built-in task's decisions
        results["weight_edit"] = weight_edit(
            trials, layer=args.layer, other_trials=other, erratum=args.erratum or ERRATUM
        )
    if args.cot:
        from probes.cot import cot_refresh

        results["cot_refresh"] = cot_refresh(trials, max_tokens=args.cot_tokens)
    report = ProbeReport(model=model.name, task=task.name, n=args.n, seed=args.seed, probes=results)
    return _emit(report, args.json)


def cmd_compose(args) -> int:
    from kvnotes.models import load_model
    from probes.compose import seam_repair
    from probes.results import ProbeReport

    model = load_model(args.model)
    seams = _ints(args.seams)
    offsets = _ints(args.offsets)
    results = {
        "seam_repair": seam_repair(model, args.task, n=args.n, seams=seams, offsets=offsets, seed=args.seed)
    }
    if args.memory:
        from probes.memory import memory_blocks

        results["memory_blocks"] = memory_blocks(model, n=2 * args.n, seed=args.seed)
    if args.turns:
        from probes.agent import agent_loop

        results["agent_loop"] = agent_loop(
            model, args.task, n=min(args.n, 2), turns=args.turns, seed=args.seed
        )
    report = ProbeReport(model=model.name, task=args.task, n=args.n, seed=args.seed, probes=results)
    return _emit(report, args.json)


def cmd_probe(args) -> int:
    from kvnotes.models import load_model
    from kvnotes.tasks import builtin_tasks, load_task
    from probes import check_names, regime, run_probes
    from probes.results import ProbeReport

    if args.name != "regime":
        names = check_names(args.name.split(","))  # before the (slow) model load
    task_name = args.task or (args.model if args.model in builtin_tasks() else "order-cancel")
    task = load_task(task_name)
    model = load_model(args.model)
    n = args.n or (4 if args.name == "regime" else 8)
    if args.name == "regime":
        distances = _ints(args.distances)
        result = regime(model, task, n=n, distances=distances, seed=args.seed, min_effect=args.min_effect)
        report = ProbeReport(
            model=model.name,
            task=task.name,
            n=n,
            seed=args.seed,
            probes={"regime": result},
            meta={"min_effect": args.min_effect},
        )
    else:
        report = run_probes(model, task, names, n=n, seed=args.seed, min_effect=args.min_effect)
    return _emit(report, args.json)


def cmd_circuits(args) -> int:
    from circuits import check_analyses, run_circuits
    from kvnotes.models import load_model
    from kvnotes.tasks import builtin_tasks, load_task

    names = check_analyses(args.only.split(",") if args.only else ["all"])  # before the model load
    task = load_task(args.task or (args.model if args.model in builtin_tasks() else "order-cancel"))
    sae_cfg = sae = None
    if "sae" in names:
        from circuits.sae import SAEConfig

        sae_cfg = SAEConfig(site=args.sae_site, layer=args.sae_layer, seed=args.seed)
    model = load_model(args.model)
    if args.sae:
        from circuits.sae import load_sae

        sae = load_sae(args.sae, args.sae_id, model=model)
    report = run_circuits(
        model,
        task,
        names,
        n=args.n,
        seed=args.seed,
        k_max=args.k_max,
        draws=args.draws,
        sae_config=sae_cfg,
        sae=sae,
        min_effect=args.min_effect,
    )
    return _emit(report, args.json)


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
    from circuits.prompt_attribution import attribute_prompt
    from kvnotes.errors import KVNotesError
    from kvnotes.models import load_model

    if len(args.answers) != 2:  # before the (slow) model load
        raise KVNotesError(
            f"--answers takes exactly two answer strings, the decision's two outcomes "
            f"(e.g. --answers ' yes' ' no'); got {len(args.answers)}: {args.answers}"
        )
    prompt = _read_text(args.prompt, "prompt")
    counterfactual = _read_text(args.counterfactual, "counterfactual") if args.counterfactual else None
    model = load_model(args.model)
    result = attribute_prompt(
        model,
        prompt,
        (args.answers[0], args.answers[1]),
        counterfactual=counterfactual,
        top=args.top,
        steps=args.steps,
    )
    _emit(result, args.json)
    if args.html:
        from dashboards.render import write_page

        write_page(result, args.html)
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from circuits.report import ReportConfig, run_report
    from dashboards.render import write_report
    from kvnotes.models import load_model
    from kvnotes.tasks import builtin_tasks, load_task

    tasks = args.task or [args.model if args.model in builtin_tasks() else "order-cancel"]
    tasks = [load_task(t) for t in tasks]  # before the (slow) model load: a bad task file fails now
    sizes = {k: v for k, v in {"n": args.n, "seed": args.seed}.items() if v is not None}
    cfg = ReportConfig.quick(**sizes) if args.quick else ReportConfig.full(**sizes)
    model = load_model(args.model)
    out = Path(args.out)
    report = run_report(
        model, tasks, out, cfg, resume=not args.fresh, on_part=lambda r: write_report(r, out)
    )  # the page follows every finished part
    print(f"{report!r}\nopen {out / 'index.html'} (or `kvnotes dashboard {out}`)")
    return 0


def cmd_render(args) -> int:
    from circuits.report import Report
    from dashboards.render import write_report

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvnotes", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="run the eight exactness invariants on a model")
    v.add_argument("--model", required=True, help="gemma-3-270m, a tiny-* model, or a HF checkpoint dir")
    v.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    v.set_defaults(func=cmd_verify)

    pr = sub.add_parser("probe", help="causal probes of where a model keeps its conclusion")
    pr.add_argument(
        "name",
        help="field_refresh, notes_transplant, note_map, knockout, dissociation, "
        "false_note_injection, a comma-separated list, 'all', or 'regime'",
    )
    pr.add_argument("--model", required=True, help="gemma-3-270m, an organism, a tiny-* model, or a HF dir")
    pr.add_argument(
        "--task",
        help="a built-in task name or a task.toml file (default: the model's own "
        "task for an organism, else order-cancel)",
    )
    pr.add_argument("--n", type=int, help="prompt pairs per probe (default 8; 4 for regime)")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument(
        "--min-effect",
        type=float,
        default=0.1,
        help="skip pairs whose decision moves less than this many logits (default 0.1)",
    )
    pr.add_argument(
        "--distances",
        default="0,16,32,64,128,256,512,768",
        help="regime only: filler lengths in tokens between the field and the query",
    )
    pr.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    pr.set_defaults(func=cmd_probe)

    ci = sub.add_parser(
        "circuits",
        help="head-level read/write circuits, causal scrubbing, attribution "
        "patching and SAE features (docs/circuits.md)",
    )
    ci.add_argument("--model", required=True, help="gemma-3-270m, an organism, a tiny-* model, or a HF dir")
    ci.add_argument(
        "--task", help="a built-in task or a task.toml (default: the organism's own, else order-cancel)"
    )
    ci.add_argument("--n", type=int, default=8, help="prompt pairs (default 8)")
    ci.add_argument(
        "--only",
        help="comma-separated subset of read_heads, write_heads, scrubbing, attribution, sae (default: all)",
    )
    ci.add_argument("--k-max", type=int, default=12, help="largest k of the top-k vs random-k head curves")
    ci.add_argument("--draws", type=int, default=32, help="random head sets per k (the write side uses half)")
    ci.add_argument(
        "--sae",
        metavar="DIR_OR_RELEASE",
        help="use this sae-lens SAE (a local directory, or a pretrained release with --sae-id) "
        "instead of training one",
    )
    ci.add_argument("--sae-id", help="with a pretrained release: the SAE's id in it")
    ci.add_argument(
        "--sae-site",
        choices=("auto", "notes", "decision"),
        default="auto",
        help="where the SAE reads and features are patched: the note slots, the decision "
        "token, or auto (the notes if their residual carries the decision, else the "
        "decision; docs/circuits.md)",
    )
    ci.add_argument(
        "--sae-layer",
        type=int,
        help="residual layer of a trained SAE (default: located by a whole-residual scan)",
    )
    ci.add_argument("--seed", type=int, default=0)
    ci.add_argument("--min-effect", type=float, default=0.1)
    ci.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ci.set_defaults(func=cmd_circuits)

    at = sub.add_parser(
        "attribute",
        help="which slots of any prompt's notebook carry the decision at its "
        "last token: gradient estimate, then exact transplants",
    )
    at.add_argument("--model", required=True, help="gemma-3-270m, a tiny-* model, or a HF checkpoint dir")
    at.add_argument(
        "--prompt",
        required=True,
        metavar="FILE",
        help="the prompt text (one trailing newline is dropped); its last token is the decision",
    )
    at.add_argument(
        "--answers",
        required=True,
        nargs="+",
        metavar="ANSWER",
        help="the two answer strings, each one token: ld = logit[first] - logit[second]",
    )
    at.add_argument(
        "--counterfactual",
        metavar="FILE",
        help="a second prompt of the same token count whose K/V replace the slots (default: "
        "the value mean-ablation of the prompt's own notebook)",
    )
    at.add_argument("--top", type=int, default=8, help="slots transplanted exactly (default 8)")
    at.add_argument(
        "--steps",
        type=int,
        default=4,
        help="gradient passes along the path to the source (integrated gradients; 1 = plain "
        "attribution patching; default 4)",
    )
    at.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    at.add_argument("--html", metavar="FILE", help="also write an HTML page of the results")
    at.set_defaults(func=cmd_attribute)

    ed = sub.add_parser("edit", help="one changed field: every editing method against full recompute")
    ed.add_argument("--model", required=True)
    ed.add_argument(
        "--task", help="a built-in task or a task.toml (default: the organism's own, else order-cancel)"
    )
    ed.add_argument("--n", type=int, default=8)
    ed.add_argument("--seed", type=int, default=0)
    ed.add_argument("--erratum", help="correction line; {field} and {value} are filled in")
    ed.add_argument(
        "--weights",
        action="store_true",
        help="also run the weight-edit baseline: a rank-one MLP edit per pair, with its "
        "contamination, drift (on another built-in task) and cost (docs/edit-compose.md)",
    )
    ed.add_argument("--layer", type=int, help="--weights: the MLP layer edited (default: the middle one)")
    ed.add_argument("--json", metavar="FILE")
    ed.add_argument(
        "--cot",
        action="store_true",
        help="also decode a greedy reasoning chain from the refreshed and a clean cache",
    )
    ed.add_argument("--cot-tokens", type=int, default=48, help="longest chain (tokens)")
    ed.set_defaults(func=cmd_edit)

    co = sub.add_parser("compose", help="splice a precompiled chunk, repair the seam, compare to recompute")
    co.add_argument("--model", required=True)
    co.add_argument("--task", default="order-cancel", help="its policy+shots block is the chunk")
    co.add_argument("--n", type=int, default=4, help="prompts (each at every offset)")
    co.add_argument("--seams", default="0,1,2,4,8,16", help="chunk tokens recomputed at the seam")
    co.add_argument("--offsets", default="32,128", help="host context lengths before the chunk")
    co.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the two-hop memory-blocks experiment (split vs colocated facts)",
    )
    co.add_argument(
        "--turns",
        type=int,
        default=28,
        help="agent loop: turns of field toggles, each an erratum (0 to skip)",
    )
    co.add_argument("--seed", type=int, default=0)
    co.add_argument("--json", metavar="FILE")
    co.set_defaults(func=cmd_compose)

    rp = sub.add_parser(
        "report",
        help="the per-model report: probes, circuits, edits, compose and cost "
        "curves, as report.json and a self-contained index.html",
    )
    rp.add_argument("--model", required=True, help="gemma-3-270m, an organism, a tiny-* model, or a HF dir")
    rp.add_argument(
        "--task",
        action="append",
        help="a built-in task or a task.toml; repeat for several "
        "(default: the organism's own, else order-cancel)",
    )
    rp.add_argument("--out", required=True, metavar="DIR", help="where report.json, index.html and parts/ go")
    rp.add_argument("--quick", action="store_true", help="fewer pairs, draws and lengths: a fast look")
    rp.add_argument(
        "--fresh",
        action="store_true",
        help="recompute every part (default: reuse the parts DIR/parts holds for this model and these sizes)",
    )
    rp.add_argument("--n", type=int, help="prompt pairs for probes, circuits and edits (default 8; 6 quick)")
    rp.add_argument("--seed", type=int)
    rp.set_defaults(func=cmd_report)

    rn = sub.add_parser("render", help="re-render index.html from a report.json alone")
    rn.add_argument("report", help="a report.json, or the directory holding it")
    rn.add_argument("--out", metavar="DIR", help="where index.html goes (default: beside the report)")
    rn.set_defaults(func=cmd_render)

    da = sub.add_parser(
        "dashboard",
        help="browse the reports under some directories, and compare two side by side, in a local web page",
    )
    da.add_argument("dirs", nargs="+", metavar="DIR", help="report directories, or directories above them")
    da.add_argument("--port", type=int, default=8765)
    da.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; on another address "
        "the dashboard asks for a random access token, printed in its URL at start)",
    )
    da.add_argument(
        "--no-token",
        action="store_true",
        help="with --host: serve without an access token (anyone who reaches the address can "
        "read the reports)",
    )
    da.add_argument("--open", action="store_true", help="also open the index in a web browser")
    da.set_defaults(func=cmd_dashboard)

    b = sub.add_parser("bench", help="benchmarks: two ways side by side, with the ratio")
    bsub = b.add_subparsers(dest="bench", required=True)
    ps = bsub.add_parser("patch-sweep", help="per-slot transplant sweep: engine vs naive full forwards")
    ps.add_argument("--model", default="gemma-3-270m")
    ps.add_argument("--tokens", default="256,1024", help="comma-separated prompt lengths")
    ps.add_argument("--slots", type=int, default=64, help="how many trailing slots to sweep")
    ps.add_argument("--json", metavar="FILE")
    ps.set_defaults(func=cmd_bench_patch_sweep)
    tt = bsub.add_parser("ttft", help="time to first token: spliced precompiled chunk vs full prefill")
    tt.add_argument("--model", default="gemma-3-270m")
    tt.add_argument("--lengths", default="512,1024,2048,4096,8192", help="comma-separated total lengths")
    tt.add_argument("--seam", type=int, default=8, help="chunk tokens recomputed in context at the seam")
    tt.add_argument("--json", metavar="FILE")
    tt.set_defaults(func=cmd_bench_ttft)
    ec = bsub.add_parser(
        "edit-cost",
        help="one changed field: erratum vs suffix recompute vs full prefill, "
        "as the field moves through the prompt",
    )
    ec.add_argument("--model", default="gemma-3-270m")
    ec.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ec.add_argument("--json", metavar="FILE")
    ec.set_defaults(func=cmd_bench_edit_cost)
    return p


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
