"""auto-circuit's side of `kvnotes bench edges --auto-circuit-python PY`: run by PY (an environment of
its own, `kvnotes auto-circuit-env DIR`), it imports only torch, TransformerLens 1.19 and auto-circuit
1.0.1, never kvnotes (which needs TransformerLens 3).

    PY circuits/auto_circuit_worker.py DIR

DIR holds what kvnotes exported: `config.json` (the HookedTransformerConfig fields, the thread count,
the IG samples and the repeats), `weights.safetensors` (the state dict), `pairs.json` (each pair's
clean and corrupt token ids, its answer and wrong answer, where the prompts diverge) and
`reference.safetensors` (kvnotes' logits of each clean prompt at its last position). The worker
rebuilds the model, refuses to go on unless its logits match the reference, then scores every edge
of auto-circuit's factorized graph on each pair: edge attribution patching (`mask_val=0`, its EAP)
and its integrated gradients over the edge masks (`integrated_grad_samples`), each timed `repeats`
times, both as a plain run over the whole prompt and with the shared prefix in a frozen
TransformerLens KV cache (auto-circuit's `kv_cache`/`diverge_idx`: the strongest way it offers).
Then EAP once more on a graph with an edge per token position (`patchable_model(..., seq_len=...)`,
the prompt's length: one graph per length among the pairs, whose two prompts must be aligned), plain,
for kvnotes' per-position residual edges. That graph still has no edge from a key position to a query position
(a head's K and V inputs are patched at the key's own position, not as read by each query), so
kvnotes' attention edges have no counterpart at any level; nor is its integrated gradients one
(it interpolates every edge mask together, kvnotes' EAP-IG the field's embeddings). It writes
`scores.json`: per pair, its scores by edge name (`eap-plain`, ...) and, per position,
`eap-positions` by `NAME@POSITION` (the prompt position).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

PARITY_TOL = 1e-3  # float32 logits of two TransformerLens versions over the same weights


def _config(cfg: dict):
    """The peer's HookedTransformerConfig from kvnotes' (TransformerLens 3) fields: the ones this
    version knows, less what it derives itself; the logits' parity check says whether that was all."""
    import dataclasses

    from transformer_lens import HookedTransformerConfig

    known = {f.name for f in dataclasses.fields(HookedTransformerConfig) if f.init}
    derived = {
        "n_params",
        "device",
        "dtype",
        "n_devices",
        "tokenizer_name",
        "checkpoint_index",
        "checkpoint_value",
    }
    return HookedTransformerConfig(**{k: v for k, v in cfg.items() if k in known and k not in derived})


def _model(cfg: dict, weights: dict, tokenizer):
    from transformer_lens import HookedTransformer

    model = HookedTransformer(_config(cfg), move_to_device=False)
    model.tokenizer = tokenizer
    # parameters only: buffers (the causal mask, RoPE tables) are rebuilt from the config
    wanted = {name for name, _ in model.named_parameters()}
    if wanted - set(weights) or set(weights) - wanted:
        raise SystemExit(
            f"auto-circuit worker: the exported weights do not fit TransformerLens {_tl_version()}'s model: "
            f"missing {sorted(wanted - set(weights))[:4]}, unexpected {sorted(set(weights) - wanted)[:4]}"
        )
    model.load_state_dict(weights, strict=False)
    model.eval()
    model.set_use_attn_result(True)
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    return model


def _check_parity(model, pairs: list[dict], reference) -> float:
    import torch

    worst = 0.0
    with torch.no_grad():
        for i, p in enumerate(pairs):
            got = model(torch.tensor([p["clean"]]))[0, -1]
            want = reference[f"pair{i}"]
            worst = max(worst, float((got - want).abs().max()))
    if worst > PARITY_TOL:
        raise SystemExit(
            f"auto-circuit worker: TransformerLens {_tl_version()} gives logits {worst:.2e} away from "
            f"kvnotes' on the same weights (tolerance {PARITY_TOL}); this model does not load the same "
            "way in both, so no comparison is made"
        )
    return worst


def _tl_version() -> str:
    from importlib.metadata import version

    return version("transformer_lens")


def _loader(p: dict, cache=None, seq_len: int | None = None):
    """One pair as auto-circuit's loader: from the divergence on when the prefix is in `cache`;
    `seq_len` (the prompt's length) for a graph with token positions."""
    import torch
    from auto_circuit.data import PromptDataLoader, PromptDataset

    start = p["start"] if cache is not None else 0
    ds = PromptDataset(
        [torch.tensor(p["clean"][start:])],
        [torch.tensor(p["corrupt"][start:])],
        [torch.tensor([p["answer"]])],
        [torch.tensor([p["wrong"]])],
    )
    return PromptDataLoader(ds, seq_len=seq_len, diverge_idx=start, kv_cache=cache, batch_size=1)


def _prefix_cache(net, p: dict):
    import torch
    from transformer_lens.past_key_value_caching import HookedTransformerKeyValueCache

    cache = HookedTransformerKeyValueCache.init_cache(net.cfg, net.cfg.device, 1)
    with torch.no_grad():
        net(torch.tensor([p["clean"][: p["start"]]]), past_kv_cache=cache)
    cache.freeze()
    return cache


def _positions(pm, loader) -> dict[str, float]:
    """EAP of every edge at every token position, keyed `NAME@POSITION`."""
    ps = _prune_scores(pm, loader, None)
    return {f"{e.name}@{e.seq_idx}": float(ps[e.dest.module_name][e.patch_idx]) for e in pm.edges}


def _scores(pm, loader, samples: int | None) -> dict[str, float]:
    ps = _prune_scores(pm, loader, samples)
    return {e.name: float(ps[e.dest.module_name][e.patch_idx]) for e in pm.edges}


def _prune_scores(pm, loader, samples: int | None):
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores

    return mask_gradient_prune_scores(
        pm,
        loader,
        None,
        grad_function="logit",
        answer_function="avg_diff",
        mask_val=None if samples else 0.0,
        integrated_grad_samples=samples,
    )


def main(folder: str) -> None:
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from auto_circuit.utils.graph_utils import patchable_model
    from safetensors.torch import load_file

    root = Path(folder)
    conf = json.loads((root / "config.json").read_text())
    torch.set_num_threads(conf["threads"])
    pairs = json.loads((root / "pairs.json").read_text())
    weights = load_file(root / "weights.safetensors")
    # the prompts arrive as token ids; TransformerLens's KV-cache path reads only the tokenizer's pad
    # id and padding side (its attention mask), so that is all the model is given
    tokenizer = SimpleNamespace(pad_token_id=conf["pad"], padding_side="right")
    model = _model(conf["cfg"], weights, tokenizer)
    worst = _check_parity(model, pairs, load_file(root / "reference.safetensors"))
    t0 = time.perf_counter()
    pm = patchable_model(model, factorized=True, slice_output="last_seq", separate_qkv=True)
    build_s = time.perf_counter() - t0
    out: dict = {"parity": worst, "build_s": build_s, "tl": _tl_version(), "pairs": []}
    out["n_edges"] = len(pm.edges)
    samples = conf["samples"]
    for p in pairs:
        if len(p["clean"]) != len(p["corrupt"]):
            raise SystemExit(
                f"auto-circuit worker: a pair's prompts have {len(p['clean'])} and {len(p['corrupt'])} "
                "tokens; a graph with token positions needs aligned prompts"
            )
    # its graph with an edge per position, one per prompt length (`seq_len` fixes the masks' shape),
    # each on a model of its own, as a patchable model wraps its model in place
    t0 = time.perf_counter()
    lengths = sorted({len(p["clean"]) for p in pairs})
    by_len = {
        n: patchable_model(
            _model(conf["cfg"], weights, tokenizer),
            factorized=True,
            slice_output="last_seq",
            seq_len=n,
            separate_qkv=True,
        )
        for n in lengths
    }
    out["build_positions_s"] = (time.perf_counter() - t0) / max(len(lengths), 1)
    out["n_edges_positions"] = {str(n): len(pm.edges) for n, pm in by_len.items()}
    for p in pairs:
        row: dict = {"seconds": {}}
        for way in ("plain", "cached"):
            if way == "cached" and p["start"] < 1:
                continue
            if way == "cached":
                # a patchable model holds its KV caches from the start, so each prefix needs its own:
                # the prefix's prefill and that wrapping are this way's cost per pair, added to its time
                fresh = _model(conf["cfg"], weights, tokenizer)
                t0 = time.perf_counter()
                cache = _prefix_cache(fresh, p)
                scorer = patchable_model(
                    fresh, factorized=True, slice_output="last_seq", separate_qkv=True, kv_caches=(cache,)
                )
                prep = time.perf_counter() - t0
            else:
                cache, scorer, prep = None, pm, 0.0
            for name, k in (("eap", None), ("ig", samples)):
                times = []
                for _ in range(conf["repeats"]):
                    loader = _loader(p, cache)
                    t0 = time.perf_counter()
                    got = _scores(scorer, loader, k)
                    times.append(time.perf_counter() - t0)
                row["seconds"][f"{name}-{way}"] = statistics.median(times) + prep
                row.setdefault(f"{name}-{way}", got)
        times = []
        for _ in range(conf["repeats"]):
            loader = _loader(p, seq_len=len(p["clean"]))
            t0 = time.perf_counter()
            got = _positions(by_len[len(p["clean"])], loader)
            times.append(time.perf_counter() - t0)
        row["seconds"]["eap-positions"] = statistics.median(times)
        row["eap-positions"] = got
        out["pairs"].append(row)
    (root / "scores.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
