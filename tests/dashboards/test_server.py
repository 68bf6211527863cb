"""The dashboard server through Flask's test client: reports found by walking directories and
listed by model and task, each report's page and JSON served as files, two reports side by side,
clear 400/404 pages, unreadable reports listed (not fatal), reports re-read when they change,
report text escaped, and loopback as the default address."""

from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
from markupsafe import escape

from dashboards.server import LOOPBACK_HOSTS, create_app, report_id, serve
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
    assert sections(html) == {"notes-organism": {"notes-organism-filler": [org]},
                              "tiny-llama": {escape(XSS_TASK_NAME): [xss]}}
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


@pytest.mark.parametrize("query, status, says", [
    ("", 400, "parameter &#39;a&#39; is missing"),
    ("?a={xss}", 400, "parameter &#39;b&#39; is missing"),
    ("?a={xss}&b=0000000000", 404, "no report has the id &#39;0000000000&#39;"),
    ("?a={xss}&b={xss}", 400, "pick two different reports"),
], ids=["no-ids", "no-b", "unknown-b", "same-twice"])
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


def test_loopback_hosts_only_when_trusted(dirs, tmp_path_factory):
    c = create_app([root(tmp_path_factory)], trusted_hosts=LOOPBACK_HOSTS).test_client()
    assert c.get("/", headers={"Host": "127.0.0.1:8765"}).status_code == 200
    assert c.get("/", headers={"Host": "[::1]:8765"}).status_code == 200
    assert c.get("/", headers={"Host": "attacker.example:8765"}).status_code == 400  # DNS rebinding


def test_host_defaults_to_loopback():
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    args = build_parser().parse_args(["dashboard", "some/dir"])
    assert (args.host, args.port, args.dirs) == ("127.0.0.1", 8765, ["some/dir"])


def test_cli_refuses_a_missing_or_empty_directory(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'} is not a directory" in capsys.readouterr().err
    assert main(["dashboard", str(tmp_path)]) == 2
    assert f"no report.json under {tmp_path}" in capsys.readouterr().err
