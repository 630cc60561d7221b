"""Takes the two screenshots docs/server.md shows of the playground (kvql.server.playground), on the embedded
SmolLM2-135M in headless Chromium (its chromedriver, as tests/test_playground.py drives it): the few-shot example
run twice (its prompt served from the cache the second time), and a query with an error pointed at its line.
Run: `.venv/bin/python scripts/playground_screenshots.py` (about 30 s); writes docs/playground.png and
docs/playground-error.png."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

import kvql
from kvql.server.app import create_app

DOCS = Path(__file__).resolve().parent.parent / "docs"
BROKEN = 'argmax\n    "Q: What is the capital of {country}?\\nA:[ANSWER]" where STOPS_AT(ANSWER, "\\n"\n'


def run(driver) -> None:
    driver.find_element(By.ID, "run").click()
    WebDriverWait(driver, 300).until(lambda d: d.find_element(By.ID, "status").text in ("done", "error"))


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(kvql.model("smollm2-135m"), playground_run=True), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1500,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(f"http://127.0.0.1:{port}/playground")
        run(driver)
        run(driver)  # the second run: its prompt from the cache
        driver.save_screenshot(str(DOCS / "playground.png"))
        editor = driver.find_element(By.ID, "source")
        editor.clear()
        editor.send_keys(BROKEN)
        run(driver)
        driver.save_screenshot(str(DOCS / "playground-error.png"))
    finally:
        driver.quit()
        server.should_exit = True
    print(f"wrote {DOCS / 'playground.png'} and {DOCS / 'playground-error.png'}")


if __name__ == "__main__":
    main()
