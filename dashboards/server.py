"""The browsable dashboard: every report under some directories, each report's page, and any two
side by side.

    from dashboards.server import serve
    serve(["out/"])            # http://127.0.0.1:8765/  (or: kvnotes dashboard out/)

Routes: `/` (the index, by model then task), `/report/<id>/` (the report's own index.html),
`/report/<id>/report.json`, and `/compare?a=<id>&b=<id>`. An id is a short hash of the report
directory's resolved path, so it stays the same across restarts. Directories are scanned again on
each index request and a report.json is re-read whenever its mtime or size changes, so a report
still being written by `kvnotes report` shows its newest parts. Pages are rendered by
`dashboards.render`; this module only finds, reads and serves.

Server: Werkzeug's threaded server (`werkzeug.serving.make_server`), which Flask ships with. This
is a local, single-user tool bound to 127.0.0.1 by default; a production WSGI server (waitress,
gunicorn) is not installed here and would add a dependency for no gain at this load. When bound to
a loopback address, requests must name a loopback host (Flask's TRUSTED_HOSTS), which stops a web
page from reading the dashboard through DNS rebinding.
"""

from __future__ import annotations

import hashlib
import os
import threading
import webbrowser
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from flask import Flask, Response, render_template, request, send_file

from circuits.report import Report
from dashboards.render import compare_html

__all__ = ["Catalog", "create_app", "serve", "report_id"]

REPORT_FILE = "report.json"
LOOPBACK = ("127.0.0.1", "localhost", "::1")                 # addresses that only this machine reaches
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")         # how requests to them name the host
# The index and message pages run no script: forbid any, so an escaping slip could not execute.
NO_SCRIPT = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'"


def report_id(directory: Path) -> str:
    """The stable short id of a report directory: a hash of its resolved path."""
    return hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Entry:
    """One report.json found under the served directories, read (`report`) or not (`error`)."""

    id: str
    directory: Path
    stamp: tuple[int, int]            # (mtime_ns, size) of report.json when it was read
    report: Report | None = None
    error: str | None = None

    @property
    def has_page(self) -> bool:
        return (self.directory / "index.html").is_file()


@dataclass(frozen=True)
class ScanWarning:
    """Something under the served directories that could not be read (shown on the index)."""

    path: str
    message: str


def find_report_dirs(root: Path, warnings: list[ScanWarning]) -> list[Path]:
    """`root` and every directory below it that holds a report.json (a report's `parts/` is skipped)."""
    if not root.exists():
        warnings.append(ScanWarning(str(root), "does not exist"))
        return []
    if not root.is_dir():
        warnings.append(ScanWarning(str(root), "is not a directory"))
        return []
    found = []

    def onerror(e: OSError) -> None:
        warnings.append(ScanWarning(str(e.filename), f"cannot be listed ({e.strerror or e})"))

    for here, subdirs, files in os.walk(root, onerror=onerror, followlinks=False):
        subdirs[:] = sorted(d for d in subdirs if d != "parts" and not d.startswith("."))
        if REPORT_FILE in files:
            found.append(Path(here))
    return found


class Catalog:
    """The reports under `dirs`, each read once per change of its report.json (thread-safe)."""

    def __init__(self, dirs: Sequence[str | Path]):
        self.dirs = [Path(d) for d in dirs]
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def scan(self) -> tuple[list[Entry], list[ScanWarning]]:
        """Walk the directories again; read new or changed report.json files."""
        warnings: list[ScanWarning] = []
        seen: dict[str, Path] = {}
        for root in self.dirs:
            for d in find_report_dirs(root, warnings):
                seen.setdefault(report_id(d), d)
        with self._lock:
            entries = {i: self._read(i, d) for i, d in seen.items()}
            self._entries = entries
        return list(entries.values()), warnings

    def get(self, rid: str) -> Entry | None:
        """The entry with this id, re-read if its report.json changed (one rescan if it is unknown)."""
        with self._lock:
            e = self._entries.get(rid)
        if e is None:
            self.scan()
            with self._lock:
                return self._entries.get(rid)
        with self._lock:
            e = self._entries[rid] = self._read(rid, e.directory)
        return e

    def known(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def _read(self, rid: str, directory: Path) -> Entry:
        path = directory / REPORT_FILE
        try:
            st = path.stat()
        except OSError as e:
            return Entry(rid, directory, (0, 0), error=f"cannot be read ({e.strerror or e})")
        stamp = (st.st_mtime_ns, st.st_size)
        old = self._entries.get(rid)
        if old is not None and old.stamp == stamp:
            return old
        try:
            return Entry(rid, directory, stamp, report=Report.load(path))
        except Exception as e:  # a file on disk may be broken in any way; the index must still render
            return Entry(rid, directory, stamp, error=f"{type(e).__name__}: {e}")


# --- what the index shows -----------------------------------------------------------------------


def _date(started) -> str:
    try:
        t = datetime.fromisoformat(str(started))
    except ValueError:
        return str(started) if started else "?"
    return t.strftime("%Y-%m-%d %H:%M") + (f" {t.tzname()}" if t.tzinfo else "")


def _duration(seconds) -> str:
    if not isinstance(seconds, int | float):
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    return f"{s // 60} min {s % 60:02d} s" if s < 3600 else f"{s // 3600} h {s % 3600 // 60:02d} min"


def _row(e: Entry) -> dict:
    r = e.report
    assert r is not None
    pending = list(r.meta.get("pending") or [])
    started = r.meta.get("started")
    return {"id": e.id, "path": str(e.directory), "model": r.model, "tasks": list(r.tasks),
            "date": _date(started), "sort": str(started or ""), "kind": r.config.preset,
            "run_time": _duration(r.meta.get("run_seconds", r.seconds)), "n": r.config.n,
            "parts": len(r.parts), "pending": len(pending), "has_page": e.has_page,
            "label": f"{r.model} · {', '.join(r.tasks)} · {_date(started)} · {e.id}"}


def index_groups(entries: Sequence[Entry]) -> list[dict]:
    """[{"model", "tasks": [{"task", "rows": [...]}, ...]}, ...]; a report of several tasks is listed
    under each; newest run first within a task."""
    by_model: dict[str, dict[str, list[dict]]] = {}
    for e in entries:
        if e.report is None:
            continue
        row = _row(e)
        for t in row["tasks"] or ["(no task)"]:
            by_model.setdefault(row["model"], {}).setdefault(t, []).append(row)
    return [{"model": m, "tasks": [{"task": t, "rows": sorted(rows, key=lambda r: r["sort"], reverse=True)}
                                   for t, rows in sorted(tasks.items())]}
            for m, tasks in sorted(by_model.items())]


# --- the app ------------------------------------------------------------------------------------


def create_app(dirs: Sequence[str | Path], *, trusted_hosts: Sequence[str] | None = None) -> Flask:
    """The dashboard over the reports found (recursively) under `dirs`.

    >>> app = create_app([])
    >>> app.test_client().get("/").status_code
    200
    """
    app = Flask(__name__)
    app.config["TRUSTED_HOSTS"] = list(trusted_hosts) if trusted_hosts else None
    catalog = Catalog(dirs)
    app.extensions["kvnotes_catalog"] = catalog

    def message(status: int, title: str, text: str, *, show_ids: bool = False) -> Response:
        entries = catalog.known() if show_ids else []
        body = render_template("server_message.html", title=title, text=text, status=status,
                               entries=[{"id": e.id, "label": _row(e)["label"] if e.report else
                                         f"{e.directory} (unreadable)"} for e in entries])
        return Response(body, status=status, mimetype="text/html",
                        headers={"Content-Security-Policy": NO_SCRIPT})

    def entry_or_error(rid: str | None, which: str = "") -> Entry | Response:
        if not rid:
            return message(400, "No report chosen", f"the comparison needs two reports: pass ?a=<id>&b=<id> "
                                                    f"(parameter {which!r} is missing)", show_ids=True)
        e = catalog.get(rid)
        if e is None:
            return message(404, "Unknown report", f"no report has the id {rid!r}", show_ids=True)
        return e

    @app.after_request
    def headers(resp: Response) -> Response:
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
        resp.headers.setdefault("Referrer-Policy", "no-referrer")
        resp.headers.setdefault("Cache-Control", "no-store")
        return resp

    @app.get("/")
    def index():
        entries, warnings = catalog.scan()
        unreadable = [{"path": str(e.directory / REPORT_FILE), "message": e.error}
                      for e in entries if e.error]
        body = render_template("server_index.html", groups=index_groups(entries),
                               n_reports=sum(e.report is not None for e in entries),
                               unreadable=unreadable, warnings=warnings, dirs=[str(d) for d in catalog.dirs])
        return Response(body, mimetype="text/html", headers={"Content-Security-Policy": NO_SCRIPT})

    @app.get("/report/<rid>/")  # Flask redirects /report/<rid> here
    def report_page(rid: str):
        e = entry_or_error(rid)
        if isinstance(e, Response):
            return e
        page = e.directory / "index.html"
        if not page.is_file():
            return message(404, "No page yet", f"{e.directory} holds report.json but no index.html yet; "
                                               f"write it with `kvnotes render {e.directory}`")
        return send_file(page, mimetype="text/html", max_age=0)

    @app.get("/report/<rid>/report.json")
    def report_json(rid: str):
        e = entry_or_error(rid)
        if isinstance(e, Response):
            return e
        return send_file(e.directory / REPORT_FILE, mimetype="application/json", max_age=0)

    @app.get("/compare")
    def compare():
        a = entry_or_error(request.args.get("a"), "a")
        if isinstance(a, Response):
            return a
        b = entry_or_error(request.args.get("b"), "b")
        if isinstance(b, Response):
            return b
        if a.id == b.id:
            return message(400, "Same report twice", f"a and b are both {a.id}; pick two different reports",
                           show_ids=True)
        for e in (a, b):
            if e.report is None:
                return message(422, "Unreadable report", f"{e.directory / REPORT_FILE}: {e.error}")
        return Response(compare_html(a.report, b.report), mimetype="text/html")

    @app.get("/favicon.ico")
    def favicon():
        return Response(status=204)  # browsers ask for one; answer without a 404 in their console

    @app.errorhandler(404)
    def not_found(_):
        return message(404, "Not found", f"nothing is served at {request.path}; the reports are listed at /")

    return app


def report_count(dirs: Sequence[str | Path]) -> int:
    """How many report directories (readable or not) lie under `dirs`."""
    return sum(len(find_report_dirs(Path(d), [])) for d in dirs)


def serve(dirs: Sequence[str | Path], host: str = "127.0.0.1", port: int = 8765,
          open_browser: bool = False) -> None:
    """Serve the dashboard until interrupted (Ctrl-C). Binds to loopback unless `host` says otherwise."""
    from werkzeug.serving import make_server

    trusted = list(LOOPBACK_HOSTS) if host in LOOPBACK else None
    # a port in use: Werkzeug says so and which way out, and exits 1
    server = make_server(host, port, create_app(dirs, trusted_hosts=trusted), threaded=True)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{server.server_port}/"
    print(f"kvnotes dashboard: {url} (Ctrl-C to stop)", flush=True)
    if host not in LOOPBACK:
        print(f"warning: listening on {host}: anyone who can reach this machine can read these reports",
              flush=True)
    if open_browser:
        threading.Timer(0.5, webbrowser.open, (url,)).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()

