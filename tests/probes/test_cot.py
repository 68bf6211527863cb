"""Chain of thought from an edited cache: the decoding is greedy and bounded, the figures typed."""

from __future__ import annotations

from kvnotes.engine import run
from probes import make_trials
from probes.cot import chain, cot_refresh


def test_chain_is_greedy_and_bounded(notes_organism):
    t = make_trials(notes_organism, "notes-organism", 1, progress=False)[0]
    nb, gen = chain(t, t.old_nb, cue="reasoning:", max_tokens=5)
    assert 1 <= len(gen) <= 5
    assert nb.n_slots == t.old_nb.n_slots + len(notes_organism.encode("reasoning:", bos=False)) + len(gen)
    # greedy: each generated token is the argmax after the tokens before it
    ctx, out = run(notes_organism, t.old_nb, notes_organism.encode("reasoning:", bos=False))
    for tok in gen:
        assert int(out.last[0].argmax()) == tok
        ctx, out = run(notes_organism, ctx, [tok])


def test_cot_refresh_reports_chains_and_recoveries(notes_organism):
    trials = make_trials(notes_organism, "notes-organism", 2, progress=False)
    r = cot_refresh(trials, max_tokens=4, min_effect=0.0)
    assert set(r.parts) == {
        "recovery",
        "no_cot_recovery",
        "edited_tokens",
        "clean_tokens",
        "same_chain",
        "chain_effect",
    }
    assert all(1 <= n <= 4 for n in r["edited_tokens"].values + r["clean_tokens"].values)
    assert r["no_cot_recovery"].mean < 0.1  # the organism ignores an in-place refresh without a chain
    assert len(r.examples) == 2 and set(r.examples[0]) == {"stale", "edited", "clean"}


def test_cli_edit_with_cot(tmp_path):
    import json

    from kvnotes.cli import main

    out = tmp_path / "edit.json"
    assert (
        main(
            [
                "edit",
                "--model",
                "notes-organism",
                "--n",
                "2",
                "--cot",
                "--cot-tokens",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    probes = json.loads(out.read_text())["results"]
    assert {"edit_methods", "cot_refresh"} <= set(probes)
    assert all(v <= 3 for v in probes["cot_refresh"]["edited_tokens"]["values"])
