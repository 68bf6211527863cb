"""Devices and dtypes: `load_model(device=, dtype=)` and `--device` / `--dtype`, refused in one line
before any load where the device is absent or the dtype unsupported; and the engine's guard, under
which the probes, a sweep, an edit, a splice and the edge circuits run in bfloat16 without a tensor
made on another device or in another dtype."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from kvnotes.errors import BadArgument
from kvnotes.zoo import load_model

ABSENT = [
    {"device": "cuda"},  # this machine's torch has no CUDA (skipped where it has)
    {"device": f"cuda:{torch.cuda.device_count()}"},  # one past the last CUDA device
    {"device": "mps"},
    {"device": "tpu"},
    {"dtype": "int8"},
    {"dtype": "float64"},
    {"dtype": torch.float64},
]


def _no_loader(monkeypatch) -> None:
    """Every loader fails the test if it is called: a refusal must come before any of them."""

    def refuse(*a, **k):
        raise AssertionError("a loader ran before the device/dtype check")

    for module, name in [
        ("kvnotes.zoo.tiny", "build_tiny"),
        ("kvnotes.zoo.tiny", "build_tiny_hf"),
        ("kvnotes.zoo.gemma", "load_gemma_270m"),
        ("kvnotes.zoo.organisms", "load_organism"),
        ("kvnotes.zoo.nnsight", "load_nnsight"),
        ("kvnotes.zoo.hf", "load_hf"),
    ]:
        monkeypatch.setattr(f"{module}.{name}", refuse)


@pytest.mark.parametrize("bad", ABSENT, ids=[str(b) for b in ABSENT])
@pytest.mark.parametrize("name, backend", [("tiny-llama", "transformer-lens"), ("tiny-gpt2", "nnsight")])
def test_an_absent_device_or_unsupported_dtype_is_refused_before_any_load(bad, name, backend, monkeypatch):
    if bad.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if bad.get("device") == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    _no_loader(monkeypatch)
    with pytest.raises(BadArgument) as e:
        load_model(name, backend=backend, **bad)
    message = str(e.value)
    assert "\n" not in message and ("give" in message), message


@pytest.mark.low_precision
def test_loaders_place_the_model_and_the_fingerprint_follows_the_dtype_only():
    base = load_model("tiny-llama")
    assert (base.device, base.dtype) == (torch.device("cpu"), torch.float32)
    same = load_model("tiny-llama", device=torch.device("cpu"), dtype="float32")
    assert same.fingerprint == base.fingerprint  # the device (and the spelling) leaves it alone
    half = load_model("tiny-llama", dtype="bfloat16")
    assert half.dtype == torch.bfloat16 and half.tl.cfg.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in half.tl.parameters())
    assert half.fingerprint != base.fingerprint  # a float32 notebook is refused by the bfloat16 model
    # the same weights, rounded once: bfloat16 keeps 8 bits of mantissa, so within 2^-8 relative
    w32, w16 = base.tl.embed.W_E, half.tl.embed.W_E.float()
    assert torch.allclose(w16, w32, rtol=2**-8, atol=0)


@pytest.mark.parametrize(
    "name, backend",
    [
        ("tiny-gemma3", "transformer-lens"),
        ("tiny-gpt2", "transformer-lens"),
        ("mixed-organism-25", "transformer-lens"),
        ("gated-organism", "transformer-lens"),
        ("null-organism", "transformer-lens"),
        ("tiny-gpt2", "nnsight"),
    ],
)
def test_every_loader_takes_device_and_dtype(name, backend):
    model = load_model(name, backend=backend, device="cpu", dtype="float16")
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("backend", ["transformer-lens", "nnsight"])
def test_a_checkpoint_directory_loads_in_the_dtype_asked_for(backend, tmp_path):
    from kvnotes.zoo.export import export

    out = export(load_model("tiny-gpt2"), tmp_path / "tiny-gpt2", progress=False)
    model = load_model(str(out), backend=backend, device="cpu", dtype="bfloat16")
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.bfloat16)
    assert model.fingerprint != load_model(str(out), backend=backend).fingerprint


def test_a_cached_tracr_model_stays_float32():
    pytest.importorskip("tracr")
    half = load_model("tracr-count", dtype="bfloat16")
    again = load_model("tracr-count")
    assert type(half).__name__ == "TracrModel" and half.dtype == torch.bfloat16
    assert again.dtype == torch.float32 and half.fingerprint != again.fingerprint


def _cli(argv: list[str]) -> tuple[int, str]:
    from kvnotes.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "--model", "tiny-llama", "--device", "cuda"],
        ["probe", "field_refresh", "--model", "tiny-llama", "--device", "cuda:0"],
        ["verify", "--model", "tiny-llama", "--dtype", "int8"],
        ["verify", "--model", "tiny-llama", "--device", "gpu"],
    ],
)
def test_the_cli_refuses_an_absent_device_in_one_line_before_any_load(argv, monkeypatch):
    _no_loader(monkeypatch)
    code, err = _cli(argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert argv[-1] in lines[0], lines[0]


def test_every_command_with_a_model_takes_device_and_dtype():
    from tests.test_cli_options import PARSER, _leaves

    missing = []
    for words, leaf in _leaves(PARSER):
        flags = {s for a in leaf._actions for s in a.option_strings}
        if "--model" in flags and not {"--device", "--dtype"} <= flags:
            missing.append(" ".join(words))
    assert missing == []


def test_the_cli_accepts_what_load_model_accepts():
    """`--device` / `--dtype` spell their choices without torch (a refusal imports none); they are
    the loaders' own."""
    from kvnotes.args import DEVICE, DTYPE
    from kvnotes.models.placement import DEVICE_KINDS, DTYPES

    assert DTYPE.names == tuple(DTYPES) and DEVICE.names == DEVICE_KINDS


# --- every operation on the model's device and dtype: the guard ----------------------------------
@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gemma3"])
def half(request):
    return load_model(request.param, dtype="bfloat16")


def _ops(model) -> dict:
    """The probe set, a patch sweep, an edit, a splice and the edge circuits, small: each result's
    numbers, to check they are finite."""
    import circuits.edges as E
    from kvnotes.bench.sweep import patch_sweep
    from kvnotes.ops import append, decide, precompile, prefill, refresh, splice
    from probes import field_refresh, knockout, make_trials, note_map, notes_transplant

    trials = make_trials(model, "order-cancel", 2, progress=False)
    probes = {
        "field_refresh": field_refresh(trials, min_effect=0.0),
        "notes_transplant": notes_transplant(trials, min_effect=0.0),
        "note_map": note_map(trials, min_effect=0.0),
        "knockout": knockout(trials, k=2, draws=2, min_effect=0.0),
    }
    out = {k: [v for e in r.parts.values() for v in e.values if v is not None] for k, r in probes.items()}
    sweep = patch_sweep(model, 40, n_slots=4, repeats=1, baselines=(), progress=False)
    out["sweep"] = [sweep.max_recovery_diff, sweep.max_logit_diff]
    t = trials[0]
    erratum = append(model, t.old_nb, " [STATE UPDATE] order_status -> shipped.", span="erratum")
    out["erratum"] = decide(model, erratum, t.pair.old, vocab=t.pair.answers).last[0].tolist()
    refreshed = refresh(model, t.old_nb, t.pair.new, t.pair.changed)
    out["refresh"] = decide(model, refreshed, t.pair.new, vocab=t.pair.answers).last[0].tolist()
    host = prefill(model, "Policy: an order may be cancelled while pending.")
    chunk = precompile(model, model.encode(" Refunds are allowed within 30 days.", bos=False))
    spliced = splice(model, host, chunk, seam=2)
    assert spliced.keys[0].dtype == model.dtype and spliced.n_slots == host.n_slots + chunk.n_slots
    out["splice"] = spliced.keys[-1].flatten().tolist()
    site = E.edge_patcher(model, t.pair)
    out["eap-ig"] = E.score_edges(site, "eap-ig", steps=2).scores.tolist()
    out["atp*"] = E.score_edges(site, "atp*").scores.tolist()
    out["exact"] = site.exact([0, 1, 2]).tolist()
    return out


@pytest.mark.low_precision
def test_probes_sweep_edit_splice_and_edges_stay_in_bfloat16_on_the_device(half):
    from kvnotes.engine.guard import guard

    with guard(half) as violations:
        out = _ops(half)
    assert violations == []
    for name, values in out.items():
        flat = [float(v) for v in (values if hasattr(values, "__iter__") else [values])]
        assert flat and all(math.isfinite(v) for v in flat), name


def _plant(monkeypatch, module: str, name: str, extra) -> None:
    """Wrap `module.name` so that it also runs `extra(model)` (the planted mismatch) each call."""
    import importlib

    mod = importlib.import_module(module)
    real = getattr(mod, name)

    def planted(model, *a, **k):
        extra(model)
        return real(model, *a, **k)

    monkeypatch.setattr(mod, name, planted)


PLANTS = {
    "float32 zeros": lambda m: torch.zeros(3, dtype=torch.float32, device=m.device),
    "float64 upcast": lambda m: m.tl.embed.W_E[:2].double(),
    "moved to meta": lambda m: m.tl.embed.W_E[:2].to("meta"),
    "a float with no device": lambda m: torch.full((2,), 1.0, dtype=m.dtype),
    "a host index cast to float": lambda m: torch.nn.functional.one_hot(torch.tensor([0, 1]), 3).to(m.dtype),
}


@pytest.mark.parametrize("plant", PLANTS, ids=list(PLANTS))
def test_a_planted_device_or_dtype_mismatch_fails_the_guard(plant, monkeypatch):
    from kvnotes.engine.guard import PlacementError, guard
    from kvnotes.ops import prefill

    model = load_model("tiny-llama", dtype="bfloat16")
    _plant(monkeypatch, "kvnotes.ops", "query_tokens", PLANTS[plant])
    from kvnotes.ops import decide

    nb = prefill(model, "The order has shipped. Can it be cancelled?")
    with pytest.raises(PlacementError) as e, guard(model):
        decide(model, nb, " Answer:")
    assert "test_device_dtype.py" in str(e.value)  # it names where the tensor was made


def test_a_caught_violation_is_raised_again_when_the_guard_exits():
    from kvnotes.engine.guard import PlacementError, guard

    model = load_model("tiny-llama", dtype="bfloat16")
    with pytest.raises(PlacementError, match="1 placement violation"), guard(model):
        try:
            torch.ones(2, dtype=torch.float32, device=model.device)
        except PlacementError:
            pass  # code that swallows it does not hide it


def test_allowed_upcasts_and_exits_pass_the_guard():
    from kvnotes.engine.guard import allow, guard
    from kvnotes.metrics import logit_diff, recovery

    model = load_model("tiny-llama", dtype="bfloat16")
    logits = torch.randn(2, 8, device=model.device).to(model.dtype)  # made outside the guard
    with guard(model) as violations:
        ld = logit_diff(logits, (0, 1))  # float64: the metrics' allowance
        r = recovery(ld, 0.0, 1.0)  # floats join the metric's device
        with allow(torch.float32):
            logits.float()
        idx = torch.arange(3)  # an integer index may stay on the CPU
        values = logits[0, idx].cpu().tolist() + [logits[0, 0].item()]
    assert violations == [] and ld.dtype == torch.float64 and r.shape == (2,) and len(values) == 4


def test_the_guard_checks_the_pair_it_is_given():
    from kvnotes.engine.guard import PlacementError, guard

    model = load_model("tiny-llama")  # float32
    with guard(model):
        torch.zeros(2, device=model.device)
    with pytest.raises(PlacementError, match="on cpu; the model is on meta"), guard(model, device="meta"):
        torch.zeros(2, device="cpu")
    with pytest.raises(PlacementError, match="float16"), guard(model, dtype=torch.float16):
        torch.zeros(2, device=model.device)
