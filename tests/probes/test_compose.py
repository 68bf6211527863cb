"""Seam repair: recomputing the whole chunk at the seam is full recompute; skipping re-rotation hurts."""

from __future__ import annotations

import json

from kvnotes.cli import main
from kvnotes.tasks import load_task, sample
from probes.agent import agent_loop
from probes.compose import chunk_end, seam_repair
from tests.helpers import get_model


def test_full_seam_equals_recompute_and_no_rerotation_is_worse():
    model = get_model("tiny-gemma3")
    p = sample(load_task("order-cancel"), model, 1)[0].old
    whole = chunk_end(p, "order_status") - 1
    r = seam_repair(model, "order-cancel", n=2, seams=[0, whole], offsets=[24], progress=False)
    assert all(abs(c - 1.0) < 1e-6 for c in r[f"cosine@{whole}"].values)
    # exact: fractions of agreeing decisions
    assert r[f"agree@{whole}"].mean == 1.0 and r[f"top1@{whole}"].mean == 1.0
    # without re-rotation the chunk's keys sit at the wrong angles: visibly further from recompute
    assert r["norot_cosine@0"].mean < r["cosine@0"].mean - 1e-3


def test_cli_compose(tmp_path):
    out = tmp_path / "compose.json"
    rc = main(
        [
            "compose",
            "--model",
            "tiny-llama",
            "--n",
            "1",
            "--seams",
            "0,2",
            "--offsets",
            "16",
            "--turns",
            "3",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    probes = json.loads(out.read_text())["results"]
    d = probes["seam_repair"]
    assert d["headline"] == "cosine@2" and len(d["values"]) == 1
    assert {"cosine@3", "agree@3", "follows"} <= set(probes["agent_loop"])


def test_agent_loop_with_a_full_seam_is_exact_every_turn():
    model = get_model("tiny-llama")
    p = sample(load_task("order-cancel"), model, 1)[0].old
    r = agent_loop(model, "order-cancel", n=1, turns=5, seam=chunk_end(p, "order_status") - 1, progress=False)
    for turn in range(1, 6):
        # exact: a fraction of agreeing decisions
        assert abs(r[f"cosine@{turn}"].mean - 1.0) < 1e-9 and r[f"agree@{turn}"].mean == 1.0
    assert r["follows"].n == 5


def test_memory_blocks_with_a_full_seam_are_exact():
    from probes.memory import memory_blocks

    r = memory_blocks(get_model("tiny-gqa"), n=2, seam=10_000, progress=False)
    # exact: fractions of agreeing decisions
    assert r["colocated_agree"].mean == 1.0 and r["split_agree"].mean == 1.0
    assert all(abs(c - 1.0) < 1e-6 for c in r["colocated_cosine"].values + r["split_cosine"].values)
