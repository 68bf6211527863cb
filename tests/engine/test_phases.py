"""`kvnotes.engine.phases`: off, a phase mark is the one shared no-op; on, an engine call's wall
time is split by the phases it marks, each into operators and the rest, and operators run outside
every phase are counted apart."""

from __future__ import annotations

import torch

from kvnotes import load_model
from kvnotes.engine import phases as ph
from kvnotes.ops import Patch, decide_patched, prefill

# the profiler's and the clock's readings of one run differ by their own overheads: microseconds a call
SLACK = 1e-3


def test_off_a_mark_is_the_shared_no_op():
    assert ph.phase("attention") is ph.phase("mlp") is ph._NULL


def test_a_patched_decision_is_split_by_its_phases():
    model = load_model("tiny-llama")
    old, new = prefill(model, "The order is pending. Deny?"), prefill(model, "The order is shipped. Deny?")
    prompt = model.encode(" Deny?", bos=False)
    specs = [Patch(positions=(p,)) for p in range(1, 5)]
    r = ph.phases(lambda: decide_patched(model, old, new, specs, prompt))
    names = {p.name for p in r.phases}
    assert {"plan", "overlay", "slots", "attention", "mlp", "readout"} <= names <= set(ph.PHASES)
    for p in r.phases:
        assert 0 <= p.ops <= p.seconds + SLACK and p.calls >= 1, p
    layers = model.facts.n_layers
    by = {p.name: p for p in r.phases}
    assert by["attention"].calls == by["mlp"].calls and by["mlp"].calls % layers == 0
    assert sum(p.seconds for p in r.phases) <= r.wall + SLACK
    assert ph.phase("mlp") is ph._NULL  # off again after the run


def test_operators_outside_every_phase_are_counted_apart():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    r = ph.phases(lambda: [a @ b for _ in range(20)])
    assert r.phases == () and 0 < r.ops_outside <= r.wall + SLACK
    assert r.rows()[-1][0] == "(outside the phases)"
