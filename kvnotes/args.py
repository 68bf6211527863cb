"""Command-line value types that refuse a bad value where it is parsed, before any model loads.

Each is an argparse `type=`: a count below its least, a list with one such count, or a path that
cannot be written is refused with one line naming the value and the way out (`kvnotes` prints it
and exits 2). They carry their bounds (`Bounded.least`) so the tests can drive every option of
every command with a value just out of range.

    >>> Bounded(int, least=1)("3"), Bounded(int, least=1, many=True)("256,1024")
    (3, (256, 1024))
    >>> Bounded(int, least=1)("-5")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: -5 is below 1; give an integer of at least 1
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Bounded:
    """A number (or, with `many`, a comma-separated list of them) in [least, most]."""

    kind: type  # int or float
    least: int | float | None = None
    most: int | float | None = None
    many: bool = False

    @property
    def __name__(self) -> str:  # argparse names the type in some of its messages
        return f"{'list of ' if self.many else ''}{self.kind.__name__}"

    def __call__(self, text: str):
        if self.many:
            items = [x.strip() for x in text.split(",") if x.strip()]
            return tuple(self.one(x) for x in items)
        return self.one(text)

    def one(self, text: str):
        what = "an integer" if self.kind is int else "a number"
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}{self._range()}") from None
        try:
            self.check(value, shown=text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    def check(self, value, shown: str | None = None) -> None:
        """Raise ValueError, naming the range, where `value` (with `many`, each item of a tuple) is
        not a finite number of this kind inside it; `Options` checks config fields with this."""
        what = "an integer" if self.kind is int else "a number"
        for x in value if self.many and isinstance(value, tuple) else (value,):
            shown_x = shown if shown is not None else repr(x)
            kinds = int if self.kind is int else int | float
            if not isinstance(x, kinds) or isinstance(x, bool) or not math.isfinite(x):
                raise ValueError(f"{shown_x} is not {what}{self._range()}")
            if self.least is not None and x < self.least:
                raise ValueError(f"{shown_x} is below {self.least}; give {what}{self._range()}")
            if self.most is not None and x > self.most:
                raise ValueError(f"{shown_x} is above {self.most}; give {what}{self._range()}")

    def _range(self) -> str:
        if self.least is not None and self.most is not None:
            return f" from {self.least} to {self.most}"
        if self.least is not None:
            return f" of at least {self.least}"
        if self.most is not None:
            return f" of at most {self.most}"
        return ""


COUNT = Bounded(int, least=1)  # pairs, repeats, slots, steps: at least one
SEED = Bounded(int, least=0)
PORT = Bounded(int, least=0, most=65535)  # 0: a free port
EFFECT = Bounded(float, least=0.0)  # logits


@dataclass(frozen=True)
class WritablePath:
    """A path `kvnotes` will write: a directory (`--out`) or a file (`--json`, `--html`). Checked by
    writing (and removing) a probe file in the nearest directory that exists, so an unwritable
    place is refused before a long run rather than at its end; nothing is left behind."""

    is_dir: bool = False

    @property
    def __name__(self) -> str:
        return "directory" if self.is_dir else "file"

    def __call__(self, text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("an empty path; give a file or directory to write")
        path = Path(text).expanduser()
        if path.exists():
            if self.is_dir and not path.is_dir():
                raise argparse.ArgumentTypeError(f"{text} is a file; give a directory to write into")
            if not self.is_dir and path.is_dir():
                raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name inside it")
            if not os.access(path, os.W_OK):
                raise argparse.ArgumentTypeError(f"cannot write {text}: it is read-only; give another path")
        place = path if self.is_dir and path.is_dir() else path.parent
        while not place.exists() and place != place.parent:
            place = place.parent
        if not place.is_dir():
            raise argparse.ArgumentTypeError(f"cannot write {text}: {place} is a file, not a directory")
        try:
            fd, probe = tempfile.mkstemp(prefix=".kvnotes-write-check-", dir=place)
        except OSError as e:
            raise argparse.ArgumentTypeError(
                f"cannot write {text}: {place} is not writable ({e.strerror}); give a path you can write"
            ) from None
        os.close(fd)
        os.unlink(probe)
        return text


OUT_DIR = WritablePath(is_dir=True)
OUT_FILE = WritablePath()


MODEL_HELP = (
    "the model: gemma-3-270m (the default; embedded, nothing to download), a tiny-* model "
    "(tiny-llama, tiny-gemma3, ...), an organism (notes-organism, lookup-organism, ...), a tracr-* "
    "program (tracr-reverse, ...), a Hugging Face checkpoint directory or a hub name"
)


@dataclass(frozen=True)
class Checked:
    """A value read and checked by `check` where it is parsed, with no torch import: a model's name
    (`kvnotes.zoo.outline.check_name`), a task (its name, or its file and TOML), a pair dataset (its
    file and every JSONL line). The value stays the text given; the command reads it again."""

    what: str
    check: Callable[[str], Any]

    @property
    def __name__(self) -> str:
        return self.what

    def __call__(self, text: str) -> str:
        from kvnotes.errors import KVNotesError

        try:
            self.check(text)
        except KVNotesError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text


def _model(text: str) -> None:
    from kvnotes.zoo.outline import check_name

    check_name(text)


def _task(text: str) -> None:
    from kvnotes.tasks import load_task

    load_task(text)


def _pairs(text: str) -> None:
    from kvnotes.tasks import load_pairs

    load_pairs(text)


MODEL = Checked("model", _model)
TASK = Checked("task", _task)
PAIRS = Checked("pair dataset", _pairs)


def add_model(parser: argparse.ArgumentParser) -> None:
    """`--model` on a command that takes a model: the one declaration every command shares, with
    one default (the embedded model, which every command runs on) and one help text; a name that
    is no model is refused as it is parsed.

    >>> p = argparse.ArgumentParser()
    >>> add_model(p)
    >>> p.parse_args([]).model, p.parse_args(["--model", "tiny-llama"]).model
    ('gemma-3-270m', 'tiny-llama')
    """
    from kvnotes.zoo.names import EMBEDDED

    parser.add_argument("--model", type=MODEL, default=EMBEDDED, metavar="NAME", help=MODEL_HELP)


DEVICE_HELP = (
    "where the model runs: cpu (the default), cuda, cuda:N or mps; a device not present here is "
    "refused before the model loads"
)
DTYPE_HELP = (
    "the model's dtype: float32 (the default), bfloat16 or float16; models built in float32 (tiny, "
    "organisms, the embedded Gemma) are cast once after loading"
)


@dataclass(frozen=True)
class Choice:
    """One of `names`, or (with `indexed`) one of them followed by `:N` ("cuda:1"), checked by its
    spelling only: no torch import, so refusing a value stays cheap. Whether the device is present
    here is `load_model`'s check (`kvnotes.models.placement`), still before anything loads."""

    what: str
    names: tuple[str, ...]
    indexed: tuple[str, ...] = ()

    @property
    def __name__(self) -> str:
        return self.what

    def __call__(self, text: str) -> str:
        value = text.strip().lower().removeprefix("torch.")
        kind, _, index = value.partition(":")
        if value in self.names or (kind in self.indexed and index.isdigit()):
            return value
        spelled = ", ".join([*self.names, *(f"{k}:N" for k in self.indexed)])
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {self.what} kvnotes runs on; give one of {spelled}"
        )


DEVICE = Choice("device", ("cpu", "cuda", "mps"), indexed=("cuda",))
DTYPE = Choice("dtype", ("float32", "bfloat16", "float16"))


def add_placement(parser: argparse.ArgumentParser) -> None:
    """`--device` and `--dtype` beside `--model`: where the model runs and in what precision,
    passed to `load_model` as `args.model_device` and `args.model_dtype` (defaults cpu and
    float32). A command with its own option of that name keeps it (`bench serve --dtype` is the
    launched server's), and its model loads with the default.

    >>> p = argparse.ArgumentParser()
    >>> add_placement(p)
    >>> a = p.parse_args(["--device", "cuda:1", "--dtype", "bfloat16"])
    >>> a.model_device, a.model_dtype, p.parse_args([]).model_device, p.parse_args([]).model_dtype
    ('cuda:1', 'bfloat16', 'cpu', 'float32')
    """
    taken = {s for a in parser._actions for s in a.option_strings}
    for flag, kind, default, text in (
        ("--device", DEVICE, "cpu", DEVICE_HELP),
        ("--dtype", DTYPE, "float32", DTYPE_HELP),
    ):
        if flag not in taken:
            dest = f"model_{flag[2:]}"
            parser.add_argument(
                flag, dest=dest, type=kind, default=default, metavar=kind.what.upper(), help=text
            )
