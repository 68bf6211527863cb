"""Slot attribution of an arbitrary prompt: exact limits of the transplants, the estimate as the
first-order effect, the value mean-ablation's construction, clear errors, the CLI and JSON."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest
import torch

from circuits import PromptAttribution, attribute_prompt
from circuits.prompt_attribution import PromptAttributionError, value_mean_ablation
from kvnotes.errors import TokenCountChanged
from kvnotes.ops import Patch, decide, decide_patched, patch, prefill
from tests.helpers import assert_close, full_logits, get_model

PROMPT = (
    "Policy: an order may be cancelled while its status is pending.\n"
    "order_status: shipped.\nQ: Can the order be cancelled? A:"
)
COUNTER = PROMPT.replace("shipped", "pending")  # same token count under the tiny tokenizer
ANSWERS = (" yes", " no")
MODELS = ["tiny-llama", "tiny-gqa", "tiny-gemma3"]


def _ld(model, logits) -> float:
    yes, no = (model.answer_token(a) for a in ANSWERS)
    return float(logits[..., yes] - logits[..., no])


def _notebooks(model, counterfactual: str | None):
    """The prompt's notebook, the source notebook and the decision token, built independently."""
    ids = model.encode(PROMPT)
    nb = prefill(model, ids[:-1])
    if counterfactual is None:
        return nb, value_mean_ablation(nb), ids[-1:]
    src = prefill(model, model.encode(counterfactual)[:-1])
    return nb, src, ids[-1:]


def _vocab(model):
    return [model.answer_token(a) for a in ANSWERS]


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    return get_model(request.param)


def test_every_slot_from_the_counterfactual_gives_its_decision(tiny):
    assert len(tiny.encode(PROMPT)) == len(tiny.encode(COUNTER))
    r = attribute_prompt(tiny, PROMPT, ANSWERS, counterfactual=COUNTER, progress=False)
    truth_prompt = _ld(tiny, full_logits(tiny, tiny.encode(PROMPT))[-1])
    truth_counter = _ld(tiny, full_logits(tiny, tiny.encode(COUNTER))[-1])
    nb, src, query = _notebooks(tiny, COUNTER)
    every = decide_patched(tiny, nb, src, [Patch()], query, vocab=_vocab(tiny)).last
    every_ld = float(every[0, 0] - every[0, 1])
    assert_close(
        torch.tensor([r.ld, r.ld_source, every_ld]),
        torch.tensor([truth_prompt, truth_counter, truth_counter]),
        what="ld, ld_source, all slots",
    )
    assert abs(truth_counter - truth_prompt) > 1e-3  # the counterfactual moves the decision


@pytest.mark.parametrize("counterfactual", [COUNTER, None], ids=["counterfactual", "mean-ablation"])
def test_exact_rows_are_the_single_transplants_they_name(tiny, counterfactual):
    # each row's total and per-layer values are plain unbatched transplants of that position
    r = attribute_prompt(tiny, PROMPT, ANSWERS, counterfactual=counterfactual, top=3, progress=False)
    nb, src, query = _notebooks(tiny, counterfactual)
    base = _ld(tiny, decide(tiny, nb, query).last[0])
    for row in r.exact[:2]:
        p = row["position"]
        assert row["token"] == r.tokens[r.positions.index(p)]
        specs = [Patch(positions=(p,))] + [Patch(positions=(p,), layers=(l,)) for l in range(tiny.n_layers)]
        want = [_ld(tiny, decide(tiny, patch(nb, src, s), query).last[0]) - base for s in specs]
        assert_close(torch.tensor([row["total"], *row["per_layer"]]), torch.tensor(want), what=f"slot {p}")
    # rows are ranked by |estimate summed over layers|, and that estimate is the row's
    slot_est = r.slot_estimate
    ranked = sorted(range(len(slot_est)), key=lambda i: -abs(slot_est[i]))[:3]
    assert [row["position"] for row in r.exact] == [r.positions[i] for i in ranked]
    assert [row["estimate"] for row in r.exact] == pytest.approx([slot_est[i] for i in ranked], abs=1e-6)


@pytest.mark.parametrize("counterfactual", [COUNTER, None], ids=["counterfactual", "mean-ablation"])
def test_the_estimate_is_the_first_order_effect(counterfactual):
    # a small step along (source - prompt) at one slot and layer, and at every slot and layer at
    # once, moves the decision by step * estimate
    model = get_model("tiny-llama")
    r = attribute_prompt(
        model, PROMPT, ANSWERS, counterfactual=counterfactual, top=1, steps=1, progress=False
    )
    nb, src, query = _notebooks(model, counterfactual)
    est = torch.tensor(r.estimate)
    l, s = divmod(int(est.abs().argmax()), est.shape[1])
    eps = 1e-2

    def stepped(where):
        keys = [k.clone() for k in nb.keys]
        values = [v.clone() for v in nb.values]
        for layer, idx in where:
            keys[layer][:, :, idx] += eps * (src.keys[layer][:, :, idx] - nb.keys[layer][:, :, idx])
            values[layer][:, :, idx] += eps * (src.values[layer][:, :, idx] - nb.values[layer][:, :, idx])
        moved = replace(nb, keys=tuple(keys), values=tuple(values))
        return _ld(model, decide(model, moved, query).last[0]) - r.ld

    assert stepped([(l, [s])]) == pytest.approx(eps * float(est[l, s]), rel=0.05)
    everything = [(layer, list(range(nb.n_slots))) for layer in range(model.n_layers)]
    assert stepped(everything) == pytest.approx(eps * float(est.sum()), rel=0.05)
    assert_close(est, torch.tensor(r.estimate_keys) + torch.tensor(r.estimate_values), what="K + V")


@pytest.mark.parametrize("counterfactual", [COUNTER, None], ids=["counterfactual", "mean-ablation"])
def test_integrated_gradients_add_up_to_the_whole_change(counterfactual):
    # with more steps along the path, the estimates of all slots and layers together approach the
    # exact effect of replacing everything (ld_source - ld); one step is plain attribution patching
    model = get_model("tiny-llama")
    errors = []
    for steps in (1, 16):
        r = attribute_prompt(
            model, PROMPT, ANSWERS, counterfactual=counterfactual, top=1, steps=steps, progress=False
        )
        errors.append(abs(float(torch.tensor(r.estimate).sum()) - (r.ld_source - r.ld)))
        assert r.meta["steps"] == steps
    # 16 steps: within 2% of the change, or at least ten times closer than one step
    assert errors[1] <= max(0.1 * errors[0], 0.02 * abs(r.ld_source - r.ld)) + 1e-4, errors


def test_value_mean_ablation_removes_content_and_keeps_attention(tiny):
    nb, src, query = _notebooks(tiny, None)
    for l in range(tiny.n_layers):
        assert torch.equal(src.keys[l], nb.keys[l])
        mean = nb.values[l][:, :, 1:].mean(2, keepdim=True)  # slot 0 is position 0, the BOS
        assert_close(src.values[l][:, :, 1:], mean.expand_as(nb.values[l][:, :, 1:]), what=f"layer {l}")
        assert torch.equal(src.values[l][:, :, :1], nb.values[l][:, :, :1])  # the sink is left alone
    names = [f"blocks.{l}.attn.hook_pattern" for l in range(tiny.n_layers)]
    a = decide(tiny, nb, query, capture=names[:1]).activations[names[0]]
    b = decide(tiny, src, query, capture=names[:1]).activations[names[0]]
    assert torch.equal(a, b)  # layer 0's queries see only the decision token: its pattern is the same
    r = attribute_prompt(tiny, PROMPT, ANSWERS, top=2, progress=False)
    assert r.baseline == "value-mean-ablation" and r.counterfactual is None
    assert all(x == 0 for row in r.estimate_keys for x in row)  # keys unchanged: no key effect


def test_sliding_window_layers_see_no_distant_slot():
    # tiny-gemma3's local layers (0, 1, 3) attend 8 positions back: a slot further from the
    # decision has no effect there: the estimate is exactly 0, the exact transplant 0 up to the
    # rounding between a batched and a single forward
    model = get_model("tiny-gemma3")
    r = attribute_prompt(model, PROMPT, ANSWERS, counterfactual=COUNTER, top=64, progress=False)
    decision = r.positions[-1] + 1
    local = [l for l in range(model.n_layers) if model.window(l)]
    far = [row for row in r.exact if decision - row["position"] >= model.window(local[0])]
    assert local == [0, 1, 3] and far
    for row in far:
        i = r.positions.index(row["position"])
        assert all(abs(row["per_layer"][l]) < 1e-5 and r.estimate[l][i] == 0 for l in local), row
    assert any(abs(row["per_layer"][2]) > 1e-3 for row in far)  # the global layer does see them


def test_a_one_layer_model_adds_up():
    # one layer: the per-layer transplant is the whole transplant
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from kvnotes.engine.transformer_lens.model import from_hooked
    from kvnotes.zoo.tiny import TINY_BASE, TINY_CONFIGS, tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = HookedTransformerConfig(
        **{**TINY_BASE, **TINY_CONFIGS["tiny-llama"], "n_layers": 1},
        d_vocab=len(tok),
        model_name="tiny-1layer",
        seed=0,
        original_architecture="kvnotes-tiny",
    )
    model = from_hooked("tiny-1layer", HookedTransformer(cfg, move_to_device=False), tok)
    r = attribute_prompt(model, PROMPT, ANSWERS, top=4, progress=False)
    for row in r.exact:
        assert row["per_layer"] == pytest.approx([row["total"]], abs=1e-6)


def test_errors_name_what_was_wrong():
    model = get_model("tiny-llama")
    longer = PROMPT.replace("shipped", "shipped and packed")
    n, m = len(model.encode(PROMPT)), len(model.encode(longer))
    with pytest.raises(TokenCountChanged) as e:
        attribute_prompt(model, PROMPT, ANSWERS, counterfactual=longer, progress=False)
    assert f"{m} tokens" in str(e.value) and f"prompt is {n}" in str(e.value)
    assert "token count" in str(e.value)
    with pytest.raises(PromptAttributionError, match="decision token"):
        attribute_prompt(model, PROMPT, ANSWERS, counterfactual=PROMPT[:-1] + "?", progress=False)
    with pytest.raises(PromptAttributionError, match="same token"):
        attribute_prompt(model, PROMPT, (" yes", " yes"), progress=False)
    with pytest.raises(PromptAttributionError, match="single token"):
        attribute_prompt(model, PROMPT, (" yes", " cancellation denied"), progress=False)


def test_json_round_trip_field_by_field():
    r = attribute_prompt(
        get_model("tiny-llama"), PROMPT, ANSWERS, counterfactual=COUNTER, top=3, progress=False
    )
    d = json.loads(json.dumps(r.to_dict()))
    back = PromptAttribution.from_dict(d)
    for f in fields(PromptAttribution):
        assert getattr(back, f.name) == getattr(r, f.name), f.name
    assert back == r and back.to_dict() == d
    with pytest.raises(PromptAttributionError, match="schema"):
        PromptAttribution.from_dict({**d, "schema": "something/else"})


def test_attribute_command_writes_json(tmp_path, capsys):
    from kvnotes.cli import main

    prompt, out = tmp_path / "p.txt", tmp_path / "out" / "attr.json"
    prompt.write_text(PROMPT + "\n")  # an editor's trailing newline is not part of the prompt
    rc = main(
        [
            "attribute",
            "--model",
            "tiny-llama",
            "--prompt",
            str(prompt),
            "--answers",
            " yes",
            " no",
            "--top",
            "3",
            "--json",
            str(out),
            "--html",
            str(tmp_path / "attr.html"),
        ]
    )
    assert rc == 0
    page = (tmp_path / "attr.html").read_text(encoding="utf-8")
    assert "Attribution over the prompt" in page and page.count('class="kv-fig-data"') == 1
    printed = capsys.readouterr().out
    assert "position" in printed and "Spearman" in printed
    back = PromptAttribution.from_dict(json.loads(out.read_text()))
    direct = attribute_prompt(get_model("tiny-llama"), PROMPT, ANSWERS, top=3, progress=False)
    for f in fields(PromptAttribution):
        if f.name not in ("gradient_seconds", "exact_seconds"):
            assert getattr(back, f.name) == getattr(direct, f.name), f.name
    assert len(back.exact) == 3 and back.decision_token == direct.decision_token


def test_attribute_command_refuses_bad_input_before_loading(tmp_path, capsys):
    from kvnotes.cli import main

    missing = tmp_path / "nothing-here.txt"
    assert (
        main(
            [
                "attribute",
                "--model",
                "org/no-such-model",
                "--prompt",
                str(missing),
                "--answers",
                " yes",
                " no",
            ]
        )
        == 2
    )
    assert "nothing-here.txt" in capsys.readouterr().err
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    assert (
        main(
            [
                "attribute",
                "--model",
                "org/no-such-model",
                "--prompt",
                str(prompt),
                "--answers",
                " yes",
                " no",
                " maybe",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "exactly two" in err and "3" in err


def test_a_source_that_barely_moves_the_decision_is_flagged():
    """On the probes' minimum-effect scale: the same attribution is flagged under a floor above its
    effect and not under one below it, in the result, its table and its page's reading."""
    from dashboards.circuit_panels import prompt_attribution_panels

    prompt = "order_status: shipped.\nQ: Can the order be cancelled? A:"
    r = attribute_prompt(get_model("tiny-llama"), prompt, (" yes", " no"), top=2, progress=False)
    assert abs(r.effect - (r.ld_source - r.ld)) < 1e-12
    low = type(r).from_dict({**r.to_dict(), "min_effect": abs(r.effect) / 2})
    high = type(r).from_dict({**r.to_dict(), "min_effect": abs(r.effect) * 2})
    assert low.small_effect is None and "WARNING" not in low.table()
    assert high.small_effect and "WARNING small effect" in high.table().splitlines()[1]
    assert "Caution, small effect" in prompt_attribution_panels(high)[0].reading
    assert "Caution" not in prompt_attribution_panels(low)[0].reading
