"""The registry's description for the `kvnotes` parser, without importing the registry.

Building the parser needs every analysis's options (`kvnotes.analysis.registry.cli_spec()`), and
building those imports every analysis module, torch with them: seconds. So the spec ships prebuilt
in `kvnotes/cli_spec.json`, with the files it was read from and two digests of them: of their text,
checked first (a millisecond), and of their code without comments or line breaks inside brackets
(their tokens; about a tenth of a second, read only where the text differs), so that a comment or a
reformatted line leaves the shipped spec in use. A refusal is then a fraction of a second even on
the first call after install. Where the code itself has changed since (an edited analysis in a
development tree, another package's analyses), the spec is built once and kept in the kvnotes cache,
keyed by the files' modification times.

    python -m kvnotes.cli_spec      # rewrite kvnotes/cli_spec.json (a test fails while it is stale)
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import io
import json
import os
import sys
import tokenize
from pathlib import Path

SHIPPED = Path(__file__).with_name("cli_spec.json")


def _entry_points() -> list[str]:
    """The packages the analyses are found in (`kvnotes.analysis.discovery.packages`), as lines."""
    from kvnotes.analysis.discovery import packages

    return [f"analyses={p}" for p in packages()]


def _tops() -> list[str]:
    """The top-level packages the analyses live in (kvnotes, probes, circuits, ...)."""
    return sorted({"kvnotes", *(e.split("=", 1)[1].split(".")[0].split(":")[0] for e in _entry_points())})


def _roots(top: str) -> list[Path]:
    """The directories package `top` is installed in, found without importing it."""
    spec = importlib.util.find_spec(top)
    return [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []


def _place(rel: str) -> Path | None:
    """Where `rel` ("probes/edit.py") is in this installation."""
    found = [root.parent / rel for root in _roots(rel.split("/", 1)[0])]
    return next((path for path in found if path.is_file()), None)


def digest(files: list[str]) -> str:
    """The digest the shipped spec is keyed by: the packages walked for analyses and the text of `files`."""
    h = hashlib.sha256("\n".join(_entry_points()).encode())
    for rel in sorted(files):
        path = _place(rel)
        h.update(f"\0{rel}\0".encode() + (path.read_bytes() if path else b"<missing>"))
    return h.hexdigest()


# what a comment or a reformatted line changes, and nothing the spec is read from does
_LAYOUT = frozenset({tokenize.COMMENT, tokenize.NL, tokenize.ENCODING})


def code_digest(files: list[str]) -> str:
    """The digest of the packages walked for analyses and the code of `files`: their tokens, without
    comments and line breaks inside brackets (docstrings count: an analysis's help is read from its
    run function's)."""
    h = hashlib.sha256("\n".join(_entry_points()).encode())
    for rel in sorted(files):
        path = _place(rel)
        h.update(f"\0{rel}\0".encode())
        if path is None:
            h.update(b"<missing>")
            continue
        for tok in tokenize.tokenize(io.BytesIO(path.read_bytes()).readline):
            if tok.type not in _LAYOUT:
                h.update(f"{tok.type}:{tok.string}\1".encode())
    return h.hexdigest()


def sources() -> list[str]:
    """The files the registry's spec is read from: each analysis's run function and config (and its
    bases), each package walked for analyses, and the registry itself; as "package/module.py" paths."""
    from kvnotes.analysis import registry

    objects: list = [registry]
    for a in registry.analyses().values():
        objects += [a.run, *(c for c in inspect.getmro(a.config) if c is not object)]
    for e in _entry_points():  # each package walked and the packages above it (a section's home)
        parts = e.split("=", 1)[1].split(":")[0].split(".")
        objects += [sys.modules[".".join(parts[:i])] for i in range(1, len(parts) + 1)]
    out = set()
    for obj in objects:
        path = Path(inspect.getsourcefile(obj) or inspect.getfile(obj)).resolve()
        for root in (r for top in _tops() for r in _roots(top)):
            if path.is_relative_to(root):
                out.add(str(path.relative_to(root.parent)).replace(os.sep, "/"))
    return sorted(out)


def build() -> dict:
    """{"digest", "code_digest", "files", "spec"}: the registry's spec as it stands, with what it was
    read from."""
    from kvnotes.analysis.registry import cli_spec

    files = sources()
    return {"digest": digest(files), "code_digest": code_digest(files), "files": files, "spec": cli_spec()}


def shipped() -> dict | None:
    """The prebuilt spec, where the files it was read from are unchanged but for comments and layout;
    else None."""
    try:
        data = json.loads(SHIPPED.read_text())
    except (OSError, ValueError):
        return None
    files = data.get("files", [])
    if data.get("digest") == digest(files) or data.get("code_digest") == code_digest(files):
        return data["spec"]
    return None


def _cached() -> tuple[dict | None, Path]:
    """The spec kept in the kvnotes cache for these files as they are now (by mtime), and its path."""
    from kvnotes.zoo.cache import default_cache_dir

    h = hashlib.sha256(sys.version.encode() + "\n".join(_entry_points()).encode())
    for root in (r for top in _tops() for r in _roots(top)):
        for f in sorted(root.rglob("*.py")):
            st = f.stat()
            h.update(f"{f}:{st.st_mtime_ns}:{st.st_size}\n".encode())
    path = default_cache_dir() / "cli" / f"spec-{h.hexdigest()[:20]}.json"
    try:
        return json.loads(path.read_text()), path
    except (OSError, ValueError):
        return None, path


def load() -> dict:
    """The spec the parser is built from: the live registry's where this process has imported it (a
    notebook, a test that registered an analysis of its own), else the shipped one where it is
    current, else the cached one, else built now and cached."""
    if "kvnotes.analysis.registry" in sys.modules:
        from kvnotes.analysis.registry import cli_spec

        return cli_spec()
    spec = shipped()
    if spec is not None:
        return spec
    spec, path = _cached()
    if spec is not None:
        return spec
    from kvnotes.analysis.registry import cli_spec

    spec = cli_spec()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(spec))
        tmp.replace(path)
    except OSError:  # a read-only cache: build it every time
        pass
    return spec


def write() -> Path:
    """Rewrite the shipped spec from the registry as it stands."""
    SHIPPED.write_text(json.dumps(build(), indent=1, sort_keys=True) + "\n")
    return SHIPPED


if __name__ == "__main__":
    print(f"wrote {write()}")
