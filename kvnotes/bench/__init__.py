"""Benchmarks: each puts kvnotes and the strongest other way side by side in one process and
prints the ratio. Nothing in the engine imports this package.

- `common`: what they share: the machine, the report header and JSON, the growth exponent.
- `sweep`: the per-slot transplant sweep (`kvnotes bench patch-sweep`), with the floor.
- `baselines`: the peer libraries' strongest ways to run the same sweep.
- `prefill`: prefill speed and peak memory against transformers (`kvnotes bench prefill`);
  `prefill_ways` the ways it runs, `memory` how peak memory is measured.
- `ttft`: time to first token, composed vs prefix-cached vs full (`kvnotes bench ttft`);
  `multihost` the case it times: one precompiled chunk after several hosts.
- `edit_cost`: erratum vs suffix recompute vs full prefill for one edit (`kvnotes bench edit-cost`).
- `serve`: the erratum pattern against a real vLLM server (`kvnotes bench serve`);
  `serve_workload` its sessions and schedule, `serve_client` its requests, `served_agent` the
  agent loop on the server.
"""

from kvnotes.analysis.registry import MODEL, Section, register_section

# declared here, before any bench module registers an analysis in it
register_section(
    Section(
        "bench",
        "Benchmarks",
        level=MODEL,
        command="bench",
        help="benchmarks: two ways side by side, with the ratio",
        order=60,
    )
)
