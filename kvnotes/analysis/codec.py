"""The JSON codec of results: any result field to JSON-safe data (`to_json_value`) and back as its
annotated type (`from_json_value`), refusing a wrong shape with `ResultSchemaError` naming where.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints

import numpy as np

from kvnotes.analysis.stats import Curve, Estimate
from kvnotes.errors import ResultSchemaError


def to_json_value(value: Any) -> Any:
    """A result field as JSON-safe data: Estimates and Curves by their `to_dict`, dataclasses by
    field, tuples as lists, mapping keys as strings, numpy scalars as Python numbers."""
    if isinstance(value, Estimate | Curve):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_value(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def from_json_value(hint: Any, data: Any, where: str = "result") -> Any:
    """`data` (as `to_json_value` wrote it) read back as the annotated type `hint`; wrong shapes raise
    ResultSchemaError naming `where`."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return data
    if origin in (Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        arm = next(a for a in args if a is not type(None))
        return from_json_value(arm, data, where)
    if hint in (Estimate, Curve):
        expect_shape(isinstance(data, Mapping), where, "a mapping", data)
        try:
            return hint.from_dict(data)
        except (KeyError, TypeError) as e:
            raise ResultSchemaError(f"{where}: not a {hint.__name__} ({type(e).__name__}: {e})") from e
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        expect_shape(isinstance(data, Mapping), where, "a mapping", data)
        return decode_fields(hint, data, where)
    if origin is tuple:
        expect_shape(isinstance(data, list | tuple), where, "a list", data)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
        expect_shape(len(data) == len(args), where, f"{len(args)} items", data)
        return tuple(from_json_value(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if origin in (list, Sequence, collections.abc.Sequence):
        expect_shape(isinstance(data, list | tuple), where, "a list", data)
        return [from_json_value(args[0] if args else Any, v, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin in (dict, Mapping, collections.abc.Mapping):
        expect_shape(isinstance(data, Mapping), where, "a mapping", data)
        key, val = args or (Any, Any)
        return {
            (int(k) if key is int else k): from_json_value(val, v, f"{where}.{k}") for k, v in data.items()
        }
    if hint is float:
        expect_shape(isinstance(data, int | float) and not isinstance(data, bool), where, "a number", data)
        return float(data)
    if hint in (int, str, bool):
        ok = isinstance(data, hint) and (hint is bool or not isinstance(data, bool))
        expect_shape(ok, where, f"a {hint.__name__}", data)
        return data
    return data


def expect_shape(ok: bool, where: str, what: str, data: Any) -> None:
    """Refuse `data` at `where` unless `ok`: a ResultSchemaError saying what it should be."""
    if not ok:
        raise ResultSchemaError(f"{where} should be {what}, got {type(data).__name__} {str(data)[:60]!r}")


@cache
def field_hints(cls: type) -> dict[str, Any]:
    """`cls`'s field annotations resolved to types (cached: a class's hints never change)."""
    return get_type_hints(cls)


def decode_fields(cls: type, data: Mapping, where: str) -> Any:
    """A `cls` dataclass built from `data`, each field read back as its annotated type; unknown or
    missing keys refused naming them."""
    hints = field_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ResultSchemaError(
            f"{where}: unknown key(s) {unknown} for {cls.__name__}; it has {sorted(known)}"
        )
    missing = [
        n
        for n, f in known.items()
        if n not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ResultSchemaError(f"{where}: {cls.__name__} needs key(s) {missing}, which are missing")
    return cls(**{n: from_json_value(hints[n], v, f"{where}.{n}") for n, v in data.items()})
