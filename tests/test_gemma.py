"""The embedded real model, Gemma 3 270M: the conformance suite on real weights, spans under its
real tokenizer, and the converted-weights cache. Marked `gemma`; part of the default suite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvnotes.conformance import verify
from kvnotes.errors import TokenCountChanged
from kvnotes.models import load_model
from kvnotes.prompt import Template

pytestmark = pytest.mark.gemma


@pytest.fixture(scope="module")
def gemma():
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # one real model: use every core
    yield load_model("gemma-3-270m")
    torch.set_num_threads(threads)


def test_all_eight_invariants_pass_on_real_weights_past_the_sliding_window(gemma):
    report = verify(gemma, progress=False)
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
    tpl = Template("[[rule:Deny once shipped.]]\nCustomer: {name}, order_status: {order_status}.\n"
                   "[[query:Q: cancel or deny?]]\n[[decision:A:]]")
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
    code = "from kvnotes.models import load_model; m = load_model('gemma-3-270m'); print(m.fingerprint)"
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
