"""Remote experiments up to the request boundary: the sweep as one nnsight session gives the
engine's numbers here and through nnsight's dry run of the remote path, its request carries token
ids and no notebook, and a missing key or an unreachable server is a clear error that never shows
the key. (Nothing here reaches NDIF; docs/backends.md says what was run against a live server.)"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from kvnotes import load_model, ops
from kvnotes.cli import main
from kvnotes.engine import full_logits
from kvnotes.errors import BadArgument, KVNotesError
from kvnotes.serving.remote import RemoteUnavailable, SlotSweep, slot_sweep
from kvnotes.tasks import load_task
from kvnotes.tasks.sampler import sample
from tests.checkpoints import FAMILIES, build_checkpoint

SECRET = "kvnotes-test-key-0123456789"
LONG = {
    "gemma3-long": (
        FAMILIES["gemma3-text"][0],
        {**FAMILIES["gemma3-text"][1], "max_position_embeddings": 512},
    )
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Gemma 3 checkpoint (windows of 8) with room for an order-cancel prompt, on the nnsight
    backend; one pair; slots inside and outside the sliding window."""
    path = tmp_path_factory.mktemp("gemma3-long")
    build_checkpoint("gemma3-long", path, families=LONG)
    nn = load_model(str(path), backend="nnsight")
    pair = sample(load_task("order-cancel"), nn, 1)[0]
    down = pair.downstream()
    slots = [down[0], down[len(down) // 2], *down[-5:]]  # early ones lie outside every window
    return path, nn, pair, slots


def _engine(nn, pair, slots) -> list[float]:
    stop = pair.old.span("decision").start
    nb_old, nb_new = ops.prefill(nn, pair.old, upto=stop), ops.prefill(nn, pair.new, upto=stop)
    specs = [ops.Patch(positions=(s,)) for s in slots]
    lg = ops.decide_patched(nn, nb_old, nb_new, specs, pair.old, vocab=pair.answers).last
    return (lg[:, 0] - lg[:, 1]).tolist()


@pytest.mark.parametrize("remote", [False, "local"])
def test_the_session_gives_the_engines_numbers(setup, remote):
    _, nn, pair, slots = setup
    r = slot_sweep(nn, pair, slots, batch_size=3, remote=remote)
    expected = _engine(nn, pair, slots)
    assert max(abs(a - b) for a, b in zip(expected, expected[1:])) > 1e-3  # the slots differ
    torch.testing.assert_close(torch.tensor(r.ld), torch.tensor(expected), atol=1e-4, rtol=0)
    full = [full_logits(nn, p.ids)[-1] for p in (pair.old, pair.new)]
    ends = [float(f[pair.answers[0]] - f[pair.answers[1]]) for f in full]
    assert r.ld_old == pytest.approx(ends[0], abs=1e-4) and r.ld_new == pytest.approx(ends[1], abs=1e-4)
    assert (r.request is None) == (remote is False)


def test_the_request_carries_token_ids_and_no_notebook(setup):
    _, nn, pair, slots = setup
    r = slot_sweep(nn, pair, slots, remote="local")
    n = len(pair.old.ids)
    assert r.request.tensors == {
        "old": (1, n),
        "new": (1, n),
        "decision": (1, n - pair.old.span("decision").start),
    }
    notebook_bytes = 2 * nn.n_layers * nn.n_kv_heads * n * nn.d_head * 4
    assert r.request.payload_bytes < notebook_bytes / 2  # 20 kB here; a notebook is 129 kB
    back = SlotSweep.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r


def test_a_missing_key_says_where_keys_come_from(setup, monkeypatch):
    from nnsight import CONFIG

    path, _, pair, slots = setup
    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    monkeypatch.setattr(CONFIG.API, "APIKEY", None)
    meta = load_model(str(path), backend="nnsight", remote=True)
    with pytest.raises(RemoteUnavailable, match="NDIF_API_KEY.*set_default_api_key"):
        slot_sweep(meta, pair, slots, remote=True)


def test_an_unreachable_server_is_named_and_the_key_never_shown(setup, monkeypatch, capsys):
    path, _, pair, slots = setup
    monkeypatch.setenv("NDIF_API_KEY", SECRET)
    meta = load_model(str(path), backend="nnsight", remote=True)
    with pytest.raises(RemoteUnavailable, match="no NDIF model key.*hub name"):
        slot_sweep(meta, pair, slots, remote=True)  # a local directory is nothing NDIF serves
    key = 'nnsight.modeling.transformers.TransformersModel:{"repo_id": "google/gemma-3-270m"}'
    monkeypatch.setattr(type(meta.lm), "to_model_key", lambda self: key)  # as a hub name's model has
    with pytest.raises(RemoteUnavailable) as err:
        slot_sweep(meta, pair, slots, remote="http://127.0.0.1:9")  # nothing listens on port 9
    assert "127.0.0.1:9" in str(err.value) and "remote=False" in str(err.value)
    out = capsys.readouterr()
    assert SECRET not in str(err.value) + out.out + out.err


def test_a_model_without_weights_runs_only_remotely(setup):
    path, _, pair, _ = setup
    meta = load_model(str(path), backend="nnsight", remote=True)
    assert not meta.weights
    with pytest.raises(BadArgument, match="without its weights"):
        ops.prefill(meta, pair.old)


def test_the_transformer_lens_backend_says_remote_needs_nnsight(setup):
    path, _, pair, slots = setup
    with pytest.raises(BadArgument, match="backend='nnsight'"):
        slot_sweep(load_model(str(path)), pair, slots)


def test_cli_sweep_dry_run_writes_json(setup, tmp_path):
    path, *_ = setup
    out = tmp_path / "sweep.json"
    page = tmp_path / "sweep.html"
    argv = ["sweep", "--backend", "nnsight", "--model", str(path), "--slots", "4", "--dry-run"]
    assert main([*argv, "--json", str(out), "--html", str(page)]) == 0
    d = json.loads(out.read_text())
    assert d["where"] == "dry run of the remote path" and len(d["ld"]) == 4
    assert "Slot sweep" in page.read_text() and "recovers the most" in SlotSweep.from_dict(d)._repr_html_()
    assert main(["sweep", "--model", str(path)]) == 2  # the transformer-lens backend: a clear error


def test_a_non_kv_model_is_refused_before_loading_for_remote_too(tmp_path):
    tf.MambaConfig(num_hidden_layers=1, hidden_size=16, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(KVNotesError, match="state-space"):
        load_model(str(tmp_path), backend="nnsight", remote=True)
