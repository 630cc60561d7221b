"""The playground of `kvql serve` (kvql.server.playground): its access rules over HTTP, and the page in a real
browser (headless Chromium driven by Selenium): type a query, run it, see its tokens arrive before the hole has
finished, see the prompt marked as served from the cache on the second run, see an error at its line."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading

import httpx
import pytest
from conftest import serving

import kvql
from kvql.server.app import create_app

QUERY = 'argmax\n"Tell me a story about a fox:[STORY]" where len(TOKENS(STORY)) < 40\n"The end."'
BROKEN = 'argmax\n"Hi [X]" where len(TOKENS(X)) <\n'


def model():
    """LMQL's random model (it runs to each hole's bound); a served app closes its model when it stops."""
    return kvql.model("random", seed=7)


def events(url: str, source: str, **kw) -> list[dict]:
    with httpx.stream("POST", url + "/playground/run", json={"source": source}, timeout=120, **kw) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_a_run_streams_text_then_its_traces_and_an_error_names_its_line():
    with serving(create_app(model(), playground_run=True)) as url:
        got = events(url, QUERY)
        done = got[-1]
        assert done["type"] == "done" and [e["type"] for e in got].count("text") > 10
        story = done["variables"][0]["STORY"]
        assert "".join(e["text"] for e in got if e.get("hole") == "STORY") == story
        assert got.index(next(e for e in got if e.get("hole") == "STORY")) < len(got) - 1
        (trace,) = done["traces"]
        assert "".join(t["text"] for t in trace["tokens"]).endswith("The end.") and trace["holes"][0]["name"] == "STORY"
        (error,) = events(url, BROKEN)
        assert error["type"] == "error" and error["line"] == 2 and "where clause" in error["message"]


def _refused(r: httpx.Response, why: str) -> bool:
    return r.status_code == 403 and r.json()["error"]["code"] == "playground_refused" and why in r.json()["error"]["message"]


def test_running_a_query_is_off_unless_the_operator_opts_in():
    """A key lets its holder generate, never run code: a keyed server refuses a key holder's query by default,
    and a keyless one refuses its loopback clients too; the page itself stays open."""
    with serving(create_app(model(), api_key="k")) as url:
        assert httpx.get(url + "/playground").status_code == 200
        r = httpx.post(url + "/playground/run", json={"source": QUERY}, headers={"Authorization": "Bearer k"})
        assert _refused(r, "--playground-run")
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                          headers={"Authorization": "Bearer k"}).status_code == 200
    with serving(create_app(model())) as url:
        assert _refused(httpx.post(url + "/playground/run", json={"source": QUERY}), "--playground-run")


def test_who_may_run_a_query_once_opted_in():
    """Opted in: the key where there are keys; without keys a loopback client not behind a proxy; not at all
    with --salt-per-key; nothing with --no-playground."""
    with serving(create_app(model(), api_key="k", playground_run=True)) as url:
        assert httpx.get(url + "/playground").status_code == 200
        assert httpx.post(url + "/playground/run", json={"source": QUERY}).status_code == 401
        assert events(url, QUERY, headers={"Authorization": "Bearer k"})[-1]["type"] == "done"
        assert httpx.get(url + "/playground", headers={"Host": "evil.example"}).status_code == 403
    with serving(create_app(model(), api_key="k", salt_per_key=True, playground_run=True)) as url:
        r = httpx.post(url + "/playground/run", json={"source": QUERY}, headers={"Authorization": "Bearer k"})
        assert _refused(r, "salt-per-key")
    with serving(create_app(model(), playground=False)) as url:
        assert httpx.get(url + "/playground").status_code == 404
    with pytest.raises(ValueError, match="needs the playground"):
        create_app(model(), playground=False, playground_run=True)
    with serving(create_app(model(), playground_run=True)) as url:  # keyless: the loopback, not through a proxy
        assert events(url, QUERY)[-1]["type"] == "done"
        # uvicorn itself takes a loopback peer's X-Forwarded-For as the client: refused as not on the loopback
        for header in ({"X-Forwarded-For": "127.0.0.1"}, {"X-Forwarded-For": "203.0.113.9"},
                       {"Forwarded": "for=127.0.0.1"}, {"X-Real-IP": "127.0.0.1"}, {"Via": "1.1 nginx"}):
            r = httpx.post(url + "/playground/run", json={"source": QUERY}, headers=header)
            assert _refused(r, "proxy") or _refused(r, "loopback"), (header, r.text)
    app = create_app(model(), playground_run=True)  # a client that is not on the loopback, without keys

    async def remote_client():
        transport = httpx.ASGITransport(app=app, client=("192.0.2.7", 4000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.post("/playground/run", json={"source": QUERY})

    import asyncio

    assert _refused(asyncio.run(remote_client()), "loopback")


@contextlib.contextmanager
def forwarder(target_port: int):
    """A same-host TCP forwarder (what socat or an SSH tunnel does): bytes copied both ways, nothing added; its
    connections to the server come from the loopback. Yields its own port."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def pipe(a, b):
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_a_same_host_forwarder_cannot_make_a_keyless_server_run_a_query():
    """A keyless server behind a forwarder on its own host sees every remote client as a loopback peer: by default
    it still runs nothing; the forwarded request still generates."""
    with serving(create_app(model())) as url, forwarder(int(url.rsplit(":", 1)[1])) as port:
        via = f"http://127.0.0.1:{port}"
        assert _refused(httpx.post(via + "/playground/run", json={"source": QUERY}), "--playground-run")
        assert httpx.post(via + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


# -- in a real browser -------------------------------------------------------------------------------------
CHROMIUM, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(CHROMIUM is None or DRIVER is None, reason=(
    "Chromium or its driver is not installed and could not be: ./dev test installs Debian's chromium and "
    "chromium-driver when it runs as root with apt-get"))


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,900",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def _run(browser, source: str) -> list[dict]:
    """Type `source` into the editor, click Run, wait for the run to end; -> the page's event log."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    editor = browser.find_element(By.ID, "source")
    editor.clear()
    editor.send_keys(source)
    browser.find_element(By.ID, "inputs").clear()
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, 120).until(lambda d: d.find_element(By.ID, "status").text in ("done", "error"))
    return browser.execute_script("return window.kvqlLog")


@needs_browser
def test_the_page_runs_a_query_live_marks_the_cache_and_points_at_an_error(browser, tmp_path):
    from selenium.webdriver.common.by import By

    with serving(create_app(model(), playground_run=True)) as url:
        browser.get(url + "/playground")
        assert browser.title == "kvql playground" and browser.find_element(By.ID, "source").get_attribute("value")
        log = _run(browser, QUERY)
        hole = [e for e in log if e["type"] == "text" and e["hole"] == "STORY"]
        # the hole's tokens were on the page, one by one, before the run's end arrived
        assert len(hole) > 10 and log[-1]["type"] == "done" and log[-1]["live"] >= len(hole) - 1
        assert [e["live"] for e in hole] == sorted(e["live"] for e in hole)
        first = len(browser.find_elements(By.CSS_SELECTOR, "#output .tok.cached"))
        rows = browser.find_elements(By.CSS_SELECTOR, "#holes tbody tr")
        assert len(rows) == 1 and "len(TOKENS(STORY)) < 40" in rows[0].text
        browser.save_screenshot(str(tmp_path / "first.png"))
        _run(browser, QUERY)  # again: now its prompt is served from the cache
        assert len(browser.find_elements(By.CSS_SELECTOR, "#output .tok.cached")) > first == 0
        stats = {e.get_attribute("data-stat"): e.text for e in browser.find_elements(By.CSS_SELECTOR, "#stats dd")}
        assert int(stats["tokens saved (cached)"]) > 0 and stats["hit rate"] != "0 %"
        _run(browser, BROKEN)
        error = browser.find_element(By.ID, "error")
        assert error.is_displayed() and error.text.startswith("line 2, column ")
        assert browser.find_element(By.CSS_SELECTOR, "#gutter .err").text == "2"
        browser.save_screenshot(str(tmp_path / "error.png"))
        assert (tmp_path / "error.png").read_bytes()[:4] == b"\x89PNG"
