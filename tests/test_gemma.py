"""The embedded real model, Gemma 3 270M: the conformance suite on real weights, spans under its
real tokenizer, and the converted-weights cache. Marked `gemma`; part of the default suite."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvnotes.conformance import SELF_INVARIANTS, verify
from kvnotes.errors import TokenCountChanged
from kvnotes.prompt import Template

pytestmark = pytest.mark.gemma


def test_all_eight_invariants_pass_on_real_weights_past_the_sliding_window(gemma):
    # the two against transformers run in tests/test_verify_gemma.py, with the reference loaded once
    report = verify(gemma, progress=False, only=SELF_INVARIANTS)
    assert report.max_window == 512
    assert report.prompts["long"] > 512 + 24  # queries near the end really slide
    assert report.passed, report.table()
    assert len(report.invariants) == 8


def test_bos_first_and_single_token_answers(gemma):
    assert gemma.encode("hi")[0] == 2
    assert gemma.answer_token(" cancel") != gemma.answer_token(" deny")
    with pytest.raises(ValueError, match="single token"):
        gemma.answer_token(" cancellation request")


def test_spans_follow_gemma_offsets(gemma):
    tpl = Template(
        "[[rule:Deny once shipped.]]\nCustomer: {name}, order_status: {order_status}.\n"
        "[[query:Q: cancel or deny?]]\n[[decision:A:]]"
    )
    p = tpl.render(gemma, name="Zoë-Ann", order_status="pending")
    for name, (cs, ce) in p.char_spans.items():
        decoded = gemma.tokenizer.decode(list(p.ids[slice(*p.spans[name])]))
        assert p.text[cs:ce].strip() in decoded, name
    assert p.spans["decision"][1] == len(p)


def test_value_changing_token_count_is_reported(gemma):
    p = Template("order_status: {order_status}.\n[[decision:A:]]").render(gemma, order_status="pending")
    with pytest.raises(TokenCountChanged, match=r"'order_status'.*\(\d+ → \d+\).*erratum"):
        p.with_values(gemma, order_status="awaiting courier pickup")


def test_second_load_in_a_new_process_reads_the_converted_cache(gemma):
    code = "from kvnotes.zoo import load_model; m = load_model('gemma-3-270m'); print(m.fingerprint)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "from cache" in out.stderr
    assert out.stdout.strip() == gemma.fingerprint


def test_readme_example_runs(gemma, capsys):
    """The README's notebook example, executed as written (it loads the embedded model)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - our own README
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(" recovers ")[0] for ln in lines] == ["field-only refresh", "notes transplant"]
    assert all(re.fullmatch(r".* recovers -?\d+\.\d\d of the decision", ln) for ln in lines)


def test_readme_free_form_example_runs(gemma, capsys):
    """The README's free-form example, executed as written: one text in, its next token out; two
    texts of one token count in, a per-slot sweep out, one row per slot before the decision."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[1]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own README
    (printed,) = capsys.readouterr().out.splitlines()
    assert printed.strip()  # the model's next token after the text
    old, sweep = scope["old"], scope["sweep"]
    assert tuple(sweep.last.shape) == (len(old) - 1, gemma.facts.d_vocab_out)


# --- probes on the real model ---------------------------------------------------------------------
def test_gemma_reads_the_field_directly_on_order_cancel(gemma):
    """The measured regime of Gemma 3 270M base on order-cancel (docs/probes.md): near-verbatim
    lookup — the field's own slot carries the decision, the downstream slots almost nothing."""
    from probes import field_refresh, make_trials, notes_transplant

    # template 0, the measured one: in template 2 (one sentence, no examples) the decision barely
    # follows the field (effects ~0.1 logits), so the regime cannot be read there
    trials = make_trials(gemma, "order-cancel", 4, template=0, progress=False)
    assert all(t.effect > 1.0 for t in trials)  # the task works: the decision follows the field
    assert field_refresh(trials).mean > 0.8
    assert abs(notes_transplant(trials).mean) < 0.3


def test_note_map_on_gemma_equals_unbatched_patches(gemma):
    from kvnotes.ops import Patch, decide, patch
    from probes import make_trials
    from probes.causal import single_slot_map

    t = make_trials(gemma, "order-cancel", 1, progress=False)[0]
    m = single_slot_map(t, 3)
    for p, r in zip(m["positions"], m["recovery"]):
        out = decide(
            gemma, patch(t.old_nb, t.new_nb, Patch(positions=(p,))), t.pair.new, vocab=t.pair.answers
        ).last[0]
        want = float(out[0] - out[1])
        assert abs(t.ld_old + r * (t.ld_new - t.ld_old) - want) < 1e-4, p


def test_docs_example_task_runs_on_gemma(gemma, tmp_path):
    """The complete TOML example in docs/tasks.md samples aligned pairs and probes on Gemma."""
    from probes import field_refresh, make_trials, notes_transplant
    from tests.tasks.test_tasks import docs_example

    path = tmp_path / "free-upgrade.toml"
    path.write_text(docs_example())
    trials = make_trials(gemma, str(path), 2, progress=False)
    assert field_refresh(trials, min_effect=0.0)["recovery"].n == 2
    assert notes_transplant(trials, min_effect=0.0)["kv"].n == 2


def test_head_patches_on_gemma_equal_the_unbatched_engine_and_find_the_field_reader(gemma):
    """Multi-query attention on real weights (4 query heads share one KV head per layer): batched
    read patches equal a plain decide with the same hook, every head gives the new decision, and
    the head whose attention to the field carries the conclusion (docs/circuits.md) is found."""
    from circuits import all_heads, read_sweep
    from circuits.heads import path_delta, read_capture
    from circuits.read_write import path_positions
    from kvnotes.ops import decide
    from probes import make_trials

    t = make_trials(gemma, "order-cancel", 1, progress=False)[0]
    names = [f"blocks.{l}.attn.hook_z" for l in range(gemma.n_layers)]
    z_new = decide(gemma, t.new_nb, t.pair.new, capture=names).activations
    sets = [[(10, 3)], [(11, 2), (15, 0)], all_heads(gemma)]
    got = t.ld_old + read_sweep(t, sets) * (t.ld_new - t.ld_old)
    for heads, ld in zip(sets, got.tolist()):

        def hook(z, hook, heads=heads):
            z = z.clone()
            for l, h in heads:
                if hook.name == names[l]:
                    z[:, -1, h] = z_new[names[l]][:, -1, h]
            return z

        out = decide(gemma, t.old_nb, t.pair.new, hooks=[(n, hook) for n in names], vocab=t.pair.answers)
        assert abs(ld - float(out.last[0, 0] - out.last[0, 1])) < 1e-3
    assert abs(got[-1].item() - t.ld_new) < 1e-3
    site = read_capture(t)
    total = sum(path_delta(t, where) for where in path_positions(t).values())
    torch.testing.assert_close(total, site.z_new - site.z_old, rtol=1e-4, atol=1e-4)
    field = read_sweep(t, [[(10, 3)]], path=list(t.pair.field_span))
    assert float(field[0]) > 0.5  # L10H3 reads the conclusion from the field's slot
