"""Errors that name what was wrong and the way out. All are ValueErrors, so callers can catch broadly."""

from __future__ import annotations


class KVNotesError(ValueError):
    """Base class of every kvnotes input error."""


class UnknownModelError(KVNotesError):
    """A model name that is neither built in, a local directory, nor reachable on the hub."""


class UnknownTaskError(KVNotesError):
    """A task name that is not built in and not a task file."""


class TaskError(KVNotesError):
    """A task file (or Task) whose keys are missing, mistyped or inconsistent."""


class FingerprintMismatch(KVNotesError):
    """Two notebooks (or a notebook and a model) come from different models or tokenizers."""


class TokenCountChanged(KVNotesError):
    """A field value that changes the prompt's token count, so slots no longer line up."""


class OutOfRange(KVNotesError):
    """A position, layer or head index outside what the model or notebook has."""


class CorruptNotebook(KVNotesError):
    """A saved notebook that cannot be read back faithfully."""


class UnsupportedArchitecture(KVNotesError):
    """A model whose attention the notebook engine cannot represent exactly."""


class MissingDependency(KVNotesError):
    """An optional package that a feature needs is not installed."""


class OrganismNotConverged(KVNotesError):
    """A model organism whose training did not reach its accuracy and margin from any seed tried."""
