"""auto-circuit 1.0.1 beside kvnotes' edge scores, on the same weights and the same pairs.

auto-circuit needs TransformerLens 1.19 (kvnotes runs on 3.x), so it runs from an environment of its
own (`kvnotes auto-circuit-env DIR`, `make_auto_circuit_env`): kvnotes exports the model's config and
weights (safetensors), each pair's token ids and its clean-prompt logits, and
`circuits/auto_circuit_worker.py` rebuilds the model there, checks the logits, and scores every edge
of auto-circuit's factorized graph (`kvnotes bench edges --auto-circuit-python DIR/bin/python`).

Its graph without positions is kvnotes' residual graph summed over positions: its edge
`A0.1->A2.3.Q` is every edge `L0H1@g->L2H3@g` over the groups g (positions before the field are the
same in both runs and carry nothing); `...->A2.3.K` plus `...->A2.3.V` is `->KV2.3@g` (kvnotes' KV
node is both inputs of the slot); `Resid Start` is `EMB`, `Resid End` is `LOGIT`. With positions
(`patchable_model(..., seq_len=...)`, the prompt's length: one graph per length) its edge
`A0.1->A2.3.Q@p` is kvnotes' `L0H1->L2H3` term at prompt position p
(`circuits.edges.positions.position_scores`), compared edge by edge; it also has edges at the
positions before the field, where kvnotes has none, and those must score ~0 there (the two prompts
are the same there, so the writers' changes are 0).

What cannot be compared, at any level:
- attention edges (KV slot at a key group -> head at a query group): auto-circuit's graph patches a
  head's K and V inputs at the key's own position for every query at once; it does not split a
  head's keys by position as read from each query position;
- integrated gradients: auto-circuit's interpolates every edge mask together from 0 to 1, kvnotes'
  EAP-IG the field's embeddings from old to new (Hanna et al.): different estimators, compared by
  rank only;
- models TransformerLens 1.19 cannot build (grouped-query attention, qk-norm, norms after each
  sublayer, sliding windows: Gemma 3): `check_peer` refuses them before any compute.

Its EAP (`mask_val=0`) is the gradient of the clean logit difference with respect to an edge mask,
which is (clean - corrupt) · grad: kvnotes' EAP score (a share of the pair's effect) times the effect.
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

from circuits.edges import RESIDUAL, EdgeGraph, EdgePatcher, edge_patcher, score_edges
from circuits.edges.positions import position_edges, position_scores
from kvnotes.engine import Capability, hooked, require
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
    require(model, Capability.TRANSFORMER_LENS, "the auto-circuit comparison (it exports TransformerLens)")
    cfg = hooked(model, "the auto-circuit comparison").cfg
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
    # per token position: kvnotes' residual edges at each position from the field on (K+V joined)
    ours_pos: np.ndarray  # auto-circuit's units, as ours_eap
    theirs_pos: np.ndarray
    prefix_pos: float  # the largest |EAP| auto-circuit gives an edge before the field (kvnotes: none)
    outside_pos: float  # and one from the field on that kvnotes' graph leaves out


def _writer_name(graph: EdgeGraph, w: int) -> str:
    if w == 0:
        return "Resid Start"
    l, i = divmod(w - 1, graph.n_heads + 1)
    return f"A{l}.{i}" if i < graph.n_heads else f"MLP {l}"


def _reader_names(graph: EdgeGraph, r: int) -> list[str]:
    """auto-circuit's destination(s) of a reader: a KV reader is its K and V inputs."""
    H = graph.n_heads
    if r == graph.n_layers * graph.block:
        return ["Resid End"]
    l, i = divmod(r, graph.block)
    if i < H:
        return [f"A{l}.{i}.Q"]
    if i < H + graph.n_kv_heads:
        return [f"A{l}.{i - H}.K", f"A{l}.{i - H}.V"]
    return [f"MLP {l}"]


def _our_names(graph: EdgeGraph) -> list[list[str]]:
    """Each residual edge's auto-circuit edge name(s): a KV reader is its K and V inputs."""
    return [
        [f"{_writer_name(graph, int(a))}->{r}" for r in _reader_names(graph, int(b))] if k == RESIDUAL else []
        for k, a, b in zip(graph.kind, graph.a, graph.b)
    ]


def _joined(name: str) -> str:
    """An auto-circuit edge name with a head's K or V input as kvnotes' KV node (`.KV`); a position
    suffix (`@p`) stays."""
    edge, at, pos = name.partition("@")
    return (edge[:-2] + ".KV" if edge.endswith((".K", ".V")) else edge) + at + pos


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
        key = _joined(name)
        out[key] = out.get(key, 0.0) + v
    return out


def _per_position(
    site: EdgePatcher, ours: np.ndarray, theirs: dict[str, float]
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """kvnotes' per-position residual scores (`position_scores` times the effect) and auto-circuit's
    on the same edges (`NAME@POSITION`, K+V joined), with the largest |EAP| auto-circuit gives an
    edge before the field and one from the field on that kvnotes' graph leaves out."""
    gr, t_pos = site.graph, _theirs(theirs)
    keys, mine = [], []
    for r, w, t in zip(*np.nonzero(position_edges(site))):
        keys.append(f"{_writer_name(gr, int(w))}->{_joined(_reader_names(gr, int(r))[0])}@{int(site.pos[t])}")
        mine.append(ours[r, w, t])
    if missing := [k for k in keys if k not in t_pos]:
        raise MissingDependency(f"per-position edges kvnotes has and auto-circuit lacks: {missing[:5]}")
    start, used = int(site.pos[0]), set(keys)
    rest = [(int(k.rpartition("@")[2]), abs(v)) for k, v in t_pos.items() if k not in used]
    prefix = max([v for p, v in rest if p < start], default=0.0)
    outside = max([v for p, v in rest if p >= start], default=0.0)
    return np.array(mine), np.array([t_pos[k] for k in keys]), prefix, outside


def export(model: KVModel, pairs: list[Pair], folder: Path, *, samples: int, repeats: int) -> None:
    """What the worker needs, as JSON and safetensors (nothing pickled)."""
    from safetensors.torch import save_file

    from circuits.edges import groups_of

    cfg = {
        k: v
        for k, v in hooked(model).cfg.to_dict().items()
        if isinstance(v, int | float | str | bool | list | None)
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
    state = {k: v.detach().contiguous().clone() for k, v in hooked(model).named_parameters()}
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
            ref[f"pair{i}"] = hooked(model)(torch.tensor([list(p.new.ids)]))[0, -1].contiguous()
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
        ways = {
            "eap": lambda site: score_edges(site, "eap").scores,
            "ig": lambda site: score_edges(site, "eap-ig", steps=steps).scores,
            "eap-positions": position_scores,
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        got = {}
        for _ in range(repeats):
            for name, way in ways.items():
                t0 = time.perf_counter()
                site = edge_patcher(model, p)  # our way pays its prefill and both runs, as theirs does
                got[name] = way(site)
                times[name].append(time.perf_counter() - t0)
        names = _our_names(site.graph)
        ours = {m: _aggregate(site.graph, got[m] * site.effect, names) for m in ("eap", "ig")}
        pos = _per_position(site, got["eap-positions"] * site.effect, theirs["eap-positions"])
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
                ours_ig=np.array([ours["ig"][k] for k in keys]),
                theirs_ig=np.array([t_ig[k] for k in keys]),
                seconds=secs,
                outside=outside,
                ours_pos=pos[0],
                theirs_pos=pos[1],
                prefix_pos=pos[2],
                outside_pos=pos[3],
            )
        )
    return per, peer


def summarise(per: list[PeerPair], peer: dict) -> dict:
    """ρ between the tools per pair (median), EAP's largest difference relative to the largest
    score, and median seconds a pair for each way; the same for EAP per token position
    (`positions`)."""
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
        "positions": {
            "edges": [len(p.ours_pos) for p in per],
            "auto_circuit_edges": [int(n) for n in peer["n_edges_positions"].values()],
            "eap_rho": statistics.median(spearman(p.ours_pos.tolist(), p.theirs_pos.tolist()) for p in per),
            "eap_max_rel_diff": max(rel(p.ours_pos, p.theirs_pos) for p in per),
            "prefix_max": max(p.prefix_pos for p in per),
            "outside_max": max(p.outside_pos for p in per),
            "build_s": peer["build_positions_s"],
        },
    }
