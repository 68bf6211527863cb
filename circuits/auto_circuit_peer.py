"""auto-circuit 1.0.1 beside kvnotes' edge scores, on the same weights and the same pairs.

auto-circuit needs TransformerLens 1.19 (kvnotes runs on 3.x), so it runs from an environment of its
own (`kvnotes auto-circuit-env DIR`, `make_auto_circuit_env`): kvnotes exports the model's config and
weights (safetensors), each pair's token ids and its clean-prompt logits, and
`circuits/auto_circuit_worker.py` rebuilds the model there, checks the logits, and scores every edge
of auto-circuit's factorized graph (`kvnotes bench edges --auto-circuit-python DIR/bin/python`).

Its graph is kvnotes' residual graph summed over positions: its edge `A0.1->A2.3.Q` is every edge
`L0H1@g->L2H3@g` over the groups g (positions before the field are the same in both runs and carry
nothing); `...->A2.3.K` plus `...->A2.3.V` is `->KV2.3@g` (kvnotes' KV node is both inputs of the
slot); `Resid Start` is `EMB`, `Resid End` is `LOGIT`. Attention edges (KV slot -> reader head)
have no counterpart: auto-circuit's graph does not split a head's keys by position. Its EAP
(`mask_val=0`) is the gradient of the clean logit difference with respect to an edge mask, which is
(clean - corrupt) · grad: kvnotes' EAP score (a share of the pair's effect) times the effect. Its
integrated gradients interpolate every edge's mask together (not the input, as EAP-IG does), so the
two are compared by rank only.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from circuits.edges import RESIDUAL, EdgeGraph, edge_site, score_edges
from kvnotes.errors import BadArgument, MissingDependency
from kvnotes.metrics import spearman
from kvnotes.models.model import KVModel
from kvnotes.tasks.sampler import Pair

WORKER = Path(__file__).with_name("auto_circuit_worker.py")


def _pins() -> tuple[str, ...]:
    """What the environment installs: this machine's torch (a CPU build here), auto-circuit and the
    versions it runs with (TransformerLens 1.19 predates transformers 4.45's and datasets 3's
    changes; auto-circuit imports typeguard without declaring it)."""
    return (
        f"torch=={torch.__version__.split('+')[0]}",
        "auto_circuit==1.0.1",
        "transformer_lens==1.19.0",
        "transformers==4.44.2",
        "tokenizers<0.20",
        "datasets<3",
        "typeguard",
        "safetensors",
    )


def make_auto_circuit_env(path: str | Path) -> Path:
    """A virtual environment in `path` with auto-circuit 1.0.1; returns its python. One that already
    imports auto-circuit is kept."""
    path = Path(path).expanduser().resolve()
    python = path / "bin" / "python"
    if python.exists() and _has_auto_circuit(python):
        print(f"{path} already has auto-circuit; keeping it")
        return python
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    for cmd in ([sys.executable, "-m", "venv", str(path)], pip + [_pins()[0]], pip + list(_pins()[1:])):
        print("$ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            raise MissingDependency(f"making the auto-circuit environment failed at: {' '.join(cmd)}")
    if not _has_auto_circuit(python):
        raise MissingDependency(f"{python} was made but does not import auto_circuit")
    return python


def _has_auto_circuit(python: Path) -> bool:
    cmd = [str(python), "-c", "import auto_circuit.prune_algos.mask_gradient"]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def check_peer(model: KVModel, python: str | Path) -> Path:
    """The peer's python, after the checks that need no compute: the model is one TransformerLens 1.19
    builds (multi-head attention, none of Gemma's norms), and the python exists and imports
    auto-circuit."""
    if "transformer-lens" not in model.backend.capabilities:
        raise BadArgument(
            "the auto-circuit comparison exports a TransformerLens model: use --backend transformer-lens"
        )
    cfg = model.cfg
    unsupported = [
        what
        for what, on in (
            ("grouped-query attention", (cfg.n_key_value_heads or cfg.n_heads) != cfg.n_heads),
            ("qk-norm", getattr(cfg, "use_qk_norm", False)),
            ("norms after each sublayer", getattr(cfg, "use_normalization_before_and_after", False)),
            ("sliding-window layers", getattr(cfg, "use_local_attn", False)),
        )
        if on
    ]
    if unsupported:
        raise BadArgument(
            f"auto-circuit 1.0.1 runs on TransformerLens 1.19, which cannot build {model.name} "
            f"({', '.join(unsupported)}); compare on a model it can load, e.g. --model tiny-llama"
        )
    python = Path(python).expanduser()
    if not python.exists():
        raise BadArgument(
            f"--auto-circuit-python {python} does not exist; make the environment with "
            "`kvnotes auto-circuit-env DIR` and pass DIR/bin/python"
        )
    if not _has_auto_circuit(python):
        raise MissingDependency(
            f"{python} does not import auto_circuit; make an environment that does with "
            "`kvnotes auto-circuit-env DIR`"
        )
    return python


@dataclass(frozen=True)
class PeerPair:
    """One pair's scores on auto-circuit's edges, both tools', and what each took."""

    names: list[str]
    ours_eap: np.ndarray  # in auto-circuit's units: kvnotes' EAP share times the pair's effect
    theirs_eap: np.ndarray
    theirs_eap_cached: np.ndarray | None  # the same scores with the prefix in TransformerLens's KV cache
    ours_ig: np.ndarray
    theirs_ig: np.ndarray
    seconds: dict[str, float]
    outside: float  # the largest |EAP| auto-circuit gives an edge kvnotes' graph leaves out


def _our_names(graph: EdgeGraph) -> list[list[str]]:
    """Each residual edge's auto-circuit edge name(s): a KV reader is its K and V inputs."""
    H, B = graph.n_heads, graph.block

    def writer(w: int) -> str:
        if w == 0:
            return "Resid Start"
        l, i = divmod(w - 1, H + 1)
        return f"A{l}.{i}" if i < H else f"MLP {l}"

    def readers(r: int) -> list[str]:
        if r == graph.n_layers * B:
            return ["Resid End"]
        l, i = divmod(r, B)
        if i < H:
            return [f"A{l}.{i}.Q"]
        if i < H + graph.n_kv_heads:
            return [f"A{l}.{i - H}.K", f"A{l}.{i - H}.V"]
        return [f"MLP {l}"]

    out = []
    for k, a, b in zip(graph.kind, graph.a, graph.b):
        out.append([f"{writer(int(a))}->{r}" for r in readers(int(b))] if k == RESIDUAL else [])
    return out


def _aggregate(graph: EdgeGraph, scores: np.ndarray, names: list[list[str]]) -> dict[str, float]:
    """kvnotes' residual scores summed over position groups, keyed by auto-circuit's K+V-joined name."""
    out: dict[str, float] = {}
    for e, ns in enumerate(names):
        if ns:
            key = ns[0] if len(ns) == 1 else ns[0][:-2] + ".KV"
            out[key] = out.get(key, 0.0) + float(scores[e])
    return out


def _theirs(d: dict[str, float]) -> dict[str, float]:
    """auto-circuit's scores with each head's K and V edges joined, as kvnotes' KV node has them."""
    out: dict[str, float] = {}
    for name, v in d.items():
        key = name[:-2] + ".KV" if name.endswith((".K", ".V")) else name
        out[key] = out.get(key, 0.0) + v
    return out


def export(model: KVModel, pairs: list[Pair], folder: Path, *, samples: int, repeats: int) -> None:
    """What the worker needs, as JSON and safetensors (nothing pickled)."""
    from safetensors.torch import save_file

    from circuits.edges import groups_of

    cfg = {
        k: v for k, v in model.cfg.to_dict().items() if isinstance(v, int | float | str | bool | list | None)
    }
    pad = model.tokenizer.pad_token_id
    conf = {
        "cfg": cfg,
        "pad": -1 if pad is None else int(pad),
        "threads": torch.get_num_threads(),
        "samples": samples,
        "repeats": repeats,
    }
    (folder / "config.json").write_text(json.dumps(conf))
    state = {k: v.detach().contiguous().clone() for k, v in model.tl.named_parameters()}
    save_file(state, folder / "weights.safetensors")
    rows, ref = [], {}
    with torch.no_grad():
        for i, p in enumerate(pairs):
            a, b = (int(x) for x in p.answers)
            start, _ = groups_of(model, p)
            rows.append(
                {
                    "clean": list(p.new.ids),
                    "corrupt": list(p.old.ids),
                    "answer": a,
                    "wrong": b,
                    "start": start,
                }
            )
            ref[f"pair{i}"] = model.tl(torch.tensor([list(p.new.ids)]))[0, -1].contiguous()
    (folder / "pairs.json").write_text(json.dumps(rows))
    save_file(ref, folder / "reference.safetensors")


def run_peer(python: Path, folder: Path, timeout: float = 3600) -> dict:
    r = subprocess.run(
        [str(python), str(WORKER), str(folder)], capture_output=True, text=True, timeout=timeout
    )
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-12:]
        raise MissingDependency("the auto-circuit worker failed:\n" + "\n".join(tail))
    return json.loads((folder / "scores.json").read_text())


def compare(
    model: KVModel,
    pairs: list[Pair],
    python: str | Path,
    *,
    steps: int = 8,
    repeats: int = 3,
) -> dict:
    """Both tools' EAP and IG edge scores on auto-circuit's graph with their times, summarised as
    JSON (`peer` of the edge bench's report)."""
    return summarise(*peer_pairs(model, pairs, python, steps=steps, repeats=repeats))


def peer_pairs(
    model: KVModel,
    pairs: list[Pair],
    python: str | Path,
    *,
    steps: int = 8,
    repeats: int = 3,
) -> tuple[list[PeerPair], dict]:
    """Each pair's scores by both tools on auto-circuit's edges, and what the worker reported."""
    python = check_peer(model, python)
    with tempfile.TemporaryDirectory(prefix="kvnotes-auto-circuit-") as tmp:
        folder = Path(tmp)
        export(model, pairs, folder, samples=steps, repeats=repeats)
        peer = run_peer(python, folder)
    per: list[PeerPair] = []
    for p, theirs in zip(pairs, peer["pairs"]):
        times: dict[str, list[float]] = {"eap": [], "ig": []}
        got = {}
        for _ in range(repeats):
            for m, name in (("eap", "eap"), ("eap-ig", "ig")):
                t0 = time.perf_counter()
                site = edge_site(model, p)  # our way pays its prefill and both runs, as theirs does
                got[m] = score_edges(site, m, steps=steps)
                times[name].append(time.perf_counter() - t0)
        names = _our_names(site.graph)
        ours = {m: _aggregate(site.graph, got[m].scores * site.effect, names) for m in got}
        t_eap, t_ig = _theirs(theirs["eap-plain"]), _theirs(theirs["ig-plain"])
        keys = sorted(ours["eap"])
        if set(keys) - set(t_eap):
            raise MissingDependency(
                f"edges kvnotes has and auto-circuit lacks: {sorted(set(keys) - set(t_eap))[:5]}"
            )
        # auto-circuit's edges that kvnotes leaves out (the embeddings straight to the logit: the field
        # is not at the decision) must carry nothing
        outside = max([abs(v) for k, v in t_eap.items() if k not in ours["eap"]], default=0.0)
        secs = {f"ours-{k}": statistics.median(v) for k, v in times.items()}
        secs.update({f"theirs-{k}": v for k, v in theirs["seconds"].items()})
        per.append(
            PeerPair(
                names=keys,
                ours_eap=np.array([ours["eap"][k] for k in keys]),
                theirs_eap=np.array([t_eap[k] for k in keys]),
                theirs_eap_cached=(
                    np.array([_theirs(theirs["eap-cached"])[k] for k in keys])
                    if "eap-cached" in theirs
                    else None
                ),
                ours_ig=np.array([ours["eap-ig"][k] for k in keys]),
                theirs_ig=np.array([t_ig[k] for k in keys]),
                seconds=secs,
                outside=outside,
            )
        )
    return per, peer


def summarise(per: list[PeerPair], peer: dict) -> dict:
    """ρ between the tools per pair (median), EAP's largest difference relative to the largest
    score, and median seconds a pair for each way."""
    if not per:
        return {}

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))

    cached = [rel(p.theirs_eap_cached, p.theirs_eap) for p in per if p.theirs_eap_cached is not None]
    ways = sorted({k for p in per for k in p.seconds})
    return {
        "transformer_lens": peer["tl"],
        "parity": peer["parity"],
        "edges": len(per[0].names),
        "auto_circuit_edges": peer["n_edges"],
        "pairs": len(per),
        "eap_rho": statistics.median(spearman(p.ours_eap.tolist(), p.theirs_eap.tolist()) for p in per),
        "eap_max_rel_diff": max(rel(p.ours_eap, p.theirs_eap) for p in per),
        "cached_max_rel_diff": max(cached) if cached else None,
        "outside_max": max(p.outside for p in per),
        "ig_rho": statistics.median(spearman(p.ours_ig.tolist(), p.theirs_ig.tolist()) for p in per),
        "seconds": {w: statistics.median(p.seconds[w] for p in per if w in p.seconds) for w in ways},
        "build_s": peer["build_s"],
    }
