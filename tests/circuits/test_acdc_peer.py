"""The plain TransformerLens way of edge patching (`circuits.acdc_peer`), the other side of
`kvnotes bench acdc`: it must patch what the notebook patches, on every architecture the edge graph
supports, so that ACDC makes the same decisions both ways; and the bench must say so."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import circuits.acdc_peer as P
import circuits.edges as E
from circuits.edges.acdc import acdc
from kvnotes.cli import main
from kvnotes.tasks import load_task
from kvnotes.tasks.sampler import sample
from kvnotes.zoo import load_model

# Two float32 forwards of the same patch through different code (the notebook's engine and
# TransformerLens' own blocks, the prefix recomputed) round apart: measured at most 7e-7 logits on
# the tiny models (3.7e-5 on Gemma 3 270M's IOI pairs, 18 layers); allowed 1e-5.
LOGITS = 1e-5
TINY = ["tiny-llama", "tiny-gqa", "tiny-gemma3", "tiny-gemma2", "tiny-neox", "tiny-gptj", "tiny-gpt2"]


def _site(name: str):
    m = load_model(name)
    task = "mixed-organism" if name.startswith("mixed") else "order-cancel"
    pairs = sample(load_task(task), m, 4, seed=0)
    return max((E.edge_patcher(m, p) for p in pairs), key=lambda s: abs(s.effect))


def _circuits(graph, seed: int = 0) -> np.ndarray:
    """Every edge in and none; random circuits at several densities; attention edges alone removed;
    residual edges alone removed."""
    rng = np.random.default_rng(seed)
    n, att = len(graph), graph.kind == E.ATTENTION
    rows = [np.ones(n, bool), np.zeros(n, bool)] + [rng.random(n) < f for f in (0.99, 0.9, 0.5)]
    rows.append(~(att & (rng.random(n) < 0.5)))
    rows.append(~(~att & (rng.random(n) < 0.3)))
    return np.array(rows)


def _largest_gap(site) -> float:
    rows = _circuits(site.graph)
    tl = P.TLEdgePatch(site)
    assert tl.ld_old == pytest.approx(site.ld_old, abs=LOGITS) and tl.ld_new == pytest.approx(
        site.ld_new, abs=LOGITS
    )
    return float(np.abs(site.patch(rows) - tl.patch(rows)).max() * abs(site.effect))


@pytest.mark.parametrize("name", [*TINY, "mixed-organism-75"])
def test_the_transformer_lens_way_patches_what_the_notebook_patches(name):
    assert _largest_gap(_site(name)) <= LOGITS


def test_a_head_mix_after_the_norm_after_attention_fails(monkeypatch):
    """Planted: each head's change summed after the norm Gemma applies to attention's output,
    instead of the heads mixed before it. tiny-gemma3's patch moves."""

    def summed(self, l, mh):
        blk, live = self.w.net.blocks[l], self.heads[l]
        per = live + mh.transpose(1, 2)[..., None] * (self.w.old.heads[l] - live)
        return (blk.ln1_post(per) - blk.ln1_post(live)).sum(2)

    site = _site("tiny-gemma3")
    monkeypatch.setattr(P._Live, "_heads_change", summed)
    assert _largest_gap(site) > 100 * LOGITS


def test_attention_edges_left_out_fail(monkeypatch):
    """Planted: a removed attention edge changes nothing (the head keeps the new keys and values)."""
    site = _site("tiny-gqa")
    monkeypatch.setattr(P._Live, "_attention_mask", lambda self, l: torch.zeros(1, dtype=torch.bool))
    assert _largest_gap(site) > 100 * LOGITS


@pytest.mark.parametrize("name", ["mixed-organism-25", "tracr-dyck"])
def test_acdc_decides_every_edge_alike_both_ways(name):
    if name.startswith("tracr"):
        pytest.importorskip("tracr")
        from kvnotes.zoo.tracr import load_tracr, pairs

        m = load_tracr(name)
        sites = [E.edge_patcher(m, p) for p in pairs(m, 2, seed=0)]
    else:
        m = load_model(name)
        sites = [E.edge_patcher(m, p) for p in sample(load_task("mixed-organism"), m, 2, seed=1)]
    ways = [P.TLEdgePatch(s) for s in sites]
    for tau in (0.03,) if name.startswith("tracr") else (0.01, 0.1):  # tracr: one, its runs are the long ones
        a, b = acdc(sites, tau), acdc(ways, tau)
        assert a.forwards == b.forwards and 0 < a.size < len(sites[0].graph)  # pruned, not everything
        assert np.array_equal(a.kept, b.kept)
        assert abs(a.recovery - b.recovery) * min(abs(s.effect) for s in sites) <= LOGITS


def test_the_bench_prints_both_ways_and_refuses_a_zero_threshold(tmp_path, capsys):
    out = tmp_path / "acdc.json"
    args = ["bench", "acdc", "--model", "mixed-organism-25", "--n", "2"]
    assert main([*args, "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TL/notebook" in printed and "decided every edge alike" in printed
    (point,) = json.loads(out.read_text())["results"]
    assert point["differ"] == 0 and point["kept"] == point["tl_kept"] == 14  # the designed circuit
    assert point["ratio"] == pytest.approx(point["tl_s"] / point["notebook_s"], rel=1e-9)
    with pytest.raises(SystemExit) as bad:
        main([*args, "--taus", "0"])
    assert bad.value.code == 2 and "taus" in capsys.readouterr().err
