"""Errors that name what was wrong and the way out. All are ValueErrors, so callers can catch broadly.
Also the one warning a figure carries (SmallEffect) and the threshold it is read against."""

from __future__ import annotations

MIN_EFFECT = 0.1
"""Logits. A pair whose decision moves less is left out of every analysis, and a recovery read on a
smaller change warns (SmallEffect): its ratio of two small differences is mostly noise."""


class SmallEffect(UserWarning):
    """A figure read on a change smaller than MIN_EFFECT (what the analyses would leave out)."""


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


class NotebookNotFound(KVNotesError, FileNotFoundError):
    """A notebook path with no file at it."""


class UnsupportedArchitecture(KVNotesError):
    """A model whose attention the notebook engine cannot represent exactly."""


class MissingDependency(KVNotesError):
    """An optional package that a feature needs is not installed."""


class OrganismNotConverged(KVNotesError):
    """A model organism whose training did not reach its accuracy and margin from any seed tried."""


class BadArgument(KVNotesError):
    """An option or argument value that kvnotes cannot use (an empty list, a count below 1, ...)."""


class BadArgumentType(KVNotesError, TypeError):
    """An argument of a kind the call cannot take (raw text where a Prompt is needed, ...)."""


class ShapeMismatch(KVNotesError):
    """Notebooks, tokens or positions whose counts or batch sizes do not line up."""


class DeviceMismatch(KVNotesError):
    """A notebook whose tensors are on another device than the model."""


class TemplateError(KVNotesError):
    """A prompt template whose fields or [[spans]] are malformed."""


class UnknownField(KVNotesError, KeyError):
    """A field or span name that the template, prompt or notebook does not have."""

    __str__ = BaseException.__str__  # the message as written, not KeyError's quoted repr


class UnsupportedTokenizer(KVNotesError, TypeError):
    """A model whose tokenizer gives no character offsets (not a fast tokenizer)."""


class NoRendererError(KVNotesError):
    """No package that renders kvnotes results is installed."""


class UnknownSAEError(KVNotesError):
    """An SAE source that is neither a local sae-lens directory nor a loadable pretrained release."""


class SAEMismatch(KVNotesError):
    """An SAE that does not fit the model or the analysis (another width, hook or layer)."""


class PromptAttributionError(KVNotesError):
    """A prompt, counterfactual or answer pair that `attribute_prompt` cannot attribute."""


class ResultSchemaError(KVNotesError):
    """Saved result data whose keys or types do not match the result class that reads it."""


class ReportFileError(KVNotesError):
    """A report.json (or a saved part) that kvnotes cannot read."""


class UnknownAnalysisError(KVNotesError):
    """An analysis or section name that the registry does not have."""


class BadOption(KVNotesError):
    """An analysis option (a config field) that does not exist or has a value it cannot take."""


class MissingCapability(UnsupportedArchitecture, BadArgument):
    """An operation the model's backend cannot do (weight edits on nnsight); names a backend that can."""


class PairsError(KVNotesError):
    """A pair dataset (JSONL) line that is malformed or does not fit the model's tokenizer."""


class NeedUnmet(KVNotesError):
    """An analysis refused before any compute: its task or model lacks what it needs (a rule, rotary keys)."""
