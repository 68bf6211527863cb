"""`kvnotes export`: a model as a Hugging Face checkpoint directory a server can load."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from kvnotes.errors import KVNotesError
from kvnotes.zoo import load_model
from kvnotes.zoo.export import STAMP, cached, export, is_export_of
from kvnotes.zoo.hf import load_hf
from tests.test_verify import _checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "gemma3-text")


@pytest.fixture(scope="module")
def tiny_gemma3(checkpoint):
    return load_hf(str(checkpoint))


def test_the_export_loads_back_with_the_same_weights_and_forward(tiny_gemma3, tmp_path):
    out = export(tiny_gemma3, tmp_path / "ckpt", progress=False)
    assert is_export_of(out, tiny_gemma3) and (out / "config.json").is_file()
    back = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    ref = tiny_gemma3.hf_source.load()
    ids = torch.tensor([tiny_gemma3.encode("order 12 shipped, cancel?")])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, rtol=0, atol=0)
    assert (
        tf.AutoTokenizer.from_pretrained(out)("hi")["input_ids"] == tiny_gemma3.tokenizer("hi")["input_ids"]
    )
    # cached() reuses a finished export of the same model instead of writing it again
    stamp = (out / STAMP).stat().st_mtime_ns
    assert cached(tiny_gemma3, tmp_path / "root", progress=False).name == tiny_gemma3.name.replace("/", "--")
    assert export(tiny_gemma3, out, progress=False) == out  # an earlier export is replaced
    assert (out / STAMP).stat().st_mtime_ns >= stamp


def test_export_refuses_what_it_cannot_or_should_not_write(tiny_gemma3, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(KVNotesError, match="not an earlier kvnotes export"):
        export(tiny_gemma3, busy, progress=False)
    assert (busy / "notes.txt").read_text() == "mine"
    with pytest.raises(KVNotesError, match="no Hugging Face counterpart"):
        export(load_model("tiny-llama"), tmp_path / "x", progress=False)


def test_cli_export(checkpoint, tmp_path, capsys):
    from kvnotes.cli import main

    assert main(["export", "--model", str(checkpoint), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "backend"),
    [("tiny-gpt2", "transformer-lens"), ("tiny-gpt2", "nnsight"), ("gemma3-text", "nnsight")],
)
def test_cli_export_writes_the_dtype_and_honours_the_backend_asked_for(checkpoint, tmp_path, name, backend):
    """`--dtype bfloat16` writes bfloat16 weights (the model's own, which its stamp's fingerprint
    names), on either backend: tiny-gpt2 is built in float32 and cast after loading (its
    transformers twin loads in float32), a checkpoint directory loads in bfloat16 directly."""
    from safetensors import safe_open

    from kvnotes.cli import main

    model_name = str(checkpoint) if name == "gemma3-text" else name
    out = tmp_path / "out"
    argv = ["export", "--model", model_name, "--dtype", "bfloat16", "--backend", backend, str(out)]
    assert main(argv) == 0
    with safe_open(out / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    assert dtypes == {"BF16"}
    half = load_model(model_name, backend=backend, dtype="bfloat16")
    assert is_export_of(out, half) and not is_export_of(out, load_model(model_name, backend=backend))
