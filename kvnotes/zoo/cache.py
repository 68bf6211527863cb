"""Atomic cache directories for converted and trained models (safetensors + JSON, never pickle)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def default_cache_dir() -> Path:
    """`$KVNOTES_CACHE`, else `~/.cache/kvnotes`."""
    return Path(os.environ.get("KVNOTES_CACHE") or Path.home() / ".cache" / "kvnotes")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def building(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on building `root` (a file lock beside it), so that processes starting
    together (test workers, jobs on one machine) build a cache once: the others wait, then find it.
    Where locks are unavailable (no fcntl, a read-only directory) it does nothing."""
    try:
        import fcntl

        root.parent.mkdir(parents=True, exist_ok=True)
        f = open(root.parent / f".{root.name}.lock", "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def publish(root: Path, what: str, again: str, fill: Callable[[Path], None]) -> None:
    """Write the cache directory `root` atomically: `fill` writes into a temp dir beside it, which
    is then renamed into place (a stale `root` moved aside first). A failure (disk full, read-only,
    another process won the rename) is reported — `what` will be `again` next time — and leaves
    no partial directory behind."""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    except OSError as e:
        say(f"kvnotes: cannot cache {what} under {root.parent} ({e}); it will be {again} next time")
        return
    try:
        fill(tmp)
        for p in tmp.rglob("*"):  # mkdtemp and safetensors make these private
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        if root.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{root.name}-stale-", dir=root.parent))
            os.replace(root, stale / root.name)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (root / "meta.json").is_file():
            say(f"kvnotes: could not write the {what} cache at {root} ({e}); it will be {again} next time")
