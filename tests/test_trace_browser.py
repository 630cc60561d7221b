"""The HTML trace renders in a real browser: headless Chromium's DOM holds one element per token, the
title (query, model, inputs, date), each hole's where clause as written, and counts that add up; the
model's own output reused from the cache is painted as cached."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

import kvql
from test_trace import QUERY

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed and could not be: ./dev test "
                                                             "installs Debian's chromium when it runs as root with apt-get")


class _Dom(HTMLParser):
    """Token spans (served, classes, painted background), text by element id, and the counts table."""

    def __init__(self):
        super().__init__()
        self.served: list[str] = []
        self.spans: list[dict] = []
        self.text: dict[str, str] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self._open: list[tuple[str, str | None, str | None]] = []  # (tag, id, data-count)
        self._row: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and "tok" in (a.get("class") or "").split() and "data-served" in a:
            self.served.append(a["data-served"])
            self.spans.append(a)
        if tag == "tr" and a.get("data-row") and not self.counts.get(a["data-row"]):
            self._row = a["data-row"]
            self.counts[self._row] = {}
        self._open.append((tag, a.get("id"), a.get("data-count")))

    def handle_endtag(self, tag):
        while self._open and self._open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        for _, ident, count in self._open:
            if ident:
                self.text[ident] = self.text.get(ident, "") + data
        if self._open and self._open[-1][2] and self._row:
            self.counts[self._row][self._open[-1][2]] = int(data)


def _chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--no-first-run", "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'p'}"]
    out = subprocess.run(flags + list(args), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


@needs_chromium
def test_trace_html_renders_in_headless_chromium(make_model, tmp_path):
    r = kvql.run_sync(QUERY, model=make_model())
    page, data = tmp_path / "trace.html", tmp_path / "trace.json"
    r.trace.save(page)
    r.trace.save(data)
    dom = _Dom()
    dom.feed(_chromium(tmp_path, "--dump-dom", page.as_uri()).stdout)
    summary = json.loads(data.read_text())["summary"]
    for kind in ("cached", "computed", "unsent"):
        assert dom.served.count(kind) == summary[kind]
    assert len(dom.served) == summary["tokens"]
    shot = tmp_path / "trace.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1000,700", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000


@needs_chromium
def test_the_page_shows_title_where_clause_and_counts_that_add_up(make_model, tmp_path):
    m = make_model(name="tiny-llama")

    @kvql.query(model=m, is_async=False)
    def capital(country):
        '''lmql
        "Question: what is the capital of {country}? [A] and then [B]" where len(TOKENS(A)) < 4 and len(TOKENS(B)) < 4
        "Choose: [C]" where C in ["red", "green"]
        '''

    capital("France")
    page = tmp_path / "trace.html"
    capital.last_trace.save(page)
    dom = _Dom()
    dom.feed(_chromium(tmp_path, "--dump-dom", page.as_uri()).stdout)

    assert dom.text["title"] == "kvql trace: capital on tiny-llama"
    assert dom.text["inputs"] == "country = France"
    assert re.fullmatch(r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d.*", dom.text["date"])
    assert dom.text["where"].splitlines() == ["[A] where len(TOKENS(A)) < 4", "[B] where len(TOKENS(B)) < 4",
                                              "[C] where C in ['red', 'green']"]
    assert "never sent: no request to the model ever included this token" in dom.text["legend"]

    c = dom.counts
    assert set(c) == {"prompt", "generated", "all"}
    for row in c.values():  # prompt tokens = cached + computed + never sent, and so on per row
        assert row["total"] == row["cached"] + row["computed"] + row["unsent"]
    for k in ("cached", "computed", "unsent", "total"):
        assert c["all"][k] == c["prompt"][k] + c["generated"][k]
    assert c["all"]["total"] == len(dom.served)  # the table counts the tokens the page shows
    for k in ("cached", "computed", "unsent"):
        assert c["all"][k] == dom.served.count(k)
    generated = [s for s in dom.spans if "gen" in s["class"].split()]
    assert c["generated"]["total"] == len(generated) > 0


@needs_chromium
def test_reused_model_output_is_painted_as_cached(make_model, tmp_path):
    """Chromium's computed styles: a generated token served from the cache has the cached background,
    unlike a computed one, and is marked generated (underlined) as well."""
    m = make_model()
    kvql.run_sync(QUERY, model=m)
    html = kvql.run_sync(QUERY, model=m).trace.to_html()  # a second run: prompt text is cached too
    probe = ("<script>for (const e of document.querySelectorAll('span.tok[data-served]')) {"
             "const s = getComputedStyle(e); e.dataset.bg = s.backgroundColor; e.dataset.line = s.borderBottomStyle; }"
             "</script></body>")
    page = tmp_path / "probe.html"
    page.write_text(html.replace("</body>", probe))
    dom = _Dom()
    dom.feed(_chromium(tmp_path, "--dump-dom", page.as_uri()).stdout)
    bg = {}
    for s in dom.spans:
        bg.setdefault((s["data-served"], "gen" in s["class"].split()), set()).add(s["data-bg"])
    assert len(bg[("cached", False)]) == 1 and bg[("cached", True)] == bg[("cached", False)]
    assert bg[("cached", True)] != bg[("computed", False)]
    assert all(s["data-line"] == ("double" if "drafted" in s["class"].split() else "solid")
               for s in dom.spans if "gen" in s["class"].split())  # drafted and accepted: a double underline
    assert all(s["data-line"] == "none" for s in dom.spans if "gen" not in s["class"].split())
