"""Gated-decision tasks (built in, or from a TOML file) and their aligned prompt pairs; pair
datasets (clean/corrupt prompts with per-pair answers, from JSONL) that stand in for a task."""

from kvnotes.tasks.pairs import PairRecord, PairSet, load_pairs
from kvnotes.tasks.sampler import GATE, RULE, Pair, render, sample
from kvnotes.tasks.task import (
    Digits,
    Gate,
    Rule,
    Shots,
    Task,
    TaskError,
    TaskSource,
    Variant,
    builtin_tasks,
    load_gated_task,
    load_task,
)

__all__ = [
    "Task",
    "TaskSource",
    "Gate",
    "Rule",
    "Shots",
    "Variant",
    "Digits",
    "TaskError",
    "load_gated_task",
    "load_task",
    "builtin_tasks",
    "Pair",
    "sample",
    "render",
    "GATE",
    "RULE",
    "PairSet",
    "PairRecord",
    "load_pairs",
]
