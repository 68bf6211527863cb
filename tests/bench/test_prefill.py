"""The prefill benchmark: kvnotes, transformers and TransformerLens prefill the same context and
agree on it (logits and K/V), the report has the documented JSON shape, and a way that cannot run
is skipped with its reason. (No timing is asserted: speed is a benchmark.)"""

from __future__ import annotations

import json

import pytest
import torch

from kvnotes.analysis.registry import get
from kvnotes.bench import prefill as bp
from kvnotes.bench import prefill_ways as pw
from kvnotes.bench.prefill import PrefillReport, context_ids, prefill_bench
from kvnotes.cli import main
from kvnotes.zoo import load_model
from kvnotes.zoo.hf import load_hf
from tests.helpers import get_model
from tests.test_verify import _checkpoint

POINT_KEYS = {"tokens", "ways", "skipped"}
WAY_KEYS = {"name", "seconds", "min_s", "max_s", "tokens_per_s", "peak_mib", "max_abs_logit_diff"}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """A tiny Gemma 3 checkpoint (sliding windows of 8, one global layer, local/global RoPE bases)."""
    return str(_checkpoint(tmp_path_factory, "gemma3-text"))


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_dir):
    """The checkpoint as a KVModel; its Hugging Face twin is the checkpoint itself."""
    return load_hf(gemma3_dir)


@pytest.fixture(scope="module")
def report(hf_gemma3, gemma3_dir) -> PrefillReport:
    nn = load_model(gemma3_dir, backend="nnsight")
    return prefill_bench(hf_gemma3, [96], repeats=1, nn=nn, progress=False)


def test_every_way_agrees_on_a_gemma3_checkpoint(hf_gemma3, report):
    (point,) = report.results
    assert point.tokens == 96 and point.skipped == {}
    ways = {w.name: w for w in point.ways}
    assert list(ways) == list(bp.WAYS)
    assert ways["kvnotes"].max_abs_logit_diff is None  # the reference the others are read against
    for name in ("kvnotes_nnsight", "transformers_chunked", "transformers", "transformer_lens"):
        assert ways[name].max_abs_logit_diff < 1e-3, name
        assert ways[name].max_abs_kv_diff < 1e-4, name
    # the headline reads kvnotes against transformers fed in chunks, from the medians reported
    assert point.speedup == pytest.approx(ways[bp.REFERENCE].seconds / ways["kvnotes"].seconds, rel=1e-12)
    windows = [hf_gemma3.window(l) for l in report.compared_layers]
    assert windows[0] is not None and windows[1] is None  # a sliding layer and a global one


def test_transformers_keeps_only_the_window_in_a_sliding_layer(hf_gemma3):
    """So the K/V comparison is over the last slots both hold, not over an unequal pair."""
    ids = context_ids(hf_gemma3, 40)
    layers = bp.compared_layers(hf_gemma3)
    runners = bp.Runners(model=hf_gemma3, hf=bp.load_hf_twin(hf_gemma3))
    out = pw._transformers(runners, ids)
    theirs = pw._transformers_readout(runners, out, ids, layers)
    ours = pw._kvnotes_readout(runners, pw._kvnotes(runners, ids), ids, layers)
    window = hf_gemma3.window(layers[0])
    assert [k.shape[1] for k in theirs.keys] == [window - 1, 40]
    assert [k.shape[1] for k in ours.keys] == [40, 40]
    logit, kv = pw.diffs(theirs, ours)
    assert logit < 1e-3 and kv < 1e-4


def _fresh_cache_per_chunk(r, ids):
    """A planted bug: each chunk prefilled into a cache of its own, blind to the chunks before."""
    from transformers import DynamicCache

    chunk = pw.engine.PREFILL_CHUNK
    with torch.inference_mode():
        for a in range(0, len(ids), chunk):
            piece = torch.tensor([ids[a : a + chunk]])
            out = r.hf(
                input_ids=piece, cache=DynamicCache(config=r.hf.config), use_cache=True, logits_to_keep=1
            )
    return out


@pytest.mark.parametrize("planted", [None, _fresh_cache_per_chunk], ids=["as-built", "fresh-cache-per-chunk"])
def test_transformers_fed_in_chunks_equals_one_forward(hf_gemma3, monkeypatch, planted):
    """Chunks of 32 over 96 tokens (three chunks; sliding windows of 8): the chunked way's logits
    and sliding/global K/V equal the unchunked forward's, to the tolerances above (float32
    attention summed in another order); a chunked prefill that forgets the earlier chunks fails."""
    monkeypatch.setattr(pw.engine, "PREFILL_CHUNK", 32)
    ids = context_ids(hf_gemma3, 96)
    layers = bp.compared_layers(hf_gemma3)
    runners = bp.Runners(model=hf_gemma3, hf=bp.load_hf_twin(hf_gemma3))
    chunked = planted or pw._transformers_chunked
    theirs = pw._transformers_readout(runners, chunked(runners, ids), ids, layers)
    whole = pw._transformers_readout(runners, pw._transformers(runners, ids), ids, layers)
    ours = pw._kvnotes_readout(runners, pw._kvnotes(runners, ids), ids, layers)  # chunked too
    agree = [pw.diffs(theirs, ref) for ref in (whole, ours)]
    ok = all(logit < 1e-3 and kv < 1e-4 for logit, kv in agree)
    assert ok == (planted is None), agree


def test_the_report_has_the_documented_keys_and_round_trips(report):
    d = json.loads(json.dumps(report.to_dict()))
    assert {"model", "machine", "memory_method", "results", "exponents"} <= set(d)
    assert all(POINT_KEYS <= set(p) for p in d["results"])
    assert all(WAY_KEYS <= set(w) for p in d["results"] for w in p["ways"])
    assert set(d["exponents"]) == set(bp.WAYS)  # None with a single length
    for w in report.results[0].ways:
        assert w.min_s <= w.seconds <= w.max_s and w.peak_mib >= 0 and w.tokens_per_s > 0
    back = PrefillReport.from_dict(d)
    assert back == report and back.to_dict() == d
    assert "transformer_lens" in report.table()


def test_context_starts_with_bos_and_has_the_length(hf_gemma3):
    ids = context_ids(hf_gemma3, 96)
    assert len(ids) == 96 and ids[0] == hf_gemma3.tokenizer.bos_token_id


def test_cli_writes_the_json_with_the_transformers_way_skipped_and_named(tmp_path):
    out = tmp_path / "prefill.json"
    argv = ["bench", "prefill", "--model", "tiny-gemma3", "--lengths", "64,128", "--repeats", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [p["tokens"] for p in d["results"]] == [64, 128]
    for p in d["results"]:
        assert [w["name"] for w in p["ways"]] == ["kvnotes", "transformer_lens"]
        assert "no Hugging Face twin" in p["skipped"]["transformers"]
        assert "no Hugging Face checkpoint" in p["skipped"]["kvnotes_nnsight"]
    # two lengths: a growth exponent for each way that ran, none for the skipped one
    assert d["exponents"]["transformers"] is None
    assert all(isinstance(d["exponents"][w], float) for w in ("kvnotes", "transformer_lens"))
    assert PrefillReport.from_dict(d).to_dict() == d


def test_lengths_beyond_the_context_or_free_memory_are_skipped_with_the_reason(monkeypatch):
    model = get_model("tiny-llama")
    monkeypatch.setattr(bp, "available_bytes", lambda device: 2**20)  # 1 MiB free
    report = prefill_bench(model, [64, model.n_ctx + 1], repeats=1, progress=False)
    short, long = report.results
    assert [w.name for w in short.ways] == ["kvnotes"]
    assert "run_with_cache would need about" in short.skipped["transformer_lens"]
    assert long.ways == [] and set(long.skipped) == set(bp.WAYS)
    assert all("n_ctx=512" in long.skipped[w] for w in ("kvnotes", "transformer_lens"))


def test_the_subprocess_fallback_measures_where_the_peak_cannot_be_reset(monkeypatch):
    """Where /proc/self/clear_refs is not writable: one spawned process per way and length."""
    monkeypatch.setattr(bp, "memory_method", lambda device: bp.RUSAGE)
    report = prefill_bench(get_model("tiny-llama"), [64], repeats=1, progress=False)
    assert report.memory_method == bp.RUSAGE
    kvnotes, tl = report.results[0].ways
    assert (kvnotes.name, tl.name) == ("kvnotes", "transformer_lens")
    assert tl.max_abs_logit_diff < 1e-4 and tl.peak_mib >= 0


def test_bench_prefill_is_a_registered_benchmark():
    a = get("prefill")
    assert a.section == "bench" and not a.in_report and a.result is PrefillReport
    assert a.make_config().lengths == (1024, 4096, 8192) and a.make_config().repeats == 3
