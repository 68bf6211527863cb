"""The model organisms: they learn their tasks, and their known answers come out of the engine.

notes-organism's decision cannot see the gating field (every layer is local and the field lies
outside the decision's window), so a field-only refresh recovers nothing and a transplant of the
downstream slots recovers everything; lookup-organism (one global layer) is the reverse.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvnotes import Patch, decide, decide_patched, logit_diff, patch, prefill, recovery, refresh, verify
from kvnotes.errors import OrganismNotConverged
from kvnotes.tasks import GATE, RULE, load_task, sample
from kvnotes.zoo import builtin_names, load_model, organisms
from kvnotes.zoo.organisms import (
    ORGANISMS,
    SEED_TRIES,
    OrganismConfig,
    cache_path,
    check_prompt,
    load_organism,
    organism_metrics,
)

NAMES = tuple(ORGANISMS)
KINDS = (GATE, RULE)


@pytest.fixture(scope="module", params=NAMES)
def organism(request):
    return request.getfixturevalue(request.param.replace("-", "_"))


# --- they load and are exact under the engine ------------------------------------------------
def test_organisms_are_builtin_models(notes_organism, lookup_organism):
    assert {"notes-organism", "lookup-organism"} <= set(builtin_names())
    assert notes_organism.n_layers == 3 and all(notes_organism.window(l) == 8 for l in range(3))
    assert lookup_organism.n_layers == 1 and lookup_organism.window(0) is None
    for m in (notes_organism, lookup_organism):
        assert load_task(m.name).model == m.name
        metrics = organism_metrics(m.name)  # None only where the cache directory is not writable
        # exact: a fraction of correct answers
        assert metrics is None or (metrics["converged"] and metrics["heldout_accuracy"] == 1.0)


def test_verify_passes(organism):
    report = verify(organism, progress=False)
    assert report.passed, report.table()


# --- they learned the task -------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_heldout_accuracy(organism, kind):
    """Both prompts of each fresh pair answered right (argmax over the two answers), and the
    answer logit difference moves a long way between them."""
    pairs = sample(load_task(organism.name), organism, 100, seed=7, kind=kind)
    right, moves = 0, []
    for pair in pairs:
        lds = []
        for prompt, expected in zip((pair.old, pair.new), pair.expected):
            out = decide(organism, prefill(organism, prompt), prompt, vocab=pair.answers).last[0]
            right += int(int(out.argmax()) == expected)
            lds.append(float(out[0] - out[1]))
        moves.append(abs(lds[1] - lds[0]))
    accuracy = right / (2 * len(pairs))
    assert accuracy >= 0.99, f"{organism.name} {kind}: held-out accuracy {accuracy:.3f}"
    assert min(moves) > 4.0, f"{organism.name} {kind}: the logit difference moves only {min(moves):.2f}"


# --- the known answers -----------------------------------------------------------------------
def _recoveries(model, kind: str, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: recovery of a field-only refresh and of a transplant of every downstream slot."""
    refreshed, transplanted = [], []
    for pair in sample(load_task(model.name), model, n, seed=3, kind=kind):
        a, b = pair.answers
        nb_old, nb_new = prefill(model, pair.old), prefill(model, pair.new)

        def ld(nb, a=a, b=b, pair=pair):
            return logit_diff(decide(model, nb, pair.new).last[0], a, b)

        old, new = ld(nb_old), ld(nb_new)
        refreshed.append(recovery(ld(refresh(model, nb_old, pair.new, pair.changed)), old, new))
        notes = patch(nb_old, nb_new, Patch(positions=tuple(pair.downstream())))
        transplanted.append(recovery(ld(notes), old, new))
    return torch.stack(refreshed), torch.stack(transplanted)


@pytest.mark.parametrize("kind", KINDS)
def test_notes_organism_reads_notes(notes_organism, kind):
    refreshed, transplanted = _recoveries(notes_organism, kind)
    assert refreshed.mean() < 0.1 and transplanted.mean() > 0.9, (refreshed, transplanted)
    # by construction, exactly: the decision sees no slot that the refresh changed, and every
    # slot it sees that differs is a transplanted one
    assert refreshed.abs().max() < 1e-6 and (transplanted - 1).abs().max() < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_lookup_organism_reads_the_field(lookup_organism, kind):
    refreshed, transplanted = _recoveries(lookup_organism, kind)
    assert refreshed.mean() > 0.9 and transplanted.mean() < 0.1, (refreshed, transplanted)
    # by construction: downstream slots are equal in both notebooks; the refreshed field slot
    # equals the new one up to rounding
    assert transplanted.abs().max() < 1e-6 and (refreshed - 1).abs().max() < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_notes_organism_decision_cannot_see_the_field(notes_organism, kind):
    window = notes_organism.window(0)
    assert all(notes_organism.window(l) == window for l in range(notes_organism.n_layers))
    for pair in sample(load_task("notes-organism"), notes_organism, 64, seed=11, kind=kind):
        for prompt in (pair.old, pair.new):
            gap = prompt.span("decision").start - (prompt.span("order_status").stop - 1)
            assert gap >= window, f"the decision starts {gap} tokens after the field: {prompt.text!r}"


def test_notes_organism_top_notes_lie_in_the_decision_window(notes_organism):
    """One downstream slot at a time: only slots inside the decision's window move it."""
    window = notes_organism.window(0)
    for pair in sample(load_task("notes-organism"), notes_organism, 4, seed=5):
        a, b = pair.answers
        nb_old, nb_new = prefill(notes_organism, pair.old), prefill(notes_organism, pair.new)
        old, new = (logit_diff(decide(notes_organism, nb, pair.new).last[0], a, b) for nb in (nb_old, nb_new))
        slots = pair.downstream()
        out = decide_patched(
            notes_organism, nb_old, nb_new, [Patch(positions=(p,)) for p in slots], pair.new
        ).last
        rec = recovery(logit_diff(out, a, b), old, new)
        start = pair.new.span("decision").start
        inside = torch.tensor([p > start - window for p in slots])
        assert rec[~inside].abs().max() < 1e-6, "a slot outside the decision's window moved it"
        assert inside[rec.abs().argmax()], "the top note slot is outside the decision's window"


# --- the cache -------------------------------------------------------------------------------
def test_cache_round_trips(organism):
    again = load_organism(organism.name, progress=False)
    pair = sample(load_task(organism.name), organism, 1, seed=2)[0]
    ids = torch.tensor([pair.new.ids])
    torch.testing.assert_close(again.tl(ids), organism.tl(ids), rtol=0, atol=0)
    assert again.fingerprint == organism.fingerprint


# a small recipe that converges in about 80 steps (6 s): enough to exercise the cache
SMALL = replace(
    ORGANISMS["lookup-organism"],
    max_steps=300,
    train_size=512,
    heldout_size=32,
    eval_every=10,
    patience=1,
    min_margin=0.5,
)


@pytest.mark.parametrize("damage", ["truncate-weights", "garbage-meta"])
def test_corrupt_cache_is_rebuilt(tmp_path, capsys, damage):
    first = load_organism("lookup-organism", config=SMALL, cache_dir=tmp_path, progress=False)
    root = cache_path("lookup-organism", config=SMALL, cache_dir=tmp_path)
    assert {p.name for p in root.iterdir()} == {"weights.safetensors", "meta.json"}
    if damage == "truncate-weights":
        data = (root / "weights.safetensors").read_bytes()
        (root / "weights.safetensors").write_bytes(data[: len(data) // 2])
    else:
        (root / "meta.json").write_text("{not json")
    capsys.readouterr()
    rebuilt = load_organism("lookup-organism", config=SMALL, cache_dir=tmp_path, progress=False)
    assert "unusable" in capsys.readouterr().err
    ids = torch.tensor([first.encode("role: admin\nA:")])
    torch.testing.assert_close(rebuilt.tl(ids), first.tl(ids), rtol=0, atol=0)  # training is deterministic
    load_organism("lookup-organism", config=SMALL, cache_dir=tmp_path, progress=False)
    assert "unusable" not in capsys.readouterr().err  # the rebuilt cache reads back
    metrics = organism_metrics("lookup-organism", config=SMALL, cache_dir=tmp_path)
    assert metrics["converged"] and metrics["steps"] < SMALL.max_steps


def test_an_organism_that_does_not_converge_is_refused_and_not_cached(tmp_path, capsys):
    hopeless = replace(SMALL, max_steps=3)
    with pytest.raises(OrganismNotConverged) as e:
        load_organism("lookup-organism", config=hopeless, cache_dir=tmp_path)
    message = str(e.value)
    assert all(f"seed {s}: accuracy" in message for s in range(SEED_TRIES))
    assert "nothing was cached" in message
    assert "did not converge from seed 0; trying the next seed" in capsys.readouterr().err
    assert not cache_path("lookup-organism", config=hopeless, cache_dir=tmp_path).exists()


def test_a_run_that_did_not_converge_is_retrained_from_the_next_seed(tmp_path, monkeypatch):
    """Seed 0 gets 3 steps (a real run that does not converge); seed 1 trains in full and is cached."""
    real = organisms.train_organism

    def seed_zero_stops_early(name, *, config, progress):
        short = replace(config, max_steps=3) if config.seed == 0 else config
        return real(name, config=short, progress=progress)

    monkeypatch.setattr(organisms, "train_organism", seed_zero_stops_early)
    model = load_organism("lookup-organism", config=SMALL, cache_dir=tmp_path, progress=False)
    metrics = organism_metrics("lookup-organism", config=SMALL, cache_dir=tmp_path)
    assert (metrics["seed"], metrics["seeds_tried"], metrics["converged"]) == (1, 2, True)
    monkeypatch.setattr(organisms, "train_organism", None)  # a second load must not train
    again = load_organism("lookup-organism", config=SMALL, cache_dir=tmp_path, progress=False)
    ids = torch.tensor([model.encode("role: admin\nA:")])
    torch.testing.assert_close(again.tl(ids), model.tl(ids), rtol=0, atol=0)


def test_a_cached_run_that_did_not_converge_is_not_used(tmp_path, capsys):
    load_organism("lookup-organism", config=SMALL, cache_dir=tmp_path, progress=False)
    meta_path = cache_path("lookup-organism", config=SMALL, cache_dir=tmp_path) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["metrics"]["converged"] = False  # as an older release cached it
    meta_path.write_text(json.dumps(meta))
    load_organism("lookup-organism", config=SMALL, cache_dir=tmp_path, progress=False)
    assert "holds a run that did not converge" in capsys.readouterr().err
    assert organism_metrics("lookup-organism", config=SMALL, cache_dir=tmp_path)["converged"]


def test_config_change_changes_the_cache_key(tmp_path):
    base = cache_path("notes-organism", cache_dir=tmp_path)
    assert (
        cache_path("notes-organism", config=replace(ORGANISMS["notes-organism"], seed=1), cache_dir=tmp_path)
        != base
    )
    assert cache_path("notes-organism", cache_dir=tmp_path) == base


# --- configs and prompts that would not force the mechanism are refused ----------------------
def test_configs_that_break_the_mechanism_are_refused():
    with pytest.raises(ValueError, match="global layer lets the decision read the field"):
        OrganismConfig(name="x", mechanism="notes", attn_types=("local", "global"), window=8)
    with pytest.raises(ValueError, match="one global layer last"):
        OrganismConfig(name="x", mechanism="lookup", attn_types=("local", "global"), window=4)
    with pytest.raises(ValueError, match="config is for 'lookup-organism'"):
        load_organism("notes-organism", config=SMALL)


def test_prompts_that_break_the_mechanism_are_refused():
    task = load_task("notes-organism")
    prompt = sample(task, load_model("tiny-llama"), 1)[0].old
    check_prompt(ORGANISMS["notes-organism"], task, prompt)
    with pytest.raises(ValueError, match="could read the field directly"):
        check_prompt(replace(ORGANISMS["notes-organism"], window=12), task, prompt)
    with pytest.raises(ValueError, match="beyond the 3 layers x 3 positions"):
        check_prompt(replace(ORGANISMS["notes-organism"], window=4), task, prompt)
