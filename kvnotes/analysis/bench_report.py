"""Reports of timed points: every bench's (kvnotes.bench, circuits' edge benches) and the placement
probe's: `BenchReport` (a dataclass of `POINT`s under the result protocol), `machine()` and
`header()`. Here, not in kvnotes/bench, because circuits and probes may not import kvnotes.bench.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Mapping
from typing import ClassVar

from kvnotes.display import Displayable


def machine() -> str:
    """The machine a timing was computed on, as a report's header shows it: architecture, cores,
    the torch version and its thread count (what a CPU timing depends on)."""
    import torch

    return (
        f"{platform.machine()} {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)"
    )


def header(*parts: str) -> str:
    """A bench report's first line: its title, the model, the machine and any more, dash-separated."""
    return " — ".join(parts)


class BenchReport(Displayable):
    """A report dataclass whose `results` are `POINT` dataclasses, following the result protocol:
    `to_dict`, `from_dict(d)` and a notebook view."""

    POINT: ClassVar[type]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)  # type: ignore[call-overload]  # each report class is a dataclass

    @classmethod
    def from_dict(cls, d: Mapping) -> BenchReport:
        return cls(**{**d, "results": [cls.POINT(**r) for r in d["results"]]})
