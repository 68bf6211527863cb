"""Runtime type checks on kvnotes' own packages while the tests run (the house style: jaxtyping +
beartype on), at a cost the suite can carry.

`install()` (called first thing by tests/conftest.py, before anything imports kvnotes) adds an
import hook that rewrites each module of `PACKAGES` as it is imported, giving every annotated
function, method and dataclass a check:
- **array functions**, whose annotations name a jaxtyping array (`Float[Tensor, "batch pos"]`, or
  an alias of one such as `kvnotes.types.Logits`), get `jaxtyping.jaxtyped(typechecker=beartype)`:
  their named dimensions are bound across the arguments and the return value;
- **every other annotated function** gets `checked`: beartype on its parameters and its return
  value, on annotations resolved once per definition (a name imported only for type checkers
  reads as `Any`, as jaxtyping reads it). It skips what jaxtyping adds around each call (binding
  the signature and a shape memo: ~5 us a call, against beartype's 0.3 us) and what it costs to
  define a closure again (~1 ms a definition, paid on every call of the function around it);
- dataclasses get the same choice for their `__init__`; unannotated functions are left alone.

What they cost: `python scripts/typecheck_cost.py` runs every analysis once on tiny-llama (the
fixture of tests/analysis/test_results.py) unchecked, under jaxtyping's own import hook (the
suite's checks until this one) and under this hook, each in a fresh process, and prints the
times (on a 2-core x86_64 machine, two runs: 31.5 and 32.4 s, 77.4 and 60.5 s, 47 and 41 s).
`KVNOTES_TYPECHECK=jaxtyping` runs the suite under jaxtyping's hook instead, to compare.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib._bootstrap_external as bootstrap
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from types import CodeType
from typing import Any
from unittest import mock

PACKAGES = ("kvnotes", "probes", "circuits", "dashboards")
# kvnotes.engine.profile.WRAPPER_MARK: the engine's stack readers (the placement guard, the profile)
# pass over this module's frames, as over jaxtyping's, to find who made a call
__kvnotes_wrapper__ = True
ROOT = Path(__file__).resolve().parents[1]
# jaxtyping's array dtypes as they appear in annotations (Float[...], Int[...], ...)
DTYPES = frozenset(
    "Float Float16 Float32 Float64 BFloat16 Int Int8 Int16 Int32 Int64 UInt UInt8 UInt16 UInt32 UInt64 "
    "Integer Bool Num Real Inexact Complex Complex64 Complex128 Shaped Key".split()
)
_TAG = "kvnotestc" + hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:12]  # a cache per version


# --- the checks ----------------------------------------------------------------------------------
def _resolve(annotation: Any, namespace: dict) -> Any:
    """`annotation` (a string under `from __future__ import annotations`) as a type, or Any where
    it names what only a type checker imports (or a closure's local name)."""
    if annotation is inspect.Parameter.empty:
        return annotation

    def probe(value):
        del value

    probe.__annotations__ = {"value": annotation}  # (this module's own annotations are strings)
    try:
        return typing.get_type_hints(probe, namespace, include_extras=True)["value"]
    except Exception:
        return Any


def _shim(parameters: Sequence[inspect.Parameter], namespace: dict) -> Callable:
    """A function with `parameters` (names, kinds and defaults) and an empty body, annotated with
    their resolved types: beartype checks a call's arguments by calling it."""
    parts, ns, star = [], {}, False
    posonly = [p for p in parameters if p.kind is p.POSITIONAL_ONLY]
    for i, p in enumerate(parameters):
        default = ""
        if p.default is not p.empty:
            ns[f"_d{i}"], default = p.default, f"=_d{i}"
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            if not star:
                parts.append("*")
                star = True
            parts.append(p.name + default)
        else:
            parts.append(p.name + default)
        if posonly and p is posonly[-1]:
            parts.append("/")
    exec(f"def shim({', '.join(parts)}):\n    pass", ns)  # noqa: S102 - our own parameter names
    shim = ns["shim"]
    shim.__annotations__ = {
        p.name: _resolve(p.annotation, namespace) for p in parameters if p.annotation is not p.empty
    }
    return shim


def _checkers(fn: Callable) -> tuple[Callable | None, Callable | None]:
    """beartype-checked shims of `fn`'s parameters and return value (None: nothing to check)."""
    from beartype import beartype

    sig = inspect.signature(fn)
    namespace = getattr(fn, "__globals__", {})
    params = None
    if any(p.annotation is not p.empty for p in sig.parameters.values()):
        params = beartype(_named(_shim(list(sig.parameters.values()), namespace), fn))
    ret = None
    coroutine = inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
    if sig.return_annotation is not sig.empty and not coroutine:
        ret_shim = _shim([inspect.Parameter("returned", inspect.Parameter.POSITIONAL_ONLY)], namespace)
        ret_shim.__annotations__ = {"returned": _resolve(sig.return_annotation, namespace)}
        ret = beartype(_named(ret_shim, fn, " (its return value)"))
    return params, ret


def _named(shim: Callable, fn: Callable, suffix: str = "") -> Callable:
    """`shim` under `fn`'s names, so that a failed check names the function that was called."""
    shim.__name__ = fn.__name__  # beartype writes it into code: an identifier
    shim.__qualname__ = getattr(fn, "__qualname__", fn.__name__) + suffix
    shim.__module__ = fn.__module__
    return shim


# per definition (code object, by identity: two dataclasses' generated __init__ can be equal code
# with other annotations), built once: a closure defined again on every call reuses them. The code
# object is kept with them, so its id is never reused.
_CHECKERS: dict[int, tuple[CodeType, Callable | None, Callable | None]] = {}


def checked(fn: Callable) -> Callable:
    """`fn` with beartype checks on its arguments and its return value (module docstring)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return fn
    if id(code) not in _CHECKERS:
        _CHECKERS[id(code)] = (code, *_checkers(fn))
    _, params, ret = _CHECKERS[id(code)]
    if params is None and ret is None:
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True
        if params is not None:
            params(*args, **kwargs)
        out = fn(*args, **kwargs)
        if ret is not None:
            ret(out)
        return out

    return wrapper


def checked_class(cls: type) -> type:
    """A dataclass with its generated `__init__` checked (`checked`); any other class as it is
    (its methods carry their own checks)."""
    import dataclasses

    if dataclasses.is_dataclass(cls) and "__init__" in cls.__dict__:
        cls.__init__ = checked(cls.__dict__["__init__"])  # type: ignore[misc]
    return cls


# --- the import hook -----------------------------------------------------------------------------
def _names(node: ast.AST) -> set[str]:
    """Every name an annotation mentions, strings parsed (`"Float[Tensor, 'n']"`)."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                out |= _names(ast.parse(n.value, mode="eval"))
            except SyntaxError:
                pass  # a dimension string such as "batch pos"
    return out


def array_aliases(tree: ast.Module, known: frozenset[str] = DTYPES) -> set[str]:
    """Module-level names bound to a jaxtyping array type (`Logits = Float[Tensor, "..."]`)."""
    aliases: set[str] = set()
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign) and node.value is not None
            else []
        )
        value = getattr(node, "value", None)
        if value is not None and _names(value) & (known | aliases):
            aliases |= {t.id for t in targets if isinstance(t, ast.Name)}
    return aliases


def _no_type_check(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
    return any("no_type_check" in _names(d) for d in node.decorator_list)


class _AddChecks(ast.NodeTransformer):
    def __init__(self, arrays: frozenset[str]) -> None:
        self.arrays = arrays

    def _decorator(self, name: str) -> ast.expr:
        return ast.parse(name, mode="eval").body

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        if _no_type_check(node):
            return node
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        args += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
        annotations = [a.annotation for a in args if a.annotation is not None]
        annotations += [node.returns] if node.returns is not None else []
        if annotations:
            arrays = any(_names(a) & self.arrays for a in annotations)
            node.decorator_list.append(
                self._decorator(
                    "_kvnotes_jaxtyping.jaxtyped(typechecker=_kvnotes_beartype.beartype)"
                    if arrays
                    else "_kvnotes_checks.checked"
                )
            )
        self.generic_visit(node)
        return node

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        if not _no_type_check(node):
            fields = [s.annotation for s in node.body if isinstance(s, ast.AnnAssign)]
            arrays = any(_names(a) & self.arrays for a in fields)
            node.decorator_list.insert(
                0,  # outermost: after @dataclass has made __init__
                self._decorator(
                    "_kvnotes_jaxtyping.jaxtyped(typechecker=_kvnotes_beartype.beartype)"
                    if arrays
                    else "_kvnotes_checks.checked_class"
                ),
            )
        self.generic_visit(node)
        return node


IMPORTS = ast.parse(
    "import jaxtyping as _kvnotes_jaxtyping\nimport beartype as _kvnotes_beartype\n"
    "import tests.typechecks as _kvnotes_checks\n"
).body


def instrument(tree: ast.Module, shared: frozenset[str]) -> ast.Module:
    """`tree` with every check added and the imports they use after its `__future__` imports."""
    _AddChecks(shared | array_aliases(tree, shared)).visit(tree)
    at = 0
    for i, node in enumerate(tree.body):
        docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if docstring or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            at = i + 1
    tree.body[at:at] = IMPORTS
    return ast.fix_missing_locations(tree)


class _Loader(importlib.machinery.SourceFileLoader):
    shared: frozenset[str] = DTYPES

    def source_to_code(self, data, path, *, _optimize=-1):  # type: ignore[override]
        tree = ast.parse(importlib.util.decode_source(data), path)
        return compile(instrument(tree, self.shared), path, "exec", dont_inherit=True, optimize=_optimize)

    def get_code(self, fullname):
        # the instrumented bytecode is cached beside the plain one, under its own tag (only while
        # this module's code is read: the modules it imports keep their own caches)
        tagged = functools.partial(_CACHE_FROM_SOURCE, optimization=_TAG)
        with mock.patch("importlib._bootstrap_external.cache_from_source", tagged):
            return super().get_code(fullname)


_CACHE_FROM_SOURCE = bootstrap.cache_from_source


class _Finder:
    def __init__(self, packages: Sequence[str]) -> None:
        self.packages = tuple(packages)

    def find_spec(self, fullname, path=None, target=None):
        if not any(fullname == p or fullname.startswith(p + ".") for p in self.packages):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _Loader(spec.loader.name, spec.loader.path)
        return spec


def install(packages: Sequence[str] = PACKAGES) -> None:
    """Check every module of `packages` imported from now on; refuse if one is already imported
    (it would run unchecked)."""
    early = sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in packages))
    if early:
        raise RuntimeError(
            f"{early[:3]} imported before the type checks were installed: tests/conftest.py "
            "must call tests.typechecks.install() before anything imports kvnotes"
        )
    if os.environ.get("KVNOTES_TYPECHECK") == "jaxtyping":  # jaxtyping's own hook, to compare
        from jaxtyping import install_import_hook

        install_import_hook(list(packages), "beartype.beartype")
        return
    types_py = ROOT / "kvnotes" / "types.py"  # read, not imported: importing it imports kvnotes
    _Loader.shared = DTYPES | frozenset(array_aliases(ast.parse(types_py.read_text())))
    sys.meta_path.insert(0, _Finder(packages))  # type: ignore[arg-type]
