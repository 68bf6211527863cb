"""`kvnotes circuits`: the whole run on an organism writes every analysis under its name, and bad
input fails fast with a clear message."""

from __future__ import annotations

import json

from circuits import SectionReport
from kvnotes.cli import main
from tests.helpers import readings


def test_circuits_command_writes_every_analysis(tmp_path, notes_organism, capsys):
    out = tmp_path / "circuits.json"
    rc = main(["circuits", "--model", "notes-organism", "--n", "4", "--draws", "4", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    a = d["results"]  # every section's report keeps its analyses under one key
    assert {"ranking", "topk_curve", "random_curve"} <= set(a["read_heads"])
    assert "write_heads" in a and "scrubbing" in a
    assert {"rank_correlation", "speedup"} <= set(a["attribution"])
    assert {"best_auc", "single_feature_recovery", "topk_curve", "reconstruction"} <= set(a["sae"])
    assert a["read_heads"]["details"]["grouping"]["n_kv_heads"] == notes_organism.n_kv_heads
    assert SectionReport.from_dict(d).to_dict() == d
    printed = capsys.readouterr().out
    assert "read_heads.top_k" in printed
    said = readings(printed)  # one line of conclusion per analysis, as its page reads it
    assert {"read_heads", "write_heads", "scrubbing", "attribution", "sae"} <= set(said), said


def test_unknown_analysis_is_refused_before_loading_the_model(capsys):
    assert main(["circuits", "--model", "org/no-such-model", "--only", "read_heads,heads"]) == 2
    err = capsys.readouterr().err
    assert "heads" in err and "read_heads" in err and "write_heads" in err


def test_circuits_command_uses_a_saved_sae_and_refuses_a_missing_one(tmp_path, notes_organism, capsys):
    from circuits.sae import SAEConfig, train_sae

    sae = train_sae(
        notes_organism,
        "notes-organism",
        SAEConfig(layer=0, n_train_pairs=8, training_samples=4096),
        progress=False,
    )
    sae.save_model(tmp_path / "sae")
    out = tmp_path / "sae.json"
    rc = main(
        [
            "circuits",
            "--model",
            "notes-organism",
            "--only",
            "sae",
            "--n",
            "4",
            "--sae",
            str(tmp_path / "sae"),
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    d = json.loads(out.read_text())["results"]["sae"]
    assert d["details"]["hook_name"] == "blocks.0.hook_resid_post"
    assert "train" not in d["details"]["seconds"]  # the saved SAE, not a new one
    assert (
        main(
            [
                "circuits",
                "--model",
                "notes-organism",
                "--only",
                "sae",
                "--sae",
                str(tmp_path / "nothing-here"),
            ]
        )
        == 2
    )
    assert "nothing-here" in capsys.readouterr().err
