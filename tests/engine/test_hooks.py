"""Hooks and captures inside `run`/`decide` fire under TransformerLens's own names and mean
what they mean in a full `model.tl` forward."""

from __future__ import annotations

import pytest
import torch

from kvnotes.engine import run
from kvnotes.errors import BadArgument
from kvnotes.hooks import SITES, hook_name
from kvnotes.ops import decide, prefill
from tests.helpers import WINDOW, assert_close, full_logits, make_case


def test_fired_hook_names_are_transformer_lens_names(case):
    model = case.model
    fired: list[str] = []
    decide(
        model,
        case.nb_old,
        case.old,
        hooks=[(lambda name: True, lambda act, hook: fired.append(hook.name))],
    )
    assert set(fired) <= set(model.tl.hook_dict), set(fired) - set(model.tl.hook_dict)
    # the points TransformerLens's own forward fires, fire; beside them, under learned positions,
    # hook_rot_q/k fire too, with q and k as they are (rotation is the identity there; TransformerLens
    # leaves them silent); an attention-only model's MLP points fire in neither
    _, cache = model.tl.run_with_cache(torch.tensor([case.ids]))
    learned = model.facts.positions == "learned"
    assert ("hook_pos_embed" in fired) == learned == ("hook_pos_embed" in cache)
    for l in range(model.n_layers):
        for name in (
            "attn.hook_q",
            "attn.hook_k",
            "attn.hook_v",
            "attn.hook_rot_q",
            "attn.hook_rot_k",
            "attn.hook_attn_scores",
            "attn.hook_pattern",
            "attn.hook_z",
            "hook_resid_pre",
            "hook_attn_out",
            "hook_resid_mid",
            "hook_resid_post",
        ):
            extra = learned and "hook_rot_" in name
            assert (f"blocks.{l}.{name}" in fired) == (f"blocks.{l}.{name}" in cache or extra), name
    assert len(fired) == len(set(fired)), "a hook point fired twice in one run"


def test_pattern_shape_rows_and_causality(case):
    model, nb = case.model, case.nb_old
    names = [f"blocks.{l}.attn.hook_pattern" for l in range(model.n_layers)]
    out = decide(model, nb, case.old, capture=names)
    n_query = len(case.old.span("decision"))
    for name in names:
        pat = out.activations[name]
        assert pat.shape == (1, model.n_heads, n_query, nb.n_slots + n_query), name
        assert_close(pat.sum(-1), torch.ones(1, model.n_heads, n_query), what=f"{name} row sums")
        assert (pat[..., 0, -1] == 0).all(), f"{name}: first query token attends to the next one"


def test_pattern_equals_full_forward_pattern(case):
    model, nb = case.model, case.nb_old
    _, cache = model.tl.run_with_cache(torch.tensor([case.ids]), names_filter=lambda n: "hook_pattern" in n)
    names = [f"blocks.{l}.attn.hook_pattern" for l in range(model.n_layers)]
    out = decide(model, nb, case.old, capture=names)
    assert nb.positions.tolist() == list(range(case.stop))  # key axis = slots, then query tokens
    for name in names:
        assert_close(out.activations[name], cache[name][:, :, case.stop :, :], what=name)


def test_pattern_zero_beyond_sliding_window(windowed_model):
    c = make_case(windowed_model)
    model, nb = windowed_model, c.nb_old
    out = decide(model, nb, c.old, capture=[f"blocks.{l}.attn.hook_pattern" for l in range(model.n_layers)])
    q_pos = torch.arange(c.stop, len(c.ids))
    key_pos = torch.cat([nb.positions, q_pos])
    outside = key_pos[None, :] <= q_pos[:, None] - WINDOW  # [query, key]
    local = [l for l in range(model.n_layers) if model.window(l) is not None]
    assert local and len(local) < model.n_layers
    for l in range(model.n_layers):
        pat = out.activations[f"blocks.{l}.attn.hook_pattern"][0]  # [head, query, key]
        if l in local:
            assert (pat[:, outside] == 0).all(), f"layer {l} attends beyond its window"
            assert (pat[:, ~outside].sum(-1) > 0.999).all()
        else:
            assert (pat[:, outside] > 0).any(), f"global layer {l} ignores distant slots"


def _zero(act, hook):
    return torch.zeros_like(act)


@pytest.mark.parametrize("by", ["name", "filter"])
def test_zeroing_hook_z_matches_full_forward_hooked_at_computed_positions(case, by):
    model, stop = case.model, case.stop
    key = "blocks.0.attn.hook_z" if by == "name" else (lambda n: n == "blocks.0.attn.hook_z")
    hooked = decide(model, case.nb_old, case.old, hooks=[(key, _zero)]).last[0]
    plain = decide(model, case.nb_old, case.old).last[0]
    assert (hooked - plain).abs().max() > 1e-3, "zeroing blocks.0 hook_z must change the logits"

    def zero_computed(z, hook):  # in the full forward, zero z only at the tokens decide computes
        z = z.clone()
        z[:, stop:] = 0
        return z

    full = model.tl.run_with_hooks(
        torch.tensor([case.ids]), fwd_hooks=[("blocks.0.attn.hook_z", zero_computed)]
    )[0, -1]
    assert_close(hooked, full, what="hooked decision vs hooked full forward")
    # hooks are active for the call only
    assert not any(hp._forward_hooks for hp in model.tl.hook_dict.values())
    assert torch.equal(decide(model, case.nb_old, case.old).last[0], plain)


@pytest.mark.parametrize(
    "name",
    [
        "blocks.1.hook_resid_post",
        "blocks.0.attn.hook_z",
        "blocks.1.attn.hook_rot_k",
        "blocks.2.hook_mlp_out",
    ],
)
def test_capture_equals_full_forward_cache_at_computed_positions(case, name):
    model, ids = case.model, case.ids
    if model.cfg.attn_only and "mlp" in name:  # TransformerLens never fires it: refused by name
        with pytest.raises(BadArgument, match=r"attention-only: its blocks have no MLP"):
            run(model, prefill(model, ids[:5]), ids[5:], capture=[name])
        return
    k = case.field - 1
    _, out = run(model, prefill(model, ids, upto=k), ids[k:], capture=[name])
    # learned positions: TransformerLens rotates nothing and fires no hook_rot_k; the engine fires
    # it with the keys as they are, which are TransformerLens's hook_k
    same = name.replace("hook_rot_", "hook_") if model.facts.positions == "learned" else name
    _, cache = model.tl.run_with_cache(torch.tensor([ids]), names_filter=[same])
    act = out.activations[name]
    assert act.shape[:2] == (1, len(ids) - k)
    assert_close(act, cache[same][:, k:], what=name)


def test_capture_does_not_change_logits(case):
    a = decide(case.model, case.nb_old, case.old, capture=["blocks.1.hook_resid_post"]).last
    assert torch.equal(a, decide(case.model, case.nb_old, case.old).last)
    assert_close(a[0], full_logits(case.model, case.ids)[-1], what="decision with capture")


def test_hook_name_gives_transformer_lens_names(model):
    last = model.n_layers - 1
    for site in SITES:
        assert hook_name(last, site) == f"blocks.{last}.{site}"
        if site == "mlp.hook_post" and model.cfg.attn_only:  # no MLP module to hook
            assert hook_name(last, site) not in model.tl.hook_dict
            continue
        assert hook_name(last, site) in model.tl.hook_dict, site
    with pytest.raises(BadArgument) as e:
        hook_name(0, "attn.hook_zz")
    assert "attn.hook_zz" in str(e.value) and all(site in str(e.value) for site in SITES)
    with pytest.raises(BadArgument):
        hook_name(-1, "attn.hook_z")


def test_hooked_layers_take_the_reference_path_with_the_documented_key_axis(case):
    """A hook on the pattern sees every slot, then the overlay's, then the computed tokens; the
    logits do not depend on which layers are hooked (hooked layers take the reference path)."""
    from kvnotes import engine
    from kvnotes.ops import Patch, patched_slots

    model, nb, src = case.model, case.nb_old, case.nb_new
    over = patched_slots(nb, src, [Patch(positions=(2,)), Patch(positions=(1, 3))])
    seen = {}

    def look(pattern, hook):
        seen[hook.name] = pattern.shape

    name = hook_name(model.n_layers - 1, "attn.hook_pattern")
    ids = case.ids[case.stop :]
    plain = decide(model, nb, case.old, overlay=over).last
    hooked = decide(model, nb, case.old, overlay=over, hooks=[(name, look)]).last
    with engine.fast_attention(False):
        reference = decide(model, nb, case.old, overlay=over).last
    assert seen[name] == (2, model.facts.n_heads, len(ids), nb.n_slots + over.n_slots + len(ids))
    assert_close(hooked, plain, what="one hooked layer")
    assert_close(reference, plain, what="reference path")
