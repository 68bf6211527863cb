"""Gated-decision tasks (built in, or from a TOML file) and their aligned prompt pairs."""

from kvnotes.tasks.sampler import GATE, RULE, Pair, render, sample
from kvnotes.tasks.task import (
    Digits,
    Gate,
    Rule,
    Shots,
    Task,
    TaskError,
    Variant,
    builtin_tasks,
    load_task,
)

__all__ = [
    "Task",
    "Gate",
    "Rule",
    "Shots",
    "Variant",
    "Digits",
    "TaskError",
    "load_task",
    "builtin_tasks",
    "Pair",
    "sample",
    "render",
    "GATE",
    "RULE",
]
