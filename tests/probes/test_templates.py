"""Intervals over templates: the two-stage cluster bootstrap, its labels in JSON, and `--template`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvnotes.analysis.stats import Curve, Estimate, bootstrap_ci, cluster_bootstrap_ci
from kvnotes.analysis.trials import PairOptions
from kvnotes.errors import BadOption


def test_clustered_ci_is_wider_when_values_agree_within_templates():
    # three templates, each homogeneous, far apart: 12 pairs that are really about 3 draws
    x = [0.0, 0.05, 0.1, 0.0, 1.0, 1.05, 0.95, 1.0, 2.0, 2.1, 1.9, 2.0]
    labels = [0] * 4 + [1] * 4 + [2] * 4
    naive, clustered = Estimate.of(x), Estimate.of(x, clusters=labels)
    assert clustered.mean == naive.mean
    width = lambda e: e.ci[1] - e.ci[0]  # noqa: E731
    assert width(clustered) > 2 * width(naive)
    assert clustered.ci[0] <= clustered.mean <= clustered.ci[1]
    assert clustered.ci == Estimate.of(x, clusters=labels).ci  # seeded


def test_one_cluster_gives_todays_ci_exactly():
    x = np.random.default_rng(3).normal(size=20).tolist()
    assert Estimate.of(x, clusters=[2] * 20).ci == Estimate.of(x).ci == bootstrap_ci(x)
    assert Estimate.of(x, clusters=[2] * 20).clusters == (2,) * 20


def test_clustered_ci_matches_a_slow_two_stage_bootstrap():
    rng = np.random.default_rng(0)
    x = rng.normal(size=30) + np.repeat([0.0, 0.5, 1.5], 10)
    labels = np.repeat([0, 1, 2], 10)
    lo, hi = cluster_bootstrap_ci(x.tolist(), labels.tolist())
    means = []
    for _ in range(2000):  # the same scheme, one resample at a time
        picked = rng.integers(0, 3, size=3)
        drawn = np.concatenate([rng.choice(x[labels == c], size=10) for c in picked])
        means.append(drawn.mean())
    ref = np.quantile(means, [0.025, 0.975])
    assert abs(lo - ref[0]) < 0.1 and abs(hi - ref[1]) < 0.1


def test_dropped_values_drop_their_labels():
    e = Estimate.of([1.0, None, float("nan"), 2.0, 3.0], clusters=[0, 1, 1, 1, 2])
    # exact: the values given
    assert e.values == (1.0, 2.0, 3.0) and e.clusters == (0, 1, 2) and e.dropped == 2
    with pytest.raises(ValueError, match="2 cluster labels for 3 values"):
        Estimate.of([1.0, 2.0, 3.0], clusters=[0, 1])


def test_clusters_round_trip_through_json_and_old_json_loads():
    e = Estimate.of([0.1, 0.2, 0.9, None], clusters=[0, 0, 1, 1])
    d = json.loads(json.dumps(e.to_dict()))
    assert d["clusters"] == [0, 0, 1] and Estimate.from_dict(d) == e
    plain = Estimate.of([0.1, 0.2])
    assert "clusters" not in plain.to_dict() and Estimate.from_dict(plain.to_dict()) == plain
    old = {"mean": 0.15, "ci": [0.1, 0.2], "values": [0.1, 0.2]}  # written before clusters existed
    assert Estimate.from_dict(old).clusters is None
    c = Curve.of("k", [1, 2], [[0.1, 0.3, 0.5], [0.2, None, 0.6]], clusters=[0, 1, 1])
    again = Curve.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and again.points[1].clusters == (0, 1)
    assert "clusters" not in Curve.of("k", [1], [[0.1, 0.2]]).to_dict()


def test_template_option_is_checked():
    assert PairOptions().template is None and PairOptions(template=2).template == 2
    with pytest.raises(BadOption, match="template"):
        PairOptions(template=-1)


def test_report_config_sets_the_template():
    from kvnotes.analysis.report import ReportConfig

    cfg = ReportConfig.full(template=1)
    assert cfg.config("field_refresh").template == 1 and cfg.config("read_heads").template == 1
    assert ReportConfig.full().config("field_refresh").template is None


def test_probe_cli_keeps_to_one_template(tmp_path):
    from kvnotes.cli import main

    out = tmp_path / "probes.json"
    argv = ["probe", "all", "--model", "tiny-llama", "--task", "order-cancel", "--n", "2", "--template", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["meta"]["configs"]["field_refresh"]["template"] == 1
    effect = d["results"]["field_refresh"]["effect"]
    assert effect["clusters"] == [1, 1]  # both pairs from template 1
    assert main([*argv[:-1], "9"]) == 2  # out of range: an error that names the count
