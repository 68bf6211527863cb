"""What stopping at the block it reads saves the SAE section's residual collection: `collect_residuals`
with its runs stopped after the SAE's block (the default) and through every block, side by side in
one process, on the same prompt pairs; median of `--repeats`, with the ratio, and a check that the
two read the same residuals bit for bit.

    python scripts/residual_stop.py [--model gemma-3-270m] [--pairs 8] [--layer L] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from circuits.sae import collect_residuals  # noqa: E402
from kvnotes.analysis.bench_report import machine  # noqa: E402
from kvnotes.engine import stop_for  # noqa: E402
from kvnotes.hooks import hook_name  # noqa: E402
from kvnotes.tasks import load_task  # noqa: E402
from kvnotes.tasks.sampler import sample  # noqa: E402
from kvnotes.zoo import default_task, load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument(
        "--layer", type=int, default=None, help="the block read (default: the SAE's, the middle one)"
    )
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    model = load_model(args.model)
    layer = model.n_layers // 2 if args.layer is None else args.layer
    name = hook_name(layer, "hook_resid_post")
    pairs = sample(load_task(default_task(model.name)), model, args.pairs, seed=1000)
    tokens = sum(len(pr.old.ids) + len(pr.new.ids) for pr in pairs) / (2 * len(pairs))
    times: dict[bool, list[float]] = {True: [], False: []}
    got = {}
    for _ in range(args.repeats):
        for early in (True, False):  # interleaved, so drift in the machine's speed hits both
            t0 = time.perf_counter()
            got[early] = collect_residuals(model, pairs, name, stop_early=early, progress=False)
            times[early].append(time.perf_counter() - t0)
    same = all(
        torch.equal(a, b)  # exact: the blocks below the stop run the same kernels on the same inputs
        for a, b in zip(got[True].vectors + got[True].context, got[False].vectors + got[False].context)
    )
    stop = stop_for(model, [name])
    stopped, every = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{machine()}; {model.name}, {len(pairs)} pairs of ~{tokens:.0f} tokens, "
        f"block {layer} of {model.n_layers}"
    )
    print(f"  stopped after block {layer} (stop={stop}): {stopped:.3f} s  (median of {args.repeats})")
    print(f"  every block:                       {every:.3f} s")
    print(
        f"  every block / stopped: {every / stopped:.2f}x; "
        f"blocks run {model.n_layers} / {stop or model.n_layers}"
    )
    print(f"  same residuals, bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
