"""The registry's description for the `kvnotes` parser, read from the analyses' source.

Building the parser needs every analysis's options. Importing the analyses to read them
(`kvnotes.analysis.registry.cli_spec()`) imports torch with them: seconds. So the parser reads the
same declarations from the source instead (`read()`): the modules the registry would import
(`kvnotes.analysis.discovery`) are parsed, not run, and each `@analysis(...)`, its config's fields
(`option(default, help, ...)`, through their base classes and `replace_default`), its run
function's docstring and each `register_section(Section(...))` are evaluated where they are
constants: literals, module constants (of the module or imported from the same packages), and
`tuple`, `len`, f-strings, comprehensions, dataclass instances ... of those. Nothing is written by
hand and nothing is regenerated: an analysis module added or edited is read as it stands.

A declaration that is not a constant (a default computed by a call of our own) raises `NotStatic`,
naming its file and line; the spec is then built from the registry (torch imported) instead. Either
way it is kept in the kvnotes cache, keyed by the source files' modification times, so the first
call after an install or an edit reads the source (a tenth of a second) and later ones read the
cache.

    python -m kvnotes.cli_spec      # read the source; say whether it matches the registry's spec
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import operator
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvnotes.analysis.spec_form import assemble, help_line, option_entry

REGISTRY = "kvnotes.analysis.registry"


# --- the source reader ---------------------------------------------------------------------------
class NotStatic(Exception):
    """A declaration the source reader cannot evaluate without running it (where, and what)."""


@dataclass(frozen=True)
class _Opaque:
    """A value known only by running the code: fine inside a constant nobody reads, refused in the spec."""

    where: str


@dataclass(frozen=True)
class _Ref:
    """A class or function by its module and name; `node` its definition where it is ours."""

    module: str
    name: str
    node: ast.AST | None = field(default=None, compare=False)


@dataclass(frozen=True)
class _ModRef:
    module: str


@dataclass
class _Record:
    """An instance of one of our dataclasses: its fields' values."""

    cls: str
    values: dict


@dataclass
class _Field:
    annotation: ast.AST
    module: _Module
    default: Any
    meta: dict


_MISSING = _Opaque("a field without a default")
# the builtins a declaration may call on constants, and the names the reader knows as builtins
_CALLS = {f.__name__: f for f in (tuple, list, dict, len, sorted, min, max, sum, str, int, float, bool)}
_BUILTINS = {*_CALLS, "object"}
_STR_METHODS = {"join", "format", "replace", "upper", "lower", "strip", "title", "capitalize"}
_BINOPS = {getattr(ast, op): getattr(operator, fn) for op, fn in
           (("Add", "add"), ("Sub", "sub"), ("Mult", "mul"), ("Div", "truediv"), ("FloorDiv", "floordiv"),
            ("Mod", "mod"), ("Pow", "pow"))}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}


class _Module:
    """One parsed module: its top-level names (the last binding of each) and what it imports."""

    def __init__(self, name: str, path: Path, is_package: bool):
        self.name, self.path = name, path
        self.text = path.read_text(encoding="utf-8")
        self.tree = ast.parse(self.text, str(path))
        self.package = name if is_package else name.rpartition(".")[0]
        self.defs: dict[str, ast.AST] = {}
        self.imports: dict[str, tuple[str, str | None]] = {}  # name -> (module, attribute or None)
        for stmt in self.tree.body:
            self._bind(stmt)

    def _bind(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            self._set(stmt.targets[0].id, stmt.value)
        elif isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Tuple):
            names, values = stmt.targets[0].elts, stmt.value  # `TASK, MODEL = "task", "model"`
            known = values.elts if isinstance(values, ast.Tuple) and len(values.elts) == len(names) else None
            for i, target in enumerate(names):
                if isinstance(target, ast.Name):
                    opaque = ast.Starred(values, ast.Load(), lineno=stmt.lineno)  # unpacked at run time
                    self._set(target.id, known[i] if known else opaque)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            self._set(stmt.target.id, stmt.value)
        elif isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            self._set(stmt.name, stmt)
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    self._import(alias.asname, (alias.name, None))
                else:
                    self._import(alias.name.split(".")[0], (alias.name.split(".")[0], None))
        elif isinstance(stmt, ast.ImportFrom):
            base = self.source(stmt)
            for alias in stmt.names:
                self._import(alias.asname or alias.name, (base, alias.name))

    def source(self, stmt: ast.ImportFrom) -> str:
        """The module `from ... import` reads from, relative imports resolved."""
        if not stmt.level:
            return stmt.module or ""
        up = self.package.split(".")[: len(self.package.split(".")) - (stmt.level - 1)]
        return ".".join([*up, *([stmt.module] if stmt.module else [])])

    def _set(self, name: str, node: ast.AST) -> None:
        self.imports.pop(name, None)
        self.defs[name] = node

    def _import(self, name: str, target: tuple[str, str | None]) -> None:
        self.defs.pop(name, None)
        self.imports[name] = target

    def where(self, node: ast.AST) -> str:
        return f"{self.path}:{getattr(node, 'lineno', 0)}: `{ast.unparse(node)[:80]}`"


def _plain(value: Any) -> Any:
    """`value` where it holds nothing opaque; else NotStatic naming where the opaque part came from."""
    if isinstance(value, _Opaque):
        raise NotStatic(f"{value.where} is not a constant the parser can read without running it")
    if isinstance(value, _Ref | _ModRef | _Record):
        raise NotStatic(f"{value!r} is not a constant value")
    if isinstance(value, tuple | list):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def _search_paths(top: str) -> list[str]:
    """Where package `top` is found: its live `__path__` where it is imported (a test may extend it),
    else where it is installed, found without importing it."""
    pkg = sys.modules.get(top)
    if pkg is not None and hasattr(pkg, "__path__"):
        return list(pkg.__path__)
    spec = importlib.util.find_spec(top)
    return list(spec.submodule_search_locations or []) if spec else []


class _Reader:
    """Evaluates the declarations of the analysis modules from their syntax trees."""

    def __init__(self, tops: Iterable[str]):
        self.tops = set(tops)
        self.modules: dict[str, _Module | None] = {}
        self.values: dict[tuple[str, str], Any] = {}
        self.classes: dict[str, dict[str, _Field] | None] = {}
        self.ran: set[str] = set()
        self.sections: dict[str, dict] = {}
        self.analyses: dict[str, dict] = {}

    # modules and names
    def path(self, name: str) -> Path | None:
        """The source file of module `name`, where it is one of ours; else None."""
        top, *rest = name.split(".")
        for loc in _search_paths(top) if top in self.tops else []:
            base = Path(loc, *rest)
            if (base / "__init__.py").is_file():
                return base / "__init__.py"
            if rest and base.with_suffix(".py").is_file():
                return base.with_suffix(".py")
        return None

    def module(self, name: str) -> _Module | None:
        """Module `name` parsed, where it is one of ours and has a source file; else None."""
        if name not in self.modules:
            path = self.path(name)
            self.modules[name] = _Module(name, path, path.name == "__init__.py") if path else None
        return self.modules[name]

    def lookup(self, mod: _Module, name: str) -> Any:
        if name in mod.imports:
            base, attr = mod.imports[name]
            if attr is None:
                return _ModRef(base)
            return self.attribute(_ModRef(base), attr)
        node = mod.defs.get(name)
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            return _Ref(mod.name, name, node)
        if node is not None:
            key = (mod.name, name)
            if key not in self.values:
                self.values[key] = _Opaque(mod.where(node))  # a name defined by itself stays opaque
                self.values[key] = self.value(mod, node)
            return self.values[key]
        lazy = mod.defs.get("_LAZY")  # a package's lazy re-exports (`kvnotes.lazy`)
        if lazy is not None and isinstance(table := self.value(mod, lazy), dict) and name in table:
            return self.attribute(_ModRef(table[name]), name)
        if name in _BUILTINS:
            return _Ref("builtins", name)
        return _Opaque(f"{mod.path}: the name {name}")

    def attribute(self, base: Any, attr: str) -> Any:
        if isinstance(base, _ModRef):
            mod = self.module(base.module)
            if mod is None:
                return _Ref(base.module, attr)  # another library's name: a reference, never a value
            if attr not in mod.defs and attr not in mod.imports and self.module(f"{base.module}.{attr}"):
                return _ModRef(f"{base.module}.{attr}")
            return self.lookup(mod, attr)
        if isinstance(base, _Record) and attr in base.values:
            return base.values[attr]
        return _Opaque(f"the attribute {attr} of {base!r}")

    # values
    def value(self, mod: _Module, node: ast.AST, scope: Mapping[str, Any] | None = None) -> Any:
        """`node`'s value, evaluated where it is a constant; an `_Opaque` where it is not."""
        try:
            return self._value(mod, node, scope or {})
        except NotStatic:
            raise
        except Exception:  # an operation the values do not support (join over opaque items, ...)
            return _Opaque(mod.where(node))

    def _value(self, mod: _Module, node: ast.AST, scope: Mapping[str, Any]) -> Any:
        v = lambda n: self.value(mod, n, scope)  # noqa: E731
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return scope[node.id] if node.id in scope else self.lookup(mod, node.id)
        if isinstance(node, ast.Tuple | ast.List):
            items: list = []
            for elt in node.elts:
                items += list(_concrete(v(elt.value))) if isinstance(elt, ast.Starred) else [v(elt)]
            return tuple(items) if isinstance(node, ast.Tuple) else items
        if isinstance(node, ast.Dict):
            out: dict = {}
            for k, val in zip(node.keys, node.values, strict=True):
                out.update(_concrete(v(val), dict) if k is None else {_concrete(v(k)): v(val)})
            return out
        if isinstance(node, ast.Attribute):
            return self.attribute(v(node.value), node.attr)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](_concrete(v(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](_concrete(v(node.left)), _concrete(v(node.right)))
        if isinstance(node, ast.JoinedStr):
            return "".join(_concrete(v(p)) for p in node.values)
        if isinstance(node, ast.FormattedValue):
            x = _concrete(v(node.value))
            x = {115: str, 114: repr, 97: ascii}.get(node.conversion, lambda y: y)(x)
            return format(x, _concrete(v(node.format_spec)) if node.format_spec else "")
        if isinstance(node, ast.Subscript):
            return _concrete(v(node.value))[_concrete(v(node.slice))]
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            return self._comprehension(mod, node, scope)
        if isinstance(node, ast.Call):
            return self._call(mod, node, scope)
        return _Opaque(mod.where(node))

    def _comprehension(self, mod: _Module, node: Any, scope: Mapping[str, Any]) -> Any:
        if len(node.generators) != 1 or not isinstance(node.generators[0].target, ast.Name):
            return _Opaque(mod.where(node))
        gen = node.generators[0]
        out = []
        for item in _concrete(self.value(mod, gen.iter, scope)):
            inner = {**scope, gen.target.id: item}
            if all(_concrete(self.value(mod, cond, inner)) for cond in gen.ifs):
                if isinstance(node, ast.DictComp):
                    key = _concrete(self.value(mod, node.key, inner))
                    out.append((key, self.value(mod, node.value, inner)))
                else:
                    out.append(self.value(mod, node.elt, inner))
        if isinstance(node, ast.DictComp):
            return dict(out)
        return set(out) if isinstance(node, ast.SetComp) else tuple(out)

    def _call(self, mod: _Module, node: ast.Call, scope: Mapping[str, Any]) -> Any:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _STR_METHODS:
            base = self.value(mod, func.value, scope)
            if isinstance(base, str):
                args = [_concrete(self.value(mod, a, scope)) for a in node.args]
                return getattr(base, func.attr)(*args)
        fn = self.value(mod, func, scope)
        args = [self.value(mod, a, scope) for a in node.args]
        kwargs = {k.arg: self.value(mod, k.value, scope) for k in node.keywords if k.arg}
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            return _Opaque(mod.where(node))
        if isinstance(fn, _Ref) and fn.module == "builtins" and fn.name in _CALLS:
            if fn.name == "len":
                return len(_concrete(args[0]))
            return _CALLS[fn.name](*map(_concrete, args), **{k: _concrete(x) for k, x in kwargs.items()})
        if fn == _Ref(REGISTRY, "replace_default"):
            return self._replaced(args[0], kwargs)
        if isinstance(fn, _Ref) and self.fields(fn) is not None:
            return self._instance(mod, node, fn, args, kwargs)
        return _Opaque(mod.where(node))

    # dataclasses: configs, sections
    def fields(self, cls: Any) -> dict[str, _Field] | None:
        """The dataclass fields of class `cls` (ours, or made by `replace_default`) in dataclass
        order, bases first; None where it is not one of our dataclasses."""
        if isinstance(cls, dict):  # made by `replace_default`
            return cls
        if not isinstance(cls, _Ref) or not isinstance(cls.node, ast.ClassDef):
            return None
        key = f"{cls.module}.{cls.name}"
        if key not in self.classes:
            self.classes[key] = None  # a class that derives from itself is not one
            self.classes[key] = self._class_fields(cls)
        return self.classes[key]

    def _class_fields(self, cls: _Ref) -> dict[str, _Field] | None:
        node, mod = cls.node, self.module(cls.module)
        assert isinstance(node, ast.ClassDef) and mod is not None
        decorators = [self.value(mod, d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
        if _Ref("dataclasses", "dataclass") not in decorators:
            return None
        out: dict[str, _Field] = {}
        for base in reversed(node.bases):
            ref = self.value(mod, base)
            inherited = self.fields(ref)
            if inherited is None and ref != _Ref("builtins", "object"):
                raise NotStatic(f"{mod.where(base)}: a base class the parser cannot read")
            out.update(inherited or {})
        for stmt in node.body:
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            if "ClassVar" in ast.unparse(stmt.annotation):
                continue
            out[stmt.target.id] = self._field(mod, stmt)
        return out

    def _field(self, mod: _Module, stmt: ast.AnnAssign) -> _Field:
        if stmt.value is None:
            return _Field(stmt.annotation, mod, _MISSING, {})
        call = stmt.value if isinstance(stmt.value, ast.Call) else None
        fn = self.value(mod, call.func) if call else None
        if call and fn in (_Ref(REGISTRY, "option"), _Ref("dataclasses", "field")):
            named = {k.arg: k.value for k in call.keywords if k.arg}
            if fn == _Ref(REGISTRY, "option"):  # option(default, help, **extra)
                params = dict(zip(("default", "help"), call.args, strict=False)) | named
                meta = {k: self.value(mod, n) for k, n in params.items() if k != "default"}
                return _Field(stmt.annotation, mod, self.value(mod, params["default"]), meta)
            default = self.value(mod, named["default"]) if "default" in named else _MISSING
            meta = self.value(mod, named["metadata"]) if "metadata" in named else {}
            return _Field(stmt.annotation, mod, default, meta if isinstance(meta, dict) else {"?": meta})
        return _Field(stmt.annotation, mod, self.value(mod, stmt.value), {})

    def _replaced(self, cls: Any, defaults: Mapping[str, Any]) -> dict[str, _Field] | _Opaque:
        own = self.fields(cls)
        if own is None:
            return _Opaque(f"replace_default of {cls!r}")
        return {k: _Field(f.annotation, f.module, defaults.get(k, f.default), f.meta) for k, f in own.items()}

    def _instance(
        self, mod: _Module, node: ast.Call, cls: _Ref, args: list, kwargs: dict
    ) -> _Record | _Opaque:
        own = self.fields(cls) or {}
        values = {**dict(zip(own, args, strict=False)), **kwargs}
        for name, f in own.items():
            values.setdefault(name, f.default)
        if set(values) - set(own) or len(args) > len(own):
            return _Opaque(mod.where(node))
        return _Record(cls.name, values)

    # the declarations, in import order
    def run_module(self, name: str) -> None:
        """Register what module `name` declares at its top level, as importing it would: its parent
        packages first, then each statement in order (the modules it imports that declare sections or
        analyses run where they are imported)."""
        if name in self.ran:
            return
        self.ran.add(name)
        if "." in name:
            self.run_module(name.rpartition(".")[0])
        mod = self.module(name)
        if mod is None:
            return
        for stmt in mod.tree.body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                for target in _imported(mod, stmt):  # only those that register something are read
                    path = None if target in self.ran else self.path(target)
                    if path is not None and _registers(path.read_text(encoding="utf-8")):
                        self.run_module(target)
            elif isinstance(stmt, ast.Expr | ast.Assign) and isinstance(stmt.value, ast.Call):
                if self.value(mod, stmt.value.func) == _Ref(REGISTRY, "register_section"):
                    self._section(mod, stmt.value)
            elif isinstance(stmt, ast.FunctionDef):
                for dec in stmt.decorator_list:
                    if isinstance(dec, ast.Call) and self.value(mod, dec.func) == _Ref(REGISTRY, "analysis"):
                        self._analysis(mod, dec, stmt)

    def _section(self, mod: _Module, call: ast.Call) -> None:
        sec = self.value(mod, call.args[0]) if call.args else None
        if not isinstance(sec, _Record) or sec.cls != "Section":
            raise NotStatic(f"{mod.where(call)}: a section the parser cannot read")
        values = _plain({k: sec.values[k] for k in ("name", "command", "level", "help", "order")})
        self.sections[values["name"]] = values

    def _analysis(self, mod: _Module, dec: ast.Call, fn: ast.FunctionDef) -> None:
        args = [self.value(mod, a) for a in dec.args]
        kwargs = {k.arg: self.value(mod, k.value) for k in dec.keywords if k.arg}
        if len(args) < 4 or len(dec.keywords) != len(kwargs):
            raise NotStatic(f"{mod.where(dec)}: @analysis(name, section, config, result, ...) expected")
        name, section = _plain(args[0]), _plain(args[1])
        config = self.fields(args[2])
        if config is None:
            raise NotStatic(f"{mod.where(dec.args[2])}: a config the parser cannot read")
        if section not in self.sections:
            self.sections[section] = {
                "name": section,
                "command": section,
                "level": "task",
                "help": "",
                "order": 100,
            }
        picked = {
            k: _plain(kwargs.get(k, d))
            for k, d in (("order", 100), ("default", True), ("flag", None), ("command", ""), ("help", None))
        }
        self.analyses[name] = {
            **picked,
            "name": name,
            "section": section,
            "help": picked["help"] or help_line(ast.get_docstring(fn, clean=False)),
            "options": [self._option(k, f) for k, f in config.items()],
        }

    def _option(self, name: str, f: _Field) -> dict:
        try:
            kind, item = _kind(self, f.module, f.annotation)
            return option_entry(name, kind, item, _plain(f.default), _plain(f.meta))
        except NotStatic as e:
            raise NotStatic(f"option {name}: {e}") from None

    def spec(self) -> dict:
        errors = self.module("kvnotes.errors")
        min_effect = _plain(self.lookup(errors, "MIN_EFFECT")) if errors else None
        sections = sorted(self.sections.values(), key=lambda s: s["order"])
        order = {s["name"]: s["order"] for s in sections}
        analyses = sorted(self.analyses.values(), key=lambda a: (order[a["section"]], a["order"], a["name"]))
        return assemble(min_effect, sections, analyses)  # type: ignore[arg-type]


def _registers(text: str) -> bool:
    """Whether a module's text registers a section or an analysis (or mentions doing so)."""
    from kvnotes.analysis.discovery import MARKERS

    return any(m in text for m in (*MARKERS, "register_section("))


def _imported(mod: _Module, stmt: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules `stmt` imports (for `from X import Y`, X and X.Y where Y is a module)."""
    if isinstance(stmt, ast.Import):
        return [alias.name for alias in stmt.names]
    base = mod.source(stmt)
    return [base, *(f"{base}.{alias.name}" for alias in stmt.names)]


def _concrete(x: Any, kind: type | None = None) -> Any:
    """`x` where it is a value (its items may be opaque); else an error the evaluator turns opaque."""
    if isinstance(x, _Opaque | _Ref | _ModRef | _Record) or (kind is not None and not isinstance(x, kind)):
        raise ValueError(f"not a constant: {x!r}")
    return x


_SCALARS = ("int", "float", "bool")


def _kind(reader: _Reader, mod: _Module, node: ast.AST) -> tuple[str, str]:
    """(kind, item) of a field's annotation, as the registry reads its type hint: `X | None` is X,
    `tuple[X, ...]` a list of X, int, float and bool themselves, anything else a string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _kind(reader, mod, ast.parse(node.value, mode="eval").body)
    arms = _union_arms(node)
    if len(arms) > 1:
        kept = [a for a in arms if not (isinstance(a, ast.Constant) and a.value is None)]
        return _kind(reader, mod, kept[0]) if len(kept) == 1 else ("str", "str")
    if isinstance(node, ast.Subscript):
        origin = reader.value(mod, node.value)
        if origin in (_Ref("builtins", "tuple"), _Ref("typing", "Tuple")):
            first = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
            item = _kind(reader, mod, first)[0]
            return "list", item if item in ("int", "float") else "str"
        if origin == _Ref("typing", "Optional"):
            return _kind(reader, mod, node.slice)
        return "str", "str"
    if isinstance(node, ast.Name) and node.id in _SCALARS and node.id not in mod.defs | mod.imports:
        return node.id, node.id if node.id != "bool" else "str"
    if isinstance(node, ast.Name) and isinstance(mod.defs.get(node.id), ast.expr):  # an alias
        return _kind(reader, mod, mod.defs[node.id])
    return "str", "str"


def _union_arms(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return [*_union_arms(node.left), *_union_arms(node.right)]
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Union", "typing.Union"):
        return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
    return [node]


# --- the spec the parser is built from ------------------------------------------------------------
@functools.cache
def _packages() -> tuple[str, ...]:
    """The packages the analyses are found in (`kvnotes.analysis.discovery.packages`), read once:
    the installed distributions' entry points take a few hundredths of a second to list."""
    from kvnotes.analysis.discovery import packages

    return tuple(packages())


def _tops() -> list[str]:
    """The top-level packages the analyses live in (kvnotes, probes, circuits, ...)."""
    return sorted({"kvnotes", *(p.split(".")[0] for p in _packages())})


def read() -> dict:
    """The registry's spec (`kvnotes.analysis.registry.cli_spec()`), read from the source without
    importing any analysis; NotStatic where a declaration is not a constant."""
    from kvnotes.analysis.discovery import declaring_files

    reader = _Reader(_tops())
    for package in _packages():
        top = reader.module(package)
        if top is None:
            raise NotStatic(f"no source found for the package {package}")
        paths = [str(top.path.parent)] if top.path.name == "__init__.py" else []
        if top.path.name == "__init__.py" and "." not in package:
            paths = _search_paths(package)
        for name, path in declaring_files(package, top.path, paths):
            reader.run_module(name)
            mod = reader.module(name)
            if mod is None:
                raise NotStatic(f"{path}: not a source file")
            _all_at_top(mod)
    return reader.spec()


def _all_at_top(mod: _Module) -> None:
    """Refuse a module that declares an analysis anywhere but at its top level (inside a function, or
    with `register(Analysis(...))`): the reader would not see it."""
    top = {id(d) for stmt in mod.tree.body if isinstance(stmt, ast.FunctionDef) for d in stmt.decorator_list}
    if "register(Analysis(" not in mod.text and mod.text.count("analysis(") <= len(top):
        return  # every mention can be a top-level decorator: nothing to walk for
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for d in node.decorator_list:
                if id(d) not in top and "analysis(" in ast.unparse(d):
                    raise NotStatic(f"{mod.where(d)}: an analysis declared below the top level")
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("register"):
            if node.args and "Analysis(" in ast.unparse(node.args[0]):
                raise NotStatic(f"{mod.where(node)}: register(Analysis(...)), read by importing it")


def _cache_path() -> Path:
    """Where the spec is kept for the source files as they are now (by modification time and size)."""
    from kvnotes.zoo.cache import default_cache_dir

    h = hashlib.sha256(sys.version.encode() + "\n".join(_packages()).encode())
    for top in _tops():
        for root in _search_paths(top):
            for f in sorted(Path(root).rglob("*.py")):
                st = f.stat()
                h.update(f"{f}:{st.st_mtime_ns}:{st.st_size}\n".encode())
    return default_cache_dir() / "cli" / f"spec-{h.hexdigest()[:20]}.json"


def load() -> dict:
    """The spec the parser is built from: the live registry's where this process has imported it (a
    notebook, a test that registered an analysis of its own), else the one kept for these files, else
    read from the source (or, where a declaration is not a constant, built from the registry) and kept."""
    if REGISTRY in sys.modules:
        from kvnotes.analysis.registry import cli_spec

        return cli_spec()
    path = _cache_path()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    try:
        spec = read()
    except NotStatic:
        from kvnotes.analysis.registry import cli_spec

        spec = cli_spec()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(spec))
        tmp.replace(path)
    except OSError:  # a read-only cache: read it every time
        pass
    return spec


def main() -> int:
    """Read the spec from the source and compare it with the registry's: 0 where they agree."""
    try:
        static = read()
    except NotStatic as e:
        print(f"the source cannot be read without importing it: {e}")
        return 1
    from kvnotes.analysis.registry import cli_spec

    built = json.loads(json.dumps(cli_spec()))
    n = sum(len(c["analyses"]) for c in static["commands"].values())
    if static == built:
        commands = len(static["commands"])
        print(f"read from the source: {n} analyses in {commands} commands, as the registry says")
        return 0
    for command in sorted(set(static["commands"]) | set(built["commands"])):
        ours, theirs = static["commands"].get(command), built["commands"].get(command)
        if ours != theirs:
            print(f"{command}: read {json.dumps(ours)[:400]}\n  registry {json.dumps(theirs)[:400]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
