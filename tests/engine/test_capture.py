"""`kvnotes.capture` against a hand-written capture: TransformerLens's own `run_with_cache` over each
whole prompt, sliced at the captured positions. The check fails when the runs or the positions are
swapped (both planted below)."""

from __future__ import annotations

import pytest
import torch

from kvnotes.capture import CaptureRun, PairCapture, capture_pair, capture_runs
from kvnotes.errors import BadArgument
from kvnotes.ops import prefill
from kvnotes.tasks import load_task, sample
from tests.helpers import TOLERANCES, get_model

# float32: the notebook's forward (a prefix, written tokens, then the captured ones) and one whole
# forward differ only in matmul shapes, so by float32 rounding; `tests.helpers.TOLERANCES` (2e-5,
# scaled by the largest magnitude) holds them, far below the two runs' difference asserted below.
RTOL, ATOL = TOLERANCES[torch.float32]
HOOKS = ("blocks.0.attn.hook_z", "blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern")
WRITTEN = 2  # tokens written into each run's notebook before the captured ones (the field's, which differ)


@pytest.fixture(scope="module")
def case():
    """An aligned order-cancel pair: the same tokens before the field (`start`), then the runs differ."""
    model = get_model("tiny-llama")
    pair = sample(load_task("order-cancel"), model, 1, seed=0)[0]
    ids = [list(pair.old.ids), list(pair.new.ids)]
    start = pair.field_span.start
    assert len(ids[0]) == len(ids[1]) and ids[0][:start] == ids[1][:start] and ids[0] != ids[1]
    with torch.no_grad():
        refs = [model.tl.run_with_cache(torch.tensor([i]), names_filter=list(HOOKS))[1] for i in ids]
    return model, ids, refs, start


def _ref(cache, hook: str, at: slice) -> torch.Tensor:
    """The hand-written capture at the computed positions `at` (a pattern's query axis is its third)."""
    x = cache[hook]
    return x[:, :, at] if hook.endswith("hook_pattern") else x[:, at]


def _close(pair: PairCapture, refs, at: slice) -> bool:
    for cap, cache in ((pair.old, refs[0]), (pair.new, refs[1])):
        for hook in HOOKS:
            want = _ref(cache, hook, at)
            if cap[hook].shape != want.shape or not torch.allclose(
                cap[hook], want, rtol=RTOL, atol=ATOL * max(1.0, float(want.abs().max()))
            ):
                return False
    return True


def test_capture_pair_matches_run_with_cache_and_fails_when_swapped(case):
    model, ids, refs, start = case
    n = len(ids[0])
    runs = [CaptureRun(prefill(model, i[:start]), i[start:], range(start, n), written=WRITTEN) for i in ids]
    pair = capture_pair(model, *runs, HOOKS)
    at = slice(start + WRITTEN, n)
    assert _close(pair, refs, at)
    # the written tokens went into each run's own notebook
    assert pair.old.notebook.n_slots == pair.new.notebook.n_slots == start + WRITTEN
    # the check has power: the runs differ at these sites by far more than the tolerance
    gap = (refs[0]["blocks.1.hook_resid_post"] - refs[1]["blocks.1.hook_resid_post"])[:, at].abs().max()
    assert float(gap) > 100 * ATOL
    # planted: the runs swapped, or the positions shifted by one, fail the same check
    assert not _close(PairCapture(old=pair.new, new=pair.old), refs, at)
    assert not _close(pair, refs, slice(start + WRITTEN - 1, n - 1))


def test_capture_runs_keeps_batch_rows_and_refuses_no_hooks(case):
    model, ids, refs, start = case
    n = len(ids[0])
    nb = prefill(model, ids[0][:start])
    rows = torch.tensor([ids[0][start:], ids[1][start:]])  # two rows against the old prefix
    (cap,) = capture_runs(model, [CaptureRun(nb, rows, range(start, n))], HOOKS[:1])
    z = cap[HOOKS[0]]
    assert z.shape[0] == 2
    for row, cache in enumerate(refs):
        want = _ref(cache, HOOKS[0], slice(start, n))[0]
        torch.testing.assert_close(z[row], want, rtol=RTOL, atol=ATOL * max(1.0, float(want.abs().max())))
    with pytest.raises(BadArgument, match="at least one hook"):
        capture_runs(model, [CaptureRun(nb, ids[0][start:], range(start, n))], [])
