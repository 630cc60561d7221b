"""The HTML trace renders in a real browser: headless Chromium's DOM holds one element per token."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

import kvql
from test_trace import QUERY

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Tokens(HTMLParser):
    def __init__(self):
        super().__init__()
        self.served: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and "tok" in (a.get("class") or "").split() and "data-served" in a:
            self.served.append(a["data-served"])


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed and could not be: ./dev test installs "
                                              "Debian's chromium when it runs as root with apt-get")
def test_trace_html_renders_in_headless_chromium(make_model, tmp_path):
    r = kvql.run_sync(QUERY, model=make_model())
    page, data = tmp_path / "trace.html", tmp_path / "trace.json"
    r.trace.save(page)
    r.trace.save(data)
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--no-first-run", "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'p'}"]
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parser = _Tokens()
    parser.feed(dom.stdout)
    summary = json.loads(data.read_text())["summary"]
    for kind in ("cached", "computed", "unsent"):
        assert parser.served.count(kind) == summary[kind]
    assert len(parser.served) == summary["tokens"]
    shot = tmp_path / "trace.png"
    subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1000,700", page.as_uri()], capture_output=True,
                   timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
