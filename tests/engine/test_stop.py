"""`run(..., stop=)`: a forward that ends before a later block, for reading a residual without the
blocks after it. Checked on every tiny model (rotary, partial and GPT-J rotary, GQA, sliding
windows, learned positions, attention-only): the residual it reads and the K/V it writes are the
full run's, bit for bit (the blocks below `stop` run the same kernels on the same inputs whether or
not later blocks follow); a notebook it writes serves runs that stop there and is refused by any
run that reads further; it runs exactly `stop` blocks."""

from __future__ import annotations

import pytest
import torch

from kvnotes.engine import Capability, has, run, stop_for
from kvnotes.errors import BadArgument, OutOfRange, ShapeMismatch
from kvnotes.notebook import Notebook


def _resid(stop: int) -> str:
    return f"blocks.{stop - 1}.hook_resid_post"


def _stops(model) -> list[int]:
    return sorted({1, max(1, model.n_layers // 2), model.n_layers - 1} - {0}) if model.n_layers > 1 else []


def test_a_run_that_stops_reads_and_writes_what_the_full_run_does(case):
    model, ids = case.model, case.ids
    assert has(model, Capability.STOP)
    for stop in _stops(model):
        name = _resid(stop)
        full_nb, full = run(model, Notebook.empty(model), ids, capture=[name], logits_at=())
        nb, out = run(model, Notebook.empty(model), ids, capture=[name], stop=stop)
        # exact: the same kernels on the same inputs; the later blocks never feed the earlier ones
        assert torch.equal(out.activations[name], full.activations[name]), (model.name, stop)
        assert nb.n_layers == stop and out.logits.shape[1] == 0
        for layer in range(stop):
            assert torch.equal(nb.keys[layer], full_nb.keys[layer])  # exact: as above
            assert torch.equal(nb.values[layer], full_nb.values[layer])  # exact: as above


def test_a_notebook_written_by_a_stopped_run_serves_runs_that_stop_there(case):
    """The residual collection's pattern: the prefix once, then the rest against it, both stopped."""
    model, ids, cut = case.model, case.ids, case.field
    for stop in _stops(model):
        name = _resid(stop)
        full_nb, _ = run(model, Notebook.empty(model), ids[:cut], logits_at=())
        _, full = run(model, full_nb, ids[cut:], capture=[name], logits_at=())
        nb, _ = run(model, Notebook.empty(model), ids[:cut], stop=stop)
        _, out = run(model, nb, ids[cut:], capture=[name], stop=stop)
        assert torch.equal(out.activations[name], full.activations[name]), (
            model.name,
            stop,
        )  # exact: as above
        with pytest.raises(
            ShapeMismatch, match=f"holds the first {stop} of .* run it with stop={stop} or less"
        ):
            run(model, nb, ids[cut:])  # a full run reads layers this notebook does not hold


def test_it_runs_exactly_stop_blocks(case):
    model, ids = case.model, case.ids
    for stop in _stops(model):
        fired: list[str] = []

        def note(x, hook, fired=fired):
            fired.append(hook.name)

        run(
            model,
            Notebook.empty(model),
            ids,
            hooks=[(lambda n: n.endswith("hook_resid_pre"), note)],
            stop=stop,
        )
        assert fired == [f"blocks.{layer}.hook_resid_pre" for layer in range(stop)]


def test_what_a_stopped_run_cannot_do_is_refused_before_any_compute(case):
    model, ids = case.model, case.ids
    n = model.n_layers
    empty = Notebook.empty(model)
    for bad in (0, n + 1):
        with pytest.raises(OutOfRange, match=f"stop={bad} is outside 1..{n}"):
            run(model, empty, ids, stop=bad)
    if n < 2:
        return
    with pytest.raises(BadArgument, match="has no logits: pass logits_at=()"):
        run(model, empty, ids, stop=1, logits_at=[len(ids) - 1])
    with pytest.raises(BadArgument, match="never reached by a run that stops at block 1"):
        run(model, empty, ids, stop=1, capture=["blocks.1.hook_resid_pre"])
    with pytest.raises(BadArgument, match="never reached"):
        run(model, empty, ids, stop=1, capture=["ln_final.hook_normalized"])
    assert run(model, empty, ids, stop=n)[1].logits.shape[1] == 1  # stop=n is the whole forward


def test_stop_for_names_the_least_stop_that_reaches_every_point(case):
    model = case.model
    last = model.n_layers - 1
    assert stop_for(model, ["blocks.0.hook_resid_post"]) == (1 if last else None)
    assert stop_for(model, [f"blocks.{last}.hook_resid_post"]) is None  # nothing to save
    assert stop_for(model, ["blocks.0.hook_resid_post", "ln_final.hook_normalized"]) is None
