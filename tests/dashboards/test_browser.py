"""The dashboard in a real headless Chromium (Playwright): the index, each report page and the
comparison load without console or page errors, every plotly figure is drawn and the pages are not
blank; a report whose prompt holds hostile HTML shows it as text and runs none of it; and a
report's index.html opened from disk draws offline (no request leaves file:// or data:).

Needs Debian's Chromium (/usr/bin/chromium; `apt-get install chromium`) and the `playwright`
package; without them the tests skip, unless KVNOTES_REQUIRE_BROWSER=1 (CI), where they fail.
"""

from __future__ import annotations

import html
import re
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from dashboards.figures import fmt_ci, visible
from dashboards.server import create_app, report_id
from kvnotes.analysis.report import Report
from tests.dashboards.browser import Watched
from tests.dashboards.sample_reports import XSS_AMP, XSS_IMG, XSS_SCRIPT, report_dirs, root
from tests.waiting import until

pytestmark = pytest.mark.timing  # a real browser drawing and hovering

DRAW_TIMEOUT_MS = 90_000  # plotly draws ~40 figures per page; the CI machine has 2 shared cores
SETTLE_S = 30  # one hover box or slider update on a loaded machine (idle: well under a second)


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return report_dirs(tmp_path_factory)


@pytest.fixture(scope="module")
def base_url(dirs, tmp_path_factory) -> Iterator[str]:
    """The dashboard on a free port of 127.0.0.1, served from a background thread."""
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, create_app([root(tmp_path_factory)]), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(10)


# --- checks -------------------------------------------------------------------------------------


def png_pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, pixels) of an 8-bit RGB/RGBA, non-interlaced PNG (what Chromium writes).
    Stdlib only: Pillow is not a dependency."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, head = 8, b"", None
    while pos < len(png):
        (length,), kind = struct.unpack(">I", png[pos : pos + 4]), png[pos + 4 : pos + 8]
        data = png[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", data)
        elif kind == b"IDAT":
            idat += data
    w, h, depth, ctype, _, _, interlace = head
    assert depth == 8 and ctype in (2, 6) and interlace == 0, f"unexpected PNG format {head}"
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(idat), w * bpp
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    pixels = [r[i : i + 3] for r in rows for i in range(0, stride, bpp)]
    return w, h, pixels


def assert_not_blank(png: bytes, what: str, min_ink: float = 0.005) -> None:
    """Not one colour: several colours, and at least `min_ink` of the pixels off the background."""
    w, h, pixels = png_pixels(png)
    counts = Counter(pixels)
    ink = 1 - counts.most_common(1)[0][1] / len(pixels)
    assert len(counts) >= 3 and ink >= min_ink, (
        f"{what} looks blank: {len(counts)} colour(s), {ink:.2%} of {w}x{h} pixels off the background"
    )


DRAWN = """() => {
  const figs = [...document.querySelectorAll('div.kv-fig')];
  const data = document.querySelectorAll('script.kv-fig-data').length;
  return figs.length > 0 && figs.length === data && figs.every(f => {
    if (f.dataset.plotted !== '1') return false;  // set when Plotly.newPlot's promise resolves
    const svg = f.querySelector('.plotly .main-svg');
    if (!svg) return false;
    const r = svg.getBoundingClientRect();
    return r.width > 50 && r.height > 50;
  });
}"""
UNDRAWN = """() => [...document.querySelectorAll('div.kv-fig')]
  .filter(f => f.dataset.plotted !== '1' || !f.querySelector('.plotly .main-svg')).map(f => f.id)"""


def wait_drawn(w: Watched, what: str) -> int:
    """Wait until every figure div holds a drawn plotly SVG; the number of figures."""
    try:
        w.page.wait_for_function(DRAWN, timeout=DRAW_TIMEOUT_MS)
    except Exception as e:  # name what was not drawn (and any error that stopped it)
        undrawn = w.page.evaluate(UNDRAWN)
        raise AssertionError(f"{what}: figures not drawn {undrawn}; errors {w.errors}") from e
    n = w.page.locator("div.kv-fig").count()
    assert_not_blank(w.page.screenshot(), f"{what} (viewport)")
    assert_not_blank(w.page.locator("div.kv-fig").first.screenshot(), f"{what} (first figure)", min_ink=0.02)
    return n


def assert_clean(w: Watched, what: str) -> None:
    assert w.errors == [], f"{what}: {w.errors}"


# --- tests --------------------------------------------------------------------------------------


def test_png_decoder_tells_blank_from_drawn(watched):
    """The blank check itself: a one-colour page fails it, a page with text passes."""
    watched.page.set_content("<body style='background:#fff'></body>")
    with pytest.raises(AssertionError, match="looks blank"):
        assert_not_blank(watched.page.screenshot(), "empty page")
    watched.page.set_content("<body><h1 style='font-size:80px'>kvnotes 0123</h1></body>")
    assert_not_blank(watched.page.screenshot(), "text page")


def test_index_then_each_report_page(watched, base_url, dirs):
    page = watched.page
    page.goto(base_url + "/")
    assert page.locator("section.model h2").all_inner_texts() == ["notes-organism", "tiny-llama"]
    assert_not_blank(page.screenshot(), "index")
    assert_clean(watched, "index")
    for name, d in dirs.items():
        rid = report_id(d)
        page.goto(base_url + "/")
        page.locator(f'tr[data-id="{rid}"] a.open').click()
        page.wait_for_url(f"{base_url}/report/{rid}/")
        n = wait_drawn(watched, f"{name} report page")
        assert n >= 10, f"{name} report page: only {n} figures"
        assert page.title().startswith("kvnotes report")
        assert_clean(watched, f"{name} report page")


def test_hostile_prompt_text_is_shown_not_run(watched, base_url, dirs):
    page = watched.page
    page.goto(f"{base_url}/report/{report_id(dirs['xss'])}/")
    wait_drawn(watched, "xss report page")
    assert page.evaluate("typeof window.__pwned") == "undefined"
    text = page.inner_text("body")
    for s in (XSS_SCRIPT, XSS_IMG, XSS_AMP, 'it\'s "urgent"'):  # the token spans concatenate to it
        assert s in text, f"{s!r} is not shown as text on the page"
    assert page.locator("img").count() == 0  # neither the request's <img> nor the task name's
    runnable = (
        "els => els.filter(e => !e.type || /javascript|module/.test(e.type))"
        ".filter(e => e.textContent.includes('__pwned')).length"
    )
    assert page.locator("script").evaluate_all(runnable) == 0
    assert_clean(watched, "xss report page")


def test_compare_page_from_the_index(watched, base_url, dirs):
    page = watched.page
    page.goto(base_url + "/")
    page.check(f'input[name="a"][value="{report_id(dirs["xss"])}"]')
    page.check(f'input[name="b"][value="{report_id(dirs["organism"])}"]')
    page.get_by_role("button", name="Compare A with B side by side").click()
    page.wait_for_url(f"{base_url}/compare?*")
    assert page.title() == "kvnotes · tiny-llama vs notes-organism"
    n = wait_drawn(watched, "compare page")
    assert n >= 20, f"compare page: only {n} figures"
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert XSS_SCRIPT in page.inner_text("body")
    assert_clean(watched, "compare page")


@pytest.mark.parametrize("name", ["xss", "organism"])
def test_index_html_from_disk_draws_offline(watched, dirs, name):
    page = watched.page
    page.goto((dirs[name] / "index.html").as_uri())
    wait_drawn(watched, f"{name} index.html from disk")
    assert page.evaluate("typeof window.__pwned") == "undefined"
    online = [u for u in watched.requests if not u.startswith(("file:", "data:"))]
    assert watched.requests and online == [], f"requests beyond the file: {online}"
    assert_clean(watched, f"{name} index.html from disk")


# Every heatmap cell (one per column) whose slot label holds a hostile token ("<", " &", '"', ">"),
# in the first heatmap that has one, with where to point the mouse.
HOSTILE_CELLS = """() => {
  for (const gd of document.querySelectorAll('div.kv-fig')) {
    const t = (gd.data || [])[0];
    if (!t || t.type !== 'heatmap') continue;
    gd.scrollIntoView({block: 'center'});
    const fl = gd._fullLayout, box = gd.getBoundingClientRect(), cells = [];
    t.x.forEach((l, col) => {
      const row = t.z.findIndex(r => r[col] !== null);
      if (/[<>&"']/.test(String(l).replace(/&(lt|gt|amp|quot|#x27|#39);/g, '<')) && row >= 0)
        cells.push({id: gd.id, label: String(l), px: box.left + fl.xaxis._offset + fl.xaxis.l2p(col),
                    py: box.top + fl.yaxis._offset + fl.yaxis.l2p(row)});
    });
    if (cells.length) return cells;
  }
  return [];
}"""
HOVER_SHOWS = """([id, text]) => [...document.querySelectorAll('#' + id + ' .hoverlayer .hovertext')]
  .some(e => e.textContent.includes(text))"""


@pytest.mark.parametrize("which", ["report", "compare"])
def test_hover_shows_hostile_token_text_as_text(watched, base_url, dirs, which):
    """The mouse on each note-map column whose slot is a hostile token: the hover box shows the
    token's own characters (not markup, not an entity shown literally) and nothing runs."""
    page = watched.page
    xss, org = report_id(dirs["xss"]), report_id(dirs["organism"])
    page.goto(f"{base_url}/report/{xss}/" if which == "report" else f"{base_url}/compare?a={xss}&b={org}")
    wait_drawn(watched, f"{which} page")
    cells = page.evaluate(HOSTILE_CELLS)
    assert {c for cell in cells for c in html.unescape(cell["label"]) if c in '<>&"'} == set('<>&"'), (
        f"the note map should label each hostile character; it labels {[c['label'] for c in cells]}"
    )
    for cell in cells:
        meant = html.unescape(cell["label"])  # e.g. "246:␣<"
        page.mouse.move(cell["px"], cell["py"])
        try:
            page.wait_for_function(HOVER_SHOWS, arg=[cell["id"], meant], timeout=SETTLE_S * 1000)
        except Exception as e:
            shown = page.locator(f"#{cell['id']} .hoverlayer").text_content()
            raise AssertionError(f"{which}: hovering slot {meant!r} shows {shown!r}") from e
        assert page.locator(f"#{cell['id']} .hoverlayer img").count() == 0
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert_clean(watched, f"{which} page hover")


# The edge-circuit graph (the figure with a slider): where a trace's points are on the page.
EDGE_GRAPH = """() => {
  const gd = [...document.querySelectorAll('div.kv-fig')].find(g => ((g.layout || {}).sliders || []).length);
  if (!gd) return null;
  gd.scrollIntoView({block: 'center'});
  const fl = gd._fullLayout, box = gd.getBoundingClientRect();
  const at = (t, i) => ({x: box.left + fl[t.xaxis === 'x2' ? 'xaxis2' : 'xaxis']._offset
                             + fl[t.xaxis === 'x2' ? 'xaxis2' : 'xaxis'].l2p(t.x[i]),
                         y: box.top + fl.yaxis._offset + fl.yaxis.l2p(t.y[i])});
  const points = [];
  gd.data.forEach(t => (t.hovertext || []).forEach((h, i) => {
    if (t.xaxis !== 'x2') points.push({trace: t.name, text: h, ...at(t, i)});
  }));
  const rail = gd.querySelector('.slider-rail-rect').getBoundingClientRect();
  const labels = [...gd.querySelectorAll('.slider-labels text, .slider-label')]
    .map(e => [e.textContent, e.getBoundingClientRect()])
    .map(([text, r]) => ({text, x: r.left + r.width / 2}));
  return {id: gd.id, points, rail: rail.top + rail.height / 2, labels};
}"""
EDGE_STATE = """(id) => {
  const gd = document.getElementById(id);
  return {active: gd.layout.sliders[0].active, notes: (gd.layout.annotations || []).map(a => a.text),
          lit: gd.data.filter(t => /^edge #/.test(t.name || ''))
                      .map(t => [Number(t.name.slice(6)), t.opacity === undefined ? 1 : t.opacity])};
}"""


def _hover(w: Watched, fig_id: str, point: dict, meant: str, what: str) -> None:
    w.page.mouse.move(point["x"], point["y"])
    try:
        w.page.wait_for_function(HOVER_SHOWS, arg=[fig_id, meant], timeout=SETTLE_S * 1000)
    except Exception as e:
        shown = w.page.locator(f"#{fig_id} .hoverlayer").text_content()
        raise AssertionError(f"{what}: hovering shows {shown!r}, not {meant!r}") from e
    assert w.page.locator(f"#{fig_id} .hoverlayer img").count() == 0


def test_edge_graph_hover_and_size_slider(watched, base_url, dirs):
    """The circuit graph of the hostile report: hovering the strongest edge shows its score and CI
    from report.json; hovering a node of a group that holds hostile tokens shows them as text; moving
    the slider to another circuit size moves the faithfulness note to that size's value from
    report.json and lights exactly that many of the strongest edges."""
    report = Report.load(dirs["xss"])
    edges = report.part(report.tasks[0], "circuits").results["edges"]
    page = watched.page
    page.goto(f"{base_url}/report/{report_id(dirs['xss'])}/")
    wait_drawn(watched, "xss report page")
    graph = page.evaluate(EDGE_GRAPH)
    assert graph is not None, "no figure with a circuit-size slider on the report page"
    fig = graph["id"]
    # the strongest edge, at its midpoint
    first = edges.tables["graph"][0]
    mid = next(p for p in graph["points"] if html.unescape(p["text"]).startswith("#1 "))
    _hover(watched, fig, mid, f"score {fmt_ci(first['score'], first['ci'], 3)}", "the strongest edge")
    _hover(watched, fig, mid, f"#1 {first['src']} → {first['dst']}", "the strongest edge")
    # a node whose group holds a hostile token: its hover lists the token's own characters
    hostile = {
        g: next(t for t in toks[:24] if set(t) & set('<>&"'))
        for g, toks in edges.group_tokens.items()
        if any(set(t) & set('<>&"') for t in toks[:24])
    }
    assert hostile, f"the xss task's groups should hold hostile tokens: {edges.group_tokens}"
    nodes = {n["node"]: n for n in edges.tables["nodes"]}
    shown = [
        p
        for p in graph["points"]
        if p["trace"] in ("heads", "KV slots", "MLPs")
        and html.unescape(p["text"]).split("<br>")[0] in nodes
        and nodes[html.unescape(p["text"]).split("<br>")[0]]["group"] in hostile
    ]
    assert shown, "no node of a group with hostile tokens is drawn"
    node = nodes[html.unescape(shown[0]["text"]).split("<br>")[0]]
    raw = shown[0]["text"].replace("<br>", "")  # as the figure holds it: plotly's markup is live there
    assert not re.search(r"[<>]|&(?!(lt|gt|amp);)", raw), f"unescaped token text in a node's hover: {raw!r}"
    _hover(watched, fig, shown[0], f"[{visible(hostile[node['group']])}]", f"node {node['node']}")
    _hover(watched, fig, shown[0], f"score {fmt_ci(node['score'], node['ci'], 3)}", f"node {node['node']}")
    # the slider: another size, its faithfulness point and its lit edges
    before = page.evaluate(EDGE_STATE, fig)
    curve = edges.curve("faithfulness")
    sizes = [round(x * edges.n_edges) for x in curve.x]
    j = next(j for j in range(1, len(sizes)) if j != before["active"] and sizes[j] < len(before["lit"]))
    label = next(lab for lab in graph["labels"] if lab["text"] == str(sizes[j]))
    page.mouse.click(label["x"], graph["rail"])
    # the slider moves its `active` index first and updates the note and the edges after: wait for the
    # note of the new size itself, then check its value and the lit edges in that very state
    after = until(
        lambda: page.evaluate(EDGE_STATE, fig),
        lambda s: s["active"] == j and any(n.startswith(f"{sizes[j]} edges: ") for n in s["notes"]),
        timeout=SETTLE_S,
        what=f"the slider moved to {sizes[j]} edges",
    )
    p = curve.points[j]
    assert f"{sizes[j]} edges: {fmt_ci(p.mean, p.ci, 3)}" in after["notes"], after["notes"]
    assert sorted(rank for rank, o in after["lit"] if o == 1) == list(range(1, sizes[j] + 1))
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert_clean(watched, "edge graph")


# Each figure of the page: how many finite values its traces hold (y, z, or x of a horizontal bar)
# and which panel it stands in, with that panel's reading.
FIGURE_VALUES = """() => [...document.querySelectorAll('div.kv-fig')].map(gd => {
  const flat = v => (v == null || typeof v === 'string') ? [] :
    (typeof v === 'object' && 'length' in v) ? Array.from(v).flatMap(flat) : [v];
  const finite = (gd._fullData || []).filter(t => t.visible !== false).reduce((n, t) =>
    n + ['y', 'z'].concat(t.orientation === 'h' ? ['x'] : [])
      .reduce((m, a) => m + flat(t[a]).filter(v => typeof v === 'number' && isFinite(v)).length, 0), 0);
  const panel = gd.closest('article.panel');
  return {id: gd.id, finite, title: panel ? panel.querySelector('h3').textContent : '',
          reading: panel ? panel.querySelector('.reading').textContent : ''};
})"""
TRACES = (
    "([id, show]) => document.querySelectorAll('#' + id + ' .cartesianlayer .overplot')"
    ".forEach(g => g.style.visibility = show ? '' : 'hidden')"
)
EMPTY = {  # what a panel gone wrong would put on the page: no traces, and traces with nothing finite
    "planted-no-trace": "{data: [], layout: {title: {text: 'no trace'}}}",
    "planted-all-nan": "{data: [{type: 'scatter', x: [0, 1], y: [NaN, null]}], layout: {}}",
    # finite values that draw no pixel: only the screenshot can tell
    "planted-unseen": "{data: [{type: 'scatter', x: [0, 1], y: [1, 2], mode: 'markers', "
    "marker: {opacity: 0}}], layout: {}}",
}


def figures_without_traces(w: Watched) -> list[str]:
    """Each figure on the page with nothing drawn: no finite value in its traces, or a screenshot that
    does not change when its trace layer is hidden (axes and a title alone). Its id and panel title."""
    empty = []
    for fig in w.page.evaluate(FIGURE_VALUES):
        el = w.page.locator(f"#{fig['id']}")
        shown = el.screenshot()
        w.page.evaluate(TRACES, [fig["id"], False])
        hidden = el.screenshot()
        w.page.evaluate(TRACES, [fig["id"], True])
        # the same encoder on the same pixels writes the same bytes: equal PNGs, nothing hidden
        if fig["finite"] == 0 or shown == hidden:
            empty.append(f"{fig['id']} ({fig['title']}: {fig['reading'][:80]!r})")
    return empty


def test_no_figure_of_the_organism_report_is_empty_unless_it_says_why(watched, base_url, dirs):
    """The organism's quick report, in Chromium: every figure draws something (finite values, and
    pixels that go when its traces are hidden); where a chart had nothing to draw, its panel has no
    figure and says so ("Nothing to show", what would fill it), and no headline is a bare n/a. The
    check is shown to fail on three planted empty figures."""
    page = watched.page
    page.goto(f"{base_url}/report/{report_id(dirs['organism'])}/")
    n = wait_drawn(watched, "organism report page")
    assert figures_without_traces(watched) == [], "figures with nothing drawn on the organism's report"
    readings = page.locator("article.panel .reading").all_inner_texts()
    nothing = [r for r in readings if r.startswith("Nothing to show")]
    assert all(
        page.locator("article.panel", has_text=r[:60]).locator("div.kv-fig").count() == 0 for r in nothing
    ), "a 'Nothing to show' panel still has a figure"
    bare = [r for r in readings if "n/a" in r and "n/a:" not in r and r not in nothing]  # those say why
    assert nothing and bare == [], f"every n/a says what it means; {bare}"
    # the check can fail: three empty figures planted into the same page are each found
    for fid, spec in EMPTY.items():
        page.evaluate(
            "([id, spec]) => { const a = document.createElement('article'); a.className = 'panel';"
            ' a.innerHTML = \'<h3>planted</h3><p class="reading">planted</p><div class="kv-fig" id="\''
            " + id + '\"></div>'; document.querySelector('main').appendChild(a);"
            " return Plotly.newPlot(id, ...Object.values(eval('(' + spec + ')'))); }",
            [fid, spec],
        )
    found = figures_without_traces(watched)
    assert [f.split(" ")[0] for f in found] == list(EMPTY), found
    assert n >= 10 and watched.page.locator("div.kv-fig").count() == n + len(EMPTY)
    assert_clean(watched, "organism report page")
