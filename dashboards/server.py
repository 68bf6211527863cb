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
gunicorn) is not installed here and would add a dependency for no gain at this load.

Access: bound to a loopback address, every request must name a loopback host in its Host header
(`127.0.0.1`, `localhost`, `[::1]`, any port), which stops a web page elsewhere from reading the
dashboard through DNS rebinding. The check is ours (`host_is_loopback`), not Werkzeug's
TRUSTED_HOSTS, whose parsing of IPv6 literals differs between releases. Bound to any other
address, every request must carry a random access token, printed at start as Jupyter does
(`?token=...` once, then a cookie), unless the user turns it off explicitly.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import socket
import threading
import webbrowser
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from urllib.parse import urlencode

from flask import Flask, Response, redirect, render_template, request, send_file

from dashboards.render import compare_html
from kvnotes.analysis.report import Report
from kvnotes.serving.vllm import check_port

__all__ = ["Catalog", "create_app", "dashboard_server", "host_is_loopback", "serve", "report_id"]

REPORT_FILE = "report.json"
# A Host header: a name or IPv4 address, or an IPv6 address in brackets; then an optional port.
HOST_HEADER = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9.-]+))(?::(?P<port>[0-9]{1,5}))?")
# The index and message pages run no script: forbid any, so an escaping slip could not execute.
NO_SCRIPT = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'"


def host_is_loopback(header: str | None) -> bool:
    """Whether an HTTP Host header names this machine: `localhost` or a loopback address, any port.

    >>> [host_is_loopback(h) for h in ("127.0.0.1:8765", "[::1]:8765", "LOCALHOST", "evil.example", None)]
    [True, True, True, False, False]
    """
    m = HOST_HEADER.fullmatch(header or "")
    if m is None or (m["port"] is not None and not 0 < int(m["port"]) < 65536):
        return False
    if m["name"] is not None and m["name"].lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(m["v6"] if m["v6"] is not None else m["name"])
    except ValueError:  # a host name other than localhost, or not an address at all
        return False
    return address.is_loopback and (m["v6"] is None) == (address.version == 4)


def report_id(directory: Path) -> str:
    """The stable short id of a report directory: a hash of its resolved path."""
    return hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Entry:
    """One report.json found under the served directories, read (`report`) or not (`error`)."""

    id: str
    directory: Path
    stamp: tuple[int, int]  # (mtime_ns, size) of report.json when it was read
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
    return {
        "id": e.id,
        "path": str(e.directory),
        "model": r.model,
        "tasks": list(r.tasks),
        "date": _date(started),
        "sort": str(started or ""),
        "kind": r.config.preset,
        "run_time": _duration(r.meta.get("run_seconds", r.seconds)),
        "n": r.config.n,
        "parts": len(r.parts),
        "pending": len(pending),
        "has_page": e.has_page,
        "label": f"{r.model} · {', '.join(r.tasks)} · {_date(started)} · {e.id}",
    }


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
    return [
        {
            "model": m,
            "tasks": [
                {"task": t, "rows": sorted(rows, key=lambda r: r["sort"], reverse=True)}
                for t, rows in sorted(tasks.items())
            ],
        }
        for m, tasks in sorted(by_model.items())
    ]


# --- the app ------------------------------------------------------------------------------------


def create_app(dirs: Sequence[str | Path], *, loopback_only: bool = True, token: str | None = None) -> Flask:
    """The dashboard over the reports found (recursively) under `dirs`.

    `loopback_only`: answer only requests whose Host header names this machine (400 otherwise).
    `token`: answer only requests that carry it, as `?token=` (which sets a cookie and redirects to
    the same page without it), the cookie, or an `Authorization: token ...` header (403 otherwise).

    >>> app = create_app([])
    >>> app.test_client().get("/").status_code
    200
    >>> app.test_client().get("/", headers={"Host": "attacker.example"}).status_code
    400
    """
    app = Flask(__name__)
    catalog = Catalog(dirs)
    app.extensions["kvnotes_catalog"] = catalog
    _add_access_rules(app, catalog, loopback_only=loopback_only, token=token)
    _add_pages(app, catalog)
    return app


def _message(catalog: Catalog, status: int, title: str, text: str, *, show_ids: bool = False) -> Response:
    """A small page (no script) that says what went wrong, with the known reports' ids if asked."""
    entries = catalog.known() if show_ids else []
    body = render_template(
        "server_message.html",
        title=title,
        text=text,
        status=status,
        entries=[
            {"id": e.id, "label": _row(e)["label"] if e.report else f"{e.directory} (unreadable)"}
            for e in entries
        ],
    )
    return Response(body, status=status, mimetype="text/html", headers={"Content-Security-Policy": NO_SCRIPT})


def _entry_or_error(catalog: Catalog, rid: str | None, which: str = "") -> Entry | Response:
    """The report `rid` names, or the page that says why there is none."""
    if not rid:
        return _message(
            catalog,
            400,
            "No report chosen",
            f"the comparison needs two reports: pass ?a=<id>&b=<id> (parameter {which!r} is missing)",
            show_ids=True,
        )
    e = catalog.get(rid)
    if e is None:
        return _message(catalog, 404, "Unknown report", f"no report has the id {rid!r}", show_ids=True)
    return e


def _add_access_rules(app: Flask, catalog: Catalog, *, loopback_only: bool, token: str | None) -> None:
    """Who may read: requests to this machine only (`loopback_only`), carrying `token` if one is set;
    and the headers every answer carries."""

    def message(*args, **kwargs) -> Response:
        return _message(catalog, *args, **kwargs)

    cookie = f"kvnotes_token_{hashlib.sha256((token or '').encode()).hexdigest()[:8]}"

    def carries_token() -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        offered = [
            request.args.get("token"),
            request.cookies.get(cookie),
            given if scheme.lower() == "token" else None,
        ]
        return any(t is not None and hmac.compare_digest(t.encode(), token.encode()) for t in offered)

    @app.before_request
    def check_access() -> Response | None:
        if loopback_only and not host_is_loopback(request.environ.get("HTTP_HOST")):
            return message(
                400,
                "Not a local address",
                "this dashboard answers only requests to 127.0.0.1, localhost or [::1] (the Host "
                "header names another host, or none); open it at the address `kvnotes dashboard` "
                "printed",
            )
        if token is None:
            return None
        if not carries_token():
            return message(
                403,
                "Access token needed",
                "this dashboard is served beyond this machine, so it asks for the access token "
                "that `kvnotes dashboard` printed when it started: open the link it printed "
                "(ending in ?token=...)",
            )
        if "token" in request.args and request.method in ("GET", "HEAD"):
            # the token leaves the address bar (and history, and any Referer) for a cookie
            query = urlencode([(k, v) for k, v in request.args.items(multi=True) if k != "token"])
            resp = redirect(request.path + (f"?{query}" if query else ""), code=303)
            resp.set_cookie(cookie, token, httponly=True, samesite="Strict")
            return resp
        return None

    @app.after_request
    def headers(resp: Response) -> Response:
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
        resp.headers.setdefault("Referrer-Policy", "no-referrer")
        resp.headers.setdefault("Cache-Control", "no-store")
        return resp


def _add_pages(app: Flask, catalog: Catalog) -> None:
    """The pages: the index, each report's page and JSON, the comparison of two."""

    def message(*args, **kwargs) -> Response:
        return _message(catalog, *args, **kwargs)

    def entry_or_error(rid: str | None, which: str = "") -> Entry | Response:
        return _entry_or_error(catalog, rid, which)

    @app.get("/")
    def index():
        entries, warnings = catalog.scan()
        unreadable = [
            {"path": str(e.directory / REPORT_FILE), "message": e.error} for e in entries if e.error
        ]
        body = render_template(
            "server_index.html",
            groups=index_groups(entries),
            n_reports=sum(e.report is not None for e in entries),
            unreadable=unreadable,
            warnings=warnings,
            dirs=[str(d) for d in catalog.dirs],
        )
        return Response(body, mimetype="text/html", headers={"Content-Security-Policy": NO_SCRIPT})

    @app.get("/report/<rid>/")  # Flask redirects /report/<rid> here
    def report_page(rid: str):
        e = entry_or_error(rid)
        if isinstance(e, Response):
            return e
        page = e.directory / "index.html"
        if not page.is_file():
            return message(
                404,
                "No page yet",
                f"{e.directory} holds report.json but no index.html yet; "
                f"write it with `kvnotes render {e.directory}`",
            )
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
            return message(
                400,
                "Same report twice",
                f"a and b are both {a.id}; pick two different reports",
                show_ids=True,
            )
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


def report_count(dirs: Sequence[str | Path]) -> int:
    """How many report directories (readable or not) lie under `dirs`."""
    return sum(len(find_report_dirs(Path(d), [])) for d in dirs)


def is_local(host: str) -> bool:
    """Whether binding to `host` keeps the dashboard on this machine (localhost or a loopback address)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def dashboard_server(
    dirs: Sequence[str | Path], host: str = "127.0.0.1", port: int = 8765, *, token: bool = True
):
    """The dashboard's server, bound but not yet serving, and the URL that opens it.

    On loopback only requests naming a loopback host are answered. On any other address a random
    access token is required, and the URL carries it, unless `token=False` (`--no-token`).
    """
    from werkzeug.serving import make_server

    local = is_local(host)
    secret = secrets.token_urlsafe(24) if token and not local else None
    # Werkzeug's own message for a port in use is two lines and an exit(1)
    check_port(host, port, way_out="pass another --port, or --port 0 for a free one")
    server = make_server(host, port, create_app(dirs, loopback_only=local, token=secret), threaded=True)
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return server, f"http://{shown}:{server.server_port}/" + (f"?token={secret}" if secret else "")


def serve(
    dirs: Sequence[str | Path],
    host: str = "127.0.0.1",
    port: int = 8765,
    open_browser: bool = False,
    token: bool = True,
) -> None:
    """Serve the dashboard until interrupted (Ctrl-C); see `dashboard_server` for who may read it."""
    server, url = dashboard_server(dirs, host, port, token=token)
    print(f"kvnotes dashboard: {url} (Ctrl-C to stop)", flush=True)
    if "?token=" not in url and not is_local(host):
        print(
            f"warning: listening on {host} without an access token (--no-token): anyone who can reach "
            "this machine can read these reports",
            flush=True,
        )
    if open_browser:
        threading.Timer(0.5, webbrowser.open, (url,)).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
