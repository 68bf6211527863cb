"""Devices and dtypes: `load_model(device=, dtype=)` and `--device` / `--dtype`, refused in one line
before any load where the device is absent or the dtype unsupported; and the engine's guard, under
which the probes, a sweep, an edit, a splice and the edge circuits run in bfloat16 without a tensor
made on another device or in another dtype."""

from __future__ import annotations

import contextlib
import io

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
