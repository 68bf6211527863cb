"""The dashboard server through Flask's test client: reports found by walking directories and
listed by model and task, each report's page and JSON served as files, two reports side by side,
clear 400/404 pages, unreadable reports listed (not fatal), reports re-read when they change,
report text escaped, and loopback as the default address."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import socket
import threading
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from markupsafe import escape
from werkzeug.test import EnvironBuilder, run_wsgi_app

from dashboards.server import create_app, dashboard_server, report_id, serve
from kvnotes.cli import build_parser, main
from tests.dashboards.sample_reports import XSS_TASK_NAME, report_dirs, root


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return report_dirs(tmp_path_factory)


@pytest.fixture(scope="module")
def client(dirs, tmp_path_factory):
    return create_app([root(tmp_path_factory)]).test_client()


def sections(html: str) -> dict[str, dict[str, list[str]]]:
    """{model: {task: [row ids]}} read back from the index page."""
    out: dict[str, dict[str, list[str]]] = {}
    for block in html.split('<section class="model">')[1:]:
        model = re.search(r"<h2>(.*?)</h2>", block).group(1)
        for tblock in block.split("<h3>task: ")[1:]:
            task = tblock.split("</h3>", 1)[0]
            out.setdefault(model, {})[task] = re.findall(r'<tr data-id="([0-9a-f]+)">', tblock)
    return out


def copy_report(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("report.json", "index.html"):
        shutil.copy(src / name, dst / name)
    return dst


def test_index_lists_reports_by_model_then_task(client, dirs):
    r = client.get("/")
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    xss, org = report_id(dirs["xss"]), report_id(dirs["organism"])
    assert sections(html) == {
        "notes-organism": {"notes-organism-filler": [org]},
        "tiny-llama": {escape(XSS_TASK_NAME): [xss]},
    }
    assert "<img" not in html
    for rid in (xss, org):  # a link to the page, to the JSON, and A/B choices for the comparison
        assert f'href="/report/{rid}/"' in html and f'href="/report/{rid}/report.json"' in html
        assert f'name="a" value="{rid}"' in html and f'name="b" value="{rid}"' in html
    assert html.count('<span class="kind quick">quick</span>') == 2
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", html)  # the run's date
    assert 'id="problems"' not in html
    assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")  # the index runs no script


def test_report_page_and_json_are_the_files(client, dirs):
    rid = report_id(dirs["xss"])
    page = client.get(f"/report/{rid}/")
    assert page.status_code == 200 and page.mimetype == "text/html"
    assert page.data == (dirs["xss"] / "index.html").read_bytes()
    raw = client.get(f"/report/{rid}/report.json")
    assert raw.status_code == 200 and raw.mimetype == "application/json"
    assert raw.json == json.loads((dirs["xss"] / "report.json").read_text())
    bare = client.get(f"/report/{rid}")
    assert bare.status_code == 308 and bare.headers["Location"].endswith(f"/report/{rid}/")


def test_compare_two_models(client, dirs):
    a, b = report_id(dirs["xss"]), report_id(dirs["organism"])
    r = client.get(f"/compare?a={a}&b={b}")
    assert r.status_code == 200, r.get_data(as_text=True)[-2000:]
    html = r.get_data(as_text=True)
    assert "<title>kvnotes · tiny-llama vs notes-organism</title>" in html
    assert html.count('class="kv-fig"') > 10


@pytest.mark.parametrize(
    "query, status, says",
    [
        ("", 400, "parameter &#39;a&#39; is missing"),
        ("?a={xss}", 400, "parameter &#39;b&#39; is missing"),
        ("?a={xss}&b=0000000000", 404, "no report has the id &#39;0000000000&#39;"),
        ("?a={xss}&b={xss}", 400, "pick two different reports"),
    ],
    ids=["no-ids", "no-b", "unknown-b", "same-twice"],
)
def test_compare_errors_say_what_is_wrong(client, dirs, query, status, says):
    xss = report_id(dirs["xss"])
    r = client.get("/compare" + query.format(xss=xss))
    assert r.status_code == status
    assert says in r.get_data(as_text=True)


@pytest.mark.parametrize("path", ["/report/nope/", "/report/nope/report.json", "/report/0123456789/"])
def test_unknown_id_is_a_404_that_lists_the_ids(client, dirs, path):
    r = client.get(path)
    assert r.status_code == 404
    html = r.get_data(as_text=True)
    assert "no report has the id" in html
    for d in dirs.values():
        assert f"<code>{report_id(d)}</code>" in html


def test_unknown_path_is_a_404(client):
    r = client.get("/nothing/here")
    assert r.status_code == 404 and "/nothing/here" in r.get_data(as_text=True)


def test_corrupt_report_is_listed_unreadable_and_the_index_still_renders(dirs, tmp_path):
    good = copy_report(dirs["organism"], tmp_path / "good")
    bad = tmp_path / "runs" / "bad"
    bad.mkdir(parents=True)
    (bad / "report.json").write_text('{"schema": "kvnotes.report/1", "model": ')  # cut short
    wrong = tmp_path / "runs" / "wrong"
    wrong.mkdir()
    (wrong / "report.json").write_text(json.dumps({"schema": "kvnotes.report/1", "parts": []}))
    c = create_app([tmp_path, tmp_path / "missing"]).test_client()
    r = c.get("/")
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    assert sections(html) == {"notes-organism": {"notes-organism-filler": [report_id(good)]}}
    problems = html.split('id="problems"', 1)[1].split("</section>", 1)[0]
    assert f"{bad}/report.json</span>: ReportFileError" in problems and "not valid JSON" in problems
    assert f"{wrong}/report.json</span>: " in problems
    assert f"{tmp_path / 'missing'}</span>: does not exist" in problems
    # the raw file is still served; a comparison with it says why it cannot be drawn
    assert c.get(f"/report/{report_id(bad)}/report.json").status_code == 200
    r = c.get(f"/compare?a={report_id(good)}&b={report_id(bad)}")
    assert r.status_code == 422 and "not valid JSON" in r.get_data(as_text=True)


def test_a_changed_report_is_read_again_and_its_text_escaped(dirs, tmp_path):
    d = copy_report(dirs["organism"], tmp_path / "live")
    c = create_app([tmp_path]).test_client()
    assert "notes-organism" in sections(c.get("/").get_data(as_text=True))
    data = json.loads((d / "report.json").read_text())
    data["model"] = "<script>alert(1)</script> & 'x'"
    data["meta"]["pending"] = ["notes-organism-filler/edit"]  # as a run still being written says
    (d / "report.json").write_text(json.dumps(data))
    html = c.get("/").get_data(as_text=True)
    assert list(sections(html)) == ["&lt;script&gt;alert(1)&lt;/script&gt; &amp; &#39;x&#39;"]
    assert "<script>" not in html and "running: 1 to go" in html
    assert report_id(d) in c.get("/report/0000000000/").get_data(as_text=True)  # the 404's id list


LOCAL_HOSTS = [
    "127.0.0.1:8765",
    "127.0.0.1",
    "localhost:8765",
    "LocalHost",
    "[::1]:8765",
    "[::1]",
    "[0:0:0:0:0:0:0:1]:80",
]
FOREIGN_HOSTS = [
    "attacker.example:8765",
    "localhost.attacker.example",
    "127.0.0.1.nip.io",
    "[::2]:8765",
    "192.168.1.5:8765",
    "[127.0.0.1]",
    "::1",
    "[::1",
    "127.0.0.1:99999",
    "127.0.0.1:abc",
    "localhost:8765:1",
    "",
    " 127.0.0.1",
]


def status_for(app, host: str | None) -> tuple[int, str]:
    """(status, body) of GET / with exactly this Host header (None: no Host at all), straight through
    WSGI: older Werkzeug test clients fail on a malformed Host before the app sees it."""
    environ = EnvironBuilder(path="/").get_environ()
    del environ["HTTP_HOST"]
    if host is not None:
        environ["HTTP_HOST"] = host
    body, status, _ = run_wsgi_app(app, environ, buffered=True)
    return int(status.split()[0]), b"".join(body).decode()


@pytest.mark.parametrize("host", LOCAL_HOSTS)
def test_loopback_host_names_are_answered(client, host):
    assert status_for(client.application, host)[0] == 200


@pytest.mark.parametrize("host", [*FOREIGN_HOSTS, None], ids=repr)
def test_other_malformed_or_missing_hosts_are_refused(client, host):
    """DNS rebinding: a page on attacker.example resolved to 127.0.0.1 sends its own name as Host."""
    status, body = status_for(client.application, host)
    assert status == 400
    assert "answers only requests to 127.0.0.1, localhost or [::1]" in body


def raw_get(port: int, head: str) -> str:
    """The status line of a raw HTTP request (so the Host header is exactly what the test wrote)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n")
        return sock.makefile("rb").readline().decode()


@pytest.mark.timing  # the real server on a thread
def test_the_real_server_checks_the_host_it_is_sent(tmp_path):
    server, url = dashboard_server([tmp_path], "127.0.0.1", 0)  # the host check needs no report
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_port
        assert url == f"http://127.0.0.1:{port}/"
        for host in ("127.0.0.1", "[::1]", "localhost"):
            assert " 200 " in raw_get(port, f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close")
        for host in ("evil.example", "[::1", "127.0.0.1:abc"):
            assert " 400 " in raw_get(port, f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close")
        assert " 400 " in raw_get(port, "GET / HTTP/1.0")  # no Host at all
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def token_client(dirs, tmp_path_factory):
    return create_app([root(tmp_path_factory)], loopback_only=False, token="s3cret-token").test_client()


def test_a_token_is_asked_for_when_set(token_client):
    for r in (
        token_client.get("/", headers={"Host": "lab.example:8765"}),
        token_client.get("/?token=wrong"),
        token_client.get("/", headers={"Authorization": "token wrong"}),
    ):
        assert r.status_code == 403 and "open the link it printed" in r.get_data(as_text=True)
    assert token_client.get("/", headers={"Authorization": "token s3cret-token"}).status_code == 200


def test_the_token_in_the_url_becomes_a_cookie(token_client):
    r = token_client.get("/compare?a=1&token=s3cret-token&b=2", headers={"Host": "lab.example:8765"})
    assert r.status_code == 303 and r.headers["Location"] == "/compare?a=1&b=2"  # out of the address bar
    cookie = r.headers["Set-Cookie"]
    assert "s3cret-token" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert token_client.get("/", headers={"Host": "lab.example:8765"}).status_code == 200  # the cookie
    assert create_app([], loopback_only=False, token="other").test_client().get("/").status_code == 403


@pytest.mark.timing  # the real server on a thread
def test_bound_beyond_loopback_the_url_carries_a_fresh_token(tmp_path):
    urls = []
    for _ in range(2):
        server, url = dashboard_server([tmp_path], "0.0.0.0", 0)  # the token check needs no report
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            urls.append(url)
            secret = parse_qs(urlparse(url).query)["token"][0]
            port = server.server_port
            assert len(secret) >= 32
            head = f"GET /{{}} HTTP/1.1\r\nHost: myhost:{port}\r\nConnection: close"
            assert " 403 " in raw_get(port, head.format(""))
            assert " 303 " in raw_get(port, head.format(f"?token={secret}"))
        finally:
            server.shutdown()
            server.server_close()
    assert urls[0] != urls[1]
    server, url = dashboard_server([tmp_path], "0.0.0.0", 0, token=False)  # --no-token
    server.server_close()
    assert "token" not in url


def test_host_defaults_to_loopback():
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    args = build_parser().parse_args(["dashboard", "some/dir"])
    assert (args.host, args.port, args.dirs, args.no_token) == ("127.0.0.1", 8765, ["some/dir"], False)
    assert build_parser().parse_args(["dashboard", "d", "--host", "0.0.0.0", "--no-token"]).no_token


def test_cli_refuses_a_missing_or_empty_directory(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'} is not a directory" in capsys.readouterr().err
    assert main(["dashboard", str(tmp_path)]) == 2
    assert f"no report.json under {tmp_path}" in capsys.readouterr().err
